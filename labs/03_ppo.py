# %% [markdown]
# # Lab 3: PPO -- GAE and the clipped value loss
#
# PPO for RLHF (Ziegler et al. 2019, InstructGPT) trains a critic V beside the policy: V(s_t)
# predicts the return from token t on, and the advantage of each token comes from the critic's
# errors. You write GAE and the critic's clipped loss; the grader names your mistake; then
# `ppo.py`'s own loop (policy, critic, reference and a reward model) trains with them (~55 s).
#
# Run it: `python labs/03_ppo.py` (a notebook in VS Code, or Jupyter with jupytext).
# Grade only: `python -m pytest labs -k lab3`.
#
# Notation: rewards r_t per token (B, T): minus the KL to the reference on every token, plus the
# reward model's score on the last one; values V_t (B, T) from the critic; mask (B, T) 1 on each
# completion token, 0 on the padding after a row's end (past it the episode is over: V = 0).

# %%
import torch

import lab  # labs/lab.py: hole, check, train, plot
import ppo

# %% [markdown]
# ## 1. Generalised advantage estimation (Schulman et al. 2016)
#
#     delta_t = r_t + gamma V_t+1 - V_t              (the critic's one-step error)
#     A_t     = delta_t + gamma lam A_t+1            (backwards from the last token)
#     R_t     = A_t + V_t                            (the critic's target: the returns)
#
# with V and A = 0 past a row's end (terminal), so multiply values and rewards by the mask
# first. lam = 1: A_t is the whole discounted return minus V_t; lam = 0: the one-step error.
#
# No gradient flows through GAE: ppo.py calls it on the rollout's rewards and values, both
# computed under torch.no_grad() (the critic's values before this batch's updates), so A and R
# are fixed targets; your function needs no .detach().

# %%
@lab.hole(ppo.gae)
def gae(rewards, values, mask, gamma, lam):
    """rewards, values, mask (B, T) -> (advantages, returns), (B, T) each, 0 on the padding."""
    raise lab.Todo("lab 3: write gae")


# %% [markdown]
# ## 2. The clipped value loss (the N implementation details of RLHF with PPO)
#
# As the policy's ratio is clipped, the critic may not move its value far from the one it had
# when the batch was sampled (old_values) and still earn a lower loss:
#
#     V_clipped = old_values + clip(values - old_values, -eps_v, eps_v)
#     L_V       = 0.5 max((values - returns)^2, (V_clipped - returns)^2)
#
# Also return where the clipped branch is the larger (1.0, else 0.0): logged as value_clip_frac.

# %%
@lab.hole(ppo.value_loss)
def value_loss(values, old_values, returns, clip_eps_value):
    """values, old_values, returns (B, T) -> (the loss per token (B, T), clipped (B, T))."""
    raise lab.Todo("lab 3: write value_loss")


# %% [markdown]
# ## Check

# %%
if __name__ == "__main__":
    lab.check(gae, value_loss)

# %% [markdown]
# ## Run: ppo.py's own loop with your two functions
#
# 40 steps of 64 prompts, one completion each; the critic starts as a copy of the reward model.
# Expect the held-out accuracy from about 0.3 to about 0.9, the reward model's score (reward)
# rising with the true accuracy of the samples (gold) beside it, and explained_var (how much of
# the returns' variance the critic explains) well above 0. Then set `--lam 1`, or `--gamma 0.5`:
# what do you expect of explained_var and of the learning speed?

# %%
if __name__ == "__main__":
    run = lab.train(ppo, "--max_steps 40 --eval_every 20 --eval_size 200 --save_every 0",
                    {"ppo.gae": gae, "ppo.value_loss": value_loss})
    lab.plot(run, ["reward", "gold", "value_loss", "value_clip_frac", "explained_var"])
