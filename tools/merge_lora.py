"""Merge a LoRA run's adapters into its base model: a full checkpoint that from_pretrained loads.

    python tools/merge_lora.py runs/grpo-20261201-120000            # writes .../checkpoint-merged/
    python tools/merge_lora.py runs/grpo-20261201-120000 --out merged/

A LoRA run's checkpoint/ holds only the adapters (a few MB; reward_model.py's also its score
head): loading it needs the base model named in checkpoint/args.json and the optional package
peft. The merged folder needs neither: a reward_model.py run's goes to ppo.py --reward_model.
A base model with its own code needs --trust_remote_code, given here: never read from the run.
"""
import argparse
import json
import os
import re
import shutil
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
from plumbing.errors import UserError, first_line  # noqa: E402
from plumbing import loading  # noqa: E402
from safetensors import SafetensorError  # noqa: E402
from transformers import AutoModelForSequenceClassification  # noqa: E402


# what save_pretrained writes for a model and its tokenizer: an --out holding anything else is
# not an earlier merge, and is refused rather than written over
MODEL_FILES = re.compile(r"(config|generation_config|tokenizer(_config)?|special_tokens_map|"
                         r"added_tokens|vocab|merges|chat_template)\.(json|jinja|txt)|"
                         r"model(-\d+-of-\d+)?\.safetensors(\.index\.json)?|tokenizer\.model")


def check_out(out):
    """out, without a trailing slash, if writing it replaces nothing but a model folder (an
    earlier merge): missing or empty, or holding only MODEL_FILES; so are its .tmp and .old."""
    out = os.path.normpath(out)
    for path in (out, out + ".tmp", out + ".old"):
        if os.path.exists(path) and not os.path.isdir(path):  # save_pretrained would only log it
            raise UserError(f"--out {path}: that is a file; give a folder to write the "
                            "model into")
        other = sorted(f for f in (os.listdir(path) if os.path.isdir(path) else ())
                       if not MODEL_FILES.fullmatch(f))
        if os.path.islink(path) or other:
            raise UserError(f"--out {out}: {path} holds " + (f"{', '.join(other[:3])}, "
                            if other else "a link, ") + "which a merge does not write; give "
                            "a new folder (a merge replaces only an earlier merge)")
    return out


def merge(run_dir, out="", trust_remote_code=False):
    ckpt = os.path.join(run_dir, "checkpoint")
    if not os.path.isfile(os.path.join(ckpt, "args.json")):
        raise UserError(f"{run_dir}: no checkpoint/args.json there; is it a run folder?")
    out = out or os.path.join(run_dir, "checkpoint-merged")
    real, own = os.path.realpath(out), os.path.realpath(ckpt)  # own.tmp, own.old: a save's
    if real in (os.path.realpath(run_dir), own) or real.startswith((own + os.sep, own + ".")):
        raise UserError(f"--out {out}: that is the run folder or its checkpoint, which this "
                        "reads (and --resume replaces); write elsewhere, e.g. the default")
    out = check_out(out)
    try:
        with open(os.path.join(ckpt, "args.json")) as f:
            saved = json.load(f)
        algo, args = saved["algo"], saved["args"]
        base_name, remote = args["model"], trust_remote_code  # never the run folder's say
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"{ckpt}/args.json is damaged ({type(e).__name__}: "
                        f"{first_line(e)}); is {run_dir} a run folder?") from None
    if not args.get("lora_r"):
        raise UserError(f"{run_dir} is not a LoRA run: its checkpoint/ is a full model already")
    try:
        import peft
    except ImportError:
        raise UserError("merging LoRA adapters needs peft (pip install peft)") from None
    tok = loading.load_tokenizer(ckpt)
    if algo == "reward_model":  # the base with a head; the trained head comes from ckpt
        base = AutoModelForSequenceClassification.from_pretrained(
            base_name, num_labels=1, trust_remote_code=remote)
        base.config.pad_token_id = tok.pad_token_id
    else:
        base = loading.load_model(base_name, "lm", C.torch.device("cpu"), trust_remote_code=remote)
    try:
        with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_...
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            merged = peft.PeftModel.from_pretrained(base, ckpt).merge_and_unload()
    except (OSError, ValueError, RuntimeError, KeyError, SafetensorError) as e:  # a damaged file
        raise UserError(f"{ckpt}: its LoRA adapter could not be loaded ({type(e).__name__}: "
                        f"{first_line(e)[:120]}); the run's checkpoint is damaged") from None
    tmp, old = out + ".tmp", out + ".old"  # written beside, then swapped in: never half a model
    for path in (tmp, old):  # a killed merge's (check_out: model files only)
        shutil.rmtree(path, ignore_errors=True)
    merged.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    if os.path.isdir(out):
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    print(f"merged {ckpt} into {base_name} -> {out}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the output folder of a run made with --lora_r")
    parser.add_argument("--out", default="",
                        help="where to write (default RUN_DIR/checkpoint-merged)")
    parser.add_argument("--trust_remote_code", action="store_true",
                        help="run the base model repository's own code (off: never from the run)")
    cli = parser.parse_args()
    try:
        merge(cli.run_dir, cli.out, cli.trust_remote_code)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
