"""Plots of an acceptance report."""

import os
from pathlib import Path


def plot_acceptance(report, path):
    """Acceptance rate per draft position: overall (bold) and one line per category."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = report["num_draft_tokens"]
    positions = list(range(1, k + 1))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, summary in report["categories"].items():
        ax.plot(positions, _nan(summary["position_acceptance"]), marker=".", alpha=0.6,
                label=f"{name} ({summary['acceptance_length']:.2f})")
    overall = report["overall"]
    ax.plot(positions, _nan(overall["position_acceptance"]), color="black", linewidth=2.5,
            marker="o", label=f"overall ({overall['acceptance_length']:.2f})")
    ax.set_xlabel("draft position j" if report.get("tree") is None else "tree depth j")
    ax.set_ylabel("P(j accepted | j-1 accepted)")
    ax.set_ylim(-0.02, 1.02)
    ax.set_xticks(positions)
    tree = report.get("tree")
    shape = (f"k={k}" if tree is None
             else f"tree depth {k}, top-{tree['top_k']}, {tree['nodes']} nodes")
    ax.set_title(f"{report['algo']}: acceptance length {overall['acceptance_length']:.2f} "
                 f"({shape}, {report['num_prompts']} prompts)")
    ax.legend(fontsize=8, title="category (acceptance length)")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


def save_figure(fig, path, dpi: int):
    """Write `fig` beside `path` and rename it into place once whole, then close it: a reader
    never sees half a picture, and an interrupted run leaves the old one."""
    import matplotlib.pyplot as plt

    path = Path(path)
    partial = path.with_name(f".{path.name}.partial")
    try:
        fig.savefig(partial, dpi=dpi, format=path.suffix.lstrip(".") or "png")
        os.replace(partial, path)
    finally:
        plt.close(fig)
        partial.unlink(missing_ok=True)


def _nan(values):
    return [float("nan") if v is None else v for v in values]
