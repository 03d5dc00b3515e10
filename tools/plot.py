"""tools/plot.py: overlay several runs' metrics, by name, from their own files.

    python tools/plot.py runs/grpo-A runs/reinforce-B --metric reward --metric kl
    python tools/plot.py runs/compare-X/grpo-s0 runs/compare-X/rloo-s0 --metric eval --x samples

One panel per metric, one line per run. Any key of metrics.jsonl is a metric (reward, gold, kl,
entropy, grad_norm, ...); "eval", the held-out greedy score, is logged every --eval_every steps
and gets its before and after points from summary.json. The x axis is the step, the completions
seen (--x samples) or the seconds of training (--x time: the sum of step_time, so evals, loading
and checkpoints are left out). With matplotlib (pip install matplotlib) it writes a png
(--out, default plot.png); without it, it prints a sparkline per run.
"""
import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def read_metrics(run_dir):
    """metrics.jsonl's lines as dicts; a line cut short by a crash (no newline yet) is skipped,
    and so is a damaged line, with a warning naming it."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"error: {path} not found: not a run folder")
    lines = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            try:
                m = json.loads(line)
                if not isinstance(m, dict) or type(m.get("step")) not in (int, float):
                    raise ValueError("no number 'step'")
                lines.append(m)
            except ValueError as e:  # as runs.read_jsonl_lines: a copy, so plot needs no torch
                if line.endswith("\n"):
                    print(f"warning: {path}, line {i} is damaged ({str(e)[:60]}): skipped",
                          file=sys.stderr)
    return lines


def read_summary(run_dir):
    """summary.json (written at the end of a run), or {} while the run is still going."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def run_args(run_dir):
    """The run's flags: from summary.json, else from its checkpoint's args.json."""
    args = read_summary(run_dir).get("args")
    path = os.path.join(run_dir, "checkpoint", "args.json")
    if args is None and os.path.isfile(path):
        with open(path) as f:
            args = json.load(f)["args"]
    return args or {}


def samples_per_step(args):
    """Completions sampled per step: grpo G * prompts, reinforce k * prompts, ppo batch_size (grpo
    with --dynamic_sampling samples more, which is not logged: this counts the kept ones)."""
    k = args.get("group_size") or args.get("samples_per_prompt")
    return k * args["prompts_per_step"] if k else args.get("batch_size", float("nan"))


def curve(run_dir, metric, x="step"):
    """(xs, ys): one metric of one run against x = "step", "samples" or "time"."""
    lines, summary = read_metrics(run_dir), read_summary(run_dir)
    per_step = samples_per_step(run_args(run_dir)) if x == "samples" else 1
    xs, ys, clock = [], [], 0.0
    if metric == "eval" and "eval_before" in summary:
        xs, ys = [0], [summary["eval_before"]]
    for m in lines:
        clock += m.get("step_time", 0.0)
        if isinstance(m.get(metric), (int, float)):
            xs.append(clock if x == "time" else m["step"] * per_step)
            ys.append(float(m[metric]))
    after = summary.get("eval_after")
    if metric == "eval" and isinstance(after, (int, float)) and lines:
        xs.append(clock if x == "time" else lines[-1]["step"] * per_step)
        ys.append(float(after))
    return xs, ys


XLABELS = {"step": "step", "samples": "completions seen",
           "time": "seconds of training (sum of step_time)"}


def draw(panels, path, cols=2):
    """panels: [(title, xlabel, [(label or None, xs, ys, colour index), ...]), ...] -> a png at
    path. Returns what it wrote, or a one-line reason when matplotlib is not installed."""
    try:
        import matplotlib
    except ImportError:
        return "no png: pip install matplotlib for it"
    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 3.6 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (title, xlabel, lines) in zip(axes.flat, panels):
        for label, xs, ys, colour in lines:
            ax.plot(xs, ys, color=f"C{colour % 10}", label=label, marker="." if len(xs) < 20
                    else None, alpha=0.9 if label else 0.5)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel(xlabel)
        if any(label for label, *_ in lines):
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__[__doc__.find("One panel"):],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="output folders of runs")
    p.add_argument("--metric", action="append", help="a metrics.jsonl key, repeatable "
                   "(default: reward, kl)")
    p.add_argument("--x", choices=list(XLABELS), default="step", help="the x axis")
    p.add_argument("--out", default="plot.png", help="the png to write (with matplotlib)")
    args = p.parse_args(argv)
    metrics = args.metric or ["reward", "kl"]
    names = [os.path.basename(os.path.normpath(d)) for d in args.run_dirs]
    if len(set(names)) < len(names):  # e.g. compare-A/grpo-s0 and compare-B/grpo-s0
        names = [os.path.normpath(d) for d in args.run_dirs]
    curves = {(d, k): curve(d, k, args.x) for d in args.run_dirs for k in metrics}
    for d, k in curves:
        if not curves[d, k][1]:
            print(f"note: {d} logged no {k!r}")
    panels = [(k, XLABELS[args.x], [(name, *curves[d, k], i)
                                    for i, (d, name) in enumerate(zip(args.run_dirs, names))])
              for k in metrics]
    wrote = draw(panels, args.out)
    if wrote == args.out:
        print(f"wrote {wrote}")
        return
    print(f"{wrote}; sparklines instead (x: {XLABELS[args.x]}):")
    sys.path.insert(0, ROOT)
    from plumbing.runs import spark  # the report's text chart (imports torch: only needed here)
    width = max(map(len, names))
    for k in metrics:
        print(k)
        for d, name in zip(args.run_dirs, names):
            xs, ys = curves[d, k]
            where = f"  ({len(ys)} points, x {xs[0]:.4g}..{xs[-1]:.4g})" if xs else "  (none)"
            print(f"  {name:<{width}}  {spark(ys)}{where}")


if __name__ == "__main__":
    main()
