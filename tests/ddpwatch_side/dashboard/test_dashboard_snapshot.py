"""What the dashboard's snapshot of a session (``ddpwatch/dashboard/views/snapshot.py``) says, without
drawing it: the warnings that stay on screen (a desync, the straggler, unresolved and late
reports, lost and failed ranks), the notes on a run's steps (skipped updates, compiling steps,
untimed collectives, pauses, forwards without gradients, ranks that stopped or pause now), the
header's rate, and how often a large job's are remade. The pilot tests of the widgets that show
them are in ``test_dashboard_app.py``."""

from __future__ import annotations

import json
from msgspec.structs import replace

import pytest

from ddpwatch.export import exporters
from ddpwatch.wording.figure_text import ONE_RANK_NOTE
from ddpwatch.dashboard.views.snapshot import SnapshotBuilder
from ddpwatch.ingest.receiver import ingest
from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.codec import decode, encode
from instrumented_ddp.wire.messages import Goodbye, Heartbeat, Span, StepReport
from synthetic_session import hello, session_messages, step_report, waiting_ranks
from synthetic_session import snapshot_of


def test_a_desync_stays_in_the_warnings_with_its_step_range_after_it_left_the_screen() -> None:
    def skip_a_call(report: StepReport) -> StepReport:
        if report.rank == 1 and report.step in (3, 4):
            return replace(report, spans=[s for s in report.spans if s.tag != "p3"])
        return report

    session, snapshot = snapshot_of(session_messages(edit=skip_a_call), keep_steps=3)
    assert snapshot.timeline.step == 10 and 3 not in session.reports  # the timeline moved on, the step is gone
    assert snapshot.warnings[0] == ("DESYNC at steps 3-4 (2 steps): the ranks issued different all-reduce counts "
                                    "(step 3: rank 0: 4, rank 1: 3; step 4: rank 0: 4, rank 1: 3)")


def test_a_reduce_scatter_desync_is_shown_while_its_step_is_on_screen() -> None:
    """ZeRO-2 and FSDP issue no all-reduce: the dashboard judges every collective kind."""
    def sharded(report: StepReport) -> StepReport:
        spans = [s._replace(kind="reduce_scatter") if s.kind == "all_reduce" else s for s in report.spans]
        if report.rank == 1 and report.step == 10:
            spans = [s for s in spans if s.tag != "b1"]
        return replace(report, spans=spans)

    _, snapshot = snapshot_of(session_messages(edit=sharded), keep_steps=3)
    assert snapshot.timeline.step == 10
    assert snapshot.warnings[0] == ("DESYNC at step 10: the ranks issued different reduce-scatter counts "
                                    "(rank 0: 2, rank 1: 1)")


def test_the_dashboard_and_the_export_name_the_same_straggler_by_one_rule() -> None:
    # rank 1 waits 30 ms of each ~185 ms step for rank 0 (16 %): both name rank 0
    session, snapshot = snapshot_of(session_messages(edit=waiting_ranks(30.0)), keep_steps=None)
    shown = [w for w in snapshot.warnings if "straggler" in w]
    assert shown == ["rank 0 is a straggler: over steps 1-10 the others waited 30.0 ms a step for it (17% of step time)"]
    assert [s["straggler_rank"] for s in exporters.summary(session)["segments"]] == [0, 0]
    # 0.5 ms of each step is noise: neither names anyone (the export used to name rank 0)
    session, snapshot = snapshot_of(session_messages(edit=waiting_ranks(0.5)), keep_steps=None)
    assert not any("straggler" in w for w in snapshot.warnings)
    assert [s["straggler_rank"] for s in exporters.summary(session)["segments"]] == [None, None]


def test_unresolved_steps_are_counted_per_rank_in_the_warnings_and_make_no_desync() -> None:
    def unresolved(report: StepReport) -> StepReport:
        if report.rank == 1 and report.step in (2, 3, 9):
            why = "all_reduce b1 could not be timed: RuntimeError: getDuration only works if timing was enabled" if report.step == 9 else ""
            return replace(report, unresolved=True, spans=[s for s in report.spans if s.tag not in ("p3", "b1")], unresolved_reason=why)
        return report

    session, snapshot = snapshot_of(session_messages(edit=unresolved))
    assert snapshot.warnings == ("rank 1: 3 steps sent unresolved (left out of the figures): all_reduce b1 could not be timed: "
                                 "RuntimeError: getDuration only works if timing was enabled",)  # the newest reason given
    assert session.segment_figures(session.segments[0]).per_rank[1].steps == 3


def test_many_ranks_unresolved_are_one_warning_naming_the_most_common_reason() -> None:
    from ddpwatch.dashboard.views.warning_lines import reporting_fault_lines

    failed = "all_reduce u3 could not be timed: RuntimeError: getDuration only works if timing was enabled"

    def unresolved(report: StepReport) -> StepReport:
        if report.rank in (1, 2, 3, 5) and report.step == 4:
            why = failed if report.rank != 5 else "1 timing mark had not completed 32 steps later"
            return replace(report, unresolved=True, spans=[s for s in report.spans if s.tag != "b1"], unresolved_reason=why)
        return report

    session = Session()
    ingest(session, session_messages(world_size=8, edit=unresolved))
    assert [line for line in reporting_fault_lines(session) if "unresolved" in line] == [
        f"4 ranks sent 4 steps unresolved (timing marks never completed; left out of the figures): ranks 1-3, 5; most often: {failed}"]


def test_steps_whose_update_was_skipped_are_a_note_with_their_steps() -> None:
    def skipped(report: StepReport) -> StepReport:
        return replace(report, update_skipped=True) if report.step in (3, 4, 8) else report

    _, snapshot = snapshot_of(session_messages(edit=skipped))
    assert snapshot.warnings == ()
    assert snapshot.notes == ("optimizer update skipped in 3 steps (3-4, 8): gradients reduced, then cleared with no "
                              "optimizer.step(), as a loss scaler does when it finds inf or NaN",)


def test_a_run_of_one_rank_is_a_note_that_its_communication_figures_are_empty() -> None:
    """One rank's all-reduce is a blip inside backward: Overlap% read 100 with nothing said."""
    _, one = snapshot_of(session_messages(world_size=1))
    assert one.notes == (ONE_RANK_NOTE,) and one.warnings == ()
    _, two = snapshot_of(session_messages(world_size=2))
    assert two.notes == ()


def test_steps_in_which_torch_compile_compiled_are_a_note_with_their_steps() -> None:
    def compiling(report: StepReport) -> StepReport:
        return replace(report, compiling=True, excluded=True) if report.step in (1, 2, 9) else report

    _, snapshot = snapshot_of(session_messages(edit=compiling))
    assert snapshot.warnings == ()
    assert snapshot.notes == ("torch.compile compiled in 3 steps (1-2, 9): left out of the figures; past the first steps "
                              "it recompiled (TORCH_LOGS=recompiles says why)",)


def test_collectives_a_script_issued_untimed_are_a_note_with_their_steps_and_the_most_in_one() -> None:
    """Through the wire as ranks send them (summaries carry the count too)."""
    def trainer_like(report: StepReport) -> StepReport:
        return replace(report, untimed_collectives=4 if report.rank == 0 else 3) if report.step >= 2 else report

    _, snapshot = snapshot_of(session_messages(edit=trainer_like))
    assert snapshot.warnings == ()
    assert snapshot.notes == ("collectives not timed in 9 steps (2-10), up to 4 a step on a rank: issued outside DDP's "
                              "buckets and FSDP's gathers and reductions (by the script itself, or by DDP: its rebuilt "
                              "buckets, its map of used parameters under find_unused_parameters=True): their time reads "
                              "as compute",)


def test_untimed_collectives_issued_before_a_forward_are_said_to_read_as_data_loading() -> None:
    """The Trainer's label-count gather before each forward, a loss all-reduced for logging after
    the update: the note said all untimed collectives read as compute; those read as data
    loading, and so does a wait in them for a slower rank."""
    def trainer_like(report: StepReport) -> StepReport:
        if report.step < 2:
            return report
        return replace(report, untimed_collectives=3, untimed_in_data=2 if report.step % 2 else 1)

    _, snapshot = snapshot_of(session_messages(edit=trainer_like))
    assert snapshot.notes == ("collectives not timed in 9 steps (2-10), up to 3 a step on a rank: issued outside DDP's "
                              "buckets and FSDP's gathers and reductions (by the script itself, or by DDP: its rebuilt "
                              "buckets, its map of used parameters under find_unused_parameters=True): in 9 of these steps "
                              "(2-10) up to 2 a step were issued before a forward, in the data time, and read as data "
                              "loading, a wait in them for a slower rank included; the others' time reads as compute",)


def test_steps_the_loop_paused_training_before_are_a_note_with_their_steps_and_the_longest() -> None:
    """A Trainer evaluating before steps 4 and 8 and saving before 8: ranks pause together, rank
    1 a little longer. Through the wire as ranks send them (summaries carry the pause too)."""
    def evaluating(report: StepReport) -> StepReport:
        what = {4: "evaluate", 8: "evaluate, save"}.get(report.step)
        return replace(report, paused_s=1.25 + 0.5 * report.rank, paused_for=what) if what else report

    _, snapshot = snapshot_of(session_messages(edit=evaluating))
    assert snapshot.warnings == ()
    assert snapshot.notes == ("the loop paused training (evaluate, save) before 2 steps (4, 8), up to 1.75 s: left out "
                              "of the step times and of samples/s",)


def test_a_segment_whose_loop_marked_compute_of_its_own_is_a_note_with_its_ms_a_step() -> None:
    """Each step begins with 4 ms of an average of the weights the loop marked (``watch.computing``),
    inside its data gap. Through the wire as ranks send them (summaries carry it too): a line per
    segment, as summary.md says it."""
    def averaging(report: StepReport) -> StepReport:
        return replace(report, spans=[Span("loop", report.start, report.start + 0.004, tag="ema"), *report.spans])

    _, snapshot = snapshot_of(session_messages(edit=averaging))
    assert snapshot.warnings == ()
    assert snapshot.notes == tuple(
        f"{segment}: the loop's own compute, marked with watch.computing (ema): 4.0 ms a step (mean of ranks) of a "
        f"{p50} ms step (p50), in Compute%, not data loading" for segment, p50 in (("simple (steps 1-5)", 185), ("bucket 1 MB (steps 6-10)", 170)))


def test_steps_whose_data_held_forwards_without_gradients_are_a_note_naming_the_fix() -> None:
    """A loop evaluating before steps 5 and 6 without marking it: rank 1 ran 3 forwards, rank 0
    two. Through the wire as ranks send them (summaries carry the count too)."""
    def evaluating(report: StepReport) -> StepReport:
        return replace(report, nograd_forwards=2 + report.rank) if report.step in (5, 6) else report

    _, snapshot = snapshot_of(session_messages(edit=evaluating))
    assert snapshot.warnings == ()
    assert snapshot.notes == ("the model ran forwards without gradients before 2 steps (5-6), up to 3 a step on a rank: "
                              "an evaluation? Their time reads as data loading; mark it with "
                              '`with watch.paused("evaluate"):` to leave it out of the step',)


def test_a_rank_whose_steps_stopped_while_the_others_went_on_is_a_note() -> None:
    """DDP's ``join()`` with uneven inputs: rank 1 runs out of data after step 4 and shadows the
    others' collectives outside any step; it goes on beating, so it is not lost, and rank 0
    reaches step 10. Said once it has stayed behind for a few seconds, not while it merely lags."""
    def out_of_data(report: StepReport) -> StepReport | None:
        return None if report.rank == 1 and report.step > 4 else report

    session = Session(120)
    for message in session_messages(goodbye=False, edit=out_of_data):
        envelope = decode(message)
        session.ingest(envelope, received_at=9.0 if envelope.rank == 0 else 0.0)  # rank 1's last step came at 0 s
    session.ingest(decode(encode(Heartbeat(1, 9.0, 4), seq=100)), received_at=9.0)  # alive, at its step 4
    assert SnapshotBuilder(session).build(now=2.0).notes == ()  # unmoved for 2 s: it may still be resolving
    notes = SnapshotBuilder(session).build(now=9.5).notes
    assert notes == ("rank 1 has passed no step since step 4 while the others reached 10: out of data under DDP's "
                     "join() (uneven inputs), or out of the training loop",)
    silent = SnapshotBuilder(session).build(now=13.0)
    assert "rank 1 lost: nothing heard from it for 4.0 s" in silent.warnings and silent.notes == ()  # lost, not this


def test_live_ranks_a_lost_rank_holds_in_a_collective_are_a_warning_until_they_step_again() -> None:
    """Rank 3 of 4 freezes after step 10 (all heard at 5.0 s): it is lost 2.5 s later; the others
    beat on, passing no step, since every collective needs rank 3. Said once they have been
    unmoved for 3 s (at 8.0 s, not 7.9 s); rank 0 stepping on (its heartbeat says step 11)
    is training without rank 3's telemetry, and is no longer said held."""
    session = Session(120)
    for message in session_messages(world_size=4, goodbye=False):
        session.ingest(decode(message), received_at=5.0)
    for seq, t in enumerate((6.5, 7.5, 8.5, 9.5, 10.5, 11.5)):
        for rank in (0, 1, 2):
            session.ingest(decode(encode(Heartbeat(rank, t, 10), seq=100 + seq)), received_at=t)
    held_line = ("3 ranks (0-2) have passed no step since rank 3 went silent {} s ago (at step 10): waiting for it in a "
                 "collective, until the process group's timeout (by default 10 min on NCCL, 30 min on gloo) unless the "
                 "launcher stops the job")
    assert session.ranks_held_by_lost(7.9) == ({}, {3: 5.0})
    assert SnapshotBuilder(session).build(now=8.0).warnings[:2] == ("rank 3 lost: nothing heard from it for 3.0 s",
                                                                   held_line.format(3))
    assert SnapshotBuilder(session).build(now=12.0).warnings[1] == held_line.format(7)
    session.ingest(decode(encode(Heartbeat(0, 12.5, 11), seq=200)), received_at=12.5)
    assert session.ranks_held_by_lost(13.0) == ({1: 10, 2: 10}, {3: 5.0})
    assert SnapshotBuilder(session).build(now=13.0).warnings[1].startswith(
        "2 ranks (1-2) have passed no step since rank 3 went silent 8 s ago (at step 10)")


def test_ranks_whose_loop_is_pausing_now_are_a_note_with_how_long_until_they_train_again() -> None:
    """A Trainer evaluating after step 10: both ranks' heartbeats say so from 5.0 s (rank 1's a
    little later); at 47 s the note says 42 s; once a heartbeat says training goes on, it is gone.
    A lost rank is said lost, not pausing."""
    session = Session(120)
    for message in session_messages(goodbye=False):
        session.ingest(decode(message), received_at=5.0)
    session.ingest(decode(encode(Heartbeat(0, 9.0, 10, "evaluate"), seq=100)), received_at=5.0)
    session.ingest(decode(encode(Heartbeat(1, 9.0, 10, "evaluate"), seq=100)), received_at=5.5)
    for t in (20.0, 30.0, 40.0, 46.0):  # the same pause, heartbeat after heartbeat: its start stays
        for rank in (0, 1):
            session.ingest(decode(encode(Heartbeat(rank, t, 10, "evaluate"), seq=100 + int(t))), received_at=t)
    assert SnapshotBuilder(session).build(now=47.0).notes == (
        "ranks 0-1: the loop has paused training (evaluate) for 42 s: no step comes until it trains again",)
    session.ingest(decode(encode(Heartbeat(0, 48.0, 10), seq=200)), received_at=48.0)
    assert SnapshotBuilder(session).build(now=48.5).notes == (
        "rank 1: the loop has paused training (evaluate) for 43 s: no step comes until it trains again",)
    assert SnapshotBuilder(session).build(now=52.0).notes == ()  # rank 1 silent for 6 s: lost


def test_a_late_report_is_a_note_not_rejected_input() -> None:
    def withhold(report: StepReport) -> StepReport | None:
        return None if report.rank == 1 and report.step >= 4 else report

    late = [encode(Heartbeat(1, 0.0, 9), seq=100), encode(step_report(1, 4, "simple"), seq=101)]
    session, snapshot = snapshot_of(session_messages(goodbye=False, edit=withhold) + late)
    assert session.rejected == {} and not any("rejected" in w for w in snapshot.warnings)
    assert snapshot.notes == ("rank 1: 1 step report arrived late (1 used)",)
    assert sorted(session.reports[4]) == [0, 1]


def test_the_header_samples_per_s_is_over_wall_time_with_the_time_between_steps() -> None:
    # steps start every 200 ms and last 185 (simple) or 170 ms (bucket): steps 1-10 run from
    # 100.2 s to 102.17 s = 1.97 s for 2 ranks x 10 steps x 4 samples (the windows alone sum to 1.775 s)
    _, snapshot = snapshot_of(session_messages())
    assert snapshot.header.samples_per_s == pytest.approx(80 / 1.97)


def test_the_header_samples_per_s_leaves_out_the_loops_pauses_but_its_eta_keeps_them() -> None:
    """The same steps with the time before step 6 paused (an evaluation): rank 0 0.015 s, rank 1
    0.010 s. The wall is still 1.97 s; the least any rank paused, 0.010 s, is not training:
    80 / 1.96. The seconds per step the ETA counts are 1.97 / 10 still (evaluations recur)."""
    def evaluating(report: StepReport) -> StepReport:
        return replace(report, paused_s=0.015 - 0.005 * report.rank, paused_for="evaluate") if report.step == 6 else report

    planned = {rank: replace(hello(rank), total_steps=20) for rank in (0, 1)}  # 10 steps to go
    _, snapshot = snapshot_of(session_messages(edit=evaluating, goodbye=False, hellos=planned))
    assert snapshot.header.samples_per_s == pytest.approx(80 / 1.96)
    assert snapshot.header.eta_s == pytest.approx(10 * 1.97 / 10)


def test_many_ranks_with_the_same_note_or_late_reports_make_one_line_each() -> None:
    """A thousand GPUs without NVML, or every rank of a job sending a report late, said once:
    a line per rank filled the warnings panel and changed every frame."""
    note = "NVML unavailable: libnvidia-ml.so not found; sending CPU readings"
    hellos = {rank: hello(rank, world_size=8, device=f"cuda:{rank}", device_note=note if rank != 7 else "") for rank in range(8)}
    late = [encode(step_report(rank, 4, "simple"), seq=101) for rank in range(5)]
    heartbeats = [encode(Heartbeat(rank, 0.0, 9), seq=100) for rank in range(5)]

    def withhold(report: StepReport) -> StepReport | None:
        return None if report.rank < 5 and report.step >= 4 else report

    _, snapshot = snapshot_of(session_messages(world_size=8, hellos=hellos, goodbye=False, edit=withhold) + heartbeats + late)
    assert snapshot.notes == ("5 ranks sent 5 step reports late (5 used): ranks 0-4", f"7 ranks (0-6): {note}")


@pytest.mark.parametrize("world_size", [2, 6])
def test_a_few_lost_ranks_are_warned_of_one_by_one_and_many_in_one_line(world_size: int) -> None:
    session = Session()
    ingest(session, session_messages(steps=2, world_size=world_size, goodbye=False))
    later = max(state.last_seen for state in session.ranks.values()) + 10.0
    lost = [w for w in SnapshotBuilder(session).build(now=later).warnings if "lost" in w]
    if world_size == 2:
        assert lost == ["rank 0 lost: nothing heard from it for 10.0 s", "rank 1 lost: nothing heard from it for 10.0 s"]
    else:
        assert lost == ["6 ranks lost: nothing heard from them for 10-10 s: ranks 0-5"]


def test_the_rank_whose_failure_was_heard_first_is_named_first_on_screen_and_in_the_exports() -> None:
    """Rank 2 of 4 runs out of memory; the others' next collectives fail on the dead peer after
    its goodbye came. Named by arrival, not by rank or by step."""
    oom = "failed: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB"
    reset = "failed: RuntimeError: Connection reset by peer"
    messages = [*session_messages(steps=4, world_size=4, goodbye=False), encode(Goodbye(2, 4, oom), 90, 0),
                *(encode(Goodbye(rank, 3, reset), 90, 0) for rank in (3, 0, 1))]
    session = Session()
    ingest(session, messages)
    line = ("4 ranks failed after steps 3-4: ranks 0-3; first rank 2, after step 4: RuntimeError: CUDA out of memory. "
            "Tried to allocate 2.00 GiB; then most often: RuntimeError: Connection reset by peer")
    snapshot = SnapshotBuilder(session).build(now=max(state.last_seen for state in session.ranks.values()))
    assert line in snapshot.warnings
    data = json.loads(json.dumps(exporters.summary(session)))
    assert data["first_failed_rank"] == 2 and f"**ERROR: {line}**" in exporters.summary_markdown(data)
    assert exporters.summary(Session())["first_failed_rank"] is None


def test_a_large_jobs_rows_and_warnings_are_remade_at_most_twice_a_second_and_at_once_for_a_new_view() -> None:
    world = 80  # above 64 ranks: a row per node of 8
    hellos = {rank: replace(hello(rank, world_size=world), node_rank=rank // 8) for rank in range(world)}
    session = Session(None)
    ingest(session, session_messages(steps=3, goodbye=False, world_size=world, hellos=hellos))
    builder = SnapshotBuilder(session)
    arrived = max(state.last_seen for state in session.ranks.values())
    first = builder.build(now=arrived + 2.3)
    assert {row.status for row in first.ranks} == {"live"}
    soon = builder.build(now=arrived + 2.6)  # silent 2.6 s: lost, but the rows are 0.3 s old
    assert soon.ranks is first.ranks and soon.devices is first.devices
    assert soon.warnings is first.warnings and not any("lost" in line for line in soon.warnings)  # so are the warnings
    opened = builder.build(now=arrived + 2.7, open_nodes={0})  # a node opened: remade at once
    assert len(opened.ranks) == 18 and {row.status for row in opened.ranks} == {"lost"}
    assert any("80 ranks lost" in line for line in builder.build(now=arrived + 2.8).warnings)  # half a second on
    later = builder.build(now=arrived + 3.3, open_nodes={0})  # half a second on
    assert later.ranks is not opened.ranks and later.ranks == opened.ranks


def test_the_header_rate_aligned_step_by_step_equals_it_aligned_afresh() -> None:
    """Each step is aligned once as it enters the window: fed in two halves, with rank 1's clock
    5 s ahead, the header still reads 2 ranks x 10 steps x 4 samples over 1.97 s (see above)."""
    def clock_ahead(report: StepReport) -> StepReport:
        if report.rank != 1:
            return report
        return replace(report, start=report.start + 5, end=report.end + 5,
                       spans=[s._replace(start=s.start + 5, end=s.end + 5) for s in report.spans])

    messages = session_messages(edit=clock_ahead)
    session = Session(None)
    builder = SnapshotBuilder(session)
    ingest(session, messages[: len(messages) // 2])
    builder.build(now=100.0)
    ingest(session, messages[len(messages) // 2:])
    stepwise = builder.build(now=102.0).header.samples_per_s
    assert stepwise == pytest.approx(80 / 1.97)
    assert stepwise == pytest.approx(SnapshotBuilder(session).build(now=102.0).header.samples_per_s)
