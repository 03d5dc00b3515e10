"""grader.py: compares a student's function with the project's own (the solution) on random and
edge-case inputs, and says in one line WHAT is wrong.

grade(name, fn) -> None when fn agrees with the project's function on every case, else one line.
Each function has cases (random ones first, then edges: all-equal groups, padding, one-token
completions, negative rewards) and diagnoses: a known mistake, the output it would give, and the
message naming it. The first case where fn disagrees decides: if fn's output equals a diagnosis's,
that diagnosis's message is the answer; else the line gives the case and the largest gap.
tests/test_labs.py plants each mistake and checks its message.
"""
import os
import sys
from types import SimpleNamespace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
import distill  # noqa: E402
import dpo  # noqa: E402
import grpo  # noqa: E402
import ppo  # noqa: E402
import reinforce  # noqa: E402


def same(a, b, tol=1e-5):
    """Equal shapes and values within tol (nan where both are nan)."""
    return a.shape == b.shape and torch.allclose(a.double(), b.double(), atol=tol, rtol=tol,
                                                 equal_nan=True)


def first(x):
    """A function's main output: the first of a tuple, else itself."""
    return x[0] if isinstance(x, tuple) else x


def compare(fn, reference, cases, diagnoses=(), nan=None, out=first):
    """cases: [(what the case is, args tuple)]; diagnoses: [(message, mistaken(*args))], each
    mistaken function returning what that mistake gives; nan: the message when fn gives nan where
    the project's function does not; out picks the output to compare."""
    for what, args in cases:
        expected = out(reference(*args))
        try:
            got = fn(*args)
        except NotImplementedError as e:  # the stub's Todo
            return f"not written yet ({e})"
        except Exception as e:  # noqa: BLE001  (the student's error, said in one line)
            return f"raised {type(e).__name__}: {str(e).splitlines()[0][:120]} ({what})"
        try:
            got = out(got)
        except (AttributeError, IndexError, KeyError, TypeError):
            got = None  # not the project's kind of result
        if not isinstance(got, torch.Tensor):
            return f"returned {type(got).__name__}, not what the project's returns ({what})"
        if same(got, expected):
            continue
        if got.shape == expected.shape and torch.isnan(got).any() \
                and not torch.isnan(expected).any():
            return nan or f"nan where the project's is finite ({what})"
        for message, wrong in diagnoses:
            if same(got, out(attempt(wrong, args))):
                return message
        if got.shape != expected.shape:
            return f"shape {tuple(got.shape)}, expected {tuple(expected.shape)} ({what})"
        gap = (got.double() - expected.double()).abs().nan_to_num(float("inf"))
        at = tuple(int(i) for i in torch.unravel_index(gap.argmax(), gap.shape))
        return (f"differs from the project's ({what}): at {at} got {float(got[at]):.4g}, "
                f"expected {float(expected[at]):.4g}")
    return None


def attempt(wrong, args):
    """What a mistake gives on these args; a NaN placeholder where it does not apply (fails)."""
    try:
        return wrong(*args)
    except Exception:  # noqa: BLE001
        return torch.full((1, 1, 1, 1, 1), torch.nan)


def right_padded(B, T, lengths=None, seed=0):
    """A completion mask (B, T): each row's first L_i tokens are 1, then padding 0."""
    g = torch.Generator().manual_seed(seed)
    lengths = lengths or torch.randint(1, T + 1, (B,), generator=g).tolist()
    return (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).float()


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


# ----------------------------------------------------------------------------- lab 1: REINFORCE
def tiny_model(vocab=11):
    """A 2-layer random Llama, small enough to build in a blink."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, intermediate_size=32, max_position_embeddings=32,
                      pad_token_id=0, eos_token_id=1)
    return LlamaForCausalLM(cfg).eval()


def check_token_logprobs(fn):
    model = tiny_model()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, 11, (3, 9), generator=g)
    left = torch.ones(3, 9, dtype=torch.long)
    left[1, :3] = 0  # row 1: a prompt 3 tokens shorter, left padded
    left[2, :1] = 0
    ids = ids * left
    cases = [("3 rows, prompts left padded, T = 4", (model, ids, left, 4, 1.0)),
             ("temperature 0.7", (model, ids, left, 4, 0.7)),
             ("a one-token completion, T = 1", (model, ids, left, 1, 1.0))]

    def z(model, ids, mask, T, temperature):  # the logits at the positions that score the tokens
        return C._forward(model, ids, mask).logits[:, -T - 1:-1].float()

    def take(logp, ids, T):
        return logp.gather(-1, ids[:, -T:, None])[..., 0]
    diagnoses = [
        ("no shift: the logits at position t score token t + 1, so token t's log-prob comes from "
         "position t - 1 (logits[:, -T - 1:-1])", lambda m, i, a, T, tau: take(
             C._forward(m, i, a).logits[:, -T:].float().div(tau).log_softmax(-1), i, T)),
        ("the logits are not divided by the temperature (the sampler's): logits / temperature",
         lambda m, i, a, T, tau: take(z(m, i, a, T, tau).log_softmax(-1), i, T)),
        ("the log-softmax is over the wrong axis: it normalises over the vocabulary (dim=-1), "
         "not over positions", lambda m, i, a, T, tau: take(
             z(m, i, a, T, tau).div(tau).log_softmax(1), i, T)),
        ("these are probabilities, not log-probabilities: log_softmax, not softmax",
         lambda m, i, a, T, tau: take(z(m, i, a, T, tau).div(tau).softmax(-1), i, T)),
        ("these are the prompt's first T tokens, not the completion's last T (ids[:, -T:])",
         lambda m, i, a, T, tau: C._forward(m, i, a).logits[:, :T].float().div(tau).log_softmax(
             -1).gather(-1, i[:, 1:T + 1, None])[..., 0]),
        ("these are the raw logits of the taken tokens: normalise them with log_softmax first",
         lambda m, i, a, T, tau: take(z(m, i, a, T, tau).div(tau), i, T)),
    ]
    return compare(fn, C.plain_token_logprobs, cases, diagnoses)


def check_masked_mean(fn):
    x = randn(4, 6)
    mask = right_padded(4, 6, [6, 3, 1, 4])
    empty = mask.clone()
    empty[2] = 0  # a row with no completion token (an env that answered at once)
    cases = [("padded rows, dim=None", (x, mask)), ("per row, dim=-1", (x, mask, -1)),
             ("per column, dim=0", (x, mask, 0)), ("one row has no token, dim=-1", (x, empty, -1)),
             ("no padding at all", (x, torch.ones_like(x)))]
    diagnoses = [
        ("the mask is not used: average x only where mask = 1, sum(x * mask) / sum(mask)",
         lambda x, m, d=None: x.mean(d)),
        ("the padding is counted: average x * mask over the mask's 1s (sum(x * mask) / sum(mask)),"
         " not over every entry", lambda x, m, d=None: (x * m).mean(d)),
        ("the padding's values are in the mean: multiply x by the mask before summing",
         lambda x, m, d=None: x.sum(d) / m.sum(d)),
        ("the count is the whole mask's, not each row's (sum the mask along the same dim)",
         lambda x, m, d: (x * m).sum(d) / m.sum()),
        ("the mean is over the other axis: sum over dim, the one asked for",
         lambda x, m, d: (x * m).sum(1 - d % 2) / m.sum(1 - d % 2).clamp(min=1)),
    ]
    return compare(fn, C.masked_mean, cases, diagnoses,
                   nan="a row without any token gives nan (0 / 0): clamp the count at 1")


def check_rloo_baseline(fn):
    r = randn(12)
    cases = [("3 prompts, k = 4", (r, 4)), ("2 prompts, k = 6", (r, 6)),
             ("k = 2", (r, 2)), ("an all-equal group, negative rewards", (-torch.ones(8), 4))]
    mean = lambda r, k: r.view(-1, k).mean(1, keepdim=True)  # noqa: E731
    diagnoses = [
        ("the baseline includes the sample's own reward (the group's mean): leave it out, "
         "(sum of the group - r_i) / (k - 1)",
         lambda r, k: mean(r, k).expand(-1, k).reshape(-1)),
        ("divides by k, not k - 1: the other samples are k - 1",
         lambda r, k: ((r.view(-1, k).sum(1, keepdim=True) - r.view(-1, k)) / k).view(-1)),
        ("the groups are the wrong rows: a prompt's k samples are k contiguous rows, "
         "r.view(-1, k), not r.view(k, -1)",
         lambda r, k: ((r.view(k, -1).sum(0, keepdim=True) - r.view(k, -1)) / (k - 1)).view(-1)),
        ("the baseline is over the whole batch, not each prompt's k samples",
         lambda r, k: (r.sum() - r) / (len(r) - 1)),
    ]
    return compare(fn, reinforce.rloo_baseline, cases, diagnoses)


def check_reinforce_loss(fn):
    lp = -randn(4, 5).abs()
    adv = randn(4, 5, seed=1)
    cases = [("random log-probs and advantages", (lp, adv)),
             ("negative advantages only", (lp, -adv.abs())),
             ("with is_weight", (lp, adv, None, 0.2, randn(4, 5, seed=2).abs()))]
    diagnoses = [
        ("sign flipped: the loss is -A log pi (minimising it raises log pi where A > 0)",
         lambda lp, a, *rest: a * lp * (rest[2] if len(rest) > 2 else 1)),
        ("is_weight is ignored: multiply the loss per token by it",
         lambda lp, a, *rest: -a * lp),
        ("the loss is -A pi, not -A log pi: logprobs are already logs",
         lambda lp, a, *rest: -a * lp.exp() * (rest[2] if len(rest) > 2 else 1)),
    ]
    return compare(fn, reinforce.reinforce_loss, cases, diagnoses)


# ------------------------------------------------------------------------------- lab 2: GRPO
def check_group_advantages(fn):
    r = (randn(16) > 0).float() + 0.1 * randn(16, seed=1)  # 2 prompts, G = 8
    equal = torch.cat([torch.ones(8), (randn(8, seed=2) > 0).float()])
    cases = [("2 groups of 8", (r, 8)), ("4 groups of 4", (r, 4)),
             ("negative rewards", (r - 3, 8)),
             ("an all-equal group (every A must be 0)", (equal, 8)),
             ("Dr. GRPO, scale='none'", (r, 8, "none")),
             ("Dr. GRPO, an all-equal group", (equal, 8, "none"))]
    G = lambda r, g: r.view(-1, g)  # noqa: E731

    def with_std(std, center=lambda r, g: G(r, g) - G(r, g).mean(1, keepdim=True), eps=None):
        return lambda r, g, scale="group", e=1e-4: (center(r, g) / (
            std(r, g) + (e if eps is None else eps)) if scale == "group" else center(r, g)
        ).reshape(-1)
    diagnoses = [
        ("the std is biased (divides by G): GRPO's is the unbiased std (G - 1), torch.std's "
         "default", with_std(lambda r, g: G(r, g).std(1, keepdim=True, correction=0))),
        ("the std is over the whole batch, not each group of G rows",
         with_std(lambda r, g: r.std())),
        ("the mean is over the whole batch, not each group of G rows", with_std(
            lambda r, g: G(r, g).std(1, keepdim=True), lambda r, g: G(r, g) - r.mean())),
        ("the groups are the wrong rows: a group is G contiguous rows, view(-1, G), not "
         "view(G, -1)", lambda r, g, scale="group", eps=1e-4: (
             (r.view(g, -1) - r.view(g, -1).mean(0)) / (
                 (r.view(g, -1).std(0) + eps) if scale == "group" else 1)).reshape(-1)),
        ("sign flipped: A = r - mean (a reward above the group's mean gets A > 0)",
         lambda *a: -grpo.group_advantages(*a)),
        ("scale='none' (Dr. GRPO) must not divide by the std: A = r - mean",
         lambda r, g, scale="group", eps=1e-4: grpo.group_advantages(r, g, "group", eps)),
        ("no mean subtracted: A = (r - mean) / std", with_std(
            lambda r, g: G(r, g).std(1, keepdim=True), lambda r, g: G(r, g))),
        ("the eps is missing: divide by std + eps, else an all-equal group gives nan (0 / 0)",
         with_std(lambda r, g: G(r, g).std(1, keepdim=True), eps=0.0)),
    ]
    try:  # as grpo.py calls it: std= the whole batch's std, one argument (for scale="batch")
        fn(r, 8, "group", 1e-4, lambda x: x.std())
    except TypeError:
        return ("std= is the run's whole-batch std(x), one argument, for scale='batch' only: "
                "take a group's std with rewards.view(-1, group_size).std(1)")
    except NotImplementedError:
        pass  # the stub: compare() says so
    return compare(fn, grpo.group_advantages, cases, diagnoses,
                   nan="an all-equal group gives nan (std 0): divide by std + eps")


def check_kl_estimate(fn):
    lp, ref = -randn(3, 5).abs(), -randn(3, 5, seed=1).abs()
    far = lp.clone()
    far[0, 0] = -100.0  # a token the policy finds all but impossible: log r about 100
    cases = [("k3", (lp, ref, "k3")), ("k1", (lp, ref, "k1")), ("k2", (lp, ref, "k2")),
             ("equal policies: every estimate 0", (lp, lp, "k3")),
             ("k3, log r = 100 at one token", (far, ref, "k3"))]

    def k3_of(log_r):
        return log_r.exp() - 1 - log_r
    diagnoses = [
        ("k3's r is pi_ref / pi, not pi / pi_ref: log r = ref_logprobs - logprobs",
         lambda lp, ref, e: k3_of(lp - ref) if e == "k3" else C.kl_estimate(lp, ref, e)),
        ("k1 is -log r = log pi - log pi_ref (its sign is flipped)",
         lambda lp, ref, e: (ref - lp) if e == "k1" else C.kl_estimate(lp, ref, e)),
        ("k2 is (log r)^2 / 2: the 1/2 is missing",
         lambda lp, ref, e: (ref - lp) ** 2 if e == "k2" else C.kl_estimate(lp, ref, e)),
        ("k3 is r - 1 - log r: the '- 1' is missing",
         lambda lp, ref, e: k3_of(ref - lp) + 1 if e == "k3" else C.kl_estimate(lp, ref, e)),
        ("k3 overflows where log r is far from 0: clamp log r to [-20, 20] before exp()",
         lambda lp, ref, e: k3_of(ref - lp) if e == "k3" else C.kl_estimate(lp, ref, e)),
    ]
    return compare(fn, C.kl_estimate, cases, diagnoses)


def loss_args(clip=0.2, clip_high=0.28, beta=0.04):
    return SimpleNamespace(clip_eps=clip, clip_eps_high=clip_high, beta=beta, kl_estimator="k3")


def check_per_token_loss(fn):
    old = -randn(8, 6).abs()
    lp = old + 0.4 * randn(8, 6, seed=1)  # ratios from about 0.4 to 2.5: both clips act
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.3, -0.3])
    ref = old + 0.1 * randn(8, 6, seed=3)
    mask = right_padded(8, 6, [6, 2, 1, 5, 6, 6, 3, 4])
    args = loss_args()
    cases = [("ratios far from 1, beta = 0.04", (lp, old, adv, mask, args, ref)),
             ("no reference (beta's term 0)", (lp, old, adv, mask, args)),
             ("ratio exactly 1", (old, old, adv, mask, args, ref)),
             ("negative advantages", (lp, old, -adv.abs(), mask, args, ref))]

    def grpo_with(surrogate, kl_sign=1.0, use_kl=True):
        def loss(lp, old, adv, mask, args, ref=None, w=1.0):
            ratio = torch.exp(lp - old)
            a = adv[:, None]
            kl = 0 if ref is None or not use_kl else C.kl_estimate(lp, ref, args.kl_estimator)
            return surrogate(ratio, a, args) * w + kl_sign * args.beta * kl
        return loss

    def clamp(rho, a, lo, hi):
        return torch.clamp(rho, 1 - lo, 1 + hi) * a

    def right(rho, a, s):
        return -torch.min(rho * a, clamp(rho, a, s.clip_eps, s.clip_eps_high))
    diagnoses = [
        ("sign flipped: the loss is -min(rho A, clip(rho) A), minus the objective",
         grpo_with(lambda rho, a, s: torch.min(rho * a, clamp(rho, a, s.clip_eps,
                                                               s.clip_eps_high)))),
        ("max where PPO takes the min of the two objectives (the pessimistic one)",
         grpo_with(lambda rho, a, s: -torch.max(rho * a, clamp(rho, a, s.clip_eps,
                                                                s.clip_eps_high)))),
        ("the upper clip is 1 + clip_eps; it must be 1 + clip_eps_high (DAPO's clip-higher)",
         grpo_with(lambda rho, a, s: -torch.min(rho * a, clamp(rho, a, s.clip_eps,
                                                                s.clip_eps)))),
        ("the advantage is clipped, not the ratio: clip(rho, 1 - eps_low, 1 + eps_high) * A",
         grpo_with(lambda rho, a, s: -torch.min(rho * a, rho * a.clamp(1 - s.clip_eps,
                                                                      1 + s.clip_eps_high)))),
        ("no clip: -rho A alone; the clipped branch is missing",
         grpo_with(lambda rho, a, s: -rho * a)),
        ("the KL term has the wrong sign: + beta * k (a penalty)",
         grpo_with(right, kl_sign=-1.0)),
        ("the KL term is missing: loss + beta * k", grpo_with(right, use_kl=False)),
    ]
    problem = compare(fn, grpo.per_token_loss, cases, diagnoses)
    if problem is None and compare(fn, grpo.per_token_loss, cases[:1],
                                   out=lambda x: x[1]["clip_frac"]):
        problem = ("logs['clip_frac'] must be 1.0 where the clipped branch is taken (clipped < "
                   "unclipped objective), else 0.0")
    return problem


# -------------------------------------------------------------------------------- lab 3: PPO
def check_gae(fn):
    rewards = randn(3, 6)
    values = randn(3, 6, seed=1)
    mask = right_padded(3, 6, [6, 3, 1])
    cases = [("gamma 1, lam 0.95, padded rows", (rewards, values, mask, 1.0, 0.95)),
             ("gamma 0.9, lam 0.8", (rewards, values, mask, 0.9, 0.8)),
             ("one-token completions", (rewards[:, :1], values[:, :1], mask[:, :1], 1.0, 0.95)),
             ("lam 1 (Monte Carlo)", (rewards, values, mask, 1.0, 1.0))]

    def loop(delta_of, mask_values=True, step=lambda g, l: g * l):
        def gae(r, v, m, gamma, lam):
            v = v * m if mask_values else v
            r = r * m
            adv, last = torch.zeros_like(r), torch.zeros_like(r[:, 0])
            for t in reversed(range(r.shape[1])):
                nxt = v[:, t + 1] if t + 1 < r.shape[1] else torch.zeros_like(last)
                last = delta_of(r, v, t, nxt, gamma) + step(gamma, lam) * last
                adv[:, t] = last * m[:, t]
            return adv, adv + v
        return gae
    right = lambda r, v, t, nxt, g: r[:, t] + g * nxt - v[:, t]  # noqa: E731
    diagnoses = [
        ("the padding's values leak in: V past a row's end must be 0 (terminal): V * mask",
         loop(right, mask_values=False)),
        ("A_t = delta_t + gamma * lam * A_t+1: the gamma is missing",
         loop(right, step=lambda g, l: l)),
        ("A_t = delta_t + gamma * lam * A_t+1: the lam is missing",
         loop(right, step=lambda g, l: g)),
        ("delta_t = r_t + gamma V_t+1 - V_t: the next value is not discounted by gamma",
         loop(lambda r, v, t, nxt, g: r[:, t] + nxt - v[:, t])),
        ("delta_t uses V_t where it needs V_t+1 (off by one)",
         loop(lambda r, v, t, nxt, g: r[:, t] + g * v[:, t] - v[:, t])),
        ("the recursion runs forwards: A_t needs A_t+1, so go from the last token backwards",
         lambda r, v, m, g, l: tuple(x.flip(1) for x in ppo.gae(r.flip(1), v.flip(1), m.flip(1),
                                                                 g, l))),
    ]
    problem = compare(fn, ppo.gae, cases, diagnoses)
    if problem:
        return problem
    return compare(fn, ppo.gae, cases, [
        ("returns are A + V (the critic's target), not A",
         lambda *a: (ppo.gae(*a)[0], ppo.gae(*a)[0])),
        ("returns are A + V with V masked (0 on padding)",
         lambda r, v, m, g, lam: (ppo.gae(r, v, m, g, lam)[0], ppo.gae(r, v, m, g, lam)[0] + v))],
        out=lambda x: x[1])


def check_value_loss(fn):
    old = randn(4, 5)
    values = old + randn(4, 5, seed=1)  # moves of about +-1, past the clip of 0.2
    returns = randn(4, 5, seed=2)
    cases = [("moves past the clip", (values, old, returns, 0.2)),
             ("values equal to old", (old, old, returns, 0.2)),
             ("a wide clip (nothing clipped)", (values, old, returns, 10.0))]

    def mistaken(combine, half=0.5):
        def loss(v, old, ret, eps):
            clipped = old + (v - old).clamp(-eps, eps)
            return half * combine((v - ret) ** 2, (clipped - ret) ** 2)
        return loss
    diagnoses = [
        ("min of the two losses; the clipped value loss takes the max (pessimistic)",
         mistaken(torch.min)),
        ("the 0.5 in front of the squared error is missing", mistaken(torch.max, half=1.0)),
        ("no clipping: 0.5 (V - R)^2 alone; the clipped branch is missing",
         lambda v, old, ret, eps: 0.5 * (v - ret) ** 2),
        ("sign flipped: the loss is +0.5 max(...), which the critic minimises",
         lambda *a: -ppo.value_loss(*a)[0]),
    ]
    return compare(fn, ppo.value_loss, cases, diagnoses)


# ---------------------------------------------------------------- labs 4 and 5: DPO, distillation
def check_dpo_loss(fn):
    lc, lr, rc, rr = (-randn(6, seed=s).abs() * 5 for s in range(4))
    args = SimpleNamespace(beta=0.1, label_smoothing=0.0, loss_type="sigmoid")
    cases = [("beta 0.1", (lc, lr, rc, rr, args)),
             ("beta 0.5, chosen far above rejected", (lc + 3, lr - 3, rc, rr,
                                                      SimpleNamespace(**{**vars(args),
                                                                         "beta": 0.5}))),
             ("policy = reference: loss log 2", (rc, rr, rc, rr, args)),
             ("label_smoothing 0.1 (cDPO)", (lc, lr, rc, rr, SimpleNamespace(
                 **{**vars(args), "label_smoothing": 0.1})))]
    F = torch.nn.functional

    def with_h(h_of, beta=True, sign=1.0):
        return lambda c, r, c0, r0, a: -F.logsigmoid(sign * (a.beta if beta else 1) * h_of(
            c, r, c0, r0))
    right_h = lambda c, r, c0, r0: (c - c0) - (r - r0)  # noqa: E731
    diagnoses = [
        ("chosen and rejected are swapped (or the sign is flipped): h = (log pi - log pi_ref) of "
         "chosen minus that of rejected", with_h(right_h, sign=-1.0)),
        ("beta is missing: -log sigmoid(beta h)", with_h(right_h, beta=False)),
        ("the reference is not subtracted: h = (log pi_c - log pi_ref_c) - (log pi_r - "
         "log pi_ref_r)", with_h(lambda c, r, c0, r0: c - r)),
        ("the loss is log sigmoid(beta h); it is -log sigmoid (minimise the negative)",
         lambda *a: -dpo.dpo_loss(*a)[0]),
        ("the loss is -sigmoid(beta h); it is -log sigmoid(beta h)",
         lambda c, r, c0, r0, a: -torch.sigmoid(a.beta * right_h(c, r, c0, r0))),
        ("label_smoothing is ignored: L = -(1 - eps) log sigmoid(beta h) - eps log sigmoid("
         "-beta h)", with_h(right_h)),
    ]
    return compare(fn, dpo.dpo_loss, cases, diagnoses)


def check_opd_advantages(fn):
    lp = -randn(3, 5).abs().requires_grad_()
    t_lp = -randn(3, 5, seed=1).abs()
    cases = [("kl_coef 1", (lp, t_lp)), ("kl_coef 0.5", (lp, t_lp, 0.5)),
             ("student = teacher: A = 0", (t_lp, t_lp))]
    diagnoses = [
        ("sign flipped: A_t = -(log pi_theta - log pi_T): a token the teacher likes more than "
         "the student gets A > 0", lambda lp, t, c=1.0: c * (lp - t)),
        ("kl_coef is missing: A_t = -kl_coef (log pi_theta - log pi_T)",
         lambda lp, t, c=1.0: -(lp - t)),
    ]
    problem = compare(fn, distill.opd_advantages, cases, diagnoses,
                      out=lambda x: x.detach())
    if problem:
        return problem
    if fn(lp, t_lp).requires_grad:
        return "the advantage carries a gradient: .detach() it (it is a reward, not a loss)"
    return None


# ------------------------------------------------------- lab 6: a reward of your own (chat-sums)
def check_asked_answer(fn):
    """Text, not tensors: each case is a completion of "Add 3 and 5. Answer with just the
    equation." and what the reward must pay it (1 or 0), the rule named in the message. One call
    scores them all, as the loop calls a --reward_fn: one batch, one number per completion."""
    from plumbing import chat_sums
    row = chat_sums.row(3, 5, phrasing=1, shown=0)  # "Add 3 and 5. ...": answer 8
    cases = [
        ("3 + 5 = 8", "the right equation alone must get 1"),
        ("5 + 3 = 8", "the equation in either order must get 1 (b + a = c is the same sum)"),
        ("3+5=8", "spaces do not matter: '3+5=8' must get 1"),
        ("3 + 5 = 8.", "a final '.' does not matter: '3 + 5 = 8.' must get 1"),
        (" 3 + 5 = 8\n", "whitespace around the equation does not matter: it must get 1"),
        ("3 + 5 = 9", "a wrong sum must get 0: check c, not only the form a + b = c"),
        ("2 + 6 = 8", "another sum with the right result must get 0: check a and b too"),
        ("13 + 5 = 8", "'13 + 5 = 8' must get 0: match whole numbers, not the digits that end one"),
        ("3 + 5 = 88", "'3 + 5 = 88' must get 0: match the whole result, not its first digits"),
        ("8", "the bare number must get 0: the prompt asks for the equation, not the answer"),
        ("The answer is 3 + 5 = 8.", "a sentence around the right equation must get 0: the "
         "prompt asks for just the equation (the whole completion must be it)"),
        ("3 + 5 = 8. I added 3 and 5 to get 8.", "words after the equation must get 0: pay "
         "the equation alone, or the policy learns to pad (the hack of this lab)"),
        ("", "an empty completion must get 0"),
    ]
    completions = [c for c, _ in cases]
    expected = chat_sums.asked_answer(completions, [row] * len(cases))
    try:
        got = fn(list(completions), [dict(row) for _ in cases])
    except NotImplementedError as e:
        return f"not written yet ({e})"
    except Exception as e:  # noqa: BLE001
        return f"raised {type(e).__name__}: {str(e).splitlines()[0][:100]}"
    if isinstance(got, (str, bytes, dict)) or not hasattr(got, "__iter__"):
        return f"returned a {type(got).__name__}: return a list, one number per completion"
    got = list(got)
    if len(got) != len(cases):
        return (f"returned {len(got)} values for {len(cases)} completions: one number per "
                "completion, in their order")
    for (completion, rule), g, e in zip(cases, got, expected):
        if isinstance(g, bool):  # the loop refuses a bool: one line, exit 2
            return f"returned {g!r}: return a number, float(...) of it (the loop refuses a bool)"
        if not isinstance(g, (int, float)) or g != e:
            return f"{rule}: {completion!r} got {g!r}, expected {e!r}"
    return None


# ------------------------------------------------------------------ lab 7: a tool environment
def check_calc(fn):
    """Text, not tensors: each case is one rule of the environment, named in the message."""
    from plumbing import calc
    row = {"prompt": "4312+5839=", "answer": "10151"}
    cases = [
        (["<calc>4312+5839</calc>"], "a call gives the sum with a space on each side"),
        (["<calc>4312-5839</calc>"], "a subtraction gives the difference, sign included"),
        (["<calc>12*30</calc>"], "a product"),
        (["10151"], "a turn without a call was the answer: None ends the episode"),
        (["<calc>4312+5839</calc>", "10151"], "only the last turn counts: it has no call"),
        (["<calc>1+2</calc> 3 ", "<calc>40+2</calc>"], "only the last turn counts: its call"),
        (["<calc>12+</calc>"], "a call it cannot read gets ' error '"),
        (["<calc>1234567890123+1</calc>"], "more than 12 digits gets ' error '"),
        (["<calc>4312+5839</calc> \n"], "whitespace after the call is still a call"),
        (["<calc>7+8</calc> and more"], "a call that is not at the end of the turn is no call"),
        (["<calc>1<calc>2+3</calc>"], "only the text inside the last <calc> counts"),
        (["<calc> 2 + 3 </calc>"], "spaces around the numbers are fine"),
    ]
    for turns, rule in cases:
        expected = calc.calc(dict(row), list(turns))
        try:
            got = fn(dict(row), list(turns))
        except NotImplementedError as e:
            return f"not written yet ({e})"
        except Exception as e:  # noqa: BLE001
            return f"raised {type(e).__name__}: {str(e).splitlines()[0][:100]} (turns {turns!r})"
        if got != expected:
            return f"{rule}: turns {turns!r} gave {got!r}, expected {expected!r}"
    return None


CHECKS = {"token_logprobs": check_token_logprobs, "masked_mean": check_masked_mean,
          "rloo_baseline": check_rloo_baseline, "reinforce_loss": check_reinforce_loss,
          "group_advantages": check_group_advantages, "kl_estimate": check_kl_estimate,
          "per_token_loss": check_per_token_loss, "gae": check_gae, "value_loss": check_value_loss,
          "dpo_loss": check_dpo_loss, "opd_advantages": check_opd_advantages, "calc": check_calc,
          "asked_answer": check_asked_answer}


def grade(name, fn):
    """None when fn computes what the project's function `name` computes, else one line."""
    with torch.no_grad() if name != "opd_advantages" else torch.enable_grad():
        return CHECKS[name](fn)
