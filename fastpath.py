"""fastpath.py: the fast paths of common.py's sampling and log-probs, and engine.py's. Same values
and gradients as the plain versions there (tested); read those first, and come here for how it is
made cheap. Pure torch: the model's forward comes in as a function, forward(ids, mask, cache,
keep, hidden) (common._forward with its model bound): this file imports nothing of the project.

- distinct, copy_to_rows: sample()'s prefill runs each distinct prompt once and copies its KV
  cache to every row of its group (GRPO's G rows, RLOO's k samples).
- feed_rows, forward_rows, compact: engine.sample (multi-turn) feeds an observation to its rows
  alone, the others' KV cache growing by empty (masked) columns; compact drops them.
- final_hidden, head_logprobs: token_logprobs() without the padding columns, with a
  shared-prompt KV cache, and with the LM head run a chunk at a time on the final hidden states,
  so that neither forward nor backward holds the (B, T, V) logits (at a 151k vocabulary, the
  largest tensor of a step; measured in docs/memory.md). For models whose LM head passes
  exact_head.
- prefix_forward, prefill_keeping, after_prefill: distill.py's forwards (only it calls them). A
  prefix every prompt starts with (a chat template's system prompt) runs once, the rest in groups
  of rows of like length; the student's prompts run once a step, in sampling's prefill.
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


def can_share(model):
    """Whether a forward of `model` may reuse one KV cache for rows that share a prompt: not
    under DDP (one forward per backward) nor gradient checkpointing (which drops the cache)."""
    ddp = torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1  # --vllm: 1
    return not ddp and not any(getattr(m, "gradient_checkpointing", False)
                               for m in model.modules())


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
    else:  # contiguous: MKL's rounding of the head's matmul can depend on the memory layout
        x = forward(ids, attention_mask, keep=1, hidden=True).hidden_states[-1][:, -Tb - 1:-1]
        x = x.contiguous()
    return x, ids[:, -Tb:]


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


# ------------------------------------------------- distill.py's forwards: a shared prefix once
# A distillation step forwards every prompt several times (sampling's prefill, the teacher, the
# student), the prompts are most of its tokens, and a chat template starts each one with the same
# system prompt (SmolLM2's: 24 tokens). So the prefix runs once, the rest of the rows in groups of
# like length, each without the padding columns all its rows have; and the student's prompts run
# once a step, with gradients, in sampling's prefill (prefill_keeping), its training forward
# then only over the completions (after_prefill). Measured in docs/distill.md.
def worth_sharing(c, B, W):
    """A common prefix of c tokens runs once for B rows of W columns when that saves an eighth of
    the tokens, and is 8 tokens at least (a short one is not worth another forward call; nor does
    a bundled task's prompt of a few characters ever take this path)."""
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


def length_groups(mask, c, Tb, most=4):
    """prefix_first's prompts (mask (B, P)), Tb columns after them, in at most `most` groups of
    rows of like length, each from the first column past the prefix that one of its rows needs:
    (rows, column) pairs. The fewest columns fed (a group's rows x its longest row), by an exact
    search over the rows sorted by length, each group past the first to save a sixteenth of the
    columns one group feeds (another forward call is not free)."""
    B, P = mask.shape
    first = c + P - mask.sum(-1)  # (B,): each row's first column past its padding
    rows = first.argsort(descending=True, stable=True)  # shortest prompts first
    first = first[rows].tolist()
    width = [P - f + Tb for f in first]  # rows[:j] need width[j - 1] columns (non-decreasing)
    ends = [j for j in range(1, B + 1) if j == B or first[j] != first[j - 1]]  # where one ends
    best, done = {0: (0, [])}, []  # best[j]: (columns, groups' ends) of rows[:j], g groups
    for _ in range(most):
        best = {j: min((cols + (j - i) * width[j - 1], cut + [j]) for i, (cols, cut) in
                       best.items() if i < j) for j in ends if j > min(best, default=B)}
        done += [best[B]] if B in best else []
    cols, cut = min(done, key=lambda d: d[0] + len(d[1]) * B * width[-1] / 16)
    return [(rows[i:j], first[j - 1]) for i, j in zip([0] + cut, cut)]


def prefix_first(ids, mask, P, c):
    """Rows of left-padded prompts (P columns) and their completions, re-laid as the common
    prefix of c tokens first, then each row's padding, then the rest of it: each real token keeps
    its position (positions count the mask's ones) and attends to the same tokens (the padding's
    attention is 0), so every hidden state is the same; and column 0..c-1 is one prompt for all."""
    start = P - mask[:, :P].sum(-1, keepdim=True)  # (B, 1): each prompt's first column
    cols = torch.arange(ids.shape[1], device=ids.device)[None]  # (1, W)
    order = torch.where(cols < c, start + cols, torch.where(cols < start + c, cols - c, cols))
    return ids.gather(1, order), mask.gather(1, order)


def prefix_forward(forward, ids, mask, P, share=True, embed=None):
    """Rows ids, mask (B, W) whose first P columns are left-padded prompts -> the final hidden
    states at the last prompt column and every one after it (B, W - P + 1, H) and the last
    column's logits (B, V), in the rows' order; the same values as one forward. embed (the
    model's input embedding: prefill_keeping): the ids embedded once for all the calls (one
    embedding gradient, not one a call), and also the KV cache, (keys, values) a layer, (B, heads,
    W, dim) in the groups' order (row i at place[i]: no reordering in backward), with its mask:
    prefix_first's layout, zeros at the columns a group skipped (their attention is 0). share
    False (a cache cannot be reused: can_share): one group, no prefix."""
    B, W = ids.shape
    c = common_prefix(ids[:, :P], mask[:, :P]) if share else 0
    c = c if worth_sharing(c, B, W) else 0
    ids, mask = prefix_first(ids, mask, P, c)
    inputs = ids if embed is None else embed(ids)  # (B, W) ids or (B, W, H) embeddings
    prefix = DynamicCache()
    if c:
        forward(inputs[:1, :c], mask[:1, :c], prefix, keep=1)
    xs, logits, layers, order = [], [], [], []
    for rows, start in length_groups(mask[:, :P], c, W - P, 4 if share else 1):
        n = len(rows)  # the group's rows read the prefix's cache, theirs after it
        cache = DynamicCache([(layer.keys.expand(n, -1, -1, -1), layer.values.expand(
            n, -1, -1, -1)) for layer in prefix.layers]) if c or embed is not None else None
        out = forward(inputs[rows, start:], torch.cat([mask[rows, :c], mask[rows, start:]], 1),
                      cache, keep=1, hidden=True)
        xs.append(out.hidden_states[-1][:, P - W - 1:])
        logits.append(out.logits[:, -1])
        if embed is not None:  # its KV cache at full width: zeros at the columns it skipped
            gap = start - c
            layers.append([[torch.cat([t[:, :, :c], t.new_zeros(n, t.shape[1], gap, t.shape[3]),
                                       t[:, :, c:]], 2) for t in (layer.keys, layer.values)]
                           for layer in cache.layers])
        order.append(rows)
    order = torch.cat(order)  # the groups' order: row order[j] at place j
    place = order.argsort()
    x, logits = torch.cat(xs)[place], torch.cat(logits)[place]
    if embed is None:
        return x, logits
    kv = [[torch.cat(ts) for ts in zip(*parts)] for parts in zip(*layers)]
    return x, logits, kv, mask[order], place


def prefill_keeping(forward, embed, kept, ids, mask, row_of):
    """common.sample's prefill (prefill=) of distinct prompts (b, P) that keeps their forward's
    graph for distill.py's training step: the last column's final hidden states (b, H), the KV
    cache and its mask (the groups' order), each prompt's place in it and each row's prompt
    (row_of, or None: one row a prompt) into kept; the sampler gets the next-token logits, and
    the cache (a detached copy) and its mask in the rows' order."""
    with torch.enable_grad():  # (sample() runs under no_grad)
        x, logits, kv, kv_mask, place = prefix_forward(forward, ids, mask, ids.shape[1],
                                                       embed=embed)
        kept.update(x=x[:, -1], kv=kv, mask=kv_mask, place=place, row_of=row_of)
    return logits.detach(), kv_mask[place], DynamicCache([(k.detach()[place], v.detach()[place])
                                                          for k, v in kv])


def after_prefill(forward, kept, ids, attention_mask, T):
    """The final hidden states (B, T, H) that predict the last T tokens of ids (B, P + T), with
    the prompts' forward kept by prefill_keeping: its last hidden state (it predicts token 0),
    then tokens 0..T-2 fed after its KV cache, their gradients flowing back into it. The rows go
    in the cache's order, so that one a prompt (--samples_per_prompt 1) reads it as it is."""
    row_of = kept["row_of"] if kept["row_of"] is not None else torch.arange(len(ids),
                                                                             device=ids.device)
    x = kept["x"][row_of][:, None]  # (B, 1, H)
    if T > 1:
        at = kept["place"][row_of]  # (B,): each row's prompt's place in the cache
        rows = at.argsort(stable=True)  # the rows in the cache's order
        kv, mask = kept["kv"], kept["mask"]
        if not torch.equal(at[rows], torch.arange(len(mask), device=at.device)):  # shared
            kv, mask = [[t[at[rows]] for t in layer] for layer in kv], mask[at[rows]]
        out = forward(ids[rows, -T:-1], torch.cat([mask, attention_mask[rows, -T:-1]], 1),
                      DynamicCache(kv), keep=1, hidden=True)
        x = torch.cat([x, out.hidden_states[-1][rows.argsort()]], 1)
    return x
