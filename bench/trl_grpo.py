"""grpo.py vs TRL's GRPOTrainer, same settings: bundled tiny model, built-in 2-digit addition task.

  pip install trl                      # only for this benchmark; never a project dependency
  python bench/trl_grpo.py             # --steps 200 --seed 0 --warmup 3 --threads <cpu count>
  python bench/trl_grpo.py --grpo_args=--compile   # grpo.py under torch.compile (slow 1st step)

Both train models/tiny-adder for --steps optimizer steps: 8 prompts x 8 completions = 64 per step,
at most 6 new tokens, temperature 1.0, constant lr 1e-4 (no warmup), beta 0.04 (k3 KL to a frozen
reference), eps 0.2, group-std reward scaling, token-mean loss ("dapo" in TRL), one update per
batch, grad clip 1.0, no weight decay, dropout off. Both see the same prompt stream:
tasks.task_train_pairs(random.Random(seed), ...) in order (grpo.py draws 8 per step from that
rng; TRL gets the same 8 * steps rows as a plain-text "prompt" column, unshuffled, no chat
template).

What is timed (wall clock, mean over steps after --warmup):
  grpo.py  `step_time` from its metrics.jsonl: sampling, rewards, reference log-probs,
           forward/backward, clip, optimizer step and the step's metric bookkeeping; not the
           before/after evals or the checkpoint.
  TRL      on_step_begin -> on_step_end of a TrainerCallback: generation, rewards, reference
           log-probs, forward/backward, clip, optimizer and scheduler step; not data loading,
           logging or saving.
Accuracy: common.evaluate (greedy, max_new_tokens 6, math_reward) on
tasks.load_data("").eval_rows (500 held-out prompts), run here in the same process on the base
model, grpo.py's final checkpoint and TRL's final model.
Prints a table, then one JSON line (the last line of stdout).
"""
import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from types import SimpleNamespace

try:
    import trl
    from trl import GRPOConfig, GRPOTrainer
except ImportError:
    sys.exit("error: bench/trl_grpo.py needs TRL (pip install trl); it is not a minrl dependency")
import datasets
import torch
from transformers import TrainerCallback
from transformers.trainer_callback import PrinterCallback, ProgressCallback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common as C  # noqa: E402
from plumbing import loading  # noqa: E402
from plumbing import tasks  # noqa: E402

PROMPTS, GROUP, NEW_TOKENS, TEMP, LR, BETA = 8, 8, 6, 1.0, 1e-4, 0.04


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def run_grpo_py(a, out_dir):
    """grpo.py in a subprocess with the same thread count; returns its per-step metrics, its
    summary and its checkpoint folder."""
    cmd = [sys.executable, os.path.join(ROOT, "grpo.py"), "--output_dir", out_dir,
           "--max_steps", str(a.steps), "--seed", str(a.seed),
           "--prompts_per_step", str(PROMPTS), "--group_size", str(GROUP),
           "--max_new_tokens", str(NEW_TOKENS), "--temperature", str(TEMP), "--top_p", "1.0",
           "--lr", str(LR), "--beta", str(BETA), "--kl_estimator", "k3",
           "--loss_agg", "token-mean", "--scale_rewards", "group", "--num_iterations", "1",
           "--max_grad_norm", "1.0", "--weight_decay", "0", "--eval_every", "0",
           "--save_every", str(a.steps), "--eval_size", "500",
           "--micro_batch_size", str(PROMPTS * GROUP), *a.grpo_args.split()]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "MKL_NUM_THREADS": str(a.threads)}
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = json.load(f)
    return metrics, summary, os.path.join(out_dir, "checkpoint")


class StepTimer(TrainerCallback):
    def __init__(self):
        self.times, self.rewards, self.t0 = [], [], None

    def on_step_begin(self, args, state, control, **kw):
        sync()
        self.t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kw):
        sync()
        self.times.append(time.perf_counter() - self.t0)

    def on_log(self, args, state, control, logs=None, **kw):
        if logs and "reward" in logs:
            self.rewards.append(logs["reward"])


def run_trl(a, out_dir, device):
    tok = loading.load_tokenizer(loading.DEFAULT_POLICY)  # left padding, our pad; no chat template
    model = loading.load_model(loading.DEFAULT_POLICY, "lm", device)
    pairs = tasks.task_train_pairs(random.Random(a.seed), PROMPTS * a.steps)
    rows = [tasks.addition_row(x, y) for x, y in pairs]

    def math(prompts, completions, answer, **kw):  # common.math_reward vs each row's answer
        return [C.math_reward(c, {"answer": ans}) for c, ans in zip(completions, answer)]
    cfg = GRPOConfig(
        output_dir=out_dir, max_steps=a.steps, per_device_train_batch_size=PROMPTS * GROUP,
        num_generations=GROUP, gradient_accumulation_steps=1, max_completion_length=NEW_TOKENS,
        temperature=TEMP, top_p=1.0, top_k=0, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=BETA, epsilon=0.2,
        loss_type="dapo", scale_rewards="group", num_iterations=1,
        mask_truncated_completions=False, disable_dropout=True, gradient_checkpointing=False,
        shuffle_dataset=False, seed=a.seed, use_cpu=device.type == "cpu",
        bf16=device.type == "cuda", report_to="none", save_strategy="no", logging_steps=1,
        disable_tqdm=True, log_completions=False)
    timer = StepTimer()
    trainer = GRPOTrainer(model=model, reward_funcs=math, args=cfg, processing_class=tok,
                          train_dataset=datasets.Dataset.from_list(rows), callbacks=[timer])
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.train()
    return trainer.model, tok, timer


def accuracy(model, tok, device):
    model.eval()
    args = SimpleNamespace(chat_template="auto", max_new_tokens=NEW_TOKENS, stop=[])
    return C.evaluate(model, tok, tasks.load_data("").eval_rows, args,
                      loading.autocast(device, "auto"), {"math": 1.0})


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def median(xs):
    return sorted(xs)[len(xs) // 2] if xs else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the s/step mean")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="torch threads for both")
    p.add_argument("--grpo_args", default="", help='more grpo.py flags, e.g. "--compile"')
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    device = loading.pick_device()
    with tempfile.TemporaryDirectory() as tmp:
        t = time.time()
        metrics, summary, ckpt = run_grpo_py(a, os.path.join(tmp, "grpo"))
        ours_wall = time.time() - t
        ours_acc = accuracy(loading.load_model(ckpt, "lm", device), loading.load_tokenizer(ckpt),
                            device)
        t = time.time()
        torch.manual_seed(a.seed)
        trl_model, tok, timer = run_trl(a, os.path.join(tmp, "trl"), device)
        trl_wall = time.time() - t
        trl_acc = accuracy(trl_model, tok, device)
    base_acc = accuracy(loading.load_model(loading.DEFAULT_POLICY, "lm", device), tok, device)
    if abs(ours_acc - summary["eval_after"]) > 1e-9:
        print(f"warning: grpo.py's own eval_after {summary['eval_after']:.3f} != "
              f"{ours_acc:.3f} measured here")
    ours_t = [m["step_time"] for m in metrics][a.warmup:]
    trl_t = timer.times[a.warmup:]
    tail = max(1, a.steps // 10)

    def entry(times, acc, n, rewards, wall):
        return {"s_per_step": mean(times), "s_per_step_median": median(times),
                "eval_after": acc, "steps_run": n,
                "train_reward_last10pct": mean(rewards[-tail:]), "run_wall_s": wall}
    ours_rewards = [m["reward"] for m in metrics]
    res = {"steps": a.steps, "seed": a.seed, "warmup": a.warmup, "threads": a.threads,
           "device": device.type, "grpo_args": a.grpo_args,
           "trl_version": trl.__version__, "torch": torch.__version__, "eval_before": base_acc,
           "grpo_py": entry(ours_t, ours_acc, len(metrics), ours_rewards, ours_wall),
           "trl": entry(trl_t, trl_acc, len(timer.times), timer.rewards, trl_wall)}
    res["trl_over_grpo_py_time"] = res["trl"]["s_per_step"] / res["grpo_py"]["s_per_step"]
    print(f"\n{a.steps} steps x {PROMPTS * GROUP} completions, seed {a.seed}, "
          f"{a.threads} threads, {device.type}, "
          f"grpo.py {a.grpo_args or '(no extra flags)'}; "
          f"s/step = mean over steps {a.warmup + 1}..{a.steps}; "
          f"held-out greedy accuracy on 500 prompts (before: {base_acc:.3f})")
    print(f"{'':12}{'s/step':>10}{'median':>10}{'accuracy':>10}{'reward':>10}{'run wall s':>12}")
    for name, key in (("grpo.py", "grpo_py"), (f"TRL {trl.__version__}", "trl")):
        r = res[key]
        print(f"{name:12}{r['s_per_step']:>10.3f}{r['s_per_step_median']:>10.3f}"
              f"{r['eval_after']:>10.3f}{r['train_reward_last10pct']:>10.3f}"
              f"{r['run_wall_s']:>12.1f}")
    print(f"TRL / grpo.py time per step: {res['trl_over_grpo_py_time']:.2f}x  "
          f"(reward: mean sampled reward over the last {tail} steps; run wall includes loading "
          f"and, for grpo.py, its own before/after evals)")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
