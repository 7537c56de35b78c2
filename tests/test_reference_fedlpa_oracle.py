"""benchmarks/reference_fedlpa_oracle.py puts FedLPA's own client and server code beside FLARE's on identical tensors.
Over a stand-in checkout whose scripts train as FLARE does it must find the runs equal step for step, from FLARE's
init and FLARE's batch order served to the script's own loader; a stand-in whose FedAvg script drops the momentum
must be caught at step 2, the first step momentum changes; the script's closed-form aggregation, run from its
`__main__` block over saved clients, must agree with FLARE's `merge` on the same weights and factors; and without a
checkout the tool skips, saying so."""
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import rendered_oracle, run_oracle, write_files

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "benchmarks" / "reference_fedlpa_oracle.py"

MODEL = (  # NIID-Bench's simple-cnn for 28x28 inputs, as the scripts build it
    "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"
    "class SimpleCNNMNIST(nn.Module):\n"
    "    def __init__(self, input_dim, hidden_dims, output_dim=10):\n        super().__init__()\n"
    "        self.conv1 = nn.Conv2d(1, 6, 5)\n        self.pool = nn.MaxPool2d(2, 2)\n"
    "        self.conv2 = nn.Conv2d(6, 16, 5)\n        self.fc1 = nn.Linear(input_dim, hidden_dims[0])\n"
    "        self.fc2 = nn.Linear(hidden_dims[0], hidden_dims[1])\n"
    "        self.fc3 = nn.Linear(hidden_dims[1], output_dim)\n"
    "    def forward(self, x):\n        x = self.pool(F.relu(self.conv1(x)))\n"
    "        x = self.pool(F.relu(self.conv2(x)))\n        x = x.view(-1, 16 * 4 * 4)\n"
    "        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x)))))\n")

UTILS = (
    "import torch\nimport torch.utils.data as data\nfrom torchvision import datasets, transforms\n"
    "def get_dataloader(dataset, datadir, train_bs, test_bs, dataidxs=None, noise_level=0):\n"
    "    tr = datasets.FashionMNIST(datadir, train=True, download=True, transform=transforms.ToTensor())\n"
    "    te = datasets.FashionMNIST(datadir, train=False, download=True, transform=transforms.ToTensor())\n"
    "    if dataidxs is not None:\n        tr = data.Subset(tr, list(dataidxs))\n"
    "    return (data.DataLoader(tr, batch_size=train_bs, shuffle=True), data.DataLoader(te, batch_size=test_bs),\n"
    "            tr, te)\n"
    "def compute_accuracy(model, dataloader, get_confusion_matrix=False, device='cpu'):\n"
    "    was = model.training\n    model.eval()\n    right = n = 0\n    with torch.no_grad():\n"
    "        for x, y in dataloader:\n            right += (model(x).argmax(1) == y).sum().item()\n"
    "            n += len(y)\n"
    "    model.train(was)\n    return (right / n, None) if get_confusion_matrix else right / n\n")

COMMON = (  # what both scripts share: the parser and the networks
    "import argparse, copy, logging\nfrom collections import OrderedDict\nimport torch\nfrom model import *\n"
    "from utils import *\n"
    "def get_args():\n    p = argparse.ArgumentParser()\n"
    "    for k, t, d in (('--model', str, 'mlp'), ('--dataset', str, 'mnist'), ('--alg', str, 'fedavg'),\n"
    "                    ('--lr', float, 0.01), ('--batch-size', int, 64), ('--epochs', int, 5),\n"
    "                    ('--n_parties', int, 2), ('--rho', float, 0.0), ('--comm_round', int, 50),\n"
    "                    ('--partition', str, 'homo'), ('--beta', float, 0.5), ('--device', str, 'cuda:0'),\n"
    "                    ('--datadir', str, './data/'), ('--logdir', str, './logs/'), ('--noise', float, 0.0),\n"
    "                    ('--init_seed', int, 0), ('--reg', float, 1e-5), ('--optimizer', str, 'sgd')):\n"
    "        p.add_argument(k, type=t, default=d)\n"
    "    p.add_argument('--net_config', default=None)\n"
    "    EXTRA\n"
    "    return p.parse_args()\n"
    "def init_nets(net_configs, dropout_p, n_parties, args):\n"
    "    nets = {i: SimpleCNNMNIST(16 * 4 * 4, [120, 84], 10) for i in range(n_parties)}\n"
    "    return nets, None, None\n")

OURS = COMMON.replace("EXTRA", "p.add_argument('--coor', type=float, default=1e-4)") + (
    "def train_net_blockoffline(net_id, net_local, f_local, mu_global, f_global, len_of_data, train_dataloader,\n"
    "                           test_dataloader, epochs, lr, coordinator, args, device='cpu'):\n"
    "    compute_accuracy(net_local, train_dataloader)\n"
    "    optimizer = torch.optim.SGD(net_local.parameters(), lr=lr, momentum=args.rho, weight_decay=args.reg)\n"
    "    for epoch in range(epochs):\n        for x, target in train_dataloader:\n"
    "            optimizer.zero_grad()\n"
    "            loss = torch.nn.CrossEntropyLoss()(net_local(x), target.long())\n"
    "            loss.backward()\n            optimizer.step()\n"
    "        logger.info('Epoch: %d' % epoch)\n"
    "    stats = torch.optim.SGD(net_local.parameters(), lr=1.0)  # gathers, never steps (K-FAC's pass)\n"
    "    for x, target in train_dataloader:\n"
    "        stats.zero_grad()\n        torch.nn.CrossEntropyLoss()(net_local(x), target.long()).backward()\n"
    "    return compute_accuracy(net_local, train_dataloader), compute_accuracy(net_local, test_dataloader)\n"
    "def local_train_net_blockoffline(*a, **k):\n    pass\n"
    "def newton_solve(fed_avg_freqs, Ak, Bk, Z, device):\n"
    "    return torch.inverse(sum(f * B for f, B in zip(fed_avg_freqs, Bk))) @ Z @ torch.inverse(\n"
    "        sum(f * A for f, A in zip(fed_avg_freqs, Ak)))\n"
    "if __name__ == '__main__':\n    args = get_args()\n"
    "    for round in range(args.comm_round):\n"
    "        local_train_net_blockoffline(nets, selected, f_nets, args, net_dataidx_map)\n"
    "        total_data_points = sum(len(net_dataidx_map[r]) for r in selected)\n"
    "        fed_avg_freqs = [len(net_dataidx_map[r]) / total_data_points for r in selected]\n"
    "        avg_param = OrderedDict()\n"
    "        for key in nets[selected[0]].state_dict():\n"
    "            avg_param[key] = sum(f * nets[r].state_dict()[key] for f, r in zip(fed_avg_freqs, selected))\n"
    "        biased_param = copy.deepcopy(avg_param)\n"
    "        for name in global_fim:\n"
    "            mats = []\n"
    "            for r in selected:\n"
    "                sd = nets[r].state_dict()\n"
    "                w = sd[name + '.weight']\n"
    "                mats.append(torch.cat([w.reshape(w.shape[0], -1), sd[name + '.bias'][:, None]], 1))\n"
    "            Z = sum(f * f_nets[r][name][1] @ m @ f_nets[r][name][0]\n"
    "                    for f, r, m in zip(fed_avg_freqs, selected, mats))\n"
    "            M = newton_solve(fed_avg_freqs, [f_nets[r][name][0] for r in selected],\n"
    "                             [f_nets[r][name][1] for r in selected], Z, device)\n"
    "            biased_param[name + '.weight'] = M[:, :-1].reshape(avg_param[name + '.weight'].shape)\n"
    "            biased_param[name + '.bias'] = M[:, -1]\n"
    "        newtons_param = copy.deepcopy(biased_param)\n"
    "        logger.info('global n_training: %d' % len(train_dl_global))\n"
    "        raise SystemExit('the oracle runs only the aggregation statements')\n")

FEDAVG = COMMON.replace("EXTRA", "pass") + (
    "def train_net(net_id, net, train_dataloader, test_dataloader, epochs, lr, args_optimizer, device='cpu'):\n"
    "    compute_accuracy(net, train_dataloader)\n"
    "    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=MOMENTUM, weight_decay=args.reg)\n"
    "    for epoch in range(epochs):\n        for x, target in train_dataloader:\n"
    "            optimizer.zero_grad()\n"
    "            loss = torch.nn.CrossEntropyLoss()(net(x), target.long())\n"
    "            loss.backward()\n            optimizer.step()\n"
    "    return compute_accuracy(net, train_dataloader), compute_accuracy(net, test_dataloader)\n"
    "if __name__ == '__main__':\n    raise SystemExit('the oracle calls train_net only')\n")


def _checkout(root: Path, fedavg_momentum: str) -> Path:
    return write_files(root, {"model.py": MODEL, "utils.py": UTILS, "experiments_our.py": OURS,
                              "experiments.py": FEDAVG.replace("MOMENTUM", fedavg_momentum)})


def _saved_clients(folder: Path, k: int) -> None:
    """k clients as reference_fedlpa keeps them: the script's state dict and each layer's (A, G) factors."""
    import torch

    torch.manual_seed(1)
    folder.mkdir(parents=True)
    layers = {"conv1": (6, 26), "conv2": (16, 151), "fc1": (120, 257), "fc2": (84, 121), "fc3": (10, 85)}

    def spd(d):
        x = torch.randn(d, 2 * d)
        return x @ x.T / (2 * d) + 0.1 * torch.eye(d)

    for i in range(k):
        net = torch.nn.ModuleDict({"conv1": torch.nn.Conv2d(1, 6, 5), "conv2": torch.nn.Conv2d(6, 16, 5),
                                   "fc1": torch.nn.Linear(256, 120), "fc2": torch.nn.Linear(120, 84),
                                   "fc3": torch.nn.Linear(84, 10)})
        torch.save({"weights": net.state_dict(),
                    "factors": {name: (spd(cols), spd(rows)) for name, (rows, cols) in layers.items()}},
                   folder / f"client{i}.pt")


def _run(tmp_path: Path, checkout: Path, *extra: str, epochs: int = 2) -> dict:
    return run_oracle(TOOL, tmp_path, checkout, epochs, "--set", "test_batch_size=16", *extra)


def test_a_script_that_trains_as_flare_does_is_found_equal_step_for_step_and_its_aggregation_agrees(tmp_path):
    saved = tmp_path / "clients"
    _saved_clients(saved, 2)
    # two of the cell's rounds of 10 epochs: FLARE's optimiser carried across the boundary, the script's one loop
    rec = _run(tmp_path, _checkout(tmp_path / "ref", "args.rho"), "--saved-clients", str(saved), epochs=20)
    loc = rec["local"]
    assert loc["inputs"] == {"max_abs_diff": 0.0, "labels_equal": True}
    spe = loc["steps_per_epoch"]
    assert spe == -(-loc["samples"] // 16) and loc["optimizer_steps"] == {
        "our_script": 20 * spe, "fedavg_script": 20 * spe, "flare": 20 * spe} and rec["flare_rounds"] == 2
    # the planned batches reached the epochs (passes 1..20), not the accuracy or statistics passes around them
    assert loc["loader_passes_with_steps"] == {"our_script": list(range(1, 21)), "fedavg_script": list(range(1, 21))}
    for pair in ("our_script_vs_flare", "our_script_vs_fedavg_script"):
        assert loc[pair]["verdict"] == "same" and loc[pair]["first_divergence"] is None
        assert [r["step"] for r in loc[pair]["steps"]][-1] == 20 * spe
        assert all(r["max_abs_diff"] <= 1e-5 and min(r["max_abs_update"]) > 0 for r in loc[pair]["steps"])
    assert loc["final_logits_max_abs_diff_our_script_vs_flare"] <= 1e-4
    assert rec["plan_is_the_cells_first_epochs"] is True
    srv = rec["server"]
    assert srv["weights"] == pytest.approx([n / sum(srv["client_sizes"]) for n in srv["client_sizes"]])
    assert srv["flare_merge_closed_form"]["max_abs_diff_vs_script_biased"] < 1e-3 * srv["max_abs_param"]
    for key in ("fedavg", "biased", "newton"):
        assert 0 <= srv["script"][key] <= 100
    assert set(srv) >= {"flare_fedlpa", "flare_fedlpa_reference"}
    text = rendered_oracle(tmp_path, "fedlpa-fmnist", rec)
    assert "`experiments_our.py` ↔ FLARE the same" in text or "`experiments_our.py` ↔ FLARE bit-identical" in text
    assert f"biased {srv['script']['biased']:.2f}" in text
    assert f"closed form {srv['flare_merge_closed_form']['acc']:.2f}" in text


def test_a_fedavg_script_without_momentum_is_caught_at_step_two(tmp_path):
    rec = _run(tmp_path, _checkout(tmp_path / "ref", "0.0"))
    loc = rec["local"]
    assert loc["our_script_vs_flare"]["verdict"] == "same"
    other = loc["our_script_vs_fedavg_script"]
    assert other["verdict"] == "differs" and other["first_divergence"]["step"] == 2  # step 1: the buffer is the grad
    assert other["steps"][0]["step"] == 1 and other["steps"][0]["max_abs_diff"] <= 1e-5
    assert rec["flare_rounds"] == 1 and rec["plan_is_the_cells_first_epochs"] is True  # 2 of the round's 10 epochs
    assert "server" not in rec
    text = rendered_oracle(tmp_path, "fedlpa-fmnist", rec)
    assert "`experiments_our.py` ↔ `experiments.py` apart from step 2 on" in text and "K-FAC" not in text


def test_without_a_checkout_it_skips_and_says_so(tmp_path):
    r = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert r.returncode == 0 and "skipped" in r.stdout and "--checkout" in r.stdout
    assert list(tmp_path.iterdir()) == []
