"""The command line: each script end to end, --help, bad input and flag ranges."""
import dataclasses
import inspect
import json
import os
import random
import re
import shutil
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers import LlamaForSequenceClassification

import common as C
from plumbing.errors import UserError
import dpo
from plumbing import flags
import grpo
from plumbing import loading
import ppo
import reinforce as R
import reward_model
import sft
from tools.merge_lora import merge as merge_lora

from tests.helpers import (ARCHS, FAST_GRPO, REWARD_FILE, ROOT, SCRIPTS, one_error_line,
                           read_metrics, run_main, tiny_config, tiny_model, tiny_rm)

sys.path.insert(0, os.path.join(ROOT, "tools"))
import calc_report  # noqa: E402  (tools/calc_report.py)
import compare  # noqa: E402  (tools/compare.py, which imports its sibling plot.py)


# ---- command line: the scripts end to end
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
def test_grpo_end_to_end_on_tiny_random_models(tiny_dirs, tmp_path, arch, monkeypatch):
    out = tmp_path / "out"
    run_main(monkeypatch, grpo, "--model", tiny_dirs / arch, "--data", tiny_dirs / "data.jsonl",
             "--max_steps", "3", "--group_size", "4", "--prompts_per_step", "2",
             "--micro_batch_size", "4", "--max_new_tokens", "8", "--eval_size", "8",
             "--dynamic_sampling", "--loss_agg", "seq-mean-token-mean", "--num_iterations", "2",
             "--save_every", "0", "--output_dir", out)
    check_outputs(out, 3)


def test_grpo_learns_on_the_bundled_task(tmp_path, capsys, monkeypatch):
    """A short run on the bundled model: held-out greedy accuracy and the sampled reward both rise
    clearly. The README's snippet loads its checkpoint and generates the eval's greedy answer."""
    out = tmp_path / "out"
    run_main(monkeypatch, grpo, "--max_steps", "40", "--eval_every", "0", "--eval_size", "200",
             "--output_dir", out)
    printed = capsys.readouterr()
    summary, metrics = check_outputs(out, 40)
    assert summary["eval_after"] >= summary["eval_before"] + 0.2, summary
    model = loading.load_model(loading.DEFAULT_POLICY, "lm", torch.device("cpu"))
    n_params = sum(p.numel() for p in model.parameters())
    adam_mb = 8 * n_params / 2**20
    assert f"AdamW's moments will add {adam_mb:,.0f} MB from step 2" in printed.out + printed.err
    assert re.search(r"memory: peak [\d,]+ MB in step 1, before AdamW's", printed.out + printed.err)
    first = [m["reward"] for m in metrics[:10]]
    last = [m["reward"] for m in metrics[-10:]]
    assert sum(last) / 10 >= sum(first) / 10 + 0.15
    readme = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    snippet = re.search(r"```python\n(from transformers import .*?)```", readme, re.S)[1]
    folder = str(out / "checkpoint")
    exec(snippet.replace('"runs/grpo-20261201-120000/checkpoint"', repr(folder)), {})
    args = grpo.Args(max_new_tokens=6)  # the snippet's
    greedy = C.generate(loading.load_model(folder, "lm", torch.device("cpu")),
                        loading.load_tokenizer(folder), [{"prompt": "37+48="}], args,
                        torch.autocast("cpu", enabled=False), greedy=True)[1]
    assert capsys.readouterr().out.strip().splitlines()[-1] == greedy[0], greedy


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


def test_short_run_raises_the_reward_model_score(tmp_path, monkeypatch):
    """Bundled policy and reward model: 16 PPO steps raise the RM score by well over its noise."""
    out = tmp_path / "run"
    run_main(monkeypatch, ppo, "--max_steps", "16", "--batch_size", "32", "--eval_every", "0",
             "--eval_size", "50", "--output_dir", out)
    m = read_metrics(out)
    first = sum(x["reward"] for x in m[:2]) / 2
    last = sum(x["reward"] for x in m[-4:]) / 4
    # the noise of that difference is about 0.16 reward_std (32 samples a step): the bar is 2.5
    # times that
    assert last - first > 0.4 * m[0]["reward_std"], (first, last, m[0]["reward_std"])


def test_end_to_end_tiny_random_models_and_resume(tmp_path, tok, monkeypatch, capsys):
    tiny_model("llama").save_pretrained(tmp_path / "policy")
    tiny_rm().save_pretrained(tmp_path / "rm")
    for d in ("policy", "rm"):
        tok.save_pretrained(tmp_path / d)
    out = tmp_path / "run"
    args = ["--model", str(tmp_path / "policy"), "--reward_model", str(tmp_path / "rm"),
            "--batch_size", "16", "--micro_batch_size", "8", "--eval_size", "16",
            "--eval_every", "0", "--adaptive_kl", "--kl_target", "1e-6", "--kl_estimator", "k3",
            "--kl_horizon", "16", "--save_optimizer", "--output_dir", str(out)]
    run_main(monkeypatch, ppo, *args, "--max_steps", "2")
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
    run_main(monkeypatch, ppo, "--resume", out, "--max_steps", "3")
    m = read_metrics(out)
    assert [x["step"] for x in m] == [1, 2, 3] and abs(m[2]["kl_coef"] - 0.04 * 1.2) < 1e-9
    # bad input: one line, exit code 2
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, ppo, *args, "--batch_size", "15", guard=True)
    assert e.value.code == 2 and one_error_line(capsys).startswith("error: --num_minibatches")


def test_help_shows_each_flag_once_under_its_section(monkeypatch):
    """--help: every Args field once (no --data-split twin, no usage block naming them all),
    under the section comment of Args above it, in lines of at most 100 columns."""
    for name, script in SCRIPTS.items():
        text = flags.help_text(script.Args, name, script.__doc__)
        shown = re.findall(r"^  --(\w+)", text, re.M)
        assert sorted(shown) == sorted(f.name for f in dataclasses.fields(script.Args)), name
        assert max(len(line) for line in text.splitlines()) <= 100, name
    monkeypatch.chdir(ROOT)
    text = flags.help_text(grpo.Args, "grpo", grpo.__doc__)
    assert text.index("\nsampling:\n") < text.index("\n  --group_size N ") < text.index(
        "\nrewards:\n") < text.index("\n  --reward_fn TEXT [TEXT ...] ")
    assert "--model TEXT                hub id or local folder" in text
    assert "(default: models/tiny-adder)" in " ".join(text.split())  # relative to the repo


def test_help_lists_sections_in_a_users_order_whatever_order_args_declares():
    """grpo's, reinforce's and ppo's Args open with their objective (a reader of the equations
    meets its fields first); --help still lists model and data, sampling, tool use, rewards, the
    objective, optimisation, run (flags.HELP_ORDER), and a section HELP_ORDER does not name
    stays after the one before it (distill's objective after sampling, its rewards after it)."""
    for name in ("grpo", "reinforce", "ppo"):
        source = inspect.getsource(SCRIPTS[name].Args)
        first = re.search(r"# --- (.+)", source)[1]
        assert first.startswith(("the GRPO", "the REINFORCE", "the PPO")), (name, first)
        text = flags.help_text(SCRIPTS[name].Args, name, SCRIPTS[name].__doc__)
        titles = sorted(re.findall(r"# --- (.+)", source), key=lambda t: text.index(f"\n{t}:\n"))
        ranks = [next(i for i, t in enumerate(flags.HELP_ORDER) if title.startswith(t))
                 for title in titles]
        assert titles[0] == "model and data" and ranks == sorted(ranks), (name, titles)
    text = flags.help_text(SCRIPTS["distill"].Args, "distill", SCRIPTS["distill"].__doc__)
    assert text.index("\nsampling:") < text.index("\nthe distillation objective:") < text.index(
        "\nrewards: logged") < text.index("\noptimisation:")


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
       # a mistyped local folder (models/ is a folder here): never tried on the hub
       (["--model", "models/tiny-addr"], "no such local folder (did you mean models/tiny-adder?)"),
       (["--model", "./tiny-adder"], "'./tiny-adder': no such local folder, and not a hub id"),
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
    with pytest.raises(UserError, match="invalid choice: 'rlooo'"):
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


def test_merge_lora_and_compare_refuse_bad_flags_in_one_line(tmp_path, capsys):
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "args.json").write_text("{}")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match="--out .*file: that is a file"):
        merge_lora(str(tmp_path / "run"), str(tmp_path / "file"))
    with pytest.raises(UserError, match="no checkpoint/args.json there"):
        merge_lora(str(tmp_path / "nothing"))
    with pytest.raises(UserError, match="that is the run folder or its checkpoint"):
        merge_lora(str(tmp_path / "run"), str(tmp_path / "run" / "checkpoint" / "sub"))
    (tmp_path / "run" / "checkpoint" / "args.json").write_text('{"algo": "grpo", "args": {')
    with pytest.raises(UserError, match="checkpoint/args.json is damaged .JSONDecodeError"):
        merge_lora(str(tmp_path / "run"))
    for argv, message in ((["--seeds", "0"], "--seeds must be >= 1, not 0"),
                          (["--samples", "-5"], "--samples must be >= 1, not -5"),
                          (["--algos", ""], "--algos names no algorithm; known: ['reinforce'"),
                          (["--algos", "grpo,ppo,grpo"], "--algos names grpo twice"),
                          (["--seeds", str(10**21)], "--seeds must be <= 100, not 1000000"),
                          (["--task", "calc", "--algos", "ppo-math"], "leaves out ppo-math"),
                          (["--threads", "100000"], "--threads must be <= "),
                          (["--output_dir", str(tmp_path / "file")], "that is a file"),
                          (["--out", str(tmp_path / "file")], "that is a file")):
        with pytest.raises(SystemExit) as e:
            compare.main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("argv,message", [
    ([], "usage: python tools/calc_report.py MODEL [K]"), (["a", "b", "c"], "usage:"),
    ([loading.DEFAULT_POLICY, "0"], "K: 1 to 1000"), (["/no/such/model"], "no such local folder"),
    ([loading.DEFAULT_REWARD_MODEL], "has no causal-LM head")])
def test_calc_report_refuses_a_bad_model_in_one_line(argv, message, monkeypatch, capsys):
    """python tools/calc_report.py MODEL [K]: no model, a bad one, a bad K: exit 2."""
    monkeypatch.setattr(sys, "argv", ["calc_report.py", *argv])
    with pytest.raises(SystemExit) as e:
        calc_report.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: ") \
        and message in err[0], err


# ---- command line: flag ranges
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


def test_a_pretrained_model_gets_its_own_defaults_printed_and_explicit_flags_win(
        tmp_path, monkeypatch, capsys):
    """--model a pretrained model (config.json of a model over 10 M parameters; a hub id): the
    RL scripts take flags.REAL_MODEL's defaults, print them in one line and record them
    (flags.MODEL_DEFAULTS, summary.json's model_defaults); a flag given, --data chat-sums's
    preset and a toy or bundled model keep theirs. The micro-batch divides the step's rows."""
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(
        {"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30}))  # SmolLM2-135M

    def parse(module, *argv):
        monkeypatch.setattr(sys, "argv", [f"{module.__name__}.py", *map(str, argv)])
        args = flags.parse_args(module.Args, module.__name__, module.__doc__)
        return args, capsys.readouterr().out.strip()
    args, out = parse(grpo, "--model", big, "--lr", "3e-5")
    assert (args.max_new_tokens, args.lr, args.temperature, args.beta, args.micro_batch_size,
            args.eval_size) == (128, 3e-5, 0.7, 0.0, 8, 128)
    assert out == ("defaults for a pretrained model (flags you give win; flags.REAL_MODEL): "
                   "--max_new_tokens 128 --temperature 0.7 --beta 0.0 --micro_batch_size 8 "
                   "--eval_size 128")
    assert flags.MODEL_DEFAULTS == {"max_new_tokens": 128, "temperature": 0.7, "beta": 0.0,
                                    "micro_batch_size": 8, "eval_size": 128}
    args, _ = parse(grpo, "--model", "Org/Some-Hub-Model", "--group_size", "3",
                    "--prompts_per_step", "4")  # a hub id: pretrained; 12 rows: micro-batch 4
    assert (args.lr, args.micro_batch_size) == (1e-5, 4)
    args, _ = parse(R, "--model", big)
    assert (args.baseline, args.lr, args.beta) == ("rloo", 1e-5, 0.0)
    args, _ = parse(ppo, "--model", big)
    assert (args.critic_init, args.critic_lr, args.ppo_epochs, args.batch_size) == (
        "policy", 1e-5, 1, 32)
    args, _ = parse(dpo, "--model", big)  # its own beta stays DPO's
    assert (args.lr, args.beta, args.micro_batch_size, args.eval_size) == (1e-6, 0.1, 8, 128)
    args, out = parse(grpo, "--model", big, "--data", "chat-sums")  # its preset, measured there
    assert (args.max_new_tokens, args.lr, args.micro_batch_size) == (10, 2e-5, 32) and out == ""
    small = tmp_path / "toy"
    small.mkdir()
    (small / "config.json").write_text(json.dumps(
        {"vocab_size": 64, "hidden_size": 64, "num_hidden_layers": 2}))
    for model in (small, loading.DEFAULT_POLICY):  # a toy, the bundled model: as before
        args, out = parse(grpo, "--model", model)
        assert (args.max_new_tokens, args.lr, args.beta, out) == (6, 1e-4, 0.04, "")
        assert flags.MODEL_DEFAULTS == {}
