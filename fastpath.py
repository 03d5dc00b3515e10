"""fastpath.py: the fast paths of common.py's sampling and log-probs. Same values and gradients
as the plain versions there (tested); read those first, and come here for how it is made cheap.

- prefill_shared: sample()'s prefill runs each distinct prompt once and copies its KV cache to
  every row of its group (GRPO's G rows, RLOO's k samples).
- fast_token_logprobs: token_logprobs() without the padding columns, with a shared-prompt KV
  cache, and with the LM head run a chunk at a time on the final hidden states, so that neither
  forward nor backward holds the (B, T, V) logits (at a 151k vocabulary, the largest tensor of a
  step; measured in docs/memory.md). For models whose head check_head passed at load.
"""
import functools
import weakref

import torch
import torch.nn.functional as F
from transformers import DynamicCache

import common as C


def prefill_shared(model, prompt_ids, pad_id, device):
    """sample()'s prefill with the same results (last logits, cache, ids, mask), but each distinct
    prompt runs once and its KV cache is copied to its rows (HF's generate runs a group's G)."""
    index = {p: i for i, p in enumerate(dict.fromkeys(map(tuple, prompt_ids)))}  # distinct prompts
    row_of = torch.tensor([index[tuple(p)] for p in prompt_ids], device=device)  # row -> its prompt
    ids, mask = C.left_pad(list(index), pad_id, device)
    cache = DynamicCache()
    logits = C._forward(model, ids, mask, C.positions(mask), cache, keep=1).logits[:, -1][row_of]
    cache.batch_select_indices(row_of)
    for layer in cache.layers:  # laid out as after a decode step: one compiled decode graph
        layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
    return logits, cache, ids[row_of], mask[row_of]


SPLIT_HEADS = weakref.WeakSet()  # the LM heads that passed check_head: token_logprobs' fast path


def check_head(model):
    """At load (loading.load_model): may token_logprobs run this model's LM head on its own, a
    chunk at a time? Only a plain nn.Linear whose output on the final hidden state IS the logits
    (not where the model scales or soft-caps them, e.g. Gemma 2): checked on two tokens, where the
    same matmul on the same input gives the same bits, so any change to the logits shows. If so
    the head joins SPLIT_HEADS. A head put in its place later (peft's LoRA-wrapped lm_head) or a
    model that never passes here (e.g. built by hand) takes token_logprobs' plain path."""
    head = model.get_output_embeddings()
    ids = torch.tensor([[0, 1]], device=model.device)
    with torch.no_grad():
        out = C._forward(model, ids, torch.ones_like(ids), C.positions(ids), keep=1, hidden=True)
        ok = type(head) is torch.nn.Linear and torch.equal(
            head(out.hidden_states[-1][:, -1:]).float(), out.logits.float())
    if ok:
        SPLIT_HEADS.add(head)
    else:
        print(f"{type(model).__name__}: its logits are not a linear LM head applied to its last "
              "hidden state; log-probs make the full logits (more memory)")


def fast_token_logprobs(model, head, ids, attention_mask, T, temperature, entropy,
                        chunk_elems=2**22):
    """token_logprobs() where head is in SPLIT_HEADS, with less compute and memory: padding columns
    skipped, shared prompts run once, <= chunk_elems logits at a time (docs/memory.md)."""
    P = ids.shape[1] - T
    Tb = max(1, int(attention_mask[:, P:].sum(-1).max()))  # these rows' longest completion
    ids, attention_mask = ids[:, :P + Tb], attention_mask[:, :P + Tb]
    B, V, pos = ids.shape[0], head.out_features, C.positions(attention_mask)
    prompts, row_of = torch.unique(torch.cat([ids[:, :P], attention_mask[:, :P]], 1), dim=0,
                                   return_inverse=True)
    # share prompts if that saves a quarter of the tokens; not under torchrun (DDP: one forward per
    # backward; the reference, unwrapped, must match the policy bit for bit) nor with checkpointing
    if P > 1 and len(prompts) * P + B * Tb <= 0.75 * B * (P + Tb) and not (
            torch.distributed.is_initialized()  # (checkpointed layers drop the KV cache)
            or any(getattr(m, "gradient_checkpointing", False) for m in model.modules())):
        cache, p_mask = DynamicCache(), prompts[:, P:2 * P - 1]
        C._forward(model, prompts[:, :P - 1], p_mask, C.positions(p_mask), cache, keep=1)
        cache.batch_select_indices(row_of)  # every prompt but its last token, once per prompt
        # each row feeds its last prompt token and completion tokens 0..Tb-2: they predict 0..Tb-1
        x = C._forward(model, ids[:, P - 1:-1], attention_mask[:, :-1], pos[:, P - 1:-1], cache,
                       keep=1, hidden=True).hidden_states[-1]  # (B, Tb, H)
    else:  # contiguous: MKL's rounding of the head's matmul can depend on the memory layout
        x = C._forward(model, ids, attention_mask, pos, keep=1,
                       hidden=True).hidden_states[-1][:, -Tb - 1:-1].contiguous()
    targets, never = ids[:, -Tb:], C.suppressed(model, V, ids.device)
    r = max(1, chunk_elems // (Tb * V))  # chunks: r whole rows while a row's logits fit,
    c = Tb if Tb * V <= chunk_elems else max(1, chunk_elems // V)  # else c positions of a row
    blocks = [(slice(i, i + r), slice(j, j + c)) for i in range(0, B, r) for j in range(0, Tb, c)]
    if torch.is_grad_enabled() and B * Tb * V <= chunk_elems:  # one chunk: plain autograd
        lp, ent = _chunk_logprobs(x, targets, temperature, entropy, head, never)
    else:  # backward recomputes each chunk (without gradients: each chunk is freed)
        lp, ent = LinearHeadLogprobs.apply(x, head.weight, head.bias, targets, temperature, never,
                                           blocks, entropy)
    return F.pad(lp, (0, T - Tb)), F.pad(ent, (0, T - Tb)) if entropy else None


def _chunk_logprobs(x, targets, temperature, entropy, head, never):
    """Final hidden states x (r, c, H) -> log-probs of targets (r, c), entropies (0: not asked)."""
    logp = C.masked_logits(head(x).float() / temperature, never).log_softmax(-1)
    ent = -(logp.exp() * logp).sum(-1) if entropy else 0
    return logp.gather(-1, targets[..., None])[..., 0], ent


class LinearHeadLogprobs(torch.autograd.Function):
    """fast_token_logprobs' chunks for a plain linear head, by hand. Forward: x (B, Tb, H) final
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
        need_x, need_w, need_b = ctx.needs_input_grad[:3]  # LoRA: the head is frozen, so W and
        grad_x = torch.zeros_like(x) if need_x else None  # b need none (a V x H buffer saved)
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b else None  # bias None: need_b is False
        for rows, cols in blocks:
            xc, t = x[rows, cols], targets[rows, cols]
            with torch.autocast(dev, dtype=dtype, enabled=amp):  # as in forward
                logits = F.linear(xc, weight, bias)
            logp = C.masked_logits(logits.float() / temperature, never).log_softmax(-1)
            del logits
            p = logp.exp()
            # dL/dz = g_lp (onehot(target) - p) - g_ent p (log p + entropy), z the logits / temp.
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
