"""The advisor's reading of a session, worked by hand: ready times from the marks, the profile
and its other time, transfer samples paired across ranks, and the advice or why there is none."""

from __future__ import annotations

from msgspec.structs import replace
from typing import Any

import pytest

from ddpwatch.advisor.advice import (
    FIT_STEPS,
    Advice,
    MeasuredCap,
    advice_for_session,
    advise,
    backward_profile,
    keep_shown_best,
    layout_tensors,
    ready_times,
    step_collectives,
)
from ddpwatch.figures.cost_model import StepCollectives, transfer_samples_of
from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import Hello, Span, StepReport
from instrumented_ddp.wire.step_figures import summarize
from bucket_steps import LAYOUT, bucket_step, hello, one_bucket, slowed_session

MIB = 1024 * 1024
TENSORS = layout_tensors(LAYOUT)


@pytest.mark.parametrize(("marks", "layout"), [("b", [[3, 2], [1, 0]]), ("b", []), ("p", [])],
                         ids=["buckets-with-layout", "ddp-buckets-by-bytes", "per-parameter"])
def test_ready_times_spread_a_bucket_between_marks_by_bytes(marks: str, layout: list[list[int]]) -> None:
    """b0 at 20 ms holds p3 and p2: p3 at 10 ms (half its bytes since 0), p2 at 20; b1 at 40 ms:
    p1 at 30, p0 at 40. Without a layout (DDP) the members are the reverse module order, 2 MiB
    each; per-parameter marks say the same directly."""
    found = ready_times(bucket_step(marks=marks), TENSORS, layout)
    assert found is not None
    ready, origin = found
    assert origin == 0.1 and ready == pytest.approx([0.04, 0.03, 0.02, 0.01])


def test_a_report_without_marks_or_missing_a_tensor_has_no_ready_times() -> None:
    assert ready_times(bucket_step(marks=""), TENSORS) is None
    assert ready_times(bucket_step(marks="b"), TENSORS + TENSORS[:1], [[3, 2], [1, 0]]) is None  # a 5th never marked


def test_the_profile_holds_the_rest_of_the_step_fixed() -> None:
    """Backward's compute is 40 ms (the last mark); the communication ends 56 ms after backward
    began, so the rest of the 170 ms step is 170 - 56 = 114 ms."""
    profile = backward_profile([{0: bucket_step(step=s)} for s in (3, 4, 5)], TENSORS, [[3, 2], [1, 0]])
    assert profile is not None
    assert profile.backward_s == pytest.approx(0.04) and profile.other_s == pytest.approx(0.114)


def late_rank_step(step: int = 3) -> dict[int, StepReport]:
    """Rank 1's backward runs 10 ms behind rank 0's and its clock reads 1 s more (offset -1 s):
    its b0 at 0.130 and b1 at 0.150 on rank 0's clock. Each all-reduce starts once both ranks
    have the bucket: b0 0.130-0.146, b1 0.150-0.166; rank 0 waits 0.140-0.166 and its step,
    optimizer 0.166-0.180, ends at 0.180."""
    early = bucket_step(0, step)
    early = replace(early, end=0.18, spans=[
        Span("forward", 0.01, 0.1), Span("backward", 0.1, 0.166),
        Span("ready", 0.12, 0.12, False, 2 * MIB, "b0"), Span("ready", 0.14, 0.14, False, 2 * MIB, "b1"),
        Span("all_reduce", 0.12, 0.146, False, 2 * MIB, "b0", "float32"), Span("all_reduce", 0.14, 0.166, False, 2 * MIB, "b1", "float32"),
        Span("wait", 0.14, 0.166, True), Span("optimizer", 0.166, 0.18)])
    late = replace(early, rank=1, start=1.0, end=1.18, spans=[
        Span("forward", 1.01, 1.11), Span("backward", 1.11, 1.166),
        Span("ready", 1.13, 1.13, False, 2 * MIB, "b0"), Span("ready", 1.15, 1.15, False, 2 * MIB, "b1"),
        Span("all_reduce", 1.13, 1.146, False, 2 * MIB, "b0", "float32"), Span("all_reduce", 1.15, 1.166, False, 2 * MIB, "b1", "float32"),
        Span("wait", 1.15, 1.166, True), Span("optimizer", 1.166, 1.18)])
    return {0: early, 1: late}


def test_the_profile_waits_for_the_slowest_ranks_gradients() -> None:
    """On rank 0's clock (backward from 0.100) rank 1's gradients are ready at p3 20 ms, p2 30,
    p1 40, p0 50 (its backward began 10 ms later, at 0.110; its marks at 30 and 50 ms, each
    bucket spread by bytes from the mark before), each later than rank 0's 10, 20, 30, 40: so
    backward's compute ends at 50 ms, and the rest of rank 0's 180 ms step is
    180 - 66 = 114 ms. At the run's own 2 MiB (12 ms + 2 ms/MiB: 16 ms a bucket, one stream) b1
    runs 50-66 ms: 16 ms exposed, 114 + 50 + 16 = 180 ms, the step measured. From rank 0 alone the
    same data would predict 114 + 40 + 16 = 170 ms: the 10 ms rank 0 waited for rank 1 lost.
    Rank 2, as early as rank 0 and the last in the step's reports, changes nothing."""
    steps = [{**late_rank_step(s), 2: replace(late_rank_step(s)[0], rank=2)} for s in (3, 4, 5)]  # rank 2 as early as 0
    profile = backward_profile(steps, TENSORS, [[3, 2], [1, 0]], offsets={0: 0.0, 1: -1.0, 2: 0.0})
    assert profile is not None
    assert profile.ready_s == pytest.approx((0.05, 0.04, 0.03, 0.02))
    assert profile.backward_s == pytest.approx(0.05) and profile.other_s == pytest.approx(0.114)
    advice = advise(strategy="bucket", cap_mb=2.0, backend="nccl", world_size=2, profile_steps=steps, fit_steps=two_sized_fit(),
                    parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]], caps=[2 * MIB], offsets={0: 0.0, 1: -1.0, 2: 0.0})
    alone = advise(strategy="bucket", cap_mb=2.0, backend="nccl", world_size=2, profile_steps=[{0: s[0]} for s in steps],
                   fit_steps=two_sized_fit(), parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]], caps=[2 * MIB])
    assert isinstance(advice, Advice) and isinstance(alone, Advice)
    assert advice.current.step_s == pytest.approx(0.18) and alone.current.step_s == pytest.approx(0.17)


def test_the_profile_waits_only_for_the_slowest_rank_of_the_references_group() -> None:
    """The steps above with ranks 2 and 3 beside them, 2 as early as rank 0 and 3 as late as rank
    1, in the groups {0, 2} and {1, 3}. Rank 0's all-reduces meet rank 2 only, so its buckets wait
    for nobody: backward's compute ends at 40 ms and the step predicted at 2 MiB is rank 0's own
    170 ms. Over the world they waited for rank 3's (and 1's) gradients: 50 ms, 180 ms."""
    steps = [{**late_rank_step(s), 2: replace(late_rank_step(s)[0], rank=2), 3: replace(late_rank_step(s)[1], rank=3)}
             for s in (3, 4, 5)]
    offsets = {0: 0.0, 1: -1.0, 2: 0.0, 3: -1.0}
    (two_ranks,) = two_sized_steps()  # every rank's link as in the two-rank run: 12 ms + 2 ms/MiB
    fit = [step_collectives({rank: replace(two_ranks[rank % 2], rank=rank) for rank in range(4)})]
    common: dict[str, Any] = dict(strategy="bucket", cap_mb=2.0, backend="nccl", world_size=4, profile_steps=steps, fit_steps=fit,
                  parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]], caps=[2 * MIB], offsets=offsets)
    within, world = advise(**common, groups=[[0, 2], [1, 3]]), advise(**common)
    assert isinstance(within, Advice) and isinstance(world, Advice)
    assert within.current.step_s == pytest.approx(0.17) and world.current.step_s == pytest.approx(0.18)
    profile = backward_profile(steps, TENSORS, [[3, 2], [1, 0]], offsets=offsets, groups=[[0, 2], [1, 3]])
    assert profile is not None and profile.backward_s == pytest.approx(0.04)


def test_a_session_puts_every_ranks_backward_on_the_first_ranks_clock() -> None:
    """The same steps folded into a session: rank 1's clock offset (-1 s) is found from the
    steps themselves (both ranks leave b1's all-reduce at the same instant, 0.166 and 1.166), and
    the cost model from the two-sized steps before them: the run's own 180 ms comes back."""
    session = Session()
    for rank in (0, 1):
        session.ingest(Envelope(Hello(rank, 2, "s", "h", 1, "cpu", "gloo", "bucket", {"bucket_mb": 2.0, "grad_accum": 1}, 4 * MIB,
                                      parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]]), rank, 0, 0), received_at=0.0)
    sequence = 1
    for step, reports in [(1, two_sized_steps()[0]), (2, two_sized_steps()[0])] + [(s, late_rank_step(s)) for s in (3, 4, 5)]:
        for rank, report in reports.items():
            session.ingest(Envelope(replace(report, step=step, settings={"bucket_mb": 2.0}), rank, sequence, 0), received_at=0.0)
        sequence += 1
    advice = advice_for_session(session, caps=[2 * MIB])
    assert isinstance(advice, Advice), advice
    assert advice.workers == 2 and advice.current.step_s == pytest.approx(0.18)


def test_transfer_samples_pair_calls_across_ranks_and_keep_the_shortest() -> None:
    """Rank 1's b1 took 30 ms where rank 0's took 16: 14 ms of it waited for rank 0."""
    steps = [{0: bucket_step(0), 1: bucket_step(1, transfer_s=(0.016, 0.030))}, {0: bucket_step(0, step=4)}]
    samples = transfer_samples_of([step_collectives(s) for s in steps], world_size=2)  # the second step lacks rank 1: left out
    assert [(s.nbytes, round(s.seconds, 6)) for s in samples] == [(2 * MIB, 0.016), (2 * MIB, 0.016)]


def two_sized_steps() -> list[dict[int, StepReport]]:
    """All-reduces of 1 and 3 MiB costing 12 ms + 2 ms per MiB on both ranks: 14 and 18 ms."""
    def report(rank: int) -> StepReport:
        spans = [Span("all_reduce", 0.0, 0.014, False, MIB, "b0"), Span("all_reduce", 0.02, 0.038, False, 3 * MIB, "b1")]
        return StepReport(rank=rank, step=1, strategy="bucket", settings={}, start=0.0, end=0.1, spans=spans, samples=1, tokens=0)

    return [{0: report(0), 1: report(1)}]


def two_sized_fit() -> list[StepCollectives]:
    return [step_collectives(reports) for reports in two_sized_steps()]


def pairs_on_two_links() -> list[StepCollectives]:
    """Four ranks in two all-reduce groups, {0, 1} and {2, 3} (a DDP on each pair of a 2-D
    mesh): the first pair's link as in ``two_sized_steps`` (14 ms at 1 MiB, 18 at 3: 12 ms +
    2 ms/MiB), the second pair's slower, 16 and 24 ms (12 ms + 4 ms/MiB)."""
    (fast,) = two_sized_steps()
    slow = replace(fast[0], spans=[fast[0].spans[0]._replace(end=0.016), fast[0].spans[1]._replace(end=0.044)])
    return [step_collectives({0: fast[0], 1: fast[1], 2: replace(slow, rank=2), 3: replace(slow, rank=3)})]


def test_the_cost_model_is_fitted_within_the_groups_each_all_reduce_spans() -> None:
    """Within the groups each pair's calls are transfers of their own, 14 and 16 ms at 1 MiB, 18
    and 24 at 3 MiB; a call's sample is their mean, 15 and 21 ms. Through those two points: 3
    ms/MiB, latency 15 - 3 = 12 ms (the line least squares fits through all four). A pair's bus
    factor is 2·1/2 = 1, so busbw is 1 MiB in 3 ms. Paired over the world the shortest of four is
    the fast pair's, 14 and 18 ms: 2 ms/MiB, and the slow link is not seen; its bus factor 2·3/4
    = 1.5 read busbw as 1.5 MiB in 2 ms, 2.25 times the pairs'."""
    common: dict[str, Any] = dict(strategy="bucket", cap_mb=2.0, backend="nccl", world_size=4, profile_steps=[{0: bucket_step()}],
                  fit_steps=pairs_on_two_links(), parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]], caps=[2 * MIB])
    within = advise(**common, groups=[[0, 1], [2, 3]])
    world = advise(**common)
    assert isinstance(within, Advice) and isinstance(world, Advice)
    assert within.model.samples == world.model.samples == 2  # a sample a call, however many groups
    assert within.model.alpha_s == pytest.approx(0.012) and within.model.seconds(MIB) == pytest.approx(0.015)
    assert within.model.busbw_gbps == pytest.approx(MIB / 0.003 / 1e9)
    assert world.model.seconds(MIB) == pytest.approx(0.014)
    assert world.model.busbw_gbps == pytest.approx(1.5 * MIB / 0.002 / 1e9)


def test_a_session_hands_the_advisor_the_groups_its_hellos_name() -> None:
    """The two-rank session of the test above, twice over: ranks 2 and 3 send what 0 and 1 do,
    and every hello names its pair. The pairs' transfers are the same as the world's, so the
    step predicted at 2 MiB is the same 180 ms; busbw is counted over a pair (bus factor 1,
    not 1.5 over four ranks)."""
    models = []
    for groups in (False, True):
        session = Session()
        for rank in range(4):
            session.ingest(Envelope(Hello(rank, 4, "s", "h", 1, "cpu", "gloo", "bucket", {"bucket_mb": 2.0, "grad_accum": 1}, 4 * MIB,
                                          parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]],
                                          all_reduce_group=[rank // 2 * 2, rank // 2 * 2 + 1] if groups else []), rank, 0, 0),
                           received_at=0.0)
        sequence = 1
        for step, reports in [(1, two_sized_steps()[0]), (2, two_sized_steps()[0])] + [(s, late_rank_step(s)) for s in (3, 4, 5)]:
            for rank in range(4):
                report = replace(reports[rank % 2], rank=rank, step=step, settings={"bucket_mb": 2.0})
                session.ingest(Envelope(report, rank, sequence, 0), received_at=0.0)
            sequence += 1
        advice = advice_for_session(session, caps=[2 * MIB])
        assert isinstance(advice, Advice), advice
        assert advice.current.step_s == pytest.approx(0.18)
        models.append(advice.model)
    world, pairs = models
    assert (world.world_size, pairs.world_size) == (4, 2)
    assert pairs.busbw_gbps == pytest.approx(world.busbw_gbps / 1.5)


def test_a_session_fits_the_cost_model_from_ranks_that_sent_summaries() -> None:
    """Rank 1 sends summaries only (as most ranks of a large job do): its durations, 30 and 18 ms
    (its b0 waited 16 ms for rank 0), pair with rank 0's 14 and 18, and the sizes come from rank
    0's full report: transfers of 14 ms at 1 MiB and 18 ms at 3 MiB, each step, as if every rank
    had sent its spans. A step where no rank sent its spans has no sizes and gives none."""
    session = Session()
    for rank in (0, 1):
        session.ingest(Envelope(Hello(rank, 2, "s", "h", 1, "cpu", "gloo", "bucket", {"bucket_mb": 2.0, "grad_accum": 1}, 4 * MIB,
                                      parameter_layout=LAYOUT), rank, 0, 0), received_at=0.0)
    (reports,) = two_sized_steps()
    late = replace(reports[1], spans=[reports[1].spans[0]._replace(end=0.030), reports[1].spans[1]])
    for step in (1, 2, 3):
        full = replace(reports[0], step=step)
        rank0 = full if step < 3 else summarize(full, 2)
        session.ingest(Envelope(rank0, 0, step, 0), received_at=0.0)
        session.ingest(Envelope(summarize(replace(late, step=step), 2), 1, step, 0), received_at=0.0)
    samples = transfer_samples_of([session.step_collectives(step) for step in (1, 2, 3)], world_size=2)
    assert [(s.nbytes, round(s.seconds, 6)) for s in samples] == [(MIB, 0.014), (3 * MIB, 0.018)] * 2


def test_advice_at_a_cap_the_run_trains_predicts_the_step_it_measured_and_finds_the_valley() -> None:
    """The model fitted from 14 ms at 1 MiB and 18 ms at 3 MiB is 12 ms + 2 ms/MiB: at the run's
    own 2 MiB the predicted step is 114 + 40 + 16 = 170 ms, the step measured; 1 MiB would make
    four calls (26 ms exposed: 180 ms) and 4 MiB one exposed call (20 ms: 174 ms)."""
    measured = [MeasuredCap("bucket", 2 * MIB, 0.17, 20)]
    advice = advise(strategy="bucket", cap_mb=2.0, backend="nccl", world_size=2,
                    profile_steps=[{0: bucket_step(step=s)} for s in (3, 4, 5)], fit_steps=two_sized_fit(),
                    parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]], measured=measured, caps=[MIB, 2 * MIB, 4 * MIB])
    assert isinstance(advice, Advice)
    assert advice.model.alpha_s == pytest.approx(0.012)
    assert advice.current.step_s == pytest.approx(0.17) and advice.best.cap_bytes == 2 * MIB and advice.gain == pytest.approx(0.0)
    assert [round(p.step_s, 6) for p in advice.predictions] == [0.18, 0.17, 0.174]
    assert advice.default.cap_bytes == 25 * MIB and advice.default.step_s == pytest.approx(0.174)
    assert advice.workers == 1 and advice.measured == tuple(measured)


def test_a_ddp_at_its_default_cap_is_simulated_with_its_first_bucket_of_1_mib_and_so_is_pytorchs_default() -> None:
    """The same four 1 MiB gradients on ``ddp``. A DDP given no ``bucket_cap_mb`` (the Trainer's)
    caps its first bucket at 1 MiB: at 4 MiB that is [1 MiB] then [3 MiB], not one call of all;
    PyTorch's default, 25 MB, likewise. Any other cap is every bucket's (a cap given)."""
    advice = advise(strategy="ddp", cap_mb=4.0, first_bucket_mb=1.0, backend="nccl", world_size=2,
                    profile_steps=[{0: bucket_step(step=s)} for s in (3, 4, 5)], fit_steps=two_sized_fit(),
                    parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]], caps=[MIB, 2 * MIB, 4 * MIB])
    assert isinstance(advice, Advice)
    assert advice.current.bucket_bytes == (MIB, 3 * MIB) and advice.default.bucket_bytes == (MIB, 3 * MIB)
    assert [p.bucket_bytes for p in advice.predictions][-1] == (4 * MIB,)  # 4 MiB given: one bucket of all


def test_the_best_cap_shown_stays_while_it_is_predicted_within_a_point_of_the_fastest() -> None:
    """At 1, 2 and 4 MiB the steps are predicted at 180, 170 and 174 ms (above). 4 MiB shown
    before is 2.4 % slower than the fastest: the best moves to 2 MiB; within 3 % it would stay at
    4 MiB. Before, the demo's best flipped between 0.5 and 1.41 MB at 12 of 65 refreshes (0 now)."""
    advice = advise(strategy="bucket", cap_mb=2.0, backend="nccl", world_size=2,
                    profile_steps=[{0: bucket_step(step=s)} for s in (3, 4, 5)], fit_steps=two_sized_fit(),
                    parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]], caps=[MIB, 2 * MIB, 4 * MIB])
    assert isinstance(advice, Advice) and advice.best.cap_bytes == 2 * MIB
    assert keep_shown_best(advice, 4 * MIB) is advice  # 174 > 170 x 1.01
    assert keep_shown_best(advice, 4 * MIB, within=0.03).best.cap_bytes == 4 * MIB  # 174 <= 170 x 1.03
    assert keep_shown_best(advice, None) is advice and keep_shown_best(advice, 3 * MIB) is advice  # nothing shown, or off the grid


def test_a_group_of_several_backends_runs_a_models_buckets_on_nccl_and_a_cap_under_a_byte_is_one() -> None:
    """``init_process_group()`` with no backend names its backends by device, and the advisor
    took gloo's two workers for a GPU run; a cap of 1e-7 MB, which the bucket strategy runs as one
    byte, crashed the plot (the log of 0)."""
    from ddpwatch.advisor.advice import measured_caps, workers_of

    assert (workers_of("nccl"), workers_of("cpu:gloo,cuda:nccl"), workers_of("gloo")) == (1, 1, 2)
    session = Session()
    session.ingest(Envelope(Hello(rank=0, world_size=1, session="s", host="h", pid=1, device="cpu", backend="gloo",
                                  strategy="bucket", settings={"bucket_mb": 1e-7}, model_parameters=4), 0, 0, 0))
    session.ingest(Envelope(replace(bucket_step(), rank=0, step=1, settings={"bucket_mb": 1e-7}), 0, 1, 0))
    assert [cap.cap_bytes for cap in measured_caps(session)] == [1]


def test_gloos_workers_make_the_smaller_cap_the_advice() -> None:
    advice = advise(strategy="bucket", cap_mb=2.0, backend="gloo", world_size=2,
                    profile_steps=[{0: bucket_step()}], fit_steps=two_sized_fit(), parameter_layout=LAYOUT,
                    bucket_layout=[[3, 2], [1, 0]], caps=[MIB, 2 * MIB, 4 * MIB])
    assert isinstance(advice, Advice) and advice.workers == 2
    assert advice.best.cap_bytes == MIB and advice.gain == pytest.approx(1 - 0.168 / 0.17)  # 114 + 40 + 14 ms


@pytest.mark.parametrize(("changes", "says"), [
    ({"strategy": "async"}, "this segment is async"),
    ({"parameter_layout": []}, "waiting for the ranks' hello"),
    ({"profile_steps": [{0: bucket_step(marks="")}]}, "gradient-ready marks"),
    ({"fit_steps": []}, "two sizes or more"),
    ({"fit_steps": [step_collectives({r: replace(s, spans=[x._replace(end=x.start + 0.02) for x in s.spans])
                                      for r, s in two_sized_steps()[0].items()})]},
     "did not take longer as they grew"),
    ({"world_size": 1}, "one rank"),
])
def test_without_what_it_needs_the_advisor_says_what_is_missing(changes: dict, says: str) -> None:
    arguments: dict[str, Any] = dict(strategy="bucket", cap_mb=2.0, backend="gloo", world_size=2, profile_steps=[{0: bucket_step()}],
                     fit_steps=two_sized_fit(), parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]])
    advice = advise(**{**arguments, **changes})
    assert isinstance(advice, str) and says in advice


def test_with_every_gradient_in_one_bucket_the_advisor_asks_for_a_cap_under_it() -> None:
    """One 4 MiB all-reduce a step at a 25 MB cap: a larger cap gives the same one bucket, so
    "another cap" is not enough; under 4 MiB the gradients split. Below its size, any cap will do."""
    def one_bucket(rank: int) -> StepReport:
        spans = [Span("all_reduce", 0.0, 0.02, False, 4 * MIB, "b0")]
        return StepReport(rank=rank, step=1, strategy="bucket", settings={}, start=0.0, end=0.1, spans=spans, samples=1, tokens=0)

    arguments: dict[str, Any] = dict(strategy="bucket", backend="gloo", world_size=2, profile_steps=[{0: bucket_step()}],
                     fit_steps=[step_collectives({0: one_bucket(0), 1: one_bucket(1)})], parameter_layout=LAYOUT,
                     bucket_layout=[[3, 2], [1, 0]])
    assert advise(cap_mb=25.0, **arguments) == ("needs all-reduces of two sizes or more to fit the cost model: every one "
                                                "seen was 4 MB, under the cap: run a cap under 4 MB (-) to cut them smaller")
    assert advise(cap_mb=2.0, **arguments) == "needs all-reduces of two sizes or more to fit the cost model: run another cap (+ / -)"
    # an attached run (the user's own DDP) has no key to press: it is told where to set a cap, half the size or the cap
    assert advise(cap_mb=25.0, switchable=False, **arguments) == (
        "needs all-reduces of two sizes or more to fit the cost model: every one seen was 4 MB, under the cap: restart with "
        "DistributedDataParallel(..., bucket_cap_mb=2) (a Trainer: TrainingArguments(ddp_bucket_cap_mb=2)) to cut them smaller")
    assert advise(cap_mb=2.0, switchable=False, **arguments) == (
        "needs all-reduces of two sizes or more to fit the cost model: restart with "
        "DistributedDataParallel(..., bucket_cap_mb=1) (a Trainer: TrainingArguments(ddp_bucket_cap_mb=1))")


def test_sizes_the_recent_steps_no_longer_issue_still_fit_the_cost_model() -> None:
    """Three steps at a 2 MB cap issue 1 and 3 MiB all-reduces (14 and 18 ms: 12 ms + 2 ms/MiB);
    then the run switches to 25 MB, where every gradient makes one 4 MiB bucket (20 ms), for more
    steps than the fit's recent window. Those steps alone cannot tell latency from bandwidth; the
    session kept the earlier sizes' transfers, so the model is still 12 ms + 2 ms/MiB, six of its
    samples remembered (three steps, two sizes), and the 25 MB step is predicted as measured:
    110 ms besides backward + 40 ms of backward + the exposed 20 ms all-reduce = 170 ms. Before,
    once the switch was 40 steps old the Advisor tab said it needed two sizes (seen in the demo)."""
    session = Session()

    (two_sized,) = two_sized_steps()
    for rank in (0, 1):
        session.ingest(hello(rank, 2.0, [[3, 2], [1, 0]]), received_at=0.0)
    for step in (1, 2, 3):
        for rank in (0, 1):
            session.ingest(Envelope(replace(two_sized[rank], step=step, settings={"bucket_mb": 2.0}), rank, step, 0), received_at=0.0)
    for rank in (0, 1):
        session.ingest(hello(rank, 25.0, [[3, 2, 1, 0]]), received_at=0.0)
    for step in range(4, 4 + FIT_STEPS + 5):
        for rank in (0, 1):
            session.ingest(Envelope(one_bucket(rank, step, 25.0), rank, step, 0), received_at=0.0)
    advice = advice_for_session(session)
    assert isinstance(advice, Advice), advice
    assert advice.remembered == 6 and advice.model.samples == FIT_STEPS + 6
    assert advice.model.alpha_s == pytest.approx(0.012) and advice.model.seconds(MIB) == pytest.approx(0.014)
    assert advice.current.cap_bytes == 25 * MIB and advice.current.step_s == pytest.approx(0.17)
    from ddpwatch.dashboard.widgets.advisor_panel import render_advice
    assert f"fitted on {FIT_STEPS + 6} calls of 1 MB-4 MB (6 of sizes only earlier steps issued)" in render_advice(advice, 200).plain


@pytest.mark.parametrize(("nbytes", "shown"), [(768, "768 B"), (12 * 1024, "12 KB"), (9_636_864, "9.19 MB")])
def test_the_cost_models_sizes_read_in_the_unit_that_fits_them(nbytes: int, shown: str) -> None:
    from ddpwatch.dashboard.widgets.advisor_panel import size_text
    assert size_text(nbytes) == shown


def test_right_after_a_switch_the_advisor_waits_for_the_new_segment_rather_than_misread_the_old_one() -> None:
    """A switched rank sends its new hello (the 4 MB cap: one bucket [3, 2, 1, 0]) before the new
    segment's first report. Until that report comes, the last segment is still the 2 MB one, whose
    b0 and b1 marks read with the new layout would put the wrong parameters in each bucket."""
    session = Session()

    for rank in (0, 1):
        session.ingest(hello(rank, 2.0, [[3, 2], [1, 0]]), received_at=0.0)
    for step in (1, 2, 3, 4):
        for rank in (0, 1):
            session.ingest(Envelope(bucket_step(rank, step), rank, step, 0), received_at=0.0)
    before = advice_for_session(session)
    assert isinstance(before, str) and "two sizes or more" in before  # read with its own layout: only the fit is missing
    for rank in (0, 1):
        session.ingest(hello(rank, 4.0, [[3, 2, 1, 0]]), received_at=0.0)
    assert advice_for_session(session) == "waiting for the run's first steps as bucket at 4 MB, where it switched"
    for rank in (0, 1):
        session.ingest(Envelope(replace(bucket_step(rank, 5), settings={"bucket_mb": 4.0}), rank, 5, 0), received_at=0.0)
    after = advice_for_session(session)
    assert isinstance(after, str) and "two sizes or more" in after, after  # the new segment read: only the fit is missing


def test_an_attached_fsdp_run_is_told_why_there_is_no_advice_without_being_told_to_switch() -> None:
    """An attached run cannot switch: the line that asks a train.py run to switch to bucket would
    name a key that does nothing."""
    for switchable, says in ((True, "switch to bucket to see it"), (False, "not started by ddpwatch, so it cannot switch")):
        session = Session()
        for rank in (0, 1):
            session.ingest(Envelope(Hello(rank, 2, "s", "h", 1, "cpu", "gloo", "fsdp", {"grad_accum": 1}, 4 * MIB,
                                          parameter_layout=LAYOUT, switchable=switchable), rank, 0, 0), received_at=0.0)
            session.ingest(Envelope(replace(bucket_step(rank, 1), strategy="fsdp", settings={"grad_accum": 1}), rank, 1, 0),
                           received_at=0.0)
        advice = advice_for_session(session)
        assert isinstance(advice, str) and says in advice and "this" in advice and "fsdp" in advice


def test_the_plot_puts_the_best_lowest_the_measured_where_measured_and_the_caps_on_a_log_axis() -> None:
    """43 columns, 1 KB to 2 GB: a factor of 2 is 2 columns (42 columns for 21 doublings). The
    best is the current cap, 2 MiB: 2.83 MiB makes the same two buckets, as fast (the best was
    the largest of equals, 2.83, before: ``bucket_sim.best``)."""
    from ddpwatch.dashboard.views.advisor_plot import BEST, CURRENT_COLUMN, DEFAULT_COLUMN, MEASURED, plot

    advice = advise(strategy="bucket", cap_mb=2.0, backend="nccl", world_size=2, profile_steps=[{0: bucket_step()}],
                    fit_steps=two_sized_fit(), parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]],
                    measured=[MeasuredCap("bucket", 32 * MIB, 0.180, 10)])
    assert isinstance(advice, Advice)
    picture = plot(advice, width=43, height=5)
    column_of = {1024: 0, 2 * MIB: 22, int(2**21.5): 23, 25 * MIB: 29, 32 * MIB: 30}  # 2·log2(cap / 1 KB)
    assert picture.rows[-1][column_of[2 * MIB]] == BEST and picture.bottom_ms == pytest.approx(170.0)
    assert picture.rows[0][column_of[32 * MIB]] == MEASURED and picture.top_ms == pytest.approx(180.0)
    assert all(row[column_of[2 * MIB]] in (CURRENT_COLUMN, "•") for row in picture.rows[:-1])
    assert sum(row[column_of[25 * MIB]] == DEFAULT_COLUMN for row in picture.rows) >= 3
    assert picture.x_axis.startswith("1K") and picture.x_axis[column_of[32 * MIB]:].startswith("32M")


def test_a_measured_caps_interval_is_a_whisker_through_its_point_clipped_to_the_plot() -> None:
    """The plot above, the 32 MB point measured with a 90 % interval of 172-190 ms: rows span
    180 (top) to 170 ms (bottom), 2.5 ms a row, so 172 ms is row round(3.2) = 3 and 190 ms is above
    the top, clipped to row 0, the point itself. Rows 1-3 of its column hold the whisker, except
    where the prediction at 32 MB lies (174 ms, row 2, beyond the sizes seen); row 4 (170 ms)
    lies below the interval."""
    from ddpwatch.dashboard.views.advisor_plot import EXTRAPOLATED, MEASURED, WHISKER, plot
    from ddpwatch.dashboard.widgets.advisor_panel import render_advice

    advice = advise(strategy="bucket", cap_mb=2.0, backend="nccl", world_size=2, profile_steps=[{0: bucket_step()}],
                    fit_steps=two_sized_fit(), parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]],
                    measured=[MeasuredCap("bucket", 32 * MIB, 0.180, 10, (0.172, 0.190))])
    assert isinstance(advice, Advice)
    column = [row[30] for row in plot(advice, width=43, height=5).rows]
    assert column == [MEASURED, WHISKER, EXTRAPOLATED, WHISKER, " "]
    assert "bucket 32 MB 180.0 ms (172.0–190.0 over 10 steps)" in render_advice(advice, 43).plain


def test_a_run_that_cannot_switch_is_told_how_to_set_the_best_cap_in_its_own_script() -> None:
    """An attached run (``switchable`` False) gets no switch key; it is told the DDP argument and
    the Trainer's, in MiB as DDP counts them."""
    from ddpwatch.dashboard.widgets.advisor_panel import render_advice

    advice = advise(strategy="ddp", cap_mb=2.0, backend="nccl", world_size=2, profile_steps=[{0: bucket_step()}],
                    fit_steps=two_sized_fit(), parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]])
    assert isinstance(advice, Advice)
    best_mb = f"{advice.best.cap_bytes / MIB:.3g}"
    attached = render_advice(advice, 60, switchable=False).plain
    assert "b: switch" not in attached
    assert f"DistributedDataParallel(..., bucket_cap_mb={best_mb})" in attached
    assert f"TrainingArguments(ddp_bucket_cap_mb={best_mb})" in attached
    assert "b: switch to ddp" in render_advice(advice, 60).plain
    replayed = render_advice(advice, 60, replay=True).plain  # a replay cannot switch either: the next run's flags
    assert "b: switch" not in replayed and f"train.py with --strategy ddp --bucket-mb {best_mb} (a replay cannot switch)" in replayed
    assert "DistributedDataParallel(" in render_advice(advice, 60, switchable=False, replay=True).plain


def test_an_attached_ddp_with_its_own_communication_hook_is_told_the_advisor_does_not_model_it() -> None:
    """A compression hook sends what it likes per bucket (half the bytes under fp16, PowerSGD's small
    matrices): a replay of DDP's all-reduce of each whole bucket would predict another run."""
    session = Session()
    settings = {"bucket_mb": 2.0, "grad_accum": 1, "comm_hook": "fp16_compress_hook"}
    for rank in (0, 1):
        session.ingest(Envelope(Hello(rank, 2, "s", "h", 1, "cpu", "gloo", "ddp", settings, 4 * MIB,
                                      parameter_layout=LAYOUT, switchable=False), rank, 0, 0), received_at=0.0)
        for step in (1, 2, 3, 4):
            session.ingest(Envelope(replace(bucket_step(rank, step), strategy="ddp", settings=settings), rank, step, 0),
                           received_at=0.0)
    assert advice_for_session(session) == ("this run's DDP communicates through a hook of its own, fp16_compress_hook, which "
                                           "the advisor does not model: it replays DDP's own all-reduce of each whole bucket")


def test_the_caps_run_say_how_much_the_all_reduces_slow_backward_and_each_is_predicted_as_measured() -> None:
    """``slowed_session``: backward / forward is 0.444 with nothing beside it, 0.511 with b0's
    16 ms all-reduce (0.178 forward) beside it: 6 ms more in 16, so 0.375 of the compute is lost
    while an all-reduce runs. Read from the 2 MB segment, b1's mark at 46 ms comes back to 40
    alone and the sweep gives each cap the step it measured: 4 MB 110 + 40 + 20 = 170 ms, the
    best; 2 MB 172 (``test_bucket_sim``). Replayed as measured instead (as before), 4 MB read
    110 + 46 + 20 = 176 ms, and 2 MB looked the better by 4 ms."""
    session = slowed_session()
    advice = advice_for_session(session, caps=[2 * MIB, 4 * MIB])
    assert isinstance(advice, Advice), advice
    assert advice.slowdown is not None and advice.slowdown.segments == 2
    assert advice.slowdown.lost_share == pytest.approx(0.375)
    two, four = advice.predictions
    assert (two.step_s, four.step_s) == (pytest.approx(0.172), pytest.approx(0.170)) and advice.best is four
    as_measured = advice_for_session(session, caps=[2 * MIB, 4 * MIB], slowed=False)
    assert isinstance(as_measured, Advice) and as_measured.slowdown is None
    assert [p.step_s for p in as_measured.predictions] == [pytest.approx(0.172), pytest.approx(0.176)]
    assert as_measured.best.cap_bytes == 2 * MIB
    from ddpwatch.dashboard.widgets.advisor_panel import render_advice
    speed = f"{1 - advice.slowdown.lost_share:.0%}"  # 0.625 as the fit's float rounds it
    assert (f"backward computes at {speed} of its speed while an all-reduce runs beside it, fitted over 2 segments"
            in render_advice(advice, 200).plain)
    assert "backward replayed as measured: how the all-reduces beside it slow it needs a second cap" in render_advice(as_measured, 200).plain
    assert "needs two caps in one run, so small caps may read faster" in render_advice(as_measured, 200, switchable=False).plain
