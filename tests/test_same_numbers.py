"""tools/same_numbers.py's comparison on constructed records (no preset runs, no git)."""
import importlib.util
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("same_numbers_tool", ROOT / "tools" / "same_numbers.py")
tool = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = tool  # dataclasses look their module up there
spec.loader.exec_module(tool)


def records():
    return [
        {"kind": "client", "round": 0, "client": 0, "loss_cls": 2.452915736607143, "lambda": 5.0, "seconds": 0.21},
        {"kind": "round", "round": 0, "method": "fafi", "acc_feature": 0.135, "client_acc": [0.12, 0.135],
         "loss_x": "nan", "seconds_eval": 0.07, "seconds_train": 0.49, "seconds": 0.56},
    ]


def test_identical_records_are_ok():
    c = tool.compare_records(records(), records())
    assert c.identical and c.differences == [] and c.records == (2, 2)
    assert c.ignored == {"seconds", "seconds_eval", "seconds_train"}


def test_changed_value_is_reported_with_its_key():
    after = records()
    after[1]["acc_feature"] = 0.14
    c = tool.compare_records(records(), after)
    assert not c.identical
    d = c.differences[0]
    assert (d.index, d.key, d.before, d.after) == (1, "acc_feature", 0.135, 0.14)
    assert "record 1, acc_feature" in d.describe()


def test_last_bit_of_a_float_and_json_type_count():
    after = records()
    after[0]["loss_cls"] = math.nextafter(2.452915736607143, 3.0)  # one ulp away
    assert after[0]["loss_cls"] != 2.452915736607143
    assert [d.key for d in tool.compare_records(records(), after).differences] == ["loss_cls"]
    after = records()
    after[0]["lambda"] = 5  # int instead of float: not the same JSON
    assert [d.key for d in tool.compare_records(records(), after).differences] == ["lambda"]
    after = records()
    after[1]["client_acc"] = [0.12, 0.136]  # inside a list
    assert [d.key for d in tool.compare_records(records(), after).differences] == ["client_acc"]


def test_timing_keys_are_ignored():
    after = records()
    after[0]["seconds"] = 9.9
    after[1].update(seconds_eval=1.0, seconds_train=2.0, seconds=3.0, server_seconds=4.0, wall=5.0, time=6.0)
    c = tool.compare_records(records(), after)
    assert c.identical, [d.describe() for d in c.differences]
    assert {"server_seconds", "wall", "time"} <= c.ignored
    assert not tool.is_timing_key("acc_seconds_feature")  # only prefix/suffix rules
    assert tool.is_timing_key("otfusion.seconds") and tool.is_timing_key("dense.seconds_synthesis")
    assert not tool.is_timing_key("otfusion.unmoved_share")


def test_key_on_one_side_only_is_reported():
    after = records()
    after[0]["new_metric"] = 1.0
    c = tool.compare_records(records(), after)
    assert [(d.index, d.key, d.before, d.after) for d in c.differences] == [(0, "new_metric", tool._MISSING, 1.0)]
    before = records()
    before[1]["old_metric"] = 2.0
    c = tool.compare_records(before, records())
    assert [(d.index, d.key) for d in c.differences] == [(1, "old_metric")]


def test_allow_listed_key_only_on_the_after_side_is_accepted_and_counted():
    assert set(tool.ALLOWED_NEW_KEYS) == {"evaluated"}  # minimal and documented
    after = records()
    after[1]["evaluated"] = True
    c = tool.compare_records(records(), after)
    assert c.identical and c.allowed == {"evaluated": 1}
    c = tool.compare_records(after, records())  # on the before side only: a difference
    assert [d.key for d in c.differences] == ["evaluated"]
    after[1]["evaluated"] = False  # present on both sides with different values: a difference
    before = records()
    before[1]["evaluated"] = True
    assert [d.key for d in tool.compare_records(before, after).differences] == ["evaluated"]


def test_record_count_differs():
    c = tool.compare_records(records(), records()[:1])
    assert not c.identical and c.records == (2, 1)
    assert (c.differences[0].index, c.differences[0].key) == (None, "records")


def test_read_records_and_finished_marker(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records()))
    assert tool.read_records(d / "metrics.jsonl") == records()
    assert not tool.finished(d)
    (d / "config.yaml").write_text("rounds: 2\n")
    (d / "state.json").write_text(json.dumps({"status": "running", "rounds_done": 1, "warnings": []}))
    assert not tool.finished(d)
    (d / "state.json").write_text(json.dumps({"status": "finished", "rounds_done": 2, "warnings": []}))
    assert tool.finished(d)


def _tree(root: Path, runs: dict) -> Path:
    for (method, seed), recs in runs.items():
        d = root / method / f"seed={seed}"
        d.mkdir(parents=True)
        (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return root


def test_dirs_compares_two_run_trees_made_anywhere(tmp_path, capsys):
    """`--dirs A B`: another machine's `make run` against the committed records — identical runs pass (timing keys
    aside), a changed bit or a run on one side only fails, and a missing tree is bad input (exit 2)."""
    slower = [{**r, "seconds": 9.0} for r in records()]
    a = _tree(tmp_path / "a", {("fafi", 1): records(), ("fedavg", 1): records()})
    b = _tree(tmp_path / "b", {("fafi", 1): slower, ("fedavg", 1): records()})
    assert tool.main(["--dirs", str(a), str(b)]) == 0
    assert "ALL IDENTICAL" in capsys.readouterr().out
    changed = records()
    changed[1]["acc_feature"] = math.nextafter(0.135, 1)
    c = _tree(tmp_path / "c", {("fafi", 1): records(), ("fedavg", 1): changed, ("flare", 2): records()})
    rows, ok, _ = tool.compare_dirs(a, c)
    assert not ok and [r[0] for r in rows] == ["fafi/seed=1", "fedavg/seed=1", "flare/seed=2"]
    assert rows[1][2] == "no" and "record 1, acc_feature" in rows[1][3]
    assert rows[2][2] == "no" and "only under" in rows[2][3]
    assert tool.main(["--dirs", str(a), str(c)]) == 1
    assert tool.main(["--dirs", str(a), str(tmp_path / "nowhere")]) == 2
    assert "not a directory of runs" in capsys.readouterr().err
    for argv in (["--before", "HEAD"], ["--dirs", str(a), str(b), "--before", "HEAD"]):
        try:
            tool.parse_args(argv)
        except SystemExit as e:
            assert e.code == 2
        else:
            raise AssertionError(f"{argv} must be refused")
