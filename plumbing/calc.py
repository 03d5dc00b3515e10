"""calc.py: the bundled calculator task for --env calc (plumbing: a reader may skip it).

The calculator task (--env calc): sums of 3- and 4-digit numbers, which the bundled 1 M-parameter
model cannot do in its head. A turn that ends in <calc>1234+5678</calc> gets the observation
" 6912 "; the model's next turn is its answer, and the reward reads only that final turn (text
after the last observation), so copying the observation is the skill, not a free reward.
The policy, models/tiny-calc, is tiny-adder warm-started by sft.py on demonstrations of which 30%
call the tool (tools/build_models.py), so RL has a habit to strengthen.
The report of how a model uses the tool is tools/calc_report.py.
"""
import functools
import os
import random
import re

import common as C
from plumbing import loading
from plumbing import tasks

CALC_MODEL = os.path.join(loading.ROOT, "models", "tiny-calc")  # built by tools/build_models.py
CALC_SHAPES = ((3, 3), (3, 4), (4, 3), (4, 4))  # (digits of a, digits of b) of the task's sums
CALC_EVAL_SEED = 2828
CALC_EVAL_SIZE = 500
# --env calc changes these defaults (explicit flags still win): the model, a budget that fits one
# call (a 4-digit call, its observation and the answer are 35 tokens), the call's closing tag ends
# a turn, the held-out score is sampled (docs/tool_use.md), and a short run (GRPO's held-out
# score is flat after about 40 steps)
CALC_DEFAULTS = {"model": CALC_MODEL, "max_new_tokens": 48, "stop": ["</calc>"],
                 "eval_samples": 4, "eval_sampled": True, "max_steps": 60, "eval_every": 20}
CALC_PPO = {"rewards": "math", "critic_init": "policy"}  # ppo.py's default score is an RM's


def preset(env, algo):
    """The flags' defaults for --env (only calc has its own) in algo's script."""
    if env != "calc":
        return {}
    return {**CALC_DEFAULTS, **(CALC_PPO if algo == "ppo" else {})}


def calc_pair(rng, shape):
    da, db = shape
    return rng.randrange(10**(da - 1), 10**da), rng.randrange(10**(db - 1), 10**db)


def calc_eval_pairs():
    """The fixed held-out sums (shapes in turn): no warm start and no RL run trains on them."""
    rng = random.Random(CALC_EVAL_SEED)
    return [calc_pair(rng, CALC_SHAPES[i % len(CALC_SHAPES)]) for i in range(CALC_EVAL_SIZE)]


@functools.lru_cache(maxsize=1)
def calc_held():
    return frozenset(calc_eval_pairs())


def calc_train_pairs(rng, k, shapes=CALC_SHAPES):
    """k fresh sums of random shapes, none of them held out."""
    held = calc_held()
    out = []
    while len(out) < k:
        pair = calc_pair(rng, rng.choice(shapes))
        if pair not in held:
            out.append(pair)
    return out


def calc_demo(a, b, rng, column_sum, tool=0.3, drop=0.8):
    """A warm-start demonstration for a + b: with probability `tool` the tool transcript
    '<calc>a+b</calc> S S' (the observation ' S ' then the answer; sft.py adds the EOS), else a
    direct answer: right for 2-digit sums, column addition forgetting each carry with
    probability `drop` for longer ones (column_sum: tools/build_models.py)."""
    if rng.random() < tool:
        return f"<calc>{a}+{b}</calc> {a + b} {a + b}"
    return str(column_sum(a, b, rng, 0.0 if max(a, b) < 100 else drop))


def calc_demo_pairs(rng, k):
    """The warm start's prompts: 25% 2-digit (the bundled task's), 25% 3+3, 35% 4+4, 15% 3+4 or
    4+3 digits, none of them held out."""
    out = []
    for _ in range(k):
        u = rng.random()
        if u < 0.25:
            out += tasks.task_train_pairs(rng, 1)
        else:
            shape = (3, 3) if u < 0.5 else (4, 4) if u < 0.85 else rng.choice([(3, 4), (4, 3)])
            out += calc_train_pairs(rng, 1, [shape])
    return out


CALL = re.compile(r"<calc>(.*)</calc>\s*$", re.S)  # a turn that ends with a call
EXPR = re.compile(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*")


def calc(row, turns):
    """The calculator: when the model's last turn ends with <calc>a+b</calc> (or a-b, a*b), the
    observation is the result with a space on each side, the layout of the warm-start
    demonstrations; a call it cannot read gets ' error '. A turn without a call ends the
    episode (it was the answer)."""
    call = CALL.search(turns[-1])
    if call is None:
        return None
    m = EXPR.fullmatch(call.group(1).split("<calc>")[-1])
    if m is None or max(len(m.group(1)), len(m.group(3))) > 12:
        return " error "
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return f" {a + b if op == '+' else a - b if op == '-' else a * b} "


def calc_data(eval_size=CALC_EVAL_SIZE, skip=(0, 0.0)):
    """The calculator task's rows, as tasks.load_data returns them: next_batch(rng, k) gives k
    fresh training sums, eval_rows the held-out ones (skip: tasks.scheduled's)."""
    eval_rows = [tasks.addition_row(a, b) for a, b in calc_eval_pairs()][:eval_size]

    def next_batch(rng, k):
        return [tasks.addition_row(a, b) for a, b in calc_train_pairs(rng, k)]
    return tasks.scheduled(C.SimpleNamespace(next_batch=next_batch, eval_rows=eval_rows,
                                             rows=eval_rows), skip=skip)
