"""The workshop kit: tools/compare.py, tools/plot.py, EXERCISES.md, bench/threads.py."""
import dataclasses
import importlib
import json
import os
import re
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "tools"))
import compare  # noqa: E402  (tools/compare.py, which imports its sibling plot.py)
import plot  # noqa: E402  (tools/plot.py)


# ---- tools/compare.py
def fake_run(folder, algo, rewards, evals=(0.3, 0.6, 0.9), extra=None):
    """A run folder as the scripts write it: metrics.jsonl (a held-out "eval" on the middle step,
    and a last line cut short, as a crash leaves it) and summary.json."""
    os.makedirs(folder)
    args = {"grpo": {"group_size": 8, "prompts_per_step": 8, "beta": 0.04},
            "reinforce": {"samples_per_prompt": 8, "prompts_per_step": 8, "beta": 0.0},
            "ppo": {"batch_size": 64, "kl_coef": 0.05}}[algo]
    args.update(rewards="", lora_r=0)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, r in enumerate(rewards, 1):
            m = {"step": step, "reward": r, "kl": 0.01 * step, "grad_norm": 1.0 + r,
                 "step_time": 0.5, **(extra or {})}
            if step == len(rewards) // 2:
                m["eval"] = evals[1]
            f.write(json.dumps(m) + "\n")
        f.write('{"step": 99, "rew')  # cut short by a crash: skipped
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump({"algo": algo, "args": args, "eval_before": evals[0], "eval_after": evals[2],
                   "wall_time_s": 12.0, "peak_mem_mb": 450.0, "interrupted": False}, f)
    return folder


def without_matplotlib(monkeypatch):
    """`import matplotlib` raises ImportError from here on, installed or not."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


def test_compare_quick_path_runs_each_script_and_prints_the_table(tmp_path):
    """--quick with a tiny budget (one step of 64 completions, 10 held-out prompts, one seed) on
    one configuration of each script. A second call reads the finished runs instead of rerunning
    them; one with another budget is refused rather than mixed into the same folder."""
    out = tmp_path / "cmp"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "compare.py"), "--quick", "--samples", "64",
           "--eval_size", "10", "--eval_points", "1", "--algos", "rloo,ppo-math,grpo",
           "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    r = subprocess.run(cmd + ["--kl_samples", "1"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"runs go to {out}/" in r.stdout
    table = r.stdout[r.stdout.index("algorithm"):]
    for name, models in (("rloo", "1 (1)"), ("ppo-math", "3 (2)"), ("grpo", "2 (1)")):
        row = next(line for line in table.splitlines() if line.startswith(name + " "))
        assert models in row and "failed" not in row
        assert os.path.isfile(out / f"{name}-s0" / "summary.json")
        assert os.path.isfile(out / f"{name}-s0.log")
        assert str(out / f"{name}-s0") in r.stdout  # where its curves' data lives
    assert "compare.png" in r.stdout  # written, or the one-line reason why not
    print(f"compare.py --quick, tiny: {time.time() - t0:.0f} s")
    again = subprocess.run(cmd + ["--kl_samples", "0"], capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=120)
    assert again.returncode == 0 and again.stdout.count("finished before, read from") == 3
    other = subprocess.run(cmd + ["--samples", "128"], capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=120)  # the folder holds 1-step runs: refused
    assert other.returncode == 1 and "holds a run with other settings" in other.stderr


def test_compare_figure_needs_matplotlib_and_says_so(tmp_path, monkeypatch):
    done = {"reinforce": [fake_run(tmp_path / "r", "reinforce", [0.2, 0.5, 0.7],
                                   extra={"sample_grad_rms": 0.3})],
            "grpo": [fake_run(tmp_path / "g", "grpo", [0.3, 0.6, 0.8])]}
    path = str(tmp_path / "compare.png")
    without_matplotlib(monkeypatch)
    assert compare.figure(done, path) == "no png: pip install matplotlib for it"
    assert not os.path.exists(path)
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    assert compare.figure(done, path) == path and os.path.getsize(path) > 10_000


def test_compare_table_and_models_held(tmp_path):
    done = {"grpo": [fake_run(tmp_path / "g0", "grpo", [0.3, 0.6, 0.8], (0.3, 0.6, 0.9)),
                     fake_run(tmp_path / "g1", "grpo", [0.3, 0.6, 0.8], (0.3, 0.6, 0.8))],
            "ppo": []}
    text = compare.table(done, kl_samples=0)
    grpo_row, ppo_row = text.splitlines()[1:]
    assert grpo_row.split()[:4] == ["grpo", "0.300", "0.850", "(0.80-0.90)"]
    assert "failed" in ppo_row
    ppo_args = {"rewards": "", "kl_coef": 0.05, "lora_r": 0}
    assert compare.models_held(ppo_args, "ppo") == (4, 2)  # policy, critic; reference, RM
    assert compare.models_held({**ppo_args, "rewards": "math"}, "ppo") == (3, 2)
    assert compare.models_held({"rewards": "", "beta": 0.0, "lora_r": 0}, "reinforce") == (1, 1)


# ---- tools/plot.py
def test_plot_text_fallback_prints_a_sparkline_per_run(tmp_path, monkeypatch, capsys):
    a = fake_run(tmp_path / "grpo-a", "grpo", [0.1, 0.4, 0.5, 0.9])
    b = fake_run(tmp_path / "rf-b", "reinforce", [0.2, 0.3, 0.8, 0.7])
    without_matplotlib(monkeypatch)
    plot.main([str(a), str(b), "--metric", "reward", "--metric", "eval", "--x", "samples",
               "--out", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert out.startswith("no png: pip install matplotlib for it; sparklines instead")
    assert not os.path.exists(tmp_path / "p.png")
    lines = out.splitlines()
    reward = lines[lines.index("reward") + 1:lines.index("eval")]
    evals = lines[lines.index("eval") + 1:]
    assert [line.split()[0] for line in reward] == ["grpo-a", "rf-b"]
    assert "[0.1 .. 0.9]" in reward[0] and "4 points, x 64..256" in reward[0]
    assert "3 points, x 0..256" in evals[0]  # before (summary), step 2 (metrics), after


def test_plot_curve_axes(tmp_path):
    run = fake_run(tmp_path / "ppo", "ppo", [1.0, 2.0, 3.0])
    assert plot.curve(run, "reward") == ([1, 2, 3], [1.0, 2.0, 3.0])
    assert plot.curve(run, "reward", "samples")[0] == [64, 128, 192]
    assert plot.curve(run, "eval", "time") == ([0, 0.5, 1.5], [0.3, 0.6, 0.9])
    assert plot.curve(run, "no_such_metric") == ([], [])


# ---- EXERCISES.md
def exercises():
    """(number, title, script, the quoted line, commands) of each exercise in EXERCISES.md."""
    text = open(os.path.join(ROOT, "EXERCISES.md"), encoding="utf-8").read()
    out = []
    for section in re.split(r"\n## ", text)[1:]:
        title = section.splitlines()[0]
        script = re.search(r"\*\*Script:\*\* `(\w+\.py)`", section)
        line = re.search(r"\*\*Line to change:\*\*\n+```python\n(.*?)\n```", section, re.S)
        commands = re.findall(r"^ *(python \w+\.py.*)$", section, re.M)
        out.append((title, script and script.group(1), line and line.group(1), commands))
    return out


def test_exercises_quote_lines_that_still_exist():
    found = exercises()
    assert 8 <= len(found) <= 24
    for title, script, line, commands in found:
        assert script in ("grpo.py", "reinforce.py", "ppo.py", "objectives.py", "distill.py"), title
        assert line, f"{title}: no quoted line to change"
        source = open(os.path.join(ROOT, script), encoding="utf-8").read().splitlines()
        assert source.count(line) == 1, f"{title}: {script} no longer has, once, the line {line!r}"
        assert commands, f"{title}: no measured command"


def test_exercises_commands_use_flags_their_script_has():
    for title, script, _, commands in exercises():
        for command in commands:
            name = command.split()[1][:-3]
            fields = {f.name for f in dataclasses.fields(importlib.import_module(name).Args)}
            for flag in re.findall(r"--(\w+)", command):
                assert flag in fields, f"{title}: {name}.py has no --{flag}"


# ---- bench/threads.py
def test_threads_bench_kills_its_busy_processes():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    threads = importlib.import_module("threads")
    threads.start_busy(2)
    procs = list(threads.BUSY)
    assert all(p.poll() is None for p in procs)
    threads.stop_busy()
    assert not threads.BUSY and all(p.poll() is not None for p in procs)
