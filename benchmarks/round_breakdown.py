"""Seconds per round in local training, aggregation (server rules + diagnostics) and evaluation.

Runs one experiment (any preset and overrides) and prints the per-round split that the runner records
in metrics.jsonl (`seconds_train`, `seconds_aggregate`, `seconds_eval`).

    python benchmarks/round_breakdown.py --preset fafi dataset.name=synthetic-cifar10 model.width=0.25 rounds=2
"""
from __future__ import annotations

import argparse
import tempfile

from flare.config import load_config
from flare.rundir import read_jsonl
from flare.runner import Run


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="fafi")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_intermixed_args(argv)  # KEY=VALUE may come before or after the options
    cfg = load_config(None, args.preset, ["rounds=2", "dataset.train_subset=5000", "dataset.test_subset=1000",
                                          "model.name=resnet18", "model.width=0.25"] + args.overrides)
    out = args.out or tempfile.mkdtemp(prefix="flare-breakdown-")
    Run(cfg, out, quiet=True).execute()
    rounds = [r for r in read_jsonl(f"{out}/metrics.jsonl") if r["kind"] == "round"]
    print(f"{cfg.method}: {cfg.dataset.name}, {cfg.num_clients} clients, {cfg.model.name} w{cfg.model.width}, "
          f"batch {cfg.batch_size}, device {cfg.device}")
    print(f"{'round':>5} {'train s':>9} {'aggregate s':>12} {'eval s':>8} {'total s':>8}")
    for r in rounds:
        print(f"{r['round']:>5} {r['seconds_train']:>9.2f} {r['seconds_aggregate']:>12.3f} {r['seconds_eval']:>8.2f} "
              f"{r['seconds']:>8.2f}")


if __name__ == "__main__":
    main()
