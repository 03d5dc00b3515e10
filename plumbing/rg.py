"""rg.py: reasoning-gym's generators as data and reward, --data rg:NAME (plumbing: an algorithm
reader can skip it). Needs the optional package reasoning-gym (pip install reasoning-gym==0.1.25).

--data 'rg:NAME?KEY=VALUE&KEY=VALUE:WEIGHT,NAME...' (quote it: ? and & mean something to the
shell): one generator, or a mixture drawn by weight (default 1 each), each with its settings, e.g.
'rg:chain_sum?max_terms=2&max_digits=1' or 'rg:basic_arithmetic:2,leg_counting:1'. KEY: any field
of the generator's config (reasoning-gym's docs list them; a wrong one is refused with the valid
ones), seed (default 0) or size (default 100000): a value is read as a number, true/false, or text;
a list field takes its items joined by | (operators=+|-). Each row is the generator's question in
one user message, then ASK; its "answer", "rg_task" and "rg_entry" (the generator's whole item)
go with it.

Held out, never trained on: the training items are the generator's items 0 .. size - 1 at `seed`,
drawn at random (reasoning-gym makes item i from random.Random(seed + i)); the held-out items are
items 0 .. n - 1 at EVAL_SEED = 2**31, seeds no training item reaches while seed + size <=
2**31, and every seed stays under 2**32, numpy's limit (pool_matrix seeds numpy with seed + i);
a training item whose question is a held-out question is drawn again (a small generator repeats
questions). A mixture holds out --eval_size rows shared by weight.

The reward rg (--rewards rg=1) is the generator's own score_answer on the answer the completion
states: the last <answer>...</answer>, or without one the last line, after its last '=' (a small
model writes "4 + 7 = 11"). Scores are reasoning-gym's, partial credit included (0-1). rg_strict
reads the answer as reasoning-gym does (no tags: no answer, 0); docs/tasks.md says why rg is not.

Curriculum (--curriculum_up): a generator with a reasoning-gym curriculum trains at a level (0:
its easiest settings; each level up raises every attribute one step, e.g. chain_sum's number of
terms and digits) that tasks.observe moves with the training score; the held-out split stays at
the settings given (the target).
"""
import functools
import re
from types import SimpleNamespace

from plumbing.errors import UserError, first_line

try:  # optional: --data rg:... needs it
    import reasoning_gym
    from reasoning_gym import factory
except ImportError:
    reasoning_gym = None

PREFIX = "rg:"
EVAL_SEED = 2**31  # the held-out items' seed: above every training item's seed + index, and
# EVAL_SEED + n below numpy's 2**32 (np.random.seed refuses more) for any --eval_size n < 2**31
SIZE = 100_000  # training items per generator, unless size=N
ASK = "\n\nWork it out briefly, then give the final answer in <answer></answer> tags."
# --data rg:... sets these defaults for the RL scripts on a real model (explicit flags still win):
# measured on SmolLM2-135M-Instruct, 2 CPU cores (docs/tasks.md). "4 + 7 = 11" and its EOS are
# about 8 tokens, a tagged answer after a line of work about 20: 24 cuts few; T 0.7 and lr 2e-5
# as chat-sums' preset (docs/real_model.md); beta 0 loads no reference model
PRESET = {"rewards": "rg=1", "max_new_tokens": 24, "temperature": 0.7, "lr": 2e-5, "beta": 0.0,
          "prompts_per_step": 4, "micro_batch_size": 32, "eval_size": 128, "max_steps": 8,
          "eval_every": 4, "save_every": 0, "samples_every": 5}
PRESET_ALGO = {"grpo": {"group_size": 8},
               "reinforce": {"samples_per_prompt": 8, "baseline": "rloo"},
               "ppo": {"batch_size": 32, "micro_batch_size": 16, "critic_init": "policy",
                       "critic_lr": 1e-5, "ppo_epochs": 1, "num_minibatches": 2},
               # one sample of 32 prompts, jsd's beta TRL's 1 (chat-sums's distill preset
               # moved to the forward KL, --loss jsd --beta 0: not measured on rg)
               "distill": {"samples_per_prompt": 1, "prompts_per_step": 32, "beta": 1.0}}


def preset(data, algo, names):
    """The flags' defaults for --data rg:... in algo's script, those of its flags (names) only."""
    if not data.startswith(PREFIX) or algo not in PRESET_ALGO:
        return {}
    return {k: v for k, v in {**PRESET, **PRESET_ALGO[algo]}.items() if k in names}


def value(text):
    """A setting's value: an int, a float, true/false, else the text itself."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def parse(spec):
    """'rg:NAME?K=V&K=V:W,NAME' -> [(name, {setting: value}, weight)], checked: one line each."""
    if reasoning_gym is None:
        raise UserError(f"--data {spec}: needs the optional package reasoning-gym "
                        "(pip install reasoning-gym==0.1.25)")
    out = []
    for part in spec[len(PREFIX):].split(","):
        head, _, weight = part.rpartition(":") if re.search(r":[\d.]+$", part) else (part, "", "")
        name, _, query = head.partition("?")
        if name not in factory.DATASETS:
            close = [n for n in factory.DATASETS if name and (name in n or n in name)][:5]
            raise UserError(f"--data {spec}: reasoning-gym has no generator {name!r}"
                            + (f" (did you mean {', '.join(close)}?)" if close else ""))
        fields = factory.DATASETS[name][1].__dataclass_fields__
        settings = {}
        for item in filter(None, query.split("&")):
            key, eq, text = item.partition("=")
            if not eq or key not in fields:
                raise UserError(f"--data {spec}: {name} has no setting {key!r} (KEY=VALUE; its "
                                f"settings: {', '.join(fields)})")
            default = fields[key].default
            settings[key] = tuple(text.split("|")) if isinstance(default, (tuple, list)) \
                else value(text)
        w = float(weight or 1)
        if not w > 0:
            raise UserError(f"--data {spec}: the weight of {name} must be > 0, not {weight}")
        out.append((name, settings, w))
    return out


def config(name, settings, level=None):
    """The generator's config: its defaults, the curriculum's level (if any), then settings."""
    if level is not None:
        curriculum = factory.create_curriculum(name)
        curriculum.set_global_level(level)
        return curriculum.generate_configuration({**settings, "seed": 0, "size": 1})
    return factory.DATASETS[name][1](**{**settings, "seed": 0, "size": 1})


@functools.lru_cache(maxsize=64)
def generator(name, settings, seed, level=None):
    """The generator at these settings (a tuple of items) and seed (and level), made once."""
    try:
        cfg = config(name, dict(settings), level)
        cfg.seed, cfg.size = seed, SIZE
        if hasattr(cfg, "validate"):
            cfg.validate()
        return factory.DATASETS[name][0](config=cfg)
    except (AssertionError, ValueError, TypeError) as e:  # reasoning-gym's checks of settings
        raise UserError(f"--data rg:{name}: reasoning-gym refuses the settings "
                        f"{dict(settings)} ({type(e).__name__}: {first_line(e)})") from None


@functools.lru_cache(maxsize=None)
def max_level(name):
    """The highest curriculum level that still raises some attribute of name's curriculum."""
    return max(len(a.levels) for a in factory.create_curriculum(name).attributes.values()) - 1


def check_levels(name, settings, seed):
    """Every level the curriculum can reach (0 .. max_level) makes a generator, checked at load:
    reasoning-gym's own level values break some (caesar_cipher's rotation at levels 2-3), which
    would otherwise stop the run when the curriculum got there. One line naming those it takes."""
    refused, why = [], ""
    for level in range(max_level(name) + 1):
        try:
            generator(name, settings, seed, level)
        except UserError as e:
            refused.append(level)
            why = why or str(e).partition(f"{dict(settings)} (")[2][:-1]  # generator()'s reason
    if refused:
        top = max_level(name)
        taken = ", ".join(str(n) for n in range(top + 1) if n not in refused) or "none"
        raise UserError(f"--curriculum_up: reasoning-gym refuses {name}'s curriculum at level(s) "
                        f"{', '.join(map(str, refused))} of 0-{top} ({why}); it takes {taken}: "
                        f"train {name} without --curriculum_up, at the settings given")


def row(name, entry):
    return {"prompt": [{"role": "user", "content": entry["question"] + ASK}],
            "answer": str(entry["answer"]), "rg_task": name, "rg_entry": entry}


def load(spec, eval_size, curriculum, make_row):
    """tasks.load_data's answer for rg:...: next_batch(rng, k) -> k training rows (at level
    state["level"][name] when the curriculum is on), eval_rows (held out), rows (eval_rows) and
    state (the curriculum's levels, saved in checkpoints). make_row(raw row) -> a data row."""
    tasks = parse(spec)
    total = sum(w for _, _, w in tasks)
    eval_rows, level, train = [], {}, []  # train: (name, settings, seed, size), weights
    for name, settings, w in tasks:
        seed, size = settings.pop("seed", 0), settings.pop("size", SIZE)
        if not (0 <= seed and 0 < size and seed + size <= EVAL_SEED):
            raise UserError(f"--data rg:{name}: seed + size must be <= 2**31 (the held-out "
                            f"seed) and size > 0, not seed {seed}, size {size}")
        held = generator(name, tuple(sorted(settings.items())), EVAL_SEED)  # the given settings
        n = max(1, round(eval_size * w / total))  # a mixture: shared by weight
        eval_rows += [make_row(row(name, held[i])) for i in range(n)]
        if curriculum:  # the curriculum sets the fields its attributes move; the rest stay
            if not factory.has_curriculum(name):
                raise UserError(f"--curriculum_up: reasoning-gym has no curriculum for {name}")
            level[name] = 0
            moved = {getattr(a, f, None) for a in factory.create_curriculum(name).attributes
                     .values() for f in ("lower_field_name", "upper_field_name", "field_name")}
            settings = {k: v for k, v in settings.items() if k not in moved}
            check_levels(name, tuple(sorted(settings.items())), seed)
        train.append((name, tuple(sorted(settings.items())), seed, size))
    weights = [w for _, _, w in tasks]
    questions = {r["rg_entry"]["question"] for r in eval_rows}

    state = {"level": level, "tasks": [t[0] for t in train]}  # tasks.observe moves the levels

    def next_batch(rng, k):
        out = []
        for _ in range(k):
            name, settings, seed, size = rng.choices(train, weights)[0]
            gen = generator(name, settings, seed, state["level"].get(name))
            for _ in range(1000):  # a held-out question: draw again
                entry = gen[rng.randrange(size)]
                if entry["question"] not in questions:
                    break
            else:
                raise UserError(f"--data rg:{name}: 1000 draws in a row were held-out "
                                "questions: its settings make too few distinct questions")
            out.append(make_row(row(name, entry)))
        return out
    return SimpleNamespace(next_batch=next_batch, eval_rows=eval_rows, rows=eval_rows,
                           state=state)


def stated_answer(completion, strict=False):
    """What the completion gives as its answer: the last <answer>...</answer>, else its last
    line, after the line's last '=' (strict: else None, as reasoning-gym's extract_answer)."""
    tagged = re.findall(r"<answer>(.*?)</answer>", completion, re.S)
    if tagged:
        return tagged[-1].strip()
    if strict:
        return None
    lines = completion.strip().splitlines()
    return lines[-1].rpartition("=")[2].strip() if lines else ""


@functools.lru_cache(maxsize=None)
def scorer(name):
    return factory.get_score_answer_fn(name)


def score(completion, row, strict=False):
    try:
        return float(scorer(row["rg_task"])(stated_answer(completion, strict), row["rg_entry"]))
    except Exception:  # a verifier that chokes on the model's text (an expression it cannot
        return 0.0  # parse): a wrong answer, not a crashed run


def reward(completions, rows, strict=False):
    """--rewards rg: each row's generator scores the answer its completion states (0-1)."""
    if rows and "rg_task" not in rows[0]:
        raise UserError("--rewards rg scores reasoning-gym's rows: give --data rg:NAME")
    return [score(c, r, strict) for c, r in zip(completions, rows)]
