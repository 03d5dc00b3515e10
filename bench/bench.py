"""Speed and memory benchmarks, measured side by side in one run (these machines are noisy: quote
ratios).

  python bench/bench.py sample     common.sample vs model.generate, tokens/s, same model, batch,
                                   lengths and temperature
  python bench/bench.py steps      seconds per step and peak memory: grpo (beta=0, beta>0),
                                   reinforce, ppo
  python bench/bench.py logprobs   memory held for backward by the training log-probs, one chunk
                                   vs chunked
  python bench/bench.py memory     peak memory and time of one training forward + backward of
                                   token_logprobs on a 151,936-token vocabulary, T = 128 and 512:
                                   plain and the chunked head; the bundled model's speed, fast
                                   path vs plain
  python bench/bench.py trl        grpo.py vs TRL's GRPOTrainer on the bundled model and task
                                   (needs `pip install trl`, used only here, never a project
                                   dependency)
  python bench/bench.py lora       full fine-tuning vs LoRA (r 16): s/step and peak memory of
                                   grpo.py (beta 0.04) and ppo.py on a ~100 M-parameter random
                                   Qwen2
  python bench/bench.py all

Prints a table per part and a final JSON line. Results with date, hardware and commands:
bench/RESULTS.md.
"""
import functools
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common as C  # noqa: E402
import fastpath  # noqa: E402
from plumbing import loading  # noqa: E402
from plumbing import tasks  # noqa: E402


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # CUDA runs asynchronously: time the work, not its launch


def timed(fn, repeats):
    """(fn's result, best wall time of `repeats` runs) after one warm-up run (allocations, lazy
    init, compile)."""
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        n = fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return n, best


def bench_sample(device, model_name=loading.DEFAULT_POLICY, batch=64, group=1, new_tokens=(6, 32),
                 repeats=5):
    """Tokens/s of common.sample and model.generate on the same batch of `batch` rows, temperature
    1, EOS stopping: batch // group distinct prompts, each repeated `group` times in a row (group=8
    is a GRPO batch, as TRL builds it for generate). Generated tokens are counted up to and
    including each row's EOS (what RL uses)."""
    tok = loading.load_tokenizer(model_name)
    model = loading.load_model(model_name, "lm", device, frozen=True)
    rows = tasks.load_data("").eval_rows[:batch // group]
    prompts = C.encode_prompts(tok, [r["prompt"] for r in rows for _ in range(group)])
    ids, mask = C.left_pad(prompts, tok.pad_token_id, device)
    eos = torch.tensor(C.eos_ids(model, tok), device=device)
    out = {}
    for T in new_tokens:
        torch.manual_seed(0)

        def ours():
            return int(C.sample(model, tok, prompts, T, temperature=1.0).completion_mask.sum())

        def hf():
            full = model.generate(ids, attention_mask=mask, max_new_tokens=T, do_sample=True,
                                  temperature=1.0, top_k=0, top_p=1.0,
                                  pad_token_id=tok.pad_token_id)
            g = full[:, ids.shape[1]:]  # the generated columns
            ended = torch.isin(g, eos).int()
            no_eos = torch.full_like(ended[:, 0], g.shape[1])  # a row without EOS: all of it
            first = torch.where(ended.any(1), ended.argmax(1) + 1, no_eos)
            return int(first.sum())
        n_ours, t_ours = timed(ours, repeats)
        n_hf, t_hf = timed(hf, repeats)
        ours_tok_s = n_ours / t_ours
        hf_tok_s = n_hf / t_hf
        key = f"{batch // group}x{group} T{T}"
        out[key] = {"ours_tok_s": ours_tok_s, "generate_tok_s": hf_tok_s,
                    "speedup": ours_tok_s / hf_tok_s}
        print(f"sample  {batch // group:2d} prompts x {group} samples  max_new_tokens {T:3d}:  "
              f"common.sample {ours_tok_s:9.0f} tok/s   model.generate {hf_tok_s:9.0f} tok/s   "
              f"ratio {out[key]['speedup']:.2f}x")
    return out


def random_qwen2(device, layers=4, hidden=256, vocab=99):
    """A random-weight Qwen2-shaped model with the bundled tokenizer: EOS almost never fires, so
    every row decodes all max_new_tokens (pure decode speed)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=4 * hidden,
                      max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    path = os.path.join(tempfile.mkdtemp(), "qwen2")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    loading.load_tokenizer(loading.DEFAULT_POLICY).save_pretrained(path)
    return path


def run_script(script, args, tmp):
    """Run one training script to its own folder; its mean s/step (steps 3 on), first step, peak
    memory, evals."""
    out = os.path.join(tmp, script.replace(".py", "") + "-" + str(abs(hash(tuple(args))) % 10**6))
    cmd = [sys.executable, os.path.join(ROOT, script), "--output_dir", out, *args]
    t = time.time()
    r = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        last_line = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise RuntimeError(f"{script} failed: {last_line}")
    wall = time.time() - t
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    times = [m["step_time"] for m in metrics[2:]] or [m["step_time"] for m in metrics]
    return {"s_per_step": sum(times) / len(times), "first_step_s": metrics[0]["step_time"],
            "peak_mem_mb": summary["peak_mem_mb"], "tokens_per_s": summary["tokens_per_s"],
            "eval_before": summary["eval_before"], "eval_after": summary["eval_after"],
            "wall_s": wall}


def bench_steps(steps=20, model=None, label="bundled"):
    """Seconds per training step and peak memory at equal settings (64 completions per step, same
    lengths). With `model` (a bigger random model, so that model state shows above the ~470 MB of
    the torch runtime), PPO's critic is a copy of the policy (--critic_init policy), as with real
    models."""
    common = ["--max_steps", str(steps), "--eval_size", "100", "--eval_every", "0",
              "--save_every", "1000"]
    common += ["--model", model] if model else []
    runs = {"grpo beta=0": ("grpo.py", ["--beta", "0"]),
            "grpo beta=0.04": ("grpo.py", ["--beta", "0.04"]),
            "reinforce rloo": ("reinforce.py", ["--baseline", "rloo"]),
            "ppo": ("ppo.py", ["--critic_init", "policy"] if model else [])}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (script, extra) in runs.items():
            out[name] = run_script(script, common + extra, tmp)
            print(f"steps   {label:8s} {name:16s} {out[name]['s_per_step']:.3f} s/step   "
                  f"peak memory {out[name]['peak_mem_mb']:.0f} MB")
    return out


def bench_lora(steps=2):
    """Full fine-tuning vs LoRA at equal settings on a random Qwen2 big enough for the weights to
    dominate (12 layers x 768: 96 M parameters, 384 MB in fp32). LoRA keeps no reference copy (the
    policy with its adapters off is the reference) and gradients and Adam moments only for the
    adapters; PPO's critic stays a full model either way. Micro-batches of 8 rows keep the
    activations (which LoRA does not shrink: backward still runs through every layer) small."""
    big = random_qwen2(None, layers=12, hidden=768)
    common = ["--model", big, "--max_steps", str(steps), "--eval_size", "16", "--eval_every", "0",
              "--save_every", "1000", "--max_new_tokens", "16", "--micro_batch_size", "8"]
    runs = {"grpo full": ("grpo.py", []), "grpo lora": ("grpo.py", ["--lora_r", "16"]),
            "ppo full": ("ppo.py", ["--critic_init", "policy", "--batch_size", "32"]),
            "ppo lora": ("ppo.py", ["--critic_init", "policy", "--batch_size", "32",
                                    "--lora_r", "16"])}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (script, extra) in runs.items():
            out[name] = run_script(script, common + extra, tmp)
            print(f"lora    {name:10s} {out[name]['s_per_step']:.2f} s/step   peak memory "
                  f"{out[name]['peak_mem_mb']:.0f} MB")
    return out


def logprob_memory(chunk_elems, rows=8, T=64, vocab=151936):
    """MB that autograd holds between a training log-prob forward (bf16 autocast, entropy on, as in
    grpo.py) and its backward, on a 2-layer random Qwen2 with Qwen's vocabulary; run in a fresh
    process per setting."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    device = loading.pick_device()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    model = Qwen2ForCausalLM(cfg).to(device)
    ids = torch.randint(3, vocab, (rows, 8 + T), device=device)

    def used():  # MB allocated now (CUDA) or resident now (CPU)
        if device.type == "cuda":
            return torch.cuda.memory_allocated() / 2**20
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024

    def forward():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            x, targets = fastpath.final_hidden(functools.partial(C._forward, model), ids,
                                               torch.ones_like(ids), T)
            fastpath.CHUNK_ELEMS = chunk_elems  # this process measures one setting
            return fastpath.head_logprobs(x, model.lm_head, targets, 1.0, None, True)[0]
    forward().sum().backward()  # warm-up: gradients and allocator caches exist before we measure
    base = used()
    t = time.perf_counter()
    lp = forward()
    held = used() - base
    lp.sum().backward()
    sync()
    return {"held_for_backward_mb": held, "fwd_bwd_s": time.perf_counter() - t,
            "fp32_rows_T_V_mb": rows * T * vocab * 4 / 2**20}


def bench_logprob_memory():
    """One chunk (head and log-softmax are plain autograd ops: their outputs are kept) vs 2^24
    logits a chunk (only the hidden states are kept; each chunk is recomputed in backward by
    fastpath.LinearHeadLogprobs). Before #27 the chunked side kept the full bf16 logits: see the
    `memory` mode for that path."""
    out = {}
    for name, chunk_elems in (("one chunk", 2**40), ("default chunks", 2**24)):
        cmd = [sys.executable, __file__, "_logprob_memory", str(chunk_elems)]
        r = subprocess.run(cmd, capture_output=True, text=True, check=True)
        out[name] = json.loads(r.stdout.strip().splitlines()[-1])
        m = out[name]
        print(f"logprobs {name:15s} held for backward {m['held_for_backward_mb']:6.0f} MB   "
              f"fwd+bwd {m['fwd_bwd_s']:.2f} s   "
              f"(8 x 64 x 151,936 in fp32: {m['fp32_rows_T_V_mb']:.0f} MB)")
    return out


def peak_rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def train_logprobs_memory(path, T, rows=8, P=16, vocab=151936, hidden=256, layers=2):
    """One training forward + backward of common.token_logprobs (entropy on and detached at
    once, as grpo.py logs it) on a random Qwen2 with Qwen's vocabulary, fp32 on the CPU, in this
    fresh process. Peak memory above the weights and their gradients: on CUDA the allocator's
    peak; on the CPU the kernel's peak resident set (VmHWM), reset just before the pass by
    writing 5 to /proc/self/clear_refs (big blocks are mmap'ed, so freed ones leave the resident
    set: after a warm-up pass the RSS is the weights, their gradients and the runtime). path:
    'plain' (plain_token_logprobs) or 'hidden' (the default: the chunked head)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.set_num_threads(1)
    device = loading.pick_device()
    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=1024)
    model = Qwen2ForCausalLM(cfg).to(device).eval()
    ids = torch.randint(3, vocab, (rows, P + T), device=device)  # distinct prompts: no sharing

    def step():
        logprobs = C.plain_token_logprobs if path == "plain" else C.token_logprobs
        lp, ent = logprobs(model, ids, torch.ones_like(ids), T, entropy=True)
        ent = ent.detach()
        lp.sum().backward()
        sync()
    step()  # warm-up: the gradients exist, lazy init is done
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        base = rss_mb()
    t = time.perf_counter()
    step()
    seconds = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else peak_rss_mb()
    weights = sum(p.numel() for p in model.parameters()) * 4 / 2**20
    return {"path": path, "T": T, "increase_mb": round(peak - base, 1), "fwd_bwd_s": seconds,
            "weights_mb": round(weights, 1),
            "full_logits_fp32_mb": round(rows * T * vocab * 4 / 2**20, 1)}


def bundled_logprobs_speed(repeats=30):
    """s per training forward + backward of token_logprobs on the bundled model and a GRPO-sized
    batch (64 rows, 8 groups), the fast path against the plain one, interleaved in one process."""
    tok = loading.load_tokenizer(loading.DEFAULT_POLICY)
    model = loading.load_model(loading.DEFAULT_POLICY, "lm", loading.pick_device())
    torch.manual_seed(0)
    rows = tasks.load_data("").eval_rows[:8]
    prompts = C.encode_prompts(tok, [r["prompt"] for r in rows] * 8)
    roll = C.sample(model, tok, prompts, 6)
    T = roll.completion_mask.shape[1]

    def step(fast):
        logprobs = C.token_logprobs if fast else C.plain_token_logprobs
        lp, ent = logprobs(model, roll.ids, roll.attention_mask, T, entropy=True)
        (lp * roll.completion_mask).sum().backward()
    best = {"hidden": float("inf"), "plain": float("inf")}
    torch.set_num_threads(1)  # as the scripts run the bundled model
    for _ in range(repeats):
        for name in best:
            t = time.perf_counter()
            step(fast=name == "hidden")
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def bench_memory():
    """train_logprobs_memory for each path and T, each in a fresh process, then the bundled
    model's speed."""
    out = []
    # (the plain path at T = 512 would need about 11 GB: not run)
    for T, paths in ((128, ("plain", "hidden")), (512, ("hidden",))):
        for path in paths:
            cmd = [sys.executable, __file__, "_train_memory", path, str(T)]
            # glibc would keep freed blocks under 32 MB in its heap (its mmap threshold rises as
            # big blocks are freed): the resident set would count them as if still in use
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            r = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            m = json.loads(r.stdout.strip().splitlines()[-1])
            out.append(m)
            print(f"memory T={T:4d} {path:7s} +{m['increase_mb']:7.0f} MB over weights and grads "
                  f"({m['weights_mb']:.0f} MB of weights)   fwd+bwd {m['fwd_bwd_s']:.2f} s   "
                  f"one (8, {T}, 151,936) fp32 logits: {m['full_logits_fp32_mb']:.0f} MB")
    speed = bundled_logprobs_speed()
    print(f"bundled model, fwd+bwd of token_logprobs: {speed['hidden'] * 1e3:.2f} ms (fast) vs "
          f"{speed['plain'] * 1e3:.2f} ms (plain)")
    return {"train_memory": out, "bundled_s": speed}


def main():
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what == "_logprob_memory":  # the child process of bench_logprob_memory
        return print(json.dumps(logprob_memory(int(sys.argv[2]))))
    if what == "_train_memory":  # the child process of bench_memory
        return print(json.dumps(train_logprobs_memory(sys.argv[2], int(sys.argv[3]))))
    device = loading.pick_device()
    torch.set_num_threads(os.cpu_count() or 1)
    if device.type == "cuda":
        device_name = torch.cuda.get_device_name()
    else:
        device_name = platform.processor() or platform.machine()
    result = {"date": time.strftime("%Y-%m-%d"), "device": device_name, "cpus": os.cpu_count(),
              "torch": torch.__version__}
    if what in ("sample", "all"):
        result["sample_bundled"] = {**bench_sample(device, group=8),
                                    **bench_sample(device, group=1)}
        qwen2 = random_qwen2(device)
        result["sample_random_qwen2"] = {**bench_sample(device, qwen2, group=8, new_tokens=(64,)),
                                         **bench_sample(device, qwen2, group=1, new_tokens=(64,))}
    if what in ("steps", "all"):
        result["steps"] = bench_steps()
        big = random_qwen2(device, layers=4, hidden=512)  # 15.8 M parameters: 63 MB of fp32 weights
        result["steps_random_qwen2_16M"] = bench_steps(steps=3, model=big, label="qwen2-16M")
    if what in ("lora", "all"):
        result["lora"] = bench_lora()
    if what in ("logprobs", "all"):
        result["logprob_memory"] = bench_logprob_memory()
    if what in ("memory", "all"):
        result["memory"] = bench_memory()
    if what in ("trl", "all"):
        trl_script = os.path.join(ROOT, "bench", "trl_grpo.py")
        r = subprocess.run([sys.executable, trl_script], capture_output=True, text=True)
        print(r.stdout.strip() or r.stderr.strip().splitlines()[-1])
        result["trl"] = json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else None
    print(json.dumps(result))


if __name__ == "__main__":
    main()
