"""loading.py: models, tokenizers, LoRA and your reward functions (plumbing: a reader may skip it).

Any AutoModelForCausalLM (policy, reference) and AutoModelForSequenceClassification (reward model)
from a hub id or a local folder, with one-line errors for what cannot load; trained weights in
fp32, frozen ones in bf16 on a GPU, dropout off everywhere; LoRA adapters (optional package peft);
`--reward_fn file.py:function` and the `--rewards` weights.
"""
import contextlib
import difflib
import functools
import importlib
import importlib.util
import math
import numbers
import os
import pickle
import re
import warnings

from jinja2 import TemplateError
import torch
from safetensors import SafetensorError
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoTokenizer)
from transformers.modeling_layers import GradientCheckpointingLayer

import common as C
from plumbing.errors import UserError, first_line
from plumbing import tasks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
DEFAULT_POLICY = os.path.join(ROOT, "models", "tiny-adder")  # bundled: tools/build_models.py
DEFAULT_REWARD_MODEL = os.path.join(ROOT, "models", "tiny-adder-rm")


# --------------------------------------------------------------------------------------- loading
def pick_device():
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def autocast(device, dtype):
    """Trained weights stay fp32 (in bf16, lr ~1e-6 updates round away); forwards run in bf16."""
    on = dtype == "bf16" or (dtype == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=on)


def _check_source(name):
    """A name that is not a folder here goes to the hub only if it reads as a hub id (owner/name)
    and not as a path: ./x, /x, ~/x, a\\b, or dir/x where dir is a folder here (a mistyped
    local model would cost a minute of hub retries offline before its error)."""
    if os.path.isdir(name):
        return
    if name.lower().endswith(".gguf"):  # llama.cpp's one-file format, which from_pretrained reads
        raise UserError(f"model {name!r} is a GGUF file; give a model folder or hub id: convert"
                        " it as tools/smollm2.py does (python tools/smollm2.py for SmolLM2-135M-"
                        "Instruct; others: from_pretrained(folder, gguf_file=name), then "
                        "save_pretrained)")
    head = name.split("/")[0]
    path_like = (name.startswith((".", "/", "~")) or "\\" in name
                 or "/" in name and os.path.isdir(head))
    if path_like or not re.fullmatch(r"[\w-][\w.-]*(/[\w.-]+)?", name):
        near = os.path.dirname(os.path.expanduser(name)) or "."
        close = difflib.get_close_matches(os.path.basename(name), os.listdir(near)
                                          if os.path.isdir(near) else [], 1, 0.6)
        hint = f" (did you mean {os.path.join(os.path.dirname(name), close[0])}?)" if close else ""
        raise UserError(f"model {name!r}: no such local folder{hint}, and not a hub id like "
                        "owner/name")


def load_tokenizer(name, trust_remote_code=False):
    _check_source(name)
    try:
        tok = AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)
        if len(tok) <= len(tok.all_special_tokens):  # transformers 5 builds one from no files
            raise ValueError("Couldn't instantiate the backend tokenizer")
    except (OSError, ValueError) as e:
        why = ("it has no tokenizer files: save them beside the model (tokenizer.save_pretrained)"
               if "backend tokenizer" in str(e) else first_line(e))
        raise UserError(f"tokenizer {name!r} could not be loaded: {why}") from None
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
        raise UserError(f"model {name!r} could not be loaded: {first_line(e)}") from None
    archs = cfg.architectures or []
    is_lm = any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in archs)
    if kind == "lm" and archs and not is_lm:
        raise UserError(f"model {name!r} has no causal-LM head (architectures: "
                        f"{', '.join(archs)})")
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
    except (OSError, ValueError, RuntimeError, SafetensorError, pickle.UnpicklingError) as e:
        found = re.search(r"GLOBAL (\S+)", str(e))  # a .bin file's pickle holds other objects
        why = (f"{first_line(e)} (re-download or rebuild it)" if not found else
               f"its weights file holds {found[1]}: unpickling it could run code, so it is refused")
        raise UserError(f"model {name!r} could not be loaded as {auto.__name__}: {why}") from None
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


def load_policy(args, device, checkpoint="", rows=(), env=None):
    """The trained policy and its tokenizer: args.model (a hub id or a folder), or a run's
    checkpoint folder to resume from. Fully trained: fp32 weights. With args.lora_r > 0 the base
    is frozen (bf16 on a GPU) and only LoRA adapters (Hu et al. 2021) train, in fp32. Before the
    weights load (a minute for a big model), what needs only the tokenizer and the config is
    checked: env's chat template (--tools) and that rows' prompts fit the context."""
    tok = load_tokenizer(checkpoint or args.model, args.trust_remote_code)
    src = args.model if args.lora_r else checkpoint or args.model  # LoRA saves only adapters
    if env is not None:
        env.check(tok)
    if rows:
        config = AutoConfig.from_pretrained(src, trust_remote_code=args.trust_remote_code)
        check_prompts(tok, config, rows, args, env.tools if env else None)
    model = load_model(src, "lm", device, frozen=args.lora_r > 0,
                       trust_remote_code=args.trust_remote_code, compile=args.compile)
    if args.gradient_checkpointing:
        enable_gradient_checkpointing(model)
    if args.lora_r:
        model = add_lora(model, args, checkpoint)
    head = C._unwrap(model).get_output_embeddings()
    if getattr(args, "fsdp", False):  # runs.wrap_model shards it: fastpath.exact_head says no
        print("--fsdp shards the LM head's weight: log-probs make the full logits (more memory)")
    if args.lora_r and type(head) is not torch.nn.Linear:  # peft wrapped it: a new module
        print("LoRA on the LM head: log-probs make the full logits (more memory)")
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


def load_reward_model(args, device):
    """--reward_model as the reward 'rm', a function like your --reward_fn ones: f(completions,
    rows) -> (B,), the model's score of each prompt + completion (common.rm_scores)."""
    model = load_model(args.reward_model, "rm", device, True, args.trust_remote_code)
    tok = load_tokenizer(args.reward_model, args.trust_remote_code)

    def rm(completions, rows):  # its own chat template may refuse them: one line, not a traceback
        with template_errors(tok, "--reward_model: "):
            return C.rm_scores(model, tok, [r["prompt"] for r in rows], completions).cpu()
    return rm


def check_default_reward_model(args, used):
    """ppo.py's default --reward_model is the bundled tiny-adder-rm, which reads the bundled
    model's characters: a policy with another tokenizer (a real model) is refused in one line
    rather than trained against it. used: the run would score with it, or start its critic
    from it."""
    if not used or args.reward_model != DEFAULT_REWARD_MODEL:
        return
    policy = load_tokenizer(args.model, args.trust_remote_code)
    if policy.get_vocab() != load_tokenizer(DEFAULT_REWARD_MODEL).get_vocab():
        raise UserError(f"--model {args.model} has its own tokenizer, and the default "
                        "--reward_model is the bundled tiny-adder-rm, trained on the bundled "
                        "model's sums: pass --reward_model PATH (reward_model.py makes one), or "
                        "--rewards math --critic_init policy for the rule reward")


def check_prompts(tok, config, rows, args, tools=None):
    """Fail early when a prompt plus max_new_tokens does not fit the model's context (tools: the
    --tools schemas the template shows in every prompt, counted too), or when the chat template
    refuses the prompts (template_errors). config: the model's, or AutoConfig's (load_policy: the
    weights not loaded yet)."""
    limit = getattr(config, "max_position_embeddings", None)
    # a token stands for at most `longest` characters (its text in the vocabulary: byte-level
    # BPE's is its bytes), so a prompt of more characters than longest * (limit - max_new_tokens)
    # cannot fit: refused before it is tokenized (a 20 MB row took 90 s and 4 GB to tokenize)
    longest = max(map(len, tok.get_vocab()))
    chars = max(len(C.as_text(r["prompt"])) for r in rows)
    if limit and chars > longest * (limit - args.max_new_tokens):
        raise UserError(f"a prompt of {chars:,} characters is too long: prompt + max_new_tokens "
                        f"({args.max_new_tokens}) exceeds the model's context of {limit} "
                        f"tokens (one token is {longest} characters at most)")
    hint = " (--system_prompt puts a system message first)" if getattr(
        args, "system_prompt", "") else ""
    with template_errors(tok, suffix=hint):
        prompt_ids = C.encode_prompts(tok, [r["prompt"] for r in rows], args.chat_template, tools)
    if not limit:
        return
    lens = [len(s) for s in prompt_ids]
    too_long = sum(n + args.max_new_tokens > limit for n in lens)
    if too_long:
        raise UserError(f"{too_long} of {len(lens)} prompts are too long: prompt + "
                        f"max_new_tokens ({args.max_new_tokens}) exceeds the model's context of "
                        f"{limit} tokens (longest prompt: {max(lens)} tokens"
                        f"{', the tools shown in it included' if tools else ''})")


@contextlib.contextmanager
def template_errors(tok, prefix="", suffix=""):
    """A chat template that refuses what it is given (its raise_exception: Gemma's 'System role
    not supported', roles that must alternate, a template without tools) is one line naming the
    template and its message, not a traceback. prefix, suffix: what the line adds."""
    try:
        yield
    except TemplateError as e:
        raise UserError(f"{prefix}the chat template of {tok.name_or_path!r} refuses the "
                        f"conversation: {first_line(e)[:200]}{suffix}") from None


def load_function(flag, spec, usage, several=False):
    """The function that `flag` names as path/to/file.py:function or package.module:function
    (--reward_fn, --env), imported; several (--tools): FILE.py:a,b -> a list of functions, the
    file imported once (they share its module state). Every error is one line: `usage` says how
    to write it. The file is code you choose to run, like any script."""
    where, _, names = spec.rpartition(":")
    if not where or not names:
        raise UserError(f"{flag} {spec!r}: {usage}")
    if where.endswith(".py") and not os.path.isfile(where):
        raise UserError(f"{flag} {spec!r}: file {where!r} not found")
    names = [n.strip() for n in names.split(",")] if several else [names]
    try:
        if where.endswith(".py"):
            found = importlib.util.spec_from_file_location(f"{flag[2:]}_{names[0]}", where)
            module = importlib.util.module_from_spec(found)
            found.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
    except Exception as e:
        raise UserError(f"{flag} {spec!r}: importing {where!r} failed: "
                        f"{type(e).__name__}: {first_line(e)}") from None
    except SystemExit as e:  # it would end the run with its code (0: as if all went well)
        raise UserError(f"{flag} {spec!r}: importing {where!r} called sys.exit({e.code!r}): "
                        "the file is imported, not run (put its script part under "
                        "if __name__ == '__main__':)") from None
    for name in names:
        if not callable(getattr(module, name, None)):
            raise UserError(f"{flag} {spec!r}: {where!r} has no function {name!r}")
    return [getattr(module, name) for name in names] if several else getattr(module, names[0])


def load_reward_fns(specs):
    """Your own rewards: --reward_fn path/to/file.py:name (or package.module:name), repeatable or
    comma-separated -> {name: function}. A function scores the whole batch at once (so it can
    batch a verifier or a judge model): f(completions: list[str], rows: list[dict]) -> list of
    floats, where rows carry every field of the data rows. Each comes back checked
    (checked_reward): called as fns[name](completions, rows) -> a tensor (B,)."""
    fns = {}
    for spec in (s for item in specs for s in item.split(",") if s):
        fn = load_function("--reward_fn", spec, "write path/to/file.py:function")
        name = spec.rpartition(":")[2]
        if name in C.RULES or name == "rm" or name in tasks.REWARDS:
            raise UserError(f"--reward_fn {spec!r}: {name!r} is a built-in reward; rename it")
        fns[name] = functools.partial(checked_reward, name, fn)
    return fns


def checked_reward(name, fn, completions, rows):
    """Your reward on the batch, checked: one number per completion, (B,). NaN/inf pass through:
    the training step is then skipped. An error names the first row that fails alone."""
    try:
        values = fn(completions, rows)
        kind = type(values).__name__  # a list, a tuple, a generator, a tensor: one number each
        if not isinstance(values, (str, bytes, dict)) and hasattr(values, "__iter__"):
            values = list(values)  # (a str would be one value per character)
    except (Exception, SystemExit, KeyboardInterrupt) as e:  # sys.exit() in it: one line too
        what = f"reward {name!r} raised {type(e).__name__}: {first_line(e)}"
        for i in range(len(rows)) if isinstance(e, Exception) else ():  # which row? each alone
            try:
                fn(completions[i:i + 1], rows[i:i + 1])
            except Exception:
                prompt = C.as_text(rows[i]["prompt"])[:40]
                raise UserError(f"{what} (first on row {i}, prompt {prompt!r})") from None
        raise UserError(what) from None
    if not isinstance(values, list):
        raise UserError(f"reward {name!r} returned a {kind}, not a list of numbers: return one "
                        "number per completion")
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
        if name not in C.RULES and name != "rm" and name not in fns and name not in tasks.REWARDS:
            known = ", ".join([*C.RULES, "rm", *tasks.REWARDS, *fns])
            raise UserError(f"--rewards: unknown reward {name!r} (known: {known})")
        if name in weights:  # math=1,math=2: one would silently win
            raise UserError(f"--rewards names {name!r} twice: give each reward one weight")
        try:
            weights[name] = float(w or 1.0)
        except ValueError:
            raise UserError(f"--rewards: the weight of {name!r} must be a number, not {w!r}") \
                from None
        if not math.isfinite(weights[name]) or not weights[name]:  # NaN: nothing would train
            raise UserError(f"--rewards: the weight of {name!r} must be finite and not 0 (a "
                            f"reward that counts for nothing: leave it out), not {w}")
    if "rm" in weights and not reward_model:
        raise UserError("--rewards names 'rm' but no --reward_model is given")
    for name in (n for n in fns if n not in weights):  # imported, and never called
        raise UserError(f"--reward_fn {name!r} is loaded but --rewards {spec!r} does not use "
                        f"it: add {name}=W to --rewards, or drop that --reward_fn")
    for name in (n for n in weights if n in tasks.REWARDS):  # rg, random: the scripts' fns
        fns[name] = tasks.REWARDS[name]
    return weights
