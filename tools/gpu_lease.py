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
    """How far one run got: rounds done of R, the last round's accuracy, mean seconds per round of training and of
    evaluation after the first round (which carries the warm-up), and how many runs shared the GPU."""
    cfg = yaml.safe_load((point / "config.yaml").read_text())
    rounds = [r for r in map(json.loads, (point / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "round"]
    sp = json.loads((point / "sweep_point.json").read_text()) if (point / "sweep_point.json").exists() else {}
    rest = rounds[1:] or rounds
    return {"point": point.name, "engine": cfg["client_engine"], "done": len(rounds), "of": cfg["rounds"],
            "acc": rounds[-1]["acc"] if rounds else float("nan"),
            "train": statistics.mean(r["seconds_train"] for r in rest) if rest else float("nan"),
            "eval": statistics.mean(r["seconds_eval"] for r in rest) if rest else float("nan"),
            "sharing": round(1 / sp["gpus"]) if sp.get("gpus") else 1}


def render(base: Path, calls: list[str]) -> str:
    md = []
    for call in calls:
        log = parse_log((base / call / "suite.log").read_text())
        md += [f"**{call}** — {log['gpu']}, torch {log['torch']}; a convolution under vmap + autocast computes in "
               f"`{log['conv_dtype']}`.", "", "| stage | outcome | seconds |", "| --- | --- | --- |"]
        for s in log["stages"]:
            outcome = ("finished" if s["rc"] == 0 else "cut at its time limit" if s["rc"] == 124
                       else f"failed: `{s['error']}`" if s["error"] else f"failed (exit {s['rc']})")
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
            md += ["", "| run | engine | runs sharing the GPU | rounds done | accuracy at the last round | "
                   "train s/round | eval s/round |", "| --- | --- | --- | --- | --- | --- | --- |"]
            for r in map(run_row, points):
                acc, train, ev = ((f"{100 * r['acc']:.2f}", f"{r['train']:.2f}", f"{r['eval']:.2f}") if r["done"]
                                  else ("—",) * 3)
                md.append(f"| {r['point']} | {r['engine']} | {r['sharing']} | {r['done']} of {r['of']} | {acc} "
                          f"| {train} | {ev} |")
        md.append("")
    return "\n".join(md)
