"""Markdown tables over runs and rows: results, server strategies, learned λ, parameter sweeps, comparisons.
Accuracies are shown in %; "peak" is `rundir.peak_index` of the (seed-mean) curve."""
from __future__ import annotations

import math

from pathlib import Path

import numpy as np

from flare.report.runs import Row, SweepLine, short_key, fmt_value
from flare.report.style import rule_title
from flare.rundata import RunData
from flare.records import acc_keys
from flare.stats import ALPHA, holm, paired, verdict

PAIRED_EXPLAIN = ("Each method minus the baseline, paired by seed (runs of one seed share the partition, the initial "
                  "model and the anchors): mean difference of the primary accuracy in points, its 95 % confidence "
                  "interval, the two-sided p of the paired t-test, and that p adjusted for the table's comparisons "
                  f"(Holm); *significant* means adjusted p < {ALPHA}. flare/stats.py says why this test.")


def fmt_ms(mean: float, std: float, pct: bool = True) -> str:
    if mean is None or math.isnan(mean):
        return "—"
    scale, d = (100, 2) if pct else (1, 4)
    s = f"{scale * mean:.{d}f}" if (pct or abs(mean) < 1e4) else f"{mean:.3g}"
    if std is not None and not math.isnan(std):
        s += f" ± {scale * std:.{d}f}" if (pct or abs(mean) < 1e4) else f" ± {std:.3g}"
    return s


def fmt_big(v: float) -> str:
    if v is None or math.isnan(v):
        return "—"
    return f"{v:.4g}" if abs(v) < 1e4 else f"{v:.3e}"


def md_table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def _row_cells(row: Row) -> list:
    """A row's seeds, final and peak accuracy (the peak's round beside it) and final prototype diagnostics."""
    pk, pr, psd = row.peak()
    return [len(row.seeds), fmt_ms(*row.stat("acc")[:2]), f"{fmt_ms(pk, psd)} ({pr})" if pr is not None else "—",
            *(fmt_ms(*row.stat(k)[:2], pct=False) for k in ("g_protos_std", "inter_client_proto_std"))]


def results_table(rows: list[Row]) -> str:
    head = ["method", "notes", "seeds", "final acc (%)", "peak acc (%) (round)", "g_protos_std",
            "inter_client_proto_std", "status"]
    return md_table(head, [[row.label, row.notes_name, *_row_cells(row), row.status] for row in rows])


def strategy_table(rows: list[Row]) -> str | None:
    """Final accuracy of every global predictor the runs evaluated (the server-strategy comparison)."""
    rules = acc_keys([r.rounds[-1] for row in rows for r in row.runs if r.rounds])
    if len(rules) < 2:
        return None
    head = ["method"] + [rule_title(k.removeprefix("acc_")) or k for k in rules]
    return md_table(head, [[row.label] + [fmt_ms(*row.stat(k)[:2]) for k in rules] for row in rows])


def lambda_table(rows: list[Row]) -> str | None:
    lr = [row for row in rows if any(r.client_curve("lambda_raw") is not None for r in row.runs)]
    if not lr:
        return None
    head = ["method", "notes", "peak acc (%) (round)", "final acc (%)", "final λ_raw (mean over clients)",
            "max λ_raw (any client, any round)", "final λ_eff"]
    body = []
    for row in lr:
        pk, pr, psd = row.peak()
        mx = max((float(np.nanmax(c)) for r in row.runs if (c := r.client_curve("lambda_raw")) is not None
                  and np.isfinite(c).any()), default=float("nan"))
        lam_raw = row.stat("lambda_raw")
        body.append([row.label, row.notes_name, f"{fmt_ms(pk, psd)} ({pr})", fmt_ms(*row.stat("acc")[:2]),
                     fmt_big(lam_raw[0]) + (f" ± {fmt_big(lam_raw[1])}" if not math.isnan(lam_raw[1]) else ""),
                     fmt_big(mx), fmt_big(row.stat("lambda_eff")[0])])
    return md_table(head, body)


def sweep_table(key: str, lines: list[SweepLine]) -> str:
    head = ["method", short_key(key), "seeds", "final acc (%)", "peak acc (%) (round)", "g_protos_std",
            "inter_client_proto_std"]
    return md_table(head, [[ln.label, fmt_value(x), *_row_cells(row)] for ln in lines for x, row in zip(ln.x, ln.rows)])


def compare_table(rows: list[tuple[dict, Row]]) -> str:
    """One row per method of a `flare compare` (seeds aggregated): the primary accuracy first, then every rule and
    diagnostic at the last round, mean ± std when there are several seeds."""
    cols = acc_keys([r.rounds[-1] for _, row in rows for r in row.runs if r.rounds])
    finals = {r.final_label for _, row in rows for r in row.runs if r.rounds}
    acc_head = "acc (primary)" if finals <= {"last round"} else f"acc (primary; {', '.join(sorted(finals))})"
    head = ["method", "notes", "seeds", acc_head, "peak (round)"] + [c.removeprefix("acc_") for c in cols] + [
        "g_protos_std", "inter_client_proto_std"]
    body = []
    for preset, row in rows:
        _, acc, peak, *protos = _row_cells(row)
        body.append([row.label, preset.get("notes_name", ""), len(row.runs), f"{acc} ({row.runs[0].primary})", peak,
                     *(fmt_ms(*row.stat(c)[:2]) for c in cols), *protos])
    return md_table(head, body)


def points_table(points: list[tuple[str, Path, str, float | None]]) -> str:
    """A sweep's points: (name, run directory, status, seconds) → final and peak accuracy of each."""
    body = []
    for name, d, status, secs in points:
        run = RunData.load(d)
        best, at = run.peak("acc")  # (nan, None) without rounds
        acc = f"{100 * run.final('acc'):.2f}" if run.rounds else "—"
        peak = "—" if at is None else f"{100 * best:.2f} ({at})"
        body.append([name, status, acc, peak, "—" if secs is None else f"{secs:.1f}"])
    return md_table(["point", "status", "final acc", "peak acc (round)", "seconds"], body)


def seed_values(row: Row) -> dict:
    """{seed: final accuracy} of a row's finished runs."""
    return {r.seed: r.final("acc") for r in row.runs if r.rounds}


def paired_rows(rows: list[Row], baseline: str) -> list[list[str]]:
    """The cells of `paired_table`, one list per method other than the baseline."""
    base = next(row for row in rows if row.label == baseline)
    others = [row for row in rows if row is not base]
    tests = [paired(seed_values(row), seed_values(base)) for row in others]
    return [[row.label, baseline, t.n, "—" if math.isnan(t.mean) else f"{100 * t.mean:+.2f}", *cells]
            for row, t, cells in zip(others, tests, paired_cells(tests))]


PAIRED_HEAD = ["95 % CI", "p (paired t)", "p (Holm)", "difference"]  # the columns of `paired_cells`


def paired_cells(tests: list) -> list[list[str]]:
    """Each paired test's 95 % CI, raw and Holm-adjusted p (the list is the family) and verdict; — where it cannot
    be tested."""
    return [[f"[{100 * t.low:+.2f}, {100 * t.high:+.2f}]", f"{t.p:.3g}", f"{pa:.3g}", verdict(t, pa)] if t.testable
            else ["—", "—", "—", verdict(t, pa)] for t, pa in zip(tests, holm([t.p for t in tests]))]


def paired_table(rows: list[Row], baseline: str) -> str:
    """Every method against `baseline` (a row label), paired by seed: is the gap real?"""
    return md_table(["method", "vs", "paired seeds", "Δ acc (points)", *PAIRED_HEAD], paired_rows(rows, baseline))


def default_baseline(labels: list[str], asked: str | None = None) -> str | None:
    """The baseline a comparison tests against: the one asked for, else `fafi` when present, else the first."""
    if asked:
        return asked if asked in labels else None
    return "fafi" if "fafi" in labels else (labels[0] if labels else None)
