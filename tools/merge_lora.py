"""Merge a LoRA run's adapters into its base model: a full checkpoint that from_pretrained loads.

    python tools/merge_lora.py runs/grpo-20261201-120000            # writes .../checkpoint-merged/
    python tools/merge_lora.py runs/grpo-20261201-120000 --out merged/

A LoRA run's checkpoint/ holds only the adapters (a few MB; reward_model.py's also its score
head): loading it needs the base model named in checkpoint/args.json and the optional package
peft. The merged folder needs neither: a reward_model.py run's goes to ppo.py --reward_model.
"""
import argparse
import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import common as C  # noqa: E402
import loading
from transformers import AutoModelForSequenceClassification  # noqa: E402


def merge(run_dir, out=""):
    ckpt = os.path.join(run_dir, "checkpoint")
    if not os.path.isfile(os.path.join(ckpt, "args.json")):
        raise C.UserError(f"{run_dir}: no checkpoint/args.json there; is it a run folder?")
    out = out or os.path.join(run_dir, "checkpoint-merged")
    if os.path.exists(out) and not os.path.isdir(out):  # save_pretrained would only log this
        raise C.UserError(f"--out {out}: that is a file; give a folder to write the model into")
    with open(os.path.join(ckpt, "args.json")) as f:
        saved = json.load(f)
    args = saved["args"]
    if not args.get("lora_r"):
        raise C.UserError(f"{run_dir} is not a LoRA run: its checkpoint/ is a full model already")
    try:
        import peft
    except ImportError:
        raise C.UserError("merging LoRA adapters needs peft (pip install peft)") from None
    tok = loading.load_tokenizer(ckpt)
    if saved["algo"] == "reward_model":  # the base with a head; the trained head comes from ckpt
        base = AutoModelForSequenceClassification.from_pretrained(
            args["model"], num_labels=1, trust_remote_code=args["trust_remote_code"])
        base.config.pad_token_id = tok.pad_token_id
    else:
        base = loading.load_model(args["model"], "lm", C.torch.device("cpu"),
                            trust_remote_code=args["trust_remote_code"])
    with warnings.catch_warnings():  # peft reads transformers' deprecated is_gradient_...
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        merged = peft.PeftModel.from_pretrained(base, ckpt).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    print(f"merged {ckpt} into {args['model']} -> {out}")
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="the output folder of a run made with --lora_r")
    parser.add_argument("--out", default="",
                        help="where to write (default RUN_DIR/checkpoint-merged)")
    cli = parser.parse_args()
    try:
        merge(cli.run_dir, cli.out)
    except C.UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
