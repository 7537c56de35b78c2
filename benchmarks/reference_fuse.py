"""FLARE's server over the clients a paper's own code trained: how much of a code ↔ FLARE difference the server holds.

    python benchmarks/reference_fuse.py --table configs/papers/fedlpa-fmnist.yaml --alpha 0.1 --seed 0 \
        --strategy dense --reference results/papers-reference/fedlpa-fmnist/dense-a0.1-s0 \
        --saved-clients runs/papers-reference/fedlpa-fmnist/dense-a0.1-s0/clients \
        --record results/papers-reference/fedlpa-fmnist/oracle/a0.1-s0-fuse-dense.json

A run of the paper's code (benchmarks/reference_dense.py, reference_fedlpa.py) keeps the clients it trained
(`clients/client<i>.pt`) and records what its own server made of them (`record.json`). This tool hands those very
clients to FLARE's server strategy as the table's column runs it — the cell's config, the column's `fuse_options`
(the generator budget), the cell's partition for the upload sizes — and scores it on the test set, beside FLARE's
FedAvg and ensemble of the same clients (which the script scored too: the same teachers read the same). What is
left of a code ↔ FLARE difference once both servers have fused the same clients lies in the clients: their
training code and their random draws, which the identical-tensors oracles (reference_*_oracle.py) take apart.

Nothing of the paper's code runs here (its clients are tensors). The strategy keeps its progress in a scratch
directory under `--runs`, one per clients and options, so an interrupted run goes on from its last saved epoch; the
directory goes once the record is written. One process, the kernels `flare run` uses.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import reference_dense as ref  # noqa: E402
from oracle import emit, flare_models, machine_facts, portable  # noqa: E402

TOOL = "reference_fuse"
# what the reference's record calls its server's value, per FLARE strategy: (final, best epoch)
SCRIPT_KEYS = {"dense": ("student_final", "student_best")}


def their_weights(saved: dict) -> dict:
    """A kept client's state dict: DENSE's and FedLPA's drivers keep it as `weights`; FedLPA's DENSE script as the
    first thing its client function returned."""
    return saved["weights"] if "weights" in saved else saved["returned"][0]


def fused(cfg, strategy: str, weights: list[dict], scratch: Path) -> dict:
    """FLARE's `strategy`, FedAvg and ensemble over the clients `weights` (the script's keys, paired with FLARE's by
    position), scored as `flare fuse` scores them at the last round."""
    from flare.setup import ServerSetup, checked_split

    rules = (strategy, "fedavg", "output")
    server = ServerSetup.build(cfg, bank=False, checkpoints=False, strategies=rules)
    _, partition = checked_split(server)
    parts = partition.client_indices
    if len(parts) != len(weights):
        raise SystemExit(f"{TOOL}: the cell has {len(parts)} clients, --saved-clients {len(weights)}")
    models, uploads, _ = flare_models(TOOL, server.template, weights, [len(p) for p in parts])
    t0, c0 = time.perf_counter(), time.process_time()
    ev = server.evaluate(cfg.rounds - 1, uploads, models, rules=rules, scratch=scratch)
    logs = ev.predictors[strategy].logs
    curve = [list(p) for p in logs.get("curve", [])]
    final = 100 * ev.record[f"acc_{strategy}"]
    return {"strategy": strategy, "final": final,
            "best": max([100 * p[-1] for p in curve] + [final]),
            "curve": curve, "fedavg": 100 * ev.record["acc_fedavg"], "ensemble": 100 * ev.record["acc_output"],
            "client_sizes": [len(p) for p in parts],
            "logs": {k: v for k, v in logs.items() if k != "curve"},
            "wall_seconds": round(time.perf_counter() - t0, 1), "cpu_seconds": round(time.process_time() - c0, 1)}


def scratch_dir(a, spec: dict, cfg) -> Path:
    """Where the strategy keeps its resumable state: one directory per cell, clients and strategy options, so that
    a run with other options (a smoke's smaller budget) never resumes from this one's."""
    key = json.dumps([str(a.saved_clients.resolve()), cfg.server.strategies[a.strategy], a.set], sort_keys=True,
                     default=str)
    tag = hashlib.sha256(key.encode()).hexdigest()[:12]
    return (a.runs / spec["table"] / f"a{a.alpha:g}-s{a.seed}" / f"{a.strategy}-{tag}").resolve()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", type=Path, required=True, help="the table file (configs/papers/*.yaml)")
    ap.add_argument("--alpha", type=float, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategy", default="dense", choices=sorted(SCRIPT_KEYS))
    ap.add_argument("--reference", type=Path, required=True,
                    help="the reference run's results directory (its record.json: the script's own server)")
    ap.add_argument("--saved-clients", type=Path, required=True, help="the clients/ directory that run kept")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a FLARE config override")
    ap.add_argument("--runs", type=Path, default=ref.RUNS / "fuse", help="scratch: the strategy's resumable state")
    ap.add_argument("--record", type=Path, help="write the measurement here (JSON)")
    a = ap.parse_args(argv)
    t_wall, t_cpu = time.time(), time.process_time()

    import torch

    from flare.config.load import deep_merge, load_config, parse_overrides

    rec_file = a.reference / "record.json"
    try:
        theirs = json.loads(rec_file.read_text())
    except (OSError, ValueError) as e:
        print(f"{TOOL}: {rec_file} is not a finished reference run's record ({type(e).__name__}).", file=sys.stderr)
        return 2
    if float(theirs.get("alpha", -1)) != a.alpha or int(theirs.get("seed", -1)) != a.seed:
        print(f"{TOOL}: {rec_file} is the run at α = {theirs.get('alpha')}, seed {theirs.get('seed')}, not α = "
              f"{a.alpha:g}, seed {a.seed}.", file=sys.stderr)
        return 2
    files = sorted(a.saved_clients.glob("client*.pt"), key=lambda f: int(f.stem[len("client"):]))
    if not files:
        print(f"{TOOL}: {a.saved_clients} holds no client<i>.pt.", file=sys.stderr)
        return 2
    spec, cell = ref.table_cell(a.table, a.alpha, a.seed)
    mapping = deep_merge(deep_merge(cell["config"], {"server": {"strategies": cell["fuse_options"]}}),
                         parse_overrides(list(a.set)))
    cfg = load_config(overrides=mapping)
    weights = [their_weights(torch.load(f, weights_only=False)) for f in files]
    final_key, best_key = SCRIPT_KEYS[a.strategy]
    rec = {"tool": f"benchmarks/{TOOL}.py", "table": spec["table"], "flare_cell": cell["name"], "alpha": a.alpha,
           "seed": a.seed, "strategy": a.strategy, "fuse_options": cell["fuse_options"].get(a.strategy, {}),
           "flare_overrides": a.set,
           "reference": {"record": rec_file.as_posix(), "reference": theirs.get("reference"),
                         "commit": theirs.get("commit"), "partition": (theirs.get("partition") or {}).get("used"),
                         "saved_clients": portable(a.saved_clients)},
           "script": {"final": theirs.get(final_key), "best": theirs.get(best_key),
                      "fedavg": theirs.get("fedavg"), "ensemble": theirs.get("ensemble")},
           "flare": None}
    scratch = scratch_dir(a, spec, cfg)
    try:
        rec["flare"] = fused(cfg, a.strategy, weights, scratch)
    except SystemExit as e:  # clients that are not the cell's network, or not its number: refused, nothing written
        if not isinstance(e.code, str):
            raise
        print(e.code, file=sys.stderr)
        return 2
    rec.update(machine_facts(t_wall, t_cpu))
    emit(rec, a.record)
    shutil.rmtree(scratch, ignore_errors=True)  # the record holds what the strategy's progress was kept for
    return 0


if __name__ == "__main__":
    sys.exit(main())
