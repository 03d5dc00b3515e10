"""reward_model.py: a Bradley-Terry reward model (Christiano et al. 2017; InstructGPT, Ouyang et
al. 2022), the second stage of the RLHF pipeline: a scalar score r(x, y) fitted to preferences.

Bradley-Terry: an annotator prefers y_w to y_l with probability sigmoid(r(x, y_w) - r(x, y_l)),
and maximum likelihood on preference pairs gives

    r(x, y) = the score head on the last real token of x + y + EOS (left-padded)  score_forward()
    loss    = -(1/N) sum over rows, sum over the row's pairs of
              w * log sigmoid(r(x, y_w) - r(x, y_l) - margin)             bradley_terry_loss()
    w       = 1 / (pairs of the row);  N = rows in the optimizer step

A row is one prompt's annotation: a pair {"prompt", "chosen", "rejected"} (optional "margin", as
Llama 2; TRL's formats: text or messages, the prompt explicit or implicit) or a ranking
{"prompt", "ranking": [best, ..., worst]} of K completions, expanded into all K(K-1)/2 pairs in
one batch, each weighted 1/(K(K-1)/2) so that a long ranking counts as one prompt (InstructGPT;
tasks.ranking_pairs()). Each completion is scored once: K forwards, K(K-1)/2 pairs.

Scoring is common.rm_scores' exactly (prompt + completion re-tokenised, then EOS; or the chat
template), so the checkpoint is a reward model as it is for `ppo.py --reward_model OUT/checkpoint`
and `grpo.py --rewards rm --reward_model OUT/checkpoint`. It starts from a causal LM (InstructGPT:
the SFT model) with a fresh score head, N(0, 1/sqrt(d + 1)) (N details); a reward model keeps its
own. Logged: loss, pair accuracy, margin r_w - r_l, the scores' mean and std. Held out: pair
accuracy on a fixed fifth of the prompts, scored as C.rm_scores() scores (score_forward()).

Run:  python reward_model.py             # bundled: data/rankings.jsonl, 2-core CPU, ~1 min
      python reward_model.py --lora_r 16 --lr 1e-3   # LoRA; then tools/merge_lora.py RUN_DIR
      python reward_model.py --model OUT_SFT/checkpoint --data prefs.jsonl --lr 1e-5
Expect (bundled default): held-out pair accuracy from about 0.5 (a random head) to about 0.9.
"""
from plumbing import ctrl_c  # noqa: F401  (first: Ctrl-C while torch loads is one line)
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification
from transformers.utils import logging as hf_logging

import common as C
from plumbing.errors import UserError, first_line
from plumbing import flags
from plumbing.flags import arg  # an Args field with its valid range
from plumbing import loading
from plumbing import runs as R
from plumbing import tasks



@dataclass
class Args:
    # --- model and data
    model: str = loading.DEFAULT_POLICY  # a causal LM (new score head), or a reward model to go on
    data: str = tasks.PIPELINE_RANKINGS  # pairs or rankings, a data file or hf:... (tasks.py)
    chat_template: Literal["auto", "none"] = "auto"  # auto: the tokenizer's template, if it has one
    trust_remote_code: bool = False  # never run a model repo's own code unless asked
    # --- optimisation
    lr: float = arg(3e-4, "> 0")  # tiny-model lr (1e-3 overfits); TRL 1e-4, TL;DR 3e-6
    anneal_lr: bool = True  # the lr falls linearly to 0 over max_steps (TL;DR details)
    max_grad_norm: float = arg(1.0, "> 0")  # gradient clipping (TRL 1.0)
    batch_size: int = arg(32, "> 0")  # prompts per step, all pairs of each (InstructGPT 64)
    max_steps: int = arg(300, "> 0")  # optimizer steps (4 passes over the bundled rows)
    micro_batch_size: int = arg(32, "> 0")  # rows per forward; the loss is normalised per step
    fsdp: bool = False  # torchrun: shard the trained model across processes with FSDP2 (README)
    lora_r: int = arg(0, ">= 0")  # LoRA rank (peft): adapters on the body, the head in full
    lora_alpha: int = arg(32, "> 0")  # LoRA scale: the update is alpha / r * B A (TRL examples)
    lora_dropout: float = arg(0.0, "[0, 1)")  # dropout on the adapters' input
    lora_target_modules: str = "all-linear"  # comma list, or peft's every linear layer but the head
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    threads: int = arg(0, ">= 0, <= 4 * cores")  # CPU threads; 0: 1 under 10 M params, else all
    # --- run
    seed: int = arg(0, ">= 0, < 2**63")  # seeds the batch order: same seed, same run
    eval_every: int = arg(100, ">= 0")  # steps between held-out evals (0: only before and after)
    eval_size: int = arg(500, "> 0")  # held-out prompts at most (a fifth of them)
    save_every: int = arg(100, ">= 0")  # steps between checkpoints (0: only at the end, Ctrl-C)
    save_optimizer: bool = False  # the final checkpoint too keeps AdamW: --resume may extend it
    output_dir: str = ""  # default runs/reward_model-<time>
    resume: str = ""  # a previous output_dir: continue its run from its checkpoint


# --------------------------------------------------------------------------- the algorithm
def bradley_terry_loss(r_chosen, r_rejected, margin, weight, n_rows):
    """-w log sigmoid(r_chosen - r_rejected - margin), summed over pairs and divided by n_rows,
    the rows of the whole optimizer step. All arguments but n_rows are (pairs,)."""
    return -(weight * F.logsigmoid(r_chosen - r_rejected - margin)).sum() / n_rows


class Scorer(torch.nn.Module):
    """The reward model as one module whose forward returns r (B,): DistributedDataParallel syncs
    the gradients of what a module's forward computes, and FSDP2 gathers the weights it needs
    (C.rm_forward reads the backbone and the head separately)."""

    def __init__(self, rm):
        super().__init__()
        self.rm = rm

    def forward(self, ids, mask):
        return C.rm_forward(self.rm, ids, mask)


def score_forward(scorer, tok, prompts, completions, chat_template):
    """r (B,) with gradients, exactly as C.rm_scores reads it when ppo.py or grpo.py score with
    this model: prompt + completion + EOS (or the chat template), left-padded, the score head on
    every row's last real token (C.rm_sequences, C.rm_forward). scorer: a Scorer, or it wrapped."""
    seqs = C.rm_sequences(tok, prompts, completions, chat_template)
    ids, mask = C.left_pad(seqs, tok.pad_token_id, next(scorer.parameters()).device)
    return scorer(ids, mask)


def load_reward_model(src, tok, device, args):
    """AutoModelForSequenceClassification, num_labels=1, fp32, dropout off; a fresh head."""
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its loading report's table of missing keys: said below
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            src, num_labels=1, dtype=torch.float32, trust_remote_code=args.trust_remote_code,
            output_loading_info=True)
    except (OSError, ValueError) as e:
        raise UserError(f"model {src!r} could not be loaded as a reward model: "
                        f"{first_line(e)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    if any(k.startswith("score.") for k in info["missing_keys"]):  # a fresh head (N details)
        if R.get_rank() == 0:
            print(f"{src}: a causal LM; its reward model starts with a fresh score head")
        torch.nn.init.normal_(model.score.weight, std=1 / (model.config.hidden_size + 1) ** 0.5)
    model.config.pad_token_id = tok.pad_token_id  # HF's own forward finds the last token by it
    return model.to(device).eval()


@torch.no_grad()
def pair_accuracy(scorer, tok, rows, args, micro_batch=64):
    """Held-out fraction of pairs whose chosen completion scores higher (under torchrun, over
    every process's rows)."""
    prompts, completions, chosen, rejected, _, _ = tasks.flatten(rows)
    r = torch.cat([score_forward(scorer, tok, prompts[i:i + micro_batch],
                                 completions[i:i + micro_batch], args.chat_template)
                   for i in range(0, len(prompts), micro_batch)] or [torch.zeros(0)])
    right, n = R.global_sum(torch.tensor([float((r[chosen] > r[rejected]).sum()), len(chosen)]))
    return float(right / n) if n else float("nan")


# -------------------------------------------------------------------------- the training loop
def main():
    args = flags.parse_args(Args, "reward_model", __doc__)  # --resume DIR: that run's own settings
    flags.check_args(args)
    train, held = tasks.read_preferences(args.data or tasks.PIPELINE_RANKINGS, args.eval_size)
    device = R.setup_distributed()  # under torchrun: this process's device; else cuda or cpu
    run = R.start_run(args, "reward_model")  # output folder, lock, metrics.jsonl, Ctrl-C handler
    rng = R.seed_everything(args.seed)  # (also seeds the fresh score head)
    amp = loading.autocast(device, args.dtype)  # bf16 forwards on a GPU; weights stay fp32
    ckpt = f"{run.dir}/checkpoint" if args.resume else ""
    tok = loading.load_tokenizer(ckpt or args.model, args.trust_remote_code)
    model = load_reward_model(args.model if args.lora_r else ckpt or args.model, tok, device, args)
    R.set_threads(args, model)  # CPU: one thread for a small model (see runs.set_threads)
    if args.lora_r:  # LoRA saves the adapters and the head: tools/merge_lora.py makes a full RM
        model = loading.add_lora(model, args, ckpt, task="SEQ_CLS")
    plain = Scorer(model)  # r (B,) from one forward: the module DDP or FSDP2 wraps
    scorer = R.wrap_model(plain, args.fsdp)  # torchrun: DDP, or FSDP2 in place (--fsdp)
    trained = [p for p in model.parameters() if p.requires_grad]  # all, or adapters and head
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0,  # (TRL 0)
                            fused=True)  # fused: one kernel for all parameters

    def evaluate():  # torchrun: each process scores a share of the rows
        with R.gathered(plain):  # --fsdp: the whole model in every process, for any row count
            return {"eval": pair_accuracy(plain, tok, held[run.rank::run.world], args)}
    start, eval_before, _ = R.resume_or_eval(run, opt, rng, evaluate, "pair accuracy", [scorer])

    # checkpoint/ after `done` steps (every --save_every, at the end, on Ctrl-C). The run-keeping
    # (Ctrl-C, the NaN guard, logs, eval, checkpoints) is keep's: each keep.* call below is one of
    # its duties (runs.Keeper); what is left is the algorithm.
    def save(done):
        R.save_checkpoint(run, model, tok, opt, rng, done, {"eval_before": eval_before},
                          trained=[scorer])
    keep = R.Keeper(run, opt, rng, save, evaluate, shown=("loss", "accuracy", "eval"))
    for step in keep.steps(start):
        if args.anneal_lr:  # from the step number, so resuming needs no scheduler state
            opt.param_groups[0]["lr"] = args.lr * (1 - step / args.max_steps)
        # 1. the next batch of rows (each epoch a new shuffle; torchrun: this process's share)
        batch = R.my_share(tasks.step_rows(train, args.batch_size, args.seed, step))
        n_rows = len(batch) * run.world  # the whole step's rows and pairs, over every process
        n_pairs = float(R.global_sum(sum(len(r["pairs"]) for r in batch)))
        # 2. score each completion once; Bradley-Terry loss over every pair of the step's rows
        sums, scores = dict.fromkeys(("loss", "accuracy", "margin"), 0.0), []
        starts = range(0, len(batch), args.micro_batch_size)
        for s in starts:
            prompts, completions, ci, ri, margin, weight = tasks.flatten(
                batch[s:s + args.micro_batch_size])
            with R.sync_gradients(scorer, now=s == starts[-1]):  # DDP: at the last
                with amp:
                    r = score_forward(scorer, tok, prompts, completions, args.chat_template)
                loss = bradley_terry_loss(r[ci], r[ri], margin.to(device), weight.to(device),
                                          n_rows)
                # gradients add up over the micro-batches. DDP (FSDP2) averages the processes'
                # gradients: scaled by their number, that is the whole step's sum
                (loss * run.world).backward()
            diff = (r[ci] - r[ri]).detach()
            sums["loss"] += loss.item()
            sums["accuracy"] += float((diff > 0).sum()) / n_pairs
            sums["margin"] += float(diff.sum()) / n_pairs
            scores.append(r.detach())
        # 3. clip, step
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if keep.finite(grad_norm):  # NaN/inf would ruin the weights: skip it
            opt.step()
        opt.zero_grad(set_to_none=True)
        # 4. log, eval, checkpoint. Under torchrun: sums over the processes; score_mean the mean
        # over every process's scores (end_step weights it by this process's), score_std too
        scores = torch.cat(scores)
        keep.end_step(step, {**{k: float(R.global_sum(v)) for k, v in sums.items()},
                             "score_mean": float(scores.mean()),
                             "score_std": float(R.global_std(scores)),
                             "grad_norm": float(grad_norm), "pairs": int(n_pairs),
                             "epoch": step * args.batch_size / len(train),
                             "lr": opt.param_groups[0]["lr"]},
                      token_weights={"score_mean": len(scores)})
    keep.finish("pair accuracy", eval_before, charts=("loss", "accuracy", "score_mean"),
                label="chosen > rejected")


if __name__ == "__main__":
    R.main_guard(main)
