"""The matplotlib figures the notebooks and widgets share. Each function returns its Figure."""

from __future__ import annotations

import matplotlib.pyplot as plt


def new_figure(width: float = 7.0, height: float = 4.0):
    """A figure and axes in the course's house style."""
    fig, ax = plt.subplots(figsize=(width, height), layout="constrained")
    ax.grid(True, alpha=0.3)
    return fig, ax
