"""minrl tests, CPU only, minutes not hours (minGPT style): our pieces against plain, obvious
reference computations on tiny random models of real architectures; learning on the bundled task;
the scripts end to end; bad input.

The order follows the code: common.py (data, loading, sampling, log-probs, KL, rewards, eval), the
run plumbing of runs.py, then grpo.py, reinforce.py and ppo.py, and last the command line and
reliability (the scripts end to end, bad input, resume, Ctrl-C, sanity, the README's code map,
the 100-column rule).

Run: python -m pytest -q test_algos.py"""
import ast
import builtins
import csv
import dataclasses
import functools
import importlib
import inspect
import io
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import types
import warnings
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers import GPT2Config
from transformers import GPTNeoXConfig
from transformers import LlamaConfig
from transformers import LlamaForSequenceClassification
from transformers import Qwen2Config

import common as C
import fastpath
import dpo
import envs as E
from flags import parse_args
import grpo
import loading
import ppo
import reinforce as R
import reward_model
import runs
import sft
import tasks
from tools.build_models import column_sum, wrong_answer
from tools.merge_lora import merge as merge_lora

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))
import compare  # noqa: E402  (tools/compare.py, which imports its sibling plot.py)
import plot  # noqa: E402  (tools/plot.py)
import check_docs  # noqa: E402  (tools/check_docs.py)

ROOT = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(2)

PROMPTS = ["1+2=", "37+48=", "5+999=", "0+0=", "Hello, how are you?"]
ARCHS = ["llama", "qwen2", "gpt2", "gpt_neox"]
OFF = torch.autocast("cpu", enabled=False)

# What metrics.jsonl holds for each step: the keys every script logs, plus each script's own.
# reinforce's reward/* parts are those of the tests' --rewards math,length; ppo's of its RM.
STEP_METRICS = {"step", "reward", "reward_std", "gold", "kl", "entropy", "loss", "grad_norm",
                "completion_len", "frac_truncated", "lr", "step_time", "tokens_per_s"}
METRIC_KEYS = {
    "grpo": STEP_METRICS | {"frac_zero_std", "clip_frac", "ratio"},
    "reinforce": STEP_METRICS | {"reward/math", "reward/length", "adv_std", "adv_mean",
                                 "sample_grad_rms"},
    "ppo": STEP_METRICS | {"reward/rm", "clip_frac", "ratio", "value_loss", "value_clip_frac",
                           "explained_var", "kl_coef", "approx_kl"},
}


# ---- fixtures and helpers
@pytest.fixture(autouse=True)
def _keep_sigint():
    """Scripts' main() installs a Ctrl-C handler; tests that call main() in-process must not leave
    it behind."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)
    runs.STOP["requested"] = False


@pytest.fixture(scope="session", autouse=True)
def _runs_folder_stays_as_it_was():
    """Every script a test runs writes under tmp_path: the repo's runs/ folder gains nothing."""
    folder = os.path.join(ROOT, "runs")
    before = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    yield
    after = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    assert not after - before, f"the tests left {sorted(after - before)} in {folder}"


@pytest.fixture(scope="session")
def tok():
    return loading.load_tokenizer(loading.DEFAULT_POLICY)


def tiny_config(arch, vocab=99):
    ids = dict(vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=64)
    return {"llama": LlamaConfig(num_key_value_heads=2, **sizes, **ids),
            "qwen2": Qwen2Config(num_key_value_heads=2, **sizes, **ids),
            "gpt2": GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **ids),
            "gpt_neox": GPTNeoXConfig(**sizes, **ids)}[arch]


def tiny_model(arch, seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                          "gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM"}[arch]]
    return AutoModelForCausalLM.from_config(cfg).eval()


def tiny_rm(seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config("llama")
    cfg.num_labels = 1
    cfg.architectures = ["LlamaForSequenceClassification"]
    return LlamaForSequenceClassification(cfg).eval()


def _offline():
    """Where and how every test runs a script: in the repo folder, never reaching the Hub."""
    return dict(cwd=ROOT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def run_script(script, *args, timeout=600):
    """`python script args` to its end: the CompletedProcess, with stdout and stderr as text."""
    return subprocess.run([sys.executable, script, *args], capture_output=True, timeout=timeout,
                          **_offline())


def start_script(script, *args):
    """`python script args` left running, to send it a signal: the Popen, with stderr in a pipe
    and stdout dropped."""
    return subprocess.Popen([sys.executable, script, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, **_offline())


def run_main(monkeypatch, script, *argv, guard=False):
    """script.main() in this process (no 9 s of imports) with argv as its command line, keeping
    pytest's Ctrl-C handler. guard=True runs it through runs.main_guard as `python script.py`
    does: bad input exits 2 with one line on stderr."""
    monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", *map(str, argv)])
    monkeypatch.setattr(runs.signal, "signal", lambda *a: None)
    return runs.main_guard(script.main) if guard else script.main()


def read_metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def baseline_args(baseline, k, whiten=False):
    """reinforce.advantages' switches: the baseline, k samples per prompt, whitening after it."""
    return R.Args(baseline=baseline, samples_per_prompt=k, whiten=whiten)


def reinforce_step_loss(logprobs, adv, mask, n_seqs, n_tokens, loss_agg="seq-sum", old=None,
                        clip_eps=0.2, is_weight=1.0):
    """A micro-batch's loss as reinforce.py's loop forms it from reinforce_loss: the per-token
    terms summed over the completion, over the step's N (sequences, or tokens)."""
    loss, ratio, clipped = R.reinforce_loss(logprobs, adv, old, clip_eps, is_weight)
    return (loss * mask).sum() / (n_seqs if loss_agg == "seq-sum" else n_tokens), ratio, clipped


# ---- common.py: data
@pytest.mark.parametrize("text,need_answer,expect", [
    ('{"prompt": "a"}\nnot json\n', False, "line 2: not valid JSON"),
    ('{"prompt": "a"}\n{"answer": "1"}\n', False, "line 2: field 'prompt'"),
    ("\n\n", False, "is empty"),
    ('{"prompt": "a"}\n{"prompt": "caf\xe9"}\n'.encode("latin-1"), False,
     "line 2: not UTF-8 text"),
    ('{"prompt": "a", "answer": 3}\n{"prompt": "b", "answer": [3]}\n', False,
     "line 2: field 'answer' must be a"),
    ('{"prompt": "a", "answer": "#### 0"}\n{"prompt": "b", "answer": null}\n', True,
     "line 2: field 'answer' is missing"),
    ('{"prompt": "a", "answer": "7"}\n{"prompt": "b", "answer": "seven"}\n', True,
     "line 2: field 'answer' is missing")])
def test_jsonl_errors_name_the_line(tmp_path, text, need_answer, expect):
    f = tmp_path / "d.jsonl"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(C.UserError, match=expect):
        tasks.read_rows(str(f), need_answer)


def test_hub_dataset_rows_keep_only_real_answers(monkeypatch):
    """--data hf:NAME reads 'question' (or 'prompt') and 'answer', keeping every column; a missing
    answer is no answer, not the text 'None'."""
    hub_rows = [{"question": "1+1=", "answer": "#### 2"}, {"question": "x", "answer": None}] * 5
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda *a, split: hub_rows
    monkeypatch.setitem(sys.modules, "datasets", fake)
    data = tasks.load_data("hf:someone/set:main", eval_size=2)
    want = [{"question": "1+1=", "answer": "#### 2", "prompt": "1+1="},
            {"question": "x", "prompt": "x"}] * 5
    def key(row):
        return json.dumps(row, sort_keys=True)
    assert sorted(map(key, data.rows)) == sorted(map(key, want))
    assert tasks.eval_metric(data.rows) == "mean reward" and len(data.eval_rows) == 2
    with pytest.raises(C.UserError, match="row 1: field 'answer' is missing or has no number"):
        tasks.load_data("hf:someone/set:main", need_answer=True)
    # too few rows to hold a fifth out
    fake.load_dataset = lambda *a, split: [{"prompt": "1+1=", "answer": "2"}] * 4
    assert tasks.load_data("hf:someone/set", eval_size=2).eval_rows == []
    # no held-out rows: no score, rather than a made-up 0
    assert math.isnan(C.evaluate(None, None, [], None, OFF, {"math": 1.0})["eval"])


def test_jsonl_reads_numbers_nulls_and_a_byte_order_mark(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "answer": 2}\r\n'
                  b'\r\n'
                  b'{"prompt": "x", "answer": null}\r\n')
    assert tasks.read_rows(str(f)) == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "x"}]
    # null is no answer: the math reward refuses
    with pytest.raises(C.UserError, match="line 3: field 'answer'"):
        tasks.read_rows(str(f), need_answer=True)

DATA_ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "id": f"r{i}"} for i in range(10)]


def write_data(folder, kind, monkeypatch, rows=DATA_ROWS):
    """rows written as a data source of one kind: its --data spec."""
    path = os.path.join(folder, f"d.{kind}")
    if kind in ("parquet", "files"):
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    if kind in ("save_to_disk", "dataset_dict", "files"):
        datasets = pytest.importorskip("datasets")
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", os.path.join(folder, "cache"))
    if kind == "jsonl":
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    elif kind == "json":  # one JSON array
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
    elif kind == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif kind == "save_to_disk":
        datasets.Dataset.from_list(rows).save_to_disk(path)
        return f"hf:{path}"
    elif kind == "dataset_dict":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                              "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(path)
        return f"hf:{path}"
    elif kind == "files":  # a folder of data files, as a hub dataset's repo holds them
        os.makedirs(path)
        for i in (0, 1):
            pq.write_table(pa.Table.from_pylist(rows[i * 5:i * 5 + 5]),
                           os.path.join(path, f"train-0000{i}-of-00002.parquet"))
        return f"hf:{path}"
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "save_to_disk",
                                  "dataset_dict", "files"])
def test_every_kind_of_data_file_gives_the_same_rows(tmp_path, monkeypatch, kind):
    """--data: JSON lines, a JSON array, CSV, parquet (pyarrow), or hf:DIR on a save_to_disk
    folder (a Dataset or a DatasetDict) or a folder of data files (datasets): the same rows."""
    spec = write_data(str(tmp_path), kind, monkeypatch)
    assert tasks.read_rows(spec) == DATA_ROWS
    data = tasks.load_data(spec, eval_size=2, need_answer=True)
    assert len(data.eval_rows) == 2 and len(data.rows) == 10
    if kind == "dataset_dict":
        assert tasks.read_rows(spec, split="test") == DATA_ROWS[:2]
        with pytest.raises(C.UserError, match=r"no split 'dev'; it has train, test \(pick one "
                                              r"with --data_split\)"):
            tasks.read_rows(spec, split="dev")


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk"])
def test_grpo_trains_on_a_parquet_file_and_a_save_to_disk_folder(tmp_path, monkeypatch, kind):
    spec = write_data(str(tmp_path), kind, monkeypatch, [
        {"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in tasks.task_eval_pairs()[:20]])
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "1", "--data", spec,
             "--output_dir", tmp_path / "run")
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1]


@pytest.mark.parametrize("name,text,message", [
    ("d.csv", "prompt,answer\n1+1=,2\n2+2=\n", r"d.csv, line 3: not as many values as the "
     "header line has fields"),
    ("d.json", '[{"prompt": "1+1=", "answer": 2}, "2+2="]',
     r"d.json, row 1: not a JSON object \(found str\)"),
    ("d.jsonl", '{"prompt": "1+1=", "answer": 2}\n{"question": 5, "answer": 2}\n',
     r"d.jsonl, line 2: field 'question' is missing or not a non-empty string \(or a list of "
     r"chat messages\); fields found: question, answer"),
    ("d.jsonl", '{"prompt": "1+1=", "answer": 2}\n{"prompt": [{"role": "wizard", "content": '
     '"hi"}]}\n',
     r"d.jsonl, line 2: field 'prompt', message 0: role 'wizard' is not one of system, user, "
     "assistant, tool"),
    ("d.parquet", "not parquet", r"d.parquet': pyarrow cannot read it as parquet")])
def test_bad_data_files_get_one_line_naming_the_file_and_the_row(tmp_path, monkeypatch, capsys,
                                                                 name, text, message):
    if name.endswith("parquet"):
        pytest.importorskip("pyarrow")
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--data", path, "--output_dir", tmp_path / "run", guard=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and re.search(message, err[0]), err


def test_optional_packages_missing_and_a_hub_dataset_offline_are_one_line(tmp_path, monkeypatch):
    """Parquet without pyarrow, hf:... without datasets: one line naming the package. A hub
    dataset that is not cached, offline (HF_HUB_OFFLINE=1, as in every test): one line."""
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # an import of it raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(C.UserError, match=r"d.parquet': reading parquet needs the optional "
                                          r"package `pyarrow` \(pip install pyarrow\)"):
        tasks.read_rows(str(path))
    monkeypatch.undo()
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(C.UserError, match=r"^--data hf:nobody/nothing:main: not in the local "
                                          "cache, and this machine cannot reach the hub"):
        tasks.read_rows("hf:nobody/nothing:main")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(C.UserError, match=r"needs the optional package `datasets`"):
        tasks.read_rows(f"hf:{tmp_path}")



def test_builtin_task_split_is_held_out():
    held = set(tasks.task_eval_pairs())
    assert len(held) == tasks.TASK_EVAL_SIZE
    assert not held & set(tasks.task_train_pairs(random.Random(0), 5000))
    # the warm-start data: true sums, or with carries forgotten
    assert all(column_sum(a, b) == a + b for a, b in tasks.task_train_pairs(random.Random(1), 200))
    assert column_sum(37, 48, random.Random(0), drop=1.0) == 75


# ---- common.py: loading
def test_bundled_models_load_offline():
    code = ("from transformers import AutoModelForCausalLM as A;"
            "from transformers import AutoModelForSequenceClassification as S;"
            "import loading;"
            "A.from_pretrained(loading.DEFAULT_POLICY);"
            "S.from_pretrained(loading.DEFAULT_REWARD_MODEL)")
    r = run_script("-c", code)  # python -c code, offline as every script run here
    assert r.returncode == 0, r.stderr[-3000:]


def test_gradient_checkpointing_recomputes_with_dropout_off_and_same_gradients(tmp_path, tok):
    """--gradient_checkpointing must really recompute the layers (HF only does so for layers in
    training mode, and our models stay in eval mode), keep dropout off, and leave the gradients
    unchanged."""
    cfg = tiny_config("gpt2")
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.5  # dropout would show as noisy log-probs
    cfg.architectures = ["GPT2LMHeadModel"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    grads, calls = [], []
    for ckpt in (False, True):
        args = SimpleNamespace(model=str(tmp_path / "m"), lora_r=0, trust_remote_code=False,
                               compile=False, gradient_checkpointing=ckpt)
        model, _ = loading.load_policy(args, torch.device("cpu"))
        n = []
        # a pre-hook: the recompute may stop early
        model.transformer.h[0].attn.register_forward_pre_hook(lambda *a: n.append(1))
        if not grads:  # one rollout, sampled by the first model, scored by both
            prompts = [p for p in C.encode_prompts(tok, PROMPTS) for _ in range(2)]
            roll = C.sample(model, tok, prompts, 6)
        T = roll.completion_mask.shape[1]
        lp, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T)
        lp2, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T)
        assert torch.equal(lp, lp2)  # deterministic: dropout is off
        n.clear()
        (lp * roll.completion_mask).sum().backward()
        # forwards of the layer during backward: 1 recompute with checkpointing, 0 without
        calls.append(len(n))
        grads.append([p.grad.clone() for p in model.parameters()])
    assert calls == [0, 1]
    # the KV cache still works
    greedy = C.sample(model, tok, C.encode_prompts(tok, PROMPTS), 8, greedy=True)
    ids, mask = C.left_pad(C.encode_prompts(tok, PROMPTS), tok.pad_token_id, "cpu")
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False,
                             use_cache=False, pad_token_id=tok.pad_token_id)
    ref = ref[:, ids.shape[1]:]
    for i in range(len(PROMPTS)):
        n = int(greedy.completion_mask[i].sum())
        assert greedy.ids[i, greedy.P:greedy.P + n].tolist() == ref[i, :n].tolist()
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ---- common.py: sampling
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_sample_equals_generate(arch, tok):
    model = tiny_model(arch, seed=1)
    model.generation_config.eos_token_id = [2, 43, 72]
    prompts = C.encode_prompts(tok, PROMPTS + PROMPTS[::-1])  # repeats share one prefill
    roll = C.sample(model, tok, prompts, 10, greedy=True)
    ids, mask = C.left_pad(prompts, tok.pad_token_id, "cpu")
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    ref = ref[:, ids.shape[1]:]
    for i in range(len(prompts)):
        n = int(roll.completion_mask[i].sum())
        assert roll.ids[i, roll.P:roll.P + n].tolist() == ref[i, :n].tolist()


def test_stop_strings_end_rows_as_generate_does(tok):
    """A row ends at the token that completes a stop string (kept in the completion and its mask,
    not truncated); greedy completions equal model.generate(stop_strings=...)."""
    model = loading.load_model(loading.DEFAULT_POLICY, "lm", torch.device("cpu"), frozen=True)
    prompts = C.encode_prompts(tok, [r["prompt"] for r in tasks.load_data("").eval_rows[:64]])
    stop = ["8", "12"]  # a one-token and a two-token stop string
    roll = C.sample(model, tok, prompts, 6, greedy=True, stop=stop)
    ids, mask = C.left_pad(prompts, tok.pad_token_id, "cpu")
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                         stop_strings=stop, tokenizer=tok, pad_token_id=tok.pad_token_id)
    ref = ref[:, ids.shape[1]:]
    texts = C.decode_completions(tok, roll)
    n_stopped = 0
    for i, text in enumerate(texts):
        n = int(roll.completion_mask[i].sum())
        assert roll.ids[i, roll.P:roll.P + n].tolist() == ref[i, :n].tolist()
        if any(s in text for s in stop):
            n_stopped += 1
            assert any(text.endswith(s) for s in stop) and not any(s in text[:-1] for s in stop)
            assert not roll.truncated[i] and (n == ref.shape[1] or ref[i, n] == tok.pad_token_id)
    assert 0 < n_stopped < len(texts) and "12" in "".join(texts)


def test_completion_mask_includes_eos_and_nothing_after(tok):
    model = tiny_model("llama", seed=1)
    model.generation_config.eos_token_id = [2, 43, 72]
    roll = C.sample(model, tok, C.encode_prompts(tok, PROMPTS * 4), 10, temperature=1.0)
    eos = torch.tensor([2, 43, 72])
    comp = roll.ids[:, roll.P:]
    for i in range(len(comp)):
        hits = torch.isin(comp[i], eos).nonzero()
        n = int(hits[0]) + 1 if len(hits) else comp.shape[1]
        assert roll.completion_mask[i].tolist() == [1.0] * n + [0.0] * (comp.shape[1] - n)
        assert bool(roll.truncated[i]) == (len(hits) == 0)
    assert (~roll.truncated).any() and roll.truncated.any()


def test_completion_mask_when_pad_equals_eos(tok):
    """pad == eos (as for many hub tokenizers): the mask still comes from lengths and keeps the
    EOS."""
    t = loading.load_tokenizer(loading.DEFAULT_POLICY)
    t.pad_token = t.eos_token
    model = tiny_model("qwen2", seed=1)
    model.generation_config.eos_token_id = [2, 43]
    roll = C.sample(model, t, C.encode_prompts(t, PROMPTS * 3), 10, temperature=1.0)
    comp = roll.ids[:, roll.P:]
    for i in range(len(comp)):
        hits = torch.isin(comp[i], torch.tensor([2, 43])).nonzero()
        n = int(hits[0]) + 1 if len(hits) else comp.shape[1]
        assert int(roll.completion_mask[i].sum()) == n  # the EOS (== pad id 2) is in the mask
    assert ((comp == 2) & (roll.completion_mask == 1)).any()


# ---- common.py: log-probs
def reference_logprobs(model, prompt, completion, temperature):
    """A plain HF forward on one unpadded row, log_softmax over (logits / temperature), gather the
    taken tokens."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1:]


@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_equal_plain_forward_with_left_padding(arch, tok):
    model = tiny_model(arch)
    # frequent tokens of this random model, so rows end early
    model.generation_config.eos_token_id = [2, 43, 72]
    prompts = C.encode_prompts(tok, PROMPTS)
    roll = C.sample(model, tok, prompts, 8, temperature=0.7)
    lp = C.batched_logprobs(model, roll, 0.7, 2, OFF)
    # one row per micro-batch: rows shorter than the batch run on fewer columns; same values,
    # zeros after
    one_by_one = C.batched_logprobs(model, roll, 0.7, 1, OFF)
    torch.testing.assert_close(one_by_one, lp, atol=1e-5, rtol=1e-5)
    for i, p in enumerate(prompts):
        n = int(roll.completion_mask[i].sum())
        comp = roll.ids[i, roll.P:roll.P + n].tolist()
        ref = reference_logprobs(model, p, comp, 0.7)
        torch.testing.assert_close(lp[i, :n], ref, atol=1e-4, rtol=1e-4)
        assert (lp[i, n:] == 0).all()
    # the sampler's own log-probs agree with the recomputed ones (same temperature)
    torch.testing.assert_close(roll.sample_logprobs, lp, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prompt_logprobs_and_grads_equal_row_by_row(arch, tok):
    """GRPO-style groups (each prompt 4 times): token_logprobs runs each prompt once and shares its
    KV cache. Values and parameter gradients must equal plain forwards over each unpadded row."""
    model = tiny_model(arch)
    model.generation_config.eos_token_id = [2, 43, 72]
    # [1]: a 1-token prompt
    prompts = [p for p in C.encode_prompts(tok, PROMPTS) + [[1]] for _ in range(4)]
    roll = C.sample(model, tok, prompts, 8, temperature=0.7)
    T = roll.completion_mask.shape[1]
    # rows differ within groups
    assert len({tuple(r) for r in roll.ids[:, roll.P:].tolist()}) > len(PROMPTS)
    lp, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T, 0.7)
    (lp * roll.completion_mask).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    for i, p in enumerate(prompts):
        n = int(roll.completion_mask[i].sum())
        ref = reference_logprobs(model, p, roll.ids[i, roll.P:roll.P + n].tolist(), 0.7)
        torch.testing.assert_close(lp[i, :n], ref, atol=1e-4, rtol=1e-4)
        ref.sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, atol=1e-4, rtol=1e-3)


def fast_head(model):
    """The head token_logprobs' fast path runs apart (fastpath.exact_head), or None."""
    base = C._unwrap(model)
    return fastpath.exact_head(base.get_output_embeddings(), functools.partial(C._forward, base))


def fast_logprobs(model, ids, mask, T, temperature, entropy=False, chunk_elems=2**22):
    """token_logprobs' fast path with a chosen chunk size (fastpath.final_hidden, head_logprobs)."""
    x, targets = fastpath.final_hidden(functools.partial(C._forward, model), ids, mask, T)
    never = C.suppressed(model, model.lm_head.out_features, ids.device)  # p = 0 for these ids
    default, fastpath.CHUNK_ELEMS = fastpath.CHUNK_ELEMS, chunk_elems
    try:
        lp, ent = fastpath.head_logprobs(x, model.lm_head, targets, temperature, never, entropy)
    finally:
        fastpath.CHUNK_ELEMS = default
    pad = (0, T - targets.shape[1])
    return F.pad(lp, pad), F.pad(ent, pad) if entropy else None


def test_chunked_logprobs_recompute_in_backward_with_the_same_values_and_gradients(
        monkeypatch, tok):
    """Spread over several chunks, the training log-probs keep only the final hidden states for
    backward (fastpath.LinearHeadLogprobs recomputes each chunk's LM head and fp32 log-softmax):
    same values, entropies and gradients as one chunk and as the plain path (bf16: the head's
    matmul on other shapes rounds differently, so to bf16 precision)."""
    model = tiny_model("llama")
    roll = C.sample(model, tok, C.encode_prompts(tok, PROMPTS * 2), 8, temperature=0.7)
    T, V = roll.completion_mask.shape[1], model.config.vocab_size
    chunks, real = [], fastpath._chunk_logprobs
    monkeypatch.setattr(fastpath, "_chunk_logprobs",
                        lambda *a: chunks.append(a[0].shape[:2]) or real(*a))

    def run(chunk_elems, dtype, fast=True):
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16"):
            if fast:
                lp, ent = fast_logprobs(model, roll.ids, roll.attention_mask, T, 0.7,
                                        entropy=True, chunk_elems=chunk_elems)
            else:
                lp, ent = C.plain_token_logprobs(model, roll.ids, roll.attention_mask, T, 0.7,
                                                 entropy=True)
        mask = roll.completion_mask
        (lp * mask).sum().backward()
        return (lp * mask).detach(), ent.detach() * mask, torch.cat([p.grad.flatten()
                                                          for p in model.parameters()])
    assert int(roll.completion_mask.sum(-1).max()) == T
    for dtype in ("fp32", "bf16"):
        one = run(2**24, dtype)
        assert chunks == [(len(roll.ids), T)]
        chunks.clear()
        many = run(3 * T * V, dtype)  # three rows per chunk
        assert chunks == [(3, T)] * (len(roll.ids) // 3) + [(len(roll.ids) % 3, T)]
        chunks.clear()
        plain = run(0, dtype, fast=False)
        for a, b, c in zip(many, one, plain):
            if dtype == "fp32":
                torch.testing.assert_close(a, b)
                torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-4)
            else:
                for x in (a, c):
                    assert float((x - b).norm() / b.norm()) < 2e-2
        chunks.clear()


def test_chunked_head_backward_skips_the_frozen_heads_weight_gradient(monkeypatch):
    """Under LoRA the LM head is frozen: LinearHeadLogprobs.backward builds no V x H weight
    gradient (nor a bias one) for autograd to throw away, and x's gradient is the same."""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 8, requires_grad=True)
    head = torch.nn.Linear(8, 11)
    targets = torch.randint(0, 11, (4, 3))
    blocks = [(slice(0, 2), slice(None)), (slice(2, 4), slice(None))]
    made = []  # the shapes of the gradient buffers backward allocates
    real = torch.zeros_like
    monkeypatch.setattr(fastpath.torch, "zeros_like", lambda t, **kw: made.append(t.shape)
                        or real(t, **kw))

    def grad_x(frozen):
        head.requires_grad_(not frozen)
        head.zero_grad(set_to_none=True)
        x.grad, made[:] = None, []
        lp, _ = fastpath.LinearHeadLogprobs.apply(x, head.weight, head.bias, targets, 0.7, None,
                                                  blocks, False)
        lp.sum().backward()
        return x.grad, list(made)
    trained, frozen = grad_x(False), grad_x(True)
    torch.testing.assert_close(trained[0], frozen[0], rtol=0, atol=0)
    assert head.weight.shape in trained[1] and head.bias.shape in trained[1]
    assert head.weight.shape not in frozen[1] and head.bias.shape not in frozen[1]
    assert head.weight.grad is None


def test_entropy_and_its_gradient_equal_a_plain_forward(tok):
    """With gradients on, the entropy is differentiable (PPO's bonus needs no second flag): its
    value and parameter gradient equal -sum p log p of a plain forward's (logits / temperature),
    also when the head and log-softmax are chunked; under no_grad it has none."""
    model = tiny_model("gpt2")
    roll = C.sample(model, tok, C.encode_prompts(tok, PROMPTS * 2), 8, temperature=0.7)
    T, mask = roll.completion_mask.shape[1], roll.completion_mask
    logits = model(roll.ids, attention_mask=roll.attention_mask,
                   position_ids=C.positions(roll.attention_mask)).logits
    lp = (logits[:, -T - 1:-1] / 0.7).log_softmax(-1)
    ref = -(lp.exp() * lp).sum(-1)
    (ref * mask).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    for chunk_elems in (2**24, 3 * T * model.config.vocab_size):
        model.zero_grad()
        _, ent = fast_logprobs(model, roll.ids, roll.attention_mask, T, 0.7, entropy=True,
                               chunk_elems=chunk_elems)
        torch.testing.assert_close(ent * mask, ref.detach() * mask, atol=1e-5, rtol=1e-5)
        (ent * mask).sum().backward()
        for g, p in zip(want, model.parameters()):
            torch.testing.assert_close(p.grad, g, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        _, ent = C.token_logprobs(model, roll.ids, roll.attention_mask, T, 0.7, entropy=True)
    assert ent.grad_fn is None


def test_batch_order_does_not_change_logprobs(tok):
    model = tiny_model("llama")
    roll = C.sample(model, tok, C.encode_prompts(tok, PROMPTS), 6)
    lp = C.batched_logprobs(model, roll, 1.0, 5, OFF)
    perm = torch.tensor([3, 0, 4, 2, 1])
    rolled = SimpleNamespace(ids=roll.ids[perm], attention_mask=roll.attention_mask[perm],
                             completion_mask=roll.completion_mask[perm], P=roll.P)
    lp_rolled = C.batched_logprobs(model, rolled, 1.0, 2, OFF)
    torch.testing.assert_close(lp_rolled, lp[perm], atol=1e-5, rtol=1e-5)


# ---- real vocabularies (#27)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EXTRA_ROWS = 37  # embedding rows with no token, as real Qwen2.5 (151,936 rows, 151,665 tokens)


def bpe_chat_tokenizer(folder):
    """A real byte-level BPE tokenizer, trained here on a few kB of text (the `tokenizers`
    library, as Qwen's and GPT-2's): ChatML special tokens, <|im_end|> the EOS, a separate pad,
    a chat template. Saved to folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    rng = random.Random(0)
    lines = [f"{a}+{b}={a + b} <answer>{a + b}</answer>" for a, b in
             ((rng.randrange(100), rng.randrange(100)) for _ in range(150))]
    lines += ["What is the sum? Think step by step, then answer.", "Be brief.",
              "The quick brown fox jumps over the lazy dog."] * 5
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    return tok


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    """A small random Qwen2 with that tokenizer, EXTRA_ROWS more embedding rows than tokens, and a
    generation config that stops on two ids (<|im_end|> and <|endoftext|>): its folder."""
    from transformers import Qwen2ForCausalLM
    folder = str(tmp_path_factory.mktemp("chat-qwen2"))
    tok = bpe_chat_tokenizer(folder)
    end, pad = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    cfg = Qwen2Config(vocab_size=len(tok) + EXTRA_ROWS, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      max_position_embeddings=256, eos_token_id=end, pad_token_id=pad,
                      tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # the extra rows are likely: unmasked, the sampler would pick them
        model.lm_head.weight[len(tok):] = model.lm_head.weight[:len(tok)].std() * 20
    model.generation_config.eos_token_id = [end, pad]
    model.save_pretrained(folder)
    return folder


def bigram_chat_model(folder, tmp_path):
    """chat_model with every layer's output zeroed (the last hidden state is the current token's
    embedding) and an LM head that walks one chain: after the generation prompt it writes
    "7</answer>" (several tokens), then <|im_end|>."""
    model = loading.load_model(folder, "lm", torch.device("cpu"))
    tok = loading.load_tokenizer(folder)
    chain = [C.encode_prompts(tok, ["hi"])[0][-1]] + tok("7</answer>")["input_ids"] \
        + [tok.eos_token_id]
    assert len(set(chain)) == len(chain) > 4
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for a, b in zip(chain, chain[1:]):
            head[b] += 10 * emb[a] / emb[a].norm()
    model.save_pretrained(tmp_path / "bigram")
    tok.save_pretrained(tmp_path / "bigram")
    return str(tmp_path / "bigram"), chain


def test_real_tokenizer_encode_sample_decode_logprobs_equal_a_plain_forward(chat_model):
    """Through the chat template: encode -> sample -> decode, and the training log-probs (fast,
    and plain) equal a plain HF forward's over each unpadded row, with the untokenized rows
    masked (suppressed) in both."""
    tok = loading.load_tokenizer(chat_model)
    model = loading.load_model(chat_model, "lm", torch.device("cpu"))
    assert tok.pad_token_id != tok.eos_token_id and C.eos_ids(model, tok) == sorted(
        tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"]))
    assert model.generation_config.suppress_tokens == list(range(len(tok), len(tok) + 37))
    prompts = C.encode_prompts(tok, ["12+30=", "What is the sum?", "Be brief."] * 2)
    assert tok.decode(prompts[0]) == "<|im_start|>user\n12+30=<|im_end|>\n<|im_start|>assistant\n"
    torch.manual_seed(0)
    roll = C.sample(model, tok, prompts, 12, temperature=1.0)
    assert (roll.ids[:, roll.P:] < len(tok)).all()  # unmasked, the boosted extra rows would win
    texts = C.decode_completions(tok, roll)
    assert all(isinstance(t, str) for t in texts) and any(texts)
    never = torch.arange(model.config.vocab_size) >= len(tok)
    T = roll.completion_mask.shape[1]
    with torch.no_grad():
        fast, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T)
        plain, _ = C.plain_token_logprobs(model, roll.ids, roll.attention_mask, T)
        for i, p in enumerate(prompts):
            n = int(roll.completion_mask[i].sum())
            ids = torch.tensor([p + roll.ids[i, roll.P:roll.P + n].tolist()])
            logits = model(ids).logits[0, len(p) - 1:-1].masked_fill(never, -math.inf)
            want = logits.log_softmax(-1).gather(-1, ids[0, len(p):, None])[:, 0]
            torch.testing.assert_close(fast[i, :n], want, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(plain[i, :n], want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(roll.sample_logprobs, fast * roll.completion_mask, atol=1e-5,
                               rtol=1e-5)


def test_real_tokenizer_system_prompt_adds_a_chat_turn(chat_model):
    tok = loading.load_tokenizer(chat_model)
    rows = tasks.load_data("", eval_size=4, system_prompt="Be brief.").eval_rows
    text = tok.decode(C.encode_prompts(tok, [rows[0]["prompt"]])[0])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")


def test_multi_token_stop_string_ends_a_row_on_its_last_token_and_sanity_passes(chat_model,
                                                                                 tmp_path):
    """The bigram model writes "7</answer>" then <|im_end|>: with --stop </answer> each row ends on
    the last token of the stop string (not truncated, mask 1 up to it), and --sanity accepts
    that ending; with every row truncated, its mask check fails instead of passing unchecked."""
    folder, chain = bigram_chat_model(chat_model, tmp_path)
    model = loading.load_model(folder, "lm", torch.device("cpu"))
    tok = loading.load_tokenizer(folder)
    prompts = C.encode_prompts(tok, ["1+2=", "What is the sum?"] * 2)
    for stop, want in ((["</answer>"], chain[1:-1]), ([], chain[1:])):
        roll = C.sample(model, tok, prompts, 10, greedy=True, stop=stop)
        assert len(chain[1:-1]) > 2 and not roll.truncated.any()
        assert roll.completion_mask.tolist() == [[1.0] * len(want)] * 4
        assert roll.ids[:, roll.P:].tolist() == [want] * 4
    rows = [{"prompt": p} for p in ["1+2=", "What is the sum?"]]
    args = SimpleNamespace(chat_template="auto", max_new_tokens=10, temperature=1.0, top_p=1.0,
                           micro_batch_size=4, dtype="fp32", stop=["</answer>"])
    assert runs.sanity_check(model, model, tok, rows, args) == []
    args.max_new_tokens = 2  # every row truncated: the mask check has nothing to check
    failed = runs.sanity_check(model, model, tok, rows, args)
    assert failed == ["completion_mask ends on the EOS or a stop string"]


def test_sampling_puts_only_the_last_position_through_the_lm_head(chat_model):
    """The prefill and every decode step make (rows, 1, V) logits, never (B, P, V)."""
    model = loading.load_model(chat_model, "lm", torch.device("cpu"))
    tok = loading.load_tokenizer(chat_model)
    shapes = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    C.sample(model, tok, C.encode_prompts(tok, ["1+2=", "Be brief.", "1+2="]), 5)
    C.sample(model, tok, C.encode_prompts(tok, ["1+2=", "Be brief."]), 5, share_prompts=False)
    hook.remove()
    assert shapes and all(s[1] == 1 for s in shapes)


def test_logprobs_never_make_the_full_logits(chat_model, monkeypatch):
    """With gradients, the fast path's LM head sees at most chunk_elems / V positions at a time,
    forward and backward; values and gradients equal the plain path's."""
    model = loading.load_model(chat_model, "lm", torch.device("cpu"))
    tok = loading.load_tokenizer(chat_model)
    torch.manual_seed(0)
    roll = C.sample(model, tok, C.encode_prompts(tok, ["1+2=", "What is the sum?"] * 3), 12)
    T, V = roll.completion_mask.shape[1], model.config.vocab_size
    sizes, blocks, real = [], [], fastpath.LinearHeadLogprobs.apply
    hook = model.lm_head.register_forward_hook(lambda m, i, o: sizes.append(tuple(o.shape[:-1])))
    monkeypatch.setattr(fastpath.LinearHeadLogprobs, "apply",  # the chunks of both passes
                        lambda *a: blocks.append(a[6]) or real(*a))

    def grads(fast):
        model.zero_grad()
        lp, ent = fast_logprobs(
            model, roll.ids, roll.attention_mask, T, 0.7, True, chunk_elems=5 * V
        ) if fast else C.plain_token_logprobs(model, roll.ids, roll.attention_mask, T, 0.7,
                                              True)
        ((lp + 0.1 * ent) * roll.completion_mask).sum().backward()
        return [lp.detach(), ent.detach()] + [p.grad.clone() for p in model.parameters()]
    fast = grads(True)
    # the head module: the forwards' logits_to_keep=1 only; the chunks, forward and backward:
    # blocks of one row and <= 5 positions, covering every position
    assert sizes and all(s[1] == 1 for s in sizes)
    assert len(blocks) == 1
    assert all(b[0].stop - b[0].start == 1 and b[1].stop - b[1].start <= 5 for b in blocks[0])
    assert len(blocks[0]) == 6 * -(-T // 5)
    hook.remove()
    for a, b in zip(fast, grads(False)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_logprobs_with_lora_on_the_lm_head_take_the_plain_path(chat_model, capsys):
    """peft wraps the LM head when it is targeted: a new module, not an nn.Linear, so
    fastpath.exact_head says no and token_logprobs takes its plain path (said at load), the adapter
    in it (and off inside adapters_off). LoRA elsewhere keeps the fast path, with the plain
    path's numbers."""
    tok = loading.load_tokenizer(chat_model)
    prompts = C.encode_prompts(tok, ["1+2=", "Be brief."] * 2)  # shared prompts
    for targets in ("q_proj,lm_head", "q_proj,v_proj"):
        args = SimpleNamespace(model=chat_model, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                               lora_target_modules=targets, trust_remote_code=False,
                               compile=False, gradient_checkpointing=False)
        model, _ = loading.load_policy(args, torch.device("cpu"))
        on_head = targets.endswith("lm_head")
        assert ("LoRA on the LM head" in capsys.readouterr().out) == on_head
        assert (fast_head(model) is None) == on_head
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)  # adapters that change the output
        torch.manual_seed(0)
        roll = C.sample(model, tok, prompts, 8)
        T = roll.completion_mask.shape[1]

        def run(fast):
            model.zero_grad()
            logprobs = C.token_logprobs if fast else C.plain_token_logprobs
            lp, _ = logprobs(model, roll.ids, roll.attention_mask, T)
            (lp * roll.completion_mask).sum().backward()
            return [lp.detach()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
        plain = run(False)
        for a, b in zip(run(True), plain):
            tol = 0 if on_head else 1e-5  # the plain path itself, or the fast path's rounding
            torch.testing.assert_close(a, b, atol=tol, rtol=tol * 10)
        with torch.no_grad(), runs.adapters_off(model):
            off, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T)
        assert (off - plain[0]).abs().max() > 1e-3  # the adapter was in the log-probs


def test_the_logprob_path_is_decided_from_the_model_itself(tmp_path, tok, capsys):
    """A model whose logits are not its LM head applied to its last hidden state (Gemma 2
    soft-caps them: c tanh(z / c)) fails fastpath.exact_head's check (said once), so
    token_logprobs takes its plain path: the model's own logits, where the fast path would be
    wrong. A model built by hand, never loaded by load_model, takes the fast path: its head
    qualifies, and the numbers equal the plain path's."""
    from transformers import Gemma2Config
    cfg = Gemma2Config(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=64, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, final_logit_softcapping=0.1,
                       architectures=["Gemma2ForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gemma2")
    capped = loading.load_model(str(tmp_path / "gemma2"), "lm", torch.device("cpu"))
    assert fast_head(capped) is None and fast_head(capped) is None  # checked once
    assert capsys.readouterr().out.count("logits are not a linear LM head") == 1
    torch.manual_seed(1)
    by_hand = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    assert fast_head(by_hand) is by_hand.lm_head
    for model in (capped, by_hand):
        roll = C.sample(model, tok, C.encode_prompts(tok, PROMPTS), 6, temperature=0.7)
        T = roll.completion_mask.shape[1]
        lp, ent = C.token_logprobs(model, roll.ids, roll.attention_mask, T, 0.7, entropy=True)
        want, want_ent = C.plain_token_logprobs(model, roll.ids, roll.attention_mask, T, 0.7,
                                                entropy=True)
        if model is capped:  # the plain path itself
            assert torch.equal(lp, want) and torch.equal(ent, want_ent)
            wrong, _ = fast_logprobs(capped, roll.ids, roll.attention_mask, T, 0.7)
            assert ((wrong - want) * roll.completion_mask).abs().max() > 1e-2
        else:  # the fast path, to rounding
            torch.testing.assert_close(lp, want, atol=1e-5, rtol=1e-4)


def test_fsdp_policy_takes_the_plain_logprob_path(capsys, tmp_path):
    """--fsdp: FSDP2 (runs.wrap_model) shards the LM head's weight (a DTensor), so
    fastpath.exact_head says no and token_logprobs takes the plain path; load_policy says so (the
    2-process runs against 1 process: test_two_processes_make_the_one_process_update). A one-
    process gloo group in this process."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    args = SimpleNamespace(model=loading.DEFAULT_POLICY, lora_r=0, trust_remote_code=False,
                           compile=False, gradient_checkpointing=False, fsdp=True)
    model, tok = loading.load_policy(args, torch.device("cpu"))
    assert "--fsdp shards the LM head's weight" in capsys.readouterr().out
    assert fast_head(model) is model.lm_head  # not sharded yet
    del model.lm_head.exact_logits
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    try:
        fully_shard(model)
        assert fast_head(model) is None
        assert not hasattr(model.lm_head, "exact_logits")  # no check forward: refused before
    finally:
        dist.destroy_process_group()


def test_ddp_policy_and_its_unwrapped_reference_give_bit_equal_logprobs(tmp_path):
    """Under torchrun the DDP-wrapped policy and the unwrapped reference compute log-probs alike,
    bit for bit (neither shares prompts), so with zero advantages and policy = reference GRPO's
    gradient is exactly 0, not rounding that Adam would turn into a full step. A one-process gloo
    group in this process: the paths are the same as with several."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    model = tiny_model("qwen2")
    tok = loading.load_tokenizer(loading.DEFAULT_POLICY)
    prompts = [p for p in C.encode_prompts(tok, PROMPTS) for _ in range(4)]  # GRPO groups
    roll = C.sample(model, tok, prompts, 8)
    T = roll.completion_mask.shape[1]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        ref = C.batched_logprobs(model, roll, 1.0, len(prompts), OFF)
        lp, _ = C.token_logprobs(ddp, roll.ids, roll.attention_mask, T)
        assert torch.equal(lp.detach() * roll.completion_mask, ref)
        loss, *_ = grpo.per_token_loss(lp, lp.detach(), torch.zeros(len(lp)), None,
                                       grpo.Args(), ref)
        (loss * roll.completion_mask).sum().backward()
        assert all(float(p.grad.abs().max()) == 0 for p in model.parameters())
    finally:
        dist.destroy_process_group()


def test_reward_model_names_its_eval_row_pair_accuracy_not_greedy(monkeypatch, tmp_path):
    """reward_model.py's held-out table row is the pair accuracy (chosen scored above rejected):
    no greedy decoding is involved."""
    seen = {}
    monkeypatch.setattr(runs, "finish_run", lambda *a, **kw: seen.update(metric=a[1], **kw))
    run_main(monkeypatch, reward_model, "--max_steps", 1, "--eval_every", 0, "--eval_size", 8,
             "--output_dir", tmp_path / "rm")
    assert seen["metric"] == "pair accuracy" and seen["label"] == "chosen > rejected"


@pytest.mark.parametrize("module", [grpo, R, ppo, dpo])
def test_scripts_run_on_the_real_tokenizer_model(module, chat_model, tmp_path, monkeypatch):
    """One short run of each RL script (and DPO) on the BPE/ChatML model with extra rows."""
    flags = {grpo: ["--group_size", "4", "--prompts_per_step", "2", "--micro_batch_size", "8",
                    "--stop", "</answer>", "--beta", "0.04"],
             R: ["--samples_per_prompt", "2", "--prompts_per_step", "2"],
             ppo: ["--batch_size", "8", "--critic_init", "policy"],
             dpo: ["--batch_size", "4"]}[module]
    run_main(monkeypatch, module, "--model", chat_model, "--max_steps", "1", "--eval_every", "0",
             "--save_every", "0", "--eval_size", "4", "--max_new_tokens", "6",
             "--output_dir", tmp_path / "run", *flags)
    steps = read_metrics(tmp_path / "run")
    assert len(steps) == 1 and all(math.isfinite(v) for v in steps[0].values()
                                   if isinstance(v, float))


# ---- common.py: KL
def test_kl_estimators_against_exact_kl():
    """On samples from p, k1 and k3 average to KL(p || q); k3 is never negative."""
    torch.manual_seed(0)
    p = torch.distributions.Categorical(logits=torch.randn(6))
    q = torch.distributions.Categorical(logits=torch.randn(6))
    x = p.sample((200000,))
    exact = torch.distributions.kl_divergence(p, q)
    for est in ("k1", "k3"):
        k = C.kl_estimate(p.log_prob(x), q.log_prob(x), est)
        assert abs(float(k.mean()) - float(exact)) < 0.02
    assert (C.kl_estimate(p.log_prob(x), q.log_prob(x), "k3") >= 0).all()
    assert (C.kl_estimate(p.log_prob(x), q.log_prob(x), "k2") >= 0).all()


def test_only_k3_clamps_the_log_ratio():
    lp, ref = torch.tensor([0.0, 0.0]), torch.tensor([-30.0, 30.0])  # log r = -30, 30
    torch.testing.assert_close(C.kl_estimate(lp, ref, "k1"), torch.tensor([30.0, -30.0]))
    torch.testing.assert_close(C.kl_estimate(lp, ref, "k2"), torch.tensor([450.0, 450.0]))
    assert torch.isfinite(C.kl_estimate(lp, ref, "k3")).all()


# ---- common.py: rewards
def test_rule_rewards():
    assert C.math_reward("85", {"answer": "85"}) == 1.0
    assert C.math_reward("The answer is 1,004.", {"answer": "#### 1004"}) == 1.0
    assert C.math_reward("75", {"answer": "85"}) == 0.0
    assert C.math_reward("", {"answer": "85"}) == 0.0
    weights = {"math": 1.0, "format": 0.5}
    total, parts = C.compute_rewards([{"answer": "3"}] * 2, ["so \\boxed{3}", "So:\n#### 4"],
                                     weights)
    assert total.tolist() == [1.5, 0.5] and parts["math"].tolist() == [1.0, 0.0]
    # format: a final answer as \boxed{...} or a last line '#### N', nothing else
    for text, want in (("85", 0), ("the sum is 85", 0), ("\\boxed{85}", 1), ("\\boxed{ }", 0),
                       ("1+2\n#### 3", 1), ("#### 1,004.5", 1), ("#### 3 and more", 0),
                       ("x #### 3", 0), ("\\boxed{3} because", 1)):
        assert C.format_reward(text, {}) == want, text


def test_reward_model_batch_equals_one_by_one(tok):
    rm = tiny_rm()
    prompts, comps = ["1+2=", "37+48=", "5+999="], ["3", "85", "1004 is the answer"]
    batch = C.rm_scores(rm, tok, prompts, comps)
    one = torch.cat([C.rm_scores(rm, tok, [p], [c]) for p, c in zip(prompts, comps)])
    torch.testing.assert_close(batch, one, atol=1e-5, rtol=1e-5)
    # and equals HF's own pooling on an unpadded row (the score of the last token)
    ids = torch.tensor([tok(prompts[2] + comps[2])["input_ids"] + [tok.eos_token_id]])
    torch.testing.assert_close(batch[2], rm(ids).logits[0, 0], atol=1e-5, rtol=1e-5)


# ---- common.py: eval
def test_without_answers_eval_is_the_mean_reward_and_gold_is_not_logged(tmp_path):
    """Prompts with no answers (e.g. for a reward model): the held-out score is the mean of the
    run's --rewards on greedy completions (checked against HF generate and hand-written rewards),
    and no `gold` is made up."""
    rows = [{"prompt": f"{a}+{b}="} for a, b in tasks.task_train_pairs(random.Random(5), 12)]
    tok = loading.load_tokenizer(loading.DEFAULT_POLICY)
    model = loading.load_model(loading.DEFAULT_POLICY, "lm", torch.device("cpu"))
    args = SimpleNamespace(chat_template="auto", max_new_tokens=6, stop=[],
                           rewards="format=1,length=0.5", reward_model="")
    want = []
    for r in rows:
        ids = torch.tensor([tok(r["prompt"])["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=6,
                             do_sample=False, pad_token_id=tok.pad_token_id)
        text = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        formatted = "\\boxed{" in text or "####" in text  # never, for this model
        want.append(float(formatted) - 0.5 * len(text) / 100)
    weights = loading.parse_rewards(args.rewards, args.reward_model)
    score = C.evaluate(model, tok, rows, args, OFF, weights, batch_size=5)["eval"]
    assert score == pytest.approx(sum(want) / len(want), abs=1e-6)
    assert C.gold(["5", "4"], [{"prompt": "x", "answer": "5"}] * 2) == {"gold": 0.5}
    assert C.gold(["5", "4"], [{"prompt": "x", "answer": "5"}, {"prompt": "y"}]) == {}
    data = tmp_path / "d.jsonl"
    out = tmp_path / "out"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 3))
    r = run_script("grpo.py", "--data", str(data), "--rewards", "length", "--max_steps", "2",
                   "--eval_size", "4", "--output_dir", str(out))
    assert r.returncode == 0 and "held-out mean reward" in r.stdout, r.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_metric"] == "mean reward"
    assert -0.5 < summary["eval_before"] < 0  # short answers: a small length penalty
    assert not any("gold" in m for m in read_metrics(out))


# ---- common.py: your own task (data fields, reward functions, what eval measures)
REWARD_FILE = '''
import sys


def exact(completions, rows):
    return [float(c.strip() == row["target"]) for c, row in zip(completions, rows)]


def shout(completions, rows):
    raise ValueError("no")


def short(completions, rows):
    return [1.0]


def words(completions, rows):
    return ["good" for _ in completions]


def quits(completions, rows):
    sys.exit(0)


def ctrl_c(completions, rows):
    raise KeyboardInterrupt


def one_row(completions, rows):
    return [1 / (row["target"] != "4") for row in rows]


def exits_later(completions, rows):  # sys.exit(0) at its second call, after step 1 is logged
    exits_later.calls = getattr(exits_later, "calls", 0) + 1
    return [0.0] * len(completions) if exits_later.calls == 1 else sys.exit(0)
'''


def test_a_reward_that_calls_sys_exit_stops_in_one_line_and_keeps_the_run(tmp_path, monkeypatch,
                                                                          capsys):
    """sys.exit(0) inside a reward function used to end the run with exit 0, silently, and
    remove its folder: now one line, exit 2, and the folder keeps step 1 and its checkpoint."""
    (tmp_path / "mine.py").write_text(REWARD_FILE)
    out, spec = tmp_path / "run", f"{tmp_path / 'mine.py'}:exits_later"
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *FAST_GRPO, "--reward_fn", spec, "--max_steps", "3",
                 "--save_every", "1", "--output_dir", out, guard=True)
    line = one_error_line(capsys)
    assert e.value.code == 2 and line == "error: reward 'exits_later' raised SystemExit: 0", line
    assert [m["step"] for m in read_metrics(out)] == [1]
    assert torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=True)["step"] == 1


def test_a_user_reward_file_is_weighted_logged_and_learned(tmp_path, monkeypatch):
    """A reward function from the user's own file, reading an extra data field, drives GRPO:
    the held-out score rises, and reward/exact is logged."""
    (tmp_path / "mine.py").write_text(REWARD_FILE)
    rng = random.Random(0)
    with open(tmp_path / "data.jsonl", "w") as f:
        for a, b in tasks.task_train_pairs(rng, 300):
            row = {"question": f"{a}+{b}=", "target": str(a + b), "answer": f"the sum: {a + b}"}
            f.write(json.dumps(row) + "\n")
    out = tmp_path / "out"
    run_main(monkeypatch, grpo, "--data", str(tmp_path / "data.jsonl"), "--reward_fn",
             f"{tmp_path / 'mine.py'}:exact", "--max_steps", "25", "--eval_size", "60",
             "--eval_every", "0", "--eval_samples", "2", "--output_dir", str(out))
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert summary["eval_metric"] == "accuracy"  # every answer holds a number
    assert summary["eval_after"] >= summary["eval_before"] + 0.2, summary
    after = summary["evals"]["after"]
    assert after["eval_pass@2"] >= after["eval_mean@2"] - 1e-9
    assert "reward/exact" in metrics[0] and "reward/math" not in metrics[0]


def test_user_reward_errors_name_the_reward_and_the_row(tmp_path):
    (tmp_path / "mine.py").write_text(REWARD_FILE)
    fns = loading.load_reward_fns([f"{tmp_path / 'mine.py'}:exact,{tmp_path / 'mine.py'}:shout",
                             f"{tmp_path / 'mine.py'}:short", f"{tmp_path / 'mine.py'}:words"])
    rows = [{"prompt": "1+1=", "target": "2"}, {"prompt": "2+2=", "target": "4"}]
    assert fns["exact"](["2", "5"], rows).tolist() == [1.0, 0.0]
    fns.update(loading.load_reward_fns([f"{tmp_path / 'mine.py'}:{n}"
                                        for n in ("quits", "ctrl_c", "one_row")]))
    for name, message in (("shout", "reward 'shout' raised ValueError: no"),
                          ("short", "returned 1 values for 2 completions"),
                          ("words", "returned 'good' for row 0: not a number"),
                          ("quits", "reward 'quits' raised SystemExit: 0"),
                          ("ctrl_c", "reward 'ctrl_c' raised KeyboardInterrupt"),
                          ("one_row", "raised ZeroDivisionError: division by zero (first on row "
                                      "1, prompt '2+2=')")):
        with pytest.raises(C.UserError, match=re.escape(message)):
            fns[name](["2", "5"], rows)
    for spec, message in (("nofile.py:f", "file 'nofile.py' not found"),
                          (f"{tmp_path / 'mine.py'}:missing", "has no function 'missing'"),
                          ("nosuchmodule:f", "importing 'nosuchmodule' failed"),
                          (f"{tmp_path / 'mine.py'}", "write path/to/file.py:function")):
        with pytest.raises(C.UserError, match=re.escape(message)):
            loading.load_reward_fns([spec])
    weights = loading.parse_rewards("", "", fns)
    assert weights == dict.fromkeys(fns, 1.0)  # no --rewards: each function once
    assert loading.parse_rewards("", "", {}) == {"math": 1.0}


def test_rows_keep_every_field_chat_prompts_and_system_prompt(tmp_path, monkeypatch, tok):
    fake = SimpleNamespace(load_dataset=lambda name, *config, split: [
        {"problem": f"{name} {split} {i}", "solution": f"so \\boxed{{{i}}}", "level": i}
        for i in range(10)])
    monkeypatch.setitem(sys.modules, "datasets", fake)
    data = tasks.load_data("hf:org/set", eval_size=2, need_answer=True, split="test")
    assert {r["prompt"] for r in data.rows} == {f"org/set test {i}" for i in range(10)}
    # every column is kept
    assert all(r["level"] == tasks.final_number(r["answer"]) for r in data.rows)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+2="}]
    (tmp_path / "d.jsonl").write_text(json.dumps({"q": chat, "a": 3}) + "\n"
                                      + json.dumps({"q": "2+2=", "a": 4}) + "\n")
    rows = tasks.read_rows(str(tmp_path / "d.jsonl"), prompt_field="q", answer_field="a",
                       system_prompt="Add.")
    assert rows[0]["prompt"] == chat  # its own system message is kept
    assert rows[1]["prompt"] == [{"role": "system", "content": "Add."},
                                 {"role": "user", "content": "2+2="}]
    want = tok("Add.\n\n2+2=")["input_ids"]
    assert C.encode_prompts(tok, [rows[1]["prompt"]], "none")[0] == want
    templated = loading.load_tokenizer(loading.DEFAULT_POLICY)
    templated.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}; "
                               "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")
    ids = C.encode_prompts(templated, [rows[1]["prompt"]])[0]
    assert templated.decode(ids) == "system: Add.; user: 2+2=; assistant: "


def test_answers_in_boxes_fractions_and_math_verify(monkeypatch):
    assert tasks.final_number("so \\boxed{\\frac{1}{2}} and 7") == 0.5
    assert tasks.final_number("#### 1,234") == 1234.0
    assert tasks.final_number("3/4 of it") == 0.75
    assert tasks.final_number("\\boxed{x^{2}}") is None  # not read by its last digit
    assert C.math_reward("\\boxed{\\dfrac{3}{4}}", {"answer": "0.75"}) == 1.0
    calls = []
    fake = SimpleNamespace(parse=lambda s: calls.append(s) or s, verify=lambda a, b: a == b)
    monkeypatch.setattr(C, "math_verify", fake)
    assert C.math_reward("x", {"answer": "x"}) == 1.0 and calls == ["x", "x"]


def test_math_answers_that_are_not_numbers_are_compared_as_written(monkeypatch, tmp_path):
    """Without math-verify a MATH answer that is no plain number is not read by its last digits:
    it is compared as an expression; the bundled task's and GSM8K's numbers score as before."""
    monkeypatch.setattr(C, "math_verify", None)

    def score(completion, answer):
        return C.math_reward(completion, {"answer": answer})
    for answer in ("\\boxed{(1,2)}", "(1,2)", "(1, 2)"):
        assert score("\\boxed{12}", answer) == 0 and score("so \\boxed{(1,\\!2)}", answer) == 1
    assert score("\\boxed{2}", "\\frac{\\sqrt{3}}{2}") == 0
    assert score("\\boxed{\\dfrac{\\sqrt{3}}{2}}", "$\\frac{\\sqrt{3}}{2}$") == 1
    assert score("\\boxed{\\pi}", "\\pi") == 1 and score("\\boxed{3}", "\\pi") == 0
    assert score("\\boxed{1,234}", "1234") == 1 and score("\\boxed{\\frac{1}{2}}", "0.5") == 1
    assert score("46", "46") == 1 and score("46a", "46") == 1 and score("4a", "46") == 0
    assert score("so 1,234 in all.\n#### 1,234", "1,000 + 234 = 1,234\n#### 1234") == 1
    assert score("The answer is 42.", "The answer is 42") == 1  # a sentence: its last number
    assert C.final_answer("A", reference=True) is None  # a letter is not maths
    path = tmp_path / "math.jsonl"  # the data check reads \pi too, so the file is not refused
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": a}) + "\n"
                            for i, a in enumerate(["\\pi", "\\boxed{(1,2)}", "#### 7"])))
    rows = tasks.read_rows(str(path), need_answer=True)
    assert C.has_numbers(rows) and tasks.eval_metric(rows) == "accuracy"
    assert C.gold(["\\boxed{\\pi}", "\\boxed{(1, 2)}", "#### 8"], rows) == {"gold": 2 / 3}


def test_eval_reward_math_on_text_answers_is_refused_and_auto_uses_the_rewards():
    rows = [{"prompt": "a", "answer": "yes"}, {"prompt": "b", "answer": "no"}]
    with pytest.raises(C.UserError, match="would be 0 whatever the model says"):
        tasks.eval_metric(rows, "math")
    assert tasks.eval_metric(rows, "auto") == "mean reward"
    assert tasks.eval_metric([{"prompt": "a", "answer": "#### 3"}], "auto") == "accuracy"


# ---- common.py: LoRA
def lora_args(**kw):
    return SimpleNamespace(**{"model": loading.DEFAULT_POLICY, "trust_remote_code": False,
                              "compile": False, "gradient_checkpointing": False, "lora_r": 8,
                              "lora_alpha": 32, "lora_dropout": 0.0,
                              "lora_target_modules": "all-linear", **kw})


def test_lora_reference_is_the_base_and_merged_checkpoints_match(tmp_path, tok):
    """With adapters off the LoRA policy computes exactly as the separately loaded base (so no
    second copy is needed); the merged checkpoint gives the adapter model's log-probs."""
    pytest.importorskip("peft")
    cpu = torch.device("cpu")
    model, _ = loading.load_policy(lora_args(), cpu)
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    torch.manual_seed(0)
    with torch.no_grad():  # as after some training: B != 0
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    base = loading.load_model(loading.DEFAULT_POLICY, "lm", cpu)
    roll = C.sample(base, tok, C.encode_prompts(tok, PROMPTS[:4] * 2), 6)
    base_lp = C.batched_logprobs(base, roll, 1.0, 8, OFF)
    with runs.adapters_off(model):
        torch.testing.assert_close(C.batched_logprobs(model, roll, 1.0, 8, OFF), base_lp)
    lora_lp = C.batched_logprobs(model, roll, 1.0, 8, OFF)
    assert (lora_lp - base_lp).abs().max() > 1e-3  # the adapters do change the policy
    run = tmp_path / "run"
    model.save_pretrained(run / "checkpoint")
    tok.save_pretrained(run / "checkpoint")
    (run / "checkpoint" / "args.json").write_text(json.dumps(
        {"algo": "grpo", "args": vars(lora_args())}))
    merged = loading.load_model(merge_lora(str(run)), "lm", cpu)
    torch.testing.assert_close(C.batched_logprobs(merged, roll, 1.0, 8, OFF), lora_lp,
                               atol=1e-5, rtol=1e-5)
    resumed, _ = loading.load_policy(lora_args(), cpu, str(run / "checkpoint"))
    torch.testing.assert_close(C.batched_logprobs(resumed, roll, 1.0, 8, OFF), lora_lp)


def test_lora_without_peft_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(C.UserError, match="needs the optional package peft"):
        loading.load_policy(lora_args(), torch.device("cpu"))


@pytest.mark.parametrize("script,flags", [
    ("grpo", ["--lr", "1e-3", "--max_steps", "30"]),
    ("reinforce", ["--lr", "1e-3", "--baseline", "rloo", "--beta", "0.05", "--max_steps", "30"]),
    ("ppo", ["--lr", "2e-3", "--rewards", "math", "--critic_init", "policy", "--max_steps", "15"])])
def test_lora_runs_learn_on_the_bundled_task_and_resume(script, flags, tmp_path, monkeypatch):
    """Only the adapters train, the reference is the policy with them off, and it learns; the
    adapter-only checkpoint resumes."""
    pytest.importorskip("peft")
    module = {"grpo": grpo, "reinforce": R, "ppo": ppo}[script]
    out = tmp_path / "run"
    run_main(monkeypatch, module, "--lora_r", "16", *flags, "--eval_every", "0", "--eval_size",
             "100", "--output_dir", str(out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_after"] >= summary["eval_before"] + 0.2, summary
    assert (out / "checkpoint" / "adapter_model.safetensors").exists()
    n = summary["steps"]
    run_main(monkeypatch, module, "--resume", str(out), "--max_steps", str(n + 1))
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, n + 2))


# ---- runs.py: run folders, memory, charts
def test_one_run_per_folder_and_stale_locks_are_taken(tmp_path):
    busy, stale = tmp_path / "busy", tmp_path / "stale"
    for folder, pid in ((busy, os.getppid()), (stale, 2**22 + 12345)):  # alive / no such process
        folder.mkdir()
        (folder / "run.lock").write_text(str(pid))
    args = grpo.Args(output_dir=str(busy))
    with pytest.raises(C.UserError, match=f"in use by a run in process {os.getppid()}"):
        runs.start_run(args, "grpo")
    run = runs.start_run(grpo.Args(output_dir=str(stale)), "grpo")
    assert (stale / "run.lock").read_text() == str(os.getpid())
    run.metrics.close()
    run.samples.close()
    runs._release_lock(run.dir)


def test_peak_memory_without_proc_or_resource_is_unknown_not_a_crash(monkeypatch):
    """Windows has neither /proc/self/status nor the `resource` module: the first step must not
    crash on it."""
    real_open = builtins.open

    def open_without_proc(f, *a, **k):
        if str(f).startswith("/proc/"):
            raise FileNotFoundError(f)
        return real_open(f, *a, **k)
    monkeypatch.setattr(builtins, "open", open_without_proc)
    monkeypatch.setattr(runs, "resource", None)  # as runs.py's `import resource` leaves it there
    assert math.isnan(runs.peak_mem_mb(torch.device("cpu")))


def test_spark_skips_nan_and_prints_ascii_where_blocks_cannot_be_encoded(monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="utf-8"))
    # a NaN step (update skipped) is left out
    assert runs.spark([0.0, float("nan"), 1.0, 2.0]) == "▁▄█  [0 .. 2]"
    # Windows, redirected
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BytesIO(), encoding="cp1252"))
    assert runs.spark([0.0, 1.0, 2.0]) == "_~#  [0 .. 2]"


# ---- grpo.py
def test_group_advantages_match_slow_reference():
    torch.manual_seed(0)
    r = torch.randint(0, 3, (6 * 4,)).float()
    r[:4] = 1.0  # one group with all-equal rewards
    for scale in ("group", "batch", "none"):
        got = grpo.group_advantages(r, 4, scale)
        for g in range(6):
            grp = r[g * 4:(g + 1) * 4].tolist()
            mean = sum(grp) / 4
            std = (sum((x - mean) ** 2 for x in grp) / 3) ** 0.5  # unbiased, as torch.std
            for j in range(4):
                want = grp[j] - mean
                if scale == "group":
                    want /= std + 1e-4
                elif scale == "batch":
                    want /= float(r.std()) + 1e-4
                assert abs(float(got[g * 4 + j]) - want) < 1e-5
    assert (grpo.group_advantages(r, 4)[:4] == 0).all()


def slow_aggregate(loss, mask, mode, max_new_tokens):
    rows = [[float(loss[i, t]) for t in range(loss.shape[1]) if mask[i, t]]
            for i in range(len(loss))]
    if mode == "token-mean":
        return sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    if mode == "seq-mean-token-mean":
        return sum(sum(r) / len(r) for r in rows) / len(rows)
    return sum(sum(r) for r in rows) / (len(rows) * max_new_tokens)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-sum-norm"])
def test_loss_aggregation_matches_hand_written_reference(mode):
    torch.manual_seed(0)
    loss = torch.randn(6, 5)
    lengths = torch.tensor([1, 5, 3, 2, 4, 5])
    mask = (torch.arange(5)[None] < lengths[:, None]).float()
    got = grpo.aggregate(loss, mask, mode, mask.sum(), 6, 5)
    assert abs(float(got) - slow_aggregate(loss, mask, mode, 5)) < 1e-5


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-sum-norm"])
def test_micro_batched_gradient_equals_full_batch_gradient(mode, tok):
    """The normaliser covers the whole optimizer step, so gradient accumulation does not change the
    gradient."""
    model = tiny_model("llama", seed=3)
    model.generation_config.eos_token_id = [2, 43, 72]
    roll = C.sample(model, tok, C.encode_prompts(tok, PROMPTS + PROMPTS[:3]), 8)
    mask, T = roll.completion_mask, roll.completion_mask.shape[1]
    # rows of different lengths, or the test proves nothing
    assert len(set(mask.sum(-1).tolist())) > 1
    adv = torch.randn(len(mask))
    # ratio != 1
    old = C.batched_logprobs(model, roll, 1.0, 8, OFF) + 0.05 * torch.randn(mask.shape)

    def grads(mb):
        model.zero_grad()
        for s in C.micro_batches(mask, mb):  # as grpo.py and reinforce.py split a step
            lp, _ = C.token_logprobs(model, roll.ids[s], roll.attention_mask[s], T)
            loss = grpo.per_token_loss(lp, old[s], adv[s], None, grpo.Args())[0]
            grpo.aggregate(loss, mask[s], mode, mask.sum(), len(mask), 8).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    rows = torch.cat(C.micro_batches(mask, 3))  # every row once, shortest completions first
    assert sorted(rows.tolist()) == list(range(len(mask)))
    assert (mask.sum(-1)[rows].diff() >= 0).all()
    full, micro, single = grads(8), grads(3), grads(1)  # shorter micro-batches run on fewer columns
    assert full.abs().max() > 0
    torch.testing.assert_close(micro, full, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(single, full, atol=1e-6, rtol=1e-4)


def test_clipping_zeroes_the_gradient_exactly_where_it_should():
    ratio = torch.tensor([0.5, 0.9, 1.1, 1.5, 0.5, 0.9, 1.1, 1.5])
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -1.0, -1.0, -1.0, -1.0])
    logprobs = torch.log(ratio)[:, None].requires_grad_()  # 8 rows of one token each
    loss, _, _, clipped = grpo.per_token_loss(logprobs, torch.zeros(8, 1), adv, None,
                                                grpo.Args(clip_eps_high=0.28))
    loss.sum().backward()
    # A > 0: clipped above 1 + eps_high (1.5); A < 0: clipped below 1 - eps (0.5).
    # Elsewhere grad = -A * ratio.
    expect_zero = torch.tensor([False, False, False, True, True, False, False, False])
    assert torch.equal(logprobs.grad[:, 0] == 0, expect_zero)
    assert torch.equal(clipped[:, 0].bool(), expect_zero)
    torch.testing.assert_close(logprobs.grad[~expect_zero, 0], -(adv * ratio)[~expect_zero])


def test_ratio_is_one_and_kl_zero_at_first_inner_step(tok):
    model, ref = tiny_model("qwen2", seed=4), tiny_model("qwen2", seed=4)
    roll = C.sample(model, tok, C.encode_prompts(tok, PROMPTS), 6)
    T = roll.completion_mask.shape[1]
    lp, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T)
    ref_lp = C.batched_logprobs(ref, roll, 1.0, 2, OFF)
    adv = torch.ones(len(lp))
    _, ratio, kl, _ = grpo.per_token_loss(lp, lp.detach(), adv, None, grpo.Args(), ref_lp)
    m = roll.completion_mask.bool()
    assert (ratio[m] == 1).all()
    assert kl[m].abs().max() < 1e-6


def expected_kl_term_gradient(estimator, logits, ref_logits):
    """E_{y ~ pi}[grad of beta * k(y)] for a categorical policy pi = softmax(logits), by exact
    summation over the vocabulary (no sampling noise), as grpo.per_token_loss computes the term:
    each sampled token y is a row whose loss is differentiated with y held fixed."""
    theta = logits.clone().requires_grad_(True)
    logp = theta.log_softmax(-1)
    ref_logp = ref_logits.log_softmax(-1)
    V = len(logits)
    zero = torch.zeros(V)
    loss, _, _, _ = grpo.per_token_loss(logp[:, None], logp.detach()[:, None], zero, None,
                                        grpo.Args(beta=1.0, kl_estimator=estimator),
                                        ref_logp[:, None])
    weights = logp.exp().detach()  # pi(y): the chance that the sampled token is y
    (weights * loss[:, 0]).sum().backward()
    return theta.grad


def test_kl_in_grpo_loss_pulls_towards_the_kl_its_docstring_names():
    torch.manual_seed(0)
    logits, ref_logits = torch.randn(7), torch.randn(7)

    def grad_of(f):
        theta = logits.clone().requires_grad_(True)
        f(theta).backward()
        return theta.grad
    p_ref = ref_logits.softmax(-1)
    reverse = grad_of(lambda t: (t.softmax(-1) * (t.log_softmax(-1) - p_ref.log())).sum())
    forward = grad_of(lambda t: (p_ref * (p_ref.log() - t.log_softmax(-1))).sum())
    torch.testing.assert_close(expected_kl_term_gradient("k2", logits, ref_logits), reverse)
    torch.testing.assert_close(expected_kl_term_gradient("k3", logits, ref_logits), forward)
    assert expected_kl_term_gradient("k1", logits, ref_logits).abs().max() < 1e-6
    assert (forward - reverse).abs().max() > 1e-2  # the two directions really differ here


def test_grpo_refuses_k1_in_the_loss(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--kl_estimator", "k1"])
    with pytest.raises(C.UserError, match="zero expected gradient"):
        grpo.check_args(parse_args(grpo.Args, "grpo"))
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--kl_estimator", "k1", "--beta", "0"])
    grpo.check_args(parse_args(grpo.Args, "grpo"))  # no KL term: nothing to refuse


def test_beta_zero_loads_no_reference_model(monkeypatch, tmp_path):
    """Run grpo.main up to the training loop and record which frozen models it loads, and whether
    compiled."""
    loaded, compiled = [], []

    def fake_load_model(name, kind, device, frozen=False, trust_remote_code=False, compile=False):
        loaded.append((kind, frozen))
        compiled.append(compile)
        return tiny_model("llama")

    class Stop(Exception):
        pass

    def stop(*args):
        raise Stop
    monkeypatch.setattr(loading, "load_model", fake_load_model)
    monkeypatch.setattr(runs, "resume_or_eval", stop)
    for beta, frozen, flags in (("0", [], []),
                                ("0.04", [("lm", True)], []),
                                ("0.04", [("lm", True)], ["--compile"])):
        loaded.clear()
        compiled.clear()
        out = tmp_path / f"{beta}{flags}"
        with pytest.raises(Stop):
            run_main(monkeypatch, grpo, "--beta", beta, "--output_dir", str(out), *flags)
        assert [x for x in loaded if x[1]] == frozen and ("lm", False) in loaded
        # --compile reaches policy and reference alike
        assert compiled == [bool(flags)] * len(loaded)


# ---- grpo.py: policy losses since DAPO (#29)
def slow_policy_loss(lp, old, adv, mask, eps, level, kind, tau=(1.0, 1.05)):
    """Each token's policy loss, one scalar at a time, straight from the papers' formulas."""
    out = [[torch.zeros(()) for _ in range(lp.shape[1])] for _ in range(lp.shape[0])]
    for i in range(lp.shape[0]):
        toks = [t for t in range(lp.shape[1]) if mask[i, t]]
        s = torch.exp(sum(lp[i, t] - old[i, t] for t in toks) / max(1, len(toks)))  # GSPO's s_i
        for t in range(lp.shape[1]):
            r = s if level == "sequence" else torch.exp(lp[i, t] - old[i, t])
            a, w = float(adv[i]), r.clamp(1 - eps[0], 1 + eps[1])
            if kind == "clip":
                out[i][t] = -torch.min(r * a, w * a)
            elif kind == "cispo":
                out[i][t] = -w.detach() * a * lp[i, t]
            else:
                tau_ = tau[0] if a > 0 else tau[1]
                out[i][t] = -torch.sigmoid(tau_ * (r - 1)) * 4 / tau_ * a
    return torch.stack([torch.stack(row) for row in out])


def random_step(seed=0, B=6, T=5, spread=0.3):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=g) * 3
    lp = (old + torch.randn(B, T, generator=g) * spread).requires_grad_()
    adv = torch.randn(B, generator=g)
    lengths = torch.tensor([1, 5, 3, 2, 4, 5])[:B]
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return lp, old, adv, mask


@pytest.mark.parametrize("kind", ["clip", "cispo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_policy_losses_and_gradients_match_slow_reference(kind, level):
    eps = (0.2, 0.28) if level == "token" else (0.05, 0.08)  # some ratios clipped either way
    lp, old, adv, mask = random_step()
    loss, ratio, _, clipped = grpo.per_token_loss(lp, old, adv, mask, grpo.Args(
        clip_eps=eps[0], clip_eps_high=eps[1], seq_clip_eps=eps[0], seq_clip_eps_high=eps[1],
        importance_sampling_level=level, policy_loss=kind))
    (grad,) = torch.autograd.grad((loss * mask).sum(), lp)
    want = slow_policy_loss(lp, old, adv, mask, eps, level, kind)
    (want_grad,) = torch.autograd.grad((want * mask).sum(), lp)
    torch.testing.assert_close(loss * mask, want * mask, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    if kind != "sapo":
        assert 0 < float((clipped * mask).sum()) < float(mask.sum())  # the test reaches the clip


def test_gspo_ratio_is_one_number_per_sequence_and_its_gradient_the_papers():
    lp, old, adv, mask = random_step(spread=0.01)
    loss, ratio, _, _ = grpo.per_token_loss(lp, old, adv, mask, grpo.Args(
        seq_clip_eps=1.0, seq_clip_eps_high=1.0, importance_sampling_level="sequence"))
    for i in range(len(lp)):
        n = int(mask[i].sum())
        s = math.exp(float(((lp.detach() - old)[i, :n]).sum()) / n)
        assert torch.allclose(ratio[i, :n], torch.full((n,), s), atol=1e-6)  # one number
    # GSPO (eq. 10): grad J = 1/G sum_i s_i A_i 1/|o_i| sum_t grad log pi_theta(o_i,t); with the
    # eps this wide nothing is clipped, and seq-mean-token-mean is GSPO's own 1/G sum_i
    agg = grpo.aggregate(loss, mask, "seq-mean-token-mean", mask.sum(), len(lp), 5)
    (grad,) = torch.autograd.grad(agg, lp)
    s = ratio[:, 0].detach()
    want = -(s * adv / mask.sum(-1))[:, None] * mask / len(lp)
    torch.testing.assert_close(grad, want, atol=1e-7, rtol=1e-5)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    lp, old, adv, mask = random_step(spread=1.0)  # ratios far outside [0.8, 1.2]
    cispo, _, _, clipped = grpo.per_token_loss(lp, old, adv, None, grpo.Args(policy_loss="cispo"))
    (g_cispo,) = torch.autograd.grad((cispo * mask).sum(), lp)
    clip, _, _, drop = grpo.per_token_loss(lp, old, adv, None, grpo.Args())
    (g_clip,) = torch.autograd.grad((clip * mask).sum(), lp)
    dropped = (drop * mask).bool()
    assert dropped.sum() >= 3
    assert (g_clip[dropped] == 0).all()  # PPO's clip: no gradient at all
    w = torch.exp(lp - old).clamp(0.8, 1.2).detach()  # CISPO: the clipped weight, -w A
    torch.testing.assert_close(g_cispo[dropped], (-w * adv[:, None])[dropped])
    assert (g_cispo[dropped].abs() > 0).all() and (clipped * mask).sum() >= dropped.sum()


@pytest.mark.parametrize("kind", ["clip", "cispo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mu_one_gives_ratio_one_and_the_plain_policy_gradient(kind, level):
    lp, _, adv, mask = random_step()
    loss, ratio, _, _ = grpo.per_token_loss(lp, lp.detach(), adv, mask, grpo.Args(
        clip_eps=3e-4, clip_eps_high=4e-4, importance_sampling_level=level, policy_loss=kind))
    assert (ratio == 1).all()
    (grad,) = torch.autograd.grad((loss * mask).sum(), lp)  # plain PG: -A grad log pi per token
    torch.testing.assert_close(grad, -adv[:, None] * mask, atol=1e-6, rtol=1e-5)


def slow_mismatch_weight(old, sample, mask, cap, mode, level):
    w = torch.exp((old - sample) * mask)
    if level == "sequence":
        w = w.prod(-1, keepdim=True)
    return w.clamp(max=cap) if mode == "truncate" else w * (w <= cap)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mismatch_weights_match_slow_reference_and_cap_inf_is_the_identity(mode, level):
    lp, old, adv, mask = random_step()
    sample = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * 0.5
    w, raw = grpo.mismatch_weights(old, sample, mask, 1.5, mode, level)
    torch.testing.assert_close(w, slow_mismatch_weight(old, sample, mask, 1.5, mode, level))
    assert (w <= 1.5).all() and (raw * mask).max() > 1.5  # the cap is reached
    torch.testing.assert_close(raw, torch.exp((old - sample) * mask))
    assert grpo.mismatch_weights(old, sample, mask)[0] == 1.0  # cap 0: off
    # the weight multiplies the policy part, not the KL term (as TRL applies it)
    ref = old - 0.1
    got, *_ = grpo.per_token_loss(lp, old, adv, None, grpo.Args(), ref, is_weight=w)
    policy, *_ = grpo.per_token_loss(lp, old, adv, None, grpo.Args())
    torch.testing.assert_close(got, policy * w + 0.04 * C.kl_estimate(lp, ref, "k3"))
    # no mismatch and an infinite cap: the weight is 1 and the loss exactly the uncorrected one
    w, _ = grpo.mismatch_weights(old, old.clone(), mask, math.inf, mode, level)
    plain, *_ = grpo.per_token_loss(lp, old, adv, None, grpo.Args())
    weighted, *_ = grpo.per_token_loss(lp, old, adv, None, grpo.Args(), is_weight=w)
    assert (w == 1).all() and torch.equal(weighted, plain)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_reinforce_mismatch_correction_is_grpos(mode, level):
    lp, old, adv, mask = random_step()
    sample = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * 0.5
    w, raw = grpo.mismatch_weights(old, sample, mask, 1.5, mode, level)
    w2, raw2 = R.mismatch_weights(old, sample, mask, 1.5, mode, level)
    assert torch.equal(w, w2) and torch.equal(raw, raw2)
    A = adv[:, None] * mask
    got, _, _ = reinforce_step_loss(lp, A, mask, 6, mask.sum(), is_weight=w)
    want = (-A * lp * w * mask).sum() / 6
    torch.testing.assert_close(got, want)


def test_raw_sampler_ratio_is_one_in_fp32_and_the_kept_mass_with_top_p(tok):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = [2, 43, 72]
    prompts = C.encode_prompts(tok, PROMPTS)
    torch.manual_seed(0)
    roll = C.sample(model, tok, prompts, 8, temperature=0.7)
    lp = C.batched_logprobs(model, roll, 0.7, 8, OFF)
    _, raw = grpo.mismatch_weights(lp, roll.sample_logprobs, roll.completion_mask)
    # 1 up to float rounding (1e-6 on one CPU, exactly 1 on another: either may hold), and
    # exactly 1 outside the completion, where the mask zeroes log pi_old - log pi_sampler
    assert float((raw - 1).abs().max()) < 1e-4
    assert bool((raw[roll.completion_mask == 0] == 1).all())
    # top_p 0.8: the sampler's log-prob is over the kept tokens, renormalised, the trainer's over
    # all: the raw ratio is each step's kept mass, which a plain forward recomputes
    roll = C.sample(model, tok, prompts, 8, temperature=0.7, top_p=0.8)
    lp = C.batched_logprobs(model, roll, 0.7, 8, OFF)
    _, raw = grpo.mismatch_weights(lp, roll.sample_logprobs, roll.completion_mask)
    for i, p in enumerate(prompts):
        n = int(roll.completion_mask[i].sum())
        ids = torch.tensor([p + roll.ids[i, roll.P:roll.P + n].tolist()])
        probs = (model(ids).logits[0, len(p) - 1:-1].float() / 0.7).softmax(-1)
        sorted_p = probs.sort(-1, descending=True).values
        kept = (sorted_p * (sorted_p.cumsum(-1) - sorted_p < 0.8)).sum(-1)
        torch.testing.assert_close(raw[i, :n], kept, atol=1e-4, rtol=1e-4)
    assert float(raw.min()) < 0.95


# ---- reinforce.py: pure functions
def random_mask(B, T, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    lengths[0] = T
    return (torch.arange(T)[None] < lengths[:, None]).float()


def test_rloo_baseline_equals_slow_leave_one_out():
    torch.manual_seed(0)
    for k in (2, 3, 8):
        returns = torch.randn(5 * k)
        b = R.rloo_baseline(returns, k)
        for i in range(len(returns)):
            g = i // k
            others = [float(returns[j]) for j in range(g * k, g * k + k) if j != i]
            assert abs(float(b[i]) - sum(others) / len(others)) < 1e-5


def test_rloo_with_one_sample_refuses():
    """Refused once, when the flags are read (rloo_baseline itself assumes k >= 2)."""
    with pytest.raises(C.UserError, match="samples_per_prompt >= 2"):
        R.check_args(R.Args(baseline="rloo", samples_per_prompt=1, prompts_per_step=8,
                            micro_batch_size=8))
    # without rloo, one sample per prompt is fine
    R.check_args(R.Args(baseline="none", samples_per_prompt=1, prompts_per_step=8,
                        micro_batch_size=8))


def test_rloo_with_per_token_kl_matches_the_slow_leave_one_out_of_scores():
    """OpenRLHF's form: A_i,t = s_i - mean_{j != i} s_j - beta * (KL of o_i still to come)."""
    torch.manual_seed(0)
    k, B, T, beta = 4, 8, 5, 0.05
    mask = random_mask(B, T)
    scores, kl = torch.rand(B), torch.rand(B, T) * mask
    returns = R.kl_returns(scores, mask, kl, beta, "token")
    got = R.advantages(returns, mask, baseline_args("rloo", k), scores=scores)
    want = torch.zeros(B, T)
    for i in range(B):
        others = [scores[j] for j in range(i // k * k, i // k * k + k) if j != i]
        for t in range(T):
            if mask[i, t]:
                want[i, t] = scores[i] - sum(others) / (k - 1) - beta * kl[i, t:].sum()
    torch.testing.assert_close(got, want)


def test_whiten_has_mean_0_std_1_over_valid_entries():
    torch.manual_seed(0)
    x, mask = 3 + 5 * torch.randn(16, 7), random_mask(16, 7)
    x = x + 100 * (1 - mask)  # garbage on padding must not leak into the statistics
    w = C.whiten(x, mask)
    v = w[mask.bool()]
    assert abs(float(v.mean())) < 1e-5
    assert abs(float(v.pow(2).mean().sqrt()) - 1) < 1e-4  # biased std = 1
    assert (w[~mask.bool()] == 0).all()
    # reinforce_pp is exactly that whitening of the returns
    torch.testing.assert_close(R.advantages(x * mask, mask, baseline_args("reinforce_pp", 4)), w)


def test_kl_returns_equal_slow_reward_to_go():
    torch.manual_seed(0)
    B, T, beta = 6, 5, 0.3
    scores, mask, kl = torch.randn(B), random_mask(B, T, seed=1), torch.randn(B, T)
    G_tok = R.kl_returns(scores, mask, kl, beta, "token")
    G_seq = R.kl_returns(scores, mask, kl, beta, "sequence")
    for i in range(B):
        n = int(mask[i].sum())
        rewards = [-beta * float(kl[i, t]) for t in range(n)]
        rewards[-1] += float(scores[i])  # the score is paid on the last real token (the EOS)
        for t in range(T):
            want_tok = sum(rewards[t:]) if t < n else 0.0
            want_seq = sum(rewards) if t < n else 0.0
            assert abs(float(G_tok[i, t]) - want_tok) < 1e-5
            assert abs(float(G_seq[i, t]) - want_seq) < 1e-5
    # beta = 0: the score
    torch.testing.assert_close(R.kl_returns(scores, mask), scores[:, None] * mask)


def test_advantages_for_each_baseline():
    torch.manual_seed(0)
    k, mask = 4, random_mask(12, 5)
    returns = R.kl_returns(torch.rand(12), mask, torch.randn(12, 5), 0.1)
    torch.testing.assert_close(R.advantages(returns, mask, baseline_args("none", k)), returns)
    ema = R.advantages(returns, mask, baseline_args("ema", k), ema=0.25)
    torch.testing.assert_close(ema, (returns - 0.25) * mask)
    first = R.advantages(returns, mask, baseline_args("ema", k), ema=None)  # first step: the mean
    torch.testing.assert_close(first, (returns - returns[:, 0].mean()) * mask)
    group_sums = [float(returns[(i // k) * k:(i // k + 1) * k, 0].sum()) for i in range(12)]
    loo = torch.tensor([(group_sums[i] - float(returns[i, 0])) / (k - 1) for i in range(12)])
    rloo = R.advantages(returns, mask, baseline_args("rloo", k))
    torch.testing.assert_close(rloo, (returns - loo[:, None]) * mask)
    w = R.advantages(returns, mask, baseline_args("rloo", k, whiten=True))
    assert abs(float(w[mask.bool()].mean())) < 1e-5
    # a group whose rewards are all equal (and no KL) gets zero advantage under rloo
    same = R.kl_returns(torch.tensor([1.0] * 4 + [0.0, 1.0, 0.0, 0.0]), mask[:8])
    assert (R.advantages(same, mask[:8], baseline_args("rloo", 4))[:4] == 0).all()


@pytest.mark.parametrize("loss_agg", ["seq-sum", "token-mean"])
def test_loss_gradient_equals_hand_derived_on_toy_categorical_policy(loss_agg):
    """pi(a | t) = softmax(theta_t): the gradient of -(1/Z) sum_i sum_t m A log pi(a_i,t) w.r.t.
    theta_t is -(1/Z) sum_i m A (onehot(a_i,t) - softmax(theta_t)), with Z = sequences or tokens
    in the step."""
    torch.manual_seed(0)
    B, T, V = 10, 4, 6
    theta = torch.randn(T, V, requires_grad=True)
    actions = torch.distributions.Categorical(logits=theta.detach()).sample((B,))
    adv, mask = torch.randn(B, T), random_mask(B, T)
    logprobs = theta.log_softmax(-1).expand(B, T, V).gather(-1, actions[..., None])[..., 0]
    n_tokens = mask.sum()
    reinforce_step_loss(logprobs, adv, mask, B, n_tokens, loss_agg)[0].backward()
    Z = B if loss_agg == "seq-sum" else float(n_tokens)
    hand = torch.zeros(T, V)
    p = theta.detach().softmax(-1)
    for i in range(B):
        for t in range(T):
            if mask[i, t]:
                hand[t] -= adv[i, t] * (torch.nn.functional.one_hot(actions[i, t], V) - p[t]) / Z
    torch.testing.assert_close(theta.grad, hand, atol=1e-6, rtol=1e-5)
    # the clipped PPO surrogate (mu > 1) has the same gradient while the ratio is 1
    theta.grad = None
    logprobs = theta.log_softmax(-1).expand(B, T, V).gather(-1, actions[..., None])[..., 0]
    loss, _, _ = reinforce_step_loss(logprobs, adv, mask, B, n_tokens, loss_agg,
                                      old=logprobs.detach())
    loss.backward()
    torch.testing.assert_close(theta.grad, hand, atol=1e-6, rtol=1e-5)


def test_clipping_stops_the_gradient_outside_the_trust_region():
    # ratios 1.5, 0.5, 1.1 vs old = 0
    logprobs = torch.log(torch.tensor([[1.5, 0.5, 1.1]])).requires_grad_()
    adv, mask = torch.tensor([[1.0, -1.0, 1.0]]), torch.ones(1, 3)
    old = torch.zeros(1, 3)
    out, ratio, clipped = reinforce_step_loss(logprobs, adv, mask, 1, 3, "seq-sum", old, 0.2)
    out.backward()
    assert clipped.tolist() == [[1.0, 1.0, 0.0]]
    assert logprobs.grad[0, :2].tolist() == [0.0, 0.0]
    assert abs(float(logprobs.grad[0, 2]) + 1.1) < 1e-6


# ---- reinforce.py: on a tiny model
def _loss_and_grad(model, roll, adv, micro, loss_agg, old=None):
    model.zero_grad()
    mask, n, T = roll.completion_mask, len(roll.ids), roll.completion_mask.shape[1]
    total = 0.0
    for i in range(0, n, micro):
        s = slice(i, i + micro)
        lp, _ = C.token_logprobs(model, roll.ids[s], roll.attention_mask[s], T)
        old_s = None if old is None else old[s]
        out = reinforce_step_loss(lp, adv[s], mask[s], n, mask.sum(), loss_agg, old_s)[0]
        out.backward()
        total += out.item()
    return total, torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("loss_agg", ["seq-sum", "token-mean"])
@pytest.mark.parametrize("clipped", [False, True])
def test_micro_batching_does_not_change_the_gradient(loss_agg, clipped, tok):
    model = tiny_model("llama")
    model.generation_config.eos_token_id = [2, 43, 72]  # rows of different lengths
    roll = C.sample(model, tok, C.encode_prompts(tok, PROMPTS * 2), 6)
    assert len(set(roll.completion_mask.sum(-1).tolist())) > 1  # or the test proves nothing
    adv = torch.randn(len(roll.ids), 1) * roll.completion_mask
    old = None
    if clipped:  # ratio != 1, some tokens clipped
        old = C.batched_logprobs(model, roll, 1.0, 10, OFF)
        old = old + 0.1 * torch.randn(roll.completion_mask.shape)
    l1, g1 = _loss_and_grad(model, roll, adv, 10, loss_agg, old)
    l2, g2 = _loss_and_grad(model, roll, adv, 3, loss_agg, old)
    assert abs(l1 - l2) < 1e-5 and g1.abs().max() > 0
    torch.testing.assert_close(g1, g2, atol=1e-6, rtol=1e-4)


@pytest.mark.parametrize("k", [1, 3])
def test_sample_grad_probe_equals_per_sample_backward(k, tok):
    """The hook's row norms equal each sample's gradient w.r.t. its own logits, taken one sample at
    a time; also when k samples share a prompt and token_logprobs shares the prompt's forward
    between them."""
    model = tiny_model("gpt_neox")
    norms = R.sample_grad_probe(model)
    prompts = [p for p in C.encode_prompts(tok, PROMPTS) for _ in range(k)]
    roll = C.sample(model, tok, prompts, 5)
    mask, n, T = roll.completion_mask, len(roll.ids), roll.completion_mask.shape[1]
    adv = torch.randn(n, 1) * mask
    lp, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T)
    reinforce_step_loss(lp, adv, mask, n, mask.sum())[0].backward()
    got = torch.cat(norms)
    assert len(got) == n
    for i in range(n):
        ids, am = roll.ids[i:i + 1], roll.attention_mask[i:i + 1]
        logits = model(input_ids=ids, attention_mask=am, position_ids=C.positions(am)).logits
        lp_i = logits[:, -T - 1:-1].log_softmax(-1).gather(-1, ids[:, -T:, None])[..., 0]
        g = torch.autograd.grad(-(adv[i:i + 1] * lp_i * mask[i:i + 1]).sum() / n, logits)[0]
        assert abs(float(g.norm()) - float(got[i])) < 1e-5 * max(1.0, float(got[i]))


# ---- ppo.py: pure functions
def random_batch(B=6, T=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 1, 3, T - 1, 5, 2][:B])
    mask = (torch.arange(T)[None] < lengths[:, None]).float()
    return torch.randn(B, T, generator=g), torch.randn(B, T, generator=g), mask, lengths


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.7), (1.0, 1.0)])
def test_gae_equals_slow_loop_and_returns_are_advantages_plus_values(gamma, lam):
    rewards, values, mask, lengths = random_batch()
    adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
    for i, n in enumerate(lengths.tolist()):
        for t in range(n):  # A_t = sum_j (gamma lam)^j delta_t+j over the row's real tokens only
            expect = 0.0
            for j in range(n - t):
                # terminal after the last real token
                v_next = values[i, t + j + 1] if t + j + 1 < n else 0.0
                delta = rewards[i, t + j] + gamma * v_next - values[i, t + j]
                expect += (gamma * lam) ** j * delta
            assert abs(float(adv[i, t]) - float(expect)) < 1e-5
            assert abs(float(ret[i, t]) - float(adv[i, t] + values[i, t])) < 1e-6
        assert (adv[i, n:] == 0).all() and (ret[i, n:] == 0).all()
    # lam = 1, gamma = 1: the return is the plain reward-to-go, whatever the values
    _, ret1 = ppo.gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(ret1, (rewards * mask).flip(1).cumsum(1).flip(1) * mask)


def test_shaped_rewards_put_the_score_on_the_last_real_token():
    logprobs, ref_logprobs, mask, lengths = random_batch(seed=1)
    scores = torch.tensor([10.0, 20.0, 30.0, 40.0, 50.0, 60.0])
    rewards, kl = ppo.shaped_rewards(scores, logprobs, ref_logprobs, mask, 0.1, "k1")
    for i, n in enumerate(lengths.tolist()):
        for t in range(mask.shape[1]):
            k1 = float(logprobs[i, t] - ref_logprobs[i, t])
            expect = 0.0 if t >= n else -0.1 * k1 + (float(scores[i]) if t == n - 1 else 0.0)
            assert abs(float(rewards[i, t]) - expect) < 1e-5
    assert (kl * (1 - mask) == 0).all()


def test_shaped_rewards_leave_an_empty_row_alone():
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    zeros = torch.zeros(2, 3)
    rewards, _ = ppo.shaped_rewards(torch.tensor([2.0, 5.0]), zeros, zeros, mask, 0.1)
    torch.testing.assert_close(rewards, torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 0.0]]))


def test_value_loss_and_policy_loss_equal_scalar_reference():
    g = torch.Generator().manual_seed(2)
    v, v_old, ret, lp, old_lp, adv = (torch.randn(50, generator=g) for _ in range(6))
    loss, clipped = ppo.value_loss(v, v_old, ret, 0.2)
    pl, ratio, pclipped = ppo.policy_loss(lp * 0.3, old_lp * 0.3, adv, 0.2)
    for i in range(50):
        vc = min(max(float(v[i]), float(v_old[i]) - 0.2), float(v_old[i]) + 0.2)
        a, b = (float(v[i]) - float(ret[i])) ** 2, (vc - float(ret[i])) ** 2
        assert abs(float(loss[i]) - 0.5 * max(a, b)) < 1e-5 and bool(clipped[i]) == (b > a)
        r = torch.exp(lp[i] * 0.3 - old_lp[i] * 0.3).item()
        expect = -min(r * float(adv[i]), min(max(r, 0.8), 1.2) * float(adv[i]))
        assert abs(float(pl[i]) - expect) < 1e-5
    # both branches exercised
    assert 0 < float(clipped.mean()) < 1 and 0 < float(pclipped.mean()) < 1


def test_whiten_over_valid_tokens_only():
    x, _, mask, _ = random_batch(seed=3)
    w = C.whiten(x + 5.0, mask)
    vals = w[mask.bool()]
    assert abs(float(vals.mean())) < 1e-5
    assert abs(float(vals.pow(2).mean()) - 1) < 1e-4
    assert (w[~mask.bool()] == 0).all()
    kept = C.whiten(x + 5.0, mask, shift_mean=False)[mask.bool()]
    assert abs(float(kept.mean()) - float((x + 5.0)[mask.bool()].mean())) < 1e-4


def test_adaptive_kl_moves_kl_coef_the_right_way():
    # too much KL: penalise more; too little: penalise less
    assert ppo.adaptive_kl(0.1, kl=12.0, target=6.0, horizon=10000, n_steps=64) > 0.1
    assert ppo.adaptive_kl(0.1, kl=1.0, target=6.0, horizon=10000, n_steps=64) < 0.1
    assert ppo.adaptive_kl(0.1, kl=6.0, target=6.0, horizon=10000, n_steps=64) == 0.1
    # the proportional error is clipped to +-20%, scaled by n_steps / horizon
    assert abs(ppo.adaptive_kl(0.1, kl=600.0, target=6.0, horizon=100, n_steps=100) - 0.12) < 1e-12


def test_ppo_refuses_adaptive_kl_from_zero_and_has_no_weight_decay_by_default(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["ppo.py", "--adaptive_kl", "--kl_coef", "0"])
    with pytest.raises(C.UserError, match="from --kl_coef 0 it would stay 0"):
        ppo.check_args(parse_args(ppo.Args, "ppo"))
    assert ppo.Args().weight_decay == 0.0  # AdamW's own default is 0.01


# ---- ppo.py: on a tiny model
def test_critic_values_read_the_state_before_each_token_with_left_padding(tok):
    critic = tiny_rm()
    model = tiny_model("llama")
    roll = C.sample(model, tok, C.encode_prompts(tok, PROMPTS), 5)
    T = roll.completion_mask.shape[1]
    values = ppo.critic_values(critic, roll.ids, roll.attention_mask, T)
    for i in range(len(PROMPTS)):
        ids = roll.ids[i][roll.attention_mask[i].bool()][None]  # the row without padding
        per_pos = critic.score(critic.model(ids).last_hidden_state)[0, :, 0]
        n = int(roll.completion_mask[i].sum())
        # prompt + n completion tokens: token t's value is read at position L - n + t - 1
        L = ids.shape[1]
        torch.testing.assert_close(values[i, :n], per_pos[L - n - 1:L - 1], atol=1e-4, rtol=1e-4)
    # three more completion columns that are padding in every row: not run, the same values,
    # zeros there
    pad = torch.nn.functional.pad
    wide = ppo.critic_values(critic, pad(roll.ids, (0, 3)), pad(roll.attention_mask, (0, 3)), T + 3)
    torch.testing.assert_close(wide, pad(values, (0, 3)), atol=1e-5, rtol=1e-5)


def make_update_inputs(tok, seed=0, varied=False):
    torch.manual_seed(seed)
    model, critic = tiny_model("llama"), tiny_rm()
    roll = C.sample(model, tok, C.encode_prompts(tok, PROMPTS * 4), 5)
    # the random model never ends early: give rows lengths 1..5, as EOS would (masks from lengths)
    if varied:
        lengths = torch.arange(len(roll.ids)) % 5 + 1
        roll.completion_mask = (torch.arange(5)[None] < lengths[:, None]).float()
        prompt_mask = roll.attention_mask[:, :roll.P]
        roll.attention_mask = torch.cat([prompt_mask, roll.completion_mask.long()], 1)
    mask, T = roll.completion_mask, roll.completion_mask.shape[1]
    old_lp = C.batched_logprobs(model, roll, 1.0, 8, OFF)
    with torch.no_grad():
        old_v = ppo.critic_values(critic, roll.ids, roll.attention_mask, T) * mask
    adv = torch.randn(mask.shape) * mask
    batch = {"old_logprobs": old_lp, "old_values": old_v, "returns": old_v + adv,
             "advantages": C.whiten(adv, mask)}
    return model, critic, roll, batch


@pytest.mark.parametrize("target_kl,expect_updates", [(0.0, 8), (1e-6, 1)])
def test_target_kl_stops_the_epochs(tok, target_kl, expect_updates):
    """The first minibatch sees ratio == 1 (KL 0) and is applied; with a tiny target the next one
    stops the epochs."""
    model, critic, roll, batch = make_update_inputs(tok)
    args = SimpleNamespace(ppo_epochs=4, num_minibatches=2, micro_batch_size=5, temperature=1.0,
                           ent_coef=0.0, clip_eps=0.2, clip_eps_value=0.2, vf_coef=0.1,
                           target_kl=target_kl, max_grad_norm=1.0)
    opt = torch.optim.AdamW([{"params": model.parameters(), "lr": 1e-2},
                             {"params": critic.parameters(), "lr": 1e-2}])
    before = [p.detach().clone() for p in model.parameters()]
    run = SimpleNamespace(nonfinite=0, nonfinite_in_row=0, world=1, rank=0)
    stats = ppo.ppo_update(model, ppo.ValueModel(critic), opt, run, roll, batch, args, OFF)
    assert stats["ppo_updates"] == expect_updates
    # the first update did happen
    assert any((p != b).any() for p, b in zip(model.parameters(), before))
    # a dropped update leaves no gradient behind
    assert all(p.grad is None for p in model.parameters())


def test_ppo_micro_batches_do_not_change_the_update(tok):
    """One minibatch as one micro-batch, or as micro-batches of 3 rows taken in order of length:
    the same step."""
    after = []
    for micro in (20, 3):
        # varied lengths: so the order of rows matters
        model, critic, roll, batch = make_update_inputs(tok, seed=2, varied=True)
        args = SimpleNamespace(ppo_epochs=1, num_minibatches=1, micro_batch_size=micro,
                               temperature=1.0, ent_coef=0.01, clip_eps=0.2, clip_eps_value=0.2,
                               vf_coef=0.5, target_kl=0.0, max_grad_norm=1e9)
        opt = torch.optim.SGD([*model.parameters(), *critic.parameters()], lr=1.0)
        run = SimpleNamespace(nonfinite=0, nonfinite_in_row=0, world=1, rank=0)
        ppo.ppo_update(model, ppo.ValueModel(critic), opt, run, roll, batch, args, OFF)
        after.append([p.detach().clone() for p in (*model.parameters(), *critic.parameters())])
    for a, b in zip(*after):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_ppo_update_lowers_value_loss_and_raises_advantaged_logprobs(tok):
    """Many epochs on one batch: the critic fits the returns, the policy moves toward positive
    advantages."""
    model, critic, roll, batch = make_update_inputs(tok, seed=1)
    args = SimpleNamespace(ppo_epochs=30, num_minibatches=1, micro_batch_size=20, temperature=1.0,
                           ent_coef=0.0, clip_eps=0.2, clip_eps_value=10.0, vf_coef=1.0,
                           target_kl=0.0, max_grad_norm=1.0)
    opt = torch.optim.AdamW([{"params": model.parameters(), "lr": 3e-3},
                             {"params": critic.parameters(), "lr": 3e-3}])
    mask = roll.completion_mask
    v0 = C.masked_mean((batch["old_values"] - batch["returns"]) ** 2, mask)
    run = SimpleNamespace(nonfinite=0, nonfinite_in_row=0, world=1, rank=0)
    ppo.ppo_update(model, ppo.ValueModel(critic), opt, run, roll, batch, args, OFF)
    with torch.no_grad():
        values = ppo.critic_values(critic, roll.ids, roll.attention_mask, mask.shape[1])
        v1 = C.masked_mean((values - batch["returns"]) ** 2, mask)
    new_lp = C.batched_logprobs(model, roll, 1.0, 20, OFF)
    gain = (new_lp - batch["old_logprobs"]) * batch["advantages"]
    assert float(v1) < 0.5 * float(v0)
    assert float((gain * mask).sum()) > 0


def test_critic_from_policy_starts_at_zero_and_bad_tokenizer_is_refused(tmp_path, tok):
    model = tiny_model("llama")
    model.save_pretrained(tmp_path / "policy")
    tok.save_pretrained(tmp_path / "policy")
    args = SimpleNamespace(critic_init="policy", model=str(tmp_path / "policy"), reward_model="",
                           trust_remote_code=False, gradient_checkpointing=False)
    critic = ppo.load_critic(args, tok, torch.device("cpu"))
    ids, mask = C.left_pad(C.encode_prompts(tok, PROMPTS), tok.pad_token_id, "cpu")
    assert (ppo.critic_values(critic, ids, mask, 3) == 0).all()
    assert any(p.requires_grad for p in critic.parameters())
    other = loading.load_tokenizer(loading.DEFAULT_POLICY)
    other.add_tokens(["<new>"])
    other.save_pretrained(tmp_path / "rm")
    tiny_rm().save_pretrained(tmp_path / "rm")
    args.critic_init = "reward_model"
    args.reward_model = str(tmp_path / "rm")
    with pytest.raises(C.UserError, match="different tokenizer"):
        ppo.load_critic(args, tok, torch.device("cpu"))


def test_gradient_checkpointing_reaches_the_ppo_critic(tok):
    """The critic's layers are recomputed in backward (HF recomputes only layers in training
    mode; the critic stays in eval mode), with the same gradients as without."""
    grads, calls = [], []
    for ckpt in (False, True):
        args = SimpleNamespace(critic_init="reward_model", model=loading.DEFAULT_POLICY,
                               reward_model=loading.DEFAULT_REWARD_MODEL, trust_remote_code=False,
                               gradient_checkpointing=ckpt)
        critic = ppo.load_critic(args, tok, torch.device("cpu"))
        n = []
        critic.model.layers[0].self_attn.register_forward_pre_hook(lambda *a: n.append(1))
        ids, mask = C.left_pad(C.encode_prompts(tok, PROMPTS[:4]), tok.pad_token_id, "cpu")
        values = ppo.critic_values(critic, ids, mask, 2)
        n.clear()
        values.sum().backward()
        calls.append(len(n))
        grads.append([p.grad.clone() for p in critic.parameters()])
    assert calls == [0, 1]
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ---- tool use: the one sampler with env_step (common.sample), envs.py, --env / --tools


def always_env(text=" 12 "):
    """An environment that answers every turn with the same observation (a tiny random model
    never writes a tool call, so the test envs do not wait for one); its calls are recorded."""
    calls = []

    def env(row, turns):
        calls.append((row["prompt"], list(turns)))
        return text
    env.calls = calls
    return env


def rollout(model, tok, prompt_ids, env, rows, max_turns, budget, timeout=60, **kw):
    """The multi-turn sampler with a test env function env(row, turns): common.sample with the
    env_step that envs builds (one episode per row, its checks and deadline)."""
    env_step, finish = E.start_episodes(rows, lambda row: functools.partial(env, row), "--env",
                                        "test", timeout, tok)
    roll = C.sample(model, tok, prompt_ids, budget, env_step=env_step, max_turns=max_turns, **kw)
    finish(roll)  # the episodes' turns and observations, on the rollout
    return roll


class ScriptedModel(torch.nn.Module):
    """A stand-in causal LM that writes the turns a test gives it: its next token is
    table[(last token, its position)] (else the EOS), with logit 5 against 0 for every other
    token, so greedy sampling follows the script and each log-prob is the same number < 0."""

    def __init__(self, table, vocab, eos):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))  # a device, for the sampler
        self.table, self.vocab, self.eos = table, vocab, eos
        self.generation_config = SimpleNamespace(eos_token_id=eos, suppress_tokens=None)

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep=0,
                use_cache=False, output_hidden_states=False, past_key_values=None):
        logits = torch.zeros(len(input_ids), 1, self.vocab)
        for j, (x, p) in enumerate(zip(input_ids[:, -1].tolist(), position_ids[:, -1].tolist())):
            logits[j, 0, self.table.get((x, p), self.eos)] = 5.0
        return SimpleNamespace(logits=logits)


def scripted_model(tok, prompt_ids, completions, kinds):
    """A ScriptedModel that writes each row's model tokens (kinds 1) of its completion, after its
    prompt (not left-padded: position = index), whatever comes between them (kinds 0)."""
    table = {}
    for p, comp, kind in zip(prompt_ids, completions, kinds):
        seq = list(p) + comp
        for k, (x, m) in enumerate(zip(comp, kind)):
            key = (seq[len(p) + k - 1], len(p) + k - 1)
            if m:
                assert table.setdefault(key, x) == x, "two rows' scripts collide"
    return ScriptedModel(table, len(tok), tok.eos_token_id)


def test_multi_turn_masks_and_ids_on_scripted_turns():
    """Exactly the masks of a multi-turn rollout on scripted turns: an EOS inside the transcript
    (a turn ends with EOS, the env answers, the model goes on), an observation cut at the
    budget's edge, a turn cut by the budget, and pad == EOS. Model ids are exactly the sampled
    ones, observation ids the observation's tokens, and rewards read the text after the last
    observation."""
    t = loading.load_tokenizer(loading.DEFAULT_POLICY)
    t.pad_token = t.eos_token  # pad == EOS: masks must come from positions
    eos = t.eos_token_id
    enc = lambda s: t(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompts = ["3+4=", "33+44=", "5+55="]  # three lengths: the scripts cannot collide
    p = [C.encode_prompts(t, [s], "none")[0] for s in prompts]
    budget = 20  # row 2: 18 call tokens + 2 of its 4 observation tokens
    want = [enc("ab") + [eos] + enc(" 77 ") + enc("7") + [eos],
            enc("<calc>33+44</calc>") + enc(" 7"),
            enc("xyzxyzxyzxyzxyzxyzxyzxyz")[:budget]]
    kinds = [[1] * 3 + [0] * 4 + [1] * 2, [1] * 18 + [0] * 2, [1] * budget]
    model = scripted_model(t, p, want, kinds)
    rows = [{"prompt": s, "answer": str(eval(s[:-1]))} for s in prompts]

    def env(row, turns):
        return " 77 " if row["prompt"] != "5+55=" and len(turns) == 1 else None
    roll = rollout(model, t, p, env, rows, 3, budget, greedy=True, stop=["</calc>"])
    comp = roll.ids[:, roll.P:]
    for i in range(3):
        n = len(want[i])
        assert comp[i, :n].tolist() == want[i]
        assert roll.completion_mask[i].tolist() == kinds[i] + [0] * (comp.shape[1] - n)
        assert roll.attention_mask[i, roll.P:].tolist() == [1] * n + [0] * (comp.shape[1] - n)
        lp = roll.sample_logprobs[i, :n]
        assert (lp[torch.tensor(kinds[i]) == 0] == 0).all()
        assert (lp[torch.tensor(kinds[i]) == 1] < 0).all()
    assert roll.truncated.tolist() == [False, True, True]
    assert roll.turns.tolist() == [2, 1, 1] and roll.tool_calls.tolist() == [1, 1, 0]
    assert roll.obs_truncated.tolist() == [False, True, False]
    assert roll.final == ["7", "", "xyzxyzxyzxyzxyzxyzxy"]  # row 1: nothing after its observation
    assert roll.transcript[0] == "ab⟦ 77 ⟧7"
    assert roll.transcript[1] == "<calc>33+44</calc>⟦ 7⟧"
    assert [C.math_reward(c, r) for c, r in zip(roll.final, rows)] == [1.0, 0.0, 0.0]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_multi_turn_logprobs_equal_a_plain_forward_and_each_token_is_forwarded_once(arch, tok):
    """On a tiny random model (EOS frequent, observations after every turn): the log-probs of the
    whole multi-turn sequence by one plain HF forward, at the model's positions, equal the
    sampler's own and the training forward's; observation positions hold the observation's
    tokens; and the positions the model forwards are the ideal: each distinct prompt once, and
    each completion token once (but each row's last, which nothing reads)."""
    model = tiny_model(arch, seed=2)
    model.generation_config.eos_token_id = list(range(2, 99, 9))  # turns of ~9 tokens
    forwarded = []
    hook = model.register_forward_pre_hook(
        lambda m, a, kw: forwarded.append(kw["input_ids"].numel()), with_kwargs=True)
    torch.manual_seed(0)
    prompts = C.encode_prompts(tok, PROMPTS * 2)
    env = always_env(" 12 ")
    roll = rollout(model, tok, prompts, env, [{"prompt": p} for p in PROMPTS * 2], 16, 40)
    hook.remove()
    mask, T = roll.completion_mask, roll.completion_mask.shape[1]
    assert (roll.tool_calls >= 3).any() and (mask[:, :-1] < mask[:, 1:]).any()  # 0 -> 1: obs
    lengths = roll.attention_mask[:, roll.P:].sum(-1)
    assert sum(forwarded) == len(PROMPTS) * roll.P + int((lengths - 1).sum())
    obs = tok(" 12 ", add_special_tokens=False)["input_ids"]
    for i in range(len(prompts)):  # row i: runs of model tokens and observation tokens
        n = int(lengths[i])
        runs_ = []
        for x, m in zip(roll.ids[i, roll.P:roll.P + n].tolist(), mask[i, :n].tolist()):
            if not runs_ or runs_[-1][0] != m:
                runs_.append((m, []))
            runs_[-1][1].append(x)
        assert all(ids == obs[:len(ids)] for m, ids in runs_ if m == 0)  # the last may be cut
        assert sum(m for m, _ in runs_) == int(roll.turns[i])
        assert len(runs_) - int(roll.turns[i]) == int(roll.tool_calls[i])
    ids, am = roll.ids, roll.attention_mask
    logits = model(input_ids=ids, attention_mask=am, position_ids=C.positions(am)).logits
    plain = logits[:, -T - 1:-1].float().log_softmax(-1).gather(-1, ids[:, -T:, None])[..., 0]
    torch.testing.assert_close(plain * mask, roll.sample_logprobs, atol=2e-5, rtol=0)
    train = C.batched_logprobs(model, roll, 1.0, 4, OFF)
    torch.testing.assert_close(train, roll.sample_logprobs, atol=2e-5, rtol=0)


def test_multi_turn_respects_max_turns_and_the_budget(tok):
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = [2, 43, 72]
    prompts = C.encode_prompts(tok, PROMPTS * 4)
    rows = [{"prompt": p} for p in PROMPTS * 4]
    for max_turns, budget in ((1, 30), (2, 30), (4, 40), (4, 9)):
        env = always_env(" 1 ")
        torch.manual_seed(0)
        roll = rollout(model, tok, prompts, env, rows, max_turns, budget)
        assert roll.turns.max() <= max_turns and roll.tool_calls.max() <= max_turns - 1
        assert (roll.attention_mask[:, roll.P:].sum(-1) <= budget).all()
        n_model = roll.completion_mask.sum(-1)
        assert (roll.tool_calls <= roll.turns).all() and (n_model >= roll.turns).all()
        assert len(env.calls) == int(roll.tool_calls.sum())  # never called after the last turn
        full = roll.attention_mask[:, roll.P:].sum(-1) == budget
        assert (roll.truncated <= full).all()  # truncated only where the budget is spent
        if max_turns == 1:
            assert not env.calls
    assert roll.truncated.any()  # budget 9: some rows hit it


def test_env_gets_its_row_and_the_turns_so_far(tok):
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = [2, 43, 72]
    env = always_env(" 1 ")
    torch.manual_seed(0)
    prompts = C.encode_prompts(tok, PROMPTS)
    roll = rollout(model, tok, prompts, env, [{"prompt": p} for p in PROMPTS], 3, 40)
    for i, p in enumerate(PROMPTS):
        mine = [turns for q, turns in env.calls if q == p]
        assert [len(t) for t in mine] == list(range(1, len(mine) + 1))  # one more each call
        if mine:
            pieces = [t for t in re.split("⟦[^⟧]*⟧", roll.transcript[i]) if t]  # cut: ⟦⟧
            assert mine[-1] == pieces[:len(mine[-1])]


def test_each_episode_owns_its_row_and_a_class_env_gets_one_object_per_episode(tok):
    """Every sample gets its own deep copy of its row: an env that counts its calls in the row
    sees 1, 2, ... within its own episode, whatever its group's other samples do, and the rows
    the caller holds (the reward's targets, the held-out rows) are untouched. --env
    FILE.py:Class builds one object per episode from its row and calls its step(turns)."""
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = [2, 43, 72]
    rows = [{"prompt": "1+2=", "answer": "3", "seen": []}] * 6  # one dict, six samples
    counts = []

    def env(row, turns):
        row["seen"].append(len(turns))
        row["answer"] = "999"  # must not reach the reward's target
        counts.append(list(row["seen"]))
        return " 1 "
    torch.manual_seed(0)
    prompts = C.encode_prompts(tok, [r["prompt"] for r in rows])
    roll = rollout(model, tok, prompts, env, rows, 4, 40)
    assert roll.tool_calls.max() >= 2 and rows[0] == {"prompt": "1+2=", "answer": "3", "seen": []}
    assert all(c == list(range(1, len(c) + 1)) for c in counts), counts

    class Episode:
        made = []

        def __init__(self, row):
            self.row, self.calls = row, 0
            Episode.made.append(self)

        def step(self, turns):
            self.calls += 1
            return f" {self.calls} "
    env_step, finish = E.start_episodes(rows, Episode, "--env", "x.py:Episode", 60, tok)
    torch.manual_seed(0)
    roll = C.sample(model, tok, prompts, 40, env_step=env_step, max_turns=4)
    finish(roll)
    made = [e for e in roll.episodes if e is not None]
    assert len(made) == len(Episode.made) == int((roll.tool_calls > 0).sum())
    assert [e.calls for e in made] == [int(n) for n in roll.tool_calls if n > 0]
    assert all(e.row is not rows[0] and e.row == rows[0] for e in made)


def test_env_calls_of_one_decode_step_run_at_once_and_a_slow_one_stops_in_time(tok):
    """The rows whose turn ends at the same step call their envs concurrently: 8 calls that each
    wait for all 8 to have started (a barrier) pass, as they could not one after another. A
    call that hangs stops the rollout with one line within its limit (one that spins:
    test_a_spinning_env_or_one_that_exits_stops_the_run_in_one_line)."""
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = list(range(len(tok)))  # every turn is one token
    barrier = threading.Barrier(8, timeout=20)

    def env(row, turns):
        barrier.wait()
        return None
    prompts = C.encode_prompts(tok, ["1+2="] * 8)
    roll = rollout(model, tok, prompts, env, [{"prompt": "1+2="}] * 8, 2, 10)
    assert roll.turns.tolist() == [1] * 8
    t0 = time.time()
    with pytest.raises(C.UserError, match=r"--env 'test' took more than 0.5 s on the row with "
                                          r"prompt '1\+2=', turn 1 \(--env_timeout\)"):
        rollout(model, tok, prompts[:2], lambda row, turns: time.sleep(3600),
                [{"prompt": "1+2="}] * 2, 2, 10, timeout=0.5)
    assert time.time() - t0 < 5  # (the sleeping thread is a daemon: it ends with the process)


@pytest.mark.parametrize("obs", ["<eos></s><pad><bos><unk> x", "\ud800 lone \udfff surrogates",
                                 "9" * 1_000_000])
def test_an_observation_is_text_never_special_tokens_and_is_cut_before_it_is_tokenized(
        obs, tok, monkeypatch):
    """What a tool returns is data: '<eos>' in it is five characters, never the EOS id (which
    would end the row, or let a tool write the model's turn markers); invalid unicode is
    replaced; a 1 MB observation is cut to the budget before it is tokenized, and counted."""
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = [2, 43, 72]
    tokenized = []
    real = type(tok).__call__
    monkeypatch.setattr(type(tok), "__call__", lambda self, text, *a, **k: (
        tokenized.append(len(text)), real(self, text, *a, **k))[1])
    torch.manual_seed(0)
    prompts = C.encode_prompts(tok, PROMPTS)
    roll = rollout(model, tok, prompts, always_env(obs), [{"prompt": p} for p in PROMPTS], 2, 40)
    assert (roll.tool_calls > 0).any()
    observed = set(roll.ids[:, roll.P:][(roll.attention_mask[:, roll.P:] == 1)
                                        & (roll.completion_mask == 0)].tolist())
    assert not observed & {tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}
    assert obs[0] != "<" or tok.unk_token_id not in observed  # (unk: a character not in vocab)
    assert max(tokenized) < 32 * 40 + 40  # never the whole megabyte
    if len(obs) > 40:
        assert roll.obs_truncated[roll.tool_calls > 0].all()


def test_calc_env_reads_calls_and_ends_on_an_answer():
    assert E.calc({}, ["<calc>1234+5678</calc>"]) == " 6912 "
    assert E.calc({}, ["a", "b<calc>12*3</calc>  "]) == " 36 "
    assert E.calc({}, ["<calc>7-9</calc>"]) == " -2 "
    assert E.calc({}, ["<calc>12+</calc>"]) == " error "
    assert E.calc({}, ["<calc>12+34</calc>", "46"]) is None  # the answer: the episode ends
    assert E.calc({}, ["<calc>12+34"]) is None  # no closing tag: not a call
    pairs = E.calc_eval_pairs()
    assert len(pairs) == 500 and pairs == E.calc_eval_pairs()
    assert all(100 <= a < 10000 and 100 <= b < 10000 for a, b in pairs)
    train = E.calc_train_pairs(random.Random(0), 2000)
    assert not set(train) & set(pairs)
    demos = E.calc_demo_pairs(random.Random(0), 2000)
    assert not set(demos) & (set(pairs) | set(tasks.task_eval_pairs()))


def write_env(tmp_path, body):
    path = tmp_path / "myenv.py"
    path.write_text(body)
    return f"{path}:env"


@pytest.mark.parametrize("body,message", [
    ("def env(row, turns):\n    raise ValueError('boom')\n",
     r"--env '.*myenv.py:env' raised ValueError: boom \(on the row with prompt '.*', turn 1\)"),
    ("def env(row, turns):\n    return 12\n",
     r"--env '.*myenv.py:env' returned int 12 \(on the row .*\): return the observation text"),
    ("def other(row, turns):\n    return None\n", r"has no function 'env'"),
    ("import nosuchmodule\n", r"importing .* failed: ModuleNotFoundError")])
def test_env_errors_are_one_line(body, message, tmp_path, monkeypatch, capsys):
    spec = write_env(tmp_path, body)  # the bundled model's turns end with an EOS: env called
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *FAST_GRPO, "--env", spec,
                 "--max_steps", "2", "--output_dir", str(tmp_path / "run"), guard=True)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and re.search(message, err), err
    assert not (tmp_path / "run").exists()  # failed before step 1: no folder left


def test_env_too_slow_or_failing_mid_run_loses_nothing(tmp_path, monkeypatch, capsys):
    """An env that fails at step 3 stops the run with one line; the steps before are logged and
    the checkpoint of step 2 is there."""
    spec = write_env(tmp_path, "N = [0]\ndef env(row, turns):\n    N[0] += 1\n"
                               "    if N[0] > 60:\n        raise KeyError('late')\n"
                               "    return ' 1 '\n")
    out = tmp_path / "run"
    with pytest.raises(SystemExit):
        run_main(monkeypatch, grpo, *FAST_GRPO, "--env", spec, "--max_new_tokens", "12",
                 "--max_steps", "50", "--save_every", "1",
                 "--output_dir", str(out), guard=True)
    assert "raised KeyError: 'late'" in capsys.readouterr().err
    steps = [m["step"] for m in read_metrics(out)]
    assert steps and (out / "checkpoint").is_dir()


@pytest.mark.parametrize("body,message", [
    ("while True:\n            pass", r"took more than 2 s on the row with prompt '.*', turn \d"),
    ("raise SystemExit(0)", r"raised SystemExit: 0 \(on the row with prompt '.*', turn \d\)"),
    ("raise KeyboardInterrupt", r"raised KeyboardInterrupt:")])
def test_a_spinning_env_or_one_that_exits_stops_the_run_in_one_line(body, message, tmp_path):
    """An env that spins for ever, or raises SystemExit(0) or KeyboardInterrupt, from its 40th
    call (mid-run): `python grpo.py` exits 2 with one line within about twice --env_timeout,
    and the steps logged and the last checkpoint stay."""
    spec = write_env(tmp_path, "N = [0]\ndef env(row, turns):\n    N[0] += 1\n"
                               f"    if N[0] > 40:\n        {body}\n    return ' 1 '\n")
    out = tmp_path / "run"
    t0 = time.time()
    r = run_script("grpo.py", *FAST_GRPO, "--env", spec, "--env_timeout", "2",
                   "--max_new_tokens", "12", "--max_steps", "50", "--save_every", "1",
                   "--output_dir", str(out), timeout=300)
    assert r.returncode == 2 and time.time() - t0 < 120, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()[-1]
    assert err.startswith("error: --env") and re.search(message, err), err
    assert read_metrics(out) and (out / "checkpoint").is_dir()


def test_an_observation_cut_by_the_budget_is_counted_and_said_once(tmp_path, monkeypatch,
                                                                    capsys):
    spec = write_env(tmp_path, "def env(row, turns):\n    return ' 1' * 40\n")
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--env", spec, "--max_new_tokens", "12",
             "--max_steps", "3", "--output_dir", out)
    assert capsys.readouterr().out.count("an observation was cut by --max_new_tokens") == 1
    assert all(m["obs_truncated"] > 0 for m in read_metrics(out))


def test_tool_use_flags_are_checked(monkeypatch, neox_dir, tmp_path):
    for flags, message in ((["--max_turns", "0"], "--max_turns must be >= 1"),
                           (["--eval_sampled"], "--eval_sampled scores mean@k"),
                           (["--env", "nocolon"], "write calc, path/to/file.py:function")):
        with pytest.raises(C.UserError, match=message):
            run_main(monkeypatch, grpo, *FAST_GRPO, "--model", neox_dir, *flags,
                     "--output_dir", str(tmp_path / "x"))


def test_env_calc_brings_its_defaults_and_given_flags_win(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--env", "calc", "--max_new_tokens", "40"])
    args = parse_args(grpo.Args, "grpo")
    assert args.model == E.CALC_MODEL and args.stop == ["</calc>"] and args.eval_sampled
    assert args.max_new_tokens == 40 and args.eval_samples == 4
    monkeypatch.setattr(sys, "argv", ["ppo.py", "--env", "calc"])
    args = parse_args(ppo.Args, "ppo")
    assert args.rewards == "math" and args.critic_init == "policy"
    monkeypatch.setattr(sys, "argv", ["grpo.py"])
    assert parse_args(grpo.Args, "grpo") == grpo.Args()  # without --env: as it was


def test_micro_batching_does_not_change_the_gradient_with_observations(tok):
    model = tiny_model("llama", seed=3)
    model.generation_config.eos_token_id = [2, 43, 72]
    torch.manual_seed(1)
    prompts = C.encode_prompts(tok, PROMPTS + PROMPTS[:3])
    roll = rollout(model, tok, prompts, always_env(" 5 "), [{"prompt": p} for p in
                                                            PROMPTS + PROMPTS[:3]], 3, 20)
    mask, T = roll.completion_mask, roll.completion_mask.shape[1]
    assert (roll.tool_calls > 0).sum() >= 3 and len(set(mask.sum(-1).tolist())) > 1
    adv = torch.randn(len(mask))
    old = C.batched_logprobs(model, roll, 1.0, 8, OFF) + 0.05 * torch.randn(mask.shape)

    def grads(mb, mode):
        model.zero_grad()
        for s in C.micro_batches(mask, mb):
            lp, _ = C.token_logprobs(model, roll.ids[s], roll.attention_mask[s], T)
            loss = grpo.per_token_loss(lp, old[s], adv[s], None, grpo.Args())[0]
            grpo.aggregate(loss, mask[s], mode, mask.sum(), len(mask), 20).backward()
        return torch.cat([p.grad.flatten() for p in model.parameters()])
    for mode in ("token-mean", "seq-mean-token-mean"):
        full = grads(8, mode)
        assert full.abs().max() > 0
        torch.testing.assert_close(grads(3, mode), full, atol=1e-6, rtol=1e-4)
        torch.testing.assert_close(grads(1, mode), full, atol=1e-6, rtol=1e-4)
    # an observation token's log-prob carries no gradient into the loss: changing its advantage
    # weight there changes nothing (the mask is 0)
    lp, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T)
    g = torch.autograd.grad((lp * mask).sum(), lp)[0]
    assert (g[mask == 0] == 0).all()


def slow_gae(rewards, values, mask, gamma, lam):
    """GAE over each row's model tokens only, written out: compact them, run the textbook
    recursion, put the results back."""
    adv = torch.zeros_like(rewards)
    for i in range(len(rewards)):
        idx = mask[i].nonzero().squeeze(-1).tolist()
        a_next, v_next = 0.0, 0.0
        for t in reversed(idx):
            delta = float(rewards[i, t]) + gamma * v_next - float(values[i, t])
            a_next = delta + gamma * lam * a_next
            adv[i, t], v_next = a_next, float(values[i, t])
    return adv, (adv + values) * mask


def test_ppo_score_and_gae_skip_observation_tokens():
    torch.manual_seed(0)
    mask = torch.tensor([[1, 1, 0, 0, 1, 1, 0], [1, 0, 0, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1],
                         [0, 0, 0, 0, 0, 0, 0]]).float()
    lp, ref = torch.randn(4, 7), torch.randn(4, 7)
    scores = torch.tensor([1.0, 2.0, 3.0, 4.0])
    rewards, kl = ppo.shaped_rewards(scores, lp, ref, mask, 0.1)
    assert (rewards[mask == 0] == 0).all() and (kl[mask == 0] == 0).all()
    for i, last in enumerate([5, 3, 6]):  # the score lands on each row's last model token
        expect = -0.1 * kl[i] * mask[i]
        expect[last] += scores[i]
        torch.testing.assert_close(rewards[i], expect)
    values = torch.randn(4, 7)
    for gamma, lam in ((1.0, 0.95), (0.9, 0.7)):
        adv, ret = ppo.gae(rewards, values, mask, gamma, lam)
        want_adv, want_ret = slow_gae(rewards, values * mask, mask, gamma, lam)
        torch.testing.assert_close(adv, want_adv)
        torch.testing.assert_close(ret * mask, want_ret)


def test_cat_rollouts_keeps_multi_turn_fields(tok):
    model = tiny_model("llama", seed=4)
    model.generation_config.eos_token_id = [2, 43, 72]
    torch.manual_seed(0)
    rows = [{"prompt": p} for p in PROMPTS]
    a = rollout(model, tok, C.encode_prompts(tok, PROMPTS[:3]), always_env(), rows[:3], 3, 20)
    b = rollout(model, tok, C.encode_prompts(tok, PROMPTS[3:]), always_env(), rows[3:], 3, 12)
    both = grpo.cat_rollouts([(a, torch.tensor([0, 2])), (b, torch.tensor([1]))])
    assert both.final == [a.final[0], a.final[2], b.final[1]]
    assert both.tool_calls.tolist() == [a.tool_calls[0], a.tool_calls[2], b.tool_calls[1]]
    for key in ("completion_mask", "sample_logprobs"):
        x = getattr(both, key)
        assert x[2, :getattr(b, key).shape[1]].tolist() == getattr(b, key)[1].tolist()
        assert x[2, getattr(b, key).shape[1]:].abs().sum() == 0
    lp = C.batched_logprobs(model, both, 1.0, 8, OFF)
    torch.testing.assert_close(lp, both.sample_logprobs, atol=2e-5, rtol=0)


QWEN_STYLE_TEMPLATE = (  # Qwen2.5's tool-use layout, in short
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\n</tools>\nCall a tool as <tool_call>{\"name\": ..., \"arguments\": ...}"
    "</tool_call><|im_end|>\n{%- endif %}"
    "{% for m in messages %}{% if m['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user"
    "{% endif %}{{ '\\n<tool_response>\\n' + m['content'] + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def chat_tokenizer():
    """The bundled tokenizer with a Qwen-style chat template (role tags, tools, tool messages)
    whose turns end on <|im_end|>, a special token and the EOS, as Qwen2.5-Instruct's do."""
    t = loading.load_tokenizer(loading.DEFAULT_POLICY)
    t.add_tokens(["<|im_start|>", "<|im_end|>"], special_tokens=True)
    t.add_tokens(["\n"])  # (the bundled vocabulary has no newline)
    t.eos_token = "<|im_end|>"
    t.chat_template = QWEN_STYLE_TEMPLATE
    return t


@pytest.mark.parametrize("ends_on", ["eos", "stop"])
def test_chat_tool_observation_is_the_templates_difference(ends_on):
    """envs.chat_observation: the chat template rendered with and without the tool message, the
    difference, as token ids. Fed after the model's call turn, the transcript is the template's
    rendering of the whole conversation, token for token, the model's own ids untouched,
    whether the call turn ended on the model's own <|im_end|> (the EOS) or on a stop string; the
    tool's result is text, its '<|im_end|>' five-and-more characters, not the special token."""
    t = chat_tokenizer()
    messages = [{"role": "user", "content": "1234+5678="}]
    call = '<tool_call>{"a": 1234, "b": 5678}</tool_call>'
    result = "6912 <|im_end|>"
    obs = E.chat_observation(t, messages, call, result)
    im_end = t.convert_tokens_to_ids("<|im_end|>")
    assert obs[0] == im_end and obs.count(im_end) == 2  # the turn's end tag and the message's
    assert t.decode(obs) == ("<|im_end|>\n<|im_start|>user\n<tool_response>\n6912 <|im_end|>\n"
                             "</tool_response><|im_end|>\n<|im_start|>assistant\n")
    enc = lambda s: t(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    prompt = C.encode_prompts(t, [messages])[0]
    turn1 = enc(call) + ([im_end] if ends_on == "eos" else [])
    obs_ids = obs[1:] if ends_on == "eos" else obs
    completion = turn1 + obs_ids + enc("6912") + [im_end]
    kinds = [1] * len(turn1) + [0] * len(obs_ids) + [1] * 5
    model = scripted_model(t, [prompt], [completion], [kinds])

    def env(row, turns):
        return E.chat_observation(t, row["prompt"], turns[-1], result) if len(turns) == 1 \
            else None
    stop = ["</tool_call>"] if ends_on == "stop" else []
    roll = rollout(model, t, [prompt], env, [{"prompt": messages}], 3, 200, greedy=True,
                   stop=stop)
    whole = messages + [{"role": "assistant", "content": call},
                        {"role": "tool", "content": result}]
    rendered = t.apply_chat_template(whole, tokenize=False, add_generation_prompt=True)
    head, tail = rendered.split(result)
    want = enc(head) + t(result, add_special_tokens=False, split_special_tokens=True)[
        "input_ids"] + enc(tail) + enc("6912") + [im_end]
    n = int(roll.attention_mask[0].sum())
    assert roll.ids[0, -n:].tolist() == want
    assert roll.final == ["6912"] and roll.completion_mask[0].sum() == len(turn1) + 5


TOOLS_FILE = '''
def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def shout(text: str) -> str:
    """Refuse loudly.

    Args:
        text: what to refuse
    """
    raise ValueError("no " + text)
'''


def test_tools_are_shown_by_the_template_parsed_run_and_answered_as_tool_messages(tmp_path):
    """--tools: the functions' schemas (get_json_schema: type hints and docstring) are rendered
    into every prompt by the chat template; a model turn's calls are parsed in Qwen's
    <tool_call> JSON, several in one turn; a bad call, an unknown tool or a raising tool is an
    'error: ...' tool message, never a crash; the results go back as tool messages through the
    template, so the whole transcript is the template's rendering of the conversation; calls
    and errors are counted per tool."""
    (tmp_path / "tools.py").write_text(TOOLS_FILE)
    env = E.load_env("", f"{tmp_path / 'tools.py'}:add,shout")
    assert [s["function"]["name"] for s in env.tools] == ["add", "shout"]
    t = chat_tokenizer()
    messages = [{"role": "user", "content": "2+3="}]
    prompt = C.encode_prompts(t, [messages], tools=env.tools)[0]
    shown = t.decode(prompt)
    assert '"name": "add"' in shown and "Add two whole numbers." in shown and "the first" in shown
    call = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'
            '<tool_call>{"name": "shout", "arguments": {"text": "x"}}</tool_call>'
            '<tool_call>{"name": "mul", "arguments": {}}</tool_call><tool_call>{oops</tool_call>')
    enc = lambda s: t(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    im_end = t.eos_token_id
    functions, schemas = E.load_tools(f"{tmp_path}/tools.py:add,shout")
    episode = E.ToolEpisode({"prompt": messages}, t, functions, schemas)
    obs = episode.step([call])
    results = ["5", "error: ValueError: no x", "error: no tool 'mul'; the tools are add, shout",
               "error: the call is not JSON with a name and arguments: {oops"]
    assert [m["content"] for m in episode.messages[2:]] == results
    assert episode.calls == [("add", True), ("shout", False), ("mul", False), (None, False)]
    assert episode.step(["5"]) is None  # no call: that turn was the answer
    # the same turns through the sampler: a scripted model writes the call, then the answer
    completion = enc(call) + [im_end] + obs[1:] + enc("5") + [im_end]
    kinds = [1] * (len(enc(call)) + 1) + [0] * (len(obs) - 1) + [1, 1]
    model = scripted_model(t, [prompt], [completion], [kinds])
    args = SimpleNamespace(max_new_tokens=900, temperature=1.0, top_p=1.0, stop=[], max_turns=3,
                           chat_template="auto", system_prompt="")
    roll, texts = C.generate(model, t, [{"prompt": messages, "answer": "5"}], args, OFF, env,
                             greedy=True)
    whole = t.apply_chat_template(
        messages + [{"role": "assistant", "content": call}]
        + [{"role": "tool", "content": r} for r in results], tools=env.tools, tokenize=False,
        add_generation_prompt=True) + "5<|im_end|>"
    n = int(roll.attention_mask[0].sum())
    assert t.decode(roll.ids[0, -n:]) == whole and texts == ["5"]
    m = runs.tool_metrics(roll, env)
    assert m["tool_calls/add"] == 1 and m["tool_errors/add"] == 0
    assert m["tool_calls/shout"] == 1 and m["tool_errors/shout"] == 1 and m["tool_calls"] == 1


def test_tools_need_a_template_that_renders_them_and_a_schema_per_function(tmp_path):
    (tmp_path / "tools.py").write_text(TOOLS_FILE + "\ndef bare(x):\n    return x\n")
    env = E.load_env("", f"{tmp_path / 'tools.py'}:add")
    plain = loading.load_tokenizer(loading.DEFAULT_POLICY)
    with pytest.raises(C.UserError, match="--tools needs a model whose chat template renders"):
        env.start([{"prompt": "1+2="}], plain)
    with pytest.raises(C.UserError, match=r"--tools: 'bare' has no schema: .* type hint"):
        E.load_env("", f"{tmp_path / 'tools.py'}:add,bare")
    with pytest.raises(C.UserError, match="give --env or --tools, not both"):
        E.load_env("calc", f"{tmp_path / 'tools.py'}:add")
    t = chat_tokenizer()
    t.chat_template = t.chat_template.replace("<tool_call>", "[CALL]")
    with pytest.raises(C.UserError, match="--tools reads calls through the tokenizer's response"):
        env.start([{"prompt": "1+2="}], t)


def test_grpo_with_tools_runs_and_samples_show_the_rendered_prompt(tmp_path, monkeypatch):
    """`grpo.py --tools FILE.py:add` on a chat model whose template renders tools: it runs, logs
    calls and errors per tool, and samples.jsonl shows each prompt as the model saw it, the tool's
    name and docstring included, beside the raw prompt."""
    (tmp_path / "tools.py").write_text(TOOLS_FILE)
    t = chat_tokenizer()
    cfg = tiny_config("qwen2", vocab=len(t))
    cfg.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "model")
    t.save_pretrained(tmp_path / "model")
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--model", tmp_path / "model", "--tools",
             f"{tmp_path / 'tools.py'}:add,shout", "--max_new_tokens", "8", "--max_steps", "2",
             "--rewards", "length", "--samples_every", "1", "--output_dir", out)
    m = read_metrics(out)
    assert {"tool_calls", "tool_calls/add", "tool_errors/add", "tool_calls/shout"} <= set(m[0])
    lines = (out / "samples.jsonl").read_text().splitlines()  # --samples_every 1: each step
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    sample = json.loads(lines[0])["samples"][0]
    shown = sample["rendered_prompt"].replace(" ", "")  # (this saved tokenizer drops spaces)
    assert sample["prompt"].endswith("=") and '"name":"add"' in shown
    assert "Addtwowholenumbers." in shown and shown.endswith("<|im_start|>assistant\n")


def test_env_calc_runs_every_script_with_its_metrics(tmp_path, monkeypatch):
    """grpo, reinforce and ppo with --env calc (the bundled model and task): tool metrics logged,
    samples show transcripts with observations marked, eval is mean@k with greedy beside it."""
    for script, flags in ((grpo, FAST_GRPO), (R, ["--prompts_per_step", "2",
                                                  "--samples_per_prompt", "4"]),
                          (ppo, ["--batch_size", "8", "--micro_batch_size", "8",
                                 "--num_minibatches", "1"])):
        out = tmp_path / script.__name__
        run_main(monkeypatch, script, "--env", "calc", *flags, "--max_steps", "2",
                 "--eval_size", "8", "--eval_every", "0", "--output_dir", str(out))
        m = read_metrics(out)
        assert {"tool_calls", "frac_tool", "turns", "tool_errors"} <= set(m[0])
        assert all(0 <= x["frac_tool"] <= x["tool_calls"] <= 2 for x in m)
        s = json.loads((out / "summary.json").read_text())
        assert s["args"]["model"] == E.CALC_MODEL and {"eval_greedy", "eval_pass@4"} <= set(
            s["evals"]["before"])
        shown = [x["completion"] for line in (out / "samples.jsonl").read_text().splitlines()
                 for x in json.loads(line)["samples"]]
        assert shown and all(c.count("⟦") == c.count("</calc>⟦") for c in shown), shown
        assert any(x["frac_tool"] > 0 for x in m)


def test_torchrun_and_resume_with_env(tmp_path, monkeypatch):
    """--env calc under torchrun (2 gloo processes) makes the one-process update; --resume
    continues an --env run as a straight run goes."""
    flags = ["--env", "calc", "--prompts_per_step", "4", "--group_size", "4",
             "--micro_batch_size", "8", "--eval_size", "8", "--max_steps", "1"]
    out = {}
    for name, n in (("one", 1), ("two", 2)):
        out[name] = tmp_path / name
        r = run_processes(tmp_path, n, "grpo", *flags, "--output_dir", str(out[name]))
        assert r.returncode == 0, r.stderr[-3000:]
    a, b = read_metrics(out["one"])[0], read_metrics(out["two"])[0]
    for key in ("reward", "tool_calls", "frac_tool", "grad_norm"):
        assert b[key] == pytest.approx(a[key], rel=1e-5), key
    common = ["--env", "calc", *FAST_GRPO, "--save_every", "2"]
    run_main(monkeypatch, grpo, *common, "--output_dir", str(tmp_path / "a"), "--max_steps", "4")
    run_main(monkeypatch, grpo, *common, "--output_dir", str(tmp_path / "b"), "--max_steps", "2")
    run_main(monkeypatch, grpo, "--resume", str(tmp_path / "b"), "--max_steps", "4")
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    for key in ("reward", "loss", "grad_norm", "tool_calls"):
        assert [x[key] for x in a] == pytest.approx([x[key] for x in b], rel=1e-5), key


def test_compare_task_calc_runs_the_scripts_with_env_calc(tmp_path):
    out = tmp_path / "cmp"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "compare.py"), "--task", "calc",
           "--quick", "--samples", "64", "--eval_size", "8", "--eval_points", "1", "--algos",
           "rloo,ppo,ppo-math,grpo", "--kl_samples", "1", "--output_dir", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "held-out mean@4 sampled accuracy on 8 prompts" in r.stdout
    table = r.stdout[r.stdout.index("algorithm"):]
    assert not any(line.startswith("ppo-math") for line in table.splitlines())  # = ppo here
    for name, models in (("rloo", "1 (1)"), ("ppo", "3 (2)"), ("grpo", "2 (1)")):
        row = next(line for line in table.splitlines() if line.startswith(name + " "))
        assert models in row and "failed" not in row, row
        args = json.loads((out / f"{name}-s0" / "summary.json").read_text())["args"]
        assert args["env"] == "calc" and args["model"] == E.CALC_MODEL


def test_calc_task_learns(tmp_path):
    """grpo.py --env calc, short: the held-out score (mean@4 sampled) and the calling rate rise
    clearly (measured on 500 prompts, 3 seeds: 0.27-0.30 -> 0.89-0.91 by step 20)."""
    out = tmp_path / "out"
    r = run_script("grpo.py", "--env", "calc", "--max_steps", "15", "--eval_every", "0",
                   "--eval_size", "100", "--save_every", "0", "--output_dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_after"] >= summary["eval_before"] + 0.3, summary
    metrics = read_metrics(out)
    first = sum(m["frac_tool"] for m in metrics[:5]) / 5
    last = sum(m["frac_tool"] for m in metrics[-5:]) / 5
    assert last >= first + 0.2, (first, last)


# ---- the RLHF pipeline: sft.py, reward_model.py, dpo.py
def summary_and_metrics(out):
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, metrics


def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------ the losses
def test_bradley_terry_loss_equals_slow_reference():
    torch.manual_seed(0)
    rc, rr, margin = torch.randn(7), torch.randn(7), torch.rand(7)
    weight = torch.tensor([1, 1 / 3, 1 / 3, 1 / 3, 0.5, 0.5, 1])  # rows of 1, 3, 2 and 1 pairs
    slow = 0.0
    for c, r, m, w in zip(rc.tolist(), rr.tolist(), margin.tolist(), weight.tolist()):
        slow += -w * math.log(1 / (1 + math.exp(-(c - r - m))))
    got = reward_model.bradley_terry_loss(rc, rr, margin, weight, n_rows=4)
    assert float(got) == pytest.approx(slow / 4, rel=1e-5)


@pytest.mark.parametrize("loss_type,eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_dpo_and_ipo_losses_equal_slow_reference(loss_type, eps):
    torch.manual_seed(1)
    lc, lr_, rc, rr = (torch.randn(6) * 3 for _ in range(4))
    weight, beta = torch.rand(6), 0.3
    slow = 0.0
    for a, b, c, d, w in zip(lc.tolist(), lr_.tolist(), rc.tolist(), rr.tolist(), weight.tolist()):
        h = (a - c) - (b - d)
        if loss_type == "ipo":
            slow += w * (h - 1 / (2 * beta)) ** 2
        else:
            sig = 1 / (1 + math.exp(-beta * h))
            slow += w * (-(1 - eps) * math.log(sig) - eps * math.log(1 - sig))
    loss, r_chosen, r_rejected = dpo.dpo_loss(lc, lr_, rc, rr, beta, loss_type, eps, weight, 3)
    assert float(loss) == pytest.approx(slow / 3, rel=1e-5)
    torch.testing.assert_close(r_chosen, beta * (lc - rc))
    torch.testing.assert_close(r_rejected, beta * (lr_ - rr))
    # policy = reference: h = 0, so DPO's loss is log 2 (IPO's 1 / (4 beta^2)) for every pair
    start, _, _ = dpo.dpo_loss(lc, lr_, lc, lr_, beta, loss_type, eps)
    assert float(start) == pytest.approx(math.log(2) if loss_type == "sigmoid"
                                         else 1 / (4 * beta**2), rel=1e-6)


def test_sft_gradient_is_the_same_with_micro_batches_and_eos_is_in_the_loss(tok):
    """The loss is normalised over the whole step's completion tokens, so micro-batches do not
    change the gradient; masks come from lengths, so the EOS carries loss even when pad = EOS."""
    model = loading.load_model(loading.DEFAULT_POLICY, "lm", torch.device("cpu"))
    examples = [(tok(f"{a}+{b}=")["input_ids"],
                 tok(str(a + b), add_special_tokens=False)["input_ids"] + [tok.eos_token_id])
                for a, b in [(1, 2), (37, 48), (99, 99), (5, 60)]]
    batch = tasks.collate(examples, tok.eos_token_id, "cpu")  # padded with the EOS id itself
    mask = batch.completion_mask
    assert mask.sum(1).tolist() == [len(c) for _, c in examples]  # every EOS counted
    grads = []
    for size in (4, 1):
        model.zero_grad()
        for mb in C.micro_batches(mask, size):
            lp, _ = C.token_logprobs(model, batch.ids[mb], batch.attention_mask[mb], mask.shape[1])
            sft.sft_loss(lp, mask[mb], mask.sum()).backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol=1e-4)
    # and the loss is the plain per-token mean of -log pi over the completions
    with torch.no_grad():
        lp, _ = C.plain_token_logprobs(model, batch.ids, batch.attention_mask, mask.shape[1])
    slow = [-lp[i, :len(c)].sum() for i, (_, c) in enumerate(examples)]
    assert float(sft.sft_loss(lp, mask, mask.sum())) == pytest.approx(
        float(sum(slow)) / float(mask.sum()), rel=1e-5)


# ------------------------------------------------------------------------------ the data
def test_rankings_expand_into_all_pairs_weighted_per_prompt(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [
        {"prompt": "1+1=", "ranking": ["2", "3", "1", "x"]}, "",
        {"prompt": "2+2=", "chosen": "4", "rejected": "5", "margin": 2}])
    rows, held = tasks.read_preferences(str(path), eval_size=0)
    assert held == [] and len(rows) == 2
    assert tasks.ranking_pairs(4) == [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)]
    prompts, completions, chosen, rejected, margin, weight = tasks.flatten(rows)
    assert completions == ["2", "3", "1", "x", "4", "5"]
    pairs = [(completions[i], completions[j]) for i, j in zip(chosen, rejected)]
    assert pairs == [("2", "3"), ("2", "1"), ("2", "x"), ("3", "1"), ("3", "x"), ("1", "x"),
                     ("4", "5")]
    assert [prompts[i] for i in chosen] == ["1+1="] * 6 + ["2+2="]
    torch.testing.assert_close(weight, torch.tensor([1 / 6] * 6 + [1.0]))  # each row weighs 1
    torch.testing.assert_close(margin, torch.tensor([0.0] * 6 + [2.0]))


def test_held_out_split_keeps_every_row_of_a_prompt_on_one_side(tmp_path):
    rows = [{"prompt": f"{i % 40}+1=", "chosen": "a", "rejected": f"b{i}"} for i in range(200)]
    train, held = tasks.read_preferences(str(write_jsonl(tmp_path / "p.jsonl", rows)), 500)
    assert len({r["prompt"] for r in held}) == 8  # a fifth of the 40 prompts
    assert not {r["prompt"] for r in held} & {r["prompt"] for r in train}
    again = tasks.read_preferences(str(tmp_path / "p.jsonl"), 500)[1]
    assert [r["completions"] for r in again] == [r["completions"] for r in held]  # fixed split

def chat(*turns):
    """Messages from (role, content) pairs, e.g. chat(("user", "1+1="))."""
    return [{"role": r, "content": c} for r, c in turns]


PREFERENCE_FORMATS = {  # TRL's preference formats, each: (row, prompt, [chosen, rejected])
    "explicit text": ({"prompt": "The sky is", "chosen": " blue.", "rejected": " green."},
                      "The sky is", [" blue.", " green."]),
    "implicit text": ({"chosen": "The sky is blue.", "rejected": "The sky is green."},
                      "The sky is", [" blue.", " green."]),
    "implicit text, a shared word start": ({"chosen": "1+1= 22", "rejected": "1+1= 23"}, "1+1=",
                                           [" 22", " 23"]),
    "explicit messages": ({"prompt": chat(("user", "Sky?")), "chosen": chat(("assistant", "Blue")),
                           "rejected": chat(("assistant", "Green"))},
                          chat(("user", "Sky?")), ["Blue", "Green"]),
    "implicit messages": ({"chosen": chat(("system", "Be brief."), ("user", "Sky?"),
                                          ("assistant", "Blue")),
                           "rejected": chat(("system", "Be brief."), ("user", "Sky?"),
                                            ("assistant", "Green"))},
                          chat(("system", "Be brief."), ("user", "Sky?")), ["Blue", "Green"]),
    "ranking of messages": ({"prompt": "Sky?", "ranking": [chat(("assistant", "Blue")), "Grey",
                                                           chat(("assistant", "Green"))]},
                            "Sky?", ["Blue", "Grey", "Green"])}


@pytest.mark.parametrize("name", PREFERENCE_FORMATS)
def test_preference_rows_in_trls_formats(tmp_path, name):
    row, prompt, completions = PREFERENCE_FORMATS[name]
    rows, _ = tasks.read_preferences(str(write_jsonl(tmp_path / "p.jsonl", [row])), 0)
    assert [(r["prompt"], r["completions"]) for r in rows] == [(prompt, completions)]


@pytest.mark.parametrize("row,message", [
    ({"chosen": "Blue.", "rejected": "Green."}, "line 1: field 'prompt' is missing, and 'chosen' "
     "and 'rejected' do not start with a shared .implicit. prompt; fields found: chosen, rejected"),
    ({"prompt": "Sky?", "chosen": chat(("assistant", "a"), ("assistant", "b")), "rejected": "c"},
     "line 1: field 'chosen' is missing or not a string or a list of one assistant message"),
    ({"chosen": chat(("user", "Sky?"), ("wizard", "Blue")), "rejected": chat(("user", "Sky?"))},
     "line 1: field 'chosen', message 1: role 'wizard' is not one of")])
def test_bad_preference_formats_get_one_line(tmp_path, row, message):
    with pytest.raises(C.UserError, match=message):
        tasks.read_preferences(str(write_jsonl(tmp_path / "p.jsonl", [row])), 0)


@pytest.mark.parametrize("script", [dpo, reward_model])
def test_dpo_and_reward_model_train_on_implicit_conversational_pairs_in_parquet(
        script, tmp_path, monkeypatch):
    """TRL's conversational implicit-prompt pairs, in a parquet file: two optimizer steps."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    rows = [{"chosen": chat(("user", f"{a}+{b}="), ("assistant", str(a + b))),
             "rejected": chat(("user", f"{a}+{b}="), ("assistant", str(a + b + 10)))}
            for a, b in tasks.task_train_pairs(random.Random(0), 40)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "pairs.parquet")
    out = tmp_path / "run"
    run_main(monkeypatch, script, "--data", tmp_path / "pairs.parquet", "--max_steps", "2",
             "--batch_size", "8", "--eval_size", "8", "--eval_every", "0", "--output_dir", out)
    summary, metrics = summary_and_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2] and metrics[0]["pairs"] == 8



def test_length_batches_cover_each_row_once_and_group_similar_lengths():
    lengths = [random.Random(i).randrange(1, 50) for i in range(1000)]
    batches = sft.length_batches(lengths, 32, seed=0, epoch=3)
    assert sorted(i for b in batches for i in b) == list(range(1000))
    assert batches == sft.length_batches(lengths, 32, seed=0, epoch=3)  # resumable
    assert batches != sft.length_batches(lengths, 32, seed=0, epoch=4)
    def spread(batches):
        return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches)
    assert spread(batches) < 0.3 * len(batches) * 49  # random batches span nearly all of 1..49
    plain = sft.length_batches(lengths, 32, seed=0, epoch=3, window=0)  # the default: random
    assert sorted(i for b in plain for i in b) == list(range(1000))
    assert spread(plain) > 0.8 * len(plain) * 49


def test_score_forward_equals_common_rm_scores_with_and_without_a_chat_template():
    """Training scores what ppo.py and grpo.py will score: C.rm_scores' tokens and position."""
    tok = loading.load_tokenizer(loading.DEFAULT_POLICY)  # its own: the template is changed below
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=64,
                      max_position_embeddings=64, num_labels=1, pad_token_id=tok.pad_token_id)
    rm = LlamaForSequenceClassification(cfg).eval()
    prompts, completions = ["1+2=", "37+48=", "5+999="], ["3", "85", ""]
    for template in (None, "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} | "
                           "{% endfor %}"):
        tok.chat_template = template
        want = C.rm_scores(rm, tok, prompts, completions)
        scorer = reward_model.Scorer(rm)
        got = reward_model.score_forward(scorer, tok, prompts, completions, "auto")
        torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ the scripts learn
def test_sft_learns_on_the_bundled_task(monkeypatch, tmp_path):
    out = tmp_path / "sft"
    run_main(monkeypatch, sft, "--max_steps", 60, "--eval_every", 0, "--eval_size", 200,
             "--output_dir", out)
    summary, metrics = summary_and_metrics(out)
    before, after = summary["evals"]["before"], summary["evals"]["after"]
    assert after["eval"] >= before["eval"] + 0.25, summary["evals"]  # 0.36 -> about 0.75
    assert after["eval_loss"] <= before["eval_loss"] - 0.05, summary["evals"]
    assert [m["step"] for m in metrics] == list(range(1, 61))
    AutoModelForCausalLM.from_pretrained(out / "checkpoint")  # loads as it is


@pytest.fixture(scope="module")
def trained_rm(tmp_path_factory):
    """A reward model trained briefly on the bundled rankings (shared by two tests)."""
    out = tmp_path_factory.mktemp("rm") / "run"
    with pytest.MonkeyPatch.context() as mp:
        run_main(mp, reward_model, "--max_steps", 80, "--lr", "1e-3", "--eval_every", 0,
                 "--eval_size", 100, "--output_dir", out)
    return out


def test_reward_model_learns_on_the_bundled_rankings(trained_rm):
    summary, metrics = summary_and_metrics(trained_rm)
    assert summary["eval_before"] < 0.65 and summary["eval_after"] >= 0.75, summary["evals"]
    first, last = metrics[:10], metrics[-10:]  # measured: 0.48 -> 0.84 held out; 0.63 -> 0.84
    assert sum(m["accuracy"] for m in last) / 10 >= sum(m["accuracy"] for m in first) / 10 + 0.1
    assert {"loss", "accuracy", "margin", "score_mean", "score_std"} <= set(metrics[0])


def test_a_trained_reward_model_loads_in_ppo(monkeypatch, trained_rm, tmp_path, tok):
    ckpt = str(trained_rm / "checkpoint")
    rm = loading.load_model(ckpt, "rm", torch.device("cpu"), frozen=True)
    rm_tok = loading.load_tokenizer(ckpt)
    pairs, rng = tasks.task_eval_pairs()[:200], random.Random(0)
    held = [f"{a}+{b}=" for a, b in pairs]
    right = C.rm_scores(rm, rm_tok, held, [str(a + b) for a, b in pairs])
    wrong = C.rm_scores(rm, rm_tok, held, [str(wrong_answer(a, b, rng)) for a, b in pairs])
    assert (right > wrong).float().mean() >= 0.6  # true sums over slips (measured 0.70)
    prompts = ["37+48=", "57+68=", "12+13="]
    with torch.no_grad():  # the score it was trained on is the score ppo.py reads
        scorer = reward_model.Scorer(rm)
        torch.testing.assert_close(reward_model.score_forward(scorer, rm_tok, prompts,
                                                              ["85"] * 3, "auto"),
                                   C.rm_scores(rm, rm_tok, prompts, ["85"] * 3))
    out = tmp_path / "ppo"  # and ppo.py runs on it, as reward model and critic
    run_main(monkeypatch, ppo, "--reward_model", ckpt, "--max_steps", 2, "--batch_size", 8,
             "--num_minibatches", 1, "--micro_batch_size", 8, "--eval_size", 8,
             "--eval_every", 0, "--output_dir", out)
    summary, metrics = summary_and_metrics(out)
    assert summary["steps"] == 2 and all(math.isfinite(m["reward"]) for m in metrics)


def test_dpo_learns_on_the_bundled_rankings(monkeypatch, tmp_path):
    out = tmp_path / "dpo"
    run_main(monkeypatch, dpo, "--max_steps", 60, "--lr", "2e-4", "--eval_every", 0,
             "--eval_size", 200, "--output_dir", out)
    summary, metrics = summary_and_metrics(out)
    before, after = summary["evals"]["before"], summary["evals"]["after"]
    assert after["eval"] >= before["eval"] + 0.25, summary["evals"]
    assert before["eval_reward_acc"] == 0.5 and after["eval_reward_acc"] >= 0.7
    assert metrics[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # pi_theta = pi_ref
    assert metrics[0]["rewards/margin"] == pytest.approx(0.0, abs=1e-5)
    assert sum(m["rewards/margin"] for m in metrics[-10:]) > 0.1
    AutoModelForCausalLM.from_pretrained(out / "checkpoint")


@pytest.mark.parametrize("module,flags", [
    (sft, ["--batch_size", "16", "--micro_batch_size", "8"]),
    (reward_model, ["--batch_size", "8", "--micro_batch_size", "4"]),
    (dpo, ["--batch_size", "8", "--micro_batch_size", "4"])])
def test_pipeline_stopped_and_resumed_ends_as_a_straight_run(module, flags, monkeypatch,
                                                             tmp_path):
    """Ctrl-C (faked) after step 2 of 3, then --resume: the same losses and the same weights as a
    run straight through (the batches and the lr are functions of the step; the optimizer
    state is restored)."""
    flags = [*flags, "--max_steps", "3", "--lr", "1e-3", "--eval_size", "20", "--eval_every",
             "0", "--save_every", "0"]
    run_main(monkeypatch, module, *flags, "--output_dir", str(tmp_path / "a"))
    real_log = runs.log_step

    def log_step(run, metrics, *a):
        real_log(run, metrics, *a)
        runs.STOP["requested"] = metrics["step"] == 2  # as Ctrl-C does
    monkeypatch.setattr(runs, "log_step", log_step)
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, module, *flags, "--output_dir", str(tmp_path / "b"))
    assert e.value.code == 130 and [m["step"] for m in read_metrics(tmp_path / "b")] == [1, 2]
    run_main(monkeypatch, module, "--resume", str(tmp_path / "b"))
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["step"] for m in b] == [1, 2, 3]
    assert [m["loss"] for m in b] == pytest.approx([m["loss"] for m in a], rel=1e-6)
    wa, wb = (load_file(tmp_path / x / "checkpoint" / "model.safetensors") for x in "ab")
    for k in wa:
        torch.testing.assert_close(wb[k], wa[k], rtol=0, atol=1e-6)


@pytest.mark.parametrize("module", [sft, reward_model, dpo])
def test_pipeline_lora_trains_adapters_and_the_merged_model_scores_the_same(module, monkeypatch,
                                                                          tmp_path):
    """--lora_r: the checkpoint holds the adapters (a reward model's also its head), DPO's pi_ref
    is the policy with them off (so the first step's implicit rewards are exactly 0), and the
    model tools/merge_lora.py writes scores the held-out set as the run's own final eval did."""
    pytest.importorskip("peft")
    out = tmp_path / "run"
    run_main(monkeypatch, module, "--lora_r", "8", "--lr", "1e-2", "--max_steps", "3",
             "--batch_size", "8", "--micro_batch_size", "8", "--eval_size", "40",
             "--eval_every", "0", "--output_dir", str(out))
    assert (out / "checkpoint" / "adapter_model.safetensors").exists()
    assert not (out / "checkpoint" / "model.safetensors").exists()
    summary, metrics = summary_and_metrics(out)
    if module is dpo:
        assert metrics[0]["rewards/margin"] == 0.0 and metrics[0]["loss"] == pytest.approx(
            math.log(2), abs=1e-6)
    merged, args, cpu = merge_lora(str(out)), module.Args(eval_size=40), torch.device("cpu")
    tok = loading.load_tokenizer(merged)
    if module is reward_model:
        held = tasks.read_preferences(tasks.PIPELINE_RANKINGS, 40)[1]
        merged_rm = reward_model.Scorer(loading.load_model(merged, "rm", cpu))
        score = reward_model.pair_accuracy(merged_rm, tok, held, args)
    else:
        rows = tasks.load_data("", 40).eval_rows
        score = C.evaluate(loading.load_model(merged, "lm", cpu), tok, rows, args, OFF,
                           {"math": 1.0})["eval"]
    assert score == summary["eval_after"] != summary["eval_before"], summary["evals"]


# ------------------------------------------------------------------------------ bad input
BAD_ROWS = [({"prompt": "1+1=", "chosen": "2"}, "line 2: field 'rejected' is missing"),
            ({"prompt": "1+1=", "chosen": "2", "rejected": "2"},
             "line 2: a completion is both chosen and rejected"),
            ({"prompt": "1+1=", "ranking": []}, "line 2: field 'ranking' must be a list of 2"),
            ({"prompt": "1+1=", "ranking": ["2", "3", "2"]},
             "line 2: a completion is both chosen and rejected"),
            ({"chosen": "2", "rejected": "3"}, "line 2: field 'prompt'"),
            ({"prompt": "1+1=", "chosen": "2", "rejected": "3", "margin": "big"},
             "line 2: field 'margin' must be a finite number"),
            ("not json", "line 2: not valid JSON")]


@pytest.mark.parametrize("script", [reward_model, dpo])
@pytest.mark.parametrize("row,message", BAD_ROWS, ids=[m for _, m in BAD_ROWS])
def test_bad_preference_rows_get_one_line_with_file_and_line(script, row, message, monkeypatch,
                                                             tmp_path, capsys):
    path = write_jsonl(tmp_path / "prefs.jsonl", [{"prompt": "1+1=", "ranking": ["2", "3"]}, row])
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, script, "--data", path, "--output_dir", out, guard=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1, err
    assert f"{path}, {message}" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("row,message", [
    ({"prompt": "1+1="}, "line 2: field 'completion' is missing"),
    ({"messages": [{"role": "user", "content": "1+1="}]}, "line 2: field 'messages' must be"),
    ({"prompt": "1+1=", "completion": "2" * 80}, "line 2: 86 tokens, more than the model's")])
def test_bad_demonstration_rows_get_one_line_with_file_and_line(row, message, monkeypatch,
                                                                tmp_path, capsys):
    path = write_jsonl(tmp_path / "demos.jsonl", [{"prompt": "1+1=", "completion": "2"}, row])
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, sft, "--data", path, "--output_dir", tmp_path / "out", guard=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and f"{path}, {message}" in err[0], err


def test_bad_flags_are_refused(monkeypatch, tmp_path, capsys):
    for argv, message in ((["--label_smoothing", "0.5"], "--label_smoothing must be in [0, 0.5)"),
                          (["--loss_type", "ipo", "--label_smoothing", "0.1"], "IPO has none"),
                          (["--loss_type", "hinge"], "invalid choice: 'hinge'"),
                          (["--beta", "0"], "--beta must be > 0, not 0.0")):
        with pytest.raises(SystemExit):
            run_main(monkeypatch, dpo, *argv, "--output_dir", tmp_path / "out", guard=True)
        assert message in capsys.readouterr().err


def test_chat_messages_rows_train_with_a_chat_template(tmp_path):
    """{"messages"} rows: the prompt is the chat before the last (assistant) message, through
    the tokenizer's template, as common.encode_prompts builds it for the RL scripts."""
    tok = loading.load_tokenizer(loading.DEFAULT_POLICY)
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} | {% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")
    rows = [{"messages": [{"role": "system", "content": "Add."}, {"role": "user", "content": q},
                          {"role": "assistant", "content": a}]} for q, a in [("1+1=", "2")] * 3]
    examples = sft.read_demonstrations(str(write_jsonl(tmp_path / "chat.jsonl", rows)), tok,
                                       "auto", 64)
    prompt, completion, mask = examples[0]
    assert tok.decode(prompt, skip_special_tokens=True) == "system: Add. | user: 1+1= | assistant: "
    # the assistant's turn as the template renders it ("2 | "), to its last visible character
    assert completion == tok("2 |", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert mask == [1] * len(completion)

QWEN_TOOLS = (  # a Qwen2.5-style template: tools in the system turn, tool calls, tool messages
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "<|im_end|>\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n"
    "<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def runs_of(ids, mask, tok):
    """The completion cut where the mask changes: [(mask value, decoded text), ...]."""
    runs = []
    for i, m in zip(ids, mask):
        if not runs or runs[-1][0] != m:
            runs.append((m, []))
        runs[-1][1].append(i)
    return [(m, tok.decode(r)) for m, r in runs]


def test_sft_trains_every_assistant_turn_of_a_tool_conversation_and_nothing_else(chat_model,
                                                                                  tmp_path):
    """A multi-turn conversation through a Qwen-style chat template: the loss (and so the
    gradient) is on each assistant turn's tokens, its tool call and end tag included, and on
    nothing of the system, user and tool messages; the tokens are the template's rendering of
    the whole conversation. --last_turn_only trains the last turn alone."""
    tok = loading.load_tokenizer(chat_model)
    tok.chat_template = QWEN_TOOLS
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 12, "b": 34}}}
    conversation = [{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "12+34="},
                    {"role": "assistant", "content": None, "tool_calls": [call]},
                    {"role": "tool", "content": "46"},
                    {"role": "assistant", "content": "46"},
                    {"role": "user", "content": "and 1+1?"},
                    {"role": "assistant", "content": "2"}]
    tools = [{"name": "add"}]  # (a JSON schema, cut short: the model's context is 256)
    rows = [{"messages": conversation, "tools": tools}] * 2
    path = str(write_jsonl(tmp_path / "conv.jsonl", rows))
    (prompt, ids, mask), _ = sft.read_demonstrations(path, tok, "auto", 256)
    whole = tok.apply_chat_template([{**m, "content": m["content"] or ""} for m in conversation],
                                    tools=tools, tokenize=False)
    assert tok.decode(prompt + ids) == whole.rstrip()  # the template's rendering, to its end
    assert tok.decode(prompt).endswith("12+34=<|im_end|>\n<|im_start|>assistant\n")
    assert '# Tools\n{"name": "add"}' in tok.decode(prompt)  # the row's tools, rendered
    assert runs_of(ids, mask, tok) == [
        (1, '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 34}}\n</tool_call>'
            '<|im_end|>'),
        (0, "\n<|im_start|>user\n<tool_response>\n46\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n"),
        (1, "46<|im_end|>"),
        (0, "\n<|im_start|>user\nand 1+1?<|im_end|>\n<|im_start|>assistant\n"),
        (1, "2<|im_end|>")]  # the last end tag is the EOS token itself
    # the gradient of the step's loss reaches exactly the assistant tokens' log-probs
    model = loading.load_model(chat_model, "lm", torch.device("cpu"))
    batch = tasks.collate([(prompt, ids, mask)], tok.pad_token_id, "cpu")
    lp, _ = C.token_logprobs(model, batch.ids, batch.attention_mask, len(ids))
    grad, = torch.autograd.grad(sft.sft_loss(lp, batch.completion_mask, sum(mask)), lp)
    assert (grad[0] != 0).long().tolist() == mask and sum(mask) < len(mask)
    # the last turn only: the rest is the prompt, as before multi-turn training
    (p1, ids1, mask1), _ = sft.read_demonstrations(path, tok, "auto", 256, last_turn_only=True)
    assert p1 + ids1 == prompt + ids and runs_of(ids1, mask1, tok) == [(1, "2<|im_end|>")]
    # a template that does not render tool calls would train an empty turn: refused
    tok.chat_template = CHATML
    with pytest.raises(C.UserError, match=r"conv.jsonl, line 1: message 2: the chat template "
                                          "does not render its tool_calls"):
        sft.read_demonstrations(path, tok, "auto", 256)


def test_sft_conversation_without_a_template_is_the_multi_turn_rollouts_transcript():
    """Without a chat template a calculator conversation is exactly what common.sample builds
    when the model writes those turns with --env calc: the same ids, and the loss mask is the
    rollout's completion_mask (the observation ' 46 ' masked, the EOS in). The same text as one
    completion (envs.calc_demo's) has the same ids, every one of them trained."""
    t = loading.load_tokenizer(loading.DEFAULT_POLICY)
    conversation = chat(("user", "12+34="), ("assistant", "<calc>12+34</calc>"), ("tool", " 46 "),
                        ("assistant", "46"))
    prompt, ids, mask = tasks.encode_demonstration(t, tasks.demonstration(
        {"messages": conversation}, "row"))
    assert prompt == C.encode_prompts(t, ["12+34="], "none")[0]
    enc = lambda s: t(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    completion = enc("<calc>12+34</calc>") + enc(" 46 ") + enc("46") + [t.eos_token_id]
    model = scripted_model(t, [prompt], [completion], [[1] * 18 + [0] * 4 + [1] * 3])
    roll = rollout(model, t, [prompt], E.calc, [tasks.addition_row(12, 34)], 3, 48, greedy=True,
                   stop=["</calc>"])
    assert roll.observations == [[" 46 "]] and roll.final == ["46"]
    assert roll.ids[0, roll.P:].tolist() == ids
    assert roll.completion_mask[0].long().tolist() == mask == [1] * 18 + [0] * 4 + [1] * 3
    flat = E.calc_demo(12, 34, random.Random(0), column_sum, tool=1.0)
    assert tasks.encode_demonstration(t, tasks.demonstration(
        {"prompt": "12+34=", "completion": flat}, "row")) == (prompt, ids, [1] * len(ids))


SFT_FORMATS = {  # TRL's SFT formats, each: (row, the prompt's text, the completion's pieces)
    "language modelling": ({"text": "12+34=46"}, "<bos>", [(1, "12+34=46<eos>")]),
    "prompt-completion": ({"prompt": "12+34=", "completion": "46"}, "<bos>12+34=",
                          [(1, "46<eos>")]),
    "conversational prompt-completion": ({"prompt": chat(("user", "12+34=")),
                                          "completion": chat(("assistant", "46"))},
                                         "<bos>12+34=", [(1, "46<eos>")]),
    "conversation": ({"messages": chat(("user", "12+34="), ("assistant", "46"), ("user", "+1?"),
                                       ("assistant", "47"))},
                     "<bos>12+34=", [(1, "46"), (0, "+1?"), (1, "47<eos>")]),
    "completion of several messages": ({"prompt": "12+34=", "completion": chat(
        ("assistant", "<calc>12+34</calc>"), ("tool", " 46 "), ("assistant", "46"))},
        "<bos>12+34=", [(1, "<calc>12+34</calc>"), (0, " 46 "), (1, "46<eos>")])}


@pytest.mark.parametrize("name", SFT_FORMATS)
def test_sft_rows_in_trls_formats(tmp_path, tok, name):
    """Each SFT format, without a chat template: the prompt, and which completion tokens train."""
    row, prompt_text, runs = SFT_FORMATS[name]
    path = write_jsonl(tmp_path / "d.jsonl", [row])
    (prompt, ids, mask), = sft.read_demonstrations(str(path), tok, "auto", 64)
    assert tok.decode(prompt) == prompt_text and runs_of(ids, mask, tok) == runs


def test_sft_runs_on_text_rows_and_conversational_prompt_completion_rows(tmp_path, monkeypatch):
    rows = [SFT_FORMATS[k][0] for k in ("language modelling", "conversational prompt-completion")]
    out = tmp_path / "run"
    run_main(monkeypatch, sft, "--data", write_jsonl(tmp_path / "d.jsonl", rows * 10),
             "--max_steps", "2", "--batch_size", "8", "--eval_size", "8", "--eval_every", "0",
             "--output_dir", out)
    assert [m["step"] for m in summary_and_metrics(out)[1]] == [1, 2]



def test_report_to_sends_the_metrics_and_samples_to_a_tracker(tmp_path, monkeypatch, capsys):
    """--report_to wandb (a fake module here): every metrics line and the samples table reach it;
    a tracker that is not installed is one line."""
    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: calls.append(("init", kw["project"]))
    fake.log = lambda data, step: calls.append(("log", step, sorted(data)))
    fake.Table = lambda columns, data: ("table", columns, len(data))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--report_to", "wandb",
             "--output_dir", out)
    logged = [c for c in calls if c[0] == "log"]
    assert calls[0] == ("init", "minrl") and calls[-1] == ("finish",)
    assert [c[1] for c in logged] == [1, 2]  # one call a step; step 1 with the samples table
    assert "reward" in logged[0][2] and "samples" in logged[0][2]
    assert set(logged[1][2]) == set(read_metrics(out)[1]) - {"step"}
    monkeypatch.setitem(sys.modules, "trackio", None)
    with pytest.raises(SystemExit):
        run_main(monkeypatch, grpo, "--report_to", "trackio", "--output_dir", tmp_path / "t",
                 guard=True)
    assert "needs the optional package trackio (pip install trackio)" in capsys.readouterr().err


# ---- the workshop kit: tools/compare.py, tools/plot.py, EXERCISES.md, bench/threads.py
def fake_run(folder, algo, rewards, evals=(0.3, 0.6, 0.9), extra=None):
    """A run folder as the scripts write it: metrics.jsonl (a held-out "eval" on the middle step,
    and a last line cut short, as a crash leaves it) and summary.json."""
    os.makedirs(folder)
    args = {"grpo": {"group_size": 8, "prompts_per_step": 8, "beta": 0.04},
            "reinforce": {"samples_per_prompt": 8, "prompts_per_step": 8, "beta": 0.0},
            "ppo": {"batch_size": 64, "kl_coef": 0.05}}[algo]
    args.update(rewards="", lora_r=0)
    with open(os.path.join(folder, "metrics.jsonl"), "w") as f:
        for step, r in enumerate(rewards, 1):
            m = {"step": step, "reward": r, "kl": 0.01 * step, "grad_norm": 1.0 + r,
                 "step_time": 0.5, **(extra or {})}
            if step == len(rewards) // 2:
                m["eval"] = evals[1]
            f.write(json.dumps(m) + "\n")
        f.write('{"step": 99, "rew')  # cut short by a crash: skipped
    with open(os.path.join(folder, "summary.json"), "w") as f:
        json.dump({"algo": algo, "args": args, "eval_before": evals[0], "eval_after": evals[2],
                   "wall_time_s": 12.0, "peak_mem_mb": 450.0, "interrupted": False}, f)
    return folder


def without_matplotlib(monkeypatch):
    """`import matplotlib` raises ImportError from here on, installed or not."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)


# ---- tools/compare.py
def test_compare_quick_path_runs_each_script_and_prints_the_table(tmp_path):
    """--quick with a tiny budget (one step of 64 completions, 10 held-out prompts, one seed) on
    one configuration of each script. A second call reads the finished runs instead of rerunning
    them; one with another budget is refused rather than mixed into the same folder."""
    out = tmp_path / "cmp"
    cmd = [sys.executable, os.path.join(ROOT, "tools", "compare.py"), "--quick", "--samples", "64",
           "--eval_size", "10", "--eval_points", "1", "--algos", "rloo,ppo-math,grpo",
           "--out", str(out)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    t0 = time.time()
    r = subprocess.run(cmd + ["--kl_samples", "1"], capture_output=True, text=True, cwd=ROOT,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert f"runs go to {out}/" in r.stdout
    table = r.stdout[r.stdout.index("algorithm"):]
    for name, models in (("rloo", "1 (1)"), ("ppo-math", "3 (2)"), ("grpo", "2 (1)")):
        row = next(line for line in table.splitlines() if line.startswith(name + " "))
        assert models in row and "failed" not in row
        assert os.path.isfile(out / f"{name}-s0" / "summary.json")
        assert os.path.isfile(out / f"{name}-s0.log")
        assert str(out / f"{name}-s0") in r.stdout  # where its curves' data lives
    assert "compare.png" in r.stdout  # written, or the one-line reason why not
    print(f"compare.py --quick, tiny: {time.time() - t0:.0f} s")
    again = subprocess.run(cmd + ["--kl_samples", "0"], capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=120)
    assert again.returncode == 0 and again.stdout.count("finished before, read from") == 3
    other = subprocess.run(cmd + ["--samples", "128"], capture_output=True, text=True, cwd=ROOT,
                           env=env, timeout=120)  # the folder holds 1-step runs: refused
    assert other.returncode == 1 and "holds a run with other settings" in other.stderr


def test_compare_figure_needs_matplotlib_and_says_so(tmp_path, monkeypatch):
    done = {"reinforce": [fake_run(tmp_path / "r", "reinforce", [0.2, 0.5, 0.7],
                                   extra={"sample_grad_rms": 0.3})],
            "grpo": [fake_run(tmp_path / "g", "grpo", [0.3, 0.6, 0.8])]}
    path = str(tmp_path / "compare.png")
    without_matplotlib(monkeypatch)
    assert compare.figure(done, path) == "no png: pip install matplotlib for it"
    assert not os.path.exists(path)
    monkeypatch.undo()
    pytest.importorskip("matplotlib")
    assert compare.figure(done, path) == path and os.path.getsize(path) > 10_000


def test_compare_table_and_models_held(tmp_path):
    done = {"grpo": [fake_run(tmp_path / "g0", "grpo", [0.3, 0.6, 0.8], (0.3, 0.6, 0.9)),
                     fake_run(tmp_path / "g1", "grpo", [0.3, 0.6, 0.8], (0.3, 0.6, 0.8))],
            "ppo": []}
    text = compare.table(done, kl_samples=0)
    grpo_row, ppo_row = text.splitlines()[1:]
    assert grpo_row.split()[:4] == ["grpo", "0.300", "0.850", "(0.80-0.90)"]
    assert "failed" in ppo_row
    ppo_args = {"rewards": "", "kl_coef": 0.05, "lora_r": 0}
    assert compare.models_held(ppo_args, "ppo") == (4, 2)  # policy, critic; reference, RM
    assert compare.models_held({**ppo_args, "rewards": "math"}, "ppo") == (3, 2)
    assert compare.models_held({"rewards": "", "beta": 0.0, "lora_r": 0}, "reinforce") == (1, 1)


# ---- tools/plot.py
def test_plot_text_fallback_prints_a_sparkline_per_run(tmp_path, monkeypatch, capsys):
    a = fake_run(tmp_path / "grpo-a", "grpo", [0.1, 0.4, 0.5, 0.9])
    b = fake_run(tmp_path / "rf-b", "reinforce", [0.2, 0.3, 0.8, 0.7])
    without_matplotlib(monkeypatch)
    plot.main([str(a), str(b), "--metric", "reward", "--metric", "eval", "--x", "samples",
               "--out", str(tmp_path / "p.png")])
    out = capsys.readouterr().out
    assert out.startswith("no png: pip install matplotlib for it; sparklines instead")
    assert not os.path.exists(tmp_path / "p.png")
    lines = out.splitlines()
    reward = lines[lines.index("reward") + 1:lines.index("eval")]
    evals = lines[lines.index("eval") + 1:]
    assert [line.split()[0] for line in reward] == ["grpo-a", "rf-b"]
    assert "[0.1 .. 0.9]" in reward[0] and "4 points, x 64..256" in reward[0]
    assert "3 points, x 0..256" in evals[0]  # before (summary), step 2 (metrics), after


def test_plot_curve_axes(tmp_path):
    run = fake_run(tmp_path / "ppo", "ppo", [1.0, 2.0, 3.0])
    assert plot.curve(run, "reward") == ([1, 2, 3], [1.0, 2.0, 3.0])
    assert plot.curve(run, "reward", "samples")[0] == [64, 128, 192]
    assert plot.curve(run, "eval", "time") == ([0, 0.5, 1.5], [0.3, 0.6, 0.9])
    assert plot.curve(run, "no_such_metric") == ([], [])


# ---- EXERCISES.md
def exercises():
    """(number, title, script, the quoted line, commands) of each exercise in EXERCISES.md."""
    text = open(os.path.join(ROOT, "EXERCISES.md"), encoding="utf-8").read()
    out = []
    for section in re.split(r"\n## ", text)[1:]:
        title = section.splitlines()[0]
        script = re.search(r"\*\*Script:\*\* `(\w+\.py)`", section)
        line = re.search(r"\*\*Line to change:\*\*\n+```python\n(.*?)\n```", section, re.S)
        commands = re.findall(r"^ *(python \w+\.py.*)$", section, re.M)
        out.append((title, script and script.group(1), line and line.group(1), commands))
    return out


def test_exercises_quote_lines_that_still_exist():
    found = exercises()
    assert 8 <= len(found) <= 17
    for title, script, line, commands in found:
        assert script in ("grpo.py", "reinforce.py", "ppo.py"), title
        assert line, f"{title}: no quoted line to change"
        source = open(os.path.join(ROOT, script), encoding="utf-8").read().splitlines()
        assert source.count(line) == 1, f"{title}: {script} no longer has, once, the line {line!r}"
        assert commands, f"{title}: no measured command"


def test_exercises_commands_use_flags_their_script_has():
    for title, script, _, commands in exercises():
        for command in commands:
            name = command.split()[1][:-3]
            fields = {f.name for f in dataclasses.fields(importlib.import_module(name).Args)}
            for flag in re.findall(r"--(\w+)", command):
                assert flag in fields, f"{title}: {name}.py has no --{flag}"


# ---- bench/threads.py
def test_threads_bench_kills_its_busy_processes():
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    threads = importlib.import_module("threads")
    threads.start_busy(2)
    procs = list(threads.BUSY)
    assert all(p.poll() is None for p in procs)
    threads.stop_busy()
    assert not threads.BUSY and all(p.poll() is not None for p in procs)


# ---- command line: the scripts end to end
FAST_GRPO = ["--prompts_per_step", "2", "--group_size", "4", "--micro_batch_size", "8",
             "--eval_size", "10", "--eval_every", "0"]


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Tiny random models of real architectures saved as HF folders (one with a chat template),
    and a JSONL file."""
    d = tmp_path_factory.mktemp("models")
    for arch in ARCHS:
        t = loading.load_tokenizer(loading.DEFAULT_POLICY)
        if arch == "qwen2":
            t.chat_template = ("{% for m in messages %}"
                               "{{ m['role'] }}: {{ m['content'] }}\n"
                               "{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
        tiny_model(arch).save_pretrained(d / arch)
        t.save_pretrained(d / arch)
    rng = random.Random(0)
    with open(d / "data.jsonl", "w") as f:
        for _ in range(40):
            a, b = rng.randrange(50), rng.randrange(50)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return d


def check_outputs(out, steps):
    summary = json.loads((out / "summary.json").read_text())
    assert {"eval_before", "eval_after", "wall_time_s", "peak_mem_mb"} <= set(summary)
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == list(range(1, steps + 1))
    assert METRIC_KEYS["grpo"] <= set(metrics[0]), METRIC_KEYS["grpo"] - set(metrics[0])
    AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    return summary, metrics


@pytest.mark.parametrize("arch", ["qwen2", "gpt2"])
def test_grpo_end_to_end_on_tiny_random_models(tiny_dirs, tmp_path, arch):
    out = tmp_path / "out"
    r = run_script("grpo.py", "--model", str(tiny_dirs / arch),
                   "--data", str(tiny_dirs / "data.jsonl"), "--max_steps", "3",
                   "--group_size", "4", "--prompts_per_step", "2", "--micro_batch_size", "4",
                   "--max_new_tokens", "8", "--eval_size", "8", "--dynamic_sampling",
                   "--loss_agg", "seq-mean-token-mean", "--num_iterations", "2",
                   "--save_every", "0", "--output_dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    check_outputs(out, 3)


def test_grpo_learns_on_the_bundled_task(tmp_path):
    """A short run on the bundled model: held-out greedy accuracy and the sampled reward both rise
    clearly."""
    out = tmp_path / "out"
    r = run_script("grpo.py", "--max_steps", "40", "--eval_every", "0", "--eval_size", "200",
                   "--output_dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    summary, metrics = check_outputs(out, 40)
    assert summary["eval_after"] >= summary["eval_before"] + 0.2, summary
    model = loading.load_model(loading.DEFAULT_POLICY, "lm", torch.device("cpu"))
    n_params = sum(p.numel() for p in model.parameters())
    adam_mb = 8 * n_params / 2**20
    assert f"AdamW's moments will add {adam_mb:,.0f} MB from step 2" in r.stdout + r.stderr
    assert re.search(r"memory: peak [\d,]+ MB in step 1, before AdamW's", r.stdout + r.stderr)
    first = [m["reward"] for m in metrics[:10]]
    last = [m["reward"] for m in metrics[-10:]]
    assert sum(last) / 10 >= sum(first) / 10 + 0.15


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("neox")
    tiny_model("gpt_neox").save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("extra", [
    ["--baseline", "rloo", "--beta", "0.1"],
    ["--baseline", "none", "--num_iterations", "2"],
    ["--baseline", "ema", "--loss_agg", "token-mean", "--micro_batch_size", "4"],
    ["--baseline", "reinforce_pp", "--beta", "0.1", "--kl_in_reward", "sequence"]])
def test_end_to_end_tiny_gpt_neox(monkeypatch, neox_dir, tmp_path, extra):
    out = str(tmp_path / "run")
    # a random model never answers right: the length penalty gives every run a reward signal (and
    # KL a push)
    run_main(monkeypatch, R, "--model", neox_dir, "--output_dir", out, "--max_steps", "3",
             "--prompts_per_step", "4", "--samples_per_prompt", "4", "--eval_size", "8",
             "--lr", "1e-3", "--rewards", "math,length", *extra)
    m = read_metrics(out)
    assert [x["step"] for x in m] == [1, 2, 3]
    assert METRIC_KEYS["reinforce"] <= set(m[0])
    assert all(torch.isfinite(torch.tensor(v)) for v in m[-1].values() if isinstance(v, float))
    # policy == reference before the first update: KL exactly 0, then it moves
    if "--beta" in extra:
        assert m[0]["kl"] == 0.0 and m[-1]["kl"] != 0.0
    if "--num_iterations" in extra:
        assert m[0]["ratio"] != 1.0  # the second pass sees the updated policy
    summary = json.load(open(os.path.join(out, "summary.json")))
    assert summary["steps"] == 3 and summary["algo"] == "reinforce"
    loading.load_model(os.path.join(out, "checkpoint"), "lm", torch.device("cpu"))


def test_short_run_raises_the_reward_model_score(tmp_path):
    """Bundled policy and reward model: 16 PPO steps raise the RM score by well over its noise."""
    out = tmp_path / "run"
    r = run_script("ppo.py", "--max_steps", "16", "--batch_size", "32", "--eval_every", "0",
                   "--eval_size", "50", "--output_dir", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    m = read_metrics(out)
    first = sum(x["reward"] for x in m[:2]) / 2
    last = sum(x["reward"] for x in m[-4:]) / 4
    # the noise of that difference is about 0.16 reward_std (32 samples a step): the bar is 2.5
    # times that
    assert last - first > 0.4 * m[0]["reward_std"], (first, last, m[0]["reward_std"])


def test_end_to_end_tiny_random_models_and_resume(tmp_path, tok):
    tiny_model("llama").save_pretrained(tmp_path / "policy")
    tiny_rm().save_pretrained(tmp_path / "rm")
    for d in ("policy", "rm"):
        tok.save_pretrained(tmp_path / d)
    out = tmp_path / "run"
    args = ["--model", str(tmp_path / "policy"), "--reward_model", str(tmp_path / "rm"),
            "--batch_size", "16", "--micro_batch_size", "8", "--eval_size", "16",
            "--eval_every", "0", "--adaptive_kl", "--kl_target", "1e-6", "--kl_estimator", "k3",
            "--kl_horizon", "16", "--output_dir", str(out)]
    r = run_script("ppo.py", *args, "--max_steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    m = read_metrics(out)
    assert [x["step"] for x in m] == [1, 2] and METRIC_KEYS["ppo"] <= set(m[0])
    assert m[0]["kl_seq"] == 0 and m[1]["kl_seq"] > 1e-6  # policy == reference at step 1 only
    # KL below target: -20% * 16 / 16
    assert m[0]["kl_coef"] == 0.05 and abs(m[1]["kl_coef"] - 0.04) < 1e-9
    assert abs(m[0]["ratio"] - 1) < 0.1
    for f in ("summary.json", "samples.jsonl", "checkpoint/model.safetensors",
              "checkpoint/trainer_state.pt"):
        assert (out / f).exists()
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert "score.weight" in state["extra"]["critic"]
    assert [g["weight_decay"] for g in state["optimizer"]["param_groups"]] == [0.0, 0.0]
    # resume: step 3 continues from the saved kl_coef (restored, not reset to 0.05), raised as
    # KL > target
    r = run_script("ppo.py", "--resume", str(out), "--max_steps", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    m = read_metrics(out)
    assert [x["step"] for x in m] == [1, 2, 3] and abs(m[2]["kl_coef"] - 0.04 * 1.2) < 1e-9
    # bad input: one line, exit code 2
    bad = run_script("ppo.py", *args, "--batch_size", "15")
    assert bad.returncode == 2 and bad.stderr.startswith("error: --num_minibatches")


def test_help_documents_every_flag():
    out = run_script("grpo.py", "--help").stdout
    for field in grpo.Args.__dataclass_fields__:
        assert f"--{field}" in out


# ---- command line: bad input
@pytest.fixture(scope="session")
def bad_inputs(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "empty.jsonl").write_text("")
    (d / "notjson.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": oops}\n')
    (d / "noprompt.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n'
                                      '{"text": "1+2=", "answer": "3"}\n')
    (d / "noanswer.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "1+2="}\n')
    long_row = json.dumps({"prompt": "1+" * 40 + "1=", "answer": "41"}) + "\n"
    (d / "long.jsonl").write_text(long_row * 10)
    t = loading.load_tokenizer(loading.DEFAULT_POLICY)
    t.pad_token = None
    t.eos_token = None
    model = AutoModelForCausalLM.from_pretrained(loading.DEFAULT_POLICY)
    model.save_pretrained(d / "nopad")
    t.save_pretrained(d / "nopad")
    torch.manual_seed(0)
    cfg = tiny_config("llama")
    cfg.num_labels = 2
    LlamaForSequenceClassification(cfg).save_pretrained(d / "rm2")
    loading.load_tokenizer(loading.DEFAULT_POLICY).save_pretrained(d / "rm2")
    (d / "mine.py").write_text(REWARD_FILE)
    tiny_model("qwen2").save_pretrained(d / "notok")  # transformers 5 makes an empty tokenizer
    hostile = d / "hostile"  # a bin-only model whose pickle would run a command when loaded
    shutil.copytree(loading.DEFAULT_POLICY, hostile, ignore=shutil.ignore_patterns("*.safetensors"))
    torch.save({"w": RunsCommand()}, hostile / "pytorch_model.bin")
    return d


class RunsCommand:
    def __reduce__(self):  # unpickling calls os.system: torch.load(weights_only=True) refuses it
        return (os.system, ("touch /tmp/minrl-hostile-pickle-ran",))


BAD = [(["--model", "/no/such/folder"], "no such local folder"),
       (["--model", "nobody-here/no-such-model"], "could not be loaded"),
       (["--model", loading.DEFAULT_REWARD_MODEL], "no causal-LM head"),
       (["--model", "{d}/nopad"], "neither a pad nor an eos token"),
       (["--data", "{d}/missing.jsonl"], "not found"),
       (["--data", "{d}/empty.jsonl"], "is empty"),
       (["--data", "{d}/notjson.jsonl"], "notjson.jsonl, line 2: not valid JSON"),
       (["--data", "{d}/noprompt.jsonl"], "noprompt.jsonl, line 2: field 'prompt'"),
       # the math reward needs an answer on every line
       (["--data", "{d}/noanswer.jsonl"], "noanswer.jsonl, line 2: field 'answer' is missing"),
       (["--data", "{d}/long.jsonl"], "10 of 10 prompts are too long"),
       (["--group_size", "1"], "--group_size must be >= 2"),
       (["--temperature", "0"], "--temperature must be >= 1e-30, not 0.0"),
       (["--temperature", "1e-300"], "--temperature must be >= 1e-30, not 1e-300"),
       (["--top_p", "0"], "--top_p must be in [1.2e-38, 1], not 0.0"),
       (["--top_p", "1e-300"], "--top_p must be in [1.2e-38, 1], not 1e-300"),
       (["--group_size", str(10**30)], "--group_size * --prompts_per_step * --max_new_tokens = "
        "4.8e+31 token ids a step"),
       (["--prompts_per_step", str(2**62)], "= 2.21e+20 token ids a step"),
       (["--weight_decay", "1e30"], "AdamW multiplies every weight by 1 - lr * weight_decay "
        "(-1e+26) at each step, so lr * weight_decay must be < 1"),
       (["--tis_cap", "1e-30"], "--tis_cap 1e-30: the cap C on pi_old / pi_sampler"),
       (["--policy_loss", "sapo", "--sapo_tau_neg", "1e-40"], "--sapo_tau_neg must be in"),
       (["--lr", "-1e-4"], "--lr must be > 0, not -0.0001"),  # argparse alone: a flag
       (["--rewards", "math=1,math=2"], "--rewards names 'math' twice"),
       (["--rewards", "math=1,format=0"], "the weight of 'format' must be finite and not 0"),
       (["--reward_fn", "{d}/mine.py:exact", "--rewards", "math=1"],
        "--reward_fn 'exact' is loaded but --rewards 'math=1' does not use it: add exact=W"),
       (["--model", "{d}/notok"], "it has no tokenizer files: save them beside the model"),
       (["--model", "{d}/hostile"], "holds posix.system: unpickling it could run code"),
       (["--micro_batch_size", "0"], "--micro_batch_size must be > 0"),
       (["--lrr", "1e-5"], "unknown argument '--lrr' (did you mean --lr?)"),
       (["--rewards", "math=abc"], "the weight of 'math' must be a number, not 'abc'"),
       (["--stop", ""], "an empty stop string would end every completion"),
       (["--chat_template", "chatml"], "invalid choice: 'chatml' (choose from 'auto', 'none')"),
       (["--reward_model", "{d}/rm2", "--rewards", "rm"], "num_labels=2"),
       (["--micro_batch_size", "7"], "--micro_batch_size 7 must divide"),
       (["--loss_agg", "mean"], "invalid choice: 'mean' (choose from 'token-mean',"),
       (["--kl_estimator", "k1"], "k1 in the loss has zero expected gradient"),
       (["--lr", "-1"], "--lr must be > 0, not -1.0"),
       (["--lr", "nan"], "--lr must be a finite number, not nan"),
       (["--max_grad_norm", "-1"], "--max_grad_norm must be > 0"),
       (["--beta", "-1"], "--beta must be >= 0, not -1.0"),
       (["--max_steps", "0"], "--max_steps must be > 0, not 0"),
       (["--data", "{d}"], "is a directory (a save_to_disk folder or a folder of data files: "
                           "--data hf:DIR)")]


@pytest.mark.parametrize("args,message", BAD, ids=[m for _, m in BAD])
def test_bad_input_exits_2_with_one_clear_line(bad_inputs, tmp_path, args, message, monkeypatch,
                                               capsys):
    """In-process (no 9 s of imports per case): exit 2, one line, no folder left behind."""
    out = tmp_path / "out"
    argv = [a.format(d=bad_inputs) for a in args]
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *argv, "--output_dir", str(out), guard=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_bad_baseline_is_a_user_error(monkeypatch, tmp_path):
    with pytest.raises(C.UserError, match="invalid choice: 'rlooo'"):
        run_main(monkeypatch, R, "--baseline", "rlooo", "--output_dir", str(tmp_path))


def test_filesystem_and_model_faults_get_one_line(tmp_path, tok, capsys, monkeypatch):
    """An --output_dir that is a file, a damaged safetensors file, a truncated trainer_state.pt,
    a causal LM or a head-less model as the reward model: each one line naming the problem, and
    no empty run folder left behind."""
    (tmp_path / "file").write_text("x")
    broken = tmp_path / "broken"
    shutil.copytree(loading.DEFAULT_POLICY, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    headless = tmp_path / "headless"
    tiny_model("llama").save_pretrained(headless)
    cfg = json.loads((headless / "config.json").read_text())
    cfg["architectures"] = ["LlamaForSequenceClassification"]
    cfg["num_labels"] = 1
    (headless / "config.json").write_text(json.dumps(cfg))
    tok.save_pretrained(headless)
    cases = [(["--output_dir", str(tmp_path / "file")], "File exists"),
             (["--model", str(broken)], "could not be loaded as AutoModelForCausalLM"),
             (["--reward_model", loading.DEFAULT_POLICY, "--rewards", "rm"],
              "is not a sequence-classification model"),
             (["--reward_model", str(headless), "--rewards", "rm"], "no trained score head")]
    for i, (argv, message) in enumerate(cases):
        out = ["--output_dir", str(tmp_path / f"out{i}")] if i else []
        with pytest.raises(SystemExit) as e:
            run_main(monkeypatch, grpo, *FAST_GRPO, *out, *argv, guard=True)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and message in err[0], err
        assert i == 0 or not (tmp_path / f"out{i}").exists()  # no empty folder left
    run = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "1", "--output_dir", str(run))
    state = run / "checkpoint" / "trainer_state.pt"
    state.write_bytes(state.read_bytes()[:100])
    with pytest.raises(SystemExit):
        run_main(monkeypatch, grpo, "--resume", str(run), "--max_steps", "2", guard=True)
    assert "trainer_state.pt is damaged" in capsys.readouterr().err


# ---- reliability: resume and Ctrl-C
def test_resume_reproduces_a_straight_run_with_ema_state(monkeypatch, neox_dir, tmp_path):
    common = ["--model", neox_dir, "--prompts_per_step", "4", "--samples_per_prompt", "2",
              "--eval_size", "4", "--baseline", "ema", "--lr", "1e-3", "--save_every", "2",
              "--rewards", "math,length"]
    run_main(monkeypatch, R, *common, "--output_dir", str(tmp_path / "a"), "--max_steps", "4")
    run_main(monkeypatch, R, *common, "--output_dir", str(tmp_path / "b"), "--max_steps", "2")
    run_main(monkeypatch, R, "--resume", str(tmp_path / "b"), "--max_steps", "4")
    a = read_metrics(tmp_path / "a")
    b = read_metrics(tmp_path / "b")
    for key in ("reward", "loss", "baseline_ema", "grad_norm"):
        assert [x[key] for x in a] == pytest.approx([x[key] for x in b], rel=1e-5), key


def test_resume_without_max_steps_continues_to_the_runs_own(monkeypatch, tmp_path, capsys):
    """Interrupted at step 2 of 4 (Ctrl-C, faked), `--resume DIR` alone finishes steps 3-4: not the
    script's default max_steps. Samples are cut back too, and changed settings are refused."""
    out = tmp_path / "run"
    real_log = runs.log_step

    def log_step(run, metrics, *a):
        real_log(run, metrics, *a)
        if metrics["step"] == 2 and run.state is None:
            runs.STOP["requested"] = True  # as Ctrl-C does
    monkeypatch.setattr(runs, "log_step", log_step)
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "4", "--output_dir", str(out))
    assert e.value.code == 130
    assert "final held-out eval is skipped" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["eval_after"] is None  # null, not a bare NaN
    with open(out / "samples.jsonl", "a") as f:  # as if killed after a later step's samples
        f.write(json.dumps({"step": 3, "samples": []}) + "\n")
    runs.STOP["requested"] = False
    with pytest.raises(C.UserError, match="--lr 0.5 differs from the resumed run's 0.0001"):
        run_main(monkeypatch, grpo, "--resume", str(out), "--lr", "0.5")
    run_main(monkeypatch, grpo, "--resume", str(out))
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    lines = (out / "samples.jsonl").read_text().splitlines()
    samples = [json.loads(line)["step"] for line in lines]
    assert samples == [1]  # the stale step-3 line is gone
    assert not (out / "run.lock").exists()


def test_sigint_saves_a_checkpoint_and_resume_continues(tmp_path):
    out = tmp_path / "run"
    p = start_script("grpo.py", "--max_steps", "400", "--save_every", "4", "--eval_every", "0",
                     "--eval_size", "50", "--output_dir", str(out))
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not ((out / "checkpoint").exists() and metrics.exists()
                                          and len(metrics.read_text().splitlines()) >= 6):
        time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130, err[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["interrupted"] and 6 <= stopped < 400
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == stopped
    # the checkpoint is a plain HF model folder
    AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    r = run_script("grpo.py", "--resume", str(out), "--max_steps", str(stopped + 3))
    assert r.returncode == 0, r.stderr[-2000:]
    steps = [m["step"] for m in read_metrics(out)]
    assert steps == list(range(1, stopped + 4))  # no step duplicated or missing
    # killed while saving: a half-deleted checkpoint.old/ must not break the next save, and a kill
    # between the two renames (checkpoint/ already moved to checkpoint.old/, the new one not yet in
    # place) must still resume
    (out / "checkpoint.old").mkdir()
    (out / "checkpoint.old" / "partial.bin").write_bytes(b"x")
    r = run_script("grpo.py", "--resume", str(out), "--max_steps", str(stopped + 4))
    assert r.returncode == 0 and not (out / "checkpoint.old").exists(), r.stderr[-2000:]
    os.replace(out / "checkpoint", out / "checkpoint.old")
    r = run_script("grpo.py", "--resume", str(out), "--max_steps", str(stopped + 5))
    resumed = f"resumed {out} at step {stopped + 4}"
    assert r.returncode == 0 and resumed in r.stdout, r.stderr[-2000:]
    steps = [m["step"] for m in read_metrics(out)]
    assert steps == list(range(1, stopped + 6))
    # another script's run
    r = run_script("ppo.py", "--resume", str(out), "--max_steps", str(stopped + 9))
    assert r.returncode == 2 and "made by grpo.py" in r.stderr, r.stderr[-2000:]
    # a new run may not reuse the folder
    before = (out / "metrics.jsonl").read_text()
    r = run_script("grpo.py", "--output_dir", str(out), "--max_steps", "2")
    assert r.returncode == 2 and "already holds a run" in r.stderr
    assert (out / "metrics.jsonl").read_text() == before


def test_a_second_ctrl_c_in_a_save_and_a_backwards_resume_get_one_line(tmp_path, monkeypatch,
                                                                      capsys):
    """A second Ctrl-C quits at once (runs._on_sigint raises KeyboardInterrupt), also inside a
    save: one line, no traceback, exit 130, the last complete checkpoint intact, and --resume
    goes on. A --max_steps below the checkpoint's step is refused: the loop would do nothing and
    report the run as finished."""
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--save_every", "1",
             "--output_dir", out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--resume", out, "--max_steps", "1", guard=True)
    line = one_error_line(capsys)
    assert e.value.code == 2 and "--max_steps 1 is below the step of" in line, line
    assert "checkpoint (2)" in line and "--max_steps 2 or more" in line
    real_save = torch.save

    def second_ctrl_c(*a, **kw):  # trainer_state.pt is written after the weights: mid-save
        raise KeyboardInterrupt
    monkeypatch.setattr(runs.torch, "save", second_ctrl_c)
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--resume", out, "--max_steps", "3", guard=True)
    err = capsys.readouterr().err
    assert e.value.code == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted: the last complete checkpoint is intact"
    monkeypatch.setattr(runs.torch, "save", real_save)
    assert torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=True)["step"] == 2
    run_main(monkeypatch, grpo, "--resume", out, "--max_steps", "3")
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]


# ---- reliability: out of memory, a full disk, non-finite updates
def test_out_of_memory_exits_1_with_advice_and_keeps_the_checkpoint(monkeypatch, tmp_path, capsys):
    """An OOM at step 3 (faked: no GPU here) ends with one line saying what to change; steps 1-2
    stay saved."""
    calls = []
    real_sample = C.sample

    def sample(*a, **kw):
        calls.append(1)
        if len(calls) == 4:  # 1: the eval before training, 2-3: steps 1-2
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\n"
                                         "more details")
        return real_sample(*a, **kw)
    monkeypatch.setattr(C, "sample", sample)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--eval_size", "20", "--save_every", "1",
                 "--output_dir", str(out), guard=True)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 1
    assert "out of memory (CUDA out of memory. Tried to allocate 20.00 GiB)" in err
    assert "--micro_batch_size" in err and "--gradient_checkpointing" in err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert loading.load_model(str(out / "checkpoint"), "lm", torch.device("cpu")) is not None


def test_a_cpu_allocation_that_fails_is_out_of_memory_too(capsys):
    """On a CPU torch says so with a RuntimeError (DefaultCPUAllocator), not OutOfMemoryError:
    the same one line, exit 1; any other RuntimeError keeps its traceback."""
    def alloc():
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: refused at once, on every machine
    with pytest.raises(SystemExit) as e:
        runs.main_guard(alloc)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and "error: out of memory (" in err[0], err
    with pytest.raises(RuntimeError, match="not memory"):
        runs.main_guard(lambda: (_ for _ in ()).throw(RuntimeError("not memory")))


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    real_save = torch.save
    calls = []

    def save(obj, path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos")
        return real_save(obj, path, *a, **kw)
    monkeypatch.setattr(runs.torch, "save", save)
    with pytest.raises(C.UserError, match="could not write .*checkpoint.tmp .* free some space"):
        run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--save_every", "1",
                 "--output_dir", str(tmp_path / "run"))
    state = torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 1 and not (tmp_path / "run" / "checkpoint.tmp").exists()


def test_nonfinite_update_is_skipped_and_counted(tmp_path, monkeypatch):
    """A NaN reward at step 2 is skipped and counted (metrics keep steps 1 and 3); ten in a row
    stop."""
    run = runs.Run(dir=str(tmp_path), algo="grpo", args=None, state=None, metrics=None,
                   samples=None)
    for _ in range(9):
        runs.skip_update(run, "gradient")
    with pytest.raises(C.UserError, match="NaN or inf in 10 updates in a row"):
        runs.skip_update(run, "gradient")
    calls = []
    real = C.compute_rewards

    def rewards(*a, **kw):  # call 1 scores the held-out eval before training, call 3 step 2
        calls.append(1)
        total, parts = real(*a, **kw)
        return (total * float("nan") if len(calls) == 3 else total), parts
    monkeypatch.setattr(C, "compute_rewards", rewards)
    out = tmp_path / "out"
    run_main(monkeypatch, grpo, "--max_steps", "3", "--eval_size", "10", "--output_dir", str(out))
    summary = json.loads((out / "summary.json").read_text())
    steps = [m["step"] for m in read_metrics(out)]
    assert summary["nonfinite_skips"] == 1 and steps == [1, 3]


# ---- reliability round three (#26)
def one_error_line(capsys):
    """The run's one error line: the last thing on stderr, no traceback after it."""
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and err[-1] == errors[0], err[-5:]
    return errors[0]


class Payload:  # unpickling this calls builtins.open(path, "w"): code that runs on load
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (builtins.open, (self.path, "w"))


def test_a_pickled_object_in_trainer_state_is_refused_and_never_runs(tmp_path, monkeypatch,
                                                                     capsys):
    """--resume reads trainer_state.pt with weights_only=True: what the scripts write loads so,
    and a planted object is refused in one line without running."""
    run = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "1", "--output_dir", run)
    path = run / "checkpoint" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)  # a plain state: tensors, numbers, lists
    assert state["step"] == 1 and isinstance(state["rngs"][0][0], torch.Tensor)
    marker = tmp_path / "ran"
    torch.save({**state, "extra": Payload(str(marker))}, path)
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--resume", run, "--max_steps", "2", guard=True)
    line = one_error_line(capsys)
    assert e.value.code == 2 and "trainer_state.pt holds io.open, not only tensors" in line
    assert "could run code, so it is refused" in line and not marker.exists()


NONFINITE_REWARDS = """
def nan(completions, rows):
    return [float("nan")] * len(completions)


def inf(completions, rows):
    return [float("inf")] * len(completions)


def huge(completions, rows):
    return [1e300] * len(completions)
"""


def test_a_reward_that_is_nan_every_step_stops_in_one_line_and_keeps_the_folder(
        tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.py").write_text(NONFINITE_REWARDS)
    out = tmp_path / "nan"
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *FAST_GRPO, "--reward_fn", f"{tmp_path / 'bad.py'}:nan",
                 "--max_steps", "12", "--output_dir", out, guard=True)
    line = one_error_line(capsys)
    assert e.value.code == 2 and "the reward was NaN or inf in 10 updates in a row" in line
    assert "no checkpoint yet" in line and (out / "metrics.jsonl").exists()
    for fn in ("inf", "huge"):  # inf, and a float that overflows to inf, count as NaN does
        out = tmp_path / fn
        with pytest.raises(SystemExit) as e:  # fewer steps than 10: the end of the run says it
            run_main(monkeypatch, grpo, *FAST_GRPO, "--reward_fn", f"{tmp_path / 'bad.py'}:{fn}",
                     "--max_steps", "3", "--output_dir", out, guard=True)
        line = one_error_line(capsys)
        assert e.value.code == 2 and "every update of this run was skipped" in line, line
        assert out.is_dir() and not (out / "summary.json").exists()


@pytest.mark.parametrize("weight", ["nan", "inf", "-inf"])
def test_a_non_finite_reward_weight_is_refused_up_front(weight, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        run_main(monkeypatch, grpo, "--rewards", f"math={weight}", "--output_dir",
                 tmp_path / "out", guard=True)
    line = one_error_line(capsys)
    assert "the weight of 'math' must be finite and not 0" in line
    assert line.endswith(f"not {weight}")
    assert not (tmp_path / "out").exists()


def test_a_diverged_policy_stops_naming_the_step(tmp_path, monkeypatch, capsys):
    """--lr 1e10: after an update the logits overflow, and the next step cannot sample."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *FAST_GRPO, "--lr", "1e10", "--max_steps", "5",
                 "--output_dir", out, guard=True)
    line = one_error_line(capsys)
    found = re.search(r"the policy diverged \(NaN/inf\): step (\d) cannot sample; lower --lr", line)
    assert e.value.code == 2 and found, line
    assert [m["step"] for m in read_metrics(out)] == list(range(1, int(found[1])))


def test_a_checkpoint_is_never_written_from_nan_weights(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "1", "--output_dir", run_dir)
    model, tok = loading.load_policy(grpo.Args(), torch.device("cpu"), str(run_dir / "checkpoint"))
    opt = torch.optim.AdamW(model.parameters())
    run = runs.Run(dir=str(run_dir), algo="grpo", args=grpo.Args(), state=None, metrics=None,
                   samples=None, saved_step=1)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(C.UserError, match="the weights are NaN or inf after step 2.*the "
                                          "checkpoint of step 1"):
        runs.save_checkpoint(run, model, tok, opt, random.Random(0), 2, {})
    state = torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 1
    model.float()
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(C.UserError, match=r"diverged \(NaN/inf\): step 4 cannot"):
        with runs.stop_on_divergence(run, 3):
            C.sample(model, tok, C.encode_prompts(tok, ["1+1="]), 2)


def test_a_full_disk_inside_safetensors_is_one_line_and_leaves_no_tmp(tmp_path, monkeypatch):
    """safetensors raises its own SafetensorError (not OSError) on a full disk: measured on a
    64 KB tmpfs, "Error while serializing: I/O error: No space left on device (os error 28)"."""
    import safetensors
    import transformers.modeling_utils as mu
    real, calls = mu.safe_save_file, []

    def save_file(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise safetensors.SafetensorError("Error while serializing: I/O error: No space left "
                                              "on device (os error 28)")
        return real(*a, **kw)
    monkeypatch.setattr(mu, "safe_save_file", save_file)
    out = tmp_path / "run"
    with pytest.raises(C.UserError, match="could not write .*checkpoint.tmp .*No space left"):
        run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--save_every", "1",
                 "--output_dir", out)
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 1 and not (out / "checkpoint.tmp").exists()


def test_a_damaged_metrics_line_is_skipped_with_a_warning(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--save_every", "1",
             "--output_dir", out)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(["{not json\n", *lines[1:]]))
    assert [m["step"] for m in plot.read_metrics(str(out))] == [2]
    assert "metrics.jsonl, line 1 is damaged" in capsys.readouterr().err
    run_main(monkeypatch, grpo, "--resume", out, "--max_steps", "3")
    assert "metrics.jsonl, line 1 is damaged" in capsys.readouterr().err
    assert [m["step"] for m in read_metrics(out)] == [2, 3]


def test_every_numeric_flag_declares_its_range_and_help_shows_it(monkeypatch, capsys):
    for name, script in SCRIPTS.items():
        source = inspect.getsource(script.Args)
        for f in dataclasses.fields(script.Args):
            if f.type in (int, float):
                assert "valid" in f.metadata, f"{name}.py: --{f.name} declares no range"
            comment = re.search(rf"^    {f.name}: .*?  # (.+)$", source, re.M)[1]
            assert not comment.startswith("...") and not comment.endswith("..."), (name, f.name)
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--help")
    shown = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert e.value.code == 0 and "(default: 0.0001; valid: > 0)" in shown
    assert "(default: 'all-linear')" not in shown and "(default: all-linear)" in shown


@pytest.mark.parametrize("script,argv,message", [
    (grpo, ["--threads", "100000"], f"--threads must be <= {4 * (os.cpu_count() or 1)}, not"),
    # sizes whose step cannot be allocated (each would allocate until the machine kills it)
    (ppo, ["--batch_size", str(2**62)], "--batch_size * --max_new_tokens = 2.77e+19 token ids"),
    (R, ["--samples_per_prompt", str(2**62)], "--samples_per_prompt * --prompts_per_step * "),
    (sft, ["--batch_size", str(2**62)], "--batch_size = 4.61e+18 token ids a step: 3.44e+10 GB"),
    (reward_model, ["--batch_size", str(10**30)], "--batch_size = 1e+30 token ids a step"),
    (dpo, ["--batch_size", str(2**62)], "--batch_size = 4.61e+18 token ids a step"),
    # ranges from the maths: fp32 sampling, AdamW's decay, the TIS cap; and "-1e-4" as a number
    (ppo, ["--top_p", "1e-300"], "--top_p must be in [1.2e-38, 1], not 1e-300"),
    (R, ["--temperature", "1e-300"], "--temperature must be >= 1e-30, not 1e-300"),
    (ppo, ["--weight_decay", "2000"], "--weight_decay 2000.0 with --critic_lr 0.001: AdamW"),
    (sft, ["--weight_decay", "1e4"], "--weight_decay 10000.0 with --lr 0.0003: AdamW"),
    (R, ["--tis_cap", "0.5"], "must be >= 1, or 0 (off)"),
    (dpo, ["--lr", "-1e-4"], "--lr must be > 0, not -0.0001"),
    (ppo, ["--critic_lr", "-2e-5"], "--critic_lr must be > 0, not -2e-05"),
    (ppo, ["--rewards", "rm=1,rm=1"], "--rewards names 'rm' twice"),
    (grpo, ["--seed", str(2**63)], f"--seed must be < {2**63}, not {2**63}"),
    (grpo, ["--seed", "-1"], "--seed must be >= 0, not -1"),
    (grpo, ["--num_iterations", "101"], "--num_iterations must be <= 100, not 101"),
    (grpo, ["--eval_samples", "100000"], "--eval_samples must be <= 1000"),
    (ppo, ["--ppo_epochs", str(10**20)], "--ppo_epochs must be <= 100"),
    (ppo, ["--gamma", "1.5"], "--gamma must be in [0, 1], not 1.5"),
    (R, ["--ema_decay", "1"], "--ema_decay must be in [0, 1), not 1.0"),
    (dpo, ["--lora_dropout", "1"], "--lora_dropout must be in [0, 1), not 1.0"),
    (sft, ["--warmup_steps", "-2"], "--warmup_steps must be >= 0, not -2"),
    (grpo, ["--lora_r", "100000"], "--lora_r 100000 is above the model's width 160"),
    (grpo, ["--lora_r", "4", "--lora_target_modules", "nosuch"],
     "the model has no module nosuch (its linear layers: down_proj, gate_proj,"),
    (sft, ["--lora_r", "4", "--lora_target_modules", "q_proj,v_projj"], "no module v_projj ("),
    (dpo, ["--lora_r", "4", "--lora_target_modules", "q_proj,nosuch"], "no module nosuch (")],
    ids=lambda x: x.__name__ if hasattr(x, "main") else None)
def test_flags_out_of_range_get_one_line(script, argv, message, tmp_path, monkeypatch, capsys):
    if "--lora_r" in argv:
        pytest.importorskip("peft")
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, script, *argv, "--output_dir", tmp_path / "out", guard=True)
    line = one_error_line(capsys)
    assert e.value.code == 2 and message in line, line
    assert not (tmp_path / "out").exists()


def test_merge_lora_and_compare_refuse_bad_flags_in_one_line(tmp_path, capsys):
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "args.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    with pytest.raises(C.UserError, match="--out .*file: that is a file"):
        merge_lora(str(tmp_path / "run"), str(tmp_path / "file"))
    with pytest.raises(C.UserError, match="no checkpoint/args.json there"):
        merge_lora(str(tmp_path / "nothing"))
    with pytest.raises(C.UserError, match="that is the run folder or its checkpoint"):
        merge_lora(str(tmp_path / "run"), str(tmp_path / "run" / "checkpoint" / "sub"))
    (tmp_path / "run" / "checkpoint" / "args.json").write_text('{"algo": "grpo", "args": {')
    with pytest.raises(C.UserError, match="checkpoint/args.json is damaged .JSONDecodeError"):
        merge_lora(str(tmp_path / "run"))
    for argv, message in ((["--seeds", "0"], "--seeds must be >= 1, not 0"),
                          (["--samples", "-5"], "--samples must be >= 1, not -5"),
                          (["--algos", ""], "--algos names no algorithm; known: ['reinforce'"),
                          (["--task", "calc", "--algos", "ppo-math"], "leaves out ppo-math"),
                          (["--threads", "100000"], "--threads must be <= "),
                          (["--output_dir", str(tmp_path / "file")], "that is a file"),
                          (["--out", str(tmp_path / "file")], "that is a file")):
        with pytest.raises(SystemExit) as e:
            compare.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("argv,message", [
    ([], "usage: python envs.py MODEL [K]"), (["a", "b", "c"], "usage:"),
    ([loading.DEFAULT_POLICY, "0"], "K: 1 to 1000"), (["/no/such/model"], "no such local folder"),
    ([loading.DEFAULT_REWARD_MODEL], "has no causal-LM head")])
def test_envs_report_refuses_a_bad_model_in_one_line(argv, message, monkeypatch, capsys):
    """python envs.py MODEL [K] (the calculator report): no model, a bad one, a bad K: exit 2."""
    monkeypatch.setattr(sys, "argv", ["envs.py", *argv])
    with pytest.raises(SystemExit) as e:
        E.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") \
        and message in err[0], err


def test_merge_lora_prints_no_future_warning(tmp_path, tok):
    pytest.importorskip("peft")
    model, _ = loading.load_policy(lora_args(), torch.device("cpu"))
    run = tmp_path / "run"
    model.save_pretrained(run / "checkpoint")
    tok.save_pretrained(run / "checkpoint")
    (run / "checkpoint" / "args.json").write_text(json.dumps(
        {"algo": "grpo", "args": vars(lora_args())}))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        merge_lora(str(run))
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], caught
    for out in (run, run / "checkpoint", run / "checkpoint.tmp"):  # what it reads or a save uses
        with pytest.raises(C.UserError, match="that is the run folder or its checkpoint"):
            merge_lora(str(run), str(out))
    (run / "checkpoint" / "adapter_model.safetensors").write_bytes(b"damaged")
    with pytest.raises(C.UserError, match="its LoRA adapter could not be loaded .SafetensorError"):
        merge_lora(str(run), str(tmp_path / "merged"))


def test_a_run_with_relative_paths_resumes_from_another_folder(tmp_path, monkeypatch):
    """--data and --reward_fn given relative to the run's folder are stored absolute; resuming
    from elsewhere finds them, and naming them by their absolute paths is no change."""
    work = tmp_path / "work"
    work.mkdir()
    write_jsonl(work / "data.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)}
                                      for a, b in tasks.task_train_pairs(random.Random(0), 40)])
    (work / "mine.py").write_text(REWARD_FILE.replace('row["target"]', 'row["answer"]'))
    monkeypatch.chdir(work)
    run_main(monkeypatch, grpo, *FAST_GRPO, "--data", "data.jsonl", "--reward_fn",
             "mine.py:exact", "--max_steps", "1", "--output_dir", tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "checkpoint" / "args.json").read_text())["args"]
    assert saved["data"] == str(work / "data.jsonl")
    assert saved["reward_fn"] == [f"{work / 'mine.py'}:exact"]
    monkeypatch.chdir(tmp_path)
    run_main(monkeypatch, grpo, "--resume", tmp_path / "run", "--max_steps", "2",
             "--data", work / "data.jsonl")
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]


def test_readme_own_task_shows_the_fields_its_reward_reads():
    section = read_readme("Your own task")
    for field_name in set(re.findall(r'row\["(\w+)"\]', section)):
        assert f'"{field_name}":' in section, f"no data row in the README shows {field_name!r}"


# ---- torchrun: several processes (gloo on the CPU)
SAME_COMPLETIONS = """
import os, sys
sys.path.insert(0, os.environ["MINRL_ROOT"])
import torch
import common as C
import dpo, grpo, ppo, reinforce, reward_model, runs, sft
real_sample = C.sample


def sample(model, tok, prompt_ids, *args, env_step=None, **kwargs):  # each row alone, seeded
    seen, pieces = {}, []                    # by its prompt and its index among that prompt's rows
    for j, p in enumerate(prompt_ids):
        k = seen[tuple(p)] = seen.get(tuple(p), -1) + 1
        torch.manual_seed(hash((tuple(p), k)) % 2**31)
        step = env_step and (lambda reqs, j=j: env_step([(j, *r[1:]) for r in reqs]))  # row j's
        pieces.append((real_sample(model, tok, [p], *args, env_step=step, **kwargs),
                       torch.tensor([0])))
    # then the RNG as one process leaves it in rank 0 and another stream in rank 1 (so
    # runs.seed_everything seeds them): ppo's minibatches must follow rank 0's shuffle alone
    torch.manual_seed(1 + runs.get_rank())
    return grpo.cat_rollouts(pieces)


C.sample = sample
script = {"grpo": grpo, "ppo": ppo, "reinforce": reinforce, "sft": sft, "dpo": dpo,
          "reward_model": reward_model}[sys.argv[1]]
sys.argv = sys.argv[1:]
runs.main_guard(script.main)
"""


# What a busy machine (CI shares its own) can make gloo's connect or torchrun's rendezvous say:
# the machine's fault, not the code's, so the launch is tried again. The last: a process aborted
# by a gloo thread as it exits, after its run is done (seen once here, ppo, beside 5 busy jobs)
TRANSIENT = ("Resource temporarily unavailable", "connectFullMesh", "Address already in use",
             "RendezvousError", "RendezvousTimeoutError", "RendezvousConnectionError",
             "RendezvousClosedError", "terminate called without an active exception")


def free_port():
    """A port nothing listens on now (the OS picks it): each launch its own rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(tmp_path, n, script, *args, tries=3):
    """`torchrun --nproc_per_node n` (n > 1) or one plain process, of a driver whose sampler gives
    each row the same completion in whichever process samples it: the same rows, either way.
    Robust to a loaded machine: each launch rendezvous on its own free port, with a read timeout
    of 300 s (torchrun's default is 60 s; gloo's own is 30 min), and a launch that fails for one of
    the TRANSIENT reasons is tried again (up to `tries` times) from its run folder as it was."""
    driver = tmp_path / "driver.py"
    driver.write_text(SAME_COMPLETIONS)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MINRL_ROOT": ROOT, "OMP_NUM_THREADS": "1"}
    flags = list(map(str, args))
    folder = next((flags[i + 1] for i, f in enumerate(flags[:-1])
                   if f in ("--output_dir", "--resume")), None)
    before = tmp_path / "before-launch"
    shutil.rmtree(before, ignore_errors=True)
    if folder and os.path.isdir(folder):
        shutil.copytree(folder, before)
    for attempt in range(tries):
        launch = ["-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={n}",
                  "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                  "--rdzv-conf=read_timeout=300"] if n > 1 else []
        r = subprocess.run([sys.executable, *launch, str(driver), script, *flags], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env=env)
        if r.returncode == 0 or n == 1 or not any(t in r.stderr for t in TRANSIENT):
            return r
        print(f"torchrun launch {attempt + 1} failed for the machine's reasons; again")
        if folder:  # the run folder as it was before this launch
            shutil.rmtree(folder, ignore_errors=True)
            if before.is_dir():
                shutil.copytree(before, folder)
    return r


# Keys whose value is wall-clock time, not a statistic of the rows
WALL_CLOCK = ("step_time", "tokens_per_s")


@pytest.mark.parametrize("script,flags", [
    ("grpo", ["--prompts_per_step", "4", "--group_size", "4", "--micro_batch_size", "4",
              "--scale_rewards", "batch"]),
    ("reinforce", ["--prompts_per_step", "4", "--samples_per_prompt", "4", "--micro_batch_size",
                   "4", "--baseline", "ema", "--beta", "0.05"]),
    ("ppo", ["--batch_size", "16", "--micro_batch_size", "4", "--num_minibatches", "2",
             "--ppo_epochs", "2", "--rewards", "math", "--critic_init", "policy"])])
def test_two_processes_make_the_one_process_update(script, flags, tmp_path):
    """One optimizer step on the same rows: 2 gloo processes under torchrun (normalisers and
    statistics over both), with DDP and with --fsdp (FSDP2: each process holds half of every
    weight, samples on gathered weights, and the checkpoint is gathered back), vs 1 process. The
    gradient norms agree to float rounding; Adam's first step, lr * g / (|g| + eps), amplifies
    rounding only where |g| ~ eps, so almost every weight agrees to 1e-6 (measured: >= 99.2%,
    either way). Statistics of the whole step: grpo's --scale_rewards batch divides by the std of
    every process's rewards, reinforce's first --baseline ema is the mean return of every
    process's rows, ppo's 2 epochs of 2 minibatches follow one shuffle of the whole batch (rank
    0's: the driver leaves rank 1's RNG elsewhere), unevenly split between the processes, and
    every logged number is what one process logs on the same rows (token means weighted by
    their tokens, stds over all rows), the step an int."""
    out = {}
    for name, n, extra in (("one", 1, []), ("ddp", 2, []), ("fsdp", 2, ["--fsdp"])):
        out[name] = tmp_path / name
        r = run_processes(tmp_path, n, script, *flags, *extra, "--max_steps", "1", "--eval_size",
                          "8", "--output_dir", str(out[name]))
        assert r.returncode == 0, r.stderr[-3000:]
    m1 = read_metrics(out["one"])
    a = load_file(out["one"] / "checkpoint" / "model.safetensors")
    for name in ("ddp", "fsdp"):
        m2 = read_metrics(out[name])
        assert len(m2) == 1 and m2[0]["grad_norm"] == pytest.approx(m1[0]["grad_norm"], rel=1e-5)
        assert m2[0]["reward"] == pytest.approx(m1[0]["reward"], abs=1e-9)
        assert m2[0].keys() == m1[0].keys() and type(m2[0]["step"]) is int, name
        for key in m1[0].keys() - set(WALL_CLOCK):
            assert m2[0][key] == pytest.approx(m1[0][key], rel=1e-5, abs=1e-7), (name, key)
        b = load_file(out[name] / "checkpoint" / "model.safetensors")
        assert a.keys() == b.keys()  # FSDP2's gathered tied LM head too is written once
        close = sum(int(((a[k] - b[k]).abs() <= 1e-6).sum()) for k in a)
        assert close / sum(a[k].numel() for k in a) >= 0.98, name
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 2e-4  # at most one lr of a flip


@pytest.mark.parametrize("script,flags", [
    ("grpo", ["--prompts_per_step", "4", "--group_size", "4", "--micro_batch_size", "8"]),
    ("ppo", ["--batch_size", "8", "--micro_batch_size", "4", "--num_minibatches", "2",
             "--rewards", "math", "--critic_init", "policy", "--fsdp"])])
def test_torchrun_writes_one_metrics_line_per_step_and_resumes(script, flags, tmp_path):
    """DDP (grpo) and --fsdp (ppo: policy and critic sharded; their full weights and optimizer
    state gathered into the checkpoint, which from_pretrained loads, and sharded again on
    resume)."""
    out = tmp_path / "run"
    flags = [*flags, "--eval_size", "8", "--save_every", "2", "--output_dir", str(out)]
    r = run_processes(tmp_path, 2, script, *flags, "--max_steps", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert len(state["rngs"]) == 2  # each process's sampling RNG
    r = run_processes(tmp_path, 2, script, "--resume", str(out), "--max_steps", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
    AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    if script == "grpo":
        r = run_processes(tmp_path, 2, "grpo", *flags[:-2], "--prompts_per_step", "3",
                          "--output_dir", str(tmp_path / "bad"))
        assert r.returncode != 0 and "must divide among the 2 processes" in r.stderr
        assert r.stderr.count("error: --prompts_per_step") == 1  # said once, by rank 0


@pytest.mark.parametrize("script,lr", [("sft", 3e-4), ("reward_model", 3e-4), ("dpo", 1e-4)])
def test_pipeline_under_torchrun_makes_the_one_process_update(script, lr, tmp_path):
    """sft.py, reward_model.py and dpo.py under torchrun: 2 gloo processes (DDP, and --fsdp) each
    take half of every step's rows, in 2 micro-batches, and make the update 1 process makes; the
    second step starts from the first's weights and optimizer state; eval is split and merged."""
    out = {}
    for name, n, extra in (("one", 1, []), ("ddp", 2, []), ("fsdp", 2, ["--fsdp"])):
        out[name] = tmp_path / name
        r = run_processes(tmp_path, n, script, "--batch_size", "8", "--micro_batch_size", "2",
                          *extra, "--max_steps", "2", "--eval_size", "20", "--eval_every", "0",
                          "--output_dir", str(out[name]))
        assert r.returncode == 0, r.stderr[-3000:]
    m1, s1 = read_metrics(out["one"]), json.loads((out["one"] / "summary.json").read_text())
    a = load_file(out["one"] / "checkpoint" / "model.safetensors")
    for name in ("ddp", "fsdp"):
        m2, s2 = read_metrics(out[name]), json.loads((out[name] / "summary.json").read_text())
        assert [m["step"] for m in m2] == [1, 2] and m2[0].keys() == m1[0].keys(), name
        # every logged number, not only the loss. Not dpo's rewards/accuracy (yet): at step 1
        # (pi_theta = pi_ref) every pair ties, but under torchrun the wrapped policy and pi_ref
        # compute log-probs on different code paths, so the ties turn into rounding-sized margins
        # of either sign (#26 item 15). test_dpo_training_accuracy_counts_a_tie_as_half checks ties
        for key in m1[0].keys() - {*WALL_CLOCK, "rewards/accuracy"}:
            assert [m[key] for m in m2] == pytest.approx([m[key] for m in m1], rel=1e-5,
                                                         abs=1e-6), (name, key)
        assert s2["eval_before"] == s1["eval_before"], name  # the same rows, split and merged
        b = load_file(out[name] / "checkpoint" / "model.safetensors")
        assert a.keys() == b.keys(), name
        close = sum(int(((a[k] - b[k]).abs() <= 1e-6).sum()) for k in a)
        assert close / sum(a[k].numel() for k in a) >= 0.98, name
        assert max(float((a[k] - b[k]).abs().max()) for k in a) < 4 * lr, name


def test_fsdp_needs_torchrun_and_full_weights(monkeypatch):
    """--fsdp is refused, in one line before any collective, without torchrun and with LoRA."""
    with pytest.raises(C.UserError, match="launch with torchrun"):
        run_main(monkeypatch, grpo, "--fsdp")
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun: refused before joining a group
    with pytest.raises(C.UserError, match="--fsdp with --lora_r is not supported"):
        run_main(monkeypatch, ppo, "--fsdp", "--lora_r", "4", "--batch_size", "16")


# ---- torchrun statistics (#26)
def as_two_processes(monkeypatch, fn, inputs):
    """[fn(inputs[0]), fn(inputs[1])], run in two threads that stand in for two torchrun
    processes: runs' collectives see a world of 2, and dist.all_reduce sums in place over both,
    as gloo does. No process, no port: the merging arithmetic alone."""
    slots, barrier = {}, threading.Barrier(2, timeout=30)

    def all_reduce(t):
        slots[threading.get_ident()] = t.clone()
        barrier.wait()  # both have put theirs
        total = sum(slots.values())
        barrier.wait()  # both have read: the next all_reduce may overwrite
        t.copy_(total)
    monkeypatch.setattr(runs.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(runs.dist, "all_reduce", all_reduce)
    results = [None, None]

    def one(i):
        results[i] = fn(inputs[i])
    workers = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return results


def test_global_statistics_are_those_of_every_processs_rows(monkeypatch):
    """runs.global_std and runs.global_mean over two processes of unequal shares are what one
    process computes on all the rows: the unbiased std (as torch.std), a token mean weighted by
    each process's tokens, a row mean by rows, and the step stays an int. With one process they
    return what they are given, bit for bit; grpo's --scale_rewards batch then divides by the
    whole step's std."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(12, generator=g) * 3 + 1
    assert torch.equal(runs.global_std(x), x.std())  # one process: torch.std itself
    metrics = {"step": 3, "kl": 0.25}
    assert runs.global_mean(metrics, weights={"kl": 7}) is metrics
    for std in as_two_processes(monkeypatch, runs.global_std, (x[:5], x[5:])):
        assert std.dtype == x.dtype and float(std) == pytest.approx(float(x.std()), rel=1e-6)
    same = torch.full((61,), 3.563326597213745)  # equal rewards: the one-pass variance rounds < 0
    assert as_two_processes(monkeypatch, runs.global_std, (same[:30], same[30:])) == [0.0, 0.0]
    kl, reward = torch.rand(12, generator=g), torch.rand(8, generator=g)  # 3 + 9 tokens, 4 + 4 rows
    shares = [(kl[:3], reward[:4]), (kl[3:], reward[4:])]
    merged = as_two_processes(monkeypatch, lambda s: runs.global_mean(
        {"step": 3, "kl": float(s[0].mean()), "reward": float(s[1].mean())},
        weights={"kl": len(s[0])}), shares)
    for m in merged:
        assert type(m["step"]) is int and m["step"] == 3
        assert m["kl"] == pytest.approx(float(kl.mean()), rel=1e-6)  # not the mean of 2 means
        assert m["reward"] == pytest.approx(float(reward.mean()), rel=1e-6)
    no_tokens = as_two_processes(monkeypatch, lambda s: runs.global_mean(  # e.g. all masked
        {"kl": 0.0}, weights={"kl": 0}), (None, None))
    assert [m["kl"] for m in no_tokens] == [0.0, 0.0]  # not 0 / 0 = nan
    rewards = torch.tensor([1.0, 0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 1, 1, 1, 1])  # 4 groups of 4
    whole = grpo.group_advantages(rewards, 4, "batch")
    halves = as_two_processes(monkeypatch, lambda r: grpo.group_advantages(
        r, 4, "batch", std=runs.global_std), (rewards[:8], rewards[8:]))
    torch.testing.assert_close(torch.cat(halves), whole)  # per process, halves' stds differ
    assert not torch.allclose(torch.cat([grpo.group_advantages(r, 4, "batch")
                                         for r in (rewards[:8], rewards[8:])]), whole)


FAST_PIPELINE = ["--batch_size", "8", "--micro_batch_size", "8", "--eval_size", "10",
                 "--eval_every", "0"]


def test_dpo_training_accuracy_counts_a_tie_as_half(monkeypatch, tmp_path):
    """At the first step pi_theta = pi_ref, so every pair's implicit rewards tie: the training
    accuracy is 0.5, as the held-out eval_reward_acc counts a tie, not 0."""
    out = tmp_path / "dpo"
    run_main(monkeypatch, dpo, *FAST_PIPELINE, "--max_steps", 1, "--output_dir", out)
    summary, metrics = summary_and_metrics(out)
    assert metrics[0]["rewards/margin"] == 0.0 and metrics[0]["rewards/accuracy"] == 0.5
    assert summary["evals"]["before"]["eval_reward_acc"] == 0.5


@pytest.mark.parametrize("module", [sft, reward_model, dpo])
def test_pipeline_scripts_take_the_thread_policy_and_repeat_bit_for_bit(module, monkeypatch,
                                                                         tmp_path):
    """sft.py, reward_model.py and dpo.py apply runs.set_threads, as the RL scripts do: the bundled
    model (under 10 M parameters) runs on one torch thread, whatever the process had, so two runs
    of the same seed end with identical weights on a loaded machine (each op split over 2 OpenMP
    threads beside busy processes gave different weights)."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # auto: the policy decides
    weights = []
    for i in range(2):
        torch.set_num_threads(2)
        out = tmp_path / f"run{i}"
        run_main(monkeypatch, module, *FAST_PIPELINE, "--max_steps", 2, "--output_dir", out)
        assert torch.get_num_threads() == 1
        weights.append(load_file(out / "checkpoint" / "model.safetensors"))
    torch.set_num_threads(2)  # as this file runs its tests
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_report_to_tensorboard_writes_what_its_own_reader_reads_back(monkeypatch, tmp_path):
    """--report_to tensorboard, against the real package: tensorboard's EventAccumulator reads
    every number of every metrics.jsonl line back at its step (as float32), and the samples."""
    pytest.importorskip("tensorboard", reason="--report_to tensorboard needs the tensorboard "
                        "package (.ci/run installs it)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--report_to", "tensorboard",
             "--output_dir", out)
    metrics = read_metrics(out)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    keys = {k for k, v in metrics[0].items() if isinstance(v, (int, float)) and k != "step"}
    assert set(events.Tags()["scalars"]) == keys
    for key in keys:
        assert [e.step for e in events.Scalars(key)] == [1, 2], key
        assert [e.value for e in events.Scalars(key)] == pytest.approx(
            [m[key] for m in metrics], rel=1e-6, abs=1e-12), key
    [text] = events.Tags()["tensors"]  # add_text: the first step's samples, as JSON
    [sample] = events.Tensors(text)
    logged = json.loads(sample.tensor_proto.string_val[0])
    assert sample.step == 1 and [s["prompt"] for s in logged] == \
        [s["prompt"] for s in json.loads((out / "samples.jsonl").read_text())["samples"]]


def test_run_processes_tries_again_only_when_the_machine_fails_the_launch(monkeypatch, tmp_path):
    """The torchrun tests' launcher: each try on a free port of its own; a gloo or rendezvous
    failure is tried again from the run folder as it was before the launch; a failure of the code
    is returned at once."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "metrics.jsonl").write_text("before\n")
    calls, seen = [], []

    def fake_run(cmd, **kwargs):  # the first try fails as gloo does on a busy machine
        calls.append(cmd)
        seen.append(sorted(os.listdir(folder)))
        (folder / "half-written").write_text("x")
        err = "RuntimeError: [pair.cc:534] Read error: Resource temporarily unavailable"
        return subprocess.CompletedProcess(cmd, 1 if len(calls) == 1 else 0, "",
                                           err if len(calls) == 1 else "")
    monkeypatch.setattr(subprocess, "run", fake_run)
    assert run_processes(tmp_path, 2, "grpo", "--resume", folder).returncode == 0
    assert seen == [["metrics.jsonl"], ["metrics.jsonl"]]  # the second try: as before the first
    assert all(any(re.fullmatch(r"--rdzv-endpoint=127\.0\.0\.1:\d+", a) for a in c)
               for c in calls)
    calls.clear()
    monkeypatch.setattr(subprocess, "run", lambda cmd, **kw: calls.append(cmd) or
                        subprocess.CompletedProcess(cmd, 1, "", "ValueError: a bug"))
    assert run_processes(tmp_path, 2, "grpo").returncode == 1 and len(calls) == 1


def wandb_history(path):
    """The history rows of an offline wandb run file (run-*.wandb), as {key: value}: its records
    are in LevelDB's log format (a 7-byte file header, then 32 KiB blocks of pieces, each a crc32
    (4 bytes), a length (2) and a kind: 1 whole, 2 first, 3 middle, 4 last), each record a
    protobuf wandb_internal_pb2.Record."""
    from wandb.proto import wandb_internal_pb2
    data, pos, records, piece = path.read_bytes(), 7, [], b""
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's last bytes, too few for a header: padding
            pos += 32768 - pos % 32768
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        piece += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            records.append(piece)
            piece = b""
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json)
                         for i in record.history.item})
    return rows


def test_report_to_wandb_offline_records_the_run(monkeypatch, tmp_path):
    """--report_to wandb against the real package, offline (WANDB_MODE=offline: nothing leaves
    the machine): the run file it writes holds every number of every metrics.jsonl line at its
    step, and the first step's samples table."""
    wandb = pytest.importorskip("wandb", reason="wandb is not installed (optional: pip install "
                                "wandb)")
    for name, value in (("WANDB_MODE", "offline"), ("WANDB_DIR", str(tmp_path)),
                        ("WANDB_SILENT", "true")):
        monkeypatch.setenv(name, value)
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--report_to", "wandb",
             "--output_dir", out)
    wandb.teardown()  # its service writes the run file on its own time: wait for it to finish
    [path] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    history, metrics = wandb_history(path), read_metrics(out)
    assert [h["_step"] for h in history] == [m["step"] for m in metrics] == [1, 2]
    for h, m in zip(history, metrics):
        for key in (k for k, v in m.items() if isinstance(v, (int, float)) and k != "step"):
            assert h[key] == pytest.approx(m[key], rel=1e-12), key
    samples = json.loads((out / "samples.jsonl").read_text())["samples"]
    assert history[0]["samples/_type"] == "table-file"
    assert history[0]["samples/nrows"] == len(samples) and "samples/nrows" not in history[1]


# ---- reliability: --sanity
def test_sanity_flag_passes_on_the_bundled_model_and_catches_dropout(tmp_path, tok):
    r = run_script("grpo.py", "--sanity", "--output_dir", str(tmp_path / "run"))
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    assert "sanity: all checks passed" in r.stdout, r.stdout + r.stderr[-2000:]
    cfg = tiny_config("gpt2")
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.5
    torch.manual_seed(0)
    # dropout on: log-probs are noisy, ratio != 1
    model = AutoModelForCausalLM.from_config(cfg).train()
    args = SimpleNamespace(chat_template="none", max_new_tokens=6, temperature=1.0, top_p=1.0,
                           micro_batch_size=8, dtype="fp32", stop=[])
    failed = runs.sanity_check(model, None, tok, [{"prompt": p} for p in PROMPTS], args)
    assert any("ratio" in f for f in failed)


def test_sanity_checks_multi_turn_transcripts(tmp_path, monkeypatch, capsys):
    """--sanity with --env calc samples multi-turn episodes (observations between the model's
    turns) and checks the model tokens' log-probs against one training forward over each whole
    transcript: it passes on the bundled calculator model."""
    seen, real = [], C.generate
    monkeypatch.setattr(C, "generate", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--env", "calc", "--sanity", "--output_dir", tmp_path / "r")
    assert e.value.code == 0 and "sanity: all checks passed" in capsys.readouterr().out
    assert (seen[0][0].tool_calls > 0).any() and (seen[0][0].completion_mask == 0).any()


# ---- docs/ (#30)
# The README is the front page; docs/ holds one file a topic. Every command shown in either must
# run as written: its flags exist, its links resolve, the tests it names exist.
SCRIPTS = {"grpo": grpo, "reinforce": R, "ppo": ppo, "sft": sft, "reward_model": reward_model,
           "dpo": dpo}


def read_docs():
    """{path relative to the repo: text} of README.md and every docs/*.md."""
    paths = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs"))
                                   if f.endswith(".md"))
    return {p: open(os.path.join(ROOT, p), encoding="utf-8").read() for p in paths}


def shown_commands(text):
    """Each `python SCRIPT ...` or `torchrun ... SCRIPT ...` command the text shows: in a code
    block (4-space indented or fenced; a trailing backslash continues the line) or inline in
    backticks. A trailing comment (" # ...") is dropped."""
    lines, out, fenced = text.splitlines(), [], False
    for i, line in enumerate(lines):
        fenced = fenced != line.startswith("```")
        if fenced or line.startswith("    "):
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1].rstrip() + " " + lines[i].strip()
            out.append(line.strip())
        else:
            out += re.findall(r"`((?:python|torchrun) [^`]+)`", line)
    out = [part for c in out for part in c.split(" && ")]  # pip install ... && python ...
    cmds = [re.split(r"\s+#\s", c)[0] for c in out if c.startswith(("python ", "torchrun "))]
    return [c for c in cmds if re.search(r"\S+\.py\b", c)]


def test_docs_commands_use_flags_their_script_has():
    checked = 0
    for path, text in read_docs().items():
        for command in shown_commands(text):
            words = command.split()
            script = next(w for w in words if w.endswith(".py"))
            flags = re.findall(r"(?<!\S)--(\w+)", " ".join(words[words.index(script) + 1:]))
            name = script[:-3]
            if name in SCRIPTS:
                have = {f.name for f in dataclasses.fields(SCRIPTS[name].Args)} | {"help"}
                missing = [f for f in flags if f not in have]
            else:  # tools/ and bench/: argparse scripts, each flag spelled out in the source
                assert os.path.isfile(os.path.join(ROOT, script)), f"{path}: no {script}: {command}"
                source = open(os.path.join(ROOT, script), encoding="utf-8").read()
                missing = [f for f in flags if f'"--{f}"' not in source]
            assert not missing, f"{path}: {script} has no --{missing[0]}: {command}"
            checked += 1
    assert checked >= 20


def test_check_docs_claims_quote_the_docs_and_their_commands_use_real_flags():
    """tools/check_docs.py (a number in the docs is a claim it re-runs): each claim's text, with
    its number, is still in its file, each command's flags exist, and a measurement drifts when
    it differs at the quoted digits (or, for a wall time, beyond the stated factor)."""
    assert len(check_docs.CLAIMS) >= 100
    for file, text, command, read, tol, tags in check_docs.CLAIMS:
        assert check_docs.holds(file, text), f"{file} no longer says {text!r}"
        float(check_docs.quoted(text)[0].replace(",", ""))
        for part in (p for c in check_docs.as_list(command) for p in c.split(" && ")):
            words = part.split()
            if words[0] == "python" and words[1] in {f"{n}.py" for n in SCRIPTS}:
                have = {f.name for f in dataclasses.fields(SCRIPTS[words[1][:-3]].Args)}
                flags = re.findall(r"(?<!\S)--(\w+)", part)
                assert set(flags) <= have, (command, set(flags) - have)
    assert not check_docs.drifted("0.954", 0.9543, 0) and check_docs.drifted("0.954", 0.932, 0)
    assert check_docs.drifted("0.93", 0.897, 0) and not check_docs.drifted("16", 16.0, 0)
    assert not check_docs.drifted("70", 164.6, 2.0) and check_docs.drifted("70", 230.0, 2.0)


def test_shown_commands_finds_block_inline_and_continued_commands():
    text = ("Run `python grpo.py --help` or\n\n"
            "    python ppo.py --lr 1 \\\n        --seed 2  # why\n"
            "\n```bash\ntorchrun --nproc_per_node 2 sft.py --lora_r 4\n```\n`pip install x`\n"
            "\n    pip install x && python dpo.py --system_prompt 'after ####.' --seed 1\n")
    assert shown_commands(text) == ["python grpo.py --help", "python ppo.py --lr 1 --seed 2",
                                    "torchrun --nproc_per_node 2 sft.py --lora_r 4",
                                    "python dpo.py --system_prompt 'after ####.' --seed 1"]


def test_readme_test_command_is_the_one_ci_runs():
    """.ci/run installs the CPU torch first, then runs exactly the README's test command."""
    readme = read_readme()
    command = re.search(r"Run the tests:\n\n    (.*)\n", readme).group(1)
    install, tests = command.split(" && ")
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read().splitlines()
    assert tests.replace("python ", "python3 ", 1) in ci
    assert any("pip install" in line and line.endswith(install[len("pip install"):])
               for line in ci), (install, ci)
    # plain PyPI's torch is the CUDA build: the set-up note gives a user PyTorch's CPU index
    note = readme[readme.index("Run the tests:"):readme.index("## The scripts")]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in note


def anchor(heading):
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_relative_links_and_anchors_resolve():
    docs = read_docs()
    for path, text in docs.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            file, _, frag = target.partition("#")
            where = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            assert os.path.exists(os.path.join(ROOT, where)), f"{path}: {target}: no {where}"
            if frag:
                headings = re.findall(r"^#+ (.*)$", docs.get(where) or open(
                    os.path.join(ROOT, where), encoding="utf-8").read(), re.M)
                assert frag in {anchor(h) for h in headings}, f"{path}: no heading for {target}"


def test_no_import_cycle_and_the_core_imports_no_plumbing():
    """Each module imports only modules below it: the project's imports form no cycle. errors.py
    and fastpath.py import nothing of the project, common.py only those two, and no module
    imports an algorithm script."""
    mods = {f[:-3] for f in os.listdir(ROOT) if f.endswith(".py")
            and not f.startswith(("test", "conftest"))}
    graph = {}
    for m in mods:
        tree = ast.parse(open(os.path.join(ROOT, m + ".py"), encoding="utf-8").read())
        graph[m] = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for a in n.names if a.name in mods}
        graph[m] |= {n.module for n in ast.walk(tree)
                     if isinstance(n, ast.ImportFrom) and n.module in mods}
    assert graph["errors"] == set() and graph["fastpath"] == set()
    assert graph["common"] == {"errors", "fastpath"}
    scripts = {"grpo", "ppo", "reinforce", "sft", "dpo", "reward_model"}
    assert not any(graph[m] & scripts for m in mods)
    done = set()
    while len(done) < len(graph):  # peel off the modules whose imports are all done
        ready = {m for m in graph if m not in done and graph[m] <= done}
        assert ready, f"an import cycle among {sorted(set(graph) - done)}"
        done |= ready


def test_every_module_keeps_the_line_budget_the_readme_states():
    """README's "Reading the code" table gives each module a budget in lines: each file keeps it."""
    rows = re.findall(r"^\| `(\w+\.py)`[^|]*\|[^|]*\| (\d+) lines \|$", read_readme(), re.M)
    assert len(rows) >= 12  # common, errors, fastpath, envs, the plumbing, the six scripts
    for name, budget in rows:
        with open(os.path.join(ROOT, name)) as f:
            assert len(f.read().splitlines()) <= int(budget), f"{name} is over its {budget} lines"


def test_readme_links_every_docs_file():
    readme, docs = read_readme(), [p for p in read_docs() if p.startswith("docs/")]
    assert docs and all(f"]({p})" in readme for p in docs), [p for p in docs if p not in readme]


def test_readme_stays_a_front_page():
    assert len(read_readme().splitlines()) <= 300


def test_tests_named_in_the_docs_exist():
    source = open(os.path.join(ROOT, "test_algos.py"), encoding="utf-8").read()
    defined = set(re.findall(r"^def (test_\w+)\(", source, re.M))
    for path, text in read_docs().items():
        for name in re.findall(r"`(test_\w+)`", text):
            assert name in defined, f"{path} names {name}, which test_algos.py does not define"


def test_docs_code_references_name_functions_that_exist():
    """`file.py: name()` anywhere in docs/ names a function defined there (with the key symbols
    KEY_SYMBOLS lists for it)."""
    for path, text in read_docs().items():
        if path != "README.md":
            check_code_map(text, ROOT, least=0)


# ---- the README's code map and docstrings, the 100-column rule
# What each equation in the README must show in the code it points at: the map cannot rot.
KEY_SYMBOLS = {"group_advantages": ["mean", "std", "eps"],
               "per_token_loss": ["ratio", "clamp", "torch.min", "beta", "kl_estimate"],
               "aggregate": ["n_tokens", "n_seqs", "max_new_tokens"],
               "kl_returns": ["beta", "cumsum", "scores"],
               "advantages": ["returns - b", "rloo_baseline", "whiten"],
               "reinforce_loss": ["-advantages * logprobs", "clamp"],
               "shaped_rewards": ["kl_coef", "scores", "lengths - 1"],
               "gae": ["gamma", "lam", "advantages + values"],
               "policy_loss": ["ratio", "clamp", "torch.max"],
               "value_loss": ["clip_eps_value", "0.5", "torch.max"],
               "sft_loss": ["logprobs * mask", "n_tokens"],
               "bradley_terry_loss": ["logsigmoid", "margin", "weight", "n_rows"],
               "ranking_pairs": ["range(i + 1, k)"],
               "score_forward": ["rm_sequences", "rm_forward"],
               "dpo_loss": ["logsigmoid", "label_smoothing", "1 / (2 * beta)", "ref_chosen"],
               "sequence_logprobs": ["token_logprobs", "sum(-1)"],
               "length_batches": ["sorted", "shuffle"],
               "plain_token_logprobs": ["temperature", "log_softmax", "gather"],
               "kl_estimate": ["0.5 * log_r**2", "log_r.exp() - 1 - log_r"],
               "whiten": ["mean", "rsqrt", "mask"]}


def check_code_map(text, folder, least=10):
    """Every `file.py: name()` in text names a function defined in that file (found by name, so no
    edit elsewhere in the file breaks it) whose source holds the equation's key symbols. With
    least > 0 (the README's code map) every name must have its key symbols listed above."""
    refs = re.findall(r"(\w+\.py): (\w+)\(\)", text)
    assert len(refs) >= least
    for file, name in refs:
        source = open(os.path.join(folder, file)).read()
        funcs = {n.name: ast.get_source_segment(source, n) for n in ast.parse(source).body
                 if isinstance(n, ast.FunctionDef)}
        assert name in funcs, f"the docs point at {file}: {name}(), which is not defined there"
        assert not least or name in KEY_SYMBOLS, f"{name}: add its key symbols to KEY_SYMBOLS"
        missing = [k for k in KEY_SYMBOLS.get(name, []) if k not in funcs[name]]
        assert not missing, f"{file}: {name}() no longer shows {missing}"


def read_readme(section=""):
    """README.md, or only its `## section` (up to the next `## ` heading)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return text.split(f"\n## {section}\n")[1].split("\n## ")[0] if section else text


def test_readme_code_map_names_functions_that_compute_its_equations():
    check_code_map(read_readme("Reading the code"), ROOT)


def test_a_students_edit_above_a_mapped_function_keeps_the_map_valid(tmp_path):
    """The exercise kind of edit: three lines inserted above per_token_loss move every line
    below."""
    for script in ("grpo.py", "reinforce.py", "ppo.py", "sft.py", "reward_model.py", "dpo.py",
                   "common.py"):
        shutil.copy(os.path.join(ROOT, script), tmp_path / script)
    source = (tmp_path / "grpo.py").read_text()
    edit = "def rank_advantages(rewards):\n    return rewards.argsort().argsort().float()\n\n\n"
    edited = source.replace("def per_token_loss(", edit + "def per_token_loss(")
    (tmp_path / "grpo.py").write_text(edited)
    check_code_map(read_readme("Reading the code"), tmp_path)
    (tmp_path / "grpo.py").write_text(source.replace("def aggregate(", "def aggregate_renamed("))
    with pytest.raises(AssertionError, match="aggregate"):  # and a real rot is caught
        check_code_map(read_readme("Reading the code"), tmp_path)


@pytest.mark.parametrize("script", ["grpo.py", "reinforce.py", "ppo.py", "runs.py", "sft.py",
                                    "reward_model.py", "dpo.py"])
def test_docstring_references_name_functions_that_exist(script):
    """`name()` in a module docstring is defined in that file (`C.name()` in common.py,
    `tasks.name()` in tasks.py, and so on)."""
    source = open(os.path.join(ROOT, script)).read()
    defined = {"": source, "C.": open(os.path.join(ROOT, "common.py")).read()}
    for module in ("tasks", "loading", "fastpath", "runs"):
        defined[module + "."] = open(os.path.join(ROOT, module + ".py")).read()
    pattern = r"\b(C\.|tasks\.|loading\.|fastpath\.|runs\.)?(\w+)\(\)"
    for prefix, name in re.findall(pattern, ast.get_docstring(ast.parse(source))):
        assert f"def {name}(" in defined[prefix], f"{script} docstring: {prefix}{name}()"


def test_every_python_line_fits_in_100_columns():
    """The style rule of pyproject.toml, checked without needing ruff installed."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    files = tracked or [f for f in os.listdir(ROOT) if f.endswith(".py")]
    long = [f"{f}:{i}" for f in files
            for i, line in enumerate(open(os.path.join(ROOT, f), encoding="utf-8"), 1)
            if len(line.rstrip("\n")) > 100]
    assert not long, f"{len(long)} lines over 100 columns, e.g. {long[:5]}"
