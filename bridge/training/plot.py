"""Loss and accuracy curves of training runs as one PNG (matplotlib, an optional dependency).

``plot_history({"bridge": trainer.history, "torch": other}, "run.png")``: on the left the loss
of every optimizer step (and the per-epoch validation loss when recorded), on the right the
per-epoch accuracy and validation accuracy; one colour per run, so runs can be overlaid.
"""
from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import BridgeError

if TYPE_CHECKING:
    from .trainer import History


class MissingDependencyError(BridgeError, ImportError):
    """An optional package that a feature needs is not installed."""


def plot_history(histories: Mapping[str, History], path: str | os.PathLike, title: str = "") -> Path:
    """Write the curves of ``histories`` (label -> ``bridge.History``) to the PNG ``path``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError as exc:
        raise MissingDependencyError("plotting needs matplotlib: pip install matplotlib "
                                     "(it is in bridge's test extra)") from exc
    figure, (loss_axis, accuracy_axis) = plt.subplots(1, 2, figsize=(11, 4))
    for index, (label, history) in enumerate(histories.items()):
        color = f"C{index}"
        steps = [record["loss"] for record in history.steps]
        loss_axis.plot(range(1, len(steps) + 1), steps, color=color, alpha=0.6, label=f"{label} loss (step)")
        _epoch_curve(loss_axis, history, "val_loss", len(steps), color, f"{label} val loss")
        for key, style in (("accuracy", "--"), ("val_accuracy", "-")):
            values = history[key]
            if any(v is not None for v in values):
                accuracy_axis.plot(range(1, len(values) + 1), values, style, color=color, marker="o",
                                   label=f"{label} {key.replace('_', ' ')}")
    loss_axis.set(xlabel="optimizer step", ylabel="loss", yscale="log")
    accuracy_axis.set(xlabel="epoch", ylabel="accuracy")
    accuracy_axis.xaxis.set_major_locator(MaxNLocator(integer=True))
    for axis in (loss_axis, accuracy_axis):
        if axis.lines:
            axis.legend(fontsize="small")
        axis.grid(alpha=0.3)
    if title:
        figure.suptitle(title)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def _epoch_curve(axis, history, key: str, steps: int, color: str, label: str) -> None:
    """A per-epoch metric drawn at the step that ends each epoch (on the step axis)."""
    values = history[key]
    if not values or any(v is None for v in values):
        return
    ends = [round(steps * (i + 1) / len(values)) for i in range(len(values))]
    axis.plot(ends, values, "o-", color=color, label=label)
