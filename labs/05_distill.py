# %% [markdown]
# # Lab 5: on-policy distillation's per-token advantage
#
# RL gives one number per completion; a teacher gives one per token. In on-policy distillation
# (Agarwal et al. 2024; Thinking Machines' Tinker cookbook 2025) the student samples, a frozen
# teacher scores every sampled token, and each token's advantage is how much likelier the
# teacher finds it than the student does. You write that advantage; first `grpo.py` trains a
# teacher (the project's own functions, ~10 s), then `distill.py`'s own loop distils it into a
# fresh copy of the bundled model with your function (~10 s).
#
# Run it: `python labs/05_distill.py`. Grade only: `python -m pytest labs -k lab5`.

# %%
import lab  # labs/lab.py: hole, check, train, plot
import distill
import grpo

# %% [markdown]
# ## The per-token advantage
#
# For each sampled token o_t, minus the one-sample estimate of the reverse KL(pi_theta || pi_T):
#
#     A_t = -kl_coef (log pi_theta(o_t) - log pi_T(o_t))
#
# A token the teacher likes more than the student gets A_t > 0 and is pushed up by the loop's
# policy-gradient loss -(pi_theta / pi_old) A_t. A_t is a reward, not something to
# differentiate: detach it (else the gradient also flows through log pi_theta inside A).

# %%
@lab.hole(distill.opd_advantages)
def opd_advantages(logprobs, teacher_logprobs, kl_coef=1.0):
    """Log-probs of the sampled tokens under the student (with gradients) and the teacher, the
    same shape -> A, that shape, detached."""
    raise lab.Todo("lab 5: write opd_advantages")


# %% [markdown]
# ## Check

# %%
if __name__ == "__main__":
    lab.check(opd_advantages)

# %% [markdown]
# ## Run: a teacher, then distill.py's own loop with your advantage
#
# Expect the student's held-out accuracy from about 0.3 to near the teacher's (0.9 and more) and
# the KL to the teacher per token (kl) falling. Then try `--kl_coef 0.1`: slower, or not?

# %%
if __name__ == "__main__":
    teacher = lab.train(grpo, "--max_steps 60 --eval_every 0 --eval_size 200 --save_every 0", {})
    run = lab.train(distill, f"--teacher {teacher}/checkpoint --max_steps 60 --eval_every 20 "
                    "--eval_size 200 --save_every 0", {"distill.opd_advantages": opd_advantages})
    lab.plot(run, ["reward", "kl", "entropy"])
