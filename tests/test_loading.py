"""loading.py: bundled models offline, which models a script loads, gradient checkpointing."""
import os
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

import common as C
import grpo
from plumbing import loading
import ppo
from plumbing import runs

from tests.helpers import PROMPTS, one_error_line, run_main, tiny_config, tiny_model, write_jsonl


# ---- loading.py: models offline, gradient checkpointing
ADD_TOOL = '''
def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first
        b: the second
    """
    return a + b
'''


def test_tokenizer_checks_come_before_the_weights_load(chat_model, tmp_path, monkeypatch, capsys):
    """What needs only the tokenizer and the config fails before any weights load (a minute for
    a big model), in one line: --tools on a template that shows no tools, prompts longer than the
    context, and ppo.py on a policy with its own tokenizer and the bundled toy reward model."""
    def no_weights(*a, **kw):
        raise AssertionError("weights loaded before the check")
    monkeypatch.setattr(loading, "load_model", no_weights)
    (tmp_path / "tools.py").write_text(ADD_TOOL)
    long = write_jsonl(tmp_path / "long.jsonl", [{"prompt": "1 + 1 " * 200, "answer": "2"}] * 5)
    for script, flags, message in [
            (grpo, ["--tools", f"{tmp_path / 'tools.py'}:add"], "--tools needs a model whose "
             "chat template renders tools"),
            (grpo, ["--data", long], "5 of 5 prompts are too long"),
            (ppo, [], f"--model {chat_model} has its own tokenizer, and the default "
             "--reward_model is the bundled tiny-adder-rm"),
            (ppo, ["--rewards", "math"], "pass --reward_model PATH (reward_model.py makes one), "
             "or --rewards math --critic_init policy")]:
        with pytest.raises(SystemExit) as e:
            run_main(monkeypatch, script, "--model", chat_model, *flags, "--output_dir",
                     tmp_path / "run", guard=True)
        assert e.value.code == 2 and message in one_error_line(capsys), (flags, message)


def test_bundled_models_load_offline():
    """With HF_HUB_OFFLINE=1 (conftest.py, as every script run here), plain transformers loads
    both bundled models from their folders."""
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    AutoModelForCausalLM.from_pretrained(loading.DEFAULT_POLICY)
    AutoModelForSequenceClassification.from_pretrained(loading.DEFAULT_REWARD_MODEL)


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


# ---- grpo.py: which models it loads
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
