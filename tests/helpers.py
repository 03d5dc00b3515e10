"""Helpers and constants that several test files share (fixtures are in conftest.py)."""
import functools
import json
import os
import random
import shutil
import socket
import subprocess
import sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM
from transformers import GPT2Config
from transformers import GPTNeoXConfig
from transformers import LlamaConfig
from transformers import LlamaForSequenceClassification
from transformers import Qwen2Config

import common as C
import engine
import fastpath
import distill
import dpo
from plumbing import envs as E
import grpo
import objectives
import ppo
import reinforce as R
import reward_model
from plumbing import runs
import sft


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repo folder

PROMPTS = ["1+2=", "37+48=", "5+999=", "0+0=", "Hello, how are you?"]
ARCHS = ["llama", "qwen2", "gpt2", "gpt_neox"]
OFF = torch.autocast("cpu", enabled=False)


def grpo_loss(logprobs, old_logprobs, advantages, mask, args, *rest, **kw):
    """The per-token loss grpo.main() computes for these Args: GRPO's own per_token_loss, or
    objectives.per_token_loss when a flag since DAPO is on (the same arguments and returns)."""
    fn = objectives.loss_for(args) or grpo.per_token_loss
    return fn(logprobs, old_logprobs, advantages, mask, args, *rest, **kw)


def tiny_config(arch, vocab=99):
    ids = dict(vocab_size=vocab, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    sizes = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=64, max_position_embeddings=64)
    return {"llama": LlamaConfig(num_key_value_heads=2, **sizes, **ids),
            "qwen2": Qwen2Config(num_key_value_heads=2, **sizes, **ids),
            "gpt2": GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64, **ids),
            "gpt_neox": GPTNeoXConfig(**sizes, **ids)}[arch]


def tiny_model(arch, seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    cfg.architectures = [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                          "gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM"}[arch]]
    return AutoModelForCausalLM.from_config(cfg).eval()


def tiny_rm(seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config("llama")
    cfg.num_labels = 1
    cfg.architectures = ["LlamaForSequenceClassification"]
    return LlamaForSequenceClassification(cfg).eval()


def _offline():
    """Where and how every test runs a script: in the repo folder, never reaching the Hub."""
    return dict(cwd=ROOT, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})


def run_script(script, *args, timeout=600):
    """`python script args` to its end: the CompletedProcess, with stdout and stderr as text."""
    return subprocess.run([sys.executable, script, *args], capture_output=True, timeout=timeout,
                          **_offline())


def run_main(monkeypatch, script, *argv, guard=False):
    """script.main() in this process (no 9 s of imports) with argv as its command line, keeping
    pytest's Ctrl-C handler. guard=True runs it through runs.main_guard as `python script.py`
    does: bad input exits 2 with one line on stderr."""
    monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", *map(str, argv)])
    monkeypatch.setattr(runs.signal, "signal", lambda *a: None)
    return runs.main_guard(script.main) if guard else script.main()


def read_metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


# ---- common.py and fastpath.py: log-probs against a plain forward
def fast_logprobs(model, ids, mask, T, temperature, entropy=False, chunk_elems=2**22):
    """token_logprobs' fast path with a chosen chunk size (fastpath.final_hidden, head_logprobs)."""
    x, targets = fastpath.final_hidden(functools.partial(C._forward, model), ids, mask, T)
    never = C.suppressed(model, model.lm_head.out_features, ids.device)  # p = 0 for these ids
    default, fastpath.CHUNK_ELEMS = fastpath.CHUNK_ELEMS, chunk_elems
    try:
        lp, ent = fastpath.head_logprobs(x, model.lm_head, targets, temperature, never, entropy)
    finally:
        fastpath.CHUNK_ELEMS = default
    pad = (0, T - targets.shape[1])
    return F.pad(lp, pad), F.pad(ent, pad) if entropy else None


# ---- real vocabularies: a BPE tokenizer, ChatML, spare embedding rows
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
EXTRA_ROWS = 37  # embedding rows with no token, as real Qwen2.5 (151,936 rows, 151,665 tokens)


def bpe_chat_tokenizer(folder):
    """A real byte-level BPE tokenizer, trained here on a few kB of text (the `tokenizers`
    library, as Qwen's and GPT-2's): ChatML special tokens, <|im_end|> the EOS, a separate pad,
    a chat template. Saved to folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    rng = random.Random(0)
    lines = [f"{a}+{b}={a + b} <answer>{a + b}</answer>" for a, b in
             ((rng.randrange(100), rng.randrange(100)) for _ in range(150))]
    lines += ["What is the sum? Think step by step, then answer.", "Be brief.",
              "The quick brown fox jumps over the lazy dog."] * 5
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(lines, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.chat_template = CHATML
    tok.save_pretrained(folder)
    return tok


# ---- your own task: data fields, reward functions, what eval measures
REWARD_FILE = '''
import sys


def exact(completions, rows):
    return [float(c.strip() == row["target"]) for c, row in zip(completions, rows)]


def shout(completions, rows):
    raise ValueError("no")


def short(completions, rows):
    return [1.0]


def words(completions, rows):
    return ["good" for _ in completions]


def text(completions, rows):
    return "abc"


def scalar(completions, rows):
    return 1.0


def quits(completions, rows):
    sys.exit(0)


def ctrl_c(completions, rows):
    raise KeyboardInterrupt


def one_row(completions, rows):
    return [1 / (row["target"] != "4") for row in rows]


def exits_later(completions, rows):  # sys.exit(0) at its second call, after step 1 is logged
    exits_later.calls = getattr(exits_later, "calls", 0) + 1
    return [0.0] * len(completions) if exits_later.calls == 1 else sys.exit(0)
'''


# ---- tool use: the multi-turn sampler (engine.sample), envs.py, --env / --tools
def rollout(model, tok, prompt_ids, env, rows, max_turns, budget, timeout=60, **kw):
    """The multi-turn sampler with a test env function env(row, turns): engine.sample with the
    env_step that envs builds (one episode per row, its checks and deadline)."""
    env_step, finish = E.start_episodes(rows, lambda row: functools.partial(env, row),
                                        "--env 'test'", timeout, tok, max_turns)
    roll = engine.sample(model, tok, prompt_ids, budget, env_step=env_step, **kw)
    finish(roll)  # the episodes' turns and observations, on the rollout
    return roll


class ScriptedModel(torch.nn.Module):
    """A stand-in causal LM that writes the turns a test gives it: its next token is
    table[(last token, its position)] (else the EOS), with logit 5 against 0 for every other
    token, so greedy sampling follows the script and each log-prob is the same number < 0."""

    def __init__(self, table, vocab, eos):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))  # a device, for the sampler
        self.table, self.vocab, self.eos = table, vocab, eos
        self.generation_config = SimpleNamespace(eos_token_id=eos, suppress_tokens=None)

    def forward(self, input_ids, attention_mask, position_ids, logits_to_keep=0,
                use_cache=False, output_hidden_states=False, past_key_values=None):
        logits = torch.zeros(len(input_ids), 1, self.vocab)
        for j, (x, p) in enumerate(zip(input_ids[:, -1].tolist(), position_ids[:, -1].tolist())):
            logits[j, 0, self.table.get((x, p), self.eos)] = 5.0
        return SimpleNamespace(logits=logits)


def scripted_model(tok, prompt_ids, completions, kinds):
    """A ScriptedModel that writes each row's model tokens (kinds 1) of its completion, after its
    prompt (not left-padded: position = index), whatever comes between them (kinds 0)."""
    table = {}
    for p, comp, kind in zip(prompt_ids, completions, kinds):
        seq = list(p) + comp
        for k, (x, m) in enumerate(zip(comp, kind)):
            key = (seq[len(p) + k - 1], len(p) + k - 1)
            if m:
                assert table.setdefault(key, x) == x, "two rows' scripts collide"
    return ScriptedModel(table, len(tok), tok.eos_token_id)


# ---- the RLHF pipeline: sft.py, reward_model.py, dpo.py
def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


# ---- command line: the scripts end to end
FAST_GRPO = ["--prompts_per_step", "2", "--group_size", "4", "--micro_batch_size", "8",
             "--eval_size", "10", "--eval_every", "0"]


# ---- reliability: planted pickles, non-finite rewards, damaged files, relative paths
def one_error_line(capsys):
    """The run's one error line: the last thing on stderr, no traceback after it."""
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("error: ")]
    assert len(errors) == 1 and err[-1] == errors[0], err[-5:]
    return errors[0]


# ---- torchrun: several processes (gloo on the CPU)
SAME_COMPLETIONS = """
import os, sys
sys.path.insert(0, os.environ["MINRL_ROOT"])
import torch
import common as C
import engine
import distill, dpo, grpo, ppo, reinforce, reward_model, sft
from plumbing import runs


def each_row_alone(real, multi_turn):  # common.sample, or engine.sample(..., N, env_step, ...)
    def sample(model, tok, prompt_ids, N, *args, **kwargs):  # each row alone, seeded
        env_step, args = (args[0], args[1:]) if multi_turn else (None, args)
        seen, pieces = {}, []                # by its prompt and its index among that prompt's rows
        for j, p in enumerate(prompt_ids):
            k = seen[tuple(p)] = seen.get(tuple(p), -1) + 1
            torch.manual_seed(hash((tuple(p), k)) % 2**31)
            step = env_step and (lambda reqs, wait, j=j: [  # row j's episode, as row 0 here
                (0, obs) for _, obs in env_step([r._replace(row=j) for r in reqs], wait)])
            pieces.append((real(model, tok, [p], N, *[step][:multi_turn], *args, **kwargs),
                           torch.tensor([0])))
        # then the RNG as one process leaves it in rank 0 and another stream in rank 1 (so
        # runs.seed_everything seeds them): ppo's minibatches must follow rank 0's shuffle alone
        torch.manual_seed(1 + runs.get_rank())
        return grpo.cat_rollouts(pieces)
    return sample


C.sample = each_row_alone(C.sample, False)
engine.sample = each_row_alone(engine.sample, True)
script = {"grpo": grpo, "ppo": ppo, "reinforce": reinforce, "sft": sft, "dpo": dpo,
          "reward_model": reward_model, "distill": distill}[sys.argv[1]]
sys.argv = sys.argv[1:]
runs.main_guard(script.main)
"""


# What a busy machine (CI shares its own) can make gloo's connect or torchrun's rendezvous say:
# the machine's fault, not the code's, so the launch is tried again. The last: a process aborted
# by a gloo thread as it exits, after its run is done (seen once here, ppo, beside 5 busy jobs)
TRANSIENT = ("Resource temporarily unavailable", "connectFullMesh", "Address already in use",
             "RendezvousError", "RendezvousTimeoutError", "RendezvousConnectionError",
             "RendezvousClosedError", "terminate called without an active exception")


def free_port():
    """A port nothing listens on now (the OS picks it): each launch its own rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(tmp_path, n, script, *args, tries=3):
    """`torchrun --nproc_per_node n` (n > 1) or one plain process, of a driver whose sampler gives
    each row the same completion in whichever process samples it: the same rows, either way.
    Robust to a loaded machine: each launch rendezvous on its own free port, with a read timeout
    of 300 s (torchrun's default is 60 s; gloo's own is 30 min), and a launch that fails for one of
    the TRANSIENT reasons is tried again (up to `tries` times) from its run folder as it was."""
    driver = tmp_path / "driver.py"
    driver.write_text(SAME_COMPLETIONS)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "MINRL_ROOT": ROOT, "OMP_NUM_THREADS": "1"}
    flags = list(map(str, args))
    folder = next((flags[i + 1] for i, f in enumerate(flags[:-1])
                   if f in ("--output_dir", "--resume")), None)
    before = tmp_path / "before-launch"
    shutil.rmtree(before, ignore_errors=True)
    if folder and os.path.isdir(folder):
        shutil.copytree(folder, before)
    for attempt in range(tries):
        launch = ["-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={n}",
                  "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
                  "--rdzv-conf=read_timeout=300"] if n > 1 else []
        r = subprocess.run([sys.executable, *launch, str(driver), script, *flags], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env=env)
        if r.returncode == 0 or n == 1 or not any(t in r.stderr for t in TRANSIENT):
            return r
        print(f"torchrun launch {attempt + 1} failed for the machine's reasons; again")
        if folder:  # the run folder as it was before this launch
            shutil.rmtree(folder, ignore_errors=True)
            if before.is_dir():
                shutil.copytree(before, folder)
    return r


# ---- docs/: commands, links, the tests they name
SCRIPTS = {"grpo": grpo, "reinforce": R, "ppo": ppo, "sft": sft, "reward_model": reward_model,
           "dpo": dpo, "distill": distill}


# a --tools file: add (a tool that works) and shout (one that raises)
TOOLS_FILE = '''
def add(a: int, b: int) -> int:
    """Add two whole numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


def shout(text: str) -> str:
    """Refuse loudly.

    Args:
        text: what to refuse
    """
    raise ValueError("no " + text)
'''
