"""Shared fixtures: a tiny, learnable image-folder dataset written to disk in the real format."""
import os
import sys

# What the `flare` CLI sets before torch loads OpenMP (flare/cli.py), set here for the tests' own processes, which
# import flare without the CLI: idle OpenMP threads sleep instead of spinning. The tests that run at torch's default
# thread count (default_torch_threads) spun against the other xdist worker and the processes they start: one
# end-to-end test measured 48 s of CPU with spinning threads and 8-10 s without, the same numbers (waiting is no
# arithmetic).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from PIL import Image  # noqa: E402

import flare  # noqa: F401  first: it pins the CPU kernels (flare/cpu.py) before any test computes
from flare.data.partition import PartitionFacts  # noqa: E402
from flare.registry import PARTITIONS, REFERENCE_PARTITIONS  # noqa: E402

os.environ.setdefault("FLARE_QUIET", "1")
# A run's plots/ cost a second or two of matplotlib per run, about a quarter of the suite: off, except in the tests
# marked `plots`, which look at them (FLARE_PLOTS=1 in the environment draws them everywhere).
os.environ.setdefault("FLARE_PLOTS", "0")

# The plugin modules of tests/plugins/ live outside src/, as a user's would: importable here and in every process
# the tests start (flare run subprocesses, sweep workers).
PLUGINS = str(Path(__file__).resolve().parent / "plugins")
sys.path.insert(0, PLUGINS)
os.environ["PYTHONPATH"] = os.pathsep.join([PLUGINS, *filter(None, [os.environ.get("PYTHONPATH")])])


def write_tiny_imagefolder(root, classes=4, train_per_class=24, test_per_class=8, size=12, seed=0):
    """Each class is a noisy colour/stripe pattern, so a tiny CNN can learn it in a few steps."""
    rng = np.random.default_rng(seed)
    base = [rng.integers(0, 256, size=3) for _ in range(classes)]
    for split, n in (("train", train_per_class), ("test", test_per_class)):
        for c in range(classes):
            d = root / split / f"class{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                img = np.zeros((size, size, 3), dtype=np.int64) + base[c]
                img[:, c % size] = 255 - base[c]  # a class-specific stripe
                img = np.clip(img + rng.integers(-40, 40, size=img.shape), 0, 255).astype(np.uint8)
                Image.fromarray(img).save(d / f"{i:04d}.png")
    return root


_THREADS = {}


@pytest.fixture(autouse=True)
def _run_plots(request, monkeypatch):
    """A test marked `plots` gets every run's figures, in this process and in those it starts."""
    if request.node.get_closest_marker("plots"):
        monkeypatch.setenv("FLARE_PLOTS", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread():
    """The tests use tiny models: one intra-op thread is as fast, and immune to OpenMP threads of
    concurrent processes spinning against each other on a shared CPU."""
    import torch

    _THREADS["default"] = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(_THREADS["default"])


@pytest.fixture
def default_torch_threads():
    """torch's default thread count, for tests that compare in-process numbers bit for bit with
    subprocesses (which start with the default): another thread count changes float summation order."""
    import torch

    torch.set_num_threads(_THREADS["default"])
    yield
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory):
    return write_tiny_imagefolder(tmp_path_factory.mktemp("tiny"))


@pytest.fixture
def tiny_overrides(tiny_folder, tmp_path):
    """Overrides for a run that takes a second or two on CPU."""
    return [f"dataset.name=imagefolder", f"dataset.root={tiny_folder}", f"dataset.cache_dir={tmp_path / 'cache'}",
            "model.name=cnn", "model.width=0.25", "num_clients=3", "rounds=2", "batch_size=16",
            "partition.alpha=0.5", "device=cpu", "test_batch_size=32"]


_FINISHED: dict[str, Path] = {}


@pytest.fixture(autouse=True, scope="session")
def _speed_probe_cache(tmp_path_factory):
    """speed=fast's probe figures (flare/speed.py) go to a temporary cache, never the user's ~/.cache/flare."""
    import os
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(autouse=True, scope="session")
def _finished_runs_dir(tmp_path_factory):
    _FINISHED["dir"] = tmp_path_factory.mktemp("finished-runs")


def copy_of_finished_run(key: str, dest: Path, make) -> Path:
    """A finished run that `make(run_dir)` trains once per session (per `key`), copied to `dest` for each test:
    the tests that only read, fuse or resume a finished run need not train their own. The copy's config.yaml
    still names the first caller's dataset cache, which lives as long as the session."""
    import shutil

    src = _FINISHED["dir"] / key
    if key not in _FINISHED:
        make(src)
        _FINISHED[key] = src
    shutil.copytree(src, dest)
    return dest


def finished_fedavg_run(tiny_overrides, dest: Path) -> Path:
    """A copy of the session's finished one-round fedavg run on the tiny folder, for the tests that fuse it or are
    refused a fuse of it."""
    from flare.config import load_config
    from flare.runner import Run

    return copy_of_finished_run("fedavg-1-round", dest, lambda d: Run(
        load_config(None, "fedavg", tiny_overrides + ["rounds=1"]), d, quiet=True).execute())


def run_interrupted(cfg, d, monkeypatch, at_round):
    """Run `cfg` into `d` until round `at_round` (0-based) starts, then stop as a crash would."""
    import flare.client.trainer as trainer
    from flare.runner import Run

    real = trainer.Client.train_round

    def crash(self, ctx, round_idx, on_step=None):
        if round_idx == at_round:
            raise KeyboardInterrupt
        return real(self, ctx, round_idx, on_step)

    monkeypatch.setattr(trainer.Client, "train_round", crash)
    with pytest.raises(KeyboardInterrupt):
        Run(cfg, d, quiet=True).execute()
    monkeypatch.setattr(trainer.Client, "train_round", real)


def make_partition(labels, num_clients, kind, seed, *, alpha=0.5, shards_per_client=2, num_classes=None,
                   rng="generator", options=None):
    """A split as the run draws it (data.prepare.split): the kind built by name from the run facts, with rng="legacy"
    its reference draw."""
    facts = PartitionFacts(labels, num_clients, seed, num_classes, alpha, shards_per_client)
    if rng == "legacy":
        return REFERENCE_PARTITIONS.create(kind, facts, options, key="partition.rng")
    return PARTITIONS.create(kind, facts, options)


# ---- the identical-tensors oracles (benchmarks/reference_*_oracle.py): a stand-in checkout, tiny data, a run
ROOT = Path(__file__).resolve().parents[1]


def write_files(root: Path, files: dict[str, str]) -> Path:
    """A stand-in checkout: each relative path with its text."""
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def write_tiny_fmnist(folder: Path, n: int = 120, m: int = 40) -> None:
    """A tiny Fashion-MNIST as the four IDX files FLARE's `fmnist` reads from dataset.root."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import reference_dense

    rng = np.random.default_rng(0)
    for name, arr in (("train-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28))),
                      ("train-labels-idx1-ubyte", np.arange(n) % 10),
                      ("t10k-images-idx3-ubyte", rng.integers(0, 256, (m, 28, 28))),
                      ("t10k-labels-idx1-ubyte", np.arange(m) % 10)):
        reference_dense.write_idx(folder / name, arr)


def run_oracle(tool: Path, tmp_path: Path, checkout: Path, epochs: int, *extra: str) -> dict:
    """The oracle over the stand-in checkout on tiny data (two clients, batches of 16); its record."""
    import json
    import subprocess

    data = tmp_path / "fmnist"
    if not data.is_dir():
        write_tiny_fmnist(data)
    record = tmp_path / "oracle.json"
    r = subprocess.run([sys.executable, str(tool), "--checkout", str(checkout), "--epochs", str(epochs),
                        "--runs", str(tmp_path / "runs"), "--record", str(record),
                        "--set", f"dataset.root={data}", "--set", f"dataset.cache_dir={tmp_path / 'cache'}",
                        "--set", "num_clients=2", "--set", "batch_size=16", *extra],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return json.loads(record.read_text())


def rendered_oracle(tmp_path: Path, table: str, rec: dict) -> str:
    """An oracle's record as tools/papers.py renders it into the table's block."""
    import json

    sys.path.insert(0, str(ROOT / "tools"))
    import papers

    d = tmp_path / "reference" / table / "oracle"
    d.mkdir(parents=True)
    (d / "record.json").write_text(json.dumps(rec))
    return "\n".join(papers.oracle_lines(d.parent))


@pytest.hookimpl(trylast=True)  # after `-m` has deselected: the slices are of the tests that run
def pytest_collection_modifyitems(items):
    """The tests marked `long` start first, spread over the test processes: longest first is the classic rule for
    packing jobs onto workers, and a minute-long test that starts last leaves the other process idle that long.
    xdist's worksteal hands its i-th of n processes the next len(pending) // (n - i) tests, one contiguous slice,
    then moves tests from the back of a busy queue to an idle process: so each slice begins with its share of the
    long tests, and what moves at the end is short. Without xdist they simply run first."""
    n = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    long = [it for it in items if it.get_closest_marker("long")]
    rest = [it for it in items if not it.get_closest_marker("long")]
    ordered, pending = [], len(items)
    for i in range(n):
        size = pending // (n - i)
        take = max(0, size - len(long[i::n]))
        ordered += long[i::n] + rest[:take]
        rest, pending = rest[take:], pending - size
    items[:] = ordered + rest


def flare_in_process(argv, capsys) -> "subprocess.CompletedProcess":
    """`flare ARGV` in the test's own process, answered as `subprocess.run` would (returncode, stdout, stderr).
    Where a test checks what a command does — an exit code, a message, the files it writes — this is the same code
    without the fresh interpreter, which costs about 3 s of CPU for torch's import alone. What only a fresh process
    shows (no traceback from the entry point, a plugin imported by name, the CPU pin, a lock held by another
    process) stays checked through real processes: test_bad_input.py, test_plugins.py, test_cpu.py, test_rundir.py,
    and `flare fuse` processes in test_baselines_data.py, test_baselines_weights.py and test_strategy.py."""
    import subprocess

    from flare.cli import main

    capsys.readouterr()  # what the test printed before is not the command's
    try:
        rc = main([str(a) for a in argv])
    except SystemExit as e:  # argparse's own errors exit through SystemExit
        rc = e.code
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(argv, rc, out, err)
