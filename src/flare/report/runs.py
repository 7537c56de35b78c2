"""Grouping run directories for reports: which runs share a setting, which form a row (a method, seeds
aggregated), which form a parameter sweep.

* a **section** per distinct *setting* — the data/protocol keys (dataset.*, partition.*, model.*, num_clients,
  rounds, local_epochs, batch_size) that differ between the runs;
* inside a section a **row** per method (`method`, i.e. the preset) plus the keys that vary between runs of the
  same method (e.g. `align.lambda0` of a λ0 sweep), aggregated over seeds (mean ± std);
* a **parameter sweep** for every numeric key that takes ≥ 2 values with everything else equal (λ0, α, ...)."""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from flare.config.protocol import ITEM_KEYS
from flare.errors import FlareError
from flare.report.style import method_order
from flare.rundata import RunData, num, peak_index

IGNORE = {"seed", "description", "notes_name", "device", "dataset.root", "dataset.cache_dir", "dataset.download",
          "dataset.format", "logging.tensorboard", "amp", "channels_last", "compile", "client_engine", "preset",
          "method", "test_batch_size", "eval.noise_seed"} | set(ITEM_KEYS)  # items: in the `protocol` label
SETTING_KEYS = {"num_clients", "rounds", "local_epochs", "batch_size"}
SETTING_PREFIXES = ("dataset.", "partition.", "model.")


def is_setting(key: str) -> bool:
    return (key in SETTING_KEYS or key.startswith(SETTING_PREFIXES)) and key != "dataset.public_size"


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", s).strip("-")[:80] or "x"


# ----------------------------------------------------------------------------------------------
# runs


def discover(paths: Iterable[str | Path]) -> list[Path]:
    """Run directories among `paths`: a path that is one, or every one below a path (reports skipped)."""
    found: list[Path] = []
    for p in paths:
        p = Path(p)
        if not p.exists():
            raise FlareError(f"'{p}' does not exist.", key="DIR", fix="give run directories or folders holding them.")
        if (p / "config.yaml").exists() and (p / "metrics.jsonl").exists():
            found.append(p)
            continue
        found += [c.parent for c in sorted(p.rglob("config.yaml")) if (c.parent / "metrics.jsonl").exists()]
    unique: dict[Path, Path] = {}
    for d in found:
        unique.setdefault(d.resolve(), d)
    return list(unique.values())


def load_runs(paths: Iterable[str | Path]) -> list[RunData]:
    dirs = discover(paths)
    if not dirs:
        raise FlareError("no run directories found (a run directory holds config.yaml and metrics.jsonl).",
                         key="DIR", fix="give the --out directories of `flare run`, `compare`, `sweep` or `paper`.")
    return [RunData.load(d) for d in dirs]


def varying_keys(runs: list[RunData]) -> list[str]:
    keys = sorted({k for r in runs for k in r.flat} - IGNORE)
    return [k for k in keys if len({repr(r.flat.get(k)) for r in runs}) > 1]


def short_key(k: str) -> str:
    return k.split(".")[-1]


def fmt_value(v: Any) -> str:
    return format(v, "g") if isinstance(v, float) else str(v)


def protocols_line(runs: list[RunData]) -> str:
    """Which protocol produced the runs of a report: e.g. "Protocol: clean (4 runs), reference (4 runs)."."""
    counts = Counter(r.protocol for r in runs)
    parts = [f"`{p}` ({n} run{'s' if n > 1 else ''})" for p, n in counts.items()]
    return "Protocol (config/protocol.py, docs/reproduction.md): " + ", ".join(parts) + "."


def describe_setting(r: RunData) -> str:
    c = r.cfg
    ds, part = c.get("dataset", {}), c.get("partition", {})
    p = f"{part.get('kind')}"
    if part.get("kind") == "dirichlet":
        p = f"α={fmt_value(part.get('alpha'))}"
    elif part.get("kind") in ("dirichlet-fafi", "noniid-labeldir"):
        p = f"{part.get('kind')} α={fmt_value(part.get('alpha'))}"
    elif part.get("kind") == "shards":
        p = f"shards({part.get('shards_per_client')})"
    sub = ""
    if ds.get("train_subset") or ds.get("test_subset"):
        sub = f" ({ds.get('train_subset') or 'all'}/{ds.get('test_subset') or 'all'} samples)"
    return (f"{ds.get('name')}{sub}, {p}, {c.get('num_clients')} clients, R={c.get('rounds')}×E={c.get('local_epochs')}, "
            f"{r.models}")


@dataclass
class Row:
    label: str
    method: str
    variant: dict
    runs: list[RunData]

    @property
    def notes_name(self) -> str:
        return self.runs[0].notes_name

    @property
    def seeds(self) -> list:
        return sorted({r.seed for r in self.runs}, key=str)

    def curves(self, key: str = "acc") -> np.ndarray:
        """seeds × rounds (truncated to the shortest run)."""
        cs = [r.curve(key) for r in self.runs if r.rounds]
        if not cs:
            return np.zeros((0, 0))
        n = min(len(c) for c in cs)
        return np.stack([c[:n] for c in cs])

    def client_mean_curves(self, key: str) -> np.ndarray | None:
        """seeds × rounds of the per-round mean over clients."""
        cs = [c for r in self.runs if r.rounds and (c := r.client_curve(key)) is not None]
        if not cs:
            return None
        n = min(len(c) for c in cs)
        with np.errstate(all="ignore"):
            return np.stack([_nanmean_rows(c[:n]) for c in cs])

    def stat(self, key: str) -> tuple[float, float, int]:
        vals = np.array([r.final(key) for r in self.runs if r.rounds], dtype=float)
        vals = vals[~np.isnan(vals)]
        if not len(vals):
            return float("nan"), float("nan"), 0
        return float(vals.mean()), float(vals.std(ddof=1)) if len(vals) > 1 else float("nan"), len(vals)

    def peak(self) -> tuple[float, int | None, float]:
        """Peak of the seed-mean accuracy curve, its round, and the std over seeds at that round."""
        c = self.curves("acc")
        if c.size == 0 or np.isnan(c).all():
            return float("nan"), None, float("nan")
        with np.errstate(all="ignore"):
            m = np.nanmean(c, axis=0)
        b = peak_index(m)
        sd = float(np.nanstd(c[:, b], ddof=1)) if c.shape[0] > 1 else float("nan")
        return float(m[b]), self.runs[0].round_numbers()[b], sd

    @property
    def status(self) -> str:
        unfinished = [r for r in self.runs if not r.finished]
        return ", ".join(f"{len(r.rounds)}/{r.cfg.get('rounds')} rounds" for r in unfinished) or "finished"


def _nanmean_rows(a: np.ndarray) -> np.ndarray:
    """Each row's mean over its entries that are not NaN (NaN for none): np.nanmean would sum zeros in their place,
    which changes the summation order of a long row, and warn about a row of NaNs."""
    return np.array([f.mean() if len(f := row[~np.isnan(row)]) else np.nan for row in a], dtype=float)


def make_rows(runs: list[RunData], variant_keys: list[str] | None = None) -> list[Row]:
    """Rows by method plus the keys that vary between runs of the same method (seeds aggregated)."""
    if variant_keys is None:
        variant_keys = sorted({k for m in {r.method for r in runs}
                               for k in varying_keys([r for r in runs if r.method == m])})
    rows: dict[tuple, Row] = {}
    for r in runs:
        var = {k: r.flat.get(k) for k in variant_keys
               if len({repr(x.flat.get(k)) for x in runs if x.method == r.method}) > 1}
        key = (r.method, tuple(sorted((k, repr(v)) for k, v in var.items())))
        if key not in rows:
            label = r.method + (" (" + ", ".join(f"{short_key(k)}={fmt_value(v)}" for k, v in var.items()) + ")"
                                if var else "")
            rows[key] = Row(label, r.method, var, [])
        rows[key].runs.append(r)
    return sorted(rows.values(), key=row_order)


def row_order(row: "Row") -> tuple:
    """Rows by their preset's `order` (`style.method_order`: the baselines, then the notes' variants in order),
    then by method; a method's variants by value."""
    return (method_order(row.method), row.method, tuple((k, num(x) if isinstance(x, (int, float)) else str(x))
                                 for k, x in sorted(row.variant.items())))


@dataclass
class Section:
    title: str
    slug: str
    setting: dict
    rows: list[Row]


def sections(runs: list[RunData]) -> list[Section]:
    setting_keys = [k for k in varying_keys(runs) if is_setting(k)]
    groups: dict[tuple, list[RunData]] = {}
    for r in runs:
        groups.setdefault(tuple(repr(r.flat.get(k)) for k in setting_keys), []).append(r)
    out = []
    for rs in groups.values():
        setting = {k: rs[0].flat.get(k) for k in setting_keys}
        title = describe_setting(rs[0])
        sl = slug("_".join(f"{short_key(k)}={fmt_value(v)}" for k, v in setting.items()) or "all")
        nonsetting = [k for k in varying_keys(rs) if not is_setting(k)]
        out.append(Section(title, sl, setting, make_rows(rs, None if nonsetting else [])))
    seen: Counter = Counter()  # unique slugs: the second `x` is `x-1`
    for s in out:
        seen[s.slug] += 1
        if seen[s.slug] > 1:
            s.slug = f"{s.slug}-{seen[s.slug] - 1}"
    return out


@dataclass
class SweepLine:
    label: str
    x: list[float]
    rows: list[Row]  # one per x


def param_sweeps(runs: list[RunData]) -> dict[str, list[SweepLine]]:
    """For every numeric key with ≥ 2 values and everything else equal: lines of rows against it."""
    vary = varying_keys(runs)
    out: dict[str, list[SweepLine]] = {}
    for k in vary:
        vals = {r.flat.get(k) for r in runs}
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vals):
            continue
        others = [o for o in vary if o != k]
        groups: dict[tuple, list[RunData]] = {}
        for r in runs:
            groups.setdefault((r.method,) + tuple(repr(r.flat.get(o)) for o in others), []).append(r)
        lines = []
        for key, rs in groups.items():
            by_x: dict[float, list[RunData]] = {}
            for r in rs:
                by_x.setdefault(float(r.flat[k]), []).append(r)
            if len(by_x) < 2:
                continue
            xs = sorted(by_x)
            fixed = [f"{short_key(o)}={fmt_value(rs[0].flat.get(o))}" for o in others
                     if not is_setting(o) and len({repr(x.flat.get(o)) for x in runs if x.method == rs[0].method}) > 1]
            label = rs[0].method + (f" ({', '.join(fixed)})" if fixed else "")
            if setting := [f"{short_key(o)}={fmt_value(rs[0].flat.get(o))}" for o in others if is_setting(o)]:
                label += " · " + ", ".join(setting)
            lines.append(SweepLine(label, xs, [Row(label, rs[0].method, {}, by_x[x]) for x in xs]))
        if lines:
            out[k] = lines
    return out


