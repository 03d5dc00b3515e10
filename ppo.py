"""ppo.py: PPO for RLHF (Ziegler et al. 2019; InstructGPT, Ouyang et al. 2022), as in "The N Implementation Details
of RLHF with PPO" (Huang et al. 2023, = N) and its TL;DR follow-up (arXiv 2403.17031, = N+).

Four models: the policy pi_theta (trained), a frozen reference pi_ref (the starting policy), a critic V_phi
(trained; a scalar per token) and a frozen reward model RM. Per step, sample ONE completion per prompt, then:

    r_t    = -kl_coef * KL_t(pi_old || pi_ref)   on every completion token        (per-token KL in the reward)
           + score = (RM(prompt, completion) - mu) / sigma   on the last real token: the EOS, or the last
             token when truncated (then minus missing_eos_penalty); mu, sigma: the RM's mean and std on samples
             of the starting policy (N's reward gain and bias), so kl_coef means the same for any RM's scale
                                                                                          shaped_rewards()
    delta_t = r_t + gamma V(s_t+1) - V(s_t);  A_t = delta_t + gamma lam A_t+1 (backwards)  gae()
    R_t    = A_t + V(s_t)  (the critic's regression target);  A whitened over the batch      whiten()
then ppo_epochs passes over shuffled minibatches, each one optimizer step on
    L = token-mean[ max(-A rho, -A clip(rho, 1 - eps, 1 + eps)) ]                           policy_loss()
      + vf_coef * token-mean[ 0.5 max((V - R)^2, (V_old + clip(V - V_old, +-eps_v) - R)^2) ] value_loss()
      - ent_coef * token-mean[ entropy ]
with rho = pi_theta / pi_old. The epochs stop early once the approximate KL(pi_old || pi_theta) of a minibatch
passes target_kl (that minibatch's update is dropped). kl_coef is fixed (N+, TRL: 0.05) or adapted by Ziegler's
controller: kl_coef *= 1 + clip(KL_seq / kl_target - 1, -0.2, 0.2) * batch_size / kl_horizon   adaptive_kl().

The critic is a separate model whose head reads the hidden state before each completion token. It starts as a copy
of the reward model (default, as in N+: the RM already knows what a good answer looks like, so V is roughly right
at step 0 and the policy gets useful advantages at once) or, with --critic_init policy, as the policy's backbone
with a fresh zero-init head (N's value head: V = 0 at first, so the first advantages are lambda-discounted sums of
rewards). It reads the policy's token ids, so it must share the policy's tokenizer. Its learning rate is its own
(critic_lr); policy and critic share one AdamW with a parameter group each, and each has its gradient clipped.
The reward model is a proxy: watch `gold` (true accuracy of the sampled answers) beside `reward`. A reward model
trained on too narrow a set of wrong answers was hacked within 20 steps here: reward up, gold down.

Memory: four models. Trained ones keep fp32 weights + grads + two Adam moments = 16 bytes/param each; the frozen
reference and RM live in bf16 on a GPU (2 bytes/param). A 7B policy with a 7B critic: 112 + 112 + 14 + 14 GB
before activations, about twice GRPO's bill; that critic is why GRPO and RLOO drop it.
Simplified: PyTorch AdamW, not TF Adam (N); one process, no DeepSpeed.

Run:  python ppo.py                                   # bundled policy + reward model, CPU, a few minutes
      python ppo.py --rewards math --critic_init policy   # the rule reward instead of the RM; N's critic
      python ppo.py --model Qwen/Qwen2.5-0.5B-Instruct --reward_model OWNER/RM --data my.jsonl \\
                    --max_new_tokens 128 --lr 3e-6 --critic_lr 3e-6 --temperature 0.7 --batch_size 64 --compile
Expect (bundled default, 2-core CPU, about 80 s): held-out greedy accuracy 0.29 -> about 0.9 (seeds 0, 1, 2:
0.90, 0.93, 0.93), the RM score from about 1 to about 8 with `gold` rising beside it (0.4 -> 0.88).
With the rule reward (--rewards math --critic_init policy) 30 steps suffice: 0.29 -> 0.96 in 24 s.
"""
import random, time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm
from transformers import AutoModelForSequenceClassification

import common as C


@dataclass
class Args:
    # --- model and data
    model: str = C.DEFAULT_POLICY  # hub id or local folder of any AutoModelForCausalLM
    reward_model: str = C.DEFAULT_REWARD_MODEL  # AutoModelForSequenceClassification, num_labels=1 (InstructGPT)
    critic_init: str = "reward_model"  # reward_model (N+) | policy (backbone + zero-init head, N)
    data: str = ""  # '' = the built-in addition task; or a JSONL file of {"prompt", "answer"}; or hf:NAME[:CONFIG]
    chat_template: str = "auto"  # auto: use the tokenizer's chat template when it has one; none: raw prompts
    trust_remote_code: bool = False  # never run a repo's own code unless asked
    # --- sampling
    batch_size: int = 64  # prompts (= completions, one each) per step (N+ 512 on 8 GPUs; TRL 64)
    max_new_tokens: int = 6  # completion length cap (N+ 53; the built-in task needs 4)
    temperature: float = 1.0  # N, N+, TRL use 0.7; 1.0 explores more on the tiny task. Log-probs use the same one
    top_p: float = 1.0  # N: top_k 0, top_p 1.0 (sample from the full distribution the log-probs are taken on)
    stop: list[str] = field(default_factory=list)  # stop strings, e.g. "</answer>": a row also ends at the token completing one
    # --- rewards
    rewards: str = "rm"  # the score: 'rm' (the reward model), or rules/mixes as in grpo.py, e.g. "math" or "rm,math=1"
    missing_eos_penalty: float = 1.0  # subtracted from the score of completions with no EOS (N+ non_eos_penalty; TRL None)
    kl_coef: float = 0.05  # beta of the per-token KL in the reward (N+ 0.05, TRL 0.05; N adaptive from 0.15)
    kl_estimator: str = "k1"  # k1 | k2 | k3 (Schulman 2020); N, N+, TRL and OpenRLHF put k1 in the reward
    adaptive_kl: bool = False  # Ziegler et al. controller (N: on; N+, TRL: off)
    kl_target: float = 6.0  # adaptive target for the per-sequence KL in nats (N: 6)
    kl_horizon: int = 10000  # adaptive horizon in episodes (N: 10000)
    normalize_score: bool = True  # score -> (score - mean) / std under the starting policy (N: RM gain and bias)
    whiten_rewards: bool = False  # scale per-token rewards to unit variance, mean kept (N: on; N+, TRL: off)
    # --- the PPO update
    gamma: float = 1.0  # discount (N, N+, TRL, OpenRLHF, verl: 1)
    lam: float = 0.95  # GAE lambda (N, N+, TRL: 0.95; OpenRLHF, verl: 1.0)
    clip_eps: float = 0.2  # policy ratio clip (PPO paper, N, N+, TRL)
    clip_eps_value: float = 0.2  # value clip around the rollout's values (N, N+, TRL 0.2; OpenRLHF, verl 0.5)
    vf_coef: float = 0.1  # value loss weight (N, N+, TRL 0.1)
    ent_coef: float = 0.0  # entropy bonus (N, N+, TRL, verl: 0)
    ppo_epochs: int = 4  # passes over each batch (N, N+, TRL 4)
    num_minibatches: int = 2  # optimizer steps per epoch (N+ 1 per epoch; TRL 1; N 1..8)
    target_kl: float = 0.0  # stop the epochs once approx KL(pi_old || pi) of a minibatch passes this; 0: off (CleanRL 0.015)
    # --- optimisation
    lr: float = 2e-4  # policy lr: tiny model default; real models ~3e-6 (N+, TRL) or 1e-6 (OpenRLHF, verl)
    critic_lr: float = 1e-3  # critic lr: tiny model default; real models ~1e-5 (verl) / 9e-6 (OpenRLHF)
    anneal_lr: bool = True  # both lrs fall linearly to 0 over max_steps (N)
    adam_eps: float = 1e-5  # AdamW epsilon (N+)
    max_grad_norm: float = 1.0  # per model (TRL, verl, OpenRLHF 1.0)
    max_steps: int = 120  # PPO steps (each: one batch, ppo_epochs * num_minibatches optimizer steps)
    micro_batch_size: int = 32  # rows per forward; the token-mean normaliser is the minibatch's, so results match
    gradient_checkpointing: bool = False  # trade compute for activation memory on real models
    compile: bool = False  # torch.compile policy and reference forwards: faster steps after a slow first one (README)
    dtype: str = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU; or bf16 | fp32
    # --- run
    seed: int = 0
    eval_every: int = 40  # steps between held-out greedy evals (0: only before and after)
    eval_size: int = 500  # held-out prompts per eval
    save_every: int = 40  # steps between checkpoints (atomic; also on Ctrl-C and at the end; 0: only then)
    output_dir: str = ""  # default runs/ppo-<time>
    resume: str = ""  # a previous output_dir: continue from its checkpoint (policy, critic, optimizer, kl_coef, RNG)
    sanity: bool = False  # check log-probs, ratio, KL and masks on the real model and data, then exit


# ------------------------------------------------------------------------------------------- --- ALGORITHM ---
def shaped_rewards(scores, logprobs, ref_logprobs, mask, kl_coef, kl_estimator="k1"):
    """Per-token reward: -kl_coef * KL on every completion token, plus the sequence score on the last real token
    (index length - 1: the EOS, or the last token of a truncated row; N+ `padding_mask_p1`), not at the padded end."""
    kl = C.kl_estimate(logprobs, ref_logprobs, kl_estimator) * mask
    rewards = -kl_coef * kl
    last = mask.sum(1).long() - 1
    rewards[torch.arange(len(rewards), device=rewards.device), last] += scores
    return rewards, kl


def whiten(x, mask, shift_mean=True, eps=1e-8):
    """(x - mean) / std over the valid tokens only, biased variance (N, as in TF); shift_mean=False keeps the mean."""
    mean = C.masked_mean(x, mask)
    var = C.masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    return (out if shift_mean else out + mean) * mask


def gae(rewards, values, mask, gamma, lam):
    """Generalised advantage estimation (Schulman et al. 2016), backwards over the completion:
    delta_t = r_t + gamma V_t+1 - V_t, A_t = delta_t + gamma lam A_t+1; V and A are 0 past a row's end (the state
    after the EOS is terminal). Returns (advantages, returns = advantages + values)."""
    values, rewards = values * mask, rewards * mask
    T = rewards.shape[1]
    advantages, last = torch.zeros_like(rewards), torch.zeros_like(rewards[:, 0])
    for t in reversed(range(T)):
        next_value = values[:, t + 1] if t + 1 < T else torch.zeros_like(last)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        last = (delta + gamma * lam * last) * mask[:, t]
        advantages[:, t] = last
    return advantages, advantages + values


def policy_loss(logprobs, old_logprobs, advantages, clip_eps):
    """Clipped surrogate per token (PPO). Returns loss, ratio and where the clipped branch won (gradient 0)."""
    ratio = torch.exp(logprobs - old_logprobs)
    unclipped, clipped = -advantages * ratio, -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps)
    return torch.max(unclipped, clipped), ratio, (clipped > unclipped).float()


def value_loss(values, old_values, returns, clip_eps_value):
    """Clipped value loss per token (N, N+, OpenAI baselines): the new value may move at most clip_eps_value from
    the rollout's value before the loss stops rewarding the move. Returns loss and where the clipped term won."""
    clipped_values = old_values + (values - old_values).clamp(-clip_eps_value, clip_eps_value)
    l_unclipped, l_clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    return 0.5 * torch.max(l_unclipped, l_clipped), (l_clipped > l_unclipped).float()


def adaptive_kl(kl_coef, kl, target, horizon, n_steps):
    """Ziegler et al. (2019) proportional controller: KL above target raises kl_coef, below lowers it, by at most
    20% * n_steps / horizon per update (N `AdaptiveKLController`)."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n_steps / horizon)


def critic_values(critic, ids, attention_mask, T):
    """V(s_t) for the last T positions: the head reads the hidden state BEFORE token t (the same shift as the
    log-probs), i.e. positions -T-1 .. -2 of prompt + completion. Completion columns that are padding in every
    row are not run (their values are 0, and masked out everywhere)."""
    Tb = max(1, int(attention_mask[:, -T:].sum(-1).max()))  # these rows' longest completion
    ids, attention_mask = ids[:, :ids.shape[1] - T + Tb], attention_mask[:, :ids.shape[1] - T + Tb]  # prompt + Tb
    hidden = critic.base_model(input_ids=ids, attention_mask=attention_mask, position_ids=C.positions(attention_mask),
                               use_cache=False).last_hidden_state
    return torch.nn.functional.pad(critic.score(hidden[:, -Tb - 1:-1]).float()[..., 0], (0, T - Tb))


def ppo_update(model, critic, opt, run, roll, batch, args, amp):
    """ppo_epochs passes over the batch in shuffled minibatches, one optimizer step per minibatch (gradients summed
    over micro-batches with the minibatch's token count as normaliser). Stops early, dropping that minibatch's
    update, when its approx KL(pi_old || pi) = mean(rho - 1 - log rho) passes target_kl. Returns averaged stats."""
    mask, (B, T) = roll.completion_mask, roll.completion_mask.shape
    mb_size = B // args.num_minibatches
    micro = min(args.micro_batch_size, mb_size)
    keys = ("loss", "pg_loss", "value_loss", "clip_frac", "value_clip_frac", "ratio", "approx_kl", "entropy", "grad_norm")
    sums, n_updates, stopped = dict.fromkeys(keys, 0.0), 0, False
    for epoch in range(args.ppo_epochs):
        perm = torch.randperm(B, device=mask.device)  # reshuffled every epoch (N, N+)
        for start in range(0, B, mb_size):
            idx = perm[start:start + mb_size]
            n_tokens, mb = mask[idx].sum().clamp(min=1), dict.fromkeys(keys, 0.0)
            for j in (idx[k] for k in C.micro_batches(mask[idx], micro)):  # rows of similar lengths together
                m = mask[j]
                with amp:
                    logprobs, entropy = C.token_logprobs(model, roll.ids[j], roll.attention_mask[j], T, args.temperature,
                                                         entropy=True, entropy_grad=args.ent_coef > 0)
                    values = critic_values(critic, roll.ids[j], roll.attention_mask[j], T)
                pg, ratio, clipped = policy_loss(logprobs, batch["old_logprobs"][j], batch["advantages"][j], args.clip_eps)
                vf, v_clipped = value_loss(values, batch["old_values"][j], batch["returns"][j], args.clip_eps_value)
                tok_sum = lambda x: (x * m).sum() / n_tokens  # token-mean over the whole minibatch
                loss = tok_sum(pg) + args.vf_coef * tok_sum(vf) - args.ent_coef * tok_sum(entropy)
                loss.backward()
                approx_kl = C.kl_estimate(batch["old_logprobs"][j], logprobs.detach(), "k3")  # KL(old || new), k3
                mb["loss"] += float(loss.detach())
                for k, v in (("pg_loss", pg), ("value_loss", vf), ("clip_frac", clipped), ("value_clip_frac", v_clipped),
                             ("ratio", ratio), ("approx_kl", approx_kl), ("entropy", entropy)):
                    mb[k] += float(tok_sum(v.detach()))
            if args.target_kl and mb["approx_kl"] > args.target_kl:
                opt.zero_grad(set_to_none=True)  # drop this update: the policy has moved far enough from pi_old
                stopped = True
                break
            critic_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), args.max_grad_norm)
            if not torch.isfinite(critic_norm):
                critic.zero_grad(set_to_none=True)  # AdamW skips parameters without gradients
                C.skip_nonfinite(run, "value loss or critic gradient")
            mb["grad_norm"] = C.finite_update(run, model, opt, args.max_grad_norm)
            for k in keys:
                sums[k] += mb[k]
            n_updates += 1
        if stopped:
            break
    return {**{k: v / max(n_updates, 1) for k, v in sums.items()}, "ppo_updates": n_updates}


def explained_variance(values, returns, mask):
    """1 - Var(R - V) / Var(R) over valid tokens: 1 is a perfect critic, 0 no better than a constant."""
    var_r = C.masked_mean((returns - C.masked_mean(returns, mask)) ** 2, mask)
    diff = returns - values
    return float(1 - C.masked_mean((diff - C.masked_mean(diff, mask)) ** 2, mask) / var_r.clamp(min=1e-8))


def score_stats(model, tok, data, weights, rm, rm_tok, args, amp, n=256):
    """Mean and std of the score on n samples of the starting policy, for normalize_score (N normalises the RM
    this way, so kl_coef means the same for any RM's scale). A separate data rng leaves the training stream as is."""
    rows = data.next_batch(random.Random(args.seed + 1), n)
    roll = C.sample(model, tok, C.encode_prompts(tok, [r["prompt"] for r in rows], args.chat_template),
                    args.max_new_tokens, args.temperature, args.top_p, amp=amp, stop=args.stop)
    scores = C.compute_rewards(rows, C.decode_completions(tok, roll), weights, rm, rm_tok)[0]
    return float(scores.mean()), float(scores.std().clamp(min=1e-6))


# ---------------------------------------------------------------------------------------------- plumbing
def load_critic(args, tok, device, norm=(0.0, 1.0)):
    """The value model: the RM checkpoint (N+), its head given a bias and rescaled like the scores,
    V = (RM head - mean) / std; or the policy's backbone with a new zero-init scalar head (N)."""
    src = args.reward_model if args.critic_init == "reward_model" else args.model
    if args.critic_init == "reward_model":
        if not args.reward_model:
            raise C.UserError("--critic_init reward_model needs --reward_model (or use --critic_init policy)")
        if C.load_tokenizer(src, args.trust_remote_code).get_vocab() != tok.get_vocab():
            raise C.UserError(f"the critic reads the policy's token ids, but reward model {src!r} has a different "
                              "tokenizer; use --critic_init policy")
        critic = C.load_model(src, "rm", device, frozen=False, trust_remote_code=args.trust_remote_code)
    else:
        critic = AutoModelForSequenceClassification.from_pretrained(
            src, num_labels=1, dtype=torch.float32, trust_remote_code=args.trust_remote_code).to(device).eval()
    if not isinstance(getattr(critic, "score", None), torch.nn.Linear):
        raise C.UserError(f"critic from {src!r}: its {type(critic).__name__} has no linear `score` head")
    head = torch.nn.Linear(critic.score.in_features, 1, device=device)
    with torch.no_grad():
        if args.critic_init == "policy":  # V = 0 at the start (N: value head init std 0)
            head.weight.zero_(), head.bias.zero_()
        else:  # the normalised RM score of the prefix so far
            head.weight.copy_(critic.score.weight / norm[1])
            head.bias.copy_(((critic.score.bias if critic.score.bias is not None else 0.0) - norm[0]) / norm[1])
    critic.score = head
    if args.gradient_checkpointing:
        critic.gradient_checkpointing_enable()
    return critic


def check_args(a):
    C.check_shared_args(a)
    mb = a.batch_size // a.num_minibatches
    if a.batch_size % a.num_minibatches or mb % min(a.micro_batch_size, mb):
        raise C.UserError(f"--num_minibatches {a.num_minibatches} must divide --batch_size {a.batch_size}, and "
                          f"--micro_batch_size {a.micro_batch_size} the minibatch")
    if a.batch_size < 8:
        raise C.UserError("--batch_size must be >= 8: advantages are whitened over the batch (N)")
    for name, value, choices in (("critic_init", a.critic_init, ("reward_model", "policy")),
                                 ("kl_estimator", a.kl_estimator, ("k1", "k2", "k3")),
                                 ("dtype", a.dtype, ("auto", "bf16", "fp32"))):
        if value not in choices:
            raise C.UserError(f"--{name} {value!r}: choose one of {', '.join(choices)}")


def main():
    args = C.parse_args(Args)
    check_args(args), C.parse_rewards(args.rewards, args.reward_model)  # bad input fails before a folder is made
    run = C.start_run(args, "ppo")  # on --resume, restores the run's saved args ...
    weights = C.parse_rewards(args.rewards, args.reward_model)  # ... so the rewards are read from them
    rng = C.seed_everything(args.seed)
    data = C.load_data(args.data, args.eval_size, need_answer="math" in weights)  # math checks answers
    device, amp = C.pick_device(), C.autocast(C.pick_device(), args.dtype)
    model, tok = C.load_policy(run, args, device)
    C.check_prompts(tok, model, data.rows, args)
    use_ref = args.kl_coef > 0 or args.adaptive_kl  # kl_coef = 0 loads no reference model at all
    ref = C.load_model(args.model, "lm", device, frozen=True, trust_remote_code=args.trust_remote_code,
                       compile=args.compile) \
        if use_ref or args.sanity else None
    if args.sanity:
        raise SystemExit(2 if C.sanity_check(model, ref, tok, data.eval_rows, args, amp) else 0)
    rm, rm_tok = C.load_reward_model(args, device) if "rm" in weights else (None, None)
    norm = (0.0, 1.0)  # N's RM gain and bias; from the checkpoint on resume, measured once otherwise
    if run.state:
        norm = run.state["extra"]["score_norm"]
    elif args.normalize_score:
        norm = score_stats(model, tok, data, weights, rm, rm_tok, args, amp)
        print(f"score under the starting policy: mean {norm[0]:.3g}, std {norm[1]:.3g} (normalised to 0, 1)")
    critic = load_critic(args, tok, device, norm)
    # one optimizer, two parameter groups: the critic has its own lr; checkpoints keep both groups' Adam state
    opt = torch.optim.AdamW([{"params": list(model.parameters()), "lr": args.lr},
                             {"params": list(critic.parameters()), "lr": args.critic_lr}], eps=args.adam_eps, fused=True)
    start, eval_before = C.resume_or_eval(run, model, tok, opt, rng, data, args, amp, rm, rm_tok)
    kl_coef = args.kl_coef
    if run.state:  # the critic's weights and kl_coef travel in the checkpoint's `extra`
        critic.load_state_dict(run.state["extra"]["critic"])
        kl_coef = run.state["extra"]["kl_coef"]
    bar = run.bar = tqdm(range(start, args.max_steps), initial=start, total=args.max_steps, desc="ppo")
    for step in bar:
        t0 = time.time()
        if args.anneal_lr:  # from the step number, so resume needs no scheduler state
            for group, lr in zip(opt.param_groups, (args.lr, args.critic_lr)):
                group["lr"] = lr * (1 - step / args.max_steps)
        # ---- rollout: one completion per prompt, scored by the reward model -----------------------------------
        rows = data.next_batch(rng, args.batch_size)
        roll = C.sample(model, tok, C.encode_prompts(tok, [r["prompt"] for r in rows], args.chat_template),
                        args.max_new_tokens, args.temperature, args.top_p, amp=amp, stop=args.stop)
        completions = C.decode_completions(tok, roll)
        scores, parts = C.compute_rewards(rows, completions, weights, rm, rm_tok)
        if not torch.isfinite(scores).all():
            C.skip_nonfinite(run, "reward")
            continue
        raw_scores = scores
        scores = (scores.to(device) - norm[0]) / norm[1] - args.missing_eos_penalty * roll.truncated.float()  # N+ "EOS trick"
        mask, T = roll.completion_mask, roll.completion_mask.shape[1]
        # ---- old log-probs and values from the training forward (ratio exactly 1 at the first update) --------
        old_logprobs = C.batched_logprobs(model, roll, args.temperature, args.micro_batch_size, amp)
        ref_logprobs = C.batched_logprobs(ref, roll, args.temperature, args.micro_batch_size, amp) \
            if ref is not None else old_logprobs
        old_values = torch.zeros_like(mask)
        with torch.no_grad(), amp:
            for mb in C.micro_batches(mask, args.micro_batch_size):  # like batched_logprobs: similar lengths together
                old_values[mb] = critic_values(critic, roll.ids[mb], roll.attention_mask[mb], T) * mask[mb]
        # ---- rewards, GAE, whitening ----------------------------------------------------------------------------
        rewards, kl = shaped_rewards(scores, old_logprobs, ref_logprobs, mask, kl_coef, args.kl_estimator)
        if args.whiten_rewards:
            rewards = whiten(rewards, mask, shift_mean=False)
        advantages, returns = gae(rewards, old_values, mask, args.gamma, args.lam)
        batch = {"old_logprobs": old_logprobs, "old_values": old_values, "returns": returns,
                 "advantages": whiten(advantages, mask)}
        stats = ppo_update(model, critic, opt, run, roll, batch, args, amp)
        kl_seq = float(kl.sum(1).mean())  # nats per sequence, what Ziegler's controller targets
        metrics_kl_coef = kl_coef
        if args.adaptive_kl:
            kl_coef = adaptive_kl(kl_coef, kl_seq, args.kl_target, args.kl_horizon, len(rows))
        # ---- log, eval, checkpoint ------------------------------------------------------------------------------
        metrics = {"step": step + 1, "reward": float(raw_scores.mean()), "reward_std": float(raw_scores.std()),
                   **{f"reward/{k}": float(v.mean()) for k, v in parts.items()},
                   **C.gold(completions, rows),
                   "kl": float(C.masked_mean(kl, mask)), "kl_seq": kl_seq, "kl_coef": metrics_kl_coef, **stats,
                   "explained_var": explained_variance(old_values, returns, mask),
                   "returns": float(C.masked_mean(returns, mask)), "values": float(C.masked_mean(old_values, mask)),
                   "completion_len": float(mask.sum(-1).mean()), "frac_truncated": float(roll.truncated.float().mean()),
                   "lr": opt.param_groups[0]["lr"], "step_time": time.time() - t0,
                   "tokens_per_s": float(mask.sum()) / (time.time() - t0)}
        samples = [{"prompt": r["prompt"], "completion": c, "score": float(s)}
                   for r, c, s in zip(rows[:4], completions[:4], scores[:4])]
        if C.end_of_step(run, step, metrics, samples, extra={"kl_coef": kl_coef, "score_norm": norm,
                                                             "critic": critic.state_dict()}):
            break
    C.finish_run(run, args, device, eval_before, C.evaluate(model, tok, data.eval_rows, args, amp, rm, rm_tok))


if __name__ == "__main__":
    C.main_guard(main)
