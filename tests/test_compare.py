"""`flare compare` (the command `make run` runs): same partition and init for every method, one table,
the accuracy figure and the diagnostics figure."""
import json

import pytest

from flare.cli import main


def _final(run_dir):
    rounds = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rounds if r["kind"] == "round"][-1]


def _row(md: str, method: str) -> list[str]:
    line = next(l for l in md.splitlines() if l.startswith(f"| {method} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_compare_writes_the_table_and_both_figures(tiny_overrides, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--quiet", "--presets", "fafi,etf-anneal,fedavg", "--out", str(out), *tiny_overrides]) == 0
    md = (out / "compare.md").read_text()
    tables = md.split("Against fafi, paired by seed:")
    assert len(tables) == 2
    assert sum(l.startswith("| ") for l in tables[0].splitlines()) == 5  # header, separator, 3 methods
    paired = [l for l in tables[1].splitlines() if l.startswith("| ")]
    assert len(paired) == 4 and paired[2].startswith("| etf-anneal | fafi | 1 |")  # one seed: no test
    assert all(l.endswith("| 1 seed: no test |") for l in paired[2:])
    head = [c.strip() for c in md.splitlines()[2].strip("|").split("|")]
    for method in ("fafi", "etf-anneal", "fedavg"):
        final = _final(out / method)
        row = dict(zip(head, _row(md, method)))
        assert row["acc (primary)"].split()[0] == f"{100 * final['acc']:.2f}"
        if "g_protos_std" in final:
            assert row["g_protos_std"] == f"{final['g_protos_std']:.4f}"
        else:
            assert row["g_protos_std"] == "—"
    # the same partition for every method: a comparison, not three unrelated runs
    parts = {m: json.loads((out / m / "partition.json").read_text())["clients"] for m in ("fafi", "etf-anneal", "fedavg")}
    assert parts["fafi"] == parts["etf-anneal"] == parts["fedavg"]
    for fig in ("compare_accuracy.png", "compare_diagnostics.png"):
        assert (out / fig).read_bytes()[:4] == b"\x89PNG" and f"({fig})" in md
    assert "etf-anneal" in capsys.readouterr().out


def test_compare_of_plain_classifiers_has_no_diagnostics_figure(tiny_overrides, tmp_path):
    out = tmp_path / "cmp"
    assert main(["compare", "--quiet", "--presets", "fedavg", "--out", str(out), *tiny_overrides, "rounds=1"]) == 0
    assert (out / "compare_accuracy.png").exists()
    assert not (out / "compare_diagnostics.png").exists()
    assert "compare_diagnostics" not in (out / "compare.md").read_text()


def test_compare_checks_every_preset_before_running_any(tiny_overrides, tmp_path, capsys):
    out = tmp_path / "cmp"
    assert main(["compare", "--presets", "fafi,no-such-method", "--out", str(out), *tiny_overrides]) == 2
    assert "no-such-method" in capsys.readouterr().err
    assert not (out / "fafi").exists()


def test_final_rounds_averages_the_tail_everywhere_a_final_accuracy_is_read(tiny_overrides, tmp_path):
    """eval.final_rounds=2: the run's summary, its summary.md and the compare table all read the mean of the last
    two evaluated rounds of the primary rule, and say so; peak and diagnostics are untouched."""
    out = tmp_path / "cmp"
    tiny = [o for o in tiny_overrides if not o.startswith("rounds=")]
    assert main(["compare", "--quiet", "--presets", "fafi", "--out", str(out), *tiny, "rounds=3",
                 "eval.final_rounds=2"]) == 0
    recs = [json.loads(l) for l in (out / "fafi" / "metrics.jsonl").read_text().splitlines()]
    rounds = [r for r in recs if r["kind"] == "round"]
    tail = (rounds[1]["acc_feature"] + rounds[2]["acc_feature"]) / 2
    assert rounds[1]["acc_feature"] != rounds[2]["acc_feature"] or rounds[0]["acc_feature"] != tail  # a real mean
    from flare.rundata import RunData
    run = RunData.load(out / "fafi")
    assert run.final("acc") == tail and run.final_label == "mean of rounds 2–3"
    assert run.final("g_protos_std") == rounds[2]["g_protos_std"]
    assert run.summary()["acc_output"] == (rounds[1]["acc_output"] + rounds[2]["acc_output"]) / 2
    md = (out / "compare.md").read_text()
    head = [c.strip() for c in md.splitlines()[2].strip("|").split("|")]
    assert "acc (primary; mean of rounds 2–3)" in head
    assert dict(zip(head, _row(md, "fafi")))["acc (primary; mean of rounds 2–3)"].split()[0] == f"{100 * tail:.2f}"
    assert "| rule | final (mean of rounds 2–3) |" in (out / "fafi" / "summary.md").read_text()


@pytest.mark.long
def test_compare_with_two_workers_gives_one_thread_runs_of_the_same_plan(tiny_overrides, tmp_path):
    """--workers 2 runs the plan in two one-thread processes: the same records as running each run alone at one
    thread, and the same table."""
    par, seq = tmp_path / "par", tmp_path / "seq"
    assert main(["compare", "--quiet", "--presets", "fafi,fedavg", "--seeds", "1,2", "--workers", "2", "--out",
                 str(par), *tiny_overrides, "rounds=1"]) == 0
    import torch
    assert torch.get_num_threads() == 1  # the tests' own setting: the sequential side runs at one thread too
    assert main(["compare", "--quiet", "--presets", "fafi,fedavg", "--seeds", "1,2", "--out", str(seq),
                 *tiny_overrides, "rounds=1"]) == 0
    for m in ("fafi", "fedavg"):
        for s in (1, 2):
            a, b = (d / m / f"seed={s}" / "metrics.jsonl" for d in (par, seq))
            strip = lambda p: [{k: v for k, v in json.loads(l).items() if not k.startswith("seconds")}
                               for l in p.read_text().splitlines()]
            assert strip(a) == strip(b), (m, s)
    assert json.loads((par / "fafi" / "seed=1" / "sweep_point.json").read_text())["threads"] == 1


def test_compare_workers_must_be_a_positive_count(tiny_overrides, tmp_path, capsys):
    import pytest
    for bad in ("0", "two", "-1"):
        with pytest.raises(SystemExit) as e:
            main(["compare", "--presets", "fafi", "--workers", bad, "--out", str(tmp_path / "x"), *tiny_overrides])
        assert e.value.code == 2 and "--workers" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_a_failed_worker_is_one_paragraph_naming_the_run(tiny_overrides, tmp_path, capsys, monkeypatch):
    """A run that crashed in a worker process is reported with its error and what to do, not as a traceback."""
    from flare.experiments import compare as compare_mod

    def one_fails(points, **kw):
        return {p.name: ({"status": "failed", "error": "ZeroDivisionError: boom"} if i == 0 else {"status": "done"})
                for i, p in enumerate(points)}

    monkeypatch.setattr(compare_mod, "execute_points", one_fails)
    rc = main(["compare", "--quiet", "--presets", "fafi,fedavg", "--workers", "2", "--out", str(tmp_path / "c"),
               *tiny_overrides])
    err = capsys.readouterr().err
    assert rc == 2 and "1 of 2 compare runs failed — fafi: ZeroDivisionError: boom" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
