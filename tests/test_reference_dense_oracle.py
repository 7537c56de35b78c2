"""benchmarks/reference_dense_oracle.py puts DENSE's own client and server code beside FLARE's on identical tensors.
Over a stand-in checkout whose script trains as FLARE's cell does (momentum 0.9, `model.train()` once, a `test` after
every epoch that leaves the model in eval mode) it must find the runs equal step for step, BatchNorm's statistics and
mode included, and the script's own init FLARE's; its pretrain statements over saved clients must score what FLARE's
server scores. A stand-in without momentum must be caught at step 2, the first step momentum changes; one that puts
the model back in train mode every epoch at the first step of epoch 2; and without a checkout the tool skips."""
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import rendered_oracle, run_oracle, write_files

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "benchmarks" / "reference_dense_oracle.py"

NETS = (  # DENSE's CNNMnist, as models/nets.py builds it
    "import torch.nn as nn\n"
    "class CNNMnist(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
    "        self.layer1 = nn.Sequential(nn.Conv2d(1, 16, kernel_size=5, padding=2), nn.BatchNorm2d(16), nn.ReLU(),\n"
    "                                    nn.MaxPool2d(2))\n"
    "        self.layer2 = nn.Sequential(nn.Conv2d(16, 32, kernel_size=5, padding=2), nn.BatchNorm2d(32), nn.ReLU(),\n"
    "                                    nn.MaxPool2d(2))\n"
    "        self.fc = nn.Linear(7 * 7 * 32, 10)\n"
    "    def forward(self, x):\n        return self.fc(self.layer2(self.layer1(x)).view(x.size(0), -1))\n")

UTILS = (  # helpers/utils.py's parts the pretrain reads
    "import copy, random\nimport numpy as np\nimport torch\nimport torch.nn.functional as F\n"
    "from torch.utils.data import Dataset\n"
    "class DatasetSplit(Dataset):\n    def __init__(self, dataset, idxs):\n"
    "        self.dataset, self.idxs = dataset, [int(i) for i in idxs]\n"
    "    def __len__(self):\n        return len(self.idxs)\n"
    "    def __getitem__(self, item):\n        image, label = self.dataset[self.idxs[item]]\n"
    "        return image.clone(), torch.tensor(label)\n"
    "def average_weights(w):\n    w_avg = copy.deepcopy(w[0])\n    for key in w_avg.keys():\n"
    "        for i in range(1, len(w)):\n            w_avg[key] += w[i][key]\n"
    "        if 'num_batches_tracked' in key:\n            w_avg[key] = w_avg[key].true_divide(len(w))\n"
    "        else:\n            w_avg[key] = torch.div(w_avg[key], len(w))\n    return w_avg\n"
    "def setup_seed(seed):\n    torch.manual_seed(seed)\n    np.random.seed(seed)\n    random.seed(seed)\n"
    "def test(model, test_loader):\n    model.eval()\n    correct = 0\n    with torch.no_grad():\n"
    "        for data, target in test_loader:\n            data, target = data.cuda(), target.cuda()\n"
    "            correct += model(data).argmax(1).eq(target).sum().item()\n"
    "    return 100. * correct / len(test_loader.dataset), 0.0\n")

DATASETS = (  # helpers/datasets.py: torchvision's FashionMNIST under /dataset, a split of the script's own
    "import numpy as np\nfrom torchvision import datasets, transforms\n"
    "def partition_data(dataset, partition, beta=0.4, num_users=5):\n"
    "    tr = datasets.FashionMNIST('/dataset', train=True, transform=transforms.Compose([transforms.ToTensor()]))\n"
    "    te = datasets.FashionMNIST('/dataset', train=False, transform=transforms.Compose([transforms.ToTensor()]))\n"
    "    idx = np.random.permutation(len(tr))\n"
    "    return tr, te, {i: p for i, p in enumerate(np.array_split(idx, num_users))}, None\n")

SCRIPT = (  # loop_df_fl.py's pretrain path, its structure kept
    "import argparse, copy\nimport numpy as np\nimport torch\nimport torch.nn.functional as F\nimport wandb\n"
    "from torch.utils.data import DataLoader\nfrom helpers.datasets import partition_data\n"
    "from helpers.utils import average_weights, DatasetSplit, setup_seed, test\nfrom models.nets import CNNMnist\n"
    "class LocalUpdate(object):\n    def __init__(self, args, dataset, idxs):\n        self.args = args\n"
    "        self.train_loader = DataLoader(DatasetSplit(dataset, idxs), batch_size=self.args.local_bs,\n"
    "                                       shuffle=True, num_workers=4)\n"
    "    def update_weights(self, model, client_id):\n        model.train()\n"
    "        optimizer = torch.optim.SGD(model.parameters(), lr=self.args.lr, momentum=MOMENTUM)\n"
    "        accs = []\n        for iter in range(self.args.local_ep):\n            EPOCH\n"
    "            for batch_idx, (images, labels) in enumerate(self.train_loader):\n"
    "                images, labels = images.cuda(), labels.cuda()\n                model.zero_grad()\n"
    "                loss = F.cross_entropy(model(images), labels)\n                loss.backward()\n"
    "                optimizer.step()\n"
    "            acc, test_loss = test(model, test_loader)\n            accs.append(acc)\n"
    "        return model.state_dict(), np.array(accs)\n"
    "def args_parser():\n    p = argparse.ArgumentParser()\n"
    "    for k, t, d in (('--num_users', int, 5), ('--local_ep', int, 100), ('--local_bs', int, 128),\n"
    "                    ('--lr', float, 0.01), ('--dataset', str, 'cifar10'), ('--iid', int, 1),\n"
    "                    ('--partition', str, 'dirichlet'), ('--beta', float, 0.5), ('--seed', int, None),\n"
    "                    ('--type', str, 'pretrain'), ('--model', str, '')):\n"
    "        p.add_argument(k, type=t, default=d)\n    return p.parse_args()\n"
    "class Ensemble(torch.nn.Module):\n    def __init__(self, model_list):\n        super().__init__()\n"
    "        self.models = model_list\n"
    "    def forward(self, x):\n        return sum(m(x) for m in self.models) / len(self.models)\n"
    "def get_model(args):\n    return CNNMnist().cuda()\n"
    "if __name__ == '__main__':\n    args = args_parser()\n    wandb.init(config=args, project='x')\n"
    "    setup_seed(args.seed)\n"
    "    train_dataset, test_dataset, user_groups, _ = partition_data(args.dataset, args.partition,\n"
    "                                                                 beta=args.beta, num_users=args.num_users)\n"
    "    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=256, shuffle=False, num_workers=4)\n"
    "    global_model = get_model(args)\n    local_weights = []\n    global_model.train()\n"
    "    if args.type == 'pretrain':\n"
    "        for idx in range(args.num_users):\n"
    "            local_model = LocalUpdate(args=args, dataset=train_dataset, idxs=user_groups[idx])\n"
    "            w, local_acc = local_model.update_weights(copy.deepcopy(global_model), idx)\n"
    "            local_weights.append(copy.deepcopy(w))\n"
    "        torch.save(local_weights, 'clients.pkl')\n"
    "        global_weights = average_weights(local_weights)\n        global_model.load_state_dict(global_weights)\n"
    "        test_acc, test_loss = test(global_model, test_loader)\n        model_list = []\n"
    "        for i in range(len(local_weights)):\n            net = copy.deepcopy(global_model)\n"
    "            net.load_state_dict(local_weights[i])\n            model_list.append(net)\n"
    "        ensemble_model = Ensemble(model_list)\n        test(ensemble_model, test_loader)\n")


def _checkout(root: Path, momentum: str = "0.9", epoch: str = "pass") -> Path:
    files = {"helpers/__init__.py": "", "helpers/utils.py": UTILS, "helpers/datasets.py": DATASETS,
             "helpers/synthesizers.py": "", "models/__init__.py": "", "models/nets.py": NETS,
             "loop_df_fl.py": SCRIPT.replace("MOMENTUM", momentum).replace("EPOCH", epoch)}
    return write_files(root, files)


def _saved_clients(folder: Path, k: int) -> None:
    """k clients as reference_dense keeps them: the script's state dict (BatchNorm statistics moved too)."""
    import torch

    ns: dict = {}
    exec(NETS, ns)
    torch.manual_seed(1)
    folder.mkdir(parents=True)
    for i in range(k):
        state = {name: v + 0.1 * torch.rand_like(v) if v.is_floating_point() else v + 3 * i
                 for name, v in ns["CNNMnist"]().state_dict().items()}
        torch.save({"weights": state, "record": {"acc_per_epoch": [50.0]}}, folder / f"client{i}.pt")


def _run(tmp_path: Path, checkout: Path, *extra: str, epochs: int = 3) -> dict:
    return run_oracle(TOOL, tmp_path, checkout, epochs, *extra)


def test_a_script_that_trains_as_flare_does_is_found_equal_step_for_step_and_its_server_agrees(tmp_path):
    saved = tmp_path / "clients"
    _saved_clients(saved, 2)
    rec = _run(tmp_path, _checkout(tmp_path / "ref"), "--saved-clients", str(saved))
    loc = rec["local"]
    assert loc["inputs"] == {"max_abs_diff": 0.0, "labels_equal": True}
    spe = loc["steps_per_epoch"]
    assert spe == -(-loc["samples"] // 16) and loc["optimizer_steps"] == {"script": 3 * spe, "flare": 3 * spe}
    assert loc["loader_passes_with_steps"] == [0, 1, 2]  # the planned orders reached the script's three epochs
    pair = loc["script_vs_flare"]
    assert pair["verdict"] == "same" and pair["first_divergence"] is None
    assert all(r["max_abs_diff"] <= 1e-5 and min(r["max_abs_update"]) > 0 for r in pair["steps"])
    # train mode in the first epoch only, on both sides: the script's per-epoch test leaves it in eval mode
    assert [r["train_mode"] for r in pair["steps"]] == [[r["epoch"] <= 1] * 2 for r in pair["steps"]]
    assert len(loc["script_test_accuracy_per_epoch"]) == 3
    assert loc["test_accuracy"]["script"] == pytest.approx(loc["test_accuracy"]["flare"], abs=1e-9)
    assert rec["plan_is_the_cells_first_epochs"] is True
    own = rec["own_draws"]
    assert own["init_max_abs_diff"] == 0.0  # setup_seed, then the network: FLARE's seeded init
    assert own["first_epoch_order_equals_flare"] is False  # its loader draws from torch's global stream
    srv = rec["server"]
    assert srv["flare_weights"] == pytest.approx([0.5, 0.5])  # the table's server.weights: uniform
    for key in ("fedavg", "ensemble"):  # percent as correct/n·100 on one side, 100·correct/n on the other
        assert srv["script"][key] == pytest.approx(srv["flare"][key], abs=1e-9)
    assert srv["average_max_abs_diff"] < 1e-6 * srv["average_max_abs"]
    assert srv["num_batches_tracked"]["script"] != srv["num_batches_tracked"]["flare"]  # a mean against client 0's
    text = rendered_oracle(tmp_path, "dense-fmnist", rec)
    assert "`loop_df_fl.py` ↔ FLARE bit-identical" in text or "`loop_df_fl.py` ↔ FLARE the same" in text
    assert "train mode in epoch 1 on both sides" in text and "is FLARE's, bit for bit" in text
    assert f"FedAvg {srv['script']['fedavg']:.2f} and the ensemble {srv['script']['ensemble']:.2f}" in text


def test_a_script_without_momentum_is_caught_at_step_two(tmp_path):
    rec = _run(tmp_path, _checkout(tmp_path / "ref", momentum="0.0"), epochs=1)
    pair = rec["local"]["script_vs_flare"]
    assert pair["verdict"] == "differs" and pair["first_divergence"]["step"] == 2  # step 1: the buffer is the grad
    assert pair["steps"][0]["step"] == 1 and pair["steps"][0]["max_abs_diff"] <= 1e-5
    assert "server" not in rec
    text = rendered_oracle(tmp_path, "dense-fmnist", rec)
    assert "`loop_df_fl.py` ↔ FLARE apart from step 2 on" in text and "clients `loop_df_fl.py` trained" not in text


def test_a_script_that_trains_every_epoch_in_train_mode_is_caught_at_epoch_two(tmp_path):
    rec = _run(tmp_path, _checkout(tmp_path / "ref", epoch="model.train()"), epochs=2)
    pair, spe = rec["local"]["script_vs_flare"], rec["local"]["steps_per_epoch"]
    first = pair["first_divergence"]
    assert pair["verdict"] == "differs" and spe < first["step"] and first["train_mode"] == [True, False]
    assert all(r["max_abs_diff"] <= 1e-5 for r in pair["steps"] if r["step"] <= spe)
    assert "train mode in epochs 1,2 in the script, 1 in FLARE" in rendered_oracle(tmp_path, "dense-fmnist", rec)


def test_without_a_checkout_it_skips_and_says_so(tmp_path):
    r = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "skipped" in r.stdout and "--checkout" in r.stdout
    assert list(tmp_path.iterdir()) == []


def test_records_name_kept_clients_from_the_run_tree_not_the_machine():
    """A kept run's folder enters a record from its `runs/` component on, wherever the worktree sat; every committed
    oracle and fuse record holds such a path, never an absolute one."""
    import json
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from oracle import portable

    assert portable(Path("/any/worktree/runs/papers-reference/t/a0.3-s2/clients")) == \
        "runs/papers-reference/t/a0.3-s2/clients"
    assert portable(Path("/elsewhere/clients")) == "/elsewhere/clients"  # outside a run tree: said as given
    named = []
    for f in sorted((ROOT / "results" / "papers-reference").glob("*/oracle/*.json")):
        rec = json.loads(f.read_text())
        for part in (rec.get("server", {}).get("saved_clients"), rec.get("reference")):
            path = (part.get("path") or part.get("saved_clients")) if isinstance(part, dict) else None
            if isinstance(path, str):
                named.append(path)
                assert path.startswith("runs/"), f"{f.name} names {path}"
    assert named, "no committed record names its kept clients"
