"""The overview's charts as SVG geometry: no chart library, no script, just numbers to plot.

A :class:`Chart` holds what the template draws: series as polyline segments (a minute
without a value breaks a line instead of drawing it at zero), axis ticks and labels. The
throughput chart has a linear scale from zero; the latency chart a log10 scale, because
p50 and p99 often differ by orders of magnitude and a linear scale would flatten p50.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import math
from collections.abc import Callable, Sequence

WIDTH = 640
HEIGHT = 200
LEFT = 52
RIGHT = 20
TOP = 12
BOTTOM = 26


@dataclasses.dataclass(frozen=True)
class Series:
    """One line: ``segments`` are SVG ``points`` strings (``"x,y x,y ..."``)."""

    name: str
    css_class: str
    segments: list[str]
    latest: str


@dataclasses.dataclass(frozen=True)
class Tick:
    position: float
    label: str


@dataclasses.dataclass(frozen=True)
class Chart:
    """Everything a template needs to draw one chart (sizes in SVG user units)."""

    title: str
    width: int
    height: int
    left: int
    top: int
    plot_width: int
    plot_height: int
    series: list[Series]
    y_ticks: list[Tick]
    x_ticks: list[Tick]
    empty: bool


def nice_ceiling(value: float) -> float:
    """The smallest of 1, 2, 2.5, 5 times 10^k at or above ``value`` (1 for ``value`` <= 0)."""
    if value <= 0:
        return 1.0
    exponent = math.floor(math.log10(value))
    for step in (1.0, 2.0, 2.5, 5.0, 10.0):
        candidate = step * 10.0**exponent
        if candidate >= value * (1 - 1e-9):
            return candidate
    return 10.0 ** (exponent + 1)


def format_count(value: float) -> str:
    """``950``, ``1.2k``, ``3M``: short axis labels."""
    for threshold, suffix in ((1e6, "M"), (1e3, "k")):
        if value >= threshold:
            scaled = value / threshold
            return f"{scaled:.{0 if scaled >= 10 or scaled.is_integer() else 1}f}{suffix}"
    return f"{value:.{0 if float(value).is_integer() else 1}f}"


def format_seconds(value: float) -> str:
    """``5 ms``, ``120 ms``, ``1.5 s``, ``100 s``, ``17 min``: latency labels."""
    if value < 1:
        return f"{value * 1000:.0f} ms"
    if value < 1000:
        return f"{value:.{0 if value >= 10 or value.is_integer() else 1}f} s"
    return f"{value / 60:.0f} min"


def _x_ticks(minutes: Sequence[dt.datetime], plot_width: int) -> list[Tick]:
    step = plot_width / max(1, len(minutes) - 1)
    return [
        Tick(LEFT + i * step, minute.strftime("%H:%M"))
        for i, minute in enumerate(minutes)
        if minute.minute % 10 == 0
    ]


def _segments(values: Sequence[float | None], x_step: float, y_of: Callable[[float], float]) -> list[str]:
    segments: list[str] = []
    current: list[str] = []
    for i, value in enumerate(values):
        if value is None:
            if current:
                segments.append(" ".join(current))
                current = []
            continue
        current.append(f"{LEFT + i * x_step:.1f},{y_of(value):.1f}")
    if current:
        segments.append(" ".join(current))
    return segments


def _chart(
    title: str, minutes: Sequence[dt.datetime], lines: list[Series], ticks: list[Tick], empty: bool
) -> Chart:
    plot_width, plot_height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    x_ticks = _x_ticks(minutes, plot_width)
    return Chart(title, WIDTH, HEIGHT, LEFT, TOP, plot_width, plot_height, lines, ticks, x_ticks, empty)


def counts_chart(
    title: str, minutes: Sequence[dt.datetime], series: Sequence[tuple[str, str, Sequence[int]]]
) -> Chart:
    """A linear chart of per-minute counts; ``series`` is ``(name, css class, values)``."""
    plot_width, plot_height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    top_value = nice_ceiling(max((max(values, default=0) for _, _, values in series), default=0))
    x_step = plot_width / max(1, len(minutes) - 1)

    def y_of(value: float) -> float:
        return TOP + plot_height * (1 - value / top_value)

    lines = [
        Series(name, css, _segments([float(v) for v in values], x_step, y_of), format_count(values[-1]))
        for name, css, values in series
        if values
    ]
    ticks = [Tick(y_of(top_value * f), format_count(top_value * f)) for f in (0, 0.25, 0.5, 0.75, 1)]
    empty = all(v == 0 for _, _, values in series for v in values)
    return _chart(title, minutes, lines, ticks, empty)


def latency_chart(
    title: str, minutes: Sequence[dt.datetime], series: Sequence[tuple[str, str, Sequence[float | None]]]
) -> Chart:
    """A log10 chart of per-minute latencies in seconds; None values break the line."""
    plot_width, plot_height = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    present = [v for _, _, values in series for v in values if v is not None and v > 0]
    low = 10 ** math.floor(math.log10(min(present))) if present else 0.01
    high = 10 ** math.ceil(math.log10(max(present))) if present else 10.0
    if high <= low:
        high = low * 10
    span = math.log10(high) - math.log10(low)
    x_step = plot_width / max(1, len(minutes) - 1)

    def y_of(value: float) -> float:
        clamped = min(max(value, low), high)
        return TOP + plot_height * (1 - (math.log10(clamped) - math.log10(low)) / span)

    lines = []
    for name, css, values in series:
        cleaned = [v if v is not None and v > 0 else None for v in values]
        latest = next((v for v in reversed(cleaned) if v is not None), None)
        lines.append(
            Series(
                name, css, _segments(cleaned, x_step, y_of), "-" if latest is None else format_seconds(latest)
            )
        )
    decades = range(round(math.log10(low)), round(math.log10(high)) + 1)
    ticks = [Tick(y_of(10.0**d), format_seconds(10.0**d)) for d in decades]
    return _chart(title, minutes, lines, ticks, not present)
