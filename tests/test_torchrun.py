"""torchrun: several processes on gloo make the one-process update; global statistics."""
import json
import os
import re
import subprocess
import threading

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from plumbing.errors import UserError
import grpo
import ppo
from plumbing import runs

from tests.helpers import read_metrics, run_main, run_processes


# ---- torchrun: several processes (gloo on the CPU)
# Keys whose value is wall-clock time, not a statistic of the rows
WALL_CLOCK = ("step_time", "tokens_per_s")


@pytest.mark.parametrize("script,flags", [
    ("grpo", ["--prompts_per_step", "4", "--group_size", "4", "--micro_batch_size", "4",
              "--scale_rewards", "batch"]),
    ("reinforce", ["--prompts_per_step", "4", "--samples_per_prompt", "4", "--micro_batch_size",
                   "4", "--baseline", "ema", "--beta", "0.05"]),
    ("ppo", ["--batch_size", "16", "--micro_batch_size", "4", "--num_minibatches", "2",
             "--ppo_epochs", "2", "--rewards", "math", "--critic_init", "policy"]),
    ("distill", ["--prompts_per_step", "8", "--micro_batch_size", "4",  # a self-teacher, shown
                 "--teacher_system_prompt", "1+1=2"])])  # a sum first (as text: no template)
def test_two_processes_make_the_one_process_update(script, flags, tmp_path):
    """One optimizer step on the same rows: 2 gloo processes under torchrun (normalisers and
    statistics over both), with DDP and with --fsdp (FSDP2: each process holds half of every
    weight, samples on gathered weights, and the checkpoint is gathered back), vs 1 process. The
    gradient norms agree to float rounding; Adam's first step, lr * g / (|g| + eps), amplifies
    rounding only where |g| ~ eps, so almost every weight agrees to 1e-6 (measured: >= 99.2%,
    either way). Statistics of the whole step: grpo's --scale_rewards batch divides by the std of
    every process's rewards, reinforce's first --baseline ema is the mean return of every
    process's rows, ppo's 2 epochs of 2 minibatches follow one shuffle of the whole batch (rank
    0's: the driver leaves rank 1's RNG elsewhere), unevenly split between the processes, and
    every logged number is what one process logs on the same rows (token means weighted by
    their tokens, stds over all rows), the step an int."""
    out = {}
    for name, n, extra in (("one", 1, []), ("ddp", 2, []), ("fsdp", 2, ["--fsdp"])):
        out[name] = tmp_path / name
        r = run_processes(tmp_path, n, script, *flags, *extra, "--max_steps", "1", "--eval_size",
                          "8", "--output_dir", str(out[name]))
        assert r.returncode == 0, r.stderr[-3000:]
    m1 = read_metrics(out["one"])
    a = load_file(out["one"] / "checkpoint" / "model.safetensors")
    for name in ("ddp", "fsdp"):
        m2 = read_metrics(out[name])
        assert len(m2) == 1 and m2[0]["grad_norm"] == pytest.approx(m1[0]["grad_norm"], rel=1e-5)
        assert m2[0]["reward"] == pytest.approx(m1[0]["reward"], abs=1e-9)
        assert m2[0].keys() == m1[0].keys() and type(m2[0]["step"]) is int, name
        for key in m1[0].keys() - set(WALL_CLOCK):
            assert m2[0][key] == pytest.approx(m1[0][key], rel=1e-5, abs=1e-7), (name, key)
        b = load_file(out[name] / "checkpoint" / "model.safetensors")
        assert a.keys() == b.keys()  # FSDP2's gathered tied LM head too is written once
        close = sum(int(((a[k] - b[k]).abs() <= 1e-6).sum()) for k in a)
        assert close / sum(a[k].numel() for k in a) >= 0.98, name
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 2e-4  # at most one lr of a flip


@pytest.mark.parametrize("script,flags", [
    ("grpo", ["--prompts_per_step", "4", "--group_size", "4", "--micro_batch_size", "8"]),
    ("ppo", ["--batch_size", "8", "--micro_batch_size", "4", "--num_minibatches", "2",
             "--rewards", "math", "--critic_init", "policy", "--fsdp"])])
def test_torchrun_writes_one_metrics_line_per_step_and_resumes(script, flags, tmp_path):
    """DDP (grpo) and --fsdp (ppo: policy and critic sharded; their full weights and optimizer
    state gathered into the checkpoint, which from_pretrained loads, and sharded again on
    resume)."""
    out = tmp_path / "run"
    flags = [*flags, "--eval_size", "8", "--save_every", "2", "--save_optimizer", "--output_dir",
             str(out)]
    r = run_processes(tmp_path, 2, script, *flags, "--max_steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert len(state["rngs"]) == 2  # each process's sampling RNG
    r = run_processes(tmp_path, 2, script, "--resume", str(out), "--max_steps", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
    AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    if script == "grpo":
        r = run_processes(tmp_path, 2, "grpo", *flags[:-2], "--prompts_per_step", "3",
                          "--output_dir", str(tmp_path / "bad"))
        assert r.returncode != 0 and "must divide among the 2 processes" in r.stderr
        assert r.stderr.count("error: --prompts_per_step") == 1  # said once, by rank 0


ONE_RANK_FAILS = """
import os


def picky(completions, rows):
    if os.environ["RANK"] == "1":
        raise ValueError("only in process 1")
    return [1.0] * len(completions)
"""


def test_an_error_in_one_process_but_rank_0_says_its_one_line(tmp_path):
    """A reward that fails in process 1 alone: that process says why, in one line (before, only
    rank 0 spoke, and rank 0 waits in a collective until torchrun stops it)."""
    (tmp_path / "picky.py").write_text(ONE_RANK_FAILS)
    r = run_processes(tmp_path, 2, "grpo", "--prompts_per_step", "4", "--group_size", "2",
                      "--micro_batch_size", "4", "--eval_size", "4", "--eval_every", "0",
                      "--reward_fn", f"{tmp_path / 'picky.py'}:picky", "--max_steps", "2",
                      "--output_dir", str(tmp_path / "run"))
    line = "error: reward 'picky' raised ValueError: only in process 1 (first on row 0, prompt"
    assert r.returncode != 0 and r.stderr.count(line) == 1, r.stderr[-3000:]
    ours = r.stderr.split("ChildFailedError")[0]  # before torchrun's own report of the exits
    assert "[rank0]: Traceback" not in ours, ours[-3000:]
    assert "Connection closed by peer" not in ours, ours[-3000:]


@pytest.mark.parametrize("script,lr", [("sft", 3e-4), ("reward_model", 3e-4), ("dpo", 1e-4)])
def test_pipeline_under_torchrun_makes_the_one_process_update(script, lr, tmp_path):
    """sft.py, reward_model.py and dpo.py under torchrun: 2 gloo processes (DDP, and --fsdp) each
    take half of every step's rows, in 2 micro-batches, and make the update 1 process makes; the
    second step starts from the first's weights and optimizer state; eval is split and merged."""
    out = {}
    for name, n, extra in (("one", 1, []), ("ddp", 2, []), ("fsdp", 2, ["--fsdp"])):
        out[name] = tmp_path / name
        r = run_processes(tmp_path, n, script, "--batch_size", "8", "--micro_batch_size", "2",
                          *extra, "--max_steps", "2", "--eval_size", "20", "--eval_every", "0",
                          "--output_dir", str(out[name]))
        assert r.returncode == 0, r.stderr[-3000:]
    m1, s1 = read_metrics(out["one"]), json.loads((out["one"] / "summary.json").read_text())
    a = load_file(out["one"] / "checkpoint" / "model.safetensors")
    for name in ("ddp", "fsdp"):
        m2, s2 = read_metrics(out[name]), json.loads((out[name] / "summary.json").read_text())
        assert [m["step"] for m in m2] == [1, 2] and m2[0].keys() == m1[0].keys(), name
        # every logged number, not only the loss. Not dpo's rewards/accuracy (yet): at step 1
        # (pi_theta = pi_ref) every pair ties, but under torchrun the wrapped policy and pi_ref
        # compute log-probs on different code paths, so the ties turn into rounding-sized margins
        # of either sign (#26 item 15). test_dpo_training_accuracy_counts_a_tie_as_half checks ties
        for key in m1[0].keys() - {*WALL_CLOCK, "rewards/accuracy"}:
            assert [m[key] for m in m2] == pytest.approx([m[key] for m in m1], rel=1e-5,
                                                         abs=1e-6), (name, key)
        assert s2["eval_before"] == s1["eval_before"], name  # the same rows, split and merged
        b = load_file(out[name] / "checkpoint" / "model.safetensors")
        assert a.keys() == b.keys(), name
        close = sum(int(((a[k] - b[k]).abs() <= 1e-6).sum()) for k in a)
        assert close / sum(a[k].numel() for k in a) >= 0.98, name
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 4 * lr, name


def test_fsdp_needs_torchrun_and_full_weights(monkeypatch):
    """--fsdp is refused, in one line before any collective, without torchrun and with LoRA."""
    with pytest.raises(UserError, match="launch with torchrun"):
        run_main(monkeypatch, grpo, "--fsdp")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: refused before joining a group
    with pytest.raises(UserError, match="--fsdp with --lora_r is not supported"):
        run_main(monkeypatch, ppo, "--fsdp", "--lora_r", "4", "--batch_size", "16")


def test_run_processes_tries_again_only_when_the_machine_fails_the_launch(monkeypatch, tmp_path):
    """The torchrun tests' launcher: each try on a free port of its own; a gloo or rendezvous
    failure is tried again from the run folder as it was before the launch; a failure of the code
    is returned at once."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("before\n")
    calls, seen = [], []

    def fake_run(cmd, **kwargs):  # the first try fails as gloo does on a busy machine
        calls.append(cmd)
        seen.append(sorted(os.listdir(folder)))
        (folder / "half-written").write_text("x")
        err = "RuntimeError: [pair.cc:534] Read error: Resource temporarily unavailable"
        return subprocess.CompletedProcess(cmd, 1 if len(calls) == 1 else 0, "",
                                           err if len(calls) == 1 else "")
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert run_processes(tmp_path, 2, "grpo", "--resume", folder).returncode == 0
    assert seen == [["metrics.jsonl"], ["metrics.jsonl"]]  # the second try: as before the first
    assert all(any(re.fullmatch(r"--rdzv-endpoint=127\.0\.0\.1:\d+", a) for a in c)
               for c in calls)
    calls.clear()
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        subprocess.CompletedProcess(cmd, 1, "", "ValueError: a bug"))
    assert run_processes(tmp_path, 2, "grpo").returncode == 1 and len(calls) == 1


# ---- torchrun: statistics over every process's rows
def as_two_processes(monkeypatch, fn, inputs):
    """[fn(inputs[0]), fn(inputs[1])], run in two threads that stand in for two torchrun
    processes: runs' collectives see a world of 2, and dist.all_reduce sums in place over both,
    as gloo does. No process, no port: the merging arithmetic alone."""
    slots, barrier = {}, threading.Barrier(2, timeout=30)

    def all_reduce(t):
        slots[threading.get_ident()] = t.clone()
        barrier.wait()  # both have put theirs
        total = sum(slots.values())
        barrier.wait()  # both have read: the next all_reduce may overwrite
        t.copy_(total)
    monkeypatch.setattr(runs.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(runs.dist, "all_reduce", all_reduce)
    results = [None, None]

    def one(i):
        results[i] = fn(inputs[i])
    workers = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return results


def test_global_statistics_are_those_of_every_processs_rows(monkeypatch):
    """runs.global_std and runs.global_mean over two processes of unequal shares are what one
    process computes on all the rows: the unbiased std (as torch.std), a token mean weighted by
    each process's tokens, a row mean by rows, and the step stays an int. With one process they
    return what they are given, bit for bit; grpo's --scale_rewards batch then divides by the
    whole step's std."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, generator=g) * 3 + 1
    assert torch.equal(runs.global_std(x), x.std())  # one process: torch.std itself
    metrics = {"step": 3, "kl": 0.25}
    assert runs.global_mean(metrics, weights={"kl": 7}) is metrics
    for std in as_two_processes(monkeypatch, runs.global_std, (x[:5], x[5:])):
        assert std.dtype == x.dtype and float(std) == pytest.approx(float(x.std()), rel=1e-6)
    same = torch.full((61,), 3.563326597213745)  # equal rewards: the one-pass variance rounds < 0
    assert as_two_processes(monkeypatch, runs.global_std, (same[:30], same[30:])) == [0.0, 0.0]
    kl, reward = torch.rand(12, generator=g), torch.rand(8, generator=g)  # 3 + 9 tokens, 4 + 4 rows
    shares = [(kl[:3], reward[:4]), (kl[3:], reward[4:])]
    merged = as_two_processes(monkeypatch, lambda s: runs.global_mean(
        {"step": 3, "kl": float(s[0].mean()), "reward": float(s[1].mean())},
        weights={"kl": len(s[0])}), shares)
    for m in merged:
        assert type(m["step"]) is int and m["step"] == 3
        assert m["kl"] == pytest.approx(float(kl.mean()), rel=1e-6)  # not the mean of 2 means
        assert m["reward"] == pytest.approx(float(reward.mean()), rel=1e-6)
    no_tokens = as_two_processes(monkeypatch, lambda s: runs.global_mean(  # e.g. all masked
        {"kl": 0.0}, weights={"kl": 0}), (None, None))
    assert [m["kl"] for m in no_tokens] == [0.0, 0.0]  # not 0 / 0 = nan
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1])  # 4 groups of 4
    whole = grpo.group_advantages(rewards, 4, "batch")
    halves = as_two_processes(monkeypatch, lambda r: grpo.group_advantages(
        r, 4, "batch", std=runs.global_std), (rewards[:8], rewards[8:]))
    torch.testing.assert_close(torch.cat(halves), whole)  # per process, halves' stds differ
    assert not torch.allclose(torch.cat([grpo.group_advantages(r, 4, "batch")
                                         for r in (rewards[:8], rewards[8:])]), whole)
