"""minrl tests, CPU only, minutes not hours (minGPT style): our pieces against plain, obvious reference computations
on tiny random models of real architectures; learning on the bundled task; the scripts end to end; bad input.
Run: python -m pytest -q test_algos.py"""
import json, os, random, subprocess, sys

import pytest
import torch
from transformers import (AutoModelForCausalLM, AutoTokenizer, GPT2Config, GPTNeoXConfig, LlamaConfig,
                          LlamaForSequenceClassification, Qwen2Config)

import common as C

ROOT = os.path.dirname(os.path.abspath(__file__))
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tok():
    return C.load_tokenizer(C.DEFAULT_POLICY)


def tiny_config(arch, vocab=99):
    ids = dict(vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return {"llama": LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=64, max_position_embeddings=64, **ids),
            "qwen2": Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=64, max_position_embeddings=64, **ids),
            "gpt2": GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **ids),
            "gpt_neox": GPTNeoXConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=64, **ids)}[arch]


def tiny_model(arch, seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gpt2": "GPT2LMHeadModel",
                          "gpt_neox": "GPTNeoXForCausalLM"}[arch]]
    return AutoModelForCausalLM.from_config(cfg).eval()


PROMPTS = ["1+2=", "37+48=", "5+999=", "0+0=", "Hello, how are you?"]
ARCHS = ["llama", "qwen2", "gpt2", "gpt_neox"]
OFF = torch.autocast("cpu", enabled=False)


def reference_logprobs(model, prompt, completion, temperature):
    """A plain HF forward on one unpadded row, log_softmax over (logits / temperature), gather the taken tokens."""
    ids = torch.tensor([prompt + completion])
    logits = model(ids).logits[0, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    return lp[len(prompt) - 1:]


# ------------------------------------------------------------------------------------------------- common.py
@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_equal_plain_forward_with_left_padding(arch, tok):
    model = tiny_model(arch)
    model.generation_config.eos_token_id = [2, 43, 72]  # frequent tokens of this random model, so rows end early
    prompts = C.encode_prompts(tok, PROMPTS)
    roll = C.sample(model, tok, prompts, 8, temperature=0.7)
    lp = C.batched_logprobs(model, roll, 0.7, 2, OFF)
    for i, p in enumerate(prompts):
        n = int(roll.completion_mask[i].sum())
        comp = roll.ids[i, roll.P:roll.P + n].tolist()
        ref = reference_logprobs(model, p, comp, 0.7)
        torch.testing.assert_close(lp[i, :n], ref, atol=1e-4, rtol=1e-4)
        assert (lp[i, n:] == 0).all()
    # the sampler's own log-probs agree with the recomputed ones (same temperature)
    torch.testing.assert_close(roll.sample_logprobs, lp, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_sample_equals_generate(arch, tok):
    model = tiny_model(arch, seed=1)
    model.generation_config.eos_token_id = [2, 43, 72]
    prompts = C.encode_prompts(tok, PROMPTS)
    roll = C.sample(model, tok, prompts, 10, greedy=True)
    ids, mask = C.left_pad(prompts, tok.pad_token_id, "cpu")
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=tok.pad_token_id)
    ref = ref[:, ids.shape[1]:]
    for i in range(len(prompts)):
        n = int(roll.completion_mask[i].sum())
        assert roll.ids[i, roll.P:roll.P + n].tolist() == ref[i, :n].tolist()


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
    """pad == eos (as for many hub tokenizers): the mask still comes from lengths and keeps the EOS."""
    t = C.load_tokenizer(C.DEFAULT_POLICY)
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


def test_batch_order_does_not_change_logprobs(tok):
    model = tiny_model("llama")
    roll = C.sample(model, tok, C.encode_prompts(tok, PROMPTS), 6)
    lp = C.batched_logprobs(model, roll, 1.0, 5, OFF)
    perm = torch.tensor([3, 0, 4, 2, 1])
    rolled = C.SimpleNamespace(ids=roll.ids[perm], attention_mask=roll.attention_mask[perm],
                               completion_mask=roll.completion_mask[perm], P=roll.P)
    torch.testing.assert_close(C.batched_logprobs(model, rolled, 1.0, 2, OFF), lp[perm], atol=1e-5, rtol=1e-5)


def test_reward_model_batch_equals_one_by_one(tok):
    torch.manual_seed(0)
    cfg = tiny_config("llama")
    cfg.num_labels = 1
    rm = LlamaForSequenceClassification(cfg).eval()
    prompts, comps = ["1+2=", "37+48=", "5+999="], ["3", "85", "1004 is the answer"]
    batch = C.rm_scores(rm, tok, prompts, comps)
    one = torch.cat([C.rm_scores(rm, tok, [p], [c]) for p, c in zip(prompts, comps)])
    torch.testing.assert_close(batch, one, atol=1e-5, rtol=1e-5)
    # and equals HF's own pooling on an unpadded row (the score of the last token)
    ids = torch.tensor([tok(prompts[2] + comps[2])["input_ids"] + [tok.eos_token_id]])
    torch.testing.assert_close(batch[2], rm(ids).logits[0, 0], atol=1e-5, rtol=1e-5)


def test_rule_rewards():
    assert C.math_reward("85", {"answer": "85"}) == 1.0
    assert C.math_reward("The answer is 1,004.", {"answer": "#### 1004"}) == 1.0
    assert C.math_reward("75", {"answer": "85"}) == 0.0
    assert C.math_reward("", {"answer": "85"}) == 0.0
    total, parts = C.compute_rewards([{"answer": "3"}] * 2, ["3", "4"], {"math": 1.0, "format": 0.5})
    assert total.tolist() == [1.5, 0.5] and parts["math"].tolist() == [1.0, 0.0]


def test_kl_estimators_against_exact_kl():
    """On samples from p, k1 and k3 average to KL(p || q); k3 is never negative."""
    torch.manual_seed(0)
    p, q = torch.distributions.Categorical(logits=torch.randn(6)), torch.distributions.Categorical(logits=torch.randn(6))
    x = p.sample((200000,))
    exact = torch.distributions.kl_divergence(p, q)
    for est in ("k1", "k3"):
        k = C.kl_estimate(p.log_prob(x), q.log_prob(x), est)
        assert abs(float(k.mean()) - float(exact)) < 0.02
    assert (C.kl_estimate(p.log_prob(x), q.log_prob(x), "k3") >= 0).all()
    assert (C.kl_estimate(p.log_prob(x), q.log_prob(x), "k2") >= 0).all()


@pytest.mark.parametrize("text,expect", [("{\"prompt\": \"a\"}\nnot json\n", "line 2: not valid JSON"),
                                         ("{\"prompt\": \"a\"}\n{\"answer\": \"1\"}\n", "line 2: field 'prompt'"),
                                         ("\n\n", "is empty")])
def test_jsonl_errors_name_the_line(tmp_path, text, expect):
    f = tmp_path / "d.jsonl"
    f.write_text(text)
    with pytest.raises(C.UserError, match=expect):
        C.read_jsonl(str(f))


def test_builtin_task_split_is_held_out():
    held = set(C.task_eval_pairs())
    assert len(held) == C.TASK_EVAL_SIZE
    assert not held & set(C.task_train_pairs(random.Random(0), 5000))
    assert all(C.column_sum(a, b) == a + b for a, b in C.task_train_pairs(random.Random(1), 200))
    assert C.column_sum(37, 48, random.Random(0), drop=1.0) == 75


def test_bundled_models_load_offline():
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    code = ("from transformers import AutoModelForCausalLM as A, AutoModelForSequenceClassification as S;"
            "import common as C; A.from_pretrained(C.DEFAULT_POLICY); S.from_pretrained(C.DEFAULT_REWARD_MODEL)")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env)
