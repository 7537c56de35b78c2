"""Wall time and peak GPU memory of the notes' full experiments.

  cifar10  : FAFI, ResNet-18, 5 clients, R = 50, E = 1, batch 512, α = 0.05 (the CIFAR-10 export)
  cifar100 : FAFI, ResNet-18, 5 clients, R = 10, E = 10 on CIFAR-100-shaped synthetic data when no
             CIFAR-100 is at hand

    python benchmarks/full_run.py cifar10 --root .carry/cifar10-jpg.tar.gz
    python benchmarks/full_run.py cifar100
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from flare.config import load_config
from flare.runner import Run, read_jsonl

SETTINGS = {
    "cifar10": ["dataset.name=cifar10", "dataset.format=imagefolder", "rounds=50", "local_epochs=1"],
    "cifar100": ["dataset.name=synthetic-cifar100", "rounds=10", "local_epochs=10"],
}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("setting", choices=sorted(SETTINGS))
    ap.add_argument("--root", default="../shared/data/cifar10-jpg.tar.gz")
    ap.add_argument("--preset", default="fafi")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    ov = SETTINGS[args.setting] + ["model.name=resnet18", "num_clients=5", "partition.alpha=0.05",
                                   "batch_size=512", "seed=1"]
    if args.setting == "cifar10":
        ov.append(f"dataset.root={args.root}")
    cfg = load_config(None, args.preset, ov + args.overrides)
    out = args.out or tempfile.mkdtemp(prefix=f"flare-full-{args.setting}-")
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    s = Run(cfg, out, quiet=True).execute()
    wall = time.perf_counter() - t
    rounds = [r for r in read_jsonl(f"{out}/metrics.jsonl") if r["kind"] == "round"]
    train = sum(r["seconds_train"] for r in rounds)
    ev = sum(r["seconds_eval"] for r in rounds)
    dev = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
    peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
    print(f"{args.setting}: {cfg.method} on {dev}, torch {torch.__version__}")
    print(f"wall {wall:.1f} s (train {train:.1f} s, eval {ev:.1f} s), peak GPU memory {peak:.2f} GiB")
    print(f"final acc ({s['primary']}) {100 * s['acc']:.2f}%, peak {100 * s['peak_acc']:.2f}% at round {s['peak_round']}")


if __name__ == "__main__":
    main()
