"""ddpwatch's figures held against hand-made torch.profiler traces of the standard run
(``profiled_run``)."""

from __future__ import annotations

from msgspec.structs import replace
import subprocess
import sys

import pytest

from ddpwatch.doctor.clock_pairing import estimate_offset
from ddpwatch.doctor.profile_check import (
    PairedCollective,
    all_passed,
    compare_rank,
    render_checks,
    render_steps,
    syncs_per_iteration,
)
from ddpwatch.doctor.profiler_trace import parse_trace
from instrumented_ddp.wire.messages import Span, StepReport
from profiled_run import ALL_REDUCE, CHECKS, OFFSET_US, STEPS, Trace, checks, compare, failed, replace_report, report, sec, standard_reports, standard_spans, standard_trace, us


# --- a faithful run --------------------------------------------------------------------------


def test_a_faithful_run_passes_every_check() -> None:
    result = compare()
    assert failed(result) == set() and result.passed and all_passed([result])
    assert [r.step for r in result.rows] == list(STEPS)
    assert [r.profiler_step for r in result.rows] == [3, 4, 5, 6, 7]
    by_name = checks(result)
    assert (by_name["profiled steps reported"].ddpwatch, by_name["profiled steps reported"].profiler) == (5, 5)
    assert (by_name["collectives per step"].ddpwatch, by_name["collectives per step"].profiler) == (10, 10)  # 2 × 5 steps
    for row in result.rows:
        # C = [0, 6] of K = 10 ms -> 60 %; M = [4, 8], C ∩ M = [4, 6] -> 2 / 4 = 50 %.
        assert row.ddpwatch_compute_pct == pytest.approx(60.0) and row.profiler_compute_pct == pytest.approx(60.0)
        assert row.ddpwatch_overlap_pct == pytest.approx(50.0) and row.profiler_overlap_pct == pytest.approx(50.0)
        assert row.ddpwatch_calls == row.profiler_calls == {"all_reduce": 2}
        assert row.syncs == ()
    # 3 ms and 1 ms on both sides, kernel ends exactly where ddpwatch's spans end.
    assert sorted({(round(p.ddpwatch_ms, 6), round(p.profiler_ms, 6)) for p in result.pairs}) == [(1.0, 1.0), (3.0, 3.0)]
    assert all(abs(p.end_difference_us) < 1e-3 and abs(p.start_difference_us) < 1e-3 for p in result.pairs)
    text = render_checks([result])
    assert "verdict: PASS - all 6 checks held on 1 rank(s)" in text
    assert "FAIL" not in text


def test_the_clock_offset_is_recovered_with_jitter_and_a_per_step_lag() -> None:
    """ddpwatch's collective ends jitter by a few µs, and step 5's conversion runs 40 µs early
    (its reference event executed 40 µs after the host recorded it).

    kernel end − span end, µs beyond 123 456 000: step 4: −2, +2; step 5: +40, +40;
    step 6: 0, 0; step 7: −3, +3; step 8: 0, 0. Sorted: −3 −2 0 0 0 0 2 3 40 40 -> median 0.
    Per step: 0, 40, 0, 0, 0.
    """
    jitter = {4: (0.002, -0.002), 6: (0.0, 0.0), 7: (0.003, -0.003), 8: (0.0, 0.0)}  # ms
    reports = standard_reports()
    for step, (a, b) in jitter.items():
        spans = standard_spans(step)
        spans[2] = spans[2]._replace(start=spans[2].start + a / 1e3, end=spans[2].end + a / 1e3)
        spans[3] = spans[3]._replace(start=spans[3].start + b / 1e3, end=spans[3].end + b / 1e3)
        reports = replace_report(reports, report(step, spans))
    reports = replace_report(reports, report(5, shift_ms=-0.040))
    compared = [r for r in reports if r.step in STEPS]
    offset = estimate_offset(parse_trace(standard_trace()), compared)
    assert offset.method == "launch-paired" and offset.pairs == 10
    assert offset.offset_us == pytest.approx(OFFSET_US, abs=1e-3)
    assert offset.for_step(5) == pytest.approx(OFFSET_US + 40.0, abs=1e-3)
    assert offset.for_step(4) == pytest.approx(OFFSET_US, abs=1e-3)
    assert offset.spread_us == pytest.approx(40.0, abs=1e-3)
    # Each step is read under its own offset, so step 5's lag costs nothing.
    result = compare(reports=reports)
    assert failed(result) == set()
    assert result.rows[1].offset_us == pytest.approx(OFFSET_US + 40.0, abs=1e-3)


def test_kernels_outside_the_profiled_steps_are_ignored() -> None:
    """The trace holds 7 iterations × 2 all-reduces, and 7 broadcasts, and a stop-time sync;
    only the 10 all-reduces launched inside ProfilerStep#3-#7 and run inside ddpwatch's
    windows are compared. The 5 switch broadcasts are launched inside the windows but run
    before ddpwatch's steps start: counted apart and named in the notes."""
    parsed = parse_trace(standard_trace())
    assert sum(k.collective == "all_reduce" for k in parsed.kernels) == 14
    result = compare_rank(parsed, standard_reports())
    assert failed(result) == set()
    assert sum(sum(r.profiler_calls.values()) for r in result.rows) == 10
    assert all(r.outside_calls == {"broadcast": 1} for r in result.rows)
    assert any("outside ddpwatch's step windows" in note and "broadcast 5" in note for note in result.notes)
    # ddpwatch reports for unprofiled steps (1-3, 9, 10) are not compared either.
    assert [r.step for r in result.rows] == [4, 5, 6, 7, 8]


def test_without_launch_links_the_clock_places_the_kernels() -> None:
    """A trace with no ``correlation`` on its kernels: the offset comes from pairing every
    all-reduce span with every all-reduce kernel in order (the step-3 kernels start before the
    first window and are left out; the step-9 ones are extra at the end, shift 0 still pairs
    every span with its kernel), and kernels join the step whose shifted window holds them."""
    result = compare(standard_trace(link_launches=False))
    assert result.offset.method == "order-paired"
    assert result.offset.offset_us == pytest.approx(OFFSET_US, abs=1e-3)
    assert failed(result) == set()
    assert any("no launch call" in note for note in result.notes)


# --- each check failing on its own -----------------------------------------------------------


def test_a_collective_ddpwatch_missed_fails_only_the_count() -> None:
    """Step 6's profiler shows a third, 0.1 ms all-reduce at [8.5, 8.6] ms that ddpwatch never
    reported. Count 2 vs 3: FAIL. The two spans still pair with their own kernels (nearest ends),
    so durations hold. Profiler's M = [4, 8] ∪ [8.5, 8.6] = 4.1 ms, C ∩ M = 2 ms:
    Overlap% 48.8 vs ddpwatch's 50.0 (1.2 pts, within 5). Compute% stays 60."""
    def extra(trace: Trace) -> None:
        trace.kernel(ALL_REDUCE, us(6, 8.5), us(6, 8.6), us(6, 8.2), "cuLaunchKernelEx", "cuda_driver")

    result = compare(standard_trace(extra))
    assert failed(result) == {"collectives per step"}
    count = checks(result)["collectives per step"]
    assert (count.ddpwatch, count.profiler) == (10, 11)
    assert "step 6: ddpwatch all_reduce 2, profiler all_reduce 3" in count.detail
    row = result.rows[2]
    assert row.profiler_overlap_pct == pytest.approx(100 * 2 / 4.1)
    assert row.pairs == 2 and row.worst_duration_error == pytest.approx(0.0, abs=1e-6)


def test_a_collective_the_rank_counted_untimed_is_the_profilers_extra_one_and_no_other() -> None:
    """The same extra all-reduce in step 6, now one the rank says it issued and did not time (an
    attached script's own: ``untimed_collectives``): the counts agree, 10 + 1 against 11, and the
    two timed spans still pair with their own kernels. Counted 2 untimed, or said of step 5 where
    there is none, it is a miss again."""
    def extra(trace: Trace) -> None:
        trace.kernel(ALL_REDUCE, us(6, 8.5), us(6, 8.6), us(6, 8.2), "cuLaunchKernelEx", "cuda_driver")

    def with_untimed(step: int, untimed: int) -> list[StepReport]:
        return replace_report(standard_reports(), replace(report(step), untimed_collectives=untimed))

    result = compare(standard_trace(extra), with_untimed(6, 1))
    assert failed(result) == set()
    count = checks(result)["collectives per step"]
    assert (count.ddpwatch, count.profiler) == (11, 11)
    assert count.detail == ("per step: 2/2/3/2/2, of which issued outside what ddpwatch times (counted, not timed): "
                            "0/0/1/0/0")
    assert result.rows[2].pairs == 2 and result.rows[2].worst_duration_error == pytest.approx(0.0, abs=1e-6)
    assert " 2+1/3 " in render_steps(result).splitlines()[4]  # step 6
    assert "step 6: ddpwatch all_reduce 2 and 2 untimed, profiler all_reduce 3" in checks(
        compare(standard_trace(extra), with_untimed(6, 2)))["collectives per step"].detail
    assert failed(compare(standard_trace(), with_untimed(5, 1))) == {"collectives per step"}


def test_a_barrier_timed_as_a_wait_is_the_profilers_extra_kernel() -> None:
    """The same extra all-reduce kernel in step 6, now the one-element all-reduce NCCL runs for a
    barrier the loop issued, which the rank timed as a wait tagged ``barrier``: no span of a
    collective's kind, and not untimed either, so the counts agree only with the barrier counted
    (10 + 1 against 11); before, a script with a barrier in its steps failed the doctor's count."""
    def extra(trace: Trace) -> None:
        trace.kernel(ALL_REDUCE, us(6, 8.5), us(6, 8.6), us(6, 8.2), "cuLaunchKernelEx", "cuda_driver")

    step6 = report(6)
    with_barrier = replace(step6, spans=[*step6.spans, Span("wait", 0.0082, 0.0087, True, tag="barrier")])
    result = compare(standard_trace(extra), replace_report(standard_reports(), with_barrier))
    assert failed(result) == set()
    count = checks(result)["collectives per step"]
    assert (count.ddpwatch, count.profiler) == (11, 11)
    assert count.detail == "per step: 2/2/3/2/2, of which barriers (timed as waits): 0/0/1/0/0"
    assert " 2+1b/3 " in render_steps(result).splitlines()[4]  # step 6


def test_a_gather_and_an_all_to_all_pair_with_the_point_to_point_kernels_nccl_runs_them_as() -> None:
    """A loop's gather to rank 0 and all-to-all in step 6 (spans of their own kinds): torch's NCCL
    group issues each as grouped sends and receives, one SendRecv kernel a call, so the counts
    agree (10 + 2 against 12) and each span pairs with its kernel; before, a gather against a
    send_recv kernel failed the count."""
    def p2p(trace: Trace) -> None:
        for a, b in ((8.5, 8.7), (8.8, 9.4)):
            trace.kernel("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", us(6, a), us(6, b), us(6, 8.2),
                         "cuLaunchKernelEx", "cuda_driver")

    step6 = report(6)
    with_loops = replace(step6, spans=[*step6.spans, Span("gather", sec(6, 8.5), sec(6, 8.7), True, 8_000_000, "l0"),
                                       Span("all_to_all", sec(6, 8.8), sec(6, 9.4), True, 8_000_000, "l1")])
    result = compare(standard_trace(p2p), replace_report(standard_reports(), with_loops))
    assert failed(result) == set()
    count = checks(result)["collectives per step"]
    assert (count.ddpwatch, count.profiler) == (12, 12)
    assert result.rows[2].ddpwatch_calls == result.rows[2].profiler_calls == {"all_reduce": 2, "send_recv": 2}
    assert sorted(round(p.profiler_ms, 6) for p in result.pairs if p.kind == "send_recv") == [0.2, 0.6]


def test_a_duration_30_percent_off_fails_only_the_duration() -> None:
    """Step 5's second all-reduce recorded as [6.7, 8] ms: 1.3 ms against the kernel's 1.0 ms,
    +30 %. Its end is unchanged, so is M = [4, 7] ∪ [6.7, 8] = [4, 8]: every other figure holds."""
    spans = standard_spans(5)
    spans[3] = spans[3]._replace(start=sec(5, 6.7))
    result = compare(reports=replace_report(standard_reports(), report(5, spans)))
    assert failed(result) == {"collective duration"}
    duration = checks(result)["collective duration"]
    assert duration.ddpwatch == pytest.approx(1.3) and duration.profiler == pytest.approx(1.0)
    assert "step 5 all_reduce #2 (+30.0 %)" in duration.detail  # the 2nd all-reduce of step 5, in order of end
    assert "1 outside" in duration.detail
    (late,) = [p for p in result.pairs if p.step == 5 and p.index == 2]
    assert late.start_difference_us == pytest.approx(300.0) and late.end_difference_us == pytest.approx(0.0, abs=1e-3)
    # its end agrees with the kernel's: the miss is said apart as a wait at one end, and still fails
    assert ("collective durations outside: each is its kernel plus 0.30-0.30 ms at one end (at the other under a tenth "
            "of that): the kernel waited for the GPU, not the wire (as when ranks sharing a GPU time-slice it)" in result.notes)


@pytest.mark.parametrize(("span_ms", "wait_ms"), [((6.7, 8.0), 0.3), ((6.9, 8.4), None), ((7.2, 8.0), None)])
def test_a_missed_duration_is_a_wait_at_one_end_only_where_the_other_end_agrees(span_ms: tuple[float, float],
                                                                                 wait_ms: float | None) -> None:
    """Step 5's second all-reduce (kernel [7, 8] ms) recorded as a span that began 0.3 ms early,
    one 0.1 ms early and 0.4 ms late, or one that began 0.2 ms late (inside its kernel): only the
    first is its kernel plus a wait at one end, said in a note (the check fails all three)."""
    spans = standard_spans(5)
    spans[3] = spans[3]._replace(start=sec(5, span_ms[0]), end=sec(5, span_ms[1]))
    result = compare(reports=replace_report(standard_reports(), report(5, spans)))
    assert "collective duration" in failed(result)
    (pair,) = [p for p in result.pairs if p.step == 5 and p.index == 2]
    assert pair.wait_at_one_end_us() == (None if wait_ms is None else pytest.approx(wait_ms * 1e3))
    said = [note for note in result.notes if note.startswith("collective durations outside")]
    assert len(said) == (wait_ms is not None)


def test_a_span_whose_end_mark_came_late_is_a_wait_at_its_end() -> None:
    """As seen on an H200 shared by 2 ranks (µs, kernel minus span): start +143.7 and end -2,398.8
    (NCCL's launch lead at the start, a time slice at the end); start +4.7, end -345.5; start
    +2,398.1, end +1.2 (a time slice before the kernel). Not a wait at one end: a kernel that began
    20 µs before its span, and excess at both ends (+100 and -400)."""
    def pair(start_us: float, end_us: float) -> PairedCollective:
        return PairedCollective(7, "all_gather", 6, 2.838, 0.295, end_difference_us=end_us, start_difference_us=start_us)

    assert pair(143.7, -2398.8).wait_at_one_end_us() == pytest.approx(2398.8)
    assert pair(4.7, -345.5).wait_at_one_end_us() == pytest.approx(345.5)
    assert pair(2398.1, 1.2).wait_at_one_end_us() == pytest.approx(2398.1)
    assert pair(-20.0, 0.0).wait_at_one_end_us() is None
    assert pair(100.0, -400.0).wait_at_one_end_us() is None


def test_a_short_collective_within_the_floor_passes() -> None:
    """The same 0.3 ms too early a start, with a floor of 500 µs: an absolute difference under the
    floor passes whatever its share (NCCL's start event leads its kernel by tens of µs)."""
    spans = standard_spans(5)
    spans[3] = spans[3]._replace(start=sec(5, 6.7))
    result = compare_rank(parse_trace(standard_trace()), replace_report(standard_reports(), report(5, spans)),
                          duration_floor_us=500.0)
    assert checks(result)["collective duration"].passed


def test_a_compute_share_8_points_off_fails_only_compute() -> None:
    """ddpwatch also reports an optimizer phase at [8.8, 9.6] ms in step 7 that ran no kernel:
    C = [0, 6] ∪ [8.8, 9.6] = 6.8 ms -> Compute% 68 against the profiler's 60 (8 points).
    C ∩ M is still [4, 6] = 2 ms of M = 4 ms: Overlap% 50 on both sides."""
    spans = [*standard_spans(7), Span("optimizer", sec(7, 8.8), sec(7, 9.6))]
    result = compare(reports=replace_report(standard_reports(), report(7, spans)))
    assert failed(result) == {"Compute%"}
    compute = checks(result)["Compute%"]
    assert compute.ddpwatch == pytest.approx(68.0) and compute.profiler == pytest.approx(60.0)
    assert "worst step 7 (+8.0 pts)" in compute.detail


def test_an_overlap_share_off_fails_only_overlap() -> None:
    """ddpwatch's backward recorded half a millisecond late in step 8: forward [0, 2],
    backward [2.5, 6.5]. |C| = 2 + 4 = 6 ms (Compute% 60, as the profiler), but
    C ∩ M = [4, 6.5] = 2.5 ms of 4 -> Overlap% 62.5 against 50 (12.5 points)."""
    spans = standard_spans(8)
    spans[1] = Span("backward", sec(8, 2.5), sec(8, 6.5))
    result = compare(reports=replace_report(standard_reports(), report(8, spans)))
    assert failed(result) == {"Overlap%"}
    assert checks(result)["Overlap%"].ddpwatch == pytest.approx(62.5)


@pytest.mark.parametrize("kind", ["pageable copy", "item", "device synchronize"])
def test_a_sync_in_a_step_fails_only_the_sync_check(kind: str) -> None:
    """A DtoH copy to pageable memory (the host waits for it), a ``.item()`` (pinned copy +
    cudaStreamSynchronize) or a ``torch.cuda.synchronize()`` in step 6's iteration: 1 sync."""
    def add(trace: Trace) -> None:
        if kind == "pageable copy":
            trace.memcpy("Memcpy DtoH (Device -> Pageable)", us(6, 5.0), us(6, 5.01), us(6, 4.98))
        elif kind == "item":
            trace.memcpy("Memcpy DtoH (Device -> Pinned)", us(6, 9.0), us(6, 9.01), us(6, 8.98))
            trace.call("cudaStreamSynchronize", us(6, 8.99))
        else:
            trace.call("cudaDeviceSynchronize", us(6, 10.5))  # after ddpwatch's step, inside the iteration

    result = compare(standard_trace(add))
    assert failed(result) == {"device syncs per step"}
    sync = checks(result)["device syncs per step"]
    assert sync.profiler == 1
    assert "step 6:" in sync.detail and "1 of 5 iterations sync" in sync.detail
    assert [len(r.syncs) for r in result.rows] == [0, 0, 1, 0, 0]
    assert result.rows[2].syncs_in_step_window == (0 if kind == "device synchronize" else 1)


def _model_syncs_twice_a_step(trace: Trace) -> None:
    """transformers' padding-mask check: two ``.item()``-like syncs in every forward."""
    for step in STEPS:
        trace.call("cudaStreamSynchronize", us(step, 0.5))
        trace.call("cudaStreamSynchronize", us(step, 0.8))


def test_syncs_the_unwatched_run_makes_too_are_not_ddpwatchs() -> None:
    """With the unwatched run of the same script, its two syncs a step pass as the model's."""
    unwatched = syncs_per_iteration(parse_trace(standard_trace(_model_syncs_twice_a_step)))
    assert unwatched[4] == ("cudaStreamSynchronize", "cudaStreamSynchronize")
    result = compare(standard_trace(_model_syncs_twice_a_step), unwatched_syncs=unwatched)
    assert failed(result) == set()
    sync = checks(result)["device syncs ddpwatch adds per step"]
    assert (sync.ddpwatch, sync.profiler) == (0, 2)
    assert "cudaStreamSynchronize ×2 in an iteration too" in sync.detail
    # without the reference, the same trace fails: every sync counts
    assert failed(compare(standard_trace(_model_syncs_twice_a_step))) == {"device syncs per step"}


def test_a_sync_only_the_watched_run_makes_is_ddpwatchs() -> None:
    unwatched = syncs_per_iteration(parse_trace(standard_trace(_model_syncs_twice_a_step)))

    def one_more_in_step_6(trace: Trace) -> None:
        _model_syncs_twice_a_step(trace)
        trace.call("cudaEventSynchronize", us(6, 9.5))

    result = compare(standard_trace(one_more_in_step_6), unwatched_syncs=unwatched)
    assert failed(result) == {"device syncs ddpwatch adds per step"}
    sync = checks(result)["device syncs ddpwatch adds per step"]
    assert sync.ddpwatch == 1
    assert sync.detail.startswith("step 6: cudaEventSynchronize ×1 more than unwatched; 1 of 5 iterations")


def test_a_pinned_copy_without_a_sync_is_not_a_sync() -> None:
    """``tensor.to("cpu", non_blocking=True)`` into pinned memory: the host does not wait."""
    result = compare(standard_trace(lambda t: t.memcpy("Memcpy DtoH (Device -> Pinned)", us(6, 5.0), us(6, 5.01), us(6, 4.98))))
    assert failed(result) == set()


def test_a_profiled_step_without_a_usable_report_fails() -> None:
    """Step 6 never arrived and step 7 arrived unresolved: 3 of 5 profiled steps compared."""
    reports = [r for r in standard_reports() if r.step != 6]
    reports = replace_report(reports, report(7, unresolved=True))
    result = compare(reports=reports)
    assert failed(result) == {"profiled steps reported"}
    steps = checks(result)["profiled steps reported"]
    assert (steps.ddpwatch, steps.profiler) == (3, 5)
    assert steps.detail == "no usable report for step 6, 7 (unresolved)"
    assert checks(compare())["profiled steps reported"].detail == "steps 4, 5, 6, 7, 8"


def test_no_report_at_all_fails_every_check_without_raising() -> None:
    result = compare(reports=[])
    assert failed(result) == set(CHECKS)
    assert "verdict: FAIL - 6 of 6 checks missed" in render_checks(result)


def test_a_trace_that_cannot_be_checked_raises() -> None:
    no_steps = {"traceEvents": [e for e in standard_trace()["traceEvents"] if e["cat"] != "user_annotation"]}
    with pytest.raises(ValueError, match="ProfilerStep"):
        compare(no_steps)
    no_kernels = {"traceEvents": [e for e in standard_trace()["traceEvents"] if e["cat"] != "kernel"]}
    with pytest.raises(ValueError, match="no GPU kernel"):
        compare(no_kernels)


# --- rendering -------------------------------------------------------------------------------


def test_render_checks_lines_up_columns_and_names_every_miss() -> None:
    good = compare()
    spans = standard_spans(5)
    spans[3] = spans[3]._replace(start=sec(5, 6.7))
    bad = compare_rank(parse_trace(standard_trace()), [r if r.step != 5 else report(5, spans) for r in standard_reports()], rank=1)
    text = render_checks([good, bad])
    lines = text.splitlines()
    header, table = lines[0], lines[1:13]
    assert header.split() == ["rank", "check", "ddpwatch", "profiler", "tolerance", "result", "detail"]
    for column in ("check", "tolerance", "result", "detail"):
        at = header.index(column)
        assert all(line[at - 2:at] == "  " and line[at] != " " for line in table if len(line) > at), column
    assert "1.300 ms" in text and "±20 %" in text
    assert lines[13] == "verdict: FAIL - 1 of 12 checks missed: rank 1 collective duration"
    assert any(line.startswith("rank 0: clock offset 123456000.0 µs") for line in lines[14:])
    assert not all_passed([good, bad]) and all_passed([good]) and not all_passed([])


def test_render_steps_shows_one_row_per_step() -> None:
    lines = render_steps(compare()).splitlines()
    assert lines[0] == "rank 0"
    assert len(lines) == 2 + len(STEPS)
    assert lines[2].split()[:2] == ["4", "#3"] and "60.0/60.0" in lines[2] and "50.0/50.0" in lines[2]


def test_the_module_never_imports_torch() -> None:
    code = "import sys, ddpwatch.doctor.profile_check; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
