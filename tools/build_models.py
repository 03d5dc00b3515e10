"""Rebuild the bundled checkpoints in models/ with the repo's own pipeline, deterministically
(CPU, fixed seeds, one thread): this script writes the data and runs sft.py and reward_model.py,
as a user would.

  0. A fresh LlamaForCausalLM (3 blocks, d = 160, 1.0 M parameters) and a character-level
     tokenizer: the "pretrained model" of this tiny world.
  1. sft.py on correct sums (1,500 steps of 128 fresh demonstrations): it learns to add.
  2. sft.py on demonstrations that forget each carry 70% of the time (1,000 steps; 57+68=15):
     the right answer keeps real probability but is no longer the greedy choice, so RL has
     something to find (held-out greedy accuracy about 0.3).                -> models/tiny-adder
  3. reward_model.py, Bradley-Terry on (correct, wrong) pairs, from the policy (the SFT model, as
     InstructGPT does). The wrong answers are varied (dropped carries, any digit off, random
     numbers, a digit added or cut): a good but imperfect proxy for correctness. A reward model
     trained only on dropped-carry and one-digit mistakes was hacked by PPO within 20 steps
     (answers like 55+43=107 scored above the truth), so negatives must cover what a drifting
     policy writes.                                                      -> models/tiny-adder-rm

  4. sft.py from tiny-adder on calculator demonstrations (calc.calc_demo): 30% call the tool,
     '<calc>1234+5678</calc> 6912 6912' (the call, the observation, the answer), the rest answer
     in the head (right for 2-digit sums, carries forgotten 80% of the time for 3-4 digits);
     1,500 steps at lr 1e-3. For `--env calc` (docs/tool_use.md).         -> models/tiny-calc

The correct and wrong answers stand in for human demonstrators and annotators. Neither model ever
sees the held-out eval pairs (tasks.task_eval_pairs). Each stage's run folder (metrics.jsonl,
summary.json) and data stay in runs/build-models/.
Run: python tools/build_models.py [DEST]   (DEST: another folder than models/, for a try;
     CLEAN_STEPS, SLOPPY_STEPS, RM_STEPS and CALC_STEPS shorten the stages)
     python tools/build_models.py [DEST] --only calc   (stage 4 alone, from DEST/tiny-adder)
Measured 2026-12-01 (2-core CPU shared with other jobs): 11-12 minutes; held-out greedy accuracy
0 -> 1.000 after stage 1, 0.292 after stage 2; reward model held-out pair agreement 0.892 on
correct vs dropped-carry / one-digit-off answers. A second build wrote bit-identical files.
Stage 4 alone (--only calc): 1,235 s on the shared CPU (load average ~7); tiny-calc then calls
the tool on 23-33% of sampled prompts and is right 0.97-1.00 of the time when it calls on 3-4
digit sums (python tools/calc_report.py models/tiny-calc; docs/tool_use.md). The shipped
tiny-calc was built before common.token_logprobs got its chunked LM head; rebuilt after it (704 s)
the weights differ in the last bits (float order) and the report agrees within sampling noise
(T = 1 calls 0.30 / 0.27 / 0.22 on 2 / 3 / 4-digit sums, against 0.33 / 0.26 / 0.23).
"""
import json
import os
import random
import shutil
import subprocess
import sys
import time
from types import SimpleNamespace

import torch
from tokenizers import Tokenizer, decoders, models, processors
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common  # noqa: E402
from plumbing import calc  # noqa: E402
from plumbing import loading  # noqa: E402
from plumbing import tasks  # noqa: E402

DROP = 0.7  # probability that a demonstration forgets a carry
BATCH, RM_BATCH = 128, 64  # demonstrations / preference pairs per optimizer step
BUILD = os.path.join(loading.ROOT, "runs", "build-models")
SPECIALS = ["<pad>", "<bos>", "<eos>", "<unk>"]


def column_sum(a, b, rng=None, drop=0.0):
    """a + b by column addition. Each carry is forgotten with probability `drop`: the warm-start
    data's human-like error (37+48 -> 75, 57+68 -> 15, not 85 and 125). drop=0 gives the true
    sum."""
    da, db = str(a)[::-1], str(b)[::-1]
    n, out, carry = max(len(da), len(db)), 0, 0
    for i in range(n):
        s = int(da[i] if i < len(da) else 0) + int(db[i] if i < len(db) else 0) + carry
        out, carry = out + (s % 10) * 10**i, s // 10
        if carry and rng is not None and rng.random() < drop:
            carry = 0
    return out + carry * 10**n


def build_tokenizer():
    """Character level over printable ASCII: a BPE with no merges is exactly one token per
    character."""
    vocab = {t: i for i, t in enumerate(SPECIALS + [chr(c) for c in range(32, 127)])}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tk.decoder = decoders.Fuse()
    tk.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                      special_tokens=[("<bos>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<bos>", eos_token="<eos>",
                                   pad_token="<pad>", unk_token="<unk>", padding_side="left",
                                   model_max_length=64)


def config(tok, **kw):
    return LlamaConfig(vocab_size=len(tok), max_position_embeddings=64, tie_word_embeddings=True,
                       pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id,
                       eos_token_id=tok.eos_token_id, num_attention_heads=4,
                       num_key_value_heads=4, **kw)


def wrong_answer(a, b, rng):
    """A plausible mistake: a forgotten carry when there is one, else one digit nudged."""
    s, bad = a + b, column_sum(a, b, rng, 1.0)
    if bad != s and rng.random() < 0.6:
        return bad
    d = list(str(s))
    i = rng.randrange(len(d))
    d[i] = str((int(d[i]) + rng.choice([1, 9])) % 10)
    return int("".join(d))


def negative(a, b, rng):
    """A wrong answer for RM training: the policy's own kind of mistake, and the kinds a drifting
    policy makes."""
    s, u = a + b, rng.random()
    if u < 0.35:
        return str(wrong_answer(a, b, rng))
    if u < 0.55:  # any digit off by 1..9
        d = list(str(s))
        i = rng.randrange(len(d))
        d[i] = str((int(d[i]) + rng.randrange(1, 10)) % 10)
        return str(int("".join(d))) if "".join(d) != str(s) else str(s + 1)
    if u < 0.70:  # a random number
        r = rng.randrange(200)
        return str(r if r != s else r + 1)
    if u < 0.82:  # a digit too many
        return str(s) + str(rng.randrange(10))
    if u < 0.92:  # a digit too few
        return str(s)[:-1]
    return str(s + rng.choice([-10, 10, 100, -100] if s >= 100 else [-10, 10, 100]))




def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def pipeline_script(script, **flags):
    """Run one of the repo's training scripts as a user would: python sft.py --flag value ..."""
    cmd = [sys.executable, os.path.join(loading.ROOT, script)]
    for k, v in flags.items():
        cmd += [f"--{k}", str(v)]
    print("$", " ".join(cmd[1:]), flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}  # one thread: same sums
    subprocess.run(cmd, check=True, env=env, cwd=loading.ROOT)


MODEL_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}


def check_dest(dest):
    """dest (a bundled model's folder, which ship replaces) is missing or holds model files only:
    never a user's folder of another kind. Checked before the build, and again in ship."""
    other = sorted(set(os.listdir(dest)) - MODEL_FILES) if os.path.isdir(dest) else []
    if other or os.path.isfile(dest) or os.path.islink(dest):
        raise SystemExit(f"error: {dest} holds {', '.join(other[:3]) or 'a file or link'}, which "
                         "this does not write; it replaces only a bundled model's folder: give "
                         "another DEST")


def ship(run_dir, dest, tok):
    """The run's final checkpoint as a bundled model: weights and config (not the trainer state),
    and the tokenizer as built (a reloaded one would record that it was read offline)."""
    check_dest(dest)
    shutil.rmtree(dest, ignore_errors=True)
    shutil.copytree(os.path.join(run_dir, "checkpoint"), dest,
                    ignore=shutil.ignore_patterns("trainer_state.pt", "args.json", "tokenizer*"))
    tok.save_pretrained(dest)


def build_calc(dest, tok):
    """4. The tool user: sft.py from tiny-adder on calculator demonstrations (calc.calc_demo: 30%
    call the tool, the rest answer in the head, 3-4 digit sums with carries mostly forgotten),
    1,500 steps at lr 1e-3.                                                    -> tiny-calc"""
    steps = int(os.environ.get("CALC_STEPS", 1500))
    build = os.path.join(BUILD, "calc")
    shutil.rmtree(build, ignore_errors=True)
    os.makedirs(build)
    rng = random.Random(28)  # its own stream: the other models' data stay as they were
    write_jsonl(f"{build}/demos.jsonl", [
        {"prompt": f"{a}+{b}=", "completion": calc.calc_demo(a, b, rng, column_sum)}
        for a, b in calc.calc_demo_pairs(rng, steps * BATCH)])
    pipeline_script("sft.py", model=f"{dest}/tiny-adder", data=f"{build}/demos.jsonl",
                    output_dir=f"{build}/sft", lr=1e-3, warmup_steps=steps // 20,
                    max_steps=steps, batch_size=BATCH, micro_batch_size=BATCH, eval_every=0,
                    eval_size=200, save_every=0, chat_template="none")
    ship(f"{build}/sft", f"{dest}/tiny-calc", tok)
    report = os.path.join(loading.ROOT, "tools", "calc_report.py")
    subprocess.run([sys.executable, report, f"{dest}/tiny-calc"],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})  # the tool-use report


def main():
    t0 = time.time()
    hf_logging.disable_progress_bar()  # the library's "writing shards" bars
    clean_steps = int(os.environ.get("CLEAN_STEPS", 1500))
    sloppy_steps = int(os.environ.get("SLOPPY_STEPS", 1000))
    rm_steps = int(os.environ.get("RM_STEPS", 600))
    argv = sys.argv[1:]
    only = argv[argv.index("--only") + 1] if "--only" in argv else ""
    argv = [a for a in argv if a not in ("--only", only)]
    dest = argv[0] if argv else os.path.join(loading.ROOT, "models")
    policy, reward_model = f"{dest}/tiny-adder", f"{dest}/tiny-adder-rm"
    if only not in ("", "calc"):
        raise SystemExit(f"error: --only {only!r}: the only stage built alone is calc")
    for name in ("tiny-adder", "tiny-adder-rm", "tiny-calc")[2 if only else 0:]:
        check_dest(f"{dest}/{name}")  # before an hour of building
    if only == "calc":  # from the tiny-adder already in DEST, which stays as it is
        build_calc(dest, build_tokenizer())
        print(f"rebuild time {time.time() - t0:.0f} s; the runs are in {BUILD}/calc/")
        return
    shutil.rmtree(BUILD, ignore_errors=True)
    os.makedirs(BUILD)
    # 0. a fresh model and its tokenizer: the "pretrained" starting point of the pipeline
    tok = build_tokenizer()
    torch.manual_seed(0)
    init = LlamaForCausalLM(config(tok, hidden_size=160, num_hidden_layers=3,
                                   intermediate_size=480))
    init.generation_config.pad_token_id = tok.pad_token_id
    init.save_pretrained(f"{BUILD}/init", safe_serialization=True)
    tok.save_pretrained(f"{BUILD}/init")
    # the data: one row per training example, fresh pairs each (one epoch, BATCH rows a step)
    rng = random.Random(0)

    def demos(steps, drop):
        return [{"prompt": f"{a}+{b}=", "completion": str(column_sum(a, b, rng, drop))}
                for a, b in tasks.task_train_pairs(rng, steps * BATCH)]
    write_jsonl(f"{BUILD}/clean.jsonl", demos(clean_steps, 0.0))
    write_jsonl(f"{BUILD}/sloppy.jsonl", demos(sloppy_steps, DROP))
    write_jsonl(f"{BUILD}/pairs.jsonl", [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": negative(a, b, rng)}
        for a, b in tasks.task_train_pairs(rng, rm_steps * RM_BATCH)])
    flags = dict(eval_every=500, save_every=0, chat_template="none")  # both SFT stages
    # 1. SFT from scratch on correct sums: the model learns to add
    pipeline_script("sft.py", model=f"{BUILD}/init", data=f"{BUILD}/clean.jsonl",
                    output_dir=f"{BUILD}/sft-clean", lr=2e-3, warmup_steps=clean_steps // 20,
                    max_steps=clean_steps, batch_size=BATCH, micro_batch_size=BATCH, **flags)
    # 2. SFT on sloppy demonstrations: each carry forgotten 70% of the time -> the policy
    pipeline_script("sft.py", model=f"{BUILD}/sft-clean/checkpoint",
                    data=f"{BUILD}/sloppy.jsonl", output_dir=f"{BUILD}/sft-sloppy", lr=1e-3,
                    warmup_steps=sloppy_steps // 20, max_steps=sloppy_steps, batch_size=BATCH,
                    micro_batch_size=BATCH, **flags)
    ship(f"{BUILD}/sft-sloppy", policy, tok)
    # 3. the reward model, from the SFT model (InstructGPT), on (correct, wrong) pairs
    pipeline_script("reward_model.py", model=policy, data=f"{BUILD}/pairs.jsonl",
                    output_dir=f"{BUILD}/rm", lr=5e-4, max_steps=rm_steps, batch_size=RM_BATCH,
                    micro_batch_size=RM_BATCH, eval_every=200, save_every=0, chat_template="none")
    ship(f"{BUILD}/rm", reward_model, tok)
    report(tok, policy, reward_model)
    build_calc(dest, tok)
    print(f"rebuild time {time.time() - t0:.0f} s; the runs' metrics and data are in {BUILD}/")


def report(tok, policy_dir, rm_dir):
    """Held-out greedy accuracy of the policy; held-out agreement of the reward model on correct
    vs dropped-carry / one-digit-off answers."""
    policy = loading.load_model(policy_dir, "lm", torch.device("cpu"), frozen=True)
    rm = loading.load_model(rm_dir, "rm", torch.device("cpu"), frozen=True)
    args = SimpleNamespace(chat_template="none", max_new_tokens=6, stop=())
    pairs = tasks.task_eval_pairs()
    rows = [tasks.addition_row(a, b) for a, b in pairs]
    acc = common.evaluate(policy, tok, rows, args, torch.autocast("cpu", enabled=False),
                          {"math": 1.0})["eval"]
    rng = random.Random(2)
    prompts = [f"{a}+{b}=" for a, b in pairs]
    with torch.no_grad():
        good = common.rm_scores(rm, tok, prompts, [str(a + b) for a, b in pairs])
        bad = common.rm_scores(rm, tok, prompts, [str(wrong_answer(a, b, rng)) for a, b in pairs])
    print(f"policy params {sum(p.numel() for p in policy.parameters())}, held-out greedy "
          f"accuracy {acc:.3f}")
    print(f"reward model params {sum(p.numel() for p in rm.parameters())}, held-out pair "
          f"agreement {(good > bad).float().mean():.3f}")


if __name__ == "__main__":
    main()
