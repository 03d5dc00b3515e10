"""common.py: the algorithmic core that every training script shares, and must share identically:
sampling (one turn; the multi-turn episodes of tool use are engine.py's) -> log-probs and KL
-> rewards -> held-out eval. The fast paths (same numbers) are in fastpath.py; the plumbing an
algorithm reader can skip in the folder plumbing/ (never imported here).

Notation used in every script:
  pi_theta  the policy being trained;  pi_old  the policy that sampled the batch (a frozen copy of
  pi_theta's log-probs);  pi_ref  a frozen reference model, usually the starting policy.
  A rollout `roll` (a Rollout: the class lists every field, with its shape) holds B rows: P prompt
  columns (left-padded), then T completion columns (right-padded). roll.completion_mask (B, T) is
  1 on every generated token up to AND including the EOS and 0 after it. Masks come from lengths,
  never from token values, so the EOS is in the loss even when the pad token is the EOS token.
  Multi-turn (tool use): observation tokens sit between the model's turns with attention_mask 1,
  completion_mask 0 and sample_logprobs 0: context, like the prompt.
  Log-probs are log pi(token | earlier tokens), in fp32, on logits / the sampling temperature.
"""
import functools
import inspect
import math
import re
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import fastpath  # the fast paths of sample() and token_logprobs(): same numbers, less work

# optional: a symbolic answer checker (pip install math-verify), used when installed
try:
    import math_verify
except ImportError:
    math_verify = None


# ------------------------------------------------------------------------------------ sampling
def as_messages(prompt):
    """A prompt as chat messages: a text is one user message; a list of messages stays as it is."""
    return prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]


def as_text(prompt):
    """A prompt as plain text, for a tokenizer without a chat template: the messages' contents."""
    return prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in prompt)


def encode_prompts(tok, prompts, chat_template="auto", tools=None):
    """Token ids per prompt (text or messages), with the tokenizer's chat template unless 'none';
    tools: JSON schemas the template renders (--tools)."""
    if chat_template != "none" and tok.chat_template:
        texts = [tok.apply_chat_template(as_messages(p), tools=tools, tokenize=False,
                                         add_generation_prompt=True) for p in prompts]
        return [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    return [tok(as_text(p))["input_ids"] for p in prompts]


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


def _forward(model, ids, mask, cache=None, keep=0, hidden=False):
    """ids (b, W) after the cache's S columns (or their embeddings (b, W, H)), mask (b, S + W).
    Every forward passes the same arguments, so --compile's guards hold. keep: logits_to_keep (the
    last `keep` positions go through the LM head, 0 = all); hidden: also the hidden states."""
    pos = positions(mask)[:, -ids.shape[1]:]
    inputs = {"inputs_embeds" if ids.is_floating_point() else "input_ids": ids}
    return model(**inputs, attention_mask=mask, position_ids=pos, logits_to_keep=keep,
                 use_cache=cache is not None, output_hidden_states=hidden,
                 **{_cache_kwarg(type(_unwrap(model))): cache})


def suppressed(model, V, device):
    """(V,) bool or None: the ids never sampled and given probability 0 by the log-probs, the
    generation config's suppress_tokens (loading.load_model: embedding rows with no token)."""
    ids = getattr(_unwrap(model).generation_config, "suppress_tokens", None)
    if not ids:
        return None
    return torch.isin(torch.arange(V, device=device), torch.tensor(ids, device=device))


def masked_logits(z, mask):
    """z (..., V) with the suppressed ids at the most negative float, not -inf: their probability
    is exactly 0, and p log p (entropy) stays 0 * finite = 0, not nan."""
    return z if mask is None else z.masked_fill(mask, torch.finfo(z.dtype).min)


def eos_ids(model, tok):
    """Every token that ends a completion: the tokenizer's EOS and the generation config's."""
    stop = getattr(model.generation_config, "eos_token_id", None)
    return sorted({tok.eos_token_id, *(stop if isinstance(stop, list) else [stop])} - {None})


@dataclass(slots=True)
class Rollout:
    """What a rollout carries, every field of it: B rows of P prompt columns (left-padded), then T
    completion columns (right-padded). The samplers (sample, engine.sample) fill the first six;
    grpo.sample_groups adds the rows and their scores; a multi-turn rollout (engine.generate)
    adds the episodes' record. A field no one filled is None (slots: no other field exists)."""
    ids: torch.Tensor  # (B, P + T) long: the prompt's tokens, then the completion's
    attention_mask: torch.Tensor  # (B, P + T) long: 1 on every real token, observations too
    completion_mask: torch.Tensor  # (B, T) float: 1 on each sampled token, EOS included, else 0
    truncated: torch.Tensor  # (B,) bool: no EOS (nor stop string, nor the env's end) in budget
    sample_logprobs: torch.Tensor  # (B, T) float: log pi_sampler of each sampled token, else 0
    P: int  # the prompt columns
    # grpo.sample_groups: the data rows, the texts scored, the rewards and each reward's part
    rows: list | None = None  # B dicts
    texts: list | None = None  # B str
    rewards: torch.Tensor | None = None  # (B,) float
    parts: dict | None = None  # {reward name: (B,) float}
    # multi-turn (envs.start_episodes' finish): the episodes' record
    turns: torch.Tensor | None = None  # (B,) long: model turns
    tool_calls: torch.Tensor | None = None  # (B,) long: observations fed
    obs_truncated: torch.Tensor | None = None  # (B,) bool: an observation cut by the budget
    observations: list | None = None  # B lists of str: each observation as the model read it
    final: list | None = None  # B str: the text after the last observation (what rewards read)
    transcript: list | None = None  # B str: the turns with the observations in ⟦...⟧
    episodes: list | None = None  # B episode objects (None: never called); --tools: their calls


def draw(probs, u):
    """Inverse-CDF sampling, one uniform u in [0, 1) a row: the token whose share of the
    cumulative distribution holds u * total (probs need not sum to 1: top-p zeroes some)."""
    cdf = probs.cumsum(-1)  # non-decreasing; a token of probability 0 adds exactly 0
    total = cdf[:, -1:]
    x = torch.minimum(u[:, None] * total, total.nextafter(torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True)[:, 0]  # cdf[k-1] <= x < cdf[k]: p_k > 0


def next_token(logits, temperature=1.0, top_p=1.0, greedy=False, never=None, u=None):
    """Each row's next token (b,) and its log-prob (b,) from its logits (b, V): at the temperature,
    from the top_p nucleus, never a suppressed id; greedy: the argmax. By torch.multinomial (one
    stream for the batch), or with u (b,) one uniform a row by draw() (engine.py's streams)."""
    z = masked_logits(logits.float(), never) / temperature
    probs = z.softmax(-1)
    if top_p < 1.0:  # nucleus: keep the smallest set of tokens with mass >= top_p
        p_sorted, idx = probs.sort(-1, descending=True)
        drop = p_sorted.cumsum(-1) - p_sorted >= top_p
        probs = probs.scatter(-1, idx, p_sorted.masked_fill(drop, 0.0))
    if greedy:
        nxt = z.argmax(-1)
    elif u is None:
        nxt = torch.multinomial(probs, 1).squeeze(-1)
    else:
        nxt = draw(probs, u)
    lp = z.log_softmax(-1).gather(-1, nxt[:, None])[:, 0]
    if top_p < 1.0:  # drawn from the kept tokens, renormalised: their mass probs.sum()
        lp -= probs.sum(-1).log()
    return nxt, lp


@torch.no_grad()
def sample(model, tok, prompt_ids, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False,
           stop=(), share_prompts=True, prefill=None):
    """Batched sampling with a KV cache -> a Rollout (its first six fields). A row ends at its
    first EOS or at the token that completes a `stop` string, and leaves the batch and the cache.
    greedy: the argmax, not a draw. (Multi-turn episodes: engine.sample.)"""
    B, N, device = len(prompt_ids), max_new_tokens, next(model.parameters()).device
    eos = torch.tensor(eos_ids(model, tok), device=device)
    out = torch.full((B, N), tok.pad_token_id, device=device)  # row i's token t at column t
    out_lp = torch.zeros(B, N, device=device)
    lengths = torch.full((B,), N, device=device)  # tokens each row wrote
    finished = torch.zeros(B, dtype=torch.bool, device=device)  # ended by EOS / stop
    window = max(map(len, stop), default=0) + 2  # a stop string spans <= 1 token per character
    # the prefill: every row's prompt; share_prompts (the fast path, same numbers): each
    # distinct prompt once, its KV cache then copied to its rows (a GRPO group's G rows)
    prompts, row_of = fastpath.distinct(prompt_ids, device) if share_prompts else (
        prompt_ids, None)
    ids, prompt_mask = left_pad(prompts, tok.pad_token_id, device)
    if prefill is None:
        cache, kv_mask = DynamicCache(), prompt_mask
        logits = _forward(model, ids, prompt_mask, cache, keep=1).logits[:, -1]  # (b, V): next
    else:  # distill.py's: -> the same logits, the KV cache and its mask (its forward kept)
        logits, kv_mask, cache = prefill(ids, prompt_mask, row_of)
    if row_of is not None:
        fastpath.copy_to_rows(cache, row_of)
        logits, ids, prompt_mask, kv_mask = (x[row_of] for x in (logits, ids, prompt_mask, kv_mask))
    never = suppressed(model, logits.shape[-1], device)  # (V,) bool: ids never sampled
    batch = torch.arange(B, device=device)  # the rows still going
    for t in range(N):
        nxt, lp = next_token(logits, temperature, top_p, greedy, never)
        out[batch, t], out_lp[batch, t] = nxt, lp
        ended = torch.isin(nxt, eos)
        if stop:  # decode each row's last few tokens: does a stop string end here?
            tails = [tok.decode(x[max(0, t + 1 - window):t + 1]) for x in out[batch].tolist()]
            ended |= torch.tensor([any(s in x for s in stop) for x in tails], device=device)
        finished[batch[ended]], lengths[batch[ended]] = True, t + 1
        if ended.all() or t + 1 == N:
            break
        if ended.any():  # rows done leave the batch and the KV cache
            keep = (~ended).nonzero()[:, 0]
            cache.batch_select_indices(keep)
            batch, nxt, kv_mask = batch[keep], nxt[keep], kv_mask[keep]
        kv_mask = torch.cat([kv_mask, torch.ones_like(kv_mask[:, :1])], 1)
        logits = _forward(model, nxt[:, None], kv_mask, cache, keep=1).logits[:, -1]
    T = int(lengths.max())
    real = torch.arange(T, device=device)[None] < lengths[:, None]
    completion_mask = real.float()  # 1 on each token written, EOS included
    return Rollout(ids=torch.cat([ids, out[:, :T]], 1),
                   attention_mask=torch.cat([prompt_mask, real.long()], 1),
                   completion_mask=completion_mask, truncated=~finished,
                   sample_logprobs=out_lp[:, :T] * completion_mask, P=ids.shape[1])


def decode_completions(tok, roll):
    lengths = roll.completion_mask.sum(-1).long().tolist()
    rows = roll.ids[:, roll.P:].tolist()
    return [tok.decode(row[:n], skip_special_tokens=True) for row, n in zip(rows, lengths)]


def generate(model, tok, rows, args, amp, env=None, greedy=False, sampler=None, prefill=None):
    """One completion per row by sample() -> (the rollout, the texts rewards read). With env
    (envs.load_env) one multi-turn episode per row instead, by the engine the env brings
    (engine.generate); with sampler (--vllm: plumbing/vllm_sampler.py) by vLLM's engine, episodes
    too. Under the autocast amp; greedy (held-out eval): argmax, temperature 1."""
    if sampler is not None:
        return sampler.generate(rows, args, greedy, env)
    with amp:
        if env is not None:
            return env.generate(model, tok, rows, args, greedy)
        prompt_ids = encode_prompts(tok, [r["prompt"] for r in rows], args.chat_template)
        temperature, top_p = (1.0, 1.0) if greedy else (args.temperature, args.top_p)
        roll = sample(model, tok, prompt_ids, args.max_new_tokens, temperature, top_p, greedy,
                      args.stop, prefill=prefill)
    return roll, decode_completions(tok, roll)


# ------------------------------------------------------------------------------ log-probs, KL
def plain_token_logprobs(model, ids, attention_mask, T, temperature=1.0, entropy=False):
    """log pi(token_t | tokens before t), with gradients, for the last T positions of ids (B, P+T):
    (B, T); entropy: also each position's entropy (B, T), else None. suppressed() ids get p = 0.
    The plain computation, as a student's; token_logprobs gives the same numbers with less."""
    # the last T + 1 positions through the LM head (logits_to_keep): position t predicts
    logits = _forward(model, ids, attention_mask, keep=T + 1).logits
    logits = logits[:, :-1]  # (B, T, V): token t + 1, so shift by one and drop the last
    z = logits.float() / temperature  # fp32, at the sampling temperature
    logp = masked_logits(z, suppressed(model, z.shape[-1], z.device)).log_softmax(-1)
    lp = logp.gather(-1, ids[:, -T:, None])[..., 0]  # (B, T): the log-prob of each taken token
    return lp, -(logp.exp() * logp).sum(-1) if entropy else None


def token_logprobs(model, ids, attention_mask, T, temperature=1.0, entropy=False):
    """plain_token_logprobs' numbers, by its fast path when the model's LM head qualifies."""
    base = _unwrap(model)  # the model inside a DDP or LoRA wrapper: its LM head qualifies?
    head = fastpath.exact_head(base.get_output_embeddings(), functools.partial(_forward, base))
    if head is None:
        return plain_token_logprobs(model, ids, attention_mask, T, temperature, entropy)
    # fastpath.py: no padding columns, shared prompts once, the head in chunks: no (B, T, V)
    x, targets = fastpath.final_hidden(functools.partial(_forward, model), ids, attention_mask, T,
                                       fastpath.can_share(model))
    lp, ent = fastpath.head_logprobs(x, head, targets, temperature,
                                     suppressed(model, head.out_features, ids.device), entropy)
    pad = (0, T - targets.shape[1])  # zeros at the padding columns it skipped
    return F.pad(lp, pad), F.pad(ent, pad) if entropy else None


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
    with amp:
        for mb in micro_batches(roll.completion_mask, micro_batch):
            out[mb], _ = token_logprobs(model, roll.ids[mb], roll.attention_mask[mb], out.shape[1],
                                        temperature)
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
# what a text's answer states, as MATH (\boxed{...}) and GSM8K ('#### N') write it
NUMBER = r"(-?\d+(?:\.\d+)?)(?:\s*/\s*(\d+(?:\.\d+)?))?"  # 7, -2.5, 3/4: numerator, denominator


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


def final_answer(text, reference=False):
    """The last \\boxed{...}: a float if it holds a number alone (1,234, -2.5, \\frac{3}{4}), else
    a str, the expression without spaces, \\left, \\right (\\pi, (1,2)). No box: the number after
    '####', else the last number, or None. reference (a row's answer): read whole if no sentence."""
    if reference and not re.search(r"####|(?<![\\a-zA-Z])[a-zA-Z]{2,}", text):  # \\pi: no word
        text = f"\\boxed{{{text}}}"
    text = re.sub(r"\\[dt]?frac\{\s*(-?[\d.]+)\s*\}\{\s*(-?[\d.]+)\s*\}", r"\1/\2", text)
    if (boxed := last_boxed(text)) is None:
        found = re.findall(NUMBER, text.split("####")[-1].replace(",", ""))
    else:  # a thousands comma goes (1,234), a list's stays (1,2)
        boxed = re.sub(r"(?<=\d),(?=\d{3}\b)|\s|\\left|\\right|\\?[$%]|\\[,!]|\.$", "", boxed)
        found = re.findall(NUMBER, boxed) if re.fullmatch(NUMBER, boxed) else []
    if not found:  # an expression if it is maths (a digit, or a command: \\pi), else None
        return boxed.replace("dfrac", "frac") if re.search(r"[\d\\]", boxed or "") else None
    num, den = found[-1]
    return float(num) / float(den) if den and float(den) else float(num)


def math_reward(completion, row):
    """1 when the completion states the answer: its number, or its expression written alike (\\pi;
    final_answer). With the optional package math-verify, its symbolic check."""
    if math_verify is not None:
        return float(math_verify.verify(math_verify.parse(row.get("answer", "")),
                                        math_verify.parse(completion)))
    want = final_answer(row.get("answer", ""), reference=True)
    got = final_answer(completion)
    if isinstance(want, str) or isinstance(got, str):  # an expression (\pi, (1,2)): as written
        return float(want == got)
    return float(want is not None and got is not None and math.isclose(got, want, rel_tol=1e-9))


def format_reward(completion, row):
    """1 when the completion states its final answer as graders read it, whatever its value: a
    non-empty \\boxed{...} (MATH) or a last line '#### N' (GSM8K)."""
    boxed = last_boxed(completion)
    gsm8k = re.search(r"(^|\n)\s*####\s*-?[\d,]*\.?\d+\s*$", completion)
    return float(bool(boxed and boxed.strip()) or gsm8k is not None)


def length_reward(completion, row):
    return -len(completion) / 100.0  # a mild penalty per character


RULES = {"math": math_reward, "format": format_reward, "length": length_reward}


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


def compute_rewards(rows, completions, weights, fns=None):
    """The weighted sum of the reward components (B,), and each component (logged: reward/<name>).
    fns: the other rewards by name, f(completions, rows) -> (B,): your --reward_fn functions
    (checked by loading.load_reward_fns) and 'rm', rm_scores (loading.load_reward_model)."""
    parts = {name: torch.tensor([RULES[name](c, r) for c, r in zip(completions, rows)])
             if name in RULES else fns[name](completions, rows) for name in weights}
    return sum(weights[n] * v for n, v in parts.items()), parts


# ------------------------------------------------------------------------------------------ eval
def has_numbers(rows):  # can math_reward score every row? (a number, or maths: \pi, (1,2))
    return all(final_answer(r.get("answer", ""), True) is not None for r in rows)


def gold(completions, rows):
    """{"gold": true task score of these completions} when every row's answer has a number."""
    numeric = has_numbers(rows)
    return {"gold": sum(map(math_reward, completions, rows)) / len(rows)} if numeric else {}


@torch.no_grad()
def evaluate(model, tok, rows, args, amp, weights, fns=None, env=None, batch_size=128,
             sampler=None):
    """Held-out scores under these reward weights ({"math": 1}: accuracy; the scripts choose by
    eval_metric): "eval", the mean score of greedy completions; args.eval_samples = k > 0: also
    eval_mean@k and eval_pass@k (a prompt's best of k) of k samples at the training temperature."""
    if not rows:  # e.g. a data file too small to hold rows out: no score, not a made-up 0
        return {"eval": float("nan")}
    k = getattr(args, "eval_samples", 0)
    scores = {"eval": [], "sampled": []}
    for i in range(0, len(rows), batch_size):
        for key, reps in (("eval", 1), ("sampled", k)):
            batch = [r for r in rows[i:i + batch_size] for _ in range(reps)]  # reps rows a prompt
            if batch:
                _, texts = generate(model, tok, batch, args, amp, env, key == "eval", sampler)
                scores[key] += compute_rewards(batch, texts, weights, fns)[0].tolist()
    greedy = sum(scores["eval"]) / len(rows)
    if not k:
        return {"eval": greedy}
    per_prompt = torch.tensor(scores["sampled"]).view(-1, k)
    mean, best = float(per_prompt.mean()), float(per_prompt.max(1).values.mean())
    if getattr(args, "eval_sampled", False):  # the headline score is mean@k, greedy beside it
        return {"eval": mean, "eval_greedy": greedy, f"eval_pass@{k}": best}
    return {"eval": greedy, f"eval_mean@{k}": mean, f"eval_pass@{k}": best}
