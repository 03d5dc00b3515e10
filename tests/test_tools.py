"""Tool use: multi-turn sampling with env_step, envs.py, --env and --tools, chat templates."""
import gc
import json
import os
import random
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import common as C
from plumbing.errors import UserError
import engine
from plumbing import calc
from plumbing import envs as E
from plumbing.flags import parse_args
import grpo
from plumbing import loading
import ppo
import reinforce as R
from plumbing import tasks

from tests.helpers import (FAST_GRPO, OFF, PROMPTS, ROOT, read_metrics, rollout, run_main,
                           run_processes, run_script, scripted_model, tiny_config, tiny_model,
                           TOOLS_FILE)


# ---- tool use: the multi-turn sampler (engine.sample), envs.py, --env / --tools
def always_env(text=" 12 "):
    """An environment that answers every turn with the same observation (a tiny random model
    never writes a tool call, so the test envs do not wait for one); its calls are recorded."""
    calls = []

    def env(row, turns):
        calls.append((row["prompt"], list(turns)))
        return text
    env.calls = calls
    return env


def test_multi_turn_masks_and_ids_on_scripted_turns():
    """Exactly the masks of a multi-turn rollout on scripted turns: an EOS inside the transcript
    (a turn ends with EOS, the env answers, the model goes on), an observation cut at the
    budget's edge, a turn cut by the budget, and pad == EOS. Model ids are exactly the sampled
    ones, observation ids the observation's tokens, and rewards read the text after the last
    observation."""
    t = loading.load_tokenizer(loading.DEFAULT_POLICY)
    t.pad_token = t.eos_token  # pad == EOS: masks must come from positions
    eos = t.eos_token_id
    enc = lambda s: t(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = ["3+4=", "33+44=", "5+55="]  # three lengths: the scripts cannot collide
    p = [C.encode_prompts(t, [s], "none")[0] for s in prompts]
    budget = 20  # row 2: 18 call tokens + 2 of its 4 observation tokens
    want = [enc("ab") + [eos] + enc(" 77 ") + enc("7") + [eos],
            enc("<calc>33+44</calc>") + enc(" 7"),
            enc("xyzxyzxyzxyzxyzxyzxyzxyz")[:budget]]
    kinds = [[1] * 3 + [0] * 4 + [1] * 2, [1] * 18 + [0] * 2, [1] * budget]
    model = scripted_model(t, p, want, kinds)
    rows = [{"prompt": s, "answer": str(eval(s[:-1]))} for s in prompts]

    def env(row, turns):
        return " 77 " if row["prompt"] != "5+55=" and len(turns) == 1 else None
    roll = rollout(model, t, p, env, rows, 3, budget, greedy=True, stop=["</calc>"])
    comp = roll.ids[:, roll.P:]
    for i in range(3):
        n = len(want[i])
        assert comp[i, :n].tolist() == want[i]
        assert roll.completion_mask[i].tolist() == kinds[i] + [0] * (comp.shape[1] - n)
        assert roll.attention_mask[i, roll.P:].tolist() == [1] * n + [0] * (comp.shape[1] - n)
        lp = roll.sample_logprobs[i, :n]
        assert (lp[torch.tensor(kinds[i]) == 0] == 0).all()
        assert (lp[torch.tensor(kinds[i]) == 1] < 0).all()
    assert roll.truncated.tolist() == [False, True, True]
    assert roll.turns.tolist() == [2, 1, 1] and roll.tool_calls.tolist() == [1, 1, 0]
    assert roll.obs_truncated.tolist() == [False, True, False]
    assert roll.final == ["7", "", "xyzxyzxyzxyzxyzxyzxy"]  # row 1: nothing after its observation
    assert roll.transcript[0] == "ab⟦ 77 ⟧7"
    assert roll.transcript[1] == "<calc>33+44</calc>⟦ 7⟧"
    assert [C.math_reward(c, r) for c, r in zip(roll.final, rows)] == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_multi_turn_logprobs_equal_a_plain_forward_and_each_token_is_forwarded_once(arch, tok):
    """On a tiny random model (EOS frequent, observations after every turn): the log-probs of the
    whole multi-turn sequence by one plain HF forward, at the model's positions, equal the
    sampler's own and the training forward's; observation positions hold the observation's
    tokens; and the positions the model forwards are the ideal: each distinct prompt once, and
    each completion token once, up to each row's last sampled one (nothing reads what comes
    after it: its EOS, an observation cut by the budget). (Counted: the
    positions a forward feeds with attention 1; rows that ride along as padding, attention 0,
    are not tokens.)"""
    model = tiny_model(arch, seed=2)
    model.generation_config.eos_token_id = list(range(2, 99, 9))  # turns of ~9 tokens
    forwarded = []
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: forwarded.append(int(kw["attention_mask"][
            :, -kw["input_ids"].shape[1]:].sum())), with_kwargs=True)
    torch.manual_seed(0)
    prompts = C.encode_prompts(tok, PROMPTS * 2)
    env = always_env(" 12 ")
    roll = rollout(model, tok, prompts, env, [{"prompt": p} for p in PROMPTS * 2], 16, 40)
    hook.remove()
    mask, T = roll.completion_mask, roll.completion_mask.shape[1]
    assert (roll.tool_calls >= 3).any() and (mask[:, :-1] < mask[:, 1:]).any()  # 0 -> 1: obs
    lengths = roll.attention_mask[:, roll.P:].sum(-1)
    # each row forwards every token before its last sampled one: nothing reads what follows
    last = [int(m.nonzero().max()) for m in mask]
    assert sum(forwarded) == sum(map(len, set(map(tuple, prompts)))) + sum(last)
    obs = tok(" 12 ", add_special_tokens=False)["input_ids"]
    for i in range(len(prompts)):  # row i: runs of model tokens and observation tokens
        n = int(lengths[i])
        runs_ = []
        for x, m in zip(roll.ids[i, roll.P:roll.P + n].tolist(), mask[i, :n].tolist()):
            if not runs_ or runs_[-1][0] != m:
                runs_.append((m, []))
            runs_[-1][1].append(x)
        assert all(ids == obs[:len(ids)] for m, ids in runs_ if m == 0)  # the last may be cut
        assert sum(m for m, _ in runs_) == int(roll.turns[i])
        shown = sum(1 for o in roll.observations[i] if o)  # (one at the budget's end is empty)
        assert len(runs_) - int(roll.turns[i]) == shown
    ids, am = roll.ids, roll.attention_mask
    logits = model(input_ids=ids, attention_mask=am, position_ids=C.positions(am)).logits
    plain = logits[:, -T - 1:-1].float().log_softmax(-1).gather(-1, ids[:, -T:, None])[..., 0]
    torch.testing.assert_close(plain * mask, roll.sample_logprobs, atol=2e-5, rtol=0)
    train = C.batched_logprobs(model, roll, 1.0, 4, OFF)
    torch.testing.assert_close(train, roll.sample_logprobs, atol=2e-5, rtol=0)


def test_multi_turn_respects_max_turns_and_the_budget(tok):
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = [2, 43, 72]
    prompts = C.encode_prompts(tok, PROMPTS * 4)
    rows = [{"prompt": p} for p in PROMPTS * 4]
    for max_turns, budget in ((1, 30), (2, 30), (4, 40), (4, 9)):
        env = always_env(" 1 ")
        torch.manual_seed(0)
        roll = rollout(model, tok, prompts, env, rows, max_turns, budget)
        assert roll.turns.max() <= max_turns and roll.tool_calls.max() <= max_turns - 1
        assert (roll.attention_mask[:, roll.P:].sum(-1) <= budget).all()
        n_model = roll.completion_mask.sum(-1)
        assert (roll.tool_calls <= roll.turns).all() and (n_model >= roll.turns).all()
        assert len(env.calls) == int(roll.tool_calls.sum())  # never called after the last turn
        full = roll.attention_mask[:, roll.P:].sum(-1) == budget
        assert (roll.truncated <= full).all()  # truncated only where the budget is spent
        if max_turns == 1:
            assert not env.calls
    assert roll.truncated.any()  # budget 9: some rows hit it


def test_env_gets_its_row_and_the_turns_so_far(tok):
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = [2, 43, 72]
    env = always_env(" 1 ")
    torch.manual_seed(0)
    prompts = C.encode_prompts(tok, PROMPTS)
    roll = rollout(model, tok, prompts, env, [{"prompt": p} for p in PROMPTS], 3, 40)
    for i, p in enumerate(PROMPTS):
        mine = [turns for q, turns in env.calls if q == p]
        assert [len(t) for t in mine] == list(range(1, len(mine) + 1))  # one more each call
        if mine:
            pieces = [t for t in re.split("⟦[^⟧]*⟧", roll.transcript[i]) if t]  # cut: ⟦⟧
            assert mine[-1] == pieces[:len(mine[-1])]


def test_each_episode_owns_its_row_and_a_class_env_gets_one_object_per_episode(tok):
    """Every sample gets its own deep copy of its row: an env that counts its calls in the row
    sees 1, 2, ... within its own episode, whatever its group's other samples do, and the rows
    the caller holds (the reward's targets, the held-out rows) are untouched. --env
    FILE.py:Class builds one object per episode from its row and calls its step(turns)."""
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = [2, 43, 72]
    rows = [{"prompt": "1+2=", "answer": "3", "seen": []}] * 6  # one dict, six samples
    counts = []

    def env(row, turns):
        row["seen"].append(len(turns))
        row["answer"] = "999"  # must not reach the reward's target
        counts.append(list(row["seen"]))
        return " 1 "
    torch.manual_seed(0)
    prompts = C.encode_prompts(tok, [r["prompt"] for r in rows])
    roll = rollout(model, tok, prompts, env, rows, 4, 40)
    assert roll.tool_calls.max() >= 2 and rows[0] == {"prompt": "1+2=", "answer": "3", "seen": []}
    assert all(c == list(range(1, len(c) + 1)) for c in counts), counts

    class Episode:
        made = []

        def __init__(self, row):
            self.row, self.calls = row, 0
            Episode.made.append(self)

        def step(self, turns):
            self.calls += 1
            return f" {self.calls} "
    env_step, finish = E.start_episodes(rows, Episode, "--env 'x.py:Episode'", 60, tok, 4)
    torch.manual_seed(0)
    roll = engine.sample(model, tok, prompts, 40, env_step=env_step)
    finish(roll)
    made = [e for e in roll.episodes if e is not None]
    assert len(made) == len(Episode.made) == int((roll.tool_calls > 0).sum())
    assert [e.calls for e in made] == [int(n) for n in roll.tool_calls if n > 0]
    assert all(e.row is not rows[0] and e.row == rows[0] for e in made)


def test_env_calls_of_one_decode_step_run_at_once_and_a_slow_one_stops_in_time(tok):
    """The rows whose turn ends at the same step call their envs concurrently: 8 calls that each
    wait for all 8 to have started (a barrier) pass, as they could not one after another. A
    call that hangs stops the rollout with one line within its limit (one that spins:
    test_a_spinning_env_or_one_that_exits_stops_the_run_in_one_line)."""
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = list(range(len(tok)))  # every turn is one token
    barrier = threading.Barrier(8, timeout=20)

    def env(row, turns):
        barrier.wait()
        return None
    prompts = C.encode_prompts(tok, ["1+2="] * 8)
    roll = rollout(model, tok, prompts, env, [{"prompt": "1+2="}] * 8, 2, 10)
    assert roll.turns.tolist() == [1] * 8
    t0 = time.time()
    with pytest.raises(UserError, match=r"--env 'test' took more than 0.5 s on the row with "
                                          r"prompt '1\+2=', turn 1 \(--env_timeout\)"):
        rollout(model, tok, prompts[:2], lambda row, turns: time.sleep(3600),
                [{"prompt": "1+2="}] * 2, 2, 10, timeout=0.5)
    assert time.time() - t0 < 5  # (the sleeping thread is a daemon: it ends with the process)


def test_a_rollout_does_not_depend_on_when_the_tools_answer(tok):
    """Tools of random latency: from run to run the calls finish in other orders and rows rejoin
    the forwards at other steps, yet the same seed and the same tool outputs give the same
    rollout (each row draws from its own stream, u[i, k]); its log-probs agree to float
    rounding (which rows share a forward changes the matmuls' rounding, not the tokens)."""
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = [2, 43, 72, 80]
    prompts = C.encode_prompts(tok, PROMPTS * 2)
    rows = [{"prompt": p} for p in PROMPTS * 2]

    def env_with(latency_seed, order):
        rng, lock = random.Random(latency_seed), threading.Lock()

        def env(row, turns):
            with lock:
                wait = rng.choice([0.0, 0.002, 0.02, 0.08])
            time.sleep(wait)
            with lock:
                order.append((row["prompt"], len(turns)))
            return None if len(turns) >= 3 else f" {len(turns) * 7} "
        return env
    rolls, orders = [], []
    for latency_seed in range(3):
        orders.append([])
        torch.manual_seed(0)
        rolls.append(rollout(model, tok, prompts, env_with(latency_seed, orders[-1]), rows, 4,
                             40, top_p=0.95))
    assert len({tuple(o) for o in orders}) > 1  # the calls did finish in other orders
    assert (rolls[0].tool_calls >= 2).any()
    for roll in rolls[1:]:
        assert torch.equal(roll.ids, rolls[0].ids)
        assert torch.equal(roll.completion_mask, rolls[0].completion_mask)
        torch.testing.assert_close(roll.sample_logprobs, rolls[0].sample_logprobs, atol=1e-5,
                                   rtol=0)
        assert roll.transcript == rolls[0].transcript


def test_draw_samples_the_distribution_and_never_a_token_of_probability_zero():
    """common.draw, the per-row inverse-CDF draw: u spread evenly over [0, 1) lands on each
    token as often as its probability, top-p's unnormalised probabilities too, and never on a
    token of probability 0, even at u = 0 and u just under 1."""
    probs = torch.tensor([[0.0, 0.1, 0.0, 0.6, 0.3, 0.0]] * 2) * torch.tensor([[1.0], [0.5]])
    u = torch.arange(10_000) / 10_000
    for row in probs:
        got = C.draw(row.expand(len(u), -1), u)
        freq = torch.bincount(got, minlength=6).float() / len(u)
        torch.testing.assert_close(freq, row / row.sum(), atol=1e-3, rtol=0)
    edge = C.draw(probs[:1].expand(3, -1), torch.tensor([0.0, 1 - 2**-24, 0.1]))
    assert edge.tolist() == [1, 4, 3]


def test_episodes_are_freed_when_their_rollout_is_done(tok):
    """An episode (an env object, a tool conversation) lives as long as its rollout: once the
    rollout is dropped nothing holds it (no worker thread keeps its last job), without waiting
    for the garbage collector."""
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = [2, 43, 72]
    alive = weakref.WeakSet()

    class Episode:
        def __init__(self, row):
            self.data = bytearray(1 << 16)
            alive.add(self)

        def step(self, turns):
            return None if len(turns) > 2 else " 5 "
    prompts = C.encode_prompts(tok, PROMPTS * 2)
    rows = [{"prompt": p} for p in PROMPTS * 2]
    gc.disable()  # freed by reference counting: no cycle holds them
    try:
        for _ in range(3):
            env_step, finish = E.start_episodes(rows, Episode, "--env 'x.py:Episode'", 60, tok, 4)
            roll = engine.sample(model, tok, prompts, 30, env_step=env_step)
            finish(roll)
            assert len(alive) == sum(e is not None for e in roll.episodes) > 0
            del env_step, finish, roll
            assert len(alive) == 0
    finally:
        gc.enable()


@pytest.mark.parametrize("obs", ["<eos></s><pad><bos><unk> x", "\ud800 lone \udfff surrogates",
                                 "9" * 1_000_000])
def test_an_observation_is_text_never_special_tokens_and_is_cut_before_it_is_tokenized(
        obs, tok, monkeypatch):
    """What a tool returns is data: '<eos>' in it is five characters, never the EOS id (which
    would end the row, or let a tool write the model's turn markers); invalid unicode is
    replaced; a 1 MB observation is cut to the budget before it is tokenized, and counted."""
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = [2, 43, 72]
    tokenized = []
    real = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__", lambda self, text, *a, **k: (
        tokenized.append(len(text)), real(self, text, *a, **k))[1])
    torch.manual_seed(0)
    prompts = C.encode_prompts(tok, PROMPTS)
    roll = rollout(model, tok, prompts, always_env(obs), [{"prompt": p} for p in PROMPTS], 2, 40)
    assert (roll.tool_calls > 0).any()
    observed = set(roll.ids[:, roll.P:][(roll.attention_mask[:, roll.P:] == 1)
                                        & (roll.completion_mask == 0)].tolist())
    assert not observed & {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
    assert obs[0] != "<" or tok.unk_token_id not in observed  # (unk: a character not in vocab)
    assert max(tokenized) < 32 * 40 + 40  # never the whole megabyte
    if len(obs) > 40:
        assert roll.obs_truncated[roll.tool_calls > 0].all()


def test_calc_env_reads_calls_and_ends_on_an_answer():
    assert calc.calc({}, ["<calc>1234+5678</calc>"]) == " 6912 "
    assert calc.calc({}, ["a", "b<calc>12*3</calc>  "]) == " 36 "
    assert calc.calc({}, ["<calc>7-9</calc>"]) == " -2 "
    assert calc.calc({}, ["<calc>12+</calc>"]) == " error "
    assert calc.calc({}, ["<calc>12+34</calc>", "46"]) is None  # the answer: the episode ends
    assert calc.calc({}, ["<calc>12+34"]) is None  # no closing tag: not a call
    pairs = calc.calc_eval_pairs()
    assert len(pairs) == 500 and pairs == calc.calc_eval_pairs()
    assert all(100 <= a < 10000 and 100 <= b < 10000 for a, b in pairs)
    train = calc.calc_train_pairs(random.Random(0), 2000)
    assert not set(train) & set(pairs)
    demos = calc.calc_demo_pairs(random.Random(0), 2000)
    assert not set(demos) & (set(pairs) | set(tasks.task_eval_pairs()))


def write_env(tmp_path, body):
    path = tmp_path / "myenv.py"
    path.write_text(body)
    return f"{path}:env"


@pytest.mark.parametrize("body,message", [
    ("def env(row, turns):\n    raise ValueError('boom')\n",
     r"--env '.*myenv.py:env' raised ValueError: boom \(on the row with prompt '.*', turn 1\)"),
    ("def env(row, turns):\n    return 12\n",
     r"--env '.*myenv.py:env' returned int 12 \(on the row .*\): return the observation text"),
    ("def other(row, turns):\n    return None\n", r"has no function 'env'"),
    ("import nosuchmodule\n", r"importing .* failed: ModuleNotFoundError")])
def test_env_errors_are_one_line(body, message, tmp_path, monkeypatch, capsys):
    spec = write_env(tmp_path, body)  # the bundled model's turns end with an EOS: env called
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *FAST_GRPO, "--env", spec,
                 "--max_steps", "2", "--output_dir", str(tmp_path / "run"), guard=True)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "run").exists()  # failed before step 1: no folder left


def test_env_too_slow_or_failing_mid_run_loses_nothing(tmp_path, monkeypatch, capsys):
    """An env that fails at step 3 stops the run with one line; the steps before are logged and
    the checkpoint of step 2 is there."""
    spec = write_env(tmp_path, "N = [0]\ndef env(row, turns):\n    N[0] += 1\n"
                               "    if N[0] > 60:\n        raise KeyError('late')\n"
                               "    return ' 1 '\n")
    out = tmp_path / "run"
    with pytest.raises(SystemExit):
        run_main(monkeypatch, grpo, *FAST_GRPO, "--env", spec, "--max_new_tokens", "12",
                 "--max_steps", "50", "--save_every", "1",
                 "--output_dir", str(out), guard=True)
    assert "raised KeyError: 'late'" in capsys.readouterr().err
    steps = [m["step"] for m in read_metrics(out)]
    assert steps and (out / "checkpoint").is_dir()


@pytest.mark.parametrize("body,message", [
    ("while True:\n            pass", r"took more than 2 s on the row with prompt '.*', turn \d"),
    ("raise SystemExit(0)", r"raised SystemExit: 0 \(on the row with prompt '.*', turn \d\)"),
    ("raise KeyboardInterrupt", r"raised KeyboardInterrupt:")])
def test_a_spinning_env_or_one_that_exits_stops_the_run_in_one_line(body, message, tmp_path):
    """An env that spins for ever, or raises SystemExit(0) or KeyboardInterrupt, from its 40th
    call (mid-run): `python grpo.py` exits 2 with one line within about twice --env_timeout,
    and the steps logged and the last checkpoint stay."""
    spec = write_env(tmp_path, "N = [0]\ndef env(row, turns):\n    N[0] += 1\n"
                               f"    if N[0] > 40:\n        {body}\n    return ' 1 '\n")
    out = tmp_path / "run"
    t0 = time.time()
    r = run_script("grpo.py", *FAST_GRPO, "--env", spec, "--env_timeout", "2",
                   "--max_new_tokens", "12", "--max_steps", "50", "--save_every", "1",
                   "--output_dir", str(out), timeout=300)
    assert r.returncode == 2 and time.time() - t0 < 120, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: --env") and re.search(message, err), err
    assert read_metrics(out) and (out / "checkpoint").is_dir()


def test_an_observation_cut_by_the_budget_is_counted_and_said_once(tmp_path, monkeypatch,
                                                                    capsys):
    spec = write_env(tmp_path, "def env(row, turns):\n    return ' 1' * 40\n")
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--env", spec, "--max_new_tokens", "12",
             "--max_steps", "3", "--output_dir", out)
    assert capsys.readouterr().out.count("an observation was cut by --max_new_tokens") == 1
    assert all(m["obs_truncated"] > 0 for m in read_metrics(out))


def test_tool_use_flags_are_checked(monkeypatch, neox_dir, tmp_path):
    for flags, message in ((["--max_turns", "0"], "--max_turns must be >= 1"),
                           (["--eval_sampled"], "--eval_sampled scores mean@k"),
                           (["--env", "nocolon"], "write calc, path/to/file.py:function")):
        with pytest.raises(UserError, match=message):
            run_main(monkeypatch, grpo, *FAST_GRPO, "--model", neox_dir, *flags,
                     "--output_dir", str(tmp_path / "x"))


def test_env_calc_brings_its_defaults_and_given_flags_win(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--env", "calc", "--max_new_tokens", "40"])
    args = parse_args(grpo.Args, "grpo")
    assert args.model == calc.CALC_MODEL and args.stop == ["</calc>"] and args.eval_sampled
    assert args.max_new_tokens == 40 and args.eval_samples == 4
    monkeypatch.setattr(sys, "argv", ["ppo.py", "--env", "calc"])
    args = parse_args(ppo.Args, "ppo")
    assert args.rewards == "math" and args.critic_init == "policy"
    monkeypatch.setattr(sys, "argv", ["grpo.py"])
    assert parse_args(grpo.Args, "grpo") == grpo.Args()  # without --env: as it was


def test_micro_batching_does_not_change_the_gradient_with_observations(tok):
    model = tiny_model("llama", seed=3)
    model.generation_config.eos_token_id = [2, 43, 72]
    torch.manual_seed(1)
    prompts = C.encode_prompts(tok, PROMPTS + PROMPTS[:3])
    roll = rollout(model, tok, prompts, always_env(" 5 "), [{"prompt": p} for p in
                                                            PROMPTS + PROMPTS[:3]], 3, 20)
    mask, T = roll.completion_mask, roll.completion_mask.shape[1]
    assert (roll.tool_calls > 0).sum() >= 3 and len(set(mask.sum(-1).tolist())) > 1
    adv = torch.randn(len(mask))
    old = C.batched_logprobs(model, roll, 1.0, 8, OFF) + 0.05 * torch.randn(mask.shape)

    def grads(mb, mode):
        model.zero_grad()
        for s in C.micro_batches(mask, mb):
            lp, _ = C.token_logprobs(model, roll.ids[s], roll.attention_mask[s], T)
            loss = grpo.per_token_loss(lp, old[s], adv[s], None, grpo.Args())[0]
            grpo.aggregate(loss, mask[s], mode, mask.sum(), len(mask), 20).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    for mode in ("token-mean", "seq-mean-token-mean"):
        full = grads(8, mode)
        assert full.abs().max() > 0
        torch.testing.assert_close(grads(3, mode), full, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(grads(1, mode), full, atol=1e-6, rtol=1e-4)
    # an observation token's log-prob carries no gradient into the loss: changing its advantage
    # weight there changes nothing (the mask is 0)
    lp, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T)
    g = torch.autograd.grad((lp * mask).sum(), lp)[0]
    assert (g[mask == 0] == 0).all()


def slow_gae(rewards, values, mask, gamma, lam):
    """GAE over each row's model tokens only, written out: compact them, run the textbook
    recursion, put the results back."""
    adv = torch.zeros_like(rewards)
    for i in range(len(rewards)):
        idx = mask[i].nonzero().squeeze(-1).tolist()
        a_next, v_next = 0.0, 0.0
        for t in reversed(idx):
            delta = float(rewards[i, t]) + gamma * v_next - float(values[i, t])
            a_next = delta + gamma * lam * a_next
            adv[i, t], v_next = a_next, float(values[i, t])
    return adv, (adv + values) * mask


def test_ppo_score_and_gae_skip_observation_tokens():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1],
                         [0, 0, 0, 0, 0, 0, 0]]).float()
    lp, ref = torch.randn(4, 7), torch.randn(4, 7)
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    rewards, kl = ppo.shaped_rewards(scores, lp, ref, mask, 0.1)
    assert (rewards[mask == 0] == 0).all() and (kl[mask == 0] == 0).all()
    for i, last in enumerate([5, 3, 6]):  # the score lands on each row's last model token
        expect = -0.1 * kl[i] * mask[i]
        expect[last] += scores[i]
        torch.testing.assert_close(rewards[i], expect)
    values = torch.randn(4, 7)
    for gamma, lam in ((1.0, 0.95), (0.9, 0.7)):
        adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
        want_adv, want_ret = slow_gae(rewards, values * mask, mask, gamma, lam)
        torch.testing.assert_close(adv, want_adv)
        torch.testing.assert_close(ret * mask, want_ret)


def test_cat_rollouts_keeps_multi_turn_fields(tok):
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = [2, 43, 72]
    torch.manual_seed(0)
    rows = [{"prompt": p} for p in PROMPTS]
    a = rollout(model, tok, C.encode_prompts(tok, PROMPTS[:3]), always_env(), rows[:3], 3, 20)
    b = rollout(model, tok, C.encode_prompts(tok, PROMPTS[3:]), always_env(), rows[3:], 3, 12)
    a.parts = {"math": torch.tensor([1.0, 0, 1]), "format": torch.tensor([0.0, 1, 1])}
    b.parts = {"math": torch.tensor([0.0, 1, 0]), "format": torch.tensor([1.0, 1, 0])}
    both = grpo.cat_rollouts([(a, torch.tensor([0, 2])), (b, torch.tensor([1]))])
    assert both.final == [a.final[0], a.final[2], b.final[1]]
    assert {k: v.tolist() for k, v in both.parts.items()} == {"math": [1, 1, 1],
                                                              "format": [0, 1, 1]}  # GDPO's
    assert both.tool_calls.tolist() == [a.tool_calls[0], a.tool_calls[2], b.tool_calls[1]]
    for key in ("completion_mask", "sample_logprobs"):
        x = getattr(both, key)
        assert x[2, :getattr(b, key).shape[1]].tolist() == getattr(b, key)[1].tolist()
        assert x[2, getattr(b, key).shape[1]:].abs().sum() == 0
    lp = C.batched_logprobs(model, both, 1.0, 8, OFF)
    torch.testing.assert_close(lp, both.sample_logprobs, atol=2e-5, rtol=0)
    assert grpo.cat_rollouts([(a, torch.arange(3))]) is a  # one round, every row: as sampled
    with pytest.raises(AttributeError):  # C.Rollout lists every field: no other can be added
        a.note = "a field the class does not declare"
    a.final = "a field of no kind it splits by rows"
    with pytest.raises(TypeError, match="'final' is a str"):  # said, not dropped
        grpo.cat_rollouts([(a, torch.tensor([0])), (b, torch.tensor([1]))])


QWEN_STYLE_TEMPLATE = (  # Qwen2.5's tool-use layout, in short
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call><|im_end|>\n{%- endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user"
    "{% endif %}{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer():
    """The bundled tokenizer with a Qwen-style chat template (role tags, tools, tool messages)
    whose turns end on <|im_end|>, a special token and the EOS, as Qwen2.5-Instruct's do."""
    t = loading.load_tokenizer(loading.DEFAULT_POLICY)
    t.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    t.add_tokens(["\n"])  # (the bundled vocabulary has no newline)
    t.eos_token = "<|im_end|>"
    t.chat_template = QWEN_STYLE_TEMPLATE
    return t


@pytest.mark.parametrize("ends_on", ["eos", "stop"])
def test_chat_tool_observation_is_the_templates_difference(ends_on):
    """envs.chat_observation: the chat template rendered with and without the tool message, the
    difference, as token ids. Fed after the model's call turn, the transcript is the template's
    rendering of the whole conversation, token for token, the model's own ids untouched,
    whether the call turn ended on the model's own <|im_end|> (the EOS) or on a stop string; the
    tool's result is text, its '<|im_end|>' five-and-more characters, not the special token."""
    t = chat_tokenizer()
    messages = [{"role": "user", "content": "1234+5678="}]
    call = '<tool_call>{"a": 1234, "b": 5678}</tool_call>'
    result = "6912 <|im_end|>"
    obs = E.chat_observation(t, messages, result)
    im_end = t.convert_tokens_to_ids("<|im_end|>")
    assert obs[0] == im_end and obs.count(im_end) == 2  # the turn's end tag and the message's
    assert t.decode(obs) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n6912 <|im_end|>\n"
                             "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    enc = lambda s: t(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = C.encode_prompts(t, [messages])[0]
    turn1 = enc(call) + ([im_end] if ends_on == "eos" else [])
    obs_ids = obs[1:] if ends_on == "eos" else obs
    completion = turn1 + obs_ids + enc("6912") + [im_end]
    kinds = [1] * len(turn1) + [0] * len(obs_ids) + [1] * 5
    model = scripted_model(t, [prompt], [completion], [kinds])

    def env(row, turns):
        return E.chat_observation(t, row["prompt"], result) if len(turns) == 1 \
            else None
    stop = ["</tool_call>"] if ends_on == "stop" else []
    roll = rollout(model, t, [prompt], env, [{"prompt": messages}], 3, 200, greedy=True,
                   stop=stop)
    whole = messages + [{"role": "assistant", "content": call},
                        {"role": "tool", "content": result}]
    rendered = t.apply_chat_template(whole, tokenize=False, add_generation_prompt=True)
    head, tail = rendered.split(result)
    want = enc(head) + t(result, add_special_tokens=False, split_special_tokens=True)[
        "input_ids"] + enc(tail) + enc("6912") + [im_end]
    n = int(roll.attention_mask[0].sum())
    assert roll.ids[0, -n:].tolist() == want
    assert roll.final == ["6912"] and roll.completion_mask[0].sum() == len(turn1) + 5




def test_tools_are_shown_by_the_template_parsed_run_and_answered_as_tool_messages(tmp_path):
    """--tools: the functions' schemas (get_json_schema: type hints and docstring) are rendered
    into every prompt by the chat template; a model turn's calls are parsed in Qwen's
    <tool_call> JSON, several in one turn; a bad call, an unknown tool or a raising tool is an
    'error: ...' tool message, never a crash; the results go back as tool messages through the
    template, so the whole transcript is the template's rendering of the conversation; calls
    and errors are counted per tool."""
    (tmp_path / "tools.py").write_text(TOOLS_FILE)
    env = E.load_env("", f"{tmp_path / 'tools.py'}:add,shout")
    assert [s["function"]["name"] for s in env.tools] == ["add", "shout"]
    t = chat_tokenizer()
    messages = [{"role": "user", "content": "2+3="}]
    prompt = C.encode_prompts(t, [messages], tools=env.tools)[0]
    shown = t.decode(prompt)
    assert '"name": "add"' in shown and "Add two whole numbers." in shown and "the first" in shown
    call = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            '<tool_call>{"name": "shout", "arguments": {"text": "x"}}</tool_call>'
            '<tool_call>{"name": "mul", "arguments": {}}</tool_call><tool_call>{oops</tool_call>')
    enc = lambda s: t(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    im_end = t.eos_token_id
    functions, schemas = E.load_tools(f"{tmp_path}/tools.py:add,shout")
    episode = E.ToolEpisode({"prompt": messages}, t, functions, schemas)
    obs = episode.step([call])
    results = ["5", "error: ValueError: no x", "error: no tool 'mul'; the tools are add, shout",
               "error: the call is not JSON with a name and arguments: {oops"]
    assert [m["content"] for m in episode.messages[2:]] == results
    assert episode.calls == [("add", True), ("shout", False), ("mul", False), (None, False)]
    assert episode.step(["5"]) is None  # no call: that turn was the answer
    # the same turns through the sampler: a scripted model writes the call, then the answer
    completion = enc(call) + [im_end] + obs[1:] + enc("5") + [im_end]
    kinds = [1] * (len(enc(call)) + 1) + [0] * (len(obs) - 1) + [1, 1]
    model = scripted_model(t, [prompt], [completion], [kinds])
    args = SimpleNamespace(max_new_tokens=900, temperature=1.0, top_p=1.0, stop=[], max_turns=3,
                           chat_template="auto", system_prompt="")
    roll, texts = C.generate(model, t, [{"prompt": messages, "answer": "5"}], args, OFF, env,
                             greedy=True)
    whole = t.apply_chat_template(
        messages + [{"role": "assistant", "content": call}]
        + [{"role": "tool", "content": r} for r in results], tools=env.tools, tokenize=False,
        add_generation_prompt=True) + "5<|im_end|>"
    n = int(roll.attention_mask[0].sum())
    assert t.decode(roll.ids[0, -n:]) == whole and texts == ["5"]
    m = E.tool_metrics(roll, env)
    assert m["tool_calls/add"] == 1 and m["tool_errors/add"] == 0
    assert m["tool_calls/shout"] == 1 and m["tool_errors/shout"] == 1 and m["tool_calls"] == 1


def test_tools_need_a_template_that_renders_them_and_a_schema_per_function(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS_FILE + "\ndef bare(x):\n    return x\n")
    env = E.load_env("", f"{tmp_path / 'tools.py'}:add")
    plain = loading.load_tokenizer(loading.DEFAULT_POLICY)
    with pytest.raises(UserError, match="--tools needs a model whose chat template renders"):
        env.start([{"prompt": "1+2="}], plain, 3)
    with pytest.raises(UserError, match=r"--tools: 'bare' has no schema: .* type hint"):
        E.load_env("", f"{tmp_path / 'tools.py'}:add,bare")
    with pytest.raises(UserError, match="give --env or --tools, not both"):
        E.load_env("calc", f"{tmp_path / 'tools.py'}:add")
    t = chat_tokenizer()
    t.chat_template = t.chat_template.replace("<tool_call>", "[CALL]")
    with pytest.raises(UserError, match="--tools reads calls through the tokenizer's response"):
        env.start([{"prompt": "1+2="}], t, 3)


def test_grpo_with_tools_runs_and_samples_show_the_rendered_prompt(tmp_path, monkeypatch):
    """`grpo.py --tools FILE.py:add` on a chat model whose template renders tools: it runs, logs
    calls and errors per tool, and samples.jsonl shows each prompt as the model saw it, the tool's
    name and docstring included, beside the raw prompt."""
    (tmp_path / "tools.py").write_text(TOOLS_FILE)
    t = chat_tokenizer()
    cfg = tiny_config("qwen2", vocab=len(t))
    cfg.architectures = ["Qwen2ForCausalLM"]
    cfg.max_position_embeddings = 1024  # the prompts with the tools shown: 628 tokens
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "model")
    t.save_pretrained(tmp_path / "model")
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--model", tmp_path / "model", "--tools",
             f"{tmp_path / 'tools.py'}:add,shout", "--max_new_tokens", "8", "--max_steps", "2",
             "--rewards", "length", "--samples_every", "1", "--output_dir", out)
    m = read_metrics(out)
    assert {"tool_calls", "tool_calls/add", "tool_errors/add", "tool_calls/shout"} <= set(m[0])
    lines = (out / "samples.jsonl").read_text().splitlines()  # --samples_every 1: each step
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    sample = json.loads(lines[0])["samples"][0]
    shown = sample["rendered_prompt"].replace(" ", "")  # (this saved tokenizer drops spaces)
    assert sample["prompt"].endswith("=") and '"name":"add"' in shown
    assert "Addtwowholenumbers." in shown and shown.endswith("<|im_start|>assistant\n")


def test_env_calc_runs_every_script_with_its_metrics(tmp_path, monkeypatch):
    """grpo, reinforce and ppo with --env calc (the bundled model and task): tool metrics logged,
    samples show transcripts with observations marked, eval is mean@k with greedy beside it."""
    for script, flags in ((grpo, FAST_GRPO), (R, ["--prompts_per_step", "2",
                                                  "--samples_per_prompt", "4"]),
                          (ppo, ["--batch_size", "8", "--micro_batch_size", "8",
                                 "--num_minibatches", "1"])):
        out = tmp_path / script.__name__
        run_main(monkeypatch, script, "--env", "calc", *flags, "--max_steps", "2",
                 "--eval_size", "8", "--eval_every", "0", "--output_dir", str(out))
        m = read_metrics(out)
        assert {"tool_calls", "frac_tool", "turns", "tool_errors"} <= set(m[0])
        assert all(0 <= x["frac_tool"] <= x["tool_calls"] <= 2 for x in m)
        s = json.loads((out / "summary.json").read_text())
        assert s["args"]["model"] == calc.CALC_MODEL and {"eval_greedy", "eval_pass@4"} <= set(
            s["evals"]["before"])
        shown = [x["completion"] for line in (out / "samples.jsonl").read_text().splitlines()
                 for x in json.loads(line)["samples"]]
        assert shown and all(c.count("⟦") == c.count("</calc>⟦") for c in shown), shown
        assert any(x["frac_tool"] > 0 for x in m)


def test_torchrun_and_resume_with_env(tmp_path, monkeypatch):
    """--env calc under torchrun (2 gloo processes) makes the one-process update; --resume
    continues an --env run as a straight run goes."""
    flags = ["--env", "calc", "--prompts_per_step", "4", "--group_size", "4",
             "--micro_batch_size", "8", "--eval_size", "8", "--max_steps", "1"]
    out = {}
    for name, n in (("one", 1), ("two", 2)):
        out[name] = tmp_path / name
        r = run_processes(tmp_path, n, "grpo", *flags, "--output_dir", str(out[name]))
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = read_metrics(out["one"])[0], read_metrics(out["two"])[0]
    for key in ("reward", "tool_calls", "frac_tool", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-5), key
    common = ["--env", "calc", *FAST_GRPO, "--save_every", "2"]
    run_main(monkeypatch, grpo, *common, "--output_dir", str(tmp_path / "a"), "--max_steps", "4")
    run_main(monkeypatch, grpo, *common, "--output_dir", str(tmp_path / "b"), "--max_steps", "2",
             "--save_optimizer")
    run_main(monkeypatch, grpo, "--resume", str(tmp_path / "b"), "--max_steps", "4")
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    for key in ("reward", "loss", "grad_norm", "tool_calls"):
        assert [x[key] for x in a] == pytest.approx([x[key] for x in b], rel=1e-5), key


def test_compare_task_calc_runs_the_scripts_with_env_calc(tmp_path):
    out = tmp_path / "cmp"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "compare.py"), "--task", "calc",
           "--quick", "--samples", "64", "--eval_size", "8", "--eval_points", "1", "--algos",
           "rloo,ppo,ppo-math,grpo", "--kl_samples", "1", "--output_dir", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "held-out mean@4 sampled accuracy on 8 prompts" in r.stdout
    table = r.stdout[r.stdout.index("algorithm"):]
    assert not any(line.startswith("ppo-math") for line in table.splitlines())  # = ppo here
    for name, models in (("rloo", "1 (1)"), ("ppo", "3 (2)"), ("grpo", "2 (1)")):
        row = next(line for line in table.splitlines() if line.startswith(name + " "))
        assert models in row and "failed" not in row, row
        args = json.loads((out / f"{name}-s0" / "summary.json").read_text())["args"]
        assert args["env"] == "calc" and args["model"] == calc.CALC_MODEL


def test_calc_task_learns(tmp_path, monkeypatch):
    """grpo.py --env calc, short: the held-out score (mean@4 sampled) and the calling rate rise
    clearly (measured on 500 prompts, 3 seeds: 0.27-0.30 -> 0.89-0.91 by step 20)."""
    out = tmp_path / "out"
    run_main(monkeypatch, grpo, "--env", "calc", "--max_steps", "15", "--eval_every", "0",
             "--eval_size", "100", "--save_every", "0", "--output_dir", out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_after"] >= summary["eval_before"] + 0.3, summary
    metrics = read_metrics(out)
    first = sum(m["frac_tool"] for m in metrics[:5]) / 5
    last = sum(m["frac_tool"] for m in metrics[-5:]) / 5
    assert last >= first + 0.2, (first, last)


def python_tool():
    """examples/python_tool.py, imported; skipped in one line where bubblewrap cannot run (it
    refuses to load there: test_python_tool_refuses_without_bubblewrap_unless_told)."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    try:
        import python_tool as P
    except RuntimeError as e:
        pytest.skip(str(e))
    return P


def running(word):
    """Is a process with this word on its command line running (this one aside)?"""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(pid) != os.getpid() and word in open(f"/proc/{pid}/cmdline", "rb").read():
                return True
        except OSError:
            pass
    return False


def gone(word, seconds=5.0):
    """No process with this word on its command line, within seconds."""
    t0 = time.time()
    while running(word) and time.time() - t0 < seconds:
        time.sleep(0.05)
    return not running(word)


def test_python_tool_cannot_hang_fill_the_disk_reach_the_network_or_leave_anything(tmp_path,
                                                                                 monkeypatch):
    """examples/python_tool.py: a sleep or a spin stops at the wall-clock limit; a huge
    allocation is a MemoryError; a huge file or output is cut; a process it starts in a session
    of its own is gone after, and so is the temporary folder this call made (made in this test's
    own folder: another test's sandbox call in a parallel worker is not this one's)."""
    P = python_tool()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the calls' folders go here
    assert P.run_python("print(6 * 7)") == "42\n"
    assert P.python("print(sum(x * x for x in [3, 4]))") == "25\n"
    for code in ("import time\ntime.sleep(60)", "while True: pass"):
        t0 = time.time()
        assert P.run_python(code, timeout=1).endswith("(stopped: took more than 1 s)")
        assert time.time() - t0 < 5
    assert "MemoryError" in P.run_python("x = bytearray(4 << 30)")
    assert "File too large" in P.run_python("open('f', 'wb').write(b'x' * (100 << 20))")
    out = P.run_python("while True: print('y' * 1000)", timeout=1)
    assert len(out) < 2200 and "(output cut to 2000 characters)" in out
    P.run_python("import subprocess\nsubprocess.Popen(['sleep', '31.4159'], "
                 "start_new_session=True)", timeout=1)  # a process that leaves its group
    assert gone(b"31.4159")  # it died with its PID namespace
    assert not [f for f in os.listdir(tmp_path) if f.startswith("minrl-python-")]


# what the code inside tries -> what it must get; each a line of docs/tool_use.md's table
LIBC = "import ctypes\nc = ctypes.CDLL(None, use_errno=True)\n"  # the system calls themselves
ESCAPES = {
    "remount / read-write": (LIBC + "print(c.mount(None, b'/', None, 32 | 4096, None), "
                             "ctypes.get_errno())", "-1 1\n"),  # EPERM (MS_REMOUNT | MS_BIND)
    "unmount /tmp": (LIBC + "print(c.umount2(b'/tmp', 2), ctypes.get_errno())",  # MNT_DETACH
                     "-1 1\n"),
    "a new user namespace": ("import ctypes\nprint(ctypes.CDLL(None).unshare(0x10000000))",
                             "-1\n"),  # CLONE_NEWUSER: the filter (and bubblewrap 0.8+)
    "write /proc/sys": ("open('/proc/sys/kernel/core_pattern', 'w')", "Read-only file system"),
    "write /usr": ("open('/usr/x', 'w')", "Read-only file system"),
    "see the host's /tmp": ("import os\nprint(sorted(os.listdir('/tmp')))", "[]\n"),
    "see the checkout": (f"open({ROOT + '/README.md'!r})", "No such file or directory"),
    "kill the run": ("import os\nos.kill(os.getppid(), 9)\nprint(os.getppid())", "1\n"),
    "read the run's environment": ("import os\nprint('MINRL_TEST_SECRET' in os.environ, "
                                   "sorted(set(os.environ) - {'LC_CTYPE', 'PWD'}))",
                                   "False ['HOME', 'OMP_NUM_THREADS', 'PATH']\n"),
    "fork 300 processes": ("import os, time\nfor _ in range(300):\n    if os.fork() == 0:\n"
                           "        time.sleep(30)\n",
                           "(stopped: more than 16 processes or threads)"),
    "1.6 GB across processes": ("import os, time\nfor _ in range(4):\n    if os.fork() == 0:\n"
                                "        x = bytearray(400 << 20)\n        time.sleep(30)\n"
                                "time.sleep(30)", "(stopped: more than 512 MB of memory in all"),
    "fill /dev/shm": ("for k in range(8):\n    open(f'/dev/shm/{k}', 'wb').write(bytes(12 << 20))",
                      "No space left on device"),  # 64 MB, as /tmp
    "swap its output file for a FIFO": ("import os\np = os.readlink('/proc/self/fd/1')\n"
                                        "os.unlink(p.replace(' (deleted)', ''))\nos.mkfifo(p)",
                                        "FileNotFoundError"),  # it has no name
    "a NUL byte": ("print(1)\x00", "SyntaxError: source code cannot contain null bytes"),
    "128 KB of code": ("x = 1\n" * 22000 + "print('ran')", "ran\n"),
}
if os.uname().machine == "x86_64":  # a system call by its 32-bit number (int 0x80: getpid, 20)
    ESCAPES["a 32-bit system call"] = (
        "import ctypes, mmap\nm = mmap.mmap(-1, 4096, prot=7)  # read, write, execute\n"
        "m.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax, 20; int 0x80; ret\n"
        "print(ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)))())",
        "(exit code 159)")  # killed by the filter: SIGSYS (31), as bwrap reports it


@pytest.mark.parametrize("case", ESCAPES)
def test_python_tool_sandbox_holds_against_the_code_inside(case, monkeypatch):
    """The red team's cases: each line of docs/tool_use.md's sandbox table, tried from inside."""
    P = python_tool()
    code, want = ESCAPES[case]
    if case == "read the run's environment":
        monkeypatch.setenv("MINRL_TEST_SECRET", "hunter2")
    out = P.run_python(code, timeout=10)
    assert want in out, out
    assert P.run_python("print('still here')") == "still here\n"  # and the run goes on


def test_python_tool_reaches_no_network_and_no_socket_file(tmp_path):
    """A server on the host's 127.0.0.1 and a unix socket file in the host's /tmp: the code
    reaches neither (its 127.0.0.1 is its own; the socket file is out of sight)."""
    P = python_tool()
    server, unix = socket.socket(), socket.socket(socket.AF_UNIX)
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.setblocking(False)
    path = str(tmp_path / "s.sock")
    unix.bind(path)
    unix.listen()
    unix.setblocking(False)
    try:
        port = server.getsockname()[1]
        out = P.run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), 2)")
        assert "ConnectionRefusedError" in out or "Network is unreachable" in out, out
        out = P.run_python(f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({path!r})")
        assert "FileNotFoundError" in out, out
        for s in (server, unix):
            with pytest.raises(BlockingIOError):
                s.accept()  # nobody came
    finally:
        server.close()
        unix.close()


def test_python_tool_runs_with_a_venv_under_tmp_and_dies_with_the_run(tmp_path):
    """An interpreter in a venv under /tmp (a fresh clone's) runs the code (its folder is bound
    over the private /tmp); and a run killed mid-call (kill -9) leaves no sandboxed process."""
    python_tool()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(venv)], check=True)
    script = ("import sys, os, threading, time\nsys.path.insert(0, 'examples')\n"
              "import python_tool as P\nprint(P.run_python('import sys; print(sys.prefix)'), "
              "flush=True)\nthreading.Thread(target=P.run_python, args=('import time; "
              "time.sleep(27.1828)', 60)).start()\ntime.sleep(1)\nos.kill(os.getpid(), 9)\n")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", script], capture_output=True,
                       text=True, cwd=ROOT, timeout=60)
    assert r.returncode == -9 and r.stdout.startswith(str(venv)), r.stdout + r.stderr
    assert gone(b"27.1828")


def test_python_tool_refuses_without_bubblewrap_unless_told(tmp_path):
    """Without bwrap, loading the tool refuses in one line naming the fix; with
    MINRL_UNSAFE_TOOLS=1 it loads and says once, at load, what is not contained."""
    cmd = [sys.executable, "-c", "import sys; sys.path.insert(0, 'examples')\n"
           "import python_tool as P; print(P.run_python('print(1)'), end='')"]
    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}  # no bwrap on it
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert r.returncode == 1 and r.stderr.strip().splitlines()[-1] == (
        "RuntimeError: python_tool: bubblewrap (bwrap) is not installed: install it (apt-get "
        "install bubblewrap), or set MINRL_UNSAFE_TOOLS=1 to run the model's code without a "
        "sandbox")
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120,
                       env={**env, "MINRL_UNSAFE_TOOLS": "1"})
    assert r.returncode == 0 and r.stdout == "1\n", r.stderr
    assert len(r.stderr.splitlines()) == 1 and "CAN read and write your files" in r.stderr
    r = subprocess.run([sys.executable, "examples/python_tool.py", str(tmp_path / "no" / "x")],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == (
        f"python_tool: cannot write {str(tmp_path / 'no' / 'x')!r}: No such file or directory")


def as_uid_65534(script):
    """Run `script` (python -I -c, from a folder holding examples/python_tool.py) as uid 65534 with
    /usr/bin/python3 (this interpreter may sit under /root, which that user cannot read); skipped
    where this test is not root or has no setpriv."""
    system = "/usr/bin/python3"
    if os.getuid() != 0 or not shutil.which("setpriv") or not os.path.exists(system):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to run a call as uid 65534")
    folder = tempfile.mkdtemp(dir="/tmp")  # readable by uid 65534 (tmp_path is root's only)
    try:
        os.chmod(folder, 0o755)
        os.mkdir(os.path.join(folder, "examples"), 0o755)
        shutil.copy(os.path.join(ROOT, "examples", "python_tool.py"),
                    os.path.join(folder, "examples"))
        return subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534",
                               "--clear-groups", system, "-I", "-c", script],
                              capture_output=True, text=True, cwd=folder, timeout=120)
    finally:
        shutil.rmtree(folder)


def test_python_tool_binds_no_folder_where_a_secret_can_sit(tmp_path):
    """Round seven's red team: the sandbox bound the venv's root and every sys.path folder (one a
    .pth names: an editable install's checkout), so a .env or a pip.conf there was read from
    inside. Now only the interpreter's own files are bound: the secrets planted in the venv's
    root, beside its site-packages, in the checkout a .pth names and in that sys.path folder are
    all out of sight; the stdlib and site-packages still import, the editable package does not
    (docs/tool_use.md: install it without -e to use it inside)."""
    python_tool()
    venv, proj = tmp_path / "venv", tmp_path / "proj"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages",
                    str(venv)], check=True)
    site = next(venv.glob("lib/python3*/site-packages"))
    (proj / "src" / "mine").mkdir(parents=True)
    (proj / "src" / "mine" / "__init__.py").write_text("")
    (site / "mine.pth").write_text(f"{proj / 'src'}\n")  # what pip install -e writes
    secrets = [venv / ".env", venv / "pip.conf", site.parent / ".env", proj / ".env",
               proj / "src" / ".env"]
    for k, path in enumerate(secrets):
        path.write_text(f"HF_TOKEN=hf_secret{k}\nindex-url = https://me:hunter{k}@example.com\n")
    code = (f"for p in {list(map(str, secrets))!r}:\n    try:\n        print(open(p).read())\n"
            "    except OSError as e:\n        print(type(e).__name__)\n"
            "import json, site, numpy\ntry:\n    import mine\nexcept ImportError as e:\n"
            "    print(type(e).__name__)\n")
    script = ("import sys\nsys.path.insert(0, 'examples')\nimport mine, python_tool as P\n"
              f"print(P.run_python({code!r}), end='')")  # mine imports here, on the host
    r = subprocess.run([str(venv / "bin" / "python"), "-I", "-c", script], capture_output=True,
                       text=True, cwd=ROOT, timeout=120)  # -I: no torch (plumbing) to import
    assert r.returncode == 0 and "hf_secret" not in r.stdout, r.stdout + r.stderr
    assert r.stdout == "FileNotFoundError\n" * 5 + "ModuleNotFoundError\n", r.stdout


# the key system calls' numbers (add_key, keyctl) where the tests know them
KEY_CALLS = {"x86_64": (248, 250), "aarch64": (217, 219)}


def test_python_tool_cannot_read_the_runs_session_keyring(tmp_path):
    """The kernel keyring is not namespaced: a key in the trainer's session keyring (`keyctl add
    user NAME DATA @s`) was read from inside by its number. The sandbox's system-call filter
    refuses keyctl, add_key and request_key (EPERM); the trainer keeps its key. As root and as
    uid 65534."""
    python_tool()
    if os.uname().machine not in KEY_CALLS:
        pytest.skip("the key system calls' numbers are known here for x86_64 and aarch64")
    add_key, keyctl = KEY_CALLS[os.uname().machine]
    inside = ("import ctypes\nc = ctypes.CDLL(None, use_errno=True)\n"
              "b = ctypes.create_string_buffer(64)\n"
              f"print(c.syscall({keyctl}, 11, int(open('/code.py').read().split('#')[-1]), b, "
              "64), ctypes.get_errno(), b.value)\n")  # KEYCTL_READ of the key's number
    script = (
        "import ctypes, sys\nsys.path.insert(0, 'examples')\nimport python_tool as P\n"
        "c = ctypes.CDLL(None, use_errno=True)\n"
        f"assert c.syscall({keyctl}, 1, None) > 0  # a session keyring of this process's own\n"
        f"key = c.syscall({add_key}, b'user', b'minrl-test', b'hunter2', 7, -3)  # into it (@s)\n"
        f"b = ctypes.create_string_buffer(64)\nc.syscall({keyctl}, 11, key, b, 64)\n"
        f"print(b.value, P.run_python({inside!r} + '#' + str(key)), end='')\n")
    r = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.stdout == "b'hunter2' -1 1 b''\n", r.stdout + r.stderr  # EPERM inside
    r = as_uid_65534(script)
    assert r.stdout == "b'hunter2' -1 1 b''\n", r.stdout + r.stderr


PIN = {  # memory that no process holds as resident: 600 MB, each piece left in the kernel
    "SysV shared memory": (
        "import ctypes\nc = ctypes.CDLL(None, use_errno=True)\nc.shmat.restype = ctypes.c_void_p\n"
        "for _ in range(12):  # 12 segments of 50 MB, each written then detached\n"
        "    i = c.shmget(0, 50 << 20, 0o1600)\n    if i < 0:\n"
        "        raise OSError(ctypes.get_errno(), 'shmget')\n    a = c.shmat(i, None, 0)\n"
        "    ctypes.memset(a, 1, 50 << 20)\n    c.shmdt(ctypes.c_void_p(a))\nprint('pinned')\n"),
    "memfds": ("import os\nfds = [os.memfd_create(str(k)) for k in range(40)]\n"
               "for fd in fds:  # 40 of 15 MB (16 MB is a file's limit)\n"
               "    os.write(fd, bytes(15 << 20))\nprint('pinned')\n"),
}


@pytest.mark.parametrize("kind", PIN)
def test_python_tool_cannot_pin_memory_its_processes_do_not_hold(kind):
    """600 MB of SysV shared memory or memfds under a 256 MB limit: the resident memory the 10 ms
    check sums never holds them (the red team pinned 2 GB and 640 MB under 512 MB). The system
    call filter refuses shmget and memfd_create (EPERM), as root and as uid 65534; plain memory
    is still stopped."""
    P = python_tool()
    out = P.run_python(PIN[kind], timeout=10, memory_mb=256)
    assert "pinned" not in out and "PermissionError: [Errno 1]" in out, out
    out = P.run_python("x = bytearray(400 << 20)", timeout=10, memory_mb=256)
    assert "MemoryError" in out, out
    r = as_uid_65534("import sys\nsys.path.insert(0, 'examples')\nimport python_tool as P\n"
                     f"print(P.run_python({PIN[kind]!r}, timeout=10, memory_mb=256))")
    assert "pinned" not in r.stdout and "PermissionError: [Errno 1]" in r.stdout, r


THREADS = ("import threading, time\nthreading.stack_size(1 << 16)  # small: not held by RLIMIT_AS\n"
           "n = 0\ntry:\n    for _ in range(200):\n"
           "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n"
           "        n += 1\nexcept RuntimeError as e:\n    print(e)\nprint('threads', n)\n"
           "time.sleep(1)\n")


def test_python_tool_counts_threads_as_root_and_as_an_unprivileged_user(tmp_path):
    """Threads are tasks: 200 threads in one process passed the 16-process limit (8,000 in the
    red team's run). As root (RLIMIT_NPROC does not bind root) the 10 ms check counts every
    process's threads and stops the call; as uid 65534 the kernel refuses the 14th thread
    (RLIMIT_NPROC, set inside the sandbox where only its own tasks count: bwrap's process there,
    python and 13 threads make 15, bwrap's outer one the 16th)."""
    P = python_tool()
    if os.getuid() == 0:
        out = P.run_python(THREADS)
        assert out.endswith("(stopped: more than 16 processes or threads)"), out
    r = as_uid_65534("import sys\nsys.path.insert(0, 'examples')\nimport python_tool as P\n"
                     f"print(P.run_python('print(6 * 7)'), P.run_python({THREADS!r}), end='')")
    assert r.stdout == "42\n can't start new thread\nthreads 13\n", r.stdout + r.stderr


def test_a_sandbox_that_fails_after_load_is_a_failed_call_and_stops_the_run(tok, tmp_path,
                                                                            monkeypatch, capsys):
    """A bubblewrap that fails once the tool has loaded (out of namespaces: "Creating new
    namespace failed: No space left on device") was a plain tool result, its error text the
    model's observation. Now the call fails: an error result of --tools and an observation
    starting 'error' of --env (both counted in tool_errors), a line on stderr; and 8 calls in a
    row that fail stop the run in one line. The same calls with a bubblewrap that starts work."""
    P = python_tool()
    fake = tmp_path / "bwrap"
    fake.write_text("#!/bin/sh\necho 'bwrap: Creating new namespace failed: No space left on "
                    "device' >&2\nexit 1\n")
    fake.chmod(0o755)
    real = P.SANDBOX
    monkeypatch.setattr(P, "SANDBOX", [str(fake)] + real[1:])
    monkeypatch.setattr(P, "FAILED", {"in_a_row": 0}, raising=False)  # none before this test
    why = "bwrap: Creating new namespace failed: No space left on device"
    assert E.run_tool({"python": P.python}, "python", {"code": "print(1)"}) == (
        f"error: SandboxError: the sandbox failed to start, the code did not run: {why}", True)
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = list(range(len(tok)))  # every turn is one token
    prompts, rows = C.encode_prompts(tok, ["1+2="] * 4), [{"prompt": "1+2="}] * 4

    def env(row, turns):  # each turn as if the model wrote code
        return P.env(row, [f"<python>print({len(turns)})</python>"])
    roll = rollout(model, tok, prompts, env, rows, 2, 10)  # a call a row, 4 at once
    assert E.tool_metrics(roll, SimpleNamespace(tools=None))["tool_errors"] == 1.0
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"python_tool: a call failed, its sandbox did not start (5 in a row): {why}"
    assert len([line for line in err if line.startswith("python_tool: a call failed")]) == 5
    stop = (r"^python_tool: the sandbox \(bubblewrap\) failed to start on 8 calls in a row: "
            r"bwrap: Creating new namespace failed: No space left on device; the run stops")
    for _ in range(2):  # --tools: calls 6 and 7 are error results, the 8th stops the run
        assert E.run_tool({"python": P.python}, "python", {"code": "print(1)"})[1]
    with pytest.raises(UserError, match=stop):
        E.run_tool({"python": P.python}, "python", {"code": "print(1)"})
    P.FAILED["in_a_row"] = 7
    with pytest.raises(UserError, match=stop):  # --env: the 8th call
        rollout(model, tok, prompts[:1], env, rows[:1], 2, 10)
    monkeypatch.setattr(P, "SANDBOX", real)
    assert P.run_python("print(1)") == "1\n" and P.FAILED["in_a_row"] == 0


def test_an_old_bubblewrap_without_disable_userns_still_refuses_a_new_user_namespace(tmp_path):
    """bubblewrap before 0.8 (Ubuntu 22.04 has 0.6) lacks --disable-userns: the code inside could
    make a user namespace of its own and mount there. The system-call filter refuses unshare and
    clone with CLONE_NEWUSER on any bubblewrap, so the tool loads with an old one (no refusal,
    nothing said) and holds: a fake bwrap whose --help lacks the flag, then the real one."""
    P = python_tool()
    fake = tmp_path / "bwrap"
    fake.write_text(f"#!/bin/sh\nif [ \"$1\" = --help ]; then\n  {P.SANDBOX[0]} --help | grep -v "
                    f"disable-userns\n  exit\nfi\nexec {P.SANDBOX[0]} \"$@\"\n")
    fake.chmod(0o755)
    assert "disable-userns" not in subprocess.run([str(fake), "--help"], capture_output=True,
                                                  text=True).stdout
    code = ("import ctypes\nc = ctypes.CDLL(None, use_errno=True)\n"
            "print(c.unshare(0x10000000), ctypes.get_errno())\n")  # CLONE_NEWUSER
    cmd = [sys.executable, "-I", "-c", "import sys; sys.path.insert(0, 'examples')\n"
           f"import python_tool as P; print(P.run_python({code!r}), end='')"]
    for path in (f"{tmp_path}:{os.environ['PATH']}", os.environ["PATH"]):  # old, then real
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120,
                           env={**os.environ, "PATH": path})
        assert (r.returncode, r.stdout, r.stderr) == (0, "-1 1\n", ""), r


def test_python_tool_on_a_machine_without_its_filter_says_so_once_and_runs(tmp_path):
    """The filter's system-call numbers are written for x86_64 and aarch64: on another machine
    (os.uname() says riscv64 here) the tool loads, says once what is open, and runs the code."""
    python_tool()
    script = ("import os, sys\nu = os.uname()\n"
              "os.uname = lambda: os.uname_result((*u[:4], 'riscv64'))\n"
              "sys.path.insert(0, 'examples')\nimport python_tool as P\n"
              "print(P.FILTER, P.run_python('print(1)'), P.run_python('print(2)'), end='')")
    r = subprocess.run([sys.executable, "-I", "-c", script], capture_output=True, text=True,
                       cwd=ROOT, timeout=120)
    assert r.stdout == "None 1\n 2\n" and r.stderr == (
        "python_tool: no system-call filter for riscv64 (x86_64 and aarch64 have one): the "
        "kernel keyring, SysV shared memory and memfds are open inside\n"), r


def test_tool_calls_restart_the_deadline_and_a_paused_wait_does_not_count(tok):
    """--env_timeout is per tool call (run_tool restarts it): three calls of 0.6 s in one turn
    pass a 1.5 s limit; time inside envs.paused() (python_tool waiting for a sandbox) does not
    count; a plain 3 s call still stops the run."""
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = list(range(len(tok)))  # every turn is one token
    prompts = C.encode_prompts(tok, ["1+2="] * 2)
    rows = [{"prompt": "1+2="}] * 2

    def three_calls(row, turns):
        for _ in range(3):
            E.run_tool({"slow": lambda: time.sleep(0.6)}, "slow", {})
        return None

    def waits(row, turns):
        with E.paused():
            time.sleep(2)
        return None
    for env in (three_calls, waits):
        roll = rollout(model, tok, prompts, env, rows, 2, 10, timeout=1.5)
        assert roll.turns.tolist() == [1, 1]
    with pytest.raises(UserError, match="took more than 1.5 s"):
        rollout(model, tok, prompts, lambda row, turns: time.sleep(3), rows, 2, 10, timeout=1.5)


def test_three_looping_snippets_in_one_turn_do_not_stop_the_run(tok):
    """S7 through the sandbox: a turn whose three python calls each loop until their 1 s limit
    takes over 3 s, yet passes a 3 s --env_timeout (per call, and the wait for a sandbox slot
    is paused); 12 rows at once share the 8 slots."""
    P = python_tool()
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = list(range(len(tok)))  # every turn is one token
    tools = {"python": lambda code: P.run_python(code, timeout=1)}

    def env(row, turns):
        results = [E.run_tool(tools, "python", {"code": "while True: pass"}) for _ in range(3)]
        assert all(r.endswith("(stopped: took more than 1 s)") for r, _ in results), results
        return None
    prompts = C.encode_prompts(tok, ["1+2="] * 12)
    roll = rollout(model, tok, prompts, env, [{"prompt": "1+2="}] * 12, 2, 10, timeout=3)
    assert roll.turns.tolist() == [1] * 12


def test_a_tool_that_exits_is_an_error_result_and_eleven_results_keep_their_order():
    """A tool raising SystemExit (argparse on the model's arguments) is an 'error:' result, not
    the end of the run; a turn with 12 calls gets its 12 results in order (marker 1 is no
    prefix of marker 10)."""
    def exits(text: str) -> str:
        raise SystemExit(2)
    assert E.run_tool({"exits": exits}, "exits", {"text": "x"}) == ("error: SystemExit: 2", True)
    t = chat_tokenizer()
    shown = t.decode(E.chat_observation(t, [{"role": "user", "content": "hi"}],
                                        [f"r{k}" for k in range(12)]))
    assert re.findall(r"r\d+", shown) == [f"r{k}" for k in range(12)]


def test_glm_calls_are_read_and_muse_glimmer_is_refused():
    """GLM-4.5's <arg_key>/<arg_value> calls are read (typed by the schema); Muse Glimmer's
    ATEM channels are refused in one line at the start (TRL's own templates)."""
    trl = pytest.importorskip("trl")
    folder = os.path.join(os.path.dirname(trl.__file__), "chat_templates")
    schemas = [{"type": "function", "function": {"name": "f", "description": "d", "parameters": {
        "type": "object", "properties": {"code": {"type": "string"}, "n": {"type": "integer"}}}}}]
    t = chat_tokenizer()
    t.chat_template = open(os.path.join(folder, "glm4moe.jinja")).read()
    E.check_tool_format(t, schemas)
    turn = ("<tool_call>f\n<arg_key>code</arg_key>\n<arg_value>print(1)</arg_value>\n"
            "<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n</tool_call><tool_call>f</tool_call>")
    assert E.parse_calls(t, turn, schemas) == [("f", {"code": "print(1)", "n": 3}), ("f", {})]
    t.chat_template = open(os.path.join(folder, "muse_glimmer.jinja")).read()
    with pytest.raises(UserError, match="this chat template uses none of them"):
        E.check_tool_format(t, schemas)


def test_an_env_that_draws_from_the_global_random_is_said_once(tok, capsys):
    """Its calls run at once in threads, so the order of global draws is not reproducible: said
    once on stderr (docs/reliability.md's rule); an env with its own generator is not."""
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = list(range(len(tok)))
    prompts = C.encode_prompts(tok, ["1+2="] * 4)
    rows = [{"prompt": "1+2="}] * 4
    E._SAID.clear()
    rollout(model, tok, prompts, lambda row, turns: random.Random(1).random() and None, rows, 2, 10)
    assert "warning" not in capsys.readouterr().err
    for _ in range(2):
        rollout(model, tok, prompts, lambda row, turns: random.random() and None, rows, 2, 10)
    err = capsys.readouterr().err
    assert err.count("drew from Python's or numpy's global random generator") == 1, err


def test_python_env_runs_a_turns_code_and_the_example_task_is_written(tmp_path):
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import python_tool as P
    assert P.env({}, ["<python>print(2 ** 10)</python>"]) == " <output>1024\n</output> "
    assert P.env({}, ["<python>print(1)</python>", "\\boxed{1}"]) is None
    P.write_task(tmp_path / "task.jsonl", n=30)
    rows = [json.loads(line) for line in (tmp_path / "task.jsonl").read_text().splitlines()]
    assert len(rows) == 30 and all(r["answer"].isdigit() for r in rows)
    lists = re.findall(r"\[[\d, ]+\]", rows[0]["prompt"])
    assert lists and "<python>" in rows[0]["prompt"]
