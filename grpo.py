"""grpo.py: Group Relative Policy Optimization (Shao et al., DeepSeekMath, 2024), with the Dr. GRPO and DAPO switches.

For each prompt q, sample a group of G completions o_1..o_G, score each with a reward r_i, and give every token of
o_i the same advantage, its reward normalised within the group (no critic, no value model):

    A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)                                    group_advantages()
    rho_i,t = pi_theta(o_i,t | q, o_i,<t) / pi_old(o_i,t | q, o_i,<t)
    L_i,t = -min(rho_i,t A_i, clip(rho_i,t, 1 - eps_low, 1 + eps_high) A_i) + beta KL_k3(pi_theta || pi_ref)
                                                                                           per_token_loss()
    loss = aggregate(L) over the whole optimizer step                                      aggregate()

With num_iterations = 1 (the default, as in DeepSeekMath) pi_old = pi_theta, so rho = 1 and the clipped term's
value is just -A: the logged loss sits near 0 (the advantages average to 0), but its gradient, A * grad log pi, is
not 0. Watch reward, kl and clip_frac, not the loss (TRL issues #2703, #3452).
Switches: Dr. GRPO (Liu et al. 2025) = --scale_rewards none --loss_agg seq-sum-norm; DAPO (Yu et al. 2025) =
--clip_eps_high 0.28 --loss_agg token-mean --dynamic_sampling --overlong_penalty 1 --beta 0.

Run:  python grpo.py                                   # bundled tiny model and task, CPU, under a minute
      python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --data my.jsonl --max_new_tokens 256 --lr 1e-6 \\
          --micro_batch_size 16           # micro-batches change memory, not the gradient
Expect (bundled default, 2-core CPU): held-out greedy accuracy from 0.29 to about 0.9 (README has the table).
"""
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

import common as C


@dataclass
class Args:
    # --- model and data
    model: str = C.DEFAULT_POLICY  # hub id or local folder of any AutoModelForCausalLM
    data: str = ""  # '' = the built-in addition task; or a JSONL file of {"prompt", "answer"}; or hf:NAME[:CONFIG]
    chat_template: str = "auto"  # auto: use the tokenizer's chat template when it has one; none: raw prompts
    trust_remote_code: bool = False  # never run a repo's own code unless asked
    # --- sampling
    group_size: int = 8  # G completions per prompt (DeepSeekMath 64, TRL 8, DAPO 16)
    prompts_per_step: int = 8  # prompts per optimizer step, so G * prompts_per_step completions
    max_new_tokens: int = 6  # completion length cap (TRL 256/512; the built-in task needs 4)
    temperature: float = 1.0  # sampling temperature; log-probs use the same one (N implementation details)
    top_p: float = 1.0  # nucleus sampling (TRL default 1.0); below 1 the log-probs stay the full softmax's (off-policy)
    stop: list[str] = field(default_factory=list)  # stop strings, e.g. "</answer>": a row also ends at the token completing one
    # --- rewards
    rewards: str = "math"  # weighted components, e.g. "math=1,format=0.1,rm=0.5"; each logged as reward/<name>
    reward_model: str = ""  # AutoModelForSequenceClassification (num_labels=1) scoring prompt+completion, as 'rm'
    # --- the GRPO objective
    beta: float = 0.04  # KL coefficient (DeepSeekMath 0.04; TRL >= 0.19 and DAPO use 0: no reference model)
    kl_estimator: str = "k3"  # k1 | k2 | k3 (Schulman 2020); k3 in the loss as in DeepSeekMath
    clip_eps: float = 0.2  # eps_low: ratio clipped to [1 - eps, ...] (PPO, DeepSeekMath, TRL)
    clip_eps_high: float = 0.2  # eps_high; DAPO "clip-higher" uses 0.28
    num_iterations: int = 1  # mu: updates per batch; > 1 stores old log-probs (DeepSeekMath mu = 1)
    loss_agg: str = "token-mean"  # token-mean (DAPO, TRL default) | seq-mean-token-mean (GRPO) | seq-sum-norm (Dr. GRPO)
    scale_rewards: str = "group"  # group (GRPO) | batch | none (Dr. GRPO: no std division)
    mask_truncated: bool = False  # drop completions with no EOS from the loss (DAPO overlong filtering)
    overlong_penalty: float = 0.0  # DAPO soft overlong punishment: up to this much subtracted near the cap
    overlong_buffer: int = 2  # ... linearly over the last this-many tokens before max_new_tokens
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, resample to fill the batch
    max_resample_rounds: int = 4  # ... at most this many extra sampling rounds per step
    # --- optimisation
    lr: float = 1e-4  # tiny-model default (3e-4 measured worse); real models use ~1e-6 (DeepSeekMath, TRL)
    weight_decay: float = 0.0  # TRL/verl use 0 / 0.01
    max_grad_norm: float = 1.0  # TRL, verl, OpenRLHF
    max_steps: int = 200  # optimizer steps
    micro_batch_size: int = 64  # rows per forward; gradients accumulate to the same result (normaliser is global)
    gradient_checkpointing: bool = False  # trade compute for activation memory on real models
    compile: bool = False  # torch.compile policy and reference forwards: faster steps after a slow first one (README)
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU; or bf16 | fp32
    # --- run
    seed: int = 0
    eval_every: int = 50  # steps between held-out greedy evals (0: only before and after)
    eval_size: int = 500  # held-out prompts per eval
    save_every: int = 100  # steps between checkpoints (atomic; also on Ctrl-C and at the end; 0: only then)
    output_dir: str = ""  # default runs/grpo-<time>
    resume: str = ""  # a previous output_dir: continue from its checkpoint (optimizer, RNG, step, metrics)
    sanity: bool = False  # check log-probs, ratio, KL and masks on the real model and data, then exit


# ------------------------------------------------------------------------------------------- --- ALGORITHM ---
def group_advantages(rewards, group_size, scale="group", eps=1e-4):
    """A_i = r_i - mean of its group, divided by the group's std (GRPO), the batch's std, or nothing (Dr. GRPO).
    Groups are contiguous rows. A group whose rewards are all equal gets A = 0 (no signal)."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if scale == "group":
        adv = adv / (r.std(1, keepdim=True) + eps)
    elif scale == "batch":
        adv = adv / (rewards.std() + eps)
    return adv.view(-1)


def per_token_loss(logprobs, old_logprobs, advantages, clip_eps, clip_eps_high, ref_logprobs=None, beta=0.0,
                   kl_estimator="k3"):
    """Clipped surrogate per token, plus beta * KL to the reference in the loss (GRPO places KL in the loss, not
    in the reward). Returns the (B, T) loss and the ratio, KL and clipped-mask tensors for logging."""
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    unclipped, clipped = ratio * adv, torch.clamp(ratio, 1 - clip_eps, 1 + clip_eps_high) * adv
    loss = -torch.min(unclipped, clipped)
    is_clipped = (clipped < unclipped).float()  # where the min took the clipped branch: the gradient is 0 there
    kl = torch.zeros_like(logprobs)
    if ref_logprobs is not None:
        kl = C.kl_estimate(logprobs, ref_logprobs, kl_estimator)
        loss = loss + beta * kl
    return loss, ratio, kl, is_clipped


def aggregate(loss, mask, loss_agg, n_tokens, n_seqs, max_new_tokens):
    """Sum this micro-batch's share of the step's loss. The normalisers (n_tokens, n_seqs) count the whole
    optimizer step, so splitting the batch into micro-batches does not change the gradient (TRL issue #3021):
      token-mean           sum over all tokens / tokens in the step                (DAPO; longer answers weigh more)
      seq-mean-token-mean  mean over sequences of each sequence's token mean        (original GRPO, 1/|o_i|)
      seq-sum-norm         sum over all tokens / (sequences * max_new_tokens)       (Dr. GRPO: a constant)"""
    if loss_agg == "token-mean":
        return (loss * mask).sum() / n_tokens
    if loss_agg == "seq-mean-token-mean":
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n_seqs
    if loss_agg == "seq-sum-norm":
        return (loss * mask).sum() / (n_seqs * max_new_tokens)
    raise ValueError(loss_agg)


def cat_rollouts(pieces):
    """Concatenate (rollout, kept row indices) pieces into one rollout: prompts re-left-padded, completions
    right-padded. Padding ids are 0; they are masked out everywhere, since every mask comes from lengths."""
    P, T = max(r.P for r, _ in pieces), max(r.completion_mask.shape[1] for r, _ in pieces)

    def fit(r, key, i):  # rows i of r.<key> as (len(i), P + T)
        x = getattr(r, key)[i]
        pad = torch.nn.functional.pad
        return torch.cat([pad(x[:, :r.P], (P - r.P, 0)), pad(x[:, r.P:], (0, T - x.shape[1] + r.P))], 1)
    attention_mask = torch.cat([fit(r, "attention_mask", i) for r, i in pieces])
    return C.SimpleNamespace(ids=torch.cat([fit(r, "ids", i) for r, i in pieces]), attention_mask=attention_mask,
                             completion_mask=attention_mask[:, P:].float(), P=P,
                             truncated=torch.cat([r.truncated[i] for r, i in pieces]))


def sample_groups(model, tok, data, rng, args, weights, rm, rm_tok, amp):
    """G completions for each of prompts_per_step prompts, scored. With dynamic_sampling (DAPO), groups whose
    rewards are all equal are dropped and more prompts are sampled, up to max_resample_rounds extra rounds.
    Returns the kept rollout, its rows, completion texts, rewards, and logging info over everything sampled."""
    G, want = args.group_size, args.prompts_per_step * args.group_size
    pieces, rows_kept, texts_kept, rewards_kept = [], [], [], []
    seen = {"rewards": [], "parts": [], "zero_std": []}
    for _ in range(1 + (args.max_resample_rounds if args.dynamic_sampling else 0)):
        rows = [r for r in data.next_batch(rng, args.prompts_per_step) for _ in range(G)]
        roll = C.sample(model, tok, C.encode_prompts(tok, [r["prompt"] for r in rows], args.chat_template),
                        args.max_new_tokens, args.temperature, args.top_p, amp=amp, stop=args.stop)
        texts = C.decode_completions(tok, roll)
        rewards, parts = C.compute_rewards(rows, texts, weights, rm, rm_tok)
        if args.overlong_penalty:  # DAPO soft punishment: 0 until the last overlong_buffer tokens, then linear
            length = roll.completion_mask.sum(-1).cpu()
            rewards = rewards - args.overlong_penalty * ((length - args.max_new_tokens + args.overlong_buffer)
                                                         .clamp(min=0) / args.overlong_buffer)
        zero_std = rewards.view(-1, G).std(1) < 1e-6  # all G rewards equal: advantage 0 for the whole group
        seen["rewards"].append(rewards), seen["parts"].append(parts), seen["zero_std"].append(zero_std)
        keep = (~zero_std if args.dynamic_sampling else torch.ones_like(zero_std)).repeat_interleave(G)
        idx = keep.nonzero().squeeze(-1)[: want - len(rows_kept)]
        pieces.append((roll, idx.to(roll.ids.device)))
        rows_kept += [rows[i] for i in idx.tolist()]
        texts_kept += [texts[i] for i in idx.tolist()]
        rewards_kept.append(rewards[idx])
        if len(rows_kept) >= want:
            break
    if not rows_kept:  # no group had a signal even after resampling: keep the last round (advantages are all 0)
        pieces, rows_kept, texts_kept, rewards_kept = [(roll, torch.arange(len(rows), device=roll.ids.device))], \
            rows, texts, [rewards]
    return cat_rollouts(pieces), rows_kept, texts_kept, torch.cat(rewards_kept), seen


# ---------------------------------------------------------------------------------------------- plumbing
def check_args(a):
    C.check_shared_args(a)
    if a.group_size < 2:
        raise C.UserError("--group_size must be >= 2: a group of one has no relative advantage")
    if (a.prompts_per_step * a.group_size) % a.micro_batch_size:
        raise C.UserError(f"--micro_batch_size {a.micro_batch_size} must divide prompts_per_step * group_size "
                          f"= {a.prompts_per_step * a.group_size}")
    for name, value, choices in (("loss_agg", a.loss_agg, ("token-mean", "seq-mean-token-mean", "seq-sum-norm")),
                                 ("scale_rewards", a.scale_rewards, ("group", "batch", "none")),
                                 ("kl_estimator", a.kl_estimator, ("k1", "k2", "k3")),
                                 ("dtype", a.dtype, ("auto", "bf16", "fp32"))):
        if value not in choices:
            raise C.UserError(f"--{name} {value!r}: choose one of {', '.join(choices)}")


def main():
    args = C.parse_args(Args)
    check_args(args), C.parse_rewards(args.rewards, args.reward_model)  # bad input fails before a folder is made
    run = C.start_run(args, "grpo")  # on --resume, restores the run's saved args ...
    weights = C.parse_rewards(args.rewards, args.reward_model)  # ... so the rewards are read from them
    rng = C.seed_everything(args.seed)
    data = C.load_data(args.data, args.eval_size, need_answer="math" in weights)  # math checks answers
    device, amp = C.pick_device(), C.autocast(C.pick_device(), args.dtype)
    model, tok = C.load_policy(run, args, device)
    C.check_prompts(tok, model, data.rows, args)
    # beta = 0 loads no reference model at all (saves its memory and its forward pass)
    ref = C.load_model(args.model, "lm", device, frozen=True, trust_remote_code=args.trust_remote_code,
                       compile=args.compile) \
        if args.beta > 0 or args.sanity else None
    rm, rm_tok = C.load_reward_model(args, device)
    if args.sanity:
        raise SystemExit(2 if C.sanity_check(model, ref, tok, data.eval_rows, args, amp) else 0)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay,
                            fused=True)  # one kernel for all parameters (CPU and CUDA)
    start, eval_before = C.resume_or_eval(run, model, tok, opt, rng, data, args, amp, rm, rm_tok)
    if args.num_iterations == 1:
        print("note: num_iterations=1, so pi_old = pi_theta and the ratio is exactly 1: the logged loss stays near 0 "
              "by construction while its gradient does not. Watch reward, kl and clip_frac.")
    bar = run.bar = tqdm(range(start, args.max_steps), initial=start, total=args.max_steps, desc="grpo")
    for step in bar:
        t0 = time.time()
        roll, rows, completions, rewards, seen = sample_groups(model, tok, data, rng, args, weights, rm, rm_tok, amp)
        if not torch.isfinite(rewards).all():
            C.skip_nonfinite(run, "reward")
            continue
        advantages = group_advantages(rewards, args.group_size, args.scale_rewards).to(device)
        mask = roll.completion_mask
        if args.mask_truncated:  # DAPO overlong filtering: completions with no EOS carry no loss
            mask = mask * (~roll.truncated)[:, None].float()
        # old log-probs only when reused over mu > 1 updates; with mu = 1 they equal the training forward's
        old_logprobs = C.batched_logprobs(model, roll, args.temperature, args.micro_batch_size, amp) \
            if args.num_iterations > 1 else None
        ref_logprobs = C.batched_logprobs(ref, roll, args.temperature, args.micro_batch_size, amp) \
            if ref is not None else None
        # ---- mu optimizer steps; each sums micro-batch losses that share the step's global normaliser --------
        n, T = len(rows), mask.shape[1]
        n_tokens, sums = mask.sum().clamp(min=1), dict.fromkeys(("loss", "kl", "ratio", "clip_frac", "entropy"), 0.0)
        for it in range(args.num_iterations):
            for mb in C.micro_batches(roll.completion_mask, args.micro_batch_size):  # rows of similar lengths
                m = mask[mb]
                with amp:
                    logprobs, entropy = C.token_logprobs(model, roll.ids[mb], roll.attention_mask[mb], T,
                                                         args.temperature, entropy=it == 0)
                old = old_logprobs[mb] if old_logprobs is not None else logprobs.detach()  # mu = 1: ratio == 1
                loss, ratio, kl, clipped = per_token_loss(
                    logprobs, old, advantages[mb], args.clip_eps, args.clip_eps_high,
                    ref_logprobs[mb] if ref_logprobs is not None else None, args.beta, args.kl_estimator)
                loss = aggregate(loss, m, args.loss_agg, n_tokens, n, args.max_new_tokens)
                loss.backward()
                for k, v in (("kl", kl), ("ratio", ratio), ("clip_frac", clipped)) + ((("entropy", entropy),) if it == 0 else ()):
                    sums[k] += float((v.detach() * m).sum()) / float(n_tokens) / (1 if k == "entropy" else args.num_iterations)
                sums["loss"] += loss.item() / args.num_iterations
            grad_norm = C.finite_update(run, model, opt, args.max_grad_norm)
        # ---- log, eval, checkpoint --------------------------------------------------------------------------
        all_rewards = torch.cat(seen["rewards"])
        metrics = {"step": step + 1, "reward": float(all_rewards.mean()), "reward_std": float(all_rewards.std()),
                   **{f"reward/{k}": float(torch.cat([p[k] for p in seen["parts"]]).mean()) for k in seen["parts"][0]},
                   **C.gold(completions, rows),
                   "frac_zero_std": float(torch.cat(seen["zero_std"]).float().mean()), **sums, "grad_norm": grad_norm,
                   "completion_len": float(roll.completion_mask.sum(-1).mean()),
                   "frac_truncated": float(roll.truncated.float().mean()), "lr": args.lr,
                   "step_time": time.time() - t0, "tokens_per_s": float(roll.completion_mask.sum()) / (time.time() - t0)}
        samples = [{"prompt": r["prompt"], "completion": c, "reward": float(x)} for r, c, x in
                   zip(rows[::args.group_size][:4], completions[::args.group_size][:4], rewards[::args.group_size][:4])]
        if C.end_of_step(run, step, metrics, samples):
            break
    C.finish_run(run, args, device, eval_before, C.evaluate(model, tok, data.eval_rows, args, amp, rm, rm_tok))


if __name__ == "__main__":
    C.main_guard(main)
