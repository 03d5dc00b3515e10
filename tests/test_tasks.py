"""reasoning-gym's generators as data and reward (--data rg:..., plumbing/rg.py), the curriculum and
prompt skipping (tasks.observe), the random-reward control (--rewards random)."""
import importlib.util
import json
import random
import signal
import sys

import pytest
import torch

import common as C
from plumbing.errors import UserError
import grpo
import ppo
import reinforce
from plumbing import loading, rg, runs, tasks
from plumbing.flags import parse_args
from tests.helpers import FAST_GRPO, one_error_line, read_metrics, run_main

needs_rg = pytest.mark.skipif(importlib.util.find_spec("reasoning_gym") is None,
                              reason="pip install reasoning-gym==0.1.25")
EASY = "rg:chain_sum?max_terms=2&max_digits=1"  # 2 one-digit terms: a few hundred questions


def test_without_reasoning_gym_rg_is_one_line_naming_the_package(monkeypatch):
    monkeypatch.setattr(rg, "reasoning_gym", None)
    with pytest.raises(UserError, match=r"needs the optional package reasoning-gym \(pip "):
        tasks.load_data(EASY, 10)


@needs_rg
def test_spec_settings_mixture_weights_and_its_errors():
    assert rg.parse("rg:chain_sum?max_terms=3&allow_negation=true:2,basic_arithmetic?operators="
                    "+|-&seed=7") == [("chain_sum", {"max_terms": 3, "allow_negation": True}, 2.0),
                                      ("basic_arithmetic", {"operators": ("+", "-"), "seed": 7},
                                       1.0)]
    for spec, message in (("rg:chain", "no generator 'chain' (did you mean chain_sum"),
                          ("rg:chain_sum?digits=2", "chain_sum has no setting 'digits' (KEY="),
                          ("rg:chain_sum:0", "the weight of chain_sum must be > 0"),
                          ("rg:chain_sum?min_terms=5&max_terms=2", "refuses the settings"),
                          ("rg:chain_sum?size=0", "size > 0"),
                          ("rg:chain_sum?seed=2147483000&size=1000", "must be <= 2**31")):
        with pytest.raises(UserError, match=spec.split(":")[1].split("?")[0]) as e:
            tasks.load_data(spec, 10)
        assert message in str(e.value)


@needs_rg
def test_held_out_is_another_seed_space_and_never_trained_on():
    """Held out: the generator's items 0..n-1 at seed 2**31 (as reasoning-gym makes them); the
    training rows come from seed 0 and never ask a held-out question (a small generator repeats
    its questions: 2 one-digit terms make a few hundred)."""
    import reasoning_gym
    data = tasks.load_data(EASY, 100)
    direct = reasoning_gym.create_dataset("chain_sum", seed=2**31, size=100, max_terms=2,
                                          max_digits=1)
    assert [r["rg_entry"]["question"] for r in data.eval_rows] == [e["question"] for e in direct]
    held = {r["rg_entry"]["question"] for r in data.eval_rows}
    train = data.next_batch(random.Random(0), 2000)
    assert not held & {r["rg_entry"]["question"] for r in train}
    assert len({r["rg_entry"]["question"] for r in train}) > 100  # not a handful repeated
    row = train[0]
    assert row["prompt"][0]["role"] == "user" and row["prompt"][0]["content"].endswith(rg.ASK)
    assert row["answer"] == row["rg_entry"]["answer"] and row["rg_task"] == "chain_sum"
    assert data.next_batch(random.Random(3), 5) == data.next_batch(random.Random(3), 5)


@needs_rg
def test_a_generator_that_seeds_numpy_loads_and_trains_at_every_allowed_seed():
    """pool_matrix seeds numpy's global generator with seed + i (numpy takes < 2**32): its
    held-out items (seed 2**31 + i) and its training items up to the last seed allowed (seed +
    size = 2**31) are made; held-out and training seeds never meet."""
    import reasoning_gym
    data = tasks.load_data("rg:pool_matrix", 8)
    direct = reasoning_gym.create_dataset("pool_matrix", seed=2**31, size=8)
    assert [r["rg_entry"]["question"] for r in data.eval_rows] == [e["question"] for e in direct]
    last = tasks.load_data(f"rg:pool_matrix?seed={2**31 - 100}&size=100", 8)
    assert len(last.next_batch(random.Random(0), 50)) == 50
    assert rg.generator("pool_matrix", (), 2**31 - 100)[99]["question"]  # seed 2**31 - 1
    with pytest.raises(UserError, match="seed \\+ size must be <= 2\\*\\*31"):
        tasks.load_data(f"rg:pool_matrix?seed={2**31 - 99}&size=100", 8)


@needs_rg
def test_a_mixture_draws_and_holds_out_by_weight():
    data = tasks.load_data("rg:chain_sum:3,leg_counting", 40)
    names = [r["rg_task"] for r in data.eval_rows]
    assert (names.count("chain_sum"), names.count("leg_counting")) == (30, 10)
    drawn = [r["rg_task"] for r in data.next_batch(random.Random(0), 2000)]
    assert 0.7 < drawn.count("chain_sum") / 2000 < 0.8


@needs_rg
@pytest.mark.parametrize("completion,score", [
    ("<answer>7</answer>", 1.0), ("4 + 3 = 7", 1.0), ("work\n4 + 3 = 7.", 1.0),
    ("<answer>8</answer> 4 + 3 = 7", 0.0), ("<answer>1</answer>\n<answer>7</answer>", 1.0),
    ("", 0.0), ("The answer is 7", 1 / 15)])  # reasoning-gym's partial credit, as it gives it
def test_the_rg_reward_scores_the_stated_answer_with_the_generators_scorer(completion, score):
    entry = {"question": "State the final answer to the following arithmetic problem: 4 + 3 =",
             "answer": "7", "metadata": {}}
    assert rg.reward([completion], [rg.row("chain_sum", entry)]) == [pytest.approx(score)]
    with pytest.raises(UserError, match="--rewards rg scores reasoning-gym's rows"):
        rg.reward(["7"], [{"prompt": "4+3=", "answer": "7"}])


@needs_rg
def test_rg_reads_untagged_answers_and_rg_strict_reads_them_as_reasoning_gym_does(
        chat_model, monkeypatch, tmp_path):
    """#66 D10, decided (docs/tasks.md): rg credits an answer without tags (SmolLM2-135M tags none
    of its 128 greedy held-out answers: read strictly, the preset would have nothing to teach);
    rg_strict is reasoning-gym's own reading, extract_answer then score_answer: no tags, 0."""
    import reasoning_gym
    from reasoning_gym.utils import extract_answer
    entry = {"question": "State the final answer to the following arithmetic problem: 4 + 3 =",
             "answer": "7", "metadata": {}}
    texts = ["<answer>7</answer>", "<answer> 7 </answer>", "<answer>The answer is 7</answer>",
             "<answer>1</answer>\n<answer>7</answer>", "4 + 3 = 7", "The answer is 7", "7", ""]
    rows = [rg.row("chain_sum", entry)] * len(texts)
    theirs = reasoning_gym.create_dataset("chain_sum", size=1).score_answer
    own = [theirs(extract_answer(t), entry) for t in texts]
    assert own == [1.0, 1.0, pytest.approx(1 / 15), 1.0, 0.0, 0.0, 0.0, 0.0]
    fns = {}
    weights = loading.parse_rewards("rg_strict=1", "", fns)
    assert C.compute_rewards(rows, texts, weights, fns)[0].tolist() == pytest.approx(own)
    lenient = rg.reward(texts, rows)
    assert lenient[:4] == pytest.approx(own[:4])  # tagged: the same reading
    assert lenient[4:] == pytest.approx([1.0, 1 / 15, 1.0, 0.0])  # untagged: the last line
    run_main(monkeypatch, grpo, "--model", chat_model, "--data", EASY, "--rewards", "rg_strict=1",
             "--eval_reward", "rewards", "--max_steps", "1", "--prompts_per_step", "2",
             "--group_size", "2", "--micro_batch_size", "4", "--max_new_tokens", "3",
             "--eval_size", "2", "--chat_template", "none", "--output_dir", tmp_path / "strict")
    assert "reward/rg_strict" in read_metrics(tmp_path / "strict")[0]


@needs_rg
def test_eval_scores_rg_rows_with_the_rg_score_whatever_trains(tmp_path):
    data = tasks.load_data(EASY, 4)
    fns = {}
    weights = loading.parse_rewards("random=1", "", fns)
    assert weights == {"random": 1.0} and fns == {"random": tasks.random_reward}
    metric = tasks.eval_metric(data.eval_rows)
    assert metric == "rg score" and tasks.scored_by(metric, weights, fns) == {"rg": 1.0}
    texts = [f"<answer>{r['answer']}</answer>" for r in data.eval_rows]
    assert C.compute_rewards(data.eval_rows, texts, {"rg": 1.0}, fns)[0].tolist() == [1.0] * 4
    assert tasks.eval_metric(data.eval_rows, "math") == "accuracy"
    (tmp_path / "mine.py").write_text("def random(completions, rows):\n    return [1.0]\n")
    with pytest.raises(UserError, match="'random' is a built-in reward; rename it"):
        loading.load_reward_fns([f"{tmp_path / 'mine.py'}:random"])


def test_random_reward_is_a_fair_coin_from_torchs_seeded_rng():
    torch.manual_seed(0)
    a = tasks.random_reward(["x"] * 2000, [{}] * 2000)
    torch.manual_seed(0)
    assert torch.equal(a, tasks.random_reward(["y"] * 2000, [{}] * 2000))  # not the text's
    assert 0.45 < float(a.mean()) < 0.55 and set(a.tolist()) == {0.0, 1.0}


@needs_rg
def test_curriculum_rises_with_the_training_score_and_falls(monkeypatch):
    """Level 0 is the generator's easiest setting; a full window (64 samples) at or above `up`
    raises it one level (chain_sum: up to 3 terms of up to 2 digits), below `down` lowers it; the
    held-out rows stay at the settings given."""
    data = tasks.load_data("rg:chain_sum?max_terms=4&max_digits=3", 16, curriculum=(0.8, 0.3))
    rng = random.Random(0)
    assert data.state["level"] == {"chain_sum": 0}
    assert {r["rg_entry"]["metadata"]["num_terms"] for r in data.next_batch(rng, 50)} == {2}
    rows = data.next_batch(rng, 32)
    parts = {"rg": torch.full((32,), 0.9)}
    assert tasks.observe(data.state, rows, parts["rg"], parts, 8)["curriculum/chain_sum"] == 0
    logs = tasks.observe(data.state, rows, parts["rg"], parts, 8)  # 64 samples: 0.9 >= 0.8
    assert logs == {"reward/rg/chain_sum": pytest.approx(0.9), "curriculum/chain_sum": 1}
    assert {r["rg_entry"]["metadata"]["num_terms"] for r in data.next_batch(rng, 200)} == {2, 3}
    low = {"rg": torch.full((64,), 0.1)}  # a new level starts its own window
    rows = data.next_batch(rng, 64)
    assert tasks.observe(data.state, rows, low["rg"], low, 8)["curriculum/chain_sum"] == 0
    assert max(r["rg_entry"]["metadata"]["num_terms"] for r in data.eval_rows) > 2  # the target
    with pytest.raises(UserError, match="no curriculum for gsm_symbolic"):
        tasks.load_data("rg:gsm_symbolic", 4, curriculum=(0.8, 0.3))
    with pytest.raises(UserError, match="give --data rg:NAME"):
        tasks.load_data("", 4, curriculum=(0.8, 0.3))


@needs_rg
def test_the_curriculum_rises_at_its_threshold_and_stops_at_its_last_level():
    """A window whose mean is exactly --curriculum_up (48 of 64 right: 0.75) raises the level
    (>=, not >). The top is rg.max_level, the last level that changes the generator's settings
    (naive: the configs of levels 0, 1, 2, ... compared): a perfect window there leaves it."""
    for name in ("chain_sum", "basic_arithmetic"):
        configs = [rg.config(name, {}, level) for level in range(rg.max_level(name) + 3)]
        assert rg.max_level(name) == max(i for i in range(1, len(configs))
                                          if configs[i] != configs[i - 1])
    data = tasks.load_data("rg:chain_sum", 4, curriculum=(0.75, 0.25))
    rows = data.next_batch(random.Random(0), 64)
    at_threshold = {"rg": torch.tensor([1.0] * 48 + [0.0] * 16)}
    assert tasks.observe(data.state, rows, at_threshold["rg"], at_threshold, 8) \
        ["curriculum/chain_sum"] == 1
    top = rg.max_level("chain_sum")
    data.state["level"]["chain_sum"] = top
    perfect = {"rg": torch.ones(64)}
    assert tasks.observe(data.state, rows, perfect["rg"], perfect, 8)["curriculum/chain_sum"] == top
    assert data.next_batch(random.Random(0), 2)  # the top level's generator is made


@needs_rg
def test_curriculum_levels_reasoning_gym_refuses_are_one_line_at_load(chat_model, monkeypatch,
                                                                      tmp_path, capsys):
    """caesar_cipher's curriculum sets a rotation its own check refuses at levels 2-3 (and
    knight_swap's, min_nodes 5, at every level): a run would stop when its curriculum got there.
    At load: one line, exit 2, naming the generator and the levels it takes; the same run
    without --curriculum_up trains."""
    flags = ["--model", chat_model, "--data", "rg:caesar_cipher", "--rewards", "random=1",
             "--max_steps", "1", "--prompts_per_step", "2", "--group_size", "2",
             "--micro_batch_size", "4", "--max_new_tokens", "3", "--eval_size", "2",
             "--eval_every", "0", "--chat_template", "none"]
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, *flags, "--curriculum_up", "0.8", "--output_dir",
                 tmp_path / "refused", guard=True)
    line = one_error_line(capsys)
    assert e.value.code == 2 and "refuses caesar_cipher's curriculum at level(s) 2, 3 of 0-3" \
        in line and "it takes 0, 1: train caesar_cipher without --curriculum_up" in line
    assert not (tmp_path / "refused").exists()
    run_main(monkeypatch, grpo, *flags, "--output_dir", tmp_path / "works", guard=True)
    assert len(read_metrics(tmp_path / "works")) == 1
    with pytest.raises(UserError, match="knight_swap's curriculum at level.* it takes none"):
        tasks.load_data("rg:chain_sum,knight_swap", 4, curriculum=(0.8, 0.3))


def test_skip_uniform_skips_prompts_whose_last_k_groups_scored_alike(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"q{i}", "answer": str(i)}) + "\n"
                            for i in range(10)))
    data = tasks.load_data(str(path), 2, skip=(2, 0.0))  # 8 rows to train on
    rows = data.next_batch(random.Random(0), 8)
    solved, other = rows[0], next(r for r in rows if r["prompt"] != rows[0]["prompt"])
    group = [solved] * 4 + [other] * 4
    mixed = torch.tensor([1.0, 1, 1, 1, 0, 1, 0, 1])  # solved: all right; other: a signal
    for _ in range(2):
        logs = tasks.observe(data.state, group, mixed, {}, 4)
    drawn = data.next_batch(random.Random(1), 200)
    assert solved["prompt"] not in {r["prompt"] for r in drawn}
    assert other["prompt"] in {r["prompt"] for r in drawn}
    assert tasks.observe(data.state, group, mixed, {}, 4)["frac_skipped"] > 0
    tasks.observe(data.state, group, torch.tensor([1.0, 0, 1, 1, 0, 1, 0, 1]), {}, 4)
    assert solved["prompt"] in {r["prompt"] for r in data.next_batch(random.Random(1), 200)}
    data.state.update(keep=0.5, visits={}, skipped=0)  # reweighted, not dropped
    for _ in range(2):
        tasks.observe(data.state, group, mixed, {}, 4)
    drawn = [r["prompt"] for r in data.next_batch(random.Random(2), 800)]
    assert 0.3 < drawn.count(solved["prompt"]) / drawn.count(other["prompt"]) < 0.7


@needs_rg
def test_data_rg_brings_its_defaults_and_given_flags_win(monkeypatch):
    for script in (grpo, reinforce, ppo):
        monkeypatch.setattr(sys, "argv", [f"{script.__name__}.py", "--data", EASY, "--lr",
                                          "1e-5", "--rewards", "random=1"])
        args = parse_args(script.Args, script.__name__)
        assert args.lr == 1e-5 and args.rewards == "random=1" and args.max_new_tokens == 24
        assert args.curriculum_up == 0 and args.skip_uniform == 0  # off by default
        script.check_args(args) if hasattr(script, "check_args") else None
    monkeypatch.setattr(sys, "argv", ["grpo.py", "--data", EASY])
    assert parse_args(grpo.Args, "grpo").rewards == "rg=1"


@needs_rg
@pytest.mark.parametrize("script", [grpo, reinforce, ppo])
def test_curriculum_skips_and_random_reward_resume_exactly(script, chat_model, monkeypatch,
                                                           tmp_path):
    """A run stopped after step 2 of 4 and resumed logs what the straight run logged: the
    curriculum's levels, the prompts' visits (what is skipped) and the random rewards' RNG are in
    the checkpoint. So does a run whose Ctrl-C came in step 3 after its scores were observed,
    before its update (the abandoned step: its checkpoint is step 2's, without step 3's visits).
    (Random rewards: a level's mean, about 0.5, clears up = 0.01.)"""
    batch = {grpo: ["--prompts_per_step", "4", "--group_size", "2"],
             reinforce: ["--prompts_per_step", "4", "--samples_per_prompt", "2"],
             ppo: ["--batch_size", "8", "--critic_init", "policy", "--ppo_epochs", "1",
                   "--num_minibatches", "1"]}[script]  # 8 samples a step
    flags = ["--model", chat_model, "--data", "rg:chain_sum?size=3", "--rewards", "random=1",
             "--curriculum_up", "0.01", "--skip_uniform", "1", "--max_steps", "4", *batch,
             "--max_new_tokens", "3", "--lr", "1e-3", "--eval_size", "4", "--eval_every", "0",
             "--save_every", "0", "--micro_batch_size", "8", "--chat_template", "none",
             "--temperature", "1.0"]
    monkeypatch.setattr(tasks, "CURRICULUM_WINDOW", 16)  # a level every 2 steps, at most
    run_main(monkeypatch, script, *flags, "--output_dir", str(tmp_path / "a"))
    real_log = runs.log_step

    def log_step(run, metrics, *a):
        real_log(run, metrics, *a)
        runs.STOP["requested"] = metrics["step"] == 2  # as Ctrl-C does
    monkeypatch.setattr(runs, "log_step", log_step)
    with pytest.raises(SystemExit):
        run_main(monkeypatch, script, *flags, "--output_dir", str(tmp_path / "b"))
    run_main(monkeypatch, script, "--resume", str(tmp_path / "b"))
    monkeypatch.setattr(runs, "log_step", real_log)
    real_observe, observed = tasks.observe, []

    def observe_then_ctrl_c(*a):  # Ctrl-C in step 3, once its scores moved the data's state
        observed.append(real_observe(*a))
        if len(observed) == 3:
            runs._on_sigint(signal.SIGINT, None)  # Python's call on Ctrl-C: the step abandoned
        return observed[-1]
    monkeypatch.setattr(tasks, "observe", observe_then_ctrl_c)
    runs.STOP["requested"] = False
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, script, *flags, "--output_dir", str(tmp_path / "c"), guard=True)
    assert e.value.code == 130 and len(read_metrics(tmp_path / "c")) == 2
    runs.STOP["requested"] = False
    run_main(monkeypatch, script, "--resume", str(tmp_path / "c"))
    a, b, c = (read_metrics(tmp_path / x) for x in "abc")
    keys = ("reward", "reward/random", "reward/rg/chain_sum", "curriculum/chain_sum",
            "frac_skipped", "loss")
    assert [m[k] for m in b for k in keys] == pytest.approx([m[k] for m in a for k in keys])
    assert [m[k] for m in c for k in keys] == pytest.approx([m[k] for m in a for k in keys])
    assert [m["curriculum/chain_sum"] for m in a] == [0, 1, 1, 2]  # 16 samples a level
    assert max(m["frac_skipped"] for m in a) > 0  # 3 questions a level: some settled, skipped


def test_dynamic_sampling_shows_every_sampled_group_to_the_curriculum_and_skips(monkeypatch,
                                                                              tmp_path):
    """grpo --dynamic_sampling drops the groups whose rewards are all equal and samples more; the
    data's bookkeeping (tasks.observe: curriculum levels, --skip_uniform's visits) still sees every
    group sampled, the dropped ones too: what the logged reward and frac_zero_std are made of,
    and a prompt solved every time is skipped as it is without dynamic sampling."""
    real_observe, observed = tasks.observe, []

    def observe(state, rows, rewards, parts, group_size):
        observed.append(rewards.clone())
        return real_observe(state, rows, rewards, parts, group_size)
    monkeypatch.setattr(tasks, "observe", observe)
    data = tmp_path / "sums.jsonl"  # 6 to train on, each drawn again within a few steps
    data.write_text("".join(json.dumps(tasks.addition_row(a, a + 1)) + "\n" for a in range(8)))
    run_main(monkeypatch, grpo, *FAST_GRPO, "--data", data, "--eval_size", "2",
             "--dynamic_sampling", "--skip_uniform", "1", "--max_steps", "8", "--save_every", "0",
             "--output_dir", tmp_path / "run")
    metrics = read_metrics(tmp_path / "run")
    assert any(m["frac_zero_std"] > 0 for m in metrics)  # some groups were dropped
    assert [float(r.mean()) for r in observed] == pytest.approx([m["reward"] for m in metrics])
    assert [float(grpo.zero_std_groups(r, 4).float().mean()) for r in observed] == \
        pytest.approx([m["frac_zero_std"] for m in metrics])
    assert max(m["frac_skipped"] for m in metrics) > 0
