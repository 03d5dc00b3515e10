# %% [markdown]
# # Lab 2: GRPO -- group advantages, the clipped surrogate, the k3 KL
#
# GRPO (Shao et al., DeepSeekMath 2024) has no critic: it samples a group of G completions per
# prompt and scores each against its own group. You write its three functions; the grader names
# your mistake; then `grpo.py`'s own loop trains the bundled model with them (about 20 s).
#
# Run it: `python labs/02_grpo.py` (a notebook in VS Code, or Jupyter with jupytext).
# Grade only: `python -m pytest labs -k lab2`.
#
# Notation: pi_theta the policy being trained, pi_old the policy that sampled the batch, pi_ref a
# frozen copy of the starting policy. A group is G contiguous rows of the batch.

# %%
import torch

import lab  # labs/lab.py: hole, check, train, plot
import common
import grpo

# %% [markdown]
# ## 1. Group advantages
#
# Every token of completion i gets the same advantage, its reward normalised within its group:
#
#     A_i = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)        (scale="group": GRPO)
#     A_i =  r_i - mean(r_1..r_G)                                  (scale="none": Dr. GRPO)
#
# std is the unbiased one (divides by G - 1: torch.std's default). A group whose rewards are
# all equal carries no signal: its A must be 0 (the eps keeps 0 / 0 away). Dr. GRPO (Liu et al.
# 2025) drops the std: dividing by it up-weights the groups that are nearly all right or all
# wrong. ("batch" and "mean" scales are not part of this lab.)
# The argument std is the run's std of the *whole batch* (across processes under torchrun), for
# the "batch" scale only: grpo.py passes a one-argument std(x). A group's std is
# rewards.view(-1, group_size).std(1); leave std alone here.

# %%
@lab.hole(grpo.group_advantages)
def group_advantages(rewards, group_size, scale="group", eps=1e-4, std=torch.std):
    """rewards (B,), groups of group_size contiguous rows -> A (B,)."""
    raise lab.Todo("lab 2: write group_advantages (scale 'group' and 'none')")


# %% [markdown]
# ## 2. KL estimators
#
# The loss keeps pi_theta near pi_ref with an estimate of KL(pi_theta || pi_ref) from the
# sampled tokens alone (Schulman, "Approximating KL divergence"). With r = pi_ref / pi_theta
# at each token, log r = ref_logprobs - logprobs:
#
#     k1 = -log r           k2 = (log r)^2 / 2           k3 = r - 1 - log r   (DeepSeekMath)
#
# k3 is >= 0 and unbiased. exp() of a large log r overflows: clamp log r to [-20, 20] for k3.

# %%
@lab.hole(common.kl_estimate)
def kl_estimate(logprobs, ref_logprobs, estimator):
    """Per-token KL estimates (B, T); estimator 'k1', 'k2' or 'k3'."""
    raise lab.Todo("lab 2: write kl_estimate (k1, k2, k3)")


# %% [markdown]
# ## 3. The clipped surrogate, plus beta times the KL
#
# With rho_t = pi_theta(o_t) / pi_old(o_t) = exp(logprobs - old_logprobs):
#
#     L_t = -min(rho_t A, clip(rho_t, 1 - eps_low, 1 + eps_high) A) + beta * k3_t
#
# eps_low = args.clip_eps, eps_high = args.clip_eps_high (DAPO's clip-higher lets rare tokens
# grow further), beta = args.beta. Where the min takes the clipped branch, the token gets no
# gradient: log that as clip_frac. is_weight is a per-token weight the loop passes (1 here).

# %%
@lab.hole(grpo.per_token_loss)
def per_token_loss(logprobs, old_logprobs, advantages, mask, args, ref_logprobs=None,
                   is_weight=1.0, sample_logprobs=None):
    """logprobs, old_logprobs, ref_logprobs, mask (B, T); advantages (B,) -> the loss (B, T) and
    the logs {"kl", "ratio", "clip_frac"}, (B, T) each. The loop masks and averages them."""
    raise lab.Todo("lab 2: write per_token_loss")
    # ratio = ...       # (B, T)
    # adv = advantages[:, None]  # (B, 1): one A per completion, on each of its tokens
    # unclipped = ...
    # clipped = ...
    # loss = ...        # (B, T)
    # kl = torch.zeros_like(logprobs) if ref_logprobs is None else kl_estimate(
    #     logprobs, ref_logprobs, args.kl_estimator)
    # loss = loss * is_weight + args.beta * kl
    # return loss, {"kl": kl, "ratio": ratio, "clip_frac": (clipped < unclipped).float()}


# %% [markdown]
# ## Check

# %%
if __name__ == "__main__":
    lab.check(group_advantages, kl_estimate, per_token_loss)

# %% [markdown]
# ## Run: grpo.py's own loop with your three functions
#
# 60 steps of 8 prompts x G = 8, two updates per batch (`--num_iterations 2`: on the second
# the ratio is no longer 1, so the clip can act) and DAPO's `--clip_eps_high 0.28`. Expect the
# held-out accuracy from about 0.3 to above 0.9, kl leaving 0 in the first steps and staying
# near a few tenths of a nat per token, and one or two percent of tokens clipped early on. The
# histogram shows every advantage your function gave: where do the spikes come from? Then try
# Dr. GRPO: add `--scale_rewards none --loss_agg seq-sum-norm --beta 0` to the flags. What
# happens to the histogram?

# %%
if __name__ == "__main__":
    given = []  # every advantage of the run, for the histogram

    def recorded_advantages(*args, **kwargs):
        A = group_advantages(*args, **kwargs)
        given.extend(A.tolist())
        return A
    run = lab.train(grpo, "--num_iterations 2 --clip_eps_high 0.28 --max_steps 60 "
                    "--eval_every 20 --eval_size 200 --save_every 0",
                    {"grpo.group_advantages": recorded_advantages,
                     "common.kl_estimate": kl_estimate, "grpo.per_token_loss": per_token_loss})
    lab.plot(run, ["reward", "kl", "clip_frac", "frac_zero_std"],
             {"advantages (every sample)": given})
