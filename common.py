"""common.py: the algorithmic core that every training script shares, and must share identically.

Sections, top to bottom: data (the built-in task, JSONL, hub datasets) -> loading -> prompts and
sampling -> log-probs and KL -> rewards -> held-out eval. Run plumbing (flags, output folder,
checkpoints, resume, Ctrl-C) lives in runs.py.

Notation used in every script:
  pi_theta  the policy being trained;  pi_old  the policy that sampled the batch (a frozen copy of
  pi_theta's log-probs);  pi_ref  a frozen reference model, usually the starting policy.
  A rollout `roll` holds B rows of prompt + completion: P prompt columns (left-padded), then T
  completion columns (right-padded). roll.completion_mask (B, T) is 1 on every generated token up to
  AND including the EOS and 0 after it. Masks come from lengths, never from token values, so the EOS
  is in the loss even when the pad token is the EOS token.
  Log-probs are log pi(token | earlier tokens), in fp32, on logits / the sampling temperature.
"""
import contextlib
import functools
import importlib
import importlib.util
import inspect
import json
import math
import numbers
import os
import random
import re
import warnings
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoTokenizer, DynamicCache)
from transformers.modeling_layers import GradientCheckpointingLayer

try:  # optional: a symbolic answer checker (pip install math-verify), used when installed
    import math_verify
except ImportError:
    math_verify = None

ROOT = os.path.dirname(os.path.abspath(__file__))
DEFAULT_POLICY = os.path.join(ROOT, "models", "tiny-adder")  # bundled: tools/build_models.py
DEFAULT_REWARD_MODEL = os.path.join(ROOT, "models", "tiny-adder-rm")
PIPELINE_RANKINGS = os.path.join(ROOT, "data", "rankings.jsonl")  # tools/make_pipeline_data.py


class UserError(Exception):
    """Bad input: shown as one line on stderr, exit code 2, no traceback (see runs.main_guard)."""


# ------------------------------------------------------------------------------------------ data
TASK_DIGITS = 2  # the built-in task: two-digit addition, "37+48=" -> "85"
TASK_EVAL_SEED = 1234
TASK_EVAL_SIZE = 500


def addition_row(a, b):
    return {"prompt": f"{a}+{b}=", "answer": str(a + b)}


def task_eval_pairs():
    """The fixed held-out split: no warm start and no RL run ever trains on these pairs."""
    n = 10**TASK_DIGITS
    pairs = random.Random(TASK_EVAL_SEED).sample(range(n * n), TASK_EVAL_SIZE)
    return [divmod(x, n) for x in pairs]


def task_train_pairs(rng, k):
    """k fresh pairs outside the held-out split (a fixed few hundred would teach memorisation)."""
    held = set(task_eval_pairs())
    n = 10**TASK_DIGITS
    out = []
    while len(out) < k:
        pair = (rng.randrange(n), rng.randrange(n))
        if pair not in held:
            out.append(pair)
    return out


def make_row(raw, where, need_answer=False, prompt_field="", answer_field="", system_prompt=""):
    """One data row: every field of the source kept (reward functions see them all), plus
    "prompt" (text, or a list of chat messages {"role", "content"}) and "answer" (text, optional).
    prompt_field / answer_field name the source's fields ('' = the usual names). need_answer:
    the answer must hold a number (the math reward compares each completion with it)."""
    if not isinstance(raw, dict):
        raise UserError(f"{where}: not a JSON object")
    p_key = prompt_field or next((k for k in ("prompt", "question", "problem") if k in raw), "")
    a_key = answer_field or next((k for k in ("answer", "solution") if k in raw), "answer")
    row = dict(raw)
    prompt = raw.get(p_key)
    is_chat = isinstance(prompt, list) and prompt and all(
        isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in prompt)
    if not (isinstance(prompt, str) and prompt) and not is_chat:
        raise UserError(f"{where}: field {p_key or 'prompt'!r} is missing or not a non-empty "
                        "string (or a list of chat messages)")
    if system_prompt:  # a system message before the user's (kept if the row has its own)
        messages = prompt if is_chat else [{"role": "user", "content": prompt}]
        if messages[0]["role"] != "system":
            prompt = [{"role": "system", "content": system_prompt}, *messages]
    row["prompt"] = prompt
    row.pop("answer", None)
    answer = raw.get(a_key)
    if isinstance(answer, (bool, list, dict)):
        raise UserError(f"{where}: field {a_key!r} must be a string or a number")
    if answer is not None:  # a missing or null answer stays missing (not the text 'None')
        row["answer"] = str(answer)
    if need_answer and final_number(row.get("answer", "")) is None:
        raise UserError(f"{where}: field {a_key!r} is missing or has no number, which the math "
                        "reward compares with each completion (or change --rewards)")
    return row


def jsonl_objects(path):
    """(where, object) for each non-blank line of a JSONL file, where = "FILE, line N". Errors
    name the file and the line."""
    if not os.path.isfile(path):
        what = "is a directory, not a file" if os.path.isdir(path) else "not found"
        raise UserError(f"data file {path!r} {what}")
    found = False
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            where = f"{path}, line {n}"
            try:
                line = raw.decode("utf-8-sig")  # -sig: a byte-order mark is not an error
                if not line.strip():
                    continue
                obj = json.loads(line)
            except UnicodeDecodeError:
                raise UserError(f"{where}: not UTF-8 text") from None
            except json.JSONDecodeError as e:
                raise UserError(f"{where}: not valid JSON ({e.msg})") from None
            found = True
            yield where, obj
    if not found:
        raise UserError(f"data file {path!r} is empty")


def read_jsonl(path, need_answer=False, **fields):
    """Rows of a JSONL file, one JSON object a line (see make_row). Errors name the file, the line
    and the field."""
    return [make_row(obj, where, need_answer, **fields) for where, obj in jsonl_objects(path)]


def read_hub_dataset(spec, split="train", need_answer=False, **fields):
    """'hf:NAME[:CONFIG]', e.g. hf:openai/gsm8k:main (question/answer columns), every column kept.
    Needs the optional package `datasets`."""
    try:
        import datasets
    except ImportError:
        raise UserError("--data hf:... needs the optional package `datasets` "
                        "(pip install datasets)") from None
    table = datasets.load_dataset(*spec[3:].split(":"), split=split)
    return [make_row(dict(r), f"--data {spec}, row {i}", need_answer, **fields)
            for i, r in enumerate(table)]


def load_data(spec, eval_size=TASK_EVAL_SIZE, need_answer=False, split="train", prompt_field="",
              answer_field="", system_prompt=""):
    """'' -> the built-in task; 'file.jsonl' -> its rows; 'hf:NAME[:CONFIG]' -> a hub dataset.
    need_answer: every row must have an answer with a number (the math reward checks it).
    Returns next_batch(rng, k) -> k training rows, eval_rows (held out) and rows (all). next_batch
    keeps no state but the rng it is given, so saving that rng resumes the data stream exactly."""
    fields = dict(prompt_field=prompt_field, answer_field=answer_field, system_prompt=system_prompt)
    if not spec:
        eval_rows = [make_row(addition_row(a, b), "", **fields)
                     for a, b in task_eval_pairs()][:eval_size]

        def next_task_batch(rng, k):
            return [make_row(addition_row(a, b), "", **fields) for a, b in task_train_pairs(rng, k)]
        return SimpleNamespace(next_batch=next_task_batch, eval_rows=eval_rows, rows=eval_rows)
    if spec.startswith("hf:"):
        rows = read_hub_dataset(spec, split, need_answer, **fields)
    else:
        rows = read_jsonl(spec, need_answer, **fields)
    random.Random(0).shuffle(rows)  # a fixed split, the same for every run and seed
    n_eval = min(eval_size, len(rows) // 5)
    if not n_eval:
        print(f"note: {spec} has {len(rows)} rows, too few to hold a fifth out: eval score is nan")
    eval_rows, train_rows = rows[:n_eval], rows[n_eval:]

    def next_file_batch(rng, k):
        return [rng.choice(train_rows) for _ in range(k)]
    return SimpleNamespace(next_batch=next_file_batch, eval_rows=eval_rows, rows=rows)


# preference data (reward_model.py, dpo.py): pairs {"prompt", "chosen", "rejected"} or rankings
# {"prompt", "ranking": [best, ..., worst]}
def ranking_pairs(k):
    """All K(K-1)/2 (better, worse) index pairs of a ranking of k, best first."""
    return [(i, j) for i in range(k) for j in range(i + 1, k)]


def read_preferences(path, eval_size):
    """(train rows, held-out rows), each {"prompt", "completions", "pairs": [(chosen i, rejected
    j), ...], "margin"}, from pairs or rankings; the prompt is text or chat messages (checked by
    make_row). Errors name the file, the line and the field."""
    rows = []
    for where, obj in jsonl_objects(path):
        row = make_row(obj, where)
        if "ranking" in row:
            done = row["ranking"]  # the completions, best first
            if not (isinstance(done, list) and len(done) >= 2
                    and all(isinstance(c, str) for c in done)):
                raise UserError(f"{where}: field 'ranking' must be a list of 2 or more strings")
        else:
            for key in ("chosen", "rejected"):
                if not isinstance(row.get(key), str):
                    raise UserError(f"{where}: field {key!r} is missing or not a string (a "
                                      "row needs 'chosen' and 'rejected', or 'ranking')")
            done = [row["chosen"], row["rejected"]]
        if len(set(done)) < len(done):
            raise UserError(f"{where}: a completion is both chosen and rejected: {done}")
        margin = row.get("margin", 0.0)
        if type(margin) not in (int, float) or not math.isfinite(margin):  # (True: no)
            raise UserError(f"{where}: field 'margin' must be a finite number")
        rows.append({"prompt": row["prompt"], "completions": done, "margin": float(margin),
                     "pairs": ranking_pairs(len(done))})
    # held out: a fixed fifth of the distinct prompts (at most eval_size), all rows of a prompt
    key = [json.dumps(r["prompt"]) for r in rows]  # a chat prompt is a list: not hashable
    prompts = sorted(set(key))
    random.Random(0).shuffle(prompts)
    held = set(prompts[:min(eval_size, len(prompts) // 5)])
    return ([r for r, k in zip(rows, key) if k not in held],
            [r for r, k in zip(rows, key) if k in held])


def step_rows(rows, batch_size, seed, step):
    """The rows of optimizer step `step`: each epoch is a shuffle set by (seed, epoch) alone, so
    resuming needs only the step number."""
    epoch, i = divmod(step, math.ceil(len(rows) / batch_size))
    order = random.Random(seed * 100003 + epoch).sample(rows, len(rows))
    return order[i * batch_size:(i + 1) * batch_size]


def flatten(rows):
    """Each row's completions, one after another, and the index pairs, margins and weights of
    all its pairs in that flat list: (prompts, completions, chosen, rejected, margin, weight)."""
    prompts, completions, chosen, rejected, margin, weight = [], [], [], [], [], []
    for r in rows:
        start = len(completions)
        prompts += [r["prompt"]] * len(r["completions"])
        completions += r["completions"]
        chosen += [start + i for i, _ in r["pairs"]]
        rejected += [start + j for _, j in r["pairs"]]
        margin += [r["margin"]] * len(r["pairs"])
        weight += [1 / len(r["pairs"])] * len(r["pairs"])
    return prompts, completions, chosen, rejected, torch.tensor(margin), torch.tensor(weight)


def collate(examples, pad_id, device):
    """Rows of (prompt ids, completion ids) as a rollout: prompts left-padded to P columns,
    completions right-padded to T; completion_mask (B, T) is 1 on each completion token, EOS
    included, built from lengths."""
    prompt, prompt_mask = left_pad([p for p, _ in examples], pad_id, device)
    T = max(len(c) for _, c in examples)
    completion = torch.tensor([c + [pad_id] * (T - len(c)) for _, c in examples], device=device)
    mask = torch.tensor([[1] * len(c) + [0] * (T - len(c)) for _, c in examples], device=device)
    return SimpleNamespace(ids=torch.cat([prompt, completion], 1), P=prompt.shape[1],
                             attention_mask=torch.cat([prompt_mask, mask], 1),
                             completion_mask=mask.float())


# --------------------------------------------------------------------------------------- loading
def pick_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast(device, dtype):
    """Trained weights stay fp32 (in bf16, lr ~1e-6 updates round away); forwards run in bf16."""
    on = dtype == "bf16" or (dtype == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


def _check_source(name):
    if not os.path.isdir(name) and not re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", name):
        raise UserError(f"model {name!r}: no such local folder, and not a hub id like owner/name")


def _first_line(e):
    return (str(e).splitlines() or [type(e).__name__])[0]


def load_tokenizer(name, trust_remote_code=False):
    _check_source(name)
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"tokenizer {name!r} could not be loaded: {_first_line(e)}") from None
    tok.padding_side = "left"
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise UserError(f"tokenizer {name!r} has neither a pad nor an eos token; add one")
        tok.pad_token = tok.eos_token  # safe: every mask is built from lengths, not from pad ids
    return tok


def load_model(name, kind, device, frozen=False, trust_remote_code=False, compile=False):
    """kind 'lm': AutoModelForCausalLM; 'rm': AutoModelForSequenceClassification with one label,
    whose score head must come from the checkpoint. Frozen models (reference, reward model) live in
    bf16 on a GPU; trained ones keep fp32 master weights. Dropout is off in every model."""
    _check_source(name)
    try:
        cfg = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise UserError(f"model {name!r} could not be loaded: {_first_line(e)}") from None
    archs = cfg.architectures or []
    is_lm = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    if kind == "lm" and archs and not is_lm:
        raise UserError(f"model {name!r} has no causal-LM head (architectures: {', '.join(archs)})")
    if kind == "rm" and is_lm:
        raise UserError(f"reward model {name!r} is not a sequence-classification model "
                        f"(architectures: {', '.join(archs)})")
    if kind == "rm" and cfg.num_labels != 1:
        raise UserError(f"reward model {name!r} has num_labels={cfg.num_labels}; a scalar reward "
                        "needs 1")
    auto = AutoModelForCausalLM if kind == "lm" else AutoModelForSequenceClassification
    dtype = torch.bfloat16 if frozen and device.type == "cuda" else torch.float32
    try:
        model, info = auto.from_pretrained(name, dtype=dtype, trust_remote_code=trust_remote_code,
                                           output_loading_info=True)
    except (OSError, ValueError, RuntimeError, SafetensorError) as e:
        raise UserError(f"model {name!r} could not be loaded as {auto.__name__}: "
                        f"{_first_line(e)} (re-download or rebuild it)") from None
    if kind == "rm" and any(k.startswith("score.") for k in info["missing_keys"]):
        raise UserError(f"reward model {name!r} has no trained score head in its checkpoint: "
                        "it would score with random weights")
    model = model.to(device).eval()  # eval(): dropout off; it makes log-probs noisy, KL > 0 at 0
    if kind == "lm":  # rows the tokenizer cannot decode are never sampled: see suppressed()
        _suppress_untokenized_rows(model, name, trust_remote_code)
    if frozen:
        model.requires_grad_(False)
    if compile:  # dynamic shapes: new batch sizes and lengths reuse the compiled graphs
        # policy and reference share HF's forward code, whose graphs dynamo counts together
        torch._dynamo.config.recompile_limit = 32  # (the default 8 would fall back to eager)
        model.forward = torch.compile(model.forward, dynamic=True)
    return model


def _suppress_untokenized_rows(model, name, trust_remote_code):
    try:
        n_tokens = len(AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code))
    except (OSError, ValueError):
        return  # no tokenizer in this folder: nothing to compare with
    rows = model.config.get_text_config().vocab_size  # the LM head's outputs, V
    if rows > n_tokens:
        gen = model.generation_config
        gen.suppress_tokens = sorted({*(gen.suppress_tokens or []), *range(n_tokens, rows)})


def enable_gradient_checkpointing(model):
    """Recompute each layer's activations in backward instead of keeping them. HF recomputes a layer
    only when it is in training mode; the model stays in eval mode (dropout off), so only the
    checkpointed layers are flagged as training: their dropouts (children) stay off, and so does the
    base model (GPT-2's would stop passing the KV cache to its layers, even when sampling)."""
    enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.24
    (enable or model.gradient_checkpointing_enable)()
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer):
            m.training = True


def load_policy(args, device, checkpoint=""):
    """The trained policy and its tokenizer: args.model (a hub id or a folder), or a run's
    checkpoint folder to resume from. Fully trained: fp32 weights. With args.lora_r > 0 the base
    is frozen (bf16 on a GPU) and only LoRA adapters (Hu et al. 2021) train, in fp32."""
    tok = load_tokenizer(checkpoint or args.model, args.trust_remote_code)
    src = args.model if args.lora_r else checkpoint or args.model  # LoRA saves only adapters
    model = load_model(src, "lm", device, frozen=args.lora_r > 0,
                       trust_remote_code=args.trust_remote_code, compile=args.compile)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if args.lora_r:
        model = add_lora(model, args, checkpoint)
    return model, tok


def add_lora(model, args, adapter="", task="CAUSAL_LM"):
    """Wrap a frozen model with trainable LoRA adapters (peft), new or from a saved adapter folder.
    Adapters start with B = 0, so the model starts exactly as the base. task "SEQ_CLS" (a reward
    model): peft also trains and saves the score head in full."""
    try:
        import peft
    except ImportError:
        raise UserError("--lora_r needs the optional package peft (pip install peft)") from None
    if getattr(args, "gradient_checkpointing", False):
        model.enable_input_require_grads()  # checkpointed blocks need an input that wants grads
    if adapter:
        with warnings.catch_warnings():  # peft asks for a name transformers deprecated
            warnings.simplefilter("ignore", FutureWarning)
            return peft.PeftModel.from_pretrained(model, adapter, is_trainable=True)
    targets = args.lora_target_modules
    names = [n for n, _ in model.named_modules()]  # peft matches a name or its dotted ending
    bad = [t for t in targets.split(",") if targets != "all-linear"
           and not any(n == t or n.endswith("." + t) for n in names)]
    if bad:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                         if isinstance(m, torch.nn.Linear)})
        raise UserError(f"--lora_target_modules: the model has no module {', '.join(bad)} "
                        f"(its linear layers: {', '.join(linear)}; or all-linear)")
    width = getattr(model.config, "hidden_size", None)
    if width and args.lora_r > width:  # rank r of B A (width x r, r x width) is at most width
        raise UserError(f"--lora_r {args.lora_r} is above the model's width {width}: a rank "
                        "beyond it adds memory and nothing else")
    config = peft.LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, task_type=task,
                             lora_dropout=args.lora_dropout,
                             target_modules=targets.split(",") if "," in targets else targets)
    with warnings.catch_warnings():  # peft asks for a name transformers deprecated: not ours
        warnings.simplefilter("ignore", FutureWarning)
        return peft.get_peft_model(model, config)


def adapters_off(model):
    """Context in which a LoRA policy computes as its frozen base: the reference model for free.
    For any other model, nothing changes."""
    if hasattr(model, "disable_adapter"):
        return model.disable_adapter()
    return contextlib.nullcontext()


def load_reward_model(args, device):
    model = load_model(args.reward_model, "rm", device, True, args.trust_remote_code)
    return model, load_tokenizer(args.reward_model, args.trust_remote_code)


def check_prompts(tok, model, rows, args):
    """Fail early when a prompt plus max_new_tokens does not fit the model's context."""
    limit = getattr(model.config, "max_position_embeddings", None)
    if not limit:
        return
    lens = [len(s) for s in encode_prompts(tok, [r["prompt"] for r in rows], args.chat_template)]
    too_long = sum(n + args.max_new_tokens > limit for n in lens)
    if too_long:
        raise UserError(f"{too_long} of {len(lens)} prompts are too long: prompt + max_new_tokens "
                        f"({args.max_new_tokens}) exceeds the model's context of {limit} tokens "
                        f"(longest prompt: {max(lens)} tokens)")


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


def prefill_shared(model, prompt_ids, pad_id, device):
    """Fast path of sample()'s prefill: each distinct prompt runs once and its KV cache is copied to
    every row that asks for it (a GRPO group of G rows shares one prefill; HF's generate runs G).
    Returns the same (last logits, cache, ids, mask) as the plain prefill."""
    keys = [tuple(p) for p in prompt_ids]
    distinct = {p: i for i, p in enumerate(dict.fromkeys(keys))}
    row_of = torch.tensor([distinct[k] for k in keys], device=device)  # row -> its prompt
    ids, mask = left_pad(list(distinct), pad_id, device)
    cache = DynamicCache()
    logits = _forward(model, ids, mask, positions(mask), cache, keep=1).logits[:, -1][row_of]
    cache.batch_select_indices(row_of)
    for layer in cache.layers:  # laid out as after a decode step: one compiled decode graph
        layer.keys, layer.values = layer.keys.contiguous(), layer.values.contiguous()
    return logits, cache, ids[row_of], mask[row_of]


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
            logits, cache, ids, prompt_mask = prefill_shared(model, prompt_ids, tok.pad_token_id,
                                                             device)
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


# ------------------------------------------------------------------------------ log-probs, KL
def token_logprobs(model, ids, attention_mask, T, temperature=1.0, entropy=False, fast=True):
    """log pi(token_t | tokens before t) for the last T positions of ids (B, P+T): (B, T), with
    gradients. entropy: also each position's entropy (B, T), or None; with gradients when they are
    on (PPO's bonus); a caller that only logs it detaches it at once, which drops its graph and
    costs nothing in backward. Ids the model never samples (suppressed()) get probability 0 here
    too, so these log-probs are those of the distribution the sampler draws from.
    fast=True takes fast_token_logprobs(): the same numbers with less compute and memory.
    The plain computation, as a student would write it:"""
    if fast:
        return fast_token_logprobs(model, ids, attention_mask, T, temperature, entropy)
    logits = _forward(model, ids, attention_mask, positions(attention_mask)).logits  # (B, P+T, V)
    logits = logits[:, -T - 1:-1]  # position t predicts token t + 1: shift by one
    z = logits.float() / temperature  # fp32, at the sampling temperature
    logp = masked_logits(z, suppressed(model, z.shape[-1], z.device)).log_softmax(-1)
    lp = logp.gather(-1, ids[:, -T:, None])[..., 0]  # (B, T): the log-prob of each taken token
    return lp, -(logp.exp() * logp).sum(-1) if entropy else None


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
    pos = positions(attention_mask)
    head = _lm_head(model)  # None: fall back to logits from the model's forward
    prompts, row_of = torch.unique(torch.cat([ids[:, :P], attention_mask[:, :P]], 1), dim=0,
                                   return_inverse=True)
    saves = len(prompts) * P + B * Tb <= 0.75 * B * (P + Tb)
    # (checkpointed layers drop the KV cache; FSDP2 wants one forward per backward)
    if P > 1 and saves and not torch.distributed.is_initialized() and not any(
            isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing
            for m in model.modules()):
        cache, p_mask = DynamicCache(), prompts[:, P:2 * P - 1]
        _forward(model, prompts[:, :P - 1], p_mask, positions(p_mask), cache, keep=1)
        cache.batch_select_indices(row_of)  # every prompt but its last token, once per prompt
        # each row feeds its last prompt token and completion tokens 0..Tb-2: they predict 0..Tb-1
        out = _forward(model, ids[:, P - 1:-1], attention_mask[:, :-1], pos[:, P - 1:-1], cache,
                       keep=0 if head is None else 1, hidden=head is not None)
        x = out.hidden_states[-1] if head is not None else out.logits  # (B, Tb, H), or (B, Tb, V)
    else:
        out = _forward(model, ids, attention_mask, pos, keep=Tb + 1 if head is None else 1,
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
    never = suppressed(model, V, ids.device)
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
    logp = masked_logits(logits.float() / temperature, never).log_softmax(-1)
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
            logp = masked_logits(logits.float() / temperature, never).log_softmax(-1)
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
    hf = _unwrap(model)
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
    cls = type(_unwrap(model))
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


def masked_mean(x, mask, dim=None):
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


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


def load_reward_fns(specs):
    """Your own rewards: --reward_fn path/to/file.py:name (or package.module:name), repeatable or
    comma-separated -> {name: function}. A function scores the whole batch at once (so it can
    batch a verifier or a judge model): f(completions: list[str], rows: list[dict]) -> list of
    floats, where rows carry every field of the data rows."""
    fns = {}
    for spec in (s for item in specs for s in item.split(",") if s):
        where, _, name = spec.rpartition(":")
        if not where or not name:
            raise UserError(f"--reward_fn {spec!r}: write path/to/file.py:function")
        if where.endswith(".py") and not os.path.isfile(where):
            raise UserError(f"--reward_fn {spec!r}: file {where!r} not found")
        try:
            if where.endswith(".py"):
                found = importlib.util.spec_from_file_location(f"reward_{name}", where)
                module = importlib.util.module_from_spec(found)
                found.loader.exec_module(module)
            else:
                module = importlib.import_module(where)
        except Exception as e:
            raise UserError(f"--reward_fn {spec!r}: importing {where!r} failed: "
                            f"{type(e).__name__}: {_first_line(e)}") from None
        if not callable(getattr(module, name, None)):
            raise UserError(f"--reward_fn {spec!r}: {where!r} has no function {name!r}")
        if name in RULES or name == "rm":
            raise UserError(f"--reward_fn {spec!r}: {name!r} is a built-in reward; rename it")
        fns[name] = getattr(module, name)
    return fns


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


def parse_rewards(spec, reward_model, fns=(), default="math"):
    """'math=1,format=0.1' -> {'math': 1.0, 'format': 0.1}; 'rm' names the reward model's score;
    names of --reward_fn functions count too. '' = your functions (weight 1 each) or default."""
    weights = {}
    for part in filter(None, (spec or ",".join(fns) or default).split(",")):
        name, _, w = part.partition("=")
        if name not in RULES and name != "rm" and name not in fns:
            known = ", ".join([*RULES, "rm", *fns])
            raise UserError(f"--rewards: unknown reward {name!r} (known: {known})")
        try:
            weights[name] = float(w or 1.0)
        except ValueError:
            raise UserError(f"--rewards: the weight of {name!r} must be a number, not {w!r}") \
                from None
        if not math.isfinite(weights[name]):  # every reward would be NaN: nothing would train
            raise UserError(f"--rewards: the weight of {name!r} must be finite, not {w}")
    if "rm" in weights and not reward_model:
        raise UserError("--rewards names 'rm' but no --reward_model is given")
    return weights


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
    weights: the run's reward weights (default: parsed from args.rewards). env: multi-turn
    rollouts with that environment (see rollout)."""
    if not rows:  # e.g. a data file too small to hold rows out: no score rather than a made-up 0
        return {"eval": float("nan")}
    accuracy = eval_metric(rows, getattr(args, "eval_reward", "auto")) == "accuracy"
    weights = weights or parse_rewards(args.rewards, args.reward_model, fns or {})
    k = getattr(args, "eval_samples", 0)
    scores = {"eval": [], "sampled": []}
    for i in range(0, len(rows), batch_size):
        chunk = rows[i:i + batch_size]
        for key, reps in (("eval", 1), ("sampled", k)):
            batch = [r for r in chunk for _ in range(reps)]  # reps contiguous rows per prompt
            if not batch:
                continue
            prompt_ids = encode_prompts(tok, [r["prompt"] for r in batch], args.chat_template)
            if env is not None:  # multi-turn (--env): rewards read each row's final turn
                roll = rollout(model, tok, prompt_ids, env, batch, args.max_turns,
                               args.max_new_tokens, args.temperature, args.top_p,
                               greedy=key == "eval", amp=amp, stop=args.stop)
            elif key == "eval":
                roll = sample(model, tok, prompt_ids, args.max_new_tokens, greedy=True, amp=amp,
                              stop=args.stop)
            else:  # at the training temperature
                roll = sample(model, tok, prompt_ids, args.max_new_tokens, args.temperature,
                              args.top_p, amp=amp, stop=args.stop)
            texts = roll.final if env is not None else decode_completions(tok, roll)
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
