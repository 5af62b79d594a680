"""Steps that wait on their data, said in words (``ddpwatch.wording.data_wait``), hand-worked."""

from __future__ import annotations

from msgspec.structs import replace

from synthetic_session import session_messages

from ddpwatch.export import exporters
from ddpwatch.dashboard.views.snapshot import SnapshotBuilder
from ddpwatch.wording.data_wait import DATA_WAIT_NOTE_PCT, data_wait_text, uneven_text
from ddpwatch.ingest.receiver import ingest
from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.messages import Span, StepReport


def test_a_segment_whose_steps_waited_on_their_data_is_said_with_the_ms_it_cost() -> None:
    # 48.7 % of a 32 ms step: 15.6 ms, said as 16 (a 15 ms sleep before each forward, by hand)
    assert data_wait_text("segment 0", 48.7, 54.7, 32.0) == (
        "segment 0: the step waited on its data 48.7 % of the time (about 16 ms of a 32 ms step; Idle% 54.7): the gap "
        "before each forward with nothing else running. A DataLoader that cannot keep up (more num_workers, "
        "pin_memory=True, a larger prefetch_factor), or the loop's own work between steps (logging, an "
        "evaluation not marked with watch.paused, an average of the weights not marked with watch.computing)")


def test_a_loop_that_issued_its_own_collectives_in_the_gap_is_told_they_are_in_the_figure() -> None:
    """A loss all-reduced for logging after each update waits for the slowest rank, in the next
    step's data gap: untimed, so a straggler reads as a slow loader unless the line says so."""
    line = data_wait_text("segment 0", 48.7, 54.7, 32.0, collectives_in_data=2)
    assert line is not None and line.endswith(
        "evaluation not marked with watch.paused, an average of the weights not marked with watch.computing); here the loop also issued up to 2 collectives of its own a step in "
        "that gap, and a wait in them for a slower rank counts as waiting on data")
    assert data_wait_text("segment 0", 48.7, 54.7, 32.0, collectives_in_data=1).endswith(
        "up to 1 collective of its own a step in that gap, and a wait in them for a slower rank counts as waiting on data")


def test_below_the_threshold_nothing_is_said() -> None:
    # train.py and the examples on this box wait 0.7-4.2 % on their data: not worth a line
    assert data_wait_text("segment 0", DATA_WAIT_NOTE_PCT - 0.01, 20.0, 200.0) is None
    assert data_wait_text("segment 0", DATA_WAIT_NOTE_PCT, 20.0, 200.0) is not None


def test_ranks_that_waited_unevenly_name_the_one_that_waited_most() -> None:
    """Rank 1 does 30 ms of its own work before each forward (86.6 % of its step), rank 0 waits
    on nothing (2.2 %): 84.4 points apart, over the 10, so the line names rank 1. Ranks 9.9
    points apart are even; one rank of 64 at 90 % gets the line though the mean is 1.4 %."""
    assert uneven_text({0: 2.2, 1: 86.6}) == (
        ". Unevenly: rank 1 waited on its data 86.6 % of the time, rank 0 2.2 % (the most and the least): rank 1's "
        "loader or its own work between steps, which the others then wait for")
    assert uneven_text({0: 20.0, 1: 29.9}) == "" and uneven_text({0: 86.6}) == "" and uneven_text({}) == ""
    line = data_wait_text("segment 0", 44.4, 89.9, 36.0, by_rank={0: 2.2, 1: 86.6})
    assert line is not None and line.endswith(uneven_text({0: 2.2, 1: 86.6}))
    one_of_64 = {rank: 90.0 if rank == 5 else 0.0 for rank in range(64)}
    line = data_wait_text("segment 0", 90.0 / 64, 20.0, 100.0, by_rank=one_of_64)
    assert line is not None and "rank 5 waited on its data 90.0 %" in line and "rank 0 0.0 %" in line
    assert data_wait_text("segment 0", 90.0 / 64, 20.0, 100.0) is None  # the mean alone: said nothing


def slow_loader(report: StepReport) -> StepReport:
    """60 ms of data loading before each step's own spans, with nothing else running."""
    return replace(report, start=report.start - 0.06, spans=[Span("data", report.start - 0.06, report.start), *report.spans])


def test_the_dashboard_and_summary_md_say_it_of_each_segment_that_waited() -> None:
    """A step of the synthetic run is about 175 ms with 5 ms of data; 60 ms more of data before it
    is about a quarter of a 235 ms step: both segments get the line, in the notes and in summary.md."""
    session = Session()
    ingest(session, session_messages(steps=6, edit=slow_loader))
    notes = [line for line in SnapshotBuilder(session).build().notes if "waited on its data" in line]
    assert [line.split(":")[0] for line in notes] == ["simple (steps 1-3)", "bucket 1 MB (steps 4-6)"]
    markdown = exporters.summary_markdown(exporters.summary(session))
    assert "- segment 0: the step waited on its data" in markdown and "- segment 1: the step waited on its data" in markdown
    plain = Session()
    ingest(plain, session_messages(steps=6))
    assert not any("waited on its data" in line for line in SnapshotBuilder(plain).build().notes)


def test_the_segment_whose_loop_issued_collectives_in_its_data_time_says_so_and_the_other_does_not() -> None:
    """Segment 1's steps (4-6) each carry a loss all-reduce in their data gap; segment 0's none."""
    def logging_loss(report: StepReport) -> StepReport:
        report = slow_loader(report)
        return replace(report, untimed_collectives=1, untimed_in_data=1) if report.step >= 4 else report

    session = Session()
    ingest(session, session_messages(steps=6, edit=logging_loss))
    notes = [line for line in SnapshotBuilder(session).build().notes if "waited on its data" in line]
    markdown = [line for line in exporters.summary_markdown(exporters.summary(session)).splitlines() if "waited on its data" in line]
    for simple, bucket in (notes, markdown):
        assert "collective of its own" not in simple
        assert bucket.endswith("here the loop also issued up to 1 collective of its own a step in that gap, and a wait "
                               "in them for a slower rank counts as waiting on data")


def test_the_dashboard_and_summary_md_name_the_rank_whose_data_the_others_waited_for() -> None:
    """Only rank 1 loads its data slowly (60 ms before each step): the dashboard's note and
    summary.md name it, rank 0 the least; where both ranks load slowly, nobody is named."""
    def rank_1_slow(report: StepReport) -> StepReport:
        return slow_loader(report) if report.rank == 1 else report

    session = Session()
    ingest(session, session_messages(steps=6, edit=rank_1_slow))
    notes = [line for line in SnapshotBuilder(session).build().notes if "waited on its data" in line]
    markdown = [line for line in exporters.summary_markdown(exporters.summary(session)).splitlines() if "waited on its data" in line]
    assert len(notes) == 2 and len(markdown) == 2
    assert all("Unevenly: rank 1 waited on its data" in line and "rank 0 " in line for line in (*notes, *markdown))
    even = Session()
    ingest(even, session_messages(steps=6, edit=slow_loader))
    assert not any("Unevenly" in line for line in SnapshotBuilder(even).build().notes)
