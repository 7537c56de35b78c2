"""`flare paper`: the smoke suite end to end (what CI runs), the plan of the other scales, references."""
from pathlib import Path

import pytest

from flare.cli import main
from flare.report import paper

FMNIST = Path("/usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz")




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
    # a second invocation recomputes nothing
    before = {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")}
    assert main(["paper", "--scale", "smoke", "--out", str(out), "--quiet", "device=cpu"]) == 0
    assert {p: p.stat().st_mtime_ns for p in out.rglob("metrics.jsonl")} == before


def test_full_and_cpu_plans(capsys, tmp_path):
    assert main(["paper", "--scale", "full", "--dry-run", "--out", str(tmp_path / "f")]) == 0
    o = capsys.readouterr().out
    assert "46 distinct runs" in o
    assert "table1/flare_alpha=0.05_name=cifar100_seed=1" in o and "robustness" in o
    assert main(["paper", "--scale", "cpu", "--dry-run", "--datasets", "cifar10", "--seeds", "1,2",
                 "--out", str(tmp_path / "c")]) == 0
    o = capsys.readouterr().out
    assert "seed=2" in o and "fmnist" not in o
    assert not (tmp_path / "f").exists()


def test_full_scale_uses_the_notes_settings():
    s = paper.SCALES["full"]
    m = paper.dataset_mapping(s, "cifar100", {})
    assert (m["rounds"], m["local_epochs"]) == (10, 10)
    m = paper.dataset_mapping(s, "svhn", {"svhn": {"root": "/data/svhn"}})
    assert (m["rounds"], m["local_epochs"], m["dataset.root"], m["dataset.train_subset"]) == (50, 1, "/data/svhn", None)
    assert s.common["model"] == {"name": "resnet18", "width": 1.0} and s.common["num_clients"] == 5


def test_reference_numbers_are_spec_section_10():
    r = paper.reference
    assert r("cifar10", 0.05, "fafi") == 66.97 and r("cifar10", 0.5, "etf-anneal") == 88.46
    assert r("cifar10", 0.3, "drcl-anneal") == 84.54 and r("cifar10", 0.1, "drcl") == 76.13
    assert r("cifar10", 0.05, "drcl-anneal", rule="iffi_reference") == 72.11
    assert r("cifar100", 0.05, "decoupled") == 40.43 and r("cifar100", 0.05, "etf-anneal") == 40.41
    assert r("svhn", 0.05, "flare", metric="peak") == 55.4 and r("svhn", 0.05, "decoupled") == 16.4
    assert r("cifar10", 0.05, "flare") is None
    assert paper._with_ref("76.50", 76.86, True) == "76.50 [notes 76.86]"
    assert paper._with_ref("76.50", 76.86, False) == "76.50"


@pytest.mark.parametrize("args, word", [
    (["--datasets", "imagenet"], "unknown dataset"),
    (["--seeds", "a,b"], "--seeds"),
    (["--data-root", "cifar10"], "NAME=PATH"),
])
def test_bad_paper_arguments(args, word, capsys, tmp_path):
    assert main(["paper", "--scale", "smoke", "--dry-run", "--out", str(tmp_path), *args]) == 2
    assert word in capsys.readouterr().err
