"""dpo.py: Direct Preference Optimization (Rafailov et al. 2023), with the IPO (Azar et al. 2023)
and conservative-DPO (label smoothing) switches: RLHF without a reward model and without sampling.

The KL-regularised RLHF objective max E[r(x, y)] - beta KL(pi_theta || pi_ref) has the optimum
pi*(y|x) ~ pi_ref(y|x) exp(r(x, y) / beta), so r(x, y) = beta log pi*(y|x) / pi_ref(y|x) + a
term of x alone. Put that into the Bradley-Terry likelihood of a preference y_w > y_l (the term
of x cancels) and fit the policy to the preferences directly:

    log pi(y|x) = sum over the completion's tokens, EOS included      sequence_logprobs()
    h      = [log pi_theta(y_w|x) - log pi_ref(y_w|x)] - [log pi_theta(y_l|x) - log pi_ref(y_l|x)]
    sigmoid (DPO):  L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)     dpo_loss()
                    eps = label_smoothing: the labels are flipped with probability eps (cDPO)
    ipo (IPO):      L = (h - 1 / (2 beta))^2: h is pulled to a target instead of pushed to
                    infinity, so deterministic preferences do not drive pi_ref's mass to 0.
                    h sums log-probs over the tokens, the paper's form; TRL's IPO averages
                    them per token (its h is about |y| times smaller), so a beta tuned on TRL
                    is not the same beta here
    loss   = (1/N) sum over rows, sum over the row's pairs of w * L,  w = 1 / (pairs of the row)

pi_ref is a frozen copy of the starting (SFT) model (with --lora_r, the policy itself with its
adapters off: no second copy, runs.adapters_off()). beta * (log pi_theta - log pi_ref) is the
implicit reward: logged for the chosen and the rejected completions, with their margin and the
preference accuracy (how often the chosen one's is higher). Two models are held in memory, the
policy and the reference, and nothing is sampled during training: DPO learns from the fixed
preference data alone (off-policy), where PPO and GRPO score fresh samples every step.

Data: the format of reward_model.py (tasks.read_preferences()): pairs {"prompt", "chosen",
"rejected"} (TRL's: text or messages, the prompt explicit or implicit) or rankings {"prompt",
"ranking"}, expanded into all pairs, one row's pairs weighted to count as one row (a pair's
"margin" is not used by DPO). Held out: a fixed fifth of the prompts, for the implicit-reward
accuracy, and the task score, held-out greedy accuracy (C.evaluate) on the built-in addition task
(or --eval_data), before and after.

Run:  python dpo.py                      # bundled: data/rankings.jsonl, 2-core CPU, ~1 min
      python dpo.py --loss_type ipo                  # IPO (same beta: target h = 1/(2 beta))
      python dpo.py --lora_r 16 --lr 1e-3            # LoRA; pi_ref: the policy, adapters off
      python dpo.py --model OUT_SFT/checkpoint --data prefs.jsonl --lr 1e-6 --beta 0.1 \\
          --micro_batch_size 8 --max_new_tokens 256
Expect (bundled default): held-out greedy accuracy from 0.29 to about 0.83 (see README).
"""
from plumbing import ctrl_c  # noqa: F401  (first: Ctrl-C while torch loads is one line)
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

import common as C
from plumbing.errors import UserError
from plumbing import flags
from plumbing.flags import arg  # an Args field with its valid range
from plumbing import loading
from plumbing import runs as R
from plumbing import tasks


@dataclass
class Args:
    # --- model and data
    model: str = loading.DEFAULT_POLICY  # the starting (SFT) model: policy and frozen reference
    data: str = tasks.PIPELINE_RANKINGS  # pairs or rankings, a data file or hf:... (tasks.py)
    eval_data: str = ""  # task score: '' = built-in addition task; a file of {"prompt", "answer"}
    chat_template: Literal["auto", "none"] = "auto"  # auto: the tokenizer's template, if it has one
    trust_remote_code: bool = False  # never run a model repo's own code unless asked
    max_new_tokens: int = arg(6, "> 0")  # the task score's greedy answers (the task needs 4)
    stop: list[str] = field(default_factory=list)  # stop strings for those answers
    # --- the DPO objective
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"  # DPO, or IPO on summed log-probs (TRL: means)
    beta: float = arg(0.1, "> 0")  # strength of the KL to pi_ref (DPO paper 0.1-0.5; TRL 0.1)
    label_smoothing: float = arg(0.0, "[0, 0.5)")  # cDPO: chance a preference is flipped (TRL 0)
    # --- optimisation
    lr: float = arg(1e-4, "> 0")  # tiny-model lr; real models ~5e-7 (DPO paper), 1e-6 (TRL)
    weight_decay: float = arg(0.0, ">= 0")  # AdamW weight decay (TRL 0)
    anneal_lr: bool = True  # the lr falls linearly to 0 over max_steps
    max_grad_norm: float = arg(1.0, "> 0")  # gradient clipping (TRL 1.0)
    batch_size: int = arg(32, "> 0")  # prompts per step, all pairs of each (DPO paper 64)
    max_steps: int = arg(150, "> 0")  # optimizer steps (2 passes over the bundled rows)
    micro_batch_size: int = arg(32, "> 0")  # rows per forward; the loss is normalised per step
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory
    fsdp: bool = False  # torchrun: shard the trained model across processes with FSDP2 (README)
    lora_r: int = arg(0, ">= 0")  # LoRA rank (pip install peft); pi_ref: adapters off
    lora_alpha: int = arg(32, "> 0")  # LoRA scale: the update is alpha / r * B A (TRL examples)
    lora_dropout: float = arg(0.0, "[0, 1)")  # adapter dropout (> 0 makes log-probs noisy)
    lora_target_modules: str = "all-linear"  # comma list, or peft's every linear layer but the head
    compile: bool = False  # torch.compile policy and reference: for CUDA; no measured gain on CPU
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    threads: int = arg(0, ">= 0, <= 4 * cores")  # CPU threads; 0: 1 under 10 M params, else all
    # --- run
    seed: int = arg(0, ">= 0, < 2**63")  # seeds the batch order: same seed, same run
    eval_every: int = arg(50, ">= 0")  # steps between held-out evals (0: only before and after)
    eval_size: int = arg(500, "> 0")  # held-out prompts at most, and task prompts for the score
    save_every: int = arg(100, ">= 0")  # steps between checkpoints (0: only at the end, Ctrl-C)
    save_optimizer: bool = False  # the final checkpoint too keeps AdamW: --resume may extend it
    output_dir: str = ""  # default runs/dpo-<time>
    resume: str = ""  # a previous output_dir: continue its run from its checkpoint


# --------------------------------------------------------------------------- the algorithm
def dpo_loss(logp_chosen, logp_rejected, ref_chosen, ref_rejected, args):
    """The DPO or IPO loss of each pair (args.loss_type, args.beta, args.label_smoothing) from
    sequence log-probs (pairs,): (pairs,). Also returns the implicit rewards
    beta * (log pi_theta - log pi_ref) of chosen and rejected, detached."""
    beta, eps = args.beta, args.label_smoothing
    h = (logp_chosen - ref_chosen) - (logp_rejected - ref_rejected)
    if args.loss_type == "sigmoid":
        loss = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif args.loss_type == "ipo":
        loss = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(args.loss_type)
    return loss, (beta * (logp_chosen - ref_chosen)).detach(), \
        (beta * (logp_rejected - ref_rejected)).detach()


def sequence_logprobs(model, batch, amp):
    """log pi(y|x) (B,): the sum of the completion's token log-probs, EOS included."""
    mask = batch.completion_mask
    with amp:
        lp, _ = C.token_logprobs(model, batch.ids, batch.attention_mask, mask.shape[1])
    return (lp * mask).sum(-1)


@torch.no_grad()
def reference_logprobs(ref, batch, amp):
    """log pi_ref(y|x) (B,). With LoRA, pi_ref is the policy with its adapters off."""
    with R.adapters_off(ref):
        return sequence_logprobs(ref, batch, amp)


def encode_rows(tok, rows, chat_template):
    """Each row's completions as (prompt ids, completion ids + EOS), the prompt encoded as the RL
    scripts encode it (chat template and all)."""
    with loading.template_errors(tok):  # e.g. Gemma's 'System role not supported'
        prompt_ids = C.encode_prompts(tok, [r["prompt"] for r in rows], chat_template)
    for r, p in zip(rows, prompt_ids):
        r["ids"] = [(p, tok(c, add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
                    for c in r["completions"]]
    return rows


def pair_batch(rows, pad_id, device):
    """A batch of rows as one rollout of all their completions, and the pairs in it:
    (batch, chosen index, rejected index, weight)."""
    _, _, chosen, rejected, _, weight = tasks.flatten(rows)
    batch = tasks.collate([x for r in rows for x in r["ids"]], pad_id, device)
    return batch, chosen, rejected, weight.to(device)


@torch.no_grad()
def implicit_accuracy(model, ref, rows, args, pad_id, amp):
    """Held-out fraction of pairs whose chosen completion has the higher implicit reward (0.5 at
    the start, where pi_theta = pi_ref and every pair ties); under torchrun, over every
    process's rows."""
    device = next(model.parameters()).device
    right, n = 0.0, 0
    for s in range(0, len(rows), args.micro_batch_size):
        batch, ci, ri, _ = pair_batch(rows[s:s + args.micro_batch_size], pad_id, device)
        h = sequence_logprobs(model, batch, amp) - reference_logprobs(ref, batch, amp)
        right += float((h[ci] > h[ri]).sum() + 0.5 * (h[ci] == h[ri]).sum())  # a tie: a coin
        n += len(ci)
    right, n = R.global_sum(torch.tensor([right, n], dtype=torch.float64)).tolist()
    return right / n if n else float("nan")


def check_args(args):
    flags.check_args(args)
    if args.loss_type == "ipo" and args.label_smoothing:
        raise UserError("--label_smoothing is for --loss_type sigmoid (cDPO); IPO has none")


# -------------------------------------------------------------------------- the training loop
def main():
    args = flags.parse_args(Args, "dpo", __doc__)  # --resume DIR: that run's own settings
    check_args(args)
    train, held = tasks.read_preferences(args.data or tasks.PIPELINE_RANKINGS, args.eval_size)
    device = R.setup_distributed()  # under torchrun: this process's device; else cuda or cpu
    run = R.start_run(args, "dpo")  # output folder, lock, metrics.jsonl, Ctrl-C handler
    rng = R.seed_everything(args.seed)
    amp = loading.autocast(device, args.dtype)  # bf16 forwards on a GPU; weights stay fp32
    # the policy (fp32 weights, dropout off) and pi_ref, the starting model, frozen
    model, tok = loading.load_policy(args, device, f"{run.dir}/checkpoint" if args.resume else "")
    R.set_threads(args, model)  # CPU: one thread for a small model (see runs.set_threads)
    ref = model if args.lora_r else loading.load_model(
        args.model, "lm", device, frozen=True, compile=args.compile,
        trust_remote_code=args.trust_remote_code)
    train, held = [encode_rows(tok, rows, args.chat_template) for rows in (train, held)]
    task = tasks.load_data("", args.eval_size).eval_rows if not args.eval_data else \
        tasks.read_rows(args.eval_data, need_answer=True)[:args.eval_size]
    loading.check_prompts(tok, model.config, task, args)
    train_model = R.wrap_model(model, args.fsdp)  # torchrun: DDP, or FSDP2 in place (--fsdp)
    trained = [p for p in model.parameters() if p.requires_grad]  # all, or LoRA's adapters
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=args.weight_decay,
                            fused=True)  # fused: one kernel for all parameters

    def evaluate():  # task score (greedy accuracy) and held-out implicit-reward accuracy
        with R.gathered(model):  # --fsdp: the whole model in every process, for any row count
            acc = implicit_accuracy(model, ref, held[run.rank::run.world], args,
                                    tok.pad_token_id, amp)  # torchrun: each process a share
        score = R.split_eval(run, model, task, lambda rows: C.evaluate(model, tok, rows, args, amp,
                                                                       {"math": 1.0}))
        return {**score, "eval_reward_acc": acc}
    start, eval_before, _ = R.resume_or_eval(run, opt, rng, evaluate, "accuracy", [model])

    # checkpoint/ after `done` steps (every --save_every, at the end, on Ctrl-C). The run-keeping
    # (Ctrl-C, the NaN guard, logs, eval, checkpoints) is keep's: each keep.* call below is one of
    # its duties (runs.Keeper); what is left is the algorithm.
    def save(done):
        R.save_checkpoint(run, model, tok, opt, rng, done, {"eval_before": eval_before})
    keep = R.Keeper(run, opt, rng, save, evaluate,
                    shown=("loss", "rewards/margin", "rewards/accuracy", "eval"))
    for step in keep.steps(start):
        if args.anneal_lr:  # from the step number, so resuming needs no scheduler state
            opt.param_groups[0]["lr"] = args.lr * (1 - step / args.max_steps)
        # 1. the next batch of rows (each epoch a new shuffle; torchrun: this process's share)
        rows = R.my_share(tasks.step_rows(train, args.batch_size, args.seed, step))
        n_rows = len(rows) * run.world  # the whole step's rows and pairs, over every process
        n_pairs = float(R.global_sum(sum(len(r["pairs"]) for r in rows)))
        # 2. log-probs of every completion under pi_theta and pi_ref; the loss over every pair
        keys = ("loss", "rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy",
                "logps/chosen", "logps/rejected")
        sums = dict.fromkeys(keys, 0.0)
        starts = range(0, len(rows), args.micro_batch_size)
        for s in starts:
            batch, ci, ri, weight = pair_batch(rows[s:s + args.micro_batch_size],
                                               tok.pad_token_id, device)
            with R.sync_gradients(train_model, now=s == starts[-1]):  # DDP: at the last
                logp = sequence_logprobs(train_model, batch, amp)  # (completions,), with grads
                ref_logp = reference_logprobs(ref, batch, amp)
                loss, r_chosen, r_rejected = dpo_loss(logp[ci], logp[ri], ref_logp[ci],
                                                      ref_logp[ri], args)
                loss = (weight * loss).sum() / n_rows  # weighted, over the whole step's rows
                # gradients add up over the micro-batches. DDP (FSDP2) averages the processes'
                # gradients: scaled by their number, that is the whole step's sum
                (loss * run.world).backward()
            sums["loss"] += loss.item()
            for key, x in (("rewards/chosen", r_chosen), ("rewards/rejected", r_rejected),
                           ("rewards/margin", r_chosen - r_rejected),
                           ("rewards/accuracy",  # a tie counts 0.5, as in implicit_accuracy
                            (r_chosen > r_rejected) + 0.5 * (r_chosen == r_rejected)),
                           ("logps/chosen", logp[ci].detach()),
                           ("logps/rejected", logp[ri].detach())):
                sums[key] += float(x.sum()) / n_pairs  # means over the step's pairs
        # 3. clip, step
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if keep.finite(grad_norm):  # NaN/inf would ruin the weights: skip it
            opt.step()
        opt.zero_grad(set_to_none=True)
        # 4. log, eval, checkpoint
        sums = {k: float(R.global_sum(v)) for k, v in sums.items()}  # torchrun: every process's
        keep.end_step(step, {**sums, "grad_norm": float(grad_norm), "pairs": int(n_pairs),
                             "epoch": step * args.batch_size / len(train),
                             "lr": opt.param_groups[0]["lr"]})
    keep.finish("accuracy", eval_before, charts=("loss", "rewards/margin", "rewards/accuracy"))


if __name__ == "__main__":
    R.main_guard(main)
