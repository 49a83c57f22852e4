"""`bench --scenario soak`: the run's history drawn as PNGs next to its verdict.

Three figures, time in minutes since the run's start, every fault window shaded in its kind's
colour: lateness of each task's first start by due time (with the p99 per 10 s), throughput
(ok ends, starts and tasks falling due per second), and each listener slot's RSS and open
descriptors (a restarted listener's line breaks where its predecessor's ends).

matplotlib is optional (`pip install 'keyexpiry[bench]'`) and imported only when plotting; the
per-task series are re-read from the run's files through `soak_verdict.load`, so the verdict
JSON stays small.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keyexpiry.bench.soak_history import Fault, History, load
from keyexpiry.bench.soak_verdict import BUCKET_S, lateness_points, throughput_series

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MAX_POINTS = 200_000
"""Lateness points drawn at most: beyond, every k-th is drawn, plus every one above the p99."""
LABEL_FAULTS_MAX = 80
"""Fault windows are labelled with their kind up to this many (beyond, the legend says it)."""
MIN_LATENESS_MS = 1.0
"""A log axis cannot show 0 or less: such lateness is drawn at 1 ms."""
FAULT_COLOURS = {
    "kill9": "tab:red",
    "sigstop": "tab:purple",
    "failover": "tab:orange",
    "pubsub_kill": "tab:olive",
    "ledger_restart": "tab:brown",
    "mariadb_restart": "tab:brown",
    "flushall": "tab:pink",
    "stall": "tab:cyan",
    "reshard": "tab:gray",
}
SLOT_COLOURS = ("tab:blue", "tab:green", "tab:orange", "tab:purple", "tab:red")
FIG_SIZE_IN = (13.0, 5.5)
DPI = 110


def _minutes(t_ms: float, t0_ms: int) -> float:
    return (t_ms - t0_ms) / 60_000


def _new_figure(rows: int = 1) -> tuple[Figure, list[Axes]]:
    # A Figure with its own Agg canvas, not pyplot: no global state, no GUI backend chosen.
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise RuntimeError(
            "plotting the soak run needs matplotlib: pip install 'keyexpiry[bench]'"
        ) from exc
    height_in = FIG_SIZE_IN[1] * (1.4 if rows > 1 else 1.0)
    fig = Figure(figsize=(FIG_SIZE_IN[0], height_in), dpi=DPI, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False)
    return fig, [row[0] for row in axes]


def _shade_faults(ax: Axes, faults: list[Fault], t0_ms: int, settle_s: float, label: bool) -> None:
    """Shade each fault's window; the settle time after it in a lighter tone."""
    from matplotlib.transforms import blended_transform_factory

    on_top = blended_transform_factory(ax.transData, ax.transAxes)
    for f in faults:
        colour = FAULT_COLOURS.get(f.kind, "tab:gray")
        start, end = _minutes(f.start_ms, t0_ms), _minutes(f.end_ms, t0_ms)
        # A line as well: a kill -9 has no duration, and its span alone would be invisible.
        ax.axvline(start, color=colour, lw=0.8, alpha=0.7)
        ax.axvspan(start, end, color=colour, alpha=0.25, lw=0)
        ax.axvspan(end, _minutes(f.end_ms + settle_s * 1000, t0_ms), color=colour, alpha=0.08, lw=0)
        if label and len(faults) <= LABEL_FAULTS_MAX:
            ax.text(
                start,
                0.99,
                f.kind,
                transform=on_top,
                rotation=90,
                va="top",
                ha="right",
                fontsize=7,
                color=colour,
            )


def _legend(ax: Axes, faults: list[Fault]) -> None:
    """The lines' legend plus one patch per kind of fault present."""
    from matplotlib.patches import Patch

    handles, labels = ax.get_legend_handles_labels()
    for kind in sorted({f.kind for f in faults}):
        handles.append(Patch(color=FAULT_COLOURS.get(kind, "tab:gray"), alpha=0.35))
        labels.append(f"fault: {kind}")
    ax.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)


def _thin(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """At most about MAX_POINTS points, keeping every one above the p99 (the ones that matter)."""
    if len(points) <= MAX_POINTS:
        return points
    p99 = sorted(late for _, late in points)[int(0.99 * len(points))]
    step = math.ceil(len(points) / MAX_POINTS)
    return [p for n, p in enumerate(points) if n % step == 0 or p[1] > p99]


def _p99_per_bucket(points: list[tuple[int, int]], t0_ms: int) -> tuple[list[float], list[float]]:
    buckets: dict[int, list[int]] = defaultdict(list)
    for due_ms, late_ms in points:
        buckets[(due_ms - t0_ms) // (BUCKET_S * 1000)].append(late_ms)
    xs, ys = [], []
    for n in sorted(buckets):
        ordered = sorted(buckets[n])
        xs.append((n + 0.5) * BUCKET_S / 60)
        ys.append(max(MIN_LATENESS_MS, ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]))
    return xs, ys


def plot_lateness(history: History, params: dict[str, Any], path: Path) -> Path:
    """Lateness of each task's first start by due time, log scale, p99 per 10 s, faults shaded."""
    from matplotlib.ticker import LogFormatter

    t0_ms = int(params["start_ms"])
    fig, (ax,) = _new_figure()
    points = lateness_points(history)
    shown = _thin(points)
    ax.plot(
        [_minutes(d, t0_ms) for d, _ in shown],
        [max(MIN_LATENESS_MS, float(late)) for _, late in shown],
        linestyle="none",
        marker=".",
        markersize=1.5,
        alpha=0.3,
        color="tab:blue",
        rasterized=True,
        label=f"one task's first start ({len(shown):,} of {len(points):,})",
    )
    xs, ys = _p99_per_bucket(points, t0_ms)
    ax.plot(xs, ys, color="black", lw=1.2, label=f"p99 per {BUCKET_S} s of due time")
    ax.set_yscale("log")
    # Plain milliseconds (50, 2000) read faster than 5x10^1 on a log axis.
    ax.yaxis.set_major_formatter(LogFormatter())
    ax.yaxis.set_minor_formatter(LogFormatter(labelOnlyBase=False, minor_thresholds=(1.5, 0.5)))
    _shade_faults(ax, history.faults, t0_ms, float(params.get("settle_s", 10)), label=True)
    ax.set_title("Soak: lateness of each task's first start (start minus the producer's due)")
    ax.set_xlabel("due time (minutes since the run started)")
    ax.set_ylabel(f"lateness (ms, log; <= 0 drawn at {MIN_LATENESS_MS:g})")
    ax.grid(True, which="major", alpha=0.3)
    _legend(ax, history.faults)
    fig.savefig(path)
    return path


def plot_throughput(history: History, params: dict[str, Any], path: Path) -> Path:
    """Ok ends, starts and tasks falling due per second (10 s buckets), faults shaded."""
    t0_ms = int(params["start_ms"])
    series = throughput_series(history, t0_ms, int(params["end_ms"]))
    xs = [(n + 0.5) * series.bucket_s / 60 for n in range(len(series.ok_ends))]

    def per_s(counts: list[int]) -> list[float]:
        return [c / series.bucket_s for c in counts]

    fig, (ax,) = _new_figure()
    ax.plot(xs, per_s(series.due), color="gray", lw=1, ls="--", label="tasks falling due")
    ax.plot(xs, per_s(series.starts), color="tab:orange", lw=1, label="handler starts")
    ax.plot(xs, per_s(series.ok_ends), color="tab:green", lw=1.2, label="ok ends")
    _shade_faults(ax, history.faults, t0_ms, float(params.get("settle_s", 10)), label=True)
    ax.set_title(f"Soak: throughput (per second, averaged over {series.bucket_s} s)")
    ax.set_xlabel("time (minutes since the run started)")
    ax.set_ylabel("tasks per second")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    _legend(ax, history.faults)
    fig.savefig(path)
    return path


def _slot_lines(
    samples: list[dict[str, Any]], t0_ms: int, metric: str
) -> dict[int, tuple[list[float], list[float]]]:
    """Per slot: x (minutes) and y, with a NaN where the slot's process changed (a restart)."""
    lines: dict[int, tuple[list[float], list[float]]] = {}
    last_pid: dict[int, int] = {}
    for sample in samples:
        for entry in sample.get("listeners") or ():
            slot, pid, value = int(entry["slot"]), int(entry["pid"]), entry.get(metric)
            xs, ys = lines.setdefault(slot, ([], []))
            x = _minutes(sample["t_ms"], t0_ms)
            if slot in last_pid and last_pid[slot] != pid:
                xs.append(x)
                ys.append(math.nan)
            last_pid[slot] = pid
            xs.append(x)
            ys.append(math.nan if value is None else float(value))
    return lines


def plot_listeners(history: History, params: dict[str, Any], path: Path) -> Path:
    """RSS and open descriptors per listener slot; a restart breaks the slot's line."""
    t0_ms = int(params["start_ms"])
    fig, (ax_rss, ax_fds) = _new_figure(rows=2)
    settle_s = float(params.get("settle_s", 10))
    for ax, metric, unit in ((ax_rss, "rss_mb", "RSS (MB)"), (ax_fds, "fds", "open fds (count)")):
        for slot, (xs, ys) in sorted(_slot_lines(history.samples, t0_ms, metric).items()):
            colour = SLOT_COLOURS[slot % len(SLOT_COLOURS)]
            ax.plot(xs, ys, color=colour, lw=1.2, marker=".", markersize=2, label=f"slot {slot}")
        _shade_faults(ax, history.faults, t0_ms, settle_s, label=ax is ax_rss)
        ax.set_ylabel(unit)
        ax.grid(True, alpha=0.3)
        _legend(ax, history.faults)
    warm_up_min = float(params.get("warm_up_s", 0)) / 60
    for ax in (ax_rss, ax_fds):
        ax.axvline(warm_up_min, color="black", lw=0.8, ls=":")
    ax_rss.set_title(
        "Soak: listener RSS and descriptors per slot (a break is a restart; dotted: end of warm-up)"
    )
    ax_fds.set_xlabel("time (minutes since the run started)")
    fig.savefig(path)
    return path


def plot(run_dir: Path, verdict: dict[str, Any], history: History | None = None) -> list[Path]:
    """Write the soak run's three PNGs into `run_dir`; their paths.

    `verdict` is `soak_verdict.verdict()`'s answer (its `params` give the run's times); the
    per-task series come from `history` (`soak_verdict.load(run_dir)`, pass it to skip reading
    the files again: an hour at 500 tasks/s takes about 20 s to read). Raises RuntimeError
    without matplotlib.
    """
    _new_figure()  # fail on a missing matplotlib before reading a large history
    if history is None:
        history = load(run_dir)
    params = verdict["params"]
    return [
        plot_lateness(history, params, run_dir / "soak-lateness.png"),
        plot_throughput(history, params, run_dir / "soak-throughput.png"),
        plot_listeners(history, params, run_dir / "soak-listeners.png"),
    ]
