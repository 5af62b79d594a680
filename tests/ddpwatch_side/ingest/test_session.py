"""How the session stores what it keeps (spans packed so the cycle collector never scans them) and
how it tells late, repeated, backwards and unresolved step reports apart."""

from __future__ import annotations

import dataclasses
import gc

from msgspec.structs import replace

import pytest

from ddpwatch.ingest.receiver import ingest
from ddpwatch.figures.compact_steps import PackedSpans
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.notable_steps import PAUSE_KINDS_KEPT, note_pause_kinds
from ddpwatch.ingest.rank_liveness import ranks_left_behind
from ddpwatch.ingest.segment_folding import SEGMENT_GAP_STEPS
from ddpwatch.ingest.segments import short_strategy_label, strategy_label
from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import Heartbeat, Span, SpanRequest
from instrumented_ddp.wire.step_figures import call_times
from synthetic_session import hello, session_messages, step_report, waiting_ranks


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
    packed = [r.spans for r in reports if isinstance(r.spans, PackedSpans)]
    assert reports and len(packed) == len(reports)
    assert not any(gc.is_tracked(row) for spans in packed for row in spans._rows)
    assert gc.is_tracked(as_sent)  # why they are packed: a named tuple is scanned in every full pass


def test_figures_of_a_packed_report_equal_those_of_the_report_as_sent() -> None:
    from instrumented_ddp.wire import step_figures

    session = Session()
    ingest(session, session_messages(steps=4))
    for step, ranks in session.reports.items():
        for rank, report in ranks.items():
            assert session.step_figures(step)[rank] == step_figures.step_figures(report, session.world_size)


# --- late, repeated and unresolved reports ------------------------------------------------------


class Feeder:
    """Feeds messages into a session with a running sequence number per rank."""

    def __init__(self, session: Session) -> None:
        self.session, self.seq = session, {0: 0, 1: 0}

    def __call__(self, message) -> str | None:  # noqa: ANN001
        rank = message.rank
        self.seq[rank] += 1
        return self.session.ingest(Envelope(message, rank, self.seq[rank], 0), received_at=0.0)


def two_ranks(keep_steps: int | None = None) -> tuple[Session, Feeder]:
    session = Session(keep_steps)
    feed = Feeder(session)
    feed(hello(0))
    feed(hello(1))
    return session, feed


def test_step_set_keeps_runs_of_consecutive_steps() -> None:
    from ddpwatch.figures.compact_steps import StepSet

    steps = StepSet()
    for step in (1, 2, 3, 7, 5, 6, 4, 10):
        steps.add(step)
    assert steps.runs == 2  # 1-7 and 10
    assert all(s in steps for s in (1, 4, 7, 10)) and not any(s in steps for s in (0, 8, 9, 11))
    steps.add(4)
    assert steps.runs == 2
    for step in (20, 30, 31):
        steps.add(step)
    steps.forget_below(5)  # inside a run: its first steps go
    assert steps.ranges() == [(5, 7), (10, 10), (20, 20), (30, 31)]
    steps.forget_below(20)  # at a run's first: the runs before it go
    assert steps.ranges() == [(20, 20), (30, 31)]
    steps.forget_below(25)  # between runs
    assert steps.ranges() == [(30, 31)] and 20 not in steps
    steps.forget_below(40)
    assert steps.ranges() == []


def test_a_report_for_a_step_the_rank_passed_is_counted_late_and_used_while_its_step_is_open() -> None:
    session, feed = two_ranks()
    for step in range(1, 7):
        feed(step_report(0, step, "simple"))
    for step in (1, 2):
        feed(step_report(1, step, "simple"))
    feed(Heartbeat(1, 0.0, 6))  # rank 1 is training step 6; its report of step 3 was still resolving
    assert feed(step_report(1, 3, "simple")) is None  # was rejected as step_backwards
    assert session.rejected == {}
    assert (session.ranks[1].late, session.ranks[1].late_unused) == (1, 0)
    assert sorted(session.reports[3]) == [0, 1] and session.is_folded(3)
    figures = session.segment_figures(session.segments[0])
    assert figures.per_rank[1].steps == 3  # steps 1, 2 and the late 3


def test_a_report_that_comes_after_its_step_was_folded_is_late_and_left_out_not_repeated() -> None:
    session, feed = two_ranks()
    feed(step_report(1, 1, "simple"))
    for step in range(1, 23):
        feed(step_report(0, step, "simple"))  # step 2 is folded without rank 1 once rank 0 reaches 22
    assert session.is_folded(2) and 1 not in session.reports[2]
    assert feed(step_report(1, 2, "simple")) is None  # was rejected as step_repeated
    assert session.rejected == {}
    assert (session.ranks[1].late, session.ranks[1].late_unused) == (1, 1)
    assert 1 not in session.reports[2]  # its step's figures are made: it enters none of them
    assert session.segment_figures(session.segments[0]).per_rank[1].steps == 1


def test_the_same_step_from_the_same_rank_twice_is_still_repeated_even_after_it_was_forgotten() -> None:
    session, feed = two_ranks(keep_steps=3)
    for step in range(1, 11):
        feed(step_report(0, step, "simple"))
        feed(step_report(1, step, "simple"))
    assert 2 not in session.reports  # forgotten
    assert feed(step_report(1, 10, "simple")) == "step_repeated"
    assert feed(step_report(0, 2, "simple")) == "step_repeated"
    assert session.rejected == {"step_repeated": 2} and session.ranks[0].late == 0


def test_a_report_older_than_the_ranks_own_earlier_reports_is_still_backwards() -> None:
    session, feed = two_ranks()
    for step in range(1, 6):
        feed(step_report(1, step, "simple"))
    assert feed(replace(step_report(1, 1, "simple"), step=0)) == "step_backwards"


def test_unresolved_reports_are_counted_per_rank_and_enter_no_figure() -> None:
    session, feed = two_ranks()
    for step in range(1, 5):
        feed(step_report(0, step, "simple"))
        report = step_report(1, step, "simple")
        if step in (2, 3):  # two all-reduces never completed: only the spans that did are sent
            report = replace(report, unresolved=True, spans=[s for s in report.spans if s.tag not in ("p2", "p3")])
        feed(report)
    assert session.ranks[1].unresolved == 2 and session.ranks[0].unresolved == 0
    assert 1 not in session.step_figures(2) and 0 in session.step_figures(2)
    assert sorted(session.counted_calls(2)) == [0]
    figures = session.segment_figures(session.segments[0])
    assert figures.desync is None and figures.desyncs == ()  # partial spans are not a desync
    assert (figures.per_rank[0].steps, figures.per_rank[1].steps) == (4, 2)
    assert figures.all_reduce_calls == 4 and figures.all_reduce_calls_total == 24


def test_a_rejected_message_is_rejected_not_also_lost_and_a_listeners_own_message_makes_no_rank() -> None:
    """The rejected one never moved the rank's sequence on, so the next counted it lost as well;
    a span request (a listener's, rank -1) made a rank -1 that *passed no step* in summary.md."""
    session, feed = two_ranks()
    feed(step_report(0, 1, "simple"))
    assert feed(step_report(0, 1, "simple")) == "step_repeated"
    feed(step_report(0, 2, "simple"))
    assert session.rejected == {"step_repeated": 1} and session.ranks[0].lost_messages == 0
    assert session.ingest(Envelope(SpanRequest(full=True), -1, 1, 0)) == "unknown_rank"
    assert sorted(session.ranks) == [0, 1]


def test_a_message_that_passed_every_check_and_raises_as_it_is_folded_is_rejected_and_said_not_raised(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where a check is missing (a settings value the wire once took, read as a number later),
    the recorder died and its recording could not be read back; the dashboard with it."""
    from ddpwatch.dashboard.views.warning_lines import reporting_fault_lines

    session, feed = two_ranks()
    monkeypatch.setattr(session, "_receive_report", lambda *args: int("two"))
    assert feed(step_report(0, 1, "simple")) == "unfoldable"
    assert session.rejected == {"unfoldable": 1}
    line = ("a message that passed every check raised as it was read, and was left out (the last: step from rank 0: "
            "ValueError: invalid literal for int() with base 10: 'two'): please report it")
    assert line in reporting_fault_lines(session)


def test_a_report_dropped_while_another_rank_lags_leaves_its_segment_whole() -> None:
    """Rank 0's report of step 3 dropped (its sender's queue full), its step 4 in before rank 1's
    step 3: the segment split in two for good, each row figured from part of the steps."""
    session, feed = two_ranks()
    for rank, step in [(0, 1), (1, 1), (0, 2), (1, 2), (0, 4), (1, 3), (0, 5), (1, 4), (0, 6), (1, 5), (1, 6)]:
        assert feed(step_report(rank, step, "simple")) is None
    assert [(s.strategy, s.first_step, s.last_step) for s in session.segments] == [("simple", 1, 6)]
    assert session.segment_figures(session.segments[0]).steps == 6


def test_a_segment_extends_across_a_few_missing_steps_only_as_they_may_hold_another_strategys() -> None:
    """Beyond ``SEGMENT_GAP_STEPS`` steps with no report the gap may be a segment of another
    strategy whose reports are still to come: a new segment begins instead."""
    session, feed = two_ranks()
    feed(step_report(0, 1, "simple"))
    feed(step_report(0, 2 + SEGMENT_GAP_STEPS, "simple"))
    feed(step_report(0, 4 + 2 * SEGMENT_GAP_STEPS, "simple"))
    assert [(s.first_step, s.last_step) for s in session.segments] == [
        (1, 2 + SEGMENT_GAP_STEPS), (4 + 2 * SEGMENT_GAP_STEPS, 4 + 2 * SEGMENT_GAP_STEPS)]
    feed(step_report(1, 3 + 2 * SEGMENT_GAP_STEPS, "bucket"))  # another strategy's step, its report late
    assert [s.strategy for s in session.segments] == ["simple", "bucket", "simple"]


def test_the_declared_world_follows_the_hellos_including_a_smaller_one_repeated() -> None:
    session = Session()

    def heartbeat_from(rank: int) -> str | None:
        return session.ingest(Envelope(Heartbeat(rank, 1.0, 0), rank, 100, 0))

    for rank in (0, 1):
        session.ingest(Envelope(hello(rank, world_size=8), rank, 0, 0))
    assert heartbeat_from(6) is None
    session.ingest(Envelope(hello(0, world_size=4), 0, 1, 0))  # one rank's repeated hello: the largest still stands
    assert heartbeat_from(6) is None
    session.ingest(Envelope(hello(1, world_size=4), 1, 1, 0))  # every hello now declares 4 ranks
    assert heartbeat_from(6) == "unknown_rank"
    session.ingest(Envelope(hello(1, world_size=8), 1, 2, 0))
    assert heartbeat_from(6) is None


def test_ranks_that_issued_the_same_calls_share_one_tuple_of_tags() -> None:
    session = Session()
    for rank in (0, 1):
        session.ingest(Envelope(hello(rank, "bucket"), rank, 0, 0))
    for rank in (0, 1):
        session.ingest(Envelope(step_report(rank, 3, "bucket"), rank, 1, 0))
    calls = session.step_calls(3)
    assert calls[0].tags == call_times(step_report(0, 3, "bucket")).tags
    assert calls[0].tags is calls[1].tags


def test_a_session_with_a_detail_window_forgets_old_steps_spans_and_durations_but_not_their_figures_or_waits() -> None:
    from ddpwatch.ingest.step_store import MIN_DETAIL_STEPS

    full, windowed = Session(keep_steps=100), Session(keep_steps=100, detail_rank_steps=1)
    messages = session_messages(steps=MIN_DETAIL_STEPS + 6, world_size=3, goodbye=False)
    ingest(full, messages)
    ingest(windowed, messages)
    steps = sorted(full.reports)
    old, recent = steps[:6], steps[6:]
    for step in steps:
        assert windowed.step_waits(step) == full.step_waits(step)
        for rank, figures in full.step_figures(step).items():
            kept = windowed.step_figures(step)[rank]
            assert dataclasses.replace(kept, algbw_gbps=figures.algbw_gbps) == figures
            assert len(kept.algbw_gbps) == (0 if step in old else len(figures.algbw_gbps))
    assert all(not windowed.has_spans(step, rank) and not windowed.step_calls(step) for step in old for rank in range(3))
    assert all(windowed.has_spans(step, 0) and windowed.step_calls(step) == full.step_calls(step) for step in recent)
    assert windowed.segment_figures(windowed.segments[-1]) == full.segment_figures(full.segments[-1])


def test_spans_pinned_after_their_details_were_forgotten_come_back_with_their_durations() -> None:
    from ddpwatch.ingest.step_store import MIN_DETAIL_STEPS
    from instrumented_ddp.wire.step_figures import summarize

    session = Session(keep_steps=100, detail_rank_steps=1)
    seq = {0: 0, 1: 0}

    def send(rank: int, message: object) -> None:
        session.ingest(Envelope(message, rank, seq[rank], 0))  # type: ignore[arg-type]
        seq[rank] += 1

    for rank in (0, 1):
        send(rank, hello(rank, "bucket"))
    for step in range(1, MIN_DETAIL_STEPS + 4):
        for rank in (0, 1):
            send(rank, summarize(step_report(rank, step, "bucket"), 2))
    assert not session.step_calls(1) and not session.has_spans(1, 0)
    send(0, step_report(0, 1, "bucket"))  # the user pinned step 1
    assert session.has_spans(1, 0) and not session.has_spans(1, 1)
    assert session.step_calls(1) == {0: call_times(step_report(0, 1, "bucket"))}


def test_a_session_with_a_device_sample_budget_shares_it_over_the_ranks() -> None:
    """A dashboard keeps 600 samples a rank up to 64 ranks; at 1,024 that was ~300 MiB and 1.8M
    objects for the cycle collector. The budget is split over the world, eight a rank at least."""
    from instrumented_ddp.wire.codec import encode
    from instrumented_ddp.wire.messages import DeviceSample

    def samples(session: Session, world: int, count: int) -> list[int]:
        messages = [encode(hello(rank, world_size=world), seq=0) for rank in range(world)]
        messages += [encode(DeviceSample(rank, float(i), "cpu", {"process_cpu_pct": float(i)}), seq=1 + i)
                     for i in range(count) for rank in range(world)]
        ingest(session, messages)
        assert all(s.devices_received == count for s in session.ranks.values())
        assert all(s.devices[-1].readings["process_cpu_pct"] == count - 1 for s in session.ranks.values())  # the newest kept
        return [len(s.devices) for s in session.ranks.values()]

    assert samples(Session(device_samples=40), 2, 50) == [20, 20]
    assert samples(Session(device_samples=40), 16, 50) == [8] * 16
    assert samples(Session(), 2, 700) == [600, 600]  # no budget: 600 a rank, as the recorder keeps


def test_ranks_left_behind_are_those_five_or_more_steps_behind_the_newest() -> None:
    # newest 10: rank 1 at 5 is 5 behind (named), rank 2 at 6 is 4 behind (ranks drift that far)
    assert ranks_left_behind({0: 10, 1: 5, 2: 6, 3: 10}) == {1: 5}
    assert ranks_left_behind({}) == {} and ranks_left_behind({0: 3}) == {}


def test_a_short_label_names_the_same_settings_in_words_and_leaves_an_accumulation_of_one_unsaid() -> None:
    bucket = {"bucket_mb": 1.0, "grad_accum": 1}
    assert strategy_label("bucket", bucket) == "bucket (bucket_mb=1.0, grad_accum=1)"
    assert short_strategy_label("bucket", bucket) == "bucket 1 MB"
    assert short_strategy_label("ddp", {"bucket_mb": 0.05, "grad_accum": 4}) == "ddp 0.05 MB accum 4"
    assert short_strategy_label("ga", {"grad_accum": 2}) == "ga accum 2"
    assert short_strategy_label("fsdp", {"grad_accum": 1, "replicas": 2}) == "fsdp 2 replicas"
    assert short_strategy_label("simple", {}) == "simple"
    hooked = {"bucket_mb": 25.0, "grad_accum": 1, "comm_hook": "fp16_compress_hook"}  # an attached DDP's own hook
    assert strategy_label("ddp", hooked) == "ddp (bucket_mb=25.0, comm_hook=fp16_compress_hook, grad_accum=1)"
    assert short_strategy_label("ddp", hooked) == "ddp 25 MB fp16_compress"
    assert short_strategy_label("bucket", {"bucket_mb": "odd"}) == "bucket odd MB"  # a hostile setting: no exception


def test_an_hsdp_session_pairs_and_counts_busbw_within_the_groups_its_hellos_name() -> None:
    """Four ranks, each ``simple`` step's all-reduces 4,000 bytes in 9 ms. Where the hellos say
    each rank all-reduces with one other ({0, 2} and {1, 3}: HSDP's 2 replicas of 2 shards) the
    bus factor is 2*1/2 = 1, where over the world it is 2*3/4; the segment is labelled with the
    replicas ``attach`` puts in its settings."""
    def as_simple(report):  # noqa: ANN001, ANN202 (the synthetic session switches to bucket at step 3)
        return replace(report, strategy="simple", settings={"grad_accum": 1}) if report.step <= 2 else None

    def as_hsdp(report):  # noqa: ANN001, ANN202
        return replace(report, strategy="fsdp", settings={"grad_accum": 1, "replicas": 2}) if report.step <= 2 else None

    replicas = {rank: replace(hello(rank, world_size=4), all_reduce_group=[rank % 2, rank % 2 + 2]) for rank in range(4)}
    figures, groups = {}, []
    for edit, hellos in ((as_simple, None), (as_hsdp, replicas)):
        session = Session(None)
        ingest(session, session_messages(steps=2, world_size=4, edit=edit, hellos=hellos))
        (segment,) = session.segments
        figures[segment.label] = session.segment_figures(segment).busbw_gbps
        groups.append(session.all_reduce_groups())
    (plain, world_busbw), (hsdp, replicas_busbw) = figures.items()
    assert hsdp == "fsdp (grad_accum=1, replicas=2)"
    assert world_busbw is not None and replicas_busbw == pytest.approx(world_busbw / 1.5)
    assert groups == [None, [[0, 2], [1, 3]]]  # who waits for whom in its all-reduces


def test_ranks_no_hello_groups_stay_in_the_waits_and_contradicting_hellos_fall_back_to_the_world(tmp_path) -> None:  # noqa: ANN001
    """Four ranks; ranks 0 and 1 name {0, 1}, ranks 2 and 3 no group (their hellos said nothing
    yet of one). Before, ranks 2 and 3 fell out of every wait: rank 3's 30 ms waiting for rank 2
    was not counted anywhere. Now they are a group of their own. Where rank 2 names {1, 2}, the
    hellos contradict each other: the figures are over the world, and the dashboard and the
    exports say why."""
    from ddpwatch.dashboard.views.snapshot import SnapshotBuilder
    from ddpwatch.export.exporters import summary, summary_markdown

    def session_of(named: dict[int, list[int]]) -> Session:
        hellos = {rank: replace(hello(rank, world_size=4), all_reduce_group=group) for rank, group in named.items()}
        session = Session(None)
        ingest(session, session_messages(steps=4, world_size=4, edit=waiting_ranks(30.0, ranks=(1, 3)), hellos=hellos))
        return session

    partial = session_of({0: [0, 1], 1: [0, 1], 2: [], 3: []})
    assert partial.all_reduce_groups() == [[0, 1], [2, 3]] and partial.all_reduce_groups_problem is None
    waited, waited_for = partial.step_waits(3)
    assert waited == pytest.approx({0: 0.0, 1: 30.0, 2: 0.0, 3: 30.0})
    assert waited_for == pytest.approx({0: 30.0, 1: 0.0, 2: 30.0, 3: 0.0})

    contradicting = session_of({0: [0, 1], 1: [0, 1], 2: [1, 2], 3: []})
    assert contradicting.all_reduce_groups() is None
    why = "the ranks' hellos name all-reduce groups that overlap (rank 1 in {0, 1} and {1, 2}): waits and busbw are figured over every rank"
    assert contradicting.all_reduce_groups_problem == why
    assert why in SnapshotBuilder(contradicting).build().warnings
    exported = summary(contradicting)
    assert exported["all_reduce_groups"] is None and exported["all_reduce_groups_problem"] == why
    assert f"Not within groups: {why}." in summary_markdown(exported)


def test_groups_named_after_a_segment_began_hold_for_the_whole_segment() -> None:
    """A dashboard started mid-run folds steps by age (``FOLD_LAG``) before the hellos, resent
    every 2 s, are in. Four HSDP ranks in replica groups {0, 2} and {1, 3}, the hellos arriving
    after 30 steps: the segment was made over the world and kept it, so its busbw read 1.5 times
    high (bus factor 2*3/4 against 2*1/2) for the rest of the run."""
    def as_hsdp(report):  # noqa: ANN001, ANN202
        return replace(report, strategy="fsdp", settings={"grad_accum": 1, "replicas": 2})

    replicas = {rank: replace(hello(rank, world_size=4), all_reduce_group=[rank % 2, rank % 2 + 2]) for rank in range(4)}
    messages = session_messages(steps=40, world_size=4, edit=as_hsdp, hellos=replicas)
    hellos, before, after = messages[:4], messages[4:4 + 4 * 2 * 30], messages[4 + 4 * 2 * 30:]  # a report and a sample a rank a step
    told_first, told_late = Session(None), Session(None)
    ingest(told_first, messages)
    ingest(told_late, before)
    assert told_late.segments[0].folded is not None  # the first steps are in, figured over the world
    ingest(told_late, hellos + after)
    busbw = [session.segment_figures(session.segments[0]).busbw_gbps for session in (told_first, told_late)]
    assert busbw[1] == pytest.approx(busbw[0])


def test_what_the_loop_paused_for_is_kept_in_order_first_heard_a_few_kinds_of_a_few_words() -> None:
    """A sender naming a thousand kinds of pause (or one of a megabyte) would grow the notes line
    without bound: eight kinds kept, each cut to 80 characters."""
    kinds: dict[str, None] = {}
    for paused_for in ("evaluate, save", "save", "", "x" * 200, *(f"kind {i}" for i in range(20))):
        note_pause_kinds(kinds, paused_for)
    assert list(kinds) == ["evaluate", "save", "x" * 80, *(f"kind {i}" for i in range(PAUSE_KINDS_KEPT - 3))]
