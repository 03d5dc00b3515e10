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
  obs     one call turn then an observation of L = 4, 64, 256, 512 tokens, 8 and 32 rows (the 15 M
          Qwen2): the rollout's time against the ideal, timed apart (medians of 3): the prompts'
          prefill, as many whole-batch decode steps as the row with the most model tokens has,
          and one prefill of L tokens (one row) per observation
  stall   32 rows whose turns end one per decode step (the bundled model, EOS forced at position
          40, prompts of 2 to 33 tokens), each calling a tool that sleeps 0.5 s, then answering
  memory  an env whose episodes hold 4 MB each, 8 x 8 rollouts a step for 50 steps: the process's
          resident memory at steps 2, 10, 25, 50, and the episodes still alive at the end
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
    where = "plumbing." if os.path.isdir(os.path.join(repo, "plumbing")) else ""  # older: top
    return [importlib.import_module(m) for m in ("common", f"{where}envs", f"{where}loading",
                                                  f"{where}tasks")]


def run_rollout(C, E, model, tok, prompt_ids, env, rows, max_turns, budget):
    """One multi-turn rollout by whichever sampler the checkout has."""
    if hasattr(C, "rollout"):  # before the one-sampler engine: re-prefills every turn
        return C.rollout(model, tok, prompt_ids, env, rows, max_turns, budget)
    make = lambda row: (lambda turns: env(row, turns))  # noqa: E731
    if "who" in inspect.signature(E.start_episodes).parameters:  # episodes count their turns
        env_step, finish = E.start_episodes(rows, make, "--env 'bench'", 60, tok, max_turns)
        roll = multi_turn_sampler(C)(model, tok, prompt_ids, budget, env_step=env_step)
    else:
        env_step, finish = E.start_episodes(rows, make, "--env", "bench", 60, tok)
        roll = C.sample(model, tok, prompt_ids, budget, env_step=env_step, max_turns=max_turns)
    if callable(finish):  # the episodes' fields (roll.turns): since episodes keep their turns
        finish(roll)
    return roll


def multi_turn_sampler(C):
    """engine.sample since the engine has its own module; common.sample before."""
    return importlib.import_module("engine").sample if importlib.util.find_spec("engine") else (
        C.sample)


def bundled_policy(L):
    """The bundled tokenizer and policy, frozen, on the CPU."""
    tok = L.load_tokenizer(L.DEFAULT_POLICY)
    return tok, L.load_model(L.DEFAULT_POLICY, "lm", torch.device("cpu"), frozen=True)


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
            prompt_ids = C.encode_prompts(tok, prompts, "none")

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
    tok, model = bundled_policy(L)
    model.generation_config.eos_token_id = list(range(99))  # every turn is one token
    prompts = [f"{a}+{a}=" for a in range(32)]
    rows, ids = [{"prompt": p} for p in prompts], C.encode_prompts(tok, prompts, "none")
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
    tok, model = bundled_policy(L)
    model.generation_config.suppress_tokens = [tok.eos_token_id]  # every row runs 64 steps
    prompt_ids = C.encode_prompts(tok, [f"{a}+{a}=" for a in range(8)], "none")
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


def obs(C, E, L, T):
    """The rollout's time against the ideal: its decode steps and one prefill per observation."""
    from transformers import DynamicCache
    tok = L.load_tokenizer(L.DEFAULT_POLICY)
    eos = list(range(5, 99, 8))  # a turn ends after about 8 tokens
    model = random_qwen2(tok, eos)

    def timed(rows_n, width, past):  # median of 3: a forward of width tokens after past ones
        times = []
        for _ in range(3):
            cache = DynamicCache()
            if past:
                model(input_ids=torch.full((rows_n, past), 9), cache=cache)
            t0 = time.perf_counter()
            model(input_ids=torch.full((rows_n, width), 9), cache=cache,
                  position_ids=torch.arange(past, past + width).expand(rows_n, -1))
            times.append(time.perf_counter() - t0)
        return sorted(times)[1]
    out = []
    for rows_n in (8, 32):
        for n_obs in (4, 64, 256, 512):
            prompts = [f"{a}+{a + 1}=" for a in range(rows_n)]
            rows, prompt_ids = [{"prompt": p} for p in prompts], C.encode_prompts(tok, prompts,
                                                                                   "none")
            text = " ".join(["7"] * n_obs)  # about one token a character: cut to n_obs tokens
            text = tok.decode(tok(text, add_special_tokens=False)["input_ids"][:n_obs])

            def env(row, said):
                return None if len(said) >= 2 else text
            torch.manual_seed(0)
            t0 = time.perf_counter()
            roll = run_rollout(C, E, model, tok, prompt_ids, env, rows, 2, n_obs + 48)
            seconds = time.perf_counter() - t0
            calls = int(roll.tool_calls.sum())
            # the ideal: the prompts' prefill, then as many full-batch decode steps as the row
            # with the most model tokens needs, and one prefill of L tokens (one row) a call
            steps = int(roll.completion_mask.sum(-1).max())
            ideal = (timed(rows_n, roll.P, 0) + steps * timed(rows_n, 1, roll.P + 16)
                     + calls * timed(1, n_obs, roll.P + 16))
            out.append({"rows": rows_n, "L": n_obs, "observations": calls, "seconds": seconds,
                        "ideal": ideal, "ratio": seconds / ideal})
            print(f"obs   rows {rows_n:2d}  L {n_obs:3d}  {calls:2d} observations  {seconds:6.2f} s"
                  f"  ideal {ideal:6.2f} s  ratio {seconds / ideal:5.2f}", flush=True)
    return out


def ends_at(model, eos, at):
    """The model with its next token forced to the EOS from position `at` on (never before)."""
    real = model.forward

    def forward(*a, **kw):
        out = real(*a, **kw)
        late = kw["position_ids"][:, -1] >= at - 1  # the logits at position p predict p + 1
        out.logits[:, -1] = torch.where(late[:, None], -1e4, out.logits[:, -1])
        out.logits[:, -1, eos] = torch.where(late, 1e4, -1e4).to(out.logits.dtype)
        return out
    model.forward = forward
    return model


def stall(C, E, L, T):
    """32 rows whose turns end one a decode step, a 0.5 s tool: rows do not wait for others."""
    tok, model = bundled_policy(L)
    model = ends_at(model, tok.eos_token_id, 40)
    prompts = ["1" * k for k in range(1, 33)]  # 2 to 33 tokens (and the BOS)
    rows, ids = [{"prompt": p} for p in prompts], C.encode_prompts(tok, prompts, "none")
    times = {}
    for wait in (0.0, 0.5):
        def env(row, said, wait=wait):
            if len(said) > 1:
                return None
            time.sleep(wait)
            return " 1 "
        torch.manual_seed(0)
        t0 = time.perf_counter()
        roll = run_rollout(C, E, model, tok, ids, env, rows, 2, 64)
        times[wait] = time.perf_counter() - t0
        ends = sorted(int(m.argmin()) for m in roll.completion_mask)  # the first turn's end
    print(f"stall 32 rows, turns ending at steps {ends[0]}..{ends[-1]}, a 0.5 s tool: "
          f"{times[0.5]:.2f} s (an instant tool: {times[0.0]:.2f} s)")
    return {"seconds": times, "turn_ends": ends}


def memory(C, E, L, T, steps=50):
    """Resident memory over rollouts of an env whose episodes hold 4 MB each."""
    import gc
    import resource
    import weakref
    tok, model = bundled_policy(L)
    model.generation_config.eos_token_id = list(range(5, 99, 8))
    alive = weakref.WeakSet()

    class Big:
        def __init__(self, row):
            self.data = bytearray(4 << 20)  # 4 MB an episode
            self.data[::4096] = b"x" * len(self.data[::4096])  # touched: resident
            alive.add(self)

        def step(self, turns):
            return None if len(turns) > 1 else " 1 "
    prompts = [f"{a}+{a}=" for a in range(8)] * 8
    rows, ids = [{"prompt": p} for p in prompts], C.encode_prompts(tok, prompts, "none")

    def rss_mb():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    out = {}
    for step_ in range(1, steps + 1):
        env_step, finish = E.start_episodes(rows, Big, "--env 'bench'", 60, tok, 3)
        roll = multi_turn_sampler(C)(model, tok, ids, 24, env_step=env_step)
        finish(roll)
        del env_step, finish, roll
        if step_ in (2, 10, 25, 50):
            out[step_] = round(rss_mb())
    live_now = len(alive)
    gc.collect()
    out.update(alive_at_end=live_now, alive_after_gc=len(alive),
               peak_mb=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    at = ", ".join(f"{k}: {v}" for k, v in out.items() if isinstance(k, int))
    print(f"memory  resident MB at steps {at}; episodes alive after the last rollout: "
          f"{live_now} (after gc: {out['alive_after_gc']})")
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--repo", default=HERE)
    p.add_argument("--parts", default="work,tool,step,obs,stall,memory")
    a = p.parse_args()
    torch.set_num_threads(1)
    C, E, L, T = load(os.path.abspath(a.repo))
    result = {part: globals()[part](C, E, L, T) for part in a.parts.split(",")}
    print(json.dumps({"repo": a.repo, **result}))


if __name__ == "__main__":
    main()
