"""How the session stores what it keeps: spans packed so the cycle collector never scans them."""

from __future__ import annotations

import gc

from ddpwatch.receiver import ingest
from ddpwatch.session import PackedSpans, Session
from instrumented_ddp.protocol import Span
from synthetic_session import session_messages


def test_packed_spans_read_back_as_the_spans_that_came_in() -> None:
    spans = [Span("forward", 0.0, 1.0, True), Span("all_reduce", 1.0, 2.5, False, 4096, "b0", "float32")]
    packed = PackedSpans(spans)
    assert list(packed) == spans and packed == spans and len(packed) == 2
    assert packed[1].nbytes == 4096 and packed[1].tag == "b0" and packed[-1] == spans[-1]
    assert packed[:1] == spans[:1]
    assert packed != spans[:1]


def test_kept_spans_are_not_tracked_by_the_cycle_collector() -> None:
    session = Session(keep_steps=5)
    ingest(session, session_messages(steps=8))
    as_sent = Span("forward", 0.0, 1.0, True)
    gc.collect()  # a tuple of plain values is untracked the first time the collector sees it
    reports = [r for ranks in session.reports.values() for r in ranks.values()]
    assert reports and all(isinstance(r.spans, PackedSpans) for r in reports)
    assert not any(gc.is_tracked(row) for r in reports for row in r.spans._rows)
    assert gc.is_tracked(as_sent)  # why they are packed: a named tuple is scanned in every full pass


def test_figures_of_a_packed_report_equal_those_of_the_report_as_sent() -> None:
    from ddpwatch import metrics

    session = Session()
    ingest(session, session_messages(steps=4))
    for step, ranks in session.reports.items():
        for rank, report in ranks.items():
            assert session.step_figures(step)[rank] == metrics.step_figures(report, session.world_size)
