"""reward_model.py: a Bradley-Terry reward model (Christiano et al. 2017; InstructGPT, Ouyang et
al. 2022), the second stage of the RLHF pipeline: a scalar score r(x, y) fitted to preferences.

Bradley-Terry: an annotator prefers y_w to y_l with probability sigmoid(r(x, y_w) - r(x, y_l)),
and maximum likelihood on preference pairs gives

    r(x, y) = the score head on the last real token of x + y + EOS (left-padded)  score_forward()
    loss    = -(1/N) sum over rows, sum over the row's pairs of
              w * log sigmoid(r(x, y_w) - r(x, y_l) - margin)             bradley_terry_loss()
    w       = 1 / (pairs of the row);  N = rows in the optimizer step

A row is one prompt's annotation: a pair {"prompt", "chosen", "rejected"} (optional "margin", as
Llama 2) or a ranking {"prompt", "ranking": [best, ..., worst]} of K completions, expanded into
all K(K-1)/2 pairs in one batch, each weighted 1/(K(K-1)/2) so that a long ranking counts as one
prompt (InstructGPT; C.ranking_pairs()). Each completion is scored once: K forwards, K(K-1)/2 pairs.

Scoring is common.rm_scores' exactly (prompt + completion re-tokenised, then EOS; or the chat
template), so the checkpoint is a reward model as it is for `ppo.py --reward_model OUT/checkpoint`
and `grpo.py --rewards rm --reward_model OUT/checkpoint`. It starts from a causal LM (InstructGPT:
the SFT model) with a fresh score head, N(0, 1/sqrt(d + 1)) (N details); a reward model keeps its
own. Logged: loss, pair accuracy, margin r_w - r_l, the scores' mean and std. Held out: pair
accuracy on a fixed fifth of the prompts, scored by C.rm_scores() itself.

Run:  python reward_model.py             # bundled: data/rankings.jsonl, 2-core CPU, ~1 min
      python reward_model.py --model OUT_SFT/checkpoint --data prefs.jsonl --lr 1e-5
Expect (bundled default): held-out pair accuracy from about 0.5 (a random head) to about 0.9.
"""
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoModelForSequenceClassification

import common as C
import runs as R



@dataclass
class Args:
    # --- model and data
    model: str = C.DEFAULT_POLICY  # a causal LM (a fresh score head) or a reward model to go on
    data: str = C.PIPELINE_RANKINGS  # JSONL of pairs {"prompt", "chosen", "rejected"} or rankings
    chat_template: Literal["auto", "none"] = "auto"  # auto: the tokenizer's template, if it has one
    trust_remote_code: bool = False  # never run a model repo's own code unless asked
    # --- optimisation
    lr: float = 3e-4  # tiny-model value (1e-3 overfits the data's bias); TRL 1e-4, TL;DR 3e-6
    anneal_lr: bool = True  # the lr falls linearly to 0 over max_steps (TL;DR details)
    max_grad_norm: float = 1.0  # gradient clipping (TRL 1.0)
    batch_size: int = 32  # rows (prompts) per optimizer step, all pairs of each (InstructGPT 64)
    max_steps: int = 300  # optimizer steps (about 4 passes over the bundled 2,280 train rows)
    micro_batch_size: int = 32  # rows per forward; the loss is normalised over the whole step
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    # --- run
    seed: int = 0  # seeds the batch order: same seed, same run
    eval_every: int = 100  # steps between held-out evals (0: only before and after)
    eval_size: int = 500  # held-out prompts at most (a fifth of them)
    save_every: int = 100  # steps between checkpoints (also at the end and on Ctrl-C; 0: only then)
    output_dir: str = ""  # default runs/reward_model-<time>
    resume: str = ""  # a previous output_dir: continue its run from its checkpoint


# --------------------------------------------------------------------------- the algorithm
def bradley_terry_loss(r_chosen, r_rejected, margin, weight, n_rows):
    """-w log sigmoid(r_chosen - r_rejected - margin), summed over pairs and divided by n_rows,
    the rows of the whole optimizer step. All arguments but n_rows are (pairs,)."""
    return -(weight * F.logsigmoid(r_chosen - r_rejected - margin)).sum() / n_rows


def score_forward(rm, tok, prompts, completions, chat_template):
    """r (B,) with gradients, exactly as C.rm_scores reads it when ppo.py or grpo.py score with
    this model: prompt + completion + EOS (or the chat template), left-padded, the score head on
    every row's last real token (C.rm_sequences, C.rm_forward)."""
    seqs = C.rm_sequences(tok, prompts, completions, chat_template)
    ids, mask = C.left_pad(seqs, tok.pad_token_id, next(rm.parameters()).device)
    return C.rm_forward(rm, ids, mask)


def load_reward_model(src, tok, device, args):
    """AutoModelForSequenceClassification, num_labels=1, fp32, dropout off; a fresh head."""
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            src, num_labels=1, dtype=torch.float32, trust_remote_code=args.trust_remote_code,
            output_loading_info=True)
    except (OSError, ValueError) as e:
        raise C.UserError(f"model {src!r} could not be loaded as a reward model: "
                          f"{C._first_line(e)}") from None
    if any(k.startswith("score.") for k in info["missing_keys"]):  # a fresh head (N details)
        torch.nn.init.normal_(model.score.weight, std=1 / (model.config.hidden_size + 1) ** 0.5)
    model.config.pad_token_id = tok.pad_token_id  # HF's own forward finds the last token by it
    return model.to(device).eval()


@torch.no_grad()
def pair_accuracy(rm, tok, rows, args):
    """Held-out fraction of pairs whose chosen completion scores higher, by C.rm_scores."""
    prompts, completions, chosen, rejected, _, _ = C.flatten(rows)
    r = C.rm_scores(rm, tok, prompts, completions, chat_template=args.chat_template)
    return float((r[chosen] > r[rejected]).float().mean()) if chosen else float("nan")


# -------------------------------------------------------------------------- the training loop
def main():
    args = R.parse_args(Args, "reward_model", __doc__)  # --resume DIR: that run's own settings
    R.check_args(args)
    train, held = C.read_preferences(args.data or C.PIPELINE_RANKINGS, args.eval_size)
    run = R.start_run(args, "reward_model")  # output folder, lock, metrics.jsonl, Ctrl-C handler
    rng = R.seed_everything(args.seed)  # (also seeds the fresh score head)
    device = C.pick_device()
    amp = C.autocast(device, args.dtype)  # bf16 forwards on a GPU; weights stay fp32
    src = f"{run.dir}/checkpoint" if args.resume else args.model
    tok = C.load_tokenizer(src, args.trust_remote_code)
    model = load_reward_model(src, tok, device, args)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0,  # (TRL 0)
                            fused=True)  # fused: one kernel for all parameters

    def evaluate():
        return {"eval": pair_accuracy(model, tok, held, args)}
    start, eval_before, _ = R.resume_or_eval(run, opt, rng, evaluate, "pair accuracy")
    bar = tqdm(range(start, args.max_steps), initial=start, total=args.max_steps, desc="rm")
    for step in bar:
        t0 = time.time()
        if args.anneal_lr:  # from the step number, so resuming needs no scheduler state
            opt.param_groups[0]["lr"] = args.lr * (1 - step / args.max_steps)
        # 1. the next batch of rows (each epoch a new shuffle)
        batch = C.step_rows(train, args.batch_size, args.seed, step)
        # 2. score each completion once; Bradley-Terry loss over every pair of the step's rows
        sums, scores = dict.fromkeys(("loss", "accuracy", "margin"), 0.0), []
        n_pairs = sum(len(r["pairs"]) for r in batch)
        for s in range(0, len(batch), args.micro_batch_size):
            prompts, completions, ci, ri, margin, weight = C.flatten(
                batch[s:s + args.micro_batch_size])
            with amp:
                r = score_forward(model, tok, prompts, completions, args.chat_template)
            loss = bradley_terry_loss(r[ci], r[ri], margin.to(device), weight.to(device),
                                      len(batch))
            loss.backward()  # gradients add up over the micro-batches
            diff = (r[ci] - r[ri]).detach()
            sums["loss"] += loss.item()
            sums["accuracy"] += float((diff > 0).sum()) / n_pairs
            sums["margin"] += float(diff.sum()) / n_pairs
            scores.append(r.detach())
        # 3. clip, step
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if torch.isfinite(grad_norm):  # a NaN/inf gradient would ruin the weights: skip it
            opt.step()
            run.nonfinite_in_row = 0
        else:
            R.skip_update(run, "loss or gradient")
        opt.zero_grad(set_to_none=True)
        # 4. log, eval, checkpoint
        scores = torch.cat(scores)
        metrics = {"step": step + 1, **sums, "score_mean": float(scores.mean()),
                   "score_std": float(scores.std()), "grad_norm": float(grad_norm),
                   "pairs": n_pairs, "epoch": step * args.batch_size / len(train),
                   "lr": opt.param_groups[0]["lr"], "step_time": time.time() - t0}
        last = step + 1 == args.max_steps or R.STOP["requested"]  # Ctrl-C makes this the last
        if R.every(step, args.eval_every) and not last:
            metrics.update(evaluate())
        R.log_step(run, metrics, bar, None, opt)
        if R.every(step, args.save_every) or last or R.STOP["requested"]:
            R.save_checkpoint(run, model, tok, opt, rng, step + 1, {"eval_before": eval_before})
        if R.STOP["requested"]:
            break
    R.finish_run(run, device, "pair accuracy", eval_before, evaluate,
                 charts=("loss", "accuracy", "score_mean"))


if __name__ == "__main__":
    R.main_guard(main)
