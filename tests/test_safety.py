"""Safety: no command deletes what it did not write; no flag combination trains backwards or to
NaN without a word (MaxRL, GDPO); one-line refusals of flags no float can hold."""
import os
import re
from types import SimpleNamespace

import pytest
import torch

import common as C
import distill
from plumbing.errors import UserError
from plumbing import runs
import grpo
import objectives
import reinforce
from tools import smollm2

from tests.helpers import (FAST_GRPO, _offline, grpo_loss, one_error_line, read_metrics,
                           run_main)


# ---- no command deletes what it did not write
def fake_conversion(tmp):
    """What convert() writes, as tiny files: the swap is tested without a 20-40 s conversion."""
    os.makedirs(tmp)
    for name in smollm2.FILES:
        with open(os.path.join(tmp, name), "w") as f:
            f.write("new")


def test_smollm2_out_refuses_a_folder_that_is_not_its_own_output(tmp_path, monkeypatch):
    """--out models, --out ., a folder with a user's file, a file, a link: one line, and every
    byte stays. A trailing slash is stripped; an earlier conversion is swapped, not merged."""
    models = tmp_path / "models"
    (models / "SmolLM2-135M-Instruct").mkdir(parents=True)
    (models / "tiny-policy").mkdir()
    (models / "tiny-policy" / "config.json").write_text("mine")
    user = tmp_path / "work"
    user.mkdir()
    (user / "notes.txt").write_text("a week of work")
    (user / "config.json").write_text("mine")
    (tmp_path / "file").write_text("x")
    os.symlink(user, tmp_path / "link")
    monkeypatch.chdir(user)
    for out in (str(models), str(models) + "/", str(user), ".", "", str(tmp_path / "file"),
                str(tmp_path / "link"), str(tmp_path)):
        with pytest.raises(UserError, match=r"--out .*(does not write|link or a file)"):
            smollm2.replace_folder(smollm2.check_out(out), fake_conversion)
    assert (user / "notes.txt").read_text() == "a week of work"
    assert (models / "tiny-policy" / "config.json").read_text() == "mine"
    # a leftover out.tmp that is not a killed conversion's is refused too, not removed
    (tmp_path / "new.tmp").mkdir()
    (tmp_path / "new.tmp" / "keep.txt").write_text("x")
    with pytest.raises(UserError, match="new.tmp holds 1 thing"):
        smollm2.check_out(str(tmp_path / "new"))
    assert (tmp_path / "new.tmp" / "keep.txt").exists()
    # its own output: a new folder (slash stripped), then an earlier conversion, replaced whole
    out = smollm2.check_out(str(models / "SmolLM2-135M-Instruct") + "/")
    assert out == str(models / "SmolLM2-135M-Instruct")
    smollm2.replace_folder(out, fake_conversion)
    (models / "SmolLM2-135M-Instruct" / "config.json").write_text("old")
    os.remove(models / "SmolLM2-135M-Instruct" / "tokenizer.json")  # an older, partial one
    smollm2.replace_folder(smollm2.check_out(out), fake_conversion)
    assert sorted(os.listdir(out)) == sorted(smollm2.FILES)
    assert (models / "SmolLM2-135M-Instruct" / "config.json").read_text() == "new"
    assert sorted(os.listdir(models)) == ["SmolLM2-135M-Instruct", "tiny-policy"]  # no .tmp/.old


def test_smollm2_conversion_killed_midway_leaves_the_old_folder_whole(tmp_path):
    """A write that fails (a full disk, a kill) leaves the earlier conversion as it was."""
    out = str(tmp_path / "m")
    smollm2.replace_folder(out, fake_conversion)

    def fails(tmp):
        os.makedirs(tmp)
        raise OSError("No space left on device")
    with pytest.raises(OSError):
        smollm2.replace_folder(smollm2.check_out(out), fails)
    assert sorted(os.listdir(out)) == sorted(smollm2.FILES)
    smollm2.replace_folder(smollm2.check_out(out), fake_conversion)  # its .tmp is its own: redone
    assert not os.path.exists(out + ".tmp")


def test_merge_lora_out_refuses_a_folder_a_merge_did_not_write(tmp_path):
    """--out a folder of the user's (or its .tmp): refused before anything is read or written;
    an earlier merge's folder (model files only) may be replaced."""
    from tools.merge_lora import check_out, merge
    (tmp_path / "run" / "checkpoint").mkdir(parents=True)
    (tmp_path / "run" / "checkpoint" / "args.json").write_text("{}")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.json").write_text("mine")
    (mine / "train.py").write_text("mine")
    for out in (str(mine), str(mine) + "/", str(tmp_path)):
        with pytest.raises(UserError, match="which a merge does not write"):
            merge(str(tmp_path / "run"), out)
    assert (mine / "config.json").read_text() == "mine"
    (tmp_path / "m.tmp").mkdir()
    (tmp_path / "m.tmp" / "notes.txt").write_text("x")
    with pytest.raises(UserError, match="m.tmp holds notes.txt"):
        check_out(str(tmp_path / "m"))
    earlier = tmp_path / "merged"
    earlier.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", "chat_template.jinja",
                 "model-00001-of-00002.safetensors", "model.safetensors.index.json"):
        (earlier / name).write_text("")
    assert check_out(str(earlier) + "/") == str(earlier)


def users_files(folder):
    """{path: bytes} of every file under folder that no run writes (the user's)."""
    out = {}
    for top, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(top, name)
            if os.path.relpath(path, folder).split(os.sep)[0] not in runs.RUN_NAMES:
                with open(path, "rb") as f:
                    out[path] = f.read()
    return out


def test_a_shell_log_or_tee_in_the_output_dir_is_left_to_the_shell(tmp_path):
    """`mkdir D; python grpo.py --output_dir D > D/log 2>&1` and `... | tee D/train.log`, through
    a real shell: the shell makes the log before the script starts; the run goes on beside it
    and the log holds the run's own report."""
    import subprocess
    import sys
    redirected, teed = tmp_path / "redirected", tmp_path / "teed"
    redirected.mkdir()
    teed.mkdir()
    python = f"{sys.executable} grpo.py {' '.join(FAST_GRPO)} --max_steps 1 --output_dir"
    for line in (f"{python} {redirected} > {redirected}/log 2>&1",
                 f"{python} {teed} 2>&1 | tee {teed}/train.log"):  # (tee's exit status)
        p = subprocess.run(["sh", "-c", line], capture_output=True, timeout=600, **_offline())
        assert p.returncode == 0, p.stdout[-800:] + p.stderr[-800:]
    for log in (redirected / "log", teed / "train.log"):
        assert f"wrote {log.parent}/: metrics.jsonl" in log.read_text()
        assert len(read_metrics(log.parent)) == 1


def test_output_dir_beside_a_users_files_trains_resumes_and_never_touches_them(
        tmp_path, monkeypatch, capsys):
    """A folder holding a user's notes, a config and a folder of theirs: a run writes its own
    names beside them, --resume goes on there, and every byte of theirs stays. A new run in that
    folder is refused (the run's names are there), naming what still works: --resume, or
    another folder (both run here)."""
    out = tmp_path / "mine"
    (out / "data").mkdir(parents=True)
    (out / "notes.md").write_bytes(b"lr 1e-4 was too high\n\xff not even utf-8\n")
    (out / "config.yaml").write_text("lr: 1e-4\n")
    (out / "data" / "checkpoint").write_text("a file of theirs named like ours, one level down")
    theirs = users_files(out)
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--save_every", "1",
             "--save_optimizer", "--output_dir", out, guard=True)
    assert users_files(out) == theirs and (out / "checkpoint" / "args.json").exists()
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "2", "--output_dir", out,
                 guard=True)
    line = one_error_line(capsys)
    assert e.value.code == 2 and "already holds a run (metrics.jsonl, samples.jsonl" in line
    assert f"continue it with --resume {out}, or choose another --output_dir" in line
    run_main(monkeypatch, grpo, "--resume", out, "--max_steps", "3", guard=True)  # what works
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "1", "--output_dir",
             tmp_path / "another", guard=True)  # ... and another folder
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3]
    assert users_files(out) == theirs
    assert sorted(os.listdir(out)) == sorted(["notes.md", "config.yaml", "data", "metrics.jsonl",
                                              "samples.jsonl", "summary.json", "checkpoint",
                                              *(["curves.png"] if os.path.exists(
                                                  out / "curves.png") else [])])
    # a run that fails before its first step leaves the folder as it was: no empty files
    failed = tmp_path / "failed"
    failed.mkdir()
    (failed / "log").write_text("")
    with pytest.raises(SystemExit):
        run_main(monkeypatch, grpo, *FAST_GRPO, "--model", tmp_path / "no-such-model",
                 "--output_dir", failed, guard=True)
    assert "no-such-model" in one_error_line(capsys) and os.listdir(failed) == ["log"]


def test_output_dir_holding_any_of_a_runs_names_is_refused_and_left_as_it_was(tmp_path,
                                                                              monkeypatch):
    """Each name a run writes (and would replace): refused in one line naming it, nothing written
    (no run.lock either); a checkpoint/ of the user's own is not replaced. An empty
    metrics.jsonl (a run that failed before its first step) holds nothing: no refusal."""
    monkeypatch.chdir(tmp_path)
    for name in runs.RUN_NAMES:
        folder = tmp_path / name.replace(".", "_")
        folder.mkdir()
        if "." in name:
            (folder / name).write_text("x")
        else:
            (folder / name).mkdir()
            (folder / name / "weights.bin").write_text("a week of training")
        (folder / "log").write_text("")
        before = users_files(folder), sorted(os.listdir(folder))
        with pytest.raises(UserError, match=rf"\({re.escape(name)}[,)].*another --output_dir"):
            runs.start_run(grpo.Args(output_dir=str(folder)), "grpo")
        assert (users_files(folder), sorted(os.listdir(folder))) == before
    assert (tmp_path / "checkpoint" / "checkpoint" / "weights.bin").read_text() == \
        "a week of training"
    with pytest.raises(UserError, match="--resume checkpoint, or choose another --output_dir"):
        runs.start_run(grpo.Args(output_dir="checkpoint"), "grpo")
    with pytest.raises(UserError, match="move them or choose another --output_dir"):
        runs.start_run(grpo.Args(output_dir="summary_json"), "grpo")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text("")
    run = runs.start_run(grpo.Args(output_dir=str(empty)), "grpo")
    run.metrics.close()
    run.samples.close()
    runs._release_lock(run.dir)


def test_a_run_stopped_before_its_first_checkpoint_says_the_way_forward(tmp_path, monkeypatch,
                                                                        capsys):
    """S13: a run killed after logging steps but before its first save: neither a new run in
    its folder nor --resume points at the other; both say to start again elsewhere."""
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    for argv in (["--output_dir", out], ["--resume", out]):
        with pytest.raises(SystemExit):
            run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "3", *argv, guard=True)
        line = one_error_line(capsys)
        assert "stopped before its first checkpoint" in line and "another --output_dir" in line


def test_build_models_replaces_only_a_bundled_models_folder(tmp_path):
    """tools/build_models.py DEST replaces DEST/tiny-adder, ...: refused when one holds anything
    else (before the build); the bundled models themselves pass."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(C.__file__), "tools"))
    import build_models
    (tmp_path / "tiny-adder").mkdir()
    (tmp_path / "tiny-adder" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit, match="tiny-adder holds notes.txt, which this does not"):
        build_models.check_dest(str(tmp_path / "tiny-adder"))
    for name in ("tiny-adder", "tiny-adder-rm", "tiny-calc"):
        build_models.check_dest(os.path.join(os.path.dirname(C.__file__), "models", name))


# ---- no flag combination trains backwards or to NaN without a word
def naive_maxrl(rewards, G, eps=1e-4):
    """MaxRL's advantage, one group at a time, with the guard of AllenAI's open-instruct and
    Google's Tunix: A = (r - m) / (m + eps) for the group mean m > 0, else 0."""
    out = []
    for i in range(0, len(rewards), G):
        group = [float(r) for r in rewards[i:i + G]]
        m = sum(group) / G
        out += [(r - m) / (m + eps) if m > 0 else 0.0 for r in group]
    return torch.tensor(out)


def test_maxrl_advantages_with_rewards_of_both_signs_and_partial_credit_match_a_naive_loop():
    """grpo --scale_rewards mean and reinforce --baseline maxrl: non-0/1 rewards (0.5, 0.25,
    2.5) and negative ones, groups whose mean is < 0, exactly 0 with mixed signs (unguarded:
    +-1e4), and > 0 with a negative member. No advantage points against r - mean (the sign flip
    the unguarded formula gave for a group mean < 0)."""
    rewards = torch.tensor([1.0, 0.5, 0.25, 0.0,    # partial credit: mean 0.4375
                            -1.0, -0.5, 0.0, -2.0,  # all <= 0: mean < 0, A = 0
                            -1.0, 1.0, 0.0, 0.0,    # mean exactly 0, mixed signs: A = 0
                            2.5, -0.5, 0.0, 1.0,    # mean 0.75 > 0 with a negative reward
                            0.0, 0.0, 0.0, 0.0,     # no success: A = 0
                            -0.1, 0.05, 0.0, 0.0])  # mean -0.0125: unguarded, A ~ -8 for 0.05
    want = naive_maxrl(rewards, 4)
    got = grpo.group_advantages(rewards, 4, "mean")
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    centred = rewards - rewards.view(-1, 4).mean(1).repeat_interleave(4)
    assert (got * centred >= 0).all() and got[4:12].eq(0).all() and got[16:].eq(0).all()
    assert float(got.abs().max()) < 10  # no +-1e4 from a mean near 0
    mask = torch.ones(len(rewards), 3)
    mask[::3, 2] = 0  # ragged lengths: A on every real token, 0 on padding
    args = SimpleNamespace(baseline="maxrl", samples_per_prompt=4, whiten=False)
    adv = reinforce.advantages(reinforce.kl_returns(rewards, mask), mask, args)
    torch.testing.assert_close(adv, want[:, None] * mask, rtol=1e-6, atol=1e-6)


def test_gdpo_with_one_sample_per_prompt_gives_zero_as_trl_not_nan():
    """objectives.normalize_then_sum with groups of one: each reward's group std is TRL's 0, so
    every advantage is 0 (it was NaN, and the run stopped after 10 skipped updates); reinforce.py
    refuses the flags at start, since nothing could be learned."""
    parts = {"math": torch.tensor([1.0, 0.0, 1.0]), "format": torch.tensor([0.0, 1.0, 1.0])}
    got = objectives.normalize_then_sum(parts, {"math": 1.0, "format": 0.5}, 1)
    assert torch.equal(got, torch.zeros(3))


@pytest.mark.parametrize("script,argv,message", [
    (grpo, ["--scale_rewards", "mean", "--rewards", "math=1,length=1"],
     "--scale_rewards mean (MaxRL) divides by each group's mean reward, a success rate; "
     "--rewards length makes rewards negative"),
    (grpo, ["--scale_rewards", "mean", "--rewards", "math=1,format=-0.5"], "--rewards format"),
    (grpo, ["--scale_rewards", "mean", "--overlong_penalty", "1"], "--overlong_penalty makes"),
    (grpo, ["--scale_rewards", "mean", "--rewards", "math,format", "--multi_objective_aggregation",
            "normalize_then_sum"], "MaxRL would be ignored"),
    (reinforce, ["--baseline", "maxrl", "--rewards", "length"], "--baseline maxrl (MaxRL)"),
    (reinforce, ["--baseline", "maxrl", "--beta", "0.05"], "the KL penalty in the return"),
    (reinforce, ["--baseline", "maxrl", "--rewards", "math,format",
                 "--multi_objective_aggregation", "normalize_then_sum"], "GDPO's normalised"),
    (reinforce, ["--samples_per_prompt", "1", "--rewards", "math,format",
                 "--multi_objective_aggregation", "normalize_then_sum"],
     "GDPO) needs --samples_per_prompt >= 2"),
])
def test_flag_combinations_that_would_train_backwards_are_refused_in_one_line(
        script, argv, message, tmp_path, monkeypatch, capsys):
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, script, *argv, "--output_dir", tmp_path / "run", guard=True)
    assert e.value.code == 2 and message in one_error_line(capsys)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("flag", ["--clip_eps", "--clip_eps_high", "--seq_clip_eps",
                                  "--seq_clip_eps_high", "--tis_cap"])
def test_a_float_flag_beyond_float32_is_one_line_not_a_traceback(flag, tmp_path, monkeypatch,
                                                                 capsys):
    """S14: 1e39 passed the ranges (> 0) and failed in torch.clamp ("cannot be converted to type
    float without overflow"); every float flag is now checked against float32's largest."""
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, flag, "1e39", "--output_dir", tmp_path / "run", guard=True)
    assert e.value.code == 2 and f"{flag} 1e+39 is beyond float32's largest number" in \
        one_error_line(capsys)


# ---- run-keeping edge cases
CTRL_C_AT_IMPORT = """
import os, runpy, signal, sys
class CtrlC:  # Ctrl-C arrives while {module} is being imported, wherever that falls in time
    def find_spec(self, name, path, target=None):
        if name == "{module}":
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, CtrlC())
sys.path.insert(0, {root!r})
sys.argv = [os.path.join({root!r}, "{script}"), "--output_dir", {out!r}]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("script,module,line", [
    ("grpo.py", "torch", "interrupted while starting: nothing was written"),
    ("sft.py", "transformers", "interrupted while starting: nothing was written")])
def test_ctrl_c_in_the_first_seconds_is_one_line_not_a_traceback(script, module, line, tmp_path):
    """S12: Ctrl-C while torch or transformers are imported (seconds on a busy laptop): one line,
    exit 130 (once main() has begun, runs.main_guard says it: test_reliability)."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.abspath(C.__file__))
    out = str(tmp_path / "run")
    code = CTRL_C_AT_IMPORT.format(module=module, root=root, script=script, out=out)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 130 and p.stderr.strip().splitlines() == [line], p.stderr[-600:]
    assert not os.path.exists(out)


def test_messages_name_what_the_user_gave(monkeypatch, tmp_path):
    """S15: --data chat-sums --rewards math is the user's math reward, not an error blaming a
    --reward_fn they never gave (the preset's reward applies only when --rewards is not given or
    names it); --model FILE.gguf says how to convert it."""
    import sys
    from plumbing import flags, loading
    for rewards, fns in (("math", []), ("math,asked_answer", ["plumbing.chat_sums:asked_answer"])):
        monkeypatch.setattr(sys, "argv", ["grpo.py", "--data", "chat-sums", "--rewards", rewards])
        args = flags.parse_args(grpo.Args, "grpo")
        assert args.reward_fn == fns and args.max_new_tokens == 10  # the rest of the preset stays
        weights = loading.parse_rewards(args.rewards, "", loading.load_reward_fns(args.reward_fn))
        assert list(weights) == rewards.split(",")
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    for name in (str(gguf), "SmolLM2.gguf"):
        with pytest.raises(UserError, match=r"is a GGUF file; .*python tools/smollm2.py"):
            loading.load_model(name, "lm", torch.device("cpu"))


def test_a_run_killed_in_its_final_eval_is_finished_by_resume(tmp_path, monkeypatch, capsys):
    """R9: killed after its last step's checkpoint, during the final held-out eval (no
    summary.json): --resume runs only that eval and writes the summary an uninterrupted run
    writes; once finished, --resume refuses again (no optimizer state to extend it)."""
    import json
    from plumbing import runs
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    argv = [*FAST_GRPO, "--max_steps", "2", "--save_every", "0"]
    run_main(monkeypatch, grpo, *argv, "--output_dir", straight)
    finish = runs.finish_run

    def killed_in_final_eval(*a, **kw):
        raise KeyboardInterrupt
    monkeypatch.setattr(runs, "finish_run", killed_in_final_eval)
    with pytest.raises(SystemExit):
        run_main(monkeypatch, grpo, *argv, "--output_dir", killed, guard=True)
    assert not (killed / "summary.json").exists() and (killed / "checkpoint").exists()
    monkeypatch.setattr(runs, "finish_run", finish)
    run_main(monkeypatch, grpo, "--resume", killed)
    want, got = (json.loads((d / "summary.json").read_text()) for d in (straight, killed))
    assert got["evals"] == want["evals"] and got["steps"] == 2 and not got["interrupted"]
    with pytest.raises(SystemExit):
        run_main(monkeypatch, grpo, "--resume", killed, guard=True)
    assert "holds no optimizer state" in one_error_line(capsys)


def test_dppo_ratio_cap_caps_the_detached_ratio_as_the_dppo_authors():
    """--dppo_ratio_cap C: the gradient -M min(rho_s, C) A grad log pi_theta, token by token, with
    rho_s = pi_theta / pi_sampler; C = 0 leaves the uncapped -M rho_s A grad log pi."""
    g = torch.Generator().manual_seed(0)
    sample = -torch.rand(6, 5, generator=g) * 3
    lp = (sample + torch.randn(6, 5, generator=g) * 1.5).requires_grad_()  # rho_s up to ~e^4
    adv, mask = torch.randn(6, generator=g), torch.ones(6, 5)
    for cap in (0.0, 3.0):
        args = grpo.Args(policy_loss="dppo", beta=0.0, dppo_ratio_cap=cap, clip_eps=0.9,
                         clip_eps_high=0.9)
        loss, logs = grpo_loss(lp, lp.detach(), adv, mask, args, None, 1.0, sample)
        (grad,) = torch.autograd.grad(loss.sum(), lp)
        rho = (lp.detach() - sample).exp()
        w = rho.clamp(max=cap) if cap else rho
        keep = 1 - logs["clip_frac"]
        torch.testing.assert_close(grad, -keep * w * adv[:, None])  # d(log pi)/d lp = 1
        torch.testing.assert_close(loss.detach(), -keep * w * adv[:, None])
        assert (rho > 3).any() and keep.sum() > 10  # the cap had tokens to act on


def test_off_policy_mask_0_is_trls_threshold_0_and_luspo_is_in_help(capsys, monkeypatch):
    """--off_policy_mask left out: off; 0: TRL's threshold 0, every negative sample that drifted
    at all is dropped (0 meant "off" before). --help names LUSPO beside --loss_agg seq-sum."""
    import sys
    lp = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0]])
    sample = torch.tensor([[-0.9, -1.0], [-1.1, -1.0], [-0.9, -1.0]])  # drift +0.05, -0.05, +0.05
    adv, mask = torch.tensor([-1.0, -1.0, 1.0]), torch.ones(3, 2)
    dropped = {}
    for delta in (None, 0.0, 0.1):
        args = grpo.Args(beta=0.0, off_policy_mask=delta)
        _, logs = grpo_loss(lp, lp, adv, mask, args, None, 1.0, sample)
        dropped[delta] = logs.get("seq_masked", torch.zeros(3, 2))[:, 0].tolist()
    assert dropped == {None: [0, 0, 0], 0.0: [1, 0, 0], 0.1: [0, 0, 0]}
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--help"])
    from plumbing import flags
    with pytest.raises(SystemExit):
        flags.parse_args(grpo.Args, "grpo", grpo.__doc__)
    text = " ".join(capsys.readouterr().out.split())
    assert "seq-sum LUSPO" in text and "--off_policy_mask X off (TRL: 0.5)" in text


@pytest.mark.parametrize("script,flags", [
    (grpo, [*FAST_GRPO, "--save_every", "0"]),
    (reinforce, ["--prompts_per_step", "2", "--samples_per_prompt", "4", "--micro_batch_size",
                 "8", "--eval_size", "10", "--eval_every", "0", "--save_every", "0",
                 "--baseline", "ema"]),
    # distill.py through runs.Keeper since #63 (before, its steps ran to their end on Ctrl-C)
    (distill, ["--teacher_system_prompt", "Answer with the number.", "--prompts_per_step", "2",
               "--samples_per_prompt", "4", "--micro_batch_size", "8", "--eval_size", "10",
               "--eval_every", "0", "--save_every", "0"])])
def test_ctrl_c_in_a_long_step_stops_at_once_and_resumes_bit_identical(script, flags, tmp_path,
                                                                       monkeypatch, capsys):
    """#53: the first Ctrl-C in a step, before its update (a real model's step: minutes of
    sampling), abandons it: the step's completions are dropped, no update from it, and the last
    completed step is saved with the RNG states of its end (here after step 2, never saved by
    --save_every 0). --resume then gives the weights and metrics of the run never interrupted,
    bit for bit (reinforce's ema baseline, which the abandoned step had moved, included)."""
    import json
    from safetensors.torch import load_file
    from plumbing import runs
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    run_main(monkeypatch, script, *flags, "--max_steps", "4", "--output_dir", straight)
    real = C.compute_rewards

    def ctrl_c_in_step_3(*a, **kw):  # mid-step: after sampling (RNG drawn), before the update
        out = real(*a, **kw)
        if len(runs.STARTED["run"].history) == 2 and runs.STOP["abandon"]:  # in step 3
            runs._on_sigint(2, None)  # what the signal calls
        return out
    monkeypatch.setattr(C, "compute_rewards", ctrl_c_in_step_3)
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, script, *flags, "--max_steps", "4", "--output_dir", stopped,
                 guard=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 130 and err[-1] == ("interrupted: step 3 abandoned before its update;"
                                               f" the checkpoint of step 2 resumes exactly "
                                               f"(--resume {stopped})"), err[-3:]
    assert [m["step"] for m in read_metrics(stopped)] == [1, 2]
    monkeypatch.setattr(C, "compute_rewards", real)
    runs.STOP["requested"] = False
    run_main(monkeypatch, script, "--resume", stopped)
    timing = ("step_time", "tokens_per_s")
    want, got = ([{k: v for k, v in m.items() if k not in timing} for m in read_metrics(d)]
                 for d in (straight, stopped))
    assert got == want
    a, b = (load_file(d / "checkpoint" / "model.safetensors") for d in (straight, stopped))
    assert all(torch.equal(a[k], b[k]) for k in a)
    s1, s2 = (json.loads((d / "summary.json").read_text()) for d in (straight, stopped))
    assert s1["evals"] == s2["evals"]
