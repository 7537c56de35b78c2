"""One figure for `flare compare`: the primary accuracy of every method against rounds."""
from __future__ import annotations

from pathlib import Path

from flare.report.run_report import _plt, load_run


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
                label=f"{run['config'].get('method', d.name)} ({key.removeprefix('acc_')})")
    ax.set(xlabel="round", ylabel="test accuracy (%)", title=title)
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
