"""Server strategies over the same saved uploads (`flare fuse`), across methods and seeds: the table of one-shot
research — clients trained once per method and seed, every server scored on them.

`fused_table` gives each strategy's mean ± std over seeds per method (the clients' objective), with its mean wall
time; `fused_vs_table` tests every (strategy, clients) cell against one reference cell — e.g. FAFI's own server
(`feature`) over FAFI clients — paired by seed, Holm-adjusted over the table (report/tables.py explains
the test). A strategy the run itself evaluated (its last round's `acc_<name>`) counts as fused too, so a run's
built-in rules need no second pass."""
from __future__ import annotations

import math

import numpy as np

from flare.report.runs import Row
from flare.report.tables import PAIRED_HEAD, fmt_ms, md_table, paired_cells
from flare.stats import paired


def fused_values(row: Row, strategy: str) -> dict:
    """{seed: accuracy} of `strategy` over each of the row's finished runs: its fuse record, else the run's own last
    round."""
    out = {}
    for r in row.runs:
        rec = next((f for f in r.fused if f.get("strategy") == strategy), None)
        if rec is not None:
            out[r.seed] = float(rec["acc"])
        elif r.rounds and r.rounds[-1].get(f"acc_{strategy}") is not None:
            out[r.seed] = float(r.rounds[-1][f"acc_{strategy}"])
    return out


def _seconds(rows: list[Row], strategy: str) -> float:
    s = [float(f["seconds"]) for row in rows for r in row.runs for f in r.fused
         if f.get("strategy") == strategy and f.get("seconds") is not None]
    return float(np.mean(s)) if s else math.nan


def fused_table(rows: list[Row], strategies: list[str] | None = None) -> str | None:
    """| strategy | <method> … | s per run |: accuracy (%) mean ± std over seeds; None when nothing was fused."""
    strategies = strategies or list(dict.fromkeys(f["strategy"] for row in rows for r in row.runs for f in r.fused))
    if not strategies:
        return None
    body = []
    for s in strategies:
        values = [list(fused_values(row, s).values()) for row in rows]
        cells = ["—" if not v else fmt_ms(float(np.mean(v)), float(np.std(v, ddof=1)) if len(v) > 1 else math.nan)
                 for v in values]
        sec = _seconds(rows, s)
        body.append([s, *cells, "—" if math.isnan(sec) else f"{sec:.1f}"])
    return md_table(["strategy", *[row.label for row in rows], "s per run"], body)


def fused_vs_table(rows: list[Row], strategies: list[str], base_row: str, base_strategy: str) -> str:
    """Every (strategy, clients) against `base_strategy` over `base_row`'s clients, paired by seed."""
    base = next(row for row in rows if row.label == base_row)
    ref = fused_values(base, base_strategy)
    cells = [(s, row) for s in strategies for row in rows if not (s == base_strategy and row is base)
             and fused_values(row, s)]
    tests = [paired(fused_values(row, s), ref) for s, row in cells]
    body = [[s, row.label, t.n, f"{100 * t.mean:+.2f}", *c]
            for (s, row), t, c in zip(cells, tests, paired_cells(tests))]
    head = ["strategy", "clients", "paired seeds", f"Δ vs {base_strategy} on {base_row} (points)", *PAIRED_HEAD]
    return md_table(head, body)
