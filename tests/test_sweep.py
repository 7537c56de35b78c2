"""`flare sweep`: expansion, naming, validation before any run, skip/resume on re-invocation, Ray."""
import json
import sys

import pytest
import yaml

from flare.cli import main
from flare.errors import FlareError
from flare.experiments.execute import read_point_file
from flare.experiments.sweep import expand, load_sweep, parse_sweep
from flare.rundir import read_jsonl




def _base(tiny_folder, tmp_path, **extra):
    b = {"dataset": {"name": "imagefolder", "root": str(tiny_folder), "cache_dir": str(tmp_path / "cache")},
         "model": {"name": "cnn", "width": 0.25}, "num_clients": 3, "rounds": 1, "batch_size": 16,
         "device": "cpu", "test_batch_size": 32, "partition": {"alpha": 0.5}}
    b.update(extra)
    return b


def _write(tmp_path, spec, name="sweep.yaml"):
    p = tmp_path / name
    p.write_text(yaml.safe_dump(spec))
    return p


def _mtimes(d):
    return {str(f): f.stat().st_mtime_ns for f in sorted(d.rglob("*")) if f.is_file() and "report" not in f.parts}


def test_expansion_names_and_zip():
    spec, base = parse_sweep({"name": "t", "base": {"rounds": 2, "dataset.name": "fmnist"},
                              "presets": ["fafi", "etf-anneal"], "seeds": [1, 2],
                              "grid": {"partition.alpha": [0.05, 0.1], "align.lambda0": [1, 2.5]},
                              "zip": {"dataset.root": ["/a/cifar10-jpg.tar.gz", "/b/x"], "local_epochs": [1, 10]}})
    pts = expand(spec, base)
    assert len(pts) == 2 * 2 * 2 * 2 * 2
    names = [p.name for p in pts]
    assert len(set(names)) == len(names)
    assert "etf-anneal_alpha=0.1_lambda0=2.5_root=cifar10-jpg.tar.gz_seed=2" in names
    p = next(p for p in pts if p.name == "etf-anneal_alpha=0.1_lambda0=2.5_root=x_seed=1")
    c = p.config
    assert (c.preset, c.partition.alpha, c.align.lambda0, c.local_epochs, c.seed, c.rounds, c.dataset.name) == (
        "etf-anneal", 0.1, 2.5, 10, 1, 2, "fmnist")
    assert c.align.anchors == "etf"  # the preset is applied under the base and the point's values


def test_top_level_presets_and_seeds_keep_the_product_order():
    spec, base = parse_sweep({"name": "t", "presets": ["fafi", "flare"], "seeds": [1, 2],
                              "grid": {"partition.alpha": [0.05, 0.1]}, "zip": {"rounds": [1, 2], "local_epochs": [3, 4]}})
    names = [p.name for p in expand(spec, base)]
    assert names[:4] == ["fafi_alpha=0.05_rounds=1_seed=1", "fafi_alpha=0.05_rounds=1_seed=2",
                         "fafi_alpha=0.05_rounds=2_seed=1", "fafi_alpha=0.05_rounds=2_seed=2"]
    assert names[-1] == "flare_alpha=0.1_rounds=2_seed=2"


def test_preset_and_seed_inside_the_grid_set_the_run_order_not_the_names():
    """A sweep that lists `seed` before `preset` in its grid runs every method of seed 1 before any of seed 2, so
    what finishes first in a cut-short sweep is a paired comparison; the directory names stay canonical."""
    spec, base = parse_sweep({"name": "t", "grid": {"protocol": ["reference", "clean"], "seed": [1, 2],
                                                    "preset": ["fafi", "flare"]}})
    pts = expand(spec, base)
    assert [p.name for p in pts[:5]] == ["fafi_protocol=reference_seed=1", "flare_protocol=reference_seed=1",
                                         "fafi_protocol=reference_seed=2", "flare_protocol=reference_seed=2",
                                         "fafi_protocol=clean_seed=1"]
    assert (pts[1].config.preset, pts[1].config.seed, pts[1].config.protocol) == ("flare", 1, "reference")


@pytest.mark.parametrize("spec, words", [
    ({"grid": {"partition.alpah": [0.1]}}, ["partition.alpah", "did you mean 'partition.alpha'"]),
    ({"grid": {}}, ["grid is empty"]),
    ({"grid": {"partition.alpha": []}}, ["empty list"]),
    ({"grid": {"partition.alpha": 0.1}}, ["must be a list"]),
    ({"presets": ["fafi", "nope"]}, ["preset 'nope' does not exist"]),
    ({"presets": ["fafi"], "grid": {"partition.alpha": [-1.0]}}, ["point 'fafi_alpha=-1_seed=1'", "partition.alpha"]),
    ({"zip": {"rounds": [1, 2], "local_epochs": [1]}}, ["different lengths"]),
    ({"gird": {"rounds": [1]}}, ["unknown sweep key 'gird'", "did you mean 'grid'"]),
    ({"grid": {"rounds": [1, 1]}}, ["two points get the run directory"]),
])
def test_bad_sweep_files_fail_before_any_run(tmp_path, capsys, spec, words):
    f = _write(tmp_path, {"name": "bad", **spec})
    out = tmp_path / "out"
    assert main(["sweep", "--config", str(f), "--out", str(out), "--quiet"]) == 2
    err = capsys.readouterr().err
    for w in words:
        assert w in err, err
    assert "Traceback" not in err
    assert not out.exists()


def test_other_experiment_in_a_point_dir_is_refused_before_running(tiny_folder, tmp_path, capsys):
    f = _write(tmp_path, {"name": "s", "base": _base(tiny_folder, tmp_path), "presets": ["fafi"],
                          "grid": {"partition.alpha": [0.5, 1.0]}})
    out = tmp_path / "out"
    pts, _ = __import__("flare.experiments.sweep", fromlist=["run_sweep"]).run_sweep(f, out, quiet=True, dry_run=True)
    d = out / "fafi_alpha=1_seed=1"
    d.mkdir(parents=True)
    (d / "config.yaml").write_text(yaml.safe_dump({"rounds": 99}))
    assert main(["sweep", "--config", str(f), "--out", str(out), "--quiet"]) == 2
    assert "different experiment" in capsys.readouterr().err
    assert not (out / "fafi_alpha=0.5_seed=1").exists()  # nothing ran


def test_grid_2x2_with_2_seeds_second_invocation_recomputes_nothing(tiny_folder, tmp_path, capsys):
    f = _write(tmp_path, {"name": "grid", "base": _base(tiny_folder, tmp_path), "presets": ["fafi", "etf-anneal"],
                          "grid": {"partition.alpha": [0.5, 1.0]}, "seeds": [1, 2]})
    out = tmp_path / "grid"
    assert main(["sweep", "--config", str(f), "--out", str(out)]) == 0
    captured = capsys.readouterr().out
    assert "8 points — 0 done earlier (skipped), 0 to resume, 8 to run" in captured
    dirs = sorted(p.name for p in out.iterdir() if (p / "config.yaml").exists())
    assert dirs == sorted(f"{m}_alpha={a}_seed={s}" for m in ("fafi", "etf-anneal") for a in ("0.5", "1")
                          for s in (1, 2))
    for d in dirs:
        assert json.loads((out / d / "state.json").read_text())["status"] == "finished"
        assert read_point_file(out / d)["status"] == "finished"
    man = json.loads((out / "sweep.json").read_text())
    assert len(man["points"]) == 8 and {p["status"] for p in man["points"]} == {"finished"}
    speed = man["throughput"]
    assert speed["runs"] == speed["finished"] == 8 and speed["runs_per_hour"] > 0 and speed["wall_seconds"] > 0
    assert "8 of 8 runs finished" in (out / "sweep.md").read_text() and "runs/hour" in captured
    assert (out / "report" / "report.md").exists() and "±" in (out / "report" / "report.md").read_text()
    before = _mtimes(out)

    assert main(["sweep", "--config", str(f), "--out", str(out)]) == 0
    assert "8 points — 8 done earlier (skipped), 0 to resume, 0 to run" in capsys.readouterr().out
    assert json.loads((out / "sweep.json").read_text())["throughput"]["runs"] == 0  # skipped points don't count
    assert "nothing ran in this invocation" in (out / "sweep.md").read_text()
    after = _mtimes(out)
    changed = [k for k in before if before[k] != after.get(k) and not k.endswith(("sweep.json", "sweep.md",
                                                                                   "sweep.yaml"))]
    assert not changed, changed


def test_interrupted_point_resumes_on_the_next_invocation(tiny_folder, tmp_path, monkeypatch, capsys):
    import flare.client.trainer as trainer

    f = _write(tmp_path, {"name": "r", "base": _base(tiny_folder, tmp_path, rounds=2), "presets": ["fafi"],
                          "seeds": [1, 2]})
    out = tmp_path / "r"
    real = trainer.Client.train_round

    def interrupted(self, ctx, round_idx, on_step=None):
        if round_idx == 1:
            raise KeyboardInterrupt
        return real(self, ctx, round_idx, on_step)

    monkeypatch.setattr(trainer.Client, "train_round", interrupted)
    assert main(["sweep", "--config", str(f), "--out", str(out), "--quiet"]) == 130
    monkeypatch.setattr(trainer.Client, "train_round", real)
    first = out / "fafi_seed=1"
    kept = (first / "metrics.jsonl").read_text()
    assert main(["sweep", "--config", str(f), "--out", str(out)]) == 0
    assert "2 points — 0 done earlier (skipped), 1 to resume, 1 to run" in capsys.readouterr().out
    assert (first / "metrics.jsonl").read_text().startswith(kept)
    assert [r["round"] for r in read_jsonl(first / "metrics.jsonl") if r["kind"] == "round"] == [0, 1]


@pytest.mark.long
def test_without_ray_workers_run_in_local_processes(tiny_folder, tmp_path, monkeypatch, capsys):
    """No Ray: --workers 2 still runs two points at once, in two fresh processes on this machine."""
    import os

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    f = _write(tmp_path, {"name": "n", "base": _base(tiny_folder, tmp_path, local_epochs=3), "presets": ["fedavg"],
                          "seeds": [1, 2]})
    out = tmp_path / "n"
    assert main(["sweep", "--config", str(f), "--out", str(out), "--workers", "2", "--no-report"]) == 0
    o = capsys.readouterr().out
    assert "Ray is not installed, so the points run in 2 processes" in o and "pip install 'flare-ofl[sweep]'" in o
    infos = [read_point_file(out / f"fedavg_seed={s}") for s in (1, 2)]
    assert all(i["status"] == "finished" for i in infos), infos
    assert len({i["pid"] for i in infos}) == 2 and os.getpid() not in {i["pid"] for i in infos}
    assert max(i["start"] for i in infos) < min(i["end"] for i in infos), infos
    assert json.loads((out / "sweep.json").read_text())["throughput"]["finished"] == 2
    _assert_workers_kept_the_kernel_level(out, "fedavg")


def test_gpu_fraction_shares_one_gpu_among_the_workers():
    from flare.experiments.execute import gpu_fraction

    assert gpu_fraction(1, 4) == 0.25 and gpu_fraction(1, 1) == 1.0
    assert gpu_fraction(2, 2) == 1.0 and gpu_fraction(8, 2) == 1.0 and gpu_fraction(0, 4) == 0.0
    assert gpu_fraction(1, 4, asked=0.5) == 0.5 and gpu_fraction(4, 2, asked=2.7) == 2.0


@pytest.mark.long
def test_ray_runs_points_in_parallel(tiny_folder, tmp_path, monkeypatch):
    """Ray told of one GPU (none is needed: device=cpu): --workers 2 gives each point half of it, so both run."""
    pytest.importorskip("ray")
    import flare.experiments.execute as execute

    monkeypatch.setattr(execute, "_gpu_count", lambda: 1)
    f = _write(tmp_path, {"name": "ray", "base": _base(tiny_folder, tmp_path, local_epochs=3),
                          "presets": ["fafi"], "seeds": [1, 2]})
    out = tmp_path / "ray"
    assert main(["sweep", "--config", str(f), "--out", str(out), "--workers", "2", "--quiet", "--no-report"]) == 0
    infos = [read_point_file(out / f"fafi_seed={s}") for s in (1, 2)]
    assert all(i["status"] == "finished" for i in infos), infos
    assert [i["gpus"] for i in infos] == [0.5, 0.5]
    import os

    assert len({i["pid"] for i in infos}) == 2 and os.getpid() not in {i["pid"] for i in infos}
    # the two points' [start, end] intervals overlap: they really ran at the same time
    assert max(i["start"] for i in infos) < min(i["end"] for i in infos), infos
    _assert_workers_kept_the_kernel_level(out, "fafi")


def _assert_workers_kept_the_kernel_level(out, preset):
    """Worker processes dispatch at the level this process pinned (flare/cpu.py: the environment travels), not at
    their CPU's own best."""
    import torch

    for s in (1, 2):
        backend = json.loads((out / f"{preset}_seed={s}" / "state.json").read_text())["backend"]
        assert backend["cpu_isa"] == "avx2" and backend["cpu_kernels"] == torch.backends.cpu.get_cpu_capability()


def test_example_sweep_files_are_valid():
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "configs" / "sweeps").glob("*.yaml"))
    assert files
    for f in files:
        spec, base = load_sweep(f)
        assert expand(spec, base), f


def test_flare_error_type():
    with pytest.raises(FlareError):
        parse_sweep(["not", "a", "mapping"])
