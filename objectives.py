"""objectives.py: the policy objectives since DAPO, beside GRPO's own loss (grpo.per_token_loss;
when one of their flags is on, grpo.py's loop calls per_token_loss below in its place, with the
same arguments). Each is a small function of per-token tensors (B, T) and the advantages A
(B, 1); per_token_loss puts the switched-on ones together. docs/policy_losses.md is the guide:
each one's idea, its paper, TRL's name for it and the runs measured; tests/test_trl_losses.py
checks each against TRL's own code.

    GSPO     one ratio per sequence, s_i = exp(mean_t log rho_i,t)            sequence_log_ratio()
    CISPO    -sg(clip(rho, 1 - eps_low, 1 + eps_high)) A log pi_theta                     cispo()
    SAPO     -f(rho) A, f(x) = sigmoid(tau (x - 1)) 4 / tau                                sapo()
    DPPO     -M rho_s A, rho_s = pi_theta / pi_sampler, M = 0 past a move delta            dppo()
    VESPO    -sg(phi(w_i)) A log pi_theta, phi(w) = w^k exp(lambda (1 - w))               vespo()
    V3.2     o_i dropped when A_i < 0 and it drifted off-policy              off_policy_keep()
             beta's KL term times rho (unbiased KL)                             per_token_loss()
    prime-rl + kappa (log pi_theta - log pi_sampler)^2                         per_token_loss()
    TIS/MIS  loss * min(pi_old / pi_sampler, C), or 0 past C                 mismatch_weights()
    GDPO     A from each reward normalised in its group, then summed       normalize_then_sum()

reinforce.py uses mismatch_weights and normalize_then_sum too (the same flags). The ratio objectives
need a ratio pi_theta / pi_old that moves, which GRPO and REINFORCE have only with --num_iterations
> 1; ppo.py's loss (its policy_loss) could take cispo() or sapo() in place of its clip, untested.
"""
import math

import torch

import common as C

LOG_1E8 = math.log(1e-8)  # VESPO: the floor of its log-weights (its code, and TRL's)


def loss_for(args):
    """per_token_loss below when a flag since DAPO changes GRPO's loss, else None: grpo.py's own
    per_token_loss (grpo.main() calls `loss_for(args) or per_token_loss`)."""
    on = (args.policy_loss != "clip" or args.importance_sampling_level == "sequence"
          or args.off_policy_mask is not None or args.unbiased_kl or args.sampler_kl_coef)
    return per_token_loss if on else None


def per_token_loss(logprobs, old_logprobs, advantages, mask, args, ref_logprobs=None,
                   is_weight=1.0, sample_logprobs=None):
    """grpo.per_token_loss (same arguments, same returns) with the switches since DAPO on: the
    ratio (GSPO's by sequence), the policy loss by --policy_loss, the V3.2 mask, the KL term (its
    unbiased form), the mismatch weight, the sampler penalty. The logs add a switch's own
    (vespo_phi, seq_masked, sampler_kl: (B, T) each)."""
    log_ratio = logprobs - old_logprobs  # log rho = log pi_theta - log pi_old, per token
    eps = (args.clip_eps, args.clip_eps_high)  # eps_low, eps_high
    if args.importance_sampling_level == "sequence":  # GSPO, with its own tiny eps
        log_ratio = sequence_log_ratio(log_ratio, mask)
        eps = (args.seq_clip_eps, args.seq_clip_eps_high)
    ratio = torch.exp(log_ratio).expand_as(logprobs)  # (B, T): token ratios, or s_i per token
    adv, logs = advantages[:, None], {}
    low, high = 1 - eps[0], 1 + eps[1]
    if args.policy_loss == "clip":
        loss, clipped = clip(ratio, adv, low, high)
    elif args.policy_loss == "cispo":
        loss, clipped = cispo(ratio, adv, logprobs, low, high)
    elif args.policy_loss == "sapo":
        loss, clipped = sapo(ratio, adv, args.sapo_tau_pos, args.sapo_tau_neg)
    elif args.policy_loss == "dppo":  # clip_eps, clip_eps_high are its delta_low, delta_high
        loss, clipped = dppo(logprobs, sample_logprobs, adv, *eps, args.dppo_ratio_cap)
    else:  # vespo: the mismatch weight goes inside its w
        loss, logs["vespo_phi"] = vespo(logprobs, log_ratio, adv, mask, is_weight, args)
        clipped, is_weight = torch.zeros_like(logprobs), 1.0
    if args.off_policy_mask is not None:  # DeepSeek-V3.2: no loss on o_i, A_i < 0, that drifted
        keep = off_policy_keep(logprobs, sample_logprobs, adv, mask, args.off_policy_mask)
        loss, logs["seq_masked"] = loss * keep, (1 - keep).expand_as(logprobs)
    kl = torch.zeros_like(logprobs) if ref_logprobs is None else C.kl_estimate(
        logprobs, ref_logprobs, args.kl_estimator)
    if args.unbiased_kl:  # DeepSeek-V3.2: k3 * rho, rho's gradient included (as TRL)
        kl = kl * ratio
    loss = loss * is_weight + args.beta * kl  # is_weight: TIS, MIS
    if args.sampler_kl_coef:  # Kimi K2.5, prime-rl: kappa (log pi_theta - log pi_sampler)^2
        logs["sampler_kl"] = (logprobs - sample_logprobs) ** 2
        loss = loss + args.sampler_kl_coef * logs["sampler_kl"]
    return loss, {"kl": kl, "ratio": ratio, "clip_frac": clipped, **logs}


def sequence_log_ratio(log_ratio, mask):
    """GSPO: log s_i = the mean of o_i's token log-ratios (B, 1)."""
    return (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(1)


def clip(ratio, adv, low, high):
    """PPO, GRPO: -min(rho A, clip(rho, low, high) A), and where the clipped branch won (no
    gradient): grpo.per_token_loss's own, here for the GSPO ratio and the corrections."""
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, low, high) * adv
    return -torch.min(unclipped, clipped), (clipped < unclipped).float()


def cispo(ratio, adv, logprobs, low, high):
    """MiniMax-M1: -sg(clip(rho, low, high)) A log pi_theta: the weight is clipped, every
    token's gradient kept. Returns the loss and where the weight was clipped."""
    loss = -torch.clamp(ratio, low, high).detach() * adv * logprobs
    return loss, ((ratio < low) | (ratio > high)).float()


def sapo(ratio, adv, tau_pos, tau_neg):
    """SAPO: -f(rho) A, f(x) = sigmoid(tau (x - 1)) 4 / tau (f'(1) = 1: the plain gradient at
    rho = 1), tau by A's sign. A soft gate: no hard clip (clip_frac 0)."""
    t = torch.where(adv > 0, tau_pos, tau_neg)
    return -torch.sigmoid(t * (ratio - 1)) * 4 / t * adv, torch.zeros_like(ratio)


def dppo(logprobs, sample_logprobs, adv, delta_low, delta_high, cap=0.0):
    """DPPO binary-TV: -M rho_s A, rho_s = pi_theta / pi_sampler; M = 0 (no gradient) where the
    token's probability moved past delta in A's direction: up with A > 0, down with A < 0.
    cap C > 0: rho_s's gradient rho_s grad log pi with the detached rho_s capped at C."""
    moved = logprobs.exp() - sample_logprobs.exp()  # pi_theta - pi_sampler
    masked = ((adv > 0) & (moved > delta_high) | (adv < 0) & (moved < -delta_low)).float()
    rho_s = torch.exp(logprobs - sample_logprobs)
    if cap:  # the DPPO authors: 3
        rho_s = rho_s * (rho_s.clamp(max=cap) / rho_s).detach()
    return -(1 - masked) * rho_s * adv, masked


def vespo(logprobs, log_ratio, adv, mask, is_weight, args):
    """VESPO: -sg(phi(w_i)) A log pi_theta, phi(w) = w^k exp(lambda (1 - w)) (phi(1) = 1) of the
    sequence weight log w_i = sum_t log rho_i,t + the mismatch weight's log (0 when off), clamped
    as VESPO and TRL; k, lambda by A's sign. Returns the loss and phi (B, T)."""
    log_is = torch.log(torch.as_tensor(is_weight)).clamp(LOG_1E8, 20).sum(-1, keepdim=True)
    log_w = (log_ratio.detach().clamp(-20, 20) * mask).sum(-1, keepdim=True) + log_is
    log_w = log_w.clamp(LOG_1E8, 20)
    k = torch.where(adv >= 0, args.vespo_k_pos, args.vespo_k_neg)
    lam = torch.where(adv >= 0, args.vespo_lambda_pos, args.vespo_lambda_neg)
    phi = torch.exp(lam + k * log_w - lam * log_w.exp())  # (B, 1), detached
    return -phi * adv * logprobs, phi.expand_as(logprobs)


def off_policy_keep(logprobs, sample_logprobs, adv, mask, delta):
    """DeepSeek-V3.2: (B, 1), 0 for o_i with A_i < 0 and a mean log(pi_sampler / pi_theta) > delta,
    else 1."""
    drift = (sample_logprobs - logprobs.detach()) * mask  # log pi_sampler - log pi_theta
    drift = drift.sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # (B, 1)
    return ((adv >= 0) | (drift <= delta)).float()


def normalize_then_sum(parts, weights, group_size, eps=1e-4, std=torch.std):
    """GDPO's advantages from several rewards (arXiv 2601.05242; TRL's "normalize_then_sum"): each
    reward normalised within its group of contiguous rows first (summed first, one reward's spread
    drowns another's), then the weighted sum over the batch (std: runs.global_std under torchrun).
    parts {name: (B,)}, weights {name: w} -> (B,)."""
    total = 0.0
    for name, w in weights.items():
        r = parts[name].float().view(-1, group_size)
        sd = r.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(r)  # one: 0 (TRL)
        total = total + w * ((r - r.mean(1, keepdim=True)) / (sd + eps))
    total = total.view(-1)  # each part's group mean is 0, so the batch mean is 0 up to rounding
    return (total - total.mean()) / (std(total) + eps)


def mismatch_weights(old_logprobs, sample_logprobs, mask, cap=0.0, mode="truncate", level="token"):
    """The detached loss weight per token for the sampler/trainer mismatch (docs/policy_losses.md):
    (B, T), (B, 1) at level sequence, 1 when cap C = 0 (off); and the raw pi_old / pi_sampler."""
    log_w = ((old_logprobs - sample_logprobs) * mask).detach()  # 0 outside the completion
    raw = log_w.exp()  # 1 to rounding unless they differ (bf16, vLLM, top_p)
    if not cap:
        return 1.0, raw
    w = log_w.sum(-1, keepdim=True).exp() if level == "sequence" else raw  # sequence: the product
    # truncate: min(w, C), TIS (Yao et al. 2025); mask: w, or 0 where w > C, MIS (IcePop)
    return (w.clamp(max=cap) if mode == "truncate" else torch.where(w <= cap, w, 0.0)), raw
