"""envs.py: environments for multi-turn (tool-use) rollouts, and the bundled calculator task.

An environment is a plain function env(row, turns) -> str | None. common.rollout() calls it after
each model turn with the data row and the list of the model's turns so far (decoded texts); it
returns the observation to append to the transcript (a tool's output, as text: it is tokenized
without special tokens), or None to end the episode. Pick one with --env FILE.py:FUNCTION (or
package.module:function), or --env calc for the calculator below. docs/tool_use.md has the
details, and a recipe for chat models.

The calculator task (--env calc): sums of 3- and 4-digit numbers, which the bundled 1 M-parameter
model cannot do in its head. A turn that ends in <calc>1234+5678</calc> gets the observation
" 6912 "; the model's next turn is its answer, and the reward reads only that final turn (text
after the last observation), so copying the observation is the skill, not a free reward.
The policy, models/tiny-calc, is tiny-adder warm-started by sft.py on demonstrations of which 30%
call the tool (tools/build_models.py), so RL has a habit to strengthen.
"""
import functools
import os
import random
import re
import time

import torch

import common as C
import loading
import tasks

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


# --------------------------------------------------------------------------- the calculator
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


def calc_data(eval_size=CALC_EVAL_SIZE):
    """The calculator task's rows, as tasks.load_data returns them: next_batch(rng, k) gives k
    fresh training sums, eval_rows the held-out ones."""
    eval_rows = [tasks.addition_row(a, b) for a, b in calc_eval_pairs()][:eval_size]

    def next_batch(rng, k):
        return [tasks.addition_row(a, b) for a, b in calc_train_pairs(rng, k)]
    return C.SimpleNamespace(next_batch=next_batch, eval_rows=eval_rows, rows=eval_rows)


# ------------------------------------------------------------------ --env: loading, checking
ENV_TIMEOUT_S = 10.0  # one call slower than this stops the run: an environment must be quick


def load_env(spec):
    """--env calc or FILE.py:FUNCTION (or package.module:function) -> a checked env function, or
    None for ''. The checked function turns a raise, a result that is not a string or None, or a
    call slower than ENV_TIMEOUT_S into one line naming the env and the row."""
    if not spec:
        return None
    if spec == "calc":
        fn = calc
    else:
        fn = loading.load_function("--env", spec, "write calc, path/to/file.py:function or "
                                   "package.module:function")

    def checked(row, turns):
        t0 = time.time()
        where = f"on the row with prompt {str(row['prompt'])[:60]!r}, turn {len(turns)}"
        try:
            out = fn(row, list(turns))
        except Exception as e:
            raise C.UserError(f"--env {spec!r} raised {type(e).__name__}: {C._first_line(e)} "
                              f"({where})") from None
        if out is not None and not isinstance(out, str):
            raise C.UserError(f"--env {spec!r} returned {type(out).__name__} {out!r:.40} "
                              f"({where}): return the observation text, or None to end")
        if time.time() - t0 > ENV_TIMEOUT_S:
            raise C.UserError(f"--env {spec!r} took {time.time() - t0:.0f} s ({where}); the "
                              f"limit is {ENV_TIMEOUT_S:.0f} s a call")
        return out
    return checked


def task_data(args, data):
    """--env calc without --data: the calculator's sums, else the data as loaded."""
    return calc_data(args.eval_size) if args.env == "calc" and not args.data else data


def tool_metrics(roll):
    """Per-step tool use: tool_calls and turns per completion, frac_tool (completions with a call),
    tool_errors (the fraction of observations that start with 'error', as calc's do)."""
    n = sum(len(o) for o in roll.observations)
    errors = sum(x.strip().startswith("error") for o in roll.observations for x in o)
    return {"tool_calls": float(roll.tool_calls.float().mean()),
            "frac_tool": float((roll.tool_calls > 0).float().mean()),
            "turns": float(roll.turns.float().mean()), "tool_errors": errors / max(n, 1)}


def from_args(args):
    """The run's checked environment (None without --env), after checking the tool-use flags
    (--max_turns has its range beside its Args field, checked with the others)."""
    if args.eval_sampled and args.eval_samples < 1:
        raise C.UserError("--eval_sampled scores mean@k of --eval_samples k samples: give "
                          "--eval_samples k (k >= 1)")
    return load_env(args.env)


# ------------------------------------------------------------------------ chat models' format
def chat_observation(tok, messages, turn, result, role="tool"):
    """A tool result in a chat model's own format: the chat template rendered for the
    conversation with the model's turn and the tool message, minus its rendering up to the end
    of the turn; that difference (the turn's end tag, the tool message, the next assistant
    header) is the observation. messages: the conversation before this turn (the prompt, and
    any earlier turns and tool messages). End the call turn on a stop string (e.g.
    --stop '</tool_call>'), so the turn's end tag comes from the template, not the model."""
    head = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) + turn
    whole = tok.apply_chat_template(
        messages + [{"role": "assistant", "content": turn}, {"role": role, "content": result}],
        tokenize=False, add_generation_prompt=True)
    if not whole.startswith(head):
        raise C.UserError("the chat template does not render the conversation as a prefix of "
                          "itself plus a tool message: build the observation by hand")
    return whole[len(head):]


# -------------------------------------------------------------- the calculator's tool-use report
CALC_REPORT_SHAPES = ((2, 2), (3, 3), (4, 4))


def calc_report(model, tok, n=200, k=1, seed=0, max_new_tokens=48, max_turns=3):
    """Per sum shape (2+2, 3+3, 4+4 digits), sampled at T = 1 (k per prompt) and greedy: how often
    the model calls the tool, how often it is right when it calls and when it does not, overall,
    and how often a call's observation is the last thing in the transcript (nothing after it).
    Held-out pairs for 3-4 digits; 2-digit ones from the bundled task's held-out split."""
    out, rng = {}, random.Random(seed)
    for shape in CALC_REPORT_SHAPES:
        pairs = tasks.task_eval_pairs()[:n] if shape == (2, 2) else [
            p for p in calc_eval_pairs() if (len(str(p[0])), len(str(p[1]))) == shape][:n]
        pairs = [(a, b) for a, b in pairs if min(a, b) >= 10] if shape == (2, 2) else pairs
        rows = [tasks.addition_row(a, b) for a, b in pairs for _ in range(k)]
        for mode in ("T=1", "greedy"):
            torch.manual_seed(rng.randrange(2**31))
            prompt_ids = tasks.encode_prompts(tok, [r["prompt"] for r in rows], "none")
            roll = C.rollout(model, tok, prompt_ids, calc, rows, max_turns, max_new_tokens,
                             greedy=mode == "greedy", stop=["</calc>"])
            right = torch.tensor([C.math_reward(c, r) for c, r in zip(roll.final, rows)])
            called = roll.tool_calls > 0
            out[f"{shape[0]}+{shape[1]} {mode}"] = {
                "calls": float(called.float().mean()),
                "right when calling": float(right[called].mean()) if called.any() else None,
                "right when not": float(right[~called].mean()) if (~called).any() else None,
                "overall": float(right.mean()),
                "says nothing after": float(torch.tensor([  # the observation, of those calling
                    f.strip() == "" for f, c in zip(roll.final, called) if c]).float().mean())
                if called.any() else None}
    return out


def main():
    """python envs.py MODEL [K]: the calculator report (calc_report) of a model or checkpoint."""
    import sys
    model = loading.load_model(sys.argv[1], "lm", torch.device("cpu"), frozen=True)
    tok = loading.load_tokenizer(sys.argv[1])
    torch.set_num_threads(1)
    rep = calc_report(model, tok, k=int(sys.argv[2]) if len(sys.argv) > 2 else 1)
    cols = ["calls", "right when calling", "right when not", "overall", "says nothing after"]
    print(f"{'':12}" + "".join(f"{c:>19}" for c in cols))
    for name, r in rep.items():
        print(f"{name:12}" + "".join(f"{'-' if r[c] is None else f'{r[c]:.3f}':>19}"
                                     for c in cols))


if __name__ == "__main__":
    main()
