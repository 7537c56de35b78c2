"""`flare compare`'s report: one table row per method (the primary accuracy first, then every rule and
diagnostic; mean ± std over seeds when there are several) and the figures — every method's accuracy against
rounds, and the server diagnostics (`g_protos_std`, `inter_client_proto_std`) of every prototype method, in which
the notes' finding "alignment lowers g_protos_std" is seen at a glance. Reads the run directories only."""
from __future__ import annotations

from pathlib import Path

from flare.config import list_presets
from flare.report.figures import plot_accuracy_curves, plot_compare_diagnostics
from flare.report.fused import fused_table
from flare.report.runs import Row, protocols_line
from flare.report.tables import PAIRED_EXPLAIN, compare_table, default_baseline, paired_table
from flare.rundata import RunData
from flare.rundir import atomic_write_text

EXPLAIN = ("`acc` is the primary global predictor's test accuracy at the last round; `peak (round)` is the best round "
           "of the (seed-mean) curve, round r being the evaluation after r rounds of training. With several seeds every "
           "cell is mean ± std over them. One seed at this scale swings by several points from round to round (the "
           "figure shows the whole curve): read differences smaller than the std, or than that swing, as noise.")


def compare_title(run: RunData, seeds: list | None = None) -> str:
    c = run.cfg
    part = c.get("partition", {})
    R, E = c.get("rounds"), c.get("local_epochs")
    seed_text = f"seeds {', '.join(map(str, seeds))}" if seeds and len(seeds) > 1 else f"seed {c.get('seed')}"
    return (f"{c.get('dataset', {}).get('name')}, {c.get('num_clients')} clients, {part.get('kind')} "
            f"α={part.get('alpha')}, {R} round{'s' if R != 1 else ''} × {E} local epoch{'s' if E != 1 else ''}, "
            f"{run.models}, {seed_text}")


def compare_rows(methods: list[tuple[str, list[Path]]]) -> list[tuple[dict, Row]]:
    """(preset metadata, Row over its seeds' runs) per method, in order: what compare_table renders."""
    presets = list_presets()
    loaded = [(name, [RunData.load(d) for d in dirs]) for name, dirs in methods]
    return [(presets.get(name, {}), Row(name, runs[0].method, {}, runs)) for name, runs in loaded]


def compare_markdown(meta_rows: list[tuple[dict, Row]], baseline: str | None = None) -> str:
    """The comparison table, then (with several methods) each against the baseline, paired by seed."""
    rows = [row for _, row in meta_rows]
    table = compare_table(meta_rows)
    if fused := fused_table(rows):  # `flare fuse` ran over these runs: every server strategy on the same uploads
        table += ("\n\nServer strategies over the saved uploads (`flare fuse`; accuracy %, mean ± std over seeds):"
                  f"\n\n{fused}")
    base = default_baseline([r.label for r in rows], baseline)
    if base is None or len(rows) < 2:
        return table
    return f"{table}\n\nAgainst {base}, paired by seed:\n\n{paired_table(rows, base)}\n\n{PAIRED_EXPLAIN}"


def write_compare_report(methods: list[tuple[str, list[Path]]], out: Path,
                         baseline: str | None = None) -> tuple[str, str]:
    """compare.md, compare_accuracy.png and (for prototype methods) compare_diagnostics.png in `out`, from each
    method's run directories (one per seed); returns the title and the markdown (the table, and the paired tests
    against `baseline`: default fafi when compared, else the first method)."""
    meta_rows = compare_rows(methods)
    rows = [row for _, row in meta_rows]
    table = compare_markdown(meta_rows, baseline)
    title = compare_title(rows[0].runs[0], [r.seed for r in rows[0].runs])
    plot_accuracy_curves(rows, out / "compare_accuracy.png", title)
    figures = "![accuracy](compare_accuracy.png)\n"
    if plot_compare_diagnostics(rows, out / "compare_diagnostics.png", title):
        figures += "\n![diagnostics](compare_diagnostics.png)\n"
    proto = protocols_line([r for row in rows for r in row.runs])
    atomic_write_text(out / "compare.md", f"# Comparison — {title}\n\n{table}\n\n{proto}\n\n{EXPLAIN}\n\n{figures}")
    return title, table
