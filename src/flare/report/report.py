"""`flare report DIR...`: tables and figures over any set of run directories.

Runs are read back from their files (config.yaml, metrics.jsonl, partition.json, state.json), so the report
works on old, partial and foreign runs alike; how they are grouped into sections, rows and parameter sweeps
is `report.runs`."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable

from flare.report.figures import (plot_acc_lambda_raw, plot_accuracy_curves, plot_label_distributions,
                                  plot_lambda_eff, plot_param_sweep)
from flare.report.runs import load_runs, param_sweeps, protocols_line, sections, slug
from flare.errors import FlareError
from flare.report.tables import (PAIRED_EXPLAIN, default_baseline, lambda_table, md_table, paired_table, results_table,
                                 strategy_table, sweep_table)
from flare.rundata import num
from flare.rundir import RunDir, atomic_write_text


def write_report(paths: Iterable[str | Path], out: str | Path, title: str = "Report",
                 baseline: str | None = None) -> Path:
    """report.md and its figures; every section with several methods also tests each against `baseline` (a
    method name; default fafi where present, else the section's first method), paired by seed."""
    runs = load_runs(paths)
    out = Path(out)
    with_rounds = [r for r in runs if r.rounds]
    empty = [r for r in runs if not r.rounds]
    md = [f"# {title}", "", f"{len(runs)} run directories, read {time.strftime('%Y-%m-%d %H:%M')}. Accuracies are "
          "the primary global predictor's test accuracy in % (mean ± std over seeds where there are several); "
          "`peak` is the best round of the seed-mean curve (round r = the evaluation after r rounds of training); "
          "g_protos_std and inter_client_proto_std are the diagnostics of docs/method.md#metrics at the last "
          "round.", "", protocols_line(runs), ""]
    if empty:
        md += ["Runs without a complete round (left out): " + ", ".join(f"`{r.dir}`" for r in empty), ""]
    secs = sections(with_rounds)
    if baseline and not any(baseline in [r.label for r in sec.rows] for sec in secs):
        raise FlareError(f"--baseline {baseline} names no method of these runs.", key="--baseline",
                         fix="use one of: " + ", ".join(sorted({r.label for sec in secs for r in sec.rows})) + ".")
    RunDir(out).create(key="--out")  # after every check: a refused report writes nothing
    for sec in secs:
        md += [f"## {sec.title}", "", results_table(sec.rows), ""]
        base = default_baseline([r.label for r in sec.rows], baseline)
        if base and len(sec.rows) > 1:
            md += [f"### Against {base}, paired by seed", "", paired_table(sec.rows, base), "", PAIRED_EXPLAIN, ""]
        plot_accuracy_curves(sec.rows, out / f"accuracy_{sec.slug}.png", f"test accuracy — {sec.title}")
        md += [f"![accuracy against rounds](accuracy_{sec.slug}.png)", ""]
        if st := strategy_table(sec.rows):
            md += ["### Global predictors (server strategies), final accuracy (%)", "", st, ""]
        if lt := lambda_table(sec.rows):
            md += ["### Learned alignment strength", "", lt, ""]
            v7 = [r for r in sec.rows if r.runs[0].learner == "none"
                  and r.runs[0].cfg.get("align", {}).get("schedule") == "linear"
                  and r.client_mean_curves("lambda") is not None]
            if plot_lambda_eff(sec.rows, out / f"lambda_eff_{sec.slug}.png", f"λ_eff against rounds — {sec.title}", v7):
                md += [f"![lambda_eff against rounds](lambda_eff_{sec.slug}.png)", ""]
            if plot_acc_lambda_raw(sec.rows, out / f"lambda_raw_{sec.slug}.png", f"accuracy and raw λ — {sec.title}"):
                md += [f"![accuracy and lambda_raw against rounds](lambda_raw_{sec.slug}.png)", ""]
    if sweeps := param_sweeps(with_rounds):
        md += ["## Parameter sweeps", ""]
        for k, lines in sweeps.items():
            f = f"sweep_{slug(k)}.png"
            plot_param_sweep(k, lines, out / f, f"sweep over {k}")
            md += [f"### {k}", "", sweep_table(k, lines), "", f"![sweep over {k}]({f})", ""]
    if fused := [r for r in runs if r.fused]:
        md += ["## Server strategies over the saved uploads", "", "`flare fuse`: each strategy over every client's "
               "state after the last round (no client retrained); test accuracy in %.", "",
               md_table(["run", "method", "seed", "strategy", "accuracy", "seconds"],
                        [[f"`{r.dir}`", r.method, r.seed, f.get("strategy"), f"{100 * num(f.get('acc')):.2f}",
                          f"{num(f.get('seconds')):.2f}"] for r in fused for f in r.fused]), ""]
    if plot_label_distributions(with_rounds, out / "label_distribution.png"):
        md += ["## Label distributions", "", "![label distribution](label_distribution.png)", ""]
    md += ["## Run directories", "", md_table(["run", "method", "seed", "rounds done", "status"],
                                            [[f"`{r.dir}`", r.method, r.seed, len(r.rounds),
                                              r.state.get("status", "unknown")] for r in runs]), ""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(md))
    return path
