"""grpo.py vs TRL's GRPOTrainer on a real chat model: SmolLM2-135M-Instruct, --data chat-sums.

  python tools/smollm2.py                          # models/SmolLM2-135M-Instruct, once
  python bench/trl_real.py --steps 16 --eval_size 128  # grpo.py, TRL, then a profile (RESULTS.md)
  python bench/trl_real.py --steps 4 --rounds 2    # grpo.py, TRL, grpo.py, TRL; then a profile
  python bench/trl_real.py --only profile          # where one grpo.py step's time goes

Same settings for both, PRESET in plumbing/chat_sums.py (grpo.py's --data chat-sums): 4 prompts
x 8 completions a step, at most 10 new tokens, temperature 0.7, constant lr 2e-5, beta 0 (no
reference model), eps 0.2, group-std reward scaling, token-mean loss ("dapo" in TRL), one update
per batch, grad clip 1.0, no weight decay; the reward chat_sums.asked_answer; the prompts rendered
by the model's chat template (its default system prompt included) in both. Both see the same
prompts in the same order (grpo.py draws 4 a step from random.Random(seed); TRL gets those rows,
unshuffled). Each run is its own process, so its peak memory (ru_maxrss) is its own.
Timed: grpo.py's `step_time` (sampling, rewards, forward, backward, optimizer step; not the evals);
TRL from on_step_begin to on_step_end (generation, rewards, forward, backward, optimizer).
The learning curve: each step's mean sampled reward. The profile times one grpo.py-like step's
parts in this process (common.generate, a reference forward as beta > 0 would add, the training
forward, backward, optimizer step). Prints a table and one JSON line per run.
"""
import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common as C  # noqa: E402
from plumbing import chat_sums, loading, tasks  # noqa: E402

P = chat_sums.PRESET
PROMPTS, GROUP = P["prompts_per_step"], chat_sums.PRESET_ALGO["grpo"]["group_size"]


def peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KB


def run_grpo_py(a, out_dir):
    """grpo.py as a user runs it: --model and --data chat-sums, --max_steps, no eval between."""
    cmd = [sys.executable, os.path.join(ROOT, "grpo.py"), "--model", a.model, "--data",
           chat_sums.NAME, "--output_dir", out_dir, "--max_steps", str(a.steps), "--seed",
           str(a.seed), "--eval_every", "0", "--eval_size", str(a.eval_size),
           "--threads", str(a.threads)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = json.load(f)
    return {"who": "grpo.py", "step_s": [m["step_time"] for m in metrics],
            "reward": [m["reward"] for m in metrics], "eval_before": summary["eval_before"],
            "eval_after": summary["eval_after"], "peak_mb": summary["peak_mem_mb"]}


def run_trl(a):
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    import datasets
    from trl import GRPOConfig, GRPOTrainer
    device = torch.device("cpu")
    tok = loading.load_tokenizer(a.model)
    model = loading.load_model(a.model, "lm", device)
    data = tasks.load_data(chat_sums.NAME, a.eval_size)
    rng = random.Random(a.seed)  # grpo.py's data stream (runs.seed_everything)
    rows = [r for _ in range(a.steps) for r in data.next_batch(rng, PROMPTS)]

    def asked_answer(prompts, completions, equation, **kw):  # completions: [[assistant message]]
        return chat_sums.asked_answer([c[0]["content"] for c in completions],
                                      [{"equation": e} for e in equation])

    class StepTimer(TrainerCallback):
        times, t0 = [], 0.0

        def on_step_begin(self, args, state, control, **kw):
            StepTimer.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            StepTimer.times.append(time.perf_counter() - StepTimer.t0)
    rewards = []

    class Rewards(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                rewards.append(logs["reward"])
    cfg = GRPOConfig(
        output_dir=a.tmp, max_steps=a.steps, per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP, gradient_accumulation_steps=1,
        max_completion_length=P["max_new_tokens"], temperature=P["temperature"], top_p=1.0,
        top_k=0, learning_rate=P["lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, max_grad_norm=1.0, beta=P["beta"], epsilon=0.2, loss_type="dapo",
        scale_rewards="group", num_iterations=1, mask_truncated_completions=False,
        disable_dropout=True, gradient_checkpointing=False, shuffle_dataset=False, seed=a.seed,
        use_cpu=True, bf16=False, report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, log_completions=False)
    trainer = GRPOTrainer(model=model, reward_funcs=asked_answer, args=cfg, processing_class=tok,
                          train_dataset=datasets.Dataset.from_list(rows),
                          callbacks=[StepTimer(), Rewards()])
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    score = heldout(trainer.model, tok, data.eval_rows)
    trainer.train()
    return {"who": "TRL", "step_s": StepTimer.times, "reward": rewards, "eval_before": score,
            "eval_after": heldout(trainer.model, tok, data.eval_rows), "peak_mb": peak_mb()}


def heldout(model, tok, rows):  # grpo.py's held-out score: greedy, asked_answer, mean
    model.eval()
    args = SimpleNamespace(chat_template="auto", max_new_tokens=P["max_new_tokens"], stop=[])
    fns = {"asked_answer": lambda c, r: torch.tensor(chat_sums.asked_answer(c, r))}
    return C.evaluate(model, tok, rows, args, loading.autocast(torch.device("cpu"), "auto"),
                      {"asked_answer": 1.0}, fns)["eval"]


def profile(a):
    """One grpo.py step's parts, timed apart, a.steps times (the first is left out)."""
    device = torch.device("cpu")
    tok = loading.load_tokenizer(a.model)
    model = loading.load_model(a.model, "lm", device)
    ref = loading.load_model(a.model, "lm", device, frozen=True)
    opt = torch.optim.AdamW(model.parameters(), lr=P["lr"], weight_decay=0.0, fused=True)
    data = tasks.load_data(chat_sums.NAME, a.eval_size)
    rng = random.Random(a.seed)
    args = SimpleNamespace(chat_template="auto", max_new_tokens=P["max_new_tokens"], stop=[],
                           temperature=P["temperature"], top_p=1.0)
    amp = loading.autocast(device, "auto")
    parts = {k: [] for k in ("sample", "reference", "forward", "backward", "optimizer")}
    for _ in range(a.steps):
        rows = [r for r in data.next_batch(rng, PROMPTS) for _ in range(GROUP)]
        t = [time.perf_counter()]
        with torch.no_grad():
            roll, texts = C.generate(model, tok, rows, args, amp)
        t.append(time.perf_counter())
        T = roll.completion_mask.shape[1]
        C.batched_logprobs(ref, roll, args.temperature, P["micro_batch_size"], amp)
        t.append(time.perf_counter())
        rewards = torch.tensor(chat_sums.asked_answer(texts, rows)).view(-1, GROUP)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-4))
        logprobs, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T,
                                       args.temperature)
        mask = roll.completion_mask
        loss = -(adv.view(-1, 1) * logprobs * mask).sum() / mask.sum()  # GRPO's at ratio 1
        t.append(time.perf_counter())
        loss.backward()
        t.append(time.perf_counter())
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t.append(time.perf_counter())
        for k, t0, t1 in zip(parts, t, t[1:]):
            parts[k].append(t1 - t0)
    return {"who": "profile", **{k: v[1:] for k, v in parts.items()}, "peak_mb": peak_mb()}


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct"))
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--rounds", type=int, default=1, help="grpo.py then TRL, this many times")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval_size", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--only", choices=("grpo", "trl", "profile"), default="")
    p.add_argument("--tmp", default="")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.only:  # one run in this process: its JSON line on stdout's last line
        with tempfile.TemporaryDirectory() as tmp:
            a.tmp = tmp
            run = {"grpo": lambda: run_grpo_py(a, os.path.join(tmp, "run")),
                   "trl": lambda: run_trl(a), "profile": lambda: profile(a)}[a.only]
            print(json.dumps({**run(), "steps": a.steps, "seed": a.seed, "threads": a.threads}))
        return
    results = []
    for which in ["grpo", "trl"] * a.rounds + ["profile"]:
        t = time.time()
        out = subprocess.run([sys.executable, __file__, "--only", which, "--steps", str(a.steps),
                              "--seed", str(a.seed), "--model", a.model, "--threads",
                              str(a.threads), "--eval_size", str(a.eval_size)],
                             capture_output=True, text=True, check=True)
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
        load = os.getloadavg()[0]
        print(f"{which}: {time.time() - t:.0f} s, load {load:.1f}: {json.dumps(results[-1])}",
              flush=True)
    print(f"\n{'':10}{'s/step':>8}{'eval before':>12}{'eval after':>11}{'peak MB':>9}  reward/step")
    for r in results[:-1]:
        print(f"{r['who']:10}{mean(r['step_s'][1:]):>8.1f}{r['eval_before']:>12.3f}"
              f"{r['eval_after']:>11.3f}{r['peak_mb']:>9.0f}  "
              + " ".join(f"{x:.2f}" for x in r["reward"]))
    prof = results[-1]
    print("grpo.py step parts (s): " + ", ".join(f"{k} {mean(v):.1f}" for k, v in prof.items()
                                                if isinstance(v, list)))
    ours = mean([x for r in results if r["who"] == "grpo.py" for x in r["step_s"][1:]])
    theirs = mean([x for r in results if r["who"] == "TRL" for x in r["step_s"][1:]])
    print(f"grpo.py / TRL time per step (steps 2..{a.steps}): {ours / theirs:.2f}x")


if __name__ == "__main__":
    main()
