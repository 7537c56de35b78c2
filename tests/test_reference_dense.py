"""benchmarks/reference_dense.py runs DENSE's own script on FLARE's data and partition. Over a stand-in checkout it
must hand the script FLARE's index lists, serve the data as torchvision's FashionMNIST does, run on the CPU without
FLARE in the process, record every accuracy by what it scored, and resume an interrupted pretrain bit for bit; over
a real checkout (DENSE_CHECKOUT=path) the script's own split must equal FLARE's `noniid-labeldir` legacy draw."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "benchmarks" / "reference_dense.py"


def _driver():
    spec = importlib.util.spec_from_file_location("bench_reference_dense", DRIVER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


FAKE = {  # the calls loop_df_fl.py's __main__ block makes, in its order, recording what it got
    "helpers/__init__.py": "",
    "helpers/synthesizers.py": "import ipdb  # the real one imports it; a stand-in must exist\n",
    "helpers/datasets.py":
        "import numpy as np\nfrom torchvision import datasets, transforms\n"
        "def partition_data(dataset, partition, beta=0.4, num_users=5):\n"
        "    tr = datasets.FashionMNIST('/dataset', train=True, transform=transforms.Compose([transforms.ToTensor()]))\n"
        "    te = datasets.FashionMNIST('/dataset', train=False, transform=transforms.Compose([transforms.ToTensor()]))\n"
        "    idx = np.random.permutation(len(tr))  # its own split: not FLARE's\n"
        "    return tr, te, {i: p for i, p in enumerate(np.array_split(idx, num_users))}, None\n",
    "helpers/utils.py":
        "import copy\nimport torch\n"
        "def average_weights(w):\n    out = copy.deepcopy(w[0])\n"
        "    for k in out:\n        out[k] = sum(x[k] for x in w) / len(w)\n    return out\n"
        "def test(model, loader):\n    model.eval()\n    right = n = 0\n    with torch.no_grad():\n"
        "        for x, y in loader:\n            x, y = x.cuda(), y.cuda()\n"
        "            right += (model(x).argmax(1) == y).sum().item()\n            n += len(y)\n"
        "    return 100.0 * right / n, 0.0\n",
    "models/__init__.py": "",
    "models/vit.py": "from torch._six import container_abcs\n",
    "loop_df_fl.py":
        "import argparse, copy, json, os, sys\nimport numpy as np\nimport torch\nimport wandb\n"
        "from torch.utils.data import DataLoader\nfrom helpers.datasets import partition_data\n"
        "from helpers.utils import test, average_weights\nimport helpers.synthesizers\nimport models.vit\n"
        "TRAINED = []\n"
        "class LocalUpdate(object):\n"
        "    def __init__(self, args, dataset, idxs):\n        self.args = args\n"
        "        self.train_loader = DataLoader(torch.utils.data.Subset(dataset, [int(i) for i in idxs]),\n"
        "                                       batch_size=4, shuffle=True, num_workers=4, pin_memory=True)\n"
        "    def update_weights(self, model, client_id):\n        TRAINED.append(client_id)\n"
        "        if os.environ.get('FAKE_STOP_AT') == str(client_id):\n            raise SystemExit(3)\n"
        "        model.train()\n        opt = torch.optim.SGD(model.parameters(), lr=0.1)\n        accs = []\n"
        "        for _ in range(self.args.local_ep):\n            for x, y in self.train_loader:\n"
        "                x, y = x.cuda(), y.cuda()\n                opt.zero_grad()\n"
        "                torch.nn.functional.cross_entropy(model(x), y).backward()\n                opt.step()\n"
        "            accs.append(test(model, test_loader)[0])\n"
        "        return model.state_dict(), np.array(accs)\n"
        "class Ensemble(torch.nn.Module):\n    def __init__(self, ms):\n        super().__init__()\n"
        "        self.models = ms\n    def forward(self, x):\n        return sum(m(x) for m in self.models)\n"
        "def args_parser():\n    p = argparse.ArgumentParser()\n"
        "    for k, t in (('--type', str), ('--local_ep', int), ('--seed', int), ('--num_users', int),\n"
        "                 ('--epochs', int)):\n        p.add_argument(k, type=t, default=1)\n"
        "    return p.parse_args()\n"
        "if __name__ == '__main__':\n    args = args_parser()\n    wandb.init(config=args)\n"
        "    torch.manual_seed(args.seed)\n    np.random.seed(args.seed)\n"
        "    train_dataset, test_dataset, user_groups, _ = partition_data('fmnist', 'dirichlet', 0.3, args.num_users)\n"
        "    test_loader = DataLoader(test_dataset, batch_size=5, shuffle=False, num_workers=4)\n"
        "    global_model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)).cuda()\n"
        "    if args.type == 'pretrain':\n        local_weights = []\n"
        "        for idx in range(args.num_users):\n"
        "            local = LocalUpdate(args=args, dataset=train_dataset, idxs=user_groups[idx])\n"
        "            w, acc = local.update_weights(copy.deepcopy(global_model), idx)\n"
        "            local_weights.append(copy.deepcopy(w))\n"
        "        torch.save(local_weights, 'clients.pkl')\n"
        "    else:\n        local_weights = torch.load('clients.pkl')\n"
        "    x, y = train_dataset[0]\n"
        "    json.dump({'trained': TRAINED, 'item': [list(x.shape), str(x.dtype), float(x.max()), int(y)],\n"
        "               'groups': [[int(i) for i in user_groups[k]] for k in range(args.num_users)],\n"
        "               'flare': 'flare' in sys.modules, 'workers': test_loader.num_workers},\n"
        "              open('seen.json', 'w'))\n"
        "    global_model.load_state_dict(average_weights(local_weights))\n    test(global_model, test_loader)\n"
        "    nets = []\n    for w in local_weights:\n        n = copy.deepcopy(global_model)\n"
        "        n.load_state_dict(w)\n        nets.append(n)\n    test(Ensemble(nets), test_loader)\n"
        "    if args.type == 'kd_train':\n        for _ in range(args.epochs):\n"
        "            test(global_model, test_loader)\n",
}


def _checkout(tmp_path: Path) -> Path:
    for rel, text in FAKE.items():
        (tmp_path / "ref" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ref" / rel).write_text(text)
    return tmp_path / "ref"


def _data(drv, run: Path, n: int = 40, m: int = 10, seed: int = 0) -> np.ndarray:
    """A tiny Fashion-MNIST as IDX files under the run directory, as the parent writes FLARE's arrays."""
    rng = np.random.default_rng(seed)
    raw = run / "data" / "FashionMNIST" / "raw"
    y = np.arange(n) % 10
    drv.write_idx(raw / "train-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
    drv.write_idx(raw / "train-labels-idx1-ubyte", y)
    drv.write_idx(raw / "t10k-images-idx3-ubyte", rng.integers(0, 256, (m, 28, 28)))
    drv.write_idx(raw / "t10k-labels-idx1-ubyte", np.arange(m) % 10)
    return y


def _spec(tmp_path: Path, run: Path, argv: list[str], flare: list[list[int]], name: str = "fedavg") -> Path:
    (run / "flare-partition.json").write_text(json.dumps(flare))
    spec = tmp_path / f"{name}-spec.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"run_dir": str(run), "argv": argv, "partition": "flare",
                                "flare_partition": str(run / "flare-partition.json"),
                                "progress": str(tmp_path / "rec" / name / "progress.json")}))
    return spec


def _child(checkout: Path, spec: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DRIVER), "--checkout", str(checkout), "--child", str(spec)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **env})


FLARE_SPLIT = [[39, 0, 5, 7, 11, 12, 13, 14], [1, 2, 3, 4, 6, 8, 9, 10], list(range(15, 40, 2)),
               list(range(16, 39, 2))]


def test_the_script_gets_flares_partition_the_data_as_torchvision_serves_it_and_no_gpu_or_flare(tmp_path):
    drv, ref = _driver(), _checkout(tmp_path)
    run = tmp_path / "run"
    _data(drv, run)
    argv = ["--type", "pretrain", "--local_ep", "2", "--seed", "0", "--num_users", "4"]
    r = _child(ref, _spec(tmp_path, run, argv, FLARE_SPLIT))
    assert r.returncode == 0, r.stderr
    seen = json.loads((run / "seen.json").read_text())
    assert seen["groups"] == FLARE_SPLIT and seen["trained"] == [0, 1, 2, 3]
    assert seen["item"][:2] == [[1, 28, 28], "torch.float32"] and 0 < seen["item"][2] <= 1 and seen["item"][3] == 0
    assert seen["flare"] is False and seen["workers"] == 0  # FLARE never imported; one process
    rec = json.loads((tmp_path / "rec" / "fedavg" / "progress.json").read_text())
    assert rec["status"] == "finished" and rec["argv"] == argv
    part = rec["partition"]
    assert part["used"] == "flare" and part["own_equals_flare"] is False and part["client_sizes"] == [8, 8, 13, 12]
    assert part["own_client_sizes"] == [10, 10, 10, 10]
    labels = np.arange(40) % 10
    assert part["class_histograms"][2] == np.bincount(labels[FLARE_SPLIT[2]], minlength=10).tolist()
    assert sorted(rec["clients"]) == ["0", "1", "2", "3"]
    assert all(len(c["acc_per_epoch"]) == 2 and c["sitting"] == 1 for c in rec["clients"].values())
    assert [c["size"] for c in rec["clients"].values()] == [8, 8, 13, 12]
    assert rec["fedavg"] is not None and rec["ensemble"] is not None and rec["student_curve"] == []
    assert rec["sittings"][0]["cpu_seconds"] > 0


def test_an_interrupted_pretrain_goes_on_from_its_last_client_bit_for_bit(tmp_path):
    import torch

    drv, ref = _driver(), _checkout(tmp_path)
    argv = ["--type", "pretrain", "--local_ep", "3", "--seed", "1", "--num_users", "4"]
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for run in (whole, cut):
        _data(drv, run)
    assert _child(ref, _spec(tmp_path / "w", whole, argv, FLARE_SPLIT)).returncode == 0
    spec = _spec(tmp_path / "c", cut, argv, FLARE_SPLIT)
    assert _child(ref, spec, FAKE_STOP_AT="2").returncode == 3
    assert sorted(p.name for p in (cut / "clients").iterdir()) == ["client0.pt", "client1.pt"]
    r = _child(ref, spec)
    assert r.returncode == 0, r.stderr
    assert json.loads((cut / "seen.json").read_text())["trained"] == [2, 3]  # 0 and 1 loaded, not trained
    a, b = torch.load(whole / "clients.pkl"), torch.load(cut / "clients.pkl")
    assert all(torch.equal(x[k], y[k]) for x, y in zip(a, b) for k in x)
    w = json.loads((tmp_path / "w" / "rec" / "fedavg" / "progress.json").read_text())
    c = json.loads((tmp_path / "c" / "rec" / "fedavg" / "progress.json").read_text())
    assert c["fedavg"] == w["fedavg"] and c["clients"]["1"]["acc_per_epoch"] == w["clients"]["1"]["acc_per_epoch"]
    assert [x["sitting"] for x in c["clients"].values()] == [1, 1, 2, 2] and len(c["sittings"]) == 2


def test_the_fusion_records_its_students_curve_after_the_clients_scores(tmp_path):
    drv, ref = _driver(), _checkout(tmp_path)
    run = tmp_path / "run"
    _data(drv, run)
    pre = ["--type", "pretrain", "--local_ep", "1", "--seed", "0", "--num_users", "4"]
    assert _child(ref, _spec(tmp_path, run, pre, FLARE_SPLIT)).returncode == 0
    kd = ["--type", "kd_train", "--epochs", "3", "--seed", "0", "--num_users", "4"]
    r = _child(ref, _spec(tmp_path, run, kd, FLARE_SPLIT, name="dense"))
    assert r.returncode == 0, r.stderr
    pre_rec = json.loads((tmp_path / "rec" / "fedavg" / "progress.json").read_text())
    rec = json.loads((tmp_path / "rec" / "dense" / "progress.json").read_text())
    assert rec["fedavg"] == pre_rec["fedavg"] and rec["ensemble"] == pre_rec["ensemble"]
    assert [p["epoch"] for p in rec["student_curve"]] == [1, 2, 3] and rec["clients"] == {}


def test_the_flags_are_the_table_cells_and_a_setting_the_script_lacks_is_refused():
    drv = _driver()
    spec, cell = drv.table_cell(drv.TABLE, 0.3, 0)
    flags, budget = drv.their_flags(cell, "fedavg", None)
    f = dict(zip(flags[::2], flags[1::2]))
    assert f["--beta"] == "0.3" and f["--seed"] == "0" and f["--local_ep"] == "200" and f["--local_bs"] == "128"
    assert f["--model"] == "fmnist_cnn" and f["--type"] == "pretrain" and budget is None
    flags, budget = drv.their_flags(cell, "dense", None)
    f = dict(zip(flags[::2], flags[1::2]))
    assert f["--type"] == "kd_train" and f["--epochs"] == "20" and f["--g_steps"] == "30" and f["--T"] == "20"
    assert budget["generator_steps"] == 600 and budget["published_generator_steps"] == 6000
    assert drv.their_flags(cell, "dense", 200)[1]["generator_steps"] == 6000
    cell["config"]["optim"]["weight_decay"] = 1e-5
    with pytest.raises(SystemExit, match="weight_decay"):
        drv.their_flags(cell, "fedavg", None)


def test_a_folder_that_is_no_checkout_is_refused(tmp_path):
    r = subprocess.run([sys.executable, str(DRIVER), "--checkout", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "is not a checkout of zj-jayzhang/DENSE" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.skipif(not os.environ.get("DENSE_CHECKOUT"), reason="no DENSE checkout given (DENSE_CHECKOUT=path)")
def test_the_real_scripts_own_split_is_flares_and_one_epoch_runs(tmp_path):
    """Over zj-jayzhang/DENSE itself, on 300 random images: its `dirichlet` split after `setup_seed(0)` equals FLARE's
    `noniid-labeldir` with rng=legacy, and its pretrain loop runs one local epoch per client on the CPU."""
    sys.path.insert(0, str(ROOT / "src"))
    from flare.data.partition import labeldir_partition

    drv = _driver()
    run = tmp_path / "run"
    y = _data(drv, run, n=300, m=60)
    flare = [ix.tolist() for ix in labeldir_partition(y, 5, 0.3, 0).client_indices]
    argv = ["--dataset", "fmnist", "--model", "fmnist_cnn", "--partition", "dirichlet", "--iid", "0", "--beta", "0.3",
            "--seed", "0", "--num_users", "5", "--type", "pretrain", "--local_ep", "1", "--local_bs", "128"]
    r = _child(Path(os.environ["DENSE_CHECKOUT"]), _spec(tmp_path, run, argv, flare))
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "rec" / "fedavg" / "progress.json").read_text())
    assert rec["partition"]["own_equals_flare"] is True
    assert rec["partition"]["client_sizes"] == [len(ix) for ix in flare]
    assert all(len(c["acc_per_epoch"]) == 1 for c in rec["clients"].values()) and len(rec["clients"]) == 5
    assert 0 <= rec["fedavg"] <= 100 and 0 <= rec["ensemble"] <= 100
