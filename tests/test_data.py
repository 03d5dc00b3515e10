"""tasks.py: data files (JSONL, CSV, parquet, hf:), their errors, the held-out split."""
import csv
import json
import math
import os
import random
import re
import sys
import types

import pytest

import common as C
from plumbing.errors import UserError
import grpo
from plumbing import tasks
from tools.build_models import column_sum

from tests.helpers import FAST_GRPO, OFF, read_metrics, run_main


# ---- tasks.py: data files, formats, the held-out split
@pytest.mark.parametrize("text,need_answer,expect", [
    ('{"prompt": "a"}\nnot json\n', False, "line 2: not valid JSON"),
    ('{"prompt": "a"}\n{"answer": "1"}\n', False, "line 2: field 'prompt'"),
    ("\n\n", False, "is empty"),
    ('{"prompt": "a"}\n{"prompt": "caf\xe9"}\n'.encode("latin-1"), False,
     "line 2: not UTF-8 text"),
    ('{"prompt": "a", "answer": 3}\n{"prompt": "b", "answer": [3]}\n', False,
     "line 2: field 'answer' must be a"),
    ('{"prompt": "a", "answer": "#### 0"}\n{"prompt": "b", "answer": null}\n', True,
     "line 2: field 'answer' is missing"),
    ('{"prompt": "a", "answer": "7"}\n{"prompt": "b", "answer": "seven"}\n', True,
     "line 2: field 'answer' is missing")])
def test_jsonl_errors_name_the_line(tmp_path, text, need_answer, expect):
    f = tmp_path / "d.jsonl"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(UserError, match=expect):
        tasks.read_rows(str(f), need_answer)


def test_hub_dataset_rows_keep_only_real_answers(monkeypatch):
    """--data hf:NAME reads 'question' (or 'prompt') and 'answer', keeping every column; a missing
    answer is no answer, not the text 'None'."""
    hub_rows = [{"question": "1+1=", "answer": "#### 2"}, {"question": "x", "answer": None}] * 5
    fake = types.ModuleType("datasets")
    fake.load_dataset = lambda *a, split: hub_rows
    monkeypatch.setitem(sys.modules, "datasets", fake)
    data = tasks.load_data("hf:someone/set:main", eval_size=2)
    want = [{"question": "1+1=", "answer": "#### 2", "prompt": "1+1="},
            {"question": "x", "prompt": "x"}] * 5
    def key(row):
        return json.dumps(row, sort_keys=True)
    assert sorted(map(key, data.rows)) == sorted(map(key, want))
    assert tasks.eval_metric(data.rows) == "mean reward" and len(data.eval_rows) == 2
    with pytest.raises(UserError, match="row 1: field 'answer' is missing or has no number"):
        tasks.load_data("hf:someone/set:main", need_answer=True)
    # too few rows to hold a fifth out
    fake.load_dataset = lambda *a, split: [{"prompt": "1+1=", "answer": "2"}] * 4
    assert tasks.load_data("hf:someone/set", eval_size=2).eval_rows == []
    # no held-out rows: no score, rather than a made-up 0
    assert math.isnan(C.evaluate(None, None, [], None, OFF, {"math": 1.0})["eval"])


def test_jsonl_reads_numbers_nulls_and_a_byte_order_mark(tmp_path):
    f = tmp_path / "d.jsonl"
    f.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "answer": 2}\r\n'
                  b'\r\n'
                  b'{"prompt": "x", "answer": null}\r\n')
    assert tasks.read_rows(str(f)) == [{"prompt": "1+1=", "answer": "2"}, {"prompt": "x"}]
    # null is no answer: the math reward refuses
    with pytest.raises(UserError, match="line 3: field 'answer'"):
        tasks.read_rows(str(f), need_answer=True)

DATA_ROWS = [{"prompt": f"{i}+1=", "answer": str(i + 1), "id": f"r{i}"} for i in range(10)]


def write_data(folder, kind, monkeypatch, rows=DATA_ROWS):
    """rows written as a data source of one kind: its --data spec."""
    path = os.path.join(folder, f"d.{kind}")
    if kind in ("parquet", "files"):
        pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    if kind in ("save_to_disk", "dataset_dict", "files"):
        datasets = pytest.importorskip("datasets")
        monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", os.path.join(folder, "cache"))
    if kind == "jsonl":
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    elif kind == "json":  # one JSON array
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
    elif kind == "csv":
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif kind == "parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    elif kind == "save_to_disk":
        datasets.Dataset.from_list(rows).save_to_disk(path)
        return f"hf:{path}"
    elif kind == "dataset_dict":
        datasets.DatasetDict({"train": datasets.Dataset.from_list(rows),
                              "test": datasets.Dataset.from_list(rows[:2])}).save_to_disk(path)
        return f"hf:{path}"
    elif kind == "files":  # a folder of data files, as a hub dataset's repo holds them
        os.makedirs(path)
        for i in (0, 1):
            pq.write_table(pa.Table.from_pylist(rows[i * 5:i * 5 + 5]),
                           os.path.join(path, f"train-0000{i}-of-00002.parquet"))
        return f"hf:{path}"
    return path


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "save_to_disk",
                                  "dataset_dict", "files"])
def test_every_kind_of_data_file_gives_the_same_rows(tmp_path, monkeypatch, kind):
    """--data: JSON lines, a JSON array, CSV, parquet (pyarrow), or hf:DIR on a save_to_disk
    folder (a Dataset or a DatasetDict) or a folder of data files (datasets): the same rows."""
    spec = write_data(str(tmp_path), kind, monkeypatch)
    assert tasks.read_rows(spec) == DATA_ROWS
    data = tasks.load_data(spec, eval_size=2, need_answer=True)
    assert len(data.eval_rows) == 2 and len(data.rows) == 10
    if kind == "dataset_dict":
        assert tasks.read_rows(spec, split="test") == DATA_ROWS[:2]
        with pytest.raises(UserError, match=r"no split 'dev'; it has train, test \(pick one "
                                              r"with --data_split\)"):
            tasks.read_rows(spec, split="dev")


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk"])
def test_grpo_trains_on_a_parquet_file_and_a_save_to_disk_folder(tmp_path, monkeypatch, kind):
    spec = write_data(str(tmp_path), kind, monkeypatch, [
        {"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in tasks.task_eval_pairs()[:20]])
    run_main(monkeypatch, grpo, *FAST_GRPO, "--max_steps", "1", "--data", spec,
             "--output_dir", tmp_path / "run")
    assert [m["step"] for m in read_metrics(tmp_path / "run")] == [1]


@pytest.mark.parametrize("name,text,message", [
    ("d.csv", "prompt,answer\n1+1=,2\n2+2=\n", r"d.csv, line 3: not as many values as the "
     "header line has fields"),
    ("d.json", '[{"prompt": "1+1=", "answer": 2}, "2+2="]',
     r"d.json, row 1: not a JSON object \(found str\)"),
    ("d.jsonl", '{"prompt": "1+1=", "answer": 2}\n{"question": 5, "answer": 2}\n',
     r"d.jsonl, line 2: field 'question' is missing or not a non-empty string \(or a list of "
     r"chat messages\); fields found: question, answer"),
    ("d.jsonl", '{"prompt": "1+1=", "answer": 2}\n{"prompt": [{"role": "wizard", "content": '
     '"hi"}]}\n',
     r"d.jsonl, line 2: field 'prompt', message 0: role 'wizard' is not one of system, user, "
     "assistant, tool"),
    ("d.parquet", "not parquet", r"d.parquet': pyarrow cannot read it as parquet")])
def test_bad_data_files_get_one_line_naming_the_file_and_the_row(tmp_path, monkeypatch, capsys,
                                                                 name, text, message):
    if name.endswith("parquet"):
        pytest.importorskip("pyarrow")
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(SystemExit) as e:
        run_main(monkeypatch, grpo, "--data", path, "--output_dir", tmp_path / "run", guard=True)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and re.search(message, err[0]), err


def test_optional_packages_missing_and_a_hub_dataset_offline_are_one_line(tmp_path, monkeypatch):
    """Parquet without pyarrow, hf:... without datasets: one line naming the package. A hub
    dataset that is not cached, offline (HF_HUB_OFFLINE=1, as in every test): one line."""
    path = tmp_path / "d.parquet"
    path.write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # an import of it raises ImportError
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(UserError, match=r"d.parquet': reading parquet needs the optional "
                                          r"package `pyarrow` \(pip install pyarrow\)"):
        tasks.read_rows(str(path))
    monkeypatch.undo()
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(UserError, match=r"^--data hf:nobody/nothing:main: not in the local "
                                          "cache, and this machine cannot reach the hub"):
        tasks.read_rows("hf:nobody/nothing:main")
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(UserError, match=r"needs the optional package `datasets`"):
        tasks.read_rows(f"hf:{tmp_path}")


def test_builtin_task_split_is_held_out():
    held = set(tasks.task_eval_pairs())
    assert len(held) == tasks.TASK_EVAL_SIZE
    assert not held & set(tasks.task_train_pairs(random.Random(0), 5000))
    # the warm-start data: true sums, or with carries forgotten
    assert all(column_sum(a, b) == a + b for a, b in tasks.task_train_pairs(random.Random(1), 200))
    assert column_sum(37, 48, random.Random(0), drop=1.0) == 75


def test_an_eval_size_above_a_fifth_of_the_file_is_said_in_one_line(tmp_path, capsys):
    """At most a fifth of a file is held out (four fifths train): asking for more says so."""
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n"
                            for i in range(12)))
    assert len(tasks.load_data(str(path), eval_size=5).eval_rows) == 2
    assert capsys.readouterr().out == (f"note: {path} has 12 rows: 2 held out (a fifth at most), "
                                       "not --eval_size 5; 10 left to train on\n")
    assert len(tasks.load_data(str(path), eval_size=2).eval_rows) == 2
    assert capsys.readouterr().out == ""
