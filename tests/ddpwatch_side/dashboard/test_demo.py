"""``ddpwatch demo`` telling the user when the training run it started fails on its own."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ddpwatch.dashboard.app import DashboardApp
from ddpwatch.dashboard.feeds import StaticFeed
from ddpwatch.demo import TrainingRun, batch_size_for, report_if_training_fails, stop_training
from synthetic_session import session_messages


def started(code: str) -> subprocess.Popen[bytes]:
    """A stand-in for torchrun, in its own session as the demo starts it (``stop_training``
    signals its process group)."""
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_a_training_run_that_fails_on_its_own_is_reported_with_its_exit_code_and_log(tmp_path: Path) -> None:
    run = TrainingRun(started("raise SystemExit(3)"), tmp_path / "train.log")
    lines: list[str] = []
    report_if_training_fails(run, lines.append).join(30)
    assert lines == [f"the demo's training run exited with code 3: its output is in {tmp_path / 'train.log'}"]


def test_the_report_gives_the_ranks_reason_not_torchruns_summary(tmp_path: Path) -> None:
    """train.py's refusal comes before torchrun's own ending, which says only that a rank failed."""
    log = tmp_path / "train.log"
    log.write_text("usage: train.py [-h]\ntrain.py: error: --batch-size 16 does not divide by world size 3\n"
                   "Traceback (most recent call last):\n    raise ChildFailedError(\n"
                   "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n  error_file: <N/A>\n")
    lines: list[str] = []
    report_if_training_fails(TrainingRun(started("raise SystemExit(1)"), log), lines.append).join(30)
    assert lines == [f"the demo's training run exited with code 1 (train.py: error: --batch-size 16 does not divide by world "
                     f"size 3): its output is in {log}"]


def test_the_demo_gives_train_py_a_global_batch_its_ranks_split_evenly() -> None:
    """train.py's 16, or the multiple of twice the ranks nearest it (ga splits each rank's share in
    two): --nproc 3 ran with 16 and failed at once; 15 would have failed under ga."""
    assert [batch_size_for(n) for n in (1, 2, 3, 6, 7, 32)] == [16, 16, 18, 12, 14, 64]


def test_a_training_run_that_ends_well_or_that_the_demo_stops_is_not_reported(tmp_path: Path) -> None:
    finished, stopped = (TrainingRun(started(code), tmp_path / "train.log") for code in ("pass", "import time; time.sleep(60)"))
    lines: list[str] = []
    waiting = [report_if_training_fails(run, lines.append) for run in (finished, stopped)]
    stop_training(stopped)  # SIGTERM: a non-zero exit, but the demo's own doing
    for thread in waiting:
        thread.join(30)
    assert stopped.process.returncode != 0 and finished.process.returncode == 0
    assert lines == []


async def test_a_held_warning_is_shown_first_and_stays() -> None:
    app = DashboardApp(StaticFeed(session_messages(steps=4)), export_on_exit=False)
    async with app.run_test(size=(160, 50)) as pilot:
        app.hold_warning("the demo's training run exited with code 2: its output is in x/train.log")
        await pilot.pause(0.3)
        shown = str(app.warnings_panel.render()).splitlines()
        assert shown[0].endswith("the demo's training run exited with code 2: its output is in x/train.log")
        assert app.warnings_panel.has_class("has-warnings")
