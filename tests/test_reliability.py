"""Reliability: resume, Ctrl-C, out of memory, a full disk, non-finite values, --sanity."""
import builtins
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import common as C
from plumbing.errors import UserError
import grpo
from plumbing import flags
from plumbing import loading
import ppo
import reinforce as R
from plumbing import runs
from plumbing import tasks

from tests.helpers import (FAST_GRPO, PROMPTS, REWARD_FILE, ROOT, _offline, one_error_line,
                           read_metrics, run_main, tiny_config, write_jsonl)

sys.path.insert(0, os.path.join(ROOT, "tools"))
import plot  # noqa: E402  (tools/plot.py)


# ---- reliability: resume and Ctrl-C
def start_script(script, *args):
    """`python script args` left running, to send it a signal: the Popen, with stderr in a pipe
    and stdout dropped."""
    return subprocess.Popen([sys.executable, script, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, **_offline())


def test_resume_reproduces_a_straight_run_with_ema_state(monkeypatch, neox_dir, tmp_path):
    common = ["--model", neox_dir, "--prompts_per_step", "4", "--samples_per_prompt", "2",
              "--eval_size", "4", "--baseline", "ema", "--lr", "1e-3", "--save_every", "2",
              "--rewards", "math,length"]
    run_main(monkeypatch, R, *common, "--output_dir", str(tmp_path / "a"), "--max_steps", "4")
    run_main(monkeypatch, R, *common, "--output_dir", str(tmp_path / "b"), "--max_steps", "2",
             "--save_optimizer")  # the finished run's checkpoint keeps AdamW: it may go on
    run_main(monkeypatch, R, "--resume", str(tmp_path / "b"), "--max_steps", "4")
    a = read_metrics(tmp_path / "a")
    b = read_metrics(tmp_path / "b")
    for key in ("reward", "loss", "baseline_ema", "grad_norm"):
        assert [x[key] for x in a] == pytest.approx([x[key] for x in b], rel=1e-5), key


def test_a_finished_runs_checkpoint_keeps_no_optimizer_state_unless_asked(monkeypatch, tmp_path,
                                                                          capsys):
    """A finished run's last checkpoint holds the model and no AdamW moments (twice the model's
    size: 1 GB for a 135 M model), so --resume refuses it in one line; a checkpoint written
    mid-run keeps them (resumed exactly: the tests above), and so does --save_optimizer's."""
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--save_every", "1",
             "--output_dir", out)
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 2 and "optimizer" not in state
    AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--resume", out, "--max_steps", "3", guard=True)
    line = one_error_line(capsys)
    assert e.value.code == 2 and "holds no optimizer state (--save_optimizer keeps it)" in line
    assert f"a new run with --model {out}/checkpoint" in line
    kept = tmp_path / "kept"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "1", "--save_optimizer",
             "--output_dir", kept)
    state = torch.load(kept / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 1 and state["optimizer"]["state"]


def test_resume_without_max_steps_continues_to_the_runs_own(monkeypatch, tmp_path, capsys):
    """Interrupted at step 2 of 4 (Ctrl-C, faked), `--resume DIR` alone finishes steps 3-4: not the
    script's default max_steps. Samples are cut back too, and changed settings are refused."""
    out = tmp_path / "run"
    real_log = runs.log_step

    def log_step(run, metrics, *a):
        real_log(run, metrics, *a)
        if metrics["step"] == 2 and run.state is None:
            runs.STOP["requested"] = True  # as Ctrl-C does
    monkeypatch.setattr(runs, "log_step", log_step)
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "4", "--output_dir", str(out))
    assert e.value.code == 130
    assert "final held-out eval is skipped" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["interrupted"] and summary["eval_after"] is None  # null, not a bare NaN
    with open(out / "samples.jsonl", "a") as f:  # as if killed after a later step's samples
        f.write(json.dumps({"step": 3, "samples": []}) + "\n")
    runs.STOP["requested"] = False
    with pytest.raises(UserError, match="--lr 0.5 differs from the resumed run's 0.0001"):
        run_main(monkeypatch, grpo, "--resume", str(out), "--lr", "0.5")
    state_path = out / "checkpoint" / "trainer_state.pt"  # as if the first part took 1000 s
    state = torch.load(state_path, weights_only=True)
    assert 0 < state["wall_time_s"] < 600
    torch.save({**state, "wall_time_s": 1000.0}, state_path)
    run_main(monkeypatch, grpo, "--resume", str(out))
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]
    wall = json.loads((out / "summary.json").read_text())["wall_time_s"]
    assert 1000 < wall < 1600  # the whole run's: the first part's time and the resumed part's
    lines = (out / "samples.jsonl").read_text().splitlines()
    samples = [json.loads(line)["step"] for line in lines]
    assert samples == [1]  # the stale step-3 line is gone
    assert not (out / "run.lock").exists()


def test_sigint_saves_a_checkpoint_and_resume_continues(tmp_path, monkeypatch, capsys):
    """A real Ctrl-C (SIGINT) to `python grpo.py`: exit 130, a checkpoint of the step it stopped
    at; then resumes (in this process: no second start-up), a half-saved checkpoint, and the
    refusals of another script's resume and of a new run in the same folder. A user's notes in
    that folder stay byte for byte through all of it."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_bytes(b"seed 0, lr 1e-4\n")
    p = start_script("grpo.py", "--max_steps", "400", "--save_every", "4", "--eval_every", "0",
                     "--eval_size", "50", "--output_dir", str(out))
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 300
    while time.time() < deadline and not ((out / "checkpoint").exists() and metrics.exists()
                                          and len(metrics.read_text().splitlines()) >= 6):
        time.sleep(0.5)
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=300)
    assert p.returncode == 130, err[-2000:]
    # the step under way when Ctrl-C came is abandoned (Keeper.steps); the last one is saved
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=False)
    stopped = state["step"]
    assert 6 <= stopped < 400 and len(read_metrics(out)) == stopped
    assert f"the checkpoint of step {stopped} resumes exactly" in err or "finishing" in err
    # the checkpoint is a plain HF model folder
    AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    run_main(monkeypatch, grpo, "--resume", str(out), "--max_steps", str(stopped + 3),
             "--save_optimizer")  # kept by the later resumes: each extends a finished run
    steps = [m["step"] for m in read_metrics(out)]
    assert steps == list(range(1, stopped + 4))  # no step duplicated or missing
    # killed while saving: a half-deleted checkpoint.old/ must not break the next save, and a kill
    # between the two renames (checkpoint/ already moved to checkpoint.old/, the new one not yet in
    # place) must still resume
    (out / "checkpoint.old").mkdir()
    (out / "checkpoint.old" / "partial.bin").write_bytes(b"x")
    run_main(monkeypatch, grpo, "--resume", str(out), "--max_steps", str(stopped + 4))
    assert not (out / "checkpoint.old").exists()
    os.replace(out / "checkpoint", out / "checkpoint.old")
    capsys.readouterr()
    run_main(monkeypatch, grpo, "--resume", str(out), "--max_steps", str(stopped + 5))
    assert f"resumed {out} at step {stopped + 4}" in capsys.readouterr().out
    steps = [m["step"] for m in read_metrics(out)]
    assert steps == list(range(1, stopped + 6))
    # another script's run
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, ppo, "--resume", str(out), "--max_steps", str(stopped + 9),
                 guard=True)
    assert e.value.code == 2 and "made by grpo.py" in one_error_line(capsys)
    # a new run may not reuse the folder
    before = (out / "metrics.jsonl").read_text()
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--output_dir", str(out), "--max_steps", "2", guard=True)
    assert e.value.code == 2 and "already holds a run" in one_error_line(capsys)
    assert (out / "metrics.jsonl").read_text() == before
    assert (out / "notes.txt").read_bytes() == b"seed 0, lr 1e-4\n"


def test_a_second_ctrl_c_in_a_save_and_a_backwards_resume_get_one_line(tmp_path, monkeypatch,
                                                                      capsys):
    """A second Ctrl-C quits at once (runs._on_sigint raises KeyboardInterrupt), also inside a
    save: one line, no traceback, exit 130, the last complete checkpoint intact, and --resume
    goes on. A --max_steps below the checkpoint's step is refused: the loop would do nothing and
    report the run as finished."""
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--save_every", "1",
             "--save_optimizer", "--output_dir", out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--resume", out, "--max_steps", "1", guard=True)
    line = one_error_line(capsys)
    assert e.value.code == 2 and "--max_steps 1 is below the step of" in line, line
    assert "checkpoint (2)" in line and "--max_steps 2 or more" in line
    real_save = torch.save

    def second_ctrl_c(*a, **kw):  # trainer_state.pt is written after the weights: mid-save
        raise KeyboardInterrupt
    monkeypatch.setattr(runs.torch, "save", second_ctrl_c)
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--resume", out, "--max_steps", "3", guard=True)
    err = capsys.readouterr().err
    assert e.value.code == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == "interrupted: the last complete checkpoint is intact"
    monkeypatch.setattr(runs.torch, "save", real_save)
    assert torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=True)["step"] == 2
    run_main(monkeypatch, grpo, "--resume", out, "--max_steps", "3")
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]


# ---- reliability: out of memory, a full disk, non-finite updates
def test_out_of_memory_exits_1_with_advice_and_keeps_the_checkpoint(monkeypatch, tmp_path, capsys):
    """An OOM at step 3 (faked: no GPU here) ends with one line saying what to change; steps 1-2
    stay saved."""
    calls = []
    real_sample = C.sample

    def sample(*a, **kw):
        calls.append(1)
        if len(calls) == 4:  # 1: the eval before training, 2-3: steps 1-2
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB\n"
                                         "more details")
        return real_sample(*a, **kw)
    monkeypatch.setattr(C, "sample", sample)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--eval_size", "20", "--save_every", "1",
                 "--output_dir", str(out), guard=True)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert e.value.code == 1
    assert "out of memory (CUDA out of memory. Tried to allocate 20.00 GiB)" in err
    assert "--micro_batch_size" in err and "--gradient_checkpointing" in err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert loading.load_model(str(out / "checkpoint"), "lm", torch.device("cpu")) is not None


def test_a_cpu_allocation_that_fails_is_out_of_memory_too(capsys):
    """On a CPU torch says so with a RuntimeError (DefaultCPUAllocator), not OutOfMemoryError:
    the same one line, exit 1; any other RuntimeError keeps its traceback."""
    def alloc():
        torch.empty(2**62, dtype=torch.uint8)  # 4 EiB: refused at once, on every machine
    with pytest.raises(SystemExit) as e:
        runs.main_guard(alloc)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 1 and len(err) == 1 and "error: out of memory (" in err[0], err
    with pytest.raises(RuntimeError, match="not memory"):
        runs.main_guard(lambda: (_ for _ in ()).throw(RuntimeError("not memory")))


def test_a_full_disk_while_saving_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    real_save = torch.save
    calls = []

    def save(obj, path, *a, **kw):
        calls.append(path)
        if len(calls) == 2:
            raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos")
        return real_save(obj, path, *a, **kw)
    monkeypatch.setattr(runs.torch, "save", save)
    with pytest.raises(UserError, match="could not write .*checkpoint.tmp .* free some space"):
        run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--save_every", "1",
                 "--output_dir", str(tmp_path / "run"))
    state = torch.load(tmp_path / "run" / "checkpoint" / "trainer_state.pt", weights_only=False)
    assert state["step"] == 1 and not (tmp_path / "run" / "checkpoint.tmp").exists()


def test_nonfinite_update_is_skipped_and_counted(tmp_path, monkeypatch):
    """A NaN reward at step 2 is skipped and counted (metrics keep steps 1 and 3); ten in a row
    stop."""
    run = runs.Run(dir=str(tmp_path), algo="grpo", args=None, state=None, metrics=None,
                   samples=None)
    keep = runs.Keeper(run, None, None, None, None)
    for _ in range(9):
        assert not keep.finite(torch.tensor(float("nan")))
    with pytest.raises(UserError, match="NaN or inf in 10 updates in a row"):
        keep.finite(torch.tensor(float("inf")))
    calls = []
    real = C.compute_rewards

    def rewards(*a, **kw):  # call 1 scores the held-out eval before training, call 3 step 2
        calls.append(1)
        total, parts = real(*a, **kw)
        return (total * float("nan") if len(calls) == 3 else total), parts
    monkeypatch.setattr(C, "compute_rewards", rewards)
    out = tmp_path / "out"
    run_main(monkeypatch, grpo, "--max_steps", "3", "--eval_size", "10", "--output_dir", str(out))
    summary = json.loads((out / "summary.json").read_text())
    steps = [m["step"] for m in read_metrics(out)]
    assert summary["nonfinite_skips"] == 1 and steps == [1, 3]



def test_only_an_update_ends_a_row_of_nonfinite_skips():
    """keep.finite guards the rewards (what="reward") and the gradients alike, and only a finite
    gradient (an update) ends a row of skipped updates: ten steps whose rewards are finite and
    whose gradients are NaN stop the run."""
    run = runs.Run(dir="", algo="grpo", args=None, state=None, metrics=None, samples=None)
    keep, nan = runs.Keeper(run, None, None, None, None), torch.tensor(float("nan"))
    for _ in range(9):
        assert keep.finite(torch.tensor(1.0), what="reward") and not keep.finite(nan)
    assert keep.finite(torch.tensor(2.0)) and run.nonfinite_in_row == 0  # an update
    for _ in range(9):
        assert keep.finite(torch.tensor(1.0), what="reward") and not keep.finite(nan)
    with pytest.raises(UserError, match="loss or gradient was NaN or inf in 10 updates in a row"):
        keep.finite(torch.tensor(1.0), what="reward") and keep.finite(nan)
    assert run.nonfinite == 19


# ---- reliability: planted pickles, non-finite rewards, damaged files, relative paths
class Payload:  # unpickling this calls builtins.open(path, "w"): code that runs on load
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (builtins.open, (self.path, "w"))


def test_a_pickled_object_in_trainer_state_is_refused_and_never_runs(tmp_path, monkeypatch,
                                                                     capsys):
    """--resume reads trainer_state.pt with weights_only=True: what the scripts write loads so,
    and a planted object is refused in one line without running."""
    run = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "1", "--save_optimizer",
             "--output_dir", run)
    path = run / "checkpoint" / "trainer_state.pt"
    state = torch.load(path, weights_only=True)  # a plain state: tensors, numbers, lists
    assert state["step"] == 1 and isinstance(state["rngs"][0][0], torch.Tensor)
    marker = tmp_path / "ran"
    torch.save({**state, "extra": Payload(str(marker))}, path)
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--resume", run, "--max_steps", "2", guard=True)
    line = one_error_line(capsys)
    assert e.value.code == 2 and "trainer_state.pt holds io.open, not only tensors" in line
    assert "could run code, so it is refused" in line and not marker.exists()


NONFINITE_REWARDS = """
def nan(completions, rows):
    return [float("nan")] * len(completions)


def inf(completions, rows):
    return [float("inf")] * len(completions)


def huge(completions, rows):
    return [1e300] * len(completions)
"""


def test_a_reward_that_is_nan_every_step_stops_in_one_line_and_keeps_the_folder(
        tmp_path, monkeypatch, capsys):
    (tmp_path / "bad.py").write_text(NONFINITE_REWARDS)
    out = tmp_path / "nan"
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *FAST_GRPO, "--reward_fn", f"{tmp_path / 'bad.py'}:nan",
                 "--max_steps", "12", "--output_dir", out, guard=True)
    line = one_error_line(capsys)
    assert e.value.code == 2 and "the reward was NaN or inf in 10 updates in a row" in line
    assert "no checkpoint yet" in line and (out / "metrics.jsonl").exists()
    for fn in ("inf", "huge"):  # inf, and a float that overflows to inf, count as NaN does
        out = tmp_path / fn
        with pytest.raises(SystemExit) as e:  # fewer steps than 10: the end of the run says it
            run_main(monkeypatch, grpo, *FAST_GRPO, "--reward_fn", f"{tmp_path / 'bad.py'}:{fn}",
                     "--max_steps", "3", "--output_dir", out, guard=True)
        line = one_error_line(capsys)
        assert e.value.code == 2 and "every update of this run was skipped" in line, line
        assert out.is_dir() and not (out / "summary.json").exists()


@pytest.mark.parametrize("weight", ["nan", "inf", "-inf"])
def test_a_non_finite_reward_weight_is_refused_up_front(weight, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit):
        run_main(monkeypatch, grpo, "--rewards", f"math={weight}", "--output_dir",
                 tmp_path / "out", guard=True)
    line = one_error_line(capsys)
    assert "the weight of 'math' must be finite and not 0" in line
    assert line.endswith(f"not {weight}")
    assert not (tmp_path / "out").exists()


def test_a_diverged_policy_stops_naming_the_step(tmp_path, monkeypatch, capsys):
    """--lr 1e10: after an update the logits overflow, and the next step cannot sample."""
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *FAST_GRPO, "--lr", "1e10", "--max_steps", "5",
                 "--output_dir", out, guard=True)
    line = one_error_line(capsys)
    found = re.search(r"the policy diverged \(NaN/inf\): step (\d) cannot sample; lower --lr", line)
    assert e.value.code == 2 and found, line
    assert [m["step"] for m in read_metrics(out)] == list(range(1, int(found[1])))


def test_a_checkpoint_is_never_written_from_nan_weights(tmp_path, monkeypatch, capsys):
    run_dir = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "1", "--output_dir", run_dir)
    model, tok = loading.load_policy(grpo.Args(), torch.device("cpu"), str(run_dir / "checkpoint"))
    opt = torch.optim.AdamW(model.parameters())
    run = runs.Run(dir=str(run_dir), algo="grpo", args=grpo.Args(), state=None, metrics=None,
                   samples=None, saved_step=1)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(UserError, match="the weights are NaN or inf after step 2.*the "
                                          "checkpoint of step 1"):
        runs.save_checkpoint(run, model, tok, opt, random.Random(0), 2, {})
    state = torch.load(run_dir / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 1
    model.float()
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("inf")
    with pytest.raises(UserError, match=r"diverged \(NaN/inf\): step 4 cannot"):
        with runs.Keeper(run, None, None, None, None).sampling(model, 3):
            C.sample(model, tok, C.encode_prompts(tok, ["1+1="]), 2)


def test_a_full_disk_inside_safetensors_is_one_line_and_leaves_no_tmp(tmp_path, monkeypatch):
    """safetensors raises its own SafetensorError (not OSError) on a full disk: measured on a
    64 KB tmpfs, "Error while serializing: I/O error: No space left on device (os error 28)"."""
    import safetensors
    import transformers.modeling_utils as mu
    real, calls = mu.safe_save_file, []

    def save_file(*a, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise safetensors.SafetensorError("Error while serializing: I/O error: No space left "
                                              "on device (os error 28)")
        return real(*a, **kw)
    monkeypatch.setattr(mu, "safe_save_file", save_file)
    out = tmp_path / "run"
    with pytest.raises(UserError, match="could not write .*checkpoint.tmp .*No space left"):
        run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--save_every", "1",
                 "--output_dir", out)
    state = torch.load(out / "checkpoint" / "trainer_state.pt", weights_only=True)
    assert state["step"] == 1 and not (out / "checkpoint.tmp").exists()


def test_a_damaged_metrics_line_is_skipped_with_a_warning(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--save_every", "1",
             "--save_optimizer", "--output_dir", out)
    lines = (out / "metrics.jsonl").read_text().splitlines(keepends=True)
    (out / "metrics.jsonl").write_text("".join(["{not json\n", *lines[1:]]))
    assert [m["step"] for m in plot.read_metrics(str(out))] == [2]
    assert "metrics.jsonl, line 1 is damaged" in capsys.readouterr().err
    run_main(monkeypatch, grpo, "--resume", out, "--max_steps", "3")
    assert "metrics.jsonl, line 1 is damaged" in capsys.readouterr().err
    assert [m["step"] for m in read_metrics(out)] == [2, 3]


def test_a_run_with_relative_paths_resumes_from_another_folder(tmp_path, monkeypatch):
    """--data and --reward_fn given relative to the run's folder are stored absolute; resuming
    from elsewhere finds them, and naming them by their absolute paths is no change."""
    work = tmp_path / "work"
    work.mkdir()
    write_jsonl(work / "data.jsonl", [{"prompt": f"{a}+{b}=", "answer": str(a + b)}
                                      for a, b in tasks.task_train_pairs(random.Random(0), 40)])
    (work / "mine.py").write_text(REWARD_FILE.replace('row["target"]', 'row["answer"]'))
    monkeypatch.chdir(work)
    run_main(monkeypatch, grpo, *FAST_GRPO, "--data", "data.jsonl", "--reward_fn",
             "mine.py:exact", "--max_steps", "1", "--save_optimizer", "--output_dir",
             tmp_path / "run")
    saved = json.loads((tmp_path / "run" / "checkpoint" / "args.json").read_text())["args"]
    assert saved["data"] == str(work / "data.jsonl")
    assert saved["reward_fn"] == [f"{work / 'mine.py'}:exact"]
    monkeypatch.chdir(tmp_path)
    run_main(monkeypatch, grpo, "--resume", tmp_path / "run", "--max_steps", "2",
             "--data", work / "data.jsonl")
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1, 2]


# ---- reliability: --sanity
def test_sanity_flag_passes_on_the_bundled_model_and_catches_dropout(tmp_path, tok, monkeypatch,
                                                                    capsys):
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--sanity", "--output_dir", tmp_path / "run")
    assert e.value.code == 0 and "sanity: all checks passed" in capsys.readouterr().out
    cfg = tiny_config("gpt2")
    cfg.resid_pdrop = cfg.embd_pdrop = cfg.attn_pdrop = 0.5
    torch.manual_seed(0)
    # dropout on: log-probs are noisy, ratio != 1
    model = AutoModelForCausalLM.from_config(cfg).train()
    args = SimpleNamespace(chat_template="none", max_new_tokens=6, temperature=1.0, top_p=1.0,
                           micro_batch_size=8, dtype="fp32", stop=[])
    failed = runs.sanity_check(model, None, tok, [{"prompt": p} for p in PROMPTS], args)
    assert any("ratio" in f for f in failed)


def test_sanity_checks_multi_turn_transcripts(tmp_path, monkeypatch, capsys):
    """--sanity with --env calc samples multi-turn episodes (observations between the model's
    turns) and checks the model tokens' log-probs against one training forward over each whole
    transcript: it passes on the bundled calculator model."""
    seen, real = [], C.generate
    monkeypatch.setattr(C, "generate", lambda *a, **k: seen.append(real(*a, **k)) or seen[-1])
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--env", "calc", "--sanity", "--output_dir", tmp_path / "r")
    assert e.value.code == 0 and "sanity: all checks passed" in capsys.readouterr().out
    assert (seen[0][0].tool_calls > 0).any() and (seen[0][0].completion_mask == 0).any()


# ---- a run folder that cannot run code
PLANTED = '''
import pathlib
pathlib.Path({marker!r}).write_text("ran")  # runs when the module is imported
from transformers import LlamaConfig, LlamaForCausalLM


class PlantedConfig(LlamaConfig):
    pass


class PlantedModel(LlamaForCausalLM):
    config_class = PlantedConfig
'''


def test_resume_takes_trust_remote_code_from_the_command_line_only(tmp_path, monkeypatch):
    """A run folder whose args.json says trust_remote_code true and whose checkpoint config names
    code (an auto_map, and the file) runs nothing on --resume: the setting comes from the command
    line alone, where it may differ from the saved one."""
    run = tmp_path / "run"
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "1", "--output_dir", run,
             "--save_optimizer")  # so that --resume may extend the finished run
    marker, ckpt = tmp_path / "ran", run / "checkpoint"
    (ckpt / "planted.py").write_text(PLANTED.format(marker=str(marker)))
    config = json.loads((ckpt / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "planted.PlantedConfig",
                          "AutoModelForCausalLM": "planted.PlantedModel"}
    (ckpt / "config.json").write_text(json.dumps(config))
    saved = json.loads((ckpt / "args.json").read_text())
    saved["args"]["trust_remote_code"] = True
    (ckpt / "args.json").write_text(json.dumps(saved))
    run_main(monkeypatch, grpo, "--resume", run, "--max_steps", "2")
    assert not marker.exists() and [m["step"] for m in read_metrics(run)] == [1, 2]
    for given in ([], ["--trust_remote_code"]):  # what the command line says, never refused
        monkeypatch.setattr(sys, "argv", ["grpo.py", "--resume", str(run), *given])
        assert flags.parse_args(grpo.Args, "grpo").trust_remote_code == bool(given)


@pytest.mark.parametrize("flag", ["--env", "--reward_fn", "--tools"])
def test_a_file_that_exits_or_is_interrupted_while_imported_gets_one_line(flag, tmp_path,
                                                                          monkeypatch, capsys):
    """sys.exit(0) at a file's top level would end the run with exit 0 and no word: one line,
    exit 2. Ctrl-C there (faked: KeyboardInterrupt) comes before any run folder: it says so."""
    (tmp_path / "quits.py").write_text("import sys\nsys.exit(0)\n\n\ndef f(*a):\n    pass\n")
    (tmp_path / "stops.py").write_text("raise KeyboardInterrupt\n")
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, flag, f"{tmp_path / 'quits.py'}:f", "--output_dir", out,
                 guard=True)
    line = one_error_line(capsys)
    assert e.value.code == 2 and f"error: {flag} " in line, line
    assert "quits.py' called sys.exit(0): the file is imported, not run" in line
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, flag, f"{tmp_path / 'stops.py'}:f", "--output_dir", out,
                 guard=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 130 and err == ["interrupted before the run began: nothing was written"]
    assert not out.exists()


# ---- data files that would be a traceback, a silent mistake, or minutes of tokenizing
def test_data_files_with_long_fields_repeated_columns_or_deep_nesting(tmp_path):
    """A CSV field over csv's 128 KB default reads; a repeated header column (DictReader would
    keep the last, silently) and JSON nested past Python's recursion limit are one line."""
    (tmp_path / "long.csv").write_text("prompt,answer\n" + "1" * 200_000 + "+1=,2\n1+1=,2\n")
    rows = tasks.read_rows(str(tmp_path / "long.csv"))
    assert [len(r["prompt"]) for r in rows] == [200_003, 4]
    (tmp_path / "twice.csv").write_text("prompt,answer,prompt\n1+1=,2,3+3=\n")
    with pytest.raises(UserError, match=r"twice.csv': the header line names column 'prompt' "
                                          "twice; rename one$"):
        tasks.read_rows(str(tmp_path / "twice.csv"))
    deep = '{"prompt": "1+1=", "meta": ' + "[" * 100_000 + "]" * 100_000 + "}"
    write_jsonl(tmp_path / "deep.jsonl", [{"prompt": "1+1="}, deep])
    (tmp_path / "deep.json").write_text(f'[{{"prompt": "1+1="}}, {deep}]')
    for name, where in (("deep.jsonl", "deep.jsonl, line 2"), ("deep.json", "deep.json, line 1")):
        with pytest.raises(UserError, match=f"{where}: not valid JSON .nested too deeply"):
            tasks.read_rows(str(tmp_path / name))


def test_a_huge_prompt_is_refused_before_it_is_tokenized(tmp_path, monkeypatch, capsys):
    """A token stands for at most as many characters as its text in the vocabulary, so a prompt
    longer than that many per token of the context is refused without tokenizing it (a 20 MB row
    took 90 s and 4 GB): the tokenizer never sees it."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)}
            for a, b in tasks.task_train_pairs(random.Random(0), 30)]
    huge = {"prompt": "1+2 " * 500_000, "answer": "3"}
    path = write_jsonl(tmp_path / "huge.jsonl", rows + [huge])
    seen, real = [], C.encode_prompts
    monkeypatch.setattr(C, "encode_prompts", lambda tok, prompts, *a, **k: seen.append(
        max(len(C.as_text(p)) for p in prompts)) or real(tok, prompts, *a, **k))
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *FAST_GRPO, "--data", path, "--output_dir", tmp_path / "o",
                 guard=True)
    line = one_error_line(capsys)
    assert e.value.code == 2 and "a prompt of 2,000,000 characters is too long" in line, line
    assert "exceeds the model's context of 64 tokens" in line and max(seen, default=0) < 100


USER_RANDOMNESS = '''
import random

import numpy


def noisy(row, turns):  # an observation drawn from Python's and numpy's global RNGs
    return f" {random.randrange(10)}{numpy.random.randint(10)} " if len(turns) == 1 else None


def luck(completions, rows):
    return [random.random() + numpy.random.rand() for _ in completions]
'''


def test_resume_is_exact_with_an_env_and_a_reward_that_use_random(tmp_path, monkeypatch):
    """Python's and numpy's global RNG states are saved beside torch's: a run resumed at step 2
    logs exactly the metrics and samples of the same run made straight to step 4."""
    (tmp_path / "mine.py").write_text(USER_RANDOMNESS)
    mine = str(tmp_path / "mine.py")
    common = [*FAST_GRPO, "--env", f"{mine}:noisy", "--max_turns", "2", "--reward_fn",
              f"{mine}:luck", "--save_every", "2", "--lr", "1e-3"]
    run_main(monkeypatch, grpo, *common, "--output_dir", tmp_path / "a", "--max_steps", "4")
    run_main(monkeypatch, grpo, *common, "--output_dir", tmp_path / "b", "--max_steps", "2",
             "--save_optimizer")  # so that --resume may extend the finished run
    random.seed(7)  # what the process draws between runs does not matter
    run_main(monkeypatch, grpo, "--resume", tmp_path / "b", "--max_steps", "4")
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert len(a) == len(b) == 4 and a[3]["tool_calls"] > 0
    for key in ("reward", "loss", "grad_norm", "kl"):
        assert [m[key] for m in a] == [m[key] for m in b], key
    assert (tmp_path / "a" / "samples.jsonl").read_text() == \
        (tmp_path / "b" / "samples.jsonl").read_text()
