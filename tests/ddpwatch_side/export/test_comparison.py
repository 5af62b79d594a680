"""``ddpwatch compare``: recorded runs side by side, each segment against the first, hand-worked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ddpwatch import cli
from ddpwatch.export.comparison import comparison_lines, compared_segments, run_differences, slower_than_allowed


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


def test_a_segment_slower_than_allowed_and_told_apart_is_a_regression() -> None:
    """Against 100 ms (95-105): 80 is faster; 102 is 2 % slower, over 1 % but its 98-110 overlaps
    95-105, so not told apart; 120 (112-125) is 20 % slower and apart; 110 without an interval is
    judged by its ratio alone, and says so."""
    slower = run(segment("ddp 4 MB", 59, 120.0, (112.0, 125.0), 533.3))
    untimed = run(segment("ddp 2 MB", 10, 110.0, None, 581.8))
    assert slower_than_allowed([("a", BASE), ("b", SMALL_CAPS)], 1.0) == []
    assert slower_than_allowed([("a", BASE), ("b", SMALL_CAPS), ("c", slower), ("d", untimed)], 5.0) == [
        "slower: c, ddp 4 MB: step p50 100.0 → 120.0 ms (+20.0 %, over the 5 % allowed; 90 % intervals apart)",
        "slower: d, ddp 2 MB: step p50 100.0 → 110.0 ms (+10.0 %, over the 5 % allowed; no interval to judge the spread by)"]
    assert slower_than_allowed([("a", BASE), ("c", slower)], 25.0) == []  # within what is allowed
    assert slower_than_allowed([("a", BASE)], 0.0) == []


def test_compare_fails_a_ci_job_on_a_regression_and_refuses_a_bad_allowance(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for name, data in (("base", BASE), ("new", run(segment("ddp 4 MB", 59, 120.0, (112.0, 125.0), 533.3)))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(data))
    both = [str(tmp_path / "base"), str(tmp_path / "new")]
    assert cli.main(["compare", *both, "--fail-if-slower", "5"]) == 1
    assert capsys.readouterr().err.startswith(f"ddpwatch compare: slower: {tmp_path / 'new'}, ddp 4 MB: step p50 100.0 → 120.0 ms")
    assert cli.main(["compare", *both, "--fail-if-slower", "25"]) == 0
    assert cli.main(["compare", *both]) == 0  # no allowance given: a report, never a failure
    for bad in ("-1", "inf"):
        assert cli.main(["compare", *both, "--fail-if-slower", bad]) == 2
        assert "--fail-if-slower must be a percentage, 0 or more" in capsys.readouterr().err


def test_the_loops_marked_compute_is_held_against_the_first_where_either_marked_any() -> None:
    """A run without an average of the weights against one with it (``watch.computing("ema")``,
    9.0 ms a step): the change line says what the average added; runs that marked none say nothing of it."""
    with_ema = run({**segment("ddp 25 MB", 59, 109.0, (104.0, 113.0), 590.0), "loop_compute_ms": 9.0, "loop_computed": ["ema"]})
    lines = comparison_lines([("none", BASE), ("ema", with_ema)])
    assert lines[-1].endswith("Overlap% 0.0 → 50.0; the loop's own compute (ema) 0.0 → 9.0 ms a step")
    assert "the loop's own compute" not in "\n".join(comparison_lines([("a", BASE), ("b", SMALL_CAPS)]))


def test_the_straggler_is_held_against_the_first_where_either_named_one() -> None:
    """A run whose rank 1 kept the others waiting 30.1 ms a step (summary.json's ``straggler``)
    against the same run after a fix, which names none: the change line says the wait is gone;
    runs where neither named one say nothing of it."""
    late = run({**segment("ddp 25 MB", 59, 130.0, (128.0, 133.0), 492.0),
                "straggler": {"rank": 1, "first_step": 50, "last_step": 59, "steps": 10, "waited_ms_per_step": 30.1, "share_pct": 23.2}})
    lines = comparison_lines([("late", late), ("fixed", BASE)])
    assert lines[-1].endswith("Overlap% 50.0 → 0.0; straggler rank 1, waited for 30.1 ms a step → none")
    assert comparison_lines([("fixed", BASE), ("late", late)])[-1].endswith("; straggler none → rank 1, waited for 30.1 ms a step")
    assert "straggler" not in "\n".join(comparison_lines([("a", BASE), ("b", SMALL_CAPS)]))


def test_the_ranks_data_wait_is_held_against_the_first_where_either_was_uneven() -> None:
    """Rank 1 waited on its data 84.7 % of the time and rank 0 2.3 % (a mean of 43.5 in the
    table), then the loader was given workers: the change line names whose wait went; runs whose
    ranks were even (or whose summaries kept no ranks' figures) say nothing of it."""
    def by_rank(seg: dict[str, Any], *pcts: float) -> dict[str, Any]:
        return {**seg, "per_rank": {str(rank): {"data_wait_pct": pct} for rank, pct in enumerate(pcts)}}

    slow_loader = run(by_rank(segment("ddp 25 MB", 59, 180.0, (175.0, 186.0), 355.0), 2.3, 84.7))
    fixed = run(by_rank(segment("ddp 25 MB", 59, 100.0, (95.0, 105.0), 640.0), 3.1, 2.9))
    lines = comparison_lines([("slow loader", slow_loader), ("workers", fixed)])
    assert lines[-1].endswith("; Data wait by rank: rank 1 84.7 %, rank 0 2.3 % → rank 0 3.1 %, rank 1 2.9 %, the most and the least")
    assert comparison_lines([("workers", fixed), ("old", BASE)])[-1].endswith("Overlap% 50.0 → 0.0")  # even, and not kept
    assert comparison_lines([("old", BASE), ("slow loader", slow_loader)])[-1].endswith(
        "; Data wait by rank: not kept → rank 1 84.7 %, rank 0 2.3 %, the most and the least")


def test_the_loops_own_collectives_are_held_against_the_first_where_either_issued_any() -> None:
    """A loop that gathered its predictions to rank 0 every step (2 calls, 4.6 ms a step) against
    the same loop gathering them once at the end: the change line says what the gathers cost;
    runs that issued none say nothing of them (an older summary's null reads as none)."""
    gathering = run({**segment("ddp 25 MB", 59, 104.6, (100.0, 109.0), 612.0), "loop_collectives": 2.0, "loop_collective_ms": 4.6})
    lines = comparison_lines([("every step", gathering), ("at the end", BASE)])
    assert lines[-1].endswith("; the loop's own collectives 2 → 0 a step, 4.6 → 0.0 ms")
    old = run({**segment("ddp 25 MB", 59, 100.0, (95.0, 105.0), 640.0), "loop_collectives": None, "loop_collective_ms": None})
    assert "the loop's own collectives" not in "\n".join(comparison_lines([("a", BASE), ("b", old)]))
