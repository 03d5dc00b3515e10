"""Where one real-model step goes: distill.py --loss jsd (or opd) against TRL's
DistillationTrainer, phase by phase, in alternating processes (bench/trl_distill.py's settings).

  python bench/distill_phases.py --rounds 2 --steps 3 --prompts 16        # SmolLM2, chat-sums
  python bench/distill_phases.py --only distill --loss opd --steps 3        # one side only
  python bench/distill_phases.py --before ../old       # and distill.py of another checkout

Each round runs distill.py (in-process: `distill.main()`, its functions wrapped by timers), then
TRL's trainer (`trainer.train()`, wrapped the same way), each in a fresh subprocess, so each peak
resident set is its own; the order flips every round. Both run the same prompts (chat-sums'
training draw of seed 0), SmolLM2-135M-Instruct as student and a frozen copy as teacher, fp32 on
the CPU, one completion a prompt, 10 new tokens, temperature 0.7, lr 2e-5, beta 1, no gradient
checkpointing. The phases (wall and CPU seconds a step, the mean over the steps after the first):
  sample     distill.py: common.generate (--loss jsd: its prefill is the student's forward of the
             prompts, with gradients, for the training step); TRL: DistillationTrainer._generate
  teacher    the teacher's forward to its final hidden states (or opd: its log-probs)
  student    the student's forward to its final hidden states (opd: its log-probs, with grad;
             distill.py --loss jsd: the completions only, after the prompts' kept forward)
  loss       the chunked divergence over both LM heads (forward); TRL: _chunked_divergence_loss
  backward   loss.backward()
  optimizer  grad clipping + AdamW's step
  step       the whole step (distill.py's step_time; TRL: on_step_begin -> on_step_end)
The last stdout line is the JSON of every round.
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
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
PHASES = ("sample", "teacher", "student", "loss", "backward", "optimizer", "step")


class Timers:
    """Per-step sums of wall and CPU seconds by phase; `step` is advanced by the caller."""

    def __init__(self):
        self.step, self.on = -1, True
        self.wall, self.cpu = defaultdict(float), defaultdict(float)

    def wrap(self, fn, phase):
        def timed(*a, **kw):
            if not self.on or self.step < 0:
                return fn(*a, **kw)
            name = phase(a, kw) if callable(phase) else phase
            w, c = time.perf_counter(), time.process_time()
            try:
                return fn(*a, **kw)
            finally:
                self.wall[self.step, name] += time.perf_counter() - w
                self.cpu[self.step, name] += time.process_time() - c
        return timed

    def table(self, skip=1):
        steps = sorted({s for s, _ in self.wall} - set(range(skip)))
        return {p: [sum(self.wall[s, p] for s in steps) / max(1, len(steps)),
                    sum(self.cpu[s, p] for s in steps) / max(1, len(steps))] for p in PHASES}


def patch_common(t):
    """Backward, clipping and AdamW's step: the same torch functions in both."""
    import torch
    torch.Tensor.backward = t.wrap(torch.Tensor.backward, "backward")
    torch.nn.utils.clip_grad_norm_ = t.wrap(torch.nn.utils.clip_grad_norm_, "optimizer")
    state = {}

    def pre(opt, a, kw):
        state["w"], state["c"] = time.perf_counter(), time.process_time()

    def post(opt, a, kw):
        if t.step >= 0 and "w" in state:
            t.wall[t.step, "optimizer"] += time.perf_counter() - state["w"]
            t.cpu[t.step, "optimizer"] += time.process_time() - state["c"]
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)
    register_optimizer_step_pre_hook(pre)
    register_optimizer_step_post_hook(post)


def run_distill(a, out_dir):
    if a.tree:  # another checkout's distill.py, common.py, fastpath.py (a before/after)
        sys.path.insert(0, os.path.abspath(a.tree))
    import torch
    import common
    import distill
    t = Timers()
    patch_common(t)
    generate = common.generate

    def gen(*args, **kw):  # a training step's sampling starts a step (the eval's does not)
        if t.on:
            t.step += 1
        return t.wrap(generate, "sample")(*args, **kw)
    common.generate = gen
    evaluate = common.evaluate

    def ev(*args, **kw):
        t.on = False
        try:
            return evaluate(*args, **kw)
        finally:
            t.on = True
    common.evaluate = ev
    grad = lambda a_, kw: "student" if torch.is_grad_enabled() else "teacher"  # noqa: E731
    distill.final_hidden = t.wrap(distill.final_hidden, grad)
    distill.chunked_divergence = t.wrap(distill.chunked_divergence, "loss")
    common.token_logprobs = t.wrap(common.token_logprobs, grad)  # opd
    sys.argv = ["distill.py", "--model", a.model, "--data", "chat-sums", "--teacher", a.model,
                "--loss", a.loss, "--beta", "1", "--output_dir", out_dir,
                "--micro_batch_size", str(a.prompts), "--max_steps", str(a.steps),
                "--prompts_per_step", str(a.prompts), "--samples_per_prompt", "1",
                "--max_new_tokens", "10", "--temperature", "0.7", "--lr", "2e-5",
                "--eval_every", "0", "--eval_size", "4", "--save_every", "0",
                "--samples_every", "0", "--threads", str(a.threads), "--seed", str(a.seed)]
    distill.main()
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        times = [json.loads(line)["step_time"] for line in f]
    for s, st in enumerate(times):  # its own clock (CPU seconds: not split from the logging)
        t.wall[s, "step"], t.cpu[s, "step"] = st, float("nan")
    return t.table()


def run_trl(a, out_dir):
    import datasets
    import torch
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback, ProgressCallback
    from trl import DistillationConfig, DistillationTrainer
    from trl.trainer import distillation_trainer as dt
    from plumbing import loading, tasks
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    t = Timers()
    patch_common(t)
    device = torch.device("cpu")
    tok = loading.load_tokenizer(a.model)
    student = loading.load_model(a.model, "lm", device)
    teacher = loading.load_model(a.model, "lm", device, frozen=True)
    rows = [{"prompt": r["prompt"]} for r in tasks.load_data("chat-sums", 4).next_batch(
        random.Random(a.seed), a.prompts * a.steps)]

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            t.step += 1
            self.w, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):
            t.wall[t.step, "step"] += time.perf_counter() - self.w
            t.cpu[t.step, "step"] += time.process_time() - self.c
    cfg = DistillationConfig(
        output_dir=out_dir, max_steps=a.steps, per_device_train_batch_size=a.prompts,
        gradient_accumulation_steps=1, max_completion_length=10, temperature=0.7,
        top_p=1.0, top_k=0, beta=1.0, learning_rate=2e-5, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, disable_dropout=True,
        gradient_checkpointing=False, shuffle_dataset=False, seed=a.seed, use_cpu=True,
        bf16=False, report_to="none", save_strategy="no", logging_steps=1, disable_tqdm=True)
    trainer = DistillationTrainer(model=student, teacher_model=teacher, args=cfg,
                                  processing_class=tok, callbacks=[StepTimer()],
                                  train_dataset=datasets.Dataset.from_list(rows))
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    trainer._generate = t.wrap(trainer._generate, "sample")
    grad = lambda a_, kw: "student" if torch.is_grad_enabled() else "teacher"  # noqa: E731
    trainer._get_last_hidden_state = t.wrap(trainer._get_last_hidden_state, grad)
    dt._chunked_divergence_loss = t.wrap(dt._chunked_divergence_loss, "loss")
    trainer.train()
    return t.table()


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=3, help="steps a run; the first is left out")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--loss", default="jsd", choices=["jsd", "opd"], help="distill.py's loss")
    p.add_argument("--only", default="", choices=["", "distill", "trl"])
    p.add_argument("--before", default="", help="also time distill.py of this checkout (a "
                   "folder: git worktree add DIR COMMIT), as 'before'")
    p.add_argument("--tree", default="", help="(internal) the checkout distill.py comes from")
    p.add_argument("--side", default="", help="(internal) run one side, print its JSON")
    a = p.parse_args()
    if a.side:
        with tempfile.TemporaryDirectory() as tmp:
            res = (run_distill if a.side == "distill" else run_trl)(a, os.path.join(tmp, "o"))
        res["peak_mem_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(json.dumps(res))
        return
    sides = [a.only] if a.only else ["distill", "trl"]
    sides += ["before"] if a.before else []
    rounds = []
    for r in range(a.rounds):
        res = {}
        for side in sides if r % 2 == 0 else sides[::-1]:
            load0 = open("/proc/loadavg").read().split()[0]
            cmd = [sys.executable, os.path.abspath(__file__), "--side",
                   "trl" if side == "trl" else "distill", f"--tree={a.before * (side == 'before')}"
                   ] + [f"--{k}={v}" for k, v in vars(a).items()
                        if k not in ("side", "only", "rounds", "before", "tree")]
            out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
            if out.returncode:
                sys.exit(f"{side} failed: {out.stderr[-3000:]}")
            res[side] = json.loads(out.stdout.strip().splitlines()[-1])
            res[side]["load"] = [load0, open("/proc/loadavg").read().split()[0]]
        rounds.append(res)
        print(f"round {r + 1}: wall s/step (CPU s/step), the mean of steps 2..{a.steps}, "
              f"{a.prompts} prompts, {a.threads} threads, distill.py --loss {a.loss}")
        print(f"{'phase':10}" + "".join(f"{s:>22}" for s in res))
        for ph in PHASES:
            print(f"{ph:10}" + "".join(f"{res[s][ph][0]:>12.2f} ({res[s][ph][1]:>6.2f})"
                                      for s in res))
        print(f"{'peak MB':10}" + "".join(f"{res[s]['peak_mem_mb']:>22.0f}" for s in res))
        print(f"{'load':10}" + "".join(f"{' -> '.join(res[s]['load']):>22}" for s in res))
        for side in ("distill", "before"):
            if side in res and "trl" in res:
                print(f"{side} / TRL step: {res[side]['step'][0] / res['trl']['step'][0]:.2f}x")
        sys.stdout.flush()
    print(json.dumps(rounds))


if __name__ == "__main__":
    main()
