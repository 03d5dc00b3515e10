"""distill.py: its losses against slow references and TRL 1.16's own code, the teacher's checks
(one line, before any weights load), self-distillation's prompts, learning on the bundled task,
resume."""
import json
import shutil
import sys

import pytest
import torch

import common as C
import distill
import grpo
from plumbing import chat_sums, flags, loading

from tests.helpers import CHATML, ROOT, one_error_line, read_metrics, run_main, write_jsonl

TINY = ["--eval_size", "20", "--eval_every", "0", "--save_every", "0", "--samples_every", "0"]


# ---- the losses
def slow_jsd(ps, pt, beta):
    """One position's generalized JSD, the definitions written out over the vocabulary (float64):
    beta KL(p_t || m) + (1 - beta) KL(p_s || m), m = (1 - beta) p_s + beta p_t; the ends: the
    plain KLs (TRL's)."""
    def kl(p, q):  # sum_v p(v) log(p(v) / q(v)), a loop over the vocabulary
        return sum(float(a) * float(torch.log(a) - torch.log(b)) for a, b in zip(p, q) if a > 0)
    if beta == 0:
        return kl(pt, ps)
    if beta == 1:
        return kl(ps, pt)
    m = (1 - beta) * ps + beta * pt
    return beta * kl(pt, m) + (1 - beta) * kl(ps, m)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_chunked_divergence_equals_the_definition_at_every_position(beta):
    """chunked_divergence, 3 positions a chunk, gives each position's generalized JSD written out
    over the vocabulary, the log-probs of the sampled tokens under both models and the student's
    entropy; whole or in
    chunks, the same values and gradients."""
    g = torch.Generator().manual_seed(0)
    N, H, V, temperature = 7, 5, 11, 0.7
    xs = torch.randn(N, H, generator=g, dtype=torch.float64, requires_grad=True)
    xt = torch.randn(N, H, generator=g, dtype=torch.float64)
    ws, wt = (torch.randn(V, H, generator=g, dtype=torch.float64) for _ in range(2))
    y = torch.randint(V, (N,), generator=g)
    heads = (lambda x, t: x @ ws.T / t, lambda x, t: x @ wt.T / t)
    args = distill.Args(beta=beta, temperature=temperature)
    div, lp, t_lp, ent = distill.chunked_divergence(xs, xt, y, heads, args, chunk=3)
    ps, pt = ((x @ w.T / temperature).softmax(-1) for x, w in ((xs, ws), (xt, wt)))
    for i in range(N):
        want = slow_jsd(ps[i].detach(), pt[i], beta)  # fp32 logits (as the LM head's): ~1e-7
        assert float(div[i].detach()) == pytest.approx(want, rel=1e-5, abs=1e-6)
        assert float(lp[i].detach()) == pytest.approx(float(ps[i, y[i]].log()), rel=1e-5)
        assert float(t_lp[i]) == pytest.approx(float(pt[i, y[i]].log()), rel=1e-5)
        assert float(ent[i]) == pytest.approx(float(-(ps[i] * ps[i].log()).sum()), rel=1e-5)
    (g_chunks,) = torch.autograd.grad(div.sum(), xs)
    whole, *_ = distill.chunked_divergence(xs, xt, y, heads, args, chunk=N)
    (g_whole,) = torch.autograd.grad(whole.sum(), xs)
    torch.testing.assert_close(g_chunks, g_whole, rtol=0, atol=1e-6)


@pytest.mark.parametrize("beta,temperature", [(0.0, 1.0), (0.25, 1.0), (0.5, 0.7), (1.0, 1.0),
                                              (1.0, 1.3)])
def test_jsd_equals_trls_distillation_loss(beta, temperature):
    """TRL 1.16's DistillationTrainer loss, _chunked_divergence_loss, on the same hidden states,
    LM heads and mask: the same token-mean loss, and the same gradients for the student's hidden
    states and head, to 1e-6 (TRL computes its tiles in fp32)."""
    trl = pytest.importorskip("trl.trainer.distillation_trainer", reason="TRL is not installed")
    g = torch.Generator().manual_seed(1)
    B, K, H, V = 3, 5, 8, 50
    hs = torch.randn(B, K, H, generator=g, requires_grad=True)
    ht = torch.randn(B, K, H, generator=g)
    ws = (torch.randn(V, H, generator=g) * 0.5).requires_grad_()
    wt = torch.randn(V, H, generator=g) * 0.5
    mask = (torch.arange(K)[None] < torch.tensor([[5], [2], [4]])).float()
    want, _, _ = trl._chunked_divergence_loss(hs, ht, ws, wt, mask, beta, temperature=temperature)
    g_want = torch.autograd.grad(want, (hs, ws))
    valid = mask.bool()
    y = torch.zeros(int(valid.sum()), dtype=torch.long)
    div, *_ = distill.chunked_divergence(hs[valid], ht[valid], y, (lambda x, t: x @ ws.T / t,
                                           lambda x, t: x @ wt.T / t),
                                         distill.Args(beta=beta, temperature=temperature), chunk=4)
    got = div.sum() / mask.sum()
    g_got = torch.autograd.grad(got, (hs, ws))
    assert float(got) == pytest.approx(float(want), abs=1e-6) and float(want) > 1e-3
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("beta,temperature", [(1.0, 0.7), (0.0, 0.5), (0.5, 1.3)])
def test_jsd_with_spare_embedding_rows_equals_trls_on_the_rows_with_tokens(beta, temperature):
    """A model with embedding rows past its tokenizer's (Qwen2.5, Qwen3): those ids are never
    sampled and have probability 0 here (common.suppressed); TRL's loss reads every row. So ours
    equals TRL 1.16's loss given only the rows with tokens (loss and gradients to 1e-6), and
    differs from TRL's on the whole head (docs/distill.md)."""
    trl = pytest.importorskip("trl.trainer.distillation_trainer", reason="TRL is not installed")
    g = torch.Generator().manual_seed(3)
    B, K, H, V, spare = 2, 4, 8, 40, 7
    hs = torch.randn(B, K, H, generator=g, requires_grad=True)
    ht = torch.randn(B, K, H, generator=g)
    ws = (torch.randn(V + spare, H, generator=g) * 0.5).requires_grad_()
    wt = torch.randn(V + spare, H, generator=g) * 0.5
    mask = (torch.arange(K)[None] < torch.tensor([[4], [3]])).float()
    never = torch.arange(V + spare) >= V
    want, _, _ = trl._chunked_divergence_loss(hs, ht, ws[:V], wt[:V], mask, beta,
                                              temperature=temperature)
    whole, _, _ = trl._chunked_divergence_loss(hs, ht, ws, wt, mask, beta,
                                               temperature=temperature)
    g_want = torch.autograd.grad(want, (hs, ws))
    valid = mask.bool()
    heads = (lambda x, t: C.masked_logits(x @ ws.T / t, never),
             lambda x, t: C.masked_logits(x @ wt.T / t, never))
    div, *_ = distill.chunked_divergence(hs[valid], ht[valid], torch.zeros(
        int(valid.sum()), dtype=torch.long), heads, distill.Args(beta=beta,
                                                                 temperature=temperature), chunk=2)
    got = div.sum() / mask.sum()
    g_got = torch.autograd.grad(got, (hs, ws))
    assert float(got) == pytest.approx(float(want), abs=1e-6)
    assert abs(float(whole) - float(want)) > 1e-4  # the spare rows do count in TRL's whole head
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_jsd_below_temperature_1_with_spare_embedding_rows_is_finite(chat_model, beta):
    """lm_head on a model with embedding rows past its tokenizer's (chat_model: 37 of them) at
    temperature 0.5: the masked logits are divided before they are masked, so the divergence,
    its gradient and the entropy stay finite (masked first, min / 0.5 = -inf, 0 * -inf = nan)."""
    model = loading.load_model(chat_model, "lm", torch.device("cpu"))
    assert C.suppressed(model, model.config.vocab_size, "cpu") is not None
    head = distill.lm_head(model)
    g = torch.Generator().manual_seed(4)
    xs = torch.randn(5, 64, generator=g, requires_grad=True)
    xt = torch.randn(5, 64, generator=g)
    div, lp, t_lp, ent = distill.chunked_divergence(
        xs, xt, torch.arange(5), (head, head), distill.Args(beta=beta, temperature=0.5), chunk=2)
    (grad,) = torch.autograd.grad(div.sum(), xs)
    for t in (div, lp, t_lp, ent, grad):
        assert torch.isfinite(t).all()
    assert float(div.sum()) > 0


def test_opd_loss_is_the_sampled_reverse_kl_as_an_advantage():
    """pg_loss with opd_advantages, token by token: the value -A_t = kl_coef (log pi - log pi_T),
    the gradient -A_t wrt log pi; and over a whole distribution, the expected gradient
    E_y[A(y) grad log p(y)] is exactly -grad KL(p || q), the reverse KL the student descends."""
    g = torch.Generator().manual_seed(2)
    lp = -torch.rand(6, generator=g, dtype=torch.float64).requires_grad_()
    t_lp = -torch.rand(6, generator=g, dtype=torch.float64)
    loss = distill.pg_loss(lp, lp.detach(), distill.opd_advantages(lp, t_lp, kl_coef=0.5))
    (grad,) = torch.autograd.grad(loss.sum(), lp)
    for t in range(6):
        a = -0.5 * (float(lp[t]) - float(t_lp[t]))
        assert float(loss[t]) == pytest.approx(-a) and float(grad[t]) == pytest.approx(-a)
    z = torch.randn(9, generator=g, dtype=torch.float64, requires_grad=True)  # student logits
    log_q = torch.randn(9, generator=g, dtype=torch.float64).log_softmax(-1)  # the teacher's
    log_p = z.log_softmax(-1)
    every = torch.arange(9)  # each token y, weighted by p(y): the exact expectation
    surrogate = distill.pg_loss(log_p[every], log_p[every].detach(),
                                distill.opd_advantages(log_p[every], log_q[every]))
    (g_pg,) = torch.autograd.grad((log_p.exp().detach() * surrogate).sum(), z, retain_graph=True)
    (g_kl,) = torch.autograd.grad((log_p.exp() * (log_p - log_q)).sum(), z)
    torch.testing.assert_close(g_pg, g_kl, rtol=0, atol=1e-12)


def test_a_sure_mistake_has_no_reverse_kl_gradient_and_a_full_forward_one():
    """A student sure of a token the teacher gives 0.05 (p 0.999): the reverse KL is 2.9 nats,
    yet its gradient wrt the logits vanishes (2e-3: p (log p - log p_T - KL) is ~0 at every
    token), and so does opd's sampled one (it samples the mistake: A grad log p, grad log p =
    e_y - p ~ 0); the forward KL's, p - p_T, stays ~1.3. Why chat-sums distills with
    --loss jsd --beta 0 (docs/distill.md)."""
    log_t = torch.tensor([0.9, 0.05, 0.05], dtype=torch.float64).log()  # the teacher: token 0
    z = torch.tensor([0.0, 8.0, 0.0], dtype=torch.float64, requires_grad=True)  # sure of 1
    grads = {}
    for beta in (1.0, 0.0):  # reverse, forward
        div = distill.generalized_jsd(z.log_softmax(-1)[None], log_t[None], beta)
        (grads[beta],) = torch.autograd.grad(div.sum(), z)
    lp = z.log_softmax(-1)[1]  # opd: the one token it samples (with p 0.999)
    (g_opd,) = torch.autograd.grad(distill.pg_loss(lp, lp.detach(), distill.opd_advantages(
        lp, log_t[1])), z)
    log_p = z.detach().log_softmax(-1)
    reverse = float((log_p.exp() * (log_p - log_t)).sum())
    assert reverse > 2.9
    assert grads[1.0].norm() < 0.01 and g_opd.norm() < 0.01, (grads[1.0], g_opd)
    assert grads[0.0].norm() > 1.2, grads[0.0]
    torch.testing.assert_close(grads[0.0], z.softmax(-1).detach() - log_t.exp())


# ---- teachers
def test_jsd_with_another_vocabulary_or_a_template_is_one_line_before_weights_load(
        chat_model, tmp_path, monkeypatch, capsys):
    """--loss jsd compares distributions over one vocabulary: a teacher with another (a BPE chat
    model for the bundled character-level student) stops the run in one line (exit 2) before
    any weights load, and so does one with the same vocabulary and another chat template; the
    same teacher with --loss opd (aligned by characters) trains a step."""
    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the teacher's tokenizer was checked")
    monkeypatch.setattr(loading, "load_model", no_weights)
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, distill, "--teacher", chat_model, "--loss", "jsd", *TINY,
                 "--output_dir", tmp_path / "a", guard=True)
    assert e.value.code == 2 and "compares next-token distributions over one vocabulary: use " \
        "--loss opd" in one_error_line(capsys)
    other = tmp_path / "templated"
    shutil.copytree(loading.DEFAULT_POLICY, other)
    config = json.loads((other / "tokenizer_config.json").read_text())
    config["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (other / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, distill, "--teacher", other, *TINY, "--output_dir", tmp_path / "b",
                 guard=True)
    assert e.value.code == 2 and "chat template differs" in one_error_line(capsys)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    monkeypatch.undo()
    run_main(monkeypatch, distill, "--teacher", chat_model, *TINY, "--max_steps", "1",
             "--prompts_per_step", "8", "--output_dir", tmp_path / "c")
    assert read_metrics(tmp_path / "c")[0]["kl"] > 0


# ---- a teacher with another tokenizer
@pytest.fixture(scope="module")
def bpe_student(tmp_path_factory):
    """A random tiny Qwen2 student with a byte-level BPE tokenizer whose merges join digits and
    signs ("37+48=85" is 37, +4, 8, =85), ChatML: another tokenizer than the bundled adder's
    characters. Its folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
    folder = str(tmp_path_factory.mktemp("bpe-student"))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randint(100, (2, 3000), generator=g).tolist()
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([f"{x}+{y}={x + y}" for x, y in zip(a, b)], trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=128, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=384,
                      max_position_embeddings=128, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(folder)
    return folder


def test_cross_rollout_aligns_the_two_tokenizations_by_characters(bpe_student, tok):
    """The student's BPE completion "58" + EOS (tokens 58, EOS) and a cut one "12+3" (1, 2+3):
    the teacher (characters) reads 5, 8, its EOS and 1, 2, +, 3 after its own prompt; a span ends
    where both cut: {58}, {EOS}, {1}, {2+3}."""
    s_tok = loading.load_tokenizer(bpe_student)
    rows = [s_tok.convert_tokens_to_ids(["58", s_tok.eos_token]),
            s_tok.convert_tokens_to_ids(["1", "2+3"])]
    prompt = C.encode_prompts(s_tok, ["37+48="])[0]
    roll = C.SimpleNamespace(ids=torch.tensor([prompt + r for r in rows]), P=len(prompt),
                             completion_mask=torch.ones(2, 2))
    t_roll, spans, t_spans, n = distill.cross_rollout(s_tok, tok, roll, ["37+48=", "5+6="],
                                                      "auto", [s_tok.eos_token_id])
    assert n == 4 and spans.tolist() == [[0, 1], [2, 3]]
    assert t_spans.tolist() == [[0, 0, 1, 0], [2, 3, 3, 3]]  # the first row's last: padding
    assert t_roll.completion_mask.tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    completions = t_roll.ids[:, t_roll.P:].tolist()
    assert completions[0][:3] == tok("58", add_special_tokens=False)["input_ids"] + [
        tok.eos_token_id] and tok.decode(completions[1]) == "12+3"
    real = t_roll.ids[1, :t_roll.P][t_roll.attention_mask[1, :t_roll.P] == 1].tolist()
    assert real == C.encode_prompts(tok, ["5+6="])[0]  # its own prompt, no chat template
    lp, t_span_lp = torch.tensor([-1.0, -2.0, -0.5]), torch.tensor([-4.0, -3.0])
    lp_c, t_lp, once = distill.span_logprobs(lp, t_span_lp, torch.tensor([0, 0, 1]))
    assert lp_c.tolist() == [-3.0, -3.0, -0.5] and t_lp.tolist() == [-4.0, -4.0, -3.0]
    assert once.tolist() == [0.5, 0.5, 1.0]


def test_one_tokenizer_presented_as_another_gives_the_same_steps(grpo_teacher, tmp_path,
                                                                 monkeypatch):
    """The GRPO teacher, and a copy of it whose vocabulary numbers the characters the other way
    round (embedding rows moved to match): the copy has another vocabulary, so it reads the
    completions' text in its own ids (cross_rollout, one-token spans) and gives the same loss,
    KL and gradient norm as the teacher reading the student's ids, step for step."""
    copy = tmp_path / "renumbered"
    shutil.copytree(grpo_teacher, copy)
    spec = json.loads((copy / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    new_id = [i if i < 4 else 4 + len(vocab) - 1 - i for i in range(len(vocab))]  # specials stay
    spec["model"]["vocab"] = {k: new_id[v] for k, v in vocab.items()}
    (copy / "tokenizer.json").write_text(json.dumps(spec))
    model = loading.load_model(grpo_teacher, "lm", torch.device("cpu"))
    with torch.no_grad():  # tied: the LM head's rows move with the embedding's
        weight = model.get_input_embeddings().weight
        weight[torch.tensor(new_id)] = weight.clone()
    model.save_pretrained(copy)
    assert loading.load_tokenizer(copy).get_vocab() != loading.load_tokenizer(
        grpo_teacher).get_vocab()
    for name, teacher in (("same", grpo_teacher), ("other", copy)):
        run_main(monkeypatch, distill, "--teacher", teacher, "--max_steps", "3", *TINY,
                 "--output_dir", tmp_path / name)
    a, b = read_metrics(tmp_path / "same"), read_metrics(tmp_path / "other")
    for key in ("loss", "kl", "grad_norm", "reward"):
        assert [x[key] for x in b] == pytest.approx([x[key] for x in a], rel=1e-5), key
    assert a[0]["kl"] > 0.1


def test_a_bpe_student_learns_from_a_character_teacher(bpe_student, grpo_teacher, tmp_path,
                                                       monkeypatch):
    """A random BPE student (ChatML prompts) distilled from the character-level GRPO teacher
    (plain prompts) on the bundled task: in 60 steps its KL to the teacher falls by more than a
    third (measured: 21 -> 8 nats per token, last 5 steps against the first 5) and it learns to
    end its answers where the teacher does (cut completions: 97% -> 2%)."""
    out = tmp_path / "o"
    run_main(monkeypatch, distill, "--model", bpe_student, "--teacher", grpo_teacher, "--lr",
             "2e-3", "--max_steps", "60", "--prompts_per_step", "32", *TINY, "--output_dir", out)
    m = read_metrics(out)
    kl, cut = [x["kl"] for x in m], [x["frac_truncated"] for x in m]
    assert sum(kl[-5:]) < 0.66 * sum(kl[:5]), kl
    assert sum(cut[-5:]) < 0.5 * sum(cut[:5]), cut


def test_a_teacher_with_fewer_embedding_rows_than_the_vocabulary_is_one_line(tmp_path,
                                                                            monkeypatch, capsys):
    """A teacher with the student's tokenizer but an LM head of 90 rows for its 99 tokens would
    have no probability for the ids past its rows: one line (exit 2) before any weights load, no
    output folder; beside it, the same teacher with rows to spare (128) trains a step."""
    from transformers import AutoModelForCausalLM
    tok = loading.load_tokenizer(loading.DEFAULT_POLICY)
    for rows in (90, 128):
        model = AutoModelForCausalLM.from_pretrained(loading.DEFAULT_POLICY)
        model.resize_token_embeddings(rows)
        model.save_pretrained(tmp_path / f"t{rows}")
        tok.save_pretrained(tmp_path / f"t{rows}")
    monkeypatch.setattr(loading, "load_model", pytest.fail)  # the weights: not loaded
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, distill, "--teacher", tmp_path / "t90", *TINY, "--output_dir",
                 tmp_path / "a", guard=True)
    assert e.value.code == 2 and "its LM head has 90 rows, fewer than the 99 token ids the " \
        "student can sample" in one_error_line(capsys)
    assert not (tmp_path / "a").exists()
    monkeypatch.undo()
    run_main(monkeypatch, distill, "--teacher", tmp_path / "t128", *TINY, "--max_steps", "1",
             "--output_dir", tmp_path / "b")
    assert read_metrics(tmp_path / "b")[0]["step"] == 1


@pytest.mark.parametrize("argv,message", [
    ([], "no --teacher: the teacher is the student's own starting weights"),
    (["--teacher_context", "demo"], "--teacher_context 'demo': the row"),
    (["--teacher", loading.DEFAULT_POLICY, "--reward_coef", "1"], "--samples_per_prompt >= 2")])
def test_bad_teacher_flags_are_one_line(argv, message, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, distill, *argv, *TINY, "--output_dir", tmp_path / "x", guard=True)
    assert e.value.code == 2 and message in one_error_line(capsys)


def test_self_distillation_teacher_reads_the_context_then_the_same_completion(tok):
    """teacher_prompt: chat-sums' `example` field makes the prompt that shows the worked example
    (and leaves a prompt that shows it as it is); a text context goes before a text prompt; a
    teacher system prompt replaces the row's. teacher_rollout: the completion columns are the
    student's, after the teacher's prompt."""
    for a, b, phrasing in ((3, 5, 0), (7, 1, 4)):
        plain, shown = chat_sums.row(a, b, phrasing, 0), chat_sums.row(a, b, phrasing, 1)
        assert distill.teacher_prompt(plain, "example") == shown["prompt"]
        assert distill.teacher_prompt(shown, "example") == shown["prompt"]
    row = {"prompt": [{"role": "system", "content": "S"}, {"role": "user", "content": "Q"}],
           "demo": "D"}
    assert distill.teacher_prompt(row, "demo", "T") == [
        {"role": "system", "content": "T"}, {"role": "user", "content": "D"},
        {"role": "user", "content": "Q"}]
    assert distill.teacher_prompt({"prompt": "37+48=", "demo": "12+34=46\n"}, "demo") == \
        "12+34=46\n37+48="
    torch.manual_seed(0)
    model = loading.load_model(loading.DEFAULT_POLICY, "lm", torch.device("cpu"))
    prompts = ["37+48=", "5+6="]
    roll = C.sample(model, tok, C.encode_prompts(tok, prompts), 5)
    t_roll = distill.teacher_rollout(tok, roll, ["1+1=2\n" + p for p in prompts], "auto")
    T = roll.completion_mask.shape[1]
    assert torch.equal(t_roll.ids[:, -T:], roll.ids[:, -T:])
    assert torch.equal(t_roll.attention_mask[:, -T:], roll.attention_mask[:, -T:])
    for i, p in enumerate(prompts):
        real = t_roll.ids[i, :t_roll.P][t_roll.attention_mask[i, :t_roll.P] == 1]
        assert real.tolist() == C.encode_prompts(tok, ["1+1=2\n" + p])[0]


# ---- learning and resume on the bundled task
@pytest.fixture(scope="module")
def grpo_teacher(tmp_path_factory, monkeypatch_module):
    """A teacher as the docs make one: 50 steps of grpo.py on the bundled task (about 0.97)."""
    out = tmp_path_factory.mktemp("teacher") / "run"
    run_main(monkeypatch_module, grpo, "--max_steps", "50", *TINY, "--output_dir", out)
    return str(out / "checkpoint")


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.mark.parametrize("loss", ["opd", "jsd"])
def test_distill_learns_the_bundled_task_from_a_grpo_teacher_in_15_steps(loss, grpo_teacher,
                                                                          tmp_path, monkeypatch):
    """15 steps (64 completions each) from a GRPO teacher: held-out accuracy on 100 prompts
    gains more than 0.3 (measured: +0.5 and more), and the student's KL to the teacher falls."""
    out = tmp_path / loss
    run_main(monkeypatch, distill, "--teacher", grpo_teacher, "--loss", loss, "--max_steps",
             "15", *TINY, "--eval_size", "100", "--output_dir", out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_after"] > summary["eval_before"] + 0.3, summary
    kl = [m["kl"] for m in read_metrics(out)]
    assert sum(kl[-5:]) < 0.5 * sum(kl[:5]), kl


def test_resume_reproduces_a_straight_run(grpo_teacher, tmp_path, monkeypatch):
    """4 steps straight, or 2 and a --resume to 4 (LoRA-free, jsd with a reward mixed in): the same
    metrics, step for step."""
    args = ["--teacher", grpo_teacher, "--loss", "jsd", "--beta", "0.5", "--reward_coef", "0.5",
            "--samples_per_prompt", "4", "--prompts_per_step", "4", *TINY, "--save_every", "2"]
    run_main(monkeypatch, distill, *args, "--max_steps", "4", "--output_dir", tmp_path / "a")
    run_main(monkeypatch, distill, *args, "--max_steps", "2", "--save_optimizer",
             "--output_dir", tmp_path / "b")
    run_main(monkeypatch, distill, "--resume", tmp_path / "b", "--max_steps", "4")
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert [m["step"] for m in b] == [1, 2, 3, 4]
    for key in ("reward", "loss", "kl", "divergence", "grad_norm"):
        assert [x[key] for x in a] == pytest.approx([x[key] for x in b], rel=1e-5), key


@pytest.mark.parametrize("loss", ["opd", "jsd"])
def test_a_teacher_equal_to_the_student_gives_kl_0_at_any_temperature(loss, tmp_path,
                                                                       monkeypatch):
    """The bundled model as its own teacher, at temperature 0.5: both models' log-probs are taken
    at the sampling temperature, so at step 1 they are equal: kl, loss and gradient 0 (a teacher
    read at temperature 1 is another distribution: kl about 0.1)."""
    run_main(monkeypatch, distill, "--teacher", loading.DEFAULT_POLICY, "--temperature", "0.5",
             "--loss", loss, "--max_steps", "1", "--prompts_per_step", "16", *TINY,
             "--output_dir", tmp_path / "o")
    (m,) = read_metrics(tmp_path / "o")
    assert abs(m["kl"]) < 1e-5 and abs(m["loss"]) < 1e-5 and m["grad_norm"] < 1e-4, m


def test_micro_batches_give_the_same_step(grpo_teacher, tmp_path, monkeypatch):
    """64 completions in one micro-batch or in four of 16: the loss is normalised by the whole
    step's tokens, so the step's loss and gradient norm are the same (per micro-batch, the loss
    would be about 4x)."""
    for loss in ("opd", "jsd"):
        out = {}
        for mb in (64, 16):
            out[mb] = tmp_path / f"{loss}{mb}"
            run_main(monkeypatch, distill, "--teacher", grpo_teacher, "--loss", loss,
                     "--micro_batch_size", mb, "--max_steps", "1", *TINY, "--output_dir", out[mb])
        (a,), (b,) = read_metrics(out[64]), read_metrics(out[16])
        assert abs(a["loss"]) > 1e-3 and a["grad_norm"] > 1e-3, a
        for key in ("loss", "kl", "grad_norm", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=1e-4), (loss, key)


def test_the_reward_part_learns_the_reward(tmp_path, monkeypatch):
    """--reward_coef 1 with the bundled model as its own teacher: the teacher's signal starts at
    0, the reward's GRPO advantage is what moves the student, toward higher rewards: held-out
    accuracy on 100 prompts gains more than 0.2 in 20 steps (measured 0.34 -> 0.81; with the
    advantage's sign turned, 0.34 -> 0.34)."""
    out = tmp_path / "o"
    run_main(monkeypatch, distill, "--teacher", loading.DEFAULT_POLICY, "--reward_coef", "1",
             "--samples_per_prompt", "8", "--prompts_per_step", "8", "--max_steps", "20", *TINY,
             "--eval_size", "100", "--output_dir", out)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_after"] > summary["eval_before"] + 0.2, summary


def test_the_lora_self_teacher_is_the_student_with_its_adapters_off(tmp_path, monkeypatch):
    """LoRA self-distillation with an empty context (the teacher reads the student's prompt) and a
    random reward mixed in: at step 1 the adapters are 0, student and teacher (the base) agree,
    kl 0; the reward moves the adapters, so at step 2 the student has left the base: kl > 0 (a
    teacher keeping the adapters would be the student itself: kl 0 again)."""
    pytest.importorskip("peft")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "demo": ""}
            for a in range(10, 40, 3) for b in range(20, 50, 7)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    run_main(monkeypatch, distill, "--data", data, "--teacher_context", "demo", "--lora_r", "4",
             "--rewards", "random=1", "--reward_coef", "1", "--samples_per_prompt", "4",
             "--lr", "1e-2", "--max_steps", "2", "--prompts_per_step", "8", *TINY,
             "--output_dir", tmp_path / "o")
    m = read_metrics(tmp_path / "o")
    assert abs(m[0]["kl"]) < 1e-6 and m[0]["grad_norm"] > 0 and m[1]["kl"] > 1e-3, m


def test_self_distillation_with_lora_on_a_data_file(tmp_path, monkeypatch):
    """No --teacher: the student's starting weights, here with LoRA the student with its adapters
    off, read each row's demonstration before the prompt; the adapters train and only they are
    saved (the teacher is never saved). At step 1 the KL is not 0: the teacher sees more."""
    pytest.importorskip("peft")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b), "demo": f"{b}+{a}={a + b}\n"}
            for a in range(10, 40, 3) for b in range(20, 50, 7)]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    run_main(monkeypatch, distill, "--data", data, "--teacher_context", "demo", "--lora_r", "4",
             "--max_steps", "2", "--prompts_per_step", "8", *TINY, "--output_dir", tmp_path / "o")
    m = read_metrics(tmp_path / "o")
    assert [x["step"] for x in m] == [1, 2] and m[0]["kl"] > 1e-3 and m[0]["grad_norm"] > 0
    saved = sorted(p.name for p in (tmp_path / "o" / "checkpoint").iterdir())
    assert "adapter_model.safetensors" in saved and "model.safetensors" not in saved, saved


def test_held_out_rg_rows_are_scored_by_their_own_generator(chat_model, tmp_path, monkeypatch):
    """--data rg:spell_backward: the held-out answers are scored by reasoning-gym's own scorer
    (the rg score, as grpo.py's), whatever --rewards trains on: 8 right answers score 8 of 8
    (the math reward gave them 0: a spelled word holds no number)."""
    pytest.importorskip("reasoning_gym")
    real = C.generate

    def generate(model, tok, rows, args, amp, env=None, greedy=False, sampler=None,
                 prefill=None):  # greedy: the held-out eval
        roll, texts = real(model, tok, rows, args, amp, env, greedy, sampler, prefill)
        return roll, [f"<answer>{r['answer']}</answer>" for r in rows] if greedy else texts
    monkeypatch.setattr(C, "generate", generate)
    run_main(monkeypatch, distill, "--model", chat_model, "--teacher", chat_model, "--data",
             "rg:spell_backward", "--rewards", "math=1", *TINY,
             "--eval_size", "8", "--max_steps", "1", "--max_new_tokens", "3",
             "--prompts_per_step", "4", "--output_dir", tmp_path / "o")
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert summary["eval_before"] == summary["eval_after"] == 1.0, summary


def test_a_pretrained_model_and_rg_take_their_defaults(tmp_path, monkeypatch, capsys):
    """--model a pretrained model: distill.py takes the RL scripts' REAL_MODEL defaults (lr 1e-5,
    T 0.7, 128 new tokens, not the 1 M adder's 1e-4 and 6), jsd's beta staying TRL's 1; --data
    rg:... its preset (one sample of 32 prompts, the rg reward); a flag given wins."""
    big = tmp_path / "big"
    big.mkdir()
    (big / "config.json").write_text(json.dumps(
        {"vocab_size": 49152, "hidden_size": 576, "num_hidden_layers": 30}))  # SmolLM2-135M

    def parse(*argv):
        monkeypatch.setattr(sys, "argv", ["distill.py", *map(str, argv)])
        return flags.parse_args(distill.Args, "distill", distill.__doc__)
    args = parse("--model", big)
    assert (args.lr, args.temperature, args.max_new_tokens, args.micro_batch_size,
            args.eval_size, args.beta) == (1e-5, 0.7, 128, 8, 128, 1.0)
    assert "--temperature 0.7" in capsys.readouterr().out
    args = parse("--model", big, "--data", "rg:spell_backward", "--lr", "3e-6")
    assert (args.samples_per_prompt, args.prompts_per_step, args.beta, args.rewards, args.lr,
            args.max_new_tokens) == (1, 32, 1.0, "rg=1", 3e-6, 24)
    args = parse("--model", loading.DEFAULT_POLICY)  # the bundled model: its own defaults
    assert (args.lr, args.max_new_tokens, args.temperature) == (1e-4, 6, 1.0)


def test_chat_sums_distills_by_the_forward_kl_and_a_given_loss_wins(monkeypatch):
    """--data chat-sums: distill.py takes --loss jsd --beta 0 (the forward KL: it keeps a GRPO
    teacher's score where opd's reverse KL slid, docs/distill.md); --loss opd or a --beta given
    wins; grpo.py's beta stays its own 0 (a KL weight, not jsd's)."""
    def parse(module, name, *argv):
        monkeypatch.setattr(sys, "argv", [f"{name}.py", "--data", "chat-sums", *argv])
        return flags.parse_args(module.Args, name, module.__doc__)
    args = parse(distill, "distill")
    assert (args.loss, args.beta, args.prompts_per_step, args.samples_per_prompt) == (
        "jsd", 0.0, 32, 1)
    assert parse(distill, "distill", "--loss", "opd").loss == "opd"
    assert parse(distill, "distill", "--beta", "1").beta == 1.0
    assert parse(grpo, "grpo").beta == 0.0


def test_a_run_whose_completions_are_cut_says_so_at_step_1(tmp_path, monkeypatch, capsys):
    """distill.py warns as the RL scripts do (runs.warn_if_stuck): one new token cuts every
    completion of the bundled task, said at step 1 with the value that fits, and logged."""
    run_main(monkeypatch, distill, "--teacher", loading.DEFAULT_POLICY, "--max_new_tokens", "1",
             "--max_steps", "1", "--prompts_per_step", "8", *TINY, "--output_dir", tmp_path / "o")
    assert "100% of completions were cut by --max_new_tokens 1" in capsys.readouterr().out
    assert "truncated" in read_metrics(tmp_path / "o")[0]["warning"].split(",")


def test_distill_is_listed_with_the_scripts():
    """The README's table of scripts and its budget table name distill.py."""
    readme = open(f"{ROOT}/README.md", encoding="utf-8").read()
    assert "| `distill.py` |" in readme
