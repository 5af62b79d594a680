"""A session file an earlier ddpwatch recorded reads message for message, and its summary,
comparison and replay find what its recorder found.

``tests/support/fixtures/recorded-session/`` holds ``session.ddpwatch`` as ``ddpwatch record
--sample 2`` wrote it for 8 steps of ``train.py`` on 2 CPU ranks (full reports and summaries,
heartbeats, device samples, evaluations, goodbyes), and ``recorded-summary.json``, the
summary.json that recorder exported when the run ended.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from ddpwatch.dashboard.app import DashboardApp
from ddpwatch.dashboard.feeds import ReplayFeed
from ddpwatch.ingest.session_file import SESSION_FILE_NAME, read_session_records
from instrumented_ddp.wire.codec import decode, encode
from dashboard_pilot import draw_the_whole_replay
from launch import REPO_ROOT

FIXTURE = REPO_ROOT / "tests" / "support" / "fixtures" / "recorded-session"
RECORDED_TYPES = {"hello": 12, "step": 8, "summary": 16, "heartbeat": 18, "device": 91, "evaluation": 2, "goodbye": 2}


def ddpwatch(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddpwatch.cli", *args], capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=120)


@pytest.fixture
def exported(tmp_path: Path) -> Path:
    """A folder holding the recorder's own summary.json, which ``summary`` and ``compare`` read
    in place of a session file."""
    shutil.copy(FIXTURE / "recorded-summary.json", tmp_path / "summary.json")
    return tmp_path


def test_every_recorded_message_decodes_and_encodes_back_to_the_bytes_it_arrived_as() -> None:
    records = list(read_session_records(FIXTURE / SESSION_FILE_NAME))
    envelopes = [decode(record.data) for record in records]
    assert Counter(envelope.message.TYPE for envelope in envelopes) == RECORDED_TYPES
    for record, envelope in zip(records, envelopes, strict=True):
        assert encode(envelope.message, envelope.seq, envelope.dropped) == record.data


def test_the_summary_of_the_recorded_session_file_is_the_one_its_recorder_wrote(exported: Path) -> None:
    from_file, from_export = ddpwatch("summary", str(FIXTURE)), ddpwatch("summary", str(exported))
    assert from_file.returncode == 0 and from_export.returncode == 0, from_file.stderr + from_export.stderr
    assert "| async (grad_accum=1) | 1-8 | " in from_file.stdout
    assert from_file.stdout == from_export.stdout


def test_compare_reads_the_recorded_session_file_as_the_run_its_recorder_summarized(exported: Path) -> None:
    result = ddpwatch("compare", str(FIXTURE), str(exported))
    assert result.returncode == 0, result.stderr
    rows = [line.split(" | ")[1:] for line in result.stdout.splitlines() if line.startswith("| ") and "async" in line]
    assert len(rows) == 2 and rows[0] == rows[1]  # every figure alike, "× step" 1.00 among them


async def test_a_replay_of_the_recorded_session_shows_every_step_of_both_ranks_to_their_goodbye() -> None:
    app = DashboardApp(ReplayFeed(FIXTURE / SESSION_FILE_NAME, speed=0), export_on_exit=False)
    async with app.run_test(size=(200, 50)) as pilot:
        await draw_the_whole_replay(app, pilot, within_s=60)
        session = app.session
        assert sorted(session.reports) == list(range(1, 9)) and all(len(by_rank) == 2 for by_rank in session.reports.values())
        assert [row.status for row in app.snapshot.ranks] == ["finished", "finished"]
        assert session.rejected == {}
