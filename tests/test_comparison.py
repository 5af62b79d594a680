"""``ddpwatch compare``: recorded runs side by side, each segment against the first, worked by hand."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ddpwatch import cli
from ddpwatch.comparison import comparison_lines, compared_segments, run_differences


def segment(label: str, steps: int, p50: float, interval: tuple[float, float] | None, samples_per_s: float,
            non_compute: float = 20.0, overlap: float = 50.0) -> dict[str, Any]:
    return {"label": label, "strategy": label.split()[0], "steps": steps, "step_ms_p50": p50,
            "step_ms_p50_interval": list(interval) if interval else None, "samples_per_s": samples_per_s,
            "compute_pct": 70.0, "non_compute_pct": non_compute, "idle_pct": 10.0, "data_wait_pct": 2.5, "overlap_pct": overlap,
            "all_reduce_calls": 9.0}


def run(*segments: dict[str, Any], world: int = 2, device: str = "cpu", parameters: int = 2_109_445, batch: int = 64) -> dict[str, Any]:
    return {"session": "s", "world_size": world, "model_parameters": parameters, "global_batch": batch,
            "ranks": [{"rank": r, "device": device if device == "cpu" else f"{device}:{r}", "backend": "gloo"} for r in range(world)],
            "segments": list(segments)}


BASE = run(segment("ddp 25 MB", 59, 100.0, (95.0, 105.0), 640.0, non_compute=40.0, overlap=0.0))
SMALL_CAPS = run(segment("ddp 1 MB", 59, 80.0, (78.0, 83.0), 800.0, non_compute=30.0, overlap=51.0),  # apart: 83 < 95
                 segment("ddp 0.5 MB", 59, 102.0, (98.0, 110.0), 627.5),  # overlaps 95-105
                 segment("ddp 0.1 MB", 0, 0.0, (0.0, 0.0), 0.0))  # no counted step: no figures


def test_each_segment_is_a_ratio_of_the_first_with_a_verdict_from_the_intervals() -> None:
    """80/100 = 0.80 and 800/640 = 1.25, intervals 78-83 and 95-105 apart; 102/100 = 1.02 and
    627.5/640 = 0.98 (0.98046…), 98-110 overlapping 95-105: not told apart."""
    lines = comparison_lines([("a", BASE), ("b", SMALL_CAPS)])
    assert lines[:6] == [
        "# ddpwatch compare: 2 runs, each segment against the first", "",
        "| run | segment | steps | step ms p50 | 90 % interval | × step | samples/s | × samples/s | Compute% | Non_Compute% | Idle% "
        "| Data wait% | Overlap% | all_reduce calls / rank / step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        "| a | ddp 25 MB | 59 | 100.0 | 95.0-105.0 | 1.00 | 640.0 | 1.00 | 70.00 | 40.00 | 10.00 | 2.50 | 0.00 | 9 |",
        "| b | ddp 1 MB | 59 | 80.0 | 78.0-83.0 | 0.80 | 800.0 | 1.25 | 70.00 | 30.00 | 10.00 | 2.50 | 51.00 | 9 |",
    ]
    assert lines[6].startswith("| b | ddp 0.5 MB | 59 | 102.0 | 98.0-110.0 | 1.02 | 627.5 | 0.98 |")
    assert lines[7:] == [
        "", "Against a, ddp 25 MB:",
        "- b, ddp 1 MB: step p50 100.0 → 80.0 ms (×0.80), 90 % intervals apart: a measured difference; samples/s 640.0 → "
        "800.0 (×1.25); exposed communication (Non_Compute%) 40.0 → 30.0 %, Overlap% 0.0 → 51.0",
        "- b, ddp 0.5 MB: step p50 100.0 → 102.0 ms (×1.02), 90 % intervals overlap: not told apart by these steps (more "
        "steps narrow them); samples/s 640.0 → 627.5 (×0.98); exposed communication (Non_Compute%) 40.0 → 20.0 %, Overlap% 0.0 → 50.0",
    ]  # the 0.1 MB segment, every step excluded, is no row


def test_what_else_differs_between_the_runs_is_said() -> None:
    """Ranks, device kinds, the model's size and the global batch: then the figures compare the
    runs, not the change; a figure a summary does not hold (written before it was kept) is not judged."""
    bigger = run(segment("ddp 25 MB", 59, 60.0, (58.0, 61.0), 2133.3), world=4, device="cuda", parameters=6_000_000, batch=128)
    assert run_differences([("a", BASE), ("b", bigger)]) == [
        "ranks 2, 4", "devices cpu, cuda", "model parameters 2.11 M, 6 M", "global batch 64, 128"]
    assert run_differences([("a", BASE), ("b", SMALL_CAPS)]) == []
    older = {**bigger, "model_parameters": None, "global_batch": None}
    assert run_differences([("a", BASE), ("b", older)]) == ["ranks 2, 4", "devices cpu, cuda"]
    assert comparison_lines([("a", BASE), ("b", bigger)])[-1].startswith(
        "The runs differ in more than their strategies and settings (ranks 2, 4; devices cpu, cuda; model parameters 2.11 M, 6 M; "
        "global batch 64, 128): the figures compare the runs, not one change alone.")


def test_a_run_with_nothing_measured_is_named_and_a_summary_without_intervals_is_not_judged() -> None:
    empty = run(segment("ddp 25 MB", 0, 0.0, (0.0, 0.0), 0.0))
    untimed = run(segment("ddp 1 MB", 10, 90.0, None, 700.0))
    lines = comparison_lines([("a", BASE), ("b", empty), ("c", untimed)])
    assert "- b: no segment with counted steps (every step excluded or none reported): not compared" in lines
    assert any(line.startswith("- c, ddp 1 MB: step p50 100.0 → 90.0 ms (×0.90), no interval to judge by") for line in lines)
    assert comparison_lines([("a", empty), ("b", empty)])[-1] == "No run has a segment with counted steps: nothing to compare."
    older = run({**segment("ddp 25 MB", 10, 90.0, (85.0, 95.0), 700.0)})
    del older["segments"][0]["data_wait_pct"]  # a summary written before it was kept
    assert "| 10.00 | — | 50.00 |" in comparison_lines([("a", BASE), ("old", older)])[5]
    assert [s.label for s in compared_segments([("a", BASE), ("b", SMALL_CAPS)])] == ["ddp 25 MB", "ddp 1 MB", "ddp 0.5 MB"]


def test_compare_reads_each_sessions_summaries_and_needs_two_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, data in (("a", BASE), ("b", SMALL_CAPS)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(data))
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    printed = capsys.readouterr().out
    assert f"| {tmp_path / 'b'} | ddp 1 MB | 59 | 80.0 | 78.0-83.0 | 0.80 |" in printed
    assert cli.main(["compare", str(tmp_path / "a")]) == 2
    assert capsys.readouterr().err.strip() == (f"ddpwatch compare: error: compare needs two runs or more: {tmp_path / 'a'} holds one "
                                               "(give another session)")
    (tmp_path / "a" / "earlier").mkdir()  # a session directory holding two runs (an earlier one's exports in a folder)
    (tmp_path / "a" / "earlier" / "summary.json").write_text(json.dumps({**SMALL_CAPS, "session": "earlier-run"}))
    assert cli.main(["compare", str(tmp_path / "a")]) == 0
    assert f"| {tmp_path / 'a'} (earlier-run) | ddp 1 MB |" in capsys.readouterr().out
