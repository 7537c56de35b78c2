"""The reproduction report of `flare paper --only reproduce`: the notes' CIFAR-10 table under protocol clean and
reference beside the notes' numbers of the matching setting, the one-item protocol ablation, and the figure of
every fusion rule against rounds for FAFI and FLARE.

It reads only `reproduce.json` (what each point stands for, and the command that made them) and the run
directories it names, so it works on a partial reproduction too (missing runs show as "—" and are counted).

    from flare_paper.reproduction import reproduction_markdown, write_reproduction_report
    md = reproduction_markdown("runs/reproduce-full", image_dir="docs/figures")   # for the README generator
    path = write_reproduction_report("runs/reproduce-full")    # <out>/report/reproduction.md (+ its figure)
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np

from flare.errors import FlareError
from flare.report.figures import integer_rounds, rounds_axis, save_figure, wrap_title
from flare.report.runs import Row
from flare.report.style import method_label, rule_colour
from flare.report.tables import fmt_ms, md_table
from flare.rundata import RunData
from flare.rundir import atomic_write_text

from flare_paper.reference import REFS, Ref, matches
from flare_paper.reference import SETTINGS as NOTE_SETTINGS

# The notes' fusion rules in the reproduction's figure, each with its line style (the colour is the strategy's).
RULE_STYLE = {"feature": "-", "iffi": "--", "iffi_reference": ":", "output": "-."}

MANIFEST = "reproduce.json"
REPORT = "reproduction.md"
FIGURE = "reproduction_rules.png"
COLUMNS = ("clean", "reference", "reference-later")
COLUMN_TITLE = {"clean": "clean", "reference": "reference · first batch", "reference-later": "reference · later batch"}
RULES = {"fedavg": ("fedavg",), "ensemble": ("output",),
         "default": ("feature", "iffi", "iffi_reference", "output")}
RULE_TITLE = {"feature": "feature (primary)", "iffi": "IFFI", "iffi_reference": "IFFI (seeds' code = uniform)",
              "output": "output", "fedavg": "FedAvg (primary)"}


def load_manifest(out: str | Path) -> dict:
    p = Path(out) / MANIFEST
    if not p.is_file():
        raise FlareError(f"'{out}' holds no {MANIFEST}: it is not the output of `flare paper --only reproduce`.",
                         key="--out", fix="give the --out directory of `flare paper --only reproduce`.")
    return json.loads(p.read_text())


class _Runs:
    """The manifest's points with their run directories read back (runs without a round are left out)."""

    def __init__(self, out: Path, doc: dict):
        self.points = doc["points"]
        self.data: dict[str, RunData] = {}
        for p in self.points:
            d = Path(p["dir"])
            d = d if d.is_absolute() or d.exists() else out / d
            if p["dir"] not in self.data:
                self.data[p["dir"]] = RunData.load(d)

    def row(self, **want) -> Row | None:
        runs, seen = [], set()
        for p in self.points:
            if all(p.get(k) == v for k, v in want.items()) and p["dir"] not in seen:
                seen.add(p["dir"])
                r = self.data[p["dir"]]
                if r.rounds:
                    runs.append(r)
        return Row(want.get("preset", ""), want.get("preset", ""), {}, runs) if runs else None

    def config(self, **want) -> dict | None:
        """The (flat, trimmed) config the manifest records for the first point matching `want`."""
        return next((p.get("config") for p in self.points if all(p.get(k) == v for k, v in want.items())), None)

    def finished(self) -> tuple[int, int]:
        return sum(1 for r in self.data.values() if r.finished), len(self.data)


def _cell(row: Row | None, key: str) -> str:
    if row is None:
        return "—"
    m, sd, n = row.stat(key)
    return f"{fmt_ms(m, sd)} (n={n})" if n else "—"


def _notes(config: dict | None, rule: str, strict: bool) -> list[Ref]:
    """The notes' numbers in the setting of a point (its flat config from the manifest; strict: R, E, batch and
    seed must match too, not only the partition, the annealing and the keys a number names)."""
    if not config:
        return []
    out = []
    for ref in REFS:
        if ref.rule != rule or ref.metric != "final":
            continue
        flat = dict(config)
        if not strict:  # compare the setting, not the scale
            flat.update(ref.where.keys)
        if matches(ref, flat, str(config.get("preset"))):
            out.append(ref)
    return out


def _main_table(runs: _Runs, alpha: float, present: list[str], strict: bool) -> str:
    head = ["method", "rule"] + [COLUMN_TITLE[c] for c in present] + ["notes · first batch", "notes · later batch"]
    body = []
    methods = list(dict.fromkeys(p["preset"] for p in runs.points if p["role"] == "main"))
    for m in methods:
        rows = {c: runs.row(role="main", setting=c, preset=m, alpha=alpha) for c in present}
        configs = {c: runs.config(role="main", setting=c, preset=m, alpha=alpha) for c in present}
        rules = RULES.get(m, RULES["default"])
        for rule in rules:
            key = "acc" if rule == rules[0] else f"acc_{rule}"  # the first rule listed is the method's primary
            notes = {}
            for batch, cols in (("first", ("reference",)), ("later", ("reference-later", "clean"))):
                cfg = next((configs[c] for c in cols if configs.get(c)), None)
                refs = [r for r in _notes(cfg, "primary" if key == "acc" else rule, strict)
                        if r.setting.startswith(batch)]
                notes[batch] = "; ".join(f"{r.value:.2f}" + (f" ({r.note})" if r.note else "") for r in refs) or "—"
            body.append([method_label(m), RULE_TITLE.get(rule, rule)] + [_cell(rows[c], key) for c in present]
                        + [notes["first"], notes["later"]])
    return md_table(head, body)


def _ablation(runs: _Runs, alpha: float) -> tuple[str, str]:
    """The one-item ablation table and its one-line summary (the item with the largest mean |Δ|)."""
    abl = [p for p in runs.points if p["role"] == "ablation"]
    keyed: dict[tuple, dict] = {}
    for p in abl:
        keyed.setdefault((p["item"], p["preset"]), {})[p["from"]] = p
    body, effect = [], {}
    for (item, preset), by_from in keyed.items():
        cells = [f"`{item}`", method_label(preset)]
        for base in ("clean", "reference"):
            p = by_from.get(base)
            if p is None:
                cells += ["—", "—", "—"]
                continue
            b = runs.row(role="main", setting=base, preset=preset, alpha=alpha)
            f = runs.row(role="ablation", item=item, preset=preset, **{"from": base})
            bm, fm = (b.stat("acc")[0] if b else math.nan), (f.stat("acc")[0] if f else math.nan)
            d = 100 * (fm - bm)
            if not math.isnan(d):
                effect.setdefault(item, []).append(abs(d))
            cells += [_cell(b, "acc"), f"{_cell(f, 'acc')} ({_fmt(p['value'])})",
                      "—" if math.isnan(d) else f"{d:+.2f}"]
        body.append(cells)
    table = md_table(["item", "method", "clean", "clean + item", "Δ (points)", "reference",
                      "reference − item", "Δ (points)"], body)
    if not effect:
        return table, "No ablation run has finished a round yet."
    ranked = sorted(effect.items(), key=lambda kv: -float(np.mean(kv[1])))
    line = ("Mean |Δ| over methods and both directions: "
            + ", ".join(f"`{k}` {np.mean(v):.2f}" for k, v in ranked)
            + f". The item that moves the numbers most here: `{ranked[0][0]}`.")
    return table, line


def _fmt(v) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def reproduction_markdown(out: str | Path, image_dir: str | Path | None = None) -> str:
    """The reproduction's markdown (table, ablation, figure, protocol labels, the command). Draws the figure into
    `image_dir` (default <out>/report) and links it relative to that directory's name when given."""
    out = Path(out)
    doc = load_manifest(out)
    runs = _Runs(out, doc)
    img = Path(image_dir) if image_dir is not None else out / "report"
    img.mkdir(parents=True, exist_ok=True)
    full = doc.get("scale") == "full"
    present = [c for c in COLUMNS if any(p.get("setting") == c for p in runs.points)]
    alphas = sorted({p["alpha"] for p in runs.points if p["role"] == "main"})
    done, total = runs.finished()
    hard = min((p["alpha"] for p in runs.points if p["role"] == "ablation"), default=min(alphas or [0.05]))
    md = [f"## Reproducing the notes: protocol clean vs reference ({doc.get('dataset')}, scale `{doc.get('scale')}`)",
          "", f"Made by `{doc.get('command')}`; {done} of {total} runs finished.", "",
          "Columns (each run's config.yaml holds its protocol; `flare.config.protocol` lists the items):", ""]
    for c in present:
        labels = sorted({runs.data[p["dir"]].protocol for p in runs.points if p.get("setting") == c
                         and runs.data[p["dir"]].cfg})
        md.append(f"- **{COLUMN_TITLE[c]}**: {doc['settings'][c]}; protocol label(s): "
                  + (", ".join(f"`{x}`" for x in labels) or "no run yet"))
    md += ["", "Notes' columns: " + " · ".join(f"**{s.label}**: {s.text}" for k, s in NOTE_SETTINGS.items()
                                               if k in ("first", "later")), ""]
    if not full:
        md += ["At this scale (not the notes' model and data) the notes' numbers are for orientation only: they are "
               "matched on the setting (partition, annealing, keys), not on R, E or the data.", ""]
    md += ["Final accuracy (%), mean ± std over seeds (n = seeds), of the last round; `—`: not run (yet).", ""]
    for a in alphas:
        md += [f"### α = {a:g}", "", _main_table(runs, a, present, strict=full), ""]
    table, line = _ablation(runs, hard)
    md += [f"### One-item protocol ablation, α = {hard:g}", "",
           "Each item flipped alone: from the clean setting to the item's reference value, and from the reference "
           "setting (first batch) to its clean value; methods the item cannot change are not run. Primary "
           "accuracy; Δ = flipped − base.", "", table, "", line, ""]
    planned = {p["preset"] for p in runs.points if p["role"] == "main"}
    shown = [m for m in ("fafi", "flare") if m in planned]
    panels = [(f"{method_label(m)} — {COLUMN_TITLE[c]}", runs.row(role="main", setting=c, preset=m, alpha=hard))
              for c in present for m in shown]
    if panels and plot_rule_panels(panels, len(shown), img / FIGURE, f"every fusion rule against rounds, α = {hard:g}, "
                                                 f"{doc.get('dataset')} (scale {doc.get('scale')})", RULE_STYLE):
        rel = f"{img.name}/{FIGURE}" if image_dir is not None else FIGURE
        md += [f"### Every fusion rule against rounds, α = {hard:g}", "", f"![fusion rules]({rel})", ""]
    return "\n".join(md)


def write_reproduction_report(out: str | Path) -> Path:
    """<out>/report/reproduction.md (and its figure) from <out>/reproduce.json and the runs it names."""
    out = Path(out)
    md = reproduction_markdown(out)
    path = out / "report" / REPORT
    atomic_write_text(path, "# Reproduction report\n\n" + md + "\n")
    return path


def plot_rule_panels(panels: list[tuple[str, Row | None]], ncols: int, path: Path, title: str,
                     rules: dict[str, str]) -> bool:
    """A grid of panels (row-major, `ncols` per line), each the accuracy of the fusion rules `rules` (rule →
    matplotlib line style; each in its strategy's colour) against rounds for one row of runs (seed mean; a band of
    ± std with several seeds). Returns False when no panel has a round."""
    live = [(t, r) for t, r in panels if r is not None and r.curves("acc").size]
    if not live:
        return False
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.4 * nrows), squeeze=False, sharey=True)
    for ax, (t, row) in zip(axes.flat, panels):
        ax.set_title(wrap_title(t, 48), fontsize=9)
        ax.grid(alpha=0.3)
        if row is None or not row.curves("acc").size:
            ax.text(0.5, 0.5, "not run (yet)", ha="center", va="center", transform=ax.transAxes)
            ax.set_xticks([])
            continue
        for rule, ls in rules.items():
            k = f"acc_{rule}"
            c = row.curves(k)
            if not c.size or np.isnan(c).all():
                continue
            x = rounds_axis(row, c.shape[1])
            with np.errstate(all="ignore"):
                m = 100 * np.nanmean(c, axis=0)
            ax.plot(x, m, ls, color=rule_colour(rule), label=rule)
            if c.shape[0] > 1:
                sd = 100 * np.nanstd(c, axis=0, ddof=1)
                ax.fill_between(x, m - sd, m + sd, alpha=0.15, color=rule_colour(rule), lw=0)
        integer_rounds(ax)
        ax.set_xlabel("round")
    for ax in axes[:, 0]:
        ax.set_ylabel("test accuracy (%)")
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    handles, labels = next(((h, lab) for h, lab in (a.get_legend_handles_labels() for a in axes.flat) if h), ([], []))
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), title="fusion rule")
    fig.suptitle(wrap_title(title, 110), fontsize=10)
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    save_figure(fig, path, dpi=110)
    return True
