"""tools/compare.py: REINFORCE, RLOO, PPO and GRPO side by side on the bundled task, with the same
sample budget (completions seen) and N seeds each.

    python tools/compare.py                  # 2 seeds x 5,120 completions (80 steps of 64)
    python tools/compare.py --quick          # 1 seed x 2,048 completions (32 steps)
    python tools/compare.py --task calc      # the calculator tool task (--env calc; its score is
                                             # mean@4 sampled, see docs/tool_use.md)
    python tools/compare.py --output_dir DIR # again into DIR: finished runs are read, not rerun

Each run is the script itself (reinforce.py, ppo.py or grpo.py: its defaults, plus the flags in
ALGOS; each samples 64 completions per step), run as a subprocess with --output_dir
DIR/<name>-s<seed>.
This file only reads what the scripts write: summary.json (held-out score before and after, wall
time, peak memory), metrics.jsonl (per step; "eval" every --eval_every steps) and checkpoint/,
from which it measures KL(pi || pi_ref) the same way for every run (see final_kl; reinforce.py
with beta 0 logs no KL, and the others log different estimators).
The gradient-noise proxies: the std over steps of grad_norm (before clipping; every script) and
reinforce.py's sample_grad_rms (see reinforce.sample_grad_probe). With matplotlib it draws
DIR/compare.png: held-out score vs completions seen and vs seconds of training, the KL each
script logs, and the noise proxies.
"""
import argparse
import os
import statistics
import subprocess
import sys
import time

import plot as P  # tools/plot.py: reads run folders, draws panels

ROOT = P.ROOT
PER_STEP = 64
ALGOS = {  # name: (script, flags): the same 64 completions per step for each
    "reinforce": ("reinforce.py", "--baseline none --prompts_per_step 8 --samples_per_prompt 8"),
    "rloo": ("reinforce.py", "--baseline rloo --prompts_per_step 8 --samples_per_prompt 8"),
    "ppo": ("ppo.py", "--batch_size 64"),  # the reward model's score; critic from the RM
    "ppo-math": ("ppo.py", "--batch_size 64 --rewards math --critic_init policy"),
    "grpo": ("grpo.py", "--prompts_per_step 8 --group_size 8"),
}


def run_all(a):
    """Run every (seed, algo) not finished yet, one at a time. Returns {name: [run folders]}."""
    steps = max(1, a.samples // PER_STEP)
    done, todo = {}, [(s, n) for s in range(a.seeds) for n in a.algos]
    env = "calc" if a.task == "calc" else ""  # --env calc: its model, data, rewards and eval
    for i, (seed, name) in enumerate(todo, 1):
        folder = os.path.join(a.out, f"{name}-s{seed}")
        done.setdefault(name, [])
        summary = P.read_summary(folder)
        same = {"max_steps": steps, "eval_size": a.eval_size, "seed": seed, "env": env}
        if summary and not summary.get("interrupted"):
            if any(summary["args"].get(k, "") != v for k, v in same.items()):
                raise SystemExit(f"error: {folder} holds a run with other settings (steps or "
                                 "eval size): choose another --output_dir")
            print(f"[{i}/{len(todo)}] {name} seed {seed}: finished before, read from {folder}")
            done[name].append(folder)
            continue
        if os.path.exists(folder):
            print(f"[{i}/{len(todo)}] {name} seed {seed}: {folder} holds an unfinished run; "
                  "remove it to run it again")
            continue
        script, flags = ALGOS[name]
        if env:  # the calc preset sets ppo's score (math) and critic (from the policy)
            flags = " ".join(f for f in flags.split() if f not in ("--rewards", "math",
                                                                    "--critic_init", "policy"))
            flags += " --env calc"
        cmd = [sys.executable, os.path.join(ROOT, script), *flags.split(), "--seed", str(seed),
               "--max_steps", str(steps), "--eval_size", str(a.eval_size),
               "--eval_every", str(max(1, steps // a.eval_points)), "--save_every", "0",
               "--output_dir", folder]
        t0 = time.time()
        with open(folder + ".log", "w") as log:
            log.write(" ".join(cmd) + "\n\n")
            log.flush()
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
        if rc == 130:  # Ctrl-C reached the script too: it saved, so stop here
            raise SystemExit(f"interrupted: rerun with --output_dir {a.out} to go on")
        status = "done" if rc == 0 else f"FAILED (exit {rc}; see {folder}.log)"
        print(f"[{i}/{len(todo)}] {name} seed {seed}: {status} in {time.time() - t0:.0f} s")
        if rc == 0:
            done[name].append(folder)
    return done


def models_held(args, algo):
    """(models in memory, of which trained): policy, reference, critic, reward model."""
    uses_rm = "rm" in [p.split("=")[0] for p in (args["rewards"] or
                                                 ("rm" if algo == "ppo" else "math")).split(",")]
    has_ref = args.get("kl_coef" if algo == "ppo" else "beta", 0) > 0 and not args["lora_r"]
    trained = 2 if algo == "ppo" else 1
    return trained + has_ref + uses_rm, trained


def final_kl(folder, k):
    """KL(pi || pi_ref) in nats per completion, from the final checkpoint: k samples per held-out
    prompt at the run's temperature; at each completion token, the exact KL between the two
    next-token distributions (a sum over the vocabulary: >= 0, and less noisy than k1), summed
    over the completion. Its expectation is the sequence-level KL."""
    import torch
    from transformers.utils import logging
    sys.path.insert(0, ROOT)
    import common as C
    import engine
    from plumbing import calc, envs as E
    from plumbing import loading
    from plumbing import tasks
    logging.disable_progress_bar()
    args, device = P.run_args(folder), torch.device("cpu")
    env = E.load_env(args.get("env", ""))  # the calc task: multi-turn rollouts, its own rows
    torch.manual_seed(0)
    policy = loading.load_model(os.path.join(folder, "checkpoint"), "lm", device, frozen=True)
    ref = loading.load_model(args["model"], "lm", device, frozen=True)
    tok = loading.load_tokenizer(args["model"])
    data = calc.calc_data(args["eval_size"]) if env else tasks.load_data("", args["eval_size"])
    rows = data.eval_rows
    rows = [r for r in rows for _ in range(k)]
    prompt_ids = C.encode_prompts(tok, [r["prompt"] for r in rows], args["chat_template"])
    total = 0.0
    for i in range(0, len(prompt_ids), 256):
        # with env, KL at the model's tokens only: completion_mask is 0 on observations
        kw = dict(temperature=args["temperature"], top_p=args["top_p"], stop=args["stop"])
        if env:  # multi-turn: engine.sample, with the episodes' env_step
            env_step = env.start(rows[i:i + 256], tok, args["max_turns"])[0]
            roll = engine.sample(policy, tok, prompt_ids[i:i + 256], args["max_new_tokens"],
                                 env_step, **kw)
        else:
            roll = C.sample(policy, tok, prompt_ids[i:i + 256], args["max_new_tokens"], **kw)
        pos = C.positions(roll.attention_mask)
        logp = [(m(input_ids=roll.ids, attention_mask=roll.attention_mask, position_ids=pos)
                 .logits[:, roll.P - 1:-1].float() / args["temperature"]).log_softmax(-1)
                for m in (policy, ref)]  # (B, T, V): next-token log-probs at each completion token
        kl = (logp[0].exp() * (logp[0] - logp[1])).sum(-1)  # (B, T)
        total += float((kl * roll.completion_mask).sum())
    return total / len(prompt_ids)


def table(done, kl_samples):
    """One row per algorithm: means over seeds (the after score: mean, then min-max)."""
    head = ["algorithm", "before", "after", "wall s", "models (trained)", "peak MB",
            "KL/compl.", "grad_norm std", "sample_grad_rms"]
    out = [head]
    for name, folders in done.items():
        if not folders:
            out.append([name, "failed"] + [""] * (len(head) - 2))
            continue
        sums = [P.read_summary(f) for f in folders]
        after = [s["eval_after"] for s in sums]
        spread = f" ({min(after):.2f}-{max(after):.2f})" if len(after) > 1 else ""
        lines = [P.read_metrics(f) for f in folders]
        rms = [m["sample_grad_rms"] for ls in lines for m in ls if "sample_grad_rms" in m]
        noise = [statistics.pstdev([m["grad_norm"] for m in ls]) for ls in lines]
        kl = statistics.mean(final_kl(f, kl_samples) for f in folders) if kl_samples else None
        held, trained = models_held(sums[0]["args"], sums[0]["algo"])
        mean = statistics.mean
        out.append([name, f"{mean(s['eval_before'] for s in sums):.3f}",
                    f"{mean(after):.3f}{spread}", f"{mean(s['wall_time_s'] for s in sums):.0f}",
                    f"{held} ({trained})", f"{mean(s['peak_mem_mb'] for s in sums):.0f}",
                    "-" if kl is None else f"{kl:.3f}", f"{mean(noise):.3f}",
                    f"{mean(rms):.3f}" if rms else "-"])
    widths = [max(len(r[i]) for r in out) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in out)


def figure(done, path, score="held-out greedy accuracy"):
    """compare.png: held-out score vs completions seen and vs seconds of training, the KL each
    script logs, and the two noise proxies."""
    def lines(metric, x):  # one line per run; one colour and one legend entry per algorithm
        out = []
        for i, (name, folders) in enumerate(done.items()):
            for j, f in enumerate(folders):
                xs, ys = P.curve(f, metric, x)
                if any(ys):  # reinforce.py with beta 0 logs a KL of 0: no reference, no line
                    out.append((None if j else name, xs, ys, i))
        return out

    samples = P.XLABELS["samples"]
    panels = [(score, samples, lines("eval", "samples")),
              (score, P.XLABELS["time"], lines("eval", "time")),
              ("KL per token, as logged (grpo: k3; ppo: k1)", samples, lines("kl", "samples")),
              ("grad_norm (before clipping; ppo: mean of its updates)", samples,
               lines("grad_norm", "samples")),
              ("sample_grad_rms (reinforce.py's per-sample gradient RMS)", samples,
               lines("sample_grad_rms", "samples"))]
    return P.draw(panels, path, cols=3)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__[__doc__.find("Each run"):],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1 seed, 2,048 completions, 200 prompts")
    p.add_argument("--task", choices=["add", "calc"], default="add",
                   help="add: the bundled addition task; calc: the calculator tool task")
    p.add_argument("--seeds", type=int, help="seeds 0..N-1 (default 2; --quick 1)")
    p.add_argument("--samples", type=int, help="completions per run (default 5120; --quick 2048)")
    p.add_argument("--eval_size", type=int, help="held-out prompts (default 500; --quick 200)")
    p.add_argument("--eval_points", type=int, default=8, help="held-out evals during each run")
    p.add_argument("--kl_samples", type=int, default=4, help="per prompt for the KL; 0: skip it")
    p.add_argument("--algos", default=",".join(ALGOS), help=f"comma list of {', '.join(ALGOS)}")
    p.add_argument("--output_dir", "--out", dest="out", default="",
                   help="the folder (default runs/compare-<time>)")
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", 1)),
                   help="torch threads per run (default: OMP_NUM_THREADS, else 1: on the bundled "
                   "model 2 threads gain 1.3x idle but lose 3x beside one busy process)")
    p.error = lambda message: p.exit(2, f"error: {message}; see --help\n")  # one line, no usage
    a = p.parse_args(argv)
    for name, quick, full in (("seeds", 1, 2), ("samples", 2048, 5120), ("eval_size", 200, 500)):
        if getattr(a, name) is None:  # not given: the preset's
            setattr(a, name, quick if a.quick else full)
    for name, least in (("seeds", 1), ("samples", 1), ("eval_size", 1), ("eval_points", 0),
                        ("kl_samples", 0), ("threads", 1)):
        if getattr(a, name) < least:
            p.error(f"--{name} must be >= {least}, not {getattr(a, name)}")
    if a.seeds > 100:  # each seed runs every algorithm: 100 are days on a CPU already
        p.error(f"--seeds must be <= 100, not {a.seeds}")
    if a.threads > 4 * (os.cpu_count() or 1):  # the scripts' own --threads range
        p.error(f"--threads must be <= {4 * (os.cpu_count() or 1)} (4 per core), not {a.threads}")
    if a.out and os.path.exists(a.out) and not os.path.isdir(a.out):
        p.error(f"--output_dir {a.out}: that is a file, not a folder")
    a.algos = [n for n in a.algos.split(",") if n and not (a.task == "calc" and n == "ppo-math")]
    if not set(a.algos) <= set(ALGOS):
        p.error(f"--algos: unknown {sorted(set(a.algos) - set(ALGOS))}; known: {list(ALGOS)}")
    twice = sorted({n for n in a.algos if a.algos.count(n) > 1})
    if twice:  # the second would read the first's runs, and the count of finished runs is off
        p.error(f"--algos names {', '.join(twice)} twice")
    if not a.algos:  # nothing would run, and the table would be empty
        calc = " (--task calc leaves out ppo-math)" if a.task == "calc" else ""
        p.error(f"--algos names no algorithm{calc}; known: {list(ALGOS)}")
    os.environ["OMP_NUM_THREADS"] = str(a.threads)  # the runs' torch threads, and final_kl's
    task = "-calc" if a.task == "calc" else ""  # (calc: ppo already scores math, see run_all)
    a.out = a.out or os.path.join(ROOT, "runs", f"compare{task}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(a.out, exist_ok=True)
    steps = max(1, a.samples // PER_STEP)
    print(f"runs go to {a.out}/: {len(a.algos)} algorithms x {a.seeds} seeds, {steps} steps of "
          f"{PER_STEP} completions each, {a.eval_size} held-out prompts, {a.threads} torch "
          "thread(s) per run")
    done = run_all(a)
    score = "held-out mean@4 sampled accuracy" if task else "held-out greedy accuracy"
    print(f"\n{score} on {a.eval_size} prompts; means over {a.seeds} seed(s); "
          f"{steps * PER_STEP} completions per run")
    print(table(done, a.kl_samples))
    print("wall s: summary.json's wall_time_s (loading, evals and training; not imports). models:"
          " held in memory, of which trained.\nKL/compl.: KL(pi || pi_ref) in nats per "
          f"completion, measured here ({a.kl_samples} samples per prompt, exact per token).")
    plot = figure({k: v for k, v in done.items() if v}, os.path.join(a.out, "compare.png"), score)
    print(f"\nwrote {plot}" if plot.endswith(".png") else f"\n{plot} (no compare.png)")
    print("where each curve's data lives (metrics.jsonl: eval, kl, grad_norm, sample_grad_rms, "
          "step_time; summary.json: eval before/after):")
    for name, folders in done.items():
        print(f"  {name:<10} {', '.join(folders) or 'no finished run'}")
    print(f"more curves: python tools/plot.py {a.out}/*-s0 --metric reward --metric entropy")
    return 0 if all(len(v) == a.seeds for v in done.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
