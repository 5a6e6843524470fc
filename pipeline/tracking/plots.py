"""Run figures rendered to PNG files with matplotlib's Agg backend: learning curves and the confusion matrix."""
from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Sequence, Union

import numpy as np

PathLike = Union[str, Path]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def learning_curves_png(history: List[Dict[str, float]], path: PathLike) -> Path:
    """Plot train_loss / val_loss (left axis) and val_acc (right axis) per epoch to `path`.

    Each history entry is one epoch's metrics; an `epoch` key is used as x when present. A key missing
    from an entry is skipped for that epoch.
    """
    if not history:
        raise ValueError("learning_curves_png: history is empty (no epoch was recorded)")
    plt = _pyplot()
    xs = [int(h.get("epoch", i)) for i, h in enumerate(history)]

    def series(key: str):
        pts = [(x, float(h[key])) for x, h in zip(xs, history) if h.get(key) is not None]
        return [p[0] for p in pts], [p[1] for p in pts]

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    try:
        for key, style in (("train_loss", "-o"), ("val_loss", "-s")):
            x, y = series(key)
            if x:
                ax.plot(x, y, style, label=key, markersize=3)
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("epoch")
        ax.set_ylabel("loss")
        ax.grid(True, alpha=0.3)
        handles, labels = ax.get_legend_handles_labels()
        x, y = series("val_acc")
        if x:
            ax2 = ax.twinx()
            ax2.plot(x, y, "-^", color="tab:green", label="val_acc", markersize=3)
            ax2.set_ylabel("accuracy")
            ax2.set_ylim(0.0, 1.0)
            h2, l2 = ax2.get_legend_handles_labels()
            handles, labels = handles + h2, labels + l2
        if handles:
            ax.legend(handles, labels, loc="best")
        ax.set_title("learning curves")
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out


def confusion_matrix_png(cm: np.ndarray, class_names: Sequence[str], path: PathLike) -> Path:
    """Plot a confusion matrix (rows = true class, columns = predicted) with counts in the cells."""
    cm = np.asarray(cm)
    n = len(class_names)
    if cm.shape != (n, n):
        raise ValueError(f"confusion_matrix_png: matrix shape {cm.shape} does not match {n} class names")
    plt = _pyplot()
    size = max(4.0, 0.5 * n + 2.0)
    fig, ax = plt.subplots(figsize=(size, size), dpi=100)
    try:
        im = ax.imshow(cm, cmap="Blues")
        fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
        ax.set_xticks(range(n), labels=[str(c) for c in class_names], rotation=45, ha="right")
        ax.set_yticks(range(n), labels=[str(c) for c in class_names])
        ax.set_xlabel("predicted")
        ax.set_ylabel("true")
        threshold = cm.max() / 2.0 if cm.size and cm.max() > 0 else 0.0
        if n <= 30:
            for i in range(n):
                for j in range(n):
                    value = cm[i, j]
                    text = f"{value:.2f}" if np.issubdtype(cm.dtype, np.floating) else str(int(value))
                    ax.text(j, i, text, ha="center", va="center", fontsize=8,
                            color="white" if value > threshold else "black")
        ax.set_title("confusion matrix")
        fig.tight_layout()
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out
