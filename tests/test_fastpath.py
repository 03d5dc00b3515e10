"""fastpath.py: which models take the fast log-prob and sampling paths, and their memory."""
import functools
import gc
import itertools
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import common as C
import distill
import fastpath
import grpo
from plumbing import loading
from plumbing import runs

from tests.helpers import ARCHS, OFF, PROMPTS, fast_logprobs, tiny_config, tiny_model


# ---- fastpath.py: which path a model takes, what it never makes
def fast_head(model):
    """The head token_logprobs' fast path runs apart (fastpath.exact_head), or None."""
    base = C._unwrap(model)
    return fastpath.exact_head(base.get_output_embeddings(), functools.partial(C._forward, base))


def test_sampling_puts_only_the_last_position_through_the_lm_head(chat_model):
    """The prefill and every decode step make (rows, 1, V) logits, never (B, P, V)."""
    model = loading.load_model(chat_model, "lm", torch.device("cpu"))
    tok = loading.load_tokenizer(chat_model)
    shapes = []
    hook = model.lm_head.register_forward_hook(lambda m, i, o: shapes.append(tuple(o.shape)))
    C.sample(model, tok, C.encode_prompts(tok, ["1+2=", "Be brief.", "1+2="]), 5)
    C.sample(model, tok, C.encode_prompts(tok, ["1+2=", "Be brief."]), 5, share_prompts=False)
    hook.remove()
    assert shapes and all(s[1] == 1 for s in shapes)


def test_logprobs_never_make_the_full_logits(chat_model, monkeypatch):
    """With gradients, the fast path's LM head sees at most chunk_elems / V positions at a time,
    forward and backward; values and gradients equal the plain path's."""
    model = loading.load_model(chat_model, "lm", torch.device("cpu"))
    tok = loading.load_tokenizer(chat_model)
    torch.manual_seed(0)
    roll = C.sample(model, tok, C.encode_prompts(tok, ["1+2=", "What is the sum?"] * 3), 12)
    T, V = roll.completion_mask.shape[1], model.config.vocab_size
    sizes, blocks, real = [], [], fastpath.LinearHeadLogprobs.apply
    hook = model.lm_head.register_forward_hook(lambda m, i, o: sizes.append(tuple(o.shape[:-1])))
    monkeypatch.setattr(fastpath.LinearHeadLogprobs, "apply",  # the chunks of both passes
                        lambda *a: blocks.append(a[6]) or real(*a))

    def grads(fast):
        model.zero_grad()
        lp, ent = fast_logprobs(
            model, roll.ids, roll.attention_mask, T, 0.7, True, chunk_elems=5 * V
        ) if fast else C.plain_token_logprobs(model, roll.ids, roll.attention_mask, T, 0.7,
                                              True)
        ((lp + 0.1 * ent) * roll.completion_mask).sum().backward()
        return [lp.detach(), ent.detach()] + [p.grad.clone() for p in model.parameters()]
    fast = grads(True)
    # the head module: the forwards' logits_to_keep=1 only; the chunks, forward and backward:
    # blocks of one row and <= 5 positions, covering every position
    assert sizes and all(s[1] == 1 for s in sizes)
    assert len(blocks) == 1
    assert all(b[0].stop - b[0].start == 1 and b[1].stop - b[1].start <= 5 for b in blocks[0])
    assert len(blocks[0]) == 6 * -(-T // 5)
    hook.remove()
    for a, b in zip(fast, grads(False)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_logprobs_with_lora_on_the_lm_head_take_the_plain_path(chat_model, capsys):
    """peft wraps the LM head when it is targeted: a new module, not an nn.Linear, so
    fastpath.exact_head says no and token_logprobs takes its plain path (said at load), the adapter
    in it (and off inside adapters_off). LoRA elsewhere keeps the fast path, with the plain
    path's numbers."""
    tok = loading.load_tokenizer(chat_model)
    prompts = C.encode_prompts(tok, ["1+2=", "Be brief."] * 2)  # shared prompts
    for targets in ("q_proj,lm_head", "q_proj,v_proj"):
        args = SimpleNamespace(model=chat_model, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                               lora_target_modules=targets, trust_remote_code=False,
                               compile=False, gradient_checkpointing=False)
        model, _ = loading.load_policy(args, torch.device("cpu"))
        on_head = targets.endswith("lm_head")
        assert ("LoRA on the LM head" in capsys.readouterr().out) == on_head
        assert (fast_head(model) is None) == on_head
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.05)  # adapters that change the output
        torch.manual_seed(0)
        roll = C.sample(model, tok, prompts, 8)
        T = roll.completion_mask.shape[1]

        def run(fast):
            model.zero_grad()
            logprobs = C.token_logprobs if fast else C.plain_token_logprobs
            lp, _ = logprobs(model, roll.ids, roll.attention_mask, T)
            (lp * roll.completion_mask).sum().backward()
            return [lp.detach()] + [p.grad.clone() for p in model.parameters() if p.requires_grad]
        plain = run(False)
        for a, b in zip(run(True), plain):
            tol = 0 if on_head else 1e-5  # the plain path itself, or the fast path's rounding
            torch.testing.assert_close(a, b, atol=tol, rtol=tol * 10)
        with torch.no_grad(), runs.adapters_off(model):
            off, _ = C.token_logprobs(model, roll.ids, roll.attention_mask, T)
        assert (off - plain[0]).abs().max() > 1e-3  # the adapter was in the log-probs


def test_the_logprob_path_is_decided_from_the_model_itself(tmp_path, tok, capsys):
    """A model whose logits are not its LM head applied to its last hidden state (Gemma 2
    soft-caps them: c tanh(z / c)) fails fastpath.exact_head's check (said once), so
    token_logprobs takes its plain path: the model's own logits, where the fast path would be
    wrong. A model built by hand, never loaded by load_model, takes the fast path: its head
    qualifies, and the numbers equal the plain path's."""
    from transformers import Gemma2Config
    cfg = Gemma2Config(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, intermediate_size=64, pad_token_id=0,
                       bos_token_id=1, eos_token_id=2, final_logit_softcapping=0.1,
                       architectures=["Gemma2ForCausalLM"])
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "gemma2")
    capped = loading.load_model(str(tmp_path / "gemma2"), "lm", torch.device("cpu"))
    assert fast_head(capped) is None and fast_head(capped) is None  # checked once
    assert capsys.readouterr().out.count("logits are not a linear LM head") == 1
    torch.manual_seed(1)
    by_hand = AutoModelForCausalLM.from_config(tiny_config("llama")).eval()
    assert fast_head(by_hand) is by_hand.lm_head
    for model in (capped, by_hand):
        roll = C.sample(model, tok, C.encode_prompts(tok, PROMPTS), 6, temperature=0.7)
        T = roll.completion_mask.shape[1]
        lp, ent = C.token_logprobs(model, roll.ids, roll.attention_mask, T, 0.7, entropy=True)
        want, want_ent = C.plain_token_logprobs(model, roll.ids, roll.attention_mask, T, 0.7,
                                                entropy=True)
        if model is capped:  # the plain path itself
            assert torch.equal(lp, want) and torch.equal(ent, want_ent)
            wrong, _ = fast_logprobs(capped, roll.ids, roll.attention_mask, T, 0.7)
            assert ((wrong - want) * roll.completion_mask).abs().max() > 1e-2
        else:  # the fast path, to rounding
            torch.testing.assert_close(lp, want, atol=1e-5, rtol=1e-4)


def test_fsdp_policy_takes_the_plain_logprob_path(capsys, tmp_path):
    """--fsdp: FSDP2 (runs.wrap_model) shards the LM head's weight (a DTensor), so
    fastpath.exact_head says no and token_logprobs takes the plain path; load_policy says so (the
    2-process runs against 1 process: test_two_processes_make_the_one_process_update). A one-
    process gloo group in this process."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    args = SimpleNamespace(model=loading.DEFAULT_POLICY, lora_r=0, trust_remote_code=False,
                           compile=False, gradient_checkpointing=False, fsdp=True)
    model, tok = loading.load_policy(args, torch.device("cpu"))
    assert "--fsdp shards the LM head's weight" in capsys.readouterr().out
    assert fast_head(model) is model.lm_head  # not sharded yet
    del model.lm_head.exact_logits
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    try:
        fully_shard(model)
        assert fast_head(model) is None
        assert not hasattr(model.lm_head, "exact_logits")  # no check forward: refused before
    finally:
        dist.destroy_process_group()


def test_ddp_policy_and_its_unwrapped_reference_give_bit_equal_logprobs(tmp_path):
    """Under torchrun the DDP-wrapped policy and the unwrapped reference compute log-probs alike,
    bit for bit (neither shares prompts), so with zero advantages and policy = reference GRPO's
    gradient is exactly 0, not rounding that Adam would turn into a full step. A one-process gloo
    group in this process: the paths are the same as with several."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    model = tiny_model("qwen2")
    tok = loading.load_tokenizer(loading.DEFAULT_POLICY)
    prompts = [p for p in C.encode_prompts(tok, PROMPTS) for _ in range(4)]  # GRPO groups
    roll = C.sample(model, tok, prompts, 8)
    T = roll.completion_mask.shape[1]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0,
                            world_size=1)
    try:
        ddp = DistributedDataParallel(model)
        ref = C.batched_logprobs(model, roll, 1.0, len(prompts), OFF)
        lp, _ = C.token_logprobs(ddp, roll.ids, roll.attention_mask, T)
        assert torch.equal(lp.detach() * roll.completion_mask, ref)
        loss, *_ = grpo.per_token_loss(lp, lp.detach(), torch.zeros(len(lp)), None,
                                       grpo.Args(), ref)
        (loss * roll.completion_mask).sum().backward()
        assert all(float(p.grad.abs().max()) == 0 for p in model.parameters())
    finally:
        # DDP's reducer holds the group: free it first, as a run's main() returning does (freed
        # after destroy_process_group, gloo's destructor waited on its threads forever, once)
        ddp = lp = loss = None
        gc.collect()
        dist.destroy_process_group()


def test_feed_rows_and_compact_equal_the_plain_whole_batch_forward():
    """fastpath.feed_rows forwards some rows' observations alone (the others' KV cache gets
    empty columns) and gives the logits and cache the plain version does: the whole batch
    forwarded, the other rows fed padding with attention 0. compact then drops the empty
    columns: the next decode step's logits stay the same."""
    from transformers import DynamicCache
    model = tiny_model("llama", seed=3)
    forward = functools.partial(C._forward, model)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    ids, mask = C.left_pad(prompts, 0, "cpu")
    caches = [DynamicCache(), DynamicCache()]
    for cache in caches:
        forward(ids, mask, cache, keep=1)
    feeds = [[20, 21, 22], [23]]  # rows 0 and 2
    fast, fast_mask = fastpath.feed_rows(forward, caches[0], mask, [0, 2], feeds, 0)
    # plain: the whole batch, row 1 fed padding (attention 0), each row's tokens at the right end
    block = torch.tensor([[20, 21, 22], [0, 0, 0], [0, 0, 23]])
    plain_mask = torch.cat([mask, torch.tensor([[1, 1, 1], [0, 0, 0], [0, 0, 1]])], 1)
    plain = forward(block, plain_mask, caches[1], keep=1).logits[:, -1]  # positions(plain_mask)
    assert torch.equal(fast_mask, plain_mask)
    torch.testing.assert_close(fast, plain[[0, 2]], atol=1e-5, rtol=0)
    # 8 empty columns more in the fast path's cache (rows waiting for a tool), then compact
    for layer in caches[0].layers:
        empty = layer.keys.new_zeros(*layer.keys.shape[:2], 8, layer.keys.shape[3])
        layer.keys, layer.values = torch.cat([layer.keys, empty], 2), torch.cat(
            [layer.values, empty], 2)
    grown = torch.cat([fast_mask, torch.zeros(3, 8, dtype=fast_mask.dtype)], 1)
    compacted = fastpath.compact(caches[0], grown)  # 15 columns > twice the 7 tokens of row 0
    assert compacted.shape[1] == 7 and torch.equal(compacted.sum(-1), plain_mask.sum(-1))
    steps = []
    for cache, m in ((caches[0], compacted), (caches[1], plain_mask)):
        m = torch.cat([m, torch.ones(3, 1, dtype=m.dtype)], 1)  # the new token: position m.sum()
        steps.append(forward(torch.tensor([[30], [31], [32]]), m, cache, keep=1).logits)
    torch.testing.assert_close(steps[0], steps[1], atol=1e-5, rtol=0)


def chat_prompts(tok):
    """PROMPTS after one system prompt (a chat template's), the first twice (one prefill)."""
    system = C.encode_prompts(tok, ["Be exact. Sum: "])[0]
    return system, [system + p for p in C.encode_prompts(tok, PROMPTS[:1] + PROMPTS)]


def plain_hidden(model, ids, mask, T):
    """One forward of the padded rows: the final hidden states that predict the last T tokens."""
    return C._forward(model, ids, mask, keep=1, hidden=True).hidden_states[-1][:, -T - 1:-1]


def hidden_and_grads(model, x, roll, w):
    """x at the completion tokens, and the parameter gradients of a sum weighted by w (H,)."""
    valid = roll.completion_mask.bool()
    model.zero_grad()
    (x[valid] @ w).sum().backward()
    return x[valid].detach(), [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                               for p in model.parameters()]


def assert_same(a, b):
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    for g, h in zip(a[1], b[1]):
        torch.testing.assert_close(g, h, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_forward_runs_the_system_prompt_once_with_a_plain_forwards_values_and_grads(
        arch, tok, monkeypatch):
    """distill.final_hidden on distinct prompts of different lengths after one system prompt:
    fastpath.prefix_forward runs the common prefix once (prefix_first's layout: the prefix, each
    row's padding, the rest), the rest in length_groups, each without the padding columns all its
    rows have. The hidden states and the parameter gradients are one plain forward's (1e-5)."""
    model = tiny_model(arch)
    model.generation_config.eos_token_id = [2, 43, 72]
    system, prompts = chat_prompts(tok)
    roll = C.sample(model, tok, prompts[1:], 8, temperature=0.7)  # distinct prompts
    T, w = roll.completion_mask.shape[1], torch.randn(model.config.hidden_size)
    relaid, groups, real = [], [], (fastpath.prefix_first, fastpath.length_groups)
    monkeypatch.setattr(fastpath, "prefix_first", lambda *a: relaid.append(a[3]) or real[0](*a))
    monkeypatch.setattr(fastpath, "length_groups", lambda *a: groups.append(real[1](*a)) or
                        groups[-1])
    fast = hidden_and_grads(model, distill.final_hidden(model, roll.ids, roll.attention_mask, T),
                            roll, w)
    assert len(relaid) == 1 and relaid[0] >= len(system) and len(groups[0]) >= 2
    assert_same(fast, hidden_and_grads(
        model, plain_hidden(model, roll.ids, roll.attention_mask, T), roll, w))


@pytest.mark.parametrize("arch", ARCHS)
def test_the_prompts_forward_kept_from_sampling_gives_the_plain_hidden_states_and_grads(
        arch, tok):
    """distill.py's one forward of the student's prompts a step: sample()'s prefill by
    fastpath.prefill_keeping (the system prompt once, the graph kept) gives the plain prefill's
    sampled completions and log-probs (rows ending at different steps, a prompt on two rows); then
    after_prefill feeds only the completions after the kept cache, and the hidden states and the
    parameter gradients (through the prompts' forward) are one plain forward's (1e-5)."""
    model = tiny_model(arch)
    model.generation_config.eos_token_id = [2, 43, 72]
    _, prompts = chat_prompts(tok)
    kept, forward = {}, functools.partial(C._forward, model)
    torch.manual_seed(0)
    roll = C.sample(model, tok, prompts, 8, prefill=functools.partial(
        fastpath.prefill_keeping, forward, model.get_input_embeddings(), kept))
    torch.manual_seed(0)  # the same draws
    plain = C.sample(model, tok, prompts, 8)
    assert torch.equal(roll.ids, plain.ids) and torch.equal(roll.attention_mask,
                                                            plain.attention_mask)
    lengths = roll.completion_mask.sum(-1)
    assert lengths.min() < lengths.max() and kept["x"].shape[0] == len(prompts) - 1
    torch.testing.assert_close(roll.sample_logprobs, plain.sample_logprobs, atol=1e-5, rtol=1e-5)
    T, w = roll.completion_mask.shape[1], torch.randn(model.config.hidden_size)
    fast = hidden_and_grads(model, fastpath.after_prefill(forward, kept, roll.ids,
                                                          roll.attention_mask, T), roll, w)
    assert_same(fast, hidden_and_grads(
        model, plain_hidden(model, roll.ids, roll.attention_mask, T), roll, w))


def test_length_groups_feed_the_fewest_columns_an_exhaustive_search_finds():
    """Rows sorted by length, cut in at most 4 contiguous groups: length_groups' columns (a group's
    rows x its longest), each group past the first costing a sixteenth of one group's, are the
    least of every cut; every row in one group, none of its tokens cut."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        B, P, Tb = 9, 30, 5
        lengths = torch.randint(2, P + 1, (B,), generator=gen)
        mask = (torch.arange(P)[None] >= P - lengths[:, None]).long()  # left-padded
        groups = fastpath.length_groups(mask, 0, Tb)
        rows = torch.cat([r for r, _ in groups]).sort().values
        assert torch.equal(rows, torch.arange(B))
        assert all(int(start) <= int(P - lengths[r].max()) for r, start in groups)
        cost = lambda gs: sum(len(g) * (Tb + int(max(g))) for g in gs) + (
            len(gs) * B * (Tb + int(lengths.max())) / 16)
        width = sorted(lengths.tolist())
        best = min(cost([width[i:j] for i, j in zip((0,) + cut, cut + (B,))])
                   for n in range(4) for cut in itertools.combinations(range(1, B), n))
        assert cost([lengths[r].tolist() for r, _ in groups]) == pytest.approx(best)
