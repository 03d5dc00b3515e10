"""runs.py: the run plumbing every training script shares, so that it behaves the same everywhere:
flags, bad-input errors, the output folder and its lock, metrics and samples files, checkpoints and
resume, Ctrl-C, skipped non-finite updates, the end-of-run report, and --sanity.

Nothing here is part of an algorithm: read grpo.py, reinforce.py or ppo.py first.

A run folder holds:
  metrics.jsonl   one JSON line per step (appended and flushed: a crash loses at most that step)
  samples.jsonl   a few decoded completions every --samples_every steps (25), from step 1
  checkpoint/     the policy and tokenizer (from_pretrained loads it), args.json, trainer_state.pt;
                  replaced atomically, so a kill at any moment leaves the previous one loadable
  summary.json    args, held-out score before and after, wall time, peak memory
  curves.png      when matplotlib is installed
A new run refuses a folder holding one of these (--resume continues that run); anything else
there (a log the shell writes into it, notes) is left as it is.
"""
import atexit
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import pickle
import random
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from safetensors import SafetensorError
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm
from transformers.utils import logging as hf_logging

try:
    import resource  # this process's peak memory on a CPU (peak_mem_mb)
except ImportError:  # Windows has none
    resource = None
try:
    import numpy  # its global RNG, which your env and reward functions may draw from
except ImportError:  # optional: torch runs without it
    numpy = None

import common as C
from plumbing.errors import UserError, first_line
from plumbing import ctrl_c, flags, loading

hf_logging.disable_progress_bar()  # the library's loading bars would break into ours
STOP = {"requested": False, "abandon": None}  # Ctrl-C: the loop saves, then stops (Keeper)
STARTING = {}  # folder -> made by this process: a run that logs no step leaves it as it was
STARTED = {"run": None}  # the Run once start_run has made it: what a Ctrl-C leaves behind
FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # whole tensors, on the CPU
# what gloo (and NCCL) raise in a collective when another process of the launch has exited
PEER_GONE = re.compile(r"Connection closed by peer|Connection reset by peer|remote worker crash")
# every name a run (any script) or tools/merge_lora.py writes in its folder, beside run.lock; a
# folder is a new run's only where none is there: anything else (a log the shell writes into it,
# notes, a config) is never read, written or removed
RUN_NAMES = ("metrics.jsonl", "samples.jsonl", "summary.json", "curves.png", "checkpoint",
             "checkpoint.tmp", "checkpoint.old", "checkpoint-merged", "tensorboard")
# warn_if_stuck's levels: nearly every completion cut (chat-sums's seed 0 cuts 0.875 at step 1 by
# design: its sentences score 0 anyway); KL to pi_ref (nats per token) that means the policy has
# left its start (documented runs: under 0.5 on SmolLM2, docs/real_model.md, up to 1.5 on the
# bundled 1 M adder; a reward-hacked SmolLM2 run at the adder's lr was reported at 4.4); clip_frac:
# most tokens' ratio left the clip range in one step (bundled ppo: under 0.2)
CUT, KL_BREAKING, CLIP_BREAKING = 0.95, 3.0, 0.5
# beta 0 (no reference): the entropy 10x off the first WINDOW steps' mean, the reward flat (a
# SmolLM2 run that learned went 0.6 -> 0.05 in 16 steps, docs/real_model.md); see collapsed
WINDOW, ENTROPY_MOVE = 10, 10.0


# ------------------------------------------------------------------------------ errors, flags
def main_guard(main):
    """Run main(). Bad input exits 2 with one line; out of memory exits 1 with what to change;
    anything else keeps its traceback. The last checkpoint and metrics stay intact either way."""
    STARTED["run"] = None
    if signal.getsignal(signal.SIGINT) is ctrl_c.starting:  # from here Ctrl-C is handled below
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        try:
            main()
        except StepAbandoned:  # Ctrl-C before the step's update: save the last completed one
            _abandon_step()
        finally:
            STOP["abandon"] = None
            # torchrun: leave the process group before exiting (gloo's threads otherwise abort
            # the process at exit); one process's group is --vllm's engine's, which leaves it
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.destroy_process_group()
            # a run that failed (or --sanity) before logging a step leaves no empty files, nor
            # the folder if it made it (os.rmdir: only when empty; a user's files there stay)
            for folder, made in STARTING.items():
                if _holds(folder, "metrics.jsonl"):
                    continue
                for name in ("metrics.jsonl", "samples.jsonl"):
                    if os.path.isfile(f"{folder}/{name}") and not _holds(folder, name):
                        os.remove(f"{folder}/{name}")
                _release_lock(folder)
                if made:
                    with contextlib.suppress(OSError):
                        os.rmdir(folder)
            STARTING.clear()
    except UserError as e:
        say_once(f"error: {e}")
        sys.exit(2)
    except (torch.OutOfMemoryError, RuntimeError) as e:  # commonest complaint (trl#2972)
        if PEER_GONE.search(str(e)):  # torchrun: another process failed (and said why) while
            say_once("error: another process of this torchrun stopped: see its line")  # this
            sys.exit(1)  # one waited for it in a collective; its traceback would bury that line
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise  # a CPU allocation that fails is a RuntimeError (DefaultCPUAllocator)
        say_once(f"error: out of memory ({first_line(e)[:100]}): lower --micro_batch_size "
                 "(activations and logits grow with it) or add --gradient_checkpointing; the "
                 "last checkpoint is intact")
        sys.exit(1)
    except KeyboardInterrupt:  # before the run began, or a second Ctrl-C (maybe inside a save,
        run = STARTED["run"]  # which is atomic: see save_checkpoint)
        kept = ("the last complete checkpoint is intact" if run and run.saved_step else
                "no checkpoint was saved yet")
        say_once("\ninterrupted before the run began: nothing was written" if run is None else
                 f"\ninterrupted: {kept}")
        sys.exit(130)


def say_once(line):
    """line on stderr. Under torchrun, every process that fails says why, and processes that
    fail alike (a bad flag: all of them) say it once: the first to make a file named for the line
    in torchrun's folder for this launch (beside its error files) prints it, the others see the
    file and say nothing."""
    launch = os.path.dirname(os.path.dirname(os.environ.get("TORCHELASTIC_ERROR_FILE", "")))
    if launch and os.path.isdir(launch):
        said = os.path.join(launch, f"minrl-said-{hashlib.sha1(line.encode()).hexdigest()}")
        try:
            os.close(os.open(said, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return
        except OSError:  # a folder we cannot write in: say it, maybe twice
            pass
    print(line, file=sys.stderr)


# ----------------------------------------------------------------- the output folder and its files
@dataclass
class Run:
    """Everything the plumbing keeps for one run; the training loop passes it explicitly."""
    dir: str
    algo: str
    args: object
    state: dict | None  # the checkpoint's trainer_state.pt when resuming, else None
    metrics: object  # metrics.jsonl, open for appending
    samples: object  # samples.jsonl, open for appending
    history: list = field(default_factory=list)  # every metrics line so far
    rank: int = 0  # this process, under torchrun (rank 0 alone writes files and the bar)
    world: int = 1  # number of processes
    t0: float = field(default_factory=time.time)  # the start; resumed: minus the earlier parts
    nonfinite: int = 0  # updates skipped for NaN/inf so far
    nonfinite_in_row: int = 0
    saved_step: int = 0  # the step of the checkpoint on disk (0: none yet)
    warned: set = field(default_factory=set)  # kinds of skipped update already reported
    tracker: object = None  # --report_to: the experiment tracker's module or writer (rank 0)


def _take_lock(folder):
    """One run per folder: a lock file holding our pid; a lock left by a dead process is taken."""
    path = os.path.join(folder, "run.lock")
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            try:
                with open(path) as f:
                    pid = int(f.read().strip() or 0)
                if pid == os.getpid():  # an earlier run in this process (tests call main())
                    raise ValueError
                os.kill(pid, 0)  # raises if no such process
            except (OSError, ValueError):
                os.remove(path)  # stale: its process is gone
                continue
            raise UserError(f"{folder!r} is in use by a run in process {pid} (remove {path} if "
                            "that process is not this program)") from None
        with os.fdopen(fd, "w") as f:
            f.write(str(os.getpid()))
        atexit.register(_release_lock, folder)
        return


def _release_lock(folder):
    path = os.path.join(folder, "run.lock")
    try:
        with open(path) as f:
            mine = f.read().strip() == str(os.getpid())
        if mine:
            os.remove(path)
    except OSError:
        pass


def _holds(folder, name):
    """folder/name is there: a folder, or a file with something in it (the empty metrics.jsonl
    of a run that stopped before its first step holds nothing)."""
    path = os.path.join(folder, name)
    return os.path.isdir(path) or os.path.exists(path) and os.path.getsize(path) > 0


def read_jsonl_lines(path):
    """A metrics or samples file's lines as dicts. A line cut short by a crash (the last, with no
    newline) is dropped; any other damaged line is dropped with a warning naming it."""
    lines = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            try:
                m = json.loads(line)
                if not isinstance(m, dict) or type(m.get("step")) not in (int, float):
                    raise ValueError("no number 'step'")
                lines.append(m)
            except ValueError as e:
                if line.endswith("\n"):  # not merely the crash-cut last line
                    print(f"warning: {path}, line {i} is damaged ({first_line(e)[:60]}): "
                          "skipped", file=sys.stderr)
    return lines


def _trim_jsonl(path, last_step):
    """Keep the lines of steps <= last_step (a damaged line is dropped, see read_jsonl_lines)."""
    if not os.path.exists(path):
        return []
    lines = [m for m in read_jsonl_lines(path) if m["step"] <= last_step]
    with open(path, "w") as f:
        f.writelines(json.dumps(m) + "\n" for m in lines)
    return lines


def start_run(args, algo):
    """Make (or, resuming, reopen) the output folder, lock it, and open the metrics and samples
    files. Resuming cuts both files back to the checkpoint's step: no step is logged twice.
    Under torchrun, rank 0 alone does the files; every process gets the same folder name."""
    rank, world = get_rank(), get_world_size()
    folder = args.output_dir or os.path.join("runs", f"{algo}-{time.strftime('%Y%m%d-%H%M%S')}")
    if world > 1:
        names = [folder]
        dist.broadcast_object_list(names, src=0)  # the timestamp of rank 0's clock
        folder = names[0]
    if rank > 0:
        state = _load_state(folder, args.max_steps) if args.resume else None
        signal.signal(signal.SIGINT, _on_sigint)
        STARTED["run"] = Run(dir=folder, algo=algo, args=args, state=state, metrics=None,
                             samples=None, rank=rank, world=world,
                             saved_step=state["step"] if state else 0)
        return STARTED["run"]
    found = [name for name in RUN_NAMES if _holds(folder, name)]  # a new run would replace them
    if found and not args.resume:  # (--resume: the folder's own run goes on)
        if "metrics.jsonl" in found and "checkpoint" not in found:
            raise UserError(flags.no_checkpoint(folder))  # --resume cannot go on: say what can
        way = f"continue it with --resume {folder}, or" if "checkpoint" in found else "move them or"
        raise UserError(f"--output_dir {folder!r} already holds a run ({', '.join(found)}), "
                        f"which a new run would replace: {way} choose another --output_dir")
    try:
        made = not os.path.exists(folder)
        os.makedirs(folder, exist_ok=True)
        _take_lock(folder)
        STARTING[folder] = made
    except OSError as e:
        raise UserError(f"--output_dir {folder!r}: {e.strerror or e}") from None
    metrics_path = os.path.join(folder, "metrics.jsonl")
    samples_path = os.path.join(folder, "samples.jsonl")
    state = _load_state(folder, args.max_steps) if args.resume else None
    for leftover in ("checkpoint.tmp", "checkpoint.old"):  # of a save that was killed
        shutil.rmtree(os.path.join(folder, leftover), ignore_errors=True)
    history = _trim_jsonl(metrics_path, state["step"]) if state else []
    if state:
        _trim_jsonl(samples_path, state["step"])
    signal.signal(signal.SIGINT, _on_sigint)
    STARTED["run"] = Run(dir=folder, algo=algo, args=args, state=state, history=history,
                         saved_step=state["step"] if state else 0, world=world,
                         t0=time.time() - (state or {}).get("wall_time_s", 0),  # resumed: and
                         # the earlier parts' time; line-buffered files: each line at once
                         metrics=open(metrics_path, "a", buffering=1),
                         samples=open(samples_path, "a", buffering=1),
                         tracker=open_tracker(args, folder))
    return STARTED["run"]


def open_tracker(args, folder):
    """--report_to tensorboard | wandb | trackio: the numbers of metrics.jsonl, and the samples as a
    table, also go to that tracker (an optional package; one line when missing). none: nothing."""
    kind = getattr(args, "report_to", "none")
    if kind == "none":
        return None
    package = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}[kind]
    try:
        if kind == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter
            return SummaryWriter(os.path.join(folder, "tensorboard"))
        tracker = __import__(package)
    except ImportError:
        raise UserError(f"--report_to {kind} needs the optional package {package} "
                        f"(pip install {package})") from None
    tracker.init(project="minrl", name=os.path.basename(os.path.abspath(folder)),
                 config=dataclasses.asdict(args))
    return tracker


def _load_state(folder, max_steps):
    """trainer_state.pt, read with weights_only=True: tensors, numbers, strings, lists, tuples and
    dicts only (save_checkpoint writes nothing else). Unpickling any other object can run code,
    so a state that needs it (a run folder from someone else) is refused, not loaded."""
    path = os.path.join(folder, "checkpoint", "trainer_state.pt")
    try:
        state = torch.load(path, weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if not found:  # damaged bytes, not a foreign object
            raise UserError(f"{path} is damaged (not a trainer state); cannot resume") from None
        raise UserError(f"{path} holds {found[1]}, not only tensors and numbers: unpickling "
                        "it could run code, so it is refused (a run writes no such thing)") \
            from None
    except Exception as e:  # truncated or damaged: say which file, not a pickle traceback
        raise UserError(f"{path} is damaged ({first_line(e)}); cannot resume") from None
    if state["step"] > max_steps:  # the loop would do nothing and report the run as finished
        raise UserError(f"--max_steps {max_steps} is below the step of {folder}'s checkpoint "
                        f"({state['step']}): a resumed run goes on from there; give "
                        f"--max_steps {state['step']} or more")
    finishing = state["step"] == max_steps and "extra" in state and not os.path.exists(
        os.path.join(folder, "summary.json"))  # killed in its final eval: --resume finishes it
    if "optimizer" not in state and not finishing:  # a finished run's last checkpoint
        raise UserError(f"{folder} is a finished run whose last checkpoint holds no optimizer "
                        "state (--save_optimizer keeps it): --resume cannot continue it exactly; "
                        f"train on in a new run with --model {folder}/checkpoint")
    return state


class StepAbandoned(Exception):
    """Ctrl-C before a step's first update: main_guard saves the last completed step, exits."""


def _abandon_step():
    """main_guard, on StepAbandoned: the RNG states and data state Keeper.steps kept, its save()."""
    keep, step, data, states, kept = STOP["abandon"]
    STOP["abandon"] = None
    keep.rng.setstate(data)
    set_rng_states(*states)
    if keep.data_state is not None:  # (sft, dpo, reward_model: none)
        keep.data_state.clear()  # in place: next_batch and observe hold this dict
        keep.data_state.update(pickle.loads(kept))  # our own bytes of a moment ago
    run = STARTED["run"]
    if step > run.saved_step:  # steps done since the last checkpoint: save them
        keep.save(step)
    say_once(f"\ninterrupted: step {step + 1} abandoned before its update; " + (
        f"the checkpoint of step {step} resumes exactly (--resume {run.dir})" if step else
        "nothing was trained yet"))
    sys.exit(130)


def _on_sigint(signum, frame):
    if STOP["requested"]:  # a second Ctrl-C exits at once; the last checkpoint is still intact
        raise KeyboardInterrupt
    STOP["requested"] = True
    if STOP.get("abandon"):  # no update yet in this step: stop now (Keeper.steps)
        raise StepAbandoned
    print("\nCtrl-C: finishing this step, then saving a checkpoint (again to quit at once)",
          file=sys.stderr)


def seed_everything(seed):
    """Seeds sampling (each torchrun process its own: they must not draw the same completions)
    and returns the data stream's rng: the same in every process, which each takes its share of
    (rows[rank::world], or my_share), and saved in checkpoints."""
    random.seed(seed)  # Python's and numpy's global RNGs: your env and reward functions may draw
    if numpy is not None:  # from them (saved in checkpoints too: see set_user_rngs)
        numpy.random.seed(seed % 2**32)  # (numpy takes seeds below 2^32)
    torch.manual_seed(seed + 100003 * get_rank())  # rank 0: seed itself, as in one process
    return random.Random(seed)


def rng_states():
    """This process's RNG states: CPU, CUDA (or None), Python's and numpy's global ones (your
    env and reward functions may use them), numpy's keys as a list (weights_only: no array)."""
    cuda = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    np_rng = numpy.random.get_state() if numpy is not None else None
    np_rng = np_rng and (np_rng[0], np_rng[1].tolist(), *np_rng[2:])
    return torch.get_rng_state(), cuda, random.getstate(), np_rng


def set_rng_states(cpu, cuda, *user):
    """The states rng_states() returned (a checkpoint from before the user RNGs were saved has
    only the first two)."""
    torch.set_rng_state(cpu)
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)
    if user:
        set_user_rngs(*user)


def set_user_rngs(python, numpy_state):
    """Python's and numpy's global RNGs (your env and reward functions may draw from them) as a
    checkpoint saved them (save_checkpoint; numpy's keys as a list: weights_only loads no array),
    so that a resumed run draws what the straight run drew."""
    random.setstate(python)
    if numpy_state is not None and numpy is not None:
        kind, keys, *rest = numpy_state
        numpy.random.set_state((kind, numpy.array(keys, dtype=numpy.uint32), *rest))


def resume_or_eval(run, opt, rng, evaluate, metric, trained=()):
    """Resuming: restore the optimizer, the RNG states and the counters from the checkpoint.
    Otherwise run the first held-out eval. Returns (first step, eval score before training,
    the algorithm's own saved state: a dict, empty for a new run). trained: the modules opt
    updates; under --fsdp each process takes its shards of the saved full optimizer state."""
    if not run.state:
        eval_before = evaluate()  # {"eval": greedy score, ...}
        scores = ", ".join(f"{k} {v:.3f}" for k, v in eval_before.items())
        weights = sum(_local(p).numel() for group in opt.param_groups for p in group["params"])
        if run.rank == 0:  # AdamW's moments: two fp32 numbers a weight, made at step 1's end
            print(f"held-out {metric} before training: {scores}")
            print(f"memory: AdamW's moments will add {8 * weights / 2**20:,.0f} MB from step 2")
        return 0, eval_before, {}
    s = run.state
    if "optimizer" not in s:  # the last step's checkpoint: only the final eval is left to do
        pass
    elif isinstance(opt.param_groups[0]["params"][0], DTensor):  # --fsdp
        set_optimizer_state_dict(torch.nn.ModuleList(trained), opt, s["optimizer"],
                                 options=StateDictOptions(full_state_dict=True))
    else:
        opt.load_state_dict(s["optimizer"])
    if len(s.get("rngs", ())) == run.world:  # a (CPU, CUDA, Python and numpy) state per
        set_rng_states(*s["rngs"][run.rank])  # process; else reseeded
    rng.setstate(s["data_rng"])
    run.nonfinite = s["nonfinite"]
    if run.rank == 0:
        print(f"resumed {run.dir} at step {s['step']} of {run.args.max_steps}")
    return s["step"], s["extra"]["eval_before"], s["extra"]


# ------------------------------------------------------------------------- during the loop
def stop_run(run, why):
    """End the run in one line (exit 2), keeping its folder, metrics.jsonl and last checkpoint."""
    STARTING.pop(run.dir, None)  # kept even with no step logged: it is evidence
    kept = f"the checkpoint of step {run.saved_step}" if run.saved_step else "no checkpoint yet"
    raise UserError(f"stopping: {why}; {run.dir}/ keeps metrics.jsonl and {kept}")


def _local(p):  # --fsdp: this process's shard of a sharded parameter (a DTensor)
    return p.to_local() if isinstance(p, DTensor) else p


def log_step(run, metrics, bar, samples, opt, shown):
    """Rank 0: metrics.jsonl, samples.jsonl (steps 1, 1 + --samples_every, ...), the tracker, the
    bar (the metrics shown)."""
    if run.rank > 0:
        return
    step, n = metrics["step"], getattr(run.args, "samples_every", 0)  # (the RL scripts' flag)
    samples = samples if n and (step - 1) % n == 0 else None
    run.history.append(metrics)
    run.metrics.write(json.dumps(metrics) + "\n")
    if samples:
        run.samples.write(json.dumps({"step": step, "samples": samples}) + "\n")
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and k != "step"}
    if hasattr(run.tracker, "add_scalar"):  # --report_to tensorboard: one number at a time
        for k, v in numbers.items():
            run.tracker.add_scalar(k, v, step)
        if samples:
            run.tracker.add_text("samples", json.dumps(samples, indent=1), step)
    elif run.tracker is not None:  # wandb and trackio: one call a step, the samples as a Table
        if samples:
            numbers["samples"] = run.tracker.Table(
                columns=list(samples[0]), data=[[s[c] for c in samples[0]] for s in samples])
        run.tracker.log(numbers, step=step)
    bar.set_postfix({k.split("/")[-1]: f"{metrics[k]:.3g}" for k in shown if k in metrics})
    if metrics.get("obs_truncated") and not any(m.get("obs_truncated") for m in run.history[:-1]):
        tqdm.write(f"note: step {step}: an observation was cut by --max_new_tokens (obs_truncated)")
    if step == 1:  # AdamW's moments add on from step 2: where runs that barely fit fail (trl#2972)
        device = opt.param_groups[0]["params"][0].device
        tqdm.write(f"memory: peak {peak_mem_mb(device):,.0f} MB in step 1, before AdamW's moments")


def collapsed(rewards, w=WINDOW, k=7):
    """A reward that fell: the last w steps' mean at or below the first w steps' and k standard
    errors below the best w steps' (the first's included: a run that only got worse). A standard
    error is sigma / sqrt(w), sigma a step's noise from successive differences (von Neumann's:
    a trend does not inflate it). Returns (start, best, best's last step, now) or None."""
    n = len(rewards)
    means = [sum(rewards[i:i + w]) / w for i in range(n - w + 1)]  # means[i]: steps i+1..i+w
    sigma = math.sqrt(sum((a - b) ** 2 for a, b in zip(rewards, rewards[1:])) / max(2 * n - 2, 1))
    if n >= 2 * w and max(means) - means[-1] > k * sigma / math.sqrt(w) and means[-1] <= means[0]:
        return means[0], max(means), means.index(max(means)) + w, means[-1]


def warn_if_stuck(run, m, args):
    """A run that cannot learn or breaks says so, each kind below once a run (a resumed run's
    earlier ones count), in the log and in this step's metrics m (warning: the kinds, warnings:
    how many). Cannot learn: a kind that held at each of the last WINDOW steps (each step so far,
    before step WINDOW) while the reward stayed at its start's. Before log_step."""
    past = run.history + [m]
    n, start, recent = len(past), past[:WINDOW], past[-WINDOW:]
    r0, r = (sum(x["reward"] for x in ms) / len(ms) for ms in (start, recent))  # mean rewards

    def held(test):
        return r <= r0 and all(test(x) for x in recent)
    parts = [k for k in m if k.startswith("reward/")]
    zero = [k for k in parts if held(lambda x: x.get(k, 0) == 0)]  # has paid no completion
    constant = held(lambda x: x.get("reward_std", 1) < 1e-6)  # one reward for every completion
    kl_flag = "--kl_coef" if hasattr(args, "kl_coef") else "--beta"
    kinds = {
        "truncated": m.get("frac_truncated", 0) >= CUT and
        f"{m.get('frac_truncated', 0):.0%} of completions were cut by --max_new_tokens "
        f"{args.max_new_tokens} (no EOS) and score as cut: try --max_new_tokens "
        f"{4 * args.max_new_tokens}, or ask for shorter answers (--system_prompt)",
        "constant_reward": constant and
        f"every completion got the same reward, {m['reward']:.3g}: nothing is learned; does "
        "your reward read fields the rows have, and can this model reach it?",
        "zero_std": not constant and held(lambda x: x.get("frac_zero_std", 0) == 1) and
        "every group's rewards were equal, so every advantage is 0 and nothing is learned: the "
        "task is out of reach or solved already, or the reward cannot tell the completions apart",
        "zero_part": 0 < len(zero) < len(parts) and
        f"{', '.join(zero)} gave every completion 0: only "
        f"{', '.join(k for k in parts if k not in zero)} teach(es), and the model learns what "
        "they pay for, not this; can it be earned from here (read samples.jsonl; a "
        "--system_prompt)?",
        "clip": m.get("clip_frac", 0) > CLIP_BREAKING and
        f"clip_frac {m['clip_frac']:.2f}: most tokens' ratio left the clip range within one "
        f"step, the updates are too large: lower --lr {args.lr:g}"}
    if hasattr(args, "teacher"):  # distill.py: its kl is the distance to the teacher, its loss
        pass
    elif any(x.get("kl") for x in past):  # the drift from pi_ref: the KL to it, when measured
        kinds["drift"] = m.get("kl", 0) > KL_BREAKING and (
            f"kl {m['kl']:.3g} nats per token to the reference: the policy has left its start "
            f"(reward hacking or collapse; read samples.jsonl): lower --lr {args.lr:g} or raise "
            f"{kl_flag}")
    elif n > WINDOW and "entropy" in m:  # none (beta 0): the entropy's move, the reward flat
        h0, h = sum(x["entropy"] for x in start) / WINDOW, m["entropy"]
        kinds["drift"] = h0 > 0 and not h0 / ENTROPY_MOVE < h < h0 * ENTROPY_MOVE and r <= r0 and (
            f"entropy {h:.3g} nats per token, {h / h0:.2g}x its start ({h0:.3g}, steps "
            f"1-{WINDOW}), while the reward did not rise ({r:.3g} against {r0:.3g}): the policy "
            "has left its start without learning (collapse; read samples.jsonl) and no KL holds "
            f"it: lower --lr {args.lr:g} or give {kl_flag} 0.04")
    fell = collapsed([x["reward"] for x in past])
    if fell:
        first, best, end, now = fell
        since = ", its start" if end == WINDOW else f"; its start, steps 1-{WINDOW}: {first:.3g}"
        kinds["collapse"] = (
            f"the reward fell to {now:.3g} (mean of steps {n - WINDOW + 1}-{n}) from {best:.3g} "
            f"(steps {end - WINDOW + 1}-{end}{since}): a collapse (read samples.jsonl from step "
            f"{end}): lower --lr {args.lr:g}")
    before = {k for x in run.history for k in x.get("warning", "").split(",")}
    said = {kind: line for kind, line in kinds.items() if line and kind not in before}
    for kind in said if run.rank == 0 else []:
        tqdm.write(f"warning: step {m['step']}: {said[kind]}")
    if said:  # only then: a run without warnings logs the same keys as before
        m.update(warning=",".join(said), warnings=len(said))


class Keeper:
    """The run-keeping of a training loop, one duty a method, so that the loop's lines are the
    algorithm's (every script's: grpo, reinforce, ppo, distill, sft, dpo, reward_model). The loop
    talks to it in these calls:

        keep = R.Keeper(run, opt, rng, save, evaluate, data.state)
        for step in keep.steps(start):        # the bar; Ctrl-C before the update; the clock
            with keep.sampling(model, step):  # --fsdp: the whole model; divergence: one line
                ...sample...
            if not keep.finite(rewards.sum(), what="reward"):  # NaN/inf in any process
                continue
            ...advantages, losses, backward...
            if keep.finite(grad_norm):        # NaN/inf gradients would ruin the weights
                opt.step()
            metrics = {**keep.rollout_metrics(roll, rows, texts, rewards, parts), ...}
            samples = keep.samples(tok, roll, rows, texts, rewards, group_size)
            keep.end_step(step, metrics, samples, tokens, token_weights)
        keep.finish(metric, eval_before)

    Its fields: run (the Run: folder, files, counters), opt (its lr is logged), rng and
    data_state (what a Ctrl-C before the update puts back), save(done) (the loop's one
    checkpoint call), evaluate() (its held-out scores) and shown (the metrics on the bar);
    bar (tqdm), t0 (this step's start) and stopping (Ctrl-C was pressed: this step is the last)
    change as the steps go."""

    def __init__(self, run, opt, rng, save, evaluate, data_state=None,
                 shown=("reward", "kl", "gold", "eval")):
        self.run, self.opt, self.rng, self.save, self.evaluate = run, opt, rng, save, evaluate
        self.data_state, self.shown = data_state, shown
        self.bar, self.t0, self.stopping = None, 0.0, False

    def steps(self, start):
        """The steps from start to --max_steps, under a tqdm bar. A Ctrl-C before a step's update
        (finite) abandons it: main_guard puts back the RNGs and data_state of its start and saves
        the last step, so --resume goes on as the straight run. After it (under torchrun always)
        the step finishes, end_step saves it and the steps stop."""
        run = self.run
        self.bar = tqdm(range(start, run.args.max_steps), initial=start, total=run.args.max_steps,
                        desc=run.algo, disable=run.rank > 0)
        for step in self.bar:
            if run.world == 1:  # data_state's copy by pickle: 6x deepcopy's pace
                kept = pickle.dumps(self.data_state)
                STOP["abandon"] = self, step, self.rng.getstate(), rng_states(), kept
            self.t0 = time.time()
            yield step
            if self.stopping:
                return

    @contextlib.contextmanager
    def sampling(self, model, step):
        """Where the loop samples: --fsdp gathers the whole model in every process (gathered). A
        diverged policy fails deep in torch.multinomial: one line naming the step instead."""
        try:
            with gathered(model):
                yield
        except RuntimeError as e:
            if "probability tensor contains" not in str(e):  # "... either inf, nan or element < 0"
                raise
            stop_run(self.run, f"the policy diverged (NaN/inf): step {step + 1} cannot sample; "
                               "lower --lr")

    def finite(self, *values, what="loss or gradient"):
        """True when the values (the gradient norms; what="reward": this process's sum of the
        rewards) are finite in every process. Else the step's update is skipped: counted
        (summary.json), said once per kind; 10 skipped in a row stop the run. A finite gradient
        begins the update: the row of skips ends, and a Ctrl-C from here finishes the step."""
        run = self.run
        if math.isfinite(global_sum(sum(map(float, values)))):
            if what != "reward":
                run.nonfinite_in_row, STOP["abandon"] = 0, None
            return True
        run.nonfinite += 1
        run.nonfinite_in_row += 1
        if what not in run.warned:
            tqdm.write(f"warning: non-finite {what}: update skipped (counted in summary.json)")
            run.warned.add(what)
        if run.nonfinite_in_row == 10:
            stop_run(run, f"the {what} was NaN or inf in 10 updates in a row")
        return False

    def rollout_metrics(self, roll, rows, texts, rewards, parts, env=None):
        """The metrics every RL script logs of its rollout: reward, reward_std (over every
        process), each reward part, gold (common.gold), completion_len, frac_truncated, lr and
        an env's own; rewards (B,) and parts {name: (B,)} may hold more rows than roll."""
        return {"reward": float(rewards.mean()), "reward_std": float(global_std(rewards)),
                **{f"reward/{k}": float(v.mean()) for k, v in parts.items()},
                **C.gold(texts, rows), "completion_len": float(roll.completion_mask.sum(-1).mean()),
                "frac_truncated": float(roll.truncated.float().mean()),
                "lr": self.opt.param_groups[0]["lr"], **(env.metrics(roll) if env else {})}

    def samples(self, tok, roll, rows, texts, rewards, stride, key="reward"):
        """samples.jsonl's lines for this step: rows 0, stride, 2 * stride, ... (the first 4),
        each prompt as given and as the model read it (prompt_text), its completion (with an
        env, the transcript: observations marked as ⟦...⟧) and its reward."""
        return [{"prompt": rows[i]["prompt"], "rendered_prompt": prompt_text(tok, roll, i),
                 "completion": texts[i], key: float(rewards[i])}
                for i in range(0, len(rows), stride)[:4]]

    def end_step(self, step, metrics, samples=None, tokens=None, token_weights=None):
        """After the step's updates, in order: its metrics (tokens: this process's; under torchrun
        the mean over the processes, token_weights' keys weighted by its values), the held-out
        eval, the warnings, the logs, and a checkpoint (after a Ctrl-C too: the last step)."""
        args, done, elapsed = self.run.args, step + 1, time.time() - self.t0
        metrics = {"step": done, **metrics, "step_time": elapsed}
        if tokens is not None:  # every process's
            metrics["tokens_per_s"] = float(global_sum(tokens)) / elapsed
        metrics = global_mean(metrics, weights=token_weights)
        if args.eval_every and done % args.eval_every == 0 and done < args.max_steps:
            metrics.update(self.evaluate())
        if "reward" in metrics:
            warn_if_stuck(self.run, metrics, args)
        log_step(self.run, metrics, self.bar, samples, self.opt, self.shown)
        self.stopping = stop_requested()  # Ctrl-C in any process: every process saves, stops
        if args.save_every and done % args.save_every == 0 or done == args.max_steps \
                or self.stopping:
            self.save(done)

    def finish(self, metric, eval_before, **report):
        """The final held-out eval, summary.json and the report (finish_run: charts, label)."""
        return finish_run(self.run, metric, eval_before, self.evaluate, **report)


def adapters_off(model):
    """LoRA: a context in which the policy computes as its frozen base (a free reference)."""
    peft = hasattr(model, "disable_adapter")
    return model.disable_adapter() if peft else contextlib.nullcontext()


def prompt_text(tok, roll, i):
    """Row i's prompt as the model read it (its chat template, --tools' schemas): decoded ids."""
    return tok.decode(roll.ids[i, :roll.P][roll.attention_mask[i, :roll.P] == 1])


def save_checkpoint(run, model, tok, opt, rng, step, extra, trained=None):
    """checkpoint/, atomically: written to checkpoint.tmp/, then renamed (docs/reliability.md)."""
    trained = trained or [model]  # the modules opt updates; extra: the algorithm's own state
    bad = sum(float(not torch.isfinite(_local(p)).all()) for m in trained for p in m.parameters())
    if global_sum(bad):  # NaN/inf weights, in any process: keep the last good checkpoint
        stop_run(run, f"the weights are NaN or inf after step {step}; try a lower --lr")
    rngs = [rng_states()] * run.world
    if run.world > 1:  # every process's sampling RNG, gathered into the list's slots
        dist.all_gather_object(rngs, rngs[0])
    weights = full_state_dict(model)  # --fsdp: every process helps gather them, and opt's state
    # a finished run's last checkpoint keeps no AdamW moments (twice the model) nor ppo's critic,
    # as HF Trainer's final save (--resume only finishes it); --save_optimizer keeps them, to go on
    resumable = step < run.args.max_steps or getattr(run.args, "save_optimizer", False)
    state = {"step": step, "nonfinite": run.nonfinite, "data_rng": rng.getstate(), "rngs": rngs,
             "extra": {k: v for k, v in extra.items() if resumable or k != "critic"},
             "wall_time_s": time.time() - run.t0}
    if resumable:
        sharded = isinstance(opt.param_groups[0]["params"][0], DTensor)  # --fsdp
        state["optimizer"] = get_optimizer_state_dict(torch.nn.ModuleList(trained), opt,
                                                      options=FULL) if sharded else opt.state_dict()
    if run.rank > 0:
        return
    tmp, final, old = (os.path.join(run.dir, "checkpoint" + end) for end in (".tmp", "", ".old"))
    try:
        model.save_pretrained(tmp, state_dict=weights, safe_serialization=True)
        tok.save_pretrained(tmp)
        torch.save(state, os.path.join(tmp, "trainer_state.pt"))
        with open(os.path.join(tmp, "args.json"), "w") as f:
            json.dump({"algo": run.algo, "args": dataclasses.asdict(run.args)}, f, indent=1)
    except (OSError, RuntimeError, SafetensorError) as e:  # a full disk, as each of them says it
        shutil.rmtree(tmp, ignore_errors=True)
        stop_run(run, f"could not write {tmp} ({' '.join(str(e).split())[:80]}); free some space")
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    run.saved_step = step


def set_threads(args, model, small=10_000_000):
    """torch's CPU threads, set once the policy is loaded. --threads N: N threads. 0 (auto):
    OMP_NUM_THREADS when it is set; else 1 thread for a model under 10 M parameters and torch's
    default (one per core) above. Measured on 2 cores (bench/threads.py, bench/RESULTS.md): the
    bundled model's steps are 1.3x faster with 2 threads when nothing else runs, but 2.9x slower
    beside one busy process and 4x beside three (every op waits for both OpenMP threads): a
    workshop laptop runs a browser and a video call. A 16 M model gains 1.7x idle with 2."""
    if next(model.parameters()).device.type != "cpu":
        return
    n = args.threads
    if n == 0 and "OMP_NUM_THREADS" not in os.environ:
        n = 1 if sum(p.numel() for p in model.parameters()) < small else 0
    if n:
        torch.set_num_threads(n)


# ------------------------------------------------------------ several processes (torchrun)
def setup_distributed():
    """Under torchrun (WORLD_SIZE > 1): join the process group (nccl on CUDA, gloo on CPU) and
    take this process's device from LOCAL_RANK. Launched plainly: one process, no group, nothing
    changes. Returns the device."""
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return loading.pick_device()
    local = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return device


def get_rank():
    return dist.get_rank() if dist.is_initialized() else 0


def get_world_size():
    return dist.get_world_size() if dist.is_initialized() else 1


def my_share(items):
    """This process's contiguous share of the rows, all shares of one size (DDP needs as many
    micro-batches in every process), for a list that need not divide among the processes."""
    n = len(items) // get_world_size()
    return items[get_rank() * n:(get_rank() + 1) * n]


def global_sum(x):
    """x summed over every process, in float64 (x stays as it was). One process: x itself."""
    if not dist.is_initialized():
        return x
    t = torch.as_tensor(x)  # reduced on the GPU where there is one: nccl reduces CUDA tensors only
    total = t.to("cuda" if torch.cuda.is_available() else "cpu", torch.float64, copy=True)
    dist.all_reduce(total)
    return total.to(t.device, t.dtype if t.is_floating_point() else torch.float64)


def global_mean(metrics, weight=1.0, weights=None):
    """Floats averaged over every process's rows, weighted by weights[key] (tokens) or weight."""
    if not dist.is_initialized():
        return metrics
    keys = sorted(k for k, v in metrics.items() if isinstance(v, float))  # ints (step) stay
    w = torch.tensor([float((weights or {}).get(k, weight)) for k in keys], dtype=torch.float64)
    x = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
    n, total = global_sum(torch.stack([w, x * w]))
    mean = torch.where(n > 0, total / n, total)  # a key no process had a row for: its sum, 0
    return {**metrics, **dict(zip(keys, mean.tolist()))}


def global_std(x):
    """The unbiased std of x's entries over every process (torch.std over all of them)."""
    if not dist.is_initialized():
        return x.std()
    x64 = x.detach().double()  # float64: the one-pass variance (sum x^2 - (sum x)^2 / n) / (n - 1)
    n, s, s2 = global_sum(torch.stack([x64.new_tensor(x.numel()), x64.sum(), x64.square().sum()]))
    return ((s2 - s * s / n).clamp(min=0) / (n - 1)).sqrt().to(x.dtype)  # >= 0 despite rounding


def stop_requested():
    """Ctrl-C in any process stops every process after the same step."""
    return bool(global_sum(float(STOP["requested"])))


def wrap_model(model, fsdp=False):
    """Under torchrun, the model for the training forward. One process: the model itself.
    DDP (default): PyTorch's DistributedDataParallel keeps a full copy of the model, its gradients
    and Adam's moments in every process and averages the gradients in backward; sampling and
    frozen forwards use the plain model (no gradient sync there).
    fsdp: FSDP2 (PyTorch's fully_shard) changes the model in place and returns it: each process
    keeps 1/N of every weight, gradient and Adam moment (16 B/param / N in fp32) and all-gathers
    a block's weights just before it runs (every process at once: log-prob forwards take the same
    number of micro-batches everywhere, since every process holds as many rows). Each decoder
    block (the classes HF models list in _no_split_modules) is its own unit, so only one block is
    gathered at a time; the root holds the rest (embeddings, head). Build the optimizer after
    this: the parameters become DTensors (sharded tensors)."""
    if get_world_size() == 1:
        return model
    if fsdp:
        names = {n for m in model.modules() for n in getattr(m, "_no_split_modules", None) or ()}
        for block in [m for m in model.modules() if type(m).__name__ in names]:
            fully_shard(block)
        fully_shard(model)
        return model
    device = next(model.parameters()).device
    return DistributedDataParallel(model, device_ids=[device] if device.type == "cuda" else None)


def sync_gradients(model, now):
    """DDP: average the gradients in the last micro-batch's backward only (now; docs/scaling.md)."""
    wait = isinstance(model, DistributedDataParallel) and not now
    return model.no_sync() if wait else contextlib.nullcontext()


@contextlib.contextmanager
def gathered(model):
    """--fsdp: the whole model in every process while it samples (docs/scaling.md). Else nothing."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]  # none without --fsdp
    for m in units:
        m.unshard()
        m.set_reshard_after_forward(False, recurse=False)  # forwards keep the weights gathered
    yield
    for m in units:  # FSDP2's defaults again: blocks free their weights after forward, root keeps
        m.set_reshard_after_forward(m is not model, recurse=False)
        m.reshard()


def split_eval(run, model, rows, score):
    """Held-out scores, score(rows) -> dict of means, each process on its share, merged by size."""
    mine = rows[run.rank::run.world]
    with gathered(model):
        return global_mean(score(mine), weight=len(mine))


def full_state_dict(model):
    """The full weights; under FSDP2 gathered onto rank 0's CPU ({} elsewhere; all must call it)."""
    if not any(isinstance(m, FSDPModule) for m in model.modules()):  # not --fsdp: no copy
        return model.state_dict()
    full = get_model_state_dict(model, options=FULL)
    first = {}  # tied weights (an LM head that is the embedding) come back as two copies: one
    for name, p in model.named_parameters(remove_duplicate=False) if full else ():  # again, as
        full[name] = full[first.setdefault(id(p), name)]  # in state_dict(), written once
    return full


# ---------------------------------------------------------------------------- end of the run
def peak_mem_mb(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss if resource else math.nan  # Windows
    return rss / 2**20 if sys.platform == "darwin" else rss / 1024  # bytes on macOS, kB on Linux


def spark(values, width=60):
    """A one-line text chart of the finite values, binned to at most `width` columns, in block
    characters, or ASCII where stdout cannot print those (a Windows code page, a redirect)."""
    values = [v for v in values if math.isfinite(v)]  # a skipped non-finite step logs NaN
    if not values:
        return ""
    k = math.ceil(len(values) / width)
    bins = [sum(values[i:i + k]) / len(values[i:i + k]) for i in range(0, len(values), k)]
    lo, hi, bars = min(bins), max(bins), "▁▂▃▄▅▆▇█"
    try:
        bars.encode(sys.stdout.encoding or "ascii")
    except (UnicodeEncodeError, LookupError):
        bars = "_.-~=+*#"
    line = "".join(bars[int(7 * (v - lo) / (hi - lo)) if hi > lo else 0] for v in bins)
    return f"{line}  [{lo:.3g} .. {hi:.3g}]"


def curve_panels(history, eval_points):
    """curves.png's panels, [(title, steps, values)]: what a user looks at first. The held-out
    score (eval_points: [(step, score)], before, during, after), the reward, each reward
    component when there are several, gold, entropy, and kl only when it was computed (beta 0
    logs kl 0: no panel)."""
    logged = list(dict.fromkeys(k for m in history for k in m))
    parts = [k for k in logged if k.startswith("reward/")]
    keys = ["reward"] + (parts if len(parts) > 1 else []) + ["gold", "entropy"]
    keys = [k for k in keys if k in logged] + (["kl"] if any(m.get("kl") for m in history) else [])
    panels = [("held-out eval", *map(list, zip(*eval_points)))] if eval_points else []
    return panels + [(k, [m["step"] for m in history if k in m], [m[k] for m in history if k in m])
                     for k in keys]


def _plot(run, eval_points):
    """curves.png of curve_panels; returns what it wrote, or why not (no matplotlib, no steps)."""
    try:
        import matplotlib
    except ImportError:
        return "no curves.png: pip install matplotlib for it"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = curve_panels(run.history, eval_points)
    if not panels:
        return "no curves.png: no steps were logged"
    cols = min(3, len(panels))
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax in axes.flat[len(panels):]:
        ax.axis("off")
    for ax, (title, xs, ys) in zip(axes.flat, panels):
        ax.plot(xs, ys, marker="." if len(xs) < 20 else None)
        ax.set_title(title)
        ax.set_xlabel("step")
    fig.tight_layout()
    fig.savefig(os.path.join(run.dir, "curves.png"))
    plt.close(fig)
    return "curves.png"


def _json_safe(x):
    """NaN and inf become null: bare NaN is not JSON, and strict parsers refuse it. Other floats
    keep 6 significant digits (a float32 0.282 is 0.28200000524520874 as a Python float)."""
    if isinstance(x, float):
        return float(f"{x:.6g}") if math.isfinite(x) else None
    if isinstance(x, dict):
        return {k: _json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_safe(v) for v in x]
    return x


def finish_run(run, metric, eval_before, evaluate, charts=("reward", "gold", "kl"), label="greedy"):
    """The final held-out eval (skipped after Ctrl-C, said so), summary.json, the before/after
    table, text charts, curves.png. Exits 130 after Ctrl-C (checkpoint and summary are saved)."""
    device = torch.device("cuda" if torch.cuda.is_initialized() else "cpu")  # for peak memory
    stopped = stop_requested()
    if stopped:
        print("interrupted: the final held-out eval is skipped; --resume the run to finish it")
        eval_after = dict.fromkeys(eval_before, float("nan"))
    else:
        eval_after = evaluate()
    if run.rank > 0:
        return None
    first = run.state["step"] if run.state else 0  # a run whose every update was skipped stops
    if run.nonfinite_in_row and not any(math.isfinite(m.get("grad_norm", math.nan))
                                        for m in run.history if m["step"] > first):
        stop_run(run, f"every update of this run was skipped for NaN/inf (non-finite "
                      f"{', '.join(sorted(run.warned))}), so nothing was trained")
    steps = [m["step"] for m in run.history]
    tokens_per_s = sum(m.get("tokens_per_s", 0) for m in run.history) / max(len(steps), 1)
    summary = {"algo": run.algo, "args": dataclasses.asdict(run.args), "eval_metric": metric,
               "eval_before": eval_before["eval"], "eval_after": eval_after["eval"],
               "evals": {"before": eval_before, "after": eval_after},
               "steps": steps[-1] if steps else 0, "wall_time_s": round(time.time() - run.t0, 2),
               "peak_mem_mb": round(peak_mem_mb(device), 1), "nonfinite_skips": run.nonfinite,
               "interrupted": stopped, "tokens_per_s": round(tokens_per_s, 1),
               "model_defaults": flags.MODEL_DEFAULTS}
    with open(os.path.join(run.dir, "summary.json"), "w") as f:
        json.dump(_json_safe(summary), f, indent=2)
    run.metrics.close()
    run.samples.close()
    if run.tracker is not None:
        (getattr(run.tracker, "close", None) or run.tracker.finish)()
    _release_lock(run.dir)
    if getattr(run.args, "eval_sampled", False):  # the headline is mean@k (common.evaluate)
        label = f"mean@{run.args.eval_samples} sampled"
    print(f"\n{'held-out ' + metric:26}{'before':>10}{'after':>10}")
    for key in eval_before:
        name = label if key == "eval" else key[5:] + (" sampled" if "@" in key else "")
        print(f"{name:>26}{eval_before[key]:>10.3f}{eval_after[key]:>10.3f}")
    keys = [k for k in charts if any(k in m for m in run.history)]
    for key in keys:
        print(f"{key:>8} {spark([m[key] for m in run.history if key in m])}")
    last = run.history[-1]["step"] if run.history else 0
    evals = [(0, eval_before["eval"])] + [(m["step"], m["eval"]) for m in run.history
                                          if "eval" in m] + [(last, eval_after["eval"])]
    plot = _plot(run, [(x, y) for x, y in evals if math.isfinite(y)] if run.history else [])
    print(f"wall time {summary['wall_time_s']:.0f} s, peak memory {summary['peak_mem_mb']:.0f} MB")
    print(f"wrote {run.dir}/: metrics.jsonl, samples.jsonl, summary.json, checkpoint/, {plot}")
    if stopped:
        sys.exit(130)
    return summary


# ---------------------------------------------------------------------------------- --sanity
def sanity_check(model, ref, tok, rows, args, env=None):
    """--sanity, on the real model and data, before any update: the sampler's log-probs equal the
    training forward's (with --env / --tools: over whole multi-turn transcripts, observations
    between the model's turns); the ratio pi / pi_old is exactly 1; KL(pi || pi_ref) is 0; every
    finished row's mask ends on an EOS or a stop string. Prints each check and a peak-memory
    estimate; returns the failures."""
    device = next(model.parameters()).device
    amp = loading.autocast(device, args.dtype)  # as the training forwards run
    # top_p 1: below 1 the sampler's log-probs are over the kept tokens (by design, not a bug)
    at_top_p_1 = C.SimpleNamespace(**{**vars(args), "top_p": 1.0})
    roll, texts = C.generate(model, tok, rows[:16], at_top_p_1, amp, env)
    lp = C.batched_logprobs(model, roll, args.temperature, args.micro_batch_size, amp)
    # fp32 on the CPU: equal up to float noise. bf16 autocast (and on a GPU a bf16 reference
    # against fp32 master weights: 3e-5 KL on the bundled model) rounds each forward differently
    exact = device.type == "cpu" and args.dtype != "bf16"
    tol, kl_tol = (1e-3, 1e-4) if exact else (0.1, 1e-2)
    checks = {}
    d = float((lp - roll.sample_logprobs).abs().max())
    checks["sampling log-probs equal the training forward's"] = (d <= tol, f"max diff {d:.3g}")
    again = C.batched_logprobs(model, roll, args.temperature, args.micro_batch_size, amp)
    d = float(((again - lp).exp() - 1).abs().max())
    checks["ratio pi/pi_old is 1 at the first inner step"] = (d <= 1e-4, f"{d:.3g} off; dropout?")
    if ref is not None:
        with adapters_off(ref):  # LoRA: the policy without its adapters
            ref_lp = C.batched_logprobs(ref, roll, args.temperature, args.micro_batch_size, amp)
        kl = float(C.masked_mean(C.kl_estimate(lp, ref_lp, "k3"), roll.completion_mask))
        checks["KL(policy || reference) is 0 before any update"] = (kl <= kl_tol, f"{kl:.3g}")
    # every finished row's mask ends on its EOS or on the last token of a stop string; with no
    # finished row there is nothing to check, and that fails too (raise --max_new_tokens)
    T = roll.completion_mask.shape[1]  # each row's last model token (multi-turn: its last turn's)
    last = (roll.completion_mask * torch.arange(1, T + 1, device=device)).argmax(-1)
    ends = roll.ids[:, roll.P:].gather(1, last[:, None])[:, 0]
    on_eos = torch.isin(ends, torch.tensor(C.eos_ids(model, tok), device=device)).tolist()
    ends_ok = [e or any(s in t for s in args.stop) for e, t in zip(on_eos, texts)]
    done = (~roll.truncated).tolist()
    checks["completion_mask ends on the EOS or a stop string"] = (
        any(done) and all(o for o, d in zip(ends_ok, done) if d),
        "no row ended within max_new_tokens" if not any(done) else "not always")
    for name, (ok, detail) in checks.items():
        print(f"  {'ok  ' if ok else 'FAIL'} {name}{'' if ok else f' ({detail})'}")
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    cfg = model.config
    acts = args.micro_batch_size * (roll.ids.shape[1] * cfg.hidden_size * cfg.num_hidden_layers * 34
                                    + 3 * 4 * (roll.completion_mask.shape[1] + 1) * cfg.vocab_size)
    now = peak_mem_mb(device)  # the runtime and every model loaded so far
    print(f"peak memory estimate: {now + (12 * trained + acts) / 2**20:,.0f} MB (now {now:,.0f}; "
          f"+ gradients and Adam moments {12 * trained / 2**20:,.0f}; + activations of one "
          f"micro-batch {acts / 2**20:,.0f})")
    failed = [name for name, (ok, _) in checks.items() if not ok]
    print("sanity: " + ("all checks passed" if not failed else "FAILED: " + "; ".join(failed)))
    return failed
