"""envs.py: environments for multi-turn (tool-use) episodes, --tools, and the calculator task.

An environment answers the model after each turn. It is a plain function env(row, turns) ->
str | None, called with its own copy of the data row and the model's turns so far (decoded
texts); or a class, built once per episode as Class(row), whose step(turns) answers. The answer
is the observation (a tool's output, as text, which is tokenized as text: never a special
token), or token ids (chat_observation: a chat template's own markers), or None to end the
episode. common.sample feeds the observation through the same KV cache and the model goes on.
Pick one with --env FILE.py:NAME (or package.module:name), or --env calc for the calculator below;
or give --tools FILE.py:NAME,... : plain Python functions that the model's chat template shows it,
whose calls are parsed in the model's own format (ToolEpisode). docs/tool_use.md has the details.

The calculator task (--env calc): sums of 3- and 4-digit numbers, which the bundled 1 M-parameter
model cannot do in its head. A turn that ends in <calc>1234+5678</calc> gets the observation
" 6912 "; the model's next turn is its answer, and the reward reads only that final turn (text
after the last observation), so copying the observation is the skill, not a free reward.
The policy, models/tiny-calc, is tiny-adder warm-started by sft.py on demonstrations of which 30%
call the tool (tools/build_models.py), so RL has a habit to strengthen.
"""
import concurrent.futures
import copy
import functools
import inspect
import json
import os
import queue
import random
import re
import threading

import torch
from transformers.utils import get_json_schema

import common as C
from errors import first_line
import loading
import tasks

CALC_MODEL = os.path.join(loading.ROOT, "models", "tiny-calc")  # built by tools/build_models.py
CALC_SHAPES = ((3, 3), (3, 4), (4, 3), (4, 4))  # (digits of a, digits of b) of the task's sums
CALC_EVAL_SEED = 2828
CALC_EVAL_SIZE = 500
# --env calc changes these defaults (explicit flags still win): the model, a budget that fits one
# call (a 4-digit call, its observation and the answer are 35 tokens), the call's closing tag ends
# a turn, the held-out score is sampled (docs/tool_use.md), and a short run (GRPO's held-out
# score is flat after about 40 steps)
CALC_DEFAULTS = {"model": CALC_MODEL, "max_new_tokens": 48, "stop": ["</calc>"],
                 "eval_samples": 4, "eval_sampled": True, "max_steps": 60, "eval_every": 20}
CALC_PPO = {"rewards": "math", "critic_init": "policy"}  # ppo.py's default score is an RM's


def preset(env, algo):
    """The flags' defaults for --env (only calc has its own) in algo's script."""
    if env != "calc":
        return {}
    return {**CALC_DEFAULTS, **(CALC_PPO if algo == "ppo" else {})}


# --------------------------------------------------------------------------- the calculator
def calc_pair(rng, shape):
    da, db = shape
    return rng.randrange(10**(da - 1), 10**da), rng.randrange(10**(db - 1), 10**db)


def calc_eval_pairs():
    """The fixed held-out sums (shapes in turn): no warm start and no RL run trains on them."""
    rng = random.Random(CALC_EVAL_SEED)
    return [calc_pair(rng, CALC_SHAPES[i % len(CALC_SHAPES)]) for i in range(CALC_EVAL_SIZE)]


@functools.lru_cache(maxsize=1)
def calc_held():
    return frozenset(calc_eval_pairs())


def calc_train_pairs(rng, k, shapes=CALC_SHAPES):
    """k fresh sums of random shapes, none of them held out."""
    held = calc_held()
    out = []
    while len(out) < k:
        pair = calc_pair(rng, rng.choice(shapes))
        if pair not in held:
            out.append(pair)
    return out


def calc_demo(a, b, rng, column_sum, tool=0.3, drop=0.8):
    """A warm-start demonstration for a + b: with probability `tool` the tool transcript
    '<calc>a+b</calc> S S' (the observation ' S ' then the answer; sft.py adds the EOS), else a
    direct answer: right for 2-digit sums, column addition forgetting each carry with
    probability `drop` for longer ones (column_sum: tools/build_models.py)."""
    if rng.random() < tool:
        return f"<calc>{a}+{b}</calc> {a + b} {a + b}"
    return str(column_sum(a, b, rng, 0.0 if max(a, b) < 100 else drop))


def calc_demo_pairs(rng, k):
    """The warm start's prompts: 25% 2-digit (the bundled task's), 25% 3+3, 35% 4+4, 15% 3+4 or
    4+3 digits, none of them held out."""
    out = []
    for _ in range(k):
        u = rng.random()
        if u < 0.25:
            out += tasks.task_train_pairs(rng, 1)
        else:
            shape = (3, 3) if u < 0.5 else (4, 4) if u < 0.85 else rng.choice([(3, 4), (4, 3)])
            out += calc_train_pairs(rng, 1, [shape])
    return out


CALL = re.compile(r"<calc>(.*)</calc>\s*$", re.S)  # a turn that ends with a call
EXPR = re.compile(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*")


def calc(row, turns):
    """The calculator: when the model's last turn ends with <calc>a+b</calc> (or a-b, a*b), the
    observation is the result with a space on each side, the layout of the warm-start
    demonstrations; a call it cannot read gets ' error '. A turn without a call ends the
    episode (it was the answer)."""
    call = CALL.search(turns[-1])
    if call is None:
        return None
    m = EXPR.fullmatch(call.group(1).split("<calc>")[-1])
    if m is None or max(len(m.group(1)), len(m.group(3))) > 12:
        return " error "
    a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
    return f" {a + b if op == '+' else a - b if op == '-' else a * b} "


def calc_data(eval_size=CALC_EVAL_SIZE):
    """The calculator task's rows, as tasks.load_data returns them: next_batch(rng, k) gives k
    fresh training sums, eval_rows the held-out ones."""
    eval_rows = [tasks.addition_row(a, b) for a, b in calc_eval_pairs()][:eval_size]

    def next_batch(rng, k):
        return [tasks.addition_row(a, b) for a, b in calc_train_pairs(rng, k)]
    return C.SimpleNamespace(next_batch=next_batch, eval_rows=eval_rows, rows=eval_rows)


# ------------------------------------------------------------------ --env: loading, checking
ENV_TIMEOUT_S = 10.0  # --env_timeout's default: a call slower than this stops the run


def call_all(calls, limit):
    """Run calls (functions of no argument) at the same time, each in a thread of its own, and
    return their results in order; what a call raises, SystemExit and KeyboardInterrupt too, is
    raised here. A call still running after `limit` seconds raises TimeoutError(its index).
    Threads, not processes: an episode's state (its row, an env object) stays in this process from
    call to call, with nothing to pickle; a call that never returns cannot be killed, but it runs
    in a daemon thread, which ends with the run. (A tool running native code that never releases
    Python's lock would block this too: run such code in a subprocess with its own timeout.) The
    threads wait for the next calls rather than end: starting one costs more than a quick env."""
    with _POOL["lock"]:
        for _ in range(len(calls) - _POOL["free"]):  # a thread for each call that has none free
            threading.Thread(target=_worker, daemon=True).start()
            _POOL["free"] += 1
        _POOL["free"] -= len(calls)  # these calls take them
    futures = [concurrent.futures.Future() for _ in calls]
    for call, future in zip(calls, futures):
        _POOL["jobs"].put((call, future))
    _, late = concurrent.futures.wait(futures, timeout=limit)
    if late:
        raise TimeoutError(min(futures.index(f) for f in late))
    return [f.result() for f in futures]


_POOL = {"jobs": queue.SimpleQueue(), "free": 0, "lock": threading.Lock()}  # call_all's threads


def _worker():
    while True:
        call, future = _POOL["jobs"].get()
        try:
            future.set_result(call())
        except BaseException as e:  # noqa: B036 -- SystemExit too: shown as one line, exit 2
            future.set_exception(e)
        with _POOL["lock"]:
            _POOL["free"] += 1


def load_env(spec, tools="", timeout=ENV_TIMEOUT_S):
    """--env (calc, FILE.py:FUNCTION, FILE.py:Class or module:name) or --tools -> the run's
    environment, or None: a namespace with start(rows, tok, max_turns) -> (env_step, finish) for
    common.sample and common.generate, and tools, the JSON schemas that the prompts' chat
    template renders (--tools; else None). Each row gets its own episode, built from its own
    copy of the row: a function env(row, turns) -> str | None is called with that copy; a class
    is built as Class(row) and its step(turns) called. Every error is one line naming the env
    and the row: a raise (even SystemExit), a result that is not a string, token ids or None,
    or a call slower than `timeout` seconds (--env_timeout)."""
    if spec and tools:
        raise C.UserError("give --env or --tools, not both: --tools is an env of its own")
    if tools:
        functions, schemas = load_tools(tools)
        checked = []  # the tokenizers whose chat template check_tool_format passed

        def check(tok):  # once per tokenizer (loading.load_policy's, before the weights load)
            if not any(t is tok for t in checked):
                check_tool_format(tok, schemas)
                checked.append(tok)

        def start(rows, tok, max_turns):
            check(tok)
            return start_episodes(rows, lambda row: ToolEpisode(row, tok, functions, schemas),
                                  f"--tools {tools!r}", timeout, tok, max_turns)
        return C.SimpleNamespace(tools=schemas, start=start, check=check)
    if not spec:
        return None
    fn = calc if spec == "calc" else loading.load_function(
        "--env", spec, "write calc, path/to/file.py:function (or :Class) or module:function")
    make = fn if inspect.isclass(fn) else lambda row: functools.partial(fn, row)
    return C.SimpleNamespace(tools=None, check=lambda tok: None,
                             start=lambda rows, tok, max_turns: start_episodes(
                                 rows, make, f"--env {spec!r}", timeout, tok, max_turns))


def start_episodes(rows, make, who, timeout, tok, max_turns=1):
    """One episode per row, each made (on its first call) from a deep copy of its row and keeping
    its own turns and observations. Returns env_step(requests) for common.sample: [(row index, the
    turn's token ids, budget left, the EOS the turn ended on)] -> each row's observation ids
    (observation_ids: cut to the budget) or None, the rows' calls run at the same time
    (call_all), and None after a row's max_turns-th turn (no call); and finish(roll), which puts
    on the rollout what the episodes saw. who: the env, as errors name it ("--env 'calc'")."""
    copies = [copy.deepcopy(r) for r in rows]
    episodes = [None] * len(rows)  # made on the first call: a function env's row, or an object
    # each row's turns (texts), observations (as the model reads them), whether one was cut by the
    # budget, and the column where its next turn begins
    seen = [C.SimpleNamespace(turns=[], observations=[], cut=False, begun=0) for _ in rows]

    def where(i, turns):  # the row an error names
        return f"on the row with prompt {str(copies[i].get('prompt'))[:60]!r}, turn {len(turns)}"

    def call(i, turns):
        try:
            if episodes[i] is None:
                episodes[i] = make(copies[i])
            step = getattr(episodes[i], "step", episodes[i])  # a class env: its step()
            out = step(turns)
        except C.UserError:
            raise
        except BaseException as e:  # noqa: B036 -- a SystemExit in an env must not end the run 0
            raise C.UserError(f"{who} raised {type(e).__name__}: {first_line(e)} "
                              f"({where(i, turns)})") from None
        ids = isinstance(out, list) and all(type(x) is int for x in out)
        if out is not None and not isinstance(out, str) and not ids:
            raise C.UserError(f"{who} returned {type(out).__name__} {out!r:.40} "
                              f"({where(i, turns)}): return the observation text, or None to end")
        return out

    def env_step(requests):  # [(row, turn ids, budget left, EOS it ended on)] -> observations
        for i, ids, _, _ in requests:
            seen[i].turns.append(tok.decode(ids, skip_special_tokens=True))
            seen[i].begun += len(ids)
        asking = [i for i, _, _, _ in requests if len(seen[i].turns) < max_turns]  # not the last
        try:
            outs = call_all([functools.partial(call, i, list(seen[i].turns)) for i in asking],
                            timeout)
        except TimeoutError as e:
            i = asking[e.args[0]]
            raise C.UserError(f"{who} took more than {timeout:g} s "
                              f"{where(i, seen[i].turns)} (--env_timeout)") from None
        outs = dict(zip(asking, outs))  # None: the episode ended (the env's None, or max_turns)
        answers = []
        for i, _, left, end in requests:
            out = outs.get(i)
            ids, cut = (None, False) if out is None else observation_ids(tok, out, left, end)
            if ids is not None:
                seen[i].observations.append(tok.decode(ids))
                seen[i].cut |= cut
                seen[i].begun += len(ids)
            answers.append(ids)
        return answers

    def finish(roll):
        """The turn a row was in when the budget ran out, then the episodes' fields on roll."""
        lengths = roll.attention_mask[:, roll.P:].sum(-1).tolist()
        for s, n, ids in zip(seen, lengths, roll.ids[:, roll.P:]):
            if s.begun < n:
                s.turns.append(tok.decode(ids[s.begun:n], skip_special_tokens=True))
        roll.turns = torch.tensor([len(s.turns) for s in seen])  # model turns per row
        roll.tool_calls = torch.tensor([len(s.observations) for s in seen])  # observations
        roll.obs_truncated = torch.tensor([s.cut for s in seen])  # one was cut by the budget
        roll.observations = [s.observations for s in seen]
        # what rewards read: the text after the last observation ('' if the budget ended in it)
        roll.final = [s.turns[-1] if len(s.turns) > len(s.observations) else "" for s in seen]
        roll.transcript = ["".join(x + (f"⟦{s.observations[k]}⟧" if k < len(s.observations)
                                        else "") for k, x in enumerate(s.turns))
                           for s in seen]  # observations in ⟦...⟧
        roll.episodes = episodes  # each episode's state (--tools: its calls, runs.tool_metrics)
    return env_step, finish


def text_ids(tok, text):
    """A tool's text as data: token ids, invalid unicode replaced, never read as special tokens
    ('<eos>' in a tool's output is five characters, not the EOS)."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def observation_ids(tok, obs, left, end=None):
    """An observation as the token ids fed to the model, cut to the `left` of the budget, and
    whether it was cut. Text (text_ids) is cut before it is tokenized (a token spans few
    characters). Token ids (chat_observation's: the chat template's own markers) are fed as they
    are; when the turn ended on the model's own EOS `end` and the ids begin with it (the
    template's end-of-turn tag), the model's token stands for the template's."""
    if isinstance(obs, str):
        ids = text_ids(tok, obs[:32 * left + 32])
        return ids[:left], len(ids) > left or 32 * left + 32 < len(obs)
    ids = obs[1:] if end is not None and obs[:1] == [end] else obs
    return ids[:left], len(ids) > left


def task_data(args, data):
    """--env calc without --data: the calculator's sums, else the data as loaded."""
    return calc_data(args.eval_size) if args.env == "calc" and not args.data else data


def from_args(args):
    """The run's environment (None without --env or --tools), after checking the tool-use flags
    (--max_turns has its range beside its Args field, checked with the others)."""
    if args.eval_sampled and args.eval_samples < 1:
        raise C.UserError("--eval_sampled scores mean@k of --eval_samples k samples: give "
                          "--eval_samples k (k >= 1)")
    return load_env(args.env, args.tools, args.env_timeout)


# ------------------------------------------------------------------------ chat models' format
RESULT = "minrl0tool0result{}"  # where each tool result goes in the template's rendering


def chat_observation(tok, messages, turn, results, tools=None):
    """Tool results in a chat model's own format, as token ids: the chat template rendered for the
    conversation with the model's turn and one tool message per result, minus its rendering up
    to the end of the turn. That difference (the turn's end tag, the tool messages, the next
    assistant header) is the observation: the template's markers are its own tokens, special
    ones included, and each result is tokenized as text (text_ids: never a special token).
    messages: the conversation before this turn (the prompt, earlier turns and tool messages);
    tools: the schemas the prompt was rendered with. A turn that ended on the model's
    own end-of-turn token keeps it, and observation_ids drops the template's copy of it."""
    results = [results] if isinstance(results, str) else list(results)

    def render(conversation):
        return tok.apply_chat_template(conversation, tools=tools, tokenize=False,
                                       add_generation_prompt=True)
    head = render(messages) + turn
    whole = render(messages + [{"role": "assistant", "content": turn}]
                   + [{"role": "tool", "content": RESULT.format(k)} for k in range(len(results))])
    if not whole.startswith(head):
        raise C.UserError("the chat template does not render the conversation as a prefix of "
                          "itself plus a tool message: build the observation by hand")
    rest, ids = whole[len(head):], []
    for k, result in enumerate(results):
        markup, found, rest = rest.partition(RESULT.format(k))
        if not found:
            raise C.UserError("the chat template does not show a tool message's content as it "
                              "is: build the observation by hand")
        ids += tok(markup, add_special_tokens=False)["input_ids"]
        ids += text_ids(tok, result)
    return ids + tok(rest, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------- --tools
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)  # Hermes, Qwen2.5 / Qwen3


def load_tools(spec):
    """--tools FILE.py:NAME[,NAME...] (or module:name,...) -> ({name: function}, JSON schemas).
    Each tool is a plain function with type hints and a Google-style docstring (Args: ...), from
    which transformers' get_json_schema writes the schema the chat template shows the model."""
    where, _, names = spec.rpartition(":")
    functions, schemas = {}, []
    for name in names.split(","):
        fn = loading.load_function("--tools", f"{where}:{name.strip()}",
                                   "write path/to/file.py:name[,name...] or module:name[,name]")
        try:
            schemas.append(get_json_schema(fn))
        except Exception as e:  # no type hints, no docstring, an argument it does not describe
            raise C.UserError(f"--tools: {name.strip()!r} has no schema: {first_line(e)} "
                              "(give every argument a type hint and a line under Args:)") from None
        functions[schemas[-1]["function"]["name"]] = fn
    return functions, schemas


def check_tool_format(tok, schemas):
    """--tools needs a chat template that renders the tools, and calls in a format read here:
    the tokenizer's response parser (transformers' response_template), or Hermes / Qwen JSON
    in <tool_call>...</tool_call>. Anything else is refused in one line."""
    chat = [{"role": "user", "content": "hi"}]
    template = tok.chat_template if isinstance(tok.chat_template, str) else str(tok.chat_template)
    if not tok.chat_template or (tok.apply_chat_template(chat, tools=schemas, tokenize=False)
                                 == tok.apply_chat_template(chat, tokenize=False)):
        raise C.UserError("--tools needs a model whose chat template renders tools (e.g. Qwen2.5 "
                          "or Qwen3 instruct); this one shows the model no tools")
    if not getattr(tok, "response_template", None) and "<tool_call>" not in template:
        raise C.UserError("--tools reads calls through the tokenizer's response parser, or as "
                          "Hermes / Qwen <tool_call>{json}</tool_call>; this chat template uses "
                          "neither: write an --env that parses its calls")


def parse_calls(tok, text, schemas):
    """The tool calls in a model turn, in the model's own format: [(name, arguments)], or
    (None, why) for a call that cannot be read."""
    if getattr(tok, "response_template", None):  # the tokenizer's own parser (transformers)
        try:
            message = tok.parse_response(text, tools=schemas)
        except Exception as e:
            return [(None, f"the call could not be parsed: {first_line(e)}")]
        found = [c.get("function", c) for c in message.get("tool_calls") or []]
        return [(c.get("name"), c.get("arguments", {})) for c in found]
    calls = []
    for body in TOOL_CALL.findall(text):
        try:
            call = json.loads(body)
            calls.append((call["name"], call.get("arguments", {})))
        except (ValueError, KeyError, TypeError):
            calls.append((None, f"the call is not JSON with a name and arguments: {body[:80]}"))
    return calls


def run_tool(functions, name, arguments):
    """One call's result as text; a bad call or a raising tool becomes 'error: ...' (the model
    sees it: a mistake to learn from, never a crash of the run)."""
    if name is None:
        return f"error: {arguments}"
    if name not in functions:
        return f"error: no tool {name!r}; the tools are {', '.join(functions)}"
    if not isinstance(arguments, dict):
        return f"error: the arguments of {name!r} must be a JSON object"
    try:
        result = functions[name](**arguments)
    except Exception as e:
        return f"error: {type(e).__name__}: {first_line(e)}"
    return result if isinstance(result, str) else json.dumps(result, default=str)


class ToolEpisode:
    """One episode of --tools: its conversation so far, as chat messages, and its calls. After
    each model turn, step() runs the turn's calls and returns their results in the chat template's
    format (chat_observation), or None when the turn made no call: it was the answer."""

    def __init__(self, row, tok, functions, schemas):
        self.tok, self.functions, self.schemas = tok, functions, schemas
        self.messages = C.as_messages(row["prompt"])  # the prompt, then turns and results
        self.calls = []  # (tool name, succeeded) of every call: runs.tool_metrics

    def step(self, turns):
        calls = parse_calls(self.tok, turns[-1], self.schemas)
        if not calls:
            return None
        results = [run_tool(self.functions, name, arguments) for name, arguments in calls]
        self.calls += [(name, not r.startswith("error:")) for (name, _), r in zip(calls, results)]
        obs = chat_observation(self.tok, self.messages, turns[-1], results, self.schemas)
        self.messages = self.messages + [{"role": "assistant", "content": turns[-1]}] + [
            {"role": "tool", "name": name, "content": r} for (name, _), r in zip(calls, results)]
        return obs


# -------------------------------------------------------------- the calculator's tool-use report
CALC_REPORT_SHAPES = ((2, 2), (3, 3), (4, 4))


def calc_report(model, tok, n=200, k=1, seed=0):
    """Per sum shape (2+2, 3+3, 4+4 digits), sampled at T = 1 (k per prompt) and greedy: how often
    the model calls the tool, how often it is right when it calls and when it does not, overall,
    and how often a call's observation is the last thing in the transcript (nothing after it).
    Held-out pairs for 3-4 digits; 2-digit ones from the bundled task's held-out split. As
    --env calc samples: 48 new tokens, 3 turns."""
    out, rng = {}, random.Random(seed)
    for shape in CALC_REPORT_SHAPES:
        pairs = tasks.task_eval_pairs()[:n] if shape == (2, 2) else [
            p for p in calc_eval_pairs() if (len(str(p[0])), len(str(p[1]))) == shape][:n]
        pairs = [(a, b) for a, b in pairs if min(a, b) >= 10] if shape == (2, 2) else pairs
        rows = [tasks.addition_row(a, b) for a, b in pairs for _ in range(k)]
        for mode in ("T=1", "greedy"):
            torch.manual_seed(rng.randrange(2**31))
            prompt_ids = C.encode_prompts(tok, [r["prompt"] for r in rows], "none")
            env_step, finish = load_env("calc").start(rows, tok, max_turns=3)  # call, answer, spare
            roll = C.sample(model, tok, prompt_ids, CALC_DEFAULTS["max_new_tokens"],
                            greedy=mode == "greedy", stop=CALC_DEFAULTS["stop"], env_step=env_step)
            finish(roll)  # roll.final: the text after the last observation
            right = torch.tensor([C.math_reward(c, r) for c, r in zip(roll.final, rows)])
            called = roll.tool_calls > 0
            out[f"{shape[0]}+{shape[1]} {mode}"] = {
                "calls": float(called.float().mean()),
                "right when calling": float(right[called].mean()) if called.any() else None,
                "right when not": float(right[~called].mean()) if (~called).any() else None,
                "overall": float(right.mean()),
                "says nothing after": float(torch.tensor([  # the observation, of those calling
                    f.strip() == "" for f, c in zip(roll.final, called) if c]).float().mean())
                if called.any() else None}
    return out


def main():
    """python envs.py MODEL [K]: the calculator report (calc_report) of a model or checkpoint."""
    import sys
    k = sys.argv[2] if len(sys.argv) == 3 else "1"
    if len(sys.argv) not in (2, 3) or not (k.isdigit() and 1 <= int(k) <= 1000):
        print("error: usage: python envs.py MODEL [K]: a model or checkpoint folder, or a hub id; "
              "K: 1 to 1000 samples per prompt", file=sys.stderr)
        sys.exit(2)
    try:
        model = loading.load_model(sys.argv[1], "lm", torch.device("cpu"), frozen=True)
        tok = loading.load_tokenizer(sys.argv[1])
    except C.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    torch.set_num_threads(1)
    rep = calc_report(model, tok, k=int(k))
    cols = ["calls", "right when calling", "right when not", "overall", "says nothing after"]
    print(f"{'':12}" + "".join(f"{c:>19}" for c in cols))
    for name, r in rep.items():
        print(f"{name:12}" + "".join(f"{'-' if r[c] is None else f'{r[c]:.3f}':>19}"
                                     for c in cols))


if __name__ == "__main__":
    main()
