"""The `gpu-lease` block (docs/performance.md): what `benchmarks/gpu_suite.sh lease` calls on a lent GPU brought back.

Each call's folder holds its `suite.log` and the records of the table's runs (`table/<sweep>/<point>/`: config,
partition, metrics, state, sweep_point; never checkpoints), as the call packed them, finished or not. This renders,
per call, the stages with their outcome, the efficiency figures, and per run how far it got and at what speed —
so a figure on the page is always the one the log and the records hold.

    python tools/readme.py --rebuild gpu-lease     # from results/gpu-lease/ (the calls cannot be rerun here)
"""
from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

import yaml

STAGE = re.compile(r"^== (\S+): rc (\d+) after (\d+) s$")
ERROR = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.*)$")
EFFICIENCY = {"bare forward+backward+step": "bare", "end-to-end local training": "e2e", "efficiency": "eff",
              "bare batched fwd+bwd+step": "bare_b", "end-to-end batched": "e2e_b",
              "efficiency (÷ bare batched)": "eff_b", "÷ bare single-model step": "vs_bare"}


def parse_log(text: str) -> dict:
    """The call's device, torch, stages (name, rc, seconds, the error that ended a failed one) and efficiency
    figures (per model width) from its suite.log."""
    lines = text.splitlines()
    out = {"gpu": lines[0].split(",")[0], "torch": None, "conv_dtype": None, "stages": [], "efficiency": {}}
    error, width = None, None
    for line in lines:
        if line.startswith("torch "):
            out["torch"] = line.split()[1]
        elif line.startswith("a convolution under vmap"):
            out["conv_dtype"] = line.rsplit(" ", 1)[1]
        elif m := ERROR.match(line):
            error = f"{m[1]}: {m[2]}"
        elif m := STAGE.match(line):
            out["stages"].append({"name": m[1], "rc": int(m[2]), "seconds": int(m[3]),
                                  "error": error if m[2] not in ("0", "124") else None})
            error = None
        elif line.startswith("config: "):
            width = re.search(r"width ([\d.]+)", line)[1]
            out["efficiency"][width] = {}
        elif width and ":" in line:
            key, _, value = line.partition(":")
            if key.strip() in EFFICIENCY and value.split():
                out["efficiency"][width][EFFICIENCY[key.strip()]] = float(value.split()[0])
            if key.strip() == "÷ bare single-model step":
                out["efficiency"][width]["vs_seq"] = float(re.search(r"sequential end to end: ([\d.]+)", value)[1])
    return out


def run_row(point: Path) -> dict:
    """How far one run got: rounds done of R, the last evaluated round's accuracy, mean seconds per round of training
    and per evaluation after the first round (which carries the warm-up), and how many runs shared the GPU."""
    cfg = yaml.safe_load((point / "config.yaml").read_text())
    rounds = [r for r in map(json.loads, (point / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "round"]
    sp = json.loads((point / "sweep_point.json").read_text()) if (point / "sweep_point.json").exists() else {}
    rest = rounds[1:] or rounds
    evals = [r for r in rest if "seconds_eval" in r]  # eval.every > 1 evaluates some rounds only
    return {"point": point.name, "engine": cfg["client_engine"], "done": len(rounds), "of": cfg["rounds"],
            "acc": evals[-1]["acc"] if evals else float("nan"),
            "train": statistics.mean(r["seconds_train"] for r in rest) if rest else float("nan"),
            "eval": statistics.mean(r["seconds_eval"] for r in evals) if evals else float("nan"),
            "sharing": round(1 / sp["gpus"]) if sp.get("gpus") else 1}


def render(base: Path, calls: list[str]) -> str:
    """Per lease call its stages, efficiency and runs; then the engines' full-run figures of every call, and the
    α = 0.05 table from every run that finished."""
    md, logs = [], {c: parse_log((base / c / "suite.log").read_text()) for c in calls
                    if (base / c / "suite.log").exists()}  # call4 ran by hand: a call.log, no stages
    for call, log in logs.items():
        md += [f"**{call}** — {log['gpu']}, torch {log['torch']}; a convolution under vmap + autocast computes in "
               f"`{log['conv_dtype']}`.", "", "| stage | outcome | seconds |", "| --- | --- | --- |"]
        for s in log["stages"]:
            outcome = ("finished" if s["rc"] == 0 else "cut at its time limit" if s["rc"] == 124
                       else f"failed: `{s['error']}`" if s["error"] else f"failed (exit {s['rc']})")
            trained = base / call / f"{s['name']}-metrics.jsonl"  # a benchmark that failed after training rounds
            if s["rc"] not in (0, 124) and trained.exists():
                n = sum(json.loads(line)["kind"] == "round" for line in trained.read_text().splitlines())
                outcome += f", after {n} rounds trained (the engines' table below)" if n else ""
            md.append(f"| {s['name']} | {outcome} | {s['seconds']} |")
        if log["efficiency"]:
            md += ["", "| ResNet-18 width | bare step (samples/s) | end to end | efficiency "
                   "| bare batched step (5 clients) | end-to-end batched | ÷ bare batched "
                   "| batched ÷ sequential end to end |",
                   "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            for w, e in log["efficiency"].items():
                md.append(f"| {w} | {e['bare']:,.0f} | {e['e2e']:,.0f} | {e['eff']:.3f} | {e['bare_b']:,.0f} | "
                          f"{e['e2e_b']:,.0f} | {e['eff_b']:.3f} | {e['vs_seq']:.3f} |")
        points = sorted(p for p in (base / call / "table").glob("*/*") if (p / "metrics.jsonl").exists())
        if points:
            md += ["", "| run | engine | runs sharing the GPU | rounds done | accuracy at the last evaluation | "
                   "train s/round | s per evaluation |", "| --- | --- | --- | --- | --- | --- | --- |"]
            for r in map(run_row, points):
                acc, train, ev = ((f"{100 * r['acc']:.2f}", f"{r['train']:.2f}", f"{r['eval']:.2f}") if r["done"]
                                  else ("—",) * 3)
                md.append(f"| {r['point']} | {r['engine']} | {r['sharing']} | {r['done']} of {r['of']} | {acc} "
                          f"| {train} | {ev} |")
        md.append("")
    md += ["**The engines on the full run** (FAFI, CIFAR-10, ResNet-18 width 1, 5 clients, α = 0.05, batch 512, bf16; "
           "short runs of the rounds shown, then the finished table runs' throughput):", "",
           gpu_column(base, calls, logs), "",
           "**The notes' α = 0.05 setting at full scale** (CIFAR-10, ResNet-18, 5 clients, R = 50, E = 1, batch 512, "
           "the card dealer; every run that finished, whichever call):", "", full_scale(base, calls)]
    return "\n".join(md)


# -- what the calls measured per engine, and the α = 0.05 table from every finished run ---------------------------
ENGINES = {"full-batched": "batched, eager", "seq": "sequential", "compiled": "batched, compiled"}
PEAK = re.compile(r"^peak GPU memory ([\d.]+) GiB allocated")
# docs/performance.md's opening paragraph: one H100 run, measured before the engines existed
BEFORE = {"engine": "sequential, before the engines (an H100)", "train": 4.2, "eval": 1.4}


def engine_rows(base: Path, calls: list[str]) -> list[dict]:
    """Per short full run a call made (`<name>-metrics.jsonl`): its engine, rounds, first-round and later training
    seconds, seconds per evaluation, and peak memory. A call's log prints one `peak GPU memory` line per run that
    got to its summary, in the order its command ran them (`FULL_ORDER` of the call's folder)."""
    rows = []
    for call in calls:
        folder = base / call
        log = next((folder / n for n in ("suite.log", "call.log") if (folder / n).exists()), None)
        peaks = [float(m[1]) for line in (log.read_text().splitlines() if log else []) if (m := PEAK.match(line))]
        order = (folder / "FULL_ORDER").read_text().split() if (folder / "FULL_ORDER").exists() else []
        for i, name in enumerate(order or sorted(ENGINES)):
            f = folder / f"{name}-metrics.jsonl"
            if not f.exists():
                continue
            rounds = [r for r in map(json.loads, f.read_text().splitlines()) if r["kind"] == "round"]
            ev = [r["seconds_eval"] for r in rounds if "seconds_eval" in r]
            rows.append({"call": call, "engine": ENGINES[name], "rounds": len(rounds),
                         "first": rounds[0]["seconds_train"],
                         "train": statistics.mean(r["seconds_train"] for r in rounds[1:]),
                         "eval": statistics.mean(ev) if ev else float("nan"),
                         "peak": peaks[i] if order and i < len(peaks) else None})
    return rows


def _points(base: Path, calls: list[str]) -> dict[str, list[Path]]:
    """Every finished table run of the calls (a later call's run of the same point replaces an earlier one), by
    sweep point name without its seed: `fafi_protocol=clean` → its seeds' run folders."""
    done: dict[str, Path] = {}
    for call in calls:
        for p in sorted((base / call / "table").glob("*/*")):
            state = p / "state.json"
            if state.exists() and json.loads(state.read_text()).get("status") == "finished":
                done[p.name] = p
    out: dict[str, list[Path]] = {}
    for name, p in sorted(done.items()):
        out.setdefault(name.rsplit("_seed=", 1)[0], []).append(p)
    return out


def full_scale(base: Path, calls: list[str]) -> str:
    """The notes' α = 0.05 setting at full scale from every finished run: per protocol, `flare compare`'s table (every
    fusion rule, mean ± std over the seeds that finished) and each method against FAFI paired by seed, the notes'
    numbers in the same setting, and the sentence that answers "does FLARE beat FAFI, under which protocol"."""
    from flare_paper.reference import references_for

    from flare.report.compare import compare_markdown, compare_rows
    from flare.report.tables import seed_values
    from flare.stats import paired

    points, md, verdicts = _points(base, calls), [], []
    for protocol in ("clean", "reference"):
        methods = [(preset, points[f"{preset}_protocol={protocol}"]) for preset in
                   ("fafi", "flare", "etf-anneal", "fedavg", "ensemble") if f"{preset}_protocol={protocol}" in points]
        if not methods:
            md += [f"**protocol={protocol}**: no run has finished yet.", ""]
            verdicts.append(f"under protocol={protocol} no run has finished")
            continue
        meta_rows = compare_rows(methods)
        md += [f"**protocol={protocol}** (seeds that finished: "
               + "; ".join(f"{row.label} {', '.join(str(r.seed) for r in row.runs)}" for _, row in meta_rows)
               + ")", "", compare_markdown(meta_rows), ""]
        refs = [f"{row.label}: {r.value:.2f} ({r.label()})" for _, row in meta_rows
                for r in references_for(row.runs[0].flat, row.label)]
        md += ["The notes' numbers in this setting (their reference protocol; final round): "
               + ("; ".join(refs) if refs else "none") + ".", ""]
        rows = {row.label: row for _, row in meta_rows}
        if "fafi" in rows and "flare" in rows:
            t = paired(seed_values(rows["flare"]), seed_values(rows["fafi"]))
            gap = f"{100 * t.mean:+.2f} points over {t.n} paired seed{'s' if t.n != 1 else ''}"
            verdicts.append(f"under protocol={protocol} FLARE − FAFI is {gap}, " + (
                f"95 % CI [{100 * t.low:+.2f}, {100 * t.high:+.2f}], p = {t.p:.3g}" if t.testable
                else "too few seeds for a test"))
        else:
            verdicts.append(f"under protocol={protocol} FLARE and FAFI have not both finished a seed")
    md += ["Does FLARE beat FAFI at full scale? From these records: " + "; ".join(verdicts) + ".", ""]
    return "\n".join(md)


def gpu_column(base: Path, calls: list[str], logs: dict[str, dict]) -> str:
    """The full-run figures per engine, beside the measurement before the engines existed, then the throughput of
    each call's finished table runs (how many shared the GPU, their wall from first start to last end, runs/hour).
    `logs`: the parsed suite.log of each call that has one (the lease calls)."""
    md = ["| engine | call | rounds timed | first round: train (s) | train s/round after it | s per evaluation | "
          "peak memory (GiB) |", "| --- | --- | --- | --- | --- | --- | --- |",
          f"| {BEFORE['engine']} | before | 50 | — | {BEFORE['train']} | {BEFORE['eval']} | — |"]
    for r in engine_rows(base, calls):
        peak = "—" if r["peak"] is None else f"{r['peak']:.2f}"
        md.append(f"| {r['engine']} | {r['call']} | {r['rounds']} | {r['first']:.2f} | {r['train']:.2f} | "
                  f"{r['eval']:.2f} | {peak} |")
    line = None
    for call, log in logs.items():
        eff = log["efficiency"]
        if "1.0" in eff:  # the efficiency stage's width-1 figures, from the last call that measured them
            e = eff["1.0"]
            line = (f"Efficiency at width 1 ({call}): per-client training "
                    f"{e['eff']:.3f} of its bare step, the batched engine {e['eff_b']:.3f} of its bare batched step "
                    f"and {e['vs_seq']:.3f}× per-client training end to end.")
    md += ["", line] if line else []
    md += ["", "| call | table runs finished | runs sharing the GPU | wall, first start to last end (s) "
           "| runs per hour |",
           "| --- | --- | --- | --- | --- |"]
    for call in calls:
        sps = [json.loads((p / "sweep_point.json").read_text()) for p in sorted((base / call / "table").glob("*/*"))
               if (p / "sweep_point.json").exists()]
        done = [sp for sp in sps if sp.get("status") == "finished"]
        if done:
            span = max(sp["end"] for sp in done) - min(sp["start"] for sp in done)
            sharing = round(1 / done[0]["gpus"]) if done[0].get("gpus") else 1
            md.append(f"| {call} | {len(done)} | {sharing} | {span:.0f} | {len(done) * 3600 / span:.1f} |")
    return "\n".join(md)
