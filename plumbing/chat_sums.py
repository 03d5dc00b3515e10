"""chat_sums.py: the real-model task, --data chat-sums (plumbing: an algorithm reader can skip it).

One-digit sums asked in chat, in 8 phrasings, each ending "Answer with just the equation."; half
the prompts first show one worked example (What is 2 + 2? ... -> "2 + 2 = 4"), half do not:
[{"role": "user", "content": "Add 3 and 5. Answer with just the equation."}] -> "3 + 5 = 8".
Generated, so nothing is downloaded. The held-out split is by problem: a sum a + b held out
(either order) is never trained on, in any phrasing, with or without the example. The reward,
asked_answer, checks what the prompt asks: 1 for the right equation alone ("3 + 5 = 8",
"3+5=8."), 0 for a wrong sum, a sentence or a bare "8" (the math reward, logged as gold, reads
only the last number). SmolLM2-135M-Instruct answers most prompts with the example right and few
without it (it writes sentences), so RL has a visible job: carry the form over to the prompts
that show none, and get the sums right (docs/real_model.md). PRESET: the flags' defaults for a
real model on it, chosen by measurement.
"""
import random
import re
from types import SimpleNamespace

NAME = "chat-sums"  # --data chat-sums
PHRASINGS = ("What is {a} + {b}?", "Add {a} and {b}.", "Compute {a} + {b}.",
             "What is the sum of {a} and {b}?", "{a} + {b} = ?", "How much is {a} plus {b}?",
             "Find the total of {a} and {b}.",
             "I have {a} apples and get {b} more. How many apples do I have?")
ASK = " Answer with just the equation."
EVAL_SEED = 4545
EXAMPLE = (2, 2, 0)  # the worked example (before half the questions): not a problem here
HELD_OUT = 18  # of the 54 other problems {a, b}: 18 held out (33 ordered sums, 528 prompts)
# --data chat-sums sets these defaults for the RL scripts (explicit flags still win): measured on
# SmolLM2-135M-Instruct, 2 CPU cores (docs/real_model.md). An equation is 7-8 tokens and its EOS
# one more, so 10 new tokens cut no answer (a sentence, 13: cut, scores 0 anyway); T 0.7 gives
# groups mixed rewards; beta 0 needs no reference model (its KL is not computed: kl logs 0)
PRESET = {"reward_fn": ["plumbing.chat_sums:asked_answer"], "eval_reward": "rewards",
          "max_new_tokens": 10, "temperature": 0.7, "lr": 2e-5, "beta": 0.0,
          "prompts_per_step": 4, "micro_batch_size": 32, "eval_size": 128,
          "max_steps": 16, "eval_every": 8, "save_every": 0, "samples_every": 4}
# reinforce: RLOO, since every reward here is >= 0 (no baseline would push up every sample); ppo:
# a critic made from the policy (there is no reward model) at verl's critic lr for real models,
# one epoch of 2 minibatches (OpenRLHF's and verl's 1 epoch): 32 distinct prompts share no
# prefix, so a PPO step costs ~6x a GRPO step here (4 x 2 updates took 170 s a step); distill:
# one sample of 32 prompts, the forward KL over the whole vocabulary (jsd, beta 0): the reverse
# KL's gradient (opd's, jsd's at beta 1) vanishes where the student is sure of a token the teacher
# rejects, and a student taught by a GRPO teacher slid back from its teacher's score (distill.md)
PRESET_ALGO = {"grpo": {"group_size": 8},
               "reinforce": {"samples_per_prompt": 8, "baseline": "rloo"},
               "ppo": {"batch_size": 32, "micro_batch_size": 16, "critic_init": "policy",
                       "critic_lr": 1e-5, "ppo_epochs": 1, "num_minibatches": 2,
                       "max_steps": 10, "eval_every": 5},
               "distill": {"samples_per_prompt": 1, "prompts_per_step": 32, "loss": "jsd",
                           "beta": 0.0}}


def preset(data, algo, names):
    """The flags' defaults for --data chat-sums in algo's script, those of its flags (names) only;
    {} for other data."""
    if data != NAME or algo not in PRESET_ALGO:
        return {}
    return {k: v for k, v in {**PRESET, **PRESET_ALGO[algo]}.items() if k in names}


def question(a, b, phrasing):
    return {"role": "user", "content": PHRASINGS[phrasing].format(a=a, b=b) + ASK}


def equation(a, b):
    return f"{a} + {b} = {a + b}"


def row(a, b, phrasing, shown=1):
    """The data row asking a + b in this phrasing, after the worked example if shown; "example":
    the worked example where the prompt does not show it (distill.py --teacher_context example)."""
    example = [question(*EXAMPLE), {"role": "assistant", "content": equation(*EXAMPLE[:2])}]
    prompt = [*example, question(a, b, phrasing)] if shown else [question(a, b, phrasing)]
    return {"prompt": prompt, "answer": str(a + b), "equation": equation(a, b),
            "example": [] if shown else example}


def split():
    """(train, held-out) lists of (a, b, phrasing, shown): held out by problem {a, b}, in every
    phrasing, shown (the worked example first) or not."""
    problems = [(a, b) for a in range(10) for b in range(a, 10) if (a, b) != EXAMPLE[:2]]
    held = set(random.Random(EVAL_SEED).sample(problems, HELD_OUT))
    every = [(a, b, p, s) for a in range(10) for b in range(10) for p in range(len(PHRASINGS))
             for s in (0, 1) if (a, b) != EXAMPLE[:2]]
    test = [x for x in every if (min(x[:2]), max(x[:2])) in held]
    random.Random(EVAL_SEED).shuffle(test)  # eval_size < all: a mix of problems and phrasings
    return [x for x in every if (min(x[:2]), max(x[:2])) not in held], test


def load(eval_size, make_row):
    """tasks.load_data's answer: next_batch(rng, k) -> k training rows, eval_rows (held out, the
    first eval_size) and rows. make_row((a, b, phrasing, shown)) -> a data row (tasks.make_row)."""
    train, test = split()  # of (a, b, phrasing, shown)
    eval_rows = [make_row(x) for x in test[:eval_size]]

    def next_batch(rng, k):
        return [make_row(rng.choice(train)) for _ in range(k)]
    return SimpleNamespace(next_batch=next_batch, eval_rows=eval_rows, rows=eval_rows)


def asked_answer(completions, rows):
    """1 when the completion is the row's equation alone, a + b = c or b + a = c (spaces and a
    final '.' aside), else 0."""
    def bare(text):
        return re.sub(r"\s|\.$", "", text.strip())

    def right(text, equation):
        a, b, c = re.findall(r"\d+", equation)
        return bare(text) in (f"{a}+{b}={c}", f"{b}+{a}={c}")
    return [float(right(c, r["equation"])) for c, r in zip(completions, rows)]
