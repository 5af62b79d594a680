"""``ddpwatch compare``: recorded runs side by side, each segment held against the first.

Why: a run ddpwatch did not start (``attach``, the Trainer callback) cannot switch live, so what a
change buys (another bucket cap, accumulation, a sharded optimizer, another machine) is measured by
running the script twice. Two summary tables read one after the other leave the user to divide the
figures, and to guess whether a 3 % difference in step time is the change or the steps' spread.
Here each segment's step time and throughput are given as a ratio of the first segment's, with a
verdict from their medians' 90 % intervals (``order_statistics.intervals_apart``), and what else
differs between the runs (ranks, devices, model, global batch) is said, since then the figures
compare the runs, not the change alone.

Pure: summaries (summary.json's dicts) in, markdown lines out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddpwatch.wording.data_wait import extremes, most_and_least
from ddpwatch.figures.order_statistics import intervals_apart

COLUMNS = ("run", "segment", "steps", "step ms p50", "90 % interval", "× step", "samples/s", "× samples/s",
           "Compute%", "Non_Compute%", "Idle%", "Data wait%", "Overlap%", "all_reduce calls / rank / step")


@dataclass(frozen=True)
class ComparedSegment:
    """One segment of one run, with the figures a comparison reads."""

    run: str
    label: str
    steps: int
    step_ms_p50: float
    interval: tuple[float, float] | None  # the median's 90 % interval, where the summary has one
    samples_per_s: float
    compute_pct: float
    non_compute_pct: float
    idle_pct: float
    overlap_pct: float
    all_reduce_calls: float
    data_wait_pct: float | None = None  # None: a summary without it
    #: The loop's own compute it marked (``watch.computing``), ms a step, and what it said it was.
    loop_compute_ms: float = 0.0
    loop_computed: tuple[str, ...] = ()
    #: The collectives the loop issued itself and ddpwatch timed (a metric's gather, a loss's
    #: all-reduce for the log): how many a step on a rank, and their ms a step (mean of ranks).
    loop_collectives: float = 0.0
    loop_collective_ms: float = 0.0
    #: The rank the segment's straggler rule named (summary.json's ``straggler``: its rank and how
    #: long the others waited for it, ms a step), None where it named none.
    straggler: tuple[int, float] | None = None
    #: Each rank's own Data wait% over the segment (summary.json's ``per_rank``), by rank; empty
    #: in a summary without it.
    data_wait_by_rank: tuple[tuple[int, float], ...] = ()


def compared_segments(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[ComparedSegment]:
    """Every segment with counted steps, run by run in the order given; a segment without
    (every step excluded: ``n/a`` in its table) has no figures to hold against another."""
    found = []
    for name, summary in runs:
        for seg in summary.get("segments", []):
            if not seg.get("steps"):
                continue
            interval = seg.get("step_ms_p50_interval")
            found.append(ComparedSegment(
                run=name, label=seg.get("label") or seg.get("strategy", "?"), steps=seg["steps"],
                step_ms_p50=seg["step_ms_p50"], interval=tuple(interval) if interval else None,
                samples_per_s=seg["samples_per_s"], compute_pct=seg["compute_pct"],
                non_compute_pct=seg["non_compute_pct"], idle_pct=seg["idle_pct"], overlap_pct=seg["overlap_pct"],
                all_reduce_calls=seg["all_reduce_calls"], data_wait_pct=seg.get("data_wait_pct"),
                loop_compute_ms=seg.get("loop_compute_ms", 0.0), loop_computed=tuple(seg.get("loop_computed", ())),
                loop_collectives=seg.get("loop_collectives") or 0.0, loop_collective_ms=seg.get("loop_collective_ms") or 0.0,
                straggler=straggler_of(seg), data_wait_by_rank=data_wait_by_rank_of(seg)))
    return found


def straggler_of(seg: dict[str, Any]) -> tuple[int, float] | None:
    """``ComparedSegment.straggler`` of one of summary.json's segments."""
    named = seg.get("straggler")
    return (int(named["rank"]), float(named["waited_ms_per_step"])) if named else None


def data_wait_by_rank_of(seg: dict[str, Any]) -> tuple[tuple[int, float], ...]:
    """``ComparedSegment.data_wait_by_rank`` of one of summary.json's segments."""
    per_rank = seg.get("per_rank") or {}
    return tuple(sorted((int(rank), float(figures["data_wait_pct"])) for rank, figures in per_rank.items()
                        if figures.get("data_wait_pct") is not None))


def ratio(value: float, base: float) -> float | None:
    """``value`` as a multiple of ``base``; None where the base measured nothing (shown as "—")."""
    return value / base if base > 0 else None


def verdict(segment: ComparedSegment, base: ComparedSegment) -> str:
    """Whether the step times of two segments are told apart by their steps."""
    if segment.interval is None or base.interval is None:
        return "no interval to judge by (a summary written before they were kept)"
    if intervals_apart(segment.interval, base.interval):
        return "90 % intervals apart: a measured difference"
    return "90 % intervals overlap: not told apart by these steps (more steps narrow them)"


def change_line(segment: ComparedSegment, base: ComparedSegment) -> str:
    """What ``segment`` reads against ``base``, in one line."""
    step = ratio(segment.step_ms_p50, base.step_ms_p50)
    rate = ratio(segment.samples_per_s, base.samples_per_s)
    return (f"- {segment.run}, {segment.label}: step p50 {base.step_ms_p50:.1f} → {segment.step_ms_p50:.1f} ms"
            f"{'' if step is None else f' (×{step:.2f})'}, {verdict(segment, base)}; samples/s "
            f"{base.samples_per_s:.1f} → {segment.samples_per_s:.1f}{'' if rate is None else f' (×{rate:.2f})'}; "
            f"exposed communication (Non_Compute%) {base.non_compute_pct:.1f} → {segment.non_compute_pct:.1f} %, "
            f"Overlap% {base.overlap_pct:.1f} → {segment.overlap_pct:.1f}{loop_compute_change(segment, base)}"
            f"{loop_collectives_change(segment, base)}"
            f"{straggler_change(segment, base)}{data_wait_change(segment, base)}")


def straggler_change(segment: ComparedSegment, base: ComparedSegment) -> str:
    """The straggler against ``base``'s, where either segment named one: whether a change (a
    balanced loader, a slow node left out) made the others stop waiting ("; straggler rank 1,
    waited for 30.1 ms a step → none")."""
    if segment.straggler is None and base.straggler is None:
        return ""

    def named(straggler: tuple[int, float] | None) -> str:
        return "none" if straggler is None else f"rank {straggler[0]}, waited for {straggler[1]:.1f} ms a step"

    return f"; straggler {named(base.straggler)} → {named(segment.straggler)}"


def data_wait_change(segment: ComparedSegment, base: ComparedSegment) -> str:
    """The ranks' own Data wait% against ``base``'s, where either segment's were uneven
    (``data_wait.most_and_least``): the mean in the table hides one rank's slow loader
    ("; Data wait by rank: rank 1 84.7 %, rank 0 2.3 % → rank 1 3.1 %, rank 0 2.9 %, the most and the least")."""
    if most_and_least(dict(base.data_wait_by_rank)) is None and most_and_least(dict(segment.data_wait_by_rank)) is None:
        return ""

    def spread(pairs: tuple[tuple[int, float], ...]) -> str:
        if not pairs:
            return "not kept"
        by_rank = dict(pairs)
        most, least = extremes(by_rank)
        return f"rank {most} {by_rank[most]:.1f} %, rank {least} {by_rank[least]:.1f} %"

    return f"; Data wait by rank: {spread(base.data_wait_by_rank)} → {spread(segment.data_wait_by_rank)}, the most and the least"


def loop_compute_change(segment: ComparedSegment, base: ComparedSegment) -> str:
    """The loop's marked compute against ``base``'s, where either marked any: what an average of
    the weights or a teacher added to the step ("; the loop's own compute (ema) 0.0 → 9.0 ms a step")."""
    if not (segment.loop_compute_ms or base.loop_compute_ms):
        return ""
    names = ", ".join(dict.fromkeys((*base.loop_computed, *segment.loop_computed)))
    return (f"; the loop's own compute{f' ({names})' if names else ''} {base.loop_compute_ms:.1f} → "
            f"{segment.loop_compute_ms:.1f} ms a step")


def loop_collectives_change(segment: ComparedSegment, base: ComparedSegment) -> str:
    """The loop's own collectives against ``base``'s, where either issued any: what a metric
    gathered every step, or a loss all-reduced for the log, cost, and what moving it out of the
    step saved ("; the loop's own collectives 2 → 0 a step, 4.6 → 0.0 ms")."""
    if not (segment.loop_collectives or base.loop_collectives):
        return ""
    return (f"; the loop's own collectives {base.loop_collectives:.3g} → {segment.loop_collectives:.3g} a step, "
            f"{base.loop_collective_ms:.1f} → {segment.loop_collective_ms:.1f} ms")


def run_differences(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """What differs between the runs besides their strategies and settings: ranks, devices,
    backends, the model's size, the global batch. Each in words, its values in run order."""
    def devices(summary: dict[str, Any]) -> str:
        kinds = sorted({str(rank.get("device") or "?").split(":")[0] for rank in summary.get("ranks", [])})
        return "+".join(kinds) or "?"

    def backends(summary: dict[str, Any]) -> str:
        return "+".join(sorted({str(rank.get("backend") or "?") for rank in summary.get("ranks", [])})) or "?"

    def parameters(summary: dict[str, Any]) -> str:
        count = summary.get("model_parameters")
        return "?" if not count else f"{count / 1e6:.3g} M"

    def batch(summary: dict[str, Any]) -> str:
        return str(summary.get("global_batch") or "?")

    lines = []
    for what, read in (("ranks", lambda s: str(s.get("world_size", "?"))), ("devices", devices), ("backends", backends),
                       ("model parameters", parameters), ("global batch", batch)):
        values = [read(summary) for _, summary in runs]
        if len(set(values)) > 1 and "?" not in values:
            lines.append(f"{what} {', '.join(values)}")
    return lines


def comparison_lines(runs: Sequence[tuple[str, dict[str, Any]]]) -> list[str]:
    """The comparison as ``ddpwatch compare`` prints it: a table with a row per segment of
    every run, each ratio against the first row, then a line per later row saying what changed
    and whether its step time is told apart from the first's, then what else differs."""
    segments = compared_segments(runs)
    lines = [f"# ddpwatch compare: {len(runs)} runs, each segment against the first", ""]
    if not segments:
        return lines + ["No run has a segment with counted steps: nothing to compare."]
    base = segments[0]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for seg in segments:
        step, rate = ratio(seg.step_ms_p50, base.step_ms_p50), ratio(seg.samples_per_s, base.samples_per_s)
        interval = "—" if seg.interval is None else f"{seg.interval[0]:.1f}-{seg.interval[1]:.1f}"
        cells = [seg.run, seg.label, str(seg.steps), f"{seg.step_ms_p50:.1f}", interval,
                 "—" if step is None else f"{step:.2f}", f"{seg.samples_per_s:.1f}", "—" if rate is None else f"{rate:.2f}",
                 f"{seg.compute_pct:.2f}", f"{seg.non_compute_pct:.2f}", f"{seg.idle_pct:.2f}",
                 "—" if seg.data_wait_pct is None else f"{seg.data_wait_pct:.2f}", f"{seg.overlap_pct:.2f}",
                 f"{seg.all_reduce_calls:.3g}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Against {base.run}, {base.label}:"]
    lines += [change_line(seg, base) for seg in segments[1:]] or ["- no other segment to hold against it"]
    unmeasured = [name for name, _ in runs if not any(seg.run == name for seg in segments)]
    lines += [f"- {name}: no segment with counted steps (every step excluded or none reported): not compared"
              for name in unmeasured]
    differences = run_differences(runs)
    if differences:
        lines += ["", f"The runs differ in more than their strategies and settings ({'; '.join(differences)}): "
                      "the figures compare the runs, not one change alone. samples/s counts every rank's samples, "
                      "so it is the figure to read where the global batch or the ranks differ."]
    return lines


def slower_than_allowed(runs: Sequence[tuple[str, dict[str, Any]]], allowed_pct: float) -> list[str]:
    """A line per segment whose step time p50 is more than ``allowed_pct`` % above the first
    segment's and told apart from it (their 90 % intervals do not overlap; where either has no
    interval, the ratio alone): what ``ddpwatch compare --fail-if-slower`` fails on, so that a CI
    job can hold a change against a recorded baseline without failing on its steps' spread."""
    segments = compared_segments(runs)
    if len(segments) < 2:
        return []
    base, found = segments[0], []
    for seg in segments[1:]:
        step = ratio(seg.step_ms_p50, base.step_ms_p50)
        if step is None or step <= 1 + allowed_pct / 100:
            continue
        judged = seg.interval is not None and base.interval is not None
        if judged and not intervals_apart(seg.interval, base.interval):  # type: ignore[arg-type]
            continue
        found.append(f"slower: {seg.run}, {seg.label}: step p50 {base.step_ms_p50:.1f} → {seg.step_ms_p50:.1f} ms "
                     f"(+{(step - 1) * 100:.1f} %, over the {allowed_pct:g} % allowed"
                     + ("; 90 % intervals apart)" if judged else "; no interval to judge the spread by)"))
    return found
