"""How much do the main job's numbers depend on the CPU's kernels? Run one comparison under several kernel paths
on this machine and print each method's mean under each path, and the spread.

    python tools/kernel_paths.py [--config configs/main.yaml] [--presets <the Makefile's PRESETS>]
                                 [--seeds <the Makefile's SEEDS>] [--workers <the Makefile's WORKERS>]
                                 [--paths avx2,avx512,default,native] [--out runs/kernel-paths] [--markdown FILE]

Why: a CPU run's digits follow the instruction set torch's kernel libraries dispatch to (src/flare/cpu.py), and
the last bits of one kernel can move a method's mean by points when the reported figure is a sample of a chaotic
training trajectory. Other CPUs are not at hand, but the paths another CPU would take are: on one x86 machine
`cpu_isa` selects ATen's and oneDNN's level and MKL's branch —

    avx2     ATen AVX2,    oneDNN AVX2,        MKL AVX2,STRICT   (the default; every x86-64 machine here)
    avx512   ATen AVX512,  oneDNN AVX512_CORE, MKL AVX512,STRICT (an AVX512 CPU pinned to its level)
    default  ATen DEFAULT, oneDNN SSE41,       MKL COMPATIBLE    (the oldest path)
    native   whatever the CPU gives; MKL's automatic dispatch, unpinned (an unpinned run on this CPU)

— each a different summation order for the same arithmetic, so the spread of a method's mean across them is what
a change of CPU (or of torch build) can do to the reported number. A path the CPU cannot run (avx512 on an
AVX2-only machine) is reported as such and left out of the spread.

Each path is one `flare compare` of the main job's command with `cpu_isa=<path>` added, in its own process (the
pin must precede the process's first kernel) with the caller's pins removed from the environment, into
OUT/<path>/; a finished path is not run again (compare resumes). Then, per method: the mean of the primary
accuracy (`RunData.final`, so `eval.final_rounds` applies) over the seeds under each path, the spread (largest
minus smallest path mean), and the half-width of the 95 % confidence interval of the mean over seeds (t
distribution, n − 1 degrees of freedom) under the first path. A method is *robust* when its spread is at most
1 point and below that half-width: then no kernel path could move it across its own confidence interval.
Exit status 0 when every method is robust, 1 otherwise, 2 on bad input.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

PATHS = ("avx2", "avx512", "default", "native")
from flare import cpu  # noqa: E402

PIN_ENV = (*cpu._ENV, "FLARE_CPU_ISA", cpu._MARK)  # every variable a pin sets: cleared so each path starts bare
SPREAD_LIMIT = 1.0  # points


def makefile_default(name: str) -> str:
    """PRESETS, SEEDS or WORKERS as `make run` sets them, so that the tool measures exactly the main job."""
    m = re.search(rf"^{name}\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(), re.M)
    if not m:
        raise SystemExit(f"kernel_paths: the Makefile sets no {name}")
    return m.group(1)


def compare_command(args, path: str) -> list[str]:
    return [sys.executable, "-m", "flare.cli", "compare", "--config", args.config, "--presets", args.presets,
            "--seeds", args.seeds, "--workers", str(args.workers), "--out", str(Path(args.out) / path), "--quiet",
            f"cpu_isa={path}"]


def runnable(path: str) -> bool:
    """Whether this CPU can run the path's instruction set (the others need no check)."""
    if path != "avx512":
        return True
    code = "import torch; print(int(torch.cpu._is_avx512_supported()))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return r.stdout.strip() == "1"


def run_path(args, path: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in PIN_ENV}
    env["PYTHONPATH"] = str(ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    print(f"kernel_paths: {path}: {' '.join(compare_command(args, path)[1:])}", flush=True)
    r = subprocess.run(compare_command(args, path), env=env, cwd=ROOT)
    if r.returncode != 0:
        raise SystemExit(f"kernel_paths: the {path} path's compare exited {r.returncode}")
    return time.perf_counter() - t0


def path_results(out: Path, path: str, presets: list[str]) -> dict:
    """{method: {seed: final primary accuracy (points)}} and the kernels the path's runs recorded."""
    from flare.rundata import RunData
    accs, kernels, label = {}, set(), set()
    for name in presets:
        accs[name] = {}
        for d in sorted((out / path / name).glob("seed=*")):
            run = RunData.load(d)
            if run.finished:
                accs[name][run.seed] = 100 * run.final("acc")
                b = run.state.get("backend") or {}
                kernels.add(f"{b.get('cpu_kernels')} / MKL {b.get('mkl', '?')}")
                label.add(run.final_label)
    return {"acc": accs, "kernels": ", ".join(sorted(kernels)), "final": ", ".join(sorted(label))}


def half_width(values: list[float]) -> float:
    """Half-width of the 95 % confidence interval of the mean (t distribution, n − 1 degrees of freedom)."""
    from flare.stats import mean_ci
    return mean_ci(values)[2]


def analyse(results: dict[str, dict], presets: list[str]) -> list[dict]:
    paths = list(results)
    rows = []
    for name in presets:
        means = {}
        for p in paths:
            vals = list(results[p]["acc"].get(name, {}).values())
            means[p] = sum(vals) / len(vals) if vals else math.nan
        finite = [v for v in means.values() if math.isfinite(v)]
        spread = max(finite) - min(finite) if len(finite) > 1 else math.nan
        hw = half_width(list(results[paths[0]]["acc"].get(name, {}).values()))
        robust = math.isfinite(spread) and spread <= SPREAD_LIMIT and math.isfinite(hw) and spread < hw
        rows.append({"method": name, "means": means, "spread": spread, "half_width": hw, "robust": robust,
                     "seeds": len(results[paths[0]]["acc"].get(name, {}))})
    return rows


def markdown(rows: list[dict], results: dict[str, dict], skipped: list[str], final: str) -> str:
    paths = list(results)
    head = ["method", "seeds"] + [f"`{p}`" for p in paths] + ["spread", "95 % CI half-width", "robust"]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join("---" for _ in head) + " |"]
    for r in rows:
        cells = [r["method"], str(r["seeds"])] + [f"{r['means'][p]:.2f}" for p in paths]
        cells += [f"{r['spread']:.2f}", f"±{r['half_width']:.2f}", "yes" if r["robust"] else "**no**"]
        lines.append("| " + " | ".join(cells) + " |")
    per_run = sorted((max(v) - min(v), name, seed) for name in [r["method"] for r in rows]
                     for seed in results[paths[0]]["acc"].get(name, {})
                     if len(v := [results[p]["acc"][name][seed] for p in paths
                                  if seed in results[p]["acc"].get(name, {})]) > 1)
    if per_run:
        worst = per_run[-1]
        lines += ["", f"One run, by contrast: the final accuracy of one (method, seed) moved by "
                  f"{per_run[len(per_run) // 2][0]:.2f} points at the median of the {len(per_run)} pairs and by "
                  f"{worst[0]:.2f} at the most ({worst[1]}, seed {worst[2]})."]
    lines += ["", "Kernels each path's runs recorded (state.json): "
              + "; ".join(f"`{p}` → {results[p]['kernels']}" for p in paths) + "."]
    if skipped:
        lines += ["", f"Not run (this CPU lacks the instruction set): {', '.join(skipped)}."]
    lines += ["", f"Each cell is the mean over seeds of the primary accuracy ({final}), in %. *Spread*: the largest "
              "minus the smallest path mean. *Robust*: spread ≤ 1 point and below the half-width of the 95 % "
              f"confidence interval of the mean over seeds under `{paths[0]}`."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="configs/main.yaml")
    ap.add_argument("--presets", default=None)
    ap.add_argument("--seeds", default=None)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--out", default="runs/kernel-paths")
    ap.add_argument("--markdown", help="also write the table to this file")
    ap.add_argument("--no-run", action="store_true", help="only read what OUT holds")
    args = ap.parse_args(argv)
    args.presets = args.presets or makefile_default("PRESETS")
    args.seeds = args.seeds or makefile_default("SEEDS")
    args.workers = args.workers or int(makefile_default("WORKERS"))
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    bad = [p for p in paths if p not in PATHS]
    if bad or len(paths) < 2:
        print(f"kernel_paths: --paths takes two or more of {', '.join(PATHS)}; got {args.paths!r}", file=sys.stderr)
        return 2
    if not (ROOT / args.config).is_file() and not Path(args.config).is_file():
        print(f"kernel_paths: no config file {args.config}", file=sys.stderr)
        return 2
    presets = [p.strip() for p in args.presets.split(",")]
    skipped = [p for p in paths if not runnable(p)]
    paths = [p for p in paths if p not in skipped]
    wall = {}
    for p in paths:
        if not args.no_run:
            wall[p] = run_path(args, p)
    results = {p: path_results(Path(args.out), p, presets) for p in paths}
    rows = analyse(results, presets)
    final = ", ".join(sorted({results[p]["final"] for p in paths}))
    table = markdown(rows, results, skipped, final)
    print(table)
    if wall:
        print("\nwall per path: " + ", ".join(f"{p} {s / 60:.1f} min" for p, s in wall.items()))
    if args.markdown:
        Path(args.markdown).write_text(table + "\n")
    (Path(args.out) / "kernel_paths.json").write_text(json.dumps(
        {"rows": rows, "skipped": skipped, "kernels": {p: results[p]["kernels"] for p in paths}}, indent=1))
    return 0 if all(r["robust"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
