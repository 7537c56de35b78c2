"""benchmarks/reference_fuse.py hands the clients a run of a paper's code kept to FLARE's server as the table's column
runs it. Over two stand-in clients in DENSE's own key names (paired with FLARE's by position) on tiny data: the
record holds FLARE's strategy at its last and best epoch beside the script's recorded values, and FLARE's FedAvg and
ensemble of the same clients; two equal clients make FedAvg and the ensemble one model; a rerun gives the same
numbers and leaves no scratch behind; a record of another cell, no clients, clients of another network, or
another number of clients than the cell's are refused."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import write_tiny_fmnist
from test_reference_dense_oracle import NETS

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "benchmarks" / "reference_fuse.py"


def _clients(folder: Path, same: bool, width: int = 32) -> None:
    import torch

    ns: dict = {}
    exec(NETS.replace("nn.Conv2d(16, 32", f"nn.Conv2d(16, {width}").replace("7 * 7 * 32", f"7 * 7 * {width}")
         .replace("BatchNorm2d(32)", f"BatchNorm2d({width})"), ns)
    folder.mkdir(parents=True)
    for i in range(2):
        torch.manual_seed(1 if same else i)
        net = ns["CNNMnist"]()
        torch.save({"weights": net.state_dict(), "record": {}}, folder / f"client{i}.pt")


def _run(tmp_path: Path, clients: Path, alpha: float = 0.3) -> subprocess.CompletedProcess:
    data = tmp_path / "fmnist"
    if not data.is_dir():
        write_tiny_fmnist(data)
    ref = tmp_path / "ref"
    ref.mkdir(exist_ok=True)
    (ref / "record.json").write_text(json.dumps({"reference": "zj-jayzhang/DENSE loop_df_fl.py --type kd_train",
                                                 "alpha": alpha, "seed": 0, "student_final": 30.0,
                                                 "student_best": 31.0, "fedavg": 20.0, "ensemble": 25.0}))
    sets = [f"dataset.root={data}", f"dataset.cache_dir={tmp_path / 'cache'}", "num_clients=2",
            "server.strategies.dense.epochs=2", "server.strategies.dense.g_steps=1",
            "server.strategies.dense.synthesis_batch=8", "server.strategies.dense.batch_size=8",
            "server.strategies.dense.curve_every=1"]
    return subprocess.run([sys.executable, str(TOOL), "--table", str(ROOT / "configs" / "papers" / "dense-fmnist.yaml"),
                           "--alpha", "0.3", "--seed", "0", "--strategy", "dense", "--reference", str(ref),
                           "--saved-clients", str(clients), "--runs", str(tmp_path / "runs"),
                           "--record", str(tmp_path / "fuse.json"), *[x for s in sets for x in ("--set", s)]],
                          capture_output=True, text=True, timeout=600)


def test_flares_server_over_the_scripts_clients_is_recorded_beside_the_scripts_values(tmp_path):
    _clients(tmp_path / "clients", same=True)
    r = _run(tmp_path, tmp_path / "clients")
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "fuse.json").read_text())
    assert rec["script"] == {"final": 30.0, "best": 31.0, "fedavg": 20.0, "ensemble": 25.0}
    fl = rec["flare"]
    assert [p[0] for p in fl["curve"]] == [1, 2] and fl["best"] == pytest.approx(max(100 * p[-1] for p in fl["curve"]))
    assert fl["final"] == pytest.approx(100 * fl["curve"][-1][-1])  # the last scored epoch is the returned student
    assert fl["fedavg"] == pytest.approx(fl["ensemble"])  # two equal clients: their mean and their ensemble agree
    assert sum(fl["client_sizes"]) == 120 and rec["fuse_options"] == {"epochs": 20, "curve_every": 2}
    again = _run(tmp_path, tmp_path / "clients")
    assert again.returncode == 0, again.stderr[-3000:]
    assert json.loads((tmp_path / "fuse.json").read_text())["flare"]["curve"] == fl["curve"]
    assert not any((tmp_path / "runs").rglob("*.pt"))  # the record holds it: the strategy's progress is gone


def test_another_cells_record_no_clients_or_another_network_are_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    r = _run(tmp_path, tmp_path / "empty")
    assert r.returncode == 2 and "holds no client<i>.pt" in r.stderr
    _clients(tmp_path / "clients", same=False)
    r = _run(tmp_path, tmp_path / "clients", alpha=0.5)
    assert r.returncode == 2 and "not α = 0.3" in r.stderr
    _clients(tmp_path / "wide", same=False, width=48)
    r = _run(tmp_path, tmp_path / "wide")
    assert r.returncode == 2 and "do not list the same tensors" in r.stderr and "Traceback" not in r.stderr
    (tmp_path / "clients" / "client2.pt").write_bytes((tmp_path / "clients" / "client1.pt").read_bytes())
    r = _run(tmp_path, tmp_path / "clients")  # three clients for a cell of two
    assert r.returncode == 2 and "the cell has 2 clients, --saved-clients 3" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "fuse.json").exists()
