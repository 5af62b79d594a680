"""bench/doctor_pairs.py reads a kept doctor run: the spread of span-vs-kernel differences, and
for two ranks on one GPU how much of a step window each rank's kernels covered."""

import importlib.util
import json
import time
from pathlib import Path

import msgspec
import pytest
from launch import REPO_ROOT
from profiled_run import standard_reports, standard_trace

from ddpwatch.ingest.session_file import SessionWriter
from instrumented_ddp.wire.codec import encode


def load_bench():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("doctor_pairs", REPO_ROOT / "bench" / "doctor_pairs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def keep_run(root: Path, ranks: int) -> Path:
    run = root / f"bucket-{ranks}-timing-on"
    (run / "session").mkdir(parents=True)
    (run / "profile").mkdir()
    writer = SessionWriter(run / "session" / "session.ddpwatch")
    for rank in range(ranks):
        for report in standard_reports():
            writer.append(encode(msgspec.structs.replace(report, rank=rank)), time.time())
        (run / "profile" / f"rank{rank}.1.pt.trace.json").write_text(json.dumps(standard_trace()))
    writer.close()
    return run


def test_two_ranks_kept_print_spreads_and_window_cover(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    keep_run(tmp_path, 2)
    assert load_bench().main([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "bucket-2-timing-on rank 1: 10 collectives" in out  # 2 all-reduces in each of 5 profiled steps
    # every span equals its kernel: zero error, zero start and end difference, at every quantile
    spreads = [line for line in out.splitlines() if line.startswith("  duration") or line.startswith("  kernel")]
    assert len(spreads) == 6
    assert all(abs(float(value)) < 0.05 for line in spreads for value in line.split()[-7:])
    # both traces are the same: C = [0, 6] of each 10 ms window, so own = theirs = either = 60 %
    assert "rank 0's step windows: its compute kernels 60.0 %, rank 1's 60.0 %, either 60.0 %" in out


def test_a_directory_without_kept_runs_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_bench().main([str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
