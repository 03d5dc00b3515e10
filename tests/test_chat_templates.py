"""--tools on the chat templates people train with: Qwen2.5, Qwen3, Qwen3.5, Llama 3.1 (the real
templates, tests/chat_templates/) and a Hermes-style one; model turns of every shape."""
import os
import time
from types import SimpleNamespace

import pytest
import torch

import common as C
from plumbing.errors import UserError
from plumbing import envs as E
from plumbing import loading

from tests.helpers import OFF, ROOT, TOOLS_FILE as TOOLS, scripted_model


HERMES_STYLE_TEMPLATE = (  # NousResearch Hermes-2-Pro's tool_use layout, in short: a 'tool' role,
    # and a tool message that ends differently when it is the last message
    "{%- if tools %}<|im_start|>system\nYou are a function calling AI model. You are provided "
    "with function signatures within <tools></tools> XML tags. <tools> {% for tool in tools %}"
    "{{ tool | tojson }}{% endfor %} </tools> For each function call return a json object with "
    "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    "{\"arguments\": <args-dict>, \"name\": <function-name>}\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for message in messages %}{%- if message.role != 'tool' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- else %}{%- if loop.previtem and loop.previtem.role != 'tool' %}"
    "{{- '<|im_start|>tool\\n' }}{%- endif %}{{- '<tool_response>\\n' + message.content }}"
    "{%- if not loop.last %}{{- '\\n</tool_response>\\n' }}{%- else %}"
    "{{- '\\n</tool_response>' }}{%- endif %}"
    "{%- if not loop.last and loop.nextitem.role != 'tool' %}{{- '<|im_end|>' }}"
    "{%- elif loop.last %}{{- '<|im_end|>' }}{%- endif %}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")

ERR = "error: ValueError: no x"  # shout's result
CHATML = ("<|im_end|>\n<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n"
          "<|im_start|>assistant\n")
TWO = "{}\n</tool_response>\n<tool_response>\n{}"  # two results in one user message (Qwen)
# each template's observation after a call turn: its end tag, the tool message(s), the next header
WANT = {"qwen2_5": CHATML, "qwen3": CHATML, "qwen3_5_think": CHATML + "<think>\n",
        "llama3_1": '<|eot_id|><|start_header_id|>ipython<|end_header_id|>\n\n"{}"<|eot_id|>'
                    "<|start_header_id|>assistant<|end_header_id|>\n\n",
        "hermes": "<|im_end|>\n<|im_start|>tool\n<tool_response>\n{}\n</tool_response><|im_end|>"
                  "<|im_start|>assistant\n"}
JSON_ADD = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
JSON_SHOUT = '<tool_call>\n{"name": "shout", "arguments": {"text": "x"}}\n</tool_call>'
XML_ADD = ("<tool_call>\n<function=add>\n<parameter=a>\n2\n</parameter>\n<parameter=b>\n3\n"
           "</parameter>\n</function>\n</tool_call>")
XML_SHOUT = ("<tool_call>\n<function=shout>\n<parameter=text>\nx\n</parameter>\n</function>\n"
             "</tool_call>")
LLAMA_ADD = '{"name": "add", "parameters": {"a": 2, "b": 3}}'
# model turns as sampled (after the generation prompt) -> the results they get; Qwen3.5's
# generation prompt opens the think block, so its turns start inside it
SHAPES = {
    "qwen": {"no think": (JSON_ADD, ["5"]),
             "empty think": ("<think>\n\n</think>\n\n" + JSON_ADD, ["5"]),
             "think": ("<think>\nI add.\n</think>\n\n" + JSON_ADD, ["5"]),
             "odd whitespace": ("\n<think>I add.</think>" + JSON_ADD + " \n ", ["5"]),
             "two calls": ("<think>\nBoth.\n</think>\n\n" + JSON_ADD + "\n" + JSON_SHOUT,
                           ["5", ERR]),
             "no call": ("<think>\nEasy.\n</think>\n\n5", None)},
    "qwen3_5": {"empty think": ("\n</think>\n\n" + XML_ADD, ["5"]),
                "think left open": (XML_ADD, ["5"]),
                "think": ("I add.\n</think>\n\n" + XML_ADD, ["5"]),
                "odd whitespace": ("I add.</think>" + XML_ADD + "  ", ["5"]),
                "json call": ("I add.\n</think>\n\n" + JSON_ADD, ["5"]),
                "two calls": ("Both.\n</think>\n\n" + XML_ADD + "\n" + XML_SHOUT, ["5", ERR]),
                "no call": ("Easy.\n</think>\n\n5", None)},
    "llama": {"call": (LLAMA_ADD, ["5"]), "odd whitespace": (" \n" + LLAMA_ADD + " ", ["5"]),
              "arguments key": (LLAMA_ADD.replace("parameters", "arguments"), ["5"]),
              "no call": ("The sum is 5.", None), "json answer": ('{"sum": 5}', None)},
    "hermes": {"call": ('<tool_call>\n{"arguments": {"a": 2, "b": 3}, "name": "add"}\n</tool_call>',
                        ["5"]),
               "two calls": (JSON_ADD + "\n" + JSON_SHOUT, ["5", ERR]),
               "no call": ("5", None)}}
FAMILY = {"qwen2_5": "qwen", "qwen3": "qwen", "qwen3_5_think": "qwen3_5", "llama3_1": "llama",
          "hermes": "hermes"}
# the shapes whose turn the template shows as the model wrote it, so that the conversation so far
# is a prefix of the conversation with the tool message: there the transcript is the template's
# own rendering, token for token. Elsewhere token in, token out keeps the model's tokens as they
# were sampled: Qwen3 drops an empty think block and rewrites the newlines around one, Qwen3.5
# trims a turn and closes a think block the model left open (a block it adds to the turn)
PREFIX_PRESERVING = {"qwen2_5": set(SHAPES["qwen"]),
                     "qwen3": {"no think", "think", "two calls", "no call"},
                     "qwen3_5_think": set(SHAPES["qwen3_5"]) - {"odd whitespace",
                                                                "think left open"},
                     "llama3_1": {"call", "arguments key", "no call"},
                     "hermes": set(SHAPES["hermes"])}


def template_tokenizer(name):
    """The bundled (one character a token) tokenizer with a real chat template and its markers as
    tokens: ChatML's <|im_start|> / <|im_end|> (the EOS) or Llama 3's headers and <|eot_id|>."""
    t = loading.load_tokenizer(loading.DEFAULT_POLICY)
    llama = name.startswith("llama")
    t.add_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|python_tag|>"] if llama else ["<|im_start|>", "<|im_end|>"],
                 special_tokens=True)
    t.add_tokens(["\n", "<think>", "</think>", "<tool_call>", "</tool_call>"])
    t.eos_token, t.bos_token = ("<|eot_id|>", "<|begin_of_text|>") if llama else ("<|im_end|>",
                                                                                   t.bos_token)
    t.model_max_length = 10**6
    t.chat_template = HERMES_STYLE_TEMPLATE if name == "hermes" else open(
        os.path.join(ROOT, "tests", "chat_templates", f"{name}.jinja")).read()
    return t


def render(t, messages, schemas, generation_prompt=True):
    return t.apply_chat_template(messages, tools=schemas, tokenize=False,
                                 add_generation_prompt=generation_prompt)


@pytest.mark.parametrize("name", list(FAMILY))
def test_tool_observations_on_real_templates_for_every_turn_shape(name, tmp_path):
    """Each template, each turn shape (empty or full think block, odd whitespace, two calls, a
    JSON call where XML is usual, no call): the calls are read in the model's format and run,
    and the observation is the template's own end tag + tool message(s) + next header, the
    results as text. Where the template shows the turn as written (prefix-preserving), prompt +
    turn + observation is the template's rendering of the whole conversation, exactly; Qwen3 and
    Qwen3.5 re-render turns (the old prefix check stopped those runs), and there the observation
    is the same text, after the model's own tokens."""
    (tmp_path / "tools.py").write_text(TOOLS)
    functions, schemas = E.load_tools(f"{tmp_path / 'tools.py'}:add,shout")
    t = template_tokenizer(name)
    E.check_tool_format(t, schemas)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3?"}]
    preserving = set()
    for shape, (turn, results) in SHAPES[FAMILY[name]].items():
        episode = E.ToolEpisode({"prompt": messages}, t, functions, schemas, budget=200)
        obs = episode.step([turn])
        if results is None:
            assert obs is None and episode.calls == [], shape
            continue
        assert [m["content"] for m in episode.messages[3:]] == results, shape
        assert [ok for _, ok in episode.calls] == [r == "5" for r in results], shape
        want = WANT[name].format(TWO.format(*results) if len(results) == 2 else results[0])
        assert t.decode(obs) == want, (shape, t.decode(obs))
        assert obs == t(want, add_special_tokens=False, split_special_tokens=False)["input_ids"]
        whole = render(t, messages + [{"role": "assistant", "content": turn}]
                       + [{"role": "tool", "content": r} for r in results], schemas)
        head = render(t, messages, schemas) + turn
        if whole.startswith(head):
            preserving.add(shape)
            assert head + t.decode(obs) == whole, shape
    assert preserving | {"no call"} == PREFIX_PRESERVING[name]


@pytest.mark.parametrize("name,shape", [("qwen3", "empty think"), ("qwen3", "odd whitespace"),
                                        ("qwen3_5_think", "think left open"),
                                        ("qwen3_5_think", "two calls"),
                                        ("llama3_1", "odd whitespace"), ("hermes", "two calls")])
def test_a_tool_episode_through_the_sampler_keeps_the_models_tokens(name, shape, tmp_path):
    """A scripted model writes a call turn of a shape the template re-renders (the runs that
    stopped at their first such call), then its answer: the rollout is the prompt, the model's
    own tokens, the observation (the template's end tag replaced by the model's EOS) and the
    answer; the masks mark the model's tokens; the metrics count each tool's calls and errors."""
    (tmp_path / "tools.py").write_text(TOOLS)
    env = E.load_env("", f"{tmp_path / 'tools.py'}:add,shout", budget=2000)
    t = template_tokenizer(name)
    messages = [{"role": "user", "content": "2+3?"}]
    prompt = C.encode_prompts(t, [messages], tools=env.tools)[0]
    turn, results = SHAPES[FAMILY[name]][shape]
    functions, schemas = E.load_tools(f"{tmp_path / 'tools.py'}:add,shout")
    obs = E.ToolEpisode({"prompt": messages}, t, functions, schemas).step([turn])
    enc = lambda s: t(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    eos = t.eos_token_id
    assert obs[0] == eos  # the template's end tag: the model's own EOS stands for it
    completion = enc(turn) + [eos] + obs[1:] + enc("5") + [eos]
    kinds = [1] * (len(enc(turn)) + 1) + [0] * (len(obs) - 1) + [1, 1]
    model = scripted_model(t, [prompt], [completion], [kinds])
    args = SimpleNamespace(max_new_tokens=2000, temperature=1.0, top_p=1.0, stop=[], max_turns=3,
                           chat_template="auto", system_prompt="")
    roll, texts = C.generate(model, t, [{"prompt": messages, "answer": "5"}], args, OFF, env,
                             greedy=True)
    n = int(roll.attention_mask[0].sum())
    assert roll.ids[0, -n:].tolist() == prompt + completion and texts == ["5"]
    assert roll.completion_mask[0, :len(kinds)].tolist() == kinds
    m = E.tool_metrics(roll, env)
    assert m["tool_calls/add"] == 1 and m["tool_errors/add"] == 0
    assert m["tool_calls/shout"] == len(results) - 1 == m["tool_errors/shout"]
    assert m["tool_errors"] == (len(results) - 1) / len(results) and m["tool_calls_unknown"] == 0


BAD_TOOLS = TOOLS + '''

def loop(n: int) -> dict:
    """A result that holds itself.

    Args:
        n: ignored
    """
    d = {}
    d["me"] = d
    return d


def deep(n: int) -> list:
    """A result nested deeper than Python recurses.

    Args:
        n: ignored
    """
    x = []
    for _ in range(100_000):
        x = [x]
    return x


def keyed(n: int) -> dict:
    """A result whose keys JSON cannot hold.

    Args:
        n: ignored
    """
    return {(1, 2): n}
'''


def test_calls_and_results_that_cannot_be_read_or_written_are_error_messages(tmp_path):
    """A call whose name is a list or a dict, whose JSON nests deeper than Python recurses, an
    unknown tool, and results that hold themselves, nest too deeply or have keys JSON cannot
    hold: each becomes an 'error: ...' tool message (the run goes on), is counted as a failed
    call, and names that are no tool are counted in tool_calls_unknown."""
    (tmp_path / "tools.py").write_text(BAD_TOOLS)
    names = "add,loop,deep,keyed"
    functions, schemas = E.load_tools(f"{tmp_path / 'tools.py'}:{names}")
    t = template_tokenizer("qwen2_5")
    calls = ['{"name": ["add"], "arguments": {}}', '{"name": {"a": 1}, "arguments": {}}',
             '{"name": "add", "arguments": ' + "[" * 100_000 + "]" * 100_000 + "}",
             '{"name": "mul", "arguments": {}}', '{"name": "loop", "arguments": {"n": 1}}',
             '{"name": "deep", "arguments": {"n": 1}}',
             '{"name": "keyed", "arguments": {"n": 1}}',
             '{"name": "add", "arguments": {"a": 2, "b": 3}}']
    episode = E.ToolEpisode({"prompt": "2+3?"}, t, functions, schemas, budget=200)
    obs = episode.step(["".join(f"<tool_call>{c}</tool_call>" for c in calls)])
    results = [m["content"] for m in episode.messages[2:]]
    assert all(r.startswith("error: ") for r in results[:-1]) and results[-1] == "5", results
    assert "Circular reference" in results[4] and "keys must be" in results[6], results
    assert [ok for _, ok in episode.calls] == [False] * 7 + [True]
    assert t.decode(obs).count("<tool_response>") == 8
    roll = SimpleNamespace(episodes=[episode, None], tool_calls=torch.tensor([8, 0]),
                           turns=torch.tensor([2, 1]), observations=[[t.decode(obs)], []],
                           obs_truncated=torch.tensor([False, False]))
    m = E.tool_metrics(roll, SimpleNamespace(tools=schemas))
    # per completion (2): unknown are the two names that are no text, the call too deep to read
    # and 'mul'
    assert m["tool_errors"] == 7 / 8 and m["tool_calls_unknown"] == 4 / 2
    assert m["tool_calls/add"] == 1 / 2 and m["tool_errors/add"] == 0
    assert m["tool_errors/loop"] == m["tool_errors/deep"] == m["tool_errors/keyed"] == 1


def test_tools_of_one_file_share_it_and_a_repeated_tool_is_refused(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS + "\nIMPORTS = []\nIMPORTS.append(1)\n")
    functions, _ = E.load_tools(f"{tmp_path / 'tools.py'}:add, shout")
    assert functions["add"].__globals__ is functions["shout"].__globals__  # one module
    assert functions["add"].__globals__["IMPORTS"] == [1]  # imported once
    with pytest.raises(UserError, match=r"--tools '.*tools.py:add,add' names the tool 'add' "
                                          r"twice: list each once"):
        E.load_tools(f"{tmp_path / 'tools.py'}:add,add")


def test_a_tool_result_is_cut_as_text_before_it_is_rendered_or_tokenized(tmp_path, monkeypatch):
    """A 1 MB result: the tokenizer never sees more than the budget's worth of characters, the
    observation is longer than the budget (so the sampler cuts it and counts it in
    obs_truncated), and 32 such calls take well under a second."""
    (tmp_path / "tools.py").write_text(TOOLS + "\ndef big(n: int) -> str:\n    \"\"\"A megabyte."
                                       "\n\n    Args:\n        n: ignored\n    \"\"\"\n"
                                       "    return '9' * 1_000_000\n")
    functions, schemas = E.load_tools(f"{tmp_path / 'tools.py'}:big")
    t = template_tokenizer("qwen3")
    seen = []
    real = type(t).__call__
    monkeypatch.setattr(type(t), "__call__", lambda self, text, *a, **k: (
        seen.append(len(text)), real(self, text, *a, **k))[1])
    t0 = time.time()
    for _ in range(32):
        episode = E.ToolEpisode({"prompt": "hi"}, t, functions, schemas, budget=100)
        obs = episode.step(['<tool_call>{"name": "big", "arguments": {"n": 1}}</tool_call>'])
    assert time.time() - t0 < 5 and max(seen) < 32 * 100 + 1000 and len(obs) > 100
    ids, cut = E.observation_ids(t, obs, 100)
    assert cut and len(ids) == 100


def test_env_token_ids_outside_the_vocabulary_and_a_huge_timeout_are_one_line(
        tok, tmp_path, monkeypatch, capsys):
    from tests.helpers import FAST_GRPO, one_error_line, rollout, tiny_model
    import grpo
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = list(range(len(tok)))  # every turn is one token
    prompts = C.encode_prompts(tok, ["1+2="] * 2)
    for bad in (len(tok), -1, 10**30):
        with pytest.raises(UserError, match=rf"--env 'test' returned token id {bad}, outside "
                                              rf"the vocabulary \(0 to {len(tok) - 1}\) \(on the"):
            rollout(model, tok, prompts, lambda row, turns: [5, bad], [{"prompt": "1+2="}] * 2,
                    2, 20)
    from tests.helpers import run_main
    with pytest.raises(SystemExit):
        run_main(monkeypatch, grpo, *FAST_GRPO, "--env", "calc", "--env_timeout", "1e10",
                 "--output_dir", tmp_path / "x", guard=True)
    assert one_error_line(capsys).startswith("error: --env_timeout must be <= 86400, not 1")


REFUSING_TEMPLATE = (  # Gemma's refusal of a system message, and a template that takes no tools
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% if tools %}{{ raise_exception('This model takes no tools') }}{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")


@pytest.fixture
def refusing_model(tmp_path):
    """A tiny llama and the bundled tokenizer with REFUSING_TEMPLATE: its folder."""
    from tests.helpers import tiny_model
    t = loading.load_tokenizer(loading.DEFAULT_POLICY)
    t.chat_template = REFUSING_TEMPLATE
    tiny_model("llama").save_pretrained(tmp_path / "refusing")
    t.save_pretrained(tmp_path / "refusing")
    return str(tmp_path / "refusing")


def test_a_template_that_refuses_is_one_line_in_every_script(refusing_model, tmp_path,
                                                               monkeypatch, capsys):
    """A chat template's raise_exception (Gemma's 'System role not supported', one that takes no
    tools) is one line naming the template and its message, exit 2, before any step: grpo with
    --system_prompt or --tools, sft on a conversation with a system message, dpo on such a
    prompt."""
    import dpo
    import grpo
    import sft
    from tests.helpers import FAST_GRPO, one_error_line, run_main, write_jsonl
    (tmp_path / "tools.py").write_text(TOOLS)
    name = repr(refusing_model)
    system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}]
    write_jsonl(tmp_path / "sft.jsonl", [{"messages": system + [
        {"role": "assistant", "content": "3"}]}] * 10)
    write_jsonl(tmp_path / "dpo.jsonl", [{"prompt": system, "chosen": "3", "rejected": "4"}]
                * 10)
    for script, flags, want in (
            (grpo, ["--system_prompt", "Be brief.", *FAST_GRPO],
             "System role not supported (--system_prompt puts a system message first)"),
            (grpo, ["--tools", f"{tmp_path / 'tools.py'}:add", *FAST_GRPO],
             "This model takes no tools"),
            (sft, ["--data", tmp_path / "sft.jsonl"], "System role not supported"),
            (dpo, ["--data", tmp_path / "dpo.jsonl"], "System role not supported")):
        out = tmp_path / f"run-{script.__name__}"
        with pytest.raises(SystemExit) as e:
            run_main(monkeypatch, script, "--model", refusing_model, "--max_new_tokens", "8",
                     *flags, "--output_dir", out, guard=True)
        line = one_error_line(capsys)
        assert e.value.code == 2 and line.endswith(
            f"the chat template of {name} refuses the conversation: {want}"), line
        assert script is not sft or "sft.jsonl, line 1: " in line
        assert not out.exists()


def test_check_prompts_counts_the_tool_schemas(tmp_path):
    """A prompt that fits the context alone but not with the tools the template shows in it gets
    the "too long" line (it was an IndexError in the position embeddings, mid-run)."""
    (tmp_path / "tools.py").write_text(TOOLS)
    _, schemas = E.load_tools(f"{tmp_path / 'tools.py'}:add")
    t = template_tokenizer("qwen2_5")
    rows = [{"prompt": "1+2="}]
    alone = len(C.encode_prompts(t, ["1+2="])[0])
    config = SimpleNamespace(max_position_embeddings=alone + 100)
    args = SimpleNamespace(chat_template="auto", max_new_tokens=100, system_prompt="")
    loading.check_prompts(t, config, rows, args)  # fits without the tools
    with pytest.raises(UserError, match=r"1 of 1 prompts are too long: .* context of \d+ tokens"
                                          r" \(longest prompt: \d+ tokens, the tools shown in it "
                                          r"included\)"):
        loading.check_prompts(t, config, rows, args, schemas)


def test_a_reward_models_template_that_refuses_is_one_line(tmp_path, monkeypatch, capsys):
    """grpo --system_prompt with a reward model whose own chat template has no system role:
    one line naming the reward model's template, exit 2, and no run folder left."""
    import grpo
    from tests.helpers import FAST_GRPO, one_error_line, run_main, tiny_rm
    rm_dir = tmp_path / "rm"
    tiny_rm().save_pretrained(rm_dir)
    t = loading.load_tokenizer(loading.DEFAULT_POLICY)
    t.chat_template = REFUSING_TEMPLATE
    t.save_pretrained(rm_dir)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *FAST_GRPO, "--system_prompt", "Be brief.", "--reward_model",
                 rm_dir, "--rewards", "rm", "--max_new_tokens", "8", "--output_dir", out,
                 guard=True)
    assert e.value.code == 2 and one_error_line(capsys) == (
        f"error: --reward_model: the chat template of {str(rm_dir)!r} refuses the "
        "conversation: System role not supported")
    assert not out.exists()
