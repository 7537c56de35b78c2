"""Figures for `flare compare`: every method's primary accuracy against rounds, and the server
diagnostics (`g_protos_std`, `inter_client_proto_std`) of every prototype method against rounds — the plot in
which the notes' finding "alignment lowers g_protos_std" is seen at a glance."""
from __future__ import annotations

from pathlib import Path

from flare.report.run_report import _plt, integer_rounds, load_run

COMPARE_DIAG = ("g_protos_std", "inter_client_proto_std")


def _label(run: dict, d: Path) -> str:
    return run["config"].get("method", d.name)


def plot_compare(run_dirs: list[Path], path: Path, title: str = "") -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for d in run_dirs:
        run = load_run(d)
        rounds = run["rounds"]
        if not rounds:
            continue
        key = f"acc_{rounds[-1].get('primary', 'feature')}"
        ax.plot([r["round"] for r in rounds], [100 * r[key] for r in rounds], marker="o", ms=3,
                label=f"{_label(run, d)} ({key.removeprefix('acc_')})")
    ax.set(xlabel="round", ylabel="test accuracy (%)", title=title)
    integer_rounds(ax)
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_compare_diagnostics(run_dirs: list[Path], path: Path, title: str = "") -> bool:
    """One panel per diagnostic, one line per method that has it; False (and no file) when none has any
    (plain classifiers have no prototypes)."""
    runs = [(d, load_run(d)) for d in run_dirs]
    keys = [k for k in COMPARE_DIAG if any(r["rounds"] and k in r["rounds"][0] for _, r in runs)]
    if not keys:
        return False
    plt = _plt()
    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 3.8), squeeze=False)
    for ax, k in zip(axes[0], keys):
        for d, run in runs:
            rounds = [r for r in run["rounds"] if k in r]
            if rounds:
                ax.plot([r["round"] for r in rounds], [r[k] for r in rounds], marker="o", ms=3,
                        label=_label(run, d))
        ax.set(xlabel="round", ylabel=k, title=k)
        integer_rounds(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
