# %% [markdown]
# # Lab 4: DPO's loss
#
# DPO (Rafailov et al. 2023) learns from preferences, a chosen answer y_w and a rejected one y_l
# per prompt x, with no reward model and no sampling. The KL-regularised RLHF objective has the
# optimum pi*(y|x) ~ pi_ref(y|x) exp(r(x, y) / beta); solve it for r and put r into the
# Bradley-Terry likelihood of the preference: the policy itself is fitted to the pairs. You write
# the loss; `dpo.py`'s own loop trains the bundled model on the bundled rankings (~1 min).
#
# Run it: `python labs/04_dpo.py`. Grade only: `python -m pytest labs -k lab4`.

# %%
import lab  # labs/lab.py: hole, check, train, plot
import dpo

# %% [markdown]
# ## The loss
#
# log pi(y|x) is the sum of the completion's token log-probs (dpo.py computes them). With
#
#     h = [log pi_theta(y_w|x) - log pi_ref(y_w|x)] - [log pi_theta(y_l|x) - log pi_ref(y_l|x)]
#     L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid(-beta h)
#
# beta = args.beta; eps = args.label_smoothing (cDPO: each label is wrong with probability eps;
# 0 by default). `torch.nn.functional.logsigmoid` is exact where log(sigmoid(.)) underflows.
# Also return the implicit rewards beta (log pi_theta - log pi_ref) of chosen and rejected,
# detached (logged: their margin and how often chosen's is higher). args.loss_type is "sigmoid".

# %%
@lab.hole(dpo.dpo_loss)
def dpo_loss(logp_chosen, logp_rejected, ref_chosen, ref_rejected, args):
    """Sequence log-probs (pairs,) each -> (the loss of each pair (pairs,), reward_chosen,
    reward_rejected)."""
    raise lab.Todo("lab 4: write dpo_loss")
    # h = ...
    # loss = ...  # (pairs,)
    # reward_chosen = (args.beta * (logp_chosen - ref_chosen)).detach()
    # reward_rejected = (args.beta * (logp_rejected - ref_rejected)).detach()
    # return loss, reward_chosen, reward_rejected


# %% [markdown]
# ## Check

# %%
if __name__ == "__main__":
    lab.check(dpo_loss)

# %% [markdown]
# ## Run: dpo.py's own loop with your loss
#
# Expect the held-out greedy accuracy on the sums (never trained on directly: only pairs of
# answers ranked by quality) from about 0.3 to about 0.8, the implicit reward margin growing and
# the pairs it orders right (rewards/accuracy) from about 0.67 to about 0.76. Then try
# `--beta 1` and `--beta 0.01`: which one stays closer to the reference, and what happens to
# the margin?

# %%
if __name__ == "__main__":
    run = lab.train(dpo, "--max_steps 100 --eval_every 50 --eval_size 200 --save_every 0",
                    {"dpo.dpo_loss": dpo_loss})
    lab.plot(run, ["loss", "rewards/margin", "rewards/accuracy", "logps/chosen"])
