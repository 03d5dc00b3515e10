"""Rule rewards, the reward model, eval, and your own task's data fields and reward files."""
import json
import random
import re
import sys
from types import SimpleNamespace

import pytest
import torch

import common as C
from plumbing.errors import UserError
import grpo
from plumbing import loading
from plumbing import tasks

from tests.helpers import (FAST_GRPO, OFF, REWARD_FILE, one_error_line, read_metrics, run_main,
                           tiny_rm)


# ---- common.py: rule rewards, the reward model
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
def test_without_answers_eval_is_the_mean_reward_and_gold_is_not_logged(tmp_path, monkeypatch,
                                                                        capsys):
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
    run_main(monkeypatch, grpo, "--data", data, "--rewards", "length", "--max_steps", "2",
             "--eval_size", "4", "--output_dir", out)
    assert "held-out mean reward" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_metric"] == "mean reward"
    assert -0.5 < summary["eval_before"] < 0  # short answers: a small length penalty
    assert not any("gold" in m for m in read_metrics(out))


# ---- your own task: data fields, reward functions, what eval measures
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
                                        for n in ("quits", "ctrl_c", "one_row", "text",
                                                  "scalar")]))
    for name, message in (("shout", "reward 'shout' raised ValueError: no"),
                          ("short", "returned 1 values for 2 completions"),
                          ("words", "returned 'good' for row 0: not a number"),
                          ("text", "reward 'text' returned a str, not a list of numbers: return "
                                   "one number per completion"),
                          ("scalar", "reward 'scalar' returned a float, not a list of numbers"),
                          ("quits", "reward 'quits' raised SystemExit: 0"),
                          ("ctrl_c", "reward 'ctrl_c' raised KeyboardInterrupt"),
                          ("one_row", "raised ZeroDivisionError: division by zero (first on row "
                                      "1, prompt '2+2=')")):
        with pytest.raises(UserError, match=re.escape(message)):
            fns[name](["2", "5"], rows)
    for spec, message in (("nofile.py:f", "file 'nofile.py' not found"),
                          (f"{tmp_path / 'mine.py'}:missing", "has no function 'missing'"),
                          ("nosuchmodule:f", "importing 'nosuchmodule' failed"),
                          (f"{tmp_path / 'mine.py'}", "write path/to/file.py:function")):
        with pytest.raises(UserError, match=re.escape(message)):
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
    with pytest.raises(UserError, match="would be 0 whatever the model says"):
        tasks.eval_metric(rows, "math")
    assert tasks.eval_metric(rows, "auto") == "mean reward"
    assert tasks.eval_metric([{"prompt": "a", "answer": "#### 3"}], "auto") == "accuracy"
