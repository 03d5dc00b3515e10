"""plumbing/chat_sums.py, the real-model task (--data chat-sums): its split, reward, defaults."""
import random
import sys

import pytest

import grpo
from plumbing import chat_sums, loading, tasks
from plumbing.flags import parse_args
import ppo
import reinforce


def test_held_out_by_problem_in_every_phrasing():
    train, test = chat_sums.split()
    problem = {(min(a, b), max(a, b)) for a, b, _, _ in test}
    assert len(problem) == chat_sums.HELD_OUT
    assert not any((min(a, b), max(a, b)) in problem for a, b, _, _ in train)  # 3+5 nor 5+3
    assert {(p, shown) for _, _, p, shown in test} == {
        (p, shown) for p in range(len(chat_sums.PHRASINGS)) for shown in (0, 1)}
    assert len(train) + len(test) == 99 * len(chat_sums.PHRASINGS) * 2  # not the example 2+2
    data = tasks.load_data(chat_sums.NAME, 50)
    seen = {r["prompt"][-1]["content"] for r in data.next_batch(random.Random(0), 2000)}
    assert len(data.eval_rows) == 50 and not seen & {r["prompt"][-1]["content"]
                                                     for r in data.eval_rows}
    shapes = {tuple(m["role"] for m in r["prompt"]) for r in data.eval_rows}
    assert shapes == {("user", "assistant", "user"), ("user",)}  # the example shown, or not
    assert all(r["prompt"][-1]["content"].endswith("Answer with just the equation.")
               for r in data.eval_rows)


@pytest.mark.parametrize("completion,reward", [
    ("3 + 5 = 8", 1.0), (" 3+5=8.\n", 1.0), ("5 + 3 = 8", 1.0), ("3 + 5 = 9", 0.0), ("8", 0.0),
    ("The answer is 3 + 5 = 8", 0.0), ("3 + 5 = 8 apples", 0.0), ("", 0.0), ("3 + 5 = 88", 0.0)])
def test_the_reward_checks_what_the_prompt_asks(completion, reward):
    assert chat_sums.asked_answer([completion], [chat_sums.row(3, 5, 0)]) == [reward]


def test_data_chat_sums_brings_its_defaults_and_given_flags_win(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--data", "chat-sums", "--lr", "1e-5"])
    args = parse_args(grpo.Args, "grpo")
    assert args.lr == 1e-5 and args.temperature == 0.7 and args.max_new_tokens == 10
    assert args.beta == 0 and args.group_size == 8
    assert args.reward_fn == chat_sums.PRESET["reward_fn"]
    grpo.check_args(args)  # micro-batch divides the step
    fns = loading.load_reward_fns(args.reward_fn)  # importable by that name
    rows = [chat_sums.row(1, 7, 0)] * 2
    assert fns["asked_answer"](["1 + 7 = 8", "8"], rows).tolist() == [1.0, 0.0]
    for script in (reinforce, ppo):
        monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", "--data=chat-sums"])
        args = parse_args(script.Args, script.__name__)
        assert args.lr == 2e-5 and args.reward_fn == chat_sums.PRESET["reward_fn"]
        if script is ppo:  # one epoch of 2 minibatches: the toy's 4 x 2 is slow on a real model
            assert (args.ppo_epochs, args.num_minibatches, args.max_steps) == (1, 2, 10)
        script.check_args(args) if hasattr(script, "check_args") else None
    monkeypatch.setattr(sys, "argv", ["grpo.py"])
    assert parse_args(grpo.Args, "grpo") == grpo.Args()  # without it: as it was
