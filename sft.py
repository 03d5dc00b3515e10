"""sft.py: supervised fine-tuning (SFT), the first stage of the RLHF pipeline (InstructGPT,
Ouyang et al. 2022): imitate demonstrations by maximum likelihood on the completion tokens only.

Each row is a prompt x and a demonstrated completion y = y_1..y_n, which ends with the EOS (the
model must learn where to stop). The prompt is context, not a target: its tokens carry no loss
(nor, in a conversation, the tokens of the user, system and tool messages after it).

    log pi_theta(y_t | x, y_<t)   for every completion token, EOS included      C.token_logprobs()
    loss = -(1/N) sum over the step's rows and completion tokens of log pi_theta(y_t | x, y_<t)
           N = completion tokens in the whole optimizer step                           sft_loss()

N counts the step, not the micro-batch, so micro-batching leaves the gradient as it is, and a
long answer weighs more than a short one (one term per token). The masks come from lengths,
never from token values, so the EOS is in the loss even when the pad token is the EOS token.
Batches are random draws; with --group_by_length, length-sorted (rows of similar length together:
less padding, but batches less random; length_batches()).

Rows (TRL's formats, docs/pipeline.md): {"prompt": "37+48=", "completion": "85"} (the prompt is
encoded exactly as the RL scripts encode it, chat template and all); {"text"} (every token
trained); or a conversation, {"messages": [...]} or a prompt and a completion that are lists of
messages: every assistant message is trained (its tool calls and end tag too, as the chat template
renders them), the user, system and tool messages are context (--last_turn_only: the last
assistant message only). Without a chat template the messages follow each other with nothing
between, the transcript of a multi-turn rollout (tasks.encode_demonstration()).
Reported before and after: the held-out loss on a fixed fifth of the rows (at most eval_size),
and the task score, held-out greedy accuracy (C.evaluate) on the built-in addition task (or on
--eval_data). The checkpoint loads with from_pretrained: pass it to grpo.py or ppo.py as --model.

Run:  python sft.py                      # bundled: data/demonstrations.jsonl, 2-core CPU, ~10 s
      python sft.py --lora_r 16 --lr 1e-3    # LoRA adapters on a frozen base (pip install peft)
      python sft.py --model Qwen/Qwen2.5-0.5B --data demos.jsonl --eval_data task.jsonl \\
          --lr 2e-5 --max_steps 1000 --batch_size 32 --micro_batch_size 8 --max_new_tokens 256
Expect (bundled default): the demonstrations forget a carry 30% of the time, the bundled policy
70%, so held-out greedy accuracy rises from 0.29 to about 0.93, the held-out loss from 0.29 to 0.19.
"""
from plumbing import ctrl_c  # noqa: F401  (first: Ctrl-C while torch loads is one line)
import math
import os
import random
from dataclasses import dataclass, field
from typing import Literal

import torch

import common as C
from plumbing.errors import UserError
from plumbing import flags
from plumbing.flags import arg  # an Args field with its valid range
from plumbing import loading
from plumbing import runs as R
from plumbing import tasks

DEMOS = os.path.join(loading.ROOT, "data", "demonstrations.jsonl")  # tools/make_pipeline_data.py


@dataclass
class Args:
    # --- model and data
    model: str = loading.DEFAULT_POLICY  # hub id or local folder of any AutoModelForCausalLM
    data: str = DEMOS  # a data file or hf:... (docs/pipeline.md); '' = the bundled one
    eval_data: str = ""  # task score: '' = built-in addition task; a file of {"prompt", "answer"}
    last_turn_only: bool = False  # a conversation's loss on its last assistant message only
    chat_template: Literal["auto", "none"] = "auto"  # auto: the tokenizer's template, if it has one
    trust_remote_code: bool = False  # never run a model repo's own code unless asked
    max_new_tokens: int = arg(6, "> 0")  # the task score's greedy answers (the task needs 4)
    stop: list[str] = field(default_factory=list)  # stop strings for those answers
    # --- optimisation
    lr: float = arg(3e-4, "> 0")  # tiny-model lr; real models ~2e-5 (TRL), 3e-6 (TL;DR)
    weight_decay: float = arg(0.0, ">= 0")  # AdamW weight decay (TRL 0)
    anneal_lr: bool = True  # the lr falls linearly to 0 over max_steps (TL;DR details anneal)
    warmup_steps: int = arg(0, ">= 0")  # the lr rises linearly from 0 over these first steps
    max_grad_norm: float = arg(1.0, "> 0")  # gradient clipping (TRL 1.0)
    batch_size: int = arg(64, "> 0")  # rows per optimizer step (tiny-model value)
    max_steps: int = arg(60, "> 0")  # optimizer steps (1.5 passes over the bundled rows)
    micro_batch_size: int = arg(64, "> 0")  # rows per forward; the loss is normalised per step
    group_by_length: bool = False  # similar lengths together: less padding, less random batches
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory
    fsdp: bool = False  # torchrun: shard the trained model across processes with FSDP2 (README)
    lora_r: int = arg(0, ">= 0")  # LoRA rank (pip install peft); 0: full fine-tuning
    lora_alpha: int = arg(32, "> 0")  # LoRA scale: the update is alpha / r * B A (TRL examples)
    lora_dropout: float = arg(0.0, "[0, 1)")  # dropout on the adapters' input (peft's default)
    lora_target_modules: str = "all-linear"  # comma list, or peft's every linear layer but the head
    compile: bool = False  # torch.compile the model: for CUDA; no measured gain on CPU
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    threads: int = arg(0, ">= 0, <= 4 * cores")  # CPU threads; 0: 1 under 10 M params, else all
    # --- run
    seed: int = arg(0, ">= 0, < 2**63")  # seeds the batch order: same seed, same run
    eval_every: int = arg(20, ">= 0")  # steps between held-out evals (0: only before and after)
    eval_size: int = arg(500, "> 0")  # held-out rows for the loss, and task prompts for the score
    save_every: int = arg(100, ">= 0")  # steps between checkpoints (0: only at the end, Ctrl-C)
    save_optimizer: bool = False  # the final checkpoint too keeps AdamW: --resume may extend it
    output_dir: str = ""  # default runs/sft-<time>
    resume: str = ""  # a previous output_dir: continue its run from its checkpoint


# --------------------------------------------------------------------------- the algorithm
def sft_loss(logprobs, mask, n_tokens):
    """-sum of log pi over the completion tokens (mask (B, T), EOS included) / n_tokens, the
    completion tokens of the whole optimizer step: this micro-batch's share of the step's loss."""
    return -(logprobs * mask).sum() / n_tokens


def length_batches(lengths, batch_size, seed, epoch, window=16):
    """One epoch's batches (lists of row indices), rows of similar length together: shuffle, sort
    each window of window * batch_size rows by length, cut into batches, shuffle the batches (as
    HF's group_by_length; window=0: no sorting). A function of (seed, epoch) alone, so resuming
    needs only the step."""
    rng = random.Random(seed * 100003 + epoch)
    order = rng.sample(range(len(lengths)), len(lengths))
    w = window * batch_size
    if w:
        order = [i for s in range(0, len(order), w)
                 for i in sorted(order[s:s + w], key=lengths.__getitem__)]
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    rng.shuffle(batches)
    return batches


@torch.no_grad()
def heldout_loss(model, examples, pad_id, micro_batch_size, amp):
    """The same loss on held-out rows: mean -log pi per completion token (under torchrun, over
    every process's rows)."""
    device = next(model.parameters()).device
    total, n = 0.0, 0.0
    for i in range(0, len(examples), micro_batch_size):
        b = tasks.collate(examples[i:i + micro_batch_size], pad_id, device)
        with amp:
            lp, _ = C.token_logprobs(model, b.ids, b.attention_mask, b.completion_mask.shape[1])
        total += float(-(lp * b.completion_mask).sum())
        n += float(b.completion_mask.sum())
    total, n = R.global_sum(torch.tensor([total, n], dtype=torch.float64)).tolist()
    return total / n if n else float("nan")


def read_demonstrations(path, tok, chat_template, limit, last_turn_only=False):
    """(prompt ids, completion ids + EOS, loss mask) per row, in any of TRL's SFT formats
    (tasks.demonstration), the mask 1 on what the model learns to write: a text completion, or
    every assistant message of a conversation (tasks.encode_demonstration). Errors name the
    file, the row and the field."""
    examples = []
    for where, row in tasks.read_records(path):  # JSON lines, JSON, CSV, parquet, hf:...
        demo = tasks.demonstration(row, where)
        with loading.template_errors(tok, f"{where}: "):  # Gemma: 'System role not supported'
            p, ids, mask = tasks.encode_demonstration(tok, demo, chat_template, last_turn_only,
                                                      where)
        if limit and len(p) + len(ids) > limit:
            raise UserError(f"{where}: {len(p) + len(ids)} tokens, more than the model's "
                            f"context of {limit}")
        examples.append((p, ids, mask))
    return examples


# -------------------------------------------------------------------------- the training loop
def main():
    args = flags.parse_args(Args, "sft", __doc__)  # --resume DIR: that run's own settings
    flags.check_args(args)
    device = R.setup_distributed()  # under torchrun: this process's device; else cuda or cpu
    run = R.start_run(args, "sft")  # output folder, lock, metrics.jsonl, Ctrl-C handler
    rng = R.seed_everything(args.seed)
    amp = loading.autocast(device, args.dtype)  # bf16 forwards on a GPU; weights stay fp32
    # fp32 weights, dropout off; with --lora_r a frozen base and trained adapters
    model, tok = loading.load_policy(args, device, f"{run.dir}/checkpoint" if args.resume else "")
    R.set_threads(args, model)  # CPU: one thread for a small model (see runs.set_threads)
    limit = getattr(model.config, "max_position_embeddings", 0)
    examples = read_demonstrations(args.data or DEMOS, tok, args.chat_template, limit,
                                   args.last_turn_only)
    random.Random(0).shuffle(examples)  # a fixed split, the same for every run and seed
    n_eval = min(args.eval_size, len(examples) // 5)
    held, train = examples[:n_eval], examples[n_eval:]
    task = tasks.load_data("", args.eval_size).eval_rows if not args.eval_data else \
        tasks.read_rows(args.eval_data, need_answer=True)[:args.eval_size]
    loading.check_prompts(tok, model.config, task, args)
    train_model = R.wrap_model(model, args.fsdp)  # torchrun: DDP, or FSDP2 in place (--fsdp)
    trained = [p for p in model.parameters() if p.requires_grad]  # all, or LoRA's adapters
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=args.weight_decay,
                            fused=True)  # fused: one kernel for all parameters

    def evaluate():  # task score (greedy accuracy) and held-out loss; torchrun: a share each
        with R.gathered(model):  # --fsdp: the whole model in every process, for any row count
            loss = heldout_loss(model, held[run.rank::run.world], tok.pad_token_id,
                                args.micro_batch_size, amp)
        score = R.split_eval(run, model, task, lambda rows: C.evaluate(model, tok, rows, args, amp,
                                                                       {"math": 1.0}))
        return {**score, "eval_loss": loss}
    start, eval_before, _ = R.resume_or_eval(run, opt, rng, evaluate, "accuracy", [model])
    lengths = [len(p) + len(c) for p, c, _ in train]
    per_epoch = math.ceil(len(train) / args.batch_size)

    # checkpoint/ after `done` steps (every --save_every, at the end, on Ctrl-C). The run-keeping
    # (Ctrl-C, the NaN guard, logs, eval, checkpoints) is keep's: each keep.* call below is one of
    # its duties (runs.Keeper); what is left is the algorithm.
    def save(done):
        R.save_checkpoint(run, model, tok, opt, rng, done, {"eval_before": eval_before})
    keep = R.Keeper(run, opt, rng, save, evaluate, shown=("loss", "eval", "eval_loss"))
    for step in keep.steps(start):
        # the lr from the step number, so resuming needs no scheduler state
        warm = min(1.0, (step + 1) / args.warmup_steps) if args.warmup_steps else 1.0
        opt.param_groups[0]["lr"] = args.lr * warm * ((1 - step / args.max_steps)
                                                      if args.anneal_lr else 1.0)
        # 1. the next batch of demonstrations, as a rollout (torchrun: this process's share)
        epoch, i = divmod(step, per_epoch)
        if i == 0 or step == start:
            batches = length_batches(lengths, args.batch_size, args.seed, epoch,
                                     window=16 if args.group_by_length else 0)
        batch = tasks.collate([train[j] for j in R.my_share(batches[i])], tok.pad_token_id, device)
        mask = batch.completion_mask  # (B, T): 1 on each completion token, EOS included
        n_tokens = R.global_sum(mask.sum())  # the whole step's, over every process
        # 2. loss over the whole step's completion tokens, micro-batch by micro-batch
        total = 0.0
        mbs = C.micro_batches(mask, args.micro_batch_size)
        for k, mb in enumerate(mbs):
            with R.sync_gradients(train_model, now=k == len(mbs) - 1):  # DDP: at the last
                with amp:
                    logprobs, _ = C.token_logprobs(train_model, batch.ids[mb],
                                                   batch.attention_mask[mb], mask.shape[1])
                loss = sft_loss(logprobs, mask[mb], n_tokens)
                # gradients add up over the micro-batches. DDP (FSDP2) averages the processes'
                # gradients: scaled by their number, that is the whole step's sum
                (loss * run.world).backward()
            total += loss.item()
        # 3. clip, step
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if keep.finite(grad_norm):  # NaN/inf would ruin the weights: skip it
            opt.step()
        opt.zero_grad(set_to_none=True)
        # 4. log (tokens_per_s: every token read), eval, checkpoint
        keep.end_step(step, {"loss": float(R.global_sum(total)), "grad_norm": float(grad_norm),
                             "epoch": step / per_epoch, "lr": opt.param_groups[0]["lr"],
                             "tokens": int(n_tokens)}, tokens=batch.attention_mask.sum())
    keep.finish("accuracy", eval_before, charts=("loss", "eval_loss"))


if __name__ == "__main__":
    R.main_guard(main)
