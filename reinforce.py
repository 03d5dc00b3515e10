"""reinforce.py: REINFORCE (Williams, 1992) for LLMs, and the baselines that tame its variance: EMA, RLOO
(Ahmadian et al., "Back to Basics", 2024) and REINFORCE++ (Hu, 2025).

Sample k completions o_1..o_k for each prompt q, score each with a reward s_i (rule or reward model), and push up
the log-probability of every token of o_i in proportion to how good the whole trajectory was:

    r_i,t = -beta KL_t(pi_old || pi_ref)  on every token,  + s_i  on the last one      (KL in the reward, k1)
    G_i,t = sum_{t' >= t} r_i,t'   (gamma = 1: the reward-to-go; --kl_in_reward sequence gives every token G_i,0)
                                                                                              kl_returns()
    A_i,t = G_i,t - b_i                                                                        advantages()
        none          b = 0: vanilla REINFORCE, unbiased; its variance grows with the reward's offset
        ema           b = moving average of earlier steps' mean return (Williams' "reinforcement comparison")
        rloo          b_i = mean whole return G_j,0 of the k - 1 OTHER samples of the same prompt (leave-one-out:
                      b_i does not depend on o_i, so the estimate stays unbiased)
        reinforce_pp  A = (G - mean) / std over every valid token of the batch (REINFORCE++ global whitening)
    loss = -(1/N) sum_i sum_t A_i,t log pi(o_i,t | q, o_i,<t)      N = sequences in the optimizer step     loss()

The gradient of that loss is the Monte-Carlo policy gradient E[A grad log pi(o)]. A baseline that does not depend
on the sample's own actions leaves its mean unchanged (E[b grad log pi] = 0) and can cut its variance. Without one
the update depends on the reward's offset: add c to every reward and each sample's gradient gains c grad log pi,
pure noise. Logged proxies: `adv_mean` / `adv_std` and `sample_grad_rms` (the RMS of each sample's own gradient,
see sample_grad_probe). Measured on the bundled task: with 0/1 rewards b = 0 already is the failure reward, so
`none` is only a little noisier than rloo at first, and quieter once most answers are right (a mean baseline gives
the rare, unlikely failures large negative advantages); with --rewards math,format (+1 for any number) vanilla's
gradient variance triples while every baseline's stays put.

Simplified: one on-policy update per batch (--num_iterations 1, as the RLOO paper); num_iterations > 1 turns on a
PPO-style clipped token ratio. --whiten whitens the advantages after any baseline (TRL RLOO normalize_advantages;
with beta = 0, --baseline rloo --whiten is exactly REINFORCE++-baseline: leave-one-out and group-mean advantages
differ by the factor k/(k-1), which whitening removes).

Run:  python reinforce.py --baseline rloo        # bundled tiny model and task, 2-core CPU, about 1-2 minutes
      python reinforce.py --baseline none --rewards math,format   # vs rloo, same flags: watch sample_grad_rms
      python reinforce.py --model Qwen/Qwen2.5-0.5B-Instruct --data my.jsonl --max_new_tokens 256 \\
          --baseline rloo --beta 0.05 --lr 1e-6 --compile
Expect (bundled default, 2-core CPU, about 25 s): held-out greedy accuracy 0.29 -> about 0.95 with rloo (seeds 0-2:
0.950, 0.942, 0.954), most of it in the first 100 steps; README has the table.
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
    samples_per_prompt: int = 8  # k per prompt (RLOO paper 2-4, TRL RLOO 2; 8 = grpo.py's batch); rloo needs >= 2
    prompts_per_step: int = 8  # prompts per optimizer step, so k * prompts_per_step completions
    max_new_tokens: int = 6  # completion length cap (the built-in task needs 4)
    temperature: float = 1.0  # sampling temperature; log-probs use the same one (N implementation details)
    top_p: float = 1.0  # nucleus sampling (TRL default 1.0); below 1 the log-probs stay the full softmax's (off-policy)
    stop: list[str] = field(default_factory=list)  # stop strings, e.g. "</answer>": a row also ends at the token completing one
    # --- rewards
    rewards: str = "math"  # weighted components, e.g. "math=1,format=0.1,rm=0.5"; each logged as reward/<name>
    reward_model: str = ""  # AutoModelForSequenceClassification (num_labels=1) scoring prompt+completion, as 'rm'
    # --- the REINFORCE objective
    baseline: str = "none"  # none (vanilla REINFORCE) | ema | rloo (Ahmadian et al. 2024) | reinforce_pp (Hu 2025)
    ema_decay: float = 0.9  # ema baseline: b <- decay * b + (1 - decay) * mean return (common practice)
    whiten: bool = False  # whiten advantages over the batch after the baseline (TRL RLOO normalize_advantages False)
    beta: float = 0.0  # KL-in-reward coefficient; 0 loads no reference model (TRL RLOO 0.05, OpenRLHF 0.01)
    kl_estimator: str = "k1"  # k1 | k2 | k3 (Schulman 2020); k1 in the reward as TRL RLOO, OpenRLHF, REINFORCE++
    kl_in_reward: str = "token"  # token: reward-to-go of per-token penalties (REINFORCE++); sequence: summed (TRL RLOO)
    loss_agg: str = "seq-sum"  # seq-sum: sum over tokens / sequences (the REINFORCE estimator, TRL RLOO) | token-mean
    num_iterations: int = 1  # mu: updates per batch (RLOO paper 1); > 1 clips the token ratio as PPO does
    clip_eps: float = 0.2  # ratio clipped to [1 - eps, 1 + eps] when num_iterations > 1 (PPO, TRL RLOO)
    # --- optimisation
    lr: float = 1e-4  # tiny model (measured: 0.29 -> 0.94 held-out); real models use ~1e-6 (TRL RLOO, OpenRLHF)
    weight_decay: float = 0.0  # TRL/verl use 0 / 0.01
    max_grad_norm: float = 1.0  # TRL, verl, OpenRLHF
    max_steps: int = 300  # optimizer steps
    micro_batch_size: int = 64  # rows per forward; gradients accumulate to the same result (normaliser is global)
    gradient_checkpointing: bool = False  # trade compute for activation memory on real models
    compile: bool = False  # torch.compile policy and reference forwards: faster steps after a slow first one (README)
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU; or bf16 | fp32
    # --- run
    seed: int = 0
    eval_every: int = 100  # steps between held-out greedy evals (0: only before and after)
    eval_size: int = 500  # held-out prompts per eval
    save_every: int = 100  # steps between checkpoints (atomic; also on Ctrl-C and at the end; 0: only then)
    output_dir: str = ""  # default runs/reinforce-<time>
    resume: str = ""  # a previous output_dir: continue from its checkpoint (optimizer, RNG, step, EMA, metrics)
    sanity: bool = False  # check log-probs, ratio, KL and masks on the real model and data, then exit


# ------------------------------------------------------------------------------------------- --- ALGORITHM ---
def kl_returns(scores, mask, kl=None, beta=0.0, kl_in_reward="token"):
    """G_i,t with gamma = 1: the score s_i (paid at the last token) minus beta * the KL still to come. With
    kl_in_reward='sequence' every token gets the whole sequence's penalty (TRL RLOO). (B,) scores -> (B, T)."""
    G = scores[:, None].to(mask) * mask
    if kl is None or beta == 0:
        return G
    kl = kl * mask
    to_come = kl.flip(-1).cumsum(-1).flip(-1) if kl_in_reward == "token" else kl.sum(-1, keepdim=True)
    return (G - beta * to_come) * mask


def whiten(x, mask, eps=1e-8):
    """(x - mean) / std over the valid (mask = 1) entries only, biased std as in OpenRLHF / N details; 0 elsewhere."""
    mean = C.masked_mean(x, mask)
    var = C.masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def rloo_baseline(returns, k):
    """b_i = mean of the other k - 1 returns of the same prompt (groups are contiguous rows): (sum - own) / (k - 1)."""
    if k < 2:
        raise C.UserError("the rloo baseline needs --samples_per_prompt >= 2: with k = 1 there is no other sample")
    R = returns.view(-1, k)
    return ((R.sum(1, keepdim=True) - R) / (k - 1)).view(-1)


def advantages(returns, mask, baseline, k, ema=None, whiten_after=False):
    """A = G - b for the chosen baseline, (B, T), 0 on padding. G[:, 0] is each sequence's whole return (every
    completion has at least one token). ema is the running baseline from earlier steps (None at the first step:
    this batch's mean is used once)."""
    R = returns[:, 0]
    if baseline == "none":
        b = torch.zeros_like(R)
    elif baseline == "ema":
        b = torch.full_like(R, float(R.mean()) if ema is None else ema)
    elif baseline == "rloo":
        b = rloo_baseline(R, k)
    elif baseline == "reinforce_pp":  # REINFORCE++: global whitening over the batch's tokens is the baseline
        return whiten(returns, mask)
    else:
        raise ValueError(baseline)
    adv = (returns - b[:, None]) * mask
    return whiten(adv, mask) if whiten_after else adv


def loss(logprobs, advantages, mask, n_seqs, n_tokens, loss_agg="seq-sum", old_logprobs=None, clip_eps=0.2):
    """This micro-batch's share of -(1/N) sum A log pi. n_seqs / n_tokens count the whole optimizer step, so
    micro-batching does not change the gradient (TRL #3021). With old_logprobs (mu > 1) the PPO clipped surrogate
    -min(rho A, clip(rho) A) replaces A log pi; both have gradient A grad log pi while rho = 1.
    Returns the loss, the ratio and the clipped mask (for logging)."""
    if old_logprobs is None:
        per_token, ratio = -advantages * logprobs, torch.ones_like(logprobs)
        clipped = torch.zeros_like(logprobs)
    else:
        ratio = torch.exp(logprobs - old_logprobs)
        unclipped, clipped_obj = ratio * advantages, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
        per_token, clipped = -torch.min(unclipped, clipped_obj), (clipped_obj < unclipped).float()
    return (per_token * mask).sum() / (n_seqs if loss_agg == "seq-sum" else n_tokens), ratio, clipped


def sample_grad_probe(model):
    """Variance proxy. A hook on the LM head's output records, at every backward, each row's gradient of the step's
    loss w.r.t. its own logits: exact per-sample gradients (the rows of a batch do not interact), at no extra pass.
    Times N (sequences per step) this is g_i, the sample's term of the batch gradient mean_i g_i, and
    sample_grad_rms = sqrt(mean ||g_i||^2) bounds the gradient's variance (tr Var(mean g) <= E||g||^2 / N).
    It is measured in logit space, not parameter space (per-parameter per-sample gradients cost a backward per
    sample): the parameter gradient is J_i^T g_i. Checked on the bundled model against the batch gradient's
    covariance over 30 batches: it ranks the baselines in the same order. Returns the list it fills."""
    norms = []

    def on_forward(module, inputs, logits):
        if logits.requires_grad:
            logits.register_hook(lambda g: norms.append(g.detach().float().flatten(1).norm(dim=1)))
    model.get_output_embeddings().register_forward_hook(on_forward)
    return norms


# ---------------------------------------------------------------------------------------------- plumbing
def check_args(a):
    C.check_shared_args(a)
    if a.baseline == "rloo" and a.samples_per_prompt < 2:
        raise C.UserError("--baseline rloo needs --samples_per_prompt >= 2: with k = 1 there is no other sample "
                          "to form the leave-one-out baseline")
    for name, value, choices in (("baseline", a.baseline, ("none", "ema", "rloo", "reinforce_pp")),
                                 ("loss_agg", a.loss_agg, ("seq-sum", "token-mean")),
                                 ("kl_in_reward", a.kl_in_reward, ("token", "sequence")),
                                 ("kl_estimator", a.kl_estimator, ("k1", "k2", "k3")),
                                 ("dtype", a.dtype, ("auto", "bf16", "fp32"))):
        if value not in choices:
            raise C.UserError(f"--{name} {value!r}: choose one of {', '.join(choices)}")


def main():
    args = C.parse_args(Args)
    check_args(args), C.parse_rewards(args.rewards, args.reward_model)  # bad input fails before a folder is made
    run = C.start_run(args, "reinforce")  # on --resume, restores the run's saved args ...
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
    ema = run.state["extra"].get("ema") if run.state else None  # the ema baseline's running value
    grad_norms = sample_grad_probe(model)
    k = args.samples_per_prompt
    bar = run.bar = tqdm(range(start, args.max_steps), initial=start, total=args.max_steps, desc="reinforce")
    for step in bar:
        t0 = time.time()
        rows = [r for r in data.next_batch(rng, args.prompts_per_step) for _ in range(k)]  # k contiguous per prompt
        roll = C.sample(model, tok, C.encode_prompts(tok, [r["prompt"] for r in rows], args.chat_template),
                        args.max_new_tokens, args.temperature, args.top_p, amp=amp, stop=args.stop)
        completions = C.decode_completions(tok, roll)
        scores, parts = C.compute_rewards(rows, completions, weights, rm, rm_tok)
        if not torch.isfinite(scores).all():
            C.skip_nonfinite(run, "reward")
            continue
        mask, n, T = roll.completion_mask, len(rows), roll.completion_mask.shape[1]
        # pi_old: the policy that sampled, recomputed with the training forward (needed for KL and for mu > 1)
        old_logprobs = C.batched_logprobs(model, roll, args.temperature, args.micro_batch_size, amp) \
            if ref is not None or args.num_iterations > 1 else None
        kl = C.kl_estimate(old_logprobs, C.batched_logprobs(ref, roll, args.temperature, args.micro_batch_size, amp),
                           args.kl_estimator) * mask if ref is not None else None
        returns = kl_returns(scores.to(device), mask, kl, args.beta, args.kl_in_reward)
        adv = advantages(returns, mask, args.baseline, k, ema, args.whiten)
        if args.baseline == "ema":  # updated after use, so b never depends on this batch's own samples
            R = float(returns[:, 0].mean())
            ema = R if ema is None else args.ema_decay * ema + (1 - args.ema_decay) * R
        # ---- mu optimizer steps; each sums micro-batch losses that share the step's global normaliser --------
        n_tokens, sums = mask.sum().clamp(min=1), dict.fromkeys(("loss", "ratio", "clip_frac", "entropy"), 0.0)
        grad_norms.clear()
        for it in range(args.num_iterations):
            for mb in C.micro_batches(roll.completion_mask, args.micro_batch_size):  # rows of similar lengths
                m = mask[mb]
                with amp:
                    logprobs, entropy = C.token_logprobs(model, roll.ids[mb], roll.attention_mask[mb], T,
                                                         args.temperature, entropy=it == 0)
                step_loss, ratio, clipped = loss(logprobs, adv[mb], m, n, n_tokens, args.loss_agg,
                                                 old_logprobs[mb] if args.num_iterations > 1 else None, args.clip_eps)
                step_loss.backward()
                for key, v in (("ratio", ratio), ("clip_frac", clipped)) + ((("entropy", entropy),) if it == 0 else ()):
                    per_it = 1 if key == "entropy" else args.num_iterations  # entropy: first pass only
                    sums[key] += float((v.detach() * m).sum() / n_tokens) / per_it
                sums["loss"] += step_loss.item() / args.num_iterations
            grad_norm = C.finite_update(run, model, opt, args.max_grad_norm)
        # ---- log, eval, checkpoint --------------------------------------------------------------------------
        valid = mask.bool()
        g = torch.cat(grad_norms)[:n] * n  # g_i: each sample's own term of the (first) update's gradient
        metrics = {"step": step + 1, "reward": float(scores.mean()), "reward_std": float(scores.std()),
                   **{f"reward/{key}": float(v.mean()) for key, v in parts.items()},
                   **C.gold(completions, rows),
                   "frac_zero_std": float((scores.view(-1, k).std(1) < 1e-6).float().mean()) if k > 1 else 0.0,
                   "kl": float(C.masked_mean(kl, mask)) if kl is not None else 0.0, **sums, "grad_norm": grad_norm,
                   "adv_mean": float(adv[valid].mean()), "adv_std": float(adv[valid].std()),
                   "sample_grad_rms": float(g.pow(2).mean().sqrt()),
                   **({"baseline_ema": ema} if args.baseline == "ema" else {}),
                   "completion_len": float(mask.sum(-1).mean()), "frac_truncated": float(roll.truncated.float().mean()),
                   "lr": args.lr, "step_time": time.time() - t0,
                   "tokens_per_s": float(mask.sum()) / (time.time() - t0)}
        samples = [{"prompt": r["prompt"], "completion": c, "reward": float(x)} for r, c, x in
                   zip(rows[::k][:4], completions[::k][:4], scores[::k][:4])]
        if C.end_of_step(run, step, metrics, samples, extra={"ema": ema}):
            break
    C.finish_run(run, args, device, eval_before, C.evaluate(model, tok, data.eval_rows, args, amp, rm, rm_tok))


if __name__ == "__main__":
    C.main_guard(main)
