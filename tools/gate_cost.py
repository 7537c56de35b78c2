"""What the round loop's upload gate costs: every transport's uploads pass it each round (flare/loop.py,
`gate_uploads`), the in-process runner's included, so its time is added to every round of every run.

    python tools/gate_cost.py [--config configs/main.yaml] [--presets <the Makefile's PRESETS>] [--repeats 50]
                              [OVERRIDE ...]

For each preset it builds the run's server (`ServerSetup.build`, as `flare run` does), makes one upload per client
from its architecture's seeded init with the statistics the last round's strategies ask for (zeros of the declared
shapes), checks that every upload passes, then times `why_rejected` over all of them `--repeats` times and prints
the median, smallest and largest time for one round's uploads. No run directory is written.
"""
from __future__ import annotations

import argparse
import copy
import re
import statistics
import time
from pathlib import Path

import torch

from flare.config import load_config
from flare.loop import why_rejected
from flare.server.extras import extras_shapes
from flare.server.upload import upload_of
from flare.setup import ServerSetup

ROOT = Path(__file__).resolve().parents[1]


def makefile_presets() -> str:
    """The main job's presets, as the Makefile's `PRESETS ?=` line names them."""
    m = re.search(r"^PRESETS \?= *(\S+)", (ROOT / "Makefile").read_text(), re.M)
    return m.group(1) if m else "fafi"


def gate_seconds(config: str, preset: str, overrides: list[str], repeats: int) -> tuple[int, int, list[float]]:
    """(clients, values per upload, seconds to gate one round's uploads, per repeat)."""
    cfg = load_config(config, preset, overrides)
    server = ServerSetup.build(cfg)
    scored = server.scored(cfg.rounds - 1)
    uploads = []
    for cid in range(cfg.num_clients):
        model = copy.deepcopy(server.client_init(cid))
        extras = {k: torch.zeros(shape, dtype=dtype) for k, (shape, dtype) in extras_shapes(scored, model).items()}
        uploads.append(upload_of(cid, model, 1, extras))
    if bad := {u.client: why for u in uploads if (why := why_rejected(server, u, scored))}:
        raise SystemExit(f"{preset}: an upload made from the seeded init does not pass the gate: {bad}")
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for u in uploads:
            why_rejected(server, u, scored)
        times.append(time.perf_counter() - t0)
    return cfg.num_clients, sum(t.numel() for t in uploads[0].state.values()), times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "main.yaml"))
    ap.add_argument("--presets", default=makefile_presets())
    ap.add_argument("--repeats", type=int, default=50)
    ap.add_argument("overrides", nargs="*", default=["device=cpu"])
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    for preset in args.presets.split(","):
        k, n, t = gate_seconds(args.config, preset, args.overrides, args.repeats)
        print(f"{preset}: {k} clients, {n:,} values an upload; one round's gate: median {1e3 * statistics.median(t):.2f}"
              f" ms, min {1e3 * min(t):.2f} ms, max {1e3 * max(t):.2f} ms")


if __name__ == "__main__":
    main()
