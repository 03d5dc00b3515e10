"""minrl's algorithm tests: each estimator, advantage, loss and log-prob against a plain reference.

The maths a reader checks, in the order of a step: the completion mask, token log-probs against
one plain forward (the fast paths too), the KL estimators against the exact KL, then grpo.py,
reinforce.py and ppo.py, and the losses of sft.py, reward_model.py and dpo.py, on tiny random
models of real architectures. The quick subset: python -m pytest -q test_algos.py. Everything
else (data, sampling, the scripts end to end, bad input, reliability, torchrun, docs) is in tests/,
a file a module; python -m pytest -q runs both."""
import math
import sys
from types import SimpleNamespace

import pytest
import torch

import common as C
from plumbing.errors import UserError
import fastpath
import dpo
from plumbing.flags import parse_args
import grpo
import objectives
from plumbing import loading
import ppo
import reinforce as R
import reward_model
from plumbing import runs
import sft
from plumbing import tasks

from tests.helpers import ARCHS, OFF, PROMPTS, fast_logprobs, grpo_loss, tiny_model, tiny_rm


# ---- common.py: the completion mask (EOS kept, pad = EOS)
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


# ---- common.py and fastpath.py: log-probs against a plain forward
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


# ---- common.py: KL estimators against the exact KL
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


# ---- grpo.py: group advantages, the loss, aggregation, clipping, KL
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
            loss = grpo_loss(lp, old[s], adv[s], None, grpo.Args())[0]
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
    loss, logs = grpo_loss(logprobs, torch.zeros(8, 1), adv, None,
                           grpo.Args(clip_eps_high=0.28))
    loss.sum().backward()
    # A > 0: clipped above 1 + eps_high (1.5); A < 0: clipped below 1 - eps (0.5).
    # Elsewhere grad = -A * ratio.
    expect_zero = torch.tensor([False, False, False, True, True, False, False, False])
    assert torch.equal(logprobs.grad[:, 0] == 0, expect_zero)
    assert torch.equal(logs["clip_frac"][:, 0].bool(), expect_zero)
    torch.testing.assert_close(logprobs.grad[~expect_zero, 0], -(adv * ratio)[~expect_zero])


def test_ratio_is_one_and_kl_zero_at_first_inner_step(tok):
    model, ref = tiny_model("qwen2", seed=4), tiny_model("qwen2", seed=4)
    roll = C.sample(model, tok, C.encode_prompts(tok, PROMPTS), 6)
    T = roll.completion_mask.shape[1]
    lp, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T)
    ref_lp = C.batched_logprobs(ref, roll, 1.0, 2, OFF)
    adv = torch.ones(len(lp))
    _, logs = grpo_loss(lp, lp.detach(), adv, None, grpo.Args(), ref_lp)
    ratio, kl = logs["ratio"], logs["kl"]
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
    loss, _ = grpo_loss(logp[:, None], logp.detach()[:, None], zero, None,
                        grpo.Args(beta=1.0, kl_estimator=estimator), ref_logp[:, None])
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
    with pytest.raises(UserError, match="zero expected gradient"):
        grpo.check_args(parse_args(grpo.Args, "grpo"))
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--kl_estimator", "k1", "--beta", "0"])
    grpo.check_args(parse_args(grpo.Args, "grpo"))  # no KL term: nothing to refuse


# ---- grpo.py: policy losses since DAPO
def reinforce_step_loss(logprobs, adv, mask, n_seqs, n_tokens, loss_agg="seq-sum", old=None,
                        clip_eps=0.2, is_weight=1.0):
    """A micro-batch's loss as reinforce.py's loop forms it from reinforce_loss: the per-token
    terms summed over the completion, over the step's N (sequences, or tokens)."""
    loss, ratio, clipped = R.reinforce_loss(logprobs, adv, old, clip_eps, is_weight)
    return (loss * mask).sum() / (n_seqs if loss_agg == "seq-sum" else n_tokens), ratio, clipped


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
    loss, logs = grpo_loss(lp, old, adv, mask, grpo.Args(
        clip_eps=eps[0], clip_eps_high=eps[1], seq_clip_eps=eps[0], seq_clip_eps_high=eps[1],
        importance_sampling_level=level, policy_loss=kind))
    (grad,) = torch.autograd.grad((loss * mask).sum(), lp)
    want = slow_policy_loss(lp, old, adv, mask, eps, level, kind)
    (want_grad,) = torch.autograd.grad((want * mask).sum(), lp)
    torch.testing.assert_close(loss * mask, want * mask, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    if kind != "sapo":
        clipped = logs["clip_frac"] * mask
        assert 0 < float(clipped.sum()) < float(mask.sum())  # the test reaches the clip


def test_gspo_ratio_is_one_number_per_sequence_and_its_gradient_the_papers():
    lp, old, adv, mask = random_step(spread=0.01)
    loss, logs = grpo_loss(lp, old, adv, mask, grpo.Args(
        seq_clip_eps=1.0, seq_clip_eps_high=1.0, importance_sampling_level="sequence"))
    for i in range(len(lp)):
        n = int(mask[i].sum())
        s = math.exp(float(((lp.detach() - old)[i, :n]).sum()) / n)
        assert torch.allclose(logs["ratio"][i, :n], torch.full((n,), s), atol=1e-6)  # one number
    # GSPO (eq. 10): grad J = 1/G sum_i s_i A_i 1/|o_i| sum_t grad log pi_theta(o_i,t); with the
    # eps this wide nothing is clipped, and seq-mean-token-mean is GSPO's own 1/G sum_i
    agg = grpo.aggregate(loss, mask, "seq-mean-token-mean", mask.sum(), len(lp), 5)
    (grad,) = torch.autograd.grad(agg, lp)
    s = logs["ratio"][:, 0].detach()
    want = -(s * adv / mask.sum(-1))[:, None] * mask / len(lp)
    torch.testing.assert_close(grad, want, atol=1e-7, rtol=1e-5)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    lp, old, adv, mask = random_step(spread=1.0)  # ratios far outside [0.8, 1.2]
    cispo, logs = grpo_loss(lp, old, adv, None, grpo.Args(policy_loss="cispo"))
    (g_cispo,) = torch.autograd.grad((cispo * mask).sum(), lp)
    clip, drop = grpo_loss(lp, old, adv, None, grpo.Args())
    (g_clip,) = torch.autograd.grad((clip * mask).sum(), lp)
    dropped = (drop["clip_frac"] * mask).bool()
    assert dropped.sum() >= 3
    assert (g_clip[dropped] == 0).all()  # PPO's clip: no gradient at all
    w = torch.exp(lp - old).clamp(0.8, 1.2).detach()  # CISPO: the clipped weight, -w A
    torch.testing.assert_close(g_cispo[dropped], (-w * adv[:, None])[dropped])
    assert (g_cispo[dropped].abs() > 0).all()
    assert (logs["clip_frac"] * mask).sum() >= dropped.sum()


@pytest.mark.parametrize("kind", ["clip", "cispo", "sapo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_mu_one_gives_ratio_one_and_the_plain_policy_gradient(kind, level):
    lp, _, adv, mask = random_step()
    loss, logs = grpo_loss(lp, lp.detach(), adv, mask, grpo.Args(
        clip_eps=3e-4, clip_eps_high=4e-4, importance_sampling_level=level, policy_loss=kind))
    assert (logs["ratio"] == 1).all()
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
    w, raw = objectives.mismatch_weights(old, sample, mask, 1.5, mode, level)
    torch.testing.assert_close(w, slow_mismatch_weight(old, sample, mask, 1.5, mode, level))
    assert (w <= 1.5).all() and (raw * mask).max() > 1.5  # the cap is reached
    torch.testing.assert_close(raw, torch.exp((old - sample) * mask))
    assert objectives.mismatch_weights(old, sample, mask)[0] == 1.0  # cap 0: off
    # the weight multiplies the policy part, not the KL term (as TRL applies it)
    ref = old - 0.1
    got, *_ = grpo_loss(lp, old, adv, None, grpo.Args(), ref, is_weight=w)
    policy, *_ = grpo_loss(lp, old, adv, None, grpo.Args())
    torch.testing.assert_close(got, policy * w + 0.04 * C.kl_estimate(lp, ref, "k3"))
    # no mismatch and an infinite cap: the weight is 1 and the loss exactly the uncorrected one
    w, _ = objectives.mismatch_weights(old, old.clone(), mask, math.inf, mode, level)
    plain, *_ = grpo_loss(lp, old, adv, None, grpo.Args())
    weighted, *_ = grpo_loss(lp, old, adv, None, grpo.Args(), is_weight=w)
    assert (w == 1).all() and torch.equal(weighted, plain)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_reinforce_mismatch_correction_is_grpos(mode, level):
    lp, old, adv, mask = random_step()
    sample = old + torch.randn(old.shape, generator=torch.Generator().manual_seed(1)) * 0.5
    assert R.O.mismatch_weights is objectives.mismatch_weights  # one function, not a copy
    w, raw = objectives.mismatch_weights(old, sample, mask, 1.5, mode, level)
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
    _, raw = objectives.mismatch_weights(lp, roll.sample_logprobs, roll.completion_mask)
    # 1 up to float rounding (1e-6 on one CPU, exactly 1 on another: either may hold), and
    # exactly 1 outside the completion, where the mask zeroes log pi_old - log pi_sampler
    assert float((raw - 1).abs().max()) < 1e-4
    assert bool((raw[roll.completion_mask == 0] == 1).all())
    # top_p 0.8: the sampler's log-prob is over the kept tokens, renormalised, the trainer's over
    # all: the raw ratio is each step's kept mass, which a plain forward recomputes
    roll = C.sample(model, tok, prompts, 8, temperature=0.7, top_p=0.8)
    lp = C.batched_logprobs(model, roll, 0.7, 8, OFF)
    _, raw = objectives.mismatch_weights(lp, roll.sample_logprobs, roll.completion_mask)
    for i, p in enumerate(prompts):
        n = int(roll.completion_mask[i].sum())
        ids = torch.tensor([p + roll.ids[i, roll.P:roll.P + n].tolist()])
        probs = (model(ids).logits[0, len(p) - 1:-1].float() / 0.7).softmax(-1)
        sorted_p = probs.sort(-1, descending=True).values
        kept = (sorted_p * (sorted_p.cumsum(-1) - sorted_p < 0.8)).sum(-1)
        torch.testing.assert_close(raw[i, :n], kept, atol=1e-4, rtol=1e-4)
    assert float(raw.min()) < 0.95


# ---- grpo.py and reinforce.py: the 2026 objectives (TRL's own code: tests/test_trl_losses.py)
def slow_dppo_loss(lp, sample, adv, mask, delta, kappa):
    """DPPO binary-TV (arXiv 2602.04879) plus the squared log-ratio to the sampler (Kimi K2.5,
    prime-rl), one token at a time: no policy gradient where pi_theta moved past delta from
    pi_sampler in the advantage's direction, -(pi_theta / pi_sampler) A elsewhere."""
    out = torch.zeros(lp.shape, dtype=lp.dtype)
    out = [[out[i, t] for t in range(lp.shape[1])] for i in range(len(lp))]
    for i in range(len(lp)):
        a = float(adv[i])
        for t in range(lp.shape[1]):
            p, q = torch.exp(lp[i, t]), math.exp(float(sample[i, t]))  # pi_theta, pi_sampler
            moved = float(p.detach()) - q
            too_far = a > 0 and moved > delta[1] or a < 0 and moved < -delta[0]
            policy = 0 * p if too_far else -(p / q) * a
            out[i][t] = policy + kappa * (lp[i, t] - float(sample[i, t])) ** 2
    return torch.stack([torch.stack(row) for row in out]) * mask


@pytest.mark.parametrize("delta", [(0.2, 0.2), (0.05, 0.3), (0.3, 0.05)])
def test_dppo_and_the_sampler_penalty_match_the_papers_token_by_token(delta):
    g = torch.Generator().manual_seed(5)
    lp = (-torch.rand(40, 6, generator=g) * 2).requires_grad_()
    adv, mask = torch.randn(40, generator=g), random_mask(40, 6)
    sample = (lp.detach() + torch.randn(lp.shape, generator=g) * 0.8).clamp(max=0) * mask
    args = grpo.Args(policy_loss="dppo", clip_eps=delta[0], clip_eps_high=delta[1],
                     sampler_kl_coef=1e-3, beta=0.0)
    loss, logs = grpo_loss(lp, lp.detach(), adv, mask, args, None, 1.0, sample)
    want = slow_dppo_loss(lp, sample, adv, mask, delta, 1e-3)
    (grad,) = torch.autograd.grad((loss * mask).sum(), lp)
    (want_grad,) = torch.autograd.grad(want.sum(), lp)
    torch.testing.assert_close(loss * mask, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(grad, want_grad, atol=1e-6, rtol=1e-5)
    masked = (logs["clip_frac"] * mask).bool()
    assert 0 < int(masked.sum()) < int(mask.sum())  # the mask acts, not everywhere
    # a masked token keeps only the penalty's gradient, 2 kappa log(pi_theta / pi_sampler)
    torch.testing.assert_close(grad[masked], (2e-3 * (lp.detach() - sample))[masked])
    torch.testing.assert_close(logs["sampler_kl"] * mask, (lp.detach() - sample) ** 2 * mask)
    # no mismatch (pi_theta = pi_sampler): nothing masked, the plain policy gradient -A grad log pi
    loss, logs = grpo_loss(lp, lp.detach(), adv, mask, args, None, 1.0, lp.detach())
    (grad,) = torch.autograd.grad((loss * mask).sum(), lp)
    torch.testing.assert_close(grad, -adv[:, None] * mask)
    assert (logs["clip_frac"] == 0).all()


def test_refusals_of_the_2026_switches(monkeypatch):
    for flags, match in [(["--policy_loss", "dppo", "--importance_sampling_level", "sequence"],
                          "dppo forms its own ratio"),
                         (["--policy_loss", "vespo", "--importance_sampling_level", "sequence"],
                          "vespo forms its own ratio"),
                         (["--multi_objective_aggregation", "normalize_then_sum",
                           "--overlong_penalty", "1"], "not one of the --rewards")]:
        monkeypatch.setattr(sys, "argv", ["grpo.py"] + flags)
        with pytest.raises(UserError, match=match):
            grpo.check_args(parse_args(grpo.Args, "grpo"))


def test_maxrl_advantages_average_the_successes_gradients_in_grpo_and_reinforce():
    """MaxRL (arXiv 2602.02710): A = (r - mean) / (mean + eps). With 0/1 rewards, K successes of
    N, (1/N) sum_i A_i g_i = (mean of the successes' g) - (mean of all g), up to eps; a group with
    no success gives A = 0."""
    rewards = torch.tensor([1.0, 0, 0, 1, 0, 0, 0, 0, 1, 1, 1, 0, 0, 1, 0, 0])
    adv = grpo.group_advantages(rewards, 4, "mean")
    g = torch.randn(16, 3, generator=torch.Generator().manual_seed(0))  # each sample's gradient
    for j in range(4):
        r, a, x = rewards[4 * j:4 * j + 4], adv[4 * j:4 * j + 4], g[4 * j:4 * j + 4]
        if r.sum() == 0:
            assert (a == 0).all()
            continue
        want = x[r == 1].mean(0) - x.mean(0)
        torch.testing.assert_close((a[:, None] * x).mean(0), want, atol=1e-3, rtol=1e-3)
    mask = random_mask(16, 5)  # reinforce.py's --baseline maxrl, beta 0: the same per token
    got = R.advantages(R.kl_returns(rewards, mask), mask, baseline_args("maxrl", 4))
    torch.testing.assert_close(got, adv[:, None] * mask)


def test_luspo_weighs_each_sequences_loss_by_its_length():
    """--loss_agg seq-sum (LUSPO, arXiv 2602.05261): (1/G) sum_i |o_i| L_i for GSPO's one loss per
    sequence L_i, where seq-mean-token-mean (GSPO's) gives every sequence the same weight."""
    lp, old, adv, mask = random_step(spread=0.01)
    loss, _ = grpo_loss(lp, old, adv, mask, grpo.Args(
        importance_sampling_level="sequence", beta=0.0))
    per_seq = loss[:, 0]  # one value per sequence
    got = grpo.aggregate(loss, mask, "seq-sum", mask.sum(), len(lp), 5)
    torch.testing.assert_close(got, (per_seq * mask.sum(-1)).mean())
    gspo = grpo.aggregate(loss, mask, "seq-mean-token-mean", mask.sum(), len(lp), 5)
    torch.testing.assert_close(gspo, per_seq.mean())


def test_gdpo_normalises_each_reward_first_and_keeps_mixes_apart():
    """normalize_then_sum against a loop over the groups; and GDPO's point (arXiv 2601.05242):
    two groups whose summed rewards are [1, 0] and [2, 0] (one reward won, or both) get the same
    GRPO advantages, while GDPO gives the double winner twice the advantage."""
    parts = {"a": torch.tensor([1.0, 0, 1, 0, 3, 1, 2, 2]), "b": torch.tensor([0.0, 0, 1, 0, 0,
                                                                                  5, 1, 1])}
    weights = {"a": 1.0, "b": 0.5}
    total = []
    for i in range(8):
        group = slice(i // 2 * 2, i // 2 * 2 + 2)
        total.append(sum(w * float((parts[k][i] - parts[k][group].mean())
                                   / (parts[k][group].std() + 1e-4)) for k, w in weights.items()))
    total = torch.tensor(total)
    want = (total - total.mean()) / (total.std() + 1e-4)
    torch.testing.assert_close(objectives.normalize_then_sum(parts, weights, 2), want)
    two = {"a": torch.tensor([1.0, 0, 1, 0]), "b": torch.tensor([0.0, 0, 1, 0])}
    summed = grpo.group_advantages(two["a"] + two["b"], 2)
    assert torch.allclose(summed[:2], summed[2:], atol=1e-3)  # summed first: they collapse
    gdpo = objectives.normalize_then_sum(two, {"a": 1.0, "b": 1.0}, 2)
    torch.testing.assert_close(gdpo[2], 2 * gdpo[0], rtol=1e-3, atol=1e-4)


# ---- reinforce.py: pure functions
def baseline_args(baseline, k, whiten=False):
    """reinforce.advantages' switches: the baseline, k samples per prompt, whitening after it."""
    return R.Args(baseline=baseline, samples_per_prompt=k, whiten=whiten)


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
    with pytest.raises(UserError, match="samples_per_prompt >= 2"):
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
    with pytest.raises(UserError, match="from --kl_coef 0 it would stay 0"):
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
    keep = runs.Keeper(SimpleNamespace(nonfinite=0, nonfinite_in_row=0, world=1, rank=0), opt,
                       None, None, None)
    stats = ppo.ppo_update(model, ppo.ValueModel(critic), opt, keep, roll, batch, args, OFF)
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
        keep = runs.Keeper(SimpleNamespace(nonfinite=0, nonfinite_in_row=0, world=1, rank=0),
                           opt, None, None, None)
        ppo.ppo_update(model, ppo.ValueModel(critic), opt, keep, roll, batch, args, OFF)
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
    keep = runs.Keeper(SimpleNamespace(nonfinite=0, nonfinite_in_row=0, world=1, rank=0), opt,
                       None, None, None)
    ppo.ppo_update(model, ppo.ValueModel(critic), opt, keep, roll, batch, args, OFF)
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
    with pytest.raises(UserError, match="different tokenizer"):
        ppo.load_critic(args, tok, torch.device("cpu"))


# ---- sft.py, reward_model.py, dpo.py: the losses
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
    args = dpo.Args(beta=beta, loss_type=loss_type, label_smoothing=eps)
    loss, r_chosen, r_rejected = dpo.dpo_loss(lc, lr_, rc, rr, args)
    assert float((weight * loss).sum()) == pytest.approx(slow, rel=1e-5)
    torch.testing.assert_close(r_chosen, beta * (lc - rc))
    torch.testing.assert_close(r_rejected, beta * (lr_ - rr))
    # policy = reference: h = 0, so DPO's loss is log 2 (IPO's 1 / (4 beta^2)) for every pair
    start, _, _ = dpo.dpo_loss(lc, lr_, lc, lr_, args)
    assert float(start.mean()) == pytest.approx(math.log(2) if loss_type == "sigmoid"
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
