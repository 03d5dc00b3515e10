"""LoRA: the base as reference, merged checkpoints, resume, merge_lora, no peft."""
import json
import sys
import warnings
from types import SimpleNamespace

import pytest
import torch

import common as C
from plumbing.errors import UserError
import grpo
from plumbing import loading
import ppo
import reinforce as R
from plumbing import runs
from tools.merge_lora import merge as merge_lora

from tests.helpers import OFF, PROMPTS, run_main


# ---- LoRA: the reference, merged checkpoints, resume
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
    with pytest.raises(UserError, match="needs the optional package peft"):
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
             "100", "--save_optimizer", "--output_dir", str(out))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_after"] >= summary["eval_before"] + 0.2, summary
    assert (out / "checkpoint" / "adapter_model.safetensors").exists()
    n = summary["steps"]
    run_main(monkeypatch, module, "--resume", str(out), "--max_steps", str(n + 1))
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, n + 2))


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
        with pytest.raises(UserError, match="that is the run folder or its checkpoint"):
            merge_lora(str(run), str(out))
    (run / "checkpoint" / "adapter_model.safetensors").write_bytes(b"damaged")
    with pytest.raises(UserError, match="its LoRA adapter could not be loaded .SafetensorError"):
        merge_lora(str(run), str(tmp_path / "merged"))
