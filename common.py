"""common.py: the plumbing that reinforce.py, ppo.py and grpo.py must share, identical, and nothing else.

Read top to bottom: errors -> the built-in task and data -> loading -> prompts and sampling -> log-probs ->
rewards -> eval -> run plumbing (outputs, checkpoints, resume, guards, the end-of-run report).
Conventions used everywhere (DESIGN.md section 4): masks come from lengths, never from token values; the EOS
is a completion token and is in the loss; log-probs are taken on logits / the sampling temperature, in fp32.
"""
import dataclasses, difflib, functools, inspect, json, math, os, random, re, shutil, signal, sys, time
from dataclasses import asdict
from types import SimpleNamespace

import torch
from tqdm import tqdm
from torch.utils.checkpoint import checkpoint
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          DynamicCache, HfArgumentParser)
from transformers.modeling_layers import GradientCheckpointingLayer

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_POLICY = os.path.join(ROOT, "models", "tiny-adder")      # bundled, see tools/build_models.py
DEFAULT_REWARD_MODEL = os.path.join(ROOT, "models", "tiny-adder-rm")


# ----------------------------------------------------------------------------------------------------- errors
class UserError(Exception):
    """Bad input: shown as one line on stderr, exit code 2, no traceback, before anything is trained."""


def main_guard(main):
    """Run main(); bad input exits 2 with one line, out of memory exits 1 with what to change, anything else keeps
    its traceback. The last checkpoint and metrics.jsonl stay intact either way."""
    try:
        main()
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except torch.OutOfMemoryError as e:  # the most common complaint of big-trainer users (trl#2972)
        what = (str(e).splitlines() or ["?"])[0][:100]
        print(f"error: out of memory ({what}): lower --micro_batch_size (activations and logits grow with it) or add "
              f"--gradient_checkpointing; the last checkpoint is intact", file=sys.stderr)
        sys.exit(1)


def check_shared_args(a):
    """Flags the three scripts share that would otherwise fail deep inside a step (NaN probabilities, empty
    batches, a stop string that ends every row at once)."""
    for name in ("temperature", "max_new_tokens", "micro_batch_size", "prompts_per_step", "group_size",
                 "samples_per_prompt", "batch_size", "num_minibatches", "ppo_epochs", "num_iterations"):
        if hasattr(a, name) and not getattr(a, name) > 0:
            raise UserError(f"--{name} must be > 0, not {getattr(a, name)}")
    for name in ("eval_every", "save_every"):
        if getattr(a, name) < 0:
            raise UserError(f"--{name} must be >= 0 (0 turns the periodic one off), not {getattr(a, name)}")
    if not 0 < a.top_p <= 1:
        raise UserError(f"--top_p must be in (0, 1], not {a.top_p}: it keeps the smallest set of tokens with that mass")
    if "" in a.stop:
        raise UserError("--stop: an empty stop string would end every completion at its first token")
    if a.chat_template not in ("auto", "none"):
        raise UserError(f"--chat_template {a.chat_template!r}: choose one of auto, none")


def parse_args(args_cls):
    """HfArgumentParser over the Args dataclass; each flag's --help text is the comment beside its field."""
    comments = dict(re.findall(r"^    (\w+): .*?  # (.+)$", inspect.getsource(args_cls), re.M))
    for f in dataclasses.fields(args_cls):
        f.metadata = {**f.metadata, "help": comments.get(f.name, "")}
    args, unknown = HfArgumentParser(args_cls).parse_args_into_dataclasses(return_remaining_strings=True)
    if unknown:  # e.g. a typo, or another script's flag
        close = difflib.get_close_matches(unknown[0].split("=")[0], [f"--{f.name}" for f in dataclasses.fields(args)])
        raise UserError(f"unknown argument {unknown[0]!r}{f' (did you mean {close[0]}?)' if close else ''}; see --help")
    return args


# ------------------------------------------------------------------------------ the built-in task and data
TASK_DIGITS, TASK_EVAL_SEED, TASK_EVAL_SIZE = 2, 1234, 500


def addition_row(a, b):
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def task_eval_pairs():
    """The fixed held-out split: no warm start and no RL run ever trains on these pairs."""
    n = 10**TASK_DIGITS
    return [divmod(x, n) for x in random.Random(TASK_EVAL_SEED).sample(range(n * n), TASK_EVAL_SIZE)]


def task_train_pairs(rng, k):
    """k fresh pairs outside the held-out split (a fixed few hundred prompts would teach memorisation)."""
    held, n, out = set(task_eval_pairs()), 10**TASK_DIGITS, []
    while len(out) < k:
        p = (rng.randrange(n), rng.randrange(n))
        if p not in held:
            out.append(p)
    return out


def read_jsonl(path, need_answer=False):
    """Rows {"prompt": str, "answer": str (optional, unless need_answer: --rewards math checks completions against
    it)}; errors name the file, the line and the field."""
    if not os.path.isfile(path):
        raise UserError(f"data file {path!r} not found")
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig")  # -sig: a byte-order mark (Windows editors) is not an error
                if not line.strip():
                    continue
                row = json.loads(line)
            except UnicodeDecodeError:
                raise UserError(f"{path}, line {n}: not UTF-8 text") from None
            except json.JSONDecodeError as e:
                raise UserError(f"{path}, line {n}: not valid JSON ({e.msg})") from None
            if not isinstance(row, dict) or not isinstance(row.get("prompt"), str) or not row["prompt"]:
                raise UserError(f"{path}, line {n}: field 'prompt' is missing or not a non-empty string")
            answer = row.pop("answer", None)
            if isinstance(answer, (bool, list, dict)):
                raise UserError(f"{path}, line {n}: field 'answer' must be a string or a number")
            if answer is not None:
                row["answer"] = str(answer)
            if need_answer and final_number(row.get("answer", "")) is None:
                raise UserError(f"{path}, line {n}: field 'answer' is missing or has no number, which the math "
                                f"reward compares with each completion's final number (or choose other --rewards)")
            rows.append(row)
    if not rows:
        raise UserError(f"data file {path!r} is empty")
    return rows


def load_data(spec, eval_size=TASK_EVAL_SIZE, need_answer=False):
    """'' -> the built-in task; 'file.jsonl' -> its rows; 'hf:NAME[:CONFIG]' -> a hub dataset (needs `datasets`).
    Returns next_batch(rng, k) -> k training rows, eval_rows (held out) and rows (all). next_batch keeps no state
    but the rng it is given, so saving that rng's state resumes the data stream exactly."""
    if not spec:
        eval_rows = [addition_row(a, b) for a, b in task_eval_pairs()][:eval_size]
        return SimpleNamespace(next_batch=lambda rng, k: [addition_row(a, b) for a, b in task_train_pairs(rng, k)],
                               eval_rows=eval_rows, rows=eval_rows)
    if spec.startswith("hf:"):  # e.g. hf:openai/gsm8k:main -> question/answer columns
        try:
            import datasets
        except ImportError:
            raise UserError("--data hf:... needs the optional package `datasets` (pip install datasets)") from None
        ds = datasets.load_dataset(*spec[3:].split(":"), split="train")
        rows = [{"prompt": r.get("prompt", r.get("question")), **({} if r.get("answer") is None else
                                                                  {"answer": str(r["answer"])})} for r in ds]
        if need_answer and (bad := [i for i, r in enumerate(rows) if final_number(r.get("answer", "")) is None]):
            raise UserError(f"--data {spec}: {len(bad)} rows (the first: row {bad[0]}) have no number in 'answer', "
                            f"which the math reward checks completions against")
    else:
        rows = read_jsonl(spec, need_answer)
    random.Random(0).shuffle(rows)  # a fixed split, the same for every run and seed
    n_eval = min(eval_size, len(rows) // 5)
    if not n_eval:
        print(f"note: {spec} has {len(rows)} rows, too few to hold a fifth out for eval: the eval score is nan")
    eval_rows, train_rows = rows[:n_eval], rows[n_eval:]
    return SimpleNamespace(next_batch=lambda rng, k: [rng.choice(train_rows) for _ in range(k)],
                           eval_rows=eval_rows, rows=rows)


# -------------------------------------------------------------------------------------------------- loading
def pick_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast(device, dtype):
    """Trained weights stay fp32 (bf16 weights round small updates away, DESIGN.md 4.9); forwards run in bf16."""
    on = dtype == "bf16" or (dtype == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


def _check_source(name):
    if not os.path.isdir(name) and not re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", name):
        raise UserError(f"model {name!r}: no such local folder, and not a hub id of the form owner/name")


def load_tokenizer(name, trust_remote_code=False):
    _check_source(name)
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"tokenizer {name!r} could not be loaded: {str(e).splitlines()[0]}") from None
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise UserError(f"tokenizer {name!r} has neither a pad nor an eos token; add one to the tokenizer")
        tok.pad_token = tok.eos_token  # safe here: every mask is built from lengths, never from pad ids
    return tok


def load_model(name, kind, device, frozen=False, trust_remote_code=False, compile=False):
    """kind 'lm' -> AutoModelForCausalLM, 'rm' -> AutoModelForSequenceClassification (num_labels must be 1).
    Frozen models (reference, reward model) live in bf16 on a GPU; trained ones keep fp32 master weights."""
    _check_source(name)
    try:
        cfg = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"model {name!r} could not be loaded: {str(e).splitlines()[0]}") from None
    archs = cfg.architectures or []
    if kind == "lm" and archs and not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs):
        raise UserError(f"model {name!r} has no causal-LM head (architectures: {', '.join(archs)})")
    if kind == "rm" and cfg.num_labels != 1:
        raise UserError(f"reward model {name!r} has num_labels={cfg.num_labels}; a scalar reward needs 1")
    auto = AutoModelForCausalLM if kind == "lm" else AutoModelForSequenceClassification
    dtype = torch.bfloat16 if frozen and device.type == "cuda" else torch.float32
    try:
        model = auto.from_pretrained(name, dtype=dtype, trust_remote_code=trust_remote_code).to(device)
    except (OSError, ValueError) as e:
        raise UserError(f"model {name!r} could not be loaded as {auto.__name__}: {str(e).splitlines()[0]}") from None
    model.eval()  # dropout off in every model, trained ones too: it makes log-probs noisy and KL > 0 at step 0
    if frozen:
        model.requires_grad_(False)
    if compile:  # dynamic shapes: new batch sizes and lengths reuse the graphs. Policy and reference share HF's code,
        torch._dynamo.config.recompile_limit = 32  # whose graphs dynamo counts together; past 8 it would run eager
        model.forward = torch.compile(model.forward, dynamic=True)
    return model


def load_policy(run, args, device):
    """The trained policy and its tokenizer: from args.model, or from the run's checkpoint when resuming."""
    src = os.path.join(run.dir, "checkpoint") if args.resume else args.model
    tok = load_tokenizer(src, args.trust_remote_code)
    model = load_model(src, "lm", device, False, args.trust_remote_code, compile=args.compile)
    if args.gradient_checkpointing:
        (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()  # < 5.24
        # HF recomputes a layer only when that layer is in training mode. The model stays in eval mode (dropout off),
        # so only the checkpointed layers themselves are flagged as training; their dropouts (children) stay off, and
        # so does the base model (GPT-2's would stop passing the KV cache to its layers, even when sampling).
        for m in model.modules():
            if isinstance(m, GradientCheckpointingLayer):
                m.training = True
    return model, tok


def load_reward_model(args, device):
    if not args.reward_model:
        return None, None
    return (load_model(args.reward_model, "rm", device, True, args.trust_remote_code),
            load_tokenizer(args.reward_model, args.trust_remote_code))


def check_prompts(tok, model, rows, args):
    """Fail early when prompts plus max_new_tokens do not fit the model's context."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit:
        lens = [len(s) for s in encode_prompts(tok, [r["prompt"] for r in rows], args.chat_template)]
        if (n := sum(l + args.max_new_tokens > limit for l in lens)):
            raise UserError(f"{n} of {len(lens)} prompts are too long: prompt + max_new_tokens ({args.max_new_tokens}) "
                            f"exceeds the model's context of {limit} tokens (longest prompt: {max(lens)} tokens)")


# ---------------------------------------------------------------------------------------- prompts, sampling
def encode_prompts(tok, prompts, chat_template="auto"):
    """Token ids per prompt. 'auto' applies the tokenizer's chat template when it has one; 'none' never does."""
    index = {p: i for i, p in enumerate(dict.fromkeys(prompts))}  # a GRPO batch repeats each prompt G times:
    distinct = list(index)                                          # tokenize it once
    if chat_template != "none" and tok.chat_template:
        texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                 for p in distinct]
        ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        ids = [tok(p)["input_ids"] for p in distinct]
    return [ids[index[p]] for p in prompts]


def left_pad(seqs, pad_id, device):
    P = max(len(s) for s in seqs)
    ids = torch.tensor([[pad_id] * (P - len(s)) + list(s) for s in seqs], device=device)
    mask = torch.tensor([[0] * (P - len(s)) + [1] * len(s) for s in seqs], device=device)
    return ids, mask


def positions(attention_mask):
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)  # left padding: real tokens count from 0


@functools.lru_cache(maxsize=None)
def _cache_kwarg(model_cls):
    # transformers >= 5.24 names the KV-cache argument `cache`; older versions call it `past_key_values`.
    return "cache" if "cache" in inspect.signature(model_cls.forward).parameters else "past_key_values"


def _forward(model, ids, mask, pos, cache=None, keep=0):
    """The same arguments on every call (keep = logits_to_keep, 0 = all): --compile's signature guards then hold."""
    return model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=cache is not None, logits_to_keep=keep,
                 **{_cache_kwarg(type(model)): cache})


def eos_ids(model, tok):
    """Every token that ends a completion: the tokenizer's EOS and the generation config's (chat models often
    stop on several, e.g. <|im_end|> and <|endoftext|>)."""
    stop = getattr(model.generation_config, "eos_token_id", None)
    return sorted({tok.eos_token_id, *(stop if isinstance(stop, list) else [stop])} - {None})


@torch.no_grad()
def sample(model, tok, prompt_ids, max_new_tokens, temperature=1.0, top_p=1.0, greedy=False, amp=None, stop=()):
    """Batched sampling with a KV cache. Each distinct prompt is prefilled once and its cache copied to every row
    that asks for it (a GRPO group of G shares one prefill; HF's generate prefills all G copies). Rows that have
    finished are dropped from the batch and the cache, so they stop costing compute. A row finishes at its first
    EOS or at the token that completes one of the `stop` strings. Returns a SimpleNamespace:
      ids (B, P+T): left-padded prompt then completion; attention_mask (B, P+T) from lengths;
      completion_mask (B, T) float: 1 on every generated token up to AND including the EOS (or the stop string's
      last token), 0 after; truncated (B,) bool: neither within max_new_tokens; sample_logprobs (B, T)."""
    device = next(model.parameters()).device
    keys = [tuple(p) for p in prompt_ids]
    distinct = {p: i for i, p in enumerate(dict.fromkeys(keys))}
    row_of = torch.tensor([distinct[k] for k in keys], device=device)  # row -> its distinct prompt
    ids, prompt_mask = left_pad(list(distinct), tok.pad_token_id, device)
    eos = torch.tensor(eos_ids(model, tok), device=device)
    B, P = len(prompt_ids), ids.shape[1]
    out = torch.full((B, max_new_tokens), tok.pad_token_id, device=device)
    out_lp = torch.zeros(B, max_new_tokens, device=device)
    lengths, finished = torch.full((B,), max_new_tokens, device=device), torch.zeros(B, dtype=torch.bool, device=device)
    window = max(map(len, stop), default=0) + 2  # tokens: a stop string spans at most one token per character
    live = torch.arange(B, device=device)  # original row index of each row still being sampled
    cache = DynamicCache()
    with amp or torch.autocast(device.type, enabled=False):
        logits = _forward(model, ids, prompt_mask, positions(prompt_mask), cache, keep=1)\
            .logits[:, -1][row_of]  # prefill: one forward per distinct prompt ...
        cache.batch_select_indices(row_of)  # ... then every row gets its own copy of that prompt's KV cache,
        for layer in cache.layers:  # laid out as after a decode step (one decode graph under --compile, not two)
            layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
        ids, prompt_mask = ids[row_of], prompt_mask[row_of]
        mask, pos = prompt_mask, positions(prompt_mask)[:, -1:]  # mask grows (and loses finished rows) as we go
        for t in range(max_new_tokens):
            logits = logits.float()
            if greedy:
                nxt = logits.argmax(-1)
            else:
                probs = (logits / temperature).softmax(-1)
                if top_p < 1.0:  # nucleus: keep the smallest set of tokens whose mass reaches top_p
                    p_sorted, idx = probs.sort(-1, descending=True)
                    drop = p_sorted.cumsum(-1) - p_sorted >= top_p
                    probs = probs.scatter(-1, idx, p_sorted.masked_fill(drop, 0.0))
                nxt = torch.multinomial(probs, 1).squeeze(-1)
            out[live, t] = nxt
            out_lp[live, t] = (logits / (1.0 if greedy else temperature)).log_softmax(-1).gather(-1, nxt[:, None])[:, 0]
            ended = torch.isin(nxt, eos)
            if stop:  # decode each row's last few tokens: does a stop string appear (so it ends at this token)?
                tails = tok.batch_decode(out[live, max(0, t + 1 - window):t + 1])
                ended |= torch.tensor([any(s in x for s in stop) for x in tails], device=device)
            lengths[live[ended]], finished[live[ended]] = t + 1, True
            if ended.all() or t == max_new_tokens - 1:
                break
            if ended.any():  # drop finished rows from the batch and the KV cache
                keep = (~ended).nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                live, nxt, mask, pos = live[keep], nxt[keep], mask[keep], pos[keep]
            mask, pos = torch.cat([mask, mask.new_ones(len(live), 1)], dim=1), pos + 1
            logits = _forward(model, nxt[:, None], mask, pos, cache, keep=1).logits[:, -1]
    T = int(lengths.max())
    completion_mask = (torch.arange(T, device=device)[None] < lengths[:, None]).float()  # from lengths
    return SimpleNamespace(ids=torch.cat([ids, out[:, :T]], 1), completion_mask=completion_mask,
                           attention_mask=torch.cat([prompt_mask, completion_mask.long()], 1),
                           truncated=~finished,
                           sample_logprobs=out_lp[:, :T] * completion_mask, P=P)


def decode_completions(tok, roll):
    lengths = roll.completion_mask.sum(-1).long().tolist()
    return [tok.decode(row[roll.P:roll.P + n], skip_special_tokens=True) for row, n in zip(roll.ids.tolist(), lengths)]


# -------------------------------------------------------------------------------------------------- log-probs
def token_logprobs(model, ids, attention_mask, T, temperature=1.0, entropy=False, entropy_grad=False,
                   chunk_elems=2**24):
    """log pi(token_t | tokens_<t) for the last T positions of ids: gradients flow.
    Only the completion positions go through the LM head; logits are divided by the sampling temperature and
    log-softmaxed in fp32 a few rows at a time (<= chunk_elems floats), never as one (B, T, V) fp32 tensor.
    When rows share prompts (GRPO groups, RLOO's k samples) and that saves a quarter of the tokens, each distinct
    prompt runs once and its KV cache, gradients included, is indexed out to its rows; same numbers, less compute.
    Either way the LM head runs once on a (B, T, V) tensor of each row's own logits (hooks see per-row values).
    entropy: also each position's entropy, detached, or with entropy_grad differentiable (PPO's entropy bonus)."""
    B, P, entropy = ids.shape[0], ids.shape[1] - T, entropy or entropy_grad
    if T > (Tb := max(1, int(attention_mask[:, P:].sum(-1).max()))):  # these rows' longest completion is shorter:
        lp, ent = token_logprobs(model, ids[:, :P + Tb], attention_mask[:, :P + Tb], Tb, temperature, entropy,
                                 entropy_grad, chunk_elems)  # skip the columns that are padding in every row
        pad = torch.nn.functional.pad
        return pad(lp, (0, T - Tb)), (pad(ent, (0, T - Tb)) if entropy else None)
    pos = positions(attention_mask)
    prompts, row_of = torch.unique(torch.cat([ids[:, :P], attention_mask[:, :P]], 1), dim=0, return_inverse=True)
    # (checkpointed layers drop the KV cache; the last test is model.is_activation_checkpointing, named otherwise
    # before transformers 5.24, and runs only when the rest holds)
    if P > 1 and len(prompts) * P + B * T <= 0.75 * B * (P + T) and \
            not any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        # each distinct prompt, but its last token, runs once; its KV cache is indexed out to every row that shares
        # it (an indexing op: gradients flow back into the one prompt forward) ...
        cache, p_ids, p_mask = DynamicCache(), prompts[:, :P - 1], prompts[:, P:2 * P - 1]
        _forward(model, p_ids, p_mask, positions(p_mask), cache, keep=1)
        cache.batch_select_indices(row_of)
        # ... then each row feeds its last prompt token and completion tokens 0..T-2, which predict tokens 0..T-1
        logits = _forward(model, ids[:, P - 1:-1], attention_mask[:, :-1], pos[:, P - 1:-1], cache).logits
    else:  # one plain forward; position t predicts token t+1
        logits = _forward(model, ids, attention_mask, pos, keep=T + 1).logits[:, :-1]
    targets, lps, ents = ids[:, -T:], [], []
    chunk = max(1, chunk_elems // max(1, T * logits.shape[-1]))
    for i in range(0, B, chunk):
        x = (logits[i:i + chunk], targets[i:i + chunk], temperature, entropy)
        # with gradients and more than one chunk, backward keeps only these logits (bf16 under autocast) and
        # recomputes their fp32 log-softmax one chunk at a time, instead of holding the whole batch's fp32 copy
        lp, ent = checkpoint(_chunk_logprobs, *x, use_reentrant=False, preserve_rng_state=False) \
            if logits.requires_grad and logits.numel() > chunk_elems else _chunk_logprobs(*x)
        lps.append(lp), ents.append(ent if entropy_grad or ent is None else ent.detach())
    return torch.cat(lps), (torch.cat(ents) if entropy else None)


def _chunk_logprobs(logits, targets, temperature, entropy):
    lp = (logits.float() / temperature).log_softmax(-1)
    return lp.gather(-1, targets[..., None])[..., 0], (-(lp.exp() * lp).sum(-1) if entropy else None)


def micro_batches(completion_mask, size):
    """Row indices of each micro-batch. With more than one, rows go in order of completion length, so that each
    micro-batch runs on fewer padding columns (token_logprobs drops the columns that are padding in all its rows).
    Losses are normalised over the whole step, so the order does not change the gradient."""
    B = len(completion_mask)
    order = completion_mask.sum(-1).argsort(stable=True) if size < B else torch.arange(B, device=completion_mask.device)
    return [order[i:i + size] for i in range(0, B, size)]


@torch.no_grad()
def batched_logprobs(model, roll, temperature, micro_batch, amp):
    """token_logprobs without gradients, micro-batched: for old, reference and sanity log-probs."""
    out = torch.zeros_like(roll.completion_mask)
    with amp:
        for mb in micro_batches(roll.completion_mask, micro_batch):
            out[mb] = token_logprobs(model, roll.ids[mb], roll.attention_mask[mb], out.shape[1], temperature)[0]
    return out * roll.completion_mask


def kl_estimate(logprobs, ref_logprobs, estimator):
    """Per-token estimators of KL(pi || pi_ref) on samples from pi (Schulman 2020, "Approximating KL divergence"),
    with r = pi_ref / pi: k1 = -log r (unbiased, noisy, can be < 0); k2 = (log r)^2 / 2 (biased, low variance);
    k3 = r - 1 - log r (unbiased, >= 0; DeepSeekMath). log r is clamped so exp() cannot overflow (TRL #3015)."""
    log_r = (ref_logprobs - logprobs).clamp(-20, 20)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r**2
    return log_r.exp() - 1 - log_r


def masked_mean(x, mask, dim=None):
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


# -------------------------------------------------------------------------------------------------- rewards
def final_number(text):
    """GSM8K-style: the number after '####' if there is one, else the last number in the text."""
    text = text.split("####")[-1].replace(",", "")
    nums = re.findall(r"-?\d+(?:\.\d+)?", text)
    return float(nums[-1]) if nums else None


def math_reward(completion, row):
    """1 when the completion's final number equals the answer's (the built-in task's checker too)."""
    want = final_number(row.get("answer", ""))
    return float(want is not None and final_number(completion) == want)


RULES = {"math": math_reward,
         "format": lambda completion, row: float(final_number(completion) is not None),  # states a number
         "length": lambda completion, row: -len(completion) / 100.0}  # a mild penalty per character


def parse_rewards(spec, reward_model):
    """'math=1,format=0.1' -> {'math': 1.0, 'format': 0.1}; 'rm' names the reward model's score."""
    weights = {}
    for part in filter(None, spec.split(",")):
        name, _, w = part.partition("=")
        if name not in RULES and name != "rm":
            raise UserError(f"--rewards: unknown reward {name!r} (known: {', '.join(RULES)}, rm)")
        try:
            weights[name] = float(w or 1.0)
        except ValueError:
            raise UserError(f"--rewards: the weight of {name!r} must be a number, not {w!r}") from None
    if "rm" in weights and not reward_model:
        raise UserError("--rewards names 'rm' but no --reward_model is given")
    return weights


@torch.no_grad()
def rm_scores(rm, rm_tok, prompts, completions, micro_batch=64, chat_template="auto"):
    """Reward-model score of prompt + completion, re-tokenised with the reward model's own tokenizer (and chat
    template), then EOS, so the RM sees a finished answer. Rows are scored independently of their batch."""
    device, scores = next(rm.parameters()).device, []
    if chat_template != "none" and rm_tok.chat_template:
        texts = [rm_tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                            tokenize=False) for p, c in zip(prompts, completions)]
        seqs = [rm_tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    else:
        seqs = [rm_tok(p + c)["input_ids"] + [rm_tok.eos_token_id] for p, c in zip(prompts, completions)]
    for i in range(0, len(seqs), micro_batch):
        ids, mask = left_pad(seqs[i:i + micro_batch], rm_tok.pad_token_id, device)
        # left padding: the last position is every row's last real token, where the RM reads its score
        hidden = rm.base_model(input_ids=ids, attention_mask=mask, position_ids=positions(mask),
                               use_cache=False).last_hidden_state
        scores.append(rm.score(hidden[:, -1]).float()[:, 0] if hasattr(rm, "score") else
                      rm(input_ids=ids, attention_mask=mask).logits.float()[:, 0])
    return torch.cat(scores)


def compute_rewards(rows, completions, weights, rm=None, rm_tok=None):
    """Weighted sum of reward components; each component is returned too, for logging as reward/<name>."""
    parts = {n: torch.tensor([RULES[n](c, r) for c, r in zip(completions, rows)]) for n in weights if n != "rm"}
    if "rm" in weights:
        parts["rm"] = rm_scores(rm, rm_tok, [r["prompt"] for r in rows], completions).cpu()
    total = sum(weights[n] * v for n, v in parts.items())
    return total, parts


# ------------------------------------------------------------------------------------------------------ eval
def eval_metric(rows):
    return "accuracy" if all("answer" in r for r in rows) else "mean reward"


def gold(completions, rows):
    """{"gold": the true task score of these completions} when every row has an answer to check, else {}."""
    return {"gold": sum(map(math_reward, completions, rows)) / len(rows)} if eval_metric(rows) == "accuracy" else {}


@torch.no_grad()
def evaluate(model, tok, rows, args, amp, rm=None, rm_tok=None, batch_size=128):
    """Held-out greedy score: accuracy (math_reward, 0-1) when every row has an answer, else the mean of the run's
    --rewards (e.g. the reward model's score, for prompts that come without answers)."""
    scores, accuracy = [], eval_metric(rows) == "accuracy"
    weights = None if accuracy else parse_rewards(args.rewards, args.reward_model)
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        roll = sample(model, tok, encode_prompts(tok, [r["prompt"] for r in chunk], args.chat_template),
                      args.max_new_tokens, greedy=True, amp=amp, stop=args.stop)
        comps = decode_completions(tok, roll)
        scores += [math_reward(c, r) for c, r in zip(comps, chunk)] if accuracy else \
            compute_rewards(chunk, comps, weights, rm, rm_tok)[0].tolist()
    return sum(scores) / len(scores) if scores else float("nan")  # no held-out rows (a file of < 5): no score


# ---------------------------------------------------------------------------------------------- run plumbing
def seed_everything(seed):
    random.seed(seed)
    torch.manual_seed(seed)
    return random.Random(seed)  # the data stream's own rng, saved in checkpoints


STOP = {"requested": False}  # set by Ctrl-C: the loop saves a checkpoint and a summary, then exits


def _on_sigint(signum, frame):
    if STOP["requested"]:  # a second Ctrl-C exits at once; the last checkpoint is still intact
        raise KeyboardInterrupt
    STOP["requested"] = True
    print("\nCtrl-C: finishing this step, then saving a checkpoint (press again to quit at once)", file=sys.stderr)


def start_run(args, algo):
    """Output folder, metrics/samples files (appended line by line and flushed), Ctrl-C handler, and resume state.
    With --resume DIR, metrics.jsonl is cut back to the checkpoint's step so no step is duplicated or missing."""
    if args.resume:
        args.output_dir, ckpt = args.resume, os.path.join(args.resume, "checkpoint")
        if not os.path.isdir(ckpt) and os.path.isfile(os.path.join(ckpt + ".old", "trainer_state.pt")):
            os.replace(ckpt + ".old", ckpt)  # killed between save_checkpoint's two renames: the previous one
        if not os.path.isfile(os.path.join(ckpt, "trainer_state.pt")):
            raise UserError(f"--resume {args.resume!r}: no checkpoint/trainer_state.pt in that folder")
    args.output_dir = args.output_dir or os.path.join("runs", f"{algo}-{time.strftime('%Y%m%d-%H%M%S')}")
    os.makedirs(args.output_dir, exist_ok=True)
    state = torch.load(os.path.join(args.output_dir, "checkpoint", "trainer_state.pt"), weights_only=False) \
        if args.resume else None
    if state and state.get("algo", algo) != algo:
        raise UserError(f"--resume {args.resume!r}: that run was made by {state['algo']}.py; resume it with that script")
    if state:  # a resumed run keeps its own settings; only max_steps may be raised
        keep = {"resume": args.resume, "output_dir": args.output_dir, "max_steps": args.max_steps}
        args.__dict__.update({**state["args"], **keep})
    path = os.path.join(args.output_dir, "metrics.jsonl")
    if not state and os.path.exists(path) and os.path.getsize(path):  # never mix two runs' metrics in one file
        raise UserError(f"--output_dir {args.output_dir!r} already holds a run (metrics.jsonl): continue it with "
                        f"--resume {args.output_dir}, or choose another --output_dir")
    history = []
    if state and os.path.exists(path):
        with open(path) as f:  # a line cut short by a crash is dropped with the steps after the checkpoint
            history = [json.loads(l) for l in f if l.endswith("}\n")]
        history = [m for m in history if m["step"] <= state["step"]]
        with open(path, "w") as f:
            f.writelines(json.dumps(m) + "\n" for m in history)
    signal.signal(signal.SIGINT, _on_sigint)
    return SimpleNamespace(dir=args.output_dir, algo=algo, state=state, history=history, t0=time.time(),
                           metrics=open(path, "a"), samples=open(os.path.join(args.output_dir, "samples.jsonl"), "a"),
                           nonfinite=0, nonfinite_in_row=0)


def log_step(run, metrics, bar=None, samples=None):
    run.history.append(metrics)
    run.metrics.write(json.dumps(metrics) + "\n")
    run.metrics.flush()
    if samples:
        run.samples.write(json.dumps({"step": metrics["step"], "samples": samples}) + "\n")
        run.samples.flush()
    if bar is not None:
        bar.set_postfix({k: f"{metrics[k]:.3g}" for k in ("reward", "kl", "gold", "eval") if k in metrics})


def finite_update(run, model, opt, max_grad_norm):
    """Clip and step, unless the loss/gradients are NaN or inf: then skip the update, count it, and stop the run
    after too many in a row (the last checkpoint stays intact). Returns the gradient norm."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if torch.isfinite(grad_norm):
        opt.step()
        run.nonfinite_in_row = 0
    else:
        skip_nonfinite(run, "loss or gradient")
    opt.zero_grad(set_to_none=True)
    return float(grad_norm)


def save_checkpoint(run, model, tok, step, opt, rng, extra=None):
    """Atomic: write checkpoint.tmp/, then swap it in by rename, so a kill while saving leaves the previous
    checkpoint loadable (start_run recovers it from checkpoint.old/ if the kill fell between the two renames).
    Holds the policy and tokenizer (from_pretrained loads it) plus trainer_state.pt."""
    final, tmp, old = (os.path.join(run.dir, n) for n in ("checkpoint", "checkpoint.tmp", "checkpoint.old"))
    for leftover in (tmp, old):  # of a save that was killed (os.replace cannot overwrite a non-empty folder)
        shutil.rmtree(leftover, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    torch.save({"step": step, "algo": run.algo, "args": asdict(run.args), "optimizer": opt.state_dict(), "torch_rng": torch.get_rng_state(),
                "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
                "data_rng": rng.getstate(), "nonfinite": run.nonfinite, "extra": extra or {}},
               os.path.join(tmp, "trainer_state.pt"))
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


def resume_or_eval(run, model, tok, opt, rng, data, args, amp, rm=None, rm_tok=None):
    """Keep what the loop's plumbing needs on `run`; then either restore optimizer, RNG states and counters from
    the checkpoint (resume) or run the first held-out eval. Returns (start_step, eval_before)."""
    run.__dict__.update(model=model, tok=tok, opt=opt, rng=rng, data=data, args=args, amp=amp, rm=rm, rm_tok=rm_tok)
    if not run.state:
        run.eval_before = evaluate(model, tok, data.eval_rows, args, amp, rm, rm_tok)
        print(f"held-out greedy {eval_metric(data.eval_rows)} before training: {run.eval_before:.3f}")
        return 0, run.eval_before
    s = run.state
    opt.load_state_dict(s["optimizer"])
    torch.set_rng_state(s["torch_rng"])
    if s["cuda_rng"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(s["cuda_rng"])
    rng.setstate(s["data_rng"])
    run.nonfinite, run.eval_before = s["nonfinite"], s["extra"]["eval_before"]
    print(f"resumed {run.dir} at step {s['step']}")
    return s["step"], run.eval_before


def skip_nonfinite(run, what, max_in_row=10):
    """Count a skipped update (NaN/inf in a loss, log-prob, gradient or reward); too many in a row stop the run."""
    run.nonfinite += 1
    run.nonfinite_in_row += 1
    tqdm.write(f"warning: non-finite {what}, update skipped ({run.nonfinite} so far)")
    if run.nonfinite_in_row >= max_in_row:
        raise RuntimeError(f"{max_in_row} non-finite updates in a row; stopping (the last checkpoint is intact)")


def end_of_step(run, step, metrics, samples=None, extra=None, kl_warn=10.0):
    """Warnings, periodic eval, the metrics line, periodic and final checkpoints. True when the loop must stop.
    `extra` holds algorithm state to restore on resume (e.g. PPO's adaptive kl_coef)."""
    args, last = run.args, step + 1 == run.args.max_steps or STOP["requested"]
    if metrics.get("kl", 0.0) > kl_warn:
        tqdm.write(f"warning: KL per token is {metrics['kl']:.2f} at step {step + 1}: the policy is running away")
    if args.eval_every and (step + 1) % args.eval_every == 0 and not last:
        metrics["eval"] = evaluate(run.model, run.tok, run.data.eval_rows, args, run.amp, run.rm, run.rm_tok)
    log_step(run, metrics, run.bar if hasattr(run, "bar") else None, samples if step % 25 == 0 else None)
    if step == 0:  # AdamW creates its moments at the end of the first step; say what they add to later steps, so
        device = next(run.model.parameters()).device  # that an out-of-memory at step 2 is no surprise (trl#2972)
        moments = 8 * sum(p.numel() for g in run.opt.param_groups for p in g["params"]) / 2**20
        gpu = torch.cuda.get_device_properties(device).total_memory / 2**20 if device.type == "cuda" else 0
        tqdm.write(f"memory: peak {peak_mem_mb(device):,.0f} MB{f' of {gpu:,.0f}' if gpu else ''} in the first step; "
                   f"AdamW's moments, created at its end, add {moments:,.0f} MB from the next step on")
    if (args.save_every and (step + 1) % args.save_every == 0) or last:
        save_checkpoint(run, run.model, run.tok, step + 1, run.opt, run.rng, {"eval_before": run.eval_before, **(extra or {})})
    return STOP["requested"]


def peak_mem_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    try:  # Linux: this process's own peak RSS (ru_maxrss also counts a parent's, as it survives fork and exec)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        try:
            import resource
        except ImportError:  # Windows: neither /proc nor `resource`; unknown rather than a crash at step 1
            return float("nan")
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # kB on Linux, bytes on macOS
        return rss / 2**20 if sys.platform == "darwin" else rss / 1024


def spark(values, width=60):
    """A one-line text chart: the (finite) values binned to at most `width` columns, drawn with block characters,
    or ASCII where stdout cannot print those (a Windows console code page, output redirected to a file)."""
    values = [v for v in values if math.isfinite(v)]  # a skipped non-finite step logs NaN
    if not values:
        return ""
    k = math.ceil(len(values) / width)
    vs = [sum(values[i:i + k]) / len(values[i:i + k]) for i in range(0, len(values), k)]
    lo, hi, bars = min(vs), max(vs), "▁▂▃▄▅▆▇█"
    try:
        bars.encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        bars = "_.-~=+*#"
    return "".join(bars[int(7 * (v - lo) / (hi - lo)) if hi > lo else 0] for v in vs) + f"  [{lo:.3g} .. {hi:.3g}]"


def finish_run(run, args, device, eval_before, eval_after):
    """summary.json, the before/after table and text charts of reward and KL; curves.png if matplotlib is there."""
    steps, metric = [m["step"] for m in run.history], eval_metric(run.data.eval_rows)
    summary = {"algo": run.algo, "args": asdict(args), "eval_metric": metric,
               "eval_before": eval_before, "eval_after": eval_after,
               "steps": steps[-1] if steps else 0, "wall_time_s": round(time.time() - run.t0, 2),
               "peak_mem_mb": round(peak_mem_mb(device), 1), "nonfinite_skips": run.nonfinite,
               "interrupted": STOP["requested"],
               "tokens_per_s": round(sum(m.get("tokens_per_s", 0) for m in run.history) / max(len(steps), 1), 1)}
    with open(os.path.join(run.dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    run.metrics.close(), run.samples.close()
    print(f"\n{'':21}{'before':>10}{'after':>10}\n{'held-out ' + metric:21}"
          f"{eval_before:>10.3f}{eval_after:>10.3f}")
    for key in ("reward", "gold", "kl"):
        if any(key in m for m in run.history):
            print(f"{key:>8} {spark([m[key] for m in run.history if key in m])}")
    print(f"wall time {summary['wall_time_s']:.0f} s, peak memory {summary['peak_mem_mb']:.0f} MB -> {run.dir}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        keys = [k for k in ("reward", "gold", "kl") if any(k in m for m in run.history)]
        fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 3), squeeze=False)
        for ax, k in zip(axes[0], keys):
            ax.plot([m["step"] for m in run.history if k in m], [m[k] for m in run.history if k in m])
            ax.set_title(k)
        fig.tight_layout()
        fig.savefig(os.path.join(run.dir, "curves.png"))
    except ImportError:
        pass
    if STOP["requested"]:
        sys.exit(130)  # interrupted (Ctrl-C): checkpoint and summary are saved
    return summary


def sanity_check(model, ref, tok, rows, args, amp):
    """--sanity, on the real model and data: sampling log-probs equal recomputed ones, the PPO ratio is exactly 1
    and KL(policy || ref) is 0 before any update, masks end on the EOS; prints a peak-memory estimate.
    Returns the list of what failed (empty when all is well)."""
    failed, device = [], next(model.parameters()).device
    roll = sample(model, tok, encode_prompts(tok, [r["prompt"] for r in rows[:16]], args.chat_template),
                  args.max_new_tokens, args.temperature, args.top_p, amp=amp, stop=args.stop)
    lp = batched_logprobs(model, roll, args.temperature, args.micro_batch_size, amp)
    # fp32 on the CPU: equal up to float noise; bf16 autocast (and, on a GPU, a bf16 reference against fp32 master
    # weights: measured 3e-5 KL on the bundled model, more on deep ones) rounds each forward a little differently
    tol, kl_tol = (1e-3, 1e-4) if device.type == "cpu" and args.dtype != "bf16" else (0.1, 1e-2)
    if (d := float((lp - roll.sample_logprobs).abs().max())) > tol:
        failed.append(f"sampling log-probs differ from the training forward's by {d:.3g} (> {tol})")
    if (d := float(((batched_logprobs(model, roll, args.temperature, args.micro_batch_size, amp) - lp).exp() - 1)
                   .abs().max())) > 1e-4:
        failed.append(f"ratio pi/pi_old at the first inner step is not 1 (off by {d:.3g}): is dropout on?")
    if ref is not None:
        kl = masked_mean(kl_estimate(lp, batched_logprobs(ref, roll, args.temperature, args.micro_batch_size, amp),
                                     "k3"), roll.completion_mask)
        if float(kl) > kl_tol:
            failed.append(f"KL(policy || reference) is {float(kl):.3g} before any update, not 0")
    ended = ~roll.truncated
    last = roll.completion_mask.sum(-1).long() - 1
    if ended.any() and not torch.isin(roll.ids[:, roll.P:][ended, last[ended]],
                                     torch.tensor(eos_ids(model, tok), device=device)).all():
        failed.append("completion_mask does not end on the EOS token for every finished row")
    n_train = sum(p.numel() for p in model.parameters())
    n_frozen = sum(p.numel() * p.element_size() for m in (ref,) if m is not None for p in m.parameters())
    cfg = model.config
    acts = args.micro_batch_size * (roll.ids.shape[1] * cfg.hidden_size * cfg.num_hidden_layers * 34
                                    + 3 * 4 * (roll.completion_mask.shape[1] + 1) * cfg.vocab_size)
    print(f"peak memory estimate: {(16 * n_train + n_frozen + acts) / 2**20:.0f} MB (fp32 weights, grads, Adam "
          f"moments {16 * n_train / 2**20:.0f} MB; frozen models {n_frozen / 2**20:.0f} MB; activations of one "
          f"micro-batch {acts / 2**20:.0f} MB)")
    print("sanity: " + ("all checks passed" if not failed else "FAILED: " + "; ".join(failed)))
    return failed
