"""bench/attach_check.py: an attached example's recorded reports held against its profiler traces,
rank by rank, as the doctor holds train.py's; each missed duration named with where its kernel
began and ended against the span."""

import importlib.util
import json
import time
from pathlib import Path

import msgspec
import pytest
from launch import REPO_ROOT
from profiled_run import standard_reports, standard_spans, standard_trace

from ddpwatch.ingest.session_file import SessionWriter
from instrumented_ddp.wire.codec import encode


def load_bench():  # noqa: ANN201
    spec = importlib.util.spec_from_file_location("attach_check", REPO_ROOT / "bench" / "attach_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def record_run(root: Path, ranks: int, early_start_ms: float = 0.0) -> list[str]:
    """A recording and its watched and unwatched traces; with ``early_start_ms`` rank 1's first
    all-reduce of step 5 starts that much before its kernel (as a rank whose GPU ran another's
    context first), ending with it."""
    (root / "session").mkdir(parents=True)
    writer = SessionWriter(root / "session" / "session.ddpwatch")
    for rank in range(ranks):
        for report in standard_reports():
            if rank == 1 and report.step == 5 and early_start_ms:
                first, *rest = [s for s in standard_spans(5) if s.kind == "all_reduce"]
                spans = [s for s in standard_spans(5) if s.kind != "all_reduce"]
                report = msgspec.structs.replace(report, spans=[*spans, first._replace(start=first.start - early_start_ms / 1e3), *rest])
            writer.append(encode(msgspec.structs.replace(report, rank=rank)), time.time())
        for folder in ("profile", "unwatched"):
            (root / folder).mkdir(exist_ok=True)
            (root / folder / f"rank{rank}.1.pt.trace.json").write_text(json.dumps(standard_trace()))
    writer.close()
    return [str(root / "session"), str(root / "profile"), "--unwatched", str(root / "unwatched"), "--label", "fsdp2"]


def test_a_faithful_attached_run_passes_every_rank(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_bench().main(record_run(tmp_path, 2)) == 0
    out = capsys.readouterr().out
    assert "verdict: PASS - all 12 checks held" in out  # 6 a rank: steps, counts, durations, Compute%, Overlap%, syncs added
    assert [line.split()[:5] for line in out.splitlines() if "collectives per step" in line] == [
        ["fsdp2,", "rank", str(rank), "collectives", "per"] for rank in (0, 1)]


def test_a_span_that_began_before_its_kernel_fails_and_says_where_the_kernel_began(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert load_bench().main([*record_run(tmp_path, 2, early_start_ms=2.0), "--sharing", "--steps"]) == 1
    out = capsys.readouterr().out
    # 5 ms against the 3 ms kernel: +66.7 %, over 20 % and 50 µs; the kernel began 2 ms into it and ended with it
    assert "  step 5 all_reduce #1: span 5.000 ms, kernel 3.000 ms, kernel start +2000.0 µs and end +0.0 µs from the span's" in out
    assert "verdict: FAIL - 1 of 8 checks missed: fsdp2, rank 1: collective duration" in out  # --sharing: 4 a rank
    assert "fsdp2, rank 0: Compute% 60.0 vs 60.0 from kernels" in out  # noted, not checked


def test_a_directory_without_a_recording_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "session").mkdir()
    assert load_bench().main([str(tmp_path / "session"), str(tmp_path)]) == 2
    assert capsys.readouterr().err.count("\n") == 1
