"""labs/: the grader names each planted mistake; the stubs say what to write; the holes filled
with the project's functions pass; lab.train puts the project's functions back; every lab runs
end to end with the solutions and learns (CI: fewer steps and held-out prompts than the labs)."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import ROOT

sys.path.insert(0, os.path.join(ROOT, "labs"))
import grader  # noqa: E402  (labs/grader.py)
import lab  # noqa: E402  (labs/lab.py)

import grpo  # noqa: E402

CI_FLAGS = "--max_steps 20 --eval_size 100"  # the labs: 40-100 steps, 200 held-out prompts
LABS = sorted(glob.glob(os.path.join(ROOT, "labs", "[0-9]*.py")))
TINY = [p for p in LABS if not os.path.basename(p).startswith("06_")]  # lab 6: SmolLM2, below


# ---- planted mistakes, as a student would write them: (function, mutant, the message's words)
def lp_no_shift(model, ids, attention_mask, T, temperature=1.0, entropy=False):
    logp = (lab.logits(model, ids, attention_mask)[:, -T:].float() / temperature).log_softmax(-1)
    return logp.gather(-1, ids[:, -T:, None])[..., 0], None


def lp_no_temperature(model, ids, attention_mask, T, temperature=1.0, entropy=False):
    logp = lab.logits(model, ids, attention_mask)[:, -T - 1:-1].float().log_softmax(-1)
    return logp.gather(-1, ids[:, -T:, None])[..., 0], None


def lp_wrong_axis(model, ids, attention_mask, T, temperature=1.0, entropy=False):
    logits = lab.logits(model, ids, attention_mask)[:, -T - 1:-1].float() / temperature
    return logits.log_softmax(1).gather(-1, ids[:, -T:, None])[..., 0], None


def lp_softmax(model, ids, attention_mask, T, temperature=1.0, entropy=False):
    logits = lab.logits(model, ids, attention_mask)[:, -T - 1:-1].float() / temperature
    return logits.softmax(-1).gather(-1, ids[:, -T:, None])[..., 0], None


def mean_no_mask(x, mask, dim=None, total=None):
    return x.mean() if dim is None else x.mean(dim)


def mean_padding_counted(x, mask, dim=None, total=None):
    return (x * mask).mean() if dim is None else (x * mask).mean(dim)


def mean_no_clamp(x, mask, dim=None, total=None):
    return (x * mask).sum(dim) / mask.sum(dim) if dim is not None else (x * mask).sum() / mask.sum()


def rloo_with_own(rewards, k):
    return rewards.view(-1, k).mean(1).repeat_interleave(k)


def rloo_over_k(rewards, k):
    r = rewards.view(-1, k)
    return ((r.sum(1, keepdim=True) - r) / k).view(-1)


def rloo_strided(rewards, k):
    r = rewards.view(k, -1)
    return ((r.sum(0, keepdim=True) - r) / (k - 1)).view(-1)


def reinforce_sign(logprobs, advantages, old_logprobs=None, clip_eps=0.2, is_weight=1.0):
    return advantages * logprobs * is_weight, torch.ones_like(logprobs), torch.zeros_like(logprobs)


def reinforce_no_weight(logprobs, advantages, old_logprobs=None, clip_eps=0.2, is_weight=1.0):
    return -advantages * logprobs, torch.ones_like(logprobs), torch.zeros_like(logprobs)


def adv(std_of, center_of=lambda r: r - r.mean(1, keepdim=True), divide_none=False):
    def group_advantages(rewards, group_size, scale="group", eps=1e-4, std=torch.std):
        r = rewards.view(-1, group_size)
        a = center_of(r)
        if scale == "group" or divide_none:
            a = a / (std_of(r) + eps)
        return a.view(-1)
    return group_advantages


def adv_no_eps(rewards, group_size, scale="group", eps=1e-4, std=torch.std):
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / r.std(1, keepdim=True)).view(-1)


def adv_std_arg(rewards, group_size, scale="group", eps=1e-4, std=torch.std):
    r = rewards.view(-1, group_size)  # a group's std through the run's whole-batch std= (a
    return ((r - r.mean(1, keepdim=True)) / (std(r, dim=1, keepdim=True) + eps)).view(-1)  # crash)


def adv_strided(rewards, group_size, scale="group", eps=1e-4, std=torch.std):
    r = rewards.view(group_size, -1)
    return ((r - r.mean(0)) / (r.std(0) + eps)).reshape(-1)


def k3(flip=False, clamp=True, minus_one=True):
    def kl_estimate(logprobs, ref_logprobs, estimator):
        log_r = ref_logprobs - logprobs
        if estimator != "k3":
            return -log_r if estimator == "k1" else 0.5 * log_r ** 2
        log_r = -log_r if flip else log_r
        log_r = log_r.clamp(-20, 20) if clamp else log_r
        return log_r.exp() - (1 if minus_one else 0) - log_r
    return kl_estimate


def surrogate(sign=-1.0, pick=torch.min, high=None, kl_sign=1.0, clip_adv=False):
    def per_token_loss(logprobs, old_logprobs, advantages, mask, args, ref_logprobs=None,
                       is_weight=1.0, sample_logprobs=None):
        ratio = torch.exp(logprobs - old_logprobs)
        a = advantages[:, None]
        hi = args.clip_eps_high if high is None else getattr(args, high)
        clipped = ratio * a.clamp(1 - args.clip_eps, 1 + hi) if clip_adv else \
            ratio.clamp(1 - args.clip_eps, 1 + hi) * a
        unclipped = ratio * a
        kl = 0 if ref_logprobs is None or kl_sign == 0 else grader.C.kl_estimate(
            logprobs, ref_logprobs, args.kl_estimator)
        loss = sign * pick(unclipped, clipped) * is_weight + kl_sign * args.beta * kl
        return loss, {"kl": kl, "ratio": ratio, "clip_frac": (clipped < unclipped).float()}
    return per_token_loss


def gae_mutant(forwards=False, mask_values=True, gamma_in_step=True, next_is_t=False,
               returns_are_a=False):
    def gae(rewards, values, mask, gamma, lam):
        values = values * mask if mask_values else values
        rewards = rewards * mask
        A, last = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
        T = rewards.shape[1]
        order = range(T) if forwards else reversed(range(T))
        for t in order:
            nxt = values[:, t] if next_is_t else (values[:, t + 1] if t + 1 < T else 0 * last)
            if forwards:
                nxt = values[:, t - 1] if t > 0 else 0 * last
            delta = rewards[:, t] + gamma * nxt - values[:, t]
            last = delta + (gamma * lam if gamma_in_step else lam) * last
            A[:, t] = last * mask[:, t]
        return A, A if returns_are_a else A + values
    return gae


def value_mutant(pick=torch.max, half=0.5, clip=True):
    def value_loss(values, old_values, returns, clip_eps_value):
        v_clipped = old_values + (values - old_values).clamp(-clip_eps_value, clip_eps_value)
        un, cl = (values - returns) ** 2, (v_clipped - returns) ** 2
        return half * (pick(un, cl) if clip else un), (cl > un).float()
    return value_loss


def dpo_mutant(swap=False, beta=True, ref=True, smoothing=True):
    def dpo_loss(logp_chosen, logp_rejected, ref_chosen, ref_rejected, args):
        c, r = (logp_rejected, logp_chosen) if swap else (logp_chosen, logp_rejected)
        c0, r0 = (ref_rejected, ref_chosen) if swap else (ref_chosen, ref_rejected)
        h = (c - c0 - r + r0) if ref else (c - r)
        z = (args.beta if beta else 1) * h
        eps = args.label_smoothing if smoothing else 0.0
        loss = -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)
        return loss, (args.beta * (logp_chosen - ref_chosen)).detach(), \
            (args.beta * (logp_rejected - ref_rejected)).detach()
    return dpo_loss


def calc_mutant(spaces=True, last_only=True, errors=True, ops="+-*"):
    def calc(row, turns):
        text = turns[-1] if last_only else turns[0]
        call = re.search(r"<calc>(.*)</calc>\s*$", text, re.S)
        if call is None:
            return None
        m = re.fullmatch(r"\s*(-?\d+)\s*([-+*])\s*(-?\d+)\s*", call.group(1).split("<calc>")[-1])
        if m is None or max(len(m.group(1)), len(m.group(3))) > 12 or m.group(2) not in ops:
            return " error " if errors else None
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        result = a + b if op == "+" else a - b if op == "-" else a * b
        return f" {result} " if spaces else str(result)
    return calc


def reward_mutant(test):
    """A chat-sums reward as a student might write it: test(text, a, b, c) decides each 1.0."""
    def asked_answer(completions, rows):
        return [float(bool(test(text, *re.findall(r"\d+", row["equation"]))))
                for text, row in zip(completions, rows)]
    return asked_answer


def bare(text):  # the completion without whitespace and one final "."
    return re.sub(r"\s", "", text).removesuffix(".")


MUTANTS = [
    ("token_logprobs", lp_no_shift, "no shift"),
    ("token_logprobs", lp_no_temperature, "not divided by the temperature"),
    ("token_logprobs", lp_wrong_axis, "wrong axis"),
    ("token_logprobs", lp_softmax, "probabilities, not log-probabilities"),
    ("masked_mean", mean_no_mask, "mask is not used"),
    ("masked_mean", lambda x, m, d=None, total=None: x.sum(d) / m.sum(d).clamp(min=1),
     "padding's values are in the mean"),
    ("masked_mean", mean_padding_counted, "the padding is counted"),
    ("masked_mean", mean_no_clamp, "row without any token gives nan"),
    ("masked_mean", lambda x, m, d=None, total=None: (x * m).sum(0 if d == -1 else d) / m.sum(
        0 if d == -1 else d).clamp(min=1), "the mean is over the other axis"),
    ("rloo_baseline", rloo_with_own, "includes the sample's own reward"),
    ("rloo_baseline", rloo_over_k, "divides by k, not k - 1"),
    ("rloo_baseline", rloo_strided, "k contiguous rows"),
    ("reinforce_loss", reinforce_sign, "sign flipped"),
    ("reinforce_loss", reinforce_no_weight, "is_weight is ignored"),
    ("group_advantages", adv(lambda r: r.std(1, keepdim=True, unbiased=False)), "biased"),
    ("group_advantages", adv(lambda r: r.std()), "std is over the whole batch"),
    ("group_advantages", adv(lambda r: r.std(1, keepdim=True), lambda r: r - r.mean()),
     "mean is over the whole batch"),
    ("group_advantages", adv(lambda r: r.std(1, keepdim=True), lambda r: r.mean(1, True) - r),
     "sign flipped"),
    ("group_advantages", adv(lambda r: r.std(1, keepdim=True), divide_none=True),
     "Dr. GRPO) must not divide"),
    ("group_advantages", adv_no_eps, "all-equal group gives nan"),
    ("group_advantages", adv_strided, "G contiguous rows"),
    ("group_advantages", adv_std_arg, "std= is the run's whole-batch std"),
    ("kl_estimate", k3(flip=True), "r is pi_ref / pi"),
    ("kl_estimate", k3(clamp=False), "clamp log r"),
    ("kl_estimate", k3(minus_one=False), "'- 1' is missing"),
    ("per_token_loss", surrogate(sign=1.0, kl_sign=1.0), "sign flipped"),
    ("per_token_loss", surrogate(pick=torch.max), "max where PPO takes the min"),
    ("per_token_loss", surrogate(high="clip_eps"), "clip_eps_high"),
    ("per_token_loss", surrogate(kl_sign=0), "KL term is missing"),
    ("per_token_loss", surrogate(kl_sign=-1.0), "KL term has the wrong sign"),
    ("per_token_loss", surrogate(clip_adv=True), "advantage is clipped, not the ratio"),
    ("gae", gae_mutant(mask_values=False), "V past a row's end must be 0"),
    ("gae", gae_mutant(gamma_in_step=False), "the gamma is missing"),
    ("gae", gae_mutant(next_is_t=True), "off by one"),
    ("gae", gae_mutant(forwards=True), "runs forwards"),
    ("gae", gae_mutant(returns_are_a=True), "returns are A + V"),
    ("value_loss", value_mutant(pick=torch.min), "min of the two losses"),
    ("value_loss", value_mutant(half=1.0), "0.5"),
    ("value_loss", value_mutant(clip=False), "no clipping"),
    ("dpo_loss", dpo_mutant(swap=True), "chosen and rejected are swapped"),
    ("dpo_loss", dpo_mutant(beta=False), "beta is missing"),
    ("dpo_loss", dpo_mutant(ref=False), "reference is not subtracted"),
    ("dpo_loss", dpo_mutant(smoothing=False), "label_smoothing is ignored"),
    ("opd_advantages", lambda lp, t, c=1.0: (c * (lp - t)).detach(), "sign flipped"),
    ("opd_advantages", lambda lp, t, c=1.0: -c * (lp - t), "carries a gradient"),
    ("calc", calc_mutant(spaces=False), "a space on each side"),
    ("calc", calc_mutant(last_only=False), "only the last turn counts"),
    ("calc", calc_mutant(errors=False), "cannot read gets ' error '"),
    ("calc", calc_mutant(ops="+"), "a subtraction"),
    ("asked_answer", reward_mutant(lambda t, a, b, c: bare(t) == f"{a}+{b}={c}"), "either order"),
    ("asked_answer", reward_mutant(lambda t, a, b, c: t.strip() in (f"{a} + {b} = {c}",
                                                                  f"{b} + {a} = {c}")),
     "spaces do not matter"),
    ("asked_answer", reward_mutant(lambda t, a, b, c: re.fullmatch(r"\d+\+\d+=\d+", bare(t))),
     "a wrong sum must get 0"),
    ("asked_answer", reward_mutant(lambda t, a, b, c: re.fullmatch(r"\d+\+\d+=(\d+)", bare(t))
                                   and bare(t).endswith(c)), "another sum"),
    ("asked_answer", reward_mutant(lambda t, a, b, c: re.search(rf"({a}\+{b}|{b}\+{a})={c}$",
                                                                bare(t))), "'13 + 5 = 8'"),
    ("asked_answer", reward_mutant(lambda t, a, b, c: c in re.findall(r"\d+", t)),
     "another sum with the right result"),
    ("asked_answer", reward_mutant(lambda t, a, b, c: re.search(
        rf"(^|\D)({a}\+{b}|{b}\+{a})={c}(\D|$)", bare(t))), "a sentence around"),
    ("asked_answer", reward_mutant(lambda t, a, b, c: bare(t).startswith((f"{a}+{b}={c}",
                                                                       f"{b}+{a}={c}"))),
     "'3 + 5 = 88' must get 0"),
    ("asked_answer", lambda cs, rows: [bare(t) in ("3+5=8", "5+3=8") for t in cs],
     "the loop refuses a bool"),
    ("asked_answer", lambda cs, rows: [1.0 if bare(t) in ("3+5=8", "5+3=8") else 0.0
                                       for t in cs[:1]], "returned 1 values for 13"),
]


# ---- right answers, written plainly as a student would (not the project's code): they pass
def lp_plain(model, ids, attention_mask, T, temperature=1.0, entropy=False):
    logits = lab.logits(model, ids, attention_mask)  # all P + T positions, not the last T + 1
    logp = torch.log_softmax(logits[:, -T - 1:-1].float() / temperature, dim=-1)
    lp = torch.gather(logp, 2, ids[:, -T:].unsqueeze(-1)).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1) if entropy else None


def mean_plain(x, mask, dim=None, total=None):
    return (x * mask).sum(dim) / torch.clamp(mask.sum(dim), min=1)


def gae_plain(rewards, values, mask, gamma, lam):
    values, rewards = values * mask, rewards * mask
    B, T = rewards.shape
    A = torch.zeros(B, T)
    for t in range(T - 1, -1, -1):
        v_next = values[:, t + 1] if t < T - 1 else torch.zeros(B)
        a_next = A[:, t + 1] if t < T - 1 else torch.zeros(B)
        delta = rewards[:, t] + gamma * v_next - values[:, t]
        A[:, t] = (delta + gamma * lam * a_next) * mask[:, t]
    return A, A + values


ANSWERS = [
    ("token_logprobs", lp_plain), ("masked_mean", mean_plain),
    ("rloo_baseline", lambda r, k: torch.stack([
        (g.sum() - g) / (k - 1) for g in r.split(k)]).flatten()),
    ("group_advantages", adv(lambda r: r.std(1, keepdim=True))),
    ("kl_estimate", k3()), ("per_token_loss", surrogate()), ("gae", gae_plain),
    ("value_loss", value_mutant()), ("dpo_loss", dpo_mutant()), ("calc", calc_mutant()),
    ("asked_answer", reward_mutant(lambda t, a, b, c: bare(t) in (f"{a}+{b}={c}",
                                                                f"{b}+{a}={c}"))),
]


@pytest.mark.parametrize("name, answer", ANSWERS, ids=[n for n, _ in ANSWERS])
def test_grader_passes_a_right_answer_written_otherwise(name, answer):
    assert grader.grade(name, answer) is None


@pytest.mark.parametrize("name, mutant, words", MUTANTS,
                         ids=[f"{n}-{w[:24]}" for n, _, w in MUTANTS])
def test_grader_names_each_planted_mistake(name, mutant, words):
    problem = grader.grade(name, mutant)
    assert problem is not None and words in problem, problem
    assert "\n" not in problem and len(problem) < 200


def test_grader_passes_the_projects_functions_and_stops_at_a_stub(monkeypatch):
    """The holes as shipped: each raises "lab N: write ..."; with MINRL_LAB_SOLUTIONS=1 (here
    lab.SOLUTIONS) every hole holds the project's function, which the grader passes."""
    names = set()
    for path in LABS:
        stubs = lab.load(path)
        monkeypatch.setattr(lab, "SOLUTIONS", True)
        solved = lab.load(path)
        monkeypatch.setattr(lab, "SOLUTIONS", False)
        number = os.path.basename(path).split("_")[0].lstrip("0")
        for name in grader.CHECKS:
            if hasattr(stubs, name):
                names.add(name)
                assert grader.grade(name, getattr(stubs, name)).startswith(
                    f"not written yet (lab {number}: write"), name
                assert grader.grade(name, getattr(solved, name)) is None, name
    assert names == set(grader.CHECKS)  # every graded function is some lab's hole


def test_train_puts_the_projects_functions_back(tmp_path, monkeypatch):
    """A run that stops on a bad flag (exit 2, one line, as `python grpo.py --lr -1` does) still
    leaves grpo.group_advantages as it was."""
    monkeypatch.setenv("MINRL_LAB_RUNS", str(tmp_path))
    project = grpo.group_advantages
    with pytest.raises(SystemExit) as stop:
        lab.train(grpo, "--lr -1", {"grpo.group_advantages": lambda *a, **k: None})
    assert stop.value.code == 2 and grpo.group_advantages is project


@pytest.mark.parametrize("path", TINY, ids=[os.path.basename(p) for p in TINY])
def test_each_lab_runs_with_the_solutions_and_learns(path, tmp_path):
    """`python labs/NN_x.py` as an instructor runs it (MINRL_LAB_SOLUTIONS=1), 20 steps: the check
    cell passes, the run in the script's own loop lifts the held-out score by 0.25 or more
    (0.315 before on every lab; the full labs reach 0.9 and more), the figure is written."""
    env = {**os.environ, "MINRL_LAB_SOLUTIONS": "1", "MINRL_LAB_RUNS": str(tmp_path),
           "MINRL_LAB_FLAGS": CI_FLAGS, "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, path], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "not right yet" not in r.stdout and ": ok" in r.stdout
    run = re.findall(r"--output_dir (\S+)", r.stdout)[-1]  # the lab's last run (5: distill's)
    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    assert summary["eval_after"] >= summary["eval_before"] + 0.25, summary
    if "no figure" not in r.stdout:
        assert os.path.getsize(os.path.join(run, "labs-figure.png")) > 10_000


def test_lab6_runs_both_runs_on_smollm2_with_the_solution(smollm2_dir, tmp_path):
    """`python labs/06_reward_hacking.py` with the solution, each run cut to 2 steps and 8
    held-out prompts (SmolLM2: about a minute of CPU; skipped without the model, as
    tests/test_real_model.py): the check passes, run 1 trains on the lab's own `thorough`
    (named __main__:thorough), run 2 on the student's asked_answer in the preset's place, and
    each prints its samples and the share that is the equation alone. The hack itself takes the
    lab's 8 steps (labs/README.md's numbers), too long for CI."""
    env = {**os.environ, "MINRL_LAB_SOLUTIONS": "1", "MINRL_LAB_RUNS": str(tmp_path),
           "MINRL_LAB_FLAGS": f"--model {smollm2_dir} --max_steps 2 --eval_size 8",
           "HF_HUB_OFFLINE": "1"}
    r = subprocess.run([sys.executable, os.path.join(ROOT, "labs", "06_reward_hacking.py")],
                       capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "  asked_answer: ok" in r.stdout
    hacked, fixed = re.findall(r"--output_dir (\S+)", r.stdout)
    for run, reward in ((hacked, "reward/thorough"), (fixed, "reward/asked_answer")):
        with open(os.path.join(run, "metrics.jsonl")) as f:
            history = [json.loads(line) for line in f]
        assert len(history) == 2 and all(reward in m and "gold" in m for m in history)
    assert r.stdout.count("just the equation: ") == 2 and r.stdout.count("step 2: ") == 2
