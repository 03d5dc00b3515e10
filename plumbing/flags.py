"""flags.py: the command line every script shares (plumbing: an algorithm reader can skip it).
parse_args reads a script's Args dataclass (each flag's --help is the comment beside its field;
--resume DIR takes that run's own settings), arg() declares a field's valid range beside it, and
check_args checks every field against its range and the flags against each other, before a run
folder is made. Every error is one line naming the flag."""
import argparse
import dataclasses
import difflib
import inspect
import json
import math
import operator
import os
import re
import sys
import textwrap
import types
from dataclasses import field

from transformers import HfArgumentParser

from plumbing.errors import UserError, first_line
from plumbing import calc, chat_sums, rg, vllm_sampler

SAFE_TO_CHANGE_ON_RESUME = ("max_steps", "eval_every", "save_every", "resume", "output_dir",
                            "threads", "report_to", "save_optimizer")
# from the command line only, never from a run folder: a folder someone gave you whose args.json
# says true (and whose checkpoint config names code, an auto_map) would run that code on --resume
COMMAND_LINE_ONLY = ("trust_remote_code",)


def no_checkpoint(folder):
    """What to do with a run folder that logged steps but was stopped before its first save."""
    return (f"{folder!r} holds a run stopped before its first checkpoint (metrics.jsonl, no "
            "checkpoint/; --save_every sets how often one is saved): there is nothing to "
            f"--resume, so start again with another --output_dir (or remove {folder})")


def check_maxrl(weights, flag, overlong_penalty=0.0):
    """MaxRL (arXiv 2602.02710) divides by each group's mean reward, read as a success rate: a
    reward that can be negative (length, a reward model's score, a negative weight, DAPO's
    overlong penalty) is refused. Your own functions' rewards < 0 meet the guard instead: A = 0
    in a group whose mean is <= 0 (as the reference implementations)."""
    signed = [n for n, w in weights.items() if n in ("length", "rm") or w < 0]
    if signed or overlong_penalty:
        what = f"--rewards {','.join(signed)}" if signed else "--overlong_penalty"
        raise UserError(f"{flag} (MaxRL) divides by each group's mean reward, a success rate; "
                        f"{what} makes rewards negative, where its advantages would flip sign: "
                        "give rewards in [0, 1], or another baseline")


def _saved_args(resume_dir, algo):
    """The settings of the run in resume_dir, from its checkpoint's args.json."""
    ckpt = os.path.join(resume_dir, "checkpoint")
    if not os.path.isdir(ckpt) and os.path.isdir(ckpt + ".old"):
        os.replace(ckpt + ".old", ckpt)  # killed between save_checkpoint's two renames
    path = os.path.join(ckpt, "args.json")
    if not os.path.isfile(path) and os.path.isfile(os.path.join(resume_dir, "metrics.jsonl")):
        raise UserError(f"--resume: {no_checkpoint(resume_dir)}")
    if not os.path.isfile(path):
        raise UserError(f"--resume {resume_dir!r}: no checkpoint/args.json in that folder")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is damaged ({first_line(e)}); cannot resume") from None
    if saved["algo"] != algo:
        raise UserError(f"--resume {resume_dir!r}: that run was made by {saved['algo']}.py; "
                        "resume it with that script")
    return saved["args"]


# --help's order of Args' sections, by the start of their titles, whatever order Args declares
# them in: a reader of grpo.py, reinforce.py or ppo.py meets the objective first, a user of --help
# the model and data. A section not named here stays after the one before it (distill's teacher).
HELP_ORDER = ("model and data", "the teacher", "sampling", "tool use", "rewards",
              "the GRPO objective", "the REINFORCE objective", "the PPO update",
              "objectives since DAPO", "the sampler/trainer", "optimisation", "run")


def help_text(args_cls, algo, doc):
    """--help: the docstring's first paragraph, then each flag once, under the section comment of
    Args it sits in (`# --- sampling`; sections in HELP_ORDER), with the comment beside it, its
    default and valid range; then the docstring's commands (from "Run:")."""
    fields = {f.name: f for f in dataclasses.fields(args_cls)}
    out = [f"usage: python {algo}.py [--flag VALUE ...]", "", doc.split("\n\n")[0]]
    if algo in REAL_MODEL_ALGO:  # the defaults below are the bundled model's
        out += ["", "The defaults shown are the bundled tiny model's; a pretrained --model "
                "takes plumbing/flags.py's", "REAL_MODEL instead (printed at the start; "
                "docs/real_model.md)."]
    sections = [[0, []]]  # [rank in HELP_ORDER, lines], in the order Args declares them
    for line in inspect.getsource(args_cls).splitlines():
        title = re.match(r"    # --- (.+)", line)
        flag = re.match(r"    (\w+): .*?(?:  # (.+))?$", line)
        if title:
            rank = [i for i, t in enumerate(HELP_ORDER) if title[1].startswith(t)]
            sections.append([rank[0] if rank else sections[-1][0], ["", title[1] + ":"]])
        if not flag or flag[1] not in fields:
            continue
        f = fields[flag[1]]
        default = f.default_factory() if f.default is dataclasses.MISSING else f.default
        if f.type is bool:  # --flag alone turns it on, --no_flag off
            value, shown = "", "on; --no_" + f.name + " turns it off" if default else "off"
        else:
            kind = f.type
            if isinstance(kind, types.UnionType):  # float | None: a float, off when not given
                kind = next(t for t in kind.__args__ if t is not type(None))
            choices = getattr(kind, "__args__", None)  # a Literal's choices, or list[str]
            value = {int: "N", float: "X", str: "TEXT"}.get(kind) or (
                "TEXT [TEXT ...]" if kind.__origin__ is list else "{%s}" % ",".join(choices))
            shown = repr(default) if default in ("", []) else default
            if isinstance(default, str) and os.path.isabs(default):  # the bundled model, data
                shown = min(default, os.path.relpath(default), key=len)  # from this folder
        valid = f"; valid: {f.metadata['valid']}" if "valid" in f.metadata else ""
        name = f"--{f.name} {value}".rstrip()
        lead = f"  {name:28}" if len(name) < 28 else f"  {name}\n" + " " * 30
        text = textwrap.wrap(f"{flag[2] or ''} (default: {shown}{valid})", 70,
                             break_on_hyphens=False)
        sections[-1][1].append(lead + ("\n" + " " * 30).join(text))
    out += [line for _, lines in sorted(sections, key=lambda s: s[0]) for line in lines]
    return "\n".join(out + (["", doc[doc.find("Run:"):].rstrip()] if "Run:" in doc else []))


# --model a pretrained model (not the bundled tiny ones, nor a toy under 10 M parameters): these
# defaults replace the bundled 1 M adder's; explicit flags, --data chat-sums's preset, --env calc's
# and a resumed run's settings still win. Each value, and where it comes from:
REAL_MODEL = {
    # room for a few sentences (TRL: 256, 512 in 1.16's GRPOConfig, for reasoning on a GPU): a
    # step samples until its longest row ends, so on a CPU one rambling row of 256 tokens made a
    # step of SmolLM2-135M 3-4x longer than its 18-token mean needs; a cap that cuts nearly
    # every answer is a warning at step 1 that names the value that fits (runs.warn_if_stuck)
    "max_new_tokens": 128,
    # measured on SmolLM2-135M-Instruct, chat-sums (docs/real_model.md): 1e-5 and 2e-5 reach the
    # same held-out score in 16 steps, 5e-5 overshoots (1e-4 is the 1 M adder's); TRL's 1e-6
    # (DeepSeekMath's) is for hundreds of steps on larger models
    "lr": 1e-5,
    "temperature": 0.7,  # measured there: mixed rewards within groups (TRL's PPO/RLOO used 0.7)
    "beta": 0.0,  # TRL 1.16 GRPOConfig, DAPO, Dr. GRPO: no reference model to hold and run
    # rows per forward: memory, not the gradient; 16 rows of 256 tokens peaked at 11.6 GB on
    # SmolLM2-135M (CPU, fp32), 8 fits a laptop (the README's GPU line uses 16)
    "micro_batch_size": 8,
    "eval_size": 128,  # docs/real_model.md: a standard error of 0.04 at 0.43, 128 greedy answers
}
REAL_MODEL_ALGO = {
    "grpo": {}, "reinforce": {"baseline": "rloo"},  # rewards >= 0: RLOO (Ahmadian et al. 2024)
    # no reward model for a user's task: the critic from the policy (N implementation details);
    # verl's critic lr; one epoch of 2 minibatches (OpenRLHF, verl), 32 prompts (docs/real_model.md)
    "ppo": {"critic_init": "policy", "critic_lr": 1e-5, "ppo_epochs": 1, "num_minibatches": 2,
            "batch_size": 32},
    # sft, dpo: the lr (TRL 1.16 SFTConfig's and DPOConfig's learning_rate; the DPO paper 5e-7),
    # and from above the micro-batch, the held-out size and the greedy answers' length
    "sft": {"lr": 2e-5}, "dpo": {"lr": 1e-6},
    # distill samples as the RL scripts do: their lr and temperature (its beta is jsd's, not a KL
    # weight: TRL's 1 stays)
    "distill": {"lr": REAL_MODEL["lr"], "temperature": REAL_MODEL["temperature"]},
}
RL = ("grpo", "reinforce", "ppo")  # REAL_MODEL's sampling and KL defaults: the RL scripts only
MODEL_DEFAULTS = {}  # the REAL_MODEL values this run took (summary.json: model_defaults)


def _small_model(model, limit=10_000_000):
    """True for a local folder whose config.json describes a model under `limit` parameters (the
    bundled tiny models, the tests' toys): vocab x hidden + 12 x layers x hidden^2. A hub id is
    read as a pretrained model (its config would need the network)."""
    try:
        with open(os.path.join(model, "config.json")) as f:
            cfg = json.load(f)
        cfg = cfg.get("text_config", cfg)
        h = cfg.get("hidden_size") or cfg.get("n_embd") or cfg.get("d_model")
        layers = cfg.get("num_hidden_layers") or cfg.get("n_layer")
        return cfg["vocab_size"] * h + 12 * layers * h * h < limit
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def real_model_preset(model, algo, names):
    """The flags' defaults for a pretrained --model in algo's script (REAL_MODEL), those of its
    flags (names) only; {} for the bundled models and toys."""
    if not model or _small_model(model) or algo not in REAL_MODEL_ALGO:
        return {}
    common = {k: v for k, v in REAL_MODEL.items()  # dpo's beta is another beta
              if algo in RL or k in ("micro_batch_size", "eval_size", "max_new_tokens")}
    return {k: v for k, v in {**common, **REAL_MODEL_ALGO[algo]}.items() if k in names}


PATH_FLAGS = ("model", "reward_model", "data", "eval_data", "reward_fn", "env", "tools")


def _resolved(name, value):
    """A local file or folder named by a relative path, made absolute (hub ids and missing paths
    stay as given): the run stores where its files are, so --resume finds them from any folder
    and compares like with like. reward_fn / env: path/to/file.py:function, comma lists too."""
    if name not in PATH_FLAGS or not value:
        return value
    if isinstance(value, list):
        return [_resolved(name, v) for v in value]
    if name in ("reward_fn", "env", "tools"):
        specs = [spec.rpartition(":") for spec in value.split(",")]
        return ",".join(f"{_resolved('data', w) if w.endswith('.py') else w}{colon}{fn}"
                        for w, colon, fn in specs)
    return os.path.abspath(value) if os.path.exists(value) else value


def parse_args(args_cls, algo, doc=""):
    """HfArgumentParser over the Args dataclass; --help is help_text's. With --resume DIR the
    run's saved settings are the defaults, so it continues as it was (to its own max_steps),
    COMMAND_LINE_ONLY settings aside; a flag that would change a setting other than
    SAFE_TO_CHANGE_ON_RESUME is refused, since the optimizer state and the data stream belong to
    the old settings."""
    fields = dataclasses.fields(args_cls)
    declared = [f.metadata for f in fields]  # e.g. {"valid": "> 0"}, from arg()
    for f in fields:  # HfArgumentParser hands every metadata key to argparse: none
        f.metadata = {}
    try:
        parser = HfArgumentParser(args_cls)
    finally:
        for f, metadata in zip(fields, declared):
            f.metadata = metadata
    parser.format_help = lambda: help_text(args_cls, algo, doc) + "\n"

    def error(message):  # argparse would print its usage, then the message: one line instead
        raise UserError(f"{message}; see --help")
    parser.error = error
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--resume", default="")
    pre.add_argument("--env", default="")
    pre.add_argument("--data", default="")
    pre.add_argument("--rewards", default=None)
    pre.add_argument("--model", default="")
    known = pre.parse_known_args()[0]
    resume = known.resume
    saved = _saved_args(resume, algo) if resume else {}
    # _resolved: a run saved before paths were stored absolute (relative to where it ran)
    saved = {k: _resolved(k, v) for k, v in saved.items() if k not in COMMAND_LINE_ONLY}
    names = {f.name for f in dataclasses.fields(args_cls)}
    real = {} if resume else real_model_preset(known.model, algo, names)
    parser.set_defaults(**real)  # a pretrained --model: REAL_MODEL; the presets below win
    task = chat_sums.preset(known.data, algo, names)  # --data chat-sums's own defaults; your
    if known.rewards is not None and "asked_answer" not in known.rewards:  # --rewards replace
        task.pop("reward_fn", None)  # its reward function (never blamed on a --reward_fn)
    if "env" in names:  # --env calc's (calc.preset); given flags still win
        task.update(calc.preset(known.env, algo))
    task.update(rg.preset(known.data, algo, names))  # --data rg:...'s own
    parser.set_defaults(**task)
    parser.set_defaults(**{k: v for k, v in saved.items() if k in names})
    argv = []  # argparse takes "-1e-4" for a flag: "--lr -1e-4" is read as "--lr=-1e-4"
    for a in sys.argv[1:]:
        if argv and re.fullmatch(r"--\w+", argv[-1]) and re.fullmatch(r"-(inf|[\d.][\w.+-]*)", a):
            argv[-1] += f"={a}"
        else:
            argv.append(a)
    args, unknown = parser.parse_args_into_dataclasses(argv, return_remaining_strings=True)
    for name in PATH_FLAGS:
        if hasattr(args, name):
            setattr(args, name, _resolved(name, getattr(args, name)))
    if unknown:  # e.g. a typo, or another script's flag
        flags = [f"--{n}" for n in names]
        close = difflib.get_close_matches(unknown[0].split("=")[0], flags)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise UserError(f"unknown argument {unknown[0]!r}{hint}; see --help")
    for name, old in saved.items():
        new = getattr(args, name, old)
        if name not in SAFE_TO_CHANGE_ON_RESUME and new != old:
            safe = ", ".join(SAFE_TO_CHANGE_ON_RESUME[:3])
            raise UserError(f"--{name} {new} differs from the resumed run's {old!r}: a resumed "
                            f"run keeps its settings (only {safe} may change); start a new run "
                            "to change it")
    if resume and args.output_dir not in ("", saved.get("output_dir"), resume):
        raise UserError("--resume DIR continues in DIR: leave --output_dir out")
    if resume:
        args.output_dir = resume
    given = {a[2:].split("=")[0] for a in argv if a.startswith("--")}
    if "micro_batch_size" in real and "micro_batch_size" not in given | set(task) | set(saved):
        rows = math.prod(getattr(args, n) for n in ("prompts_per_step", "group_size",
                                                    "samples_per_prompt", "batch_size")
                         if hasattr(args, n))  # the step's rows: the micro-batch divides them
        real["micro_batch_size"] = math.gcd(real["micro_batch_size"], rows)
        args.micro_batch_size = real["micro_batch_size"]
    MODEL_DEFAULTS.clear()
    MODEL_DEFAULTS.update({k: getattr(args, k) for k, v in real.items()
                           if k not in given and k not in task and k not in saved})
    if MODEL_DEFAULTS and os.environ.get("RANK", "0") == "0":
        shown = " ".join(f"--{k} {v}" for k, v in MODEL_DEFAULTS.items())
        print(f"defaults for a pretrained model (flags you give win; flags.REAL_MODEL): {shown}")
    return args


FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max


def arg(default, valid):
    """An Args field whose valid range is declared beside it, e.g. `lr: float = arg(1e-4, "> 0")`.
    valid: conditions, comma-separated ("> 0", ">= 0, <= 4 * cores"), or an interval ("(0, 1]");
    the bounds are number expressions, where `cores` is this machine's CPU count. check_args
    checks every field against its range before a run folder is made; --help shows it."""
    return field(default=default, metadata={"valid": valid})


def _bound(text):  # "4 * cores" -> 8: arithmetic on numbers, inf and cores, nothing else
    return eval(text, {"__builtins__": {}}, {"inf": math.inf, "cores": os.cpu_count() or 1})


def check_range(name, value, valid):
    """One flag against its declared range (see arg): a one-line UserError when outside it."""
    if valid[0] in "([":  # an interval: ( ) leave the bound out, [ ] take it in
        lo, hi = map(_bound, valid[1:-1].split(","))
        if not ((lo < value or valid[0] == "[" and value == lo)
                and (value < hi or valid[-1] == "]" and value == hi)):
            raise UserError(f"--{name} must be in {valid}, not {value}")
        return
    ops = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
    for condition in valid.split(","):
        op, bound = condition.split(maxsplit=1)
        limit = _bound(bound)
        if not ops[op](value, limit):
            shown = int(limit) if float(limit).is_integer() else limit
            raise UserError(f"--{name} must be {op} {shown}, not {value}")


def check_args(args):
    """Flags every script shares, and each numeric flag's range as its Args field declares it
    (see arg): a value out of range would otherwise fail deep inside a step (NaN probabilities,
    empty batches, a tokenizer thread pool that crashes), run for ever, or, worse, train to the
    end on nonsense (a negative lr or max_grad_norm flips the update)."""
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise UserError(f"--{f.name} must be a finite number, not {value}")
        if isinstance(value, float) and abs(value) > FP32_MAX:  # torch cannot pass it to a kernel
            raise UserError(f"--{f.name} {value:g} is beyond float32's largest number "
                            f"({FP32_MAX:.4g}), in which the losses are computed")
        if "valid" in f.metadata and value is not None:  # None: a switch left off
            check_range(f.name, value, f.metadata["valid"])
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun
    for name in ("prompts_per_step", "batch_size"):  # they count the whole step, all processes
        if world > 1 and getattr(args, name, 0) % world:
            raise UserError(f"--{name} {getattr(args, name)} counts the whole step: it must "
                            f"divide among the {world} processes")
    if getattr(args, "fsdp", False) and world == 1:
        raise UserError("--fsdp shards the model across torchrun's processes: launch with "
                        "torchrun --nproc_per_node N (N >= 2), or leave --fsdp out")
    if getattr(args, "fsdp", False) and args.lora_r:  # DDP replicates LoRA's few weights cheaply
        raise UserError("--fsdp with --lora_r is not supported: LoRA trains a few adapter "
                        "weights; under torchrun without --fsdp, DDP replicates them cheaply")
    if world > 1 and (getattr(args, "curriculum_up", 0) or getattr(args, "skip_uniform", 0)):
        raise UserError("--curriculum_up and --skip_uniform under torchrun are not supported yet:"
                        " each process sees its share of the rewards, so their draws would part")
    if world > 1 and getattr(args, "dynamic_sampling", False):
        raise UserError("--dynamic_sampling under torchrun is not supported yet: processes "
                        "would keep different numbers of rows")
    vllm_sampler.check(args)  # --vllm: installed, one process (one line, before any load)
    if "" in getattr(args, "stop", []):
        raise UserError("--stop: an empty stop string would end every completion at once")
    lr = max(("lr", "critic_lr"), key=lambda name: getattr(args, name, 0))  # ppo: two models
    shrink = getattr(args, lr) * getattr(args, "weight_decay", 0)  # AdamW: w <- w (1 - lr wd) ...
    if shrink >= 1:
        raise UserError(f"--weight_decay {args.weight_decay} with --{lr} {getattr(args, lr)}: "
                        f"AdamW multiplies every weight by 1 - lr * weight_decay "
                        f"({1 - shrink:.3g}) at each step, so lr * weight_decay must be < 1")
    if 0 < getattr(args, "tis_cap", 0) < 1:  # min(w, C) with C < 1 shrinks every token's weight
        raise UserError(f"--tis_cap {args.tis_cap}: the cap C on pi_old / pi_sampler (1 where "
                        "they agree) must be >= 1, or 0 (off); below 1 it scales the whole "
                        "gradient down (1e-30: none at all)")
    # a step's rows (the product of its sizes; times --max_new_tokens where it samples) as int64
    # token ids must fit in this machine's memory: 10**30 would allocate until it is killed
    sizes = [n for n in ("group_size", "samples_per_prompt", "prompts_per_step", "batch_size")
             if hasattr(args, n)] + (["max_new_tokens"] if hasattr(args, "temperature") else [])
    n = math.prod(getattr(args, name) for name in sizes)
    try:  # where the OS does not say (Windows): 1 TB
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        memory = 2**40
    if 8 * n > memory:
        raise UserError(f"--{' * --'.join(sizes)} = {n:.3g} token ids a step: {8 * n / 2**30:.3g}"
                        f" GB before any model runs, more than this machine's "
                        f"{memory / 2**30:.0f} GB; lower them")
