"""runs.py: run folders and locks, memory, charts, the --report_to trackers."""
import builtins
import io
import json
import math
import os
import sys
import types

import pytest
import torch

from plumbing.errors import UserError
import grpo
from plumbing import runs

from tests.helpers import FAST_GRPO, read_metrics, run_main


# ---- runs.py: run folders, memory, charts
def test_one_run_per_folder_and_stale_locks_are_taken(tmp_path):
    busy, stale = tmp_path / "busy", tmp_path / "stale"
    for folder, pid in ((busy, os.getppid()), (stale, 2**22 + 12345)):  # alive / no such process
        folder.mkdir()
        (folder / "run.lock").write_text(str(pid))
    args = grpo.Args(output_dir=str(busy))
    with pytest.raises(UserError, match=f"in use by a run in process {os.getppid()}"):
        runs.start_run(args, "grpo")
    run = runs.start_run(grpo.Args(output_dir=str(stale)), "grpo")
    assert (stale / "run.lock").read_text() == str(os.getpid())
    run.metrics.close()
    run.samples.close()
    runs._release_lock(run.dir)


def test_peak_memory_without_proc_or_resource_is_unknown_not_a_crash(monkeypatch):
    """Windows has neither /proc/self/status nor the `resource` module: the first step must not
    crash on it."""
    real_open = builtins.open

    def open_without_proc(f, *a, **k):
        if str(f).startswith("/proc/"):
            raise FileNotFoundError(f)
        return real_open(f, *a, **k)
    monkeypatch.setattr(builtins, "open", open_without_proc)
    monkeypatch.setattr(runs, "resource", None)  # as runs.py's `import resource` leaves it there
    assert math.isnan(runs.peak_mem_mb(torch.device("cpu")))


def test_spark_skips_nan_and_prints_ascii_where_blocks_cannot_be_encoded(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="utf-8"))
    # a NaN step (update skipped) is left out
    assert runs.spark([0.0, float("nan"), 1.0, 2.0]) == "▁▄█  [0 .. 2]"
    # Windows, redirected
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="cp1252"))
    assert runs.spark([0.0, 1.0, 2.0]) == "_~#  [0 .. 2]"


def stuck_steps(capsys, args):
    """step(n, **metrics): warn_if_stuck on that line of a run (then logged as log_step does):
    the line and the warnings it printed."""
    run = runs.Run(dir="", algo="grpo", args=None, state=None, metrics=io.StringIO(),
                   samples=io.StringIO())

    def step(n, **m):
        metrics = {"step": n, "reward": 0.0, "reward_std": 0.1, "frac_zero_std": 0.5,
                   "frac_truncated": 0.0, "kl": 0.1, **m}
        runs.warn_if_stuck(run, metrics, args)
        run.history.append(metrics)
        return metrics, [x for x in capsys.readouterr().out.splitlines() if "warning" in x]
    return run, step


def test_a_run_that_cannot_learn_says_so_at_step_one_once_a_run(capsys):
    """warn_if_stuck: at step 1, nearly every completion cut (naming --max_new_tokens and a value
    that fits: 4x it), every group's rewards equal, one reward for all; at any step KL to pi_ref
    or clip_frac past their levels (naming the flag). Each kind once a run (a resumed run's
    earlier warnings count), in the log and in the metrics (warning, warnings); not once the
    reward rose above the start's."""
    args = types.SimpleNamespace(max_new_tokens=6, lr=1e-4, beta=0.04)
    run, step = stuck_steps(capsys, args)
    m, said = step(1, frac_truncated=63 / 64, reward_std=0.0, frac_zero_std=1.0)
    assert said == ["warning: step 1: 98% of completions were cut by --max_new_tokens 6 (no EOS) "
                    "and score as cut: try --max_new_tokens 24, or ask for shorter answers "
                    "(--system_prompt)",
                    "warning: step 1: every completion got the same reward, 0: nothing is "
                    "learned; does your reward read fields the rows have, and can this model "
                    "reach it?"]
    assert m["warning"] == "truncated,constant_reward" and m["warnings"] == 2
    m, said = step(2, frac_truncated=1.0, reward_std=0.0, frac_zero_std=1.0)  # the same kinds
    assert said == [] and "warnings" not in m and "warning" not in m
    m, said = step(3, frac_zero_std=1.0)  # groups all equal (every step), rewards not one value
    assert said == ["warning: step 3: every group's rewards were equal, so every advantage is 0 "
                    "and nothing is learned: the task is out of reach or solved already, or the "
                    "reward cannot tell the completions apart"]
    m, said = step(4, frac_zero_std=1.0, **{"reward/exact": 0.0, "reward/mentions": 0.1})
    assert said == ["warning: step 4: reward/exact gave every completion 0: only reward/mentions "
                    "teach(es), and the model learns what they pay for, not this; can it be "
                    "earned from here (read samples.jsonl; a --system_prompt)?"]
    m, said = step(5, reward=0.9, kl=4.4)
    assert said == ["warning: step 5: kl 4.4 nats per token to the reference: the policy has "
                    "left its start (reward hacking or collapse; read samples.jsonl): lower --lr "
                    "0.0001 or raise --beta"] and m["warning"] == "drift"
    m, said = step(6, reward=0.9, clip_frac=0.7)
    assert said == ["warning: step 6: clip_frac 0.70: most tokens' ratio left the clip range "
                    "within one step, the updates are too large: lower --lr 0.0001"]
    m, said = step(7, reward=0.9, kl=5.0, clip_frac=0.8, frac_truncated=1.0)  # said already
    assert said == [] and "warning" not in m
    m, said = step(8, reward=0.0, reward_std=0.0, frac_zero_std=1.0)  # a hard batch after
    assert said == [] and "warning" not in m  # the reward rose (steps 5-7): the run learns
    history = list(run.history)  # resumed: the earlier steps' warnings are read back
    run.history[:] = [dict(x) for x in history]
    m, said = step(9, kl=6.0)
    assert said == []
    args.kl_coef = 0.05  # ppo names its own flag
    run.history.clear()
    m, said = step(1, kl=5.0)
    assert said and said[0].endswith("raise --kl_coef") and m["warning"] == "drift"
    run.history.clear()  # a new run: every reward 0, a mixture's parts included, says the
    m, said = step(1, reward_std=0.0, **{"reward/rg": 0.0, "reward/rg/chain_sum": 0.0})
    assert m["warning"] == "constant_reward", said  # constant reward's line, not "only  teach"


def test_a_run_that_breaks_after_a_good_start_is_stuck_at_the_last_ten_steps(capsys):
    """A run whose every completion scores the same for the last WINDOW (10) steps, at or below
    its start's reward (after step 1's 0.5, nothing but 0: an lr that broke the policy), is
    stuck: said at step 11, once."""
    _, step = stuck_steps(capsys, types.SimpleNamespace(max_new_tokens=6, lr=1e-2, beta=0.04))
    said = [step(1, reward=0.5)[1]] + [step(n, reward_std=0.0, frac_zero_std=1.0)[1]
                                       for n in range(2, 30)]
    assert [n for n, lines in enumerate(said, 1) if lines] == [11]
    assert said[10] == ["warning: step 11: every completion got the same reward, 0: nothing is "
                        "learned; does your reward read fields the rows have, and can this model "
                        "reach it?"]


def test_a_collapse_after_an_early_rise_is_said_once_with_its_numbers(capsys):
    """The reward rises from 0.3 to 0.9 in 20 steps, holds, then falls to 0.1: runs.collapsed
    finds the last 10 steps' mean back at the start's and more than 7 standard errors below the
    best 10 steps', and says so once, naming the steps; the rise alone says nothing; a reward
    that only fell from its start (0.3 -> 0.02 in 30 steps, as `grpo.py --beta 0 --lr 1e-3`
    did) is a collapse too."""
    _, step = stuck_steps(capsys, types.SimpleNamespace(max_new_tokens=6, lr=1e-4, beta=0.0))
    rewards = [0.3 + 0.03 * t for t in range(20)] + [0.9] * 10 + [0.1] * 20
    said = [(n, step(n, reward=r, kl=0.0)[1]) for n, r in enumerate(rewards, 1)]
    assert [(n, lines) for n, lines in said if lines] == [(36, [
        "warning: step 36: the reward fell to 0.42 (mean of steps 27-36) from 0.9 (steps 21-30; "
        "its start, steps 1-10: 0.435): a collapse (read samples.jsonl from step 30): lower --lr "
        "0.0001"])]
    rise = [0.3 + 0.03 * t for t in range(20)] + [0.9] * 30
    assert not any(runs.collapsed(rise[:n]) for n in range(1, 51))
    fall = [max(0.02, 0.3 - 0.01 * t) for t in range(40)]
    assert [n for n in range(1, 41) if runs.collapsed(fall[:n])][:1] == [20]
    assert runs.collapsed(fall[:20]) == pytest.approx((0.255, 0.255, 10, 0.155))


def test_a_run_that_learns_in_small_noisy_steps_gets_a_warning_or_two(capsys):
    """`grpo.py --prompts_per_step 2 --group_size 2 --micro_batch_size 4 --seed 2` learns (held-out
    0.29 -> 0.88) in noisy steps of 4 samples: step 1 scored 1.0 by luck, and a dip to 0.38 for 10
    steps comes near step 95. Its recorded rewards (x 4) and frac_zero_std (x 2), replayed: the
    old rules said 73 warnings (a streak again at each all-equal step); now step 1's constant
    reward and step 3's all-equal groups, and no collapse (the dip is 5.9 standard errors below
    the best 10 steps', under 7)."""
    rewards = ("402002224321003122030200011312233444212443131242132444423232242131243430"
               "332223330334144444442330222203022234334432334322144442322444323033124324"
               "42344334334243434441332224041442434144433344413444432434")
    zero_std = ("222222222121221122212222211112211222212221111222112222221212222111021212"
                "112021112112122222222112222021222012112212112122122222120222121211102122"
                "20122112112221212221112202221220212122211122211222212212")
    _, step = stuck_steps(capsys, types.SimpleNamespace(max_new_tokens=6, lr=1e-4, beta=0.04))
    warned = [(n, step(n, reward=int(r) / 4, reward_std=0.0 if r in "04" else 0.5,
                       frac_zero_std=int(z) / 2)[0].get("warning"))
              for n, (r, z) in enumerate(zip(rewards, zero_std), 1)]
    assert len(warned) == 200
    assert [(n, w) for n, w in warned if w] == [(1, "constant_reward"), (3, "zero_std")]


def test_the_drift_at_beta_0_reads_the_entropy(capsys):
    """At beta 0 (kl logs 0: no reference) the drift line reads the entropy: 10x below the mean
    of the first 10 steps' while the reward did not rise, it warns once (naming the flags);
    the documented SmolLM2 run at beta 0 whose entropy fell 0.59 -> 0.02 while its reward rose
    (docs/real_model.md, GRPO, 3 seeds' means) is not warned of."""
    args = types.SimpleNamespace(max_new_tokens=6, lr=1e-5, beta=0.0)
    _, step = stuck_steps(capsys, args)
    said = [step(n, reward=0.3, kl=0.0, entropy=0.5 if n <= 10 else 0.5 / 1.5 ** (n - 10))[1]
            for n in range(1, 31)]
    assert [n for n, lines in enumerate(said, 1) if lines] == [16]
    assert said[15] == ["warning: step 16: entropy 0.0439 nats per token, 0.088x its start (0.5, "
                        "steps 1-10), while the reward did not rise (0.3 against 0.3): the policy "
                        "has left its start without learning (collapse; read samples.jsonl) and "
                        "no KL holds it: lower --lr 1e-05 or give --beta 0.04"]
    _, step = stuck_steps(capsys, args)
    reward = [0.41, 0.68, 0.60, 0.46, 0.79, 0.39, 0.74, 0.88, 0.71, 0.84, 0.88, 0.94, 0.91, 0.95,
              0.69, 0.98]
    entropy = [0.59, 0.34, 0.41, 0.54, 0.28, 0.59, 0.15, 0.08, 0.21, 0.09, 0.04, 0.07, 0.07, 0.02,
               0.08, 0.05]
    assert not any(step(n, reward=r, reward_std=0.3, kl=0.0, entropy=h)[1]
                   for n, (r, h) in enumerate(zip(reward, entropy), 1))


@pytest.mark.parametrize("script", ["grpo", "reinforce", "ppo"])
def test_the_bundled_defaults_warn_of_nothing(script, tmp_path, monkeypatch, capsys):
    """The bundled task with each RL script's defaults learns, so warn_if_stuck says nothing
    (their first 10 steps here; the full documented runs were checked too: grpo's kl peaks at 1.5
    nats, ppo's clip_frac at 0.18)."""
    module = __import__(script)
    run_main(monkeypatch, module, "--max_steps", "10", "--eval_every", "0", "--eval_size", "20",
             "--save_every", "0", "--output_dir", tmp_path / script)
    assert not any("warning" in m for m in read_metrics(tmp_path / script))
    assert "warning: step" not in capsys.readouterr().out


def test_curves_show_the_held_out_score_entropy_each_reward_and_kl_only_when_computed():
    """curves.png's panels: held-out eval (before, during, after), reward, each component when
    there are several, gold, entropy; kl only when some step computed it (beta 0 logs 0)."""
    history = [{"step": s, "reward": 0.5, "reward/math": 0.4, "reward/short": 0.1, "gold": 0.4,
                "entropy": 0.3, "kl": 0.0, **({"eval": 0.6} if s == 2 else {})} for s in (1, 2, 3)]
    panels = runs.curve_panels(history, [(0, 0.3), (2, 0.6), (3, 0.9)])
    assert [p[0] for p in panels] == ["held-out eval", "reward", "reward/math", "reward/short",
                                      "gold", "entropy"]
    assert panels[0][1:] == ([0, 2, 3], [0.3, 0.6, 0.9])
    history[1]["kl"] = 0.02
    del history[0]["reward/short"], history[1]["reward/short"], history[2]["reward/short"]
    assert [p[0] for p in runs.curve_panels(history, [])] == ["reward", "gold", "entropy", "kl"]


# ---- runs.py: --report_to, the experiment trackers
def test_summary_numbers_are_rounded_and_json_safe():
    """summary.json: 6 significant digits (no float32 noise), NaN/inf as null, ints as they are."""
    x = torch.tensor(0.282).item()  # 0.28200000524520874
    assert runs._json_safe({"a": x, "b": [float("nan"), 1e-6, 123456789.0], "c": (3, True)}) == \
        {"a": 0.282, "b": [None, 1e-6, 123457000.0], "c": [3, True]}


def test_report_to_sends_the_metrics_and_samples_to_a_tracker(tmp_path, monkeypatch, capsys):
    """--report_to wandb (a fake module here): every metrics line and the samples table reach it;
    a tracker that is not installed is one line."""
    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw["project"]))
    fake.log = lambda data, step: calls.append(("log", step, sorted(data)))
    fake.Table = lambda columns, data: ("table", columns, len(data))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--report_to", "wandb",
             "--output_dir", out)
    logged = [c for c in calls if c[0] == "log"]
    assert calls[0] == ("init", "minrl") and calls[-1] == ("finish",)
    assert [c[1] for c in logged] == [1, 2]  # one call a step; step 1 with the samples table
    assert "reward" in logged[0][2] and "samples" in logged[0][2]
    assert set(logged[1][2]) == set(read_metrics(out)[1]) - {"step"}
    monkeypatch.setitem(sys.modules, "trackio", None)
    with pytest.raises(SystemExit):
        run_main(monkeypatch, grpo, "--report_to", "trackio", "--output_dir", tmp_path / "t",
                 guard=True)
    assert "needs the optional package trackio (pip install trackio)" in capsys.readouterr().err


def test_report_to_tensorboard_writes_what_its_own_reader_reads_back(monkeypatch, tmp_path):
    """--report_to tensorboard, against the real package: tensorboard's EventAccumulator reads
    every number of every metrics.jsonl line back at its step (as float32), and the samples."""
    pytest.importorskip("tensorboard", reason="--report_to tensorboard needs the tensorboard "
                        "package (.ci/run installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--report_to", "tensorboard",
             "--output_dir", out)
    metrics = read_metrics(out)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    keys = {k for m in metrics for k, v in m.items() if isinstance(v, (int, float)) and k != "step"}
    assert set(events.Tags()["scalars"]) == keys
    for key in keys:  # every step's, and a step's warnings count (runs.warn_if_stuck) at its step
        assert [e.step for e in events.Scalars(key)] == [m["step"] for m in metrics if key in m]
        assert [e.value for e in events.Scalars(key)] == pytest.approx(
            [m[key] for m in metrics if key in m], rel=1e-6, abs=1e-12), key
    [text] = events.Tags()["tensors"]  # add_text: the first step's samples, as JSON
    [sample] = events.Tensors(text)
    logged = json.loads(sample.tensor_proto.string_val[0])
    assert sample.step == 1 and [s["prompt"] for s in logged] == \
        [s["prompt"] for s in json.loads((out / "samples.jsonl").read_text())["samples"]]


def wandb_history(path):
    """The history rows of an offline wandb run file (run-*.wandb), as {key: value}: its records
    are in LevelDB's log format (a 7-byte file header, then 32 KiB blocks of pieces, each a crc32
    (4 bytes), a length (2) and a kind: 1 whole, 2 first, 3 middle, 4 last), each record a
    protobuf wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2
    data, pos, records, piece = path.read_bytes(), 7, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's last bytes, too few for a header: padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        piece += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(piece)
            piece = b""
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item})
    return rows


def test_report_to_wandb_offline_records_the_run(monkeypatch, tmp_path):
    """--report_to wandb against the real package, offline (WANDB_MODE=offline: nothing leaves
    the machine): the run file it writes holds every number of every metrics.jsonl line at its
    step, and the first step's samples table."""
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (optional: pip install "
                                "wandb)")
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_DIR", str(tmp_path)),
                        ("WANDB_SILENT", "true")):
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--report_to", "wandb",
             "--output_dir", out)
    wandb.teardown()  # its service writes the run file on its own time: wait for it to finish
    [path] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, metrics = wandb_history(path), read_metrics(out)
    assert [h["_step"] for h in history] == [m["step"] for m in metrics] == [1, 2]
    for h, m in zip(history, metrics):
        for key in (k for k, v in m.items() if isinstance(v, (int, float)) and k != "step"):
            assert h[key] == pytest.approx(m[key], rel=1e-12), key
    samples = json.loads((out / "samples.jsonl").read_text())["samples"]
    assert history[0]["samples/_type"] == "table-file"
    assert history[0]["samples/nrows"] == len(samples) and "samples/nrows" not in history[1]


def test_distills_kl_to_its_teacher_is_no_drift_warning(capsys):
    """distill.py logs kl, the distance to its teacher (its loss, high at the start: ~23 nats per
    token for a random student); warn_if_stuck reads no drift from the reference in it. The same
    kl in grpo (a reference model, --beta) is warned of, once."""
    for args, said in ((types.SimpleNamespace(max_new_tokens=6, lr=1e-5, kl_coef=1.0,
                                              teacher="runs/teacher/checkpoint"), []),
                       (types.SimpleNamespace(max_new_tokens=6, lr=1e-5, beta=0.04), [1])):
        _, step = stuck_steps(capsys, args)
        lines = [step(n, reward=0.3 + 0.02 * n, reward_std=0.3, kl=23.0 - n, entropy=0.5)[1]
                 for n in range(1, 13)]
        assert [n for n, x in enumerate(lines, 1) if any("kl " in line for line in x)] == said
