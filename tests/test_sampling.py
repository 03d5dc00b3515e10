"""common.sample (and engine.sample, the multi-turn one, held equal to it) and stop strings, on tiny
models and on a real-style BPE vocabulary."""
import math
from types import SimpleNamespace

import pytest
import torch

import common as C
import dpo
import engine
import grpo
from plumbing import loading
import ppo
import reinforce as R
from plumbing import runs
from plumbing import tasks

from tests.helpers import ARCHS, PROMPTS, read_metrics, run_main, tiny_model


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


@pytest.mark.parametrize("stop", [(), ("8", "12")])
def test_the_engine_with_episodes_that_end_at_once_is_the_single_turn_sampler(stop, tok):
    """engine.sample (multi-turn) and common.sample share the draw (common.next_token): with an env
    that ends every episode at its first turn, the engine's rollout is common.sample's, token for
    token, log-prob for log-prob, mask for mask, with rows that end on EOS, on a stop string and
    at the budget. Greedy (at temperature 0.7 and top-p 0.8, which the log-probs use): a draw
    would come from other streams (u[i, k] a row, against torch.multinomial's one)."""
    model = loading.load_model(loading.DEFAULT_POLICY, "lm", torch.device("cpu"), frozen=True)
    prompts = C.encode_prompts(tok, [r["prompt"] for r in tasks.load_data("").eval_rows[:48]])
    kw = dict(temperature=0.7, top_p=0.8, greedy=True, stop=stop)
    single = C.sample(model, tok, prompts, 3, **kw)
    asked = []

    def ends_at_once(requests, wait):  # the env's answer to every turn: the episode ended
        asked.extend(r.row for r in requests)
        return [(r.row, None) for r in requests]
    multi = engine.sample(model, tok, prompts, 3, ends_at_once, **kw)
    for key in ("ids", "attention_mask", "completion_mask", "truncated", "sample_logprobs"):
        assert torch.equal(getattr(multi, key), getattr(single, key)), key
    assert multi.P == single.P and 0 < int(single.truncated.sum()) < len(prompts)
    assert sorted(asked) == (~single.truncated).nonzero()[:, 0].tolist()  # each ended turn, once


# ---- real vocabularies: a BPE tokenizer, ChatML, spare embedding rows
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


@pytest.mark.parametrize("module", [grpo, R, ppo, dpo])
def test_scripts_run_on_the_real_tokenizer_model(module, chat_model, tmp_path, monkeypatch):
    """One short run of each RL script (and DPO) on the BPE/ChatML model with extra rows."""
    flags = {grpo: ["--group_size", "4", "--prompts_per_step", "2", "--micro_batch_size", "8",
                    "--stop", "</answer>", "--beta", "0.04"],
             R: ["--samples_per_prompt", "2", "--prompts_per_step", "2"],
             ppo: ["--batch_size", "8", "--critic_init", "policy", "--rewards", "math"],
             dpo: ["--batch_size", "4"]}[module]
    run_main(monkeypatch, module, "--model", chat_model, "--max_steps", "1", "--eval_every", "0",
             "--save_every", "0", "--eval_size", "4", "--max_new_tokens", "6",
             "--output_dir", tmp_path / "run", *flags)
    steps = read_metrics(tmp_path / "run")
    assert len(steps) == 1 and all(math.isfinite(v) for v in steps[0].values()
                                   if isinstance(v, float))
