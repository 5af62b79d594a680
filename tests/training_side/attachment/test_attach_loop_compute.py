"""``Attachment.computing``: the loop's own compute outside the model's phases (a teacher's
forward in distillation, an average of the weights after the update) marked in one line, so it
reads as compute and not as data loading or idle time. In one process over a one-rank gloo group;
the sleeps stand for the marked work, so that its time is long beside everything else a step does.
How the rank cuts a data span around it: ``test_timeline.py``."""

from __future__ import annotations

import threading
import time
from typing import Any

import msgspec
import pytest
import torch

from instrumented_ddp.attachment.attachment import AttachError, Attachment
from instrumented_ddp.wire.time_ranges import intersect, total_length
from instrumented_ddp.wire.messages import Span, StepReport
from instrumented_ddp.wire.step_figures import step_figures
from attach_helpers import attached, batch, make_ddp, sharded_classifier

WORK_S = 0.03  # each marked block's sleep


def marked(report: StepReport, what: str) -> list[Span]:
    return [s for s in report.spans if s.kind == "loop" and s.tag == what]


def spans_of(report: StepReport, kind: str) -> list[tuple[float, float]]:
    return [(s.start, s.end) for s in report.spans if s.kind == kind]


def distil(model: torch.nn.Module, optimizer: torch.optim.Optimizer, watch: Attachment, steps: int,
           mark: bool = True) -> None:
    """A distillation loop with an average of the weights: the teacher's forward before the
    student's, the average after ``step()``; each block marked where ``mark``."""
    def block(what: str) -> Any:
        return watch.computing(what) if mark else torch.enable_grad()

    for step in range(steps):
        optimizer.zero_grad()
        with block("teacher forward"):
            time.sleep(WORK_S)
        model(**batch(step)).loss.backward()
        optimizer.step()
        with block("ema"):
            time.sleep(WORK_S)


def test_marked_work_before_the_forward_and_after_the_update_is_compute_cut_out_of_the_data_gap(
        one_rank_group: None, sent: list[Any]) -> None:
    """Each step from the second holds the average the step before ended with (its window begins
    where the update returned), then the teacher's forward, each a ``loop`` span tagged with what
    the loop said; the data gap is cut around them, so that Data wait% holds neither and
    Compute% holds both. Unmarked, the same loop read both sleeps as data loading."""
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer) as watch:
        distil(ddp, optimizer, watch, steps=4)
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.step for r in reports] == [1, 2, 3, 4]
    assert marked(reports[0], "ema") == [] and marked(reports[0], "teacher forward") == []  # before the first step began
    for report in reports[1:]:
        (ema,) = marked(report, "ema")
        (teacher,) = marked(report, "teacher forward")
        (forward,) = [s for s in report.spans if s.kind == "forward"]
        assert report.start <= ema.start and ema.end <= teacher.start and teacher.end <= forward.start
        assert ema.duration >= WORK_S and teacher.duration >= WORK_S
        data = spans_of(report, "data")
        assert data and intersect(data, [(ema.start, ema.end), (teacher.start, teacher.end)]) == []
        # the gap before the forward, less what was marked in it, and Data wait% that and no more
        gap_from = min(start for start, _ in data)  # where the update before returned
        assert total_length(data) == pytest.approx(forward.start - gap_from - ema.duration - teacher.duration)
        figures = step_figures(report, world_size=1)
        window = report.end - report.start
        assert figures.data_wait_pct == pytest.approx(100 * total_length(data) / window)
        assert figures.compute_pct / 100 * window >= 2 * WORK_S

    sent.clear()
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer) as watch:
        distil(ddp, optimizer, watch, steps=3, mark=False)
    unmarked = [m for m in sent if isinstance(m, StepReport)]
    assert all(s.kind != "loop" for r in unmarked for s in r.spans)
    window = unmarked[-1].end - unmarked[-1].start
    assert step_figures(unmarked[-1], world_size=1).data_wait_pct / 100 * window >= 2 * WORK_S


def test_an_fsdp2_loop_marks_its_own_compute_as_a_ddp_loop_does(one_rank_group: None, sent: list[Any]) -> None:
    """The same loop over a model sharded with FSDP2: the same ``loop`` spans, cut out of its data."""
    model, optimizer = sharded_classifier()
    with attached(model, optimizer) as watch:
        distil(model, optimizer, watch, steps=3)
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.strategy for r in reports] == ["fsdp"] * 3
    assert [sorted(s.tag for s in r.spans if s.kind == "loop") for r in reports] == [
        [], ["ema", "teacher forward"], ["ema", "teacher forward"]]
    for report in reports[1:]:
        marked = [(s.start, s.end) for s in report.spans if s.kind == "loop"]
        assert intersect(spans_of(report, "data"), marked) == []


def test_a_teachers_forward_between_the_students_forward_and_backward_is_compute_not_idle(
        one_rank_group: None, sent: list[Any]) -> None:
    """Marked between the student's forward and its backward (a Trainer's ``compute_loss`` that
    runs the teacher after the student), the block was in no span: idle."""
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer) as watch:
        for step in range(3):
            optimizer.zero_grad()
            output = ddp(**batch(step))
            with watch.computing("teacher forward"), torch.no_grad():
                time.sleep(WORK_S)
            output.loss.backward()
            optimizer.step()
    report = [m for m in sent if isinstance(m, StepReport)][-1]
    (teacher,) = marked(report, "teacher forward")
    (forward,), (backward,) = spans_of(report, "forward"), spans_of(report, "backward")
    assert forward[1] <= teacher.start and teacher.end <= backward[0]
    share = 100 * teacher.duration / (report.end - report.start)
    figures = step_figures(report, world_size=1)
    unmarked = step_figures(msgspec.structs.replace(report, spans=[s for s in report.spans if s.kind != "loop"]), world_size=1)
    assert figures.compute_pct == pytest.approx(unmarked.compute_pct + share)
    assert figures.idle_pct == pytest.approx(unmarked.idle_pct - share)


def test_marked_work_after_a_skipped_update_is_the_next_steps(one_rank_group: None, sent: list[Any]) -> None:
    """A loss scaler skips ``step()``: the step ended at its backward, found at the next forward
    (``StepBoundaries.update_skipped``); the average marked after the skipped update, before ``zero_grad``, was
    done after that end, and begins the next step, as the loop's collectives there do."""
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer) as watch:
        for step in range(4):
            ddp(**batch(step)).loss.backward()
            if step != 2:
                optimizer.step()
            with watch.computing("ema"):
                time.sleep(WORK_S)
            optimizer.zero_grad()
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.update_skipped for r in reports] == [False, False, True, False]
    assert [len(marked(r, "ema")) for r in reports] == [0, 1, 1, 1]
    skipped, after = reports[2], reports[3]
    (before_it,), (carried,) = marked(skipped, "ema"), marked(after, "ema")
    assert before_it.end <= spans_of(skipped, "forward")[0][0] and skipped.end <= carried.start


def test_marked_work_where_it_is_no_steps_is_not_counted_and_a_bad_label_is_one_line(
        one_rank_group: None, sent: list[Any]) -> None:
    """Not counted: inside a pause of training (the pause's), on another thread, after detach;
    a label that is not words is refused in one line and the block does not run."""
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer) as watch:
        distil(ddp, optimizer, watch, steps=2, mark=False)
        with watch.paused("evaluate"), watch.computing("ema"):
            time.sleep(0.001)
        thread = threading.Thread(target=lambda: watch.computing("prefetch").__enter__())
        thread.start()
        thread.join()
        ran = []
        with pytest.raises(AttachError, match=r"^computing: expected what the loop computes, in words \(\"ema\"\), got "):
            with watch.computing(" "):
                ran.append(True)
        assert ran == []
        distil(ddp, optimizer, watch, steps=1, mark=False)
    with watch.computing("ema"):  # detached: nothing, no error
        pass
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert len(reports) == 3 and all(s.kind != "loop" for r in reports for s in r.spans)
    assert reports[2].paused_for == "evaluate"

