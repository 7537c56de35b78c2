"""summary.md and plots/ of one run directory (read back from its files, so it also works on old runs)."""
from __future__ import annotations

import math
import os
from pathlib import Path

from flare.rundata import RunData, num
from flare.records import acc_keys
from flare.rundir import DIAG, SUMMARY, atomic_write_text


def _f(v, digits=4):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if math.isfinite(v) else str(v)
    return str(v)


# A run's own figures, alt text → file in plots/. FLARE_PLOTS=0 (the process's switch: no config records it) draws
# none: a second or two of matplotlib text layout per run adds up over hundreds of short runs (a sweep, the tests).
PLOTS = {"accuracy": "accuracy", "labels": "label_distribution", "diagnostics": "diagnostics", "lambda": "lambda"}


def summary_markdown(run: RunData) -> str:
    cfg, rounds, part = run.cfg, run.rounds, run.partition
    lines = [f"# {cfg.get('method', 'run')} — {cfg.get('dataset', {}).get('name', '')}", ""]
    if cfg.get("description"):
        lines += [cfg["description"], ""]
    lines += [
        f"- clients {cfg.get('num_clients')}, partition {cfg.get('partition', {}).get('kind')} "
        f"α={cfg.get('partition', {}).get('alpha')}, rounds {cfg.get('rounds')} × local epochs "
        f"{cfg.get('local_epochs')}, batch {cfg.get('batch_size')}, lr {cfg.get('lr')}, model {run.models}, seed "
        f"{cfg.get('seed')}",
        f"- protocol: `{run.protocol}` (config/protocol.py; docs/reproduction.md lists what each item changes)",
        f"- status: {run.state.get('status', 'unknown')}, rounds done: {run.state.get('rounds_done', len(rounds))}",
        f"- computed with: {run.backend}"]
    if run.speed_choice:
        lines.append(f"- speed=fast's choice: {run.speed_choice}")
    lines.append("")
    if rounds:
        primary = run.primary
        lines += ["## Accuracy of every global predictor", "",
                  f"| rule | final ({run.final_label}) | peak | peak round |", "| --- | --- | --- | --- |"]
        for k in acc_keys(rounds[-1:]):  # the rules the last round scored
            best, at = run.peak(k)
            mark = " (primary)" if k == f"acc_{primary}" else ""
            lines.append(f"| {k.removeprefix('acc_')}{mark} | {100 * run.final(k):.2f} | {100 * best:.2f} | {at} |")
        lines += ["", "## Diagnostics at the last round", "", "| metric | value |", "| --- | --- |"]
        lines += [f"| {k} | {_f(rounds[-1][k], 6)} |" for k in DIAG if k in rounds[-1]]
        if "client_acc" in rounds[-1]:
            lines.append(f"| client accuracies (alone) | {', '.join(f'{100 * a:.1f}' for a in rounds[-1]['client_acc'])} |")
        lines.append("")
        if own := _strategy_logs(rounds[-1]):
            lines += ["## What the server strategies measured at the last round", "",
                      "Their cost (seconds, MiB) and what they minimised, as each strategy logged it.", "",
                      "| strategy | numbers |", "| --- | --- |"] + [f"| {k} | {v} |" for k, v in own.items()] + [""]
    if rounds and rounds[-1].get("seconds_eval_parts"):
        lines += _eval_cost(rounds[-1])
    if run.fused:
        lines += ["## Server strategies over the saved uploads", "",
                  f"`flare fuse` over every client's state after round {run.fused[0].get('round', 0) + 1} "
                  "(no client retrained); seconds: the clients' statistics the strategy asks for, its build and its "
                  "test pass.", "", "| strategy | accuracy | seconds | its numbers |", "| --- | --- | --- | --- |"]
        lines += [f"| {f.get('strategy')} | {100 * num(f.get('acc')):.2f} | {_f(f.get('seconds'), 2)} | "
                  f"{_strategy_logs(f).get(f.get('strategy'), '')} |" for f in run.fused] + [""]
    if part:
        lines += ["## Partition", "", "| client | model | samples | normalized entropy |", "| --- | --- | --- | --- |"]
        lines += [f"| {c['client']} | {c.get('model', cfg.get('model', {}).get('name'))} | {c['num_samples']} | "
                  f"{c['normalized_entropy']:.4f} |" for c in part["clients"]] + [""]
    if warns := run.state.get("warnings"):
        lines += ["## Warnings", ""] + [f"- {w}" for w in warns] + [""]
    drawn = [f"![{alt}](plots/{name}.png)" for alt, name in PLOTS.items() if (run.dir / "plots" / f"{name}.png").exists()]
    return "\n".join(lines + (["## Plots", ""] + [x for link in drawn for x in (link, "")] if drawn else []))


SHARED_PASSES = {"clients": "the K client models on the test set (every client rule, client_acc)",
                 "noise": "the K client models on IFFI's noise input (iffi, iffi_reference)",
                 "batch_bn": "eval.bn=batch's train-mode pass (the feature rules)"}


def _eval_cost(rec: dict) -> list[str]:
    """The last round's evaluation seconds, split into the shared passes and each rule's own part, and what each
    rule would cost alone (rounds.rule_costs)."""
    parts, alone = rec["seconds_eval_parts"], rec.get("seconds_eval_rules", {})
    lines = ["## Evaluation cost at the last round", "",
             f"{_f(rec.get('seconds_eval'), 2)} s in all (CPU host time). Shared passes are paid once for every rule "
             "that reads them; a rule's own part is building its predictor and scoring.", "",
             "| part | seconds | what |", "| --- | --- | --- |"]
    lines += [f"| {k} | {v:.2f} | {SHARED_PASSES[k]} |" for k, v in parts.items() if k in SHARED_PASSES]
    lines += [f"| {k} | {v:.2f} | rule {k}'s own part; alone it would cost {alone.get(k, v):.2f} s |"
              for k, v in parts.items() if k not in SHARED_PASSES]
    return lines + [""]


def _strategy_logs(rec: dict) -> dict[str, str]:
    """strategy → "key value, …" of the `<strategy>.<key>` numbers a record carries (predictor logs)."""
    out: dict[str, list[str]] = {}
    for k, v in rec.items():
        if "." in k and isinstance(v, (int, float)):
            name, key = k.split(".", 1)
            out.setdefault(name, []).append(f"{key} {v:.4g}")
    return {n: ", ".join(v) for n, v in out.items()}


def write_run_report(run_dir: str | Path) -> RunData:
    """Plots and summary.md; returns the RunData it read (callers need not read the directory again)."""
    run, draw = RunData.load(run_dir), os.environ.get("FLARE_PLOTS", "1") != "0"
    (plots := Path(run_dir) / "plots").mkdir(exist_ok=True)
    if draw:  # lazy: pyplot costs a process about 0.8 s to import; only a process that draws pays it
        from flare.report.figures import plot_accuracy, plot_diagnostics, plot_label_distribution, plot_lambda
    if draw and run.rounds:
        plot_accuracy(run, plots / "accuracy.png")
        plot_diagnostics(run, plots / "diagnostics.png")
        plot_lambda(run, plots / "lambda.png")
    if draw and run.partition:
        plot_label_distribution(run.partition, plots / "label_distribution.png")
    for name in () if draw else PLOTS.values():  # none drawn, and none left that the records have outgrown
        (plots / f"{name}.png").unlink(missing_ok=True)
    atomic_write_text(Path(run_dir) / SUMMARY, summary_markdown(run))
    return run
