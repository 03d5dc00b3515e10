"""grpo.py's objectives against TRL 1.16's own code, run on the same random tensors.

TRL's GRPOTrainer._compute_loss is called as an unbound method on a stand-in for the trainer that
holds only the settings it reads (its forward returns our log-probs, so its autograd reaches them);
its GDPO aggregation is a block inside _generate_and_score_completions, which this file cuts out of
TRL's source and runs as it is. Each case draws a random batch and random settings, and compares
the step's loss and its gradient with respect to the log-probs (float64; they agree to ~1e-15).
.ci/run installs the pinned trl==1.16.0; without TRL these tests skip."""
import functools
import math
import inspect
import textwrap
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

import common as C
import grpo
import objectives
import reinforce
from tests.helpers import grpo_loss

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer", reason="TRL is not installed")
TRL = trl_grpo.GRPOTrainer
CASES = 40  # random configurations per objective


def random_batch(g):
    """Random log-probs (pi_theta, pi_old, pi_ref, pi_sampler), advantages and a mask from lengths
    (every row at least one token), B in 2..8, T in 1..7."""
    B, T = int(torch.randint(2, 9, (1,), generator=g)), int(torch.randint(1, 8, (1,), generator=g))
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3
    spread = float(torch.rand(1, generator=g)) * 0.6
    lp = (old + torch.randn(B, T, generator=g, dtype=torch.float64) * spread).requires_grad_()
    ref = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    sample = old + torch.randn(B, T, generator=g, dtype=torch.float64) * 0.3
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None] < lengths[:, None]).double()
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    adv[torch.rand(B, generator=g) < 0.2] = 0.0  # some, as from a group of equal rewards
    return lp, old, ref, sample * mask, adv, mask


def trl_loss(lp, old, ref, sample, adv, mask, loss_type, level="token", beta=0.0, threshold=None,
             bias_kl=False, is_ratio=None, eps=(0.2, 0.2)):
    """TRL 1.16's _compute_loss on these tensors: one process, no gradient accumulation, the
    batch's tokens as DAPO's normaliser."""
    B, T = lp.shape
    args = SimpleNamespace(use_bias_correction_kl=bias_kl, delta=None, sapo_temperature_pos=1.0,
                           sapo_temperature_neg=1.05, vespo_k_pos=2.0, vespo_lambda_pos=3.0,
                           vespo_k_neg=3.0, vespo_lambda_neg=2.0, steps_per_generation=1)
    one = SimpleNamespace(num_processes=1, reduce=lambda x, reduction: x, gather=lambda x: x,
                          gather_for_metrics=lambda x: x)
    trainer = SimpleNamespace(
        args=args, beta=beta, loss_type=loss_type, importance_sampling_level=level,
        epsilon_low=eps[0], epsilon_high=eps[1], off_policy_mask_threshold=threshold,
        top_entropy_quantile=1.0, aux_loss_enabled=False, use_vllm=False,
        vllm_importance_sampling_correction=False, _entropy_bonus_enabled=False,
        current_gradient_accumulation_steps=1, accelerator=one,
        model=SimpleNamespace(training=True),
        _metrics=defaultdict(lambda: defaultdict(list)), max_completion_length=T,
        get_off_policy_mask=TRL.get_off_policy_mask, get_gamma_weights=TRL.get_gamma_weights,
        _get_per_token_logps_and_entropies=lambda *a, **k: (lp, torch.zeros_like(lp), None))
    inputs = {"prompt_ids": torch.zeros(B, 1, dtype=torch.long), "prompt_mask": torch.ones(B, 1),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": mask,
              "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "sampling_per_token_logps": sample, "num_items_in_batch": mask.sum()}
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    return TRL._compute_loss(trainer, None, inputs)


def minrl_loss(lp, old, ref, sample, adv, mask, loss_agg, is_weight=1.0, **switches):
    args = grpo.Args(**switches)
    loss, logs = grpo_loss(lp, old, adv, mask, args, ref if args.beta else None, is_weight,
                           sample)
    return grpo.aggregate(loss, mask, loss_agg, mask.sum(), len(lp), lp.shape[1]), logs


def assert_same(want, got, lp):
    (g_want,) = torch.autograd.grad(want, lp, retain_graph=True)
    (g_got,) = torch.autograd.grad(got, lp, retain_graph=True)
    assert abs(float(want.detach() - got.detach())) < 1e-6
    assert float((g_want - g_got).abs().max()) < 1e-6


def test_deepseek_v32_off_policy_mask_and_unbiased_kl_equal_trls():
    """--off_policy_mask (TRL off_policy_mask_threshold) and --unbiased_kl (use_bias_correction_kl)
    under the clip, token or sequence ratio (GSPO), with and without a KL term."""
    g = torch.Generator().manual_seed(0)
    dropped = 0
    for case in range(CASES):
        lp, old, ref, sample, adv, mask = random_batch(g)
        delta = float(torch.rand(1, generator=g)) * 0.3 if case % 5 else 0.0  # 0: TRL's 0, on
        beta = [0.0, 0.04, 0.5][case % 3]
        level = "sequence" if case % 4 == 3 else "token"
        agg = "seq-mean-token-mean" if level == "sequence" else "token-mean"  # TRL grpo, dapo
        eps = (3e-4, 4e-4) if level == "sequence" else (0.2, 0.2)  # our seq_clip_eps* defaults
        want = trl_loss(lp, old, ref, sample, adv, mask, "grpo" if level == "sequence" else "dapo",
                        level, beta, delta, bias_kl=case % 2 == 0, eps=eps)
        got, logs = minrl_loss(lp, old, ref, sample, adv, mask, agg, beta=beta,
                               off_policy_mask=delta, unbiased_kl=case % 2 == 0,
                               importance_sampling_level=level, kl_estimator="k3")
        assert_same(want, got, lp)
        dropped += int(logs["seq_masked"][:, 0].sum())
    assert dropped > 10  # the mask acted


def test_luspo_and_vespo_equal_trls():
    """LUSPO = --importance_sampling_level sequence --loss_agg seq-sum (TRL loss_type luspo);
    VESPO = --policy_loss vespo (loss_type vespo), with and without a sampler weight (TRL's
    importance_sampling_ratio: ours from mismatch_weights, token truncate or mask)."""
    g = torch.Generator().manual_seed(1)
    for case in range(CASES):
        lp, old, ref, sample, adv, mask = random_batch(g)
        beta = [0.0, 0.04][case % 2]
        eps = (float(torch.rand(1, generator=g)) * 0.01, float(torch.rand(1, generator=g)) * 0.01)
        want = trl_loss(lp, old, ref, sample, adv, mask, "luspo", "sequence", beta, eps=eps)
        got, _ = minrl_loss(lp, old, ref, sample, adv, mask, "seq-sum", beta=beta,
                            importance_sampling_level="sequence", seq_clip_eps=eps[0],
                            seq_clip_eps_high=eps[1])
        assert_same(want, got, lp)
        w = 1.0
        if case % 3:  # a mismatch weight, capped (TIS) or masked (MIS) at 1.2
            mode = ["truncate", "mask"][case % 3 - 1]
            w, _ = objectives.mismatch_weights(old, sample, mask, 1.2, mode)
        want = trl_loss(lp, old, ref, sample, adv, mask, "vespo", beta=beta,
                        is_ratio=None if case % 3 == 0 else w)
        got, logs = minrl_loss(lp, old, ref, sample, adv, mask, "token-mean", w, beta=beta,
                               policy_loss="vespo")
        assert_same(want, got, lp)


@pytest.mark.parametrize("kind", ["clip", "cispo", "sapo"])
def test_the_earlier_objectives_still_equal_trls(kind):
    """clip / GSPO, CISPO and SAPO (landed before; TRL's dapo, grpo, cispo and sapo)."""
    g = torch.Generator().manual_seed(2)
    for case in range(CASES // 4):
        lp, old, ref, sample, adv, mask = random_batch(g)
        beta = [0.0, 0.04][case % 2]
        if kind == "cispo":  # TRL caps rho at epsilon_high itself, no lower bound: ours 1 + eps
            want = trl_loss(lp, old, ref, sample, adv, mask, "cispo", beta=beta, eps=(0.2, 1.3))
            got, _ = minrl_loss(lp, old, ref, sample, adv, mask, "token-mean", beta=beta,
                                policy_loss="cispo", clip_eps=1e9, clip_eps_high=0.3)
        else:  # sapo: TRL averages per sequence
            agg = "seq-mean-token-mean" if kind == "sapo" else "token-mean"
            want = trl_loss(lp, old, ref, sample, adv, mask, "sapo" if kind == "sapo" else "dapo",
                            beta=beta)
            got, _ = minrl_loss(lp, old, ref, sample, adv, mask, agg, beta=beta, policy_loss=kind)
        assert_same(want, got, lp)


@functools.cache
def trl_gdpo_block():
    """TRL's GDPO block, cut from GRPOTrainer._generate_and_score_completions, compiled."""
    source = textwrap.dedent(inspect.getsource(TRL._generate_and_score_completions))
    start = source.index('elif self.multi_objective_aggregation == "normalize_then_sum":')
    indent = start - source.rindex("\n", 0, start) - 1  # the elif's, and its else's
    block = source[start:source.index("\n" + " " * indent + "else:", start)].split("\n", 1)[1]
    return compile(textwrap.dedent(block), "trl_gdpo_block", "exec")


def trl_normalize_then_sum(rewards_per_func, weights, num_generations):
    """TRL's GDPO block run as it is on these rewards (G = num_generations)."""
    scope = {"rewards_per_func": rewards_per_func, "num_generations": num_generations,
             "unscorable_mask": torch.zeros(len(rewards_per_func), dtype=torch.bool),
             "device": "cpu", "torch": torch, "nanstd": trl_grpo.nanstd,
             "self": SimpleNamespace(reward_funcs=weights, reward_weights=torch.tensor(weights))}
    exec(trl_gdpo_block(), scope)
    return scope["advantages"]


def test_gdpo_normalize_then_sum_equals_trls_in_grpo_and_reinforce():
    """objectives.normalize_then_sum (--multi_objective_aggregation normalize_then_sum in grpo.py
    and reinforce.py) against TRL's block, with groups whose parts are all equal (std 0) among
    them."""
    g = torch.Generator().manual_seed(3)
    for case in range(CASES):
        G, K = [2, 4, 8][case % 3], 1 + case % 3  # group size, rewards
        groups = int(torch.randint(1, 5, (1,), generator=g))
        parts = torch.randint(0, 3, (G * groups, K), generator=g).float()  # ties and std-0 groups
        parts[:, 0] += torch.rand(G * groups, generator=g) * (case % 2)
        weights = (torch.rand(K, generator=g) * 2).tolist()
        if G * groups == 2 and case % 2 == 0:
            continue  # two equal-by-construction rows: TRL's batch std is 0 and so is ours
        want = trl_normalize_then_sum(parts, weights, G)
        named = {f"r{j}": parts[:, j] for j in range(K)}
        got = objectives.normalize_then_sum(named, dict(zip(named, weights)), G)
        assert float((want - got).abs().max()) < 1e-5 * max(1.0, float(want.abs().max()))
    # one sample per prompt: TRL's per-reward std is 0, so is every advantage (ours was NaN)
    parts = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    got = objectives.normalize_then_sum({"a": parts[:, 0], "b": parts[:, 1]},
                                        {"a": 1.0, "b": 0.5}, 1)
    assert torch.equal(got, trl_normalize_then_sum(parts, [1.0, 0.5], 1))
    # reinforce.py's GDPO is the same function on the same parts (one copy, in objectives.py)
    assert reinforce.O.normalize_then_sum is grpo.O.normalize_then_sum


def test_vespo_clamps_equal_trls_where_they_act():
    """VESPO's three clamps (each token's log ratio to [-20, 20], each token's log mismatch weight
    and the sequence's log w to [log 1e-8, 20]), on rows built so that each clamp alone decides
    phi: a bound moved or dropped changes phi by a factor, not by rounding (but log w's upper
    bound: phi is 0 past log w ~ 5 either way; it guards exp's overflow). phi compared with
    TRL's get_gamma_weights to 1e-9 relative, and the loss and gradient with _compute_loss."""
    T, L = 3, math.log(1e-8)
    log_ratio = torch.tensor([[25.0, -24.5, 0.0],   # token clamp above: 20 - 20 = 0 (not 0.5)
                              [-25.0, 24.5, 0.0],   # token clamp below: -20 + 20 = 0 (not -0.5)
                              [9.0, 8.0, 7.0],      # sequence clamp above: 20, phi 0 (overflow)
                              [-9.0, -8.0, -7.0],   # sequence clamp below: log 1e-8 (not -24)
                              [0.0, 0.0, 0.0],      # the weight's clamp below: -18.42 + 18
                              [0.0, 0.0, 0.0]], dtype=torch.float64)  # its clamp above: -18 + 20
    log_is = torch.zeros(6, T, dtype=torch.float64)
    log_is[4, :2] = torch.tensor([-23.42, 18.0])
    log_is[5, :2] = torch.tensor([-18.0, 20.5])
    old = -torch.rand(6, T, generator=torch.Generator().manual_seed(0), dtype=torch.float64) - 1
    lp = (old + log_ratio).requires_grad_()
    sample, mask = old - log_is, torch.ones(6, T, dtype=torch.float64)  # pi_old / pi_sampler
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0], dtype=torch.float64)
    w = log_is.exp()
    want_phi = TRL.get_gamma_weights(adv[:, None], log_ratio, mask, w)
    got, logs = minrl_loss(lp, old, None, sample, adv, mask, "token-mean", w, beta=0.0,
                           policy_loss="vespo")
    torch.testing.assert_close(logs["vespo_phi"][:, :1].double(), want_phi, rtol=1e-9, atol=0)
    assert want_phi[0, 0] == want_phi[1, 0] == 1.0 and want_phi[2, 0] == 0  # phi(1) = 1
    assert (want_phi[3:] > 0).all()  # tiny (7e-24 at log 1e-8) but not rounded away: rtol holds
    want = trl_loss(lp, old, lp.detach(), sample, adv, mask, "vespo", is_ratio=w)
    assert_same(want, got, lp)
