"""grpo.py: Group Relative Policy Optimization (Shao et al., DeepSeekMath, 2024), with the
Dr. GRPO and DAPO switches.

For each prompt q, sample a group of G completions o_1..o_G (a group is G contiguous rows of the
batch), score each with a reward r_i, and give every token of o_i the same advantage: its reward
normalised within the group. There is no critic and no value model.

    A_i      = (r_i - mean(r_1..r_G)) / (std(r_1..r_G) + eps)                  group_advantages()
    rho_i,t  = pi_theta(o_i,t | q, o_i,<t) / pi_old(o_i,t | q, o_i,<t)     (the importance ratio)
    L_i,t    = -min(rho_i,t A_i, clip(rho_i,t, 1 - eps_low, 1 + eps_high) A_i)
               + beta * k(pi_theta, pi_ref)_i,t                                  per_token_loss()
    loss     = aggregate(L) over the whole optimizer step                             aggregate()

pi_old: the policy that sampled the batch; pi_ref: a frozen copy of the starting policy. With
num_iterations = 1 (DeepSeekMath's default) pi_old = pi_theta: rho = 1, the logged loss sits near 0
(A averages to 0), not its gradient A grad log pi: watch reward, kl, clip_frac (TRL #2703, #3452).

The KL term sits in the loss, where its gradient depends on the estimator k (common.kl_estimate,
gradients in per_token_loss): k1 has expected gradient 0, so it is refused; k2 pulls along the
reverse KL(pi_theta || pi_ref), k3 along the forward KL(pi_ref || pi_theta) (DeepSeekMath's).

Switches: Dr. GRPO (Liu et al. 2025) = --scale_rewards none --loss_agg seq-sum-norm --beta 0;
DAPO (Yu et al. 2025) = --clip_eps_high 0.28 --loss_agg token-mean --dynamic_sampling
--overlong_penalty 1 --beta 0. Since DAPO (docs/policy_losses.md): GSPO =
--importance_sampling_level sequence --beta 0; CISPO = --policy_loss cispo; SAPO = --policy_loss
sapo; sampler/trainer mismatch correction (TIS) = --tis_cap 2; DPPO with prime-rl's sampler
penalty = --policy_loss dppo --sampler_kl_coef 1e-3 --beta 0; DeepSeek-V3.2 = --off_policy_mask
0.5 --unbiased_kl; GDPO = --multi_objective_aggregation normalize_then_sum; LUSPO =
--importance_sampling_level sequence --loss_agg seq-sum; VESPO = --policy_loss vespo; MaxRL =
--scale_rewards mean.

Run:  python grpo.py                     # bundled tiny model and task, CPU, under a minute
      python grpo.py --model Qwen/Qwen2.5-0.5B-Instruct --data my.jsonl --max_new_tokens 256 \\
          --lr 1e-6 --micro_batch_size 16    # micro-batches change memory, not the gradient
Expect (bundled default, 2-core CPU): held-out greedy accuracy from 0.29 to about 0.99.
"""
from plumbing import ctrl_c  # noqa: F401  (first: Ctrl-C while torch loads is one line)
import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

import common as C
from plumbing.errors import UserError
import objectives as O  # the objectives since DAPO (docs/policy_losses.md)
from plumbing import envs as E
from plumbing import flags
from plumbing.flags import arg  # an Args field with its valid range
from plumbing import loading
from plumbing import runs as R
from plumbing import tasks
from plumbing import vllm_sampler as V

Aggregation = Literal["sum_then_normalize", "normalize_then_sum"]  # several --rewards: TRL's
LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-sum-norm", "seq-sum"]  # aggregate()


@dataclass
class Args:
    # the objective's own fields first (the docstring's equations), then sampling, then the
    # objectives since DAPO (one block: skip it on a first read), then model and data, rewards,
    # optimisation and the run; --help lists them in a user's order (flags.HELP_ORDER)
    # --- the GRPO objective
    beta: float = arg(0.04, ">= 0")  # KL weight in the loss; 0: no reference model (DeepSeekMath)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # k3: DeepSeekMath; k2: reverse KL; k1 refused
    clip_eps: float = arg(0.2, "> 0")  # eps_low: the ratio is clipped below 1 - eps_low (PPO)
    clip_eps_high: float = arg(0.2, "> 0")  # eps_high: clipped above at 1 + eps_high (DAPO: 0.28)
    num_iterations: int = arg(1, "> 0, <= 100")  # mu: updates per batch (DeepSeekMath: 1)
    loss_agg: LossAgg = "token-mean"  # see aggregate(): token-mean DAPO, TRL; seq-sum LUSPO
    scale_rewards: Literal["group", "batch", "none", "mean"] = "group"  # none: Dr.GRPO, mean: MaxRL
    mask_truncated: bool = False  # completions with no EOS carry no loss (DAPO overlong filtering)
    overlong_penalty: float = arg(0.0, ">= 0")  # DAPO soft overlong punishment (its maximum)
    overlong_buffer: int = arg(2, "> 0")  # the overlong penalty grows over these last tokens
    dynamic_sampling: bool = False  # DAPO: drop groups whose rewards are all equal, sample more
    max_resample_rounds: int = arg(4, ">= 0, <= 100")  # dynamic_sampling: extra sampling rounds
    # --- sampling
    group_size: int = arg(8, "> 0")  # G samples per prompt (DeepSeekMath 64, TRL 8, DAPO 16)
    prompts_per_step: int = arg(8, "> 0")  # prompts per optimizer step (G samples each)
    max_new_tokens: int = arg(6, "> 0")  # completion length cap (TRL 256-512; the task needs 4)
    # fp32 maths: logits / temperature stays finite at >= 1e-30 (for logits up to 3e8), and top_p
    # does not round to 0 at >= 1.2e-38 (fp32's smallest normal; at 0 no token would be kept)
    temperature: float = arg(1.0, ">= 1e-30")  # sampling temperature; the log-probs use it too
    top_p: float = arg(1.0, "[1.2e-38, 1]")  # nucleus sampling (TRL 1.0); < 1: O.mismatch_weights
    stop: list[str] = field(default_factory=list)  # stop strings, e.g. "</answer>", end a row too
    vllm: bool = False  # vLLM samples, in this process: TRL's use_vllm colocate (docs/speed.md)
    vllm_gpu_memory_utilization: float = arg(0.3, "(0, 1]")  # its share of GPU memory (TRL 0.3)
    vllm_kv_cache_gb: float = arg(0.0, ">= 0")  # its KV cache; 0: from the share (GPU), 1 (CPU)
    # --- objectives since DAPO, see objectives.py (TRL's names in brackets)
    # dppo reads clip_eps, clip_eps_high as delta_low, delta_high on pi_theta - pi_sampler (0.2)
    policy_loss: Literal["clip", "cispo", "sapo", "dppo", "vespo"] = "clip"  # [loss_type]
    importance_sampling_level: Literal["token", "sequence"] = "token"  # sequence: GSPO [same name]
    seq_clip_eps: float = arg(3e-4, "> 0")  # sequence level: s_i >= 1 - this (GSPO paper: 3e-4)
    seq_clip_eps_high: float = arg(4e-4, "> 0")  # sequence level: s_i <= 1 + this (GSPO: 4e-4)
    # SAPO's gate sigmoid(tau (rho - 1)) 4 / tau in fp32 (max 3.4e38): at tau >= 1e-30, 4 / tau
    # times a step's advantages stays finite (1e-40: NaN losses); at tau <= 1e30, tau (rho - 1) too
    sapo_tau_pos: float = arg(1.0, "[1e-30, 1e30]")  # gate temperature, A > 0 (SAPO; TRL: 1.0)
    sapo_tau_neg: float = arg(1.05, "[1e-30, 1e30]")  # the same, A <= 0 (TRL: 1.05)
    tis_cap: float = arg(0.0, ">= 0")  # loss * min(pi_old / pi_sampler, C); 0: off (TRL: 3)
    tis_mode: Literal["truncate", "mask"] = "truncate"  # truncate: min(w, C); mask: w, 0 past C
    tis_level: Literal["token", "sequence"] = "token"  # sequence: one weight, the product over o_i
    # VESPO's weight phi(w) = w^k exp(lambda (1 - w)) of the sequence ratio w, by A's sign (TRL's)
    vespo_k_pos: float = arg(2.0, ">= 0")  # k for A >= 0 (VESPO, TRL: 2) [vespo_k_pos]
    vespo_lambda_pos: float = arg(3.0, ">= 1e-4")  # lambda for A >= 0 (TRL: 3; >= 1e-4 as TRL)
    vespo_k_neg: float = arg(3.0, ">= 0")  # k for A < 0 (TRL: 3)
    vespo_lambda_neg: float = arg(2.0, ">= 1e-4")  # lambda for A < 0 (TRL: 2)
    # DeepSeek-V3.2: drop o_i if A_i < 0 and its mean log(pi_sampler / pi_theta) > this
    off_policy_mask: float | None = arg(None, ">= 0")  # off (TRL: 0.5) [off_policy_mask_threshold]
    unbiased_kl: bool = False  # beta's KL term times rho (DeepSeek-V3.2) [use_bias_correction_kl]
    dppo_ratio_cap: float = arg(0.0, ">= 0")  # dppo: sg(rho_s) capped at C (DPPO authors 3); 0 off
    sampler_kl_coef: float = arg(0.0, ">= 0")  # kappa (log pi_theta/pi_sampler)^2 (prime-rl: 1e-3)
    multi_objective_aggregation: Aggregation = "sum_then_normalize"  # normalize_then_sum: GDPO
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
    lr: float = arg(1e-4, "> 0")  # tiny-model lr; real models ~1e-6 (DeepSeekMath, TRL)
    weight_decay: float = arg(0.0, ">= 0")  # AdamW weight decay (TRL 0, verl 0.01)
    max_grad_norm: float = arg(1.0, "> 0")  # gradient clipping (TRL, verl, OpenRLHF)
    max_steps: int = arg(200, "> 0")  # optimizer steps (times num_iterations)
    micro_batch_size: int = arg(64, "> 0")  # rows per forward; the loss is normalised per step
    lora_r: int = arg(0, ">= 0")  # LoRA rank (pip install peft); 0: full fine-tuning
    lora_alpha: int = arg(32, "> 0")  # LoRA scale: the update is alpha / r * B A (TRL examples)
    lora_dropout: float = arg(0.0, "[0, 1)")  # adapter dropout (> 0 makes log-probs noisy)
    lora_target_modules: str = "all-linear"  # comma list, or peft's every linear layer but the head
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory
    fsdp: bool = False  # torchrun: shard the trained model across processes with FSDP2 (README)
    compile: bool = False  # torch.compile policy and reference: for CUDA; no measured gain on CPU
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    sample_dtype: Literal["same", "bf16", "fp32"] = "same"  # bf16: sample in bf16, a mismatch
    threads: int = arg(0, ">= 0, <= 4 * cores")  # CPU threads; 0: 1 under 10 M params, else all
    # --- run
    seed: int = arg(0, ">= 0, < 2**63")  # seeds sampling, data order, new weights: same run
    eval_every: int = arg(50, ">= 0")  # steps between held-out evals (0: before and after only)
    eval_size: int = arg(500, "> 0")  # held-out prompts per eval
    eval_reward: Literal["auto", "math", "rewards"] = "auto"  # auto: rg score, or math on numbers
    eval_samples: int = arg(0, ">= 0, <= 1000")  # k > 0: also mean@k and pass@k of k samples
    eval_sampled: bool = False  # the held-out score "eval" is mean@k, not greedy (--env calc: on)
    save_every: int = arg(100, ">= 0")  # steps between checkpoints (0: only at the end, Ctrl-C)
    save_optimizer: bool = False  # the final checkpoint too keeps AdamW: --resume may extend it
    samples_every: int = arg(25, ">= 0")  # samples.jsonl at steps 1, 1 + this, ... (0: none)
    report_to: Literal["none", "tensorboard", "wandb", "trackio"] = "none"  # also log there
    output_dir: str = ""  # default runs/grpo-<time>
    resume: str = ""  # a previous output_dir: continue its run from its checkpoint
    sanity: bool = False  # check log-probs, ratio, KL and masks on the real model, then exit


# --------------------------------------------------------------------------- the algorithm
def group_advantages(rewards, group_size, scale="group", eps=1e-4, std=torch.std):
    """A_i = r_i - its group's mean, over the group's std (GRPO), the batch's (std: runs.global_std
    under torchrun), 1 (Dr. GRPO) or the group's mean (MaxRL, arXiv 2602.02710: with 0/1 rewards,
    the mean of the successes' grad log pi, the gradient of log pass@1). rewards (B,), groups of
    contiguous rows -> (B,)."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(1, keepdim=True)
    if scale == "group":
        adv = adv / (r.std(1, keepdim=True) + eps)
    elif scale == "batch":
        adv = adv / (std(rewards) + eps)
    elif scale == "mean":
        # MaxRL, as AllenAI's open-instruct and Google's Tunix: (r - mean) / (mean + eps), and
        # A = 0 where the mean is <= 0 (no success; a reward < 0 would flip A's sign)
        mean = r.mean(1, keepdim=True)
        adv = torch.where(mean > 0, adv / (mean + eps), 0.0)
    return adv.view(-1)


def zero_std_groups(rewards, group_size):
    """(groups,) bool: all G rewards equal, so group_advantages gives the whole group A = 0."""
    return rewards.view(-1, group_size).std(1) < 1e-6


def per_token_loss(logprobs, old_logprobs, advantages, mask, args, ref_logprobs=None,
                   is_weight=1.0, sample_logprobs=None):
    """The policy loss per token plus beta * k to the reference (GRPO: KL in the loss). logprobs,
    old_logprobs, ref_logprobs, mask (B, T); advantages A (B,); args: the objective's switches
    (Args). k2's gradient pulls along the reverse KL(pi_theta || pi_ref), k3's the forward
    KL(pi_ref || pi_theta) (docs/algorithms.md). is_weight: O.mismatch_weights'. Returns the loss
    (B, T) and what to log, (B, T) each: ratio, kl, clip_frac (where the clip acted).
    sample_logprobs (the sampler's): for objectives.per_token_loss, which main() calls in this
    one's place (same arguments, same returns) when a flag since DAPO is on."""
    ratio = torch.exp(logprobs - old_logprobs)  # rho = pi_theta / pi_old, per token
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1 - args.clip_eps, 1 + args.clip_eps_high) * adv
    # PPO's and GRPO's -min(rho A, clip(rho, 1 - eps_low, 1 + eps_high) A); where the min takes
    # the clipped branch, the token's gradient is 0 (logged: clip_frac)
    loss = -torch.min(unclipped, clipped)
    is_clipped = (clipped < unclipped).float()
    kl = torch.zeros_like(logprobs) if ref_logprobs is None else C.kl_estimate(
        logprobs, ref_logprobs, args.kl_estimator)
    loss = loss * is_weight + args.beta * kl  # is_weight: the mismatch correction (1: off)
    return loss, {"kl": kl, "ratio": ratio, "clip_frac": is_clipped}


def aggregate(loss, mask, loss_agg, n_tokens, n_seqs, max_new_tokens):
    """This micro-batch's share of the step's loss. The normalisers (n_tokens, n_seqs) count the
    whole optimizer step, so micro-batching does not change the gradient (TRL issue #3021)."""
    if loss_agg == "token-mean":  # DAPO, TRL: sum over tokens / the step's tokens
        return (loss * mask).sum() / n_tokens  # a long answer weighs more
    if loss_agg == "seq-mean-token-mean":  # GRPO: mean over sequences of their token means
        return ((loss * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum() / n_seqs
    if loss_agg == "seq-sum":  # LUSPO: sum over tokens / sequences (GSPO's loss x |o_i|)
        return (loss * mask).sum() / n_seqs
    # seq-sum-norm (Dr. GRPO): sum over all tokens / (sequences * max_new_tokens), a constant
    return (loss * mask).sum() / (n_seqs * max_new_tokens)


def cat_rollouts(pieces):
    """Concatenate (rollout, kept row indices) pieces into one rollout: prompts re-left-padded,
    completions right-padded (ids 0; masks come from lengths), other fields concatenated. One
    piece of every row (dynamic_sampling off) is the rollout as sampled."""
    if len(pieces) == 1 and len(pieces[0][1]) == len(pieces[0][0].ids):
        return pieces[0][0]
    P = max(r.P for r, _ in pieces)
    T = max(r.completion_mask.shape[1] for r, _ in pieces)
    out = {"P": P}
    for key in (f.name for f in dataclasses.fields(C.Rollout)):
        x = getattr(pieces[0][0], key)
        if x is None or key == "P":  # a field not filled (a single-turn run's episodes)
            continue
        if isinstance(x, list):  # multi-turn fields: texts per row
            out[key] = [getattr(r, key)[j] for r, i in pieces for j in i.tolist()]
        elif torch.is_tensor(x) and x.dim() == 2:  # right-padded to T columns
            prompt = key in ("ids", "attention_mask")  # and left-padded to P first
            out[key] = torch.cat([F.pad(getattr(r, key)[i.to(x.device)],
                                      (P - r.P if prompt else 0, T - r.completion_mask.shape[1]))
                                  for r, i in pieces])
        elif torch.is_tensor(x):
            out[key] = torch.cat([getattr(r, key)[i.to(x.device)] for r, i in pieces])
        elif isinstance(x, dict):  # the reward parts by name, (B,) each
            out[key] = {k: torch.cat([getattr(r, key)[k][i.to(v.device)] for r, i in pieces])
                        for k, v in x.items()}
        else:  # a field this does not know how to split by rows: say so, not drop it
            raise TypeError(f"cat_rollouts: rollout field {key!r} is a {type(x).__name__}")
    return C.Rollout(**out)


def sample_groups(generate, score, data, rng, run, args):
    """G scored completions per prompt: generate(rows) -> (rollout, texts), score(rows, texts) ->
    (rewards (B,), reward parts). dynamic_sampling (DAPO): groups of equal rewards are dropped and
    more are sampled. Returns the kept rollout and every round's rollout, the dropped groups' too,
    each with its rows, texts, rewards (B,) and reward parts."""
    G = args.group_size
    want = args.prompts_per_step * G // run.world  # this process's share
    pieces, kept = [], 0  # each round's (rollout, the rows it keeps); the rows kept
    for _ in range(1 + (args.max_resample_rounds if args.dynamic_sampling else 0)):
        # this process's share of the step's prompts (torchrun), each G times
        prompts = data.next_batch(rng, args.prompts_per_step)[run.rank::run.world]
        rows = [r for r in prompts for _ in range(G)]
        roll, texts = generate(rows)
        rewards, parts = score(rows, texts)
        # DAPO's soft overlong punishment: 0 until the last overlong_buffer tokens, then linear
        if args.overlong_penalty:
            length = roll.completion_mask.sum(-1).cpu()
            over = (length - args.max_new_tokens + args.overlong_buffer).clamp(min=0)
            rewards = rewards - args.overlong_penalty * over / args.overlong_buffer
        roll.rows, roll.texts, roll.rewards, roll.parts = rows, texts, rewards, parts
        # the groups with a signal (unequal rewards); without dynamic_sampling, every group
        keep = ~zero_std_groups(rewards, G) | (not args.dynamic_sampling)
        idx = keep.repeat_interleave(G).nonzero().squeeze(-1)[:want - kept]
        pieces.append((roll, idx))
        kept += len(idx)
        if kept >= want:
            break
    rounds = cat_rollouts([(r, torch.arange(len(r.rows))) for r, _ in pieces])
    # no group had a signal, even after resampling: keep the last round (every A = 0)
    return cat_rollouts(pieces if kept else [(roll, torch.arange(len(rows)))]), rounds


def check_args(args):
    flags.check_args(args)
    if args.group_size < 2:
        raise UserError("--group_size must be >= 2: a group of one has no relative advantage")
    if args.kl_estimator == "k1" and args.beta > 0:
        raise UserError("--kl_estimator k1 in the loss has zero expected gradient (E[grad log pi]"
                        " = 0): it only adds noise. Use k2 (reverse KL) or k3 (forward KL)")
    if args.policy_loss in ("dppo", "vespo") and args.importance_sampling_level == "sequence":
        raise UserError(f"--policy_loss {args.policy_loss} forms its own ratio: leave "
                        "--importance_sampling_level token")
    if args.multi_objective_aggregation == "normalize_then_sum" and args.scale_rewards == "mean":
        raise UserError("--scale_rewards mean (MaxRL) with normalize_then_sum (GDPO): GDPO "
                        "scales each reward by its own std (as TRL), so MaxRL would be ignored")
    if args.multi_objective_aggregation == "normalize_then_sum" and args.overlong_penalty:
        raise UserError("--overlong_penalty with normalize_then_sum (GDPO): the penalty is not "
                        "one of the --rewards to normalise; write it as a --reward_fn")
    n = args.prompts_per_step * args.group_size
    if n % args.micro_batch_size:
        raise UserError(f"--micro_batch_size {args.micro_batch_size} must divide "
                        f"prompts_per_step * group_size = {n}")


# -------------------------------------------------------------------------- the training loop
def main():
    # The flags (--resume DIR: that run's own settings), the tool environment (--env, --tools;
    # None without), your reward functions by name and the --rewards weights. MaxRL divides by
    # the group's mean reward, so rewards that can be < 0 are refused.
    args = flags.parse_args(Args, "grpo", __doc__)
    check_args(args)
    env = E.from_args(args)
    fns = loading.load_reward_fns(args.reward_fn)
    weights = loading.parse_rewards(args.rewards, args.reward_model, fns, default="math")
    if args.scale_rewards == "mean":
        flags.check_maxrl(weights, "--scale_rewards mean", args.overlong_penalty)
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
    run = R.start_run(args, "grpo")
    rng = R.seed_everything(args.seed)
    amp = loading.autocast(device, args.dtype)
    sample_amp = amp if args.sample_dtype == "same" else loading.autocast(device, args.sample_dtype)
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
    # a resumed one restores the optimizer, RNGs and the data's state (curriculum, visits).
    metric = tasks.eval_metric(data.eval_rows, args.eval_reward)
    scored = tasks.scored_by(metric, weights, fns)

    def evaluate():
        return R.split_eval(run, model, data.eval_rows, lambda rows: C.evaluate(
            model, tok, rows, args, amp, scored, fns, env=env, sampler=sampler))
    start, eval_before, saved = R.resume_or_eval(run, opt, rng, evaluate, metric, [model])
    data.state.update(saved.get("data_state", {}))
    if args.num_iterations == 1 and run.rank == 0:
        print("note: num_iterations=1, so pi_old = pi_theta and the ratio is exactly 1: the logged "
              "loss stays near 0 while its gradient does not. Watch reward, kl and clip_frac.")
    # The mismatch correction (--tis_cap 0: off). A flag since DAPO (GSPO, CISPO, SAPO, DPPO,
    # VESPO, V3.2, sampler penalty) puts objectives.py's loss in place of per_token_loss, with
    # the same arguments (None: GRPO's own). token_means: the logged means over the step's
    # tokens (under torchrun weighted by each process's tokens).
    tis = (args.tis_cap, args.tis_mode, args.tis_level)
    objective = O.loss_for(args)
    G = args.group_size
    token_means = ("kl", "ratio", "clip_frac", "entropy", "is_ratio", "is_frac_out")

    # generate(rows): one completion per row (with an env: a multi-turn episode) and the texts
    # the rewards read; score(rows, texts): the weighted reward (B,) and each of its parts;
    # save: checkpoint/ after `done` steps (every --save_every, at the end, on Ctrl-C).
    generate = functools.partial(C.generate, model, tok, args=args, amp=sample_amp, env=env,
                                 sampler=sampler)
    score = functools.partial(C.compute_rewards, weights=weights, fns=fns)

    def save(done):
        R.save_checkpoint(run, model, tok, opt, rng, done,
                          {"eval_before": eval_before, "data_state": data.state})
    # The run-keeping (Ctrl-C, the NaN guards, logs, eval, warnings, checkpoints) is keep's:
    # each keep.* call below is one of its duties (runs.Keeper); what is left is the algorithm.
    keep = R.Keeper(run, opt, rng, save, evaluate, data.state)
    for step in keep.steps(start):
        # 1. sample G completions per prompt and score them
        with keep.sampling(model, step):
            roll, rounds = sample_groups(generate, score, data, rng, run, args)
        # the data's bookkeeping (curriculum, skips) sees every group sampled, dropped ones too.
        # A NaN/inf reward in any process: no update this step.
        data_logs = data.observe(rounds.rows, rounds.rewards, rounds.parts, G)
        if not keep.finite(roll.rewards.sum(), what="reward"):
            continue
        # 2. advantages, one per completion (B,): GRPO's group_advantages, or GDPO's (each
        # reward normalised first). Under torchrun the std is the whole step's (R.global_std).
        if args.multi_objective_aggregation == "normalize_then_sum":
            advantages = O.normalize_then_sum(roll.parts, weights, G, std=R.global_std)
        else:
            advantages = group_advantages(roll.rewards, G, args.scale_rewards, std=R.global_std)
        advantages = advantages.to(device)
        # DAPO's overlong filtering (--mask_truncated): no loss on a completion without an EOS
        mask = roll.completion_mask  # (B, T): 1 on each completion token, EOS included
        if args.mask_truncated:
            mask = mask * (~roll.truncated)[:, None].float()
        # log pi_old for mu > 1 (mu = 1: the training forward's own, detached): the trainer's
        # forward, not the sampler's sample_logprobs, which differ by rounding (logged: is_ratio).
        # log pi_ref: with LoRA the policy with its adapters off; none at beta 0
        old_logprobs = C.batched_logprobs(model, roll, args.temperature, args.micro_batch_size,
                                          amp) if args.num_iterations > 1 else None
        with R.adapters_off(ref):
            ref_logprobs = None if ref is None else C.batched_logprobs(
                ref, roll, args.temperature, args.micro_batch_size, amp)
        # 3. mu optimizer steps. The losses' normalisers count the whole step, every process's
        # tokens and sequences (R.global_sum: under torchrun the sum over the processes), so
        # neither micro-batches nor processes change the gradient. n_local, sums, is_max: logs.
        B, T = mask.shape
        n_tokens = R.global_sum(mask.sum()).clamp(min=1)
        n_seqs = R.global_sum(B)
        n_local = float(mask.sum().clamp(min=1))
        sums, is_max = dict.fromkeys(("loss",) + token_means, 0.0), 0.0
        for it in range(args.num_iterations):
            # DDP averages the processes' gradients in the last micro-batch's backward only
            mbs = C.micro_batches(roll.completion_mask, args.micro_batch_size)
            for i, mb in enumerate(mbs):
                with R.sync_gradients(train_model, now=i == len(mbs) - 1):
                    with amp:
                        logprobs, entropy = C.token_logprobs(train_model, roll.ids[mb],
                                                             roll.attention_mask[mb], T,
                                                             args.temperature, entropy=True)
                    # entropy (B, T) has a gradient, as logprobs do; here it is only logged, so
                    # its graph goes. An entropy bonus: delete this line and, before backward,
                    # loss = loss - coef * (entropy * mask[mb]).sum() / n_tokens (ppo's ent_coef)
                    entropy = entropy.detach()
                    old = old_logprobs[mb] if old_logprobs is not None else logprobs.detach()
                    ref_mb = ref_logprobs[mb] if ref_logprobs is not None else None
                    # pi_old / pi_sampler: logged raw; with --tis_cap, the loss's weight
                    is_weight, is_ratio = O.mismatch_weights(old, roll.sample_logprobs[mb],
                                                             mask[mb], *tis)
                    loss, logs = (objective or per_token_loss)(
                        logprobs, old, advantages[mb], mask[mb], args, ref_mb, is_weight,
                        roll.sample_logprobs[mb])
                    loss = aggregate(loss, mask[mb], args.loss_agg, n_tokens, n_seqs,
                                     args.max_new_tokens)
                    # gradients add up over the micro-batches; DDP/FSDP2 average the processes'
                    # gradients: x world makes them the sum
                    (loss * run.world).backward()
                # the logged token means (a switch's own too); is_frac_out: the tokens whose
                # pi_old / pi_sampler is off by more than 2x
                out = ((is_ratio < 0.5) | (is_ratio > 2)).float()
                logs.update(entropy=entropy, is_ratio=is_ratio, is_frac_out=out)
                for key, x in logs.items():
                    sums[key] = sums.get(key, 0.0) + float((x.detach() * mask[mb]).sum()) / n_local
                is_max = max(is_max, float((is_ratio * mask[mb]).max()))
                sums["loss"] += loss.item() * run.world
            # a NaN/inf gradient norm would ruin the weights: keep skips that update
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            if keep.finite(grad_norm):
                opt.step()
            opt.zero_grad(set_to_none=True)
        if sampler:  # --vllm: the updated weights into its engine, for the next samples
            sampler.load_weights(model)
        # 4. log (every sampling round's rewards; the mean of the mu updates'), eval, checkpoint
        metrics = {**keep.rollout_metrics(roll, roll.rows, roll.texts, rounds.rewards,
                                          rounds.parts, env), **data_logs,
                   "frac_zero_std": float(zero_std_groups(rounds.rewards, G).float().mean()),
                   **{k: v / args.num_iterations for k, v in sums.items()},
                   "is_ratio_max": is_max, "grad_norm": float(grad_norm)}
        # samples.jsonl: a completion of each of the first 4 groups
        samples = keep.samples(tok, roll, roll.rows, roll.transcript if env else roll.texts,
                               roll.rewards, G)
        # under torchrun: the mean over the processes, token means weighted by their tokens
        keep.end_step(step, metrics, samples, roll.completion_mask.sum(),
                      {k: mask.sum() for k in sums if k != "loss"})
    keep.finish(metric, eval_before)


if __name__ == "__main__":
    R.main_guard(main)
