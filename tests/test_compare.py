"""`flare compare` (the command `make run` runs): same partition and init for every method, one table,
the accuracy figure and the diagnostics figure."""
import json

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
