"""`flare report`: tables (mean ± std over seeds), λ tables and figures, parameter sweeps, partial runs."""
import functools
import json
import shutil

import numpy as np
import pytest

from flare.cli import main
from flare.config import load_config
from flare.report import figures, runs as rp
from flare.rundata import RunData
from flare.runner import Run




@pytest.fixture(scope="module")
def runs(tiny_folder, tmp_path_factory):
    """7 tiny runs: FAFI and FLARE × 2 seeds at α=0.5, V7 with λ0 ∈ {1, 5}, FAFI at α=1.0."""
    root = tmp_path_factory.mktemp("report_runs")
    base = [f"dataset.name=imagefolder", f"dataset.root={tiny_folder}", f"dataset.cache_dir={root / 'cache'}",
            "model.name=cnn", "model.width=0.25", "num_clients=3", "rounds=2", "batch_size=16", "device=cpu",
            "test_batch_size=32", "partition.alpha=0.5"]
    plan = [("a", "fafi", ["seed=1"]), ("a", "fafi", ["seed=2"]), ("a", "flare", ["seed=1"]),
            ("a", "flare", ["seed=2"]), ("b", "etf-anneal", ["align.lambda0=1"]),
            ("b", "etf-anneal", ["align.lambda0=5"]), ("c", "fafi", ["partition.alpha=1.0"])]
    for group, preset, extra in plan:
        d = root / group / f"{preset}-{'-'.join(extra)}"
        Run(load_config(None, preset, base + extra), d, quiet=True).execute()
    return root


def test_grouping_rows_and_stats(runs):
    data = rp.load_runs([runs])
    assert len(data) == 7
    secs = rp.sections(data)
    assert len(secs) == 2  # α = 0.5 and α = 1.0
    s05 = next(s for s in secs if s.setting["partition.alpha"] == 0.5)
    labels = {r.label: r for r in s05.rows}
    assert set(labels) == {"fafi", "flare", "etf-anneal (lambda0=1)", "etf-anneal (lambda0=5)"}
    fafi = labels["fafi"]
    assert fafi.seeds == [1, 2]
    m, sd, n = fafi.stat("acc")
    assert n == 2 and 0 <= m <= 1 and sd == sd  # a std exists with two seeds
    pk, pr, _ = fafi.peak()
    assert pr in (1, 2) and pk >= m - 1e-9  # rounds are counted from 1
    flare = labels["flare"]
    assert flare.client_mean_curves("lambda_eff").shape == (2, 2)
    assert flare.stat("lambda_raw")[0] > 0
    sweeps = rp.param_sweeps(data)
    assert "align.lambda0" in sweeps and "partition.alpha" in sweeps
    assert sweeps["align.lambda0"][0].x == [1.0, 5.0]
    assert [len(r.runs) for r in sweeps["partition.alpha"][0].rows] == [2, 1]  # fafi: 2 seeds at 0.5, 1 at 1.0


def test_report_command_writes_tables_and_figures(runs, tmp_path):
    # a partial run: the last round cut off, status running
    part = runs / "partial"
    if not part.exists():
        shutil.copytree(runs / "a" / "fafi-seed=1", part)
        lines = (part / "metrics.jsonl").read_text().splitlines()
        keep = [ln for ln in lines if json.loads(ln)["round"] == 0]
        (part / "metrics.jsonl").write_text("\n".join(keep) + "\n")
        (part / "state.json").write_text(json.dumps({"status": "running", "rounds_done": 1}))
        cfg = (part / "config.yaml").read_text().replace("seed: 1", "seed: 3")
        (part / "config.yaml").write_text(cfg)
    out = tmp_path / "rep"
    assert main(["report", str(runs / "a"), str(runs / "b"), str(runs / "c"), str(part), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    for s in ("final acc (%)", "peak acc (%) (round)", "g_protos_std", "inter_client_proto_std", " ± ",
              "Learned alignment strength", "final λ_raw", "Global predictors (server strategies)",
              "Parameter sweeps", "### align.lambda0", "### partition.alpha", "1/2 rounds", "label_distribution.png"):
        assert s in md, s
    pngs = {p.name for p in out.glob("*.png")}
    assert "label_distribution.png" in pngs and "sweep_align.lambda0.png" in pngs and "sweep_partition.alpha.png" in pngs
    assert any(p.startswith("accuracy_") for p in pngs)
    assert any(p.startswith("lambda_eff_") for p in pngs) and any(p.startswith("lambda_raw_") for p in pngs)
    for p in out.glob("*.png"):
        assert p.stat().st_size > 5000, p  # a real picture, not an empty canvas
        assert f"]({p.name})" in md
    # the numbers: FAFI's row at α = 0.5 is the mean ± std over its runs' last rounds, read here directly
    # (its seeds 1 and 2, and the partial run, seed 3, whose last complete round is its first)
    finals = []
    for d in (runs / "a" / "fafi-seed=1", runs / "a" / "fafi-seed=2", part):
        recs = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
        finals.append(100 * [r for r in recs if r["kind"] == "round"][-1]["acc_feature"])
    want = f"{np.mean(finals):.2f} ± {np.std(finals, ddof=1):.2f}"
    row = next(ln for ln in md.splitlines() if ln.startswith("| fafi | V4 (FAFI) | 3 |"))
    assert row.split(" | ")[3] == want, (row, want)


def test_report_on_nothing_is_a_clear_error(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main(["report", str(tmp_path / "empty")]) == 2
    assert "no run directories" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_v7_schedule_matches_the_logged_lambda(runs):
    r = RunData.load(runs / "b" / "etf-anneal-align.lambda0=5")
    logged = r.client_curve("lambda")
    assert logged is not None
    sched = figures.v7_schedule(r.cfg, len(r.rounds))
    assert abs(logged[:, 0] - sched).max() < 1e-6


def test_every_preset_has_its_own_colour():
    from flare.config import list_presets

    colours = {p: figures.method_colour(p) for p in list_presets()}
    assert len(set(colours.values())) == len(colours), colours
    assert all(m.get("label") and m.get("color") for m in list_presets().values())


def test_a_new_preset_brings_its_own_label_and_colour(runs, tmp_path, monkeypatch):
    """A preset the report code has never seen: its YAML's label and colour reach the figures, its config holds
    neither; a method no preset describes gets a fixed colour from matplotlib's cycle."""
    import matplotlib

    from flare.config import load as config_load, preset_mapping
    from flare.report import style

    presets = tmp_path / "presets"
    shutil.copytree(config_load._preset_dir(), presets)
    (presets / "zz-novel.yaml").write_text('notes_name: V99\nlabel: Novel (V99)\ncolor: "#123456"\n'
                                           "description: a method added after the report code was written.\n"
                                           "loss: {objective: fafi}\n")
    monkeypatch.setattr(config_load, "_preset_dir", lambda: presets)
    # the presets are parsed once per process: a fresh cache for this test's folder, the old one back after it
    monkeypatch.setattr(config_load, "_parsed_presets", functools.cache(config_load._parsed_presets.__wrapped__))
    assert style.method_label("zz-novel") == "Novel (V99)" and style.method_colour("zz-novel") == "#123456"
    assert "label" not in preset_mapping("zz-novel") and load_config(None, "zz-novel").method == "zz-novel"
    drawn = []
    monkeypatch.setattr(figures, "save_figure", lambda fig, path, dpi=120: drawn.append(fig))
    row = rp.Row("novel", "zz-novel", {}, [RunData.load(runs / "a" / "fafi-seed=1")])
    figures.plot_accuracy_curves([row], tmp_path / "f.png", "a new preset")
    assert matplotlib.colors.to_hex(drawn[0].axes[0].lines[0].get_color()) == "#123456"
    cycle = [matplotlib.colors.to_hex(c) for c in matplotlib.rcParamsDefault["axes.prop_cycle"].by_key()["color"]]
    assert style.method_colour("a-plugins-method") in cycle
    assert style.method_colour("a-plugins-method") == style.method_colour("a-plugins-method")
    assert style.method_label("a-plugins-method") == "a-plugins-method"
