"""The rows ``--tensorboard`` and ``--wandb`` write (``export.step_scalars``), on the fixed
two-rank session (steps 1-5 simple, 6-10 bucket; rank 1 starts its first all-reduce of each
step 30 ms early, so it waits 30 ms for rank 0), and what each writer leaves in its own files:
TensorBoard's event files read by tensorboard's ``EventAccumulator``, W&B's offline run file
read record by record (``wandb_offline``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import wandb
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import wandb_offline
from ddpwatch.export.exporters import summary
from ddpwatch.export.step_scalars import SEGMENT_TAGS, STEP_TAGS, WATCH_OVERHEAD_TAG, ScalarRows
from ddpwatch.export.tensorboard_scalars import TensorBoardScalars
from ddpwatch.export.wandb_scalars import WandbScalars
from ddpwatch.ingest.receiver import ingest
from ddpwatch.ingest.session import Session
from launch import REPO_ROOT
from synthetic_session import session_messages, waiting_ranks


def recorded(steps: int = 10) -> Session:
    session = Session()
    ingest(session, session_messages(steps=steps, edit=waiting_ranks(30.0)))
    return session


def expected_segment(session: Session, index: int) -> dict[str, float]:
    segment = summary(session)["segments"][index]
    return {tag: float(segment[name]) for tag, name in SEGMENT_TAGS.items()} | {"segment/index": float(index)}


def test_each_step_once_in_order_and_each_segment_once_it_is_over() -> None:
    session, rows = recorded(), ScalarRows()
    live = rows.new_rows(session)
    assert [step for step, _ in live] == list(range(1, 11))
    figures = session.step_figures(7)
    assert live[6][1]["step/time_ms"] == max(f.step_ms for f in figures.values())
    assert live[6][1]["step/overlap_pct"] == pytest.approx(sum(f.overlap_pct for f in figures.values()) / 2)
    assert all(row["step/waited_ms_max"] == pytest.approx(30.0, abs=1e-6) for _, row in live)
    assert set(live[0][1]) == set(STEP_TAGS)  # every step tag: the simple steps' all-reduces are measurable
    # the simple segment (steps 1-5) is over once bucket began: its figures ride on its last step
    assert {tag: value for tag, value in live[4][1].items() if tag.startswith("segment/")} == pytest.approx(
        expected_segment(session, 0))
    assert not any(tag.startswith("segment/") for _, row in live[5:] for tag in row)  # bucket still runs
    assert rows.new_rows(session) == []  # nothing new
    (final,) = rows.new_rows(session, final=True)  # the run is over: the last segment, at the last step written
    assert final[0] == 10 and final[1] == pytest.approx(expected_segment(session, 1))


def test_tensorboards_reader_gives_back_each_step_and_the_segments_figures(tmp_path: Path) -> None:
    session = recorded()
    writer = TensorBoardScalars(tmp_path)
    writer.look(session, now=0.0)
    writer.finish(session, now=1.0)
    writer.close()
    (run,) = list(tmp_path.iterdir())
    assert run.name == "fixed-session"
    events = EventAccumulator(str(run))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(STEP_TAGS) | set(SEGMENT_TAGS) | {"segment/index"}
    times = events.Scalars("step/time_ms")
    assert [e.step for e in times] == list(range(1, 11))
    assert [e.value for e in times] == pytest.approx([max(f.step_ms for f in session.step_figures(s).values())
                                                      for s in range(1, 11)], rel=1e-6)  # float32 on disk
    means = events.Scalars("segment/step_ms_mean")
    assert [(e.step, e.value) for e in means] == [(5, pytest.approx(expected_segment(session, 0)["segment/step_ms_mean"], rel=1e-6)),
                                                  (10, pytest.approx(expected_segment(session, 1)["segment/step_ms_mean"], rel=1e-6))]


def test_a_wandb_offline_run_file_holds_each_step_the_segments_figures_and_the_runs_name(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME"):
        monkeypatch.delenv(name, raising=False)
    session = recorded()
    writer = WandbScalars(project="ddpwatch-tests", run_name=None, directory=tmp_path)
    try:
        writer.look(session, now=0.0)
        writer.finish(session, now=1.0)
    finally:
        writer.close()
        wandb.teardown()  # wandb's service process ends with the test, not with the suite
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    assert wandb_offline.run_names(run_file) == ("ddpwatch-tests", "fixed-session")
    assert wandb_offline.run_config(run_file)["world_size"] == 2
    logged = wandb_offline.history(run_file)
    assert [step for step, _ in logged] == list(range(1, 11))
    assert logged[6][1]["step/time_ms"] == max(f.step_ms for f in session.step_figures(7).values())
    assert {tag: value for tag, value in logged[4][1].items() if tag.startswith("segment/")} == pytest.approx(
        expected_segment(session, 0))
    assert logged[9][1]["segment/step_ms_mean"] == pytest.approx(expected_segment(session, 1)["segment/step_ms_mean"])
    assert wandb_offline.summary(run_file)["segment/step_ms_p50"] == pytest.approx(expected_segment(session, 1)["segment/step_ms_p50"])


def test_the_docs_tables_name_every_tag_written_and_no_other() -> None:
    page = (REPO_ROOT / "docs" / "guide" / "tensorboard-wandb.md").read_text()
    documented = {tag for cell in re.findall(r"^\| (`[^|]+`) \|", page, re.MULTILINE)
                  for tag in re.findall(r"`((?:step|segment)/\w+)`", cell)}
    assert documented == set(STEP_TAGS) | set(SEGMENT_TAGS) | {"segment/index", WATCH_OVERHEAD_TAG}
