"""tools/check_docs.py: re-run the results the docs quote and print those that drifted.

A number in README.md, docs/*.md or EXERCISES.md is a claim, and claims get checked. CLAIMS below
lists each one: the file, the text that quotes it (the number in {braces}), the command that
produces it, how to read the number from the run (summary.json, metrics.jsonl or the command's
stdout) and a tolerance. Every run is seed-exact on one CPU, so a tolerance of 0 means the
measured value, rounded to the digits quoted, is the quoted text. Wall times vary with the
machine's load: their tolerance is relative (WALL: a third to three times the quoted time).

    python tools/check_docs.py --list              # the claims and their commands, nothing run
    python tools/check_docs.py --only README       # claims whose file, text, command or tag match
    python tools/check_docs.py --only calc         # the tool-use (--env calc) claims
    python tools/check_docs.py --skip calc         # the others (--only, --skip: repeat for more)
    python tools/check_docs.py --keep DIR          # keep the runs in DIR; again: only new ones run
    python tools/check_docs.py --fast              # the static claims (counts, line costs,
                                                   # the real task's sizes): seconds
    python tools/check_docs.py                     # every claim: hours on a 2-core CPU

Each distinct command runs once, in a temporary folder ({run} is its run folder, added as
--output_dir when the command does not name it; {tmp} is a scratch folder beside it), one at a
time, from the repository root. Prints `ok FILE: X (command)` or `DRIFT FILE: quoted X, measured Y
(command)` as each command finishes, `MISSING` where a file no longer holds a claim's text, and
exits 1 if anything drifted. The claims tagged fast run no training; `--fast` checks them alone,
after a report of each module's lines against README's budget; .ci/run runs it before the test
suite, so a stale count fails CI, while a student's edit that moves one still passes the README's
test command. The rest train: run them by hand.
"""
import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WALL = 2.0  # wall times (idle machine): a third to three times the quoted one on a loaded one
S = "--max_steps 60 --eval_size 200 --eval_every 20 --save_every 0"  # EXERCISES.md's $S
MU4 = "--num_iterations 4"  # docs/policy_losses.md: four updates on each batch
NOCLIP = " --clip_eps 1000 --clip_eps_high 1000"  # EXERCISES.md 4: no clip
REINFORCE = "python reinforce.py --baseline none"  # the default baseline
CALC = "python grpo.py --env calc --seed 0"  # the calculator task (tag calc)
SFT = "python sft.py --output_dir {tmp}/sft"  # docs/pipeline.md's first stage
# the README's my_rewards.py, cut out of the README, with its command
OWN_REWARD = ("sed -n '/^# my_rewards.py$/,/^```$/p' README.md | sed '$d' > {tmp}/my_rewards.py && "
              "python grpo.py --reward_fn {tmp}/my_rewards.py:exact,{tmp}/my_rewards.py:short "
              "--rewards exact=1,short=0.5")


# --------------------------------------------------------------------------- how to read a run
def summary(key):
    return lambda r: r["summary"][key]


AFTER, BEFORE, WALL_S = summary("eval_after"), summary("eval_before"), summary("wall_time_s")


def greedy_after(r):  # --env calc: the greedy held-out score beside the sampled one
    return r["summary"]["evals"]["after"]["eval_greedy"]


def mean(key, first=None, last=None):
    """The mean of a metrics.jsonl key over the first n steps (first=n) or the last n (last=n)."""
    def read(r):
        xs = [m[key] for m in r["metrics"] if key in m]
        xs = xs[:first] if first else xs[-last:] if last else xs
        return sum(xs) / len(xs)
    return read


def at_step(step, key="eval"):
    """A metrics.jsonl key at one step (held-out evals are logged at their steps)."""
    return lambda r: next(m[key] for m in r["metrics"] if m["step"] == step)


EVALS = (at_step(20), at_step(40), AFTER)  # EXERCISES.md: "held-out at steps 20 / 40 / 60"


def per_step(key):
    """A summary.json number divided by the run's steps (wall_time_s: seconds per step)."""
    return lambda r: r["summary"][key] / r["summary"]["steps"]


def over_runs(read, pick):
    """pick (min, max, a mean) of read over a claim's runs (a tuple of commands: its seeds)."""
    return lambda runs: pick([read(r) for r in runs])


def seeds(flags):  # docs/policy_losses.md: grpo.py over seeds 0, 1, 2
    return tuple(f"python grpo.py --seed {s} {flags}" for s in range(3))


def mark(values, k):
    """' / '.join(values) with the k-th in braces: one claim per number of a table cell."""
    return " / ".join(re.sub(r"[\d.]+", lambda m: "{" + m[0] + "}", v) if i == k else v
                      for i, v in enumerate(values))


def first_last(key):  # "first / last 10 steps": the mean of each
    return mean(key, first=10), mean(key, last=10)


def row(file, before, values, after, command, reads, tol=0, tags=()):
    """One claim per number of a table cell "before v1 / v2 / ... after", each read by its own
    reader (reads[k]). A number in ** (bold) is quoted without them."""
    return [(file, before + mark(values, k) + after, command, read, tol, tags)
            for k, read in enumerate(reads)]


def cpu_seconds(r):
    """User + system CPU seconds, as `/usr/bin/time -f 'CPU %U user %S system'` reports them."""
    user, system = re.search(r"CPU ([\d.]+) user ([\d.]+) system", r["stderr"]).groups()
    return float(user) + float(system)


def stdout(pattern):
    """The first group of a regular expression in the command's stdout."""
    return lambda r: float(re.search(pattern, r["stdout"]).group(1))


STEP_LINES = stdout(r"\.py(?: --\w+)*: (\d+) lines")  # tools/step_cost.py's count: the whole reach
READER_LINES = stdout(r"reader's (\d+) lines")  # and the algorithm reader's
FAST = ("fast",)  # no training: seconds (--fast; .ci/run)
# the real-model task's sizes and defaults (docs/real_model.md), from plumbing/chat_sums.py
SUMS = ("python -c \"from plumbing import chat_sums as c; tr, te = c.split(); n = c.PRESET["
        "'eval_size']; print('problems', 54, 'held', c.HELD_OUT, 'test', len(te), 'train', len(tr),"
        " 'shown', sum(x[3] for x in te[:n]), 'not', n - sum(x[3] for x in te[:n]))\"")
PRESET = "python -c \"from plumbing import chat_sums as c; print(c.PRESET)\""


def preset(key):  # a value of chat_sums.PRESET, as the command prints the dict
    return stdout(rf"'{key}': ([\d.e-]+)")


# ----------------------------------------------------------------------------------- the claims
# (file, text with the number in {braces}, command, how to read it, tolerance, tags)
CLAIMS = [
    # README.md: the scripts table and its neighbours
    ("README.md", "held-out accuracy {0.29} -> about 0.99", "python grpo.py", BEFORE, 0, ()),
    ("README.md", "| 0.292 → {0.996}, 200 steps, 12 s |", "python grpo.py", AFTER, 0, ()),
    ("README.md", "| 0.292 → 0.996, 200 steps, {12} s |", "python grpo.py", WALL_S, WALL, ()),
    ("README.md", "| {0.292} → 0.998 (`--baseline none`", REINFORCE, BEFORE, 0, ()),
    ("README.md", "| 0.292 → {0.998} (`--baseline none`", REINFORCE, AFTER, 0, ()),
    ("README.md", "the default), 300 steps, {14} s |", REINFORCE, WALL_S, WALL, ()),
    ("README.md", "| 0.292 → {0.954}, 120 steps, 70 s |", "python ppo.py", AFTER, 0, ()),
    ("README.md", "| 0.292 → 0.954, 120 steps, {70} s |", "python ppo.py", WALL_S, WALL, ()),
    ("README.md", "| 0.292 → {0.928}, 60 steps, 5 s |", "python sft.py", AFTER, 0, ()),
    ("README.md", "| 0.292 → 0.928, 60 steps, {5} s |", "python sft.py", WALL_S, WALL, ()),
    ("README.md", "held-out pair accuracy {0.898}, 300 steps", "python reward_model.py", AFTER, 0,
     ()),
    ("README.md", "0.898, 300 steps, {34} s", "python reward_model.py", WALL_S, WALL, ()),
    ("README.md", "| 0.292 → {0.834}, 150 steps, 18 s |", "python dpo.py", AFTER, 0, ()),
    ("README.md", "| 0.292 → 0.834, 150 steps, {18} s |", "python dpo.py", WALL_S, WALL, ()),
    ("README.md", "`EXERCISES.md` has {19} \"change one line",
     "grep -c '^## [0-9]' EXERCISES.md", stdout(r"(\d+)"), 0, FAST),
    ("README.md", "goes {0.280}-0.294 → 0.896-0.936", CALC, BEFORE, 0, ("calc",)),
    ("README.md", "goes 0.280-{0.294} → 0.896-0.936", "python grpo.py --env calc --seed 1",
     BEFORE, 0, ("calc",)),
    ("README.md", "→ {0.896}-0.936", CALC, AFTER, 0, ("calc",)),
    ("README.md", "→ 0.896-{0.936}", "python grpo.py --env calc --seed 1", AFTER, 0, ("calc",)),
    ("README.md", "`frac_tool` (completions that call the tool) from {0.30} at step 1",
     CALC, at_step(1, "frac_tool"), 0, ("calc",)),
    ("README.md", "from 0.30 at step 1 to {1.00} at step 60", CALC,
     at_step(60, "frac_tool"), 0, ("calc",)),
    ("README.md", "0.292 → {0.994} (`short` gives", OWN_REWARD, AFTER, 0, ()),
    ("README.md", "Today grpo.py {922}", "python tools/step_cost.py grpo.py", STEP_LINES, 0,
     FAST),
    ("README.md", "(the reader's {480}", "python tools/step_cost.py grpo.py", READER_LINES, 0,
     FAST),
    ("README.md", "`--env` {1,087}", "python tools/step_cost.py grpo.py --env", STEP_LINES, 0,
     FAST),
    ("README.md", "1,087 and {602};", "python tools/step_cost.py grpo.py --env", READER_LINES,
     0, FAST),
    ("README.md", "`--objectives` {1,005}", "python tools/step_cost.py grpo.py --objectives",
     STEP_LINES, 0, FAST),
    ("README.md", "1,005 and {585})", "python tools/step_cost.py grpo.py --objectives",
     READER_LINES, 0, FAST),
    ("README.md", "ppo.py {903} (", "python tools/step_cost.py ppo.py", STEP_LINES, 0, FAST),
    ("README.md", "903 ({483})", "python tools/step_cost.py ppo.py", READER_LINES, 0, FAST),
    ("README.md", "reinforce.py {903} (", "python tools/step_cost.py reinforce.py",
     STEP_LINES, 0, FAST),
    ("README.md", "903 ({461})", "python tools/step_cost.py reinforce.py", READER_LINES, 0,
     FAST),
    ("docs/real_model.md", "{18} of the 54 problems", SUMS, stdout(r"held (\d+)"), 0, FAST),
    ("docs/real_model.md", "evaluates {128} of them, a seeded mix", SUMS,
     lambda r: stdout(r"shown (\d+)")(r) + stdout(r"not (\d+)")(r), 0, FAST),
    ("docs/real_model.md", "({528} prompts; the preset", SUMS, stdout(r"test (\d+)"), 0, FAST),
    ("docs/real_model.md", "a seeded mix: {67} with the example", SUMS, stdout(r"shown (\d+)"), 0,
     FAST),
    ("docs/real_model.md", "with the example, {61} without", SUMS, stdout(r"not (\d+)"), 0, FAST),
    ("docs/real_model.md", "training draws from the other {1,056}", SUMS, stdout(r"train (\d+)"),
     0, FAST),
    ("docs/real_model.md", "| `--max_new_tokens` | {10} |", PRESET, preset("max_new_tokens"), 0,
     FAST),
    ("docs/real_model.md", "| `--temperature` | {0.7} |", PRESET, preset("temperature"), 0, FAST),
    ("docs/real_model.md", "| `--lr` | {2e-5} |", PRESET, preset("lr"), 0.001, FAST),
    ("docs/real_model.md", "| `--beta` | {0} |", PRESET, preset("beta"), 0, FAST),
    ("docs/memory.md", "`fastpath.CHUNK_ELEMS` (2^22 floats, {16} MB)",
     "python -c \"import fastpath; print(fastpath.CHUNK_ELEMS * 4 / 2**20)\"", stdout(r"([\d.]+)"),
     0, FAST),
    ("docs/reliability.md", "(`--ppo_epochs` and `--num_iterations` at most {100})",
     "python -c \"import ppo; print(ppo.Args.__dataclass_fields__['ppo_epochs'].metadata)\"",
     stdout(r"<= (\d+)"), 0, FAST),

    ("ppo.py", "held-out greedy accuracy 0.292 -> {0.954}", "python ppo.py", AFTER, 0, ()),
    ("ppo.py", "the RM score from {1.7} to 4.8", "python ppo.py", mean("reward", first=10), 0, ()),
    ("ppo.py", "the RM score from 1.7 to {4.8}", "python ppo.py", mean("reward", last=10), 0, ()),
    ("ppo.py", "beside it, to {0.93}.", "python ppo.py", mean("gold", last=10), 0, ()),
    ("grpo.py", "held-out greedy accuracy from 0.29 to about {0.99}", "python grpo.py", AFTER, 0.01,
     ()),
    ("reinforce.py", "0.29 -> about {0.99} with rloo", "python reinforce.py --baseline rloo",
     AFTER, 0.01, ()),

    # docs/algorithms.md
    ("docs/algorithms.md", "| 0 | 0.292 | {0.996} | 12 s | 0.060 |", "python grpo.py", AFTER, 0,
     ()),
    ("docs/algorithms.md", "| 0 | 0.292 | 0.996 | 12 s | {0.060} |", "python grpo.py",
     per_step("wall_time_s"), WALL, ()),
    ("docs/algorithms.md", "| 1 | 0.292 | {0.992} | 12 s |", "python grpo.py --seed 1", AFTER, 0,
     ()),
    ("docs/algorithms.md", "| 2 | 0.292 | {0.996} | 12 s |", "python grpo.py --seed 2", AFTER, 0,
     ()),
    *[("docs/algorithms.md", f"| `python reinforce.py --baseline {b}` | 0.292 | {{{a}}} |",
       f"python reinforce.py --baseline {b}", AFTER, 0, ())
      for b, a in (("none", "0.998"), ("ema", "0.994"), ("rloo", "0.996"),
                   ("reinforce_pp", "0.998"))],
    ("docs/algorithms.md", "| 14 s | {0.32} / 0.02 |", "python reinforce.py --baseline none",
     mean("sample_grad_rms", first=25), 0, ()),
    ("docs/algorithms.md", "| 14 s | 0.32 / {0.02} |", "python reinforce.py --baseline none",
     mean("sample_grad_rms", last=200), 0, ()),
    ("docs/algorithms.md", "`--baseline rloo` over seeds 0, 1, 2: 0.292 -> 0.996, {1.000}, 0.994",
     "python reinforce.py --baseline rloo --seed 1", AFTER, 0, ()),
    ("docs/algorithms.md", "`--baseline rloo` over seeds 0, 1, 2: 0.292 -> 0.996, 1.000, {0.994}",
     "python reinforce.py --baseline rloo --seed 2", AFTER, 0, ()),
    ("docs/algorithms.md", "| 0 | 0.292 | {0.954} | 1.7 / 4.8 |", "python ppo.py", AFTER, 0, ()),
    ("docs/algorithms.md", "| 0 | 0.292 | 0.954 | {1.7} / 4.8 |", "python ppo.py",
     mean("reward", first=10), 0, ()),
    ("docs/algorithms.md", "| 0 | 0.292 | 0.954 | 1.7 / {4.8} |", "python ppo.py",
     mean("reward", last=10), 0, ()),
    ("docs/algorithms.md", "| 0 | 0.292 | 0.954 | 1.7 / 4.8 | {0.93} |", "python ppo.py",
     mean("gold", last=10), 0, ()),
    ("docs/algorithms.md", "| 1 | 0.292 | {0.912} |", "python ppo.py --seed 1", AFTER, 0, ()),
    ("docs/algorithms.md", "| 2 | 0.292 | {0.980} |", "python ppo.py --seed 2", AFTER, 0, ()),

    # docs/policy_losses.md: four updates on each batch, seeds 0, 1, 2
    *[("docs/policy_losses.md", f"| {name} | {mark(afters, s)} |",
       f"python grpo.py --seed {s} {MU4}{flags}", AFTER, 0, ())
      for name, flags, afters in (
          ("clip (token ratio, ε 0.2)", "", ("0.970", "0.968", "0.956")),
          ("GSPO (sequence ratio, ε 3e-4 / 4e-4)", " --importance_sampling_level sequence",
           ("0.986", "0.992", "0.934")),
          ("CISPO (weight clipped to [0.8, 1.2])", " --policy_loss cispo",
           ("0.872", "0.832", "0.866")),
          ("SAPO (τ 1.0 / 1.05)", " --policy_loss sapo", ("0.946", "0.878", "0.860")))
      for s in range(3)],
    *[claim for cell, flags, kl, mean_after in (  # cell: the clip_frac column
        ("| 0.020 |", "", ("0.29", "0.41"), "0.965"),
        ("| **0.315** |", " --importance_sampling_level sequence", ("0.30", "0.35"), "0.971"),
        ("| 0.036 (weights clipped) |", " --policy_loss cispo", ("0.39", "0.55"), "0.857"),
        ("| 0 (no clip) |", " --policy_loss sapo", ("0.38", "0.47"), "0.895"))
      for claim in (
          ("docs/policy_losses.md", f"{cell} {{{kl[0]}}}-{kl[1]} |", seeds(f"{MU4}{flags}"),
           over_runs(mean("kl", last=10), min), 0, ()),
          ("docs/policy_losses.md", f"{cell} {kl[0]}-{{{kl[1]}}} |", seeds(f"{MU4}{flags}"),
           over_runs(mean("kl", last=10), max), 0, ()),
          ("docs/policy_losses.md", f"| {{{mean_after}}} {cell}", seeds(f"{MU4}{flags}"),
           over_runs(AFTER, lambda xs: sum(xs) / len(xs)), 0, ()))],
    *[("docs/policy_losses.md", f"(held-out at step 100: {mark(('0.574', '0.614', '0.850'), s)})",
       f"python grpo.py --seed {s} {MU4} --policy_loss cispo", at_step(100), 0, ())
      for s in range(3)],

    # docs/pipeline.md
    ("docs/pipeline.md", "| `sft.py` (60 steps of 64 rows) | 0.292 | **{0.928}** |",
     "python sft.py", AFTER, 0, ()),
    ("docs/pipeline.md", "| `dpo.py` (150 steps of 32 rankings) | 0.928 | {0.908} |",
     f"{SFT} && python dpo.py --model {{tmp}}/sft/checkpoint",
     AFTER, 0, ()),
    ("docs/pipeline.md", "| `ppo.py` with the bundled reward model, same SFT model | 0.928 | "
     "**{0.960}** |", f"{SFT} && python ppo.py --model {{tmp}}/sft/checkpoint", AFTER, 0, ()),
    ("docs/pipeline.md", "| `python grpo.py` | the rule reward (the true sum) | **{0.996}** |",
     "python grpo.py", AFTER, 0, ()),
    ("docs/pipeline.md", "| DPO | `python dpo.py` | the 2,730 rankings, directly | {0.834} |",
     "python dpo.py", AFTER, 0, ()),
    ("docs/pipeline.md", "| PPO | `python ppo.py` | the bundled reward model | {0.954} |",
     "python ppo.py", AFTER, 0, ()),
    ("docs/pipeline.md", "`--label_smoothing 0.1` {0.862}", "python dpo.py --label_smoothing 0.1",
     AFTER, 0, ()),
    ("docs/pipeline.md", "`--beta 0.5` {0.880}", "python dpo.py --beta 0.5", AFTER, 0, ()),
    ("docs/pipeline.md", "`--loss_type ipo` {0.862}", "python dpo.py --loss_type ipo", AFTER, 0,
     ()),

    ("docs/pipeline.md", "| `reward_model.py` (300 steps of 32 rankings) | pair accuracy {0.468} |",
     f"{SFT} && python reward_model.py --model {{tmp}}/sft/checkpoint", BEFORE, 0, ()),
    ("docs/pipeline.md", "| pair accuracy 0.468 | **{0.901}** |",
     f"{SFT} && python reward_model.py --model {{tmp}}/sft/checkpoint", AFTER, 0, ()),
    ("docs/pipeline.md", "| `ppo.py` with that reward model (120 steps) | 0.928 | {0.878} |",
     f"{SFT} && python reward_model.py --model {{tmp}}/sft/checkpoint --output_dir {{tmp}}/rm && "
     "python ppo.py --model {tmp}/sft/checkpoint --reward_model {tmp}/rm/checkpoint", AFTER, 0, ()),
    ("docs/pipeline.md", "(pair accuracy {0.898}; prefers", "python reward_model.py", AFTER, 0, ()),
    ("docs/pipeline.md", "on 65% of prompts) | {0.714} |", "python reward_model.py "
     "--output_dir {tmp}/rm && python ppo.py --reward_model {tmp}/rm/checkpoint", AFTER, 0, ()),
    ("docs/pipeline.md", "`sft.py` 0.292 → {0.924} (full: 0.928)", "python sft.py --lora_r 16 "
     "--lr 1e-3", AFTER, 0, ()),
    ("docs/pipeline.md", "pair accuracy 0.468 → {0.886} (full: 0.898)", "python reward_model.py "
     "--lora_r 16 --lr 1e-3", AFTER, 0, ()),
    ("docs/pipeline.md", "`dpo.py`\n0.292 → {0.886} (full: 0.834)", "python dpo.py --lora_r 16 "
     "--lr 1e-3", AFTER, 0, ()),
    ("docs/scaling.md", "goes from {0.315} to\n0.990 held-out in 40 steps", "python grpo.py "
     "--lora_r 16 --lr 1e-3 --max_steps 40 --eval_size 200", BEFORE, 0, ()),
    ("docs/scaling.md", "goes from 0.315 to\n{0.990} held-out in 40 steps", "python grpo.py "
     "--lora_r 16 --lr 1e-3 --max_steps 40 --eval_size 200", AFTER, 0, ()),

    # EXERCISES.md: the runs as they are (an edited run needs its line changed by hand)
    ("EXERCISES.md", "each held-out accuracy\nstarts at {0.315} on these 200 prompts",
     f"python grpo.py {S}", BEFORE, 0, ()),
    *row("EXERCISES.md", "(one update per batch, the default: ", ("0.895", "0.975", "0.995"), ")",
         f"python grpo.py {S}", EVALS),
    *row("EXERCISES.md", "| RLOO | ", ("0.880", "0.970", "0.990"), " |",
         f"python reinforce.py {S} --baseline rloo", EVALS),
    *row("EXERCISES.md", "| RLOO | 0.880 / 0.970 / 0.990 | ", ("0.05", "0.01"), " |",
         f"python reinforce.py {S} --baseline rloo", first_last("adv_mean")),
    *row("EXERCISES.md", "| 0.05 / 0.01 | ", ("0.36", "0.34"), " |",
         f"python reinforce.py {S} --baseline rloo", first_last("sample_grad_rms")),
    *row("EXERCISES.md", "| none | ", ("0.900", "0.985", "0.995"), " | 0.39 | 1.5 |",
         f"python reinforce.py {S} --baseline none", EVALS),
    ("EXERCISES.md", "| none | 0.900 / 0.985 / 0.995 | {0.39} | 1.5 |",
     f"python reinforce.py {S} --baseline none", mean("sample_grad_rms", first=10), 0, ()),
    ("EXERCISES.md", "| none | 0.900 / 0.985 / 0.995 | 0.39 | {1.5} |",
     f"python reinforce.py {S} --baseline none", mean("grad_norm", last=10), 0, ()),
    *[claim for label, flags, evals, clip, reward in (
        ("lr 1e-4, clipped", "", ("0.835", "0.970", "0.920"), "0.073", "0.92"),
        ("lr 1e-4, no clip", NOCLIP, ("0.895", "0.935", "0.870"), "0", "0.85"),
        ("lr 3e-4, clipped", " --lr 3e-4", ("0.690", "0.725", "0.535"), "0.080", "0.65"))
      for claim in (*row("EXERCISES.md", f"| {label} | ", evals, " |",
                         f"python grpo.py {S} {MU4}{flags}", EVALS),
                    ("EXERCISES.md", f"| {label} | {' / '.join(evals)} | {{{clip}}} |",
                     f"python grpo.py {S} {MU4}{flags}", mean("clip_frac", first=10), 0, ()),
                    ("EXERCISES.md", f"| {label} | {' / '.join(evals)} | {clip} | {{{reward}}} |",
                     f"python grpo.py {S} {MU4}{flags}", mean("reward", last=10), 0, ()))],
    *row("EXERCISES.md", "| lr 3e-4, no clip | **", ("0.320", "0.425", "0.300"), "** |",
         f"python grpo.py {S} {MU4} --lr 3e-4{NOCLIP}", EVALS),
    ("EXERCISES.md", "| 0 | **{0.42}** | **5.23** |", f"python grpo.py {S} {MU4} --lr 3e-4{NOCLIP}",
     mean("reward", last=10), 0, ()),
    ("EXERCISES.md", "| k3, beta 0.5 | {0.915} | 0.17 |", f"python grpo.py {S} --beta 0.5", AFTER,
     0, ()),
    ("EXERCISES.md", "| k3, beta 0.5 | 0.915 | {0.17} |", f"python grpo.py {S} --beta 0.5",
     mean("kl", last=10), 0, ()),
    ("EXERCISES.md", "| beta 0 | {0.990} | (none) |", f"python grpo.py {S} --beta 0", AFTER, 0,
     ()),
    *row("EXERCISES.md", "`--beta 0`: held-out\n", ("0.895", "0.965", "0.990"), ", and a KL",
         f"python grpo.py {S} --beta 0", EVALS),
    *row("EXERCISES.md", "| G = 2 × 32 prompts | ", ("0.935", "0.975", "0.990"), " |",
         f"python grpo.py {S} --group_size 2 --prompts_per_step 32", EVALS),
    *row("EXERCISES.md", "| 0.935 / 0.975 / 0.990 | **", ("0.70", "0.82"), "** |",
         f"python grpo.py {S} --group_size 2 --prompts_per_step 32", first_last("frac_zero_std")),
    *row("EXERCISES.md", "| G = 16 × 4 prompts | ", ("0.905", "0.875", "0.945"), " |",
         f"python grpo.py {S} --group_size 16 --prompts_per_step 4", EVALS),
    *row("EXERCISES.md", "| 0.905 / 0.875 / 0.945 | ", ("0.20", "0.38"), " |",
         f"python grpo.py {S} --group_size 16 --prompts_per_step 4", first_last("frac_zero_std")),
    *row("EXERCISES.md", "**Measured:** held-out ", ("0.865", "0.925", "0.995"), " (vs",
         f"python grpo.py {S} --scale_rewards none", EVALS),
    *row("EXERCISES.md", "`grad_norm`\n", ("1.63", "0.80"), " (vs 2.83 / 2.33)",
         f"python grpo.py {S} --scale_rewards none", first_last("grad_norm")),
    *row("EXERCISES.md", "1.63 / 0.80 (vs ", ("2.83", "2.33"), ").", f"python grpo.py {S}",
         first_last("grad_norm")),
    *row("EXERCISES.md", "| kl_coef 0.05 | ", ("1.7", "4.3"), " |", f"python ppo.py {S}",
         first_last("reward")),
    *row("EXERCISES.md", "| kl_coef 0.05 | 1.7 / 4.3 | ", ("0.55", "0.92"), " |",
         f"python ppo.py {S}", first_last("gold")),
    *row("EXERCISES.md", "| 0.55 / 0.92 | ", ("0.895", "0.920", "0.975"), " |",
         f"python ppo.py {S}", EVALS),
    *row("EXERCISES.md", "| kl_coef 0 | ", ("1.6", "4.2"), " |", f"python ppo.py {S} --kl_coef 0",
         first_last("reward")),
    *row("EXERCISES.md", "| kl_coef 0 | 1.6 / 4.2 | **", ("0.53", "0.65"), "** |",
         f"python ppo.py {S} --kl_coef 0", first_last("gold")),
    *row("EXERCISES.md", "| **0.53 / 0.65** | **", ("0.620", "0.735", "0.740"), "** |",
         f"python ppo.py {S} --kl_coef 0", EVALS),
    *row("EXERCISES.md", "| reward model | ", ("0.31", "0.84"), " |", f"python ppo.py {S}",
         first_last("explained_var")),
    *row("EXERCISES.md", "| policy | ", ("0.28", "0.87"), " |",
         f"python ppo.py {S} --critic_init policy", first_last("explained_var")),
    *row("EXERCISES.md", "| policy | 0.28 / 0.87 | ", ("0.815", "0.955", "0.965"), " |",
         f"python ppo.py {S} --critic_init policy", EVALS),
    *row("EXERCISES.md", "| GSPO, sequence ratio, ε 3e-4 / 4e-4 | ", ("0.810", "0.905", "0.945"),
         " |", f"python grpo.py {S} {MU4} --importance_sampling_level sequence", EVALS),
    *row("EXERCISES.md", "| 0.810 / 0.905 / 0.945 | **", ("0.523", "0.438"), "** |",
         f"python grpo.py {S} {MU4} --importance_sampling_level sequence",
         (mean("clip_frac", first=10), mean("clip_frac"))),
    *row("EXERCISES.md", "| token ratio, ε 0.2 | 0.835 / 0.970 / 0.920 | ", ("0.073", "0.031"),
         " |", f"python grpo.py {S} {MU4}", (mean("clip_frac", first=10), mean("clip_frac"))),
    *row("EXERCISES.md", "| clip, ε_high 0.01 | ", ("0.930", "0.970", "0.960"), " |",
         f"python grpo.py {S} {MU4} --clip_eps_high 0.01", EVALS),
    *row("EXERCISES.md", "| CISPO, ε_high 0.01 | ", ("0.785", "0.830", "**0.740**"), " |",
         f"python grpo.py {S} {MU4} --clip_eps_high 0.01 --policy_loss cispo", EVALS),
    *row("EXERCISES.md", "| CISPO, ε_high 0.2 | ", ("0.885", "0.880", "0.920"), " |",
         f"python grpo.py {S} {MU4} --policy_loss cispo", EVALS),
    *[claim for label, flags, evals in (
        ("fp32 (default)", "", ("0.895", "0.975", "0.995")),
        ("bf16 sampler", " --sample_dtype bf16", ("0.880", "0.950", "0.990")),
        ("bf16 sampler, TIS cap 2", " --sample_dtype bf16 --tis_cap 2",
         ("0.900", "0.960", "0.985")),
        ("bf16 sampler, MIS cap 1.05", " --sample_dtype bf16 --tis_cap 1.05 --tis_mode mask",
         ("0.905", "0.970", "0.995")),
        ("top-p 0.8", " --top_p 0.8", ("0.815", "0.980", "0.985")),
        ("top-p 0.8, TIS cap 2", " --top_p 0.8 --tis_cap 2", ("0.810", "0.965", "0.985")))
      for claim in row("EXERCISES.md", f"| {label} | ", evals, " |", f"python grpo.py {S}{flags}",
                       EVALS)],

    # docs/tool_use.md (and EXERCISES.md 15, 16): the calculator task, tag calc
    *[("docs/tool_use.md", f"| `python grpo.py --env calc --seed {s}` | {text}",
       f"python grpo.py --env calc --seed {s}", read, 0, ("calc",))
      for s, text, read in (
          (0, "{0.280} → 0.897 → 0.896", BEFORE), (0, "0.280 → {0.897} → 0.896", at_step(20)),
          (0, "0.280 → 0.897 → {0.896}", AFTER), (1, "{0.294} → 0.898 → 0.936", BEFORE),
          (1, "0.294 → {0.898} → 0.936", at_step(20)), (1, "0.294 → 0.898 → {0.936}", AFTER),
          (2, "{0.294} → 0.912 → 0.915", BEFORE), (2, "0.294 → {0.912} → 0.915", at_step(20)),
          (2, "0.294 → 0.912 → {0.915}", AFTER))],
    ("docs/tool_use.md", "| 0.280 → 0.897 → 0.896 | 0.558 → {0.984} | 0.49 / 0.97 |", CALC,
     greedy_after, 0, ("calc",)),
    ("docs/tool_use.md", "| 0.558 → 0.984 | {0.49} / 0.97 |", CALC,
     mean("frac_tool", first=5), 0, ("calc",)),
    ("docs/tool_use.md", "| 0.558 → 0.984 | 0.49 / {0.97} |", CALC,
     mean("frac_tool", last=5), 0, ("calc",)),
    ("docs/tool_use.md", "| `python reinforce.py --env calc` | 0.280 → 0.948 → {0.983} |",
     "python reinforce.py --env calc", AFTER, 0, ("calc",)),
    ("docs/tool_use.md", "| `python ppo.py --env calc --max_steps 20 --eval_every 10` | 0.287 → "
     "{0.909} (step 20) |", "python ppo.py --env calc --max_steps 20 --eval_every 10", AFTER, 0,
     ("calc",)),
    ("docs/tool_use.md", "(step 20) | 0.558 → {0.968} |",
     "python ppo.py --env calc --max_steps 20 --eval_every 10",
     greedy_after, 0, ("calc",)),
    ("docs/tool_use.md", "4 evals of 500 prompts took {69} s of CPU",
     f"/usr/bin/time -f 'CPU %U user %S system' {CALC}", cpu_seconds, WALL, ("calc",)),
    ("EXERCISES.md", "| as it is (no cost) | 0.006 / 0.868 | 0.976 / 0.928 | 0.629 → {0.908} |",
     "python -c \"import json, random; r = random.Random(0); open('{tmp}/mix.jsonl', 'w')"
     ".writelines(json.dumps({'prompt': f'{a}+{b}=', 'answer': str(a + b)}) + '\\n' for a, b in "
     "[(r.randrange(10, 100), r.randrange(10, 100)) if i % 2 else (r.randrange(1000, 10000), "
     "r.randrange(1000, 10000)) for i in range(4000)])\" && python grpo.py --env calc --data "
     "{tmp}/mix.jsonl --max_steps 60 --eval_every 20 --save_every 0", AFTER, 0, ("calc",)),
    ("EXERCISES.md", "| `--env calc`, as it is | 0.484 / 0.909 | 0.280 → {0.896} |",
     CALC, AFTER, 0, ("calc",)),
    ("EXERCISES.md", "| `--env calc`, as it is | {0.484} / 0.909 |", CALC,
     mean("reward", first=5), 0, ("calc",)),
    ("EXERCISES.md", "| `--max_new_tokens 29`, as it is | 0.000 / 0.028 | 0.029 → {0.072} |",
     "python grpo.py --env calc --max_new_tokens 29 --max_steps 40", AFTER, 0, ("calc",)),
]


# ------------------------------------------------------------------------------------ the runner
def budget_report():
    """README's line budgets against each module's lines today: a report (reviewed, never a
    failure: tests/test_docs.py fails only well past a budget, so a student's edit passes)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        rows = re.findall(r"^\| `([\w/]+\.py)`[^|]*\|[^|]*\| (\d+) lines \|$", f.read(), re.M)
    for name, budget in rows:
        with open(os.path.join(ROOT, name), encoding="utf-8") as f:
            n = len(f.read().splitlines())
        over = f", {n - int(budget)} over: delete, or raise README's row" if n > int(budget) else ""
        print(f"budget {name}: {n} of {budget} lines{over}")


def as_list(command):
    """A claim's commands: one, or a tuple of several (the seeds of a mean or a range)."""
    return list(command) if isinstance(command, tuple) else [command]


def quoted(text):
    """The claim's quoted number (in braces) and its text as the file shows it."""
    number = re.search(r"\{([^{}]*)\}", text).group(1)
    return number, text.replace("{" + number + "}", number, 1)


def holds(file, text):
    """Whether the file still quotes the claim's text."""
    with open(os.path.join(ROOT, file), encoding="utf-8") as f:
        return quoted(text)[1] in f.read()


def drifted(number, measured, tol):
    """Whether a measurement disagrees with the quoted number: to its digits, or within tol."""
    q = float(number.replace(",", ""))
    if tol:
        return not q / (1 + tol) <= measured <= q * (1 + tol)
    digits = len(number.split(".")[1]) if "." in number else 0
    return f"{measured:.{digits}f}" != number.replace(",", "")


def run_command(command, folder):
    """Run one claim command from the repository root (unless folder holds its finished run);
    its run folder's summary and metrics, its stdout, stderr and exit code."""
    run, tmp = os.path.join(folder, "run"), os.path.join(folder, "tmp")
    if not os.path.exists(os.path.join(folder, "rc")):
        os.makedirs(tmp, exist_ok=True)
        if "{run}" not in command and ".py" in command:
            command += " --output_dir {run}"
        # {run} and {tmp} only: the command's own braces (a python -c) stay as they are
        shell = command.replace("{run}", run).replace("{tmp}", tmp)
        p = subprocess.run(shell, shell=True, cwd=ROOT, capture_output=True, text=True)
        for name, text in (("stdout", p.stdout), ("stderr", p.stderr), ("rc", str(p.returncode))):
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
    r = {name: open(os.path.join(folder, name)).read() for name in ("stdout", "stderr", "rc")}
    r.update(summary={}, metrics=[])
    if os.path.exists(os.path.join(run, "summary.json")):
        with open(os.path.join(run, "summary.json")) as f:
            r["summary"] = json.load(f)
        with open(os.path.join(run, "metrics.jsonl")) as f:
            r["metrics"] = [json.loads(line) for line in f]
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--list", action="store_true", help="list the claims, run nothing")
    p.add_argument("--only", action="append", default=[], metavar="PATTERN",
                   help="claims whose file, text, command or tag has PATTERN (repeat: any)")
    p.add_argument("--skip", action="append", default=[], metavar="PATTERN",
                   help="leave out the claims that --only would pick with PATTERN (e.g. calc)")
    p.add_argument("--fast", action="store_true",
                   help="only the claims that run no training (tagged fast): seconds; "
                   ".ci/run runs it")
    p.add_argument("--keep", default="", metavar="DIR",
                   help="keep each command's folder under DIR, and read a command that finished "
                   "there before instead of running it again (default: a temporary folder)")
    p.error = lambda message: p.exit(2, f"error: {message}; see --help\n")  # one line, no usage
    args = p.parse_args()
    for flag, patterns in (("--only", args.only), ("--skip", args.skip)):
        if "" in patterns:  # it is in every claim's text
            p.error(f"{flag} '': an empty pattern matches every claim")

    def has(claim, patterns):
        return any(o.lower() in " ".join((*claim[:2], *as_list(claim[2]), *claim[5])).lower()
                   for o in patterns)
    claims = [c for c in CLAIMS if (not args.only or has(c, args.only)) and not has(c, args.skip)
              and (not args.fast or "fast" in c[5])]
    if not claims:
        skip = f" once --skip {args.skip!r} leaves out its claims" if args.skip else ""
        p.error(f"no claim matches --only {args.only!r}{skip}" if args.only else
                f"--skip {args.skip!r} leaves out every claim")
    commands = list(dict.fromkeys(x for c in claims for x in as_list(c[2])))  # each run once
    if args.list:
        for file, text, command, _, tol, tags in claims:
            extra = f" (tolerance x{1 + tol:g})" if tol else ""
            extra += "".join(f" [{t}]" for t in tags)
            extra += "" if holds(file, text) else " MISSING: the file no longer has its text"
            print(f"{file}: {quoted(text)[0]}{extra}  <-  {' ; '.join(as_list(command))}")
        print(f"{len(claims)} claims, {len(commands)} commands")
        return
    try:
        os.makedirs(args.keep or ".", exist_ok=True)
    except OSError as e:  # a file of that name, a folder it may not write in
        p.error(f"--keep {args.keep}: " + ("that is a file, not a folder" if os.path.isfile(
            args.keep) else f"cannot make that folder ({e.strerror or e})"))
    runs, bad = {}, 0
    if args.fast:
        budget_report()
    for command in commands:
        folder = tempfile.mkdtemp(prefix="check_docs-")
        if args.keep:  # one folder a command, named by its hash: kept, and read if it finished
            folder = os.path.join(args.keep, hashlib.sha1(command.encode()).hexdigest()[:12])
            rc = os.path.join(folder, "rc")
            if os.path.exists(rc) and open(rc).read() != "0":
                shutil.rmtree(folder)  # it failed: run it again
        runs[command] = run_command(command, folder)
        if not args.keep:
            shutil.rmtree(folder, ignore_errors=True)
        # the claims whose last command this was
        for file, text, claim_commands, read, tol, _ in claims:
            if as_list(claim_commands)[-1] != command:
                continue
            number, shown = quoted(text)
            shown_command = " ; ".join(as_list(claim_commands))
            rs = [runs[c] for c in as_list(claim_commands)]
            try:
                measured = float(read(rs if isinstance(claim_commands, tuple) else rs[0]))
            except (KeyError, StopIteration, AttributeError, ZeroDivisionError, IndexError):
                r = rs[-1]
                print(f"FAILED {file}: {number}: the run gave no value (exit {r['rc']}: "
                      f"{r['stderr'].strip()[-300:]}) ({shown_command})")
                bad += 1
                continue
            if not holds(file, text):  # the text changed, its claim did not
                print(f"MISSING {file}: {shown!r} is not in the file; measured {measured:.4g} "
                      f"({shown_command})")
                bad += 1
            elif drifted(number, measured, tol):
                print(f"DRIFT {file}: quoted {number}, measured {measured:.4g} ({shown_command})")
                bad += 1
            else:
                print(f"ok {file}: {number} ({shown_command})")
        sys.stdout.flush()
    print(f"{bad} of {len(claims)} claims drifted or failed" if bad else f"all {len(claims)} ok")
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
