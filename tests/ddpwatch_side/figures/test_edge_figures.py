"""Figures computed at the edge equal figures computed centrally.

A rank that sends a ``StepSummary`` (its own ``step_figures`` and its all-reduces' tags and
durations) instead of its spans must leave the dashboard, the recorder and the exports with
exactly the numbers the full spans give: the same session fed both ways is compared field by
field, not within a tolerance.
"""

from __future__ import annotations

import math
from msgspec.structs import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from synthetic_session import session_messages, step_report

from ddpwatch.ingest.receiver import ingest
from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.codec import decode, encode
from instrumented_ddp.wire.messages import Span, StepReport, StepSummary
from instrumented_ddp.wire.step_figures import call_times, step_figures, summarize, summary_calls, summary_figures

WORLD = 64


def uneven(report: StepReport) -> StepReport:
    """Ranks that differ: all-reduces that last longer on some ranks (they waited: the others
    arrived late), rank 9 always last (a straggler), one excluded step, one step where rank 3
    skipped a collective (a desync); and, as a sharded strategy issues, an all-gather in forward
    and a reduce-scatter, of lengths that differ by rank, and an empty all-gather (no bandwidth);
    and 2 ms of compute the loop marked, an average of the weights."""
    stretch = 0.006 * (1 + report.rank % 5) if report.rank != 9 else 0.0
    spans = [s._replace(end=s.end + stretch) if s.kind == "all_reduce" else s for s in report.spans]
    if report.step == 4 and report.rank == 3:
        spans = [s for s in spans if s.tag != "p2"]
    at = report.start
    spans += [Span("all_gather", at, at + 0.001 * (1 + report.rank % 3), nbytes=4_000_000, tag="u0"),
              Span("all_gather", at, at + 0.001, nbytes=0, tag="u1"),
              Span("reduce_scatter", at + 0.002, at + 0.0035 + 0.0001 * report.rank, nbytes=4_000_000, tag="u0"),
              Span("loop", at, at + 0.002, tag="ema")]  # the loop's marked compute (``Attachment.computing``)
    return replace(report, spans=spans, excluded=report.step == 2)


def as_summary(report: StepReport) -> StepSummary:
    return summarize(uneven(report), WORLD)


def sent_and_read(summary: StepSummary) -> StepSummary:
    """``summary`` as the dashboard reads it off the wire."""
    message = decode(encode(summary)).message
    assert isinstance(message, StepSummary)
    return message


def fed(messages: list[bytes]) -> Session:
    session = Session()
    ingest(session, messages)
    return session


def test_a_summary_gives_back_what_step_figures_and_call_times_give_from_the_spans() -> None:
    report = uneven(step_report(5, 7, "bucket"))
    summary = sent_and_read(summarize(report, WORLD))
    assert summary_figures(summary) == step_figures(report, WORLD)
    assert summary.data_wait_pct > 0  # its data span travels as a figure too
    assert summary.loop_compute_ms == pytest.approx(2.0) and summary.loop_computed == "ema"  # so does the loop's marked compute
    assert summary_calls(summary) == call_times(report)
    # rank 5's b0 runs until 0.14 s, past b1's start at 0.115: the starts travel, so that waiting
    # at once counts once; rank 9's calls and a blocking step's do not overlap: none are sent
    assert call_times(report).starts is not None and len(summary.all_reduce_starts) == 8 * 2
    assert summarize(uneven(step_report(9, 7, "bucket")), WORLD).all_reduce_starts == b""
    assert summarize(step_report(5, 3, "simple"), WORLD).all_reduce_starts == b""


def test_64_ranks_summarized_at_the_edge_give_the_central_figures_exactly() -> None:
    central = fed(session_messages(steps=12, world_size=WORLD, edit=uneven))
    edge = fed(session_messages(steps=12, world_size=WORLD, edit=as_summary))
    assert [s.label for s in edge.segments] == [s.label for s in central.segments]
    for a, b in zip(central.segments, edge.segments, strict=True):
        central_figures, edge_figures = central.segment_figures(a), edge.segment_figures(b)
        assert edge_figures.as_dict() == central_figures.as_dict()
    assert central.desync_range() == edge.desync_range() is not None
    assert central.segment_figures(central.segments[0]).straggler_rank == 9
    assert set(edge.segment_figures(edge.segments[0]).other_busbw_gbps) == {"all_gather", "reduce_scatter"}
    assert edge.rejected == central.rejected == {}


def test_a_session_fed_summaries_and_full_reports_mixed_gives_the_same_figures() -> None:
    central = fed(session_messages(steps=12, world_size=WORLD, edit=uneven))
    mixed = fed(session_messages(steps=12, world_size=WORLD,
                                 edit=lambda r: uneven(r) if r.rank in (0, 9) or r.step % 5 == 0 else as_summary(r)))
    for a, b in zip(central.segments, mixed.segments, strict=True):
        assert mixed.segment_figures(b).as_dict() == central.segment_figures(a).as_dict()


def test_spans_asked_for_after_the_summary_join_the_kept_report_without_refolding() -> None:
    summary = summarize(step_report(1, 3, "simple"), 2)
    full = step_report(1, 3, "simple")
    session = fed([encode(summary, 0), encode(replace(summary, step=4), 1)])
    assert not session.has_spans(3, 1) and session.reports[3][1].spans == []
    figures = session.step_figures(3)[1]
    assert ingest(session, [encode(full, 2)])
    assert session.has_spans(3, 1) and session.reports[3][1].spans == full.spans
    assert session.step_figures(3)[1] == figures
    assert session.ranks[1].reported.runs == 1 and session.rejected == {}
    ingest(session, [encode(full, 3)])  # the same spans again: a repeat, not a detail
    assert session.rejected == {"step_repeated": 1}


def test_spans_for_a_step_the_session_forgot_are_counted_not_kept() -> None:
    session = Session(keep_steps=2)
    ingest(session, [encode(summarize(step_report(0, step, "simple"), 1), step) for step in range(1, 6)])
    ingest(session, [encode(step_report(0, 1, "simple"), 9)])
    assert session.ranks[0].details_unused == 1 and 1 not in session.reports and session.rejected == {}


@pytest.mark.parametrize("kind", ["summary", "report"])
def test_a_second_summary_or_a_report_of_a_step_sent_in_full_is_a_repeat(kind: str) -> None:
    full = step_report(0, 3, "simple")
    again = summarize(full, 1) if kind == "summary" else full
    session = fed([encode(full, 0), encode(again, 1)])
    assert session.rejected == {"step_repeated": 1}


def test_an_unresolved_summary_is_counted_and_enters_no_figure() -> None:
    report = replace(step_report(0, 3, "simple"), unresolved=True, spans=[Span("forward", 100.6, 100.7)])
    session = fed([encode(summarize(report, 1), 0)])
    assert session.ranks[0].unresolved == 1 and session.step_figures(3) == {}


def test_a_sampled_recording_exports_the_central_figures_and_the_sampled_steps_spans(tmp_path) -> None:  # noqa: ANN001
    import json

    from ddpwatch.export.exporters import write_exports

    central = fed(session_messages(steps=12, world_size=4, edit=uneven))
    sampled = fed(session_messages(steps=12, world_size=4,
                                   edit=lambda r: uneven(r) if r.step % 5 == 0 else summarize(uneven(r), 4)))
    write_exports(central, tmp_path / "central")
    write_exports(sampled, tmp_path / "sampled")
    figures = [json.loads((tmp_path / name / "summary.json").read_text())["segments"] for name in ("central", "sampled")]
    assert figures[0] == figures[1]
    trace = json.loads((tmp_path / "sampled" / "trace.json").read_text())
    windows = {e["args"]["step"] for e in trace["traceEvents"] if e.get("name", "").startswith("step ")}
    spans = {e["args"]["step"] for e in trace["traceEvents"] if "blocking" in e.get("args", {})}
    assert windows == set(range(1, 13)) and spans == {5, 10}  # every step's window (from summaries), sampled spans


def test_a_summarized_steps_marks_and_memory_reach_the_exports_as_a_full_reports_do() -> None:
    """The report kept for a summary took its fields by position, and the memory landed where
    ``update_skipped`` goes: every summarized step whose memory was measured was exported as an
    update skipped, its memory was lost, and so was ``compiling``."""
    from ddpwatch.export.exporters import summary

    def marked(report: StepReport) -> StepReport:
        return replace(report, memory={"parameters": 8} if report.step == 10 else {}, compiling=report.step == 3,
                       excluded=report.step == 3, update_skipped=report.step == 7)

    central = fed(session_messages(steps=12, world_size=4, edit=marked))
    edge = fed(session_messages(steps=12, world_size=4, edit=lambda r: summarize(marked(r), 4)))
    keys = ("excluded_steps", "unresolved_steps", "update_skipped_steps", "compiling_steps")
    lists = [[{key: segment[key] for key in keys} for segment in summary(session)["segments"]] for session in (central, edge)]
    assert lists[1] == lists[0]
    assert [(s["update_skipped_steps"], s["compiling_steps"]) for s in lists[1]] == [([], [3]), ([7], [])]  # simple, then bucket
    assert edge.reports[10][2].memory == {"parameters": 8}


def test_a_collective_too_short_for_a_bandwidth_is_measured_as_none_and_its_summary_is_accepted() -> None:
    """1 byte in 2.2e-309 s (a subnormal duration) is 4.5e299 GB/s... as a float, inf: the
    summary carried an infinite algbw, which the wire schema rejects (the step lost), and at one
    rank its busbw was inf × 0 = NaN. No link was measured: None, as for a zero duration."""
    report = StepReport(rank=0, step=1, strategy="bucket", settings={}, start=0.0, end=0.01, samples=4, tokens=256,
                        spans=[Span("backward", 0.0, 0.008), Span("all_reduce", 0.0, 2.225073858507203e-309, nbytes=1, tag="b0")])
    for world in (1, 2):
        figures = step_figures(report, world)
        assert len(figures.algbw_gbps) == 0 and figures.busbw_gbps is None
        summary = sent_and_read(summarize(report, world))
        assert summary_figures(summary) == figures


_KINDS = ("forward", "backward", "optimizer", "loop", "data", "wait", "all_reduce", "reduce_scatter", "all_gather", "broadcast",
          "reduce")


@st.composite
def _spans(draw: st.DrawFn) -> Span:
    start = draw(st.floats(-1.0, 2.0))
    length = draw(st.floats(0.0, 1.0) | st.floats(0.0, 1e-300) | st.just(math.inf))
    return Span(draw(st.sampled_from(_KINDS)), start, start + length, draw(st.booleans()), draw(st.integers(0, 10**9)),
                draw(st.sampled_from(["", "b0", "b1", "p0", "u0", "u1", "buffers", "ema", "barrier", "l0"])), "float32")


@settings(max_examples=200, deadline=None)
@given(spans=st.lists(_spans(), max_size=16), start=st.floats(0.0, 0.5), length=st.floats(0.0, 1.5),
       world=st.integers(1, 16))
def test_any_report_summarized_and_sent_gives_back_its_figures(spans: list[Span], start: float, length: float,
                                                               world: int) -> None:
    """Whatever the spans (overlapping, outside the window, empty, unended, of any kind and tag):
    the summary a rank sends passes the wire schema and gives back the figures the full report
    gives, and the step's three shares of its window add up to 100."""
    report = StepReport(rank=1, step=3, strategy="bucket", settings={}, start=start, end=start + length, spans=spans,
                        samples=8, tokens=512)
    figures = step_figures(report, world)
    summary = sent_and_read(summarize(report, world))
    assert summary_figures(summary) == figures and summary_calls(summary) == call_times(report)
    if report.end > report.start:  # else an empty window: every share 0.0
        assert figures.compute_pct + figures.non_compute_pct + figures.idle_pct == pytest.approx(100.0)
