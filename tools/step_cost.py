"""tools/step_cost.py: what a reader meets in one training step of an RL script, in lines.

    python tools/step_cost.py grpo.py        # the whole reach and the algorithm reader's
    python tools/step_cost.py grpo.py --env  # with the multi-turn engine (--env / --tools)
    python tools/step_cost.py grpo.py --objectives  # with a loss since DAPO (objectives.py)
    python tools/step_cost.py grpo.py -v     # and each function reached, longest first

The count is the lines of main()'s `for step in ...` loop plus every function of the project's
modules (the .py files at the top of the repo and in plumbing/) that the loop reaches: called or
passed as a value, transitively, over every branch; a function nested in one that is reached
counts inside it, and a class that is reached counts all its methods (an autograd Function:
forward AND backward). An object main() makes of a project class before the loop (keep =
R.Keeper(run, opt, rng, save, evaluate, ...)) counts the methods the loop calls on it (keep.steps,
keep.end_step, and what they call) and the functions main() gave it (save, evaluate), not its
other methods. Comments and docstrings count. Static, from the code's own imports: a
function reached only through a value built before the loop (the data's next_batch, an env's
start, a --reward_fn, grpo's objective) is not seen, so the README says what each option adds:
--env and --objectives count them.

Two numbers: the whole reach (every module above) and the algorithm reader's: the loop and the
functions of the script and common.py it reaches (with --env, engine.py's too, from
engine.generate, which a run with an env reaches through the env; with --objectives,
objectives.py's): what a student reads to follow the algorithm, leaving the fast paths
(fastpath.py), the objectives since DAPO (objectives.py, off by default) and the run-keeping
(plumbing/) for later.

The count is reported, not enforced: the README quotes it (tools/check_docs.py re-checks the
number). tests/test_docs.py only holds a step to four files and under STEP_CEILING, a quarter
above today's counts, so a student's change to a loop never fails the suite.
"""
import ast
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_CEILING = 1150  # lines; today 876 to 1,081 (the README), nanochat's chat_rl.py + engine 694
READER = ("common",)  # the algorithm reader's modules, besides the script (and the extras')
# a flag -> the function a value bound before the loop reaches, whose module the reader then reads
EXTRAS = {"--env": ("engine", "generate"),  # the env's generate (--env, --tools)
          "--objectives": ("objectives", "per_token_loss")}  # grpo's objective (since DAPO)


def project_modules(root=ROOT):
    """The project's modules by name: the .py files at the top (not the tests), and those of its
    package folders (plumbing/: "plumbing.runs")."""
    mods = [f[:-3] for f in os.listdir(root) if f.endswith(".py")
            and not f.startswith(("test", "conftest"))]
    for d in sorted(os.listdir(root)):
        if os.path.isfile(os.path.join(root, d, "__init__.py")) and d not in ("tests", "tools"):
            mods += [f"{d}.{f[:-3]}" for f in os.listdir(os.path.join(root, d))
                     if f.endswith(".py") and f != "__init__.py"]
    return mods


def project_functions(root=ROOT):
    """{(module, dotted name): ast node} of every function and method; {module: {name: target}}
    of each module's imports of the project (a module name, or a (module, name) pair)."""
    mods = project_modules(root)
    funcs, imports = {}, {}

    def collect(mod, node, prefix):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                if not isinstance(child, ast.ClassDef):
                    funcs[(mod, prefix + child.name)] = child
                collect(mod, child, prefix + child.name + ".")
            else:
                collect(mod, child, prefix)

    for mod in mods:
        with open(os.path.join(root, mod.replace(".", "/") + ".py"), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        collect(mod, tree, "")
        imports[mod] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imports[mod].update({a.asname or a.name: a.name for a in node.names
                                     if a.name in mods})
            elif isinstance(node, ast.ImportFrom) and node.module in mods:
                imports[mod].update({a.asname or a.name: (node.module, a.name)
                                     for a in node.names})
            elif isinstance(node, ast.ImportFrom):  # from plumbing import runs as R
                imports[mod].update({a.asname or a.name: f"{node.module}.{a.name}"
                                     for a in node.names if f"{node.module}.{a.name}" in mods})
    return funcs, imports


def lines(node):
    first = min([node.lineno] + [d.lineno for d in node.decorator_list])
    return node.end_lineno - first + 1


def step_cost(script, root=ROOT, extras=()):
    """(loop lines, {(module, name): lines} of each function the step reaches) for script; extras:
    functions the step also reaches through values bound before the loop (EXTRAS' values)."""
    funcs, imports = project_functions(root)
    me = script[:-3]
    loop = next(n for n in ast.walk(funcs[(me, "main")]) if isinstance(n, ast.For)
                and isinstance(n.target, ast.Name) and n.target.id == "step")
    # main's names for an object of a project class (keep = R.Keeper(run, ..., save, evaluate)):
    # the loop's keep.end_step reaches that one method, not the class's every method, and the
    # functions main gave the object (save, evaluate), which its methods call
    objects = {}
    for n in ast.walk(funcs[(me, "main")]):
        if isinstance(n, ast.Assign) and isinstance(n.value, ast.Call) and len(n.targets) == 1 \
                and isinstance(n.targets[0], ast.Name):
            call = ast.unparse(n.value.func)
            head, _, attr = call.partition(".")
            imported = imports[me].get(head)
            if attr and isinstance(imported, str) and any(
                    k[0] == imported and k[1].startswith(attr + ".") for k in funcs):
                objects[n.targets[0].id] = (imported, attr, n.value)

    def targets(mod, name, scope):
        """The functions a name (or `a.b`) used in function `scope` of mod stands for."""
        head, _, attr = name.partition(".")
        imported = imports[mod].get(head)
        if attr and mod == me and head in objects:  # a method of main's object, and
            call = objects[head][2]
            given = [k for a in call.args + [kw.value for kw in call.keywords]
                     if isinstance(a, ast.Name) for k in targets(mod, a.id, "main")]
            return [(objects[head][0], f"{objects[head][1]}.{attr.split('.')[0]}")] + given
        if attr and isinstance(imported, str):  # module.function, module.Class
            mod, name, scope = imported, attr.split(".")[0], ""
        elif attr and head == "self":  # a method of the class `scope` is in
            return [(mod, scope.split(".")[0] + "." + attr.split(".")[0])]
        elif isinstance(imported, tuple):  # from module import function
            mod, name, scope = imported[0], imported[1], ""
        else:
            name = head
        while True:  # the innermost enclosing scope that defines it, out to the module
            qual = f"{scope}.{name}" if scope else name
            found = [k for k in funcs if k[0] == mod and (k[1] == qual
                                                         or k[1].startswith(qual + "."))]
            if found or not scope:
                return found
            scope = scope.rpartition(".")[0]

    def used(node):
        for n in ast.walk(node):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load):
                yield n.id
            elif isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                yield f"{n.value.id}.{n.attr}"

    seen, todo = set(), [(me, "main", stmt) for stmt in [loop.iter] + loop.body]
    for key in extras:
        seen.add(key)
        todo.append((*key, funcs[key]))
    while todo:
        mod, scope, node = todo.pop()
        for name in used(node):
            for key in targets(mod, name, scope):
                if key in funcs and key not in seen:
                    seen.add(key)
                    todo.append((key[0], key[1], funcs[key]))
    # a function counts once: not again inside a reached function that encloses it
    outer = {k for k in seen if k[1] != "main" and not any(
        o[0] == k[0] and o[1] != "main" and k[1].startswith(o[1] + ".") for o in seen)}
    return loop.end_lineno - loop.lineno + 1, {k: lines(funcs[k]) for k in outer}


def reader_cost(script, loop, reached, extras=()):
    """The algorithm reader's lines: the loop and the reached functions of the script, common.py
    and the extras' modules (engine.py with --env, objectives.py with --objectives)."""
    mine = {script[:-3], *READER, *(mod for mod, _ in extras)}
    return loop + sum(n for (mod, _), n in reached.items() if mod in mine)


def main():
    script, flags = sys.argv[1], [f for f in EXTRAS if f in sys.argv]
    extras = [EXTRAS[f] for f in flags]
    loop, reached = step_cost(os.path.basename(script), extras=extras)
    files = {script} | {m.replace(".", "/") + ".py" for m, _ in reached}
    reader = reader_cost(os.path.basename(script), loop, reached, extras)
    flags = "".join(" " + f for f in flags)
    extra = "".join(f", {mod}.py" for mod, _ in extras)
    print(f"{script}{flags}: {loop + sum(reached.values())} lines (loop {loop}, "
          f"{len(reached)} functions) in {len(files)} files; ceiling {STEP_CEILING}; the "
          f"algorithm reader's {reader} lines ({script}, common.py{extra})")
    if "-v" in sys.argv:
        for (mod, name), n in sorted(reached.items(), key=lambda kv: -kv[1]):
            print(f"  {n:4} {mod}.{name}")


if __name__ == "__main__":
    main()
