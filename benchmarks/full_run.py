"""Wall time, seconds per round (training, evaluation) and peak GPU memory of the notes' full experiments.

  cifar10  : FAFI, ResNet-18, 5 clients, R = 50, E = 1, batch 512, α = 0.05 (the CIFAR-10 export)
  cifar100 : FAFI, ResNet-18, 5 clients, R = 10, E = 10 on CIFAR-100-shaped synthetic data when no
             CIFAR-100 is at hand

Wall time is the whole `Run(...).execute()`: data loading, every round, the run directory and its report.
Per round: the runner's own `seconds_train` and `seconds_eval` of every round (mean, and without the first
round, which carries the warm-up: cuDNN autotuning, torch.compile). Any KEY=VALUE override applies last
(e.g. client_engine=batched compile=true).

    python benchmarks/full_run.py cifar10 --root .carry/cifar10-jpg.tar.gz client_engine=batched
    python benchmarks/full_run.py cifar100
    python benchmarks/full_run.py --cpu-smoke            # a tiny CPU run in seconds (CI runs it)
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from flare.config import load_config
from flare.rundir import read_jsonl
from flare.runner import Run

SETTINGS = {
    "cifar10": ["dataset.name=cifar10", "dataset.format=imagefolder", "rounds=50", "local_epochs=1"],
    "cifar100": ["dataset.name=synthetic-cifar100", "rounds=10", "local_epochs=10"],
}
COMMON = ["model.name=resnet18", "num_clients=5", "partition.alpha=0.05", "batch_size=512", "seed=1"]
SMOKE = ["dataset.name=synthetic-cifar10", "dataset.format=auto", "dataset.train_subset=256",
         "dataset.test_subset=128", "model.name=cnn", "model.width=0.25", "num_clients=2", "rounds=2",
         "local_epochs=1", "batch_size=64", "device=cpu"]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("setting", nargs="?", default="cifar10", help=f"one of {', '.join(SETTINGS)} (default cifar10)")
    ap.add_argument("--root", default="../shared/data/cifar10-jpg.tar.gz")
    ap.add_argument("--preset", default="fafi")
    ap.add_argument("--out", default=None)
    ap.add_argument("--cpu-smoke", action="store_true", help="a tiny CPU configuration that runs in seconds")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)  # KEY=VALUE may come before or after the options
    if "=" in args.setting:  # no setting named: the first word is already an override
        args.overrides.insert(0, args.setting)
        args.setting = "cifar10"
    if args.setting not in SETTINGS:
        ap.error(f"unknown setting {args.setting!r}: use one of {', '.join(SETTINGS)}")
    ov = SETTINGS[args.setting] + COMMON
    if args.setting == "cifar10" and not args.cpu_smoke:
        ov.append(f"dataset.root={args.root}")
    if args.cpu_smoke:
        ov += SMOKE
    cfg = load_config(None, args.preset, ov + args.overrides)
    out = Path(args.out or tempfile.mkdtemp(prefix=f"flare-full-{args.setting}-"))
    cuda = torch.cuda.is_available() and cfg.device != "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    s = Run(cfg, out, quiet=True).execute()
    wall = time.perf_counter() - t
    rounds = [r for r in read_jsonl(out / "metrics.jsonl") if r["kind"] == "round"]
    train = [r["seconds_train"] for r in rounds]
    ev = [r["seconds_eval"] for r in rounds if "seconds_eval" in r]  # eval.every > 1 skips rounds
    dev = torch.cuda.get_device_name() if cuda else f"CPU ({torch.get_num_threads()} threads)"
    peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
    reserved = torch.cuda.max_memory_reserved() / 2**30 if cuda else float("nan")
    res = {"wall_s": wall, "rounds": len(rounds), "train_s": sum(train), "eval_s": sum(ev),
           "train_s_per_round": _mean(train), "eval_s_per_round": _mean(ev),
           "train_s_per_round_after_first": _mean(train[1:]), "eval_s_per_round_after_first": _mean(ev[1:]),
           "peak_gib": peak, "reserved_gib": reserved, "acc": s["acc"], "out": str(out)}
    print(f"{'cpu-smoke' if args.cpu_smoke else args.setting}: {cfg.method} on {dev}, torch {torch.__version__}, "
          f"client_engine={cfg.client_engine}{' compiled' if cfg.compile else ''}, {cfg.num_clients} clients, "
          f"{cfg.model.name} width {cfg.model.width}, batch {cfg.batch_size}, R={cfg.rounds} E={cfg.local_epochs}")
    print(f"wall {wall:.1f} s (data loading, {len(rounds)} rounds, run directory and report)")
    print(f"train {sum(train):.1f} s = {res['train_s_per_round']:.3f} s/round "
          f"({res['train_s_per_round_after_first']:.3f} s/round after the first)")
    print(f"eval  {sum(ev):.1f} s = {res['eval_s_per_round']:.3f} s per evaluation, {len(ev)} of them "
          f"({res['eval_s_per_round_after_first']:.3f} s after the first)")
    print(f"peak GPU memory {peak:.2f} GiB allocated, {reserved:.2f} GiB reserved")
    print(f"final acc ({s['primary']}) {100 * s['acc']:.2f}%, peak {100 * s['peak_acc']:.2f}% at round {s['peak_round']}")
    return res


if __name__ == "__main__":
    main()
