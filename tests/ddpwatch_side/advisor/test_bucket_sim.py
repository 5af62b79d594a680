"""The advisor's pure parts worked by hand: the two bucket rules, the cost-model fit, and the
simulated step at several caps (both walls of the valley, gloo's workers and DDP's first bucket
each changing the answer)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from ddpwatch.advisor.bucket_sim import BackwardProfile, best, cap_grid, describe, simulate, sweep
from ddpwatch.figures.cost_model import CostModel, TransferMemory, TransferSample, fit_cost_model
from instrumented_ddp.wire.bucket_plan import DDP_DEFAULT_FIRST_BUCKET_BYTES, TensorSize, plan_bucket_strategy, plan_ddp

MIB = 1024 * 1024


# -- the rules ------------------------------------------------------------------------------------

def test_our_rule_closes_before_a_tensor_that_would_pass_the_cap_or_change_dtype() -> None:
    tensors = [TensorSize(MIB, "f32"), TensorSize(MIB, "f32"), TensorSize(MIB, "bf16"), TensorSize(3 * MIB, "f32")]
    # reversed: 3 (3 MiB alone: past the 2 MiB cap), 2 (bf16), then 1 + 0 = 2 MiB: not past the cap
    assert plan_bucket_strategy(tensors, 2 * MIB) == [[3], [2], [1, 0]]
    # 1.5 MiB: 1 MiB + 1 MiB would pass it, so every tensor alone
    assert plan_bucket_strategy(tensors[:2], int(1.5 * MIB)) == [[1], [0]]


def test_ddps_rule_closes_after_the_tensor_that_reaches_its_limit_first_bucket_apart() -> None:
    tensors = [TensorSize(MIB, "f32")] * 4
    ready = [3, 2, 1, 0]
    # explicit 1.5 MiB: 1 < 1.5 stays open, 2 >= 1.5 closes: pairs, each passing the cap
    assert plan_ddp(tensors, ready, int(1.5 * MIB), int(1.5 * MIB)) == [[3, 2], [1, 0]]
    # bucket_cap_mb unset: the first bucket closes at 1 MiB, the rest stay open under 25 MiB
    assert plan_ddp(tensors, ready, 25 * MIB, DDP_DEFAULT_FIRST_BUCKET_BYTES) == [[3], [2, 1, 0]]
    # one open bucket per dtype: the bf16 tensor does not close the f32 bucket
    mixed = [TensorSize(MIB, "f32"), TensorSize(MIB, "bf16"), TensorSize(MIB, "f32")]
    assert plan_ddp(mixed, [2, 1, 0], 2 * MIB, 2 * MIB) == [[2, 0], [1]]


# -- the cost model -------------------------------------------------------------------------------

def test_the_fit_recovers_latency_and_bus_bandwidth_from_exact_points() -> None:
    """4 ranks: f = 2·3/4 = 1.5. α = 50 µs, busbw 10 GB/s: 1 MB takes 50 µs + 1.5e6/1e10 s = 200 µs,
    4 MB 50 + 600 = 650 µs."""
    model = fit_cost_model([TransferSample(1_000_000, 200e-6), TransferSample(4_000_000, 650e-6),
                            TransferSample(1_000_000, 200e-6)], world_size=4)
    assert model is not None
    assert model.alpha_s == pytest.approx(50e-6) and model.busbw_gbps == pytest.approx(10.0)
    assert model.rms_error_s == pytest.approx(0.0, abs=1e-12) and model.samples == 3
    assert model.seconds(2_000_000) == pytest.approx(350e-6)
    assert not model.extrapolated(2_000_000) and model.extrapolated(8_000_000) and model.extrapolated(999_999)


def test_a_negative_latency_is_refitted_through_the_origin() -> None:
    """2 ranks (f = 1): 1 MB in 90 µs and 2 MB in 200 µs give α = -20 µs freely; through the
    origin the slope is (1e-3·90e-6 + 2e-3·200e-6) / (1e-6 + 4e-6) = 0.098 s/GB: 10.2 GB/s."""
    model = fit_cost_model([TransferSample(1_000_000, 90e-6), TransferSample(2_000_000, 200e-6)], world_size=2)
    assert model is not None and model.through_origin and model.alpha_s == 0.0
    assert model.busbw_gbps == pytest.approx(1 / 0.098)


@pytest.mark.parametrize(("samples", "world_size"), [
    ([TransferSample(1_000_000, 1e-4)] * 3, 2),  # one size: latency and bandwidth cannot be told apart
    ([TransferSample(1_000_000, 1e-4), TransferSample(2_000_000, 2e-4)], 1),  # one rank: no transfer
    ([TransferSample(1_000_000, 2e-4), TransferSample(2_000_000, 1e-4)], 2),  # bigger was faster
    # sizes apart by a byte but not in floating point once scaled (was ZeroDivisionError from the fit)
    ([TransferSample(10**18, 1e-4), TransferSample(10**18 + 1, 2e-4)], 2),
])
def test_samples_that_cannot_make_a_model_make_none(samples: list[TransferSample], world_size: int) -> None:
    assert fit_cost_model(samples, world_size) is None


def test_the_transfer_memory_keeps_the_newest_of_each_size_and_forgets_the_size_issued_longest_ago() -> None:
    """Two kept a size, two sizes in all: 1 KB seen three times keeps its last two (2 and 3 ms);
    a third size, 4 KB, pushes out 2 KB, the size issued longest ago, though it came after 1 KB's
    first sample: 1 KB was issued again since. Calls spanning 4 ranks are kept apart from those
    spanning 2, and the sizes the recent steps measured again are left out when asked."""
    memory = TransferMemory(per_size=2, sizes=2)
    memory.add([TransferSample(1024, 0.001), TransferSample(2048, 0.005)], meeting=2)
    memory.add([TransferSample(1024, 0.002), TransferSample(1024, 0.003)], meeting=2)
    assert memory.samples(2) == [TransferSample(2048, 0.005), TransferSample(1024, 0.002), TransferSample(1024, 0.003)]
    memory.add([TransferSample(4096, 0.009)], meeting=2)
    assert memory.samples(2) == [TransferSample(1024, 0.002), TransferSample(1024, 0.003), TransferSample(4096, 0.009)]
    assert memory.samples(2, besides={1024}) == [TransferSample(4096, 0.009)]
    assert memory.samples(4) == []


# -- the simulator --------------------------------------------------------------------------------

# p0..p3, 1 MiB each (module order); backward makes p3 ready at 10 ms, p2 at 20, p1 at 30, p0 at 40,
# where backward's compute ends. An all-reduce costs 12 ms + 2 ms per MiB (2 ranks, f = 1).
PROFILE = BackwardProfile(tensors=(TensorSize(MIB),) * 4, ready_s=(0.040, 0.030, 0.020, 0.010), backward_s=0.040)
MODEL = CostModel(world_size=2, alpha_s=0.012, busbw_gbps=MIB / 0.002 / 1e9, factor=1.0, samples=8,
                  min_bytes=MIB, max_bytes=2 * MIB, rms_error_s=0.0, relative_error=0.0)


def test_the_valley_one_stream_both_walls() -> None:
    """NCCL, one stream.
    1 MiB: four calls launched at 10, 20, 30, 40 ms run 10-24, 24-38, 38-52, 52-66: 26 ms exposed
           (the latency wall: four times 12 ms).
    2 MiB: [p3,p2] ready at 20 runs 20-36, [p1,p0] at 40 runs 40-56: 16 ms exposed, the best.
    4 MiB: one call at 40 runs 40-60: 20 ms exposed (the other wall: nothing overlaps)."""
    one, two, four = sweep(PROFILE, MODEL, [MIB, 2 * MIB, 4 * MIB])
    assert (one.calls, one.exposed_s, one.step_s) == (4, pytest.approx(0.026), pytest.approx(0.066))
    assert (two.calls, two.exposed_s, two.step_s) == (2, pytest.approx(0.016), pytest.approx(0.056))
    assert (four.calls, four.exposed_s, four.bucket_bytes) == (1, pytest.approx(0.020), (4 * MIB,))
    assert best([one, two, four]) is two
    assert four.extrapolated and not two.extrapolated  # the model saw 1-2 MiB only
    assert describe(one, MODEL).startswith("latency-bound: 4 calls of 1 MB")
    assert describe(four, MODEL).startswith("one exposed 4 MB all-reduce after backward")


def test_of_caps_as_fast_the_best_is_the_fewest_calls_then_the_smallest_cap() -> None:
    """Above the model's bytes every cap is one bucket of it all, equally fast: the largest
    (2 GB) was the best offered, and ``tune`` ran 1, 2 and 4 GB as three caps. Within 0.1 % of
    the fastest, fewer calls still win (a larger cap for the same time)."""
    one_bucket = [simulate(PROFILE, MODEL, cap) for cap in (4 * MIB, 64 * MIB, 2048 * MIB)]
    assert len({p.step_s for p in one_bucket}) == 1 and best(one_bucket).cap_bytes == 4 * MIB
    one, two, four = sweep(PROFILE, MODEL, [MIB, 2 * MIB, 4 * MIB])  # the valley above: 2 MiB best, 2 calls
    four_as_fast = replace(four, step_s=two.step_s * 1.0005)  # one call, 0.05 % slower
    assert best([one, two, four_as_fast]) is four_as_fast


def test_gloos_two_workers_move_the_best_cap() -> None:
    """gloo, two workers. 1 MiB: 10-24, 20-34, 30-44 (a worker free at 24), 40-54 (free at 34):
    14 ms exposed. 2 MiB: 20-36 and 40-56 as before, 16 ms. Now the smallest cap wins."""
    one, two, four = sweep(PROFILE, MODEL, [MIB, 2 * MIB, 4 * MIB], workers=2)
    assert one.exposed_s == pytest.approx(0.014) and two.exposed_s == pytest.approx(0.016)
    assert best([one, two, four]) is one


def test_ddps_rule_and_its_first_bucket() -> None:
    """DDP with bucket_cap_mb unset (first bucket 1 MiB, then 25 MiB): [p3] runs 10-24 and the
    open [p2,p1,p0] launches at 40 and runs 40-58: 18 ms. With 1.5 MiB given, DDP pairs them
    like ours at 2 MiB (16 ms), where ours at 1.5 MiB makes four calls (26 ms)."""
    default = simulate(PROFILE, MODEL, 25 * MIB, rule="ddp", first_cap_bytes=DDP_DEFAULT_FIRST_BUCKET_BYTES)
    assert default.bucket_bytes == (MIB, 3 * MIB) and default.exposed_s == pytest.approx(0.018)
    given = simulate(PROFILE, MODEL, int(1.5 * MIB), rule="ddp")
    ours = simulate(PROFILE, MODEL, int(1.5 * MIB))
    assert (given.calls, given.exposed_s) == (2, pytest.approx(0.016))
    assert (ours.calls, ours.exposed_s) == (4, pytest.approx(0.026))


def test_compute_slowed_beside_the_transfers_moves_the_best_to_one_bucket() -> None:
    """NCCL, one stream, backward computing at 0.625 of its speed while an all-reduce runs.
    2 MiB: [p3,p2] ready at 20 runs 20-36, 10 ms of compute in those 16: 30 ms done at 36, the
           last 10 at full speed, p0 ready at 46 (not 40); [p1,p0] runs 46-62: the step 62 ms,
           16 exposed.
    4 MiB: one call at 40, nothing beside backward: 60 ms as before. The valley's floor moves to
           one bucket, where without the slowdown 2 MiB won by 4 ms."""
    slowed = replace(PROFILE, lost_share=0.375)
    two, four = sweep(slowed, MODEL, [2 * MIB, 4 * MIB])
    assert (two.step_s, two.backward_s, two.exposed_s) == (pytest.approx(0.062), pytest.approx(0.046), pytest.approx(0.016))
    assert (four.step_s, four.backward_s) == (pytest.approx(0.060), pytest.approx(0.040))
    assert best([two, four]) is four
    assert best(sweep(PROFILE, MODEL, [2 * MIB, 4 * MIB])).cap_bytes == 2 * MIB
    assert two.slowed_s == pytest.approx(0.006) and four.slowed_s == 0
    assert describe(two, MODEL).endswith("; the all-reduces beside backward slow it by 6 ms")  # what hiding b0 costs
    assert "slow it" not in describe(four, MODEL)


def test_the_grid_runs_from_1_kb_to_2_gb_with_the_current_cap_and_25_mb() -> None:
    grid = cap_grid(3 * MIB)
    assert grid[0] == 1024 and grid[-1] == 2 * 1024**3 and 25 * MIB in grid and 3 * MIB in grid
    assert len(cap_grid()) == 43 + 1  # 1 KB·√2^k for k = 0..42, and 25 MiB
