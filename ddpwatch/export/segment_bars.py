"""The article's comparison as a picture: per segment, one bar of the step window.

A bar splits the step window K into Compute, Non_Compute (exposed communication) and Idle,
which add up to 100 %; Overlap is marked inside Compute as the part that communication ran
beside (``hidden_comm_pct`` = Overlap% × Comm_overhead% / 100, i.e. |C ∩ M| / K), so the hatched
part plus Non_Compute is all the communication there was, hidden and exposed. A bar's length is
its segment's time per sample against the slowest segment's (``lengths``), so the bars compare
speed as well as where the time went: at one length for all, a segment that trains 50 % faster
would draw a bar as long as the slower one's. Pure: the dashboard draws it in cells and the
exporter as ``summary.svg``, from the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape

#: (name, what it is, SVG colour): the order the parts are drawn in, left to right.
PARTS: tuple[tuple[str, str, str], ...] = (
    ("compute", "Compute, nothing communicating", "#4caf50"),
    ("hidden", "Compute with communication hidden behind it (Overlap)", "#a5d6a7"),
    ("exposed", "Non_Compute: exposed communication", "#e53935"),
    ("idle", "Idle", "#bdbdbd"),
)


@dataclass(frozen=True)
class SegmentBar:
    """One segment's step window in percent: the four parts add up to 100 (or all are 0)."""

    label: str
    compute: float  # Compute% less the hidden part
    hidden: float  # the part of Compute% that communication ran beside
    exposed: float  # Non_Compute%
    idle: float
    overlap_pct: float  # Overlap% itself, for the label
    length: float = 1.0  # of the longest bar: time per sample over the slowest segment's (``lengths``)

    @property
    def parts(self) -> tuple[float, float, float, float]:
        return (self.compute, self.hidden, self.exposed, self.idle)

    @property
    def measured(self) -> bool:
        """False for a segment with no counted step (its figures all 0): drawn as saying so, not
        as an empty bar with "Overlap 0 %", which reads as measured."""
        return sum(self.parts) > 0


def segment_bar(label: str, compute_pct: float, non_compute_pct: float, idle_pct: float,
                hidden_comm_pct: float, overlap_pct: float, length: float = 1.0) -> SegmentBar:
    """The hidden part is clamped into Compute% (each is a mean over steps, so a rounding apart)."""
    hidden = min(max(hidden_comm_pct, 0.0), max(compute_pct, 0.0))
    return SegmentBar(label, max(compute_pct, 0.0) - hidden, hidden, max(non_compute_pct, 0.0),
                      max(idle_pct, 0.0), overlap_pct, min(max(length, 0.0), 1.0))


def lengths(samples_per_s: Sequence[float]) -> list[float]:
    """Each segment's bar length: its time per sample (1 / samples/s) over the slowest segment's.
    A segment with no throughput measured (0) is drawn at full length."""
    seconds = [1.0 / rate if rate > 0 else 0.0 for rate in samples_per_s]
    slowest = max(seconds, default=0.0)
    return [t / slowest if t > 0 and slowest > 0 else 1.0 for t in seconds]


def cells(bar: SegmentBar, width: int) -> tuple[int, ...]:
    """Cells per part across the bar's share of ``width`` (``length``: at least one cell),
    summing to it exactly (largest remainder, ties to the earlier part), so the parts of a
    full-length bar fill the width. An empty window (every part 0) gives no cells."""
    total = sum(bar.parts)
    if total <= 0 or width <= 0:
        return (0,) * len(bar.parts)
    width = max(1, round(width * bar.length))
    exact = [width * part / total for part in bar.parts]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(exact)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in by_remainder[: width - sum(counts)]:
        counts[i] += 1
    return tuple(counts)


NOT_MEASURED = "no counted step"  # a segment whose steps were all excluded, or none folded yet
LENGTH_MEANS = "a bar's length: its time per sample, the slowest the longest"
BAR_PX = 480
ROW_PX = 28
LABEL_PX = 260


def bars_svg(bars: Sequence[SegmentBar], title: str) -> str:
    """A standalone SVG: one row per segment (its label, the bar, Overlap% after the longest) and
    a legend. Widths are the percentages of the bar's length of ``BAR_PX``, unrounded."""
    top = 40
    height = top + ROW_PX * len(bars) + 20 + 18 * len(PARTS) + 10
    width = LABEL_PX + BAR_PX + 120
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<text x="8" y="20" font-size="14" font-weight="bold">{escape(title)}</text>']
    for row, bar in enumerate(bars):
        y = top + row * ROW_PX
        out.append(f'<text x="8" y="{y + 15}">{escape(bar.label)}</text>')
        total = sum(bar.parts)
        x = float(LABEL_PX)
        for (name, what, colour), part in zip(PARTS, bar.parts, strict=True):
            w = BAR_PX * bar.length * part / total if total > 0 else 0.0
            if w > 0:
                out.append(f'<rect class="{name}" x="{x:.2f}" y="{y}" width="{w:.2f}" height="20" fill="{colour}">'
                           f'<title>{escape(what)}: {part:.1f} %</title></rect>')
            x += w
        if bar.measured:
            out.append(f'<text x="{LABEL_PX + BAR_PX + 8}" y="{y + 15}">Overlap {bar.overlap_pct:.0f} %</text>')
        else:
            out.append(f'<text x="{LABEL_PX}" y="{y + 15}" fill="#757575">{NOT_MEASURED}</text>')
    y = top + ROW_PX * len(bars) + 10
    for index, (name, what, colour) in enumerate(PARTS):
        out.append(f'<rect x="8" y="{y + 18 * index}" width="12" height="12" fill="{colour}"/>'
                   f'<text x="26" y="{y + 18 * index + 11}">{escape(what)}</text>')
    out.append(f'<text x="{LABEL_PX}" y="{y + 11}" fill="#757575">{LENGTH_MEANS}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
