"""The benchmarks' CPU smoke modes run in CI, so the scripts that make the GPU figures cannot rot unnoticed."""
import importlib.util
import json
import math
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _script(name):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("engine", ["sequential", "batched"])
def test_full_run_cpu_smoke(engine, tmp_path, capsys):
    # the setting first and KEY=VALUE after the options, as benchmarks/gpu_suite.sh writes them
    res = _script("full_run").main(["cifar10", "--cpu-smoke", "--out", str(tmp_path / "run"), f"client_engine={engine}"])
    out = capsys.readouterr().out
    assert res["rounds"] == 2 and res["wall_s"] > res["train_s"] > 0 and 0 <= res["acc"] <= 1
    assert math.isfinite(res["train_s_per_round"]) and math.isfinite(res["eval_s_per_round"])
    for words in ("wall", "s/round", "peak GPU memory", f"client_engine={engine}", "final acc"):
        assert words in out, out
    assert (tmp_path / "run" / "summary.md").exists()


def test_profile_round_cpu_smoke(tmp_path, capsys):
    res = _script("profile_round").main(["--cpu-smoke", "--preset", "flare", "--out", str(tmp_path),
                                         "client_engine=batched"])
    out = capsys.readouterr().out
    for phase in ("flare.augment", "flare.forward_loss", "flare.backward", "flare.optimizer", "flare.evaluate"):
        assert res["phases"][phase][0] > 0, phase  # host ms of every marked phase of the batched engine
    assert res["host_reads"].get("aten::_local_scalar_dense", 0) > 0 and res["host_reads_by_phase"]
    assert res["top_ops"] and res["steps"] == 8
    assert "traceEvents" in json.loads((tmp_path / "trace.json").read_text())
    for words in ("top", "host reads", "Chrome trace", "batched engine"):
        assert words in out, out


def test_efficiency_reports_both_engines(tiny_folder, tmp_path, capsys):
    _script("efficiency").main(["--steps", "2", "--repeats", "1", "--clients", "2", "dataset.name=imagefolder",
                                f"dataset.root={tiny_folder}", f"dataset.cache_dir={tmp_path / 'cache'}",
                                "model.name=cnn", "model.width=0.25", "batch_size=16", "device=cpu"])
    out = capsys.readouterr().out
    for words in ("efficiency", "batched engine, 2 clients", "end-to-end batched", "÷ bare batched"):
        assert words in out, out


def test_efficiency_times_each_augment_schedule(tiny_folder, tmp_path, capsys):
    """--schedules adds one end-to-end series per augment.schedule (ratios to the bare step; SCHEDULE+CROP with its
    own augment.crop), and the batched engine's figures after them are still its own."""
    _script("efficiency").main(["--steps", "2", "--repeats", "2", "--clients", "2", "--clock", "cpu",
                                "--schedules", "per_batch,chunked,chunked+separable", "--record", str(tmp_path / "rec.json"),
                                "dataset.name=imagefolder",
                                f"dataset.root={tiny_folder}", f"dataset.cache_dir={tmp_path / 'cache'}",
                                "model.name=cnn", "model.width=0.25", "batch_size=16", "device=cpu"])
    out = capsys.readouterr().out
    lines = {ln.split(":")[0].strip(): ln for ln in out.splitlines()}
    for sched in ("per_batch", "chunked", "chunked+separable"):
        assert "best" in lines[sched] and "median" in lines[sched], out
    assert "clock: cpu" in out and "end-to-end batched" in out, out
    import json  # the record holds the printed series, the block's source
    rec = json.loads((tmp_path / "rec.json").read_text())
    assert set(rec["schedules"]) == {"per_batch", "chunked", "chunked+separable"} and rec["clock"] == "cpu"
    for sched in rec["schedules"]:
        assert f"{rec['schedules'][sched]['median']:9.1f}" in lines[sched]


def test_gpu_suite_parses():
    """The device calls run this script with no second chance: a syntax error would cost a whole lease."""
    r = subprocess.run(["bash", "-n", str(ROOT / "benchmarks" / "gpu_suite.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_max_pool_benchmark_records_both_pools(tmp_path, capsys):
    """benchmarks/max_pool.py times torch's pool against flare's on the same network and records that both trained
    to the same bits (what the docs block renders from)."""
    bench = _script("max_pool")
    rec = tmp_path / "max-pool.json"
    bench.main(["--models", "cnn@0.125", "--steps", "1", "--repeats", "1", "--eval-images", "64",
                "--record", str(rec)])
    rows = json.loads(rec.read_text())["rows"]
    assert [r["model"] for r in rows] == ["cnn width 0.125"] and rows[0]["same_bits"] is True
    assert all(v > 0 for r in rows for part in ("train", "eval") for v in r[part].values())
    assert bench.table_row(rows[0]) in capsys.readouterr().out
