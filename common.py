"""common.py: the algorithmic core that every training script shares, and must share identically.

Sections, top to bottom: prompts and sampling (one turn, and the multi-turn rollout with a tool)
-> log-probs and KL -> rewards -> held-out eval. The fast paths of sampling and log-probs (same
numbers) are in fastpath.py; the plumbing an algorithm reader can skip is in tasks.py (data),
loading.py (models, LoRA, your reward functions), envs.py (--env) and runs.py (flags, output
folder, checkpoints, resume, Ctrl-C, torchrun).

Notation used in every script:
  pi_theta  the policy being trained;  pi_old  the policy that sampled the batch (a frozen copy of
  pi_theta's log-probs);  pi_ref  a frozen reference model, usually the starting policy.
  A rollout `roll` holds B rows of prompt + completion: P prompt columns (left-padded), then T
  completion columns (right-padded). roll.completion_mask (B, T) is 1 on every generated token up to
  AND including the EOS and 0 after it. Masks come from lengths, never from token values, so the EOS
  is in the loss even when the pad token is the EOS token.
  Log-probs are log pi(token | earlier tokens), in fp32, on logits / the sampling temperature.
"""
import functools
import inspect
import json
import math
import numbers
import re
from types import SimpleNamespace

import torch
from transformers import DynamicCache

import fastpath  # the fast paths of sample() and token_logprobs(): same numbers, less work

try:  # optional: a symbolic answer checker (pip install math-verify), used when installed
    import math_verify
except ImportError:
    math_verify = None


class UserError(Exception):
    """Bad input: shown as one line on stderr, exit code 2, no traceback (see runs.main_guard)."""


def _first_line(e):
    return (str(e).splitlines() or [type(e).__name__])[0]


# --------------------------------------------------------------------------- prompts, sampling
def as_messages(prompt):
    """A prompt as chat messages: a text is one user message; a list of messages stays as it is."""
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def as_text(prompt):
    """A prompt as plain text, for a tokenizer without a chat template: the messages' contents."""
    return prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)


def encode_prompts(tok, prompts, chat_template="auto"):
    """Token ids per prompt (text or chat messages). 'auto' applies the tokenizer's chat template
    if it has one; 'none' never does."""
    keys = [json.dumps(p) for p in prompts]
    distinct = dict(zip(keys, prompts))  # a GRPO batch repeats each prompt G times
    if chat_template != "none" and tok.chat_template:
        texts = [tok.apply_chat_template(as_messages(p), tokenize=False, add_generation_prompt=True)
                 for p in distinct.values()]
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        ids = [tok(as_text(p))["input_ids"] for p in distinct.values()]
    by_key = dict(zip(distinct, ids))
    return [by_key[k] for k in keys]


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


def _base_class(model):
    return type(_unwrap(model))


def _forward(model, ids, mask, pos, cache=None, keep=0, hidden=False):
    """Every forward passes the same arguments, so --compile's guards hold. keep = logits_to_keep
    (the last `keep` positions go through the LM head; 0 = all); hidden: also return every
    layer's hidden states (the last: the final norm's output, the LM head's input)."""
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=keep,
                 use_cache=cache is not None, output_hidden_states=hidden,
                 **{_cache_kwarg(_base_class(model)): cache})


def suppressed(model, V, device):
    """(V,) bool: the ids this model never samples and whose probability the log-probs set to 0,
    or None. They are its generation config's suppress_tokens (HF generate masks them too), which
    load_model sets to the embedding rows the tokenizer has no token for (Qwen2.5: 151,936 rows,
    151,665 tokens): sampling one would give text the tokenizer cannot decode."""
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
    """Every token that ends a completion: the tokenizer's EOS and the generation config's (chat
    models often stop on several, e.g. <|im_end|> and <|endoftext|>)."""
    stop = getattr(model.generation_config, "eos_token_id", None)
    return sorted({tok.eos_token_id, *(stop if isinstance(stop, list) else [stop])} - {None})


@torch.no_grad()
def sample(model, tok, prompt_ids, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False,
           amp=None, stop=(), share_prompts=True):
    """Batched sampling with a KV cache. A row ends at its first EOS or at the token that completes
    one of the `stop` strings; finished rows leave the batch and the cache (they stop costing).
    share_prompts=False prefills every row itself (the plain path; same numbers).
    Returns a SimpleNamespace:
      ids (B, P+T)            left-padded prompt, then the completion (pad after its end)
      attention_mask (B, P+T) from lengths
      completion_mask (B, T)  float, 1 on each generated token up to and including the EOS
      truncated (B,)          bool: no EOS (nor stop string) within max_new_tokens
      sample_logprobs (B, T)  log pi_sampler of each sampled token, at the sampling temperature
                              (over the kept tokens, renormalised, when top_p < 1)
      P                       the number of prompt columns"""
    device = next(model.parameters()).device
    B = len(prompt_ids)
    eos = torch.tensor(eos_ids(model, tok), device=device)
    out = torch.full((B, max_new_tokens), tok.pad_token_id, device=device)  # sampled tokens
    out_lp = torch.zeros(B, max_new_tokens, device=device)
    lengths = torch.full((B,), max_new_tokens, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    window = max(map(len, stop), default=0) + 2  # a stop string spans <= 1 token per character
    live = torch.arange(B, device=device)  # original row index of each row still being sampled
    with amp or torch.autocast(device.type, enabled=False):
        if share_prompts:
            logits, cache, ids, prompt_mask = fastpath.prefill_shared(model, prompt_ids,
                                                                      tok.pad_token_id, device)
        else:
            ids, prompt_mask = left_pad(prompt_ids, tok.pad_token_id, device)
            cache = DynamicCache()
            logits = _forward(model, ids, prompt_mask, positions(prompt_mask), cache, keep=1)
            logits = logits.logits[:, -1]
        mask, pos = prompt_mask, positions(prompt_mask)[:, -1:]
        never = suppressed(model, logits.shape[-1], device)  # (V,) bool: ids never sampled
        for t in range(max_new_tokens):  # logits (rows, V): the last position only (keep=1)
            logits = masked_logits(logits.float(), never)
            if greedy:
                nxt = logits.argmax(-1)
            else:
                probs = (logits / temperature).softmax(-1)
                if top_p < 1.0:  # nucleus: keep the smallest set of tokens with mass >= top_p
                    p_sorted, idx = probs.sort(-1, descending=True)
                    drop = p_sorted.cumsum(-1) - p_sorted >= top_p
                    probs = probs.scatter(-1, idx, p_sorted.masked_fill(drop, 0.0))
                nxt = torch.multinomial(probs, 1).squeeze(-1)
            out[live, t] = nxt
            logp = (logits / (1.0 if greedy else temperature)).log_softmax(-1)
            out_lp[live, t] = logp.gather(-1, nxt[:, None])[:, 0]
            if top_p < 1.0 and not greedy:  # it drew from the kept tokens, renormalised: their
                out_lp[live, t] -= probs.sum(-1).log()  # mass is probs.sum() (probs unscaled)
            ended = torch.isin(nxt, eos)
            if stop:  # decode each row's last few tokens: does a stop string end at this one?
                tails = tok.batch_decode(out[live, max(0, t + 1 - window):t + 1])
                ended |= torch.tensor([any(s in x for s in stop) for x in tails], device=device)
            lengths[live[ended]] = t + 1
            finished[live[ended]] = True
            if ended.all() or t == max_new_tokens - 1:
                break
            if ended.any():  # drop finished rows from the batch and the KV cache
                keep = (~ended).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                live, nxt, mask, pos = live[keep], nxt[keep], mask[keep], pos[keep]
            mask = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1)
            pos = pos + 1
            logits = _forward(model, nxt[:, None], mask, pos, cache, keep=1).logits[:, -1]
    T = int(lengths.max())
    completion_mask = (torch.arange(T, device=device)[None] < lengths[:, None]).float()
    return SimpleNamespace(ids=torch.cat([ids, out[:, :T]], 1), completion_mask=completion_mask,
                           attention_mask=torch.cat([prompt_mask, completion_mask.long()], 1),
                           truncated=~finished, sample_logprobs=out_lp[:, :T] * completion_mask,
                           P=ids.shape[1])


@torch.no_grad()
def rollout(model, tok, prompt_ids, env, rows, max_turns, max_new_tokens, temperature=1.0,
            top_p=1.0, greedy=False, amp=None, stop=()):
    """Multi-turn sampling with a tool: each turn is sample() continuing the row's transcript
    until EOS, a stop string, or the budget; then env(row, turns) reads the model's turns so far
    (texts) and returns an observation, whose tokens are appended, or None to end the episode.
    Token in, token out: the model's sampled ids are kept as they are (never decoded and
    re-encoded), so every log-prob is for the exact token sampled; only observations are
    tokenized, without special tokens. max_new_tokens is the budget of the whole completion,
    model and observation tokens together; max_turns caps the model's turns. Each turn prefills
    the whole transcript again (plain; no KV cache kept across turns).
    Returns sample()'s fields, with completion_mask 1 only on model tokens (each turn's EOS or
    stop token included) and 0 on observations, sample_logprobs 0 there, truncated = the budget
    ran out (inside a turn or an observation); and per row: turns, tool_calls (observations),
    observations (their texts), final (the text after the last observation: what rewards read)
    and transcript (the whole completion, observations marked as ⟦...⟧)."""
    B = len(prompt_ids)
    seqs = [list(p) for p in prompt_ids]  # each row's prompt + transcript so far
    kind = [[] for _ in range(B)]  # per completion token: 1 sampled by the model, 0 observation
    logps = [[] for _ in range(B)]  # the sampler's log-prob per completion token (0: observation)
    turns = [[] for _ in range(B)]  # the model's turns, decoded
    obs = [[] for _ in range(B)]  # the environment's observations (texts)
    truncated = [False] * B
    live = list(range(B))  # rows whose episode goes on
    for turn in range(max_turns):
        left = [max_new_tokens - len(kind[i]) for i in live]  # each row's budget still unspent
        roll = sample(model, tok, [seqs[i] for i in live], max(left), temperature, top_p, greedy,
                      amp, stop)
        going = []
        for j, i in enumerate(live):
            n = int(roll.completion_mask[j].sum())  # this turn's tokens, its EOS / stop included
            ended = not bool(roll.truncated[j]) and n <= left[j]
            n = min(n, left[j])  # sampled past its own budget (another row's was larger): cut
            new = roll.ids[j, roll.P:roll.P + n].tolist()
            seqs[i] += new
            kind[i] += [1] * n
            logps[i] += roll.sample_logprobs[j, :n].tolist()
            turns[i].append(tok.decode(new, skip_special_tokens=True))
            if not ended:  # the budget ran out inside the turn
                truncated[i] = True
                continue
            text = env(rows[i], turns[i]) if turn + 1 < max_turns else None
            if text is None:  # the episode is over
                continue
            ids = tok(text, add_special_tokens=False)["input_ids"]
            room = max_new_tokens - len(kind[i])
            seqs[i] += ids[:room]
            kind[i] += [0] * len(ids[:room])
            logps[i] += [0.0] * len(ids[:room])
            obs[i].append(text)
            if len(ids) >= room:  # no room left for the model to answer
                truncated[i] = True
            else:
                going.append(i)
        live = going
        if not live:
            break
    # one batch: the prompts left-padded (P columns), the completions right-padded
    device = next(model.parameters()).device
    prompt, prompt_mask = left_pad(prompt_ids, tok.pad_token_id, device)
    T = max(1, max(len(k) for k in kind))
    comp = [s[len(p):] for s, p in zip(seqs, prompt_ids)]
    ids = torch.tensor([c + [tok.pad_token_id] * (T - len(c)) for c in comp], device=device)
    real = torch.tensor([[1] * len(k) + [0] * (T - len(k)) for k in kind], device=device)
    completion_mask = torch.tensor([k + [0] * (T - len(k)) for k in kind], device=device).float()
    final = [t[-1] if len(t) > len(o) else "" for t, o in zip(turns, obs)]
    transcript = ["".join(t + (f"⟦{o[k]}⟧" if k < len(o) else "") for k, t in enumerate(ts))
                  for ts, o in zip(turns, obs)]
    return SimpleNamespace(
        ids=torch.cat([prompt, ids], 1), attention_mask=torch.cat([prompt_mask, real], 1),
        completion_mask=completion_mask, truncated=torch.tensor(truncated, device=device),
        sample_logprobs=torch.tensor([lp + [0.0] * (T - len(lp)) for lp in logps], device=device),
        P=prompt.shape[1], turns=torch.tensor([len(t) for t in turns]),
        tool_calls=torch.tensor([len(o) for o in obs]), observations=obs, final=final,
        transcript=transcript)


def decode_completions(tok, roll):
    lengths = roll.completion_mask.sum(-1).long().tolist()
    rows = roll.ids[:, roll.P:].tolist()
    return [tok.decode(row[:n], skip_special_tokens=True) for row, n in zip(rows, lengths)]


def generate(model, tok, rows, args, amp, env=None, greedy=False):
    """One completion per row: sample(), or with env the multi-turn rollout(). Returns the
    rollout and the texts rewards read: each completion, or (env) each row's final turn.
    greedy (held-out eval) takes the argmax: temperature and top_p play no part."""
    prompt_ids = encode_prompts(tok, [r["prompt"] for r in rows], args.chat_template)
    temperature, top_p = (1.0, 1.0) if greedy else (args.temperature, args.top_p)
    if env is None:
        roll = sample(model, tok, prompt_ids, args.max_new_tokens, temperature, top_p, greedy,
                      amp, args.stop)
        return roll, decode_completions(tok, roll)
    roll = rollout(model, tok, prompt_ids, env, rows, args.max_turns, args.max_new_tokens,
                   temperature, top_p, greedy, amp, args.stop)
    return roll, roll.final


# ------------------------------------------------------------------------------ log-probs, KL
def token_logprobs(model, ids, attention_mask, T, temperature=1.0, entropy=False, fast=True):
    """log pi(token_t | tokens before t), with gradients, for the last T positions of ids (B, P+T):
    (B, T); entropy: also each position's entropy (B, T), else None. suppressed() ids get p = 0."""
    head = _unwrap(model).get_output_embeddings()  # fast path: a head load_model checked
    if not fast or head not in fastpath.SPLIT_HEADS:  # the plain computation, as a student's:
        logits = _forward(model, ids, attention_mask, positions(attention_mask)).logits
        logits = logits[:, -T - 1:-1]  # (B, T, V): position t predicts token t + 1, shift by one
        z = logits.float() / temperature  # fp32, at the sampling temperature
        logp = masked_logits(z, suppressed(model, z.shape[-1], z.device)).log_softmax(-1)
        lp = logp.gather(-1, ids[:, -T:, None])[..., 0]  # (B, T): the log-prob of each taken token
        return lp, -(logp.exp() * logp).sum(-1) if entropy else None
    return fastpath.fast_token_logprobs(model, head, ids, attention_mask, T, temperature, entropy)


def micro_batches(completion_mask, size):
    """Row indices of each micro-batch. With more than one, rows go in order of completion length,
    so each micro-batch runs on fewer padding columns. Index every per-row tensor with the same
    indices (e.g. advantages[mb]); losses are normalised over the whole step, so the order does
    not change the gradient."""
    B = len(completion_mask)
    order = torch.arange(B, device=completion_mask.device)
    if size < B:
        order = completion_mask.sum(-1).argsort(stable=True)
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
    KL divergence"), with log r = log pi_ref - log pi:
      k1 = -log r            unbiased, noisy, can be < 0
      k2 = (log r)^2 / 2     biased, low variance, >= 0
      k3 = r - 1 - log r     unbiased, >= 0 (DeepSeekMath). Only k3 exponentiates, so only its
                             log r is clamped (to +-20) to keep exp() finite (TRL issue #3015).
    These are the VALUES. Placed in a loss, their gradients differ: see grpo.per_token_loss."""
    log_r = ref_logprobs - logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    log_r = log_r.clamp(-20, 20)
    return log_r.exp() - 1 - log_r


def masked_mean(x, mask, dim=None, total=None):
    """Mean of x where mask = 1; total: also sum over torchrun's processes (runs.global_sum)."""
    total = total or (lambda t: t)
    return total((x * mask).sum(dim)) / total(mask.sum(dim)).clamp(min=1)


def whiten(x, mask, shift_mean=True, eps=1e-8, total=None):
    """(x - mean) / std over the valid (mask = 1) entries only, biased variance (as OpenRLHF and
    the TF code of Ziegler et al.); shift_mean=False adds the mean back. 0 where mask = 0.
    total: sums over every process under torchrun (runs.global_sum), for the global batch's
    statistics; None: this batch's."""
    total = total or (lambda t: t)
    n = total(mask.sum()).clamp(min=1)
    mean = total((x * mask).sum()) / n
    var = total((((x - mean) ** 2) * mask).sum()) / n
    out = (x - mean) * torch.rsqrt(var + eps)
    return (out if shift_mean else out + mean) * mask


# --------------------------------------------------------------------------------------- rewards
def last_boxed(text):
    """The content of the text's last \\boxed{...} (braces matched), or None."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
    return None


def final_number(text):
    """The number a text ends on: inside its last \\boxed{} if it has one (MATH-style), else
    after '####' (GSM8K-style), else its last number. Reads 1,234, -2.5, 3/4 and \\frac{3}{4}."""
    boxed = last_boxed(text)
    text = (boxed if boxed is not None else text.split("####")[-1]).replace(",", "")
    text = re.sub(r"\\[dt]?frac\{\s*(-?[\d.]+)\s*\}\{\s*(-?[\d.]+)\s*\}", r"\1/\2", text)
    nums = re.findall(r"(-?\d+(?:\.\d+)?)(?:\s*/\s*(\d+(?:\.\d+)?))?", text)
    if not nums:
        return None
    num, den = nums[-1]
    return float(num) / float(den) if den and float(den) else float(num)


def math_reward(completion, row):
    """1 when the completion states the answer's number (the built-in task's checker). When the
    optional package math-verify is installed, its symbolic check is used instead."""
    if math_verify is not None:
        return float(math_verify.verify(math_verify.parse(row.get("answer", "")),
                                        math_verify.parse(completion)))
    want = final_number(row.get("answer", ""))
    got = final_number(completion)
    return float(want is not None and got is not None and math.isclose(got, want, rel_tol=1e-9))


def format_reward(completion, row):
    """1 when the completion states its final answer in a format graders read: a non-empty
    \\boxed{...} (MATH; "put your final answer within \\boxed{}") or a last line '#### N'
    (GSM8K). It checks the form only; math_reward checks the value."""
    boxed = last_boxed(completion)
    gsm8k = re.search(r"(^|\n)\s*####\s*-?[\d,]*\.?\d+\s*$", completion)
    return float(bool(boxed and boxed.strip()) or gsm8k is not None)


def length_reward(completion, row):
    return -len(completion) / 100.0  # a mild penalty per character


RULES = {"math": math_reward, "format": format_reward, "length": length_reward}


def call_reward_fn(name, fn, completions, rows):
    """Your reward on the batch, checked: one number per completion, (B,). An exception names
    the first row that raises it. NaN/inf pass through: the training step is then skipped."""
    try:
        values = list(fn(completions, rows))
    except Exception as e:
        def fails(i):
            try:
                fn(completions[i:i + 1], rows[i:i + 1])
            except Exception:
                return True
            return False
        bad = next((i for i in range(len(rows)) if fails(i)), None)
        which = f"row {bad}, prompt {str(rows[bad]['prompt'])[:60]!r}" if bad is not None \
            else f"a batch of {len(rows)} rows"
        raise UserError(f"reward {name!r} raised {type(e).__name__}: {_first_line(e)} "
                        f"(on {which})") from None
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
        chats = [as_messages(p) + [{"role": "assistant", "content": c}]
                 for p, c in zip(prompts, completions)]
        texts = [rm_tok.apply_chat_template(chat, tokenize=False) for chat in chats]
        return [rm_tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [rm_tok(as_text(p) + c)["input_ids"] + [rm_tok.eos_token_id]
            for p, c in zip(prompts, completions)]


def rm_forward(rm, ids, mask):
    """Scores (B,) of left-padded rows, with gradients: the head reads the last position, every
    row's last real token."""
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
            prompts = [r["prompt"] for r in rows]
            parts["rm"] = rm_scores(rm, rm_tok, prompts, completions).cpu()
        elif name in RULES:
            parts[name] = torch.tensor([RULES[name](c, r) for c, r in zip(completions, rows)])
        else:
            parts[name] = call_reward_fn(name, fns[name], completions, rows)
    total = sum(weights[n] * v for n, v in parts.items())
    return total, parts


# ------------------------------------------------------------------------------------------ eval
def eval_metric(rows, choice="auto"):
    """What the held-out score is: 'accuracy' (math_reward, 0-1) or 'mean reward' (the run's
    --rewards). auto: accuracy when every row has an answer with a number, else mean reward."""
    numeric = all(final_number(r.get("answer", "")) is not None for r in rows)
    if choice == "math" and not numeric:
        raise UserError("--eval_reward math: some held-out rows have no answer with a number, so "
                        "the score would be 0 whatever the model says; use --eval_reward rewards")
    return "accuracy" if choice == "math" or (choice == "auto" and numeric) else "mean reward"


def gold(completions, rows):
    """{"gold": true task score of these completions} when every row's answer has a number."""
    if eval_metric(rows) != "accuracy":
        return {}
    return {"gold": sum(map(math_reward, completions, rows)) / len(rows)}


@torch.no_grad()
def evaluate(model, tok, rows, args, amp, weights=None, rm=None, rm_tok=None, fns=None,
             batch_size=128, env=None):
    """Held-out scores, {"eval": greedy score}: accuracy or the mean of the run's --rewards (see
    eval_metric). With args.eval_samples = k > 0, also "eval_mean@k" and "eval_pass@k" over k
    samples per prompt at the training temperature (pass@k: the best of the k, per prompt);
    args.eval_sampled makes mean@k the "eval" and the greedy score "eval_greedy".
    weights: the run's reward weights (what the mean reward weighs). env: multi-turn rollouts
    with that environment (see rollout)."""
    if not rows:  # e.g. a data file too small to hold rows out: no score rather than a made-up 0
        return {"eval": float("nan")}
    accuracy = eval_metric(rows, getattr(args, "eval_reward", "auto")) == "accuracy"
    k = getattr(args, "eval_samples", 0)
    scores = {"eval": [], "sampled": []}
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        for key, reps in (("eval", 1), ("sampled", k)):
            batch = [r for r in chunk for _ in range(reps)]  # reps contiguous rows per prompt
            if not batch:
                continue
            _, texts = generate(model, tok, batch, args, amp, env, greedy=key == "eval")
            if accuracy:
                scores[key] += [math_reward(c, r) for c, r in zip(texts, batch)]
            else:
                scores[key] += compute_rewards(batch, texts, weights, rm, rm_tok, fns)[0].tolist()
    out = {"eval": sum(scores["eval"]) / len(rows)}
    if k:
        per_prompt = torch.tensor(scores["sampled"]).view(-1, k)
        out[f"eval_mean@{k}"] = float(per_prompt.mean())
        out[f"eval_pass@{k}"] = float(per_prompt.max(1).values.mean())
    if getattr(args, "eval_sampled", False):  # the headline score is mean@k, greedy beside it
        out = {"eval": out.pop(f"eval_mean@{k}"), "eval_greedy": out["eval"],
               f"eval_pass@{k}": out[f"eval_pass@{k}"]}
    return out
