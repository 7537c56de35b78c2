"""The benchmarks' CPU smoke modes run in CI, so the scripts that make the GPU figures cannot rot unnoticed."""
import importlib.util
import json
import math
import subprocess
import sys
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


def test_step_flops_puts_step_bare_step_and_sgemm_on_one_scale(tiny_folder, tmp_path, capsys):
    """step_flops.py counts the step's FLOPs (the model's forward and backward, the loss's products), times the
    step, the bare step and SGEMM here and in a child with the CPU's own kernels, and renders its table from the
    record alone."""
    bench = _script("step_flops")
    rec = bench.main(["--steps", "2", "--repeats", "1", "--sizes", "64,128", "--clock", "cpu", "--record",
                      str(tmp_path / "rec.json"), "dataset.name=imagefolder", f"dataset.root={tiny_folder}",
                      f"dataset.cache_dir={tmp_path / 'cache'}", "dataset.train_subset=null",
                      "dataset.test_subset=null", "model.width=0.25", "batch_size=16"])
    out = capsys.readouterr().out
    assert json.loads((tmp_path / "rec.json").read_text()) == rec and bench.markdown(rec) in out
    step, bare = rec["flops"]["step"], rec["flops"]["bare"]
    assert 0 < bare["model"] <= step["model"] <= step["total"] and step["augmentation"] < step["total"] / 100
    assert {"convolution", "convolution_backward"} <= set(step["by_op"])
    assert rec["config"]["batch"] == 16 and rec["config"]["model"] == "cnn" and rec["machine"]["threads"] == 1
    assert set(rec["sgemm"]["native"]["gflops"]) == {"64", "128"} == set(rec["sgemm"]["pinned"]["gflops"])
    f = bench.figures(rec)
    assert f["peak"] == max(f["pinned_peak"], f["native_peak"]) and 0 < f["step_peak"] and 0 < f["bare_peak"]
    assert math.isclose(f["step_bare"], f["step"] / f["bare"])
    for words in ("family", "÷ peak", "SGEMM", "GFLOP/s", "load average"):
        assert words in out, out


def test_step_flops_times_the_options_against_the_same_peak(tiny_folder, tmp_path, capsys):
    """`--options` times the step other ways beside the run's own, records which oneDNN convolutions each ran (a
    child with ONEDNN_VERBOSE=1), and the table puts them on the peak's scale; an unknown option exits 2."""
    bench = _script("step_flops")
    common = ["--steps", "2", "--repeats", "1", "--sizes", "64", "--clock", "cpu", "dataset.name=imagefolder",
              f"dataset.root={tiny_folder}", f"dataset.cache_dir={tmp_path / 'cache'}", "dataset.train_subset=null",
              "dataset.test_subset=null", "model.width=0.25", "batch_size=8"]
    rec = bench.main(["--options", "nhwc,batched2", *common])
    out = capsys.readouterr().out
    opts = rec["options"]
    assert set(opts) == {"nhwc", "batched2", "default"}
    assert set(opts["nhwc"]["seconds"]) == {"step", "bare"} and set(opts["batched2"]["seconds"]) == {"step"}
    assert opts["batched2"]["clients"] == 2 and opts["nhwc"]["flops"]["step"] > 0
    assert any("forward_training" in k for k in opts["default"]["onednn"]), opts["default"]
    assert any("forward_training" in k for k in opts["nhwc"]["onednn"]), opts["nhwc"]
    for row in ("the run's step as it runs (default)", "nhwc: channels-last layout", "batched2: batched engine"):
        assert row in out, out
    with pytest.raises(SystemExit) as e:
        bench.main(["--options", "nhwc,fast", *common])
    assert e.value.code == 2 and "unknown option 'fast'" in capsys.readouterr().err


def test_step_flops_compiled_option_trains_the_compiled_model(tiny_folder, tmp_path):
    """`compiled` builds the run's client and bare step with their models compiled in place (the optimiser keeps
    their parameters): the client's step runs a graph torch.compile captured, and the bare step runs too."""
    from flare.config import load_config
    bench = _script("step_flops")
    cfg = load_config(None, "fafi", ["device=cpu", "dataset.name=imagefolder", f"dataset.root={tiny_folder}",
                                     f"dataset.cache_dir={tmp_path / 'cache'}", "model.name=cnn", "model.width=0.25",
                                     "batch_size=8", "rounds=1", "local_epochs=1"])
    fns, clients = bench.build_option("compiled", cfg, 1, bench._efficiency())
    assert clients == 1 and set(fns) == {"compiled:step", "compiled:bare"}
    from torch._dynamo.utils import counters
    counters.clear()
    fns["compiled:step"]()
    assert counters["stats"]["calls_captured"] > 0, dict(counters["stats"])
    fns["compiled:bare"]()  # the same architecture: dynamo reuses the graph it captured for the client's model


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


FAKE_REFERENCE = {  # a stand-in for the FAFI checkout: the calls reference_fafi.py makes, recording what it got
    "configs/CIFAR10_alpha0.05.yaml":
        "seed: 1\nserver: {num_rounds: 300, model_name: resnet18}\ndevice: cuda:0\ncheckpoint: {save_path: x}\n"
        "client: {num_clients: 2}\ndataset: {train_batch_size: 4, test_batch_size: 3, num_classes: 10}\n"
        "distribution: {type: dirichlet, label_num_per_client: 2, alpha: 0.05}\n",
    "common_libs.py": "import yaml\ndef load_yaml_config(p):\n    return yaml.safe_load(open(p))\n"
                      "def setup_seed(s):\n    pass\nimport visdom, cv2  # the figure-only imports get stand-ins\n",
    "dataset_helper.py": "def load_dataset(name, path):\n    raise RuntimeError('would download')\n"
                         "def get_fl_dataset(name, path, k, kind, params, alpha):\n"
                         "    tr, te = load_dataset(name, path)\n    return tr, te, {0: [0, 1, 2, 3, 4], 1: [5, 6, 7]}\n",
    "models_lib/__init__.py":  # a model returning (logits, features), as the reference's does
        "import torch\nclass Net(torch.nn.Module):\n    def __init__(self, k):\n        super().__init__()\n"
        "        self.fc = torch.nn.Linear(3 * 32 * 32, k)\n    def forward(self, x):\n"
        "        z = self.fc(x.flatten(1))\n        return z, z\n"
        "def get_train_models(model_name, num_classes, mode):\n    return Net(num_classes)\n",
    "oneshot_algorithms/__init__.py": "",
    "oneshot_algorithms/ours/__init__.py": "",
    "oneshot_algorithms/ours/our_local_training.py":  # an epoch of 0.2 s, then its two accuracy passes of 0.1 s
        "import time\ndef test_acc(*a):\n    time.sleep(0.1)\ndef save_best_local_model(*a):\n    pass\n"
        "def ours_local_training(**kw):\n    time.sleep(0.2)\n    test_acc()\n    test_acc()\n"
        "    save_best_local_model()\n",
    "oneshot_algorithms/ours/our_main.py":
        "import json, sys\nfrom oneshot_algorithms.ours.our_local_training import ours_local_training\n"
        "def OneshotOurs(trainset, loader, idx, config, device):\n"
        "    for c in idx:\n        ours_local_training(model=None)\n"
        "    x, y = trainset[0]\n    xb, yb = next(iter(loader))\n"
        "    json.dump({'rounds': config['server']['num_rounds'], 'device': device, 'item': [list(x.shape), str(x.dtype),"
        " float(x.max()), y], 'test_batch': list(xb.shape), 'flare': 'flare' in sys.modules}, open('seen.json', 'w'))\n",
}


def test_reference_fafi_runs_the_checkouts_own_path_on_the_subset(tmp_path):
    """benchmarks/reference_fafi.py's timed child, over a stand-in checkout: one round on the CPU, the subset served
    as torchvision's CIFAR10 serves it (a float tensor in [0, 1] per item), what it trained counted after drop_last."""
    import numpy as np

    for rel, text in FAKE_REFERENCE.items():
        (tmp_path / "ref" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ref" / rel).write_text(text)
    rng = np.random.default_rng(0)
    npz = tmp_path / "subset.npz"
    np.savez(npz, train_x=rng.integers(0, 256, (8, 3, 32, 32), dtype=np.uint8), train_y=np.arange(8) % 10,
             test_x=rng.integers(0, 256, (3, 3, 32, 32), dtype=np.uint8), test_y=np.arange(3))
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reference_fafi.py"), "--checkout",
                        str(tmp_path / "ref"), "--out", str(tmp_path / "run"), "--child", str(npz)],
                       capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["client_sizes"] == [5, 3] and rec["samples"] == 8 and rec["batch"] == 4
    assert rec["samples_trained"] == 4  # drop_last: 5 → 4, 3 → 0
    # where the round went: two clients' training (0.2 s each) apart from their accuracy passes (2 × 0.1 s each)
    assert 0.4 <= rec["client_eval_seconds"] < rec["round_seconds"] and 0.4 <= rec["train_seconds"] < 0.8
    ts = rec["train_seconds"]  # rounded to 0.01 s: at 0.4 s that alone moves the rate it implies by up to 1.25 %
    assert 2 * 4 / (ts + 0.005) - 0.01 <= rec["train_rate"] <= 2 * 4 / (ts - 0.005) + 0.01
    assert rec["bare_step"]["images"] == 8 and rec["bare_step"]["reference"] > 0  # its model's step, 2 × batch
    seen = json.loads((tmp_path / "run" / "seen.json").read_text())
    assert seen["rounds"] == 1 and seen["device"] == "cpu"
    assert seen["item"][:2] == [[3, 32, 32], "torch.float32"] and 0 < seen["item"][2] <= 1 and seen["item"][3] == 0
    assert seen["test_batch"] == [3, 3, 32, 32]
    assert seen["flare"] is False  # the timed child never imports FLARE (importing it pins the kernels)


def test_reference_fafi_refuses_a_folder_that_is_no_checkout(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "reference_fafi.py"), "--checkout", str(tmp_path),
                        "--data-root", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "is not a checkout of FAFI_ICML25" in r.stderr and "Traceback" not in r.stderr


def test_frozen_grid_speed_projects_every_grid_run_and_flags_a_changed_record():
    """benchmarks/frozen_grid_speed.py: the grid's projected time counts each of its runs at its method's CPU
    seconds at the nearest measured K; a rerun whose metrics differ from the record reads NO in the table."""
    bench = _script("frozen_grid_speed")
    grid = bench.module("frozen_grid", ROOT / "tools" / "frozen_grid.py")
    cpu = {"a0.05-K5/fedavg/seed=1": 40.0, "a0.05-K50/fedavg/seed=1": 4.0, "a0.05-K10/fafi/seed=1": 20.0,
           "a0.05-K10/flare/seed=1": 10.0, "a0.05-K10/fed3r-rf/seed=1": 60.0}
    side = lambda c, same=True: {"wall": 2 * c, "cpu": c, "load": 1.0, "identical": same}  # noqa: E731
    rec = {"machine": {"cpus": 2, "cpu": "test"}, "before": "a" * 40, "after": "b" * 40,
           "points": [{"point": p, "before": side(2 * c), "after": side(c, p != "a0.05-K10/flare/seed=1")}
                      for p, c in cpu.items()]}
    methods = dict(grid.METHODS_224)
    if (rf := grid.fed3r_rf_method()) is not None:
        methods["fed3r-rf"] = rf
    want = 0.0
    for d, _, _ in grid.points(Path("grid"), "224", None, methods):
        method, k = d.parts[-2], int(d.parts[-3].split("-K")[1])
        want += {"fedavg": 40.0 if k < 30 else 4.0, "fafi": 20.0, "flare": 10.0, "fed3r-rf": 60.0}[method]
    assert bench.projection(rec, "after") == pytest.approx(want / 120)
    assert bench.projection(rec, "before") == pytest.approx(2 * want / 120)
    bench.finish(rec, None)
    text = bench.markdown(rec)
    assert text.count("| yes |") == 4 and text.count("| NO |") == 1 and "2.00×" in text
    assert f"{want / 120:.0f} min after" in text
    del rec["points"][-1]  # a method never measured: no projection
    assert bench.projection(rec, "after") is None or "fed3r-rf" not in methods
