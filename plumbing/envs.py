"""envs.py: environments for multi-turn (tool-use) episodes, and --tools (plumbing: skip it).

An environment answers the model after each turn. It is a plain function env(row, turns) ->
str | None, called with its own copy of the data row and the model's turns so far (decoded
texts); or a class, built once per episode as Class(row), whose step(turns) answers. The answer
is the observation (a tool's output, as text, which is tokenized as text: never a special
token), or token ids (chat_observation: a chat template's own markers), or None to end the
episode. engine.sample feeds the observation through the same KV cache and the model goes on.
Pick one with --env FILE.py:NAME (or package.module:name), or --env calc (the calculator, calc.py);
or give --tools FILE.py:NAME,... : plain Python functions that the model's chat template shows it,
whose calls are parsed in the model's own format (ToolEpisode). docs/tool_use.md has the details.
"""
import concurrent.futures
import contextlib
import copy
import functools
import inspect
import json
import queue
import random
import re
import sys
import threading
import time

import torch
from transformers.utils import get_json_schema

import common as C
from plumbing.errors import UserError, first_line
import engine
from plumbing import loading
from plumbing import calc

# ------------------------------------------------------------------ --env: loading, checking
ENV_TIMEOUT_S = 10.0  # --env_timeout's default: a call slower than this stops the run


def submit(call):
    """Start call() (a function of no argument) in a thread of the pool and return its Future,
    which holds its result or what it raised (SystemExit and KeyboardInterrupt too).
    Threads, not processes: an episode's state (its row, an env object) stays in this process from
    call to call, with nothing to pickle; a call that never returns cannot be killed, but it runs
    in a daemon thread, which ends with the run. (A tool running native code that never releases
    Python's lock would block this too: run such code in a subprocess, as python_tool.py does.)
    The threads wait for the next calls rather than end: starting one costs more than a quick
    env."""
    with _POOL["lock"]:
        if _POOL["free"] == 0:  # no thread free: one more
            threading.Thread(target=_worker, daemon=True).start()
            _POOL["free"] += 1
        _POOL["free"] -= 1  # this call takes one
    future = concurrent.futures.Future()
    _POOL["jobs"].put((call, future))
    return future


_POOL = {"jobs": queue.SimpleQueue(), "free": 0, "lock": threading.Lock()}  # submit's threads
_CLOCK = threading.local()  # .started: [when] of the env call this thread runs (None: paused)


def restart_clock():
    """The env call this thread runs starts its --env_timeout again (--tools: at each tool call,
    so a turn of three 5 s calls is not one 15 s call)."""
    started = getattr(_CLOCK, "started", None)
    if started is not None:
        started[0] = time.monotonic()


@contextlib.contextmanager
def paused():
    """Time spent inside does not count against --env_timeout: a tool waiting for a slot of a
    shared resource (examples/python_tool.py waits for one of its sandboxes)."""
    started = getattr(_CLOCK, "started", None)
    if started is not None:
        started[0] = None
    try:
        yield
    finally:
        restart_clock()


def _worker():
    while True:
        job = _POOL["jobs"].get()
        call, future = job
        try:
            future.set_result(call())
        except BaseException as e:  # noqa: B036 -- SystemExit too: shown as one line, exit 2
            future.set_exception(e)
        # the call (its episode, through the closure) goes now, not when the next job comes
        del job, call, future
        with _POOL["lock"]:
            _POOL["free"] += 1


def load_env(spec, tools="", timeout=ENV_TIMEOUT_S, budget=None):
    """--env (calc, FILE.py:FUNCTION, FILE.py:Class or module:name) or --tools -> the run's
    environment, or None: a namespace with start(rows, tok, max_turns) -> (env_step, finish) for
    engine.sample, generate (engine.generate, which common.generate calls), and tools, the JSON
    schemas that the prompts' chat template renders (--tools; else None). Each row gets its own
    episode, built from its own copy of the row: a function env(row, turns) -> str | None is
    called with that copy; a class is built as Class(row) and its step(turns) called. Every error
    is one line naming the env and the row: a raise (even SystemExit), a result that is not a
    string, token ids or None, or a call slower than `timeout` seconds (--env_timeout). budget
    (--max_new_tokens): --tools cuts each result to it as text, before it is rendered or
    tokenized."""
    if spec and tools:
        raise UserError("give --env or --tools, not both: --tools is an env of its own")
    if tools:
        functions, schemas = load_tools(tools)
        checked = []  # the tokenizers whose chat template check_tool_format passed

        def check(tok):  # once per tokenizer (loading.load_policy's, before the weights load)
            if not any(t is tok for t in checked):
                check_tool_format(tok, schemas)
                checked.append(tok)

        def start(rows, tok, max_turns):
            check(tok)
            return start_episodes(
                rows, lambda row: ToolEpisode(row, tok, functions, schemas, budget),
                f"--tools {tools!r}", timeout, tok, max_turns)
        return with_engine(C.SimpleNamespace(tools=schemas, start=start, check=check))
    if not spec:
        return None
    fn = calc.calc if spec == "calc" else loading.load_function(
        "--env", spec, "write calc, path/to/file.py:function (or :Class) or module:function")
    make = fn if inspect.isclass(fn) else lambda row: functools.partial(fn, row)
    return with_engine(C.SimpleNamespace(tools=None, check=lambda tok: None,
                                         start=lambda rows, tok, max_turns: start_episodes(
                                             rows, make, f"--env {spec!r}", timeout, tok,
                                             max_turns)))


def with_engine(env):
    """The env with the sampler of its episodes, env.generate (engine.generate bound to it, which
    common.generate calls for a run with an env), and env.metrics(roll), its step's tool
    metrics (tool_metrics)."""
    env.generate = functools.partial(engine.generate, env=env)
    env.metrics = functools.partial(tool_metrics, env=env)
    return env


def start_episodes(rows, make, who, timeout, tok, max_turns=1):
    """One episode per row, each made (on its first call) from a deep copy of its row and keeping
    its own turns and observations. Returns env_step(requests, wait) for engine.sample, which
    starts each row's call in a thread of its own (submit) and hands back the observations of
    the calls that have finished (observation_ids: cut to the budget), or None for an episode
    that ended (the env's None, or no call after its max_turns-th turn); and finish(roll), which
    puts on the rollout what the episodes saw. who: the env, as errors name it ("--env 'calc'")."""
    copies = [copy.deepcopy(r) for r in rows]
    episodes = [None] * len(rows)  # made on the first call: a function env's row, or an object
    # each row's turns (texts), observations (as the model reads them), whether one was cut by the
    # budget, and the column where its next turn begins
    seen = [C.SimpleNamespace(turns=[], observations=[], cut=False, begun=0) for _ in rows]
    vocab = len(tok)  # the token ids an env may return
    before = global_draws()  # an env that draws from the global generators: said in finish()

    def where(i, turns):  # the row an error names
        return f"on the row with prompt {str(copies[i].get('prompt'))[:60]!r}, turn {len(turns)}"

    def call(i, turns, started):
        _CLOCK.started = started  # the deadline counts from now, not from when it was queued
        restart_clock()
        try:
            if episodes[i] is None:
                episodes[i] = make(copies[i])
            step = getattr(episodes[i], "step", episodes[i])  # a class env: its step()
            out = step(turns)
        except UserError:
            raise
        except BaseException as e:  # noqa: B036 -- a SystemExit in an env must not end the run 0
            raise UserError(f"{who} raised {type(e).__name__}: {first_line(e)} "
                            f"({where(i, turns)})") from None
        ids = isinstance(out, list) and all(type(x) is int for x in out)
        if out is not None and not isinstance(out, str) and not ids:
            raise UserError(f"{who} returned {type(out).__name__} {out!r:.40} "
                            f"({where(i, turns)}): return the observation text, or None to end")
        bad = [x for x in out if not 0 <= x < vocab] if ids else []  # no embedding row for it
        if bad:
            raise UserError(f"{who} returned token id {bad[0]}, outside the vocabulary (0 to "
                            f"{vocab - 1}) ({where(i, turns)})")
        return out

    running = {}  # row -> (its call's Future, [when its clock started], its Request)

    def env_step(requests, wait=False):
        """Start the calls of the rows whose turns just ended (an engine.Request each) and return
        [(row, observation ids or None)] of the calls that have finished, in row order; wait:
        block until one has. A call past its deadline stops the run, even while others decode."""
        for req in requests:
            s = seen[req.row]
            s.turns.append(tok.decode(req.turn, skip_special_tokens=True))
            s.begun += len(req.turn)
            started = [time.monotonic()]  # the call restarts it; None while it is paused
            if len(s.turns) < max_turns:
                future = submit(functools.partial(call, req.row, list(s.turns), started))
            else:  # its last turn: no call, the episode ends
                future = concurrent.futures.Future()
                future.set_result(None)
            running[req.row] = (future, started, req)
        while True:
            now = time.monotonic()
            late = sorted(i for i, (f, t0, _) in running.items() if not f.done() and
                          t0[0] is not None and now - t0[0] > timeout)
            if late:
                raise UserError(f"{who} took more than {timeout:g} s "
                                f"{where(late[0], seen[late[0]].turns)} (--env_timeout)")
            ready = sorted(i for i, (f, _, _) in running.items() if f.done())
            if ready or not wait or not running:
                break
            # the next deadline to check (a clock restarted or resumed meanwhile: within 1 s)
            first = min([t0[0] for _, t0, _ in running.values() if t0[0] is not None] + [now])
            concurrent.futures.wait([f for f, _, _ in running.values()],
                                    timeout=min(1.0, max(0.0, first + timeout - now) + 0.01),
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        answers = []
        for i in ready:
            future, _, req = running.pop(i)
            out = future.result()  # what the env returned, or its error as one line
            ids, cut = (None, False) if out is None else observation_ids(tok, out, req.budget,
                                                                         req.eos)
            if ids is not None:
                seen[i].observations.append(tok.decode(ids))
                seen[i].cut |= cut
                seen[i].begun += len(ids)
            answers.append((i, ids))
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
        roll.episodes = episodes  # each episode's state (--tools: its calls, tool_metrics)
        if global_draws() != before and not _SAID:
            _SAID.append(who)
            print(f"warning: {who} drew from Python's or numpy's global random generator: its "
                  "calls run at once in threads, so the order of the draws, and the run, can "
                  "differ with the same --seed and on --resume; give each episode its own "
                  "random.Random(seed from its row) (docs/reliability.md)", file=sys.stderr)
    return env_step, finish


_SAID = []  # the env whose global draws were said (once a process)


def global_draws():
    """The states of Python's and numpy's global random generators (numpy's when imported)."""
    np = sys.modules.get("numpy")
    state = np.random.get_state() if np is not None else None
    return random.getstate(), None if state is None else (state[1].tobytes(), state[2])


def tool_metrics(roll, env):
    """Per-step tool use: tool_calls and turns per completion, frac_tool (completions with a call),
    tool_errors (the fraction of calls that failed: --tools' error results, else observations
    that start with 'error', as calc's do), obs_truncated (completions with an observation cut by
    the budget); --tools: per tool, calls per completion and the fraction that failed
    (tool_calls/NAME, tool_errors/NAME), and calls of no tool or unreadable (tool_calls_unknown)."""
    calls = [c for e in roll.episodes if env.tools and e is not None for c in e.calls]  # (name, ok)
    failed = [not ok for _, ok in calls] if env.tools else [
        x.strip().startswith("error") for o in roll.observations for x in o]
    out = {"tool_calls": float(roll.tool_calls.float().mean()),
           "frac_tool": float((roll.tool_calls > 0).float().mean()),
           "turns": float(roll.turns.float().mean()),
           "tool_errors": sum(failed) / max(len(failed), 1),
           "obs_truncated": float(roll.obs_truncated.float().mean())}
    names = [schema["function"]["name"] for schema in env.tools or []]
    for name in names:  # every tool's keys at every step (torchrun averages them)
        mine = [ok for tool, ok in calls if tool == name]
        out[f"tool_calls/{name}"] = len(mine) / len(roll.episodes)
        out[f"tool_errors/{name}"] = mine.count(False) / max(len(mine), 1)
    if names:
        out["tool_calls_unknown"] = sum(t not in names for t, _ in calls) / len(roll.episodes)
    return out


def text_ids(tok, text):
    """A tool's text as data: token ids, invalid unicode replaced, never read as special tokens
    ('<eos>' in a tool's output is five characters, not the EOS)."""
    text = text.encode("utf-8", "replace").decode("utf-8")
    return tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def cut_text(tok, text, n):
    """The start of text that holds its first n tokens and a little more, so that a 1 MB output
    is never tokenized whole: 32 characters a token, more where the tokenizer packs more."""
    chars = 32 * n + 32
    while chars < len(text) and len(text_ids(tok, text[:chars])) <= n:
        chars *= 4
    return text[:chars]


def observation_ids(tok, obs, left, end=None):
    """An observation as the token ids fed to the model, cut to the `left` of the budget, and
    whether it was cut. Text (text_ids) is cut before it is tokenized (cut_text). Token ids
    (chat_observation's: the chat template's own markers) are fed as they are; when the turn
    ended on the model's own EOS `end` and the ids begin with it (the template's end-of-turn
    tag), the model's token stands for the template's."""
    if isinstance(obs, str):
        ids = text_ids(tok, cut_text(tok, obs, left))
        return ids[:left], len(ids) > left
    ids = obs[1:] if end is not None and obs[:1] == [end] else obs
    return ids[:left], len(ids) > left


def task_data(args, data):
    """--env calc without --data: the calculator's sums, else the data as loaded."""
    skip = (args.skip_uniform, args.skip_keep)  # --skip_uniform applies to the sums too
    return calc.calc_data(args.eval_size, skip) if args.env == "calc" and not args.data else data


def from_args(args):
    """The run's environment (None without --env or --tools), after checking the tool-use flags
    (--max_turns has its range beside its Args field, checked with the others)."""
    if args.eval_sampled and args.eval_samples < 1:
        raise UserError("--eval_sampled scores mean@k of --eval_samples k samples: give "
                        "--eval_samples k (k >= 1)")
    return load_env(args.env, args.tools, args.env_timeout, args.max_new_tokens)


# ------------------------------------------------------------------------ chat models' format
TURN = "minrl0turn"  # stands for the model's turn in the template's rendering
RESULT = "minrl0tool0result{}z"  # where each result goes (z: result1 is no prefix of result10)


def chat_observation(tok, messages, results, tools=None, names=None):
    """Tool results in a chat model's own format, as token ids that follow the model's turn as it
    was sampled (token in, token out). The turn is never rendered again: Qwen3's template rewrites
    an assistant turn (it drops an empty think block, strips newlines) and Qwen3.5's adds a think
    block to one, so "the conversation with the turn" is not a prefix of "... and the tool
    message" there. Instead the template renders the conversation, a stand-in turn (TURN) and one
    tool message per result, and what follows the stand-in is the observation: the turn's end tag,
    the tool messages and the next assistant header (Qwen3.5's '<think>\\n' too). The template's
    markers are its own tokens, special ones included; each result, as the template shows it (as
    it is, trimmed, quoted as JSON), is tokenized as text (text_ids: never a special token).
    messages: the conversation before this turn; tools: the schemas the prompt was rendered with;
    names: each result's tool. A turn that ended on the model's own end-of-turn token keeps it,
    and observation_ids drops the template's copy of it (the first id)."""
    results = [results] if isinstance(results, str) else list(results)
    marks = [RESULT.format(k) for k in range(len(results))]

    def render(contents):  # the conversation, the stand-in turn, one tool message per content
        tail = [{"role": "tool", "content": c, **({"name": n} if n else {})}
                for c, n in zip(contents, names or [None] * len(contents))]
        with loading.template_errors(tok, "--tools: "):
            return tok.apply_chat_template(
                messages + [{"role": "assistant", "content": TURN}] + tail, tools=tools,
                tokenize=False, add_generation_prompt=True)
    whole = render(marks)
    at = [whole.rfind(m) for m in marks]
    begin = whole.rfind(TURN, 0, at[0]) + len(TURN)
    if begin < len(TURN) or min(at) < 0 or sorted(at) != at:
        raise UserError("--tools: the chat template does not show an assistant turn's text and "
                        "each tool message's content: write an --env that answers the model")
    ids = []
    for k, result in enumerate(results):
        ids += tok(whole[begin:at[k]], add_special_tokens=False)["input_ids"]  # markers
        before, after = whole[:at[k]], whole[at[k] + len(marks[k]):]
        shown = render(marks[:k] + [result] + marks[k + 1:])  # the result as the template shows it
        fits = shown.startswith(before) and shown.endswith(after) and len(shown) >= len(whole) - \
            len(marks[k])
        ids += text_ids(tok, shown[len(before):len(shown) - len(after)] if fits else result)
        begin = at[k] + len(marks[k])
    return ids + tok(whole[begin:], add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------------- --tools
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)  # Hermes, Qwen2.5 to 3.5
FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.S)  # Qwen3.5's XML calls
PARAMETER = re.compile(r"<parameter=([^>\n]+)>\s*(.*?)\s*</parameter>", re.S)
LLAMA_CALL = re.compile(r'\s*\{\s*"name"\s*:')  # Llama 3.1 / 3.2: a turn that starts a call
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


def load_tools(spec):
    """--tools FILE.py:NAME[,NAME...] (or module:name,...) -> ({name: function}, JSON schemas).
    Each tool is a plain function with type hints and a Google-style docstring (Args: ...), from
    which transformers' get_json_schema writes the schema the chat template shows the model. The
    file is imported once: its tools share its module state."""
    functions, schemas = {}, []
    for fn in loading.load_function("--tools", spec, "write path/to/file.py:name[,name...] or "
                                    "module:name[,name]", several=True):
        try:
            schemas.append(get_json_schema(fn))
        except Exception as e:  # no type hints, no docstring, an argument it does not describe
            raise UserError(f"--tools: {fn.__name__!r} has no schema: {first_line(e)} "
                            "(give every argument a type hint and a line under Args:)") from None
        name = schemas[-1]["function"]["name"]
        if name in functions:
            raise UserError(f"--tools {spec!r} names the tool {name!r} twice: list each once")
        functions[name] = fn
    return functions, schemas


def call_format(tok):
    """How --tools reads a model's calls: 'parser' (the tokenizer's response parser,
    transformers' response_template), 'tags' (<tool_call>...</tool_call>: Hermes and Qwen2.5 / 3
    JSON, Qwen3.5's <function=NAME> XML, GLM-4.5's <arg_key>/<arg_value>), 'json' (Llama 3.1 /
    3.2: the turn is one JSON object {"name": ..., "parameters": ...}), or None (Muse Glimmer's
    ATEM channels among them)."""
    template = tok.chat_template if isinstance(tok.chat_template, str) else str(tok.chat_template)
    if getattr(tok, "response_template", None):
        return "parser"
    if "<atem:function_calls>" in template:  # Muse Glimmer's ATEM channels: not read here
        return None
    return "tags" if "<tool_call>" in template else "json" if '"parameters"' in template else None


def check_tool_format(tok, schemas):
    """--tools needs a chat template that renders the tools and tool messages, and calls in a
    format read here (call_format). Anything else is refused in one line, before the run."""
    chat = [{"role": "user", "content": "hi"}]
    with loading.template_errors(tok, "--tools: "):
        if not tok.chat_template or (tok.apply_chat_template(chat, tools=schemas, tokenize=False)
                                     == tok.apply_chat_template(chat, tokenize=False)):
            raise UserError("--tools needs a model whose chat template renders tools (e.g. "
                            "Qwen2.5, Qwen3 or Llama 3.1 instruct); this one shows the model no "
                            "tools")
    if call_format(tok) is None:
        raise UserError("--tools reads calls through the tokenizer's response parser, as "
                        "<tool_call>...</tool_call> (Hermes, Qwen) or as Llama 3.1's JSON; this "
                        "chat template uses none of them: write an --env that parses its calls")
    chat_observation(tok, chat, ["x", "y"], schemas)  # it shows a turn and two tool messages


def read_call(body, schemas):
    """One call's text -> (name, arguments), or (None, why) when it cannot be read: JSON
    {"name": ..., "arguments" or "parameters": {...}}, Qwen3.5's <function=NAME> with a
    <parameter=KEY> block per argument, or GLM-4.5's NAME with <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value> per argument (in both, a value is text where the schema says
    string, else JSON when it reads as JSON)."""
    def typed(name, pairs):  # [(key, value as written)] -> the arguments
        types = {s["function"]["name"]: s["function"].get("parameters", {}).get("properties", {})
                 for s in schemas}.get(name, {})
        arguments = {}
        for key, value in pairs:
            try:
                as_json = types.get(key.strip(), {}).get("type") != "string"
                arguments[key.strip()] = json.loads(value) if as_json else value
            except (ValueError, RecursionError):
                arguments[key.strip()] = value
        return name, arguments
    xml = FUNCTION.match(body)
    if xml:
        return typed(xml.group(1).strip(), PARAMETER.findall(xml.group(2)))
    if "<arg_key>" in body or re.fullmatch(r"[\w.-]+", body):  # GLM-4.5 (no argument: NAME)
        return typed(body.split("<arg_key>")[0].strip(), GLM_ARGUMENT.findall(body))
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):  # not JSON, or nested deeper than Python recurses
        call = None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None, f"the call is not JSON with a name and arguments: {body[:80]}"
    return call["name"], call.get("arguments", call.get("parameters", {}))


def parse_calls(tok, text, schemas):
    """The tool calls in a model turn, in the model's own format (call_format): [(name,
    arguments)], or (None, why) for a call that cannot be read."""
    form = call_format(tok)
    if form == "parser":  # the tokenizer's own parser (transformers)
        try:
            message = tok.parse_response(text, tools=schemas)
            found = [c.get("function", c) for c in message.get("tool_calls") or []]
            return [(c.get("name"), c.get("arguments", {})) for c in found]
        except Exception as e:
            return [(None, f"the call could not be parsed: {first_line(e)[:200]}")]
    if form == "json":  # Llama 3.1: a turn that is one JSON object {"name": ...} is a call
        return [read_call(text.strip(), schemas)] if LLAMA_CALL.match(text) else []
    return [read_call(body, schemas) for body in TOOL_CALL.findall(text)]


def run_tool(functions, name, arguments):
    """One call -> (its result as text, whether it failed). A call that cannot be read, an unknown
    tool, arguments that are not an object, a tool that raises and a result that cannot be written
    as JSON become 'error: ...' (the model sees it: a mistake to learn from, never a crash); a
    UserError from the tool stops the run in one line."""
    if name is None:
        return f"error: {arguments}", True
    if not isinstance(name, str) or name not in functions:
        return f"error: no tool {name!r:.60}; the tools are {', '.join(functions)}", True
    if not isinstance(arguments, dict):
        return f"error: the arguments of {name!r} must be a JSON object", True
    restart_clock()  # each call has its own --env_timeout
    try:
        result = functions[name](**arguments)
    except UserError:  # the tool's setup, not the model's mistake (a sandbox that cannot start)
        raise
    except (Exception, SystemExit) as e:  # SystemExit: argparse on the model's arguments
        return f"error: {type(e).__name__}: {first_line(e)[:200]}", True
    try:
        return (result if isinstance(result, str) else json.dumps(result, default=str)), False
    except Exception as e:  # a circular or too deep structure, keys that are not text
        return f"error: {name!r} returned what JSON cannot hold: {first_line(e)[:200]}", True


class ToolEpisode:
    """One episode of --tools: its conversation so far, as chat messages, and its calls. After
    each model turn, step() runs the turn's calls and returns their results in the chat template's
    format (chat_observation), or None when the turn made no call: it was the answer. budget
    (max_new_tokens): each result is cut to it as text (cut_text) before it is rendered."""

    def __init__(self, row, tok, functions, schemas, budget=None):
        self.tok, self.functions, self.schemas, self.budget = tok, functions, schemas, budget
        self.messages = C.as_messages(row["prompt"])  # the prompt, then turns and results
        self.calls = []  # (tool name, succeeded) of every call: tool_metrics

    def step(self, turns):
        calls = parse_calls(self.tok, turns[-1], self.schemas)
        if not calls:
            return None
        done = [run_tool(self.functions, name, arguments) for name, arguments in calls]
        results = [r if self.budget is None else cut_text(self.tok, r, self.budget)
                   for r, _ in done]
        names = [name if isinstance(name, str) else None for name, _ in calls]
        self.calls += [(name, not failed) for (name, _), (_, failed) in zip(calls, done)]
        obs = chat_observation(self.tok, self.messages, results, self.schemas, names)
        self.messages = self.messages + [{"role": "assistant", "content": turns[-1]}] + [
            {"role": "tool", "content": r, **({"name": n} if n else {})}
            for r, n in zip(results, names)]
        return obs
