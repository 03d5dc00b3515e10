"""Generate the bundled task's RLHF-pipeline data in data/, deterministically and offline (CPU):

  data/demonstrations.jsonl  {"prompt": "37+48=", "completion": "85"}: what sft.py imitates.
                             Written by column addition that forgets each carry with probability
                             DEMO_DROP (tools/build_models.py's column_sum): the same systematic,
                             human-like slip the bundled policy learned (57+68=15), made by more
                             careful annotators (30% per carry, against the 70% of the data that
                             made models/tiny-adder), so that SFT has something to learn.
  data/rankings.jsonl        {"prompt": "37+48=", "ranking": ["85", "75", "95"]}: best first, for
                             reward_model.py and dpo.py. For each prompt, SAMPLES answers are
                             sampled from models/tiny-adder at TEMPERATURE and ranked by the true
                             sum, a stand-in for human annotators: the correct answer first, then
                             by distance from the sum, answers with no number last. Answers as far
                             from the sum as a better-ranked one are dropped (an annotator would
                             call them a tie), and prompts left with one answer give no ranking.

Why temperature 2: at 1 nearly every wrong answer is a dropped carry, which is always SMALLER than
the sum, so "bigger is better" explains the rankings, and a reward model trained on them was hacked
by PPO within 20 steps (55+43=108; held-out accuracy 0.29 -> 0.35). At 2 the samples include
answers that overshoot, digits off and garbage, as a policy drifting under RL writes them.

No prompt is in the held-out split (tasks.task_eval_pairs), which every script evaluates on.
Run: python tools/make_pipeline_data.py   (about 10 s; the same files every time)
"""
import json
import os
import random
import sys

import torch
from transformers.utils import logging as hf_logging

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
from plumbing import loading
from plumbing import tasks
from build_models import column_sum  # noqa: E402  (tools/ is this script's own folder)

DEMO_DROP = 0.3  # probability that a demonstration forgets a carry
N_DEMOS = 3000  # demonstration rows (about 120 KB)
N_RANK_PROMPTS = 3000  # prompts sampled for rankings (those with 2+ distinct answers are kept)
SAMPLES = 6  # answers sampled per prompt
TEMPERATURE = 2.0  # sampling temperature: see above
OUT = os.path.join(loading.ROOT, "data")


def rank(answers, true_sum):
    """The distinct answers, best first, ties with a better-ranked answer dropped."""
    def distance(answer):
        x = tasks.final_number(answer)
        return abs(x - true_sum) if x is not None and answer.strip() else float("inf")
    ranking, seen = [], set()
    for answer in sorted(dict.fromkeys(answers), key=distance):  # stable: first sampled wins ties
        if distance(answer) not in seen:
            seen.add(distance(answer))
            ranking.append(answer)
    return ranking


def write(name, rows):
    path = os.path.join(OUT, name)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    print(f"wrote {path}: {len(rows)} rows, {os.path.getsize(path) / 1024:.0f} KB")


def main():
    hf_logging.disable_progress_bar()
    torch.set_num_threads(1)  # one thread: the same floating-point sums, so the same samples
    torch.manual_seed(0)
    os.makedirs(OUT, exist_ok=True)
    rng = random.Random(0)
    demos = [{"prompt": f"{a}+{b}=", "completion": str(column_sum(a, b, rng, DEMO_DROP))}
             for a, b in tasks.task_train_pairs(rng, N_DEMOS)]
    write("demonstrations.jsonl", demos)

    tok = loading.load_tokenizer(loading.DEFAULT_POLICY)
    model = loading.load_model(loading.DEFAULT_POLICY, "lm", torch.device("cpu"), frozen=True)
    pairs = tasks.task_train_pairs(random.Random(1), N_RANK_PROMPTS)
    prompts = [f"{a}+{b}=" for a, b in pairs for _ in range(SAMPLES)]
    roll = C.sample(model, tok, C.encode_prompts(tok, prompts), max_new_tokens=6,
                    temperature=TEMPERATURE)
    answers = C.decode_completions(tok, roll)
    rankings, right_first = [], 0
    for i, (a, b) in enumerate(pairs):
        ranking = rank(answers[i * SAMPLES:(i + 1) * SAMPLES], a + b)
        if len(ranking) >= 2:
            rankings.append({"prompt": f"{a}+{b}=", "ranking": ranking})
            right_first += ranking[0] == str(a + b)
    write("rankings.jsonl", rankings)
    print(f"rankings with the correct answer first: {right_first / len(rankings):.2f}; answers "
          f"per ranking: {sum(len(r['ranking']) for r in rankings) / len(rankings):.2f}")


if __name__ == "__main__":
    main()
