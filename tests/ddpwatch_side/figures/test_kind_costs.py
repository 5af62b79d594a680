"""A cost model for each collective kind (``ddpwatch.figures.kind_costs``): fitted from the run's
own calls of that kind, or derived from the all-reduce fit with the kind's bus factor.
Hand-worked on two ranks, where f = 2(n-1)/n = 1 for an all-reduce and (n-1)/n = 0.5 for a
reduce-scatter or an all-gather."""

from __future__ import annotations

from instrumented_ddp.wire.messages import Span, StepReport

from ddpwatch.figures.cost_model import TransferSample
from ddpwatch.figures.kind_costs import kind_costs, kind_samples

MB = 1_000_000


def report(rank: int, spans: list[Span]) -> StepReport:
    return StepReport(rank=rank, step=1, strategy="zero2", settings={}, start=0.0, end=1.0, spans=spans, samples=4, tokens=0)


def gathers(waits: tuple[float, float]) -> dict[int, StepReport]:
    """Two all-gathers, u0 of 1 MB and u1 of 3 MB, on a link of α = 1 ms and busbw = 1 GB/s:
    t = 0.001 + S · 0.5 / 1e9, so 1.5 ms and 2.5 ms. Each rank waits ``waits[rank]`` more in u0
    (the other joined late); the shortest over the ranks is the transfer."""
    return {rank: report(rank, [Span("all_gather", 0.1, 0.1 + 0.0015 + waits[rank], False, MB, "u0"),
                                Span("all_gather", 0.2, 0.2 + 0.0025, False, 3 * MB, "u1"),
                                Span("forward", 0.0, 0.5)])
            for rank in (0, 1)}


def test_a_kinds_transfers_are_paired_across_ranks_and_the_shortest_kept() -> None:
    samples = kind_samples([gathers((0.004, 0.0))], "all_gather")
    assert [(s.nbytes, round(s.seconds, 6)) for s in samples] == [(MB, 0.0015), (3 * MB, 0.0025)]
    assert kind_samples([gathers((0.0, 0.0))], "reduce_scatter") == []
    assert kind_samples([{0: gathers((0.0, 0.0))[0]}], "all_gather") == []  # one rank: no transfer


def test_a_kind_the_run_issued_is_fitted_from_its_own_calls() -> None:
    costs = kind_costs([gathers((0.004, 0.0)), gathers((0.0, 0.001))], world_size=2)
    gather = costs["all_gather"]
    assert not gather.derived and gather.model.factor == 0.5 and gather.model.samples == 4
    assert abs(gather.model.alpha_s - 0.001) < 1e-9 and abs(gather.model.busbw_gbps - 1.0) < 1e-6
    # No all-reduce in the run: it and the others are derived from the fit over every kind (here the all-gathers), each
    # with its own factor: an all-reduce of 3 MB costs 0.001 + 3e6 * 1.0 / 1e9 = 4 ms.
    assert costs["all_reduce"].derived and abs(costs["all_reduce"].seconds(3 * MB) - 0.004) < 1e-9
    assert costs["broadcast"].derived and costs["broadcast"].model.factor == 1.0
    assert costs["reduce_scatter"].source == "derived from the fit over every kind (bus factor 0.5)"


def test_without_calls_of_a_kind_it_is_derived_from_the_all_reduce_fit() -> None:
    """All-reduces on a link of α = 2 ms and busbw = 4 GB/s: 1 MB takes 2.25 ms, 8 MB 4 ms. A
    reduce-scatter of 8 MB is then 0.002 + 8e6 * 0.5 / 4e9 = 3 ms."""
    line = [TransferSample(MB, 0.00225), TransferSample(8 * MB, 0.004)]
    costs = kind_costs([], world_size=2, all_reduce_samples=line)
    assert not costs["all_reduce"].derived and abs(costs["all_reduce"].model.alpha_s - 0.002) < 1e-12
    assert abs(costs["reduce_scatter"].seconds(8 * MB) - 0.003) < 1e-12 and costs["reduce_scatter"].derived
    assert abs(costs["all_gather"].seconds(8 * MB) - 0.003) < 1e-12
    assert abs(costs["broadcast"].seconds(8 * MB) - 0.004) < 1e-12
    assert costs["all_reduce"].source == "fitted on 2 calls, median error 0.0%"
    assert costs["all_gather"].source == "derived from the all-reduce fit (bus factor 0.5)"


def test_kinds_each_of_one_size_are_fitted_together_on_bus_bytes() -> None:
    """A bucketed run whose all-gathers are all 1 MB and reduce-scatters all 3 MB: neither kind
    alone tells latency from bandwidth. In all-reduce bytes (x 0.5 / 1) they are 0.5 MB at 1.5 ms
    and 1.5 MB at 2.5 ms, on α = 1 ms and 1 GB/s: every kind is derived from that line."""
    def step() -> dict[int, StepReport]:
        return {rank: report(rank, [Span("all_gather", 0.1, 0.1015, False, MB, "g0"),
                                    Span("reduce_scatter", 0.2, 0.2025, False, 3 * MB, "b0")]) for rank in (0, 1)}

    costs = kind_costs([step(), step()], world_size=2)
    assert {cost.derived_from for cost in costs.values()} == {"every kind"}
    assert abs(costs["all_reduce"].model.alpha_s - 0.001) < 1e-9 and abs(costs["all_reduce"].model.busbw_gbps - 1.0) < 1e-6
    assert abs(costs["all_gather"].seconds(MB) - 0.0015) < 1e-9
    assert costs["reduce_scatter"].source == "derived from the fit over every kind (bus factor 0.5)"


def test_nothing_fitted_gives_no_model() -> None:
    assert kind_costs([], world_size=2) == {}
    assert kind_costs([{0: report(0, []), 1: report(1, [])}], world_size=2) == {}
