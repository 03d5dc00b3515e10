# %% [markdown]
# # Lab 7: a tool environment -- the calculator
#
# A multi-turn rollout: the model writes until its turn ends; an environment reads the turns so
# far and answers with an observation, whose tokens go into the same completion (masked out of
# the loss: the model did not write them); the model goes on, until the environment says the
# episode is over. You write the environment of the bundled calculator task; `grpo.py --env
# calc` then trains models/tiny-calc (a 1 M-parameter model that cannot add 4-digit numbers in
# its head, warm-started to call the tool 30% of the time) with it (~95 s of CPU).
#
# Run it: `python labs/07_tools.py`. Grade only: `python -m pytest labs -k lab7`.

# %%
import re

import lab  # labs/lab.py: hole, check, train, plot
import grpo
from plumbing import calc as project_calc  # the bundled task: its data, defaults and calc()

# %% [markdown]
# ## The environment: calc(row, turns) -> an observation, or None
#
# `turns` is the list of the model's turns so far (text), `row` the prompt's row. A turn ends
# when the model writes `</calc>` (the run's stop string) or its EOS. Then:
#
# - if the LAST turn ends with `<calc>A+B</calc>` (or `A-B`, `A*B`; whitespace after it is
#   fine), the observation is the result with a space on each side: `" 6912 "` (the layout the
#   model's warm start was trained on);
# - a call it cannot read (`<calc>12+</calc>`, numbers longer than 12 digits) gets `" error "`;
# - a turn without a call at its end was the answer: return None, the episode ends.
#
# Only the text inside the last `<calc>` counts (`<calc>1<calc>2+3</calc>` is the call `2+3`).

# %%
CALL = re.compile(r"<calc>(.*)</calc>\s*$", re.S)  # a turn that ends with a call (given)


@lab.hole(project_calc.calc)
def calc(row, turns):
    """The calculator's answer to the model's last turn, or None: the episode ends."""
    raise lab.Todo("lab 7: write calc")


# %% [markdown]
# ## Check

# %%
if __name__ == "__main__":
    lab.check(calc)

# %% [markdown]
# ## Run: grpo.py's own multi-turn loop with your environment
#
# 60 steps (the --env calc preset: 48 new tokens, 4 samples per held-out prompt, the held-out
# score is their mean). Expect the held-out score from about 0.28 to about 0.9, and frac_tool
# (the share of completions that call the tool) from about 0.3 at step 1 to nearly 1: the model
# learns that calling pays. Read a transcript in the run's samples.jsonl (observations show as
# ⟦ 6912 ⟧). Then make the tool return a wrong sum one time in three: what does the model learn?

# %%
if __name__ == "__main__":
    run = lab.train(grpo, "--env calc --save_every 0", {"plumbing.calc.calc": calc})
    lab.plot(run, ["reward", "frac_tool", "completion_len"])
