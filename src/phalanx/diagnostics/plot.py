"""A picture of each step's critical path: where its time went, by phase and by rank.

Two panels share the step axis. Above, each step's bar stacks the path's milliseconds by phase,
with the critical rank and phase written over it; below, the same milliseconds stacked by rank,
and the other ranks' mean measured wait as a line. Needs matplotlib
(``pip install 'phalanx[bench]'``).
"""

from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from phalanx._optional import require
from phalanx.diagnostics.critical_path import COMMUNICATION, CriticalPath
from phalanx.diagnostics.events import OTHER

__all__ = ["plot_critical_path"]

PHASE_COLOURS = {
    "data": "#8da0cb",
    "forward": "#66c2a5",
    "backward": "#fc8d62",
    "optimizer": "#e78ac3",
    COMMUNICATION: "#b3b3b3",
    OTHER: "#e5c494",
}


def plot_critical_path(path: CriticalPath, out: str | os.PathLike[str], title: str = "") -> None:
    """Draw ``path``'s steps into the PNG ``out``."""
    require("bench", "phalanx timeline --plot", ["matplotlib"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = path.steps
    xs = [s.step for s in steps]
    width = max(9.0, 0.3 * len(xs) + 4)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(width, 7), sharex=True)
    by_phase, by_rank = _stacks(path)
    _stack(top, xs, by_phase, lambda k: PHASE_COLOURS.get(k, "#999999"), lambda k: k)
    totals = [1e3 * sum(s.path.values()) for s in steps]
    cap = _cap(totals)
    for s, total in zip(steps, totals):
        label = f"r{s.rank}\n{s.phase[:4]}"
        if total > cap:  # a set-up step off the scale: its bar is cut, its height written
            label += f"\n{total:.0f} ms"
        top.annotate(label, (s.step, min(total, cap)), ha="center", va="bottom", fontsize=7)
    top.set_ylabel("ms on the critical path\n(by phase)")
    top.set_ylim(0, 1.3 * min(cap, max(totals, default=1.0)))  # room for the labels
    top.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    cmap = plt.get_cmap("tab10")
    _stack(bottom, xs, by_rank, lambda k: cmap(int(k) % 10), lambda k: f"rank {k}")
    bottom.plot(xs, [1e3 * s.others_waited for s in steps], "k.-", lw=1, label="others waited")
    bottom.set_ylim(0, 1.15 * min(cap, max(totals, default=1.0)))
    bottom.set_ylabel("ms on the critical path\n(by rank)")
    bottom.set_xlabel("step")
    bottom.xaxis.get_major_locator().set_params(integer=True)
    bottom.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.suptitle(title or "critical path per step")
    fig.tight_layout()
    fig.savefig(os.fspath(out), dpi=110)
    plt.close(fig)


def _cap(totals: list[float]) -> float:
    """The height the axes show: all of it, unless a few steps (set-up in step 1, a checkpoint)
    are over 5 times the median step, which would flatten the rest: then 3 times the median."""
    if len(totals) < 4:
        return max(totals, default=1.0)
    median = sorted(totals)[len(totals) // 2]
    return 3 * median if max(totals) > 5 * median > 0 else max(totals)


def _stacks(path: CriticalPath) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Milliseconds per step, by phase and by rank (keys as strings)."""
    n = len(path.steps)
    by_phase: dict[str, list[float]] = defaultdict(lambda: [0.0] * n)
    by_rank: dict[str, list[float]] = defaultdict(lambda: [0.0] * n)
    for i, s in enumerate(path.steps):
        for (rank, phase), seconds in s.path.items():
            by_phase[phase][i] += 1e3 * seconds
            by_rank[str(rank)][i] += 1e3 * seconds
    known = [p for p in PHASE_COLOURS if p in by_phase]
    order = known + sorted(set(by_phase) - set(PHASE_COLOURS))
    ranks = dict(sorted(by_rank.items(), key=lambda kv: int(kv[0])))
    return {p: by_phase[p] for p in order}, ranks


def _stack(
    ax: Any,
    xs: list[int],
    stacks: dict[str, list[float]],
    colour: Callable[[str], Any],
    label: Callable[[str], str],
) -> None:
    bottom = [0.0] * len(xs)
    for key, values in stacks.items():
        ax.bar(xs, values, bottom=bottom, color=colour(key), label=label(key), width=0.8)
        bottom = [b + v for b, v in zip(bottom, values)]
