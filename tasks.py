"""tasks.py: the data a run trains and evaluates on (plumbing: an algorithm reader can skip it).

The built-in addition task (seeded, with a fixed held-out split), your JSONL files, hub datasets
(`--data hf:NAME`, optional package `datasets`), and the preference files of reward_model.py and
dpo.py; and encode_prompts(), a prompt as the token ids the model reads (its chat template). Every
error names the file, the line and the field. The calculator tool task is envs.py.
"""
import json
import math
import os
import random
from types import SimpleNamespace

import torch

import answer_format
import common as C


# the pipeline's preference data (tools/make_pipeline_data.py)
PIPELINE_RANKINGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data",
                                 "rankings.jsonl")


# ------------------------------------------------------------------------------------------ data
TASK_DIGITS = 2  # the built-in task: two-digit addition, "37+48=" -> "85"


TASK_EVAL_SEED = 1234


TASK_EVAL_SIZE = 500


def addition_row(a, b):
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def task_eval_pairs():
    """The fixed held-out split: no warm start and no RL run ever trains on these pairs."""
    n = 10**TASK_DIGITS
    pairs = random.Random(TASK_EVAL_SEED).sample(range(n * n), TASK_EVAL_SIZE)
    return [divmod(x, n) for x in pairs]


def task_train_pairs(rng, k):
    """k fresh pairs outside the held-out split (a fixed few hundred would teach memorisation)."""
    held = set(task_eval_pairs())
    n = 10**TASK_DIGITS
    out = []
    while len(out) < k:
        pair = (rng.randrange(n), rng.randrange(n))
        if pair not in held:
            out.append(pair)
    return out


def make_row(raw, where, need_answer=False, prompt_field="", answer_field="", system_prompt=""):
    """One data row: every field of the source kept (reward functions see them all), plus
    "prompt" (text, or a list of chat messages {"role", "content"}) and "answer" (text, optional).
    prompt_field / answer_field name the source's fields ('' = the usual names). need_answer:
    the answer must hold a number (the math reward compares each completion with it)."""
    if not isinstance(raw, dict):
        raise C.UserError(f"{where}: not a JSON object")
    p_key = prompt_field or next((k for k in ("prompt", "question", "problem") if k in raw), "")
    a_key = answer_field or next((k for k in ("answer", "solution") if k in raw), "answer")
    row = dict(raw)
    prompt = raw.get(p_key)
    is_chat = isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in prompt)
    if not (isinstance(prompt, str) and prompt) and not is_chat:
        raise C.UserError(f"{where}: field {p_key or 'prompt'!r} is missing or not a non-empty "
                          "string (or a list of chat messages)")
    if system_prompt:  # a system message before the user's (kept if the row has its own)
        messages = as_messages(prompt)
        if messages[0]["role"] != "system":
            prompt = [{"role": "system", "content": system_prompt}, *messages]
    row["prompt"] = prompt
    row.pop("answer", None)
    answer = raw.get(a_key)
    if isinstance(answer, (bool, list, dict)):
        raise C.UserError(f"{where}: field {a_key!r} must be a string or a number")
    if answer is not None:  # a missing or null answer stays missing (not the text 'None')
        row["answer"] = str(answer)
    if need_answer and answer_format.final_answer(row.get("answer", ""), reference=True) is None:
        raise C.UserError(f"{where}: field {a_key!r} is missing or has no number, which the math "
                          "reward compares with each completion (or change --rewards)")
    return row


def jsonl_objects(path):
    """(where, object) for each non-blank line of a JSONL file, where = "FILE, line N". Errors
    name the file and the line."""
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "not found"
        raise C.UserError(f"data file {path!r} {what}")
    found = False
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}, line {n}"
            try:
                line = raw.decode("utf-8-sig")  # -sig: a byte-order mark is not an error
                if not line.strip():
                    continue
                obj = json.loads(line)
            except UnicodeDecodeError:
                raise C.UserError(f"{where}: not UTF-8 text") from None
            except json.JSONDecodeError as e:
                raise C.UserError(f"{where}: not valid JSON ({e.msg})") from None
            found = True
            yield where, obj
    if not found:
        raise C.UserError(f"data file {path!r} is empty")


def read_jsonl(path, need_answer=False, **fields):
    """Rows of a JSONL file, one JSON object a line (see make_row). Errors name the file, the line
    and the field."""
    return [make_row(obj, where, need_answer, **fields) for where, obj in jsonl_objects(path)]


def read_hub_dataset(spec, split="train", need_answer=False, **fields):
    """'hf:NAME[:CONFIG]', e.g. hf:openai/gsm8k:main (question/answer columns), every column kept.
    Needs the optional package `datasets`."""
    try:
        import datasets
    except ImportError:
        raise C.UserError("--data hf:... needs the optional package `datasets` "
                          "(pip install datasets)") from None
    table = datasets.load_dataset(*spec[3:].split(":"), split=split)
    return [make_row(dict(r), f"--data {spec}, row {i}", need_answer, **fields)
            for i, r in enumerate(table)]


def load_data(spec, eval_size=TASK_EVAL_SIZE, need_answer=False, split="train", prompt_field="",
              answer_field="", system_prompt=""):
    """'' -> the built-in task; 'file.jsonl' -> its rows; 'hf:NAME[:CONFIG]' -> a hub dataset.
    need_answer: every row must have an answer with a number (the math reward checks it).
    Returns next_batch(rng, k) -> k training rows, eval_rows (held out) and rows (all). next_batch
    keeps no state but the rng it is given, so saving that rng resumes the data stream exactly."""
    fields = dict(prompt_field=prompt_field, answer_field=answer_field, system_prompt=system_prompt)
    if not spec:
        eval_rows = [make_row(addition_row(a, b), "", **fields)
                     for a, b in task_eval_pairs()][:eval_size]

        def next_task_batch(rng, k):
            return [make_row(addition_row(a, b), "", **fields) for a, b in task_train_pairs(rng, k)]
        return SimpleNamespace(next_batch=next_task_batch, eval_rows=eval_rows, rows=eval_rows)
    if spec.startswith("hf:"):
        rows = read_hub_dataset(spec, split, need_answer, **fields)
    else:
        rows = read_jsonl(spec, need_answer, **fields)
    random.Random(0).shuffle(rows)  # a fixed split, the same for every run and seed
    n_eval = min(eval_size, len(rows) // 5)
    if not n_eval:
        print(f"note: {spec} has {len(rows)} rows, too few to hold a fifth out: eval score is nan")
    eval_rows, train_rows = rows[:n_eval], rows[n_eval:]

    def next_file_batch(rng, k):
        return [rng.choice(train_rows) for _ in range(k)]
    return SimpleNamespace(next_batch=next_file_batch, eval_rows=eval_rows, rows=rows)


# preference data (reward_model.py, dpo.py): pairs {"prompt", "chosen", "rejected"} or rankings
# {"prompt", "ranking": [best, ..., worst]}
def ranking_pairs(k):
    """All K(K-1)/2 (better, worse) index pairs of a ranking of k, best first."""
    return [(i, j) for i in range(k) for j in range(i + 1, k)]


def read_preferences(path, eval_size):
    """(train rows, held-out rows), each {"prompt", "completions", "pairs": [(chosen i, rejected
    j), ...], "margin"}, from pairs or rankings; the prompt is text or chat messages (checked by
    make_row). Errors name the file, the line and the field."""
    rows = []
    for where, obj in jsonl_objects(path):
        row = make_row(obj, where)
        if "ranking" in row:
            done = row["ranking"]  # the completions, best first
            if not (isinstance(done, list) and len(done) >= 2
                    and all(isinstance(c, str) for c in done)):
                raise C.UserError(f"{where}: field 'ranking' must be a list of 2 or more strings")
        else:
            for key in ("chosen", "rejected"):
                if not isinstance(row.get(key), str):
                    raise C.UserError(f"{where}: field {key!r} is missing or not a string (a "
                                      "row needs 'chosen' and 'rejected', or 'ranking')")
            done = [row["chosen"], row["rejected"]]
        if len(set(done)) < len(done):
            raise C.UserError(f"{where}: a completion is both chosen and rejected: {done}")
        margin = row.get("margin", 0.0)
        if type(margin) not in (int, float) or not math.isfinite(margin):  # (True: no)
            raise C.UserError(f"{where}: field 'margin' must be a finite number")
        rows.append({"prompt": row["prompt"], "completions": done, "margin": float(margin),
                     "pairs": ranking_pairs(len(done))})
    # held out: a fixed fifth of the distinct prompts (at most eval_size), all rows of a prompt
    key = [json.dumps(r["prompt"]) for r in rows]  # a chat prompt is a list: not hashable
    prompts = sorted(set(key))
    random.Random(0).shuffle(prompts)
    held = set(prompts[:min(eval_size, len(prompts) // 5)])
    return ([r for r, k in zip(rows, key) if k not in held],
            [r for r, k in zip(rows, key) if k in held])


def step_rows(rows, batch_size, seed, step):
    """The rows of optimizer step `step`: each epoch is a shuffle set by (seed, epoch) alone, so
    resuming needs only the step number."""
    epoch, i = divmod(step, math.ceil(len(rows) / batch_size))
    order = random.Random(seed * 100003 + epoch).sample(rows, len(rows))
    return order[i * batch_size:(i + 1) * batch_size]


def flatten(rows):
    """Each row's completions, one after another, and the index pairs, margins and weights of
    all its pairs in that flat list: (prompts, completions, chosen, rejected, margin, weight)."""
    prompts, completions, chosen, rejected, margin, weight = [], [], [], [], [], []
    for r in rows:
        start = len(completions)
        prompts += [r["prompt"]] * len(r["completions"])
        completions += r["completions"]
        chosen += [start + i for i, _ in r["pairs"]]
        rejected += [start + j for _, j in r["pairs"]]
        margin += [r["margin"]] * len(r["pairs"])
        weight += [1 / len(r["pairs"])] * len(r["pairs"])
    return prompts, completions, chosen, rejected, torch.tensor(margin), torch.tensor(weight)


def collate(examples, pad_id, device):
    """Rows of (prompt ids, completion ids) as a rollout: prompts left-padded to P columns,
    completions right-padded to T; completion_mask (B, T) is 1 on each completion token, EOS
    included, built from lengths."""
    prompt, prompt_mask = C.left_pad([p for p, _ in examples], pad_id, device)
    T = max(len(c) for _, c in examples)
    completion = torch.tensor([c + [pad_id] * (T - len(c)) for _, c in examples], device=device)
    mask = torch.tensor([[1] * len(c) + [0] * (T - len(c)) for _, c in examples], device=device)
    return SimpleNamespace(ids=torch.cat([prompt, completion], 1), P=prompt.shape[1],
                           attention_mask=torch.cat([prompt_mask, mask], 1),
                           completion_mask=mask.float())


# ------------------------------------------------------------ prompts as token ids the model reads
def as_messages(prompt):
    """A prompt as chat messages: a text is one user message; a list of messages stays as it is."""
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def as_text(prompt):
    """A prompt as plain text, for a tokenizer without a chat template: the messages' contents."""
    return prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)


def encode_prompts(tok, prompts, chat_template="auto", tools=None):
    """Token ids per prompt (text or messages), with the tokenizer's chat template unless 'none';
    tools: JSON schemas the template renders (--tools)."""
    if chat_template != "none" and tok.chat_template:
        texts = [tok.apply_chat_template(as_messages(p), tools=tools, tokenize=False,
                                         add_generation_prompt=True) for p in prompts]
        return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [tok(as_text(p))["input_ids"] for p in prompts]


def prompt_text(tok, roll, i):
    """Row i's prompt as the model read it (its chat template, --tools' schemas): decoded ids."""
    return tok.decode(roll.ids[i, :roll.P][roll.attention_mask[i, :roll.P] == 1])
