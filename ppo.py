"""ppo.py: PPO for RLHF (Ziegler et al. 2019; InstructGPT, Ouyang et al. 2022), following "The N
Implementation Details of RLHF with PPO" (Huang et al. 2023) and its TL;DR follow-up (Huang et al.,
arXiv 2403.17031), cited below as "N details" and "TL;DR details".

Four models: the policy pi_theta (trained), a frozen reference pi_ref (the starting policy), a
critic V (trained; one value per token) and a frozen reward model RM. Per step, sample ONE
completion per prompt (pi_old = the policy that sampled it), then:

    r_t     = -kl_coef * KL_t(pi_old || pi_ref)  on every completion token  (KL in the reward)
              + score on the last real token (the EOS, or the last token when truncated, then
              minus missing_eos_penalty). score = (RM(prompt, completion) - mu) / sigma, with mu,
              sigma the RM's mean and std on samples of the starting policy (N details: reward
              gain and bias), so kl_coef means the same for any RM's scale      shaped_rewards()
    delta_t = r_t + gamma V(s_t+1) - V(s_t);  A_t = delta_t + gamma lam A_t+1  (backwards)   gae()
    R_t     = A_t + V(s_t), the critic's target;  A is whitened over the batch   C.whiten()
then ppo_epochs passes over shuffled minibatches, each one optimizer step on
    L = token-mean[ max(-A rho, -A clip(rho, 1 - eps, 1 + eps)) ]                  policy_loss()
      + vf_coef * token-mean[ 0.5 max((V - R)^2, (V_old + clip(V - V_old, +-eps_v) - R)^2) ]
                                                                                     value_loss()
      - ent_coef * token-mean[ entropy ]
with rho = pi_theta / pi_old. The epochs stop early once the approximate KL(pi_old || pi_theta)
of a minibatch passes target_kl (that minibatch's update is dropped). kl_coef is fixed (TL;DR
details, TRL: 0.05) or adapted by Ziegler's controller:
    kl_coef *= 1 + clip(KL_seq / kl_target - 1, -0.2, 0.2) * batch_size / kl_horizon  adaptive_kl()

The critic is a separate model whose head reads the hidden state before each completion token.
It starts as a copy of the reward model (default, as in the TL;DR details: the RM already knows
what a good answer looks like, so V is roughly right at step 0) or, with --critic_init policy, as
the policy's backbone with a fresh zero-init head (N details: V = 0 at first). It reads the
policy's token ids, so it must share the policy's tokenizer. It has its own learning rate
(critic_lr): policy and critic share one AdamW with a parameter group each, and each model's
gradient is clipped on its own. The reward model is a proxy: watch `gold` (true accuracy of the
sampled answers) beside `reward` (the README shows a weak reward model hacked in 20 steps).

Memory: trained models keep fp32 weights + grads + two Adam moments = 16 bytes/param each; the
frozen reference and RM live in bf16 on a GPU (2 bytes/param). A 7B policy with a 7B critic needs
112 + 112 + 14 + 14 GB before activations, about twice GRPO's bill: the critic is why GRPO and
RLOO drop it. Simplified: PyTorch AdamW, not the N details' TF-style Adam.

Run:  python ppo.py                      # bundled policy + reward model, 2-core CPU, ~90 s
      python ppo.py --rewards math --critic_init policy   # the rule reward instead of the RM
      python ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --reward_model OWNER/RM --data my.jsonl \\
          --max_new_tokens 128 --lr 3e-6 --critic_lr 3e-6 --temperature 0.7 --compile
Expect (bundled default): held-out greedy accuracy 0.292 -> 0.954, the RM score from 1.7 to 4.8
(means over the first and the last 10 steps) with `gold` rising beside it, to 0.93.
"""
from plumbing import ctrl_c  # noqa: F401  (first: Ctrl-C while torch loads is one line)
import random
from dataclasses import dataclass, field
from typing import Literal

import torch
from transformers import AutoModelForSequenceClassification
from transformers.utils import logging as hf_logging

import common as C
from plumbing.errors import UserError
from plumbing import envs as E
from plumbing import flags
from plumbing.flags import arg  # an Args field with its valid range
from plumbing import loading
from plumbing import runs as R
from plumbing import tasks
from plumbing import vllm_sampler as V


@dataclass
class Args:
    # the update's own fields first, and the reward's (the docstring's equations), then sampling,
    # model and data, optimisation and the run; --help lists them in a user's order
    # (flags.HELP_ORDER)
    # --- the PPO update
    gamma: float = arg(1.0, "[0, 1]")  # discount (N, TL;DR, TRL, OpenRLHF, verl: 1)
    lam: float = arg(0.95, "[0, 1]")  # GAE lambda (N, TL;DR, TRL: 0.95; OpenRLHF, verl: 1.0)
    clip_eps: float = arg(0.2, "> 0")  # the ratio is clipped to [1 - eps, 1 + eps] (PPO, TRL)
    clip_eps_value: float = arg(0.2, "> 0")  # values move at most this far (TRL 0.2; verl 0.5)
    vf_coef: float = arg(0.1, ">= 0")  # weight of the value loss (N, TL;DR, TRL: 0.1)
    ent_coef: float = arg(0.0, ">= 0")  # weight of the entropy bonus (N, TL;DR, TRL, verl: 0)
    ppo_epochs: int = arg(4, "> 0, <= 100")  # passes over each batch (N, TL;DR, TRL: 4)
    num_minibatches: int = arg(2, "> 0")  # optimizer steps per epoch (TL;DR, TRL 1; N 1-8)
    target_kl: float = arg(0.0, ">= 0")  # end the epochs at this KL(pi_old || pi) (CleanRL 0.015)
    # --- rewards
    rewards: str = ""  # the score: '' = rm (the reward model) or your --reward_fn; or "math"
    reward_fn: list[str] = field(default_factory=list)  # your rewards, file.py:function (README)
    missing_eos_penalty: float = arg(1.0, ">= 0")  # taken off scores with no EOS (TL;DR details)
    kl_coef: float = arg(0.05, ">= 0")  # beta of the per-token KL in the reward (TL;DR, TRL)
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"  # KL value in the reward (N, TRL, OpenRLHF: k1)
    adaptive_kl: bool = False  # Ziegler et al.'s controller adapts kl_coef (N: on; TL;DR, TRL: off)
    kl_target: float = arg(6.0, "> 0")  # the controller's target KL per sequence, in nats (N: 6)
    kl_horizon: int = arg(10000, "> 0")  # the controller's horizon in episodes (N: 10000)
    normalize_score: bool = True  # score -> (score - mu) / sigma on the starting policy (N details)
    whiten_rewards: bool = False  # scale per-token rewards to unit variance (N: on; TL;DR: off)
    # --- sampling
    batch_size: int = arg(64, "> 0")  # prompts (one sample each) per step (TRL 64; TL;DR 512)
    max_new_tokens: int = arg(6, "> 0")  # completion length cap (TL;DR 53; the task needs 4)
    # fp32 maths: logits / temperature stays finite at >= 1e-30 (for logits up to 3e8), and top_p
    # does not round to 0 at >= 1.2e-38 (fp32's smallest normal; at 0 no token would be kept)
    temperature: float = arg(1.0, ">= 1e-30")  # sampling temperature (N, TRL 0.7; 1 explores)
    top_p: float = arg(1.0, "[1.2e-38, 1]")  # nucleus sampling (N details: 1.0, all tokens)
    stop: list[str] = field(default_factory=list)  # stop strings, e.g. "</answer>", end a row too
    vllm: bool = False  # vLLM samples, in this process: TRL's use_vllm colocate (docs/speed.md)
    vllm_gpu_memory_utilization: float = arg(0.3, "(0, 1]")  # its share of GPU memory (TRL 0.3)
    vllm_kv_cache_gb: float = arg(0.0, ">= 0")  # its KV cache; 0: from the share (GPU), 1 (CPU)
    # --- model and data
    model: str = loading.DEFAULT_POLICY  # hub id or local folder of any AutoModelForCausalLM
    reward_model: str = loading.DEFAULT_REWARD_MODEL  # AutoModelForSequenceClassification, 1 label
    critic_init: Literal["reward_model", "policy"] = "reward_model"  # TL;DR details | N details
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
    # --- optimisation
    lr: float = arg(2e-4, "> 0")  # tiny-model lr; real models ~3e-6 (TL;DR, TRL), 1e-6 (verl)
    critic_lr: float = arg(1e-3, "> 0")  # critic lr (tiny model); real models ~1e-5 (verl)
    weight_decay: float = arg(0.0, ">= 0")  # AdamW weight decay, both models (TRL 0; verl 0.01)
    anneal_lr: bool = True  # both lrs fall linearly to 0 over max_steps (N details)
    adam_eps: float = arg(1e-5, "> 0")  # AdamW epsilon (TL;DR details)
    max_grad_norm: float = arg(1.0, "> 0")  # gradient clipping, per model (TRL, verl, OpenRLHF)
    max_steps: int = arg(120, "> 0")  # PPO steps (ppo_epochs * num_minibatches updates each)
    micro_batch_size: int = arg(32, "> 0")  # rows per forward; loss normalised per minibatch
    lora_r: int = arg(0, ">= 0")  # LoRA rank (pip install peft); 0: full fine-tuning
    lora_alpha: int = arg(32, "> 0")  # LoRA scale: the update is alpha / r * B A (TRL examples)
    lora_dropout: float = arg(0.0, "[0, 1)")  # adapter dropout (> 0 makes log-probs noisy)
    lora_target_modules: str = "all-linear"  # comma list, or peft's every linear layer but the head
    gradient_checkpointing: bool = False  # recompute activations in backward (policy and critic)
    fsdp: bool = False  # torchrun: shard policy and critic across processes with FSDP2 (README)
    compile: bool = False  # torch.compile policy and reference: for CUDA; no measured gain on CPU
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    threads: int = arg(0, ">= 0, <= 4 * cores")  # CPU threads; 0: 1 under 10 M params, else all
    # --- run
    seed: int = arg(0, ">= 0, < 2**63")  # seeds sampling, data order, new weights: same run
    eval_every: int = arg(40, ">= 0")  # steps between held-out evals (0: before and after only)
    eval_size: int = arg(500, "> 0")  # held-out prompts per eval
    eval_reward: Literal["auto", "math", "rewards"] = "auto"  # auto: rg score, or math on numbers
    eval_samples: int = arg(0, ">= 0, <= 1000")  # k > 0: also mean@k and pass@k of k samples
    eval_sampled: bool = False  # the held-out score "eval" is mean@k, not greedy (--env calc: on)
    save_every: int = arg(40, ">= 0")  # steps between checkpoints (0: only at the end, Ctrl-C)
    save_optimizer: bool = False  # the final checkpoint too keeps AdamW: --resume may extend it
    samples_every: int = arg(25, ">= 0")  # samples.jsonl at steps 1, 1 + this, ... (0: none)
    report_to: Literal["none", "tensorboard", "wandb", "trackio"] = "none"  # also log there
    output_dir: str = ""  # default runs/ppo-<time>
    resume: str = ""  # a previous output_dir: continue its run (policy, critic, kl_coef, RNG)
    sanity: bool = False  # check log-probs, ratio, KL and masks on the real model, then exit


# --------------------------------------------------------------------------- the algorithm
def shaped_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator="k1"):
    """Per-token reward (B, T): -kl_coef * KL on each model token (mask 1), plus the score (B,) on
    the last one (the EOS or a truncated row's last, TL;DR details; not the padded end)."""
    kl = C.kl_estimate(logprobs, ref_logprobs, kl_estimator) * mask
    rewards = -kl_coef * kl
    last = mask.shape[1] - 1 - mask.flip(1).argmax(1)  # the last mask 1 (one turn: lengths - 1)
    rows = torch.arange(len(rewards), device=rewards.device)
    rewards[rows, last] += scores * (mask.sum(1) > 0)  # a row with no model token: no score
    return rewards, kl


def gae(rewards, values, mask, gamma, lam):
    """GAE (Schulman et al. 2016), backwards over the model's tokens (mask 1; an observation between
    them is the env's step; V = A = 0 past the end: terminal). (B, T) -> (A, returns = A + V)."""
    values, rewards = values * mask, rewards * mask
    advantages = torch.zeros_like(rewards)
    last = torch.zeros_like(rewards[:, 0])  # A_t+1, of the next model token
    next_value = torch.zeros_like(last)  # V_t+1, of the next model token (0: terminal)
    for t in reversed(range(rewards.shape[1])):
        model_token = mask[:, t] > 0
        delta = rewards[:, t] + gamma * next_value - values[:, t]  # r_t + gamma V_t+1 - V_t
        a = delta + gamma * lam * last  # A_t = delta_t + gamma lam A_t+1
        advantages[:, t] = a * mask[:, t]
        last = torch.where(model_token, a, last)  # observations pass A and V on unchanged
        next_value = torch.where(model_token, values[:, t], next_value)
    return advantages, advantages + values


def policy_loss(logprobs, old_logprobs, advantages, clip_eps):
    """Clipped surrogate per token (PPO). Returns loss, ratio and where the clipped branch won."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps)
    return torch.max(unclipped, clipped), ratio, (clipped > unclipped).float()


def value_loss(values, old_values, returns, clip_eps_value):
    """Clipped value loss per token (N details): a move past old +- clip_eps_value earns nothing."""
    clipped_values = old_values + (values - old_values).clamp(-clip_eps_value, clip_eps_value)
    l_unclipped = (values - returns) ** 2
    l_clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.max(l_unclipped, l_clipped), (l_clipped > l_unclipped).float()


def adaptive_kl(kl_coef, kl, target, horizon, n_steps):
    """Ziegler et al. (2019) proportional controller: KL above target raises kl_coef, below lowers
    it, by at most 20% * n_steps / horizon per update (N details' AdaptiveKLController)."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / horizon)


def critic_values(critic, ids, attention_mask, T):
    """V(s_t) for the last T positions, (B, T): the head reads the hidden state BEFORE token t (the
    same shift as the log-probs). Completion columns that are padding in every row are not run."""
    Tb = max(1, int(attention_mask[:, -T:].sum(-1).max()))  # these rows' longest completion
    keep = ids.shape[1] - T + Tb  # prompt + Tb columns
    ids, attention_mask = ids[:, :keep], attention_mask[:, :keep]
    hidden = critic.base_model(input_ids=ids, attention_mask=attention_mask, use_cache=False,
                               position_ids=C.positions(attention_mask)).last_hidden_state
    values = critic.score(hidden[:, -Tb - 1:-1]).float()[..., 0]
    return torch.nn.functional.pad(values, (0, T - Tb))


class ValueModel(torch.nn.Module):
    """The critic as one module whose forward returns V(s_t), (B, T): DistributedDataParallel
    syncs the gradients of what a module's forward computes, and FSDP2 gathers the weights it
    needs (critic_values reads the backbone and the head separately)."""

    def __init__(self, critic):
        super().__init__()
        self.critic = critic

    def forward(self, ids, attention_mask, T):
        return critic_values(self.critic, ids, attention_mask, T)


def explained_variance(values, returns, mask, total=None):
    """1 - Var(R - V) / Var(R) over valid tokens: 1 is a perfect critic, 0 a constant's worth.
    total: sums over every torchrun process (runs.global_sum), for the global batch's variances."""
    def var(x):  # over the valid tokens (of every process)
        return C.masked_mean((x - C.masked_mean(x, mask, total=total)) ** 2, mask, total=total)
    return float(1 - var(returns - values) / var(returns).clamp(min=1e-8))


def score_stats(generate, score, data, args, n=256):
    """Mean and std of the score on n samples of the starting policy, for normalize_score:
    generate(rows) -> (rollout, texts), score(rows, texts) -> (scores, parts). Its own data rng
    leaves the training stream as it is."""
    rows = R.my_share(data.next_batch(random.Random(args.seed + 1), n))  # torchrun: a share
    _, texts = generate(rows)  # env: the score reads final turns
    scores = score(rows, texts)[0]
    mean = R.global_mean({"mu": float(scores.mean())})["mu"]  # torchrun: over every share
    return mean, float(R.global_std(scores).clamp(min=1e-6))


def load_critic(args, tok, device, norm=(0.0, 1.0)):
    """The value model: the RM checkpoint (TL;DR details), its head rescaled like the scores,
    V = (RM head - mu) / sigma; or the policy's backbone with a new zero-init head (N details)."""
    src = args.reward_model if args.critic_init == "reward_model" else args.model
    if args.critic_init == "reward_model":
        if not args.reward_model:
            raise UserError("--critic_init reward_model needs --reward_model (or use "
                            "--critic_init policy)")
        if loading.load_tokenizer(src, args.trust_remote_code).get_vocab() != tok.get_vocab():
            raise UserError(f"the critic reads the policy's token ids, but reward model {src!r}"
                            " has a different tokenizer; use --critic_init policy")
        critic = loading.load_model(src, "rm", device, frozen=False,
                                    trust_remote_code=args.trust_remote_code)
    else:  # a new score head, as expected: transformers' "MISSING" load report stays unsaid
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()
        critic = AutoModelForSequenceClassification.from_pretrained(
            src, num_labels=1, dtype=torch.float32, trust_remote_code=args.trust_remote_code)
        hf_logging.set_verbosity(verbosity)
        critic = critic.to(device).eval()  # eval(): dropout off
    if not isinstance(getattr(critic, "score", None), torch.nn.Linear):
        raise UserError(f"critic from {src!r}: its {type(critic).__name__} has no linear `score`")
    head = torch.nn.Linear(critic.score.in_features, 1, device=device)
    with torch.no_grad():
        if args.critic_init == "policy":  # V = 0 at the start (N details: value head std 0)
            head.weight.zero_()
            head.bias.zero_()
        else:  # the normalised RM score of the prefix so far
            bias = critic.score.bias if critic.score.bias is not None else 0.0
            head.weight.copy_(critic.score.weight / norm[1])
            head.bias.copy_((bias - norm[0]) / norm[1])
    critic.score = head
    if args.gradient_checkpointing:
        loading.enable_gradient_checkpointing(critic)
    return critic


def check_args(args):
    flags.check_args(args)
    mb = args.batch_size // args.num_minibatches
    if args.batch_size % args.num_minibatches or mb % min(args.micro_batch_size, mb):
        raise UserError(f"--num_minibatches {args.num_minibatches} must divide --batch_size "
                        f"{args.batch_size}, and --micro_batch_size {args.micro_batch_size} "
                        "the minibatch")
    if args.batch_size < 8:
        raise UserError("--batch_size must be >= 8: advantages are whitened over the batch")
    if args.adaptive_kl and args.kl_coef == 0:
        raise UserError("--adaptive_kl scales kl_coef by a factor: from --kl_coef 0 it would "
                        "stay 0; give a starting kl_coef > 0 (N details: 0.15)")


# -------------------------------------------------------------------------- the training loop
def ppo_update(model, critic, opt, keep, roll, batch, args, amp):
    """ppo_epochs passes over shuffled minibatches, an optimizer step each (micro-batch gradients
    summed, over the minibatch's tokens), ended by a minibatch whose approx KL(pi_old || pi) passes
    target_kl (its update dropped). batch: old_logprobs, old_values, returns, advantages (B, T).
    Under torchrun this process holds rows rank, rank + world, ... of the global batch (main's
    [rank::world]); every process shuffles the global batch with rank 0's permutation and trains
    on the rows it holds of each minibatch, so the processes make the one-process update. keep:
    the runs.Keeper, whose finite() guards each optimizer step."""
    run, mask = keep.run, roll.completion_mask
    B, T = mask.shape  # this process's rows
    n = B * run.world  # the global batch's rows
    mb_size = n // args.num_minibatches
    size = min(args.micro_batch_size, mb_size)  # rows per forward
    logged = ("pg_loss", "value_loss", "clip_frac", "value_clip_frac", "ratio", "approx_kl",
              "entropy")  # token means over each minibatch
    updates = []  # each optimizer step's stats
    for epoch in range(args.ppo_epochs):
        perm = torch.randperm(n, device=mask.device)  # reshuffled every epoch (N details)
        if run.world > 1:  # one permutation for every process: rank 0's (seeded as one process)
            torch.distributed.broadcast(perm, src=0)
        for start in range(0, n, mb_size):
            rows = perm[start:start + mb_size]  # this minibatch's rows of the global batch
            idx = rows[rows % run.world == run.rank] // run.world  # those this process holds
            n_tokens = R.global_sum(mask[idx].sum()).clamp(min=1)  # the whole minibatch's
            mb = dict.fromkeys(("loss",) + logged, 0.0)
            micro = C.micro_batches(mask[idx], size)
            # processes may hold unequal shares of a minibatch, but DDP's and FSDP2's collectives
            # need as many forwards in each: the most any process needs (ceil(share / size)); one
            # with fewer runs the rest on its row 0 with mask 0 (no loss, no gradient)
            shares = [int((rows % run.world == r).sum()) for r in range(run.world)]
            n_micro = max(-(-share // size) for share in shares)
            for i in range(n_micro):
                spare = i >= len(micro)
                j = idx.new_zeros(1) if spare else idx[micro[i]]
                m = mask[j] * 0 if spare else mask[j]
                with R.sync_gradients(model, now=i == n_micro - 1), \
                        R.sync_gradients(critic, now=i == n_micro - 1):
                    with amp:
                        logprobs, entropy = C.token_logprobs(model, roll.ids[j],
                                                             roll.attention_mask[j], T,
                                                             args.temperature, entropy=True)
                        if not args.ent_coef:  # no bonus: only logged, so drop its graph
                            entropy = entropy.detach()
                        values = critic(roll.ids[j], roll.attention_mask[j], T)
                    pg, ratio, clipped = policy_loss(logprobs, batch["old_logprobs"][j],
                                                     batch["advantages"][j], args.clip_eps)
                    vf, v_clipped = value_loss(values, batch["old_values"][j], batch["returns"][j],
                                               args.clip_eps_value)

                    def token_mean(x):  # over the whole minibatch's tokens
                        return (x * m).sum() / n_tokens
                    loss = token_mean(pg) + args.vf_coef * token_mean(vf) \
                        - args.ent_coef * token_mean(entropy)
                    # gradients add up over the micro-batches; DDP's (FSDP2's) average over the
                    # processes, scaled by their number, is the minibatch's sum
                    (loss * run.world).backward()
                approx_kl = C.kl_estimate(batch["old_logprobs"][j], logprobs.detach(), "k3")
                mb["loss"] += float(loss.detach())
                for k, x in zip(logged, (pg, vf, clipped, v_clipped, ratio, approx_kl, entropy)):
                    mb[k] += float(token_mean(x.detach()))
            mb = {k: v * run.world for k, v in R.global_mean(mb).items()}  # sums over processes
            stop = args.target_kl and mb["approx_kl"] > args.target_kl  # pi moved far from pi_old
            if stop:
                opt.zero_grad(set_to_none=True)  # drop this minibatch's update, and stop
                break
            critic_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), args.max_grad_norm)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
            if keep.finite(grad_norm, critic_norm):  # else NaN/inf: skip it
                opt.step()
            opt.zero_grad(set_to_none=True)
            updates.append({**mb, "grad_norm": float(grad_norm)})
        if stop:  # target_kl: no more epochs either
            break
    keys = ("loss",) + logged + ("grad_norm",)  # each one's mean over the updates (0: none)
    return {**{k: sum(u[k] for u in updates) / max(len(updates), 1) for k in keys},
            "ppo_updates": len(updates)}


def main():
    # The flags (--resume DIR: that run's own settings), the tool environment (--env, --tools;
    # None without), your reward functions by name and the --rewards weights (default: the
    # reward model). A real policy without --reward_model: one line, not a run scored by the
    # bundled toy reward model.
    args = flags.parse_args(Args, "ppo", __doc__)
    check_args(args)
    env = E.from_args(args)
    fns = loading.load_reward_fns(args.reward_fn)
    weights = loading.parse_rewards(args.rewards, args.reward_model, fns, default="rm")
    loading.check_default_reward_model(args, "rm" in weights or args.critic_init == "reward_model")
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
    run = R.start_run(args, "ppo")
    rng = R.seed_everything(args.seed)
    amp = loading.autocast(device, args.dtype)
    # The policy (a checkpoint when resuming), once the prompts and --tools are checked; on a
    # CPU one thread for a small model (runs.set_threads). The reference pi_ref: none at
    # kl_coef = 0; with LoRA the policy itself, adapters off. --rewards rm: the reward model.
    model, tok = loading.load_policy(args, device, f"{run.dir}/checkpoint" if args.resume else "",
                                     data.rows, env)
    R.set_threads(args, model)
    ref = None
    if args.kl_coef > 0 or args.sanity:
        ref = model if args.lora_r else loading.load_model(
            args.model, "lm", device, frozen=True, trust_remote_code=args.trust_remote_code,
            compile=args.compile)
    if args.sanity:
        failed = R.sanity_check(model, ref, tok, data.eval_rows, args, env)
        raise SystemExit(2 if failed else 0)
    if "rm" in weights:
        fns["rm"] = loading.load_reward_model(args, device)
    sampler = V.Sampler(args, model, tok, device) if args.vllm else None  # --vllm: vLLM samples
    # The score's (mu, sigma): from the checkpoint on resume, else measured under the starting
    # policy (--normalize_score). The critic (resumed: its weights, which a finished run's last
    # checkpoint does not keep).
    norm = (0.0, 1.0)
    if run.state:
        norm = run.state["extra"]["score_norm"]
    elif args.normalize_score:
        norm = score_stats(lambda rows: C.generate(model, tok, rows, args, amp, env,
                                                   sampler=sampler),
                           lambda rows, texts: C.compute_rewards(rows, texts, weights, fns), data,
                           args)
        if run.rank == 0:
            print(f"score under the starting policy: mean {norm[0]:.3g}, std {norm[1]:.3g}; "
                  "training uses (score - mean) / std, the logged `reward` is the raw score")
    critic = load_critic(args, tok, device, norm)
    if run.state and "critic" in run.state["extra"]:
        critic.load_state_dict(run.state["extra"]["critic"])
    # The training forwards' models (torchrun: DDP, or FSDP2 with --fsdp): the policy and the
    # critic's V (B, T). One optimizer, two parameter groups: what the policy trains (every
    # weight, or LoRA's adapters) and the critic, with its own lr.
    train_model = R.wrap_model(model, args.fsdp)
    value_model = R.wrap_model(ValueModel(critic), args.fsdp)
    trained = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": trained, "lr": args.lr},
                             {"params": list(value_model.parameters()), "lr": args.critic_lr}],
                            eps=args.adam_eps, weight_decay=args.weight_decay, fused=True)

    # The held-out score (accuracy, a reasoning-gym score or the mean reward) and what scores
    # it; under torchrun each process scores a share. A new run evaluates once before training;
    # a resumed one restores the optimizer, RNGs, kl_coef and the data's state (curriculum
    # levels, prompts' visits).
    metric = tasks.eval_metric(data.eval_rows, args.eval_reward)
    scored = tasks.scored_by(metric, weights, fns)

    def evaluate():
        return R.split_eval(run, model, data.eval_rows, lambda rows: C.evaluate(
            model, tok, rows, args, amp, scored, fns, env=env, sampler=sampler))
    start, eval_before, saved = R.resume_or_eval(run, opt, rng, evaluate, metric,
                                                 [model, value_model])
    kl_coef = saved.get("kl_coef", args.kl_coef)
    data.state.update(saved.get("data_state", {}))

    # checkpoint/ after `done` steps: every --save_every, at the end, on Ctrl-C
    def save(done):
        R.save_checkpoint(run, model, tok, opt, rng, done,
                          {"eval_before": eval_before, "kl_coef": kl_coef, "score_norm": norm,
                           "critic": R.full_state_dict(critic), "data_state": data.state},
                          trained=[model, value_model])
    token_means = ("kl", "returns", "values")  # under torchrun: means weighted by tokens
    # The run-keeping (Ctrl-C, the NaN guards, logs, eval, warnings, checkpoints) is keep's:
    # each keep.* call below is one of its duties (runs.Keeper); what is left is the algorithm.
    keep = R.Keeper(run, opt, rng, save, evaluate, data.state)
    for step in keep.steps(start):
        # --anneal_lr: the lr from the step number, so resuming needs no scheduler state
        if args.anneal_lr:
            for group, lr in zip(opt.param_groups, (args.lr, args.critic_lr)):
                group["lr"] = lr * (1 - step / args.max_steps)
        # 1. sample one completion per prompt (under torchrun this process's share; with an
        # env, a multi-turn episode) and score it. The data's bookkeeping (curriculum, skips:
        # tasks.observe) sees the scores. A NaN/inf score in any process: no update this step.
        rows = data.next_batch(rng, args.batch_size)[run.rank::run.world]
        with keep.sampling(model, step):
            roll, completions = C.generate(model, tok, rows, args, amp, env, sampler=sampler)
        raw_scores, parts = C.compute_rewards(rows, completions, weights, fns)
        data_logs = data.observe(rows, raw_scores, parts, 1)
        if not keep.finite(raw_scores.sum(), what="reward"):
            continue
        # the "EOS trick" (TL;DR details): a completion that never ended pays a fixed penalty.
        # mask (B, T): 1 on each completion token, EOS included
        scores = (raw_scores.to(device) - norm[0]) / norm[1] \
            - args.missing_eos_penalty * roll.truncated.float()
        mask = roll.completion_mask
        T = mask.shape[1]
        # 2. log pi_old and old values from the training forward (so rho = 1 at the first
        # update); log pi_ref (none at kl_coef = 0: pi_old, so KL is 0; with LoRA the policy
        # with its adapters off)
        old_logprobs = C.batched_logprobs(model, roll, args.temperature, args.micro_batch_size, amp)
        ref_logprobs = old_logprobs
        if ref is not None:
            with R.adapters_off(ref):
                ref_logprobs = C.batched_logprobs(ref, roll, args.temperature,
                                                  args.micro_batch_size, amp)
        old_values = torch.zeros_like(mask)
        with torch.no_grad(), amp:
            for mb in C.micro_batches(mask, args.micro_batch_size):
                old_values[mb] = value_model(roll.ids[mb], roll.attention_mask[mb], T) * mask[mb]
        # 3. per-token rewards, GAE advantages and returns, whitened advantages (whitening
        # takes the statistics of the global batch, under torchrun too: total=R.global_sum)
        rewards, kl = shaped_rewards(scores, old_logprobs, ref_logprobs, mask, kl_coef,
                                     args.kl_estimator)
        if args.whiten_rewards:
            rewards = C.whiten(rewards, mask, shift_mean=False, total=R.global_sum)
        advantages, returns = gae(rewards, old_values, mask, args.gamma, args.lam)
        batch = {"old_logprobs": old_logprobs, "old_values": old_values, "returns": returns,
                 "advantages": C.whiten(advantages, mask, total=R.global_sum)}
        # 4. ppo_epochs x num_minibatches optimizer steps on the clipped losses
        stats = ppo_update(train_model, value_model, opt, keep, roll, batch, args, amp)
        if sampler:  # --vllm: the updated weights into its engine, for the next samples
            sampler.load_weights(model)
        # KL in nats per sequence: what Ziegler's controller targets (the mean over all
        # processes); with --adaptive_kl it sets the next step's kl_coef
        kl_seq = R.global_mean({"kl_seq": float(kl.sum(1).mean())})["kl_seq"]
        # 5. log, eval, checkpoint
        metrics = {**keep.rollout_metrics(roll, rows, completions, raw_scores, parts, env),
                   **data_logs,
                   "kl": float(C.masked_mean(kl, mask)), "kl_seq": kl_seq, "kl_coef": kl_coef,
                   **stats, "explained_var": explained_variance(old_values, returns, mask,
                                                                 total=R.global_sum),
                   "returns": float(C.masked_mean(returns, mask)),
                   "values": float(C.masked_mean(old_values, mask))}
        if args.adaptive_kl:
            kl_coef = adaptive_kl(kl_coef, kl_seq, args.kl_target, args.kl_horizon, len(rows))
        # samples.jsonl: the first 4 completions; under torchrun: the mean over the processes,
        # token means weighted by their tokens
        samples = keep.samples(tok, roll, rows, roll.transcript if env else completions, scores,
                               1, key="score")
        keep.end_step(step, metrics, samples, mask.sum(), dict.fromkeys(token_means, mask.sum()))
    keep.finish(metric, eval_before)


if __name__ == "__main__":
    R.main_guard(main)
