"""The calculator task's tool-use report (--env calc): per sum shape, how often a model or
checkpoint calls the tool, and how often it is right when it calls and when it does not.

    python tools/calc_report.py models/tiny-calc          # 200 held-out prompts per shape
    python tools/calc_report.py runs/grpo-.../checkpoint 4  # 4 samples per prompt
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

import common as C  # noqa: E402
from plumbing.errors import UserError  # noqa: E402
import engine  # noqa: E402
from plumbing import calc, envs, loading, tasks  # noqa: E402

CALC_REPORT_SHAPES = ((2, 2), (3, 3), (4, 4))


def calc_report(model, tok, n=200, k=1, seed=0):
    """Per sum shape (2+2, 3+3, 4+4 digits), sampled at T = 1 (k per prompt) and greedy: how often
    the model calls the tool, how often it is right when it calls and when it does not, overall,
    and how often a call's observation is the last thing in the transcript (nothing after it).
    Held-out pairs for 3-4 digits; 2-digit ones from the bundled task's held-out split. As
    --env calc samples: 48 new tokens, 3 turns."""
    out, rng = {}, random.Random(seed)
    for shape in CALC_REPORT_SHAPES:
        pairs = tasks.task_eval_pairs()[:n] if shape == (2, 2) else [
            p for p in calc.calc_eval_pairs() if (len(str(p[0])), len(str(p[1]))) == shape][:n]
        pairs = [(a, b) for a, b in pairs if min(a, b) >= 10] if shape == (2, 2) else pairs
        rows = [tasks.addition_row(a, b) for a, b in pairs for _ in range(k)]
        for mode in ("T=1", "greedy"):
            torch.manual_seed(rng.randrange(2**31))
            prompt_ids = C.encode_prompts(tok, [r["prompt"] for r in rows], "none")
            env = envs.load_env("calc")
            env_step, finish = env.start(rows, tok, max_turns=3)  # call, answer, spare
            roll = engine.sample(model, tok, prompt_ids, calc.CALC_DEFAULTS["max_new_tokens"],
                                 env_step, greedy=mode == "greedy",
                                 stop=calc.CALC_DEFAULTS["stop"])
            finish(roll)  # roll.final: the text after the last observation
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
    """python tools/calc_report.py MODEL [K]: the report (calc_report) of a model or checkpoint."""
    k = sys.argv[2] if len(sys.argv) == 3 else "1"
    if len(sys.argv) not in (2, 3) or not (k.isdigit() and 1 <= int(k) <= 1000):
        print("error: usage: python tools/calc_report.py MODEL [K]: a model or checkpoint folder, "
              "or a hub id; K: 1 to 1000 samples per prompt", file=sys.stderr)
        sys.exit(2)
    try:
        model = loading.load_model(sys.argv[1], "lm", torch.device("cpu"), frozen=True)
        tok = loading.load_tokenizer(sys.argv[1])
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    rep = calc_report(model, tok, k=int(k))
    cols = ["calls", "right when calling", "right when not", "overall", "says nothing after"]
    print(f"{'':12}" + "".join(f"{c:>19}" for c in cols))
    for name, r in rep.items():
        print(f"{name:12}" + "".join(f"{'-' if r[c] is None else f'{r[c]:.3f}':>19}"
                                     for c in cols))


if __name__ == "__main__":
    main()
