"""The CPU path, exact against fast, side by side with the reference code (docs/performance.md).

The setting the reference's `OursV4` was timed in (453.5 s wall on a 2-core AVX512 VM, 2 threads): FAFI,
CIFAR-10 export, a stratified 5,000 / 1,000 subset, ResNet-18, 5 clients, α = 0.05, batch 512, one round. Each
profile runs as its own `flare run` process (the CPU kernel level is fixed per process), so the wall time is
what a user waits for: start-up, data (from the decode cache), training, evaluation, report.

    python benchmarks/cpu_profile.py --data-root ../shared/data/cifar10-jpg.tar.gz
    python benchmarks/cpu_profile.py --data-root ... --profile "bf16 only=amp=bf16 cpu_isa=native"  # add one

Prints a markdown table: wall, training and evaluation seconds, the kernels torch dispatched to, the precision,
the speed-up over `exact`, and over the reference's recorded wall time (not re-run here: it is the issue's
measurement on this VM type; our `exact` profile is the like-for-like check of that number).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REFERENCE_SECONDS = 453.5  # the reference's OursV4, same setting, same VM type
SETTING = ["--preset", "fafi", "dataset.name=cifar10", "dataset.format=imagefolder", "model.name=resnet18",
           "num_clients=5", "partition.alpha=0.05", "batch_size=512", "rounds=1"]
PROFILES = {
    "exact": [],                    # the default: AVX2 kernels, fp32, NCHW, every rule evaluated
    "native": ["cpu_isa=native"],   # what pinning costs: the same run on the CPU's best kernels
    "fast": ["speed=fast"],         # native kernels, bf16 where the CPU has it, NHWC, the primary rule only
}


def run_profile(name: str, extra: list[str], args, out: Path) -> dict:
    d = out / name
    cmd = [sys.executable, "-m", "flare.cli", "run", *SETTING, f"dataset.root={args.data_root}",
           f"dataset.train_subset={args.train_subset}", f"dataset.test_subset={args.test_subset}", *extra,
           "--out", str(d), "--quiet"]
    env = {k: v for k, v in os.environ.items() if k not in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA",
                                                            "FLARE_CPU_ISA_PINNED")}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env={**env, "FLARE_QUIET": "1"}, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{name}: flare run failed ({r.returncode}):\n{r.stderr}")
    recs = [json.loads(ln) for ln in (d / "metrics.jsonl").read_text().splitlines()]
    rnd = [x for x in recs if x["kind"] == "round"][-1]
    st = json.loads((d / "state.json").read_text())
    return {"profile": name, "settings": " ".join(extra) or "(defaults)", "wall": wall,
            "train": rnd.get("seconds_train"), "eval": rnd.get("seconds_eval"), "acc": rnd.get("acc"),
            "backend": st.get("backend", {}), "warnings": st.get("warnings", [])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-root", required=True, help="the CIFAR-10 export (.tar.gz or folder)")
    ap.add_argument("--train-subset", type=int, default=5000)
    ap.add_argument("--test-subset", type=int, default=1000)
    ap.add_argument("--out", default="runs/bench-cpu-profile", help="run directories (replaced)")
    ap.add_argument("--profile", action="append", default=[], metavar="NAME=KEY=VALUE ...",
                    help="another profile: a name, '=', then overrides separated by spaces")
    args = ap.parse_args(argv)
    profiles = dict(PROFILES)
    for p in args.profile:
        name, _, rest = p.partition("=")
        profiles[name] = rest.split()
    out = Path(args.out)
    if out.exists():
        shutil.rmtree(out)
    # Decode the archive once before timing (the decode cache), so no profile pays for it.
    warm = subprocess.run([sys.executable, "-c", "import sys; from flare.config import load_config; "
                           "from flare.setup import prepare_data; prepare_data(load_config(None, None, sys.argv[1:]))",
                           "dataset.name=cifar10", "dataset.format=imagefolder", f"dataset.root={args.data_root}"],
                          capture_output=True, text=True)
    if warm.returncode != 0:
        raise SystemExit(f"cannot read the dataset: {warm.stderr}")
    rows = [run_profile(n, x, args, out) for n, x in profiles.items()]
    base = rows[0]["wall"]
    print(f"FAFI, CIFAR-10 export {args.train_subset}/{args.test_subset}, ResNet-18, 5 clients, α = 0.05, batch 512, "
          f"one round; torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}, each profile its own process.\n")
    print("| profile | settings | CPU kernels | amp | channels_last | rules evaluated | wall (s) | train (s) | "
          "eval (s) | speed-up over exact | over the reference (453.5 s) | final acc (%) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        b = r["backend"]
        print(f"| {r['profile']} | `{r['settings']}` | {b.get('cpu_kernels')} | {b.get('amp')} | "
              f"{b.get('channels_last')} | {', '.join(b.get('eval_rules') or [])} | {r['wall']:.1f} | "
              f"{r['train']:.1f} | {r['eval']:.1f} | {base / r['wall']:.2f}× | {REFERENCE_SECONDS / r['wall']:.2f}× | "
              f"{100 * r['acc']:.2f} |")
    for r in rows:
        for w in r["warnings"]:
            print(f"\n{r['profile']}: warning: {w}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
