"""reinforce.py: REINFORCE (Williams, 1992) for LLMs, and the baselines that tame its variance:
EMA, RLOO (Ahmadian et al., "Back to Basics", 2024) and REINFORCE++ (Hu, 2025).

Sample k completions o_1..o_k for each prompt q (k contiguous rows of the batch), score each with a
reward s_i (rule or reward model), and push up the log-probability of every token of o_i in
proportion to how good the whole trajectory was:

    r_i,t = -beta KL_t(pi_old || pi_ref) on every token, + s_i on the last one  (KL in the reward)
    G_i,t = sum_{t' >= t} r_i,t'   (gamma = 1: the reward-to-go; --kl_in_reward sequence gives
            every token G_i,0, the whole sequence's return)                        kl_returns()
    A_i,t = G_i,t - b_i                                                            advantages()
        none          b = 0: vanilla REINFORCE, unbiased; its variance grows with the offset
        ema           b = moving average of earlier steps' mean return (Williams' "reinforcement
                      comparison")
        rloo          b_i = mean reward of the k - 1 OTHER samples of its prompt (leave-one-out:
                      b_i does not depend on o_i, so the estimate stays unbiased). The reward
                      compared is the score s_j when KL is paid per token (OpenRLHF), the whole
                      KL-penalised return G_j,0 when it is summed per sequence (TRL RLOO)
        reinforce_pp  A = (G - mean) / std over every valid token of the batch (REINFORCE++)
        maxrl         A = (G - b) / (b + eps), b = the mean return of the prompt's k samples
                      (MaxRL, arXiv 2602.02710: with 0/1 rewards, the gradient of log pass@1)
    loss  = -(1/N) sum_i sum_t A_i,t log pi_theta(o_i,t | q, o_i,<t)            reinforce_loss()
            N = sequences in the optimizer step

pi_theta is the policy being trained, pi_old the one that sampled the batch, pi_ref a frozen copy
of the starting policy. The gradient of that loss is the Monte-Carlo policy gradient
E[A grad log pi(o)]. A baseline that does not depend on the sample's own actions leaves its mean
unchanged (E[b grad log pi] = 0) and can cut its variance. Without one, the update depends on the
reward's offset: add c to every reward and each sample's gradient gains c grad log pi, pure noise.
Logged proxies: adv_mean, adv_std and sample_grad_rms (see sample_grad_probe). On the bundled
task, with 0/1 rewards b = 0 already is the failure reward, so `none` is no noisier than rloo;
with +1 added to every reward vanilla's per-sample gradient nearly triples while every
baseline's stays put (docs/algorithms.md: --reward_fn one.py:one, a reward that is always 1).

Simplified: one on-policy update per batch (--num_iterations 1, as the RLOO paper);
num_iterations > 1 turns on a PPO-style clipped token ratio. --whiten whitens the advantages after
any baseline (TRL RLOO's normalize_advantages; with beta = 0, --baseline rloo --whiten is exactly
REINFORCE++-baseline: leave-one-out and group-mean advantages differ by the factor k/(k-1), which
whitening removes). With several --rewards, --multi_objective_aggregation normalize_then_sum
(GDPO, docs/policy_losses.md) makes s_i each reward normalised within its prompt's k samples, summed
and normalised over the batch.

Run:  python reinforce.py --baseline rloo     # bundled tiny model and task, 2-core CPU, ~15 s
      python reinforce.py --baseline none --reward_fn one.py:one --rewards math=1,one=1  # +1
      python reinforce.py --model Qwen/Qwen2.5-0.5B-Instruct --data my.jsonl \\
          --max_new_tokens 256 --baseline rloo --beta 0.05 --lr 1e-6 --compile
Expect (bundled default, 2-core CPU): held-out greedy accuracy 0.29 -> about 0.99 with rloo.
"""
from plumbing import ctrl_c  # noqa: F401  (first: Ctrl-C while torch loads is one line)
import math
from dataclasses import dataclass, field
from typing import Literal

import torch

import common as C
from plumbing.errors import UserError
import objectives as O  # mismatch_weights: the sampler/trainer correction
from plumbing import envs as E
from plumbing import flags
from plumbing.flags import arg  # an Args field with its valid range
from plumbing import loading
from plumbing import runs as R
from plumbing import tasks
from plumbing import vllm_sampler as V


Aggregation = Literal["sum_then_normalize", "normalize_then_sum"]  # several --rewards: TRL's


@dataclass
class Args:
    # the objective's own fields first (the docstring's equations), then sampling, then the
    # mismatch correction (skip it on a first read), then model and data, rewards, optimisation and
    # the run; --help lists them in a user's order (flags.HELP_ORDER)
    # --- the REINFORCE objective
    baseline: Literal["none", "ema", "rloo", "reinforce_pp", "maxrl"] = "none"  # b in A = G - b
    ema_decay: float = arg(0.9, "[0, 1)")  # ema baseline: b <- decay * b + (1 - decay) * mean
    whiten: bool = False  # whiten advantages after the baseline (TRL RLOO normalize_advantages)
    multi_objective_aggregation: Aggregation = "sum_then_normalize"  # normalize_then_sum: GDPO
    beta: float = arg(0.0, ">= 0")  # KL-in-reward weight (TRL 0.05, OpenRLHF 0.01)
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"  # KL value in the reward (TRL, OpenRLHF: k1)
    kl_in_reward: Literal["token", "sequence"] = "token"  # per token (REINFORCE++), summed (TRL)
    loss_agg: Literal["seq-sum", "token-mean"] = "seq-sum"  # / sequences (REINFORCE) or / tokens
    num_iterations: int = arg(1, "> 0, <= 100")  # mu: updates per batch (RLOO: 1); > 1 clips
    clip_eps: float = arg(0.2, "> 0")  # mu > 1: the ratio is clipped to 1 +- eps (PPO, TRL)
    # --- sampling
    samples_per_prompt: int = arg(8, "> 0")  # k per prompt (RLOO paper 2-4, TRL 2); rloo: >= 2
    prompts_per_step: int = arg(8, "> 0")  # prompts per optimizer step (k samples each)
    max_new_tokens: int = arg(6, "> 0")  # completion length cap (the built-in task needs 4)
    # fp32 maths: logits / temperature stays finite at >= 1e-30 (for logits up to 3e8), and top_p
    # does not round to 0 at >= 1.2e-38 (fp32's smallest normal; at 0 no token would be kept)
    temperature: float = arg(1.0, ">= 1e-30")  # sampling temperature; the log-probs use it too
    top_p: float = arg(1.0, "[1.2e-38, 1]")  # nucleus sampling (TRL 1.0); < 1: O.mismatch_weights
    stop: list[str] = field(default_factory=list)  # stop strings, e.g. "</answer>", end a row too
    vllm: bool = False  # vLLM samples, in this process: TRL's use_vllm colocate (docs/speed.md)
    vllm_gpu_memory_utilization: float = arg(0.3, "(0, 1]")  # its share of GPU memory (TRL 0.3)
    vllm_kv_cache_gb: float = arg(0.0, ">= 0")  # its KV cache; 0: from the share (GPU), 1 (CPU)
    # --- the sampler/trainer mismatch correction, see objectives.mismatch_weights (grpo's flags)
    tis_cap: float = arg(0.0, ">= 0")  # loss * min(pi_old / pi_sampler, C); 0: off (TRL: 3)
    tis_mode: Literal["truncate", "mask"] = "truncate"  # truncate: min(w, C); mask: w, 0 past C
    tis_level: Literal["token", "sequence"] = "token"  # sequence: one weight, the product over o_i
    # --- model and data
    model: str = loading.DEFAULT_POLICY  # hub id or local folder of any AutoModelForCausalLM
    data: str = ""  # '' = built-in task; JSONL {"prompt", "answer"}; hf:NAME[:CONFIG]; rg:NAME
    data_split: str = "train"  # hf: datasets only: the split to read
    prompt_field: str = ""  # the rows' prompt field ('' = prompt, question or problem)
    answer_field: str = ""  # the rows' answer field ('' = answer or solution)
    system_prompt: str = ""  # a system message put before every prompt
    chat_template: Literal["auto", "none"] = "auto"  # auto: the tokenizer's template, if it has one
    trust_remote_code: bool = False  # never run a model repo's own code unless asked
    # curriculum and prompt skipping (tasks.observe), both off by default
    curriculum_up: float = arg(0.0, "[0, 1]")  # rg: level +1 at this train score (0: off; 0.8)
    curriculum_down: float = arg(0.0, "[0, 1]")  # rg: level -1 below this train score (0.3)
    skip_uniform: int = arg(0, ">= 0")  # skip prompts whose last K groups all scored alike (0: off)
    skip_keep: float = arg(0.0, "[0, 1]")  # the chance such a prompt is kept (> 0: reweighted)
    # --- tool use: multi-turn rollouts (docs/tool_use.md)
    env: str = ""  # FILE.py:FUNCTION or module:function, env(row, turns) -> str | None; calc
    tools: str = ""  # FILE.py:NAME[,NAME]: Python functions a chat model calls (its template's)
    env_timeout: float = arg(E.ENV_TIMEOUT_S, "> 0, <= 86400")  # seconds an env call may take
    max_turns: int = arg(3, ">= 1")  # model turns per episode (--env; calc: call, answer, spare)
    # --- rewards
    rewards: str = ""  # weighted, e.g. "math=1,format=0.1,rm=0.5"; '' = math, or your --reward_fn
    reward_fn: list[str] = field(default_factory=list)  # your rewards, file.py:function (README)
    reward_model: str = ""  # an AutoModelForSequenceClassification (num_labels=1), used as 'rm'
    # --- optimisation
    lr: float = arg(1e-4, "> 0")  # tiny-model lr; real models ~1e-6 (TRL, OpenRLHF)
    weight_decay: float = arg(0.0, ">= 0")  # AdamW weight decay (TRL 0, verl 0.01)
    max_grad_norm: float = arg(1.0, "> 0")  # gradient clipping (TRL, verl, OpenRLHF)
    max_steps: int = arg(300, "> 0")  # optimizer steps (times num_iterations)
    micro_batch_size: int = arg(64, "> 0")  # rows per forward; the loss is normalised per step
    lora_r: int = arg(0, ">= 0")  # LoRA rank (pip install peft); 0: full fine-tuning
    lora_alpha: int = arg(32, "> 0")  # LoRA scale: the update is alpha / r * B A (TRL examples)
    lora_dropout: float = arg(0.0, "[0, 1)")  # adapter dropout (> 0 makes log-probs noisy)
    lora_target_modules: str = "all-linear"  # comma list, or peft's every linear layer but the head
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory
    fsdp: bool = False  # torchrun: shard the trained model across processes with FSDP2 (README)
    compile: bool = False  # torch.compile policy and reference: for CUDA; no measured gain on CPU
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    threads: int = arg(0, ">= 0, <= 4 * cores")  # CPU threads; 0: 1 under 10 M params, else all
    # --- run
    seed: int = arg(0, ">= 0, < 2**63")  # seeds sampling, data order, new weights: same run
    eval_every: int = arg(100, ">= 0")  # steps between held-out evals (0: before and after only)
    eval_size: int = arg(500, "> 0")  # held-out prompts per eval
    eval_reward: Literal["auto", "math", "rewards"] = "auto"  # auto: rg score, or math on numbers
    eval_samples: int = arg(0, ">= 0, <= 1000")  # k > 0: also mean@k and pass@k of k samples
    eval_sampled: bool = False  # the held-out score "eval" is mean@k, not greedy (--env calc: on)
    save_every: int = arg(100, ">= 0")  # steps between checkpoints (0: only at the end, Ctrl-C)
    save_optimizer: bool = False  # the final checkpoint too keeps AdamW: --resume may extend it
    samples_every: int = arg(25, ">= 0")  # samples.jsonl at steps 1, 1 + this, ... (0: none)
    report_to: Literal["none", "tensorboard", "wandb", "trackio"] = "none"  # also log there
    output_dir: str = ""  # default runs/reinforce-<time>
    resume: str = ""  # a previous output_dir: continue its run from its checkpoint
    sanity: bool = False  # check log-probs, ratio, KL and masks on the real model, then exit


# --------------------------------------------------------------------------- the algorithm
def kl_returns(scores, mask, kl=None, beta=0.0, kl_in_reward="token"):
    """G_i,t with gamma = 1: the score s_i (paid at the last token) minus beta * the KL still to
    come, or the whole sequence's (kl_in_reward='sequence': TRL RLOO). scores (B,), kl (B, T)."""
    returns = scores[:, None].to(mask) * mask
    if kl is None or beta == 0:
        return returns
    kl = kl * mask  # the KL to come: token, the sum over t' >= t; sequence, over every t'
    to_come = kl.flip(-1).cumsum(-1).flip(-1) if kl_in_reward == "token" else kl.sum(-1)[:, None]
    return (returns - beta * to_come) * mask


def rloo_baseline(rewards, k):
    """b_i = mean of the other k - 1 rewards of the same prompt: (group sum - own) / (k - 1).
    k >= 2 (check_args refuses --baseline rloo with one sample per prompt)."""
    r = rewards.view(-1, k)
    return ((r.sum(1, keepdim=True) - r) / (k - 1)).view(-1)


def advantages(returns, mask, args, ema=None, scores=None, total=None):
    """A = G - b for the baseline b of args.baseline, (B, T), 0 on padding; whitened after it
    with args.whiten. ema: the running b (None: this batch's mean). scores (B,): RLOO's b from the
    other samples' scores, not their returns (OpenRLHF); k = args.samples_per_prompt. total:
    torchrun's sums, for whitening over the global batch."""
    baseline = args.baseline
    if baseline == "reinforce_pp":  # REINFORCE++: global whitening over the batch's tokens
        return C.whiten(returns, mask, total=total)
    whole = returns[:, 0]  # each sequence's whole return (every completion has a token)
    if baseline == "none":
        b = torch.zeros_like(whole)
    elif baseline == "ema":
        b = torch.full_like(whole, float(whole.mean()) if ema is None else ema)
    elif baseline == "maxrl":  # the group's mean, which also divides: (G - b) / (b + eps)
        b = whole.view(-1, args.samples_per_prompt).mean(1).repeat_interleave(
            args.samples_per_prompt)
    else:  # rloo
        b = rloo_baseline(whole if scores is None else scores.to(whole), args.samples_per_prompt)
    adv = (returns - b[:, None]) * mask
    if baseline == "maxrl":  # eps as GRPO's std's; A = 0 where b <= 0 (no success), as grpo.py
        adv = torch.where(b[:, None] > 0, adv / (b[:, None] + 1e-4), 0.0)
    return C.whiten(adv, mask, total=total) if args.whiten else adv


def reinforce_loss(logprobs, advantages, old_logprobs=None, clip_eps=0.2, is_weight=1.0):
    """-A log pi per token (B, T), the terms of -(1/N) sum A log pi (main sums them over the
    completion tokens and divides by the whole step's N); also the ratio and the clipped mask."""
    if old_logprobs is None:  # mu = 1: -A log pi_theta
        per_token = -advantages * logprobs
        ratio = torch.ones_like(logprobs)
        clipped = torch.zeros_like(logprobs)
    else:  # mu > 1: PPO's -min(rho A, clip(rho) A), the same gradient A grad log pi at rho = 1
        ratio = torch.exp(logprobs - old_logprobs)
        unclipped = ratio * advantages
        clipped_obj = ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantages
        per_token = -torch.min(unclipped, clipped_obj)
        clipped = (clipped_obj < unclipped).float()
    return per_token * is_weight, ratio, clipped  # is_weight: TIS (1: none)


def sample_grad_probe(model):
    """Variance proxy. A hook on the LM head's output records, at every backward, each row's
    gradient of the step's loss w.r.t. its own logits: exact per-sample gradients (the rows of a
    batch do not interact), at no extra pass. Times N (sequences per step) this is g_i, the
    sample's term of the batch gradient mean_i g_i, and sample_grad_rms = sqrt(mean ||g_i||^2)
    bounds the gradient's variance (tr Var(mean g) <= E||g||^2 / N). It is measured in logit space,
    not parameter space (per-parameter per-sample gradients cost a backward each): the parameter
    gradient is J_i^T g_i. On the bundled model it ranks the baselines in the same order as the
    batch gradient's covariance over 30 batches. Returns the list it fills, in micro-batch order.
    Measured while token_logprobs puts a micro-batch through the head module at once (B x T x V <=
    its chunk_elems, as on the bundled model); with a large vocabulary its chunks run the head's
    weight by hand (fastpath.LinearHeadLogprobs), nothing is recorded, and it is logged as nan."""
    norms = []

    def on_forward(module, inputs, logits):
        if logits.requires_grad:
            logits.register_hook(lambda g: norms.append(g.detach().float().flatten(1).norm(dim=1)))
    model.get_output_embeddings().register_forward_hook(on_forward)
    return norms


def check_args(args):
    flags.check_args(args)
    if args.baseline == "rloo" and args.samples_per_prompt < 2:
        raise UserError("--baseline rloo needs --samples_per_prompt >= 2: with k = 1 there is no "
                        "other sample to form the leave-one-out baseline")
    gdpo = args.multi_objective_aggregation == "normalize_then_sum"
    if gdpo and args.samples_per_prompt < 2:  # TRL gives each reward A = 0 then: nothing learns
        raise UserError("normalize_then_sum (GDPO) needs --samples_per_prompt >= 2: it "
                        "normalises each reward within a prompt's samples (one: A = 0)")
    if args.baseline == "maxrl" and (gdpo or args.beta > 0):  # MaxRL's b is a success rate
        raise UserError("--baseline maxrl divides by the mean return, a success rate in [0, 1]"
                        ": " + ("GDPO's normalised rewards (mean 0)" if gdpo else "the KL "
                        "penalty in the return (--beta > 0)") + " would make it near 0 or "
                        "negative; use another --baseline" + ("" if gdpo else " or --beta 0"))


# -------------------------------------------------------------------------- the training loop
def main():
    # The flags (--resume DIR: that run's own settings), the tool environment (--env, --tools;
    # None without), your reward functions by name and the --rewards weights. MaxRL divides by
    # the mean reward, so rewards that can be < 0 are refused.
    args = flags.parse_args(Args, "reinforce", __doc__)
    check_args(args)
    env = E.from_args(args)
    fns = loading.load_reward_fns(args.reward_fn)
    weights = loading.parse_rewards(args.rewards, args.reward_model, fns, default="math")
    if args.baseline == "maxrl":
        flags.check_maxrl(weights, "--baseline maxrl")
    # The prompts: a file, a hub dataset, rg: or the built-in task (--env calc: its own sums);
    # rg:'s curriculum moves the difficulty, --skip_uniform skips prompts already learned.
    data = E.task_data(args, tasks.load_data(
        args.data, args.eval_size, "math" in weights, args.data_split,
        curriculum=(args.curriculum_up, args.curriculum_down),
        skip=(args.skip_uniform, args.skip_keep), prompt_field=args.prompt_field,
        answer_field=args.answer_field, system_prompt=args.system_prompt))
    # This process's device (torchrun: its own), the output folder with its lock, metrics files
    # and Ctrl-C handler, the seeds; bf16 autocast on a GPU, with fp32 weights.
    device = R.setup_distributed()
    run = R.start_run(args, "reinforce")
    rng = R.seed_everything(args.seed)
    amp = loading.autocast(device, args.dtype)
    # The policy (a checkpoint when resuming), once the prompts and --tools are checked; on a
    # CPU one thread for a small model (runs.set_threads). The reference pi_ref: none at beta = 0;
    # with LoRA the policy itself, adapters off. --rewards rm: the reward model's score.
    model, tok = loading.load_policy(args, device, f"{run.dir}/checkpoint" if args.resume else "",
                                     data.rows, env)
    R.set_threads(args, model)
    ref = None
    if args.beta > 0 or args.sanity:
        ref = model if args.lora_r else loading.load_model(
            args.model, "lm", device, frozen=True, trust_remote_code=args.trust_remote_code,
            compile=args.compile)
    if "rm" in weights:
        fns["rm"] = loading.load_reward_model(args, device)
    if args.sanity:
        failed = R.sanity_check(model, ref, tok, data.eval_rows, args, env)
        raise SystemExit(2 if failed else 0)
    sampler = V.Sampler(args, model, tok, device) if args.vllm else None  # --vllm: vLLM samples
    # The training forward's model (torchrun: DDP, or FSDP2 with --fsdp) and AdamW over what is
    # trained (every weight, or LoRA's adapters), fused: one kernel for all parameters.
    train_model = R.wrap_model(model, args.fsdp)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=args.weight_decay, fused=True)

    # The held-out score (accuracy, a reasoning-gym score or the mean reward) and what scores
    # it; under torchrun each process scores a share. A new run evaluates once before training;
    # a resumed one restores the optimizer, RNGs, the ema baseline's running value (None until
    # the first step) and the data's state (curriculum levels, prompts' visits).
    metric = tasks.eval_metric(data.eval_rows, args.eval_reward)
    scored = tasks.scored_by(metric, weights, fns)

    def evaluate():
        return R.split_eval(run, model, data.eval_rows, lambda rows: C.evaluate(
            model, tok, rows, args, amp, scored, fns, env=env, sampler=sampler))
    start, eval_before, saved = R.resume_or_eval(run, opt, rng, evaluate, metric, [model])
    ema = saved.get("ema")
    data.state.update(saved.get("data_state", {}))

    # checkpoint/ after `done` steps: every --save_every, at the end, on Ctrl-C
    def save(done):
        R.save_checkpoint(run, model, tok, opt, rng, done,
                          {"eval_before": eval_before, "ema": ema, "data_state": data.state})
    # log pi_old is needed for the KL and for mu > 1; rloo compares the scores, the KL apart
    # (per_token_kl); tis: the mismatch correction (0: off). logged: the token means summed over
    # the step; token_means: those averaged over every process, weighted by tokens.
    grad_norms = sample_grad_probe(model)
    k = args.samples_per_prompt
    needs_old = ref is not None or args.num_iterations > 1
    per_token_kl = ref is not None and args.kl_in_reward == "token"
    tis = (args.tis_cap, args.tis_mode, args.tis_level)
    logged = ("ratio", "clip_frac", "entropy", "is_ratio", "is_frac_out")
    token_means = ("kl", "adv_mean") + logged
    # The run-keeping (Ctrl-C, the NaN guards, logs, eval, warnings, checkpoints) is keep's:
    # each keep.* call below is one of its duties (runs.Keeper); what is left is the algorithm.
    keep = R.Keeper(run, opt, rng, save, evaluate, data.state)
    for step in keep.steps(start):
        # 1. sample k completions per prompt (k contiguous rows each; under torchrun this
        # process's share of the prompts; with an env, multi-turn episodes) and score them. The
        # data's bookkeeping (curriculum, skips: tasks.observe) sees the scores.
        prompts = data.next_batch(rng, args.prompts_per_step)[run.rank::run.world]
        rows = [r for r in prompts for _ in range(k)]
        with keep.sampling(model, step):
            roll, completions = C.generate(model, tok, rows, args, amp, env, sampler=sampler)
        scores, parts = C.compute_rewards(rows, completions, weights, fns)
        data_logs = data.observe(rows, scores, parts, k)
        # signal, what the returns are made of: the weighted sum of the rewards, or GDPO's (each
        # reward normalised first). A NaN/inf reward in any process: no update this step.
        signal = scores
        if args.multi_objective_aggregation == "normalize_then_sum":
            signal = O.normalize_then_sum(parts, weights, k, std=R.global_std)
        if not keep.finite(scores.sum(), what="reward"):
            continue
        # mask (B, T): 1 on each completion token, EOS included. log pi_old, recomputed with the
        # training forward: needed for the KL and for mu > 1; log pi_ref: with LoRA the policy
        # with its adapters off
        mask = roll.completion_mask
        B, T = mask.shape
        old_logprobs = C.batched_logprobs(model, roll, args.temperature, args.micro_batch_size,
                                          amp) if needs_old else None
        kl = None
        if ref is not None:
            with R.adapters_off(ref):
                ref_logprobs = C.batched_logprobs(ref, roll, args.temperature,
                                                  args.micro_batch_size, amp)
            kl = C.kl_estimate(old_logprobs, ref_logprobs, args.kl_estimator) * mask
        # 2. returns and advantages, (B, T). The ema baseline b is the running mean return of
        # earlier steps (at the first step this step's own, once); mean_return is this step's,
        # over every process's rows.
        returns = kl_returns(signal.to(device), mask, kl, args.beta, args.kl_in_reward)
        b_ema = ema
        if args.baseline == "ema":
            mean_return = R.global_mean({"R": float(returns[:, 0].mean())})["R"]
            b_ema = mean_return if ema is None else ema
        adv = advantages(returns, mask, args, b_ema, signal if per_token_kl else None,
                         total=R.global_sum)
        # 3. mu optimizer steps. The losses' normalisers count the whole step, every process's
        # tokens and sequences (R.global_sum: under torchrun the sum over the processes), so
        # neither micro-batches nor processes change the gradient. For the logs: n_local, this
        # process's tokens; sums, the logged means summed; is_max, the largest pi_old / pi_sampler.
        n_tokens = R.global_sum(mask.sum()).clamp(min=1)
        n_seqs = R.global_sum(B)
        n_local = mask.sum().clamp(min=1)
        sums = dict.fromkeys(("loss",) + logged, 0.0)
        is_max = 0.0
        grad_norms.clear()
        for it in range(args.num_iterations):
            # micro-batches: row indices, sorted by length; every per-row tensor is indexed by
            # them. DDP averages the processes' gradients in the last one's backward only.
            mbs = C.micro_batches(mask, args.micro_batch_size)
            for i, mb in enumerate(mbs):
                with R.sync_gradients(train_model, now=i == len(mbs) - 1):
                    with amp:
                        logprobs, entropy = C.token_logprobs(train_model, roll.ids[mb],
                                                             roll.attention_mask[mb], T,
                                                             args.temperature, entropy=True)
                    # entropy (B, T) has a gradient, as logprobs do; here it is only logged, so
                    # its graph goes. An entropy bonus: delete this line and, before backward,
                    # loss = loss - coef * (entropy * mask[mb]).sum() / norm (ppo's ent_coef)
                    entropy = entropy.detach()
                    old = old_logprobs[mb] if args.num_iterations > 1 else None
                    # pi_old / pi_sampler: logged raw; with --tis_cap, the loss's weight
                    is_weight, is_ratio = O.mismatch_weights(
                        logprobs.detach() if old is None else old, roll.sample_logprobs[mb],
                        mask[mb], *tis)
                    loss, ratio, clipped = reinforce_loss(logprobs, adv[mb], old, args.clip_eps,
                                                          is_weight)
                    # N: the step's sequences (seq-sum) or tokens; micro-batches add up to it
                    # (TRL #3021)
                    norm = n_seqs if args.loss_agg == "seq-sum" else n_tokens
                    loss = (loss * mask[mb]).sum() / norm
                    # gradients add up over the micro-batches. DDP (FSDP2) averages the
                    # processes' gradients: scaled by their number, that is the whole step's sum
                    (loss * run.world).backward()
                # the logged token means; out: pi_old / pi_sampler off by more than a factor 2;
                # the loss summed over the processes
                out = ((is_ratio < 0.5) | (is_ratio > 2)).float()
                for key, x in zip(logged, (ratio, clipped, entropy, is_ratio, out)):
                    sums[key] += float((x.detach() * mask[mb]).sum() / n_local)
                is_max = max(is_max, float((is_ratio * mask[mb]).max()))
                sums["loss"] += loss.item() * run.world
            # a NaN/inf gradient norm would ruin the weights: keep skips that update
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            if keep.finite(grad_norm):
                opt.step()
            opt.zero_grad(set_to_none=True)
        if sampler:  # --vllm: the updated weights into its engine, for the next samples
            sampler.load_weights(model)
        # the ema baseline, updated after use (b never depends on this batch's samples) and
        # after the update (a Ctrl-C before it saves the ema the last step left)
        if args.baseline == "ema":
            ema = b_ema if ema is None else (args.ema_decay * ema
                                             + (1 - args.ema_decay) * mean_return)
        # 4. log, eval, checkpoint. The token means are the mean of the mu updates'; adv_std
        # is over every process; g_i: each sample's term of the first update's gradient (times
        # N, the step's sequences), logged as sample_grad_rms, the root of the mean of
        # ||g_i||^2 over the step's rows (equal in every process)
        valid = mask.bool()
        g = torch.cat(grad_norms)[:B] * n_seqs / run.world if grad_norms else torch.tensor(math.nan)
        metrics = {**keep.rollout_metrics(roll, rows, completions, scores, parts, env),
                   **data_logs,
                   "frac_zero_std": float((scores.view(-1, k).std(1) < 1e-6).float().mean())
                   if k > 1 else 0.0,
                   "kl": float(C.masked_mean(kl, mask)) if kl is not None else 0.0,
                   **{key: v / args.num_iterations for key, v in sums.items()},
                   "is_ratio_max": is_max, "grad_norm": float(grad_norm),
                   "adv_mean": float(adv[valid].mean()),
                   "adv_std": float(R.global_std(adv[valid])),
                   "sample_grad_rms": float((R.global_sum(g.pow(2).mean()) / run.world).sqrt()),
                   **({"baseline_ema": ema} if args.baseline == "ema" else {})}
        # samples.jsonl: one sample of each of 4 prompts; under torchrun: the mean over the
        # processes, token means weighted by their tokens
        samples = keep.samples(tok, roll, rows, roll.transcript if env else completions, scores, k)
        keep.end_step(step, metrics, samples, mask.sum(), dict.fromkeys(token_means, mask.sum()))
    keep.finish(metric, eval_before)


if __name__ == "__main__":
    R.main_guard(main)
