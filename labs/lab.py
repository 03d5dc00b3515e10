"""lab.py: what every lab shares -- the holes, the check, the run in the project's own loop, the
figure. A student reads a lab file, not this one; an instructor reads this docstring.

    hole(solution)   marks a function the student writes. It keeps the student's function, or,
                     with MINRL_LAB_SOLUTIONS=1 in the environment, puts the project's own
                     `solution` in its place (the instructor's copy: one copy of the maths)
    check(*fns)      grades each function against the project's (labs/grader.py): one line each
                     that names the mistake, and stops the lab while one is wrong
    train(...)       runs a script's own main() -- the loop users run -- with some of the
                     functions it calls replaced by the student's, then puts the project's back
    plot(...)        the run's curves (and the lab's own quantity) in labs-figure.png beside the
                     run, shown inline in a notebook; one line of text without matplotlib

Environment (for CI and the instructor): MINRL_LAB_SOLUTIONS=1 fills the holes;
MINRL_LAB_RUNS=DIR puts the runs under DIR (default runs/ in the repository);
MINRL_LAB_FLAGS="..." adds flags to every run (the last of a flag wins; CI: fewer steps).
"""
import functools
import json
import os
import signal
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # the project's modules: common, grpo, ... (a lab runs from anywhere)

import common as C  # noqa: E402
from plumbing import runs  # noqa: E402

SOLUTIONS = os.environ.get("MINRL_LAB_SOLUTIONS") == "1"


class Todo(NotImplementedError):
    """What a stub raises: 'lab N: write ...'."""


def hole(solution):
    """Decorator on a function the student writes. With MINRL_LAB_SOLUTIONS=1 the function is
    replaced by `solution`, the project's own (same arguments, same returns)."""
    def choose(stub):
        if not SOLUTIONS:
            return stub
        return functools.wraps(stub)(lambda *args, **kwargs: solution(*args, **kwargs))
    return choose


def logits(model, ids, attention_mask):
    """The model's logits at every position of ids (B, L) -> (B, L, V): position t scores the token
    at t + 1. Left padding handled (each row's positions count from its first real token)."""
    return C._forward(model, ids, attention_mask).logits


def check(*fns):
    """Grades each function against the project's own; prints one line each. Raises SystemExit
    (the lab stops there) while one is wrong or not written."""
    import grader  # labs/grader.py, beside this file
    failed = 0
    for fn in fns:
        problem = grader.grade(fn.__name__, fn)
        print(f"  {fn.__name__}: {problem or 'ok'}")
        failed += problem is not None
    if failed:
        raise SystemExit(f"{failed} of {len(fns)} not right yet: fix them, then run this again")


def train(script, flags, swaps):
    """script.main() -- the training loop of `python script.py flags` -- with each function named
    in swaps ("module.name": your function) put in that module for the run. The loop looks the
    name up in its module every time it calls it, so it calls yours; the project's is put back
    afterwards, even on an error. Returns the run's folder."""
    name = script.__name__
    parent = os.environ.get("MINRL_LAB_RUNS") or os.path.join(ROOT, "runs")
    folder = os.path.join(parent, f"lab-{name}-{time.strftime('%Y%m%d-%H%M%S')}")
    argv = [f"{name}.py", *flags.split(), "--output_dir", folder]
    argv += os.environ.get("MINRL_LAB_FLAGS", "").split()  # after the lab's: they win
    saved = {}
    before = sys.argv, signal.getsignal(signal.SIGINT)
    try:
        for dotted, fn in swaps.items():
            module_name, fn_name = dotted.rsplit(".", 1)  # "plumbing.calc.calc": calc.py's
            module = sys.modules[module_name]
            saved[module, fn_name] = getattr(module, fn_name)  # AttributeError: a wrong name
            setattr(module, fn_name, fn)
        print(f"python {' '.join(argv)}" + ("\n  with your " + ", ".join(swaps) if swaps else ""))
        sys.argv = argv
        runs.main_guard(script.main)  # as `python script.py`: bad flags exit 2 with one line
    finally:
        for (module, fn_name), fn in saved.items():
            setattr(module, fn_name, fn)
        sys.argv = before[0]
        signal.signal(signal.SIGINT, before[1])  # the script set its own Ctrl-C handler
        runs.STOP["requested"] = False
    return folder


def read_run(folder):
    """(metrics.jsonl's lines, the held-out points [(step, score)]) of a finished run."""
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        history = [json.loads(line) for line in f]
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    evals = [(0, summary["eval_before"])] + [(m["step"], m["eval"]) for m in history if "eval" in m]
    return history, evals + [(history[-1]["step"], summary["eval_after"])]


def plot(folder, keys, extra=None):
    """Prints each key's first and last 10 steps' means and the held-out score before and after;
    draws them (held-out score first, then each key of metrics.jsonl, then extra: {title:
    values} as histograms) into labs-figure.png in the run's folder. Returns its path, or None."""
    history, evals = read_run(folder)
    print(f"held-out score: {evals[0][1]:.3f} before, {evals[-1][1]:.3f} after")
    for key in keys:
        ys = [m[key] for m in history if m.get(key) is not None]
        if ys:
            n = max(1, min(10, len(ys) // 2))  # short runs: the first and the last half
            print(f"{key}: {sum(ys[:n]) / n:.4g} (first {n} steps) -> {sum(ys[-n:]) / n:.4g} "
                  f"(last {n})")
    try:
        import matplotlib
    except ImportError:
        print("no figure: pip install matplotlib for it")
        return None
    matplotlib.use("Agg")  # draw into a file; a notebook shows it below
    import matplotlib.pyplot as plt
    extra = extra or {}
    n = 1 + len(keys) + len(extra)
    fig, axes = plt.subplots(1, n, figsize=(3.2 * n, 2.8), squeeze=False)
    panels = [("held-out score", *zip(*evals))]
    panels += [(key, [m["step"] for m in history if m.get(key) is not None],
                [m[key] for m in history if m.get(key) is not None]) for key in keys]
    for ax, (title, xs, ys) in zip(axes[0], panels):
        ax.plot(xs, ys, marker="." if len(xs) < 20 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
    for ax, (title, values) in zip(axes[0][len(panels):], extra.items()):
        ax.hist(values, bins=30)
        ax.set_title(title)
    fig.tight_layout()
    path = os.path.join(folder, "labs-figure.png")
    fig.savefig(path)
    print(f"figure: {path}")
    plt.close(fig)
    if "ipykernel" in sys.modules:  # a notebook (Jupyter, VS Code): the figure, inline
        from IPython.display import Image, display
        display(Image(filename=path))
    return path


def load(path):
    """A lab file as a module (its check and run cells stay idle: they run under __main__)."""
    import importlib.util
    name = "lab" + os.path.basename(path).split("_")[0].lstrip("0")  # labs/02_grpo.py: lab2
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
