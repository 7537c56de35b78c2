"""summary.md and plots/ for one run directory (read back from its files, so it also works on old runs)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import yaml

ACC_ORDER = ("acc_feature", "acc_iffi", "acc_iffi_reference", "acc_output", "acc_fedavg")
DIAG = ("g_protos_std", "inter_client_proto_std", "model_variance_mean")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def integer_rounds(*axes) -> None:
    """Rounds are counted: tick them at integers only."""
    from matplotlib.ticker import MaxNLocator

    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def load_run(run_dir: str | Path) -> dict:
    from flare.runner import read_jsonl

    d = Path(run_dir)
    recs = read_jsonl(d / "metrics.jsonl")
    state = json.loads((d / "state.json").read_text()) if (d / "state.json").exists() else {}
    return {
        "dir": d,
        "config": yaml.safe_load((d / "config.yaml").read_text()) if (d / "config.yaml").exists() else {},
        "partition": json.loads((d / "partition.json").read_text()) if (d / "partition.json").exists() else {},
        "rounds": [r for r in recs if r.get("kind") == "round"],
        "clients": [r for r in recs if r.get("kind") == "client"],
        "state": state,
    }


def _f(v, digits=4):
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{digits}f}" if math.isfinite(v) else str(v)
    return str(v)


def plot_accuracy(run: dict, path: Path) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4))
    rounds = run["rounds"]
    for k in ACC_ORDER:
        if rounds and k in rounds[0]:
            ax.plot([r["round"] for r in rounds], [100 * r[k] for r in rounds], marker="o", ms=3,
                    label=k.removeprefix("acc_"))
    cfg = run["config"]
    ax.set(xlabel="round", ylabel="test accuracy (%)",
           title=f"{cfg.get('method', '')} on {cfg.get('dataset', {}).get('name', '')}, "
                 f"α={cfg.get('partition', {}).get('alpha', '')}")
    integer_rounds(ax)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:  # a server without a test set has no accuracy curves
        ax.legend(title="global predictor")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_label_distribution(partition: dict, path: Path) -> None:
    """Clients × classes bubble/heat map of sample counts — the picture of the non-IID split."""
    plt = _plt()
    hist = np.array([c["class_histogram"] for c in partition["clients"]])
    K, C = hist.shape
    fig, ax = plt.subplots(figsize=(max(5, 0.35 * C + 2), max(2.5, 0.4 * K + 1.5)))
    im = ax.imshow(hist, aspect="auto", cmap="viridis")
    if K * C <= 400:
        for i in range(K):
            for j in range(C):
                ax.text(j, i, str(hist[i, j]), ha="center", va="center", fontsize=7,
                        color="white" if hist[i, j] < hist.max() / 2 else "black")
    ax.set(xlabel="class", ylabel="client",
           title=f"label distribution ({partition.get('kind', '')}, α={partition.get('alpha', '')})")
    ax.set_yticks(range(K), [f"{i} (n={hist[i].sum()})" for i in range(K)])
    fig.colorbar(im, ax=ax, label="samples")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_diagnostics(run: dict, path: Path) -> None:
    plt = _plt()
    rounds = run["rounds"]
    keys = [k for k in DIAG if rounds and k in rounds[0]]
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.4), squeeze=False)
    for ax, k in zip(axes[0], keys):
        ax.plot([r["round"] for r in rounds], [r[k] for r in rounds], marker="o", ms=3)
        ax.set(xlabel="round", ylabel=k, title=k)
        integer_rounds(ax)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_lambda(run: dict, path: Path) -> bool:
    """λ per client against rounds; for λ-learner runs λ_eff and λ_raw, with V7's λ0(1 − p) beside."""
    clients = run["clients"]
    keys = [k for k in ("lambda_eff", "lambda_raw", "lambda") if clients and k in clients[0]]
    if not keys:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 3.6), squeeze=False)
    cfg = run["config"]
    ids = sorted({c["client"] for c in clients})
    for ax, k in zip(axes[0], keys):
        vals = []
        for cid in ids:
            rs = [c for c in clients if c["client"] == cid]
            y = [float(c[k]) for c in rs]
            vals += y
            ax.plot([c["round"] for c in rs], y, marker="o", ms=2, label=f"client {cid}")
        if k == "lambda_eff" and cfg.get("lam", {}).get("learner") not in (None, "none"):
            R = cfg["rounds"]
            lam0 = cfg.get("align", {}).get("lambda0", 5.0)
            p = np.arange(R) / R  # progress at the start of each round
            ax.plot(range(R), lam0 * (1 - p), "k--", label=f"V7: λ0(1−p), λ0={lam0:g}")
        finite = [v for v in vals if math.isfinite(v) and v > 0]
        if finite and max(finite) / max(min(finite), 1e-12) > 100:
            ax.set_yscale("log")
        ax.set(xlabel="round", ylabel=k, title=f"{k} per client")
        integer_rounds(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def summary_markdown(run: dict) -> str:
    cfg, rounds, part = run["config"], run["rounds"], run["partition"]
    lines = [f"# {cfg.get('method', 'run')} — {cfg.get('dataset', {}).get('name', '')}", ""]
    if cfg.get("description"):
        lines += [cfg["description"], ""]
    lines += [
        f"- clients {cfg.get('num_clients')}, partition {cfg.get('partition', {}).get('kind')} "
        f"α={cfg.get('partition', {}).get('alpha')}, rounds {cfg.get('rounds')} × local epochs "
        f"{cfg.get('local_epochs')}, batch {cfg.get('batch_size')}, lr {cfg.get('lr')}, model "
        f"{cfg.get('model', {}).get('name')} (width {cfg.get('model', {}).get('width')}), seed {cfg.get('seed')}",
        f"- status: {run['state'].get('status', 'unknown')}, rounds done: {len(rounds)}",
        "",
    ]
    if rounds:
        primary = rounds[-1].get("primary", "feature")
        lines += ["## Accuracy of every global predictor", "",
                  "| rule | final | peak | peak round |", "| --- | --- | --- | --- |"]
        for k in ACC_ORDER:
            if k in rounds[-1]:
                ys = [r[k] for r in rounds]
                b = int(np.argmax(ys))
                mark = " (primary)" if k == f"acc_{primary}" else ""
                lines.append(f"| {k.removeprefix('acc_')}{mark} | {100 * ys[-1]:.2f} | {100 * ys[b]:.2f} | "
                             f"{rounds[b]['round']} |")
        lines += ["", "## Diagnostics at the last round", "", "| metric | value |", "| --- | --- |"]
        for k in DIAG:
            if k in rounds[-1]:
                lines.append(f"| {k} | {_f(rounds[-1][k], 6)} |")
        if "client_acc" in rounds[-1]:
            lines.append(f"| client accuracies (alone) | {', '.join(f'{100 * a:.1f}' for a in rounds[-1]['client_acc'])} |")
        lines.append("")
    if part:
        lines += ["## Partition", "", "| client | samples | normalized entropy |", "| --- | --- | --- |"]
        for c in part["clients"]:
            lines.append(f"| {c['client']} | {c['num_samples']} | {c['normalized_entropy']:.4f} |")
        lines.append("")
    warns = run["state"].get("warnings") or []
    if warns:
        lines += ["## Warnings", ""] + [f"- {w}" for w in warns] + [""]
    lines += ["## Plots", "", "![accuracy](plots/accuracy.png)", "", "![labels](plots/label_distribution.png)", "",
              "![diagnostics](plots/diagnostics.png)", ""]
    if (run["dir"] / "plots" / "lambda.png").exists():
        lines += ["![lambda](plots/lambda.png)", ""]
    return "\n".join(lines)


def write_run_report(run_dir: str | Path) -> None:
    from flare.runner import atomic_write_text

    run = load_run(run_dir)
    plots = Path(run_dir) / "plots"
    plots.mkdir(exist_ok=True)
    if run["rounds"]:
        plot_accuracy(run, plots / "accuracy.png")
        plot_diagnostics(run, plots / "diagnostics.png")
        plot_lambda(run, plots / "lambda.png")
    if run["partition"]:
        plot_label_distribution(run["partition"], plots / "label_distribution.png")
    atomic_write_text(Path(run_dir) / "summary.md", summary_markdown(run))
