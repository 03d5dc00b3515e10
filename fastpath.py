"""fastpath.py: the fast paths of common.py's sampling and log-probs, and engine.py's. Same values
and gradients as the plain versions there (tested); read those first, and come here for how it is
made cheap. Pure torch: the model's forward comes in as a function, forward(ids, mask, cache,
keep, hidden) (common._forward with its model bound): this file imports nothing of the project.

- distinct, copy_to_rows: sample()'s prefill runs each distinct prompt once and copies its KV
  cache to every row of its group (GRPO's G rows, RLOO's k samples); prefill, common_prefix,
  prefix_first: a prefix every prompt starts with (a chat template's system prompt) runs once.
- feed_rows, forward_rows, compact: engine.sample (multi-turn) feeds an observation to its rows
  alone, the others' KV cache growing by empty (masked) columns; compact drops them.
- final_hidden, head_logprobs: token_logprobs() without the padding columns, with a
  shared-prompt (or shared-prefix) KV cache, and with the LM head run a chunk at a time on the
  final hidden states, so that neither forward nor backward holds the (B, T, V) logits (at a 151k
  vocabulary, the largest tensor of a step; measured in docs/memory.md). For models whose LM head
  passes exact_head.
"""
import functools

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor
from transformers import DynamicCache


def distinct(prompt_ids, device):
    """The distinct prompts (in order of first appearance) and each row's index among them."""
    index = {p: i for i, p in enumerate(dict.fromkeys(map(tuple, prompt_ids)))}
    return list(index), torch.tensor([index[tuple(p)] for p in prompt_ids], device=device)


def copy_to_rows(cache, row_of):
    """The distinct prompts' KV cache -> one per row (row_of: each row's prompt), laid out as after
    a decode step (contiguous): one compiled decode graph. HF's generate prefills a group's G."""
    cache.batch_select_indices(row_of)
    for layer in cache.layers:
        layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()


def prefill(forward, ids, mask, cache, share=True):
    """The left-padded prompts' (b, P) KV cache into cache -> each row's next-token logits (b, V)
    and the cache's attention mask: the prompts' own; or, where they all start with a prefix worth
    sharing (a chat template's system prompt), that prefix run once for all rows, in
    prefix_first's layout (the same hidden states: final_hidden)."""
    b, P = ids.shape
    if share and worth_sharing(c := common_prefix(ids, mask), b, P):
        ids, mask = prefix_first(ids, mask, P, c)
        forward(ids[:1, :c], mask[:1, :c], cache, keep=1)
        cache.batch_select_indices(torch.zeros(b, dtype=torch.long, device=ids.device))
        return forward(ids[:, c:], mask, cache, keep=1).logits[:, -1], mask
    return forward(ids, mask, cache, keep=1).logits[:, -1], mask


def feed_rows(forward, cache, mask, rows, feeds, pad_id):
    """engine.sample's observations: feeds[k], the ids of the batch's row rows[k], go through the
    model in one forward, each row's ids at the right end with padding (attention 0) before them,
    positions counting on from the row's tokens. Returns those rows' logits at the last column
    (k, V) and the cache's attention mask (b, S + W), W the longest feed."""
    W, device = max(map(len, feeds)), mask.device
    ids = torch.full((len(rows), W), pad_id, device=device)
    block = torch.zeros(len(mask), W, dtype=mask.dtype, device=device)
    for k, (j, feed) in enumerate(zip(rows, feeds)):
        ids[k, W - len(feed):] = torch.tensor(feed, device=device)
        block[j, W - len(feed):] = 1
    mask = torch.cat([mask, block], 1)
    rows = torch.tensor(rows, device=device)
    return forward_rows(forward, cache, rows, ids, mask[rows]), mask


def forward_rows(forward, cache, rows, ids, mask):
    """forward(ids, mask, cache) for the batch's rows `rows` (k,) alone: ids (k, W),
    mask (k, S + W). The plain version forwards the whole batch, the others fed padding with
    attention 0; here they get W columns of zeros, hidden by their attention mask just the same.
    Returns the k rows' logits at the last column (k, V)."""
    part = DynamicCache([(layer.keys[rows], layer.values[rows]) for layer in cache.layers])
    logits = forward(ids, mask, part, keep=1).logits[:, -1]
    W = ids.shape[1]
    for layer, new in zip(cache.layers, part.layers):
        for name in ("keys", "values"):
            grown = F.pad(getattr(layer, name), (0, 0, 0, W))  # (b, heads, S + W, head dim)
            grown[rows, :, -W:] = getattr(new, name)[:, :, -W:]
            setattr(layer, name, grown)
    return logits


def compact(cache, mask):
    """Drop the KV cache's empty columns once they are half of it: the columns of each row that
    hold a token move to the right end, in order (left padding), and mask (b, S), the attention
    mask of the cache, moves with them. Where a column sits changes nothing: a cached key
    carries its position already (rotary or learned), and attention reads the mask."""
    n = int(mask.sum(-1).max())  # the most tokens a row holds
    if mask.shape[1] <= 2 * n:
        return mask
    order = mask.argsort(dim=-1, stable=True)[:, -n:]  # (b, n): empty columns first, then tokens
    for layer in cache.layers:
        for name in ("keys", "values"):
            x = getattr(layer, name)  # (b, heads, S, head dim)
            idx = order[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[3])
            setattr(layer, name, x.gather(2, idx))
    return mask.gather(1, order)


def exact_head(head, forward):
    """The LM head if common.token_logprobs may run it apart, a chunk at a time: a plain nn.Linear,
    not sharded (--fsdp), whose output on the final hidden state IS the logits (Gemma 2 soft-caps
    them), checked once on two tokens (same matmul, same input: same bits). Else None."""
    if type(head) is not torch.nn.Linear or isinstance(head.weight, DTensor):
        return None
    if not hasattr(head, "exact_logits"):
        ids = torch.tensor([[0, 1]], device=head.weight.device)
        with torch.no_grad():
            out = forward(ids, torch.ones_like(ids), keep=1, hidden=True)  # positions 0, 1
            head.exact_logits = torch.equal(head(out.hidden_states[-1][:, -1:]).float(),
                                            out.logits.float())
        if not head.exact_logits:
            print("the model's logits are not a linear LM head applied to its last hidden state; "
                  "log-probs make the full logits (more memory)")
    return head if head.exact_logits else None


def final_hidden(forward, ids, attention_mask, T, share=True):
    """The final hidden states x (B, Tb, H) that predict the last T tokens of ids (B, P + T),
    without the padding columns past these rows' longest completion Tb, and those tokens (B, Tb).
    share: each distinct prompt runs once, its KV cache copied to its rows, when that saves a
    quarter of the tokens (common.token_logprobs turns it off where a cache cannot be reused)."""
    B, P = ids.shape[0], ids.shape[1] - T
    Tb = max(1, int(attention_mask[:, P:].sum(-1).max()))  # these rows' longest completion
    ids, attention_mask = ids[:, :P + Tb], attention_mask[:, :P + Tb]
    prompts, row_of = torch.unique(torch.cat([ids[:, :P], attention_mask[:, :P]], 1), dim=0,
                                   return_inverse=True)
    if share and P > 1 and len(prompts) * P + B * Tb <= 0.75 * B * (P + Tb):
        cache, p_mask = DynamicCache(), prompts[:, P:2 * P - 1]
        forward(prompts[:, :P - 1], p_mask, cache, keep=1)
        cache.batch_select_indices(row_of)  # every prompt but its last token, once per prompt
        # each row feeds its last prompt token and completion tokens 0..Tb-2: they predict 0..Tb-1
        x = forward(ids[:, P - 1:-1], attention_mask[:, :-1], cache, keep=1,
                    hidden=True).hidden_states[-1]  # (B, Tb, H)
    elif share and worth_sharing(c := common_prefix(ids[:, :P], attention_mask[:, :P]), B,
                                 P + Tb):  # a prefix all prompts start with (a chat template's
        ids, attention_mask = prefix_first(ids, attention_mask, P, c)  # system prompt): once
        cache = DynamicCache()
        forward(ids[:1, :c], attention_mask[:1, :c], cache, keep=1)
        # then the rest, in groups of rows of like length, each group without the padding
        # columns all its rows have (their attention is 0 and the positions count tokens)
        parts, order = [], []
        for rows, start in length_groups(attention_mask[:, :P], c, Tb):
            part = DynamicCache([(layer.keys.expand(len(rows), -1, -1, -1),
                                  layer.values.expand(len(rows), -1, -1, -1))
                                 for layer in cache.layers])
            mask = torch.cat([attention_mask[rows, :c], attention_mask[rows, start:-1]], 1)
            parts.append(forward(ids[rows, start:-1], mask, part, keep=1,
                                 hidden=True).hidden_states[-1][:, -Tb:])  # (rows, Tb, H)
            order.append(rows)
        x = torch.cat(parts)[torch.cat(order).argsort()]  # (B, Tb, H), in the rows' order
    else:  # contiguous: MKL's rounding of the head's matmul can depend on the memory layout
        x = forward(ids, attention_mask, keep=1, hidden=True).hidden_states[-1][:, -Tb - 1:-1]
        x = x.contiguous()
    return x, ids[:, -Tb:]


def worth_sharing(c, B, W):
    """A common prefix of c tokens runs once for B rows of W columns when that saves an eighth of
    the tokens, and is 8 tokens at least (a short one is not worth a second forward; nor does a
    bundled task's prompt of a few characters ever take this path)."""
    return c >= 8 and c * (B - 1) >= B * W / 8


def common_prefix(prompts, mask):
    """How many first tokens every left-padded prompt (B, P) shares, short of each one's last (the
    token that predicts the completion's first stays in each row's own part)."""
    lengths = mask.sum(-1)
    n = int(lengths.min()) - 1
    if n < 1:
        return 0
    start = (prompts.shape[1] - lengths)[:, None] + torch.arange(n, device=prompts.device)
    heads = prompts.gather(1, start)  # (B, n): each prompt's first n tokens
    differ = (heads != heads[:1]).any(0)  # (n,): a column where some prompt differs
    return int(differ.int().argmax()) if differ.any() else n


def length_groups(mask, c, Tb):
    """prefix_first's prompts (mask (B, P)), Tb completion columns after them, in one or two
    groups of rows, each with the first column past the prefix that one of its rows needs:
    (rows, column) pairs. Two (the shorter prompts, the longer) where that drops an eighth of the
    columns past the prefix; else all rows, from the longest prompt's first column."""
    B, P = mask.shape
    first = c + P - mask.sum(-1)  # (B,): each row's first column past its padding
    rows = first.argsort(descending=True, stable=True)  # shortest prompts first
    first = first[rows].tolist()
    width = [P - f + Tb for f in first]  # rows[:i + 1] need width[i] columns (non-decreasing)
    k = min(range(1, B), key=lambda i: i * width[i - 1] + (B - i) * width[-1], default=0)
    if k and k * width[k - 1] + (B - k) * width[-1] <= 7 / 8 * B * width[-1]:
        return [(rows[:k], first[k - 1]), (rows[k:], first[-1])]
    return [(rows, first[-1])]


def prefix_first(ids, mask, P, c):
    """Rows of left-padded prompts (P columns) and their completions, re-laid as the common
    prefix of c tokens first, then each row's padding, then the rest of it: each real token keeps
    its position (positions count the mask's ones) and attends to the same tokens (the padding's
    attention is 0), so every hidden state is the same; and column 0..c-1 is one prompt for all."""
    start = P - mask[:, :P].sum(-1, keepdim=True)  # (B, 1): each prompt's first column
    cols = torch.arange(ids.shape[1], device=ids.device)[None]  # (1, W)
    order = torch.where(cols < c, start + cols, torch.where(cols < start + c, cols - c, cols))
    return ids.gather(1, order), mask.gather(1, order)


CHUNK_ELEMS = 2**22  # head_logprobs makes at most this many logits at a time (16 MB in fp32)


def head_logprobs(x, head, targets, temperature, never, entropy):
    """Log-probs of targets (B, Tb) under the LM head on final hidden states x (B, Tb, H), at the
    temperature, with the ids `never` at probability 0; and the entropies if asked (else 0).
    At most CHUNK_ELEMS logits at a time (docs/memory.md), recomputed in backward."""
    B, Tb, V, chunk_elems = *targets.shape, head.out_features, CHUNK_ELEMS
    r = max(1, chunk_elems // (Tb * V))  # chunks: r whole rows while a row's logits fit,
    c = Tb if Tb * V <= chunk_elems else max(1, chunk_elems // V)  # else c positions of a row
    blocks = [(slice(i, i + r), slice(j, j + c)) for i in range(0, B, r) for j in range(0, Tb, c)]
    if torch.is_grad_enabled() and B * Tb * V <= chunk_elems:  # one chunk: plain autograd
        return _chunk_logprobs(x, targets, temperature, entropy, head, never)
    return LinearHeadLogprobs.apply(x, head.weight, head.bias, targets, temperature, never,
                                    blocks, entropy)


def _masked(z, never):  # common.masked_logits: the suppressed ids at the most negative float
    return z if never is None else z.masked_fill(never, torch.finfo(z.dtype).min)


def _chunk_logprobs(x, targets, temperature, entropy, head, never):
    """Final hidden states x (r, c, H) -> log-probs of targets (r, c), entropies (0: not asked)."""
    logp = _masked(head(x).float() / temperature, never).log_softmax(-1)
    ent = -(logp.exp() * logp).sum(-1) if entropy else 0
    return logp.gather(-1, targets[..., None])[..., 0], ent


class LinearHeadLogprobs(torch.autograd.Function):
    """head_logprobs' chunks for a plain linear head, by hand. Forward: x (B, Tb, H) final
    hidden states, through z = (x W^T + b) / temperature a chunk at a time -> log-probs of the
    targets and entropies (B, Tb); it keeps x only. Backward recomputes each chunk's softmax p
    and forms dL/dz = g_lp (onehot(target) - p) - g_ent p (log p + entropy), then adds that
    chunk's x^T-weighted terms into ONE buffer for W's gradient (a per-chunk checkpoint would
    make a V x H gradient per chunk and sum them): one chunk of logits at a time, and the
    entropy costs nothing in backward when the caller did not use it (g_ent is None)."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, temperature, never, blocks, entropy):
        ctx.amp = torch.is_autocast_enabled(x.device.type), torch.get_autocast_dtype(x.device.type)
        ctx.save_for_backward(x, weight, bias, targets)  # x, not the logits
        ctx.args = temperature, never, blocks
        ctx.set_materialize_grads(False)
        lp = x.new_zeros(targets.shape, dtype=torch.float32)
        ent = torch.zeros_like(lp)
        head = functools.partial(F.linear, weight=weight, bias=bias)  # not the module: no hooks
        for rows, cols in blocks:  # (rows, positions) slices
            lp[rows, cols], ent[rows, cols] = _chunk_logprobs(
                x[rows, cols], targets[rows, cols], temperature, entropy, head, never)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        x, weight, bias, targets = ctx.saved_tensors
        temperature, never, blocks = ctx.args
        (amp, dtype), dev = ctx.amp, x.device.type
        # a buffer for each input that needs a gradient: LoRA's frozen head none (no V x H buffer)
        grad_x, grad_w, grad_b = (torch.zeros_like(t) if need else None
                                  for t, need in zip((x, weight, bias), ctx.needs_input_grad))
        for rows, cols in blocks:
            xc, t = x[rows, cols], targets[rows, cols]
            with torch.autocast(dev, dtype=dtype, enabled=amp):  # as in forward
                logits = F.linear(xc, weight, bias)
            logp = _masked(logits.float() / temperature, never).log_softmax(-1)
            del logits
            p = logp.exp()
            gz = torch.zeros_like(p)
            if g_lp is not None:
                g = g_lp[rows, cols, None]
                gz = (-p * g).scatter_add_(-1, t[..., None], g)
            if g_ent is not None:
                ent = -(p * logp).sum(-1, keepdim=True)
                gz -= g_ent[rows, cols, None] * p * (logp + ent)
            del p, logp
            gz = (gz / temperature).flatten(0, 1)  # (n, V): dL/dlogits
            low = dtype if amp else weight.dtype  # the matmuls' precision, as autograd's
            if grad_x is not None:
                grad_x[rows, cols] = (gz.to(low) @ weight.to(low)).view(xc.shape)
            xf = xc.flatten(0, 1)
            if grad_w is not None and low == grad_w.dtype:
                grad_w.addmm_(gz.T, xf.to(low))  # in place: no V x H temporary
            elif grad_w is not None:
                grad_w += (gz.to(low).T @ xf.to(low)).to(grad_w.dtype)
            if grad_b is not None:
                grad_b += gz.sum(0).to(grad_b.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None
