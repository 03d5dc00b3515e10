"""The RLHF pipeline: sft.py, reward_model.py and dpo.py, their data, runs and bad input."""
import json
import math
import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers import LlamaConfig
from transformers import LlamaForSequenceClassification

import common as C
from plumbing.errors import UserError
import dpo
from plumbing import calc
from plumbing import loading
import ppo
import reward_model
from plumbing import runs
import sft
from plumbing import tasks
from tools.build_models import column_sum, wrong_answer
from tools.merge_lora import merge as merge_lora

from tests.helpers import CHATML, OFF, read_metrics, rollout, run_main, scripted_model, write_jsonl


# ---- the pipeline's data: preference and SFT rows
def summary_and_metrics(out):
    summary = json.loads((out / "summary.json").read_text())
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return summary, metrics


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
     "line 1: field 'chosen', message 1: role 'wizard' is not one of"),
    ({"chosen": chat(("user", "Sky?"), ("assistant", "Blue")),  # no prompt to take from them
      "rejected": chat(("user", "Sky?"), ("assistant", "Blue"))},
     "line 1: fields 'chosen' and 'rejected' are identical: a pair needs two different"),
    ({"chosen": "Blue.", "rejected": "Blue."}, "line 1: fields 'chosen' and 'rejected' are "
     "identical")])
def test_bad_preference_formats_get_one_line(tmp_path, row, message):
    with pytest.raises(UserError, match=message):
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


# ---- the pipeline scripts learn, log and repeat
def test_reward_model_names_its_eval_row_pair_accuracy_not_greedy(monkeypatch, tmp_path):
    """reward_model.py's held-out table row is the pair accuracy (chosen scored above rejected):
    no greedy decoding is involved."""
    seen = {}
    monkeypatch.setattr(runs, "finish_run", lambda *a, **kw: seen.update(metric=a[1], **kw))
    run_main(monkeypatch, reward_model, "--max_steps", 1, "--eval_every", 0, "--eval_size", 8,
             "--output_dir", tmp_path / "rm")
    assert seen["metric"] == "pair accuracy" and seen["label"] == "chosen > rejected"


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
    score = float(f"{score:.6g}")  # as summary.json keeps it: 6 significant digits
    assert score == summary["eval_after"] != summary["eval_before"], summary["evals"]


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


# ---- the pipeline: bad input
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
    with pytest.raises(UserError, match=r"conv.jsonl, line 1: message 2: the chat template "
                                          "does not render its tool_calls"):
        sft.read_demonstrations(path, tok, "auto", 256)


# thinking models' templates, cut to what matters here: Qwen3's drops the reasoning of every
# assistant turn but the last; DeepSeek-R1's also opens the next turn with <think>
DROPS_EARLIER_THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' and "
    "not loop.last %}{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% endif %}")
OPENS_THINKING = DROPS_EARLIER_THINKING.replace("not loop.last", "true").replace(
    "<|im_start|>assistant\n{% endif %}", "<|im_start|>assistant\n<think>{% endif %}")


def test_sft_on_a_thinking_template_advises_what_works(chat_model):
    """A template that rewrites earlier turns cannot train every turn: the one line advises
    --last_turn_only where that renders (and it does), else a template that keeps each turn."""
    tok = loading.load_tokenizer(chat_model)
    conversation = [{"role": "user", "content": "1+1="},
                    {"role": "assistant", "content": "<think>one and one</think>2"},
                    {"role": "user", "content": "2+2="},
                    {"role": "assistant", "content": "<think>two and two</think>4"}]
    demo = {"messages": conversation, "start": 0, "tools": None}
    tok.chat_template = DROPS_EARLIER_THINKING
    with pytest.raises(UserError, match="the start of the whole: train with --last_turn_only$"):
        tasks.encode_demonstration(tok, demo, where="row 0")
    _, ids, mask = tasks.encode_demonstration(tok, demo, last_turn_only=True)
    assert tok.decode([x for x, m in zip(ids, mask) if m]) == "<think>two and two</think>4" + \
        "<|im_end|>"
    tok.chat_template = OPENS_THINKING
    for last_turn_only in (False, True):
        with pytest.raises(UserError, match="whole: give the tokenizer a chat template that "
                                              "keeps each turn as written .a training template"):
            tasks.encode_demonstration(tok, demo, last_turn_only=last_turn_only)


def test_sft_conversation_without_a_template_is_the_multi_turn_rollouts_transcript():
    """Without a chat template a calculator conversation is exactly what engine.sample builds
    when the model writes those turns with --env calc: the same ids, and the loss mask is the
    rollout's completion_mask (the observation ' 46 ' masked, the EOS in). The same text as one
    completion (calc.calc_demo's) has the same ids, every one of them trained."""
    t = loading.load_tokenizer(loading.DEFAULT_POLICY)
    conversation = chat(("user", "12+34="), ("assistant", "<calc>12+34</calc>"), ("tool", " 46 "),
                        ("assistant", "46"))
    prompt, ids, mask = tasks.encode_demonstration(t, tasks.demonstration(
        {"messages": conversation}, "row"))
    assert prompt == C.encode_prompts(t, ["12+34="], "none")[0]
    enc = lambda s: t(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    completion = enc("<calc>12+34</calc>") + enc(" 46 ") + enc("46") + [t.eos_token_id]
    model = scripted_model(t, [prompt], [completion], [[1] * 18 + [0] * 4 + [1] * 3])
    roll = rollout(model, t, [prompt], calc.calc, [tasks.addition_row(12, 34)], 3, 48, greedy=True,
                   stop=["</calc>"])
    assert roll.observations == [[" 46 "]] and roll.final == ["46"]
    assert roll.ids[0, roll.P:].tolist() == ids
    assert roll.completion_mask[0].long().tolist() == mask == [1] * 18 + [0] * 4 + [1] * 3
    flat = calc.calc_demo(12, 34, random.Random(0), column_sum, tool=1.0)
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
