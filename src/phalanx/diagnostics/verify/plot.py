"""A picture of ``phalanx verify``: each step's largest difference against its noise bound.

One panel, log scale: the difference of the checked run from the reference per step (dots,
red past the bound), the bound (a line) and the noise it was made from (dashed), with the first
divergence named. Needs matplotlib (``pip install 'phalanx[bench]'``).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from phalanx._optional import require

if TYPE_CHECKING:
    from phalanx.diagnostics.verify.cli import Verification

__all__ = ["plot_divergence"]

TINY = 1e-12
"""Where zero is drawn on the log scale (a difference of exactly 0 is common)."""


def plot_divergence(result: Verification, out: str | os.PathLike[str]) -> None:
    """Draw ``result``'s steps into the PNG ``out``."""
    require("bench", "phalanx verify --plot", ["matplotlib"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [s.step for s in result.steps]
    diffs = [max(s.difference, TINY) for s in result.steps]
    fig, ax = plt.subplots(figsize=(max(7.0, 0.25 * len(steps) + 4), 4.2))
    ax.plot(steps, [max(s.bound, TINY) for s in result.steps], color="#444444", label="bound")
    ax.plot(
        steps,
        [max(s.noise, TINY) for s in result.steps],
        color="#999999",
        linestyle="--",
        label="noise (reference against its twin)",
    )
    colours = ["#d62728" if s.diverged else "#1f77b4" for s in result.steps]
    ax.scatter(steps, diffs, c=colours, zorder=3, label="largest difference")
    d = result.divergence
    if d is not None:
        right = d.step > (steps[0] + steps[-1]) / 2 if steps else False
        ax.annotate(
            f"first divergence: step {d.step}, {d.name}",
            (d.step, max(d.difference, TINY)),
            xytext=(-8 if right else 8, -14),
            textcoords="offset points",
            ha="right" if right else "left",
            fontsize=8,
            color="#d62728",
        )
    ax.set_yscale("log")
    ax.text(
        0.99,
        0.01,
        "0 is drawn at 1e-12",
        transform=ax.transAxes,
        ha="right",
        fontsize=7,
        color="#777777",
    )
    ax.set_xlabel("step")
    ax.set_ylabel("relative difference (max |a-b| / max |a|)")
    ax.set_title(f"phalanx verify --mode {result.mode}: {result.title}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
