"""The frozen-encoder grids of docs/frozen-encoder.md: every method over all of CIFAR-10's cached features, at
α ∈ {0.05, 0.1, 0.5} × K ∈ {5, 10, 50} × seeds 1–3.

    python tools/frozen_grid.py --out runs/frozen-encoder            # run what is missing (finished runs are kept)
    python tools/frozen_grid.py --out runs/frozen-encoder --record   # and commit each finished run's records
    python tools/frozen_grid.py --out runs/frozen-encoder --list     # what is finished, what remains
    python tools/frozen_grid.py --grid 224 --out runs/frozen-encoder-224/grid        # the encoder's own resolution
    python tools/frozen_grid.py --grid 224 --encoder efficientnet_lite2 --out runs/frozen-encoder-224/lite2
                                                                     # another encoder: the closed-form heads only
    python tools/frozen_grid.py --grid 224 --mirrored --seed-major --out runs/frozen-encoder-224/mirrored
                                    # the closed-form heads with each training image's mirror image in their statistics

`--grid 64` (the default) is the 64 px grid (configs/frozen-encoder.yaml) with its centralised bounds per seed;
`--grid 224` the grid at the encoder's own resolution (configs/frozen-encoder-224.yaml), whose bounds are
tools/frozen_bounds.py's (scikit-learn, not FLARE's strategies), and which scores every closed-form head of the one
sufficient-statistics upload. `--encoder` swaps the 224 grid's encoder (at its own resolution) and keeps only the
head-only FedAvg run that carries the closed-form heads: the rows the other encoders add. `--mirrored` keeps the
same runs (and Fed3R-RF's) over the `flip` cache with every closed-form head's `mirrored` on, where the statistics fit
the budget; its records sit beside the grid's and leave the block's machine facts (the grid's) alone.

One run per (cell, client objective, seed); the server strategies that do not depend on the clients' training ride on
one run of the cell (FedCGS and FedPFT read the frozen features only), FedAvg and the ensemble of head-only
clients on the `fedavg` run. Points run in `--workers` one-thread processes (flare.experiments.execute.run_point);
a killed grid resumes where it stopped. `--record` copies the records (tools/readme.py's `record`: configs,
partitions, metrics, states, summaries — never checkpoints) into results/<block>/ and commits them after every
finished run, so the docs block can be rendered from what finished at any time; while `--out` holds a file named
`records.hold` nothing is recorded (the runs go on), so a block rendered from the committed records stays current;
a later `--record` invocation records everything that finished meanwhile (with nothing left to run, it only records).
Every run directory of the block that lacks runs recorded under results/ gets their records copied back first (never
over a run the checkout has), so a fresh checkout skips what is recorded and its `--record` never deletes one.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import multiprocessing
import os
import shutil
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

# The grid at the encoder's own resolution. The closed-form heads all read one upload (per-class counts, sums and
# second moments) and ride on the head-only FedAvg run, whose clients cost least; FedPFT on the FAFI run.
CONFIG_224 = ROOT / "configs" / "frozen-encoder-224.yaml"
STATISTICS = ("fedcgs", "gh_nb", "gh_lda", "gh_qda", "gh_fishermix", "gh_protohyper", "fed3r", "afl", "fedncm")
# The server holds every client's upload until it sums them: K × C × d² float64 second moments (d = 1,904: 290 MB a
# client). Past this many bytes in all a cell's run leaves the statistics heads out rather than exhaust the memory of
# a 2-core machine shared with other jobs; every closed-form head is the same for every K (the clients' statistics sum
# to the pooled ones: tests/test_closed_form.py), so the cells that have them stand for those that do not.
STATISTICS_BUDGET = 4 * 2**30
METHODS_224 = {  # the run with the statistics heads first: two of them side by side would double their memory
    "fedavg": ("fedavg", ["model.options.dim=0", "eval.rules=[primary,output]"]),
    "fafi": ("fafi", ["eval.rules=[primary,fedpft]"]),
    "flare": ("flare", ["eval.rules=[primary]"]),
}
HEADS_ONLY = {"fedavg": METHODS_224["fedavg"]}  # --encoder: the run that carries the closed-form heads
# --mirrored: every closed-form head (Fed3R-RF included) with each training image's mirror image counted in its
# statistics beside the image (`mirrored`, over the `flip` cache's copy 1): the head-only runs only, in a folder of
# their own, where the statistics fit the budget (a head-only run without them would score nothing new).
MIRRORED = ["dataset.options.flip=true", *(f"server.strategies.{h}.mirrored=true" for h in STATISTICS)]
# Fed3R with random features: its own upload (D × D second moments, not the shared statistics), so its own head-only
# run, with the σ and λ that tools/fed3r_rf.py chose on the held-out training slice (`fed3r_rf_method`).
CHOICES_224 = ROOT / "results" / "frozen-encoder-224" / "choices"


def fed3r_rf_method(config: Path = CONFIG_224, extra: list[str] | None = None, choices: Path = CHOICES_224):
    """("fedavg", overrides) of the Fed3R-RF run at this config's features, or None when tools/fed3r_rf.py has
    not chosen its σ and λ for them (then the grid runs without it and the block says so)."""
    opts = load_config(config, None, extra or []).dataset.options
    res = opts["resolution"] or NATIVE_RESOLUTION[opts["encoder"]]
    hits = sorted(choices.glob(f"fed3r-rf-{opts['encoder']}-{res}px-{opts['resize']}-stages{opts['stages']}-D*-"
                               f"seed{SEEDS[0]}.json"))
    if not hits:
        return None
    rec = json.loads(hits[-1].read_text())
    return ("fedavg", ["model.options.dim=0", "eval.rules=[primary,fed3r]",
                       f"server.strategies.fed3r.random_features={rec['random_features']}",
                       f"server.strategies.fed3r.kernel_width={rec['kernel_width']!r}",
                       f"server.strategies.fed3r.ridge={rec['ridge']!r}"])


def rf_fits(k: int, features: int) -> bool:
    """Whether K clients' D × D float64 Fed3R-RF second moments fit the grid's memory budget at the server."""
    return k * features ** 2 * 8 <= STATISTICS_BUDGET


def statistics_fit(k: int, dim: int, classes: int = 10) -> bool:
    return k * classes * dim * dim * 8 <= STATISTICS_BUDGET


# Each stage's pooled width, the head's first (docs/frozen-encoder.md, Feature options; tests/test_frozen_encoder.py
# checks them against the encoders): only to size the uploads before a run, without loading an encoder.
STAGE_WIDTHS = {"efficientnet_lite0": (1280, 320, 192, 112, 80, 40, 24, 16),
                "efficientnet_lite1": (1280, 320, 192, 112, 80, 40, 24, 16),
                "efficientnet_lite2": (1280, 352, 208, 120, 88, 48, 24, 16)}


NATIVE_RESOLUTION = {"efficientnet_lite0": 224, "efficientnet_lite1": 240, "efficientnet_lite2": 260}


def grid_dim(config: Path, overrides: list[str]) -> int:
    """The feature dimension of the grid's config: the widths of its `stages`."""
    opts = load_config(config, None, overrides).dataset.options
    return int(sum(STAGE_WIDTHS[opts["encoder"]][:opts.get("stages", 1)]))


def points(out: Path, grid: str = "64", extra: list[str] | None = None, methods: dict | None = None,
           seed_major: bool = False, statistics_only: bool = False) -> list[tuple[Path, str, list[str]]]:
    """(run directory, preset, overrides) of every run, in the order they run: the centralised bounds (64 px), then
    cell by cell (each cell's seeds together, so a finished cell is complete; `seed_major`: every cell's first seed,
    then every cell's second, ..., so a grid cut short still spans every cell). `statistics_only`: no head-only
    FedAvg run where the statistics heads do not fit the budget."""
    extra = extra or []
    if grid == "64":
        pts = [(out / "central" / f"seed={s}", CENTRAL[0], CENTRAL[1] + [f"seed={s}"]) for s in SEEDS]
        methods = METHODS
    else:
        pts, methods = [], methods or METHODS_224
        dim = grid_dim(CONFIG_224, extra)
    order = [(s, k, a) for s in SEEDS for k in RUN_ORDER for a in ALPHAS] if seed_major else \
        [(s, k, a) for k in RUN_ORDER for a in ALPHAS for s in SEEDS]
    for s, k, a in order:
        for name, (preset, ov) in methods.items():
            if name == "fed3r-rf" and not rf_fits(k, int(next(o for o in ov if "random_features=" in o)
                                                        .split("=")[1])):
                continue
            if grid != "64" and name == "fedavg" and statistics_fit(k, dim):
                ov = [o.replace("]", "," + ",".join(STATISTICS) + "]") if o.startswith("eval.rules=") else o
                      for o in ov]
            elif grid != "64" and name == "fedavg" and statistics_only:
                continue
            pts.append((out / f"a{a}-K{k}" / name / f"seed={s}", preset,
                        ov + extra + [f"partition.alpha={a}", f"num_clients={k}", f"seed={s}"]))
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


def write_facts(out: Path, config: Path = CONFIG, block: str = "frozen-encoder", extra: list[str] | None = None) -> None:
    """runs/readme/<block>.json: the machine and the finished runs' summed wall time; and, beside the runs, the
    feature cache's own record of its extraction (the cache of this config's encoder, resolution and copies)."""
    tool = readme_tool()
    opts = load_config(config, None, extra or []).dataset.options
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
    (tool.OUT / f"{block}.json").write_text(json.dumps(facts, indent=1) + "\n")
    if caches:
        (out / "cache.json").write_text(json.dumps(caches[-1], indent=1) + "\n")


def commit(paths: list[str], message: str) -> None:
    for attempt in range(10):  # another process may hold the index for a moment
        subprocess.run(["git", "add", "-A", *paths], cwd=ROOT, capture_output=True)
        if subprocess.run(["git", "diff", "--cached", "--quiet", "--", *paths], cwd=ROOT).returncode == 0:
            return  # nothing new under these paths (a rerun of finished runs): not a failure
        r = subprocess.run(["git", "commit", "-q", "-m", message, "--", *paths], cwd=ROOT, capture_output=True,
                           text=True)
        if r.returncode == 0 or "nothing to commit" in r.stdout + r.stderr:
            return
        time.sleep(3 + attempt)
    print(f"frozen_grid: could not commit ({r.stderr.strip()})", file=sys.stderr)


def restore_recorded(block: str) -> int:
    """Copy back into the checkout every run whose records are committed under results/<block>/ but which the
    checkout's run directories lack (a fresh checkout, another machine), for every directory the block records (each
    of its commands' `--out`, not only this invocation's): the grid then skips what is recorded instead of running
    it again, and a `--record` — which replaces the block's copy of each of those directories with the checkout's —
    never deletes a recorded run. Returns how many runs were restored. Only the records come back (no checkpoint, no
    uploads.pt), never over a run the checkout has, and only finished ones."""
    tool = readme_tool()
    restored = 0
    for rel in tool.record_paths(tool.RESULTS[block]):
        committed, local = tool.RESULTS_DIR / block / rel, tool.RUNS / rel
        for state in sorted(committed.rglob("state.json")) if committed.is_dir() else []:
            run = state.parent
            target = local / run.relative_to(committed)
            if finished(run) and not (target / "state.json").exists():
                shutil.copytree(run, target, dirs_exist_ok=True)
                restored += 1
    return restored


HOLD = "records.hold"  # a file of this name in --out pauses --record (the docs block was rendered from what is there)


def record(out: Path, label: str, config: Path = CONFIG, block: str = "frozen-encoder",
           extra: list[str] | None = None, facts: bool = True) -> None:
    """Commit the block's records; `facts`: first rewrite the block's machine facts from the runs under `out` (not
    for runs beside the grid's, whose facts they would replace). `main` has restored every recorded run first
    (`restore_recorded`), so the copy this replaces is a superset of what was committed."""
    if (out / HOLD).exists():
        return
    if facts:
        write_facts(out, config, block, extra)
    tool = readme_tool()
    dest = tool.record(tool.RESULTS[block])
    commit([str(dest.relative_to(ROOT))], f"results/{block}: {label}")


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


def paired_table(acc: dict, cells: list, labels: list[str], against: str = "FAFI-adapter") -> str:
    """Each method against `against`, paired by seed (the same partition) in every (α, K) cell: the mean difference
    in points and its 95 % CI, bold where the Holm-adjusted p over the whole table is below 0.05."""
    from flare.report.tables import md_table
    from flare.stats import holm, paired

    tests = {(c, label): paired(acc[c][label], acc[c][against]) for c in cells for label in labels}
    adj = dict(zip(tests, holm([t.p for t in tests.values()])))

    def diff(c, label):
        t = tests[(c, label)]
        if t.n == 0:
            return "—"
        if t.n == 1:
            return f"{100 * t.mean:+.2f} (1 seed)"
        star = "**" if adj[(c, label)] < 0.05 else ""
        return f"{star}{100 * t.mean:+.2f}{star} [{100 * t.low:+.1f}, {100 * t.high:+.1f}]"
    return md_table(["α", "K", *labels], [[f"{a}", f"{k}", *[diff((a, k), label) for label in labels]]
                                          for a, k in cells])


def render(base: Path) -> str:
    """The block of docs/frozen-encoder.md from the finished runs under base/frozen-encoder (base: the checkout's
    runs/ or the block's records, results/frozen-encoder/)."""
    import numpy as np
    from flare.report.tables import md_table
    out = base / "frozen-encoder"
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
    t2 = paired_table(acc, cells, [label for label, _, _ in ROWS[1:]])
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


# ------------------------------------------------------------------------------------------ the 224 px block

# (label, run directory, accuracy key)
TRAINED_224 = [("FAFI-adapter", "fafi", "acc"), ("FLARE-adapter", "flare", "acc"), ("FedAvg (heads)", "fedavg", "acc_fedavg"),
               ("Ensemble (heads)", "fedavg", "acc_output"), ("FedPFT", "fafi", "acc_fedpft")]
CLOSED_224 = [("FedCGS", "fedavg", "acc_fedcgs"), ("GH-NB", "fedavg", "acc_gh_nb"), ("GH-LDA", "fedavg", "acc_gh_lda"),
              ("GH-QDA", "fedavg", "acc_gh_qda"), ("GH-FisherMix", "fedavg", "acc_gh_fishermix"),
              ("GH-Proto-Hyper", "fedavg", "acc_gh_protohyper"), ("Fed3R", "fedavg", "acc_fed3r"),
              ("AFL", "fedavg", "acc_afl"), ("FedNCM", "fedavg", "acc_fedncm"), ("Fed3R-RF", "fed3r-rf", "acc_fed3r")]
BOUND_HEADS = [("lda", "LDA (shrinkage)"), ("qda", "QDA (reg_param)"), ("gnb", "GaussianNB (var_smoothing)"),
               ("ridge", "Ridge (alpha)"), ("logreg", "LogisticRegression (C)")]
PUBLISHED = "published-gh-ofl.json"  # GH-OFL's CIFAR-10 row, as its paper prints it (a record, not a run)


def _finite(vals: dict) -> dict:
    import math
    return {s: v for s, v in vals.items() if math.isfinite(v)}


def _bounds(base: Path) -> dict:
    """{cache directory: {stages: {head: record}}} of tools/frozen_bounds.py's records: beside the runs when base is
    the block's records (results/frozen-encoder-224/bounds), else (base is the checkout's runs/, where no run writes
    them) the committed ones."""
    where = base / "bounds" if (base / "bounds").is_dir() else ROOT / "results" / "frozen-encoder-224" / "bounds"
    out = {}
    for f in sorted(where.glob("*/stages*-*.json")):
        rec = json.loads(f.read_text())
        out.setdefault(f.parent.name, {}).setdefault(rec["stages"], {})[rec["head"]] = rec
    return out


def _grid_acc(out: Path, rows: list, cells: list) -> dict:
    acc = {}
    for a, k in cells:
        runs = {m: _runs(out / f"a{a}-K{k}" / m) for m in {m for _, m, _ in rows}}
        acc[(a, k)] = {label: _finite({s: r.final(key) for s, r in runs[m].items()}) for label, m, key in rows}
    return acc


def rf_note(out: Path) -> str:
    """What the Fed3R-RF column ran with: its options, from a finished run's own config."""
    cfg = next(iter(sorted(out.glob("a*-K*/fed3r-rf/seed=*/config.yaml"))), None)
    if cfg is None:
        return ("; Fed3R-RF, Fed3R on random Fourier features in a head-only run of its own, not run yet: "
                "`python tools/fed3r_rf.py` chooses its σ and λ on the held-out slice first")
    o = __import__("yaml").safe_load(cfg.read_text())["server"]["strategies"]["fed3r"]
    return (f"; Fed3R-RF in a head-only run of its own: D = {o['random_features']:,} random Fourier features, "
            f"σ = {o['kernel_width']:.2f}, λ = {o['ridge']:g}, chosen on the held-out training slice by "
            f"`tools/fed3r_rf.py` (never the test set); not at K = 50, whose K × D² float64 second moments pass the "
            f"grid's {STATISTICS_BUDGET / 2**30:.0f} GiB budget")


def bounds_coverage(bounds: dict) -> str:
    """Which of the offered feature choices (each encoder at its own resolution × resize × stages 1–8, plain rows)
    have the three bounds the target is judged against, and which have none yet: what the block can and cannot
    claim about a ceiling."""
    stages, resizes, want = range(1, 9), ("bilinear", "bicubic"), (("lda", "LDA"), ("qda", "QDA"),
                                                                  ("logreg", "logistic regression"))
    offered = [(e, r) for e in NATIVE_RESOLUTION for r in resizes]
    have = {(e, r): bounds.get(f"{e}-{NATIVE_RESOLUTION[e]}px-{r}", {}) for e, r in offered}
    counts = "; ".join(f"{label} on {sum(h in have[c].get(s, {}) for c in offered for s in stages)}"
                       for h, label in want)
    none = [f"{e} {r}" for (e, r), by in have.items() if not by]
    return (f"Bounds measured on the {len(offered) * len(stages)} offered feature choices (encoder at its own "
            f"resolution × resize × stages 1–8, each training image once): {counts}."
            + (f" None yet for {', '.join(none)}." if none else ""))


def render_224(base: Path) -> str:
    """The 224 px block of docs/frozen-encoder.md: the independent bounds per layer choice, GH-OFL's published row,
    the grid (every method × α × K × seeds), paired statistics, and the target's verdict; base is the checkout's
    runs/ or the block's records (results/frozen-encoder-224/)."""
    import numpy as np
    from flare.report.tables import md_table
    out = base / "frozen-encoder-224" / "grid"
    bt = bounds_tool()
    bounds = _bounds(base)
    parts = []
    # the bounds
    best_bound = {False: (-1.0, ""), True: (-1.0, "")}  # the best bound on the plain rows, and on the doubled rows
    for cache, by_stages in bounds.items():
        rows = []
        held = {s: r["lda"]["holdout_acc"] for s, r in by_stages.items() if "lda" in r}
        chosen = max(held, key=lambda s: (held[s], -s)) if len(held) > 1 else None  # a choice among layers
        for s in sorted(by_stages):
            recs = by_stages[s]
            dim = next(iter(recs.values()))["dim"]
            cells = []
            for h, _ in BOUND_HEADS:
                r = recs.get(h)
                if r is None:
                    cells.append("—")
                    continue
                conv = "" if r.get("converged", True) else f", not converged in {r['max_iter']} iterations"
                tta = f"; with the mirrored test image {100 * r['test_acc_tta']:.2f}" if "test_acc_tta" in r else ""
                cells.append(f"{100 * r['test_acc']:.2f} <sub>({r['chosen']}; held-out {100 * r['holdout_acc']:.2f}"
                             f"{tta}{conv})</sub>")
                if r["test_acc"] > best_bound[cache.endswith("-flip")][0]:
                    best_bound[cache.endswith("-flip")] = (r["test_acc"], f"{cache}, stages {s}, {h}")
            mark = " **(chosen)**" if s == chosen else ""
            rows.append([f"{s}{mark}", f"{dim:,}", *cells])
        se = ""
        if chosen is not None:
            p_best, n_held = held[chosen], by_stages[chosen]["lda"]["holdout_images"]
            sd = (p_best * (1 - p_best) / n_held) ** 0.5
            near = sorted(s for s in held if held[s] >= held[chosen] - sd)
            se = (f" One binomial standard error of a held-out accuracy of {100 * p_best:.2f} % on {n_held:,} images is "
                  f"{100 * sd:.2f} points; the LDA rows within it of the best: stages {', '.join(map(str, near))} "
                  f"(of the {len(held)} with LDA records).")
        rows_in = ("every training image and its mirror image, 100,000 rows" if cache.endswith("-flip") else
                   "all 50,000 training features")
        parts.append(f"Independent centralised bounds, `{cache}` (scikit-learn on {rows_in}, scored on the 10,000 "
                     "test features; each hyper-parameter chosen on a held-out stratified slice of 5,000 training "
                     "images, then refitted on them all). Test accuracy (%), the chosen value and its held-out "
                     "accuracy beneath; **chosen**: the `stages` whose LDA scored best on the held-out slice, the "
                     "grid's feature option:\n\n"
                     + md_table(["stages", "d", *[label for _, label in BOUND_HEADS]], rows) + "\n\n" + se.strip())
    parts.append(bounds_coverage(bounds))
    # the published row
    pub_file = (base / "bounds").parent / PUBLISHED if (base / "bounds").is_dir() else \
        ROOT / "results" / "frozen-encoder-224" / PUBLISHED
    pub = json.loads(pub_file.read_text()) if pub_file.exists() else None
    if pub:
        parts.append(f"Published (not run here): {pub['source']} — {pub['setting']}.\n\n"
                     + md_table(list(pub["accuracy"]), [[f"{v:.2f}" for v in pub["accuracy"].values()]]))
    # the grid
    cells = [(a, k) for k in CLIENTS for a in ALPHAS]
    acc = _grid_acc(out, TRAINED_224 + CLOSED_224, cells)
    rows_all = TRAINED_224 + CLOSED_224
    n_done = {c: len(acc[c]["FAFI-adapter"]) for c in cells}
    t1 = md_table(["α", "K", *[label for label, _, _ in TRAINED_224]],
                  [[f"{a}", f"{k}", *[_ms(acc[(a, k)][label]) for label, _, _ in TRAINED_224]] for a, k in cells])
    t2 = md_table(["α", "K", *[label for label, _, _ in CLOSED_224]],
                  [[f"{a}", f"{k}", *[_ms(acc[(a, k)][label]) for label, _, _ in CLOSED_224]] for a, k in cells])
    t3 = paired_table(acc, cells, [label for label, _, _ in rows_all[1:]])
    points = sum(n_done.values())
    missing = [f"α={a} K={k} ({3 - n_done[(a, k)]} seed{'s' if 3 - n_done[(a, k)] != 1 else ''})"
               for a, k in cells if n_done[(a, k)] < len(SEEDS)]
    stat_k = sorted({k for (a, k) in cells if any(acc[(a, k)]["FedCGS"] for a in ALPHAS)})
    no_stat_k = [k for k in CLIENTS if k not in stat_k and any(n_done[(a, k)] for a in ALPHAS)]
    distinct = {label: sorted({round(100 * v, 2) for c in cells for v in acc[c][label].values()})
                for label, _, _ in CLOSED_224}
    counts = {label: sum(len(acc[c][label]) for c in cells) for label, _, _ in rows_all}
    means = {label: float(np.mean([v for c in cells for v in acc[c][label].values()]))
             for label, _, _ in rows_all if counts[label]}
    cfg = next(iter(sorted(out.rglob("config.yaml"))), None)
    opts = (json.loads(json.dumps(__import__("yaml").safe_load(cfg.read_text())))["dataset"]["options"]
            if cfg else {})
    res = opts.get("resolution")
    if opts and not res:  # the encoder's own (the block renders without the encoder packages)
        res = NATIVE_RESOLUTION[opts["encoder"]]
    lite0 = f"{opts.get('encoder')}-{res}px-{opts.get('resize')}" + "-flip" * bool(opts.get("flip"))  # the grid's cache
    held = {s: r["lda"]["holdout_acc"] for s, r in bounds.get(lite0, {}).items() if "lda" in r}
    pick = max(held, key=lambda s: (held[s], -s)) if held else None
    agrees = ("" if pick is None else " — the held-out choice" if pick == opts.get("stages") else
              f" — NOT the held-out choice, which is stages {pick} among the {len(held)} with LDA records")
    head = (f"Test accuracy (%) on all 10,000 CIFAR-10 test images, clients over all 50,000 training images, "
            f"features of `{opts.get('encoder', '?')}` at {res} px "
            f"({opts.get('resize', '?')}, stages {opts.get('stages', '?')}{agrees}); mean ± std over seeds "
            f"{SEEDS[0]}–{SEEDS[-1]} ({points} of {len(cells) * len(SEEDS)} (cell, seed) points of the FAFI run "
            f"finished{'; not yet finished: ' + ', '.join(missing) if missing else ''}).")
    parts += [head, "Clients that train, and FedPFT:\n\n" + t1,
              "The closed-form heads of the one statistics upload (scored on the head-only FedAvg run of each point"
              + (f"; not scored at K = {', '.join(map(str, no_stat_k))}: the server would hold K per-class second "
                 f"moments, K × 10 × d² float64, past the grid's {STATISTICS_BUDGET / 2**30:.0f} GiB budget — every "
                 "such head is the same for every K, as the distinct values below show" if no_stat_k else "")
              + ")" + rf_note(out) + ":\n\n" + t2,
              "Each method against FAFI-adapter, paired by seed (same partition): mean difference in points [95 % CI]; "
              "**bold**: Holm-adjusted p < 0.05 over this table.\n\n" + t3,
              *(["Distinct accuracies of each closed-form head over every finished (α, K, seed): "
                 + "; ".join(f"{label} {', '.join(f'{v:.2f}' for v in vals)}" for label, vals in distinct.items()
                             if vals) + "."] if any(distinct.values()) else [])]
    # other encoders: the closed-form heads only (`--encoder`)
    for enc_dir in sorted(d for d in (base / "frozen-encoder-224").glob("efficientnet_lite*") if d.is_dir()):
        eacc = _grid_acc(enc_dir, CLOSED_224, cells)
        ecfg = next(iter(sorted(enc_dir.rglob("config.yaml"))), None)
        eo = __import__("yaml").safe_load(ecfg.read_text())["dataset"]["options"] if ecfg else {}
        rows = [[f"{a}", f"{k}", *[_ms(eacc[(a, k)][label]) for label, _, _ in CLOSED_224]] for a, k in cells
                if any(eacc[(a, k)][label] for label, _, _ in CLOSED_224)]
        evals = {f"{label} ({enc_dir.name})": v for label, _, _ in CLOSED_224
                 if (v := [x for c in cells for x in eacc[c][label].values()])}
        means |= {label: float(np.mean(v)) for label, v in evals.items()}
        counts |= {label: len(v) for label, v in evals.items()}
        parts.append(f"`{enc_dir.name}` at {str(eo['resolution']) + ' px' if eo.get('resolution') else 'its own resolution'} ({eo.get('resize', '?')}, stages "
                     f"{eo.get('stages', '?')}, its own held-out choice): the closed-form heads, same cells and "
                     "seeds.\n\n" + md_table(["α", "K", *[label for label, _, _ in CLOSED_224]], rows))
    # the closed-form heads again, each training image's mirror image counted in their statistics (--mirrored)
    mirror = base / "frozen-encoder-224" / "mirrored"
    macc = _grid_acc(mirror, CLOSED_224, cells)
    mvals = {label: [x for c in cells for x in macc[c][label].values()] for label, _, _ in CLOSED_224}
    if any(mvals.values()):
        rows = [[f"{a}", f"{k}", *[_ms(macc[(a, k)][label]) for label, _, _ in CLOSED_224]] for a, k in cells
                if any(macc[(a, k)][label] for label, _, _ in CLOSED_224)]
        both = {label: [(acc[c][label][s], v) for c in cells for s, v in macc[c][label].items() if s in acc[c][label]]
                for label, _, _ in CLOSED_224}
        pairs = [[label, f"{len(v)}", f"{100 * np.mean([p for p, _ in v]):.2f}", f"{100 * np.mean([m for _, m in v]):.2f}",
                  f"{100 * np.mean([m - p for p, m in v]):+.2f}"] for label, v in both.items() if v]
        parts.append("The same closed-form heads with each training image's mirror image counted in their statistics "
                     "beside the image (`mirrored: true` over the `flip` cache: 100,000 rows, the rows of the "
                     "`-flip` bounds above; head-only runs of their own, `--mirrored`), scored on the plain test "
                     "images; Fed3R-RF with the σ and λ above:\n\n"
                     + md_table(["α", "K", *[label for label, _, _ in CLOSED_224]], rows) + "\n\n"
                     "Distinct accuracies of each head with mirrored statistics over every finished (α, K, seed): "
                     + "; ".join(f"{label} {', '.join(f'{v:.2f}' for v in sorted({round(100 * x, 2) for x in vals}))}"
                                 for label, vals in mvals.items() if vals) + ".\n\n"
                     "Each head, plain statistics against mirrored, on the (α, K, seed) points both ran (the same "
                     "partitions and seeds), test accuracy (%):\n\n"
                     + md_table(["head", "points", "plain statistics", "mirrored statistics", "difference"], pairs))
    mmeans = {f"{label} (mirrored)": float(np.mean(v)) for label, v in mvals.items() if v}
    mcounts = {f"{label} (mirrored)": len(v) for label, v in mvals.items() if v}

    def verdict(rows: str, means: dict, counts: dict, bound: tuple) -> tuple[str, float]:
        best = max(means, key=means.get)
        b = means[best]
        return (f"{rows}: the best one-shot head over the finished points is {best}, {100 * b:.2f} % (mean over its "
                f"{counts[best]} (α, K, seed) point{'s' if counts[best] != 1 else ''}); the best independent "
                f"centralised bound on the same rows, {100 * bound[0]:.2f} % ({bound[1]}); gap "
                f"{100 * (b - bound[0]):+.2f} points ({'within' if b >= bound[0] - 0.005 else 'not within'} 0.5)."), b
    sides = [verdict(rows, m, n, best_bound[flip]) for rows, m, n, flip in (
        ("Each training image once", means, counts, False),
        ("Each training image and its mirror image", mmeans, mcounts, True)) if m and best_bound[flip][0] > 0]
    if sides:
        b, top = max(b for _, b in sides), max(v[0] for v in best_bound.values())
        target = pub["accuracy"].get("GH-LDA") if pub else None
        parts.append("**The target**, like with like (plain test images throughout). " + " ".join(t for t, _ in sides)
                     + (f" GH-OFL's published best, {target:.2f} %, is {'reached' if 100 * b >= target else 'not reached'}"
                        + (f"; no bound on these features reaches it either ({100 * top:.2f} %)."
                           if 100 * top < target else ".") if target else ""))
    # FedPFT's deficit
    dd = base / "fedpft-deficit" if (base / "fedpft-deficit").is_dir() else \
        ROOT / "results" / "frozen-encoder-224" / "fedpft-deficit"
    recs = {f.stem: json.loads(f.read_text()) for f in sorted(dd.glob("*.json"))}
    if recs:
        variants = [v for v in ("real", "spherical-2-tol1e-3", "spherical-2-tol1e-12", "spherical-8-tol1e-3",
                                "diag-2-tol1e-3", "full-1-tol1e-3", "full-2-tol1e-3") if v in recs]
        what = {"real": "no mixture: the head on the real features"}
        rows = []
        for v in variants:
            r = recs[v]
            m = r["mixture"]
            it = r["em_iterations_per_class"]
            rows.append([what.get(v) or f"{m['covariance_type']}, {m['components']} component"
                         f"{'s' if m['components'] > 1 else ''}, tol {m['tol']:g}, max_iter {m['max_iter']}",
                         *[f"{100 * r['test_acc_by_epochs'][e]:.2f}" for e in ("1", "10")],
                         f"{min(it)}–{max(it)}" if it else "—", f"{r['mixture_seconds']:.0f}"])
        any_r = next(iter(recs.values()))
        lda = recs.get("lda")
        parts.append(f"FedPFT's deficit, measured (`python tools/fedpft_deficit.py`): one client holding "
                     f"{any_r['per_class']:,} training images a class (seeded), d = {any_r['dim']:,} (stages "
                     f"{any_r['stages']}); the baseline's pipeline with one thing changed per row; every head scored "
                     f"on all {any_r['test_images']:,} test images"
                     + (f"; scikit-learn's LDA (Ledoit–Wolf) on the same subset: {100 * lda['test_acc']:.2f} %"
                        if lda else "") + ".\n\n"
                     + md_table(["mixture per class (sent in float16)", "head: 1 epoch (the baseline's)",
                                 "head: 10 epochs", "EM iterations a class", "mixtures' seconds"], rows))
    # cost
    secs = {m: [] for m in (*METHODS_224, "fed3r-rf")}
    for a, k in cells:
        for m in secs:
            for s, r in _runs(out / f"a{a}-K{k}" / m).items():
                point = out / f"a{a}-K{k}" / m / f"seed={s}" / "sweep_point.json"
                secs[m].append(json.loads(point.read_text())["seconds"] if point.exists() else r.rounds[-1]["seconds"])
    med = lambda x: f"{np.median(x):.1f} s (max {max(x):.1f}; {len(x)} runs)" if x else "—"  # noqa: E731
    total = sum(sum(v) for v in secs.values())
    spans = [json.loads(p.read_text()) for p in out.rglob("sweep_point.json")]
    spans = [(p["start"], p["end"]) for p in spans if p.get("status") == "finished" and "end" in p]
    elapsed = (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0
    msecs = {m: [json.loads(p.read_text())["seconds"] for p in sorted(mirror.glob(f"a*-K*/{m}/seed=*/sweep_point.json"))
                 if finished(p.parent)] for m in ("fedavg", "fed3r-rf")}
    parts.append("Cost (the feature cache not included):\n\n" + md_table(["what", "measured"], [
        *[[f"one `{m}` run, wall (load the cache, train, every strategy it scores), median", med(secs[m])]
          for m in secs if secs[m] or m in METHODS_224],
        *[[f"one `{m}` run with mirrored statistics (`--mirrored`), wall, median", med(msecs[m])]
          for m in msecs if msecs[m]],
        ["all finished runs, their wall times summed", f"{total / 60:.1f} min"],
        ["the grid, first run's start to last run's end (two runs side by side, on 2 cores shared with other jobs)",
         f"{elapsed / 60:.1f} min"]]))
    return "\n\n".join(parts) + "\n"


def bounds_tool():
    """tools/frozen_bounds.py as a module: the held-out choice of `stages` and the refusal of a missing cache."""
    if "frozen_bounds" not in sys.modules:
        spec = importlib.util.spec_from_file_location("frozen_bounds", ROOT / "tools" / "frozen_bounds.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["frozen_bounds"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["frozen_bounds"]


def encoder_overrides(encoder: str) -> list[str]:
    """Another encoder at its own resolution, with the `stages` its own held-out slice picked (its bounds first)."""
    from flare.registry import MODELS
    bt = bounds_tool()
    opts = load_config(CONFIG_224).dataset.options
    res = MODELS.entry(encoder, "--encoder").obj.native_resolution(key="--encoder")
    stages, _ = bt.choose(Path(bt.OUT) / f"{encoder}-{res}px-{opts['resize']}", list(range(1, 9)))
    return [f"dataset.options.encoder={encoder}", f"dataset.options.stages={stages}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/frozen-encoder")
    ap.add_argument("--grid", default="64", choices=["64", "224"])
    ap.add_argument("--encoder", default=None, help="--grid 224 only: another encoder, the closed-form heads only")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed-major", action="store_true", help="every cell's first seed before any cell's second")
    ap.add_argument("--record", action="store_true", help="commit each finished run's records (results/)")
    ap.add_argument("--list", action="store_true", help="print finished and remaining runs, run nothing")
    ap.add_argument("--methods", default=None, help="--grid 224 only: run only these methods (comma-separated: "
                                                    "fedavg, fafi, flare, fed3r-rf)")
    ap.add_argument("--limit", type=int, default=None, help="run at most this many of the remaining runs")
    ap.add_argument("--mirrored", action="store_true", help="--grid 224 only: the head-only runs, each training "
                    "image's mirror image counted in the closed-form heads' statistics (the flip cache)")
    args = ap.parse_args(argv)
    os.chdir(ROOT)  # the config's dataset root is relative to the checkout
    out = (ROOT / args.out) if not Path(args.out).is_absolute() else Path(args.out)
    from flare.errors import FlareError
    try:
        if args.encoder and args.grid != "224":
            raise FlareError("--encoder swaps the encoder of the 224 grid only.", key="--encoder",
                             fix="add --grid 224, or leave --encoder out.")
        if args.mirrored and args.grid != "224":
            raise FlareError("--mirrored counts the mirror images of the 224 grid's cache only.", key="--mirrored",
                             fix="add --grid 224, or leave --mirrored out.")
        extra = (encoder_overrides(args.encoder) if args.encoder else []) + MIRRORED * args.mirrored
        config, block = (CONFIG, "frozen-encoder") if args.grid == "64" else (CONFIG_224, "frozen-encoder-224")
        heads_only = bool(args.encoder or args.mirrored)
        grid_facts = not heads_only  # runs beside the grid's (another encoder, mirrored) leave its machine facts
        methods = dict(HEADS_ONLY if heads_only else METHODS_224) if args.grid == "224" else None
        if methods is not None and (rf := fed3r_rf_method(config, extra)) is not None:
            methods["fed3r-rf"] = rf
        if args.methods is not None:
            if args.grid != "224":
                raise FlareError("--methods picks among the 224 grid's runs.", key="--methods",
                                 fix="add --grid 224, or leave --methods out.")
            want = [m.strip() for m in args.methods.split(",") if m.strip()]
            if bad := [m for m in want if m not in (*METHODS_224, "fed3r-rf")]:
                raise FlareError(f"unknown method(s) {bad}.", key="--methods",
                                 fix=f"choose among {', '.join([*METHODS_224, 'fed3r-rf'])}.")
            if "fed3r-rf" in want and "fed3r-rf" not in methods:
                raise FlareError("Fed3R-RF has no σ and λ chosen for these features.", key="--methods",
                                 fix="run python tools/fed3r_rf.py first (it chooses them on the held-out slice).")
            methods = {m: methods[m] for m in want}
        if args.limit is not None and args.limit < 1:
            raise FlareError(f"--limit {args.limit} is not a positive number of runs.", key="--limit",
                             fix="give 1 or more, or leave --limit out.")
        if n := restore_recorded(block):
            print(f"frozen_grid: {n} recorded run(s) restored from results/{block}/", flush=True)
        grid_points = points(out, args.grid, extra, methods, args.seed_major, args.mirrored)
        todo = [p for p in grid_points if not finished(p[0])][:args.limit]
        if args.list:
            for d, preset, ov in grid_points:
                print(("finished " if finished(d) else "remaining ") + str(d.relative_to(ROOT)))
            print(f"{len(grid_points) - len(todo)} finished, {len(todo)} remaining")
            return 0
        if todo:  # the features once, here, before two workers could both find no cache and both compute it
            from flare.data.features import FeatureOptions, load_features
            opts = FeatureOptions(**load_config(config, None, extra).dataset.options)
            if args.grid == "224":  # never an extraction: the 224 caches are hour-long background jobs
                bt = bounds_tool()
                bt.load_cached(opts.model_copy(update={"stages": 8}))
            load_features(opts, quiet=False)
    except FlareError as e:
        print(f"frozen_grid: {e}", file=sys.stderr)
        return 2
    # the runs' plots: seconds a run, and no record holds them (FLARE_PLOTS=1 draws them)
    os.environ.setdefault("FLARE_PLOTS", "0")
    ex = ProcessPoolExecutor(max_workers=args.workers, mp_context=multiprocessing.get_context("spawn"))
    futures = {}
    queue = list(todo)
    failed = 0
    try:
        while queue or futures:
            while queue and len(futures) < args.workers:
                d, preset, ov = queue.pop(0)
                mapping = load_config(config, preset, ov).model_dump(mode="json")
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
                    record(out, str(rel.relative_to(args.out)), config, block, extra, grid_facts)
    finally:
        ex.shutdown(wait=True, cancel_futures=True)
    if args.record:  # whatever finished while recording was held (or by another invocation) is recorded now
        record(out, "the finished runs", config, block, extra, grid_facts)
    elif grid_facts:
        write_facts(out, config, block, extra)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
