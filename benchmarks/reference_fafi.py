"""The reference's wall time on this machine: the official FAFI code's `--algo OursV4` (the code the notes' reference
forks; zenghui9977/FAFI_ICML25) for one round in cpu_profile's setting, so that FLARE's exact and fast profiles
have a yardstick timed on the same CPU type (cpu_profile.REFERENCE_TIMES; docs/performance.md).

    python benchmarks/reference_fafi.py --checkout PATH/TO/FAFI_ICML25 \
        --data-root ../shared/data/cifar10-jpg.tar.gz --out runs/reference-fafi --record FILE.json

The reference code is not part of FLARE and is never copied into it: give a checkout (26cf90e was timed). What runs
is its own path for OursV4 (test.py's): `get_fl_dataset` — its own Dirichlet split, seeded by its config's seed —
and `OneshotOurs` for one round, with its `configs/CIFAR10_alpha0.05.yaml` otherwise as written (batch 512, lr 0.05,
one local epoch, drop_last) but `num_rounds=1` and `device=cpu`, on torch's default threads. Nothing here may
download, so the data are FLARE's stratified 5,000 / 1,000 CIFAR-10 subset (seed 1), served the way torchvision's
CIFAR10 serves them (uint8 arrays, a PIL image per item, ToTensor); three modules it imports only for figures
(visdom, pytorch_grad_cam, cv2) get stand-ins, since none of them is called in an OursV4 round.

Its own split is not FLARE's: it deals each class to clients in proportions drawn from Dir(α), scaled by 10 and
capped at the class's size, so clients overlap and it trains more samples than the subset holds (drop_last then
drops each client's last partial batch). The record keeps the client sizes and the samples it trained beside the
wall time, so the comparison can be read per sample as well. (With FLARE's seed-1 split instead the reference
crashes: a client with fewer samples than a batch has no batch under drop_last and its accuracy divides by zero.)

The timed run is a child process that never imports FLARE (importing FLARE pins the process's kernels); this
process prepares the data and writes the record. After the round the record gets the two codes' bare steps at the
run's step size, measured one after the other in that sitting — the reference's model built by its own code, in the
child, and FLARE's exact profile, in a process of its own — because a wall time says what a user waits for but not
whose kernels are faster: the two codes train different numbers of samples, and records of two days on a VM do not
compare per sample.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import types
from pathlib import Path

def prepare(cfg, npz: Path) -> list[int]:
    """FLARE's 5,000 / 1,000 subset of the setting (cpu_profile's, at FLARE's default seed 1; the reference's config
    also says seed 1), saved for the child."""
    import numpy as np

    from flare.data.prepare import prepare_data

    data, _ = prepare_data(cfg)
    np.savez(npz, train_x=data.train_x.numpy(), train_y=data.train_y.numpy(), test_x=data.test_x.numpy(),
             test_y=data.test_y.numpy())
    return [len(data.train_y), len(data.test_y)]


def bare_step(model, images: int, torch, steps: int = 2) -> float:
    """Samples/s of the reference model's bare training step at the run's step size — forward, CE on its logits,
    backward, SGD with momentum on random input, fastest of `steps` after a warm-up: flare.speed.step_rate's
    definition, written again here because the timed child must not import FLARE and this model returns (logits,
    features) where FLARE's returns (features, logits)."""
    import torch.nn.functional as F

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn((images, 3, 32, 32), generator=gen), torch.randint(0, 10, (images,), generator=gen)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    best = float("inf")
    for i in range(steps + 1):
        t = time.perf_counter()
        logits, _ = model(x)
        loss = F.cross_entropy(logits, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i:  # the first step pays for oneDNN's kernel creation
            best = min(best, time.perf_counter() - t)
    return images / best


def child(checkout: Path, npz: Path, out: Path) -> dict:
    """One OursV4 round by the reference's own code; returns the timings and what it trained."""
    t0 = time.perf_counter()
    sys.path.insert(0, str(checkout))
    for name in ("visdom", "pytorch_grad_cam", "pytorch_grad_cam.utils", "pytorch_grad_cam.utils.model_targets",
                 "pytorch_grad_cam.utils.image", "cv2"):  # imported for figures only; stand-ins, never called
        sys.modules[name] = types.SimpleNamespace(Visdom=object, GradCAM=None, GuidedBackpropReLUModel=None,
                                                  ClassifierOutputTarget=None, show_cam_on_image=None,
                                                  preprocess_image=None, deprocess_image=None)
    import numpy as np
    import torch
    import torchvision.transforms as transforms
    from PIL import Image

    z = np.load(npz)

    class Cifar(torch.utils.data.Dataset):
        """torchvision.datasets.CIFAR10's item: a uint8 HWC array, made a PIL image, then ToTensor."""

        def __init__(self, x, y):
            self.data, self.targets = np.ascontiguousarray(x.transpose(0, 2, 3, 1)), [int(t) for t in y]
            self.transform = transforms.Compose([transforms.ToTensor()])

        def __len__(self):
            return len(self.targets)

        def __getitem__(self, i):
            return self.transform(Image.fromarray(self.data[i])), self.targets[i]

    train, test = Cifar(z["train_x"], z["train_y"]), Cifar(z["test_x"], z["test_y"])
    out.mkdir(parents=True, exist_ok=True)
    os.chdir(out)  # it writes logs/, checkpoints/ and preprocessed_data/ into the working directory
    import dataset_helper
    dataset_helper.load_dataset = lambda name, path: (train, test)
    import oneshot_algorithms.ours.our_local_training as local
    import oneshot_algorithms.ours.our_main as our_main
    from common_libs import load_yaml_config, setup_seed

    spent = {"clients": 0.0, "client_evals": 0.0, "client_saves": 0.0}

    def timed(fn, key):  # wall seconds spent inside fn, summed: what its round spends where
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[key] += time.perf_counter() - t
        return wrapper

    # each client's local training (its module-level name, as OneshotOurs calls it), and inside it the accuracy
    # passes it makes after every epoch (test set and the client's own training set)
    our_main.ours_local_training = timed(our_main.ours_local_training, "clients")
    local.test_acc = timed(local.test_acc, "client_evals")
    local.save_best_local_model = timed(local.save_best_local_model, "client_saves")  # a checkpoint per client

    config = load_yaml_config(str(checkout / "configs" / "CIFAR10_alpha0.05.yaml"))
    config["server"]["num_rounds"], config["device"] = 1, "cpu"
    config["checkpoint"]["save_path"] = str(out / "checkpoints") + "/"
    setup_seed(config["seed"])
    trainset, testset, idx = dataset_helper.get_fl_dataset(
        "CIFAR10", "unused", config["client"]["num_clients"], config["distribution"]["type"],
        config["distribution"]["label_num_per_client"], config["distribution"]["alpha"])
    loader = torch.utils.data.DataLoader(testset, batch_size=config["dataset"]["test_batch_size"], shuffle=True)
    sizes = [len(idx[c]) for c in range(config["client"]["num_clients"])]
    batch = config["dataset"]["train_batch_size"]
    t1 = time.perf_counter()
    our_main.OneshotOurs(trainset, loader, idx, config, "cpu")
    t2 = time.perf_counter()
    from models_lib import get_train_models  # the model its round trained, built by its own code

    net = get_train_models(model_name=config["server"]["model_name"], num_classes=config["dataset"]["num_classes"],
                           mode="our")
    bare = bare_step(net, 2 * batch, torch)
    trained = sum(s // batch * batch for s in sizes)
    train = spent["clients"] - spent["client_evals"] - spent["client_saves"]
    return {"client_sizes": sizes, "samples": sum(sizes), "samples_trained": trained, "batch": batch,
            "setup_seconds": round(t1 - t0, 2), "round_seconds": round(t2 - t1, 2), "train_seconds": round(train, 2),
            "client_eval_seconds": round(spent["client_evals"], 2), "save_seconds": round(spent["client_saves"], 2),
            "server_seconds": round(t2 - t1 - spent["clients"], 2),
            "train_rate": round(2 * trained / train, 2) if train > 0 else None,  # two views a sample, as FLARE
            "bare_step": {"images": 2 * batch, "reference": round(bare, 2)},
            "torch": torch.__version__, "threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkout", type=Path, required=True, help="a checkout of zenghui9977/FAFI_ICML25")
    ap.add_argument("--data-root", help="the CIFAR-10 export (folder or .tar.gz)")
    ap.add_argument("--out", type=Path, default=Path("runs/reference-fafi"))
    ap.add_argument("--record", type=Path, help="write the measurement as JSON here")
    ap.add_argument("--child", type=Path, help=argparse.SUPPRESS)  # the timed process: the prepared .npz
    args = ap.parse_args(argv)
    checkout = args.checkout.resolve()
    if args.child:
        print(json.dumps(child(checkout, args.child, args.out.resolve())), flush=True)
        return 0
    if not (checkout / "oneshot_algorithms" / "ours" / "our_main.py").is_file() or not args.data_root:
        print(f"reference_fafi: {checkout} is not a checkout of FAFI_ICML25 (no oneshot_algorithms/ours/our_main.py),"
              " or --data-root is missing.", file=sys.stderr)
        return 2
    import cpu_profile  # noqa: E402  (beside this file): the machine facts and load average its records keep

    from flare import cpu, speed
    from flare.config import load_config

    cfg = load_config(None, "fafi", [*cpu_profile.SETTING[2:], f"dataset.root={args.data_root}",
                                     "dataset.train_subset=5000", "dataset.test_subset=1000"])
    args.out.mkdir(parents=True, exist_ok=True)
    npz = args.out / "subset.npz"
    subset = prepare(cfg, npz)
    commit = subprocess.run(["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    before = cpu_profile.load_average()
    t0 = time.perf_counter()
    # The user's environment, not this process's pins (as cpu_profile gives its profiles): the reference chooses
    # its kernels as it would alone.
    res = subprocess.run([sys.executable, __file__, "--checkout", str(checkout), "--out", str(args.out / "run"),
                          "--child", str(npz)], env=cpu.user_environment(), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        print(res.stdout[-2000:] + res.stderr[-4000:], file=sys.stderr)
        return 1
    timed = json.loads(res.stdout.strip().splitlines()[-1])
    # FLARE's exact profile's bare step at the same size, in a process of its own, right after: the kernels of the
    # two codes compared in one sitting (a VM's speed drifts from day to day; records of two days do not compare)
    spec = speed.ProbeSpec(cfg.model_dump(mode="json"), cpu_profile.IMAGE_SHAPE, cpu_profile.CLASSES,
                           timed["bare_step"]["images"])
    rate = speed.measure_in_child(spec, cfg.cpu_isa, speed.Candidate(False, False), cpu.user_environment())
    timed["bare_step"]["flare_exact"] = round(rate, 2)
    rec = {"machine": cpu_profile.machine_facts(), "load_average": {"before": before,
                                                                    "after": cpu_profile.load_average()},
           "date": time.strftime("%Y-%m-%d"), "reference": "zenghui9977/FAFI_ICML25 --algo OursV4", "commit": commit,
           "subset": subset, "wall": round(wall, 1), **timed}
    print(json.dumps(rec, indent=1))
    if args.record:
        args.record.parent.mkdir(parents=True, exist_ok=True)
        args.record.write_text(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
