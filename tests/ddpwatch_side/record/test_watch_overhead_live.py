"""The run measures what watching costs it: PyTorch's DDP loop on two ranks, attached, whose
watched steps are made to cost 5 ms more on steps of 100 ms (``workers/costly_watching.py``),
recorded by ``ddpwatch record``: summary.json's ``watch_overhead`` reads about 5 %, from the steps
the ranks left unwatched (``DDPWATCH_UNWATCHED``, as a job template sets it)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import REPO_ROOT, Recorder, describe_failure, run_ranks

WORKER = REPO_ROOT / "tests" / "support" / "workers" / "costly_watching.py"
LOOP = REPO_ROOT / "examples" / "plain_ddp.py"
STEPS, EVERY, LENGTH = 60, 10, 4  # blocks at steps 5-8, 15-18, ..., 55-58: 24 unwatched steps


def test_an_injected_5_ms_a_watched_step_reads_about_5_percent(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDPWATCH_UNWATCHED", f"{EVERY}:{LENGTH}")  # the ranks' environment is this process's
    with Recorder(tmp_path / "out", "--idle-exit", "20") as recorder:
        ranks = run_ranks(WORKER, ["95", "5", str(LOOP), "--steps", str(STEPS), "--batch-size", "8", "--width", "32",
                                   "--layers", "2", "--watch", recorder.address])
        assert all(rank.returncode == 0 for rank in ranks), describe_failure(ranks)
        log = recorder.wait()
    assert "every rank said goodbye" in log, log
    assert "steps 1-60: ddpwatch costs this run" in log and "from 24 unwatched steps" in log, log
    [segment] = json.loads((tmp_path / "out" / "summary.json").read_text())["segments"]
    cost = segment["watch_overhead"]
    assert cost["unwatched_steps"] == 24
    # 5 ms over 95 ms asleep plus the small loop's own ~2 ms: 5.2 %; attach's own cost on this
    # loop adds 0.3-0.6 (five runs read 4.9-5.8)
    assert 4.0 <= cost["pct"] <= 7.0, cost
    low, high = cost["interval_pct"]
    # the interval holds the median, tells the cost from none, and is narrow enough to say something
    assert 0.0 < low <= cost["pct"] <= high and high - low < 5.0, cost
    md = (tmp_path / "out" / "summary.md").read_text()
    assert "ddpwatch costs this run" in md and "from 24 unwatched steps" in md
