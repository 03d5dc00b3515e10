"""docs/ and the README: commands, links, the code map, docstrings, the 100-column rule."""
import ast
import dataclasses
import os
import re
import shutil
import subprocess
import sys

import pytest

import grpo
from tests.helpers import ROOT, SCRIPTS, read_metrics, run_main

sys.path.insert(0, os.path.join(ROOT, "tools"))
import check_docs  # noqa: E402  (tools/check_docs.py)
import step_cost  # noqa: E402  (tools/step_cost.py)


# ---- docs/: commands, links, the tests they name
# The README is the front page; docs/ holds one file a topic. Every command shown in either must
# run as written: its flags exist, its links resolve, the tests it names exist.
def read_docs():
    """{path relative to the repo: text} of README.md and every docs/*.md."""
    paths = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs"))
                                   if f.endswith(".md"))
    return {p: open(os.path.join(ROOT, p), encoding="utf-8").read() for p in paths}


def shown_commands(text):
    """Each `python SCRIPT ...` or `torchrun ... SCRIPT ...` command the text shows: in a code
    block (4-space indented or fenced; a trailing backslash continues the line) or inline in
    backticks. A trailing comment (" # ...") is dropped."""
    lines, out, fenced = text.splitlines(), [], False
    for i, line in enumerate(lines):
        fenced = fenced != line.startswith("```")
        if fenced or line.startswith("    "):
            while line.endswith("\\") and i + 1 < len(lines):
                i += 1
                line = line[:-1].rstrip() + " " + lines[i].strip()
            out.append(line.strip())
        else:
            out += re.findall(r"`((?:python|torchrun) [^`]+)`", line)
    out = [part for c in out for part in c.split(" && ")]  # pip install ... && python ...
    cmds = [re.split(r"\s+#\s", c)[0] for c in out if c.startswith(("python ", "torchrun "))]
    return [c for c in cmds if re.search(r"\S+\.py\b", c)]


def test_docs_commands_use_flags_their_script_has():
    checked = 0
    for path, text in read_docs().items():
        for command in shown_commands(text):
            words = command.split()
            script = next(w for w in words if w.endswith(".py"))
            flags = re.findall(r"(?<!\S)--(\w+)", " ".join(words[words.index(script) + 1:]))
            name = script[:-3]
            if name in SCRIPTS:
                have = {f.name for f in dataclasses.fields(SCRIPTS[name].Args)} | {"help"}
                missing = [f for f in flags if f not in have]
            else:  # tools/ and bench/: argparse scripts, each flag spelled out in the source
                assert os.path.isfile(os.path.join(ROOT, script)), f"{path}: no {script}: {command}"
                source = open(os.path.join(ROOT, script), encoding="utf-8").read()
                missing = [f for f in flags if f'"--{f}"' not in source]
            assert not missing, f"{path}: {script} has no --{missing[0]}: {command}"
            checked += 1
    assert checked >= 20


def test_check_docs_claims_quote_the_docs_and_their_commands_use_real_flags():
    """tools/check_docs.py (a number in the docs is a claim it re-runs): each claim's text, with
    its number, is still in its file, each command's flags exist, and a measurement drifts when
    it differs at the quoted digits (or, for a wall time, beyond the stated factor)."""
    assert len(check_docs.CLAIMS) >= 100
    for file, text, command, read, tol, tags in check_docs.CLAIMS:
        assert check_docs.holds(file, text), f"{file} no longer says {text!r}"
        float(check_docs.quoted(text)[0].replace(",", ""))
        for part in (p for c in check_docs.as_list(command) for p in c.split(" && ")):
            words = part.split()
            if words[0] == "python" and words[1] in {f"{n}.py" for n in SCRIPTS}:
                have = {f.name for f in dataclasses.fields(SCRIPTS[words[1][:-3]].Args)}
                flags = re.findall(r"(?<!\S)--(\w+)", part)
                assert set(flags) <= have, (command, set(flags) - have)
    assert not check_docs.drifted("0.954", 0.9543, 0) and check_docs.drifted("0.954", 0.932, 0)
    assert check_docs.drifted("0.93", 0.897, 0) and not check_docs.drifted("16", 16.0, 0)
    assert not check_docs.drifted("70", 164.6, 2.0) and check_docs.drifted("70", 230.0, 2.0)


@pytest.mark.parametrize("argv,message", [
    (["--keep", "{file}", "--only", "calc"], "--keep {file}: that is a file, not a folder"),
    (["--skip", ""], "--skip '': an empty pattern matches every claim"),
    (["--only", "no-such-claim"], "no claim matches --only ['no-such-claim']"),
    (["--skip", "."], "--skip ['.'] leaves out every claim")])
def test_check_docs_refuses_bad_flags_in_one_line(argv, message, tmp_path, monkeypatch, capsys):
    """Before any command runs: exit 2 and one line naming the flag (not a traceback, nor a line
    blaming --only for what --skip did)."""
    (tmp_path / "file").write_text("x")
    argv = [a.format(file=tmp_path / "file") for a in argv]
    monkeypatch.setattr(sys, "argv", ["check_docs.py", *argv])
    monkeypatch.setattr(check_docs, "run_command", None)  # nothing may run
    with pytest.raises(SystemExit) as e:
        check_docs.main()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"error: {message.format(file=tmp_path / 'file')}; "
                                         "see --help"], err


def test_shown_commands_finds_block_inline_and_continued_commands():
    text = ("Run `python grpo.py --help` or\n\n"
            "    python ppo.py --lr 1 \\\n        --seed 2  # why\n"
            "\n```bash\ntorchrun --nproc_per_node 2 sft.py --lora_r 4\n```\n`pip install x`\n"
            "\n    pip install x && python dpo.py --system_prompt 'after ####.' --seed 1\n")
    assert shown_commands(text) == ["python grpo.py --help", "python ppo.py --lr 1 --seed 2",
                                    "torchrun --nproc_per_node 2 sft.py --lora_r 4",
                                    "python dpo.py --system_prompt 'after ####.' --seed 1"]


def test_readme_installs_first_and_its_test_command_is_the_one_ci_runs():
    """The README's first section installs PyTorch's CPU build before the requirements (plain
    PyPI's torch is the CUDA build); .ci/run installs the test command's packages and runs exactly
    that command."""
    readme = read_readme()
    assert re.findall(r"^## (.*)", readme, re.M)[:2] == ["Install", "Quickstart"]
    install = read_readme("Install")
    assert install.index("    pip install torch --index-url https://download.pytorch.org/whl/cpu"
                         "\n    pip install -r requirements.txt\n") > 0
    command = re.search(r"\n\n    (pip install .*)\n", read_readme("Run the tests")).group(1)
    install, tests = command.split(" && ")
    ci = open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8").read().splitlines()
    assert tests.replace("python ", "python3 ", 1) in ci
    assert any("pip install" in line and line.endswith(install[len("pip install"):])
               for line in ci), (install, ci)
    # the docs' fast claims first: a stale count fails CI, not a student's run of the suite
    fast = "python3 tools/check_docs.py --fast"
    assert fast in ci and ci.index(fast) < ci.index(tests.replace("python ", "python3 ", 1))


def test_the_docs_user_files_define_what_their_commands_name(tmp_path):
    """The user's files the docs show (README's my_rewards.py, docs/tool_use.md's my_tools.py)
    define every function their commands name: cut out of the docs, they load as printed."""
    from plumbing import envs, loading
    for doc, name, loader in (("README.md", "my_rewards.py", None),
                              ("docs/tool_use.md", "my_tools.py", envs.load_tools)):
        text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
        code = re.search(rf"```python\n# {name}\n(.*?)```", text, re.S).group(1)
        (tmp_path / name).write_text(code)
        for spec in set(re.findall(rf"{name}:([\w,]+)", text)):
            path = f"{tmp_path / name}:{spec}"
            if loader:
                assert sorted(loader(path)[0]) == sorted(spec.split(",")), (doc, spec)
            else:  # --reward_fn FILE:NAME,FILE:NAME: one each
                fn = spec.split(",")[0]
                assert callable(loading.load_reward_fns([f"{tmp_path / name}:{fn}"])[fn])


def test_check_docs_fast_runs_no_training(monkeypatch, capsys):
    """tools/check_docs.py --fast (.ci/run): its claims' commands train nothing (counts, line
    costs, python -c on the project's constants), it covers the step costs, the real-model page
    and the memory and reliability pages."""
    fast = [c for c in check_docs.CLAIMS if "fast" in c[5]]
    assert {"README.md", "docs/real_model.md", "docs/memory.md", "docs/reliability.md"} <= {
        c[0] for c in fast}
    for command in {c[2] for c in fast}:
        assert not re.search(r"python (grpo|ppo|reinforce|sft|dpo|reward_model)\.py", command)
    monkeypatch.setattr(sys, "argv", ["check_docs.py", "--fast", "--list"])
    check_docs.main()
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith(f"{len(fast)} claims") and "MISSING" not in "".join(out)


def anchor(heading):
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_relative_links_and_anchors_resolve():
    docs = read_docs()
    for path, text in docs.items():
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"\w+://", target):
                continue
            file, _, frag = target.partition("#")
            where = os.path.normpath(os.path.join(os.path.dirname(path), file)) if file else path
            assert os.path.exists(os.path.join(ROOT, where)), f"{path}: {target}: no {where}"
            if frag:
                headings = re.findall(r"^#+ (.*)$", docs.get(where) or open(
                    os.path.join(ROOT, where), encoding="utf-8").read(), re.M)
                assert frag in {anchor(h) for h in headings}, f"{path}: no heading for {target}"


def test_no_import_cycle_and_the_core_imports_no_plumbing():
    """Each module imports only modules below it: the project's imports form no cycle. fastpath.py
    imports nothing of the project, common.py only fastpath.py (nothing from plumbing/), engine.py
    only common.py and fastpath.py, and no module imports an algorithm script."""
    mods = set(step_cost.project_modules())
    assert {m for m in mods if m.startswith("plumbing.")} >= {"plumbing.runs", "plumbing.envs"}
    graph = {}
    for m in mods:
        path = os.path.join(ROOT, m.replace(".", "/") + ".py")
        tree = ast.parse(open(path, encoding="utf-8").read())
        graph[m] = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import)
                    for a in n.names if a.name in mods}
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module:
                graph[m] |= {n.module} & mods  # from plumbing.flags import arg
                graph[m] |= {f"{n.module}.{a.name}" for a in n.names} & mods  # from p import m
    assert graph["fastpath"] == set()
    assert graph["common"] == {"fastpath"}
    assert graph["engine"] <= {"common", "fastpath"}
    scripts = {"grpo", "ppo", "reinforce", "sft", "dpo", "reward_model", "distill"}
    assert not any(graph[m] & scripts for m in mods)
    done = set()
    while len(done) < len(graph):  # peel off the modules whose imports are all done
        ready = {m for m in graph if m not in done and graph[m] <= done}
        assert ready, f"an import cycle among {sorted(set(graph) - done)}"
        done |= ready


def top_level_py(root=ROOT):
    """The .py files at the top of the checkout that the project holds: git's tracked files in a
    git checkout (a user's my_rewards.py or my_env.py beside the scripts, as the README
    suggests, is not the project's), else every .py file there but a my_*.py."""
    try:
        out = subprocess.run(["git", "-C", root, "ls-files", "--", "*.py"], capture_output=True,
                             text=True, timeout=60)
        tracked = [f for f in out.stdout.splitlines() if "/" not in f] if not out.returncode else []
    except (OSError, subprocess.TimeoutExpired):
        tracked = []
    if tracked:
        return sorted(tracked)
    return sorted(f for f in os.listdir(root) if f.endswith(".py") and not f.startswith("my_"))


def test_the_top_level_is_the_reading_list():
    """At most 13 of the project's .py files at the top: the scripts (six, and distill.py),
    common.py, engine.py (the multi-turn sampler), objectives.py (the objectives since DAPO),
    fastpath.py and the tests' entry (test_algos.py, conftest.py); the plumbing lives in
    plumbing/. A file a user writes there (untracked) does not count."""
    top = top_level_py()
    assert len(top) <= 13, (f"{len(top)} tracked .py files at the top ({top}): the top level is "
                            "the reading list; put the plumbing in plumbing/, or, if a new "
                            "script earns its place, raise this 13 and README's reading list")
    assert {"grpo.py", "ppo.py", "reinforce.py", "sft.py", "reward_model.py", "dpo.py",
            "distill.py", "common.py", "engine.py", "fastpath.py", "test_algos.py"} <= set(top)


# a budget is a signal reviewed in README's table (tools/check_docs.py --fast reports each file's
# lines against it); the suite fails only this far past it, so a student's edit never fails it
BUDGET_HEADROOM = 50


def over_budget(name, n, budget):
    """The line to fail with when module `name`, n lines long, is past its budget plus the
    headroom; None otherwise."""
    if n <= budget + BUDGET_HEADROOM:
        return None
    return (f"{name}: {n} lines, {n - budget} over the {budget} of README's table (the suite "
            f"allows {BUDGET_HEADROOM} over). Delete what it no longer needs (a budget is a "
            "signal to delete, not to abstract), or, if the lines earn their place, raise its "
            "row in README.md's table")


def readme_budgets():
    rows = re.findall(r"^\| `([\w/]+\.py)`[^|]*\|[^|]*\| (\d+) lines \|$", read_readme(), re.M)
    assert len(rows) >= 12  # common, fastpath, the plumbing, the six scripts
    return [(name, int(budget)) for name, budget in rows]


def test_every_module_keeps_the_line_budget_the_readme_states():
    """README's "Reading the code" table gives each module a budget in lines: each file keeps it,
    give or take BUDGET_HEADROOM (tools/check_docs.py --fast reports the exact counts)."""
    for name, budget in readme_budgets():
        with open(os.path.join(ROOT, name)) as f:
            n = len(f.read().splitlines())
        assert not over_budget(name, n, budget), over_budget(name, n, budget)


def test_every_module_has_a_budget_row_and_the_plumbing_guide_names_it():
    """Every module of the project (the .py files at the top but the tests, and plumbing/'s) has
    a row in README's budget table, and plumbing/__init__.py's guide names each plumbing module
    (tools/step_cost.py's list of modules, as the step's count reads them)."""
    rows = {name for name, _ in readme_budgets()}
    mods = [m.replace(".", "/") + ".py" for m in step_cost.project_modules()]
    missing = sorted(m for m in mods if m not in rows)
    assert not missing, f"README's budget table has no row for {missing}"
    with open(os.path.join(ROOT, "plumbing", "__init__.py")) as f:
        guide = f.read()
    unnamed = [m for m in mods if m.startswith("plumbing/") and m[9:] not in guide]
    assert not unnamed, f"plumbing/__init__.py does not name {unnamed}"


def test_a_students_first_edit_and_a_users_file_at_the_top_pass(tmp_path):
    """A student's first edit: 30 lines more in grpo.py, ppo.py or reinforce.py passes the budget
    check (the step's ceiling has a quarter's headroom, test_each_rl_step_...); a user's
    my_rewards.py and my_env.py at the top of a git checkout (README's "Your own task",
    docs/tool_use.md) leave the reading list as it is."""
    budgets = dict(readme_budgets())
    for name in ("grpo.py", "ppo.py", "reinforce.py"):
        with open(os.path.join(ROOT, name)) as f:
            n = len(f.read().splitlines())
        assert not over_budget(name, max(n, budgets[name]) + 30, budgets[name])
    assert over_budget("grpo.py", budgets["grpo.py"] + BUDGET_HEADROOM + 1, budgets["grpo.py"])
    if shutil.which("git") is None:
        pytest.skip("no git: the user-file half reads git ls-files")
    project = top_level_py()
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True, timeout=60)
    for f in project:
        (tmp_path / f).write_text("")
    subprocess.run(["git", "-C", str(tmp_path), "add", *project], check=True, timeout=60)
    (tmp_path / "my_rewards.py").write_text("def exact(completions, rows):\n    return [0.0]\n")
    (tmp_path / "my_env.py").write_text("def env(row, turns):\n    return None\n")
    assert top_level_py(str(tmp_path)) == project
    shutil.rmtree(tmp_path / ".git")  # no git checkout: every .py file there but my_*.py
    assert top_level_py(str(tmp_path)) == project


def test_each_rl_step_reads_few_files_under_a_generous_ceiling():
    """tools/step_cost.py: one step of grpo, ppo and reinforce (the loop and what it reaches)
    stays in the script, common, fastpath, objectives (the objectives since DAPO) and
    plumbing/runs, under STEP_CEILING lines, a quarter above today's counts: the README reports
    the count, and a student's change may grow it."""
    for script in ("grpo.py", "ppo.py", "reinforce.py"):
        loop, reached = step_cost.step_cost(script)
        n = loop + sum(reached.values())
        assert n <= step_cost.STEP_CEILING, (
            f"{script}: one step now reads {n} lines, over STEP_CEILING {step_cost.STEP_CEILING} "
            f"(`python tools/step_cost.py {script} -v` lists where, longest first). If the new "
            "lines earn their place, raise STEP_CEILING in tools/step_cost.py; if not, move "
            "what only the setup needs out of the loop")
        few = {script[:-3], "common", "fastpath", "objectives", "plumbing.runs"}
        extra = sorted({m for m, _ in reached} - few)
        assert not extra, (f"{script}: a step reaches {extra}: keep what the loop calls in the "
                           "script, common.py, fastpath.py, objectives.py and plumbing/runs.py "
                           "(pass other code as values)")


def test_every_training_loop_keeps_its_run_with_the_keeper():
    """Every script's loop, the pipeline's (sft, dpo, reward_model) too, runs on runs.Keeper: its
    steps (the bar, Ctrl-C before the update), finite (the NaN guard) and end_step (logs, eval,
    warnings, checkpoints) are the run-keeping it reaches, not a loop of its own around helpers."""
    for name in SCRIPTS:
        _, reached = step_cost.step_cost(f"{name}.py")
        kept = {f for m, f in reached if m == "plumbing.runs" and f.startswith("Keeper.")}
        assert {"Keeper.steps", "Keeper.finite", "Keeper.end_step"} <= kept, (name, kept)


def test_step_cost_counts_the_loop_and_what_it_reaches(tmp_path):
    """The counter on a two-module project: the loop, a function it calls in another module and
    what that one calls, a nested function once (inside its parent), both methods of an
    autograd-style class used through .apply; not a function only setup calls."""
    (tmp_path / "lib.py").write_text(
        "def helper(x):\n    return inner(x)\n\n\n"  # 2 lines, reaches inner
        "def inner(x):\n    def nested():\n        return x\n    return nested()\n\n\n"  # 4
        "class Fn:\n    def forward(ctx, x):\n        return x\n\n"  # 2
        "    def backward(ctx, g):\n        return g\n\n\n"  # 2
        "def setup_only():\n    return 0\n")
    (tmp_path / "algo.py").write_text(
        "import lib\nfrom lib import Fn\n\n\ndef main():\n    lib.setup_only()\n"
        "    for step in range(3):\n        lib.helper(step)\n        Fn.apply(step)\n")
    loop, reached = step_cost.step_cost("algo.py", root=str(tmp_path))
    assert loop == 3
    assert reached == {("lib", "helper"): 2, ("lib", "inner"): 4, ("lib", "Fn.forward"): 2,
                       ("lib", "Fn.backward"): 2}
    assert step_cost.reader_cost("algo.py", loop, reached) == 3  # lib is not the reader's
    assert step_cost.reader_cost("lib.py", loop, reached) == 3 + 10  # as if lib were the script


def test_step_cost_follows_the_loops_object(tmp_path):
    """An object main builds before the loop (keep = lib.Keeper(save)): the loop's keep.steps and
    keep.end_step reach those two methods, what they call (self.log) and the function main gave
    the object (save, which end_step calls); not the methods the loop never calls (__init__,
    finish), nor functions not given to it."""
    (tmp_path / "lib.py").write_text(
        "class Keeper:\n    def __init__(self, save):\n        self.save = save\n\n"  # 2
        "    def steps(self, n):\n        return range(n)\n\n"  # 2
        "    def end_step(self, step):\n        self.log(step)\n        self.save(step)\n\n"
        "    def log(self, step):\n        return step\n\n"  # 2
        "    def finish(self):\n        return 0\n")
    (tmp_path / "algo.py").write_text(
        "import lib\n\n\ndef main():\n    def save(done):\n        return done\n\n"
        "    def unused():\n        return 1\n    keep = lib.Keeper(save)\n"
        "    for step in keep.steps(3):\n        keep.end_step(step)\n    keep.finish()\n")
    loop, reached = step_cost.step_cost("algo.py", root=str(tmp_path))
    assert loop == 2
    assert reached == {("lib", "Keeper.steps"): 2, ("lib", "Keeper.end_step"): 3,
                       ("lib", "Keeper.log"): 2, ("algo", "main.save"): 2}


def test_readme_links_every_docs_file():
    readme, docs = read_readme(), [p for p in read_docs() if p.startswith("docs/")]
    assert docs and all(f"]({p})" in readme for p in docs), [p for p in docs if p not in readme]


def test_readme_stays_a_front_page():
    assert len(read_readme().splitlines()) <= 302


def test_tests_named_in_the_docs_exist():
    source = "".join(open(os.path.join(ROOT, f), encoding="utf-8").read()
                     for f in each_test_file())
    defined = set(re.findall(r"^def (test_\w+)\(", source, re.M))
    for path, text in read_docs().items():
        for name in re.findall(r"`(test_\w+)`", text):
            assert name in defined, f"{path} names {name}, which no test file defines"


def test_docs_code_references_name_functions_that_exist():
    """`file.py: name()` anywhere in docs/ names a function defined there (with the key symbols
    KEY_SYMBOLS lists for it)."""
    for path, text in read_docs().items():
        if path != "README.md":
            check_code_map(text, ROOT, least=0)


KEY_SYMBOLS = {"group_advantages": ["mean", "std", "eps"],
               "per_token_loss": ["ratio", "clamp", "torch.min", "beta", "kl_estimate"],
               "aggregate": ["n_tokens", "n_seqs", "max_new_tokens"],
               "kl_returns": ["beta", "cumsum", "scores"],
               "advantages": ["returns - b", "rloo_baseline", "whiten"],
               "reinforce_loss": ["-advantages * logprobs", "clamp"],
               "shaped_rewards": ["kl_coef", "scores", "lengths - 1"],
               "gae": ["gamma", "lam", "advantages + values"],
               "policy_loss": ["ratio", "clamp", "torch.max"],
               "value_loss": ["clip_eps_value", "0.5", "torch.max"],
               "sft_loss": ["logprobs * mask", "n_tokens"],
               "bradley_terry_loss": ["logsigmoid", "margin", "weight", "n_rows"],
               "ranking_pairs": ["range(i + 1, k)"],
               "score_forward": ["rm_sequences", "rm_forward"],
               "dpo_loss": ["logsigmoid", "label_smoothing", "1 / (2 * beta)", "ref_chosen"],
               "sequence_logprobs": ["token_logprobs", "sum(-1)"],
               "length_batches": ["sorted", "shuffle"],
               "plain_token_logprobs": ["temperature", "log_softmax", "gather"],
               "kl_estimate": ["0.5 * log_r**2", "log_r.exp() - 1 - log_r"],
               "whiten": ["mean", "rsqrt", "mask"]}


def check_code_map(text, folder, least=10):
    """Every `file.py: name()` in text names a function defined in that file (found by name, so no
    edit elsewhere in the file breaks it) whose source holds the equation's key symbols. With
    least > 0 (the README's code map) every name must have its key symbols listed above."""
    refs = re.findall(r"(\w+\.py): (\w+)\(\)", text)
    assert len(refs) >= least
    for file, name in refs:  # tasks.py: the plumbing's modules are named without plumbing/
        where = [os.path.join(folder, d, file) for d in ("", "plumbing")]
        source = open(next((p for p in where if os.path.isfile(p)), where[0])).read()
        funcs = {n.name: ast.get_source_segment(source, n) for n in ast.parse(source).body
                 if isinstance(n, ast.FunctionDef)}
        assert name in funcs, f"the docs point at {file}: {name}(), which is not defined there"
        assert not least or name in KEY_SYMBOLS, f"{name}: add its key symbols to KEY_SYMBOLS"
        missing = [k for k in KEY_SYMBOLS.get(name, []) if k not in funcs[name]]
        assert not missing, f"{file}: {name}() no longer shows {missing}"


def read_readme(section=""):
    """README.md, or only its `## section` (up to the next `## ` heading)."""
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        text = f.read()
    return text.split(f"\n## {section}\n")[1].split("\n## ")[0] if section else text


def each_test_file():
    """The test files, relative to the repo: test_algos.py, then tests/test_*.py."""
    names = sorted(f for f in os.listdir(os.path.join(ROOT, "tests"))
                   if f.startswith("test_") and f.endswith(".py"))
    return ["test_algos.py"] + [f"tests/{f}" for f in names]


# ---- the README's code map and docstrings, the 100-column rule
# What each equation in the README must show in the code it points at: the map cannot rot.
def test_readme_code_map_names_functions_that_compute_its_equations():
    check_code_map(read_readme("Reading the code"), ROOT)


def test_a_students_edit_above_a_mapped_function_keeps_the_map_valid(tmp_path):
    """The exercise kind of edit: three lines inserted above per_token_loss move every line
    below."""
    for script in ("grpo.py", "reinforce.py", "ppo.py", "sft.py", "reward_model.py", "dpo.py",
                   "common.py"):
        shutil.copy(os.path.join(ROOT, script), tmp_path / script)
    source = (tmp_path / "grpo.py").read_text()
    edit = "def rank_advantages(rewards):\n    return rewards.argsort().argsort().float()\n\n\n"
    edited = source.replace("def per_token_loss(", edit + "def per_token_loss(")
    (tmp_path / "grpo.py").write_text(edited)
    check_code_map(read_readme("Reading the code"), tmp_path)
    (tmp_path / "grpo.py").write_text(source.replace("def aggregate(", "def aggregate_renamed("))
    with pytest.raises(AssertionError, match="aggregate"):  # and a real rot is caught
        check_code_map(read_readme("Reading the code"), tmp_path)


@pytest.mark.parametrize("script", ["grpo.py", "reinforce.py", "ppo.py", "plumbing/runs.py",
                                    "sft.py", "reward_model.py", "dpo.py", "distill.py"])
def test_docstring_references_name_functions_that_exist(script):
    """`name()` in a module docstring is defined in that file (`C.name()` in common.py,
    `tasks.name()` in tasks.py, and so on)."""
    source = open(os.path.join(ROOT, script)).read()
    defined = {"": source, "C.": open(os.path.join(ROOT, "common.py")).read()}
    for module in ("plumbing/tasks", "plumbing/loading", "fastpath", "plumbing/runs"):
        defined[module.split("/")[-1] + "."] = open(os.path.join(ROOT, module + ".py")).read()
    pattern = r"\b(C\.|tasks\.|loading\.|fastpath\.|runs\.)?(\w+)\(\)"
    for prefix, name in re.findall(pattern, ast.get_docstring(ast.parse(source))):
        assert f"def {name}(" in defined[prefix], f"{script} docstring: {prefix}{name}()"


def test_every_python_line_fits_in_100_columns():
    """The style rule of pyproject.toml, checked without needing ruff installed."""
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True,
                             text=True).stdout.split()
    files = tracked or [f for f in os.listdir(ROOT) if f.endswith(".py")]
    long = [f"{f}:{i}" for f in files
            for i, line in enumerate(open(os.path.join(ROOT, f), encoding="utf-8"), 1)
            if len(line.rstrip("\n")) > 100]
    assert not long, f"{len(long)} lines over 100 columns, e.g. {long[:5]}"


# ---- the README's own task
def test_readme_own_task_shows_the_fields_its_reward_reads():
    section = read_readme("Your own task")
    for field_name in set(re.findall(r'row\["(\w+)"\]', section)):
        assert f'"{field_name}":' in section, f"no data row in the README shows {field_name!r}"


def test_readme_reward_example_runs_as_printed_with_a_learning_signal(tmp_path, monkeypatch):
    """my_rewards.py as the README prints it, with its command (2 steps): it runs on the bundled
    task, each function is logged, and the groups' rewards differ (frac_zero_std < 1)."""
    section = read_readme("Your own task")
    code = re.search(r"```python\n(# my_rewards.py\n.*?)```", section, re.S).group(1)
    command = re.search(r"\n    (python grpo.py --reward_fn my_rewards.py.*)\n", section).group(1)
    (tmp_path / "my_rewards.py").write_text(code)
    monkeypatch.chdir(tmp_path)  # where the user wrote my_rewards.py
    run_main(monkeypatch, grpo, *command.split()[2:], "--max_steps", "2", "--eval_size", "20",
             "--output_dir", "out")
    metrics = read_metrics(tmp_path / "out")
    assert {"reward/exact", "reward/short"} <= set(metrics[0])
    assert min(m["frac_zero_std"] for m in metrics) < 1, metrics
