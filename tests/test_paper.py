"""`flare paper`: the smoke suite end to end (what CI runs), the plan of the other scales, references."""
import json
from pathlib import Path

import pytest

from flare.cli import main as flare_main
from flare.errors import FlareError
from flare.rundir import read_jsonl
from flare_paper import reference, scales, suite
from flare_paper import report as paper_report
from flare_paper.cli import add_command

FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")


def main(argv):
    """`flare ARGV` with the `paper` command its entry point adds where flare_paper is installed."""
    return flare_main(argv, commands=[add_command])


@pytest.mark.long
@pytest.mark.skipif(not FMNIST.exists(), reason="Fashion-MNIST (Debian's dataset-fashion-mnist) is not installed")
def test_paper_smoke_writes_the_three_tables_and_the_figures(tmp_path, capsys):
    out = tmp_path / "paper"
    assert main(["paper", "--scale", "smoke", "--out", str(out), "--quiet", "device=cpu"]) == 0
    md = (out / "report" / "report.md").read_text()
    for s in ("## Table 1", "## Table 2", "## Table 3", "## Figure 1", "## Figure 2", "## Figure 3",
              "λ0 sweep", "α sweep", "Server strategies", "fedavg", "flare", "decoupled", "uw-rescaled", "g_protos_std",
              "final λ_raw"):
        assert s in md, s
    for f in ("figure1_accuracy.png", "figure2_lambda_eff.png", "figure3_acc_lambda_raw.png", "sweep_lambda0.png",
              "sweep_alpha.png", "label_distribution.png"):
        assert (out / "report" / f).stat().st_size > 5000, f
        assert f"]({f})" in md
    for s in ("table1", "ablation", "robustness", "lambda0", "alpha"):
        assert (out / "sweeps" / f"{s}.yaml").exists()
    # Table 1's numbers are the runs' last-round primary accuracies, read here from metrics.jsonl directly
    table = md.split("## Table 1")[1].split("##")[0]
    rows = {ln.split(" | ")[0].strip("| ").split(" · ")[0]: ln.split(" | ")[1:] for ln in table.splitlines()
            if ln.startswith("| ") and "---" not in ln and not ln.startswith("| method")}
    for method in ("fedavg", "fafi", "etf-anneal", "flare"):
        for col, alpha in enumerate((0.1, 0.05)):
            (d,) = (out / "table1").glob(f"{method}_alpha={alpha:g}_*seed=1")
            recs = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
            last = [r for r in recs if r["kind"] == "round"][-1]
            assert rows[method][col].strip(" |") == f"{100 * last['acc']:.2f}", (method, alpha, rows[method])
    # each method against FAFI, paired by seed, within each setting (one seed at smoke scale: no test)
    paired = md.split("### Table 1, each method against the baseline, paired by seed")[1].split("\n##")[0]
    prow = [ln for ln in paired.splitlines() if ln.startswith("| ") and "---" not in ln
            and not ln.startswith("| setting")]
    assert {ln.split(" | ")[1] for ln in prow} == set(rows) - {"fafi"}
    assert len(prow) == 2 * (len(rows) - 1) and all(" | fafi | 1 | " in ln for ln in prow)
    assert all(ln.endswith("| 1 seed: no test |") for ln in prow)
    # a second invocation recomputes nothing
    before = {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")}
    assert main(["paper", "--scale", "smoke", "--out", str(out), "--quiet", "device=cpu"]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")} == before
    # --strategies: server strategies over Table 1's saved clients, without retraining them
    assert main(["paper", "--scale", "smoke", "--out", str(out), "--quiet", "--strategies", "output,fedproto",
                 "device=cpu"]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")} == before
    fused = sorted((out / "table1").glob("*/fuse.jsonl"))
    assert len(fused) == 8 and all({json.loads(x)["strategy"] for x in f.read_text().splitlines()} ==
                                   {"output", "fedproto"} for f in fused)
    md = (out / "report" / "report.md").read_text()
    section = md.split("### Table 1's clients under every server strategy")[1].split("\n## ")[0]
    assert "| fedproto |" in section and "| output |" in section


def test_full_and_cpu_plans(capsys, tmp_path):
    full = ["paper", "--scale", "full", "--dry-run", "--out", str(tmp_path / "f")]
    assert main(full) == 2 and "--data-root cifar10=PATH" in capsys.readouterr().err  # where is CIFAR-10?
    roots = [f"--data-root={d}=/data/{d}" for d in ("cifar10", "cifar100", "svhn")]
    assert main(full + roots) == 0
    o = capsys.readouterr().out
    assert "46 distinct runs" in o
    assert "table1/flare_alpha=0.05_name=cifar100_seed=1" in o and "robustness" in o
    assert main(["paper", "--scale", "cpu", "--dry-run", "--datasets", "cifar10", "--seeds", "1,2",
                 "--data-root", "cifar10=/data/cifar10", "--out", str(tmp_path / "c")]) == 0
    o = capsys.readouterr().out
    assert "seed=2" in o and "fmnist" not in o
    assert not (tmp_path / "f").exists()


def test_full_scale_applies_the_notes_per_dataset_settings():
    """CIFAR-100: λ_max = 20 (entropy rule) and V7's λ0 = 20; SVHN α = 0.05: batch 256 and seed 114514 for seed 1."""
    from flare.experiments.execute import Point
    from flare.experiments.sweep import expand, unflatten

    s = scales.SCALES["full"]
    exps = suite.experiments(s, ["cifar10", "cifar100", "svhn"], [1, 2], {d: {"root": f"/d/{d}"} for d in
                                                                        ("cifar10", "cifar100", "svhn")}, {})
    t1 = exps[0]
    t1.spec.base = {**s.common, **t1.spec.base}
    pts: list[Point] = expand(t1.spec, unflatten(t1.spec.base), {})
    suite.apply_rules(s.rules, pts, set())
    by = {p.name: p.config for p in pts}
    assert by["etf-anneal_alpha=0.05_name=cifar100_seed=1"].align.lambda0 == 20.0
    assert by["flare_alpha=0.05_name=cifar100_seed=1"].align.lambda_max == 20.0
    assert by["fafi_alpha=0.05_name=cifar10_seed=1"].align.lambda_max == 10.0
    sv = by["flare_alpha=0.05_name=svhn_seed=114514"]
    assert (sv.seed, sv.batch_size) == (114514, 256)
    assert by["flare_alpha=0.05_name=svhn_seed=2"].batch_size == 256
    assert (by["flare_alpha=0.1_name=svhn_seed=1"].seed, by["flare_alpha=0.1_name=svhn_seed=1"].batch_size) == (1, 512)
    # a key given on the command line wins over the scale's rule
    pts = expand(t1.spec, unflatten(t1.spec.base), {"batch_size": 128})
    suite.apply_rules(s.rules, pts, {"batch_size"})
    assert {p.config.batch_size for p in pts} == {128}


def test_full_scale_uses_the_notes_settings():
    s = scales.SCALES["full"]
    m = suite.dataset_mapping(s, "cifar100", {})
    assert (m["rounds"], m["local_epochs"]) == (10, 10)
    m = suite.dataset_mapping(s, "svhn", {"svhn": {"root": "/data/svhn"}})
    assert (m["rounds"], m["local_epochs"], m["dataset.root"], m["dataset.train_subset"]) == (50, 1, "/data/svhn", None)
    assert s.common["model"] == {"name": "resnet18", "width": 1.0} and s.common["num_clients"] == 5


def test_reference_numbers_are_the_notes_with_their_settings():
    r = reference.reference
    assert r("cifar10", 0.05, "fafi") == 66.97 and r("cifar10", 0.5, "etf-anneal") == 88.46
    assert r("cifar10", 0.3, "drcl-anneal") == 84.54 and r("cifar10", 0.1, "drcl") == 76.13
    assert r("cifar10", 0.05, "drcl-anneal", rule="iffi_reference") == 72.11
    assert r("cifar100", 0.05, "decoupled", setting="later-c100") == 40.43
    assert r("cifar100", 0.05, "etf-anneal", setting="later-c100", keys={"align.lambda0": 20.0}) == 40.41
    assert r("svhn", 0.05, "flare", metric="peak", setting="later-svhn") == 55.4
    assert r("svhn", 0.05, "decoupled", setting="later-svhn") == 16.4
    assert r("cifar100", 0.05, "decoupled") is None  # not a first-batch number
    assert r("cifar10", 0.05, "flare") is None
    refs = [x for x in reference.REFS if x.value == 76.86]
    assert paper_report._with_ref("76.50", refs, True) == "76.50 [notes 76.86, first batch, lambda0=5]"
    assert paper_report._with_ref("76.50", refs, False) == "76.50"


def _flat(preset, kind="dirichlet", progress="epoch", alpha=0.05, rounds=50, **extra):
    from flare.config import load_config
    from flare.records import flatten

    ov = [f"partition.kind={kind}", f"progress={progress}", f"partition.alpha={alpha}", f"rounds={rounds}",
          "dataset.name=cifar10"] + [f"{k.replace('__', '.')}={v}" for k, v in extra.items()]
    return flatten(load_config(None, preset, ov).model_dump(mode="json"))


def test_each_notes_number_is_shown_only_in_its_own_setting():
    """First batch (official partition, λ constant) vs later batch (card dealer, global annealing): like with like."""
    def vals(preset, **kw):
        return sorted(x.value for x in reference.references_for(_flat(preset, **kw), preset))

    assert vals("fafi") == [57.74]                                            # card dealer: the later batch
    assert vals("fafi", kind="dirichlet-fafi") == [66.97]                     # official partition: the first
    assert vals("fafi", kind="dirichlet-fafi", rounds=51) == [66.97]          # (read at round 50 of R = 300)
    assert vals("fafi", rounds=10) == []                                      # the later batch ran R = 50
    assert vals("etf-anneal", kind="dirichlet-fafi", progress="round-reset") == [67.77]
    assert vals("etf-anneal", kind="dirichlet-fafi") == []                    # annealing ≠ the first batch's constant λ
    assert vals("etf-anneal") == [58.77]                                      # λ0 = 5 (the summary table said 59.38)
    assert vals("etf-anneal", align__lambda0=10) == [59.38]
    assert vals("etf-anneal", alpha=0.3, align__lambda0=50) == [71.44]
    assert vals("progressive", kind="dirichlet-fafi", progress="round-reset", align__lambda0=20) == [65.58]
    assert vals("fafi", kind="dirichlet-fafi", alpha=0.1) == [76.10]
    iffi = reference.references_for(_flat("fafi", kind="dirichlet-fafi"), "fafi", rule="iffi_reference")
    assert [x.value for x in iffi] == [69.78]
    # every number names its setting
    assert all(x.setting in reference.SETTINGS and x.label() for x in reference.REFS)
    assert reference.reference("cifar10", 0.05, "fafi", setting="later") == 57.74
    assert reference.reference("svhn", 0.05, "fafi", setting="later-svhn") == 49.94
    assert reference.reference("cifar100", 0.05, "uw-rescaled", setting="later-c100",
                               keys={"lam.sigma_lr": 0.0001}) == 38.25


@pytest.mark.parametrize("args, word", [
    (["--datasets", "imagenet"], "unknown dataset"),
    (["--seeds", "a,b"], "--seeds"),
    (["--data-root", "cifar10"], "NAME=PATH"),
])
def test_bad_paper_arguments(args, word, capsys, tmp_path):
    assert main(["paper", "--scale", "smoke", "--dry-run", "--out", str(tmp_path), *args]) == 2
    assert word in capsys.readouterr().err


def test_reproduce_plan_at_full_scale(capsys, tmp_path):
    args = ["paper", "--scale", "full", "--only", "reproduce", "--datasets", "cifar10", "--seeds", "1,2,3",
            "--data-root", "cifar10=/data/c10", "--out", str(tmp_path / "r"), "--dry-run"]
    assert main(args) == 0
    o = capsys.readouterr().out
    for s in ("reproduce/fafi_alpha=0.3_protocol=reference_seed=3",
              "reproduce/ensemble_alpha=0.5_protocol=clean_seed=2",
              "reproduce-later/etf-anneal_alpha=0.3_seed=1", "ablation-from-clean-eval.bn/flare_bn=batch_seed=2",
              "ablation-from-reference-progress/etf-anneal_progress=epoch_seed=1",
              "ablation-from-clean-progress-round-reset/etf-anneal_progress=round-reset_seed=1",
              "ablation-from-clean-server.strategies.output.ensemble/ensemble_ensemble=logits_seed=3",
              "ablation-from-reference-drop_last/fafi_drop_last=false_seed=1"):
        assert s in o, s
    assert "ablation-from-clean-eval.bn/fedavg" not in o          # an item runs only where it can change something
    assert "ablation-from-clean-server.strategies.output.ensemble/fafi" not in o
    assert not (tmp_path / "r").exists()
    assert main(args[:-1] + ["--protocol", "clean", "--dry-run"]) == 0
    o = capsys.readouterr().out
    assert "protocol=reference" not in o and "ablation-from-reference" not in o
    assert main(args + ["--protocol", "dirty"]) == 2
    assert "--protocol" in capsys.readouterr().err


@pytest.mark.long
@pytest.mark.skipif(not FMNIST.exists(), reason="Fashion-MNIST (Debian's dataset-fashion-mnist) is not installed")
def test_reproduce_end_to_end_at_smoke_scale(tmp_path, capsys):
    """The reproduction pipeline of the full-scale table, tiny: both protocols, the ablation, the report."""
    from flare_paper.reproduction import write_reproduction_report

    out = tmp_path / "rep"
    assert main(["paper", "--scale", "smoke", "--only", "reproduce", "--out", str(out), "--quiet", "device=cpu"]) == 0
    md = (out / "report" / "reproduction.md").read_text()
    doc = json.loads((out / "reproduce.json").read_text())
    assert doc["command"] in md and "--only reproduce" in doc["command"] and "--protocol clean,reference" in md
    for s in ("### α = 0.05", "reference · first batch", "reference · later batch", "One-item protocol ablation",
              "`eval.bn`", "`loss.ce_input`", "`drop_last`", "protocol label(s): `clean`",
              "protocol label(s): `reference`", "The item that moves the numbers most", "IFFI (seeds' code"):
        assert s in md, s
    assert (out / "report" / "reproduction_rules.png").stat().st_size > 5000
    # the table's cells are the runs' last-round accuracies
    rows = {tuple(c.strip() for c in ln.split("|")[1:3]): [c.strip() for c in ln.split("|")[3:6]]
            for ln in md.split("### α = 0.05")[1].split("###")[0].splitlines() if ln.startswith("| F")}
    for setting, col in (("clean", 0), ("reference", 1), ("reference-later", 2)):
        (p,) = [p for p in doc["points"] if p["role"] == "main" and p["setting"] == setting and p["preset"] == "fafi"]
        last = [r for r in read_jsonl(Path(p["dir"]) / "metrics.jsonl") if r["kind"] == "round"][-1]
        assert rows[("FAFI (V4)", "feature (primary)")][col] == f"{100 * last['acc']:.2f} (n=1)"
        assert rows[("FAFI (V4)", "IFFI")][col] == f"{100 * last['acc_iffi']:.2f} (n=1)"
        cfg = (Path(p["dir"]) / "config.yaml").read_text()
        assert f"protocol: {'clean' if setting == 'clean' else 'reference'}" in cfg
    # every ablation point differs from its base in its item only
    for p in (p for p in doc["points"] if p["role"] == "ablation"):
        (b,) = [q for q in doc["points"] if q["role"] == "main" and q["setting"] == p["from"]
                and q["preset"] == p["preset"]]
        diff = {k for k in set(p["config"]) | set(b["config"]) if p["config"].get(k) != b["config"].get(k)}
        assert diff == {p["item"]}, (p["item"], diff)
    before = {q: q.stat().st_mtime_ns for q in out.rglob("metrics.jsonl")}
    assert main(["paper", "--scale", "smoke", "--only", "reproduce", "--out", str(out), "--quiet", "device=cpu"]) == 0
    assert {q: q.stat().st_mtime_ns for q in out.rglob("metrics.jsonl")} == before  # nothing recomputed
    assert write_reproduction_report(out) == out / "report" / "reproduction.md"
    with pytest.raises(FlareError):
        write_reproduction_report(tmp_path)
