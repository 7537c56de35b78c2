"""benchmarks/reference_fedlpa.py runs FedLPA's own scripts on FLARE's data and partition. Over a stand-in checkout it
must hand each script FLARE's index lists, run on the CPU without FLARE in the process, read the clients' per-epoch
losses from the script's own log lines (the script replaces the root logger's handlers), record FedLPA's two
solutions and the better one it prints, resume an interrupted run bit for bit, run experiments_dense.py's two phases
as one cell despite the mixed tabs Python 3 refuses, and write a record the block reads; the flags are the table
cell's, and a setting the scripts lack is refused. Over a real checkout (FEDLPA_CHECKOUT=path) the script's own
split must equal FLARE's `noniid-labeldir` legacy draw."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
DRIVER = ROOT / "benchmarks" / "reference_fedlpa.py"


def _driver():
    spec = importlib.util.spec_from_file_location("bench_reference_fedlpa", DRIVER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


UTILS = (  # the calls the scripts make into utils.py, with an own split that is not FLARE's
    "import numpy as np\nimport torch\nimport torch.utils.data as data\nfrom torchvision import datasets, transforms\n"
    "def _ds(datadir, train):\n"
    "    return datasets.FashionMNIST(datadir, train=train, download=True, transform=transforms.ToTensor())\n"
    "def partition_data(dataset, datadir, logdir, partition, n_parties, beta=0.4):\n"
    "    tr, te = _ds(datadir, True), _ds(datadir, False)\n"
    "    idx = np.random.permutation(len(tr))\n"
    "    groups = {i: p.tolist() for i, p in enumerate(np.array_split(idx, n_parties))}\n"
    "    return tr.data.numpy(), tr.targets.numpy(), te.data.numpy(), te.targets.numpy(), groups, None\n"
    "def get_dataloader(dataset, datadir, train_bs, test_bs, dataidxs=None, noise_level=0):\n"
    "    tr, te = _ds(datadir, True), _ds(datadir, False)\n"
    "    if dataidxs is not None:\n        tr = data.Subset(tr, list(dataidxs))\n"
    "    return (data.DataLoader(tr, batch_size=train_bs, shuffle=True), data.DataLoader(te, batch_size=test_bs),\n"
    "            tr, te)\n"
    "def compute_accuracy(model, dataloader, get_confusion_matrix=False, device='cpu'):\n"
    "    model.eval()\n    right = n = 0\n    with torch.no_grad():\n"
    "        for x, y in dataloader:\n            right += (model(x).argmax(1) == y).sum().item()\n"
    "            n += len(y)\n"
    "    return (right / n, None) if get_confusion_matrix else right / n\n")

OURS = (  # experiments_our.py's shape: clients one after the other, factors, two solutions, the better printed
    "import argparse, copy, json, logging, os, random, sys\nimport numpy as np\nimport torch\nfrom utils import *\n"
    "TRAINED = []\n"
    "def train_net_blockoffline(net_id, net_local, f_local, mu_global, f_global, len_of_data, train_dataloader,\n"
    "                           test_dataloader, epochs, lr, coordinator, args, device='cpu'):\n"
    "    TRAINED.append(int(net_id))\n"
    "    if os.environ.get('FAKE_STOP_AT') == str(net_id):\n        raise SystemExit(3)\n"
    "    net_local.train()\n    opt = torch.optim.SGD(net_local.parameters(), lr=lr, momentum=args.rho)\n"
    "    for epoch in range(epochs):\n        losses = []\n        for x, y in train_dataloader:\n"
    "            opt.zero_grad()\n            loss = torch.nn.functional.cross_entropy(net_local(x), y)\n"
    "            loss.backward()\n            opt.step()\n            losses.append(loss.item())\n"
    "        logger.info('Epoch: %d Loss: %f Posterior Loss: %f' % (epoch, sum(losses) / len(losses), 0.0))\n"
    "    x = torch.cat([b for b, _ in train_dataloader]).flatten(1)\n"
    "    f_local['1'][0] = x.T @ x / len(x) + (1 - coordinator) * torch.eye(x.shape[1])\n"
    "    f_local['1'][1] = torch.eye(10) * (1 + net_id)\n"
    "    return compute_accuracy(net_local, train_dataloader), compute_accuracy(net_local, test_dataloader)\n"
    "def local_train_net_blockoffline(nets, selected, f_nets, args, net_dataidx_map, test_dl):\n"
    "    for net_id in selected:\n"
    "        train_dl, _, _, _ = get_dataloader(args.dataset, args.datadir, args.batch_size, 32,\n"
    "                                           net_dataidx_map[net_id])\n"
    "        train_net_blockoffline(net_id, nets[net_id], f_nets[net_id], None, None, len(net_dataidx_map[net_id]),\n"
    "                               train_dl, test_dl, args.epochs, args.lr, args.coor, args)\n"
    "def get_args():\n    p = argparse.ArgumentParser()\n"
    "    for k, t in (('--dataset', str), ('--datadir', str), ('--logdir', str), ('--batch-size', int),\n"
    "                 ('--epochs', int), ('--n_parties', int), ('--init_seed', int), ('--lr', float),\n"
    "                 ('--rho', float), ('--coor', float), ('--device', str), ('--beta', float)):\n"
    "        p.add_argument(k, type=t)\n"
    "    return p.parse_known_args()[0]\n"
    "if __name__ == '__main__':\n    args = get_args()\n    os.makedirs(args.logdir, exist_ok=True)\n"
    "    for handler in logging.root.handlers[:]:\n        logging.root.removeHandler(handler)\n"
    "    logging.basicConfig(filename=os.path.join(args.logdir, 'log.txt'), level=logging.DEBUG, filemode='w')\n"
    "    logger = logging.getLogger()\n    logger.setLevel(logging.DEBUG)\n"
    "    np.random.seed(args.init_seed)\n    torch.manual_seed(args.init_seed)\n    random.seed(args.init_seed)\n"
    "    X_train, y_train, X_test, y_test, net_dataidx_map, _ = partition_data(\n"
    "        args.dataset, args.datadir, args.logdir, 'noniid-labeldir', args.n_parties, beta=args.beta)\n"
    "    train_dl_global, test_dl_global, _, _ = get_dataloader(args.dataset, args.datadir, args.batch_size, 32)\n"
    "    make = lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10))\n"
    "    global_model = make()\n    nets = {i: copy.deepcopy(global_model) for i in range(args.n_parties)}\n"
    "    f_nets = [{'1': {}} for _ in range(args.n_parties)]\n"
    "    selected = np.arange(args.n_parties)\n    np.random.shuffle(selected)\n"
    "    local_train_net_blockoffline(nets, selected, f_nets, args, net_dataidx_map, test_dl_global)\n"
    "    n = sum(len(net_dataidx_map[r]) for r in selected)\n"
    "    freqs = [len(net_dataidx_map[r]) / n for r in selected]\n"
    "    avg_param = {k: sum(f * nets[r].state_dict()[k] for f, r in zip(freqs, selected))\n"
    "                 for k in global_model.state_dict()}\n"
    "    biased_param = {k: v * 0.5 for k, v in avg_param.items()}\n"
    "    newtons_param = {k: v.clone() for k, v in avg_param.items()}\n"
    "    newtons_param['1.weight'] = sum(f * nets[r].state_dict()['1.weight'] @ f_nets[r]['1'][0]\n"
    "                                    for f, r in zip(freqs, selected)) / 10\n"
    "    global_model.load_state_dict(newtons_param)\n"
    "    compute_accuracy(global_model, train_dl_global)\n"
    "    best_acc, _ = compute_accuracy(global_model, test_dl_global, get_confusion_matrix=True)\n"
    "    global_model.load_state_dict(biased_param)\n"
    "    compute_accuracy(global_model, train_dl_global)\n"
    "    test_acc, _ = compute_accuracy(global_model, test_dl_global, get_confusion_matrix=True)\n"
    "    if best_acc <= test_acc:\n        best_acc = test_acc\n"
    "    json.dump({'trained': TRAINED, 'groups': [net_dataidx_map[k] for k in range(args.n_parties)],\n"
    "               'flare': 'flare' in sys.modules, 'device': args.device, 'best': best_acc},\n"
    "              open('seen.json', 'w'))\n"
    "    global_model.load_state_dict(newtons_param)\n")

DENSE = (  # experiments_dense.py's shape, with mixed tabs in a branch Fashion-MNIST never enters
    "import argparse, copy, json, logging, os, random, sys\nimport numpy as np\nimport torch\nfrom utils import *\n"
    "from helpers.utils import test, average_weights\nimport helpers.synthesizers\n"
    "class LocalUpdate(object):\n    def __init__(self, args, dataloader):\n"
    "        self.args = args\n        self.train_loader = dataloader\n"
    "    def update_weights(self, model, client_id):\n        model.train()\n"
    "        opt = torch.optim.SGD(model.parameters(), lr=self.args.lr, momentum=0.9)\n        accs = []\n"
    "        for _ in range(self.args.local_ep):\n            for x, y in self.train_loader:\n"
    "                x, y = x.cuda(), y.cuda()\n                model.zero_grad()\n"
    "                torch.nn.functional.cross_entropy(model(x), y).backward()\n                opt.step()\n"
    "            accs.append(test(model, test_loader)[0])\n"
    "        return model.state_dict(), np.array(accs)\n"
    "class Ensemble(torch.nn.Module):\n    def __init__(self, ms):\n        super().__init__()\n"
    "        self.models = ms\n    def forward(self, x):\n"
    "        return sum(m(x) for m in self.models) / len(self.models)\n"
    "def get_model(args):\n"
    "    if args.model == 'fmnist_cnn':\n"
    "        net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(784, 10)).cuda()\n"
    "    elif args.model == 'vgg-9':\n"
    "\t    if args.dataset in ('mnist',):\n"
    "\t\tnet = None\n"
    "    return net\n"
    "def args_parser():\n    p = argparse.ArgumentParser()\n"
    "    for k, t in (('--type', str), ('--local_ep', int), ('--seed', int), ('--num_users', int), ('--epochs', int),\n"
    "                 ('--lr', float), ('--beta', float), ('--batch_size', int), ('--model', str),\n"
    "                 ('--dataset', str)):\n"
    "        p.add_argument(k, type=t, default=1 if t is int else None)\n"
    "    p.add_argument('--datadir', default='./data/')\n"
    "    return p.parse_known_args()[0]\n"
    "if __name__ == '__main__':\n    args = args_parser()\n"
    "    np.random.seed(args.seed)\n    torch.manual_seed(args.seed)\n    random.seed(args.seed)\n"
    "    _, y_train, _, _, net_dataidx_map, _ = partition_data(args.dataset, args.datadir, './logs/', 'x',\n"
    "                                                         args.num_users, beta=args.beta)\n"
    "    _, test_loader, _, _ = get_dataloader(args.dataset, args.datadir, args.batch_size, 32)\n"
    "    global_model = get_model(args)\n"
    "    if args.type == 'pretrain':\n        local_weights = []\n"
    "        for idx in range(args.num_users):\n"
    "            dl, _, _, _ = get_dataloader(args.dataset, args.datadir, args.batch_size, 32, net_dataidx_map[idx])\n"
    "            w, acc = LocalUpdate(args, dl).update_weights(copy.deepcopy(global_model), idx)\n"
    "            local_weights.append(copy.deepcopy(w))\n"
    "        torch.save(local_weights, '{}_{}clients_{}.pkl'.format(args.dataset, args.num_users, args.beta))\n"
    "    else:\n"
    "        local_weights = torch.load('{}_{}clients_{}.pkl'.format(args.dataset, args.num_users, args.beta))\n"
    "        global_model.load_state_dict(average_weights(local_weights))\n        test(global_model, test_loader)\n"
    "        nets = []\n        for w in local_weights:\n            n = copy.deepcopy(global_model)\n"
    "            n.load_state_dict(w)\n            nets.append(n)\n        test(Ensemble(nets), test_loader)\n"
    "        student = get_model(args)\n"
    "        for _ in range(args.epochs):\n            test(student, test_loader)\n")

FAKE = {
    "utils.py": UTILS,
    "kfac.py": "",
    "experiments_our.py": OURS,
    "experiments_dense.py": DENSE,
    "helpers/__init__.py": "",
    "helpers/synthesizers.py": "import ipdb  # the real one imports it; a stand-in must exist\n",
    "helpers/utils.py":
        "import copy\nimport torch\n"
        "def average_weights(w):\n    out = copy.deepcopy(w[0])\n"
        "    for k in out:\n        out[k] = sum(x[k] for x in w) / len(w)\n    return out\n"
        "def test(model, loader):\n    model.eval()\n    right = n = 0\n    with torch.no_grad():\n"
        "        for x, y in loader:\n            x, y = x.cuda(), y.cuda()\n"
        "            right += (model(x).argmax(1) == y).sum().item()\n            n += len(y)\n"
        "    return 100.0 * right / n, 0.0\n",
}


def _checkout(tmp_path: Path) -> Path:
    for rel, text in FAKE.items():
        (tmp_path / "ref" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "ref" / rel).write_text(text)
    return tmp_path / "ref"


N_TRAIN = 60
SPLIT = [list(range(0, 60, 4)), list(range(1, 60, 4)), list(range(2, 60, 4)) + [3, 7], list(range(11, 60, 4))]


def _data(drv, run: Path, n: int = N_TRAIN, m: int = 20, seed: int = 0) -> np.ndarray:
    """A tiny Fashion-MNIST as IDX files under the run directory, as the parent writes FLARE's arrays."""
    rng = np.random.default_rng(seed)
    raw = run / "data" / "FashionMNIST" / "raw"
    y = np.arange(n) % 10
    drv.ref.write_idx(raw / "train-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)))
    drv.ref.write_idx(raw / "train-labels-idx1-ubyte", y)
    drv.ref.write_idx(raw / "t10k-images-idx3-ubyte", rng.integers(0, 256, (m, 28, 28)))
    drv.ref.write_idx(raw / "t10k-labels-idx1-ubyte", np.arange(m) % 10)
    return y


def _spec(tmp_path: Path, run: Path, method: str, phase: str, argv: list[str], flare: list[list[int]]) -> Path:
    (run / "flare-partition.json").write_text(json.dumps(flare))
    spec = tmp_path / f"{phase}-spec.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(json.dumps({"run_dir": str(run), "method": method, "phase": phase, "argv": argv,
                                "partition": "flare", "flare_partition": str(run / "flare-partition.json"),
                                "progress": str(tmp_path / "rec" / "progress.json"), "num_clients": len(flare),
                                "local_epochs": 2, "server_epochs": 3}))
    return spec


def _child(checkout: Path, spec: Path, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(DRIVER), "--checkout", str(checkout), "--child", str(spec)],
                          capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1", **env})


def _ours_argv(run: Path, epochs: int = 2, seed: int = 0) -> list[str]:
    return ["--dataset=fmnist", f"--datadir={run / 'data'}/", f"--logdir={run / 'logs'}/", "--batch-size=8",
            f"--epochs={epochs}", f"--n_parties={len(SPLIT)}", f"--init_seed={seed}", "--lr=0.05", "--rho=0.9",
            "--coor=0.999", "--device=cpu", "--beta=0.1"]


def test_fedlpa_gets_flares_partition_and_its_epochs_factors_and_both_solutions_are_recorded(tmp_path):
    drv, ref = _driver(), _checkout(tmp_path)
    run = tmp_path / "run"
    _data(drv, run)
    r = _child(ref, _spec(tmp_path, run, "fedlpa", "fedlpa", _ours_argv(run), SPLIT))
    assert r.returncode == 0, r.stderr
    seen = json.loads((run / "seen.json").read_text())
    assert seen["groups"] == SPLIT and sorted(seen["trained"]) == [0, 1, 2, 3]
    assert seen["flare"] is False and seen["device"] == "cpu"
    rec = json.loads((tmp_path / "rec" / "progress.json").read_text())
    assert rec["status"] == "finished" and rec["phase"] == "fedlpa"
    part = rec["partition"]
    assert part["used"] == "flare" and part["own_equals_flare"] is False
    assert part["client_sizes"] == [15, 15, 17, 13] and part["own_client_sizes"] == [15, 15, 15, 15]
    assert part["class_histograms"][2] == np.bincount((np.arange(60) % 10)[SPLIT[2]], minlength=10).tolist()
    # each client's loss after each epoch, read from the script's log lines after it replaced the handlers
    assert all(len(c["loss_per_epoch"]) == 2 and len(c["epoch_cpu_seconds"]) == 2 for c in rec["clients"].values())
    assert [rec["clients"][str(i)]["size"] for i in range(4)] == [15, 15, 17, 13]
    log = (run / "logs" / "log.txt").read_text()
    assert f"Loss: {rec['clients']['0']['loss_per_epoch'][1]:f}" in log
    # the printed value is the better of the two solutions, both kept; the plain average scored after the script
    assert rec["fedlpa"] == pytest.approx(100 * seen["best"]) and rec["fedlpa"] == max(rec["newton"], rec["biased"])
    assert 0 <= rec["fedavg_of_these_clients"] <= 100
    assert rec["sittings"][0]["cpu_seconds"] > 0


def test_an_interrupted_fedlpa_run_goes_on_from_its_last_client_bit_for_bit(tmp_path):
    import torch

    drv, ref = _driver(), _checkout(tmp_path)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    for run in (whole, cut):
        _data(drv, run)
    assert _child(ref, _spec(tmp_path / "w", whole, "fedlpa", "fedlpa", _ours_argv(whole, 3, 1), SPLIT)
                  ).returncode == 0
    spec = _spec(tmp_path / "c", cut, "fedlpa", "fedlpa", _ours_argv(cut, 3, 1), SPLIT)
    order = json.loads((whole / "seen.json").read_text())["trained"]  # the script's shuffled client order
    assert _child(ref, spec, FAKE_STOP_AT=str(order[2])).returncode == 3
    assert sorted(p.name for p in (cut / "clients").iterdir()) == sorted(f"client{i}.pt" for i in order[:2])
    r = _child(ref, spec)
    assert r.returncode == 0, r.stderr
    assert json.loads((cut / "seen.json").read_text())["trained"] == order[2:]  # the first two loaded, not trained
    for i in range(4):
        a, b = (torch.load(d / "clients" / f"client{i}.pt", weights_only=False) for d in (whole, cut))
        assert all(torch.equal(a["weights"][k], b["weights"][k]) for k in a["weights"])
        assert all(torch.equal(x, y) for x, y in zip(a["factors"]["1"], b["factors"]["1"]))
    w = json.loads((tmp_path / "w" / "rec" / "progress.json").read_text())
    c = json.loads((tmp_path / "c" / "rec" / "progress.json").read_text())
    assert (c["fedlpa"], c["newton"], c["biased"]) == (w["fedlpa"], w["newton"], w["biased"])
    assert c["clients"][str(order[1])]["loss_per_epoch"] == w["clients"][str(order[1])]["loss_per_epoch"]
    assert sorted(x["sitting"] for x in c["clients"].values()) == [1, 1, 2, 2] and len(c["sittings"]) == 2


def test_dense_runs_its_two_phases_as_one_cell_through_the_mixed_tabs(tmp_path):
    with pytest.raises(TabError):  # what Python 3 makes of the file as released: the stand-in is needed
        compile(DENSE, "experiments_dense.py", "exec")
    drv, ref = _driver(), _checkout(tmp_path)
    run = tmp_path / "run"
    _data(drv, run)
    common = ["--seed", "0", "--num_users", str(len(SPLIT)), "--beta", "0.1", "--batch_size", "8", "--model",
              "fmnist_cnn", "--dataset", "fmnist", "--lr", "0.05"]
    r = _child(ref, _spec(tmp_path, run, "dense", "pretrain", ["--type", "pretrain", "--local_ep", "2", *common],
                          SPLIT))
    assert r.returncode == 0, r.stderr
    assert (run / "fmnist_4clients_0.1.pkl").is_file()
    pre = json.loads((tmp_path / "rec" / "progress.json").read_text())
    assert pre["partition"]["client_sizes"] == [15, 15, 17, 13]
    assert all(len(c["acc_per_epoch"]) == 2 for c in pre["clients"].values()) and len(pre["clients"]) == 4
    r = _child(ref, _spec(tmp_path, run, "dense", "kd_train", ["--type", "kd_train", "--epochs", "3", *common],
                          SPLIT))
    assert r.returncode == 0, r.stderr
    rec = json.loads((tmp_path / "rec" / "progress.json").read_text())
    assert rec["clients"] == pre["clients"]  # the pretrain's clients stay in the cell's record
    assert rec["fedavg"] is not None and rec["ensemble"] is not None
    assert [p["epoch"] for p in rec["student_curve"]] == [1, 2, 3]
    assert [s["phase"] for s in rec["sittings"]] == ["pretrain", "kd_train"]


def test_the_flags_are_the_table_cells_and_a_setting_the_scripts_lack_is_refused(tmp_path):
    drv = _driver()
    spec, cell = drv.ref.table_cell(drv.TABLE, 0.1, 0)
    (ours,), budget = drv.their_flags(cell, "fedlpa", tmp_path)
    f = dict(x[2:].split("=", 1) for x in ours)
    assert f["epochs"] == "200" and f["n_parties"] == "10" and f["beta"] == "0.1" and f["init_seed"] == "0"
    assert f["batch-size"] == "64" and f["lr"] == "0.01" and f["rho"] == "0.9" and f["coor"] == "0.999"
    assert f["alg"] == "our" and f["comm_round"] == "1" and f["device"] == "cpu" and budget is None
    assert f["datadir"] == f"{tmp_path / 'data'}/"
    (pre, kd), budget = drv.their_flags(cell, "dense", tmp_path)
    assert "--local_ep=200" in pre and "--num_users=10" in pre and "--type=pretrain" in pre
    k = {kd[i]: kd[i + 1] for i in range(len(kd) - 1)}  # the flags given as two words
    assert "--type=kd_train" in kd and "--epochs=20" in kd and k["--g_steps"] == "30" and k["--T"] == "20"
    assert "--synthesis_batch_size=256" in kd and k["--batch_size"] == "64" and "--lr=0.005" in kd
    assert budget["generator_steps"] == 600 and budget["published_generator_steps"] == 6000
    assert drv.their_flags(cell, "dense", tmp_path, epochs=200)[1]["generator_steps"] == 6000
    assert "--epochs=1" in drv.their_flags(cell, "fedlpa", tmp_path, local_epochs=1)[0][0]
    cell["config"]["optim"]["weight_decay"] = 0.0
    with pytest.raises(SystemExit, match="weight_decay"):
        drv.their_flags(cell, "fedlpa", tmp_path)


def test_the_parent_writes_the_record_the_block_reads(tmp_path, monkeypatch):
    """The whole driver over the stand-in checkout (FLARE's data replaced by the tiny set), as a two-epoch smoke:
    record.json with the cell's identity, flags, stand-ins, partition, clients, the values, FLARE's and the paper's
    for the cell, and the time of its sitting; the progress file gone; a smoke is never read into the block (the
    table-setting records are: tests/test_papers.py)."""
    drv, ref = _driver(), _checkout(tmp_path)

    def prepare(cell, run_dir):
        _data(drv, run_dir)
        out = run_dir / "flare-partition.json"
        out.write_text(json.dumps([list(range(i, N_TRAIN, 10)) for i in range(10)]))
        return out

    monkeypatch.setattr(drv.ref, "prepare", prepare)
    results = tmp_path / "results"
    argv = ["--checkout", str(ref), "--method", "fedlpa", "--alpha", "0.1", "--seed", "0", "--runs",
            str(tmp_path / "runs"), "--results", str(results), "--local-epochs", "2"]
    assert drv.main(argv) == 0
    d = results / "fedlpa-fmnist" / "fedlpa-a0.1-s0-smoke-e2"
    rec = json.loads((d / "record.json").read_text())
    assert not (d / "progress.json").exists()
    assert (rec["method"], rec["alpha"], rec["seed"], rec["table_setting"]) == ("fedlpa", 0.1, 0, False)
    assert rec["flare_cell"] == "fedavg-a0.1-s0" and rec["accuracy_unit"] == "percent"
    assert rec["stand_ins"] == drv.STAND_INS["fedlpa"] and "--epochs=2" in rec["argv"][0]
    assert all(len(c["loss_per_epoch"]) == 2 for c in rec["clients"])
    assert rec["partition"]["client_sizes"] == [6] * 10 and len(rec["clients"]) == 10
    assert rec["fedlpa"] == max(rec["newton"], rec["biased"]) and rec["cpu_seconds"] > 0
    assert rec["compare"]["paper"]["FedLPA"] == 55.33 and "fedlpa" in rec["compare"]
    assert drv.main(argv) == 0  # recorded: nothing to run
    sys.path.insert(0, str(ROOT / "tools"))
    import papers

    runs = papers.reference_runs(results / "fedlpa-fmnist")
    column = {"method": "fedavg", "key": "fuse:fedlpa", "paper_rule": "final"}
    assert runs == [] and papers.reference_values(runs, column, 0.1) == {}
    rec["table_setting"] = True  # the same record at the table's setting is the cell's value
    (d / "record.json").write_text(json.dumps(rec))
    runs = papers.reference_runs(results / "fedlpa-fmnist")
    assert papers.reference_values(runs, column, 0.1) == {0: rec["fedlpa"]}


def test_a_folder_that_is_no_checkout_is_refused(tmp_path):
    r = subprocess.run([sys.executable, str(DRIVER), "--checkout", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "is not a checkout of lebronlambert/FedLPA_NeurIPS2024" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(not os.environ.get("FEDLPA_CHECKOUT"), reason="no FedLPA checkout (FEDLPA_CHECKOUT=path)")
def test_the_real_scripts_own_split_is_flares(tmp_path):
    """Over lebronlambert/FedLPA_NeurIPS2024 itself, on 300 random images: `experiments_our.py`'s noniid-labeldir
    split after `np.random.seed(0)` equals FLARE's `noniid-labeldir` with rng=legacy, and one local epoch of its
    clients, its factors and its two solutions run on the CPU."""
    sys.path.insert(0, str(ROOT / "src"))
    from flare.data.partition import labeldir_partition

    drv = _driver()
    run = tmp_path / "run"
    y = _data(drv, run, n=300, m=60)
    flare = [ix.tolist() for ix in labeldir_partition(y, 10, 0.5, 0).client_indices]
    argv = ["--model=simple-cnn", "--dataset=fmnist", "--alg=our", "--lr=0.01", "--batch-size=64", "--epochs=1",
            "--n_parties=10", "--rho=0.9", "--comm_round=1", "--partition=noniid-labeldir", "--beta=0.5",
            "--device=cpu", f"--datadir={run / 'data'}/", f"--logdir={run / 'logs'}/", "--noise=0", "--init_seed=0",
            "--coor=0.999"]
    r = _child(Path(os.environ["FEDLPA_CHECKOUT"]), _spec(tmp_path, run, "fedlpa", "fedlpa", argv, flare))
    assert r.returncode == 0, r.stderr[-3000:]
    rec = json.loads((tmp_path / "rec" / "progress.json").read_text())
    assert rec["partition"]["own_equals_flare"] is True
    assert all(len(c["loss_per_epoch"]) == 1 for c in rec["clients"].values()) and len(rec["clients"]) == 10
    assert 0 <= rec["fedlpa"] <= 100 and rec["fedlpa"] == max(rec["newton"], rec["biased"])
