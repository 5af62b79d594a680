"""Files a recorded session leaves behind: summary.json/.md/.csv, summary.svg (the segments as
bars), a Chrome trace, and steps.parquet and collectives.parquet (``parquet_tables``).

Every number comes from ``Session.segment_figures`` (that is, from ``metrics``), so an export
can never disagree with what the dashboard showed. ``summary()`` returns exactly what
``json.loads`` of summary.json gives back (string keys, lists, no NaN), so ``summary_markdown``
and ``summary_csv`` work the same on a live session and on a file read back by
``ddpwatch summary``.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from ddpwatch.ingest import evaluations
from ddpwatch.figures.accumulation import early_reductions_of
from ddpwatch.figures.cross_rank import DesyncRange, Straggler, shard_ranks
from ddpwatch.figures.metrics import ClockAlignment
from ddpwatch.figures.watch_overhead import watch_overhead_from
from ddpwatch.wording.accumulation_text import early_reductions_text
from ddpwatch.wording.data_wait import data_wait_text
from ddpwatch.wording.stall_text import stall_line
from ddpwatch.wording.figure_text import ONE_RANK_NOTE, busbw_text, calls_text, gbps_text, held_text, kinds_text
from ddpwatch.wording.loop_compute import loop_compute_text
from ddpwatch.wording.rank_lists import (detached_ranks_lines, failed_ranks_lines, heard_until_text, interrupted_ranks_lines, rank_runs,
                                 runs_text)
from ddpwatch.export.parquet_tables import write_parquet_tables
from ddpwatch.export.segment_bars import bars_svg, lengths, segment_bar
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.notable_steps import note_pause_kinds
from ddpwatch.ingest.rank_liveness import goodbyes_saying, ranks_left_behind
from instrumented_ddp.wire.messages import Goodbye, StepReport, detachment_of, failure_of, interruption_of
from instrumented_ddp.wire.kinds import COMM_KINDS, COMPUTE_KINDS, LOOP_COMPUTE_KIND, READY_KIND, is_barrier_wait

__all__ = ["chrome_trace", "clock_offsets", "summary", "summary_csv", "summary_markdown", "summary_svg", "write_exports"]

CALLS_COLUMN = "all_reduce calls / rank / step"  # the dashboard's segments table says the same
COLUMNS = ("Segment", "Steps", "Compute%", "Non_Compute%", "Idle%", "Data wait%", "Overlap%", "Comm_overhead%",
           CALLS_COLUMN, "all_reduce_ms", "step ms p50", "step ms p95", "samples/s", "busbw GB/s",
           "other busbw GB/s", "other collectives / rank / step", "held P/G/O MiB")
_FIGURE_KEYS = ("compute_pct", "non_compute_pct", "idle_pct", "data_wait_pct", "overlap_pct", "comm_overhead_pct")
_LANES = {**{kind: "compute" for kind in COMPUTE_KINDS},
          **{kind: "communication" for kind in COMM_KINDS}, "wait": "wait", "data": "data"}
_LANE_TIDS = {"step": 0, "compute": 100, "communication": 200, "wait": 300, "data": 400}  # +k: k-th sub-lane


def _jsonable(value: Any) -> Any:
    """What a strict JSON round trip would give: str keys, lists, and None for NaN/inf."""
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    return str(value)


# --- summary ---------------------------------------------------------------------------------


def summary(session: Session) -> dict[str, Any]:
    """The whole session in one JSON-ready dict: who ran, each segment's figures, what was lost.

    Errors that concern the whole run stay in it however long ago they happened: ``desync`` (every
    desynchronised step, first to last) at the top and per segment; per rank, steps sent
    ``unresolved``, the ``device_note`` its hello carried, the ``last_step`` it passed and its
    ``goodbye`` (None for a rank lost or still running; a reason beginning ``failed:`` where its
    training raised, said in summary.md as an error). ``evaluations``: what the run's evaluations
    measured, a step each (``evaluations.Evaluations``). ``refused_switches``: each switch the run
    refused, where it would have landed and why (an applied one begins a segment). ``model_parameters`` and ``global_batch``
    (samples of every rank a step; None where unknown), as the lowest rank's hello said: what
    ``ddpwatch compare`` holds two runs' figures against. ``unwatched_blocks``: the steps the ranks
    left unwatched to measure what watching costs (``every``, ``steps``), None where they left none."""
    ranks = []
    for rank, state in sorted(session.ranks.items()):
        h = state.hello
        ranks.append({"rank": rank, "host": h.host if h else None, "device": h.device if h else None,
                      "backend": h.backend if h else None, "node_rank": h.node_rank if h else None,
                      "pid": h.pid if h else None, "device_note": h.device_note if h else "",
                      "unresolved_steps": state.unresolved, "unresolved_reason": state.unresolved_reason,
                      "last_step": state.last_step,
                      "goodbye": {"steps": state.goodbye.steps, "reason": state.goodbye.reason} if state.goodbye else None})
    segments = []
    ranges = []
    for seg in session.segments:
        reports = session.segment_reports(seg, include_excluded=True)
        figures = session.segment_figures(seg)
        ranges.append(figures.desync)
        segments.append({"index": seg.index, "label": seg.label, "strategy": seg.strategy,
                         "settings": seg.settings, "world_size": session.world_size,
                         "first_step": seg.first_step, "last_step": seg.last_step,
                         "excluded_steps": sorted({r.step for r in reports if r.excluded}),
                         "unresolved_steps": sorted({r.step for r in reports if r.unresolved}),
                         "update_skipped_steps": sorted({r.step for r in reports if r.update_skipped}),
                         "compiling_steps": sorted({r.step for r in reports if r.compiling}),
                         "untimed_collective_steps": sorted({r.step for r in reports if r.untimed_collectives}),
                         "untimed_collectives_most": max((r.untimed_collectives for r in reports), default=0),
                         "untimed_in_data_steps": sorted({r.step for r in reports if r.untimed_in_data}),
                         "untimed_in_data_most": max((r.untimed_in_data for r in reports), default=0),
                         "nograd_forward_steps": sorted({r.step for r in reports if r.nograd_forwards}),
                         "nograd_forwards_most": max((r.nograd_forwards for r in reports), default=0),
                         "early_reductions": found.as_dict() if (found := early_reductions_of(reports)) else None,
                         **segment_pauses(reports, figures.wall_s),
                         **figures.as_dict(),
                         "watch_overhead": overhead.as_json() if (overhead := session.watch_overhead(seg)) else None})
    desync = DesyncRange.combine(ranges)
    states = sorted(session.ranks.items())
    telemetry = {"rejected": dict(session.rejected),
                 "late_reports": {r: s.late for r, s in states},
                 "late_unused": {r: s.late_unused for r, s in states},
                 "lost_messages": {r: s.lost_messages for r, s in states},
                 "sender_dropped": {r: s.sender_dropped for r, s in states}}
    groups = session.all_reduce_groups()
    said = next((state.hello for _, state in states if state.hello is not None), None)  # the lowest rank's hello
    return _jsonable({"session": session.session_id, "world_size": session.world_size,
                      "model_parameters": said.model_parameters if said else None,
                      "global_batch": (said.global_batch or None) if said else None,
                      "unwatched_blocks": ({"every": said.unwatched_every, "steps": said.unwatched_steps}
                                           if said and said.unwatched_every else None),
                      "ranks": ranks,
                      "first_failed_rank": session.first_failed_rank,
                      "all_reduce_groups": [list(group) for group in groups] if groups is not None else None,
                      "all_reduce_groups_problem": session.all_reduce_groups_problem,
                      "desync": asdict(desync) if desync is not None else None,
                      "segments": segments, "evaluations": session.evaluations.as_list(),
                      "refused_switches": [{"step": ack.step, "strategy": ack.strategy, "detail": ack.detail}
                                           for ack in session.refused_switches()],
                      "stalls": session.stall_watch.as_list(),
                      "telemetry": telemetry})


def segment_pauses(reports: list[StepReport], wall_s: float) -> dict[str, Any]:
    """A segment's pauses of training (``StepReport.paused_s``: a Trainer's evaluations and
    checkpoints): the steps they came before, what for, their seconds in all (each step's longest
    over the ranks, which pause together), and their share of the segment's time with them
    (``wall_s``, its training time, leaves them out): what evaluating costs the run."""
    longest: dict[int, float] = {}
    what: dict[str, None] = {}
    for r in reports:
        if r.paused_s or r.paused_for:
            longest[r.step] = max(longest.get(r.step, 0.0), r.paused_s)
            note_pause_kinds(what, r.paused_for)
    paused_s = sum(longest.values())
    return {"paused_steps": sorted(longest), "paused_for": list(what), "paused_s": paused_s,
            "paused_pct": 100.0 * paused_s / (wall_s + paused_s) if paused_s > 0 else 0.0}


def _segment_cells(seg: dict[str, Any], digits: int | None) -> list[Any]:
    """One segment's cells, in COLUMNS order; rounded to ``digits`` when given (None: raw numbers).
    A segment with no counted step (every step it ran excluded: a one-step ``ddp`` segment, whose
    first iteration is) has no figures: its cells say so instead of showing zeros as measured."""
    def num(value: Any) -> Any:
        if value is None:
            return "n/a" if digits is not None else ""
        return f"{value:.{digits}f}" if digits is not None else round(float(value), 6)

    def gbps(value: Any) -> Any:  # two significant digits under 0.01, as the dashboard and the other kinds say it
        return gbps_text(value) if digits is not None and value is not None else num(value)
    steps = f"{seg['first_step']}-{seg['last_step']}"
    if seg.get("steps") == 0:
        return [seg.get("label") or seg.get("strategy", ""), steps, *(num(None) for _ in COLUMNS[2:])]
    calls = float(seg.get("all_reduce_calls") or 0.0)  # per rank per step, as on the dashboard
    return [seg.get("label") or seg.get("strategy", ""), steps, *(num(seg.get(k)) for k in _FIGURE_KEYS),
            calls_text(calls) if digits is not None else round(calls, 6),
            num(seg.get("all_reduce_ms")), num(seg.get("step_ms_p50")), num(seg.get("step_ms_p95")),
            num(seg.get("samples_per_s")),
            gbps(seg.get("busbw_gbps")),
            busbw_text(None, seg.get("other_busbw_gbps") or {}) if digits is not None
            else json.dumps(seg.get("other_busbw_gbps") or {}, sort_keys=True),
            kinds_text(seg.get("calls_by_kind") or {}) if digits is not None
            else json.dumps(seg.get("calls_by_kind") or {}, sort_keys=True),
            held_text(seg.get("memory") or {}) if digits is not None
            else json.dumps(seg.get("memory") or {}, sort_keys=True)]


def failed_ranks(summary: dict[str, Any]) -> dict[int, tuple[int, str]]:
    """``Session.failed_ranks`` read back from a summary's ranks (none where its ranks carry no
    goodbye)."""
    return goodbyes_saying(failure_of, summary_goodbyes(summary))


def interrupted_ranks(summary: dict[str, Any]) -> dict[int, tuple[int, str]]:
    """``Session.interrupted_ranks`` read back from a summary's ranks."""
    return goodbyes_saying(interruption_of, summary_goodbyes(summary))


def detached_ranks(summary: dict[str, Any]) -> dict[int, tuple[int, str]]:
    """``Session.detached_ranks`` read back from a summary's ranks."""
    return goodbyes_saying(detachment_of, summary_goodbyes(summary))


def summary_goodbyes(summary: dict[str, Any]) -> list[tuple[int, Goodbye | None]]:
    """Each rank of a summary and its goodbye, where it said one."""
    return [(rank["rank"], Goodbye(rank["rank"], said["steps"], said.get("reason", "finished")) if (said := rank.get("goodbye")) else None)
            for rank in summary.get("ranks", [])]


def segment_loop_collectives_text(seg: dict[str, Any]) -> str:
    """A segment's collectives the loop issued itself and ddpwatch timed (``l<k>``), in words:
    how many a step on a rank and their time, as the rank mean and on the rank that spent the
    longest in them (the one waiting for the others, where a slower rank kept them)."""
    ranks = {rank: figures for rank, figures in seg.get("per_rank", {}).items() if figures.get("loop_collectives")}
    longest = max(ranks.items(), key=lambda item: item[1]["loop_collective_ms"], default=None)
    most = f", {longest[1]['loop_collective_ms']:.1f} ms on rank {longest[0]}" if longest is not None and len(ranks) > 1 else ""
    return (f"the loop's own collectives, timed where it issued them (the Trainer's all-gathers, a loss all-reduce, "
            "a metric gathered to rank 0, a mixture of experts' all-to-alls in its forward): "
            f"{seg['loop_collectives']:.3g} a step on a rank, {seg['loop_collective_ms']:.1f} ms a step (mean of ranks{most}), "
            "a wait in them for a slower rank included")


def summary_markdown(summary: dict[str, Any]) -> str:
    """The article's comparison table (the blog posts on data-parallel training the design grew
    from), one row per segment, so results read side by side with it; a desync, an error of the
    whole run, comes first."""
    world = summary.get("world_size", 0)
    lines = [f"# ddpwatch session {summary.get('session') or '(unnamed)'} ({world} rank{'' if world == 1 else 's'})", ""]
    if world == 1:
        lines += [f"*{ONE_RANK_NOTE[0].upper()}{ONE_RANK_NOTE[1:]}.*", ""]
    if summary.get("desync"):
        lines += [f"**ERROR: {DesyncRange.from_dict(summary['desync']).describe()}**", ""]
    for line in failed_ranks_lines(failed_ranks(summary), summary.get("first_failed_rank")):
        lines += [f"**ERROR: {line}**", ""]
    for line in interrupted_ranks_lines(interrupted_ranks(summary)):  # stopped, not broken: the run did not finish
        lines += [f"**{line[0].upper()}{line[1:]}**", ""]
    for line in detached_ranks_lines(detached_ranks(summary)):  # trained on, unwatched: its later steps are not here
        lines += [f"**{line[0].upper()}{line[1:]}**", ""]
    lines += ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for seg in summary.get("segments", []):
        lines.append("| " + " | ".join(str(c) for c in _segment_cells(seg, 2)) + " |")
    if summary.get("segments"):
        lines += ["", "![Compute, Overlap, exposed communication and idle time of each segment's step](summary.svg)"]
    lines += ["", "Comm_overhead% is merged wall-clock communication time over the step window: concurrent collectives "
              "count once, where a sum of raw kernel durations would count them twice. all_reduce_ms "
              "is that sum, each call's duration with its waiting: where calls run at once (gloo runs two) it can "
              "exceed the step.",
              f"{CALLS_COLUMN} is the all-reduces each rank issued in one step (a mean over ranks and steps; "
              "summary.json's all_reduce_calls_total is the whole count over every rank and step); the other "
              "figures are per rank per step (mean); step ms is each step's slowest rank.",
              "Other collectives are the reduce-scatters (RS), all-gathers (AG), broadcasts (BC), reduces (RD), "
              "all-to-alls (A2A), gathers (GA) and scatters (SC) each rank "
              "issued in one step (mean). held P/G/O MiB is the parameters, gradients and optimizer state the "
              "fullest rank held at a measured step end (every 10 steps), counted from the tensors it holds.",
              "busbw GB/s is nccl-tests' bus bandwidth of the all-reduces: the median over the calls of bytes "
              "over duration, times 2(n-1)/n for the n ranks each spans; other busbw GB/s is the same for each "
              "other kind, over the whole (unsharded) tensor's bytes (an all-to-all's: all a rank sends; a gather's "
              "or a scatter's: the root's whole list), times (n-1)/n (a broadcast, a reduce: 1). A "
              "duration includes any wait for a late rank.",
              "samples/s counts every rank's samples over the wall time from the segment's first step start to "
              "its last step end, the ranks put on one clock by the end of each step's last all-reduce: the time "
              "between steps counts, less the loop's pauses of training (a Trainer's evaluations and checkpoints).",
              "Steps marked excluded (native DDP's first iteration, before buckets are rebuilt; a step in which "
              "torch.compile compiled; a step the loop paused inside) or unresolved (timing marks that never completed) are left out of every figure; "
              "a segment with no other step has no figures (n/a)."]
    if summary.get("all_reduce_groups"):
        groups = summary["all_reduce_groups"]
        lines.append(f"All-reduces meet within {len(groups)} groups of ranks, as the ranks said (HSDP's replicas of one "
                     f"shard, a DDP on a subgroup): {'; '.join(', '.join(map(str, group)) for group in groups)}. busbw "
                     "counts each over its group's size, and a rank's waiting is judged against its group only.")
        if any(seg.get("other_busbw_gbps") for seg in summary.get("segments", [])):
            lines.append("Other busbw (reduce-scatters, all-gathers) counts each over a shard group, one rank of each of "
                         f"these groups where they are one size ({shard_ranks(groups, summary.get('world_size') or 0)} "
                         "ranks: HSDP's 2-D mesh).")
    if summary.get("all_reduce_groups_problem"):
        lines.append(f"Not within groups: {summary['all_reduce_groups_problem']}.")
    for seg in summary.get("segments", []):
        if seg.get("excluded_steps"):
            lines.append(f"- segment {seg['index']}: excluded steps {', '.join(map(str, seg['excluded_steps']))}")
        if seg.get("unresolved_steps"):
            lines.append(f"- segment {seg['index']}: steps sent unresolved {', '.join(map(str, seg['unresolved_steps']))}")
        if seg.get("update_skipped_steps"):
            lines.append(f"- segment {seg['index']}: steps without an optimizer update (gradients reduced, then cleared "
                         f"with no optimizer.step(): a loss scaler that found inf or NaN) {', '.join(map(str, seg['update_skipped_steps']))}")
        if seg.get("compiling_steps"):
            lines.append(f"- segment {seg['index']}: steps in which torch.compile compiled (excluded) "
                         f"{', '.join(map(str, seg['compiling_steps']))}")
        if seg.get("loop_collectives"):
            lines.append(f"- segment {seg['index']}: {segment_loop_collectives_text(seg)}")
        if seg.get("steps") and (marked := loop_compute_text(f"segment {seg['index']}", seg.get("loop_compute_ms", 0.0),
                                                             seg.get("loop_computed", []), seg["step_ms_p50"])):
            lines.append(f"- {marked}")
        if seg.get("untimed_collective_steps"):
            lines.append(f"- segment {seg['index']}: steps with collectives ddpwatch did not time (outside DDP's buckets and "
                         f"FSDP's gathers and reductions; up to {seg.get('untimed_collectives_most', 0)} a step on a rank) "
                         f"{runs_text(rank_runs(seg['untimed_collective_steps']), limit=20)}")
        if seg.get("untimed_in_data_steps"):
            lines.append(f"- segment {seg['index']}: steps with such collectives issued before a forward, in the data time "
                         f"(up to {seg.get('untimed_in_data_most', 0)} a step on a rank: their time, a wait in them for a slower "
                         f"rank included, reads as data loading) {runs_text(rank_runs(seg['untimed_in_data_steps']), limit=20)}")
        if seg.get("paused_steps"):
            lines.append(f"- segment {seg['index']}: steps the loop paused training before ({', '.join(seg['paused_for'])}; "
                         f"{seg['paused_s']:.2f} s in all, {seg.get('paused_pct', 0.0):.1f} % of the segment's time, left out "
                         "of step times and samples/s) "
                         f"{runs_text(rank_runs(seg['paused_steps']), limit=20)}")
        if seg.get("nograd_forward_steps"):
            lines.append(f"- segment {seg['index']}: steps whose data loading held forwards of the model without gradients "
                         f"(up to {seg.get('nograd_forwards_most', 0)} a step on a rank: an evaluation the loop did not mark "
                         "with watch.paused; their time reads as data loading) "
                         f"{runs_text(rank_runs(seg['nograd_forward_steps']), limit=20)}")
        by_rank = {int(rank): figures.get("data_wait_pct", 0.0) for rank, figures in seg.get("per_rank", {}).items()}
        if seg.get("steps") and (waited := data_wait_text(f"segment {seg['index']}", seg.get("data_wait_pct", 0.0),
                                                           seg["idle_pct"], seg["step_ms_p50"],
                                                           seg.get("untimed_in_data_most", 0), by_rank)):
            lines.append(f"- {waited}")
        if early := seg.get("early_reductions"):
            lines.append(f"- segment {seg['index']}: {early_reductions_text(rank_runs(early['steps']), early, [seg['strategy']])}")
        if cost := seg.get("watch_overhead"):
            lines.append(f"- segment {seg['index']}: {watch_overhead_from(cost).sentence()}, its steps timed against "
                         "the watched steps around them")
        if seg.get("desync"):
            lines.append(f"- segment {seg['index']}: {DesyncRange.from_dict(seg['desync']).describe()}")
        if seg.get("straggler"):
            lines.append(f"- segment {seg['index']}: {Straggler.from_dict(seg['straggler']).describe()}")
    lines += [f"- rank {r['rank']}: why its steps were sent unresolved (the last to say): {r['unresolved_reason']}"
              for r in summary.get("ranks", []) if r.get("unresolved_reason")]
    lines += refused_switch_lines(summary.get("refused_switches", []))
    lines += [f"- stall: {stall_line(stall, stall['stalled_s'])}" + (" (it never ended)" if stall["duration_s"] is None else "")
              for stall in summary.get("stalls", [])]
    lines += stopped_ranks_lines(summary.get("ranks", []))
    lines += no_goodbye_lines(summary.get("ranks", []))
    lines += evaluations.markdown_lines(summary.get("evaluations", []))
    return "\n".join(lines) + "\n"


def refused_switch_lines(refused: list[dict[str, Any]]) -> list[str]:
    """A line per switch the run refused (``Session.refused_switches``), where it would have landed
    and why: an applied switch starts a segment of the table, a refused one left no mark on it."""
    return [f"- {'switch to ' + each['strategy'] if each.get('strategy') else 'a switch'} refused at step {each['step']}: "
            f"{each['detail']}" for each in refused]


def no_goodbye_lines(ranks: list[dict[str, Any]]) -> list[str]:
    """One line for the ranks this record holds no goodbye of (a summary whose ranks carry no
    ``goodbye`` key has none to judge by), so that ``ddpwatch summary`` of a recording cut short
    (a demo quit, a recorder stopped, a job killed) says so beside its table."""
    unended = {r["rank"]: r.get("last_step", 0) for r in ranks if "goodbye" in r and r["goodbye"] is None}
    if not unended:
        return []
    return [f"- no goodbye from {heard_until_text(unended)}: this record ends before the run did (written while it "
            "trained, or a dashboard or recorder stopped first), or a rank died without one (a job killed, a rank lost)"]


def stopped_ranks_lines(ranks: list[dict[str, Any]]) -> list[str]:
    """A line per rank whose steps stopped ``STOPPED_STEPS`` or more before the others' did (as the
    dashboard's note says it: ``Session.stopped_ranks``)."""
    last_steps = {r["rank"]: r["last_step"] for r in ranks if "last_step" in r}
    newest = max(last_steps.values(), default=0)
    return [f"- rank {rank} passed no step after {step} while the others reached {newest}: out of data "
            "under DDP's join() (uneven inputs), or out of the training loop"
            for rank, step in ranks_left_behind(last_steps).items()]


def summary_svg(summary: dict[str, Any]) -> str:
    """The same segments as bars of their step window (``segment_bars``), for the markdown to show."""
    segments = summary.get("segments", [])
    bars = [segment_bar(f"{seg.get('label') or seg.get('strategy', '')} ({seg['first_step']}-{seg['last_step']})",
                        seg.get("compute_pct", 0.0), seg.get("non_compute_pct", 0.0), seg.get("idle_pct", 0.0),
                        seg.get("hidden_comm_pct", 0.0), seg.get("overlap_pct", 0.0), length)
            for seg, length in zip(segments, lengths([seg.get("samples_per_s", 0.0) for seg in segments]), strict=True)]
    return bars_svg(bars, f"ddpwatch session {summary.get('session') or '(unnamed)'}: where each step's time went")


def summary_csv(summary: dict[str, Any]) -> str:
    """The same rows as the markdown table, unrounded, with strategy and settings for spreadsheets."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["index", "strategy", "settings", *COLUMNS])
    for seg in summary.get("segments", []):
        writer.writerow([seg["index"], seg["strategy"], json.dumps(seg.get("settings", {}), sort_keys=True),
                         *_segment_cells(seg, None)])
    return out.getvalue()


# --- Chrome trace ----------------------------------------------------------------------------


def clock_offsets(session: Session) -> dict[int, float]:
    """Seconds to add to each rank's clock to land on the reference rank's (rank 0's) clock.

    ``metrics.ClockAlignment`` over every kept step: all ranks leave a step's last all-reduce
    together, so its end is a shared instant (median over steps; step starts where there is no
    all-reduce). The same rule puts ranks on one clock for throughput and for the timeline. A rank
    that never shared a step with the reference gets 0.
    """
    ranks = sorted({r for reps in session.reports.values() for r in reps} | set(session.ranks))
    if not ranks:
        return {}
    clocks = ClockAlignment(reference=0 if 0 in ranks else ranks[0], keep=None)
    for step in sorted(session.reports):
        clocks.add_step(session.step_times(step))
    offsets = clocks.offsets()
    return {rank: offsets.get(rank, 0.0) for rank in ranks}


def chrome_trace(session: Session) -> dict[str, Any]:
    """Chrome trace events (open in Perfetto / chrome://tracing): a process per rank, a thread per lane.

    Perfetto needs events on one thread to nest properly, and async collectives overlap each
    other (and could overlap a neighbour's compute), so every lane is split greedily into
    sub-lanes where no two events overlap. pid is rank + 1 because some viewers hide pid 0.
    """
    offsets = clock_offsets(session)
    starts = [rep.start + offsets.get(rank, 0.0) for reps in session.reports.values() for rank, rep in reps.items()]
    origin = min(starts) if starts else 0.0

    def us(t: float, rank: int) -> float:
        return round((t + offsets.get(rank, 0.0) - origin) * 1e6, 3)

    events: list[dict[str, Any]] = []
    lanes: dict[int, dict[str, list[float]]] = {}  # rank -> lane -> last end (µs) per sub-lane

    def place(rank: int, lane: str, name: str, t0: float, t1: float, args: dict[str, Any]) -> None:
        if not (math.isfinite(t0) and math.isfinite(t1)):
            return
        ts, end = us(t0, rank), us(t1, rank)
        end = max(end, ts)
        subs = lanes.setdefault(rank, {}).setdefault(lane, [])
        k = next((i for i, last in enumerate(subs) if last <= ts), len(subs))
        subs[k:k + 1] = [end]
        events.append({"name": name, "cat": lane, "ph": "X", "pid": rank + 1, "tid": _LANE_TIDS[lane] + k,
                       "ts": ts, "dur": round(end - ts, 3), "args": args})

    for step in sorted(session.reports):
        for rank, rep in sorted(session.reports[step].items()):
            if rep.paused_s:  # the loop's own work before the step began (``StepReport.paused_s``)
                place(rank, "data", f"paused: {rep.paused_for}", rep.start - rep.paused_s, rep.start, {"step": step})
            place(rank, "step", f"step {step}", rep.start, rep.end,
                  {"step": step, "strategy": rep.strategy, "excluded": rep.excluded, "unresolved": rep.unresolved,
                   "compiling": rep.compiling, "samples": rep.samples})
            for span in sorted(rep.spans, key=lambda s: (s.start, -s.end)):
                if span.kind == READY_KIND:  # a mark for the bucket advisor, not a time range
                    continue
                lane = _LANES.get(span.kind, "data")
                args: dict[str, Any] = {"step": step, "blocking": span.blocking}
                if lane == "communication":
                    args.update(bytes=span.nbytes, dtype=span.dtype, tag=span.tag)
                tagged = span.kind == LOOP_COMPUTE_KIND or is_barrier_wait(span)  # what the loop computed; a barrier's wait
                name = f"{span.kind}: {span.tag}" if tagged and span.tag else span.kind
                place(rank, lane, name, span.start, span.end, args)

    for rank in sorted(set(lanes) | set(session.ranks)):
        state = session.ranks.get(rank)
        host = state.hello.host if state and state.hello else "?"
        events.append({"name": "process_name", "ph": "M", "pid": rank + 1, "args": {"name": f"rank {rank} ({host})"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank + 1, "args": {"sort_index": rank}})
        for lane, subs in lanes.get(rank, {}).items():
            for k in range(len(subs)):
                tid = _LANE_TIDS[lane] + k
                label = lane if k == 0 else f"{lane} {k + 1}"
                events.append({"name": "thread_name", "ph": "M", "pid": rank + 1, "tid": tid, "args": {"name": label}})
                events.append({"name": "thread_sort_index", "ph": "M", "pid": rank + 1, "tid": tid,
                               "args": {"sort_index": tid}})
        for sample in list(state.devices) if state else []:
            readings = {k: float(v) for k, v in sample.readings.items()
                        if isinstance(v, (int, float)) and math.isfinite(v)}
            if readings and math.isfinite(sample.time):
                events.append({"name": f"device ({sample.kind})", "ph": "C", "pid": rank + 1,
                               "ts": us(sample.time, rank), "args": readings})
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"session": session.session_id,
                          "clock_offsets_s": {str(r): o for r, o in sorted(offsets.items())}}}


# --- writing ---------------------------------------------------------------------------------


def write_atomic(path: Path, text: str) -> None:
    """Temp file in the same directory + fsync + rename: a crash leaves the old file or the new, never half."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_exports(session: Session, out_dir: Path,
                  on_error: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> dict[str, Path]:
    """Write the export files into ``out_dir`` (created if needed); returns name -> path of those
    written. One that cannot be made is said in a line (``on_error``) and the others are written:
    each is made and written on its own, so one that raises (a trace of a time JSON cannot hold)
    costs neither the others nor the recorder's end."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    makers: dict[str, Callable[[], str]] = {"trace.json": lambda: json.dumps(chrome_trace(session), allow_nan=False,
                                                                               separators=(",", ":"))}
    try:
        data = summary(session)
    except Exception as error:
        on_error(f"summary.json, summary.md, summary.svg and summary.csv could not be made: {type(error).__name__}: {error}")
    else:
        makers = {"summary.json": lambda: json.dumps(data, indent=2, allow_nan=False) + "\n",
                  "summary.md": lambda: summary_markdown(data), "summary.svg": lambda: summary_svg(data),
                  "summary.csv": lambda: summary_csv(data), **makers}
        if data["stalls"]:  # as ``record.live_stalls`` keeps it while the run lasts
            makers["stalls.json"] = lambda: json.dumps({"stalls": data["stalls"]}, indent=2, allow_nan=False) + "\n"
    paths = {}
    for name, make in makers.items():
        try:
            text = make()
        except Exception as error:
            on_error(f"{name} could not be made: {type(error).__name__}: {error}")
            continue
        write_atomic(out_dir / name, text)
        paths[name] = out_dir / name
    try:
        paths.update(write_parquet_tables(session, out_dir, clock_offsets(session)))
    except ImportError as missing:  # the parquet extra: the other exports are written all the same
        on_error(str(missing))
    except Exception as error:
        on_error(f"steps.parquet and collectives.parquet could not be made: {type(error).__name__}: {error}")
    return paths
