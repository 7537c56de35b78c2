"""`flare report DIR...`: tables and figures over any set of run directories.

Runs are read back from their files (config.yaml, metrics.jsonl, partition.json, state.json), so the report
works on old, partial and foreign runs alike. How runs are grouped:

* a **section** per distinct *setting* — the data/protocol keys (dataset.*, partition.*, model.*,
  num_clients, rounds, local_epochs, batch_size) that differ between the runs;
* inside a section a **row** per method (`method`, i.e. the preset) plus the keys that vary between runs
  of the same method (e.g. `align.lambda0` of a λ0 sweep), aggregated over seeds (mean ± std);
* a **parameter sweep** for every numeric key that takes ≥ 2 values with everything else equal
  (λ0, α, ...): accuracy, g_protos_std and inter_client_proto_std against it.

The building blocks (load_runs, Row, the tables and plot functions) are reused by `flare paper`.
"""
from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from flare.errors import FlareError
from flare.report.run_report import ACC_ORDER, _plt, integer_rounds, load_run

IGNORE = {"seed", "description", "notes_name", "device", "dataset.root", "dataset.cache_dir", "dataset.download",
          "dataset.format", "logging.tensorboard", "amp", "channels_last", "compile", "concurrent_clients", "preset",
          "method", "test_batch_size", "eval.noise_seed"}
SETTING_KEYS = {"num_clients", "rounds", "local_epochs", "batch_size"}
SETTING_PREFIXES = ("dataset.", "partition.", "model.")
RULE_NAMES = {"feature": "feature (simple)", "iffi": "IFFI", "iffi_reference": "IFFI (seeds' code = uniform)",
              "output": "output ensemble", "fedavg": "FedAvg"}


def is_setting(key: str) -> bool:
    return (key in SETTING_KEYS or key.startswith(SETTING_PREFIXES)) and key != "dataset.public_size"


def num(v: Any) -> float:
    """metrics.jsonl keeps non-finite floats as strings ("nan", "inf"); None → nan."""
    if v is None:
        return float("nan")
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")


def flatten(m: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in m.items():
        if isinstance(v, dict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", s).strip("-")[:80] or "x"


# ----------------------------------------------------------------------------------------------
# runs


@dataclass
class RunData:
    dir: Path
    cfg: dict
    rounds: list[dict]
    clients: list[dict]
    state: dict
    partition: dict
    flat: dict = field(default_factory=dict)

    @classmethod
    def load(cls, d: Path) -> "RunData":
        r = load_run(d)
        return cls(Path(d), r["config"], r["rounds"], r["clients"], r["state"], r["partition"], flatten(r["config"]))

    @property
    def method(self) -> str:
        return str(self.cfg.get("method") or self.cfg.get("preset") or self.dir.name)

    @property
    def seed(self):
        return self.cfg.get("seed")

    @property
    def notes_name(self) -> str:
        return str(self.cfg.get("notes_name") or "")

    @property
    def primary(self) -> str:
        return self.rounds[-1].get("primary", "feature") if self.rounds else "feature"

    @property
    def finished(self) -> bool:
        return self.state.get("status") == "finished"

    @property
    def learner(self) -> str:
        return str(self.cfg.get("lam", {}).get("learner", "none"))

    def curve(self, key: str = "acc") -> np.ndarray:
        if key == "acc":
            key = f"acc_{self.primary}"
        return np.array([num(r.get(key)) for r in self.rounds])

    def client_curve(self, key: str) -> np.ndarray | None:
        """rounds × clients array of a client-record value (nan where missing), None if never logged."""
        recs = [c for c in self.clients if key in c]
        if not recs:
            return None
        ids = sorted({c["client"] for c in self.clients})
        col = {cid: j for j, cid in enumerate(ids)}
        out = np.full((len(self.rounds), len(ids)), np.nan)
        for c in recs:
            if c["round"] < len(self.rounds):
                out[c["round"], col[c["client"]]] = num(c[key])
        return out

    def final(self, key: str) -> float:
        if not self.rounds:
            return float("nan")
        if key == "acc":
            key = f"acc_{self.primary}"
        if key in ("lambda_raw", "lambda_eff", "lambda"):
            cc = self.client_curve("lambda_raw_end" if key == "lambda_raw" and self.client_curve("lambda_raw_end")
                                   is not None else key)
            return float(np.nanmean(cc[-1])) if cc is not None and np.isfinite(cc[-1]).any() else float("nan")
        return num(self.rounds[-1].get(key))


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
        for c in sorted(p.rglob("config.yaml")):
            if (c.parent / "metrics.jsonl").exists():
                found.append(c.parent)
    seen, out = set(), []
    for d in found:
        r = d.resolve()
        if r not in seen:
            seen.add(r)
            out.append(d)
    return out


def load_runs(paths: Iterable[str | Path]) -> list[RunData]:
    dirs = discover(paths)
    if not dirs:
        raise FlareError("no run directories found (a run directory holds config.yaml and metrics.jsonl).",
                         key="DIR", fix="give the --out directories of `flare run`, `compare`, `sweep` or `paper`.")
    return [RunData.load(d) for d in dirs]


# ----------------------------------------------------------------------------------------------
# grouping


def varying_keys(runs: list[RunData]) -> list[str]:
    keys = sorted({k for r in runs for k in r.flat} - IGNORE)
    return [k for k in keys if len({repr(r.flat.get(k)) for r in runs}) > 1]


def short_key(k: str) -> str:
    return k.split(".")[-1]


def fmt_value(v: Any) -> str:
    return format(v, "g") if isinstance(v, float) else str(v)


def describe_setting(r: RunData) -> str:
    c = r.cfg
    ds, part, model = c.get("dataset", {}), c.get("partition", {}), c.get("model", {})
    p = f"{part.get('kind')}"
    if part.get("kind") == "dirichlet":
        p = f"α={fmt_value(part.get('alpha'))}"
    elif part.get("kind") == "shards":
        p = f"shards({part.get('shards_per_client')})"
    sub = ""
    if ds.get("train_subset") or ds.get("test_subset"):
        sub = f" ({ds.get('train_subset') or 'all'}/{ds.get('test_subset') or 'all'} samples)"
    return (f"{ds.get('name')}{sub}, {p}, {c.get('num_clients')} clients, R={c.get('rounds')}×E={c.get('local_epochs')}, "
            f"{model.get('name')}" + (f"×{fmt_value(model.get('width'))}" if model.get("width") != 1.0 else ""))


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
        cs = [r.client_curve(key) for r in self.runs if r.rounds]
        cs = [c for c in cs if c is not None]
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
        b = int(np.nanargmax(m))
        sd = float(np.nanstd(c[:, b], ddof=1)) if c.shape[0] > 1 else float("nan")
        return float(m[b]), int(self.runs[0].rounds[b]["round"]), sd

    @property
    def status(self) -> str:
        unfinished = [r for r in self.runs if not r.finished]
        if not unfinished:
            return "finished"
        return ", ".join(f"{len(r.rounds)}/{r.cfg.get('rounds')} rounds" for r in unfinished)


def _nanmean_rows(a: np.ndarray) -> np.ndarray:
    out = np.full(a.shape[0], np.nan)
    for i, row in enumerate(a):
        f = row[~np.isnan(row)]
        if len(f):
            out[i] = f.mean()
    return out


def make_rows(runs: list[RunData], variant_keys: list[str] | None = None) -> list[Row]:
    """Rows by method plus the keys that vary between runs of the same method (seeds aggregated)."""
    if variant_keys is None:
        variant_keys = set()
        by_method: dict[str, list[RunData]] = {}
        for r in runs:
            by_method.setdefault(r.method, []).append(r)
        for rs in by_method.values():
            variant_keys |= set(varying_keys(rs))
        variant_keys = sorted(variant_keys)
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
    """Baselines first, then the notes' V-numbers in order (V4, V5, …, V14), then the rest; variants by value."""
    m = re.search(r"V(\d+)", row.notes_name)
    v = int(m.group(1)) if m else (-1 if row.method in ("fedavg", "ensemble") else 99)
    return (v, row.method, tuple((k, num(x) if isinstance(x, (int, float)) else str(x))
                                 for k, x in sorted(row.variant.items())))


@dataclass
class Section:
    title: str
    slug: str
    setting: dict
    runs: list[RunData]
    rows: list[Row]


def sections(runs: list[RunData]) -> list[Section]:
    vary = varying_keys(runs)
    setting_keys = [k for k in vary if is_setting(k)]
    groups: dict[tuple, list[RunData]] = {}
    for r in runs:
        groups.setdefault(tuple(repr(r.flat.get(k)) for k in setting_keys), []).append(r)
    out = []
    for rs in groups.values():
        setting = {k: rs[0].flat.get(k) for k in setting_keys}
        title = describe_setting(rs[0])
        sl = slug("_".join(f"{short_key(k)}={fmt_value(v)}" for k, v in setting.items()) or "all")
        nonsetting = [k for k in varying_keys(rs) if not is_setting(k)]
        out.append(Section(title, sl, setting, rs, make_rows(rs, None if nonsetting else [])))
    # unique slugs
    seen: dict[str, int] = {}
    for s in out:
        if s.slug in seen:
            seen[s.slug] += 1
            s.slug = f"{s.slug}-{seen[s.slug]}"
        else:
            seen[s.slug] = 0
    return out


# ----------------------------------------------------------------------------------------------
# tables


def fmt_ms(mean: float, std: float, pct: bool = True, digits: int | None = None) -> str:
    if mean is None or math.isnan(mean):
        return "—"
    scale = 100 if pct else 1
    d = digits if digits is not None else (2 if pct else 4)
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


def results_table(rows: list[Row]) -> str:
    head = ["method", "notes", "seeds", "final acc (%)", "peak acc (%) (round)", "g_protos_std",
            "inter_client_proto_std", "status"]
    body = []
    for row in rows:
        pk, pr, psd = row.peak()
        body.append([row.label, row.notes_name, len(row.seeds), fmt_ms(*row.stat("acc")[:2]),
                     f"{fmt_ms(pk, psd)} ({pr})" if pr is not None else "—",
                     fmt_ms(*row.stat("g_protos_std")[:2], pct=False),
                     fmt_ms(*row.stat("inter_client_proto_std")[:2], pct=False), row.status])
    return md_table(head, body)


def strategy_table(rows: list[Row]) -> str | None:
    """Final accuracy of every global predictor the runs evaluated (the server-strategy comparison)."""
    rules = [k for k in ACC_ORDER if any(k in r.rounds[-1] for row in rows for r in row.runs if r.rounds)]
    if len(rules) < 2:
        return None
    head = ["method"] + [RULE_NAMES.get(k.removeprefix("acc_"), k) for k in rules]
    body = [[row.label] + [fmt_ms(*row.stat(k)[:2]) for k in rules] for row in rows]
    return md_table(head, body)


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
        lam_eff = row.stat("lambda_eff")
        body.append([row.label, row.notes_name, f"{fmt_ms(pk, psd)} ({pr})", fmt_ms(*row.stat("acc")[:2]),
                     fmt_big(lam_raw[0]) + (f" ± {fmt_big(lam_raw[1])}" if not math.isnan(lam_raw[1]) else ""),
                     fmt_big(mx), fmt_big(lam_eff[0])])
    return md_table(head, body)


# ----------------------------------------------------------------------------------------------
# figures


def _wrap(title: str, width: int = 90) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(title, width)) if len(title) > width else title


def _log_if_decades(ax, values, axis: str = "y", ratio: float = 100.0) -> None:
    v = np.asarray([x for x in np.ravel(values) if np.isfinite(x) and x > 0])
    if len(v) and v.max() / v.min() >= ratio:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")


def _rounds_axis(row: Row, n: int) -> np.ndarray:
    return np.array([row.runs[0].rounds[i]["round"] for i in range(n)])  # rounds counted from 0, as logged


def plot_accuracy_curves(rows: list[Row], path: Path, title: str) -> None:
    """Figure 1: accuracy (primary global predictor) against rounds; mean over seeds, band = ±std."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    for row in rows:
        c = row.curves("acc")
        if c.size == 0:
            continue
        x = _rounds_axis(row, c.shape[1])
        with np.errstate(all="ignore"):
            m = np.nanmean(c, axis=0)
        ax.plot(x, 100 * m, marker="o", ms=3, label=row.label + (f" (n={c.shape[0]})" if c.shape[0] > 1 else ""))
        if c.shape[0] > 1:
            sd = np.nanstd(c, axis=0, ddof=1)
            ax.fill_between(x, 100 * (m - sd), 100 * (m + sd), alpha=0.15)
    ax.set(xlabel="round", ylabel="test accuracy (%)", title=_wrap(title))
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    integer_rounds(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def v7_schedule(cfg: dict, n_rounds: int) -> np.ndarray:
    """V7's hand-made λ0(1 − p), averaged over each round's epochs as the trainer logs it."""
    R, E = int(cfg.get("rounds", n_rounds)), int(cfg.get("local_epochs", 1))
    lam0 = float(cfg.get("align", {}).get("lambda0", 5.0))
    return np.array([np.mean([lam0 * (1 - e / (R * E)) for e in range(r * E, (r + 1) * E)]) for r in range(n_rounds)])


def plot_lambda_eff(rows: list[Row], path: Path, title: str, v7_rows: list[Row] | None = None) -> bool:
    """Figure 2: λ_eff of the λ-learner rows against rounds, beside V7's schedule λ0(1 − p)."""
    rows = [r for r in rows if r.client_mean_curves("lambda_eff") is not None]
    if not rows:
        return False
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    allv = []
    for row in rows:
        c = row.client_mean_curves("lambda_eff")
        x = _rounds_axis(row, c.shape[1])
        with np.errstate(all="ignore"):
            m = np.nanmean(c, axis=0)
        ax.plot(x, m, marker="o", ms=3, label=f"{row.label}: learned λ_eff (mean over clients)")
        # the spread over clients (first seed) as a band
        cc = row.runs[0].client_curve("lambda_eff")[: c.shape[1]]
        with np.errstate(all="ignore"):
            lo, hi = np.nanmin(cc, axis=1), np.nanmax(cc, axis=1)
        ax.fill_between(x, lo, hi, alpha=0.15, label=f"{row.label}: range over clients")
        allv += list(m) + list(lo) + list(hi)
    drawn = False
    for row in v7_rows or []:
        c = row.client_mean_curves("lambda")
        if c is None:
            continue
        x = _rounds_axis(row, c.shape[1])
        m = np.nanmean(c, axis=0)
        ax.plot(x, m, "k--", lw=1.5, label=f"{row.label}: hand-made λ0(1−p), λ0="
                f"{fmt_value(row.runs[0].cfg.get('align', {}).get('lambda0'))}")
        allv += list(m)
        drawn = True
    if not drawn:
        ref = rows[0].runs[0]
        n = rows[0].client_mean_curves("lambda_eff").shape[1]
        y = v7_schedule(ref.cfg, n)
        ax.plot(_rounds_axis(rows[0], n), y, "k--", lw=1.5,
                label=f"V7 schedule λ0(1−p), λ0={fmt_value(ref.cfg.get('align', {}).get('lambda0', 5.0))}")
        allv += list(y)
    _log_if_decades(ax, allv)
    ax.set(xlabel="round", ylabel="λ_eff (alignment weight)", title=_wrap(title))
    integer_rounds(ax)
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def plot_acc_lambda_raw(rows: list[Row], path: Path, title: str) -> bool:
    """Figure 3: accuracy and λ_raw against rounds (e.g. V12 beside FLARE)."""
    rows = [r for r in rows if r.client_mean_curves("lambda_raw") is not None]
    if not rows:
        return False
    plt = _plt()
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    allv = []
    for row in rows:
        c = row.curves("acc")
        x = _rounds_axis(row, c.shape[1])
        a1.plot(x, 100 * np.nanmean(c, axis=0), marker="o", ms=3, label=row.label)
        lam = row.client_mean_curves("lambda_raw")
        n = lam.shape[1]
        m = np.nanmean(lam, axis=0)
        a2.plot(_rounds_axis(row, n), m, marker="o", ms=3, label=f"{row.label} (mean over clients)")
        cc = row.runs[0].client_curve("lambda_raw")[:n]
        with np.errstate(all="ignore"):
            hi = np.nanmax(cc, axis=1)
        a2.plot(_rounds_axis(row, n), hi, ls=":", lw=1, color=a2.lines[-1].get_color(), label=f"{row.label} (max client)")
        allv += list(m) + list(hi)
    lam_max = rows[0].runs[0].cfg.get("lam", {}).get("lambda_max")
    if lam_max and any(r.runs[0].cfg.get("lam", {}).get("gamma_lambda") for r in rows):
        a2.axhline(lam_max, color="grey", ls="--", lw=1, label=f"safety-valve threshold λ_max={fmt_value(lam_max)}")
    a1.set(xlabel="round", ylabel="test accuracy (%)", title="accuracy")
    _log_if_decades(a2, allv, ratio=20)
    a2.set(xlabel="round", ylabel="λ_raw = σ²_local / σ²_align", title="raw λ")
    integer_rounds(a1, a2)
    for a in (a1, a2):
        a.grid(alpha=0.3, which="both")
        a.legend(fontsize=7)
    fig.suptitle(_wrap(title, 120), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


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
            setting = [f"{short_key(o)}={fmt_value(rs[0].flat.get(o))}" for o in others if is_setting(o)]
            if setting:
                label += " · " + ", ".join(setting)
            lines.append(SweepLine(label, xs, [Row(label, rs[0].method, {}, by_x[x]) for x in xs]))
        if lines:
            out[k] = lines
    return out


def sweep_table(key: str, lines: list[SweepLine]) -> str:
    head = ["method", short_key(key), "seeds", "final acc (%)", "peak acc (%) (round)", "g_protos_std",
            "inter_client_proto_std"]
    body = []
    for ln in lines:
        for x, row in zip(ln.x, ln.rows):
            pk, pr, psd = row.peak()
            body.append([ln.label, fmt_value(x), len(row.seeds), fmt_ms(*row.stat("acc")[:2]),
                         f"{fmt_ms(pk, psd)} ({pr})", fmt_ms(*row.stat("g_protos_std")[:2], pct=False),
                         fmt_ms(*row.stat("inter_client_proto_std")[:2], pct=False)])
    return md_table(head, body)


def plot_param_sweep(key: str, lines: list[SweepLine], path: Path, title: str) -> None:
    """Accuracy, g_protos_std and inter_client_proto_std against a swept value (e.g. λ0: the notes' U-shape)."""
    plt = _plt()
    metrics = [("acc", "final test accuracy (%)", 100.0), ("g_protos_std", "g_protos_std", 1.0),
               ("inter_client_proto_std", "inter_client_proto_std", 1.0)]
    have = [m for m in metrics if any(not math.isnan(r.stat(m[0])[0]) for ln in lines for r in ln.rows)]
    fig, axes = plt.subplots(1, len(have), figsize=(4.6 * len(have), 3.9), squeeze=False)
    xs_all = [x for ln in lines for x in ln.x]
    for ax, (m, ylabel, scale) in zip(axes[0], have):
        for ln in lines:
            st = [r.stat(m) for r in ln.rows]
            y = np.array([s[0] for s in st]) * scale
            e = np.array([s[1] if not math.isnan(s[1]) else 0.0 for s in st]) * scale
            ax.errorbar(ln.x, y, yerr=e if e.any() else None, marker="o", ms=4, capsize=3, label=ln.label)
        _log_if_decades(ax, xs_all, axis="x", ratio=10)
        ax.set(xlabel=key, ylabel=ylabel, title=f"{ylabel} vs {short_key(key)}")
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(_wrap(title, 120), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_label_distributions(runs: list[RunData], path: Path, max_panels: int = 12) -> bool:
    """One heat map (clients × classes, sample counts) per distinct partition among the runs."""
    parts: dict[str, tuple[str, dict]] = {}
    for r in runs:
        if not r.partition or "clients" not in r.partition:
            continue
        key = repr(r.partition.get("clients"))
        if key not in parts:
            pt = r.partition
            parts[key] = (f"{pt.get('dataset')} {pt.get('kind')} α={fmt_value(pt.get('alpha'))} seed {pt.get('seed')}",
                          pt)
    if not parts:
        return False
    items = sorted(parts.values(), key=lambda t: t[0])[:max_panels]
    plt = _plt()
    n = len(items)
    cols = min(n, 3)
    rws = math.ceil(n / cols)
    C = max(len(p["clients"][0]["class_histogram"]) for _, p in items)
    K = max(len(p["clients"]) for _, p in items)
    fig, axes = plt.subplots(rws, cols, figsize=(cols * max(4.0, 0.3 * C + 2.2), rws * max(2.6, 0.35 * K + 1.6)),
                             squeeze=False)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    for ax, (title, pt) in zip(axes.ravel(), items):
        hist = np.array([c["class_histogram"] for c in pt["clients"]])
        im = ax.imshow(hist, aspect="auto", cmap="viridis")
        if hist.size <= 200:
            for i in range(hist.shape[0]):
                for j in range(hist.shape[1]):
                    ax.text(j, i, str(hist[i, j]), ha="center", va="center", fontsize=6,
                            color="white" if hist[i, j] < hist.max() / 2 else "black")
        ax.set_yticks(range(hist.shape[0]), [f"{i} (n={hist[i].sum()})" for i in range(hist.shape[0])], fontsize=7)
        ax.set(xlabel="class", ylabel="client", title=title)
        ax.title.set_fontsize(8)
        fig.colorbar(im, ax=ax, label="samples")
    fig.suptitle("label distribution per client (non-IID partitions)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------------------------
# the generic report


def write_report(paths: Iterable[str | Path], out: str | Path, title: str = "Report") -> Path:
    from flare.runner import atomic_write_text

    runs = load_runs(paths)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with_rounds = [r for r in runs if r.rounds]
    empty = [r for r in runs if not r.rounds]
    md = [f"# {title}", "", f"{len(runs)} run directories, read {time.strftime('%Y-%m-%d %H:%M')}. Accuracies are "
          "the primary global predictor's test accuracy in % (mean ± std over seeds where there are several); "
          "`peak` is the best round of the seed-mean curve (rounds counted from 0); g_protos_std and "
          "inter_client_proto_std are SPEC §5's diagnostics at the last round.", ""]
    if empty:
        md += ["Runs without a complete round (left out): " + ", ".join(f"`{r.dir}`" for r in empty), ""]
    for sec in sections(with_rounds):
        md += [f"## {sec.title}", "", results_table(sec.rows), ""]
        plot_accuracy_curves(sec.rows, out / f"accuracy_{sec.slug}.png", f"test accuracy — {sec.title}")
        md += [f"![accuracy against rounds](accuracy_{sec.slug}.png)", ""]
        st = strategy_table(sec.rows)
        if st:
            md += ["### Global predictors (server strategies), final accuracy (%)", "", st, ""]
        lt = lambda_table(sec.rows)
        if lt:
            md += ["### Learned alignment strength", "", lt, ""]
            v7 = [r for r in sec.rows if r.runs[0].learner == "none"
                  and r.runs[0].cfg.get("align", {}).get("schedule") == "linear"
                  and r.client_mean_curves("lambda") is not None]
            if plot_lambda_eff(sec.rows, out / f"lambda_eff_{sec.slug}.png",
                               f"λ_eff against rounds — {sec.title}", v7):
                md += [f"![lambda_eff against rounds](lambda_eff_{sec.slug}.png)", ""]
            if plot_acc_lambda_raw(sec.rows, out / f"lambda_raw_{sec.slug}.png",
                                   f"accuracy and raw λ — {sec.title}"):
                md += [f"![accuracy and lambda_raw against rounds](lambda_raw_{sec.slug}.png)", ""]
    sweeps = param_sweeps(with_rounds)
    if sweeps:
        md += ["## Parameter sweeps", ""]
        for k, lines in sweeps.items():
            f = f"sweep_{slug(k)}.png"
            plot_param_sweep(k, lines, out / f, f"sweep over {k}")
            md += [f"### {k}", "", sweep_table(k, lines), "", f"![sweep over {k}]({f})", ""]
    if plot_label_distributions(with_rounds, out / "label_distribution.png"):
        md += ["## Label distributions", "", "![label distribution](label_distribution.png)", ""]
    md += ["## Run directories", "", md_table(["run", "method", "seed", "rounds done", "status"],
                                            [[f"`{r.dir}`", r.method, r.seed, len(r.rounds),
                                              r.state.get("status", "unknown")] for r in runs]), ""]
    path = out / "report.md"
    atomic_write_text(path, "\n".join(md))
    return path
