"""common.py: the algorithmic core that every training script shares, and must share identically:
sampling (one turn, or a multi-turn episode with a tool: one decode loop) -> log-probs and KL
-> rewards -> held-out eval. The fast paths (same numbers) are in fastpath.py; the plumbing an
algorithm reader can skip in tasks.py, loading.py, envs.py and runs.py.

Notation used in every script:
  pi_theta  the policy being trained;  pi_old  the policy that sampled the batch (a frozen copy of
  pi_theta's log-probs);  pi_ref  a frozen reference model, usually the starting policy.
  A rollout `roll` (from sample()) holds B rows of prompt + completion: roll.ids and
  roll.attention_mask (B, P + T) are P prompt columns (left-padded), then T completion columns
  (right-padded). roll.completion_mask (B, T) is 1 on every generated token up to AND including the
  EOS and 0 after it. Masks come from lengths, never from token values, so the EOS is in the loss
  even when the pad token is the EOS token. roll.truncated (B,): no EOS (nor stop string) in the
  budget; roll.sample_logprobs (B, T): log pi_sampler of each token, at the sampling temperature.
  Multi-turn (tool use): observation tokens sit between the model's turns with attention_mask 1,
  completion_mask 0 and sample_logprobs 0: context, like the prompt.
  Log-probs are log pi(token | earlier tokens), in fp32, on logits / the sampling temperature.
"""
import functools
import inspect
import math
import numbers
import re
from types import SimpleNamespace

import torch
from transformers import DynamicCache

import answer_format  # the number a text's answer states: \boxed{}, '####', fractions
from errors import UserError, first_line as _first_line  # bad input: one line (runs.main_guard)
import fastpath  # the fast paths of sample() and token_logprobs(): same numbers, less work
import tasks  # the data: encode_prompts() turns a row's prompt into token ids (chat template)

try:  # optional: a symbolic answer checker (pip install math-verify), used when installed
    import math_verify
except ImportError:
    math_verify = None


def left_pad(seqs, pad_id, device):
    P = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (P - len(s)) + list(s) for s in seqs], device=device)
    mask = torch.tensor([[0] * (P - len(s)) + [1] * len(s) for s in seqs], device=device)
    return ids, mask


def positions(attention_mask):
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens count from 0


@functools.lru_cache(maxsize=None)
def _cache_kwarg(model_cls):
    # transformers >= 5.24 names the KV-cache argument `cache`; older ones `past_key_values`
    params = inspect.signature(model_cls.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _unwrap(model):  # DDP and LoRA (peft) wrappers pass arguments on to the model they wrap
    model = getattr(model, "module", model)  # DistributedDataParallel
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _forward(model, ids, mask, pos, cache=None, keep=0, hidden=False):
    """Every forward passes the same arguments, so --compile's guards hold. keep: logits_to_keep
    (the last `keep` positions go through the LM head, 0 = all); hidden: also the hidden states."""
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=keep,
                 use_cache=cache is not None, output_hidden_states=hidden,
                 **{_cache_kwarg(type(_unwrap(model))): cache})


def suppressed(model, V, device):
    """(V,) bool or None: the ids never sampled and given probability 0 by the log-probs, the
    generation config's suppress_tokens (loading.load_model: embedding rows with no token)."""
    ids = getattr(_unwrap(model).generation_config, "suppress_tokens", None)
    if not ids:
        return None
    mask = torch.zeros(V, dtype=torch.bool, device=device)
    mask[torch.tensor([i for i in ids if i < V], dtype=torch.long, device=device)] = True
    return mask


def masked_logits(z, mask):
    """z (..., V) with the suppressed ids at the most negative float, not -inf: their probability
    is exactly 0, and p log p (entropy) stays 0 * finite = 0, not nan."""
    return z if mask is None else z.masked_fill(mask, torch.finfo(z.dtype).min)


def eos_ids(model, tok):
    """Every token that ends a completion: the tokenizer's EOS and the generation config's."""
    stop = getattr(model.generation_config, "eos_token_id", None)
    return sorted({tok.eos_token_id, *(stop if isinstance(stop, list) else [stop])} - {None})


def _observe(tok, env_step, ep, out, rows, t, left, max_turns, eos):
    """sample()'s multi-turn step for the rows whose turn ended at column t: record each turn's
    text, ask env_step for the observations of those with turns left, all at once (a request:
    row, turns, budget left, the EOS the turn ended on or None), and queue their token ids."""
    for i in rows:
        ep.turns[i].append(tok.decode(out[i, ep.begun[i]:t + 1], skip_special_tokens=True))
        ep.begun[i] = t + 1
    asking = [i for i in rows if len(ep.turns[i]) < max_turns]
    ends = [int(out[i, t]) if out[i, t] in eos else None for i in asking]
    answers = dict(zip(asking, env_step([(i, list(ep.turns[i]), left, end)
                                         for i, end in zip(asking, ends)])))
    for i, answer in answers.items():
        if answer is not None:  # (ids cut to the budget, whether they were cut); None: it ended
            ep.forced[i], cut = answer
            ep.obs_cut[i] |= cut
            ep.observations[i].append(tok.decode(ep.forced[i]))  # as the model reads it
            ep.begun[i] = t + 1 + len(ep.forced[i])  # the model's next turn starts after it
    return torch.tensor([answers.get(i) is not None for i in rows], device=out.device)


@torch.no_grad()
def sample(model, tok, prompt_ids, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False,
           amp=None, stop=(), share_prompts=True, env_step=None, max_turns=1):
    """Batched sampling with a KV cache -> a rollout (its fields: the top of this file). A row's
    turn ends at its first EOS or at the token that completes a `stop` string; greedy: the argmax
    instead of a draw. Without env_step the row is then done and leaves the batch and the cache.
    With env_step (tool use: envs.start_episodes) its env answers: None ends the episode; an
    observation's tokens are fed to the row one a step through the same KV cache (forced, not
    sampled: completion_mask 0, sample_logprobs 0) while the other rows go on sampling, and then
    the model's next turn follows: no token is forwarded twice. max_new_tokens: the budget of the
    whole completion, observations included; no env call after turn max_turns."""
    B, device = len(prompt_ids), next(model.parameters()).device
    eos = torch.tensor(eos_ids(model, tok), device=device)
    out = torch.full((B, max_new_tokens), tok.pad_token_id, device=device)  # sampled tokens
    out_lp = torch.zeros(B, max_new_tokens, device=device)
    lengths = torch.full((B,), max_new_tokens, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    window = max(map(len, stop), default=0) + 2  # a stop string spans <= 1 token per character
    live = torch.arange(B, device=device)  # original row index of each row still being sampled
    is_obs = torch.zeros(B, max_new_tokens, dtype=torch.bool, device=device)  # fed, not sampled
    # each episode's own state (multi-turn): observation tokens still to feed, the model's turns
    # (texts), the column where its current turn began, the observations, and whether one was cut
    ep = SimpleNamespace(forced=[[] for _ in range(B)], turns=[[] for _ in range(B)],
                         begun=[0] * B, observations=[[] for _ in range(B)], obs_cut=[False] * B)
    with amp or torch.autocast(device.type, enabled=False):
        if share_prompts:  # the fast path: each distinct prompt's prefill runs once (same numbers)
            logits, cache, ids, prompt_mask = fastpath.prefill_shared(model, prompt_ids,
                                                                      tok.pad_token_id, device)
        else:  # the plain prefill of every row
            ids, prompt_mask = left_pad(prompt_ids, tok.pad_token_id, device)
            cache = DynamicCache()
            logits = _forward(model, ids, prompt_mask, positions(prompt_mask), cache, keep=1)
            logits = logits.logits[:, -1]
        P = ids.shape[1]
        # the attention mask of every column there can be; step t passes its first P + t + 1
        mask = torch.cat([prompt_mask, prompt_mask.new_ones(B, max_new_tokens)], dim=1)
        pos = positions(prompt_mask)[:, -1:]  # each row's last position; + 1 per new token
        never = suppressed(model, logits.shape[-1], device)  # (V,) bool: ids never sampled
        for t in range(max_new_tokens):  # logits (rows, V): the last position only (keep=1)
            z = masked_logits(logits.float(), never) / temperature
            probs = z.softmax(-1)
            if top_p < 1.0:  # nucleus: keep the smallest set of tokens with mass >= top_p
                p_sorted, idx = probs.sort(-1, descending=True)
                drop = p_sorted.cumsum(-1) - p_sorted >= top_p
                probs = probs.scatter(-1, idx, p_sorted.masked_fill(drop, 0.0))
            nxt = z.argmax(-1) if greedy else torch.multinomial(probs, 1).squeeze(-1)
            out_lp[live, t] = z.log_softmax(-1).gather(-1, nxt[:, None])[:, 0]
            if top_p < 1.0:  # drawn from the kept tokens, renormalised: their mass is probs.sum()
                out_lp[live, t] -= probs.sum(-1).log()
            feeding = [j for j, i in enumerate(live.tolist()) if ep.forced[i]] if env_step else []
            if feeding:  # rows amid an observation take its next token instead of the draw
                fed = live[feeding]
                nxt[feeding] = torch.tensor([ep.forced[i].pop(0) for i in fed.tolist()],
                                            device=device)
                out_lp[fed, t], is_obs[fed, t] = 0.0, True
            out[live, t] = nxt
            sampled = ~is_obs[live, t]
            ended = torch.isin(nxt, eos) & sampled  # the model's turn ended on its EOS
            if stop:  # decode each row's last few tokens: does a stop string end at this one?
                lo = max(0, t + 1 - window)
                tails = tok.batch_decode(out[live, lo:t + 1])
                for j, i in enumerate(live.tolist() if env_step else []):  # a turn that began
                    if ep.begun[i] > lo:  # inside the window: its own tokens only
                        tails[j] = tok.decode(out[i, ep.begun[i]:t + 1])
                ended |= torch.tensor([any(s in x for s in stop) for x in tails],
                                      device=device) & sampled
            if env_step is not None and ended.any():  # the env answers; None ends the episode
                goes_on = _observe(tok, env_step, ep, out, live[ended].tolist(), t,
                                   max_new_tokens - t - 1, max_turns, eos)
                ended[ended.clone()] = ~goes_on  # a row that gets an observation goes on
            lengths[live[ended]] = t + 1
            finished[live[ended]] = True
            if ended.all() or t == max_new_tokens - 1:
                break
            if ended.any():  # drop finished rows from the batch and the KV cache
                keep = (~ended).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                live, nxt, mask, pos = live[keep], nxt[keep], mask[keep], pos[keep]
            pos = pos + 1  # the new token's position
            logits = _forward(model, nxt[:, None], mask[:, :P + t + 1], pos, cache,
                              keep=1).logits[:, -1]
    T = int(lengths.max())
    real = torch.arange(T, device=device)[None] < lengths[:, None]
    completion_mask = (real & ~is_obs[:, :T]).float()  # the model's tokens, not observations
    roll = SimpleNamespace(ids=torch.cat([ids, out[:, :T]], 1), completion_mask=completion_mask,
                           attention_mask=torch.cat([prompt_mask, real.long()], 1),
                           truncated=~finished, sample_logprobs=out_lp[:, :T] * completion_mask,
                           P=P)
    if env_step is None:
        return roll
    for i, n in enumerate(lengths.tolist()):  # the turn a row was in when the budget ran out
        if ep.begun[i] < n:
            ep.turns[i].append(tok.decode(out[i, ep.begun[i]:n], skip_special_tokens=True))
    roll.turns = torch.tensor([len(x) for x in ep.turns])  # model turns per row
    roll.tool_calls = torch.tensor([len(x) for x in ep.observations])  # observations per row
    roll.obs_truncated = torch.tensor(ep.obs_cut)  # an observation was cut by the budget
    roll.observations = ep.observations
    # what rewards read: the text after the last observation ('' if the budget ended inside it)
    roll.final = [t[-1] if len(t) > len(o) else "" for t, o in zip(ep.turns, ep.observations)]
    roll.transcript = ["".join(x + (f"⟦{o[k]}⟧" if k < len(o) else "") for k, x in enumerate(ts))
                       for ts, o in zip(ep.turns, ep.observations)]  # observations in ⟦...⟧
    return roll


def decode_completions(tok, roll):
    lengths = roll.completion_mask.sum(-1).long().tolist()
    rows = roll.ids[:, roll.P:].tolist()
    return [tok.decode(row[:n], skip_special_tokens=True) for row, n in zip(rows, lengths)]


def generate(model, tok, rows, args, amp, env=None, greedy=False):
    """One completion per row by sample(); with env (envs.load_env) one multi-turn episode per row,
    each on its own copy of the row. Returns the rollout and the texts rewards read (with env, the
    text after the last observation). greedy (held-out eval): the argmax, at temperature 1."""
    tools = env.tools if env else None  # --tools: their JSON schemas, rendered by the template
    prompt_ids = tasks.encode_prompts(tok, [r["prompt"] for r in rows], args.chat_template, tools)
    temperature, top_p = (1.0, 1.0) if greedy else (args.temperature, args.top_p)
    env_step, episodes = env.start(rows, tok) if env else (None, None)
    roll = sample(model, tok, prompt_ids, args.max_new_tokens, temperature, top_p, greedy, amp,
                  args.stop, env_step=env_step, max_turns=args.max_turns if env else 1)
    if env is None:
        return roll, decode_completions(tok, roll)
    roll.episodes = episodes  # each episode's state (--tools: its calls, for envs.tool_metrics)
    return roll, roll.final  # the text after the last observation


# ------------------------------------------------------------------------------ log-probs, KL
def token_logprobs(model, ids, attention_mask, T, temperature=1.0, entropy=False, fast=True):
    """log pi(token_t | tokens before t), with gradients, for the last T positions of ids (B, P+T):
    (B, T); entropy: also each position's entropy (B, T), else None. suppressed() ids get p = 0."""
    head = _unwrap(model).get_output_embeddings()  # fast path: a head load_model checked
    if not fast or head not in fastpath.SPLIT_HEADS:  # the plain computation, as a student's:
        # the last T + 1 positions through the LM head (logits_to_keep): position t predicts
        logits = _forward(model, ids, attention_mask, positions(attention_mask), keep=T + 1).logits
        logits = logits[:, :-1]  # (B, T, V): token t + 1, so shift by one and drop the last
        z = logits.float() / temperature  # fp32, at the sampling temperature
        logp = masked_logits(z, suppressed(model, z.shape[-1], z.device)).log_softmax(-1)
        lp = logp.gather(-1, ids[:, -T:, None])[..., 0]  # (B, T): the log-prob of each taken token
        return lp, -(logp.exp() * logp).sum(-1) if entropy else None
    return fastpath.fast_token_logprobs(model, head, ids, attention_mask, T, temperature, entropy)


def micro_batches(completion_mask, size):
    """Row indices of each micro-batch (index every per-row tensor with them: advantages[mb]).
    With more than one, rows go in order of completion length: fewer padding columns each."""
    B = len(completion_mask)
    by_length = completion_mask.sum(-1).argsort(stable=True)
    order = by_length if size < B else torch.arange(B, device=completion_mask.device)
    return [order[i:i + size] for i in range(0, B, size)]


@torch.no_grad()
def batched_logprobs(model, roll, temperature, micro_batch, amp):
    """token_logprobs without gradients, micro-batched: old, reference and sanity log-probs."""
    out = torch.zeros_like(roll.completion_mask)
    T = out.shape[1]
    with amp:
        for mb in micro_batches(roll.completion_mask, micro_batch):
            lp, _ = token_logprobs(model, roll.ids[mb], roll.attention_mask[mb], T, temperature)
            out[mb] = lp
    return out * roll.completion_mask


def kl_estimate(logprobs, ref_logprobs, estimator):
    """Per-token estimates of KL(pi || pi_ref) from samples of pi (Schulman 2020, "Approximating
    KL divergence"). These are the VALUES; in a loss their gradients differ: grpo.per_token_loss."""
    log_r = ref_logprobs - logprobs  # log r = log pi_ref - log pi
    if estimator == "k1":
        return -log_r  # k1 = -log r: unbiased, noisy, can be < 0
    if estimator == "k2":
        return 0.5 * log_r**2  # k2 = (log r)^2 / 2: biased, low variance, >= 0
    log_r = log_r.clamp(-20, 20)  # k3 alone exponentiates: exp() stays finite (TRL issue #3015)
    return log_r.exp() - 1 - log_r  # k3 = r - 1 - log r: unbiased, >= 0 (DeepSeekMath)


def masked_mean(x, mask, dim=None, total=None):
    """Mean of x where mask = 1; total: also sum over torchrun's processes (runs.global_sum)."""
    total = total or (lambda t: t)
    return total((x * mask).sum(dim)) / total(mask.sum(dim)).clamp(min=1)


def whiten(x, mask, shift_mean=True, eps=1e-8, total=None):
    """(x - mean) / std over the valid (mask = 1) entries only, biased variance (as OpenRLHF and
    the TF code of Ziegler et al.); shift_mean=False adds the mean back. 0 where mask = 0.
    total: also sum over torchrun's processes (runs.global_sum): the global batch's statistics."""
    mean = masked_mean(x, mask, total=total)
    var = masked_mean((x - mean) ** 2, mask, total=total)
    out = (x - mean) * torch.rsqrt(var + eps)
    return (out if shift_mean else out + mean) * mask


# --------------------------------------------------------------------------------------- rewards
def math_reward(completion, row):
    """1 when the completion states the answer: its number, or its expression written alike (\\pi;
    answer_format.final_answer). With the optional package math-verify, its symbolic check."""
    if math_verify is not None:
        return float(math_verify.verify(math_verify.parse(row.get("answer", "")),
                                        math_verify.parse(completion)))
    want = answer_format.final_answer(row.get("answer", ""), reference=True)
    got = answer_format.final_answer(completion)
    if isinstance(want, str) or isinstance(got, str):  # an expression (\pi, (1,2)): as written
        return float(want == got)
    return float(want is not None and got is not None and math.isclose(got, want, rel_tol=1e-9))


def format_reward(completion, row):
    """1 when the completion states its final answer as graders read it, whatever its value: a
    non-empty \\boxed{...} (MATH) or a last line '#### N' (GSM8K)."""
    boxed = answer_format.last_boxed(completion)
    gsm8k = re.search(r"(^|\n)\s*####\s*-?[\d,]*\.?\d+\s*$", completion)
    return float(bool(boxed and boxed.strip()) or gsm8k is not None)


def length_reward(completion, row):
    return -len(completion) / 100.0  # a mild penalty per character


RULES = {"math": math_reward, "format": format_reward, "length": length_reward}


def call_reward_fn(name, fn, completions, rows):
    """Your reward on the batch, checked: one number per completion, (B,). NaN/inf pass through:
    the training step is then skipped. An error names the first row that fails alone."""
    try:
        values = list(fn(completions, rows))
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # sys.exit() in it: one line too
        what = f"reward {name!r} raised {type(e).__name__}: {_first_line(e)}"
        for i in range(len(rows)) if isinstance(e, Exception) else ():  # which row? each alone
            try:
                fn(completions[i:i + 1], rows[i:i + 1])
            except Exception:
                prompt = tasks.as_text(rows[i]["prompt"])[:40]
                raise UserError(f"{what} (first on row {i}, prompt {prompt!r})") from None
        raise UserError(what) from None
    if len(values) != len(rows):
        raise UserError(f"reward {name!r} returned {len(values)} values for {len(rows)} "
                        "completions: return one number per completion")
    for i, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise UserError(f"reward {name!r} returned {v!r} for row {i}: not a number")
    return torch.tensor([float(v) for v in values])


def rm_sequences(rm_tok, prompts, completions, chat_template="auto"):
    """What a reward model reads: prompt + completion re-tokenised with its own tokenizer (and chat
    template), then EOS, so it sees a finished answer."""
    if chat_template != "none" and rm_tok.chat_template:
        chats = [tasks.as_messages(p) + [{"role": "assistant", "content": c}]
                 for p, c in zip(prompts, completions)]
        texts = [rm_tok.apply_chat_template(chat, tokenize=False) for chat in chats]
        return [rm_tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [rm_tok(tasks.as_text(p) + c)["input_ids"] + [rm_tok.eos_token_id]
            for p, c in zip(prompts, completions)]


def rm_forward(rm, ids, mask):
    """Scores (B,) of left-padded rows, with gradients: the head on each row's last token."""
    rm = rm.get_base_model() if hasattr(rm, "get_base_model") else rm  # LoRA: adapters stay on
    if hasattr(rm, "score"):
        hidden = rm.base_model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                               use_cache=False).last_hidden_state
        return rm.score(hidden[:, -1]).float()[:, 0]
    return rm(input_ids=ids, attention_mask=mask).logits.float()[:, 0]


@torch.no_grad()
def rm_scores(rm, rm_tok, prompts, completions, micro_batch=64, chat_template="auto"):
    """Reward-model score of each prompt + completion (B,); rows are scored independently."""
    device = next(rm.parameters()).device
    seqs = rm_sequences(rm_tok, prompts, completions, chat_template)
    scores = []
    for i in range(0, len(seqs), micro_batch):
        ids, mask = left_pad(seqs[i:i + micro_batch], rm_tok.pad_token_id, device)
        scores.append(rm_forward(rm, ids, mask))
    return torch.cat(scores)


def compute_rewards(rows, completions, weights, rm=None, rm_tok=None, fns=None):
    """Weighted sum of reward components (B,); each component is returned too, for reward/<name>.
    fns: your --reward_fn functions by name."""
    parts = {}
    for name in weights:
        if name == "rm":
            parts["rm"] = rm_scores(rm, rm_tok, [r["prompt"] for r in rows], completions).cpu()
        elif name in RULES:
            parts[name] = torch.tensor([RULES[name](c, r) for c, r in zip(completions, rows)])
        else:
            parts[name] = call_reward_fn(name, fns[name], completions, rows)
    return sum(weights[n] * v for n, v in parts.items()), parts


# ------------------------------------------------------------------------------------------ eval
def has_numbers(rows):  # can math_reward score every row? (a number, or maths: \pi, (1,2))
    return all(answer_format.final_answer(r.get("answer", ""), True) is not None for r in rows)


def eval_metric(rows, choice="auto"):
    """What the held-out score is: 'accuracy' (math_reward, 0-1) or 'mean reward' (the run's
    --rewards). auto: accuracy when every row has an answer with a number, else mean reward."""
    numeric = has_numbers(rows)
    if choice == "math" and not numeric:
        raise UserError("--eval_reward math: some held-out rows have no answer with a number, so "
                        "the score would be 0 whatever the model says; use --eval_reward rewards")
    return "accuracy" if choice == "math" or (choice == "auto" and numeric) else "mean reward"


def gold(completions, rows):
    """{"gold": true task score of these completions} when every row's answer has a number."""
    numeric = has_numbers(rows)
    return {"gold": sum(map(math_reward, completions, rows)) / len(rows)} if numeric else {}


@torch.no_grad()
def evaluate(model, tok, rows, args, amp, weights, rm=None, rm_tok=None, fns=None,
             batch_size=128, env=None):
    """Held-out scores under these reward weights ({"math": 1}: accuracy; the scripts choose by
    eval_metric): "eval", the mean score of greedy completions; args.eval_samples = k > 0: also
    eval_mean@k and eval_pass@k (the best of k, per prompt) of k samples at the training
    temperature; args.eval_sampled: mean@k is the "eval", greedy's "eval_greedy"."""
    if not rows:  # e.g. a data file too small to hold rows out: no score rather than a made-up 0
        return {"eval": float("nan")}
    k = getattr(args, "eval_samples", 0)
    scores = {"eval": [], "sampled": []}
    for i in range(0, len(rows), batch_size):
        for key, reps in (("eval", 1), ("sampled", k)):
            batch = [r for r in rows[i:i + batch_size] for _ in range(reps)]  # reps rows a prompt
            if batch:
                _, texts = generate(model, tok, batch, args, amp, env, greedy=key == "eval")
                scores[key] += compute_rewards(batch, texts, weights, rm, rm_tok, fns)[0].tolist()
    greedy = sum(scores["eval"]) / len(rows)
    if not k:
        return {"eval": greedy}
    per_prompt = torch.tensor(scores["sampled"]).view(-1, k)
    mean, best = float(per_prompt.mean()), float(per_prompt.max(1).values.mean())
    if getattr(args, "eval_sampled", False):  # the headline score is mean@k, greedy beside it
        return {"eval": mean, "eval_greedy": greedy, f"eval_pass@{k}": best}
    return {"eval": greedy, f"eval_mean@{k}": mean, f"eval_pass@{k}": best}
