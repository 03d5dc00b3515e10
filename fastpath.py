"""fastpath.py: the fast paths of common.py's sampling and log-probs. Same values and gradients
as the plain versions there (tested); read those first, and come here for how it is made cheap.

- prefill_shared: sample()'s prefill runs each distinct prompt once and copies its KV cache to
  every row of its group (GRPO's G rows, RLOO's k samples).
- fast_token_logprobs: token_logprobs() without the padding columns, with a shared-prompt KV
  cache, and with the LM head run a chunk at a time on the final hidden states, so that neither
  forward nor backward holds the (B, T, V) logits (at a 151k vocabulary, the largest tensor of a
  step; measured in docs/memory.md).
"""
import functools

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers import DynamicCache
from transformers.modeling_layers import GradientCheckpointingLayer

import common as C


def prefill_shared(model, prompt_ids, pad_id, device):
    """Fast path of sample()'s prefill: each distinct prompt runs once and its KV cache is copied to
    every row that asks for it (a GRPO group of G rows shares one prefill; HF's generate runs G).
    Returns the same (last logits, cache, ids, mask) as the plain prefill."""
    keys = [tuple(p) for p in prompt_ids]
    distinct = {p: i for i, p in enumerate(dict.fromkeys(keys))}
    row_of = torch.tensor([distinct[k] for k in keys], device=device)  # row -> its prompt
    ids, mask = C.left_pad(list(distinct), pad_id, device)
    cache = DynamicCache()
    logits = C._forward(model, ids, mask, C.positions(mask), cache, keep=1).logits[:, -1][row_of]
    cache.batch_select_indices(row_of)
    for layer in cache.layers:  # laid out as after a decode step: one compiled decode graph
        layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
    return logits, cache, ids[row_of], mask[row_of]


_HEAD_CHECKED = {}  # model class -> does its LM head turn the last hidden state into its logits?


_SAID_FSDP = []  # the FSDP2 fallback is said once


def fast_token_logprobs(model, ids, attention_mask, T, temperature=1.0, entropy=False,
                        chunk_elems=2**22):
    """token_logprobs() with three savings, same values and gradients (tested):
    1. completion columns that are padding in every row are not run;
    2. when rows share prompts (GRPO groups, RLOO's k samples) and that saves a quarter of the
       tokens, each distinct prompt runs once and its KV cache is indexed out to its rows (an
       indexing op: gradients flow back into the one prompt forward);
    3. the LM head never makes the (B, T, V) logits: the model returns its final hidden states
       (B, T, H), and head -> logits / temperature -> fp32 log-softmax -> gather runs a chunk
       of <= chunk_elems logits at a time (16 MB in fp32 by default); with gradients over
       several chunks, backward recomputes each chunk (LinearHeadLogprobs for a plain linear
       head, torch.utils.checkpoint for any other, e.g. LoRA's), so neither pass holds more
       than one chunk of logits. A model whose logits are not head(last hidden state) (checked
       once per class), or an FSDP2 model (its head's weight is sharded), falls back to a full
       forward with logits_to_keep, chunked only for the log-softmax (said once).
    Under torchrun every model skips 2.: a DDP model wants one forward per backward, and the
    unwrapped reference must compute exactly as the policy does (else KL and ratio are not
    exactly 0 and 1 at policy = reference, and Adam turns the rounding into a full step)."""
    P = ids.shape[1] - T
    Tb = max(1, int(attention_mask[:, P:].sum(-1).max()))  # these rows' longest completion
    ids, attention_mask = ids[:, :P + Tb], attention_mask[:, :P + Tb]
    B = ids.shape[0]
    pos = C.positions(attention_mask)
    head = _lm_head(model)  # None: fall back to logits from the model's forward
    prompts, row_of = torch.unique(torch.cat([ids[:, :P], attention_mask[:, :P]], 1), dim=0,
                                   return_inverse=True)
    saves = len(prompts) * P + B * Tb <= 0.75 * B * (P + Tb)
    # (checkpointed layers drop the KV cache; FSDP2 wants one forward per backward)
    if P > 1 and saves and not torch.distributed.is_initialized() and not any(
            isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
            for m in model.modules()):
        cache, p_mask = DynamicCache(), prompts[:, P:2 * P - 1]
        C._forward(model, prompts[:, :P - 1], p_mask, C.positions(p_mask), cache, keep=1)
        cache.batch_select_indices(row_of)  # every prompt but its last token, once per prompt
        # each row feeds its last prompt token and completion tokens 0..Tb-2: they predict 0..Tb-1
        out = C._forward(model, ids[:, P - 1:-1], attention_mask[:, :-1], pos[:, P - 1:-1], cache,
                       keep=0 if head is None else 1, hidden=head is not None)
        x = out.hidden_states[-1] if head is not None else out.logits  # (B, Tb, H), or (B, Tb, V)
    else:
        out = C._forward(model, ids, attention_mask, pos, keep=Tb + 1 if head is None else 1,
                       hidden=head is not None)
        x = out.logits[:, :-1] if head is None else out.hidden_states[-1][:, -Tb - 1:-1]
    if head is not None:  # (B, Tb, H), small: contiguous, so the head's matmul rounds the same
        x = x.contiguous()  # in every model (MKL's rounding can depend on the memory layout)
    pad = (0, T - Tb)
    if head is not None and not _head_makes_logits(model, head, out):  # (now falls back)
        lp, ent = fast_token_logprobs(model, ids, attention_mask, Tb, temperature, entropy,
                                      chunk_elems)
        return F.pad(lp, pad), ent if ent is None else F.pad(ent, pad)
    V = out.logits.shape[-1]
    never = C.suppressed(model, V, ids.device)
    targets = ids[:, -Tb:]
    # chunks of whole rows (x[i:i + r]: (r, Tb, H), or logits (r, Tb, V)) while a row's logits
    # fit in chunk_elems, else of c positions of one row: the same for every T beyond that
    r = max(1, chunk_elems // (Tb * V))
    c = Tb if Tb * V <= chunk_elems else max(1, chunk_elems // V)
    several = B > r or Tb > c
    if torch.is_grad_enabled() and several and type(head) is torch.nn.Linear:
        lp, ent = LinearHeadLogprobs.apply(x, head.weight, head.bias, targets, temperature, never,
                                           r, c, entropy)
        return F.pad(lp, pad), F.pad(ent, pad) if entropy else None
    lps, ents = [], []
    for i in range(0, B, r):
        row_lps, row_ents = [], []
        for j in range(0, Tb, c):
            args = (x[i:i + r, j:j + c], targets[i:i + r, j:j + c], temperature, entropy, head,
                    never)
            if torch.is_grad_enabled() and several:  # any other head (LoRA): recompute
                lp, ent = checkpoint(_chunk_logprobs, *args, use_reentrant=False,
                                     preserve_rng_state=False)
            else:
                lp, ent = _chunk_logprobs(*args)
            row_lps.append(lp)
            row_ents.append(ent)
        lps.append(torch.cat(row_lps, 1))
        ents.append(torch.cat(row_ents, 1) if entropy else None)
    lp = F.pad(torch.cat(lps), pad)
    return lp, F.pad(torch.cat(ents), pad) if entropy else None


def _chunk_logprobs(x, targets, temperature, entropy, head, never):
    """One chunk: x (r, c, H) final hidden states through the head, or x (r, c, V) logits."""
    logits = head(x) if head is not None else x
    logp = C.masked_logits(logits.float() / temperature, never).log_softmax(-1)
    ent = -(logp.exp() * logp).sum(-1) if entropy else None
    return logp.gather(-1, targets[..., None])[..., 0], ent


def _blocks(B, Tb, r, c):
    return [(slice(i, i + r), slice(j, j + c)) for i in range(0, B, r) for j in range(0, Tb, c)]


class LinearHeadLogprobs(torch.autograd.Function):
    """fast_token_logprobs' chunks for a plain linear head, by hand. Forward: x (B, Tb, H) final
    hidden states, through z = (x W^T + b) / temperature a chunk at a time -> log-probs of the
    targets and entropies (B, Tb); it keeps x only. Backward recomputes each chunk's softmax p
    and forms dL/dz = g_lp (onehot(target) - p) - g_ent p (log p + entropy), then adds that
    chunk's x^T-weighted terms into ONE buffer for W's gradient (a per-chunk checkpoint would
    make a V x H gradient per chunk and sum them): one chunk of logits at a time, and the
    entropy costs nothing in backward when the caller did not use it (g_ent is None)."""

    @staticmethod
    def forward(ctx, x, weight, bias, targets, temperature, never, r, c, entropy):
        dev = x.device.type
        ctx.amp = torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)
        ctx.save_for_backward(x, weight, bias, targets)
        ctx.args = temperature, never, r, c
        ctx.set_materialize_grads(False)
        lp = x.new_zeros(targets.shape, dtype=torch.float32)
        ent = torch.zeros_like(lp)
        head = functools.partial(F.linear, weight=weight, bias=bias)
        for rows, cols in _blocks(*targets.shape, r, c):
            lp[rows, cols], e = _chunk_logprobs(x[rows, cols], targets[rows, cols], temperature,
                                                entropy, head, never)
            if entropy:
                ent[rows, cols] = e
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        x, weight, bias, targets = ctx.saved_tensors
        temperature, never, r, c = ctx.args
        (amp, dtype), dev = ctx.amp, x.device.type
        grad_x, grad_w = torch.zeros_like(x), torch.zeros_like(weight)
        grad_b = None if bias is None else torch.zeros_like(bias)
        for rows, cols in _blocks(*targets.shape, r, c):
            xc, t = x[rows, cols], targets[rows, cols]
            with torch.autocast(dev, dtype=dtype, enabled=amp):  # as in forward
                logits = F.linear(xc, weight, bias)
            logp = C.masked_logits(logits.float() / temperature, never).log_softmax(-1)
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
            grad_x[rows, cols] = (gz.to(low) @ weight.to(low)).view(xc.shape)
            xf = xc.flatten(0, 1)
            if low == grad_w.dtype:
                grad_w.addmm_(gz.T, xf.to(low))  # in place: no V x H temporary
            else:
                grad_w += (gz.to(low).T @ xf.to(low)).to(grad_w.dtype)
            if grad_b is not None:
                grad_b += gz.sum(0).to(grad_b.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None, None


def _lm_head(model):
    """The LM head (a LoRA-wrapped one too), or None where the fast path cannot split it."""
    hf = C._unwrap(model)
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        if not _SAID_FSDP:
            _SAID_FSDP.append(print("FSDP2: the LM head's weight is sharded; log-probs make full "
                                    "logits (more memory)"))
        return None
    return None if _HEAD_CHECKED.get(type(hf)) is False else hf.get_output_embeddings()


def _head_makes_logits(model, head, out):
    """Once per model class: head(last hidden state) equals the logits of the forward's last
    position (not so for models that scale or soft-cap their logits); if not, say so and fall
    back from then on."""
    cls = type(C._unwrap(model))
    if cls not in _HEAD_CHECKED:
        with torch.no_grad():
            want = out.logits[:, -1].float()
            ok = torch.allclose(head(out.hidden_states[-1][:, -1:])[:, -1].float(), want,
                                rtol=1e-3, atol=1e-3 * float(want.abs().max()))
        _HEAD_CHECKED[cls] = ok
        if not ok:
            print(f"{cls.__name__}: its logits are not its LM head applied to its last hidden "
                  "state; log-probs make full logits (more memory)")
    return _HEAD_CHECKED[cls]
