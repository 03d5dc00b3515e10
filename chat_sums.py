"""chat_sums.py: the real-model task, --data chat-sums (plumbing: an algorithm reader can skip it).

One-digit sums asked in chat, in 8 phrasings, each ending "Answer with just the number.", after
one worked example (2 + 2 -> "4") that shows the form: [..., {"role": "user", "content": "What is
3 + 5? Answer with just the number."}] -> "8". Generated, so nothing is downloaded. The held-out
split is by problem: a sum a + b held out (either order) is never trained on, in any phrasing.
The reward, asked_answer, checks what the prompt asks: 1 for the right number alone ("8", "8."),
0.5 for the right number in a sentence ("3 + 5 = 8."; the math reward, logged as gold, counts
that as right), 0 otherwise. A pretrained chat model answers in sentences and often wrongly, so
RL has a visible job: SmolLM2-135M-Instruct's held-out score rises by tens of points in minutes
on a laptop CPU (docs/real_model.md). PRESET: the flags' defaults for a real model on it.
"""
import random
import re

import common as C

NAME = "chat-sums"  # --data chat-sums
PHRASINGS = ("What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} + {b}.",
             "What is the sum of {a} and {b}?", "{a} + {b} = ?", "How much is {a} plus {b}?",
             "Find the total of {a} and {b}.",
             "I have {a} apples and get {b} more. How many apples do I have?")
ASK = " Answer with just the number."
EVAL_SEED = 4545
EXAMPLE = (2, 2, 0)  # the worked example before each question: not a problem of the task
HELD_OUT = 18  # of the 54 other problems {a, b}: 18 held out (33 ordered sums, 264 prompts)
# --data chat-sums sets these defaults for the RL scripts (explicit flags still win): measured on
# SmolLM2-135M-Instruct, 2 CPU cores (docs/real_model.md). An answer is 1-2 tokens and its
# sentence about 8, so 10 new tokens cut nothing; T 0.7 gives groups mixed rewards; beta 0 needs
# no reference model (its KL is not computed: kl logs 0)
PRESET = {"reward_fn": ["chat_sums:asked_answer"], "eval_reward": "rewards",
          "max_new_tokens": 10, "temperature": 0.7, "lr": 2e-5, "beta": 0.0,
          "prompts_per_step": 4, "micro_batch_size": 32, "eval_size": 264,
          "max_steps": 16, "eval_every": 4, "save_every": 0, "samples_every": 4}
PRESET_ALGO = {"grpo": {"group_size": 8}, "reinforce": {"samples_per_prompt": 8},
               "ppo": {"batch_size": 32, "critic_init": "policy", "kl_coef": 0.0}}


def preset(data, algo):
    """The flags' defaults for --data chat-sums in algo's script ({} for other data)."""
    if data != NAME or algo not in PRESET_ALGO:
        return {}
    return {**PRESET, **PRESET_ALGO[algo]}


def question(a, b, phrasing):
    return {"role": "user", "content": PHRASINGS[phrasing].format(a=a, b=b) + ASK}


def row(a, b, phrasing):
    example = [question(*EXAMPLE), {"role": "assistant", "content": str(sum(EXAMPLE[:2]))}]
    return {"prompt": [*example, question(a, b, phrasing)], "answer": str(a + b)}


def split():
    """(train, held-out) lists of (a, b, phrasing): held out by problem {a, b}, every phrasing."""
    problems = [(a, b) for a in range(10) for b in range(a, 10) if (a, b) != EXAMPLE[:2]]
    held = set(random.Random(EVAL_SEED).sample(problems, HELD_OUT))
    every = [(a, b, p) for a in range(10) for b in range(10) for p in range(len(PHRASINGS))
             if (a, b) != EXAMPLE[:2]]
    test = [x for x in every if (min(x[:2]), max(x[:2])) in held]
    random.Random(EVAL_SEED).shuffle(test)  # eval_size < all: a mix of problems and phrasings
    return [x for x in every if (min(x[:2]), max(x[:2])) not in held], test


def asked_answer(completions, rows):
    """1 for the answer alone (spaces and a final '.' allowed), 0.5 for the answer as the text's
    last number (common.math_reward), else 0."""
    return [1.0 if re.sub(r"\.$", "", c.strip()) == r["answer"] else 0.5 * C.math_reward(c, r)
            for c, r in zip(completions, rows)]
