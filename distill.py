"""distill.py: on-policy distillation. The student samples, a frozen teacher scores every sampled
token, and the student moves toward the teacher on its own samples (Agarwal et al., "On-Policy
Distillation of Language Models" (GKD), 2024; Thinking Machines' Tinker cookbook, 2025; prime-rl's
opd; TRL's DistillationTrainer). RL gives one number per completion; a teacher gives one per token.

The student pi_theta samples k completions o per prompt q (k contiguous rows); the teacher pi_T,
frozen, reads the same tokens (after its own prompt, when it is shown more: see Teachers) and
gives its log-probs. Two losses, --loss:

  opd  the sampled token's reverse KL as a per-token advantage in a policy-gradient loss (Tinker,
       prime-rl; discount 0: each token answers for its own KL, not the KL still to come):
         A_t = -kl_coef (log pi_theta(o_t) - log pi_T(o_t)), detached          opd_advantages()
         L_t = -(pi_theta(o_t) / pi_old(o_t)) A_t,  pi_old = pi_theta (one update)   pg_loss()
       a token the teacher finds likelier than the student gets A_t > 0 and is pushed up.
  jsd  TRL's generalized Jensen-Shannon divergence of the whole next-token distributions at each
       sampled position, m = (1 - beta) p_theta + beta p_T:
         D_t = beta KL(p_T || m) + (1 - beta) KL(p_theta || m); beta 0: KL(p_T || p_theta),
         forward, mass-covering; 1: KL(p_theta || p_T), reverse, mode-seeking (TRL's default)
                                                                              generalized_jsd()
       from both models' final hidden states a chunk of positions at a time: neither model's
       (B, T, V) logits exist                                              chunked_divergence()
  loss = sum of L_t (or D_t) over the step's completion tokens / those tokens (token-mean, TRL)

--reward_coef c > 0 mixes RL in (Tinker's RL + distillation): every token of o_i also gets the
advantage c * A_i, A_i its --rewards' GRPO group advantage (k >= 2 samples per prompt). The
rewards are scored and logged either way; the held-out score is the other scripts'.

Teachers: --teacher PATH_OR_NAME, a causal LM with the student's tokenizer (its vocabulary and
chat template are compared before any weights load), or with another one (--loss opd: it reads the
completions' text in its own tokens, aligned by characters: cross_rollout); or none: the student's
own starting weights, frozen, shown what the student is not (self-distillation; prime-rl's opsd,
context distillation):
--teacher_context FIELD, a row field (text or chat messages) read before the prompt (a worked
example, a demonstration), or --teacher_system_prompt TEXT. On --data chat-sums the field
`example` holds the worked example for the half of the prompts that do not show it. The teacher
is never trained or saved; with --lora_r the self-teacher is the student with its adapters off.

Run:  python grpo.py --output_dir runs/teacher     # a teacher for the bundled task, ~15 s
      python distill.py --teacher runs/teacher/checkpoint
      python distill.py --model models/SmolLM2-135M-Instruct --data chat-sums \\
          --teacher_context example   # the model shown a worked example teaches itself
Expect (bundled, 2-core CPU): held-out greedy accuracy 0.29 -> about 0.99 (docs/distill.md).
"""
import bisect
import functools
import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig

import common as C
from plumbing.errors import UserError
import fastpath
from plumbing import flags
from plumbing.flags import arg  # an Args field with its valid range
from plumbing import loading
from plumbing import runs as R
from plumbing import tasks
from plumbing import vllm_sampler as V


@dataclass
class Args:
    # --- model and data
    model: str = loading.DEFAULT_POLICY  # the student: hub id or local folder of a causal LM
    data: str = ""  # '' = built-in addition task; a JSONL of {"prompt", "answer"}; hf:NAME[:CONFIG]
    data_split: str = "train"  # hf: datasets only: the split to read
    prompt_field: str = ""  # the rows' prompt field ('' = prompt, question or problem)
    answer_field: str = ""  # the rows' answer field ('' = answer or solution)
    system_prompt: str = ""  # a system message put before every prompt
    chat_template: Literal["auto", "none"] = "auto"  # auto: the tokenizer's template, if it has one
    trust_remote_code: bool = False  # never run a model repo's own code unless asked
    # --- the teacher
    teacher: str = ""  # a causal LM (another tokenizer: opd); '' = the student's start, frozen
    teacher_context: str = ""  # a row field the teacher reads before the prompt (prime-rl opsd)
    teacher_system_prompt: str = ""  # a system message the teacher reads instead of the row's
    # --- sampling
    samples_per_prompt: int = arg(1, "> 0")  # k per prompt (Tinker's distillation: 1 to 4)
    prompts_per_step: int = arg(64, "> 0")  # prompts per optimizer step (grpo.py's 8 x 8 rows)
    max_new_tokens: int = arg(6, "> 0")  # completion length cap (the built-in task needs 4)
    temperature: float = arg(1.0, ">= 1e-30")  # sampling temperature; both models' log-probs too
    top_p: float = arg(1.0, "[1.2e-38, 1]")  # nucleus sampling (TRL 1.0)
    stop: list[str] = field(default_factory=list)  # stop strings, e.g. "</answer>", end a row too
    vllm: bool = False  # vLLM samples, in this process: TRL's use_vllm colocate (docs/speed.md)
    vllm_gpu_memory_utilization: float = arg(0.3, "(0, 1]")  # its share of GPU memory (TRL 0.3)
    vllm_kv_cache_gb: float = arg(0.0, ">= 0")  # its KV cache; 0: from the share (GPU), 1 (CPU)
    # --- the distillation objective
    loss: Literal["opd", "jsd"] = "opd"  # opd: sampled reverse KL as advantage; jsd: TRL's
    beta: float = arg(1.0, "[0, 1]")  # jsd: 0 forward KL, 1 reverse KL, between: JSD (TRL: 1)
    kl_coef: float = arg(1.0, "> 0")  # opd: A_t's scale (Tinker's kl_penalty_coef: 1)
    # --- rewards: logged, and mixed into the loss with --reward_coef
    rewards: str = ""  # weighted, e.g. "math=1,format=0.1,rm=0.5"; '' = math, or your --reward_fn
    reward_fn: list[str] = field(default_factory=list)  # your rewards, file.py:function (README)
    reward_model: str = ""  # an AutoModelForSequenceClassification (num_labels=1), used as 'rm'
    reward_coef: float = arg(0.0, ">= 0")  # c: + c * GRPO advantage on every token; 0: pure KD
    # --- optimisation
    lr: float = arg(1e-4, "> 0")  # tiny-model lr (grpo.py's); real models ~1e-6 to 2e-5
    weight_decay: float = arg(0.0, ">= 0")  # AdamW weight decay (TRL 0)
    max_grad_norm: float = arg(1.0, "> 0")  # gradient clipping (TRL, verl, OpenRLHF)
    max_steps: int = arg(200, "> 0")  # optimizer steps
    micro_batch_size: int = arg(64, "> 0")  # rows per forward; the loss is normalised per step
    lora_r: int = arg(0, ">= 0")  # LoRA rank (pip install peft); 0: full fine-tuning
    lora_alpha: int = arg(32, "> 0")  # LoRA scale: the update is alpha / r * B A (TRL examples)
    lora_dropout: float = arg(0.0, "[0, 1)")  # adapter dropout (> 0 makes log-probs noisy)
    lora_target_modules: str = "all-linear"  # comma list, or peft's every linear layer but the head
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory
    fsdp: bool = False  # torchrun: shard the student across processes with FSDP2 (--loss opd)
    compile: bool = False  # torch.compile student and teacher: for CUDA; no measured gain on CPU
    dtype: Literal["auto", "bf16", "fp32"] = "auto"  # auto: bf16 autocast on CUDA, fp32 on CPU
    threads: int = arg(0, ">= 0, <= 4 * cores")  # CPU threads; 0: 1 under 10 M params, else all
    # --- run
    seed: int = arg(0, ">= 0, < 2**63")  # seeds sampling, data order, new weights: same run
    eval_every: int = arg(50, ">= 0")  # steps between held-out evals (0: before and after only)
    eval_size: int = arg(500, "> 0")  # held-out prompts per eval
    eval_reward: Literal["auto", "math", "rewards"] = "auto"  # auto: math if answers are numbers
    eval_samples: int = arg(0, ">= 0, <= 1000")  # k > 0: also mean@k and pass@k of k samples
    eval_sampled: bool = False  # the held-out score "eval" is mean@k, not greedy
    save_every: int = arg(100, ">= 0")  # steps between checkpoints (0: only at the end, Ctrl-C)
    save_optimizer: bool = False  # the final checkpoint too keeps AdamW: --resume may extend it
    samples_every: int = arg(25, ">= 0")  # samples.jsonl at steps 1, 1 + this, ... (0: none)
    report_to: Literal["none", "tensorboard", "wandb", "trackio"] = "none"  # also log there
    output_dir: str = ""  # default runs/distill-<time>
    resume: str = ""  # a previous output_dir: continue its run from its checkpoint


# --------------------------------------------------------------------------- the algorithm
def opd_advantages(logprobs, teacher_logprobs, kl_coef=1.0):
    """A_t = -kl_coef (log pi_theta(o_t) - log pi_T(o_t)) per sampled token, detached: minus the
    one-sample estimate of the token's reverse KL(pi_theta || pi_T), as a per-token reward."""
    return (-kl_coef * (logprobs - teacher_logprobs)).detach()


def pg_loss(logprobs, old_logprobs, advantages):
    """-(pi_theta / pi_old) A per token: at pi_old = pi_theta (detached) the ratio is 1 and its
    gradient is -A grad log pi_theta, the policy gradient (Tinker's importance-sampling loss)."""
    return -torch.exp(logprobs - old_logprobs) * advantages


def generalized_jsd(log_ps, log_pt, beta):
    """TRL's generalized JSD of student and teacher distributions, log-probs (N, V) -> (N,):
    beta KL(p_t || m) + (1 - beta) KL(p_s || m), m = (1 - beta) p_s + beta p_t; the two ends are
    the KLs themselves (beta 0: KL(p_t || p_s), forward; 1: KL(p_s || p_t), reverse), as TRL's."""
    ps, pt = log_ps.exp(), log_pt.exp()
    if beta == 0:
        return (pt * (log_pt - log_ps)).sum(-1)
    if beta == 1:
        return (ps * (log_ps - log_pt)).sum(-1)
    log_m = torch.logaddexp(log_ps + math.log(1 - beta), log_pt + math.log(beta))  # log m
    return beta * (pt * (log_pt - log_m)).sum(-1) + (1 - beta) * (ps * (log_ps - log_m)).sum(-1)


def chunk_divergence(xs, xt, targets, heads, args):
    """One chunk of n positions: student and teacher final hidden states xs, xt (n, H) through
    their LM heads (logits / args.temperature, fp32) -> D_t (args.beta), log pi_theta(o_t),
    log pi_T(o_t) and the student's entropy (logged only), (n,) each."""
    log_ps = heads[0](xs, args.temperature).log_softmax(-1)  # (n, V)
    log_pt = heads[1](xt, args.temperature).log_softmax(-1)
    pick = targets[:, None]
    return (generalized_jsd(log_ps, log_pt, args.beta), log_ps.gather(-1, pick)[:, 0],
            log_pt.gather(-1, pick)[:, 0], -(log_ps.exp() * log_ps).sum(-1).detach())


def chunked_divergence(xs, xt, targets, heads, args, chunk):
    """chunk_divergence over N positions (xs, xt (N, H), targets (N,)), `chunk` at a time. Each
    chunk's logits are made again in backward (checkpoint): at most one chunk's exist at once."""
    parts = [checkpoint(chunk_divergence, xs[i:i + chunk], xt[i:i + chunk], targets[i:i + chunk],
                        heads, args, use_reentrant=False)
             for i in range(0, len(xs), chunk)]
    return [torch.cat(p) for p in zip(*parts)]


def group_advantages(rewards, k, eps=1e-4):
    """GRPO's A_i = (r_i - mean of its group) / (std of its group + eps), groups of k rows."""
    r = rewards.view(-1, k)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


def final_hidden(model, ids, attention_mask, T, kept=None):
    """The final hidden states (B, T, H) at the positions that predict the last T tokens of ids.
    Rows that repeat a prompt (--samples_per_prompt > 1): token_logprobs' fast path (each prompt
    once); else fastpath.prefix_forward: a prompt prefix all rows share (a chat template's system
    prompt) once, the rest in groups of rows of like length. kept (fastpath.prefill_keeping: the
    student's prompts' forward in sampling's prefill): only the completions after it."""
    forward, P = functools.partial(C._forward, model), ids.shape[1] - T
    if kept:
        return fastpath.after_prefill(forward, kept, ids, attention_mask, T)
    Tb = max(1, int(attention_mask[:, P:].sum(-1).max()))  # these rows' longest completion
    if len(torch.unique(ids[:, :P], dim=0)) < len(ids):
        x, _ = fastpath.final_hidden(forward, ids, attention_mask, T, fastpath.can_share(model))
    else:  # the positions that predict tokens 0..Tb-1: the last prompt column and Tb - 1 more
        x, _ = fastpath.prefix_forward(forward, ids[:, :P + Tb - 1],
                                       attention_mask[:, :P + Tb - 1], P, fastpath.can_share(model))
    return F.pad(x, (0, 0, 0, T - x.shape[1]))


def lm_head(model):
    """The model's LM head as a function: final hidden states x, temperature t -> logits / t
    (fp32), the ids it never samples at probability 0 (common.suppressed), masked after the
    division (the most negative float / t < 1 is -inf, and p log p then nan). Only a plain
    linear head (fastpath.exact_head)."""
    base = C._unwrap(model)
    head = fastpath.exact_head(base.get_output_embeddings(), functools.partial(C._forward, base))
    if head is None:
        raise UserError("--loss jsd needs a plain linear LM head (not a LoRA-wrapped or "
                        "soft-capped one): use --loss opd")
    return lambda x, t: C.masked_logits(head(x).float() / t, C.suppressed(
        base, head.out_features, x.device))


def teacher_prompt(row, context_field="", system_prompt=""):
    """The prompt the teacher reads: the row's own, after the row's context field (text before a
    text prompt; else chat messages, a text being one user message), under its own system prompt
    in place of the row's when given."""
    prompt = row["prompt"]
    context = row.get(context_field, "") if context_field else ""
    if isinstance(prompt, str) and isinstance(context, str) and not system_prompt:
        return context + prompt
    messages = C.as_messages(prompt)
    system = messages[:1] if messages[0]["role"] == "system" else []
    if system_prompt:
        system = [{"role": "system", "content": system_prompt}]
    rest = messages[1:] if messages[0]["role"] == "system" else messages
    return system + (C.as_messages(context) if context else []) + rest


def teacher_rollout(tok, roll, prompts, chat_template):
    """The student's completions after the teacher's prompts: ids, attention_mask (B, P' + T)."""
    ids, mask = C.left_pad(C.encode_prompts(tok, prompts, chat_template), tok.pad_token_id,
                           roll.ids.device)
    return C.SimpleNamespace(ids=torch.cat([ids, roll.ids[:, roll.P:]], 1), P=ids.shape[1],
                             attention_mask=torch.cat([mask, roll.attention_mask[:, roll.P:]], 1),
                             completion_mask=roll.completion_mask)


# ------------------------------------------------------------- a teacher with another tokenizer
# The teacher reads the student's completion as text in its own tokens; the two tokenizations
# are aligned by characters: a span ends where both end a token (TRL GOLD's byte-offset groups;
# docs/distill.md). Over a span c, log pi(c) is the sum of its tokens' log-probs in
# either model, and every student token of c gets the span's A_c = -kl_coef (log pi_theta(c) -
# log pi_T(c)): E[sum_t A_c grad log pi_theta(o_t)] = -grad KL(pi_theta || pi_T) over c, exact.
# One tokenizer presented as another gives one-token spans: the same loss (tested).
def token_ends(tok, ids, text):
    """Where each token of ids (decoding to text) ends in text: the length of its prefix's
    decoding, or the next token's end where that is not a prefix of text (a token ending inside a
    character, byte-level BPE's), the text's length at the last."""
    pieces = [tok.decode(ids[:i + 1]) for i in range(len(ids))]
    ends = [len(p) if text.startswith(p) else None for p in pieces]
    ends[-1:] = [len(text)] * len(ends[-1:])  # the last token ends the text
    for i in reversed(range(len(ends) - 1)):  # inside a character: the next token's end
        if ends[i] is None:
            ends[i] = ends[i + 1]
    return ends


def cross_rollout(tok, t_tok, roll, prompts, chat_template, eos):
    """The teacher's rollout for another tokenizer: its prompts in its template, then each
    student completion's text (the EOS token apart, eos: the student's EOS ids) in its tokens and
    its EOS where the student's row ended with one. And the span of every student (B, T) and
    teacher (B, T') completion token, numbered across the batch: n spans."""
    t_ids, spans, t_spans, n = [], [], [], 0
    for row, m in zip(roll.ids[:, roll.P:].tolist(), roll.completion_mask.tolist()):
        ids = row[:int(sum(m))]
        end = ids[-1:] if ids and ids[-1] in eos else []  # the EOS: a span of its own
        ids = ids[:len(ids) - len(end)]
        text = tok.decode(ids)
        ids_t = t_tok(text, add_special_tokens=False)["input_ids"]
        s_end, t_end = token_ends(tok, ids, text), token_ends(t_tok, ids_t, text)
        cuts = sorted(set(s_end) & set(t_end) | {len(text)})  # where both tokenizations cut
        for out, ends in ((spans, s_end), (t_spans, t_end)):  # a token's span: its end's cut
            out.append([n + bisect.bisect_left(cuts, e) for e in ends] + [n + len(cuts)] * len(end))
        t_ids.append(ids_t + [t_tok.eos_token_id] * len(end))
        n += len(cuts) + len(end)
    T, Tt = roll.completion_mask.shape[1], max(1, max(map(len, t_ids)))
    ids, mask = C.left_pad(C.encode_prompts(t_tok, prompts, chat_template), t_tok.pad_token_id,
                           roll.ids.device)
    pad = lambda rows, width, v: torch.tensor([r + [v] * (width - len(r)) for r in rows],
                                             device=roll.ids.device)
    completion_mask = pad([[1.0] * len(r) for r in t_ids], Tt, 0.0)  # (B, T')
    t_roll = C.SimpleNamespace(ids=torch.cat([ids, pad(t_ids, Tt, t_tok.pad_token_id)], 1),
                               attention_mask=torch.cat([mask, completion_mask.long()], 1),
                               completion_mask=completion_mask, P=ids.shape[1])
    return t_roll, pad(spans, T, 0), pad(t_spans, Tt, 0), n


def span_logprobs(logprobs, teacher_span_logprobs, span):
    """The student's log-probs (N,) summed over their spans (span (N,): each token's index into
    teacher_span_logprobs (S,)) -> each token's span's log-prob under the student and under the
    teacher, and 1 / the span's tokens (the logged KL counts a span once), (N,) each."""
    student = torch.zeros_like(teacher_span_logprobs).index_add(0, span, logprobs)  # (S,)
    count = torch.zeros_like(student).index_add(0, span, torch.ones_like(logprobs))
    return student[span], teacher_span_logprobs[span], 1 / count[span]


def check_args(args, rows):
    """The flags, and the teacher before any weights load: it reads the student's tokens (the
    same vocabulary and chat template) or, returned, its own tokenizer (cross_rollout); a
    self-teacher is shown something more."""
    flags.check_args(args)
    if args.reward_coef and args.samples_per_prompt < 2:
        raise UserError("--reward_coef needs --samples_per_prompt >= 2: a group of one has no "
                        "relative advantage")
    if args.fsdp and args.loss == "jsd":
        raise UserError("--fsdp shards the LM head that --loss jsd runs a chunk at a time: "
                        "use --loss opd, or DDP (torchrun without --fsdp)")
    if not args.teacher and not (args.teacher_context or args.teacher_system_prompt):
        raise UserError("no --teacher: the teacher is the student's own starting weights, which "
                        "teach nothing unless shown more: give --teacher PATH, or "
                        "--teacher_context FIELD or --teacher_system_prompt TEXT")
    for row in rows if args.teacher_context else ():
        if args.teacher_context not in row:
            raise UserError(f"--teacher_context {args.teacher_context!r}: the row "
                            f"{C.as_text(row['prompt'])[:40]!r} has no such field")
    if args.teacher:
        student, teacher = (loading.load_tokenizer(name, args.trust_remote_code)
                            for name in (args.model, args.teacher))
        if student.get_vocab() != teacher.get_vocab():  # it reads the completions' text
            if args.loss == "jsd":
                raise UserError(f"--teacher {args.teacher}: its vocabulary ({len(teacher)} "
                                f"tokens) is not the student's ({len(student)}), and --loss jsd "
                                "compares next-token distributions over one vocabulary: use "
                                "--loss opd, which aligns the two by characters")
            return teacher
        if args.chat_template == "auto" and student.chat_template != teacher.chat_template:
            raise UserError(f"--teacher {args.teacher}: its chat template differs from the "
                            "student's, so it would read other prompts (--chat_template none "
                            "for plain text)")
        # the student samples the ids below its LM head's rows that have a token (the rows past
        # its tokenizer's are never sampled: common.suppressed); a token past the teacher's rows
        # would have no teacher probability (log 0: an infinite KL), so such a teacher is refused
        try:
            s_rows, t_rows = (AutoConfig.from_pretrained(
                name, trust_remote_code=args.trust_remote_code).get_text_config().vocab_size
                for name in (args.model, args.teacher))
        except (OSError, ValueError):
            return  # no config to read: loading the model says so in one line
        if t_rows < min(s_rows, len(student)):
            raise UserError(f"--teacher {args.teacher}: its LM head has {t_rows} rows, fewer "
                            f"than the {min(s_rows, len(student))} token ids the student can "
                            "sample: give a teacher whose embedding covers its tokenizer")


# -------------------------------------------------------------------------- the training loop
def main():
    args = flags.parse_args(Args, "distill", __doc__)  # --resume DIR: that run's own settings
    fns = loading.load_reward_fns(args.reward_fn)  # your own reward functions, by name
    weights = loading.parse_rewards(args.rewards, args.reward_model, fns, default="math")
    data = tasks.load_data(args.data, args.eval_size, "math" in weights and args.reward_coef > 0,
                           args.data_split, prompt_field=args.prompt_field,
                           answer_field=args.answer_field, system_prompt=args.system_prompt)
    # the teacher's tokenizer, before any weights load: t_tok, or None for the student's own
    t_tok = check_args(args, data.rows)
    device = R.setup_distributed()  # under torchrun: this process's device; else cuda or cpu
    run = R.start_run(args, "distill")  # output folder, lock, metrics.jsonl, Ctrl-C handler
    rng = R.seed_everything(args.seed)
    amp = loading.autocast(device, args.dtype)  # bf16 forwards on a GPU; weights stay fp32
    model, tok = loading.load_policy(args, device, f"{run.dir}/checkpoint" if args.resume else "",
                                     data.rows)  # the prompts checked first
    R.set_threads(args, model)  # CPU: one thread for a small model (see runs.set_threads)
    # the frozen teacher (bf16 on a GPU): --teacher, or the student's starting weights (LoRA: the
    # student with its adapters off, as grpo.py's reference)
    teacher = model if args.lora_r and not args.teacher else loading.load_model(
        args.teacher or args.model, "lm", device, frozen=True,
        trust_remote_code=args.trust_remote_code, compile=args.compile)
    if "rm" in weights:  # the reward model's score, as a reward function (common.rm_scores)
        fns["rm"] = loading.load_reward_model(args, device)
    heads = (lm_head(model), lm_head(teacher)) if args.loss == "jsd" else None
    if heads and model.config.vocab_size != teacher.config.vocab_size:
        raise UserError(f"--loss jsd compares whole distributions: the teacher's LM head has "
                        f"{teacher.config.vocab_size} rows, the student's "
                        f"{model.config.vocab_size}; use --loss opd")
    chunk = max(1, fastpath.CHUNK_ELEMS // model.config.vocab_size)  # positions per chunk
    sampler = V.Sampler(args, model, tok, device) if args.vllm else None  # --vllm: vLLM samples
    train_model = R.wrap_model(model, args.fsdp)  # torchrun: DDP, or FSDP2 in place (--fsdp)
    trained = [p for p in model.parameters() if p.requires_grad]  # all, or LoRA's adapters
    opt = torch.optim.AdamW(trained, lr=args.lr, weight_decay=args.weight_decay,
                            fused=True)  # fused: one kernel for all parameters

    # the held-out score: accuracy, a reasoning-gym score or the mean reward; what it scores
    metric = tasks.eval_metric(data.eval_rows, args.eval_reward)
    scored = tasks.scored_by(metric, weights, fns)

    def evaluate():  # held-out scores; under torchrun each process scores a share of the rows
        return R.split_eval(run, model, data.eval_rows, lambda rows: C.evaluate(
            model, tok, rows, args, amp, scored, fns, sampler=sampler))
    start, eval_before, _ = R.resume_or_eval(run, opt, rng, evaluate, metric, [model])
    k = args.samples_per_prompt
    shown = args.teacher_context or args.teacher_system_prompt  # the teacher reads its own prompt

    def save(done):  # checkpoint/ after `done` steps: every --save_every, at the end, on Ctrl-C
        R.save_checkpoint(run, model, tok, opt, rng, done, {"eval_before": eval_before})
    # the run-keeping (Ctrl-C, NaN guards, logs, eval, warnings, checkpoints): keep.* calls
    # (runs.Keeper; its drift warning skips distill's kl, which is the distance to the teacher)
    keep = R.Keeper(run, opt, rng, save, evaluate)
    # --loss jsd in one micro-batch: the student's prompts run once a step, in sampling's prefill
    # with their gradients kept (fastpath.prefill_keeping; the same weights: one update a batch),
    # and its training forward only over the completions after them (final_hidden's kept)
    kept, prompts_once = {}, (args.loss == "jsd" and sampler is None and fastpath.can_share(model)
                              and args.prompts_per_step * k <= args.micro_batch_size)
    prefill = functools.partial(fastpath.prefill_keeping, functools.partial(C._forward, model),
                                model.get_input_embeddings(), kept) if prompts_once else None
    for step in keep.steps(start):
        # 1. the student samples k completions per prompt (k contiguous rows); rewards scored
        prompts = data.next_batch(rng, args.prompts_per_step)[run.rank::run.world]  # a share
        rows = [r for r in prompts for _ in range(k)]
        with keep.sampling(model, step):
            roll, completions = C.generate(model, tok, rows, args, amp, sampler=sampler,
                                           prefill=prefill)
        scores, parts = C.compute_rewards(rows, completions, weights, fns)
        # a NaN/inf reward that trains (--reward_coef), in any process: no update this step
        if args.reward_coef and not keep.finite(scores.sum(), what="reward"):
            continue
        mask = roll.completion_mask  # (B, T): 1 on each completion token, EOS included
        B, T = mask.shape
        # 2. the teacher reads the same completions, after its own prompt when it is shown more
        t_roll = roll if not shown else teacher_rollout(tok, roll, [teacher_prompt(
            r, args.teacher_context, args.teacher_system_prompt) for r in rows], args.chat_template)
        teacher_logprobs = spans = None
        if t_tok is not None:  # another tokenizer: the completions' text in its own tokens
            t_roll, spans, t_spans, n = cross_rollout(tok, t_tok, roll, [teacher_prompt(
                r, args.teacher_context, args.teacher_system_prompt) for r in rows],
                args.chat_template, C.eos_ids(model, tok))
        if args.loss == "opd":  # log pi_T of each sampled token (B, T), no gradient
            with R.adapters_off(teacher):  # LoRA self-distillation: the student, adapters off
                teacher_logprobs = C.batched_logprobs(teacher, t_roll, args.temperature,
                                                      args.micro_batch_size, amp)
        if spans is not None:  # log pi_T of each span (n,): the sum of its tokens'
            on = t_roll.completion_mask.bool()
            teacher_logprobs = torch.zeros(n, device=device).index_add(
                0, t_spans[on], teacher_logprobs[on])
        reward_adv = torch.zeros(B, device=device)  # c * A_i, the RL part (0: distillation only)
        if args.reward_coef:
            reward_adv = args.reward_coef * group_advantages(scores, k).to(device)
        # 3. one update; the loss is summed over each micro-batch's tokens / the step's tokens
        n_tokens = R.global_sum(mask.sum()).clamp(min=1)
        n_local = float(mask.sum().clamp(min=1))  # for the logged means: this process's tokens
        sums = dict.fromkeys(("loss", "kl", "entropy") + (("divergence",) if heads else ()), 0.0)
        mbs = C.micro_batches(mask, args.micro_batch_size)
        for i, mb in enumerate(mbs):
            valid = mask[mb].bool()  # the micro-batch's completion tokens: N of them
            adv = reward_adv[mb, None].expand(-1, T)[valid]  # (N,)
            with R.sync_gradients(train_model, now=i == len(mbs) - 1):  # DDP: at the last
                with amp:
                    if args.loss == "opd":
                        logprobs, entropy = C.token_logprobs(train_model, roll.ids[mb],
                                                             roll.attention_mask[mb], T,
                                                             args.temperature, entropy=True)
                        lp, once = logprobs[valid], 1.0  # (N,)
                        if spans is None:  # the teacher read these very tokens
                            lp_c, t_lp = lp, teacher_logprobs[mb][valid]
                        else:  # another tokenizer: each token's span, under both models
                            lp_c, t_lp, once = span_logprobs(lp, teacher_logprobs,
                                                             spans[mb][valid])
                        entropy = entropy[valid].detach()  # logged only
                        loss = pg_loss(lp, lp.detach(), opd_advantages(lp_c, t_lp, args.kl_coef)
                                       + adv)
                    else:  # jsd: final hidden states, then both LM heads a chunk at a time
                        xs = final_hidden(train_model, roll.ids[mb], roll.attention_mask[mb], T,
                                          kept)
                        with torch.no_grad(), R.adapters_off(teacher):
                            xt = final_hidden(teacher, t_roll.ids[mb], t_roll.attention_mask[mb],
                                              T)
                        div, lp, t_lp, entropy = chunked_divergence(
                            xs[valid], xt[valid], roll.ids[mb, -T:][valid], heads, args, chunk)
                        loss = div + pg_loss(lp, lp.detach(), adv)  # + the RL part, if any
                        lp_c, once = lp, 1.0
                        sums["divergence"] += float(div.detach().sum()) / n_local
                loss = loss.sum() / n_tokens  # token-mean over the whole step
                # DDP/FSDP2 average the processes' gradients: x world makes them the sum
                (loss * run.world).backward()  # gradients add up over the micro-batches
            sums["loss"] += loss.item() * run.world  # the global mean below: the sum
            # KL(pi_theta || pi_T), k1, a span once
            sums["kl"] += float((once * (lp_c - t_lp)).detach().sum()) / n_local
            sums["entropy"] += float(entropy.sum()) / n_local
        kept.clear()  # the prompts' forward, used
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        if keep.finite(grad_norm):  # NaN/inf would ruin the weights: skip the update
            opt.step()
        opt.zero_grad(set_to_none=True)
        if sampler:  # --vllm: the updated weights into its engine, for the next samples
            sampler.load_weights(model)
        # 4. log, eval, checkpoint
        metrics = {**keep.rollout_metrics(roll, rows, completions, scores, parts), **sums,
                   "grad_norm": float(grad_norm)}
        samples = keep.samples(tok, roll, rows, completions, scores, k)  # one of each of 4 prompts
        # under torchrun: the mean over the processes, token means weighted by their tokens
        keep.end_step(step, metrics, samples, mask.sum(),
                      dict.fromkeys(("kl", "entropy", "divergence"), mask.sum()))
    keep.finish(metric, eval_before)


if __name__ == "__main__":
    R.main_guard(main)
