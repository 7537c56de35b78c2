"""The paper suite's report (`flare paper`): Tables 1–3, Figures 1–3, the λ0 and α sweeps and the server
strategies, with the notes' reference numbers beside ours at `--scale full`. It reads run directories only;
`paper.suite` plans and runs them and hands over, per experiment, each point's values and directory."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from flare.report.figures import (plot_acc_lambda_raw, plot_accuracy_curves, plot_label_distributions,
                                  plot_lambda_eff, plot_param_sweep)
from flare.report.fused import fused_table
from flare.report.runs import Row, SweepLine, describe_setting, protocols_line
from flare.report.tables import (PAIRED_EXPLAIN, default_baseline, fmt_big, fmt_ms, md_table, paired_rows,
                                 strategy_table, sweep_table)
from flare.rundata import RunData
from flare.rundir import atomic_write_text

from flare_paper.reference import REFERENCE_NOTE, REFS, SETTINGS, Ref, matches, references_for


@dataclass
class PaperScale:
    """What the report needs to know of a scale."""

    name: str
    description: str
    references: bool
    table1_alphas: list[float]
    hard_alpha: float


@dataclass
class PaperRuns:
    """One experiment of the suite: each point's swept values and run directory (points shared between experiments
    appear in each), and the run time its points took."""

    key: str
    title: str
    description: str
    dataset: str | None
    seeds: list[int]
    points: list[tuple[dict, Path]] = field(default_factory=list)
    seconds: float = 0.0
    names: dict[str, str] = field(default_factory=dict)  # preset -> its role here (Table 2: what FLARE lacks)


def _load_all(exps: list[PaperRuns]) -> dict[str, RunData]:
    """Every run directory the report names, read once (experiments share directories)."""
    return {str(d): RunData.load(d) for e in exps for _, d in e.points}


def _runs(points: list[tuple[dict, Path]], loaded: dict[str, RunData]) -> list[tuple[dict, RunData]]:
    out = []
    for values, d in points:
        r = loaded[str(d)]
        if r.rounds:
            out.append((values, r))
    return out


def _rows(pairs, by: tuple[str, ...]) -> dict[tuple, Row]:
    """Rows keyed by the given point values (seeds aggregated), in first-seen order."""
    rows: dict[tuple, Row] = {}
    for values, run in pairs:
        k = tuple(values.get(b) for b in by)
        if k not in rows:
            rows[k] = Row(str(values.get("preset", run.method)), run.method, {}, [])
        rows[k].runs.append(run)
    return rows


def _label(row: Row, protocol: bool = False) -> str:
    n = row.notes_name
    out = f"{row.method} · {n}" if n else row.method
    return out + (f" ({row.runs[0].protocol})" if protocol and row.runs else "")


def _preset(run: RunData) -> str:
    return str(run.cfg.get("preset") or run.method)


def _refs(row: Row | None, rule: str = "primary", metric: str = "final") -> list[Ref]:
    """The notes' numbers in the setting of a row's runs (like with like: reference.matches)."""
    if row is None or not row.runs:
        return []
    r = row.runs[0]
    return references_for(r.flat, _preset(r), rule, metric)


def _with_ref(text: str, refs: list[Ref], show: bool) -> str:
    """`ours [notes X, its setting]` for every notes' number in the row's setting."""
    if not show or not refs:
        return text
    return text + "".join(f" [notes {r.value:.2f}, {r.label()}]" for r in refs)


def _paired_section(rows: dict[tuple, Row], methods: list[tuple], cols: list[tuple], baseline: str | None) -> list[str]:
    """Table 1's methods against the baseline within each column (dataset, α) and protocol, paired by seed."""
    body = []
    for proto in dict.fromkeys(p for _, p in methods):
        names = [m for m, p in methods if p == proto]
        base = default_baseline(names, baseline)
        for d, a in cols:
            present = [Row(m, rows[(m, proto, d, a)].method, {}, rows[(m, proto, d, a)].runs) for m in names
                       if (m, proto, d, a) in rows]
            if base is None or len(present) < 2 or base not in [r.label for r in present]:
                continue
            body += [[f"{d} α={a:g}" + (f" ({proto})" if proto != "clean" else "")] + cells
                     for cells in paired_rows(present, base)]
    if not body:
        return []
    head = ["setting", "method", "vs", "paired seeds", "Δ acc (points)", "95 % CI", "p (paired t)", "p (Holm)",
            "difference"]
    return ["### Table 1, each method against the baseline, paired by seed", "", md_table(head, body), "",
            PAIRED_EXPLAIN + " Holm's adjustment runs within each setting.", ""]


def _fused_section(rows: dict[tuple, Row], methods: list[tuple], cols: list[tuple]) -> list[str]:
    """`flare paper --strategies`: every fused server strategy over Table 1's clients, per setting."""
    md = []
    for d, a in cols:
        present = [Row(m + (f" ({p})" if p not in (None, "clean") else ""), rows[(m, p, d, a)].method, {},
                       rows[(m, p, d, a)].runs) for m, p in methods if (m, p, d, a) in rows]
        table = fused_table(present)
        if table:
            md += [f"#### {d} α={a:g}", "", table, ""]
    if not md:
        return []
    return (["### Table 1's clients under every server strategy (`flare fuse`)", "",
             "Accuracy (%) of each strategy over the saved clients of each method, mean ± std over seeds, and its "
             "mean wall time per run.", ""] + md)


def write_paper_report(scale: PaperScale, datasets: list[str], exps: list[PaperRuns], out: Path, wall: float,
                       failed: dict, baseline: str | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    E = {e.key: e for e in exps}
    loaded = _load_all(exps)
    show = scale.references
    md = [f"# FLARE paper suite — scale `{scale.name}`", "",
          f"{scale.description}. Datasets: {', '.join(datasets)}; seeds: "
          f"{', '.join(str(s) for s in E['table1'].seeds or [])}. Accuracies are the primary global "
          "predictor's final test accuracy in % (mean ± std over seeds where there are several). "
          + ("Beside each of our numbers, in brackets, the notes' number for the same setting, with that setting "
             "(partition, annealing, R × E: `paper/reference.py`); none where the notes have no number in the "
             "run's setting." if show else
             "The notes' reference numbers are shown at `--scale full` only: other scales use other models and data "
             "sizes."), ""]
    every = [r for e in exps for _, r in _runs(e.points, loaded)]
    if every:
        md += [protocols_line(every), ""]
    several = len({r.protocol for r in every}) > 1  # then every row names its protocol
    if failed:
        md += ["**Runs that did not finish:** " + "; ".join(f"`{n}` ({r['status']})" for n, r in failed.items()), ""]

    # Table 1 -------------------------------------------------------------------------------
    t1 = _runs(E["table1"].points, loaded)
    rows = _rows(t1, ("preset", "protocol", "dataset.name", "partition.alpha"))
    cols = [(d, a) for d in datasets for a in scale.table1_alphas]
    methods = list(dict.fromkeys((v.get("preset"), v.get("protocol")) for v, _ in t1))
    head = ["method"] + [f"{d} α={a:g}" for d, a in cols]
    body = []
    for m, proto in methods:
        any_row = next((rows[k] for k in rows if k[:2] == (m, proto)), None)
        cells = [_label(any_row, several) if any_row else m]
        for d, a in cols:
            row = rows.get((m, proto, d, a))
            cells.append(_with_ref(fmt_ms(*row.stat("acc")[:2]), _refs(row), show) if row else "—")
        body.append(cells)
    md += ["## Table 1 — final accuracy (%) across datasets and α", "", md_table(head, body), ""]
    md += _paired_section(rows, methods, cols, baseline)
    md += _fused_section(rows, methods, cols)

    # Figure 1 ------------------------------------------------------------------------------
    hard = E["ablation"].dataset
    a = scale.hard_alpha
    fig1_rows = [r for k, r in rows.items() if k[2] == hard and k[3] == a]
    for r in fig1_rows:
        r.label = _label(r, several)
    if fig1_rows:
        title = f"Figure 1 — accuracy against rounds, {describe_setting(fig1_rows[0].runs[0])}"
        plot_accuracy_curves(fig1_rows, out / "figure1_accuracy.png", title)
        md += [f"## Figure 1 — accuracy against rounds ({hard}, α={a:g})", "",
               "![Figure 1](figure1_accuracy.png)", ""]

    # Table 2 -------------------------------------------------------------------------------
    ab = _runs(E["ablation"].points, loaded)
    ab_rows = list(_rows(ab, ("preset", "protocol")).values())
    names = E["ablation"].names
    body = []
    for row in ab_rows:
        pk, pr, psd = row.peak()
        body.append([names.get(row.method, _label(row)) + (f" ({row.runs[0].protocol})" if several else ""),
                     row.method, _with_ref(fmt_ms(*row.stat("acc")[:2]), _refs(row), show),
                     f"{fmt_ms(pk, psd)} ({pr})", fmt_ms(*row.stat("g_protos_std")[:2], pct=False),
                     fmt_ms(*row.stat("inter_client_proto_std")[:2], pct=False)])
    sub = "" if hard in ("cifar100",) else " (the notes ran it on CIFAR-100; not in this run's datasets)"
    md += [f"## Table 2 — ablation on {hard}, α={a:g}{sub}", "",
           md_table(["variant", "preset", "final acc (%)", "peak acc (%) (round)", "g_protos_std",
                        "inter_client_proto_std"], body), ""]

    # Figure 2 ------------------------------------------------------------------------------
    for r in ab_rows:
        r.label = _label(r)
    learned = [r for r in ab_rows if r.method == "flare"] or [r for r in ab_rows if r.runs[0].learner != "none"]
    v7 = [r for r in ab_rows if r.method == "etf-anneal"]
    if learned and ab_rows and plot_lambda_eff(learned, out / "figure2_lambda_eff.png",
                                                  f"Figure 2 — learned λ_eff vs V7's schedule, "
                                                  f"{describe_setting(learned[0].runs[0])}", v7):
        md += ["## Figure 2 — FLARE's learned λ_eff against rounds, beside V7's λ0(1 − p)", "",
               "![Figure 2](figure2_lambda_eff.png)", ""]

    # Table 3 / Figure 3 --------------------------------------------------------------------
    rb = _runs(E["robustness"].points, loaded)
    rb_rows = list(_rows(rb, ("preset", "protocol")).values())
    robust = E["robustness"].dataset
    for r in rb_rows:
        r.label = _label(r, several)
    body = []
    for row in rb_rows:
        pk, pr, psd = row.peak()
        lam = row.stat("lambda_raw")
        body.append([row.label, _with_ref(f"{fmt_ms(pk, psd)} ({pr})", _refs(row, metric="peak"), show),
                     _with_ref(fmt_ms(*row.stat("acc")[:2]), _refs(row), show),
                     fmt_big(lam[0])])
    sub = "" if robust == "svhn" else " (the notes ran it on SVHN; not in this run's datasets)"
    md += [f"## Table 3 — robustness on {robust}, α={a:g}{sub}", "",
           md_table(["method", "peak acc (%) (round)", "final acc (%)", "final λ_raw (mean over clients)"], body),
           ""]
    if rb_rows and plot_acc_lambda_raw(rb_rows, out / "figure3_acc_lambda_raw.png",
                                          f"Figure 3 — V12 vs FLARE, {describe_setting(rb_rows[0].runs[0])}"):
        md += ["## Figure 3 — accuracy and raw λ against rounds", "", "![Figure 3](figure3_acc_lambda_raw.png)", ""]

    # λ0 and α sweeps -----------------------------------------------------------------------
    for key, param, fname in (("lambda0", "align.lambda0", "sweep_lambda0.png"),
                              ("alpha", "partition.alpha", "sweep_alpha.png")):
        pairs = _runs(E[key].points, loaded)
        if not pairs:
            continue
        by_m: dict[tuple, list] = {}
        for v, r in pairs:
            by_m.setdefault((v.get("preset"), v.get("protocol")), []).append((v, r))
        lines = []
        for (m, _), prs in by_m.items():
            xs = sorted({float(v[param]) for v, _ in prs})
            rws = [Row(m, m, {}, [r for v, r in prs if float(v[param]) == x]) for x in xs]
            lines.append(SweepLine(_label(rws[0], several), xs, rws))
        ds = E[key].dataset
        if not any(len(ln.x) > 1 for ln in lines):
            md += [f"## {E[key].title} on {ds}", "", "Not run yet (fewer than two values exist).", ""]
            continue
        plot_param_sweep(param, lines, out / fname, f"{E[key].title} — {describe_setting(pairs[0][1])}")
        table = sweep_table(param, lines)
        if show:
            table = _ref_column(table, lines)
        md += [f"## {E[key].title} on {ds}", "", table, "", f"![{E[key].title}]({fname})", ""]

    # server strategies ---------------------------------------------------------------------
    md += ["## Server strategies — simple (feature) fusion vs IFFI, final accuracy (%)", "",
           "Every run evaluates every fusion rule on the same client models, so this needs no runs of its own. "
           "`IFFI (seeds' code = uniform)` is the notes' IFFI (docs/method.md#built-in-rules).", ""]
    for (d, al) in cols:
        srows = [r for k, r in rows.items() if k[2] == d and k[3] == al]
        for r in srows:
            r.label = _label(r, several)
        st = strategy_table(srows)
        if st:
            md += [f"### {d}, α={al:g}", "", st, ""]

    # label distributions, references, timing ----------------------------------------------
    if plot_label_distributions(every, out / "label_distribution.png"):
        md += ["## Label distributions", "", "![label distribution](label_distribution.png)", ""]
    if show:
        md += ["## Reference numbers of the notes, each with its setting", "", _reference_table(exps, loaded), "",
               REFERENCE_NOTE, ""]
    md += ["## Runs and time", "", f"{len({str(d) for e in exps for _, d in e.points})} distinct runs; this "
           f"invocation took {wall / 60:.1f} min (runs finished earlier were not recomputed).", ""]
    for e in exps:
        md.append(f"- `{e.key}` ({e.description}): {len(e.points)} points, "
                  f"{e.seconds / 60:.1f} min of run time (shared runs counted in each)")
    md += ["", "The sweep files are in `../sweeps/`; `flare report` on the run directories gives the generic "
               "report.", ""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(md))
    return path


def _ref_column(table: str, lines: list[SweepLine]) -> str:
    """Add the notes' numbers in each row's setting to a sweep table."""
    out = table.splitlines()
    out[0] += " notes (final acc %, setting) |"
    out[1] += " --- |"
    i = 2
    for ln in lines:
        for row in ln.rows:
            refs = _refs(row)
            out[i] += f" {'; '.join(f'{r.value:.2f} ({r.label()})' for r in refs) or '—'} |"
            i += 1
    return "\n".join(out)


def reference_table(runs: list[RunData]) -> str:
    """Every notes' number with its setting, and ours from the runs in that setting (per protocol), like with
    like; "no run in this setting" otherwise."""
    body = []
    for ref in sorted(REFS, key=lambda r: (r.dataset, r.setting, r.alpha, r.preset, r.keys)):
        mine: dict[str, Row] = {}
        for r in runs:
            if r.rounds and matches(ref, r.flat, _preset(r)):
                mine.setdefault(r.protocol, Row(r.method, r.method, {}, [])).runs.append(r)
        vals = []
        for proto, row in mine.items():
            if ref.metric == "peak":
                v = fmt_ms(*row.peak()[::2])
            else:
                v = fmt_ms(*row.stat("acc" if ref.rule == "primary" else f"acc_{ref.rule}")[:2])
            vals.append(f"{v} ({proto}, n={len(row.runs)})")
        body.append([ref.dataset, f"{ref.alpha:g}", ref.preset, ref.rule, ref.metric, ref.label(), f"{ref.value:.2f}",
                     "; ".join(vals) or "no run in this setting"])
    legend = ["", "Settings: " + " · ".join(f"**{s.label}**: {s.text}" for s in SETTINGS.values())]
    return md_table(["dataset", "α", "preset", "rule", "metric", "setting", "notes", "ours (protocol, seeds)"],
                    body) + "\n".join(legend)


def _reference_table(exps: list[PaperRuns], loaded: dict[str, RunData]) -> str:
    seen, runs = set(), []
    for e in exps:
        for _, r in _runs(e.points, loaded):
            if str(r.dir) not in seen:
                seen.add(str(r.dir))
                runs.append(r)
    return reference_table(runs)
