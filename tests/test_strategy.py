"""Server strategies (flare/server/strategy.py) and `flare fuse`: the built-in rules are registered strategies whose
numbers did not move, a plugin's strategy runs as a method's primary and through `flare fuse`, and fuse over a
finished run's saved states reproduces the run's own last-round accuracies exactly and resumes."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import copy_of_finished_run, finished_fedavg_run, flare_in_process
from flare.config import load_config
from flare.errors import FlareError
from flare.registry import STRATEGIES
from flare.rundir import read_jsonl
from flare.runner import Run
from flare.server.rounds import rules_for


def class0_share(tiny_folder: Path) -> float:
    """The share of class 0 in the tiny folder's test split, counted from its files."""
    counts = {d.name: len(list(d.iterdir())) for d in (tiny_folder / "test").iterdir()}
    return counts[sorted(counts)[0]] / sum(counts.values())


def rounds_of(d: Path) -> list[dict]:
    return [r for r in read_jsonl(d / "metrics.jsonl") if r["kind"] == "round"]


def fuse(*argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "flare.cli", "fuse", *map(str, argv)], capture_output=True, text=True)


def fuse_in_process(capsys, *argv) -> subprocess.CompletedProcess:
    return flare_in_process(["fuse", *argv], capsys)


def test_the_builtin_rules_are_registered_in_their_order():
    builtin = [n for n in STRATEGIES.names() if STRATEGIES.get(n).__module__.startswith("flare.")]  # a test plugin
    assert builtin[:5] == ["feature", "iffi", "iffi_reference", "output", "fedavg"]  # may be imported first
    assert rules_for(load_config(None, "fafi")) == ("feature", "iffi", "iffi_reference", "output", "fedavg")
    assert rules_for(load_config(None, "fedavg")) == ("output", "fedavg")


@pytest.fixture
def finished_run(tiny_overrides, tmp_path):
    return copy_of_finished_run("fafi", tmp_path / "fafi",
                                lambda d: Run(load_config(None, "fafi", tiny_overrides), d, quiet=True).execute())


def test_fuse_reproduces_the_runs_last_round_and_resumes(finished_run, capsys):
    last = rounds_of(finished_run)[-1]
    r = fuse_in_process(capsys, finished_run, "--strategies", "feature,iffi,output,fedavg")
    assert r.returncode == 0, r.stderr
    recs = read_jsonl(finished_run / "fuse.jsonl")
    assert [f["strategy"] for f in recs] == ["feature", "iffi", "output", "fedavg"]
    for f in recs:
        assert f["kind"] == "fuse" and f["round"] == last["round"] == 1
        assert f["acc"] == last[f"acc_{f['strategy']}"], f  # the same states, G, noise and test pass: exact
    assert f"feature acc = {100 * last['acc_feature']:.2f}%" in r.stdout
    summary = (finished_run / "summary.md").read_text()
    assert "## Server strategies over the saved uploads" in summary and "| fedavg |" in summary
    again = fuse_in_process(capsys, finished_run, "--strategies", "fedavg,iffi_reference")  # fedavg was fused: only the new one runs
    assert again.returncode == 0, again.stderr
    recs2 = read_jsonl(finished_run / "fuse.jsonl")
    assert recs2[:4] == recs and [f["strategy"] for f in recs2[4:]] == ["iffi_reference"]
    assert recs2[4]["acc"] == last["acc_iffi_reference"]


def test_a_plugin_strategy_through_fuse_and_in_the_report(finished_run, tiny_folder, tmp_path, capsys):
    last = rounds_of(finished_run)[-1]
    # a fresh process, where only --plugin can have imported the plugin's strategies
    r = fuse(finished_run, "--strategies", "demo_class0,demo_pick", "--plugin", "flare_demo_plugin")
    assert r.returncode == 0, r.stderr
    got = {f["strategy"]: f["acc"] for f in read_jsonl(finished_run / "fuse.jsonl")}
    assert got["demo_class0"] == class0_share(tiny_folder) == 0.25
    assert got["demo_pick"] == last["client_acc"][0]  # client 0's own model, scored by the shared evaluator
    rep = flare_in_process(["report", finished_run, "--out", tmp_path / "rep"], capsys)
    assert rep.returncode == 0, rep.stderr
    text = (tmp_path / "rep" / "report.md").read_text()
    assert "## Server strategies over the saved uploads" in text and "| demo_class0 | 25.00 |" in text


def test_a_plugin_strategy_as_the_methods_primary(tiny_overrides, tiny_folder, tmp_path):
    ov = tiny_overrides + ["plugins=[flare_demo_plugin]", "server.primary=demo_class0",
                           "server.strategies.demo_pick.client=1", "eval.rules=[primary,demo_pick,fedavg]"]
    cfg = load_config(None, "fafi", ov)
    assert cfg.server.strategies == {"demo_pick": {"client": 1}}
    assert rules_for(cfg, 0) == ("fedavg", "demo_class0") and rules_for(cfg, 1) == ("fedavg", "demo_class0",
                                                                                     "demo_pick")
    d = tmp_path / "run"
    summary = Run(cfg, d, quiet=True).execute()
    rounds = rounds_of(d)
    share = class0_share(tiny_folder)
    assert [r["primary"] for r in rounds] == ["demo_class0"] * 2
    assert [r["acc"] for r in rounds] == [r["acc_demo_class0"] for r in rounds] == [share, share]
    assert "acc_demo_pick" not in rounds[0]  # every_round=False: the last round only
    assert rounds[1]["acc_demo_pick"] == rounds[1]["client_acc"][1]
    assert summary["acc"] == share
    assert "| demo_class0 (primary) | 25.00 |" in (d / "summary.md").read_text()


def test_strategy_options_are_validated_with_the_config(tiny_overrides):
    with pytest.raises(FlareError, match=r"server\.strategies\.demo_pick\.client"):
        load_config(None, "fafi", tiny_overrides + ["plugins=[flare_demo_plugin]",
                                                    "server.strategies.demo_pick.client=many"])
    with pytest.raises(FlareError, match="takes no options"):
        load_config(None, "fafi", tiny_overrides + ["server.strategies.feature.x=1"])


def test_fuse_refuses_a_prototype_strategy_for_a_plain_classifier(tiny_overrides, tmp_path, capsys):
    d = finished_fedavg_run(tiny_overrides, tmp_path / "fedavg")
    r = fuse_in_process(capsys, d, "--strategies", "feature")
    assert r.returncode == 2 and "reads prototypes" in r.stderr and "Traceback" not in r.stderr
    assert not (d / "fuse.jsonl").exists()
    assert json.loads((d / "state.json").read_text())["status"] == "finished"


# ----------------------------------------------------------------------------------------------
# client statistics a strategy asks for (Upload.extras, server/extras.py)


def partition_class_totals(run_dir: Path) -> list[int]:
    clients = json.loads((run_dir / "partition.json").read_text())["clients"]
    return [sum(c["class_histogram"][k] for c in clients) for k in range(len(clients[0]["class_histogram"]))]


def test_a_strategy_gets_the_client_statistics_it_asks_for(tiny_overrides, tmp_path):
    """demo_counts asks every client for its class counts; what it logs is computed from what arrived, and equals
    the partition's class totals: in the run (every round) and in `flare fuse` over the saved states."""
    cfg = load_config(None, "fafi", tiny_overrides + ["plugins=[flare_demo_plugin]",
                                                      "eval.rules=[primary,demo_counts]"])
    d = tmp_path / "run"
    Run(cfg, d, quiet=True).execute()
    totals = partition_class_totals(d)
    for rec in rounds_of(d):
        assert rec["demo_counts.samples"] == sum(totals)
        assert rec["demo_counts.majority"] == max(range(len(totals)), key=lambda k: (totals[k], -k))
        assert 0 <= rec["acc_demo_counts"] <= 1
    r = fuse(d, "--strategies", "demo_counts")
    assert r.returncode == 0, r.stderr
    assert "loaded plugin module flare_demo_plugin" in r.stderr  # from the run's config.yaml, by module name
    (f,) = read_jsonl(d / "fuse.jsonl")
    last = rounds_of(d)[-1]
    assert f["acc"] == last["acc_demo_counts"] and f["demo_counts.samples"] == sum(totals)


def test_extras_that_do_not_match_the_declaration_exit_2(tiny_overrides, tmp_path, capsys):
    r = flare_in_process(["run", "--preset", "fafi", "--out", tmp_path / "r", "--quiet", *tiny_overrides,
                          "plugins=[flare_demo_plugin]", "eval.rules=[primary,demo_counts]",
                          "server.strategies.demo_counts.bad_shape=true"], capsys)
    assert r.returncode == 2, r.stderr
    assert "server.strategies.demo_counts" in r.stderr and "'demo_counts/counts' has shape" in r.stderr
    assert "Traceback" not in r.stderr


def test_the_gate_checks_extras_against_the_declaration():
    import torch

    from flare.server.upload import Upload, UploadSpec, validate_upload
    net = torch.nn.Linear(2, 2)
    net.feature_dim = 2
    spec = UploadSpec.from_model(net, 2)
    state = {k: v.detach().clone() for k, v in net.state_dict().items()}
    want = {"s/counts": ((2,), torch.float32)}
    ok = Upload(0, state, 5, None, {"s/counts": torch.ones(2)})
    assert validate_upload(ok, UploadSpec(**{**spec.__dict__, "extras": want})) == []
    bad = {"wrong shape": {"s/counts": torch.ones(3)}, "missing": {}, "nan": {"s/counts": torch.tensor([1., float("nan")])},
           "unexpected": {"s/counts": torch.ones(2), "s/other": torch.ones(1)},
           "dtype": {"s/counts": torch.ones(2, dtype=torch.float64)}}
    for name, extras in bad.items():
        reasons = validate_upload(Upload(0, state, 5, None, extras), UploadSpec(**{**spec.__dict__, "extras": want}))
        assert any("extras" in r or "s/counts" in r for r in reasons), (name, reasons)
    # extras nobody asked for are rejected too
    assert any("unexpected" in r for r in validate_upload(ok, spec))


def test_compare_shows_the_fused_strategies_across_seeds(tiny_overrides, tmp_path, capsys):
    """`flare compare`, then `flare fuse` over every run, then compare again (finished runs are kept): compare.md
    gains each fused strategy's mean ± std over seeds per method; fused_vs_table pairs them with FAFI's feature."""
    from flare.cli import main
    from flare.report.compare import compare_rows
    from flare.report.fused import fused_table, fused_values, fused_vs_table

    argv = ["compare", "--presets", "fafi,fedavg", "--seeds", "1,2", *tiny_overrides, "rounds=1", "--out",
            str(tmp_path / "c")]
    assert main(argv) == 0
    dirs = sorted((tmp_path / "c").glob("*/seed=*"))
    assert len(dirs) == 4
    r = fuse_in_process(capsys, *dirs, "--strategies", "output,fedavg")
    assert r.returncode == 0, r.stderr
    assert main(argv) == 0
    text = (tmp_path / "c" / "compare.md").read_text()
    assert "Server strategies over the saved uploads" in text and "| output |" in text
    rows = [row for _, row in compare_rows([(m, sorted((tmp_path / "c" / m).glob("seed=*")))
                                            for m in ("fafi", "fedavg")])]
    out = fused_values(rows[0], "output")
    own = {r.seed: r.rounds[-1]["acc_output"] for r in rows[0].runs}
    assert set(out) == {1, 2} and out == own  # fused over the saved states = the run's own last round
    assert "| output |" in fused_table(rows)
    vs = fused_vs_table(rows, ["feature", "output", "fedavg"], "fafi", "feature")
    assert "| output | fafi | 2 |" in vs and "| feature | fedavg" not in vs  # no feature rule for CE clients


# ----------------------------------------------------------------------------------------------
# a strategy is built once per run


@pytest.fixture
def constructions(monkeypatch):
    """Counts every strategy object made (by class name), however it is made: `Strategy.__init__` is where each
    registered strategy's constructor ends up."""
    from collections import Counter

    from flare.server.strategy import Strategy
    made: Counter = Counter()
    real = Strategy.__init__

    def counting(self, cfg, options=None):
        made[type(self).__name__] += 1
        real(self, cfg, options)

    monkeypatch.setattr(Strategy, "__init__", counting)
    return made


def test_each_strategy_is_built_once_per_run_and_once_per_fuse(tiny_overrides, tmp_path, constructions):
    """Three clients, two rounds, a strategy that asks every client for statistics: one construction per strategy
    for the whole run (not one per round, client and gate), and one per strategy that `flare fuse` scores."""
    from flare.fuse import fuse_runs
    cfg = load_config(None, "fafi", tiny_overrides + ["plugins=[flare_demo_plugin]",
                                                      "eval.rules=[primary,demo_counts,fedavg,demo_pick]"])
    d = tmp_path / "run"
    Run(cfg, d, quiet=True).execute()
    assert "acc_demo_counts" in rounds_of(d)[1] and "acc_demo_pick" in rounds_of(d)[1]
    assert dict(constructions) == {"FeatureRule": 1, "Counts": 1, "FedAvgRule": 1, "Pick": 1}
    constructions.clear()
    fuse_runs([str(d)], "demo_counts,output")
    assert dict(constructions) == {"Counts": 1, "OutputRule": 1}


def test_a_flower_node_builds_each_strategy_once_per_run(tiny_overrides, tmp_path, constructions):
    """Three nodes, two per-round messages each, a strategy that asks every client for statistics: the server builds
    it once and the node process once (the stand-in grid runs every node in this process)."""
    pytest.importorskip("flwr")
    from test_flower_protocol import Nodes
    Nodes().federate(tiny_overrides + ["plugins=[flare_demo_plugin]", "eval.rules=[primary,demo_counts]"],
                     tmp_path / "fed")
    assert constructions["Counts"] == 2 and constructions["FeatureRule"] == 2
