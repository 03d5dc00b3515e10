# %% [markdown]
# # Lab 1: log-probs, the masked mean, REINFORCE with a baseline
#
# The bundled model (1 M parameters) answers sums like `37+48=`; the reward is 1 for a right
# answer, else 0. You write the four functions a REINFORCE step is made of; the grader compares
# each one with the project's own and names your mistake; then `reinforce.py`'s own training
# loop runs with YOUR functions in place of its own, and the model learns in about 20 seconds.
#
# Run it: `python labs/01_reinforce.py` (or open it as a notebook: VS Code runs the `# %%` cells
# as they are; Jupyter needs `pip install jupytext`). Grade only: `python -m pytest labs -k lab1`.
#
# Notation: a prompt q, a completion o = (o_1 .. o_T) sampled from the policy pi_theta, its
# reward r. B rows in a batch, T the longest completion, V the vocabulary's size.

# %%
import torch

import lab  # labs/lab.py: hole, check, train, plot
import common
import reinforce

# %% [markdown]
# ## 1. The log-probs of a completion
#
# A causal LM's logits at position t score the token at position t + 1. The log-prob of each
# completion token is
#
#     log pi(o_t | q, o_<t) = log_softmax(logits_(t-1) / temperature)[o_t]
#
# The temperature is the sampler's (the log-probs must be of the distribution that sampled).
# `ids` is (B, P + T): the prompt (left padded), then the T completion tokens; the completion's
# tokens are `ids[:, -T:]`. Compute in fp32 (`.float()`): the exp-normalise loses digits in bf16.

# %%
@lab.hole(common.plain_token_logprobs)
def token_logprobs(model, ids, attention_mask, T, temperature=1.0, entropy=False):
    """(B, T) log-probs of the last T tokens of ids, and (entropy=True) each position's entropy."""
    logits = lab.logits(model, ids, attention_mask)  # (B, P + T, V): position t scores t + 1
    raise lab.Todo("lab 1: write token_logprobs: logp (B, T, V), then lp (B, T)")
    # logp = ...  # (B, T, V): log-softmax of logits / temperature at the T positions that score
    #             # the completion's tokens
    # lp = ...    # (B, T): the log-prob of each completion token (torch.gather along the vocab)
    # ent = -(logp.exp() * logp).sum(-1) if entropy else None  # entropy, for the logs (given)
    # return lp, ent


# %% [markdown]
# ## 2. The masked mean
#
# Rows end at different lengths; `completion_mask` (B, T) is 1 on each completion token (the
# EOS included) and 0 on the padding after it. A mean over tokens must skip the padding:
#
#     masked_mean(x, mask) = sum(x * mask) / max(sum(mask), 1)
#
# along `dim` (None: over everything). The max(., 1): a row with no token gives 0, not 0 / 0.
# (`total` sums over processes under torchrun; with one process it is None: ignore it.)

# %%
@lab.hole(common.masked_mean)
def masked_mean(x, mask, dim=None, total=None):
    """Mean of x where mask = 1, along dim (None: all). x, mask: the same shape."""
    raise lab.Todo("lab 1: write masked_mean")


# %% [markdown]
# ## 3. REINFORCE with a baseline (RLOO)
#
# The policy gradient is E[ (r - b) grad log pi(o | q) ], with log pi(o | q) = sum_t log
# pi(o_t | ...). Any b that does not depend on o keeps it unbiased and can cut its variance.
# RLOO (Ahmadian et al. 2024) samples k completions per prompt (k contiguous rows) and gives
# sample i the mean reward of the OTHER k - 1:
#
#     b_i = (sum_j r_j - r_i) / (k - 1)           A_i = r_i - b_i   (on each of o_i's tokens)
#
# The loss whose gradient is the policy gradient, per token:
#
#     L_t = -A_t log pi(o_t | q, o_<t)
#
# and `reinforce.py`'s loop sums it over the step's completion tokens and divides by their
# number (the masked mean over the whole step, so micro-batches do not change it).

# %%
@lab.hole(reinforce.rloo_baseline)
def rloo_baseline(rewards, k):
    """rewards (B,), k samples per prompt in contiguous rows -> b (B,): the others' mean."""
    raise lab.Todo("lab 1: write rloo_baseline")


@lab.hole(reinforce.reinforce_loss)
def reinforce_loss(logprobs, advantages, old_logprobs=None, clip_eps=0.2, is_weight=1.0):
    """The loss per token (B, T) from logprobs and advantages (B, T). This lab's loop updates once
    per batch (old_logprobs None), so the ratio pi / pi_old is 1 and nothing is clipped.
    is_weight: a per-token weight the loop passes (1 here); multiply the loss by it."""
    ratio, clipped = torch.ones_like(logprobs), torch.zeros_like(logprobs)  # for the logs
    raise lab.Todo("lab 1: write reinforce_loss's per_token")
    # per_token = ...  # (B, T)
    # return per_token * is_weight, ratio, clipped


# %% [markdown]
# ## Check: each function against the project's, on random and edge-case inputs

# %%
if __name__ == "__main__":
    lab.check(token_logprobs, masked_mean, rloo_baseline, reinforce_loss)

# %% [markdown]
# ## Run: reinforce.py's own loop with your four functions
#
# 60 steps of 8 prompts x 8 samples, `--whiten` (A whitened with your masked_mean). Expect the
# held-out accuracy from about 0.3 to about 0.95, the reward climbing, the entropy falling.
# `sample_grad_rms` is the size of each sample's own gradient (a variance proxy). Then try
# `--baseline none`: what changes, and why does it still learn with 0/1 rewards?
# (`--save_every 0` saves no checkpoint during the run; the final one, checkpoint/, is written.)

# %%
if __name__ == "__main__":
    run = lab.train(reinforce, "--baseline rloo --whiten --max_steps 60 --eval_every 20 "
                    "--eval_size 200 --save_every 0",
                    {"common.token_logprobs": token_logprobs, "common.masked_mean": masked_mean,
                     "reinforce.rloo_baseline": rloo_baseline,
                     "reinforce.reinforce_loss": reinforce_loss})
    lab.plot(run, ["reward", "entropy", "sample_grad_rms", "completion_len"])
