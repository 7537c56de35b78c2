"""What one run of each kind in the 224 px frozen-encoder grid costs, before and after a revision's speed-ups, and
that the speed-ups left its numbers alone (docs/frozen-encoder.md, "What the 224 grid costs").

    python benchmarks/frozen_grid_speed.py --before 81a9598 --out runs/frozen-grid-speed \
        --record runs/readme/frozen-grid-speed-record.json

Each point is a run the grid recorded (results/frozen-encoder-224/frozen-encoder-224/grid/<point>): its own
config.yaml is run again, once with the source of `--before` (extracted with `git archive` into `--out`) and once with
this checkout's, each in a fresh process (so each pays the imports a grid worker pays once), one torch thread, as
the grid runs them (`flare.experiments.execute.run_point`), the two sides one after the other so that both meet
the same load, and each side as its grid ran (the `--before` grid drew each run's plots; this one's sets
FLARE_PLOTS=0). Each run's metrics.jsonl is compared with the recorded one by tools/same_numbers.py's rule (every
value bit for bit, timing keys aside): `identical` in the record. The clock: wall seconds and the process's CPU
seconds of run_point; the load average (1 min) before each run. A run's uploads.pt and checkpoint.pt are deleted
when it ends (GBs at K = 10). The features are read from their cache; a point whose cache is missing is refused,
never extracted (tools/frozen_bounds.py's `load_cached`).

The projection: every run the whole grid holds (tools/frozen_grid.py's points: each method × α × K × seed, Fed3R-RF
where it fits), each at the measured CPU seconds of its method at the nearest K measured, summed, over the grid's
two workers — the grid's wall time on two cores it has to itself. `markdown(record)` renders the table from the
record alone (tools/readme.py's `frozen-grid-speed` block).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GRID = Path("results/frozen-encoder-224/frozen-encoder-224/grid")
POINTS = ["a0.05-K5/fedavg/seed=1", "a0.05-K10/fedavg/seed=1", "a0.05-K50/fedavg/seed=1", "a0.05-K10/fafi/seed=1",
          "a0.05-K10/flare/seed=1", "a0.05-K10/fed3r-rf/seed=1"]
CHILD = """
import json, sys, time, yaml
from flare.experiments.execute import run_point
mapping = yaml.safe_load(open(sys.argv[1]).read())
wall, cpu = time.perf_counter(), time.process_time()
info = run_point(mapping, sys.argv[2], 1)
print(json.dumps({"status": info["status"], "wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu,
                  "error": info.get("error")}))
"""


def module(name: str, path: Path):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def source_tree(rev: str, out: Path) -> tuple[str, Path]:
    """(the full sha, a folder holding `rev`'s src/), extracted once."""
    sha = subprocess.run(["git", "rev-parse", rev], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    tree = out / f".src-{sha[:12]}"  # hidden: not a record (tools/readme.py records --out)
    if not (tree / "src" / "flare").is_dir():
        tree.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "archive", sha, "src"], cwd=ROOT, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return sha, tree / "src"


def run_once(point: str, src: Path, out: Path, plots: bool) -> dict:
    recorded = ROOT / GRID / point
    env = dict(os.environ, PYTHONPATH=str(src), FLARE_QUIET="1", FLARE_PLOTS="1" if plots else "0",
               OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    load = os.getloadavg()[0]
    r = subprocess.run([sys.executable, "-c", CHILD, str(recorded / "config.yaml"), str(out)], cwd=ROOT, env=env,
                       capture_output=True, text=True)
    lines = [line for line in r.stdout.splitlines() if line.startswith("{")]
    if r.returncode or not lines:
        raise SystemExit(f"frozen_grid_speed: {point} failed ({src}):\n{r.stderr[-3000:]}")
    got = json.loads(lines[-1])
    same = module("same_numbers", ROOT / "tools" / "same_numbers.py")
    cmp = same.compare_records(same.read_records(recorded / "metrics.jsonl"), same.read_records(out / "metrics.jsonl"))
    for big in ("uploads.pt", "checkpoint.pt"):
        (out / big).unlink(missing_ok=True)
    return {**got, "load": load, "identical": not cmp.differences,
            "first_difference": None if not cmp.differences else str(cmp.differences[0])}


def kind(point: str) -> tuple[str, int]:
    cell, method, _ = point.split("/")
    return method, int(cell.split("-K")[1])


def projection(rec: dict, side: str) -> float | None:
    """Minutes of the whole grid on its two workers at `side`'s measured CPU seconds (module docstring)."""
    grid = module("frozen_grid", ROOT / "tools" / "frozen_grid.py")
    cpu: dict = {}
    for p in rec["points"]:
        cpu.setdefault(kind(p["point"]), []).append(p[side]["cpu"])
    methods = dict(grid.METHODS_224)
    if (rf := grid.fed3r_rf_method()) is not None:
        methods["fed3r-rf"] = rf
    total = 0.0
    for d, _, _ in grid.points(Path("grid"), "224", None, methods):
        method, k = d.parts[-2], int(d.parts[-3].split("-K")[1])
        near = [kk for m, kk in cpu if m == method]
        if not near:
            return None
        total += statistics.median(cpu[(method, min(near, key=lambda kk: abs(kk - k)))])
    return total / 2 / 60


def finish(rec: dict, record: str | None) -> None:
    """The projection, kept in the record (the grid's definition may change later; the block must not)."""
    rec["projection"] = {s: projection(rec, s) for s in ("before", "after")}
    if record:
        Path(record).write_text(json.dumps(rec, indent=1) + "\n")


def markdown(rec: dict) -> str:
    rows = []
    for p in rec["points"]:
        b, a = p["before"], p["after"]
        rows.append(f"| `{p['point']}` | {b['wall']:.1f} / {b['cpu']:.1f} (load {b['load']:.1f}) | {a['wall']:.1f} / "
                    f"{a['cpu']:.1f} (load {a['load']:.1f}) | {b['cpu'] / a['cpu']:.2f}× | "
                    f"{'yes' if b['identical'] and a['identical'] else 'NO'} |")
    proj = rec.get("projection") or {}
    m = rec["machine"]
    return ("| recorded run (α, K, method, seed) | before: wall / CPU s | after: wall / CPU s | CPU speed-up | "
            "metrics.jsonl identical to the record, both sides |\n| --- | --- | --- | --- | --- |\n" + "\n".join(rows)
            + f"\n\nBefore: `{rec['before'][:12]}`; after: `{rec['after'][:12]}`"
            + (" (and uncommitted changes)" if rec.get("dirty") else "")
            + f". Each run in a fresh process, one torch thread, on a {m['cpus']}-core CPU ({m['cpu']}) shared with "
            "other jobs (the load average beside each run). "
            + ("The whole grid (every method × α × K × seed, at its method's measured CPU seconds at the nearest K "
               f"measured, two runs at a time on two free cores): {proj['before']:.0f} min before, "
               f"{proj['after']:.0f} min after." if proj and None not in proj.values() else "") + "\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", required=True, help="the revision to compare with (its src/)")
    ap.add_argument("--points", default=",".join(POINTS), help="recorded grid points, comma-separated")
    ap.add_argument("--out", default="runs/frozen-grid-speed")
    ap.add_argument("--record", default=None, help="write the record (JSON) here")
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # the configs' dataset root is relative to the checkout
    sys.path.insert(0, str(ROOT / "src"))
    from flare.data.features import FeatureOptions
    readme = module("readme_tool", ROOT / "tools" / "readme.py")
    bounds = module("frozen_bounds", ROOT / "tools" / "frozen_bounds.py")
    out = ROOT / args.out
    points = [p for p in args.points.split(",") if p]
    import yaml
    caches = {json.dumps(yaml.safe_load((GRID / p / "config.yaml").read_text())["dataset"]["options"], sort_keys=True)
              for p in points}
    for opts in caches:  # refused, never extracted, before anything runs
        bounds.load_cached(FeatureOptions(**json.loads(opts)))
    before, before_src = source_tree(args.before, out)
    after = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()
    dirty = bool(subprocess.run(["git", "status", "--porcelain", "src"], cwd=ROOT, capture_output=True, text=True).stdout)
    rec = {"machine": readme.machine(), "before": before, "after": after, "dirty": dirty, "points": []}
    for p in points:
        name = p.replace("/", "_")
        row = {"point": p, "before": run_once(p, before_src, out / "before" / name, plots=True),
               "after": run_once(p, ROOT / "src", out / "after" / name, plots=False)}
        rec["points"].append(row)
        print(f"{p}: before {row['before']['wall']:.1f} s wall / {row['before']['cpu']:.1f} s CPU, after "
              f"{row['after']['wall']:.1f} / {row['after']['cpu']:.1f}; identical {row['before']['identical']} "
              f"{row['after']['identical']}", flush=True)
        if args.record:
            Path(args.record).parent.mkdir(parents=True, exist_ok=True)
            Path(args.record).write_text(json.dumps(rec, indent=1) + "\n")
    finish(rec, args.record)
    print(markdown(rec))
    return 0 if all(r[s]["identical"] for r in rec["points"] for s in ("before", "after")) else 1


if __name__ == "__main__":
    sys.exit(main())
