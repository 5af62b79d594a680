"""Switching strategies while torchrun trains, and a dashboard that comes and goes mid-run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ddpwatch.dashboard.process_feed import ProcessFeed
from ddpwatch.switch_client import request_switch
from instrumented_ddp.protocol import Envelope, Hello, StepReport
from launch import REPO_ROOT, Recorder, free_port, start_torchrun, stop

TRAIN = str(REPO_ROOT / "train.py")
COMMON = ["--steps", "70", "--batch-size", "8", "--grad-accum", "1", "--log-every", "10", "--seed", "3"]


def wait_for_line(log: Path, text: str, process: subprocess.Popen[bytes], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in (log.read_text() if log.exists() else ""):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.1)


@pytest.mark.timeout(400)
def test_switching_live_through_all_six_keeps_replicas_equal_to_one_process(tmp_path: Path) -> None:
    with Recorder(tmp_path / "session", "--idle-exit", "30") as recorder:
        training = start_torchrun(["--strategy", "simple", *COMMON, "--watch", recorder.address,
                                   "--save-final", str(tmp_path / "switched.pt")], tmp_path / "train.log")
        try:
            wait_for_line(tmp_path / "train.log", "step 10/70", training)  # a simple segment first
            acks = {}
            for strategy, bucket_mb in (("ga", None), ("hook", None), ("async", None), ("bucket", 1.0), ("ddp", 1.0), ("simple", None)):
                acks[strategy] = request_switch(recorder.address, strategy, bucket_mb, None, timeout_s=120)
                assert acks[strategy].applied, acks[strategy]
                time.sleep(0.6)
            assert training.wait(300) == 0, (tmp_path / "train.log").read_text()[-3000:]
        finally:
            stop(training)
        recorder.wait()
    log = (tmp_path / "train.log").read_text()
    assert "parameters identical on all 2 rank(s)" in log
    segments = json.loads((tmp_path / "session" / "summary.json").read_text())["segments"]
    assert [s["strategy"] for s in segments] == ["simple", "ga", "hook", "async", "bucket", "ddp", "simple"]
    assert [s["first_step"] for s in segments[1:]] == [acks[s].step for s in ("ga", "hook", "async", "bucket", "ddp", "simple")]

    reference = tmp_path / "one_process.pt"
    subprocess.run([sys.executable, TRAIN, "--strategy", "simple", *COMMON, "--no-watch", "--save-final", str(reference)],
                   cwd=REPO_ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), check=True, capture_output=True, timeout=300)
    switched, expected = torch.load(tmp_path / "switched.pt"), torch.load(reference)
    for name, tensor in expected.items():
        # fp32 sums in another order, through 70 AdamW steps: measured up to 3e-5 on weights of ~0.09
        torch.testing.assert_close(switched[name], tensor, rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.timeout(300)
def test_dashboard_started_late_and_restarted_picks_the_run_up(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    training = start_torchrun(["--strategy", "async", "--steps", "200", "--batch-size", "8", "--log-every", "50",
                               "--watch", address], tmp_path / "train.log")
    try:
        for attempt in ("late", "restarted"):
            time.sleep(8 if attempt == "late" else 1)  # training has started before any dashboard
            feed = ProcessFeed(address, tmp_path / attempt / "session.ddpwatch")  # the live feed `ddpwatch` runs
            feed.start()
            got: list[Envelope] = []
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and not (
                {e.message.rank for e in got if isinstance(e.message, Hello)} == {0, 1}
                and sum(isinstance(e.message, StepReport) for e in got) >= 4
            ):
                got += [arrival.item for arrival in feed.drain() if isinstance(arrival.item, Envelope)]
                time.sleep(0.1)
            feed.stop()  # the dashboard goes away while training continues
            assert {e.message.rank for e in got if isinstance(e.message, Hello)} == {0, 1}, attempt
            assert sum(isinstance(e.message, StepReport) for e in got) >= 4, attempt
        assert training.wait(300) == 0, (tmp_path / "train.log").read_text()[-3000:]
    finally:
        stop(training)


@pytest.mark.timeout(300)
def test_switches_racing_the_end_of_training_apply_on_every_rank_or_none(tmp_path: Path) -> None:
    """Commands keep coming until the run is over: each lands on the same step on every rank, or
    on none (the run ended first and nobody acknowledges it); the run still finishes cleanly."""
    from ddpwatch.recorder import load_session

    with Recorder(tmp_path / "session", "--idle-exit", "30") as recorder:
        training = start_torchrun(["--strategy", "simple", "--steps", "40", "--batch-size", "8", "--log-every", "10",
                                   "--watch", recorder.address], tmp_path / "train.log")
        applied = []
        try:
            wait_for_line(tmp_path / "train.log", "step 10/40", training)
            cycle = ["async", "bucket", "hook", "ddp", "ga", "simple"]
            index = 0
            while training.poll() is None:
                try:
                    ack = request_switch(recorder.address, cycle[index % len(cycle)], 1.0, 1, timeout_s=3)
                    applied.append(ack.step)
                except TimeoutError:
                    pass  # the run ended before rank 0 could take it: applied nowhere
                index += 1
            assert training.wait(60) == 0, (tmp_path / "train.log").read_text()[-3000:]
        finally:
            stop(training)
        recorder.wait()
    assert "parameters identical on all 2 rank(s)" in (tmp_path / "train.log").read_text()
    session = load_session(tmp_path / "session" / "session.ddpwatch")
    for step, ranks in session.reports.items():
        assert len({(r.strategy, tuple(sorted(r.settings.items()))) for r in ranks.values()}) == 1, step
    assert applied and all(step in session.reports for step in applied)
