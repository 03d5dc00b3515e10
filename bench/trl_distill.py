"""distill.py vs TRL's DistillationTrainer, same student, teacher, data and objective.

  pip install trl                      # only for this benchmark; never a project dependency
  python grpo.py --output_dir runs/teacher        # the teacher: a GRPO checkpoint (~15 s)
  python bench/trl_distill.py --teacher runs/teacher/checkpoint   # --steps 30 --threads 1
  python bench/trl_distill.py --real --steps 6 --threads 2   # SmolLM2-135M-Instruct, chat-sums

Both train the bundled student models/tiny-adder toward --teacher for --steps optimizer steps:
64 prompts a step, one completion each, at most 6 new tokens, temperature 1.0, the generalized JSD
with beta 1 (the reverse KL over the whole vocabulary, TRL's default; distill.py --loss jsd
--beta 1), token-mean, constant lr 1e-4, grad clip 1.0, no weight decay, dropout off, no
gradient checkpointing (TRL's default is on), fp32 on a CPU. Each runs in its own process
(python distill.py, and this file with --trl_only), so each peak memory is its own process's.
--real: student and teacher both models/SmolLM2-135M-Instruct (tools/smollm2.py; the teacher a
frozen copy: the loss starts at 0 and the step's work is the same), --data chat-sums's prompts
(chat messages, the chat template), 32 prompts a step, 10 new tokens, temperature 0.7, lr 2e-5.

What is timed (wall clock, mean over the steps after --warmup):
  distill.py  `step_time` from its metrics.jsonl: sampling, rewards, teacher and student
              forwards, the loss, backward, clip, optimizer step, the step's metrics.
  TRL         on_step_begin -> on_step_end of a TrainerCallback: generation, the teacher and
              student forwards, the loss, backward, clip, optimizer and scheduler step.
Memory: the process's peak resident set (ru_maxrss; distill.py's summary.json peak_mem_mb).
Prints a table, then one JSON line (the last line of stdout).
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PROMPTS, NEW_TOKENS, TEMP, LR, BETA = 64, 6, 1.0, 1e-4, 1.0
REAL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")


def settings(a):
    """(student, teacher, prompts a step, new tokens, temperature, lr, distill.py's data flags)."""
    if a.real:
        return REAL, REAL, 32, 10, 0.7, 2e-5, ["--model", REAL, "--data", "chat-sums"]
    return None, a.teacher, PROMPTS, NEW_TOKENS, TEMP, LR, []


def run_distill_py(a, out_dir):
    """distill.py in a subprocess: its per-step metrics and summary."""
    _, teacher, prompts, new_tokens, temp, lr, data = settings(a)
    cmd = [sys.executable, os.path.join(ROOT, "distill.py"), *data, "--teacher", teacher,
           "--loss", "jsd", "--beta", str(BETA), "--output_dir", out_dir, "--micro_batch_size",
           str(prompts), "--max_steps", str(a.steps), "--seed", str(a.seed), "--prompts_per_step",
           str(prompts), "--samples_per_prompt", "1", "--max_new_tokens", str(new_tokens),
           "--temperature", str(temp), "--lr", str(lr), "--eval_every", "0", "--eval_size", "4",
           "--save_every", "0", "--samples_every", "0", "--threads", str(a.threads)]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        metrics = [json.loads(line) for line in f]
    with open(os.path.join(out_dir, "summary.json")) as f:
        return metrics, json.load(f)


def run_trl(a, out_dir):
    """TRL's DistillationTrainer in this process: step times and the peak resident set (MB)."""
    import datasets
    import torch
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import DistillationConfig, DistillationTrainer
    from plumbing import loading, tasks
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    device = torch.device("cpu")
    name, teacher, prompts, new_tokens, temp, lr, _ = settings(a)
    name = name or loading.DEFAULT_POLICY
    tok = loading.load_tokenizer(name)  # left padding
    student = loading.load_model(name, "lm", device)
    teacher = loading.load_model(teacher, "lm", device, frozen=True)
    if a.real:  # chat-sums' training prompts, as distill.py draws them
        rows = [{"prompt": r["prompt"]} for r in tasks.load_data("chat-sums", 4).next_batch(
            random.Random(a.seed), prompts * a.steps)]
    else:
        pairs = tasks.task_train_pairs(random.Random(a.seed), prompts * a.steps)
        rows = [{"prompt": tasks.addition_row(x, y)["prompt"]} for x, y in pairs]
    times = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.t0)
    cfg = DistillationConfig(
        output_dir=out_dir, max_steps=a.steps, per_device_train_batch_size=prompts,
        gradient_accumulation_steps=1, max_completion_length=new_tokens, temperature=temp,
        top_p=1.0, top_k=0, beta=BETA, learning_rate=lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, disable_dropout=True,
        gradient_checkpointing=False, shuffle_dataset=False, seed=a.seed, use_cpu=True,
        bf16=False, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=cfg,
                                  processing_class=tok, callbacks=[StepTimer()],
                                  train_dataset=datasets.Dataset.from_list(rows))
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer.train()
    return times, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def mean(xs):
    return sum(xs) / len(xs) if xs else float("nan")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", default="", help="the teacher's folder (a GRPO checkpoint)")
    p.add_argument("--real", action="store_true", help="SmolLM2-135M-Instruct on chat-sums")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3, help="first steps left out of the s/step mean")
    p.add_argument("--threads", type=int, default=1, help="torch threads for both")
    p.add_argument("--trl_only", action="store_true", help="(internal) TRL's run, as JSON")
    a = p.parse_args()
    if not a.real and not a.teacher:
        sys.exit("error: --teacher DIR (a GRPO checkpoint of the bundled task), or --real")
    try:
        import trl
    except ImportError:
        sys.exit("error: bench/trl_distill.py needs TRL (pip install trl); not a minrl dependency")
    if a.trl_only:
        with tempfile.TemporaryDirectory() as tmp:
            times, peak = run_trl(a, tmp)
        print(json.dumps({"times": times, "peak_mem_mb": peak}))
        return
    with tempfile.TemporaryDirectory() as tmp:
        metrics, summary = run_distill_py(a, os.path.join(tmp, "distill"))
    out = subprocess.run([sys.executable, __file__, "--trl_only", "--teacher", a.teacher,
                          "--steps", str(a.steps), "--seed", str(a.seed), "--threads",
                          str(a.threads), *(["--real"] if a.real else [])], check=True,
                         capture_output=True, text=True, cwd=ROOT)
    theirs = json.loads(out.stdout.strip().splitlines()[-1])
    ours_t = mean([m["step_time"] for m in metrics][a.warmup:])
    trl_t = mean(theirs["times"][a.warmup:])
    res = {"steps": a.steps, "seed": a.seed, "threads": a.threads, "trl": trl.__version__,
           "real": a.real,
           "distill_py": {"s_per_step": ours_t, "peak_mem_mb": summary["peak_mem_mb"]},
           "trl_distillation": {"s_per_step": trl_t, "peak_mem_mb": theirs["peak_mem_mb"]},
           "distill_over_trl_time": ours_t / trl_t}
    task = "SmolLM2-135M-Instruct, chat-sums" if a.real else "bundled"
    print(f"{a.steps} steps x {settings(a)[2]} completions, {task}, seed {a.seed}, "
          f"{a.threads} threads; "
          f"s/step = mean over steps {a.warmup + 1}..{a.steps}")
    print(f"{'':22}{'s/step':>10}{'peak MB':>10}")
    for name, key in (("distill.py", "distill_py"), (f"TRL {trl.__version__}",
                                                     "trl_distillation")):
        print(f"{name:22}{res[key]['s_per_step']:>10.3f}{res[key]['peak_mem_mb']:>10.0f}")
    print(f"distill.py / TRL time per step: {res['distill_over_trl_time']:.2f}x")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
