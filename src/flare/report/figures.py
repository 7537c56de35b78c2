"""Every figure FLARE draws: one run's plots (accuracy, label distribution, diagnostics, λ), the comparison of
methods, and the report figures over rows of runs (accuracy curves, learned λ, parameter sweeps).

Conventions shared by every figure: a method has one colour everywhere (its preset's: `style.method_colour`), rounds
are counted from 1 (round r = the evaluation after r rounds of training) and ticked at integers, legends sit outside
the axes so they never cover data, and a curve over seeds is the mean with a ±std band."""
from __future__ import annotations

import math
import textwrap
from pathlib import Path
from typing import Callable

import matplotlib

matplotlib.use("Agg")  # files only: no display is ever needed
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from flare.config import preset_mapping  # noqa: E402
from flare.report.runs import Row, SweepLine, fmt_value, short_key  # noqa: E402
from flare.report.style import method_colour, rule_colour  # noqa: E402
from flare.rundata import RunData  # noqa: E402
from flare.records import acc_keys  # noqa: E402
from flare.rundir import DIAG  # noqa: E402
from flare.registry import SCHEDULES, NoFacts  # noqa: E402
from flare.schedules import progress  # noqa: E402

COMPARE_DIAG = ("g_protos_std", "inter_client_proto_std")


def v7_weight() -> tuple[float, Callable[[float], float]]:
    """V7's λ0 and its λ as a function of the progress p, λ0·a(p) with its preset's λ0 and schedule a (through the
    same `flare.schedules` its runs train with): the hand-made schedule that learned-λ plots are drawn beside."""
    align = preset_mapping("etf-anneal")["align"]
    lam0, a = float(align["lambda0"]), SCHEDULES.create(align["schedule"], NoFacts())
    return lam0, lambda p: lam0 * a(p)


def integer_rounds(*axes) -> None:
    """Rounds are counted: tick them at integers only."""
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _dress(ax, ylabel: str, title: str, xlabel: str = "round", which: str = "major", size=9) -> None:
    """Axis labels, a `size` title (9 points), a light grid, and integer ticks where x counts rounds."""
    ax.set(xlabel=xlabel, ylabel=ylabel, title=title)
    ax.title.set_fontsize(size)
    ax.grid(alpha=0.3, which=which)
    if xlabel == "round":
        integer_rounds(ax)


def _legend_outside(ax, **kw) -> None:
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0, fontsize=kw.pop("fontsize", 8), **kw)


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    fig.savefig(path, dpi=dpi, bbox_inches="tight")
    plt.close(fig)


def _save_panels(fig, path: Path, title: str = "", dpi: int = 120) -> None:
    """A figure of panels: its title (if any) over them all, laid out tight, saved."""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    save_figure(fig, path, dpi)


def wrap_title(title: str, width: int = 90) -> str:
    return "\n".join(textwrap.wrap(title, width)) if len(title) > width else title


def _log_if_decades(ax, values, axis: str = "y", ratio: float = 100.0) -> None:
    v = np.asarray([x for x in np.ravel(values) if np.isfinite(x) and x > 0])
    if len(v) and v.max() / v.min() >= ratio:
        (ax.set_yscale if axis == "y" else ax.set_xscale)("log")


def run_title(run: RunData) -> str:
    c = run.cfg
    part = c.get("partition", {})
    return (f"{run.method} on {c.get('dataset', {}).get('name', '')}, {part.get('kind', '')} "
            f"α={fmt_value(part.get('alpha'))}, seed {c.get('seed')}")


# ----------------------------------------------------------------------------------------------
# one run


def plot_accuracy(run: RunData, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6.4, 4))
    x = run.round_numbers()
    for i, k in enumerate(acc_keys(run.rounds)):  # a last-round-only strategy (every_round=False) is one point
        rule = k.removeprefix("acc_")
        ax.plot(x, 100 * run.curve(k), marker="o", ms=3, color=rule_colour(rule) or f"C{5 + i}",
                label=rule + (" (primary)" if rule == run.primary else ""))
    _dress(ax, "test accuracy (%)", wrap_title(run_title(run), 60))
    _legend_outside(ax, title="global predictor")  # a server without a test set has no curves: no legend
    save_figure(fig, path)


def _heat_map(fig, ax, partition: dict, title: str, who: list[str], small: bool = False) -> None:
    """Clients × classes sample counts of one partition on `ax`, each count written (white on the dark half of the
    colour scale) and each class named while they fit; `who` names each client's model; `small`: one panel of
    several, in smaller type."""
    hist = np.array([c["class_histogram"] for c in partition["clients"]])
    (K, C), size = hist.shape, 6 if small else 7
    classes = [str(c) for c in partition.get("classes") or range(C)]
    im = ax.imshow(hist, aspect="auto", cmap="viridis")
    if K * C <= (200 if small else 400):
        for i, j in np.ndindex(hist.shape):
            ax.text(j, i, str(hist[i, j]), ha="center", va="center", fontsize=size,
                    color="white" if hist[i, j] < hist.max() / 2 else "black")
    ax.set(xlabel="class", ylabel="client", title=title)
    ax.title.set_fontsize(size + 2)
    if C <= (40 if small else 60):  # every class ticked and named; beyond that the names would overlap
        turn = small or max(map(len, classes)) > 3
        ax.set_xticks(range(C), classes, rotation=45 if turn else 0, ha="right" if turn else "center", fontsize=size)
    ax.set_yticks(range(K), [f"{i} {m} (n={hist[i].sum()})".replace("  ", " ") for i, m in zip(range(K), who)],
                  fontsize=size + 1)
    fig.colorbar(im, ax=ax, label="samples")


def plot_label_distribution(partition: dict, path: Path) -> None:
    """Clients × classes heat map of sample counts — the picture of the non-IID split, every class named."""
    K, C = len(partition["clients"]), len(partition["clients"][0]["class_histogram"])
    fig, ax = plt.subplots(figsize=(max(5.5, 0.45 * C + 2.5), max(2.8, 0.45 * K + 2.0)))
    models = [c.get("model", "") for c in partition["clients"]]
    who = models if len(set(models)) > 1 else [""] * K  # clients of different architectures: each one's named
    _heat_map(fig, ax, partition, f"label distribution: {partition.get('dataset', '')}, {partition.get('kind', '')} "
              f"α={partition.get('alpha', '')}, seed {partition.get('seed', '')}", who)
    save_figure(fig, path)


def plot_diagnostics(run: RunData, path: Path) -> None:
    keys = [k for k in DIAG if run.rounds and k in run.rounds[0]]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, k in zip(axes[0], keys):
        ax.plot(run.round_numbers(), run.curve(k), marker="o", ms=3, color=method_colour(run.method))
        _dress(ax, k, k)
    _save_panels(fig, path, f"diagnostics — {run_title(run)}")


def plot_lambda(run: RunData, path: Path) -> None:
    """λ per client against rounds; for λ-learner runs λ_eff and λ_raw, with V7's λ0(1 − p) beside. Clients whose
    curves coincide (a fixed λ0 is the same for every client) are drawn once and said to be shared."""
    clients = run.clients
    keys = [k for k in ("lambda_eff", "lambda_raw", "lambda") if clients and k in clients[0]]
    if not keys:
        return
    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 3.8), squeeze=False)
    ids = sorted({c["client"] for c in clients})
    shared_any = False
    for ax, k in zip(axes[0], keys):
        curves = {cid: [(c["round"] + 1, float(c[k])) for c in clients if c["client"] == cid] for cid in ids}
        distinct: dict[tuple, list[int]] = {}
        for cid, pts in curves.items():  # equal to 6 significant digits (a per-epoch mean's last bits differ)
            key = tuple((r, float(f"{v:.6g}")) for r, v in pts)
            distinct.setdefault(key, []).append(cid)
        for i, (pts, who) in enumerate(distinct.items()):
            label = (f"all {len(who)} clients (the same λ)" if len(who) == len(ids) and len(ids) > 1
                     else ", ".join(f"client {c}" for c in who))
            ax.plot([r for r, _ in pts], [v for _, v in pts], marker="o", ms=2, color=f"C{i % 10}", label=label)
        shared_any |= len(distinct) == 1 and len(ids) > 1
        if k == "lambda_eff" and run.learner != "none":
            R, (lam0, w) = int(run.cfg["rounds"]), v7_weight()  # λ at the start of each round
            ax.plot(np.arange(1, R + 1), [w(progress(r, R)) for r in range(R)], "k--",
                    label=f"V7: λ0(1−p), λ0={lam0:g}")
        _log_if_decades(ax, [v for pts in distinct for _, v in pts])
        _dress(ax, k, f"{k} per client")
        _legend_outside(ax, fontsize=7)
    _save_panels(fig, path, f"alignment strength — {run_title(run)}"
                 + (" (every client has the same λ)" if shared_any else ""))


# ----------------------------------------------------------------------------------------------
# rows of runs (methods, seeds aggregated)


def rounds_axis(row: Row, n: int) -> np.ndarray:
    return np.array(row.runs[0].round_numbers()[:n])


def _mean_band(ax, row: Row, x, c: np.ndarray, scale: float = 1.0, **kw) -> np.ndarray:
    with np.errstate(all="ignore"):
        m = np.nanmean(c, axis=0)
    colour = kw.pop("color", method_colour(row.method))
    ax.plot(x, scale * m, marker="o", ms=3, color=colour, **kw)
    if c.shape[0] > 1:
        sd = np.nanstd(c, axis=0, ddof=1)
        ax.fill_between(x, scale * (m - sd), scale * (m + sd), alpha=0.15, color=colour, lw=0)
    return m


def _seed_note(row: Row) -> str:
    n = len(row.runs)
    return f" (mean ± std, {n} seeds)" if n > 1 else ""


def plot_accuracy_curves(rows: list[Row], path: Path, title: str) -> None:
    """Figure 1 and the comparison: accuracy (primary global predictor) against rounds; mean over seeds, band ±std."""
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    for row in rows:
        c = row.curves("acc")
        if c.size == 0:
            continue
        _mean_band(ax, row, rounds_axis(row, c.shape[1]), c, 100.0,
                   label=f"{row.label} ({row.runs[0].primary}){_seed_note(row)}")
    _dress(ax, "test accuracy (%)", wrap_title(title, 110))
    _legend_outside(ax)
    save_figure(fig, path)


def plot_compare_diagnostics(rows: list[Row], path: Path, title: str = "") -> bool:
    """One panel per diagnostic, one line per method that has it; False (and no file) when none has any (plain
    classifiers have no prototypes)."""
    keys = [k for k in COMPARE_DIAG if any(r.rounds and k in r.rounds[0] for row in rows for r in row.runs)]
    if not keys:
        return False
    fig, axes = plt.subplots(1, len(keys), figsize=(5.0 * len(keys), 3.8), squeeze=False)
    for ax, k in zip(axes[0], keys):
        for row in rows:
            if not any(r.rounds and k in r.rounds[0] for r in row.runs):
                continue
            c = row.curves(k)
            _mean_band(ax, row, rounds_axis(row, c.shape[1]), c, label=row.label + _seed_note(row))
        _dress(ax, k, k)
    _legend_outside(axes[0][-1], fontsize=7)
    _save_panels(fig, path, wrap_title(title, 110))
    return True


def v7_schedule(cfg: dict, n_rounds: int) -> np.ndarray:
    """V7's hand-made λ0(1 − p), averaged over each round's epochs as the trainer logs it."""
    R, E, (_, w) = int(cfg.get("rounds", n_rounds)), int(cfg.get("local_epochs", 1)), v7_weight()
    return np.array([np.mean([w(progress(e, R * E)) for e in range(r * E, (r + 1) * E)]) for r in range(n_rounds)])


def plot_lambda_eff(rows: list[Row], path: Path, title: str, v7_rows: list[Row] | None = None) -> bool:
    """Figure 2: λ_eff of the λ-learner rows against rounds, beside V7's schedule λ0(1 − p)."""
    rows = [r for r in rows if r.client_mean_curves("lambda_eff") is not None]
    if not rows:
        return False
    fig, ax = plt.subplots(figsize=(7.2, 4.4))
    allv = []
    for row in rows:
        c = row.client_mean_curves("lambda_eff")
        x = rounds_axis(row, c.shape[1])
        m = _mean_band(ax, row, x, c, label=f"{row.label}: learned λ_eff (mean over clients)")
        cc = row.runs[0].client_curve("lambda_eff")[: c.shape[1]]  # the spread over clients (first seed)
        with np.errstate(all="ignore"):
            lo, hi = np.nanmin(cc, axis=1), np.nanmax(cc, axis=1)
        ax.fill_between(x, lo, hi, alpha=0.1, color=method_colour(row.method), hatch="//", lw=0,
                        label=f"{row.label}: range over clients")
        allv += list(m) + list(lo) + list(hi)
    v7 = [(row, c) for row in v7_rows or [] if (c := row.client_mean_curves("lambda")) is not None]
    for row, c in v7:
        m = np.nanmean(c, axis=0)
        ax.plot(rounds_axis(row, c.shape[1]), m, "--", color=method_colour(row.method), lw=1.5,
                label=f"{row.label}: hand-made λ0(1−p), λ0={fmt_value(row.runs[0].cfg.get('align', {}).get('lambda0'))}")
        allv += list(m)
    if not v7:
        n = rows[0].client_mean_curves("lambda_eff").shape[1]
        y = v7_schedule(rows[0].runs[0].cfg, n)
        ax.plot(rounds_axis(rows[0], n), y, "--", color=method_colour("etf-anneal"), lw=1.5,
                label=f"V7 schedule λ0(1−p), λ0={fmt_value(v7_weight()[0])}")
        allv += list(y)
    _log_if_decades(ax, allv)
    _dress(ax, "λ_eff (alignment weight)", wrap_title(title), which="both")
    _legend_outside(ax, fontsize=7)
    save_figure(fig, path)
    return True


def plot_acc_lambda_raw(rows: list[Row], path: Path, title: str) -> bool:
    """Figure 3: accuracy and λ_raw against rounds (e.g. V12 beside FLARE)."""
    rows = [r for r in rows if r.client_mean_curves("lambda_raw") is not None]
    if not rows:
        return False
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2))
    allv = []
    for row in rows:
        c = row.curves("acc")
        _mean_band(a1, row, rounds_axis(row, c.shape[1]), c, 100.0, label=row.label + _seed_note(row))
        lam = row.client_mean_curves("lambda_raw")
        n = lam.shape[1]
        m = _mean_band(a2, row, rounds_axis(row, n), lam, label=f"{row.label} (mean over clients)")
        cc = row.runs[0].client_curve("lambda_raw")[:n]
        with np.errstate(all="ignore"):
            hi = np.nanmax(cc, axis=1)
        a2.plot(rounds_axis(row, n), hi, ls=":", lw=1, color=method_colour(row.method),
                label=f"{row.label} (max client)")
        allv += list(m) + list(hi)
    lam_max = rows[0].runs[0].cfg.get("lam", {}).get("valve_threshold")
    if lam_max and any(r.runs[0].cfg.get("lam", {}).get("gamma_lambda") for r in rows):
        a2.axhline(lam_max, color="grey", ls="--", lw=1, label=f"safety-valve threshold {fmt_value(lam_max)}")
    _dress(a1, "test accuracy (%)", "accuracy", which="both", size=a1.title.get_fontsize())  # titles keep their size
    _log_if_decades(a2, allv, ratio=20)
    _dress(a2, "λ_raw = σ²_local / σ²_align", "raw λ", which="both", size=a2.title.get_fontsize())
    _legend_outside(a2, fontsize=7)
    _save_panels(fig, path, wrap_title(title, 120))
    return True


def plot_param_sweep(key: str, lines: list[SweepLine], path: Path, title: str) -> None:
    """Accuracy, g_protos_std and inter_client_proto_std against a swept value (e.g. λ0: the notes' U-shape)."""
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
            ax.errorbar(ln.x, y, yerr=e if e.any() else None, marker="o", ms=4, capsize=3, label=ln.label,
                        color=method_colour(ln.rows[0].method))
        _log_if_decades(ax, xs_all, axis="x", ratio=10)
        _dress(ax, ylabel, f"{ylabel} vs {short_key(key)}", xlabel=key, which="both")
    _legend_outside(axes[0][-1], fontsize=7)
    _save_panels(fig, path, wrap_title(title, 120))


def plot_label_distributions(runs: list[RunData], path: Path, max_panels: int = 12) -> bool:
    """One heat map (clients × classes, sample counts) per distinct partition among the runs."""
    parts: dict[str, tuple[str, dict]] = {}
    for r in runs:
        pt = r.partition
        if pt and "clients" in pt:  # the first run of each distinct split draws it
            parts.setdefault(repr(pt["clients"]), (f"{pt.get('dataset')} {pt.get('kind')} "
                                                   f"α={fmt_value(pt.get('alpha'))} seed {pt.get('seed')}", pt))
    if not parts:
        return False
    items = sorted(parts.values(), key=lambda t: t[0])[:max_panels]
    n = len(items)
    cols = min(n, 3)
    rws = math.ceil(n / cols)
    C = max(len(p["clients"][0]["class_histogram"]) for _, p in items)
    K = max(len(p["clients"]) for _, p in items)
    fig, axes = plt.subplots(rws, cols, figsize=(cols * max(4.4, 0.35 * C + 2.4), rws * max(3.0, 0.35 * K + 2.0)),
                             squeeze=False)
    for ax in axes.ravel()[n:]:
        ax.axis("off")
    for ax, (title, pt) in zip(axes.ravel(), items):
        _heat_map(fig, ax, pt, title, [""] * len(pt["clients"]), small=True)
    _save_panels(fig, path, "label distribution per client (non-IID partitions)", dpi=110)
    return True
