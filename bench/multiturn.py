"""Multi-turn sampling: the work and time of a tool-use rollout, and the decode loop's fixed cost.

  python bench/multiturn.py                 this checkout
  python bench/multiturn.py --repo DIR      another checkout of minrl (e.g. an older commit: one
                                            whose common.py still has the re-prefilling rollout())

Three parts, each printed as a table, then one JSON line:
  work    positions the model forwards in one multi-turn rollout, against the ideal (each distinct
          prompt once, each completion token once but each row's last), and the wall time; a random
          15 M-parameter Qwen2 (hidden 384, 8 layers, the bundled tokenizer), turns of about 8
          tokens (12 of the 99 token ids end a turn), an observation of 4 tokens after each turn,
          at 1, 4, 8 and 16 turns, for 8 and 32 rows
  tool    32 rows, one call each to a tool that sleeps 0.2 s: the rollout's time with it, less the
          time with a tool that returns at once
  step    the decode loop's time per step at 8 rows on the bundled model (64 new tokens, EOS never
          sampled), with and without a stop string: what the loop itself costs around the forward
Run it on an otherwise idle machine, one thread (it sets torch.set_num_threads(1)).
"""
import argparse
import importlib
import inspect
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(repo):
    sys.path.insert(0, repo)
    return [importlib.import_module(m) for m in ("common", "envs", "loading", "tasks")]


def run_rollout(C, E, model, tok, prompt_ids, env, rows, max_turns, budget):
    """One multi-turn rollout by whichever sampler the checkout has."""
    if hasattr(C, "rollout"):  # before the one-sampler engine: re-prefills every turn
        return C.rollout(model, tok, prompt_ids, env, rows, max_turns, budget)
    make = lambda row: (lambda turns: env(row, turns))  # noqa: E731
    if "who" in inspect.signature(E.start_episodes).parameters:  # episodes count their turns
        env_step, finish = E.start_episodes(rows, make, "--env 'bench'", 60, tok, max_turns)
        roll = C.sample(model, tok, prompt_ids, budget, env_step=env_step)
    else:
        env_step, finish = E.start_episodes(rows, make, "--env", "bench", 60, tok)
        roll = C.sample(model, tok, prompt_ids, budget, env_step=env_step, max_turns=max_turns)
    if callable(finish):  # the episodes' fields (roll.turns): since episodes keep their turns
        finish(roll)
    return roll


def random_qwen2(tok, eos):
    from transformers import AutoModelForCausalLM, Qwen2Config
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=384, num_hidden_layers=8,
                      num_attention_heads=6, num_key_value_heads=2, intermediate_size=1024,
                      max_position_embeddings=4096, pad_token_id=tok.pad_token_id,
                      bos_token_id=tok.bos_token_id, eos_token_id=eos)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.generation_config.eos_token_id = eos
    return model


def work(C, E, L, T):
    tok = L.load_tokenizer(L.DEFAULT_POLICY)
    eos = list(range(5, 99, 8))  # 12 ids: a turn ends after about 8 tokens
    model = random_qwen2(tok, eos)
    counted = []
    model.register_forward_pre_hook(lambda m, a, kw: counted.append(kw["input_ids"].numel()),
                                    with_kwargs=True)
    out = []
    for rows_n in (8, 32):
        for turns in (1, 4, 8, 16):
            prompts = [f"{a}+{a + 1}=" for a in range(rows_n)]
            rows = [{"prompt": p} for p in prompts]
            prompt_ids = T.encode_prompts(tok, prompts, "none")

            def env(row, said, turns=turns):
                return None if len(said) >= turns else " 12 "
            torch.manual_seed(0)
            counted.clear()
            t0 = time.perf_counter()
            roll = run_rollout(C, E, model, tok, prompt_ids, env, rows, turns, 24 * turns)
            seconds = time.perf_counter() - t0
            lengths = roll.attention_mask[:, roll.P:].sum(-1)
            ideal = len(set(map(tuple, prompt_ids))) * roll.P + int((lengths - 1).sum())
            out.append({"rows": rows_n, "turns": turns, "positions": sum(counted),
                        "ideal": ideal, "ratio": sum(counted) / ideal, "seconds": seconds,
                        "mean_turns": float(roll.turns.float().mean())})
            print(f"work  rows {rows_n:2d}  turns {turns:2d} (mean {out[-1]['mean_turns']:5.2f})"
                  f"  positions / ideal {out[-1]['ratio']:5.2f}  {seconds:7.3f} s")
    return out


def tool(C, E, L, T):
    tok = L.load_tokenizer(L.DEFAULT_POLICY)
    model = L.load_model(L.DEFAULT_POLICY, "lm", torch.device("cpu"), frozen=True)
    model.generation_config.eos_token_id = list(range(99))  # every turn is one token
    prompts = [f"{a}+{a}=" for a in range(32)]
    rows, ids = [{"prompt": p} for p in prompts], T.encode_prompts(tok, prompts, "none")
    times = {}
    for wait in (0.0, 0.2):
        def env(row, said, wait=wait):
            if len(said) > 1:
                return None
            time.sleep(wait)
            return " 1 "
        t0 = time.perf_counter()
        run_rollout(C, E, model, tok, ids, env, rows, 2, 16)
        times[wait] = time.perf_counter() - t0
    extra = times[0.2] - times[0.0]
    print(f"tool  32 rows x a 0.2 s call: +{extra:.2f} s ({times[0.2]:.2f} against "
          f"{times[0.0]:.2f} s)")
    return {"seconds_added_by_the_tool": extra, "seconds": times}


def step(C, E, L, T, repeats=5):
    tok = L.load_tokenizer(L.DEFAULT_POLICY)
    model = L.load_model(L.DEFAULT_POLICY, "lm", torch.device("cpu"), frozen=True)
    model.generation_config.suppress_tokens = [tok.eos_token_id]  # every row runs 64 steps
    prompt_ids = T.encode_prompts(tok, [f"{a}+{a}=" for a in range(8)], "none")
    out = {}
    for name, stop in (("no stop string", ()), ("stop string", ("</calc>",))):
        best = float("inf")
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            C.sample(model, tok, prompt_ids, 64, stop=stop)
            best = min(best, time.perf_counter() - t0)
        out[name] = best / 64 * 1e3
        print(f"step  8 rows, {name:15s} {out[name]:6.3f} ms a decode step (best of {repeats})")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repo", default=HERE)
    p.add_argument("--parts", default="work,tool,step")
    a = p.parse_args()
    torch.set_num_threads(1)
    C, E, L, T = load(os.path.abspath(a.repo))
    result = {part: globals()[part](C, E, L, T) for part in a.parts.split(",")}
    print(json.dumps({"repo": a.repo, **result}))


if __name__ == "__main__":
    main()
