"""engine.py: the multi-turn sampler, for tool use (--env, --tools): one decode loop in which each
row runs an episode. Read common.sample first, the single-turn loop; this is that loop with the
environment's answers fed in (nanochat keeps chat_rl.py and engine.py apart the same way, TRL
its single-turn generation and its tool-call loop).

When a row's turn ends (its EOS, or a stop string), the row sends its environment a Request and
waits while the others go on decoding; the env's answer, the observation, goes through the same
KV cache in one forward (completion_mask 0, sample_logprobs 0: context, like the prompt), and the
row samples its next turn. No token is forwarded twice. Rows join and leave the forwards as their
tools answer, so each row draws from its own stream of uniforms (u[i, k] draws row i's k-th
token): the rollout does not depend on when a tool answered. The draw itself, temperature, top-p
and the log-prob, is common.next_token, the single-turn sampler's. With an env that ends every
episode at once, the rollout is common.sample's (greedy: token for token; tested).

The environments (one episode per row on its own copy, concurrent calls with a deadline,
observations as text) are plumbing/envs.py's; it hands this module env_step and finish.
"""
import functools
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from transformers import DynamicCache

import common as C
import fastpath  # feed_rows, forward_rows, compact: an observation into some rows' KV cache


class Request(NamedTuple):  # what sample() hands env_step for a row whose turn just ended
    row: int  # the row's index in the batch
    turn: list  # the turn's token ids, as sampled
    budget: int  # tokens left for the observation and all that follows it
    eos: int | None  # the EOS the turn ended on (None: a stop string ended it)


@dataclass
class RowState:  # one row of sample(), as nanochat's engine keeps it
    n: int = 0  # tokens written so far, the model's and observations': the column of the next
    begun: int = 0  # the column where its current turn began
    state: str = "sample"  # its logits are ready; "wait": its env call runs; "feed": see below
    feed: list = field(default_factory=list)  # state "feed": the ids to forward (the turn's
    # last token, sampled but not yet forwarded, then the observation's)


def generate(model, tok, rows, args, greedy=False, *, env):
    """common.generate with an env (envs.load_env, which binds it; common.generate holds the
    autocast): one multi-turn episode per row, each on its own copy of the row. Returns the
    rollout, with the episodes' fields (turns, observations, transcript, ...: common.Rollout),
    and the texts rewards read: the text after the last observation. greedy (held-out eval):
    the argmax, at temperature 1."""
    tools = env.tools  # --tools: their JSON schemas, rendered by the chat template
    prompt_ids = C.encode_prompts(tok, [r["prompt"] for r in rows], args.chat_template, tools)
    temperature, top_p = (1.0, 1.0) if greedy else (args.temperature, args.top_p)
    env_step, finish = env.start(rows, tok, args.max_turns)
    roll = sample(model, tok, prompt_ids, args.max_new_tokens, env_step, temperature, top_p,
                  greedy, args.stop)
    finish(roll)  # the episodes' turns and observations: roll.final, roll.transcript, ...
    return roll, roll.final


@torch.no_grad()
def sample(model, tok, prompt_ids, max_new_tokens, env_step, temperature=1.0, top_p=1.0,
           greedy=False, stop=(), share_prompts=True):
    """common.sample's rollout, each row an episode: when its turn ends (its first EOS, or the
    token that completes a `stop` string) it sends a Request and waits while the others go on.
    env_step(requests, wait) (envs.start_episodes) starts their calls and returns [(row,
    observation ids, or None: the episode ended)] of those finished (wait: block until one has).
    An observation goes through the KV cache in one forward (completion_mask 0, sample_logprobs
    0); no token is forwarded twice. max_new_tokens counts observations too."""
    B, N, device = len(prompt_ids), max_new_tokens, next(model.parameters()).device
    eos = torch.tensor(C.eos_ids(model, tok), device=device)
    out = torch.full((B, N), tok.pad_token_id, device=device)  # row i's tokens at columns 0..n-1
    out_lp = torch.zeros(B, N, device=device)
    is_obs = torch.zeros(B, N, dtype=torch.bool, device=device)  # fed, not sampled
    finished = torch.zeros(B, dtype=torch.bool, device=device)  # ended by EOS / stop / the env
    rows = [RowState() for _ in range(B)]
    window = max(map(len, stop), default=0) + 2  # a stop string spans <= 1 token per character
    # rows join and leave forwards as their tools answer, so each row draws from its own
    # stream: u[i, k] draws row i's k-th token, whoever shares its forwards
    u = torch.rand(B, N, device=device)
    # the prefill, as common.sample's
    prompts, row_of = fastpath.distinct(prompt_ids, device) if share_prompts else (
        prompt_ids, None)
    ids, prompt_mask = C.left_pad(prompts, tok.pad_token_id, device)
    cache = DynamicCache()
    logits = C._forward(model, ids, prompt_mask, cache, keep=1)
    logits = logits.logits[:, -1]  # (b, V): each row's next-token logits (state "sample")
    if row_of is not None:
        fastpath.copy_to_rows(cache, row_of)
        logits, ids, prompt_mask = logits[row_of], ids[row_of], prompt_mask[row_of]
    batch = torch.arange(B, device=device)  # the rows in the KV cache, in its order
    kv_mask = prompt_mask  # (b, S): the cache columns that hold a row's tokens
    never = C.suppressed(model, logits.shape[-1], device)  # (V,) bool: ids never sampled
    forward = functools.partial(C._forward, model)
    while True:
        # 1. observations that arrived go through the model, for their rows only
        feeding = [j for j, i in enumerate(batch.tolist()) if rows[i].state == "feed"]
        if feeding:  # plain: the whole batch, the others fed padding; here: these rows alone
            feeds = [rows[i].feed for i in batch[feeding].tolist()]
            logits[feeding], kv_mask = fastpath.feed_rows(forward, cache, kv_mask, feeding,
                                                          feeds, tok.pad_token_id)
            for i in batch[feeding].tolist():
                rows[i].state, rows[i].feed = "sample", []
        # 2. every row whose logits are ready draws its next token (logits: last column)
        drawing = torch.tensor([rows[i].state == "sample" for i in batch.tolist()],
                               device=device)
        who, requests = batch[drawing], []
        if len(who):
            col = torch.tensor([rows[i].n for i in who.tolist()], device=device)
            nxt, lp = C.next_token(logits[drawing], temperature, top_p, greedy, never,
                                   u[who, col])
            out[who, col], out_lp[who, col] = nxt, lp
            ended = torch.isin(nxt, eos)  # the model's turn ended on its EOS
            if stop:  # decode each row's last few tokens of this turn: a stop string?
                recent = out[who].tolist()
                tails = [tok.decode(x[max(rows[i].begun, n + 1 - window):n + 1])
                         for i, n, x in zip(who.tolist(), col.tolist(), recent)]
                ended |= torch.tensor([any(s in x for s in stop) for x in tails],
                                      device=device)
            for i, e, x in zip(who.tolist(), ended.tolist(), nxt.tolist()):
                r = rows[i]
                r.n += 1
                if e:  # its env answers: a Request, then it waits
                    requests.append(Request(i, out[i, r.begun:r.n].tolist(), N - r.n,
                                            x if x in eos else None))
                    r.state = "wait"
                elif r.n == N:  # the budget is spent
                    r.state = "done"
        # 3. the env: start the new calls; the answers of those finished (wait if no row can
        # go on without one); an observation is written now, and fed at the next forward
        waiting = any(r.state == "wait" for r in rows)
        for i, obs in env_step(requests, not drawing.any()) if waiting else []:
            r = rows[i]
            if obs is None:  # the episode ended
                r.state, finished[i] = "done", True
                continue
            out[i, r.n:r.n + len(obs)] = torch.tensor(obs, dtype=torch.long)
            is_obs[i, r.n:r.n + len(obs)] = True
            r.feed = [int(out[i, r.n - 1])] + list(obs)  # the turn's last token, then it
            r.n += len(obs)
            r.begun, r.state = r.n, "done" if r.n == N else "feed"
        # 4. rows done leave the batch and the KV cache
        keep = [j for j, i in enumerate(batch.tolist()) if rows[i].state != "done"]
        if not keep:
            break
        if len(keep) < len(batch):
            keep = torch.tensor(keep, device=device)
            cache.batch_select_indices(keep)
            batch, logits, kv_mask = batch[keep], logits[keep], kv_mask[keep]
        # 5. a decode step: the rows that drew give their token; the others (waiting, or to
        # be fed next) ride along as padding with attention 0: their columns stay empty
        going = torch.tensor([rows[i].state == "sample" for i in batch.tolist()],
                             device=device)
        if going.any():
            nxt = torch.tensor([int(out[i, rows[i].n - 1]) if rows[i].state == "sample"
                                else tok.pad_token_id for i in batch.tolist()], device=device)
            kv_mask = torch.cat([kv_mask, going[:, None].long()], 1)
            step = C._forward(model, nxt[:, None], kv_mask, cache, keep=1).logits[:, -1]
            logits = torch.where(going[:, None], step, logits)
        kv_mask = fastpath.compact(cache, kv_mask)  # empty columns: dropped once half
    lengths = torch.tensor([r.n for r in rows], device=device)
    real = torch.arange(int(lengths.max()), device=device)[None] < lengths[:, None]
    completion_mask = (real & ~is_obs[:, :real.shape[1]]).float()  # the model's, not observations
    T = real.shape[1]
    return C.Rollout(ids=torch.cat([ids, out[:, :T]], 1),
                     attention_mask=torch.cat([prompt_mask, real.long()], 1),
                     completion_mask=completion_mask, truncated=~finished,
                     sample_logprobs=out_lp[:, :T] * completion_mask, P=ids.shape[1])
