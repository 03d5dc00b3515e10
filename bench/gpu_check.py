"""One prepared GPU check: CUDA, bf16 and torch.compile on a random-weight model of a real size.

Run once per lent GPU (the full check's budget is about 10 minutes):
  python bench/gpu_check.py                # Qwen2-0.5B-shaped (494 M parameters), CUDA
  python bench/gpu_check.py --parts train  # only some parts (sampling,train,scripts,fsdp,vllm),
                                           # e.g. to rerun a failed one
  python bench/gpu_check.py --tiny         # a 2-layer toy (vocab 1,000) on any device: checks
                                           # the script itself

It needs no hub access: the model is built from a config with random weights, with a synthetic
word-level tokenizer over the same 151,936-token vocabulary (EOS almost never fires, so every row
decodes all its tokens). Measured:
  1. sampling tokens/s on a GRPO batch (8 prompts x 8): common.sample vs model.generate, bf16,
     eager and compiled (ours: torch.compile of the forward; HF: generate with its static cache
     and a compiled forward);
  2. training forward+backward of the policy (bf16 autocast, fp32 master weights): time, tokens/s
     and model FLOP utilisation, MFU = 6 * N * tokens / time / peak (N = parameters, embeddings
     excluded; attention FLOPs ignored);
  3. seconds per step and peak memory of grpo.py (beta 0 and 0.04), reinforce.py and ppo.py at
     equal settings, eager, plus grpo.py with --compile;
  4. with 2 or more GPUs (else skipped): grpo.py on all of them under torchrun, DDP vs --fsdp;
  5. with vLLM installed (pip install vllm; else skipped): --vllm against the native sampler,
     generated tokens/s, is_ratio, a training step's MFU on its rollout counting only non-padding
     tokens, and grpo.py's s/step with and without --vllm (bench_vllm).
Prints a table per part and writes everything as JSON to --out (bench/gpu_check.json, or $OUT/).
The numbers go into bench/RESULTS.md with the date and the GPU's name.
"""
import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

import bench as B  # bench/bench.py, beside this script: timed() and run_script()
import common as C  # bench.py puts the repository root on sys.path
from plumbing import loading
from plumbing import runs as R  # peak_mem_mb()
from plumbing import tasks

ROOT = B.ROOT

PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0,
                    "4090": 165.0}


def build_model(path, tiny):
    """Random Qwen2-0.5B-shaped policy (or a 2-layer toy) and a synthetic tokenizer: one token per
    character of printable ASCII (so the built-in prompts tokenize) plus filler words up to the
    full vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    vocab_size = 1000 if tiny else 151936
    words = ["<pad>", "<bos>", "<eos>", "<unk>"] + [chr(c) for c in range(32, 127)]
    words += [f" w{i}" for i in range(vocab_size - len(words))]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>",
                                  pad_token="<pad>", unk_token="<unk>", padding_side="left",
                                  model_max_length=32768)
    shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2) if tiny else \
        dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24)  # Qwen2-0.5B's
    cfg = Qwen2Config(vocab_size=vocab_size, num_attention_heads=14 if not tiny else 2,
                      num_key_value_heads=2, max_position_embeddings=32768, **shape,
                      tie_word_embeddings=True, rope_theta=1e6, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters()), model.model.embed_tokens.weight.numel()


def bench_sampling(path, device, new_tokens):
    from transformers import AutoModelForCausalLM
    tok = loading.load_tokenizer(path)
    rows = tasks.load_data("").eval_rows[:8]
    prompts = C.encode_prompts(tok, [r["prompt"] for r in rows for _ in range(8)])
    ids, mask = C.left_pad(prompts, tok.pad_token_id, device)

    def load_bf16():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
        return model.to(device).eval()
    out = {}
    for compiled in (False, True):
        # one copy each, so compiling one does not touch the other
        ours = load_bf16()
        hf = load_bf16()
        kw = {}
        if compiled:
            # both copies share HF's forward code, whose graphs dynamo counts together (limit 8)
            torch._dynamo.config.recompile_limit = 32
            ours.forward = torch.compile(ours.forward, dynamic=True)
            hf.forward = torch.compile(hf.forward, mode="reduce-overhead", fullgraph=True)
            kw = {"cache_implementation": "static"}

        def run_ours():
            return int(C.sample(ours, tok, prompts, new_tokens).completion_mask.sum())

        def run_hf():
            g = hf.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=True,
                            top_k=0, pad_token_id=tok.pad_token_id, **kw)
            return int((g[:, ids.shape[1]:] != tok.pad_token_id).sum())
        t = time.perf_counter()
        n_ours, t_ours = B.timed(run_ours, 3)
        first_ours = time.perf_counter() - t
        t = time.perf_counter()
        n_hf, t_hf = B.timed(run_hf, 3)
        first_hf = time.perf_counter() - t
        key = "compiled" if compiled else "eager"
        out[key] = {"ours_tok_s": n_ours / t_ours, "generate_tok_s": n_hf / t_hf,
                    "ratio": t_hf / t_ours * n_ours / n_hf,
                    "ours_warmup_plus_runs_s": first_ours, "generate_warmup_plus_runs_s": first_hf}
        print(f"sampling {key:8s} 8x8, {new_tokens} new tokens: "
              f"common.sample {n_ours / t_ours:8.0f} tok/s   "
              f"model.generate {n_hf / t_hf:8.0f} tok/s   ratio {out[key]['ratio']:.2f}x")
        ours = hf = None  # free both copies before the next pair is loaded
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return out


def bench_train(path, device, n_params, n_embed, seq):
    model = loading.load_model(path, "lm", device)
    amp = loading.autocast(device, "bf16")
    rows, T = 8, seq // 2
    ids = torch.randint(10, 1000, (rows, seq), device=device)
    mask = torch.ones_like(ids)

    def step():
        with amp:
            lp, _ = C.token_logprobs(model, ids, mask, T)
        lp.sum().backward()
        model.zero_grad(set_to_none=True)
        return rows * seq
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    n, t = B.timed(step, 3)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    # the tied LM head runs on T + 1 positions only
    flops = 6 * (n_params - n_embed) * n + 6 * n_embed * rows * (T + 1)
    out = {"batch": rows, "seq": seq, "s": t, "tokens_per_s": n / t, "tflops": flops / t / 1e12,
           "mfu": flops / t / 1e12 / peak if peak else None, "peak_mem_mb": R.peak_mem_mb(device)}
    mfu = f", MFU {out['mfu']:.1%} of {peak:.0f}" if peak else ""
    print(f"train fwd+bwd  {rows} x {seq} tokens (loss on the last {T}): {t * 1e3:.0f} ms, "
          f"{n / t:,.0f} tok/s, {out['tflops']:.1f} TFLOP/s{mfu}")
    return out


def bench_vllm(path, device, n_params, n_embed, new_tokens, steps):
    """--vllm against the native sampler (8 prompts x 8, bf16, EOS almost never fires): generated
    tokens/s; the sampler's log-probs against the training forward's (is_ratio); a training
    forward+backward on its rollout, MFU counting only the non-padding tokens; grpo.py's s/step
    with and without --vllm. Skipped without the package (pip install vllm)."""
    if importlib.util.find_spec("vllm") is None:
        print("vllm     skipped: pip install vllm")
        return {"skipped": "vllm is not installed"}
    from plumbing import vllm_sampler as V
    tok = loading.load_tokenizer(path)
    model = loading.load_model(path, "lm", device)
    amp = loading.autocast(device, "bf16")
    args = SimpleNamespace(model=path, seed=0, trust_remote_code=False, dtype="bf16",
                           sample_dtype="same", vllm_kv_cache_gb=0.0,
                           vllm_gpu_memory_utilization=0.3, chat_template="auto",
                           max_new_tokens=new_tokens, temperature=1.0, top_p=1.0, stop=[])
    t = time.perf_counter()
    sampler = V.Sampler(args, model, tok, device)
    out = {"vllm_start_s": time.perf_counter() - t}
    rows = [r for r in tasks.load_data("").eval_rows[:8] for _ in range(8)]
    for name, fn in (("native", lambda: C.generate(model, tok, rows, args, amp)[0]),
                     ("vllm", lambda: sampler.generate(rows, args)[0])):
        n, t = B.timed(lambda: int(fn().completion_mask.sum()), 3)
        out[f"{name}_tok_s"] = n / t
    print(f"vllm     8x8, {new_tokens} new tokens: common.sample {out['native_tok_s']:8.0f} tok/s"
          f"   vLLM {out['vllm_tok_s']:8.0f} tok/s   ratio "
          f"{out['vllm_tok_s'] / out['native_tok_s']:.2f}x")
    roll = sampler.generate(rows, args)[0]
    T, mask = roll.completion_mask.shape[1], roll.completion_mask.bool()
    log_ratio = C.batched_logprobs(model, roll, 1.0, 64, amp) - roll.sample_logprobs
    out["is_ratio"] = {"mean": float(log_ratio[mask].exp().mean()),
                       "max_abs_log": float(log_ratio[mask].abs().max())}

    def step():
        with amp:
            lp, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T)
        (lp * roll.completion_mask).sum().backward()
        model.zero_grad(set_to_none=True)
    _, t = B.timed(step, 3)
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    real = int(roll.attention_mask.sum())  # the non-padding tokens: prompts and completions
    # the tied LM head runs on the completions (and each row's last prompt token) only
    flops = 6 * (n_params - n_embed) * real + 6 * n_embed * (int(mask.sum()) + len(rows))
    out["train"] = {"s": t, "real_tokens": real, "tflops": flops / t / 1e12,
                    "mfu": flops / t / 1e12 / peak if peak else None}
    print(f"vllm     is_ratio {out['is_ratio']}; train fwd+bwd on its rollout ({real} real "
          f"tokens): {t * 1e3:.0f} ms, {out['train']['tflops']:.1f} TFLOP/s"
          + (f", MFU {out['train']['mfu']:.1%}" if peak else ""))
    sampler = model = None  # the engine's memory back before the scripts run
    common = ["--model", path, "--max_steps", str(steps), "--max_new_tokens", str(new_tokens),
              "--dtype", "bf16", "--eval_size", "16", "--eval_every", "0",
              "--save_every", str(10**6)]
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("grpo", []), ("grpo --vllm", ["--vllm"])):
            try:
                out[name] = r = B.run_script("grpo.py", common + extra, tmp)
            except RuntimeError as e:  # one failing run must not lose the other's numbers
                out[name] = {"error": str(e)}
                print(f"vllm     {name:12s} FAILED: {e}")
                continue
            print(f"vllm     {name:12s} {r['s_per_step']:7.3f} s/step (first "
                  f"{r['first_step_s']:.1f} s)   peak memory {r['peak_mem_mb']:8.0f} MB")
    return out


def bench_scripts(path, steps, new_tokens):
    common = ["--model", path, "--max_steps", str(steps), "--max_new_tokens", str(new_tokens),
              "--dtype", "bf16", "--eval_size", "16", "--eval_every", "0",
              "--save_every", str(10**6)]
    runs = {"grpo beta=0": ("grpo.py", ["--beta", "0"]),
            "grpo beta=0.04": ("grpo.py", ["--beta", "0.04"]),
            "grpo beta=0.04 --compile": ("grpo.py", ["--beta", "0.04", "--compile"]),
            "reinforce rloo": ("reinforce.py", ["--baseline", "rloo"]),
            "ppo (critic = policy copy)": ("ppo.py", ["--critic_init", "policy"])}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, (script, extra) in runs.items():
            try:
                out[name] = B.run_script(script, common + extra, tmp)
            except RuntimeError as e:  # one failing script must not lose the others' numbers
                out[name] = {"error": str(e)}
                print(f"steps    {name:28s} FAILED: {e}")
                continue
            r = out[name]
            print(f"steps    {name:28s} {r['s_per_step']:7.3f} s/step "
                  f"(first {r['first_step_s']:.1f} s)   peak memory {r['peak_mem_mb']:8.0f} MB")
    return out


def bench_fsdp(path, steps, new_tokens):
    """grpo.py on every GPU under torchrun, DDP vs --fsdp (8 prompts per GPU): s/step and rank 0's
    peak memory. FSDP2 needs 2 processes or more, so one GPU skips it."""
    n = torch.cuda.device_count()
    if n < 2:
        print(f"fsdp     skipped: {n} GPU (needs 2+: torchrun --nproc_per_node N grpo.py --fsdp)")
        return {"skipped": f"{n} GPU"}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in (("ddp", []), ("fsdp", ["--fsdp"])):
            folder = os.path.join(tmp, name)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc_per_node={n}", os.path.join(ROOT, "grpo.py"), "--model", path,
                   "--max_steps", str(steps), "--max_new_tokens", str(new_tokens), "--dtype",
                   "bf16", "--prompts_per_step", str(8 * n), "--eval_size", "16", "--eval_every",
                   "0", "--output_dir", folder, *extra]
            r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if r.returncode != 0:
                out[name] = {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
                print(f"fsdp     {name} FAILED: {out[name]['error']}")
                continue
            with open(os.path.join(folder, "summary.json")) as f:
                summary = json.load(f)
            with open(os.path.join(folder, "metrics.jsonl")) as f:
                times = [json.loads(line)["step_time"] for line in f][2:]
            out[name] = {"gpus": n, "s_per_step": sum(times) / max(len(times), 1),
                         "peak_mem_mb": summary["peak_mem_mb"]}
            print(f"torchrun {name:5s} x{n}: {out[name]['s_per_step']:7.3f} s/step   "
                  f"peak memory (rank 0) {summary['peak_mem_mb']:8.0f} MB")
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer toy: checks the script itself, on any device")
    p.add_argument("--new_tokens", type=int, default=128,
                   help="sampling benchmark completion length")
    p.add_argument("--steps", type=int, default=5,
                   help="training steps per script (the first 2 are not timed)")
    p.add_argument("--parts", default="sampling,train,scripts,fsdp,vllm",
                   help="which parts to run, comma-separated")
    out_dir = os.environ.get("OUT") or os.path.join(ROOT, "bench")
    p.add_argument("--out", default=os.path.join(out_dir, "gpu_check.json"),
                   help="JSON results ($OUT/gpu_check.json when $OUT is set, as on the "
                        "device machine)")
    a = p.parse_args()
    device = loading.pick_device()
    device_name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    res = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": device_name,
           "torch": torch.__version__, "tiny": a.tiny}
    import transformers
    res["transformers"] = transformers.__version__
    print(json.dumps(res))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "qwen2-0.5b-random")
        n_params, n_embed = build_model(path, a.tiny)
        res["params"] = n_params
        res["embedding_params"] = n_embed
        print(f"model: Qwen2-0.5B-shaped, {n_params / 1e6:.0f} M parameters, random weights")
        for part, fn in (("sampling", lambda: bench_sampling(path, device, a.new_tokens)),
                         ("train", lambda: bench_train(path, device, n_params, n_embed, 512)),
                         ("scripts", lambda: bench_scripts(path, a.steps, min(a.new_tokens, 64))),
                         ("fsdp", lambda: bench_fsdp(path, a.steps, min(a.new_tokens, 64))),
                         ("vllm", lambda: bench_vllm(path, device, n_params, n_embed,
                                                     a.new_tokens, a.steps))):
            if part not in a.parts.split(","):
                continue
            try:
                res[part] = fn()
            except Exception as e:  # one failing part must not lose the others' numbers
                res[part] = {"error": f"{type(e).__name__}: {e}"}
                print(f"{part} FAILED: {res[part]['error']}")
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
