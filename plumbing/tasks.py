"""tasks.py: the data a run trains and evaluates on (plumbing: an algorithm reader can skip it).

The built-in addition task (seeded, with a fixed held-out split); your data files (JSON lines, a
JSON array, CSV, parquet) and hub datasets or dataset folders (`--data hf:NAME`, `hf:DIR`,
optional package `datasets`), in TRL's dataset formats: prompts for the RL scripts, demonstrations
for sft.py (and their loss masks), preferences for reward_model.py and dpo.py; and what the
held-out score is (eval_metric). Every error names the file, the row and the field. The
calculator tool task is envs.py; a prompt as token ids, common.encode_prompts.
"""
import csv
import functools
import json
import math
import os
import random
import re
from types import SimpleNamespace

import torch

from plumbing import chat_sums, rg
import common as C
from plumbing.errors import UserError, first_line


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
# the pipeline's preference data (tools/make_pipeline_data.py)
PIPELINE_RANKINGS = os.path.join(ROOT, "data", "rankings.jsonl")


# ------------------------------------------------------------------------------------------ data
def final_number(text):  # final_answer's number; None for an expression (\\pi, (1,2))
    return answer if isinstance(answer := C.final_answer(text), float) else None


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


CHAT_ROLES = ("system", "user", "assistant", "tool")


def fields_found(raw):
    return f"fields found: {', '.join(map(str, raw)) or 'none'}" if isinstance(raw, dict) else \
        f"found {type(raw).__name__}"


def check_messages(messages, where, field):
    """Chat messages [{"role", "content"}, ...], each role one of CHAT_ROLES and each content a
    string; an assistant message with "tool_calls" may have none (then it is ""). Errors name the
    row, the field and the message."""
    if not (isinstance(messages, list) and messages):
        raise UserError(f"{where}: field {field!r} must be a non-empty list of chat messages "
                        "{role, content}")
    out = []
    for n, m in enumerate(messages):
        role = m.get("role") if isinstance(m, dict) else None
        if role not in CHAT_ROLES:
            raise UserError(f"{where}: field {field!r}, message {n}: role {role!r} is not one "
                            f"of {', '.join(CHAT_ROLES)}")
        calls = m.get("tool_calls") or []
        if not (isinstance(calls, list) and all(isinstance(c, dict) for c in calls)):
            raise UserError(f"{where}: field {field!r}, message {n}: 'tool_calls' must be a "
                            "list of calls {type, function: {name, arguments}}")
        if m.get("content") is None and calls:
            m = {**m, "content": ""}  # a call without text (the OpenAI format)
        if not isinstance(m.get("content"), str):
            raise UserError(f"{where}: field {field!r}, message {n}: 'content' must be a string")
        out.append(m)
    return out


def make_row(raw, where, need_answer=False, prompt_field="", answer_field="", system_prompt=""):
    """One data row: every field of the source kept (reward functions see them all), plus
    "prompt" (text, or a list of chat messages {"role", "content"}) and "answer" (text, optional).
    prompt_field / answer_field name the source's fields ('' = the usual names). need_answer:
    the answer must hold a number (the math reward compares each completion with it)."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: not a JSON object ({fields_found(raw)})")
    p_key = prompt_field or next((k for k in ("prompt", "question", "problem") if k in raw), "")
    a_key = answer_field or next((k for k in ("answer", "solution") if k in raw), "answer")
    row = dict(raw)
    prompt = raw.get(p_key)
    if isinstance(prompt, list):
        prompt = check_messages(prompt, where, p_key)
    elif not (isinstance(prompt, str) and prompt):
        raise UserError(f"{where}: field {p_key or 'prompt'!r} is missing or not a non-empty "
                        f"string (or a list of chat messages); {fields_found(raw)}")
    if system_prompt:  # a system message before the user's (kept if the row has its own)
        messages = C.as_messages(prompt)
        if messages[0]["role"] != "system":
            prompt = [{"role": "system", "content": system_prompt}, *messages]
    row["prompt"] = prompt
    row.pop("answer", None)
    answer = raw.get(a_key)
    if isinstance(answer, (bool, list, dict)):
        raise UserError(f"{where}: field {a_key!r} must be a string or a number")
    if answer is not None:  # a missing or null answer stays missing (not the text 'None')
        row["answer"] = str(answer)
    if need_answer and C.final_answer(row.get("answer", ""), reference=True) is None:
        raise UserError(f"{where}: field {a_key!r} is missing or has no number, which the math "
                        "reward compares with each completion (or change --rewards)")
    return row


# ------------------------------------------------------------------------------- data files
def jsonl_objects(path):
    """(where, object) for each non-blank line of a JSON lines file, where = "FILE, line N"."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}, line {n}"
            try:
                line = raw.decode("utf-8-sig")  # -sig: a byte-order mark is not an error
                if not line.strip():
                    continue
                obj = json.loads(line)
            except UnicodeDecodeError:
                raise UserError(f"{where}: not UTF-8 text") from None
            except (json.JSONDecodeError, RecursionError) as e:  # (it recurses once a level)
                why = getattr(e, "msg", "nested too deeply to read")
                raise UserError(f"{where}: not valid JSON ({why})") from None
            yield where, obj


def file_records(path):
    """(where, object) per row of a data file, by its name: .parquet (pyarrow), .csv (a header
    line of field names; every value is text), .json (one JSON array of objects, or JSON lines),
    anything else JSON lines. where names the file and the line ("line N"), or for a parquet file
    or a JSON array the row ("row N", from 0)."""
    ext = os.path.splitext(path)[1].lower()
    if ext == ".parquet":
        try:
            import pyarrow.parquet
        except ImportError:
            raise UserError(f"data file {path!r}: reading parquet needs the optional package "
                            "`pyarrow` (pip install pyarrow)") from None
        try:
            rows = pyarrow.parquet.read_table(path).to_pylist()
        except Exception as e:  # pyarrow's own errors: not a parquet file, damaged
            raise UserError(f"data file {path!r}: pyarrow cannot read it as parquet "
                            f"({type(e).__name__}: {first_line(e)})") from None
        return [(f"{path}, row {i}", r) for i, r in enumerate(rows)]
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: a byte-order mark is fine
            if ext == ".csv":
                csv.field_size_limit(2**31 - 1)  # not 128 KB: a long prompt is one field
                reader = csv.DictReader(f)
                repeated = [k for k in reader.fieldnames or () if reader.fieldnames.count(k) > 1]
                if repeated:  # DictReader would keep the last column of that name, silently
                    raise UserError(f"data file {path!r}: the header line names column "
                                    f"{repeated[0]!r} twice; rename one")
                out = [(f"{path}, line {reader.line_num}", r) for r in reader]
                bad = next((w for w, r in out if None in r or None in r.values()), None)
                if bad:
                    raise UserError(f"{bad}: not as many values as the header line has fields")
                return out
            whole = json.load(f) if ext == ".json" else None
    except UnicodeDecodeError:
        raise UserError(f"data file {path!r}: not UTF-8 text") from None
    except (json.JSONDecodeError, RecursionError):  # JSON lines in a .json file, or nested
        whole = None  # too deeply to read: a line at a time below (which says where)
    if isinstance(whole, dict):  # one object alone: one row
        whole = [whole]
    if isinstance(whole, list):
        return [(f"{path}, row {i}", r) for i, r in enumerate(whole)]
    return list(jsonl_objects(path))


def hub_records(spec, split="train"):
    """(where, row) per row of 'hf:NAME[:CONFIG]' (a hub dataset, e.g. hf:openai/gsm8k:main; the
    local cache when offline) or 'hf:DIR' (a folder written by Dataset.save_to_disk, or a folder
    of data files), every column kept. Needs the optional package `datasets`."""
    try:
        import datasets
    except ImportError:
        raise UserError("--data hf:... needs the optional package `datasets` "
                        "(pip install datasets)") from None
    name = spec[3:]
    try:
        if any(os.path.isfile(os.path.join(name, f)) for f in ("state.json", "dataset_dict.json")):
            table = datasets.load_from_disk(name)  # save_to_disk's folder: a Dataset or a dict
            if isinstance(table, datasets.DatasetDict):
                if split not in table:
                    raise UserError(f"--data {spec}: no split {split!r}; it has "
                                    f"{', '.join(table)} (pick one with --data_split)")
                table = table[split]
        else:
            table = datasets.load_dataset(*([name] if os.path.isdir(name) else name.split(":")),
                                          split=split)
    except ConnectionError:  # not cached, and the hub out of reach (or HF_HUB_OFFLINE=1)
        raise UserError(f"--data {spec}: not in the local cache, and this machine cannot reach "
                        "the hub (offline): load it once online, or give a file") from None
    except UserError:
        raise
    except Exception as e:  # datasets' own errors: no such dataset, config or split
        raise UserError(f"--data {spec}: datasets cannot load it ({type(e).__name__}: "
                        f"{first_line(e)})") from None
    return [(f"--data {spec}, row {i}", dict(r)) for i, r in enumerate(table)]


def read_records(spec, split="train"):
    """(where, object) per row of --data: 'hf:...' (hub_records) or a file (file_records)."""
    if spec.startswith("hf:"):
        records = hub_records(spec, split)
    elif not os.path.isfile(spec):
        raise UserError(f"data file {spec!r} " + (
            "is a directory (a save_to_disk folder or a folder of data files: --data hf:DIR)"
            if os.path.isdir(spec) else "not found"))
    else:
        records = file_records(spec)
    if not records:
        raise UserError(f"data {spec!r} is empty")
    return records


def read_rows(spec, need_answer=False, split="train", **fields):
    """Rows of --data (read_records; see make_row). Errors name the file, the row and the field."""
    return [make_row(obj, where, need_answer, **fields) for where, obj in read_records(spec, split)]


def load_data(spec, eval_size=TASK_EVAL_SIZE, need_answer=False, split="train",
              curriculum=(0.0, 0.0), skip=(0, 0.0), **fields):
    """'' -> the built-in task; 'chat-sums' -> chat_sums.py's; 'rg:...' -> reasoning-gym's (rg.py);
    a file or 'hf:...' -> its rows (read_rows). fields: make_row's prompt_field, answer_field and
    system_prompt. need_answer: every row must have an answer with a number (the math reward).
    curriculum (up, down) and skip (k, keep): see observe (off: up 0, k 0).
    Returns next_batch(rng, k) -> k training rows, eval_rows (held out), rows (all), observe(rows,
    rewards, parts, group_size) (observe on state) and state: what next_batch reads besides the
    rng (saved in checkpoints), so saving both resumes the data stream exactly."""
    data = load_rows(spec, eval_size, need_answer, split, curriculum[0] > 0, **fields)
    return scheduled(data, curriculum, skip)


def scheduled(data, curriculum=(0.0, 0.0), skip=(0, 0.0)):
    """data (next_batch, eval_rows, rows; rg's: and state) with observe and its state (see
    load_data), next_batch skipping settled prompts when skip[0] > 0."""
    data.state = getattr(data, "state", {})  # (rg's next_batch reads its levels there)
    data.state.update(up=curriculum[0], down=curriculum[1], skip=skip[0], keep=skip[1],
                      visits={}, recent={}, skipped=0)
    if skip[0]:
        data.next_batch = skipping(data.next_batch, data.state)
    data.observe = functools.partial(observe, data.state)  # the loop's call after scoring
    return data


def load_rows(spec, eval_size, need_answer, split, curriculum, **fields):
    """load_data's rows and next_batch (see there), before observe's state."""
    if spec.startswith(rg.PREFIX):
        return rg.load(spec, eval_size, curriculum, lambda x: make_row(x, "", **fields))
    if curriculum:
        raise UserError("--curriculum_up moves the difficulty of a reasoning-gym generator: "
                        "give --data rg:NAME (--skip_uniform works on any data)")
    if not spec:  # the built-in task: make_row changes its rows only when given fields
        def row(a, b):
            return make_row(addition_row(a, b), "", **fields) if any(fields.values()) else \
                addition_row(a, b)
        eval_rows = [row(a, b) for a, b in task_eval_pairs()][:eval_size]

        def next_task_batch(rng, k):
            return [row(a, b) for a, b in task_train_pairs(rng, k)]
        return SimpleNamespace(next_batch=next_task_batch, eval_rows=eval_rows, rows=eval_rows)
    if spec == chat_sums.NAME:  # the real-model task (chat_sums.py), held out by problem
        return chat_sums.load(eval_size, lambda x: make_row(chat_sums.row(*x), "", **fields))
    rows = read_rows(spec, need_answer, split, **fields)
    random.Random(0).shuffle(rows)  # a fixed split, the same for every run and seed
    n_eval = min(eval_size, len(rows) // 5)  # at most a fifth: four fifths stay for training
    if not n_eval:
        print(f"note: {spec} has {len(rows)} rows, too few to hold a fifth out: eval score is nan")
    elif n_eval < eval_size:
        print(f"note: {spec} has {len(rows)} rows: {n_eval} held out (a fifth at most), not "
              f"--eval_size {eval_size}; {len(rows) - n_eval} left to train on")
    eval_rows, train_rows = rows[:n_eval], rows[n_eval:]

    def next_file_batch(rng, k):
        return [rng.choice(train_rows) for _ in range(k)]
    return SimpleNamespace(next_batch=next_file_batch, eval_rows=eval_rows, rows=rows)


# ----------------------------------------------------- what the loop learns about its prompts
CURRICULUM_WINDOW = 64  # a generator's level moves on its training score over this many samples


def prompt_key(row):
    return json.dumps(row["prompt"], sort_keys=True)  # a chat prompt is a list: not hashable


def skipping(next_batch, state):
    """next_batch, drawing again in place of a prompt whose last k = state["skip"] visits each
    scored all alike and the same (all right, or all wrong: zero advantage, nothing learned), kept
    with chance state["keep"] (0: always skipped; 0.25: reweighted to a quarter). Polaris and
    Skywork-OR1 drop prompts a model always solves; DAPO's dynamic sampling, groups in a batch."""
    def next_batch_skipping(rng, k):
        out, tries = [], 0
        while len(out) < k:
            row, tries = next_batch(rng, 1)[0], tries + 1
            last = state["visits"].get(prompt_key(row), [])[-state["skip"]:]
            settled = len(last) == state["skip"] and last[0] is not None and len(set(last)) == 1
            if settled and tries <= 100 * k and rng.random() >= state["keep"]:
                state["skipped"] += 1  # (every prompt settled: after 100 k draws, taken anyway)
                continue
            out.append(row)
        return out
    return next_batch_skipping


def observe(state, rows, rewards, parts, group_size):
    """After a step is scored (rows, rewards (B,), the reward parts; groups of group_size
    contiguous rows): each prompt's visit is noted for skipping, each generator's training score
    (its rg score, else the reward) moves its curriculum level, one up when its mean over the last
    CURRICULUM_WINDOW samples is >= state["up"], one down when < state["down"]. Returns what to log:
    reward/rg/NAME (a mixture's tasks), curriculum/NAME (the level) and frac_skipped."""
    logs, score = {}, parts.get("rg", rewards).float().tolist()
    for name in state.get("tasks", ()):  # reasoning-gym's generators, in the --data order
        mine = [s for s, r in zip(score, rows) if r.get("rg_task") == name]
        logs[f"reward/rg/{name}"] = sum(mine) / len(mine) if mine else math.nan
        if name in state.get("level", {}):
            recent = state["recent"].setdefault(name, []) + mine
            level, move = state["level"][name], 0
            if len(recent) >= CURRICULUM_WINDOW:
                acc = sum(recent[-CURRICULUM_WINDOW:]) / CURRICULUM_WINDOW
                move = int(acc >= state["up"] and level < rg.max_level(name)) \
                    - int(acc < state["down"] and level > 0)
            state["level"][name] = level + move
            state["recent"][name] = [] if move else recent[-CURRICULUM_WINDOW:]  # a new level
            logs[f"curriculum/{name}"] = level + move  # starts its own count
    if state["skip"]:
        for i in range(0, len(rows), group_size):
            group = rewards[i:i + group_size].float()
            alike = float(group[0]) if bool((group == group[0]).all()) else None
            visits = state["visits"].setdefault(prompt_key(rows[i]), [])
            visits[:] = (visits + [alike])[-state["skip"]:]
        logs["frac_skipped"] = state["skipped"] / (state["skipped"] + len(rows) // group_size)
        state["skipped"] = 0
    return logs


def random_reward(completions, rows):
    """--rewards random: 1 or 0 by a fair coin, whatever the completion says: the control of
    "Spurious Rewards" (Shao et al. 2025), where it alone moved Qwen2.5-Math-7B on MATH. torch's
    RNG: seeded by --seed (each torchrun process its own) and saved in checkpoints, so a resumed
    run draws the same coins."""
    return (torch.rand(len(completions)) < 0.5).float()


REWARDS = {"rg": lambda completions, rows: torch.tensor(rg.reward(completions, rows)),
           "rg_strict": lambda completions, rows: torch.tensor(rg.reward(completions, rows, True)),
           "random": random_reward}  # --rewards names them beside math, format, length, rm


# preference data (reward_model.py, dpo.py), TRL's formats: pairs {"prompt", "chosen", "rejected"}
# (each completion text, or a list of one assistant message), the prompt implicit if chosen and
# rejected both start with it; or rankings {"prompt", "ranking": [best, ..., worst]}
def ranking_pairs(k):
    """All K(K-1)/2 (better, worse) index pairs of a ranking of k, best first."""
    return [(i, j) for i in range(k) for j in range(i + 1, k)]


def implicit_prompt(raw, where):
    """A pair without a prompt field (TRL's implicit prompt): chosen and rejected each hold the
    whole exchange, and the prompt is what they share at the start. Messages: their longest
    common run of first messages. Text: their longest common start, cut back to the last space
    before it (the completions keep that space, as in the text)."""
    chosen, rejected = raw.get("chosen"), raw.get("rejected")
    if chosen == rejected and chosen is not None:  # all of it would be the shared prompt
        raise UserError(f"{where}: fields 'chosen' and 'rejected' are identical: a pair needs "
                        "two different completions")
    prompt = ""
    if isinstance(chosen, list) and isinstance(rejected, list):
        chosen = check_messages(chosen, where, "chosen")
        rejected = check_messages(rejected, where, "rejected")
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        prompt = chosen[:n]
    elif isinstance(chosen, str) and isinstance(rejected, str):
        shared = re.match(r"(.*\S)\s", os.path.commonprefix([chosen, rejected]), re.S)
        prompt = shared.group(1) if shared else ""
    if not prompt:
        raise UserError(f"{where}: field 'prompt' is missing, and 'chosen' and 'rejected' do "
                        f"not start with a shared (implicit) prompt; {fields_found(raw)}")
    return {**raw, "prompt": prompt, "chosen": chosen[len(prompt):],
            "rejected": rejected[len(prompt):]}


def completion_text(c, where, field):
    """A preference's completion as text: a string, or a list of one assistant message."""
    if isinstance(c, list) and len(c) == 1:
        m = check_messages(c, where, field)[0]
        if m["role"] == "assistant" and not m.get("tool_calls"):
            return m["content"]
    if not isinstance(c, str):
        raise UserError(f"{where}: field {field!r} is missing or not a string or a list of one "
                        "assistant message (a row needs 'chosen' and 'rejected', or 'ranking')")
    return c


def read_preferences(spec, eval_size):
    """(train rows, held-out rows), each {"prompt", "completions", "pairs": [(chosen i, rejected
    j), ...], "margin"}, from pairs or rankings (read_records: any data file or hf:...); the prompt
    is text or chat messages (checked by make_row). Errors name the file, the row and the field."""
    rows = []
    for where, obj in read_records(spec):
        if isinstance(obj, dict) and not {"prompt", "question", "problem", "ranking"} & set(obj):
            obj = implicit_prompt(obj, where)
        row = make_row(obj, where)
        if "ranking" in row:
            done = row["ranking"]  # the completions, best first
            if not (isinstance(done, list) and len(done) >= 2):
                raise UserError(f"{where}: field 'ranking' must be a list of 2 or more strings")
            done = [completion_text(c, where, "ranking") for c in done]
        else:
            done = [completion_text(row.get(key), where, key) for key in ("chosen", "rejected")]
        if len(set(done)) < len(done):
            raise UserError(f"{where}: a completion is both chosen and rejected: {done}")
        margin = row.get("margin", 0.0)
        if type(margin) not in (int, float) or not math.isfinite(margin):  # (True: no)
            raise UserError(f"{where}: field 'margin' must be a finite number")
        rows.append({"prompt": row["prompt"], "completions": done, "margin": float(margin),
                     "pairs": ranking_pairs(len(done))})
    # held out: a fixed fifth of the distinct prompts (at most eval_size), all rows of a prompt
    key = [json.dumps(r["prompt"]) for r in rows]  # a chat prompt is a list: not hashable
    prompts = sorted(set(key))
    random.Random(0).shuffle(prompts)
    held = set(prompts[:min(eval_size, len(prompts) // 5)])
    return ([r for r, k in zip(rows, key) if k not in held],
            [r for r, k in zip(rows, key) if k in held])


# demonstrations (sft.py), TRL's formats: {"text"}, {"prompt", "completion"} (text or messages),
# {"messages"}; a row's "tools" (JSON schemas) go to the chat template
def demonstration(raw, where):
    """An SFT row as {"text"} (language modelling: every token trained), {"prompt", "completion"}
    (a text completion, trained) or {"messages", "start", "tools"} (a conversation whose
    assistant messages from index start on are trained: all of {"messages"}, the completion's of
    a conversational prompt-completion row). Errors name the row and the fields found."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: not a JSON object ({fields_found(raw)})")
    tools = raw.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise UserError(f"{where}: field 'tools' must be a list of JSON schemas")
    if "messages" in raw:
        m = check_messages(raw["messages"], where, "messages")
        if m[-1]["role"] != "assistant" or m[0]["role"] == "assistant":
            raise UserError(f"{where}: field 'messages' must be a conversation that ends with "
                            "an assistant message, after at least one other message")
        return {"messages": m, "start": 0, "tools": tools}
    if "text" in raw and "completion" not in raw:
        if not (isinstance(raw["text"], str) and raw["text"]):
            raise UserError(f"{where}: field 'text' must be a non-empty string")
        return {"text": raw["text"]}
    if "prompt" not in raw:
        raise UserError(f"{where}: not an SFT row: give 'prompt' and 'completion', 'messages' "
                        f"or 'text'; {fields_found(raw)}")
    prompt, completion = make_row(raw, where)["prompt"], raw.get("completion")
    if isinstance(completion, list):
        completion = check_messages(completion, where, "completion")
        if completion[-1]["role"] == "assistant":
            return {"messages": C.as_messages(prompt) + completion,
                    "start": len(C.as_messages(prompt)), "tools": tools}
    if not (isinstance(completion, str) and completion):
        raise UserError(f"{where}: field 'completion' is missing or not a non-empty string "
                        "(or messages that end with an assistant message)")
    return {"prompt": prompt, "completion": completion}


def template_turns(tok, messages, k, tools, where):
    """A conversation through the chat template, token in / token out: the prompt's text
    (messages[:k] and the generation prompt, as encode_prompts renders it) and (text, trained)
    pieces after it, cut where the template's renderings of the conversation up to each
    assistant message end: its header is context; its text, tool calls and end tag are trained
    (what the model writes); the whitespace after the end tag is context."""
    def render(n, generation_prompt):
        return tok.apply_chat_template(messages[:n], tools=tools, tokenize=False,
                                       add_generation_prompt=generation_prompt)
    prompt = render(k, True)
    cuts = [(render(i + t, not t), t, i) for i in range(k, len(messages))
            if messages[i]["role"] == "assistant" for t in (0, 1)]
    whole, start, pieces = cuts[-1][0], len(prompt), []
    for text, train, i in [(prompt, 0, k)] + cuts:
        if not whole.startswith(text):  # (a template that rewrites earlier turns: a thinking
            last = cuts[-1][2]  # model's drops their reasoning) the last assistant message
            fix = "train with --last_turn_only" if k < last and whole.startswith(
                render(last, True)) else ("give the tokenizer a chat template that keeps each "
                "turn as written (a training template, as TRL's trl/chat_templates/"
                "*_training.jinja), or --chat_template none")
            raise UserError(f"{where}: the chat template does not render the conversation up "
                            f"to each assistant message as the start of the whole: {fix}")
        end = max(start, len(text.rstrip()) if train else len(text))
        pieces.append((whole[start:end], train))
        start = end
        names = [f.get("name") for c in messages[i].get("tool_calls") or []
                 for f in [c.get("function", c)] if isinstance(f, dict)]
        if train and not all(str(name) in pieces[-1][0] for name in names):
            raise UserError(f"{where}: message {i}: the chat template does not render its "
                            "tool_calls")
    if tok.eos_token and whole[:start].endswith(tok.eos_token):  # the end tag is the EOS: it
        pieces[-1] = (pieces[-1][0][:-len(tok.eos_token)], 1)  # is the EOS token appended
    return prompt, pieces


def encode_demonstration(tok, demo, chat_template="auto", last_turn_only=False, where=""):
    """(prompt ids, completion ids, loss mask) of an SFT row (demonstration()), the mask 1 on the
    completion tokens the model learns to write, EOS included. A text: the prompt as the RL
    scripts encode it (encode_prompts), then the completion and EOS. A conversation: the prompt
    is the messages before its first trained assistant message (its last with last_turn_only);
    after it, each assistant message's tokens are trained, the other messages' are not. With a
    chat template the pieces are the template's (template_turns); without one, the messages'
    contents one after another with nothing between, each tokenized alone, then EOS: the
    transcript the multi-turn rollout builds (engine.sample)."""
    if "text" in demo:  # every token but the first, which nothing before it predicts
        ids = tok(demo["text"])["input_ids"] + [tok.eos_token_id]
        return ids[:1], ids[1:], [1] * (len(ids) - 1)
    if "completion" in demo:
        prompt, pieces = C.encode_prompts(tok, [demo["prompt"]], chat_template)[0], [
            (demo["completion"], 1)]
    else:
        m = demo["messages"]
        turns = [i for i, x in enumerate(m) if x["role"] == "assistant" and i >= demo["start"]]
        k = turns[-1] if last_turn_only else turns[0]
        if chat_template != "none" and tok.chat_template:
            text, pieces = template_turns(tok, m, k, demo.get("tools"), where)
            prompt = tok(text, add_special_tokens=False)["input_ids"]
        else:
            if any(x.get("tool_calls") for x in m[k:]):
                raise UserError(f"{where}: a message has tool_calls, which only a chat "
                                "template renders (this tokenizer has none)")
            prompt = C.encode_prompts(tok, [m[:k]], "none")[0]
            pieces = [(x["content"], int(x["role"] == "assistant")) for x in m[k:]]
    ids, mask = [], []
    for text, train in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids, mask = ids + piece, mask + [train] * len(piece)
    return prompt, ids + [tok.eos_token_id], mask + [1]


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
    """Rows of (prompt ids, completion ids[, loss mask]) as a rollout: prompts left-padded to P
    columns, completions right-padded to T; completion_mask (B, T) is the loss mask (without one,
    1 on each completion token, EOS included), attention_mask 1 on every real token: both built
    from lengths."""
    prompt, prompt_mask = C.left_pad([e[0] for e in examples], pad_id, device)
    T = max(len(e[1]) for e in examples)
    completion = torch.tensor([e[1] + [pad_id] * (T - len(e[1])) for e in examples], device=device)
    real = torch.tensor([[1] * len(e[1]) + [0] * (T - len(e[1])) for e in examples], device=device)
    loss = torch.tensor([(e[2] if len(e) > 2 else [1] * len(e[1])) + [0] * (T - len(e[1]))
                         for e in examples], device=device)
    return SimpleNamespace(ids=torch.cat([prompt, completion], 1), P=prompt.shape[1],
                           attention_mask=torch.cat([prompt_mask, real], 1),
                           completion_mask=loss.float())


def eval_metric(rows, choice="auto"):
    """What the held-out score is: 'accuracy' (math_reward, 0-1), 'rg score' (reasoning-gym's own
    score_answer, 0-1) or 'mean reward' (the run's --rewards). auto: rg score on reasoning-gym's
    rows, accuracy when every row has an answer with a number, else mean reward."""
    numeric = C.has_numbers(rows)
    if choice == "math" and not numeric:
        raise UserError("--eval_reward math: some held-out rows have no answer with a number, so "
                        "the score would be 0 whatever the model says; use --eval_reward rewards")
    if choice == "auto" and rows and all("rg_task" in r for r in rows):
        return "rg score"
    return "accuracy" if choice == "math" or (choice == "auto" and numeric) else "mean reward"


def scored_by(metric, weights, fns):
    """The reward weights a held-out answer is scored with, for eval_metric's metric (rg score:
    reasoning-gym's scorer joins fns, the functions by name, whatever --rewards trains on)."""
    fns.setdefault("rg", REWARDS["rg"])
    return {"accuracy": {"math": 1.0}, "rg score": {"rg": 1.0}}.get(metric, weights)
