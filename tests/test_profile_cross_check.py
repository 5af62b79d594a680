"""ddpwatch's all-reduce timings held against PyTorch's own profiler on the same run."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from ddpwatch.recorder import load_session
from launch import REPO_ROOT, Recorder, run_torchrun

PROFILED_STEPS = range(4, 9)  # train.py's profiler schedule: wait 2, warmup 1, active 5


@pytest.mark.parametrize("strategy", ["simple", "async"])
def test_recorded_all_reduces_match_the_profilers_gloo_events(tmp_path: Path, strategy: str) -> None:
    """For ``async`` the recorded start is when a gloo worker was free (not the issue time), so
    the durations measure transfers, as the profiler's events on gloo's threads do."""
    with Recorder(tmp_path / "session", "--idle-exit", "20") as recorder:
        result = run_torchrun([str(REPO_ROOT / "train.py"), "--strategy", strategy, "--steps", "9", "--batch-size", "8",
                               "--log-every", "9", "--profile", str(tmp_path / "profile"), "--watch", recorder.address])
        assert result.returncode == 0, result.stderr[-3000:]
        recorder.wait()
    session = load_session(tmp_path / "session" / "session.ddpwatch")
    for rank in (0, 1):
        (trace_file,) = (tmp_path / "profile").glob(f"rank{rank}.*.json")
        events = json.loads(trace_file.read_text())["traceEvents"]
        profiled = sorted((e for e in events if e.get("name") == "gloo:all_reduce"), key=lambda e: e["ts"])
        recorded = sorted((s for step in PROFILED_STEPS for s in session.reports[step][rank].spans if s.kind == "all_reduce"),
                          key=lambda s: s.start)
        assert len(recorded) == len(profiled) == 57 * len(PROFILED_STEPS)
        differences = [abs(span.duration * 1e6 - event["dur"]) for span, event in zip(recorded, profiled)]
        typical = statistics.median(event["dur"] for event in profiled)
        # ddpwatch's interval also holds the Python call around the collective: a few tens of µs.
        assert statistics.median(differences) < max(0.5 * typical, 100.0), (statistics.median(differences), typical)
        recorded_total = sum(span.duration for span in recorded) * 1e6
        profiled_total = sum(event["dur"] for event in profiled)
        assert abs(recorded_total - profiled_total) < 0.25 * profiled_total, (recorded_total, profiled_total)
