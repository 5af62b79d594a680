"""Timing through torchrun and ``ddpwatch record``: exact collective counts, true overlap, exports."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest

from ddpwatch.recorder import load_session
from ddpwatch.session import Session
from launch import REPO_ROOT, Recorder, run_torchrun

TRAIN = str(REPO_ROOT / "train.py")
PARAMETER_TENSORS = 57  # the tiny SmolLM2: embeddings, 6 layers x 9, final norm, score


def record_training(tmp_path: Path, *train_args: str, steps: int = 4) -> tuple[Session, dict]:
    with Recorder(tmp_path / "session", "--idle-exit", "20") as recorder:
        result = run_torchrun([TRAIN, "--steps", str(steps), "--batch-size", "8", "--log-every", "2",
                               "--watch", recorder.address, *train_args])
        assert result.returncode == 0, result.stderr[-3000:]
        log = recorder.wait()
    assert "every rank said goodbye" in log, log
    summary = json.loads((tmp_path / "session" / "summary.json").read_text())
    return load_session(tmp_path / "session" / "session.ddpwatch"), summary


def all_reduce_calls(session: Session) -> dict[int, Counter]:
    """step -> Counter(rank -> all_reduce spans)."""
    return {
        step: Counter({rank: sum(s.kind == "all_reduce" for s in report.spans) for rank, report in ranks.items()})
        for step, ranks in session.reports.items()
    }


@pytest.mark.parametrize(("strategy", "grad_accum", "per_step"), [
    ("simple", 1, PARAMETER_TENSORS), ("hook", 1, PARAMETER_TENSORS), ("async", 1, PARAMETER_TENSORS),
    ("ga", 2, PARAMETER_TENSORS),  # one synchronising micro-step in two
    ("simple", 2, 2 * PARAMETER_TENSORS),  # the baseline reduces after every micro-step
])
def test_all_reduce_count_per_step_is_exact_on_both_ranks(tmp_path: Path, strategy: str, grad_accum: int, per_step: int) -> None:
    session, summary = record_training(tmp_path, "--strategy", strategy, "--grad-accum", str(grad_accum))
    counts = all_reduce_calls(session)
    assert sorted(counts) == [1, 2, 3, 4]
    for step, per_rank in counts.items():
        assert per_rank == Counter({0: per_step, 1: per_step}), f"step {step}"
    (segment,) = summary["segments"]
    # Step 1 also carries wrap()'s state broadcast, so it is left out of the figures.
    assert segment["excluded_steps"] == [1]
    assert segment["all_reduce_calls"] == per_step  # per rank per step
    assert segment["all_reduce_calls_total"] == 2 * 3 * per_step
    assert segment["desyncs"] == []


def test_bucket_reduces_once_per_bucket_and_overlaps_backward(tmp_path: Path) -> None:
    session, summary = record_training(tmp_path, "--strategy", "bucket", "--bucket-mb", "1")
    buckets = len(session.ranks[0].hello.bucket_layout)
    assert buckets > 1
    assert all(c == Counter({0: buckets, 1: buckets}) for c in all_reduce_calls(session).values())
    assert summary["segments"][0]["overlap_pct"] > 5
    assert_async_collectives_complete_during_backward(session)


def test_async_and_ddp_overlap_while_simple_does_not(tmp_path: Path) -> None:
    overlaps = {}
    for strategy, extra in (("simple", []), ("async", []), ("ddp", ["--bucket-mb", "1"])):
        session, summary = record_training(tmp_path / strategy, "--strategy", strategy, *extra)
        overlaps[strategy] = summary["segments"][0]["overlap_pct"]
        if strategy != "simple":
            assert_async_collectives_complete_during_backward(session)
    assert overlaps["simple"] == 0.0
    assert overlaps["async"] > 0 and overlaps["ddp"] > 0, overlaps


def test_native_ddp_first_iteration_is_excluded_and_buckets_counted(tmp_path: Path) -> None:
    session, summary = record_training(tmp_path, "--strategy", "ddp", "--bucket-mb", "1")
    assert all(report.excluded == (step == 1) for step, ranks in session.reports.items() for report in ranks.values())
    counts = all_reduce_calls(session)
    assert counts[1] == Counter({0: 1, 1: 1})  # one bucket holding every gradient, before the rebuild
    later = {c[0] for step, c in counts.items() if step > 1}
    assert len(later) == 1 and later.pop() > 1
    assert summary["segments"][0]["excluded_steps"] == [1]
    # DDP waits for its last buckets inside backward: that time is a blocking wait, not compute
    for step, ranks in session.reports.items():
        for report in ranks.values():
            backward = next(s for s in report.spans if s.kind == "backward")
            waits = [s for s in report.spans if s.kind == "wait" and s.blocking]
            assert waits and all(backward.start <= w.start <= w.end <= backward.end + 0.01 for w in waits), step


def assert_async_collectives_complete_during_backward(session: Session) -> None:
    """Some all-reduce was issued inside backward and completed later, still inside backward."""
    for ranks in session.reports.values():
        for report in ranks.values():
            backward = [s for s in report.spans if s.kind == "backward"]
            for span in report.spans:
                if span.kind == "all_reduce" and not span.blocking and span.end > span.start:
                    if any(b.start <= span.start and span.end < b.end for b in backward):
                        return
    raise AssertionError("no asynchronous all-reduce completed while backward went on")


def test_exports_are_valid_and_summary_prints_the_table(tmp_path: Path) -> None:
    import subprocess
    import sys

    session, summary = record_training(tmp_path, "--strategy", "async")
    trace = json.loads((tmp_path / "session" / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M" and e["name"] == "process_name"}
    assert len(names) == 2 and all(name.startswith("rank ") for name in names)
    for key in ("strategy", "world_size", "first_step", "last_step", "compute_pct", "non_compute_pct", "idle_pct",
                "overlap_pct", "comm_overhead_pct", "all_reduce_calls", "all_reduce_ms", "step_ms_p50", "step_ms_p95",
                "samples_per_s", "per_rank"):
        assert key in summary["segments"][0], key
    segment = summary["segments"][0]
    assert segment["compute_pct"] + segment["non_compute_pct"] + segment["idle_pct"] == pytest.approx(100)
    printed = subprocess.run([sys.executable, "-m", "ddpwatch.cli", "summary", str(tmp_path / "session")],
                             capture_output=True, text=True, cwd=REPO_ROOT, check=True).stdout
    assert "| Compute% | Non_Compute% | Idle% | Overlap% | Comm_overhead% |" in printed
    assert "| async" in printed
