"""The frozen-encoder grid of docs/frozen-encoder.md: every method over all of CIFAR-10's cached features, at
α ∈ {0.05, 0.1, 0.5} × K ∈ {5, 10, 50} × seeds 1–3, plus the centralised bounds per seed.

    python tools/frozen_grid.py --out runs/frozen-encoder            # run what is missing (finished runs are kept)
    python tools/frozen_grid.py --out runs/frozen-encoder --record   # and commit each finished run's records
    python tools/frozen_grid.py --out runs/frozen-encoder --list     # what is finished, what remains

One run per (cell, client objective, seed); the server strategies that do not depend on the clients' training ride on
the FAFI run of the cell (FedCGS and FedPFT read the frozen features only), FedAvg and the ensemble of head-only
clients on the `fedavg` run. Points run in `--workers` one-thread processes (flare.experiments.execute.run_point);
a killed grid resumes where it stopped. `--record` copies the records (tools/readme.py's `record`: configs,
partitions, metrics, states, summaries — never checkpoints) into results/frozen-encoder/ and commits them after every
finished run, so the docs block can be rendered from what finished at any time; while `--out` holds a file named
`records.hold` nothing is recorded (the runs go on), so a block rendered from the committed records stays current;
a later `--record` invocation records everything that finished meanwhile (with nothing left to run, it only records).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import subprocess
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from flare.config import load_config  # noqa: E402
from flare.experiments.execute import run_point  # noqa: E402

CONFIG = ROOT / "configs" / "frozen-encoder.yaml"
ALPHAS = (0.05, 0.1, 0.5)
CLIENTS = (5, 10, 50)
THREADS = 1  # torch threads per run: two one-thread runs side by side use 2 cores better than one two-thread run
RUN_ORDER = (10, 5, 50)  # the middle K first: a grid cut short still spans every α at one K
SEEDS = (1, 2, 3)
# directory → (preset, overrides): the client objectives of a cell
METHODS = {
    "fafi": ("fafi", ["eval.rules=[primary,fedcgs,fedpft]"]),
    "fedavg": ("fedavg", ["model.options.dim=0", "eval.rules=[primary,output]"]),
    "flare": ("flare", ["eval.rules=[primary]"]),
}
CENTRAL = ("fedavg", ["num_clients=1", "partition.kind=iid", "model.options.dim=0", "eval.rules=[primary,fedcgs]"])


def points(out: Path) -> list[tuple[Path, str, list[str]]]:
    """(run directory, preset, overrides) of every run, in the order they run: the centralised bounds, then cell by
    cell (each cell's seeds together, so a finished cell is complete)."""
    pts = [(out / "central" / f"seed={s}", CENTRAL[0], CENTRAL[1] + [f"seed={s}"]) for s in SEEDS]
    for k in RUN_ORDER:
        for a in ALPHAS:
            for s in SEEDS:
                for name, (preset, ov) in METHODS.items():
                    pts.append((out / f"a{a}-K{k}" / name / f"seed={s}", preset,
                                ov + [f"partition.alpha={a}", f"num_clients={k}", f"seed={s}"]))
    return pts


def finished(d: Path) -> bool:
    try:
        return json.loads((d / "state.json").read_text()).get("status") == "finished"
    except (OSError, json.JSONDecodeError):
        return False


def readme_tool():
    """tools/readme.py as a module (registered before it runs: its dataclasses look their module up)."""
    if "readme_tool" not in sys.modules:
        spec = importlib.util.spec_from_file_location("readme_tool", ROOT / "tools" / "readme.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["readme_tool"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["readme_tool"]


def write_facts(out: Path) -> None:
    """runs/readme/frozen-encoder.json: the machine and the finished runs' summed wall time; and, beside the runs, the
    feature cache's own record of its extraction (the cache of this config's encoder, resolution and copies)."""
    tool = readme_tool()
    opts = load_config(CONFIG).dataset.options
    where = Path(opts.get("cache_dir") or os.environ.get("FLARE_CACHE") or Path.home() / ".cache" / "flare")
    caches = [json.loads(p.read_text()) for p in sorted(where.expanduser().glob("features-cifar10-*.json"))]
    from flare.registry import MODELS  # a null resolution is the encoder's own
    res = opts["resolution"] or MODELS.entry(opts["encoder"]).obj.native_resolution()
    caches = [c for c in caches if (c["encoder"], c["resolution"], (c["augmentation"] or {}).get("views", 0),
                                    c.get("resize", "bicubic"), c.get("view"))
              == (opts["encoder"], res, opts["views"], opts.get("resize", "bicubic"), None)]
    runs = [json.loads(p.read_text()).get("seconds", 0.0) for p in out.rglob("sweep_point.json")
            if finished(p.parent)]
    facts = {**tool.machine(), "threads": THREADS,  # each run's torch threads, not this process's
             "wall_seconds": float(sum(runs)),
             "wall_note": f"the {len(runs)} finished runs' own wall times summed, one or two running at a time on a CPU "
                          "shared with other jobs; the one-off feature cache not included"}
    tool.OUT.mkdir(parents=True, exist_ok=True)
    (tool.OUT / "frozen-encoder.json").write_text(json.dumps(facts, indent=1) + "\n")
    if caches:
        (out / "cache.json").write_text(json.dumps(caches[-1], indent=1) + "\n")


def commit(paths: list[str], message: str) -> None:
    for attempt in range(10):  # another process may hold the index for a moment
        subprocess.run(["git", "add", "-A", *paths], cwd=ROOT, capture_output=True)
        r = subprocess.run(["git", "commit", "-q", "-m", message, "--", *paths], cwd=ROOT, capture_output=True,
                           text=True)
        if r.returncode == 0 or "nothing to commit" in r.stdout + r.stderr:
            return
        time.sleep(3 + attempt)
    print(f"frozen_grid: could not commit ({r.stderr.strip()})", file=sys.stderr)


HOLD = "records.hold"  # a file of this name in --out pauses --record (the docs block was rendered from what is there)


def record(out: Path, label: str) -> None:
    if (out / HOLD).exists():
        return
    write_facts(out)
    tool = readme_tool()
    dest = tool.record(tool.RESULTS["frozen-encoder"])
    commit([str(dest.relative_to(ROOT))], f"results/frozen-encoder: {label}")


# ------------------------------------------------------------------------------------------------ the docs block

# (label, run directory, accuracy key): the table's methods, all scored on the same partition and seed
ROWS = [("FAFI-adapter", "fafi", "acc"), ("FLARE-adapter", "flare", "acc"), ("FedAvg (heads)", "fedavg", "acc_fedavg"),
        ("Ensemble (heads)", "fedavg", "acc_output"), ("FedCGS", "fafi", "acc_fedcgs"), ("FedPFT", "fafi", "acc_fedpft")]
BOUNDS = [("centralised linear probe", "acc_fedavg"), ("centralised LDA", "acc_fedcgs")]


def _runs(d: Path) -> dict:
    """{seed: RunData} of the finished runs under d/seed=*."""
    from flare.rundata import RunData  # lazy: only the block renders
    return {s: RunData.load(d / f"seed={s}") for s in SEEDS if finished(d / f"seed={s}")}


def _ms(vals: dict) -> str:
    import numpy as np
    from flare.report.tables import fmt_ms
    x = list(vals.values())
    if not x:
        return "—"
    cell = fmt_ms(float(np.mean(x)), float(np.std(x, ddof=1)) if len(x) > 1 else float("nan"))
    return cell + ("" if len(x) == len(SEEDS) else f" ({len(x)} seed{'s' if len(x) > 1 else ''})")


def render(base: Path) -> str:
    """The block of docs/frozen-encoder.md from the finished runs under base/runs/frozen-encoder."""
    import numpy as np
    from flare.report.tables import md_table
    from flare.stats import holm, paired
    out = base / "runs" / "frozen-encoder"
    central = _runs(out / "central")
    bounds = {label: {s: r.final(key) for s, r in central.items()} for label, key in BOUNDS}
    cells = [(a, k) for k in CLIENTS for a in ALPHAS]
    acc = {}
    for a, k in cells:
        runs = {m: _runs(out / f"a{a}-K{k}" / m) for m in METHODS}
        acc[(a, k)] = {label: {s: r.final(key) for s, r in runs[m].items()} for label, m, key in ROWS}
    head = ["α", "K", *[label for label, _, _ in ROWS]]
    t1 = md_table(head, [[f"{a}", f"{k}", *[_ms(acc[(a, k)][label]) for label, _, _ in ROWS]] for a, k in cells])
    t0 = md_table([label for label, _ in BOUNDS], [[_ms(bounds[label]) for label, _ in BOUNDS]])
    tests = [(c, label, paired(acc[c][label], acc[c]["FAFI-adapter"])) for c in cells for label, _, _ in ROWS[1:]]
    adj = dict(zip([(c, label) for c, label, _ in tests], holm([t.p for _, _, t in tests])))
    by = {(c, label): t for c, label, t in tests}

    def diff(c, label):
        t = by[(c, label)]
        if t.n == 0:
            return "—"
        if t.n == 1:
            return f"{100 * t.mean:+.2f} (1 seed)"
        star = "**" if adj[(c, label)] < 0.05 else ""
        return f"{star}{100 * t.mean:+.2f}{star} [{100 * t.low:+.1f}, {100 * t.high:+.1f}]"
    t2 = md_table(["α", "K", *[label for label, _, _ in ROWS[1:]]],
                  [[f"{a}", f"{k}", *[diff((a, k), label) for label, _, _ in ROWS[1:]]] for a, k in cells])
    cgs = sorted({round(v, 6) for c in cells for v in acc[c]["FedCGS"].values()})
    lda = sorted({round(v, 6) for v in bounds["centralised LDA"].values()})
    cache = json.loads((out / "cache.json").read_text()) if (out / "cache.json").exists() else None
    secs = {m: [] for m in METHODS}
    server = {"fedcgs": [], "fedpft": []}
    for a, k in cells:
        for m in METHODS:
            for s, r in _runs(out / f"a{a}-K{k}" / m).items():
                point = out / f"a{a}-K{k}" / m / f"seed={s}" / "sweep_point.json"  # run_point's wall, load included
                secs[m].append(json.loads(point.read_text())["seconds"] if point.exists() else r.rounds[-1]["seconds"])
                for n in server:
                    if f"{n}.seconds" in r.rounds[-1]:
                        server[n].append(r.rounds[-1][f"{n}.seconds"])
    med = lambda x: f"{np.median(x):.1f} s (max {max(x):.1f})" if x else "—"  # noqa: E731
    cost = md_table(["what", "measured"], [
        *([["feature cache (once): images encoded", f"{cache['extraction']['images']:,}"],
           ["feature cache (once): wall time", f"{cache['extraction']['seconds'] / 60:.1f} min at "
                                               f"{cache['extraction']['images_per_second']:.0f} images/s, "
                                               f"{cache['extraction']['threads']} threads, "
                                               f"{cache['resolution']} px, on the CPU shared with other jobs (the "
                                               "benchmark below: the same path with them paused)"]] if cache else []),
        *[[f"one `{m}` run, wall (load the cache, train, every strategy it scores), median", med(secs[m])]
          for m in METHODS],
        ["FedCGS server (sum + solve), median", med(server["fedcgs"])],
        ["FedPFT server (sample + head), median", med(server["fedpft"])]])
    complete = {c: [s for s in SEEDS if all(finished(out / f"a{c[0]}-K{c[1]}" / m / f"seed={s}") for m in METHODS)]
                for c in cells}
    done = sum(len(v) for v in complete.values())
    def lacking(c):
        gone = [str(s) for s in SEEDS if s not in complete[c]]
        return f" (seed{'s' if len(gone) > 1 else ''} {', '.join(gone)})" if complete[c] else ""
    missing = [f"α={a} K={k}{lacking((a, k))}" for a, k in cells if len(complete[(a, k)]) < len(SEEDS)]
    return (f"Test accuracy (%) on all 10,000 CIFAR-10 test images, clients over all 50,000 training images; mean ± "
            f"std over seeds {SEEDS[0]}–{SEEDS[-1]} ({done} of {len(cells) * len(SEEDS)} (cell, seed) points "
            f"finished{'; not yet finished: ' + ', '.join(missing) if missing else ''}).\n\nUpper bounds (one client holding everything, same features):\n\n{t0}\n\n{t1}\n\n"
            "Each method against FAFI-adapter, paired by seed (same partition): mean difference in points [95 % CI]; "
            "**bold**: Holm-adjusted p < 0.05 over this table.\n\n" + t2 + "\n\n"
            f"FedCGS's distinct accuracies over every finished (α, K, seed): {', '.join(f'{100 * v:.2f}' for v in cgs)}"
            f"; the centralised LDA's: {', '.join(f'{100 * v:.2f}' for v in lda)}.\n\nCost:\n\n{cost}\n")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/frozen-encoder")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--record", action="store_true", help="commit each finished run's records (results/)")
    ap.add_argument("--list", action="store_true", help="print finished and remaining runs, run nothing")
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # the config's dataset root is relative to the checkout
    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    todo = [p for p in points(out) if not finished(p[0])]
    if args.list:
        for d, preset, ov in points(out):
            print(("finished " if finished(d) else "remaining ") + str(d.relative_to(ROOT)))
        print(f"{len(points(out)) - len(todo)} finished, {len(todo)} remaining")
        return 0
    if todo:  # the features once, here, before two workers could both find no cache and both compute it
        from flare.data.features import FeatureOptions, load_features
        load_features(FeatureOptions(**load_config(CONFIG).dataset.options), quiet=False)
    ex = ProcessPoolExecutor(max_workers=args.workers, mp_context=multiprocessing.get_context("spawn"))
    futures = {}
    queue = list(todo)
    failed = 0
    try:
        while queue or futures:
            while queue and len(futures) < args.workers:
                d, preset, ov = queue.pop(0)
                mapping = load_config(CONFIG, preset, ov).model_dump(mode="json")
                futures[ex.submit(run_point, mapping, str(d), THREADS)] = d
            done, _ = wait(futures, return_when=FIRST_COMPLETED)
            for f in done:
                d = futures.pop(f)
                info = f.result()
                rel = d.relative_to(ROOT)
                print(f"frozen_grid: {rel} {info['status']} in {info['seconds']:.0f} s", flush=True)
                if info["status"] != "finished":
                    failed += 1
                    print(info.get("error", ""), file=sys.stderr, flush=True)
                elif args.record:
                    record(out, str(rel.relative_to(args.out)))
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
    if args.record:  # whatever finished while recording was held (or by another invocation) is recorded now
        record(out, "the finished runs")
    else:
        write_facts(out)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
