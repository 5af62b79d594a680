"""Each strategy's step replayed from one run's parts (``ddpwatch.advisor.strategy_sim``),
hand-worked. Two ranks, one collective at a time (NCCL's one stream), nothing lost beside transfers.

The model: two float32 tensors of 1,000,000 elements, 4 MB each (decimal MB): t0 is layer 0's
(``layers.0.w``), t1 the head's (``head.w``), whose gradient is ready first. A micro-step's
forward is 10 ms; its backward 20 ms, t1's gradient ready 8 ms in, t0's at its end; the
optimizer 6 ms; the data 2 ms. The link: α = 1 ms, busbw = 4 GB/s, so with two ranks (bus
factor 1 for an all-reduce, 0.5 for a reduce-scatter or an all-gather):

    all_reduce 4 MB = 1 + 1 = 2 ms        all_reduce 8 MB = 1 + 2 = 3 ms
    reduce_scatter / all_gather 4 MB = 1 + 0.5 = 1.5 ms, 8 MB = 1 + 1 = 2 ms
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from instrumented_ddp.wire.bucket_plan import TensorSize

from ddpwatch.advisor.strategy_sim import StepParts, fsdp_units, padded, simulate_strategy
from ddpwatch.figures.cost_model import CostModel
from ddpwatch.figures.kind_costs import KindCost

MIB = 1024 * 1024
LINK = CostModel(2, 0.001, 4.0, 1.0, samples=10, min_bytes=1, max_bytes=10**9, rms_error_s=0.0, relative_error=0.0)
COSTS = {kind: KindCost(kind, LINK if kind == "all_reduce" else replace(LINK, factor=0.5))
         for kind in ("all_reduce", "reduce_scatter", "all_gather")}
PARTS = StepParts(tensors=(TensorSize(4_000_000, "float32"), TensorSize(4_000_000, "float32")), ready_s=(0.020, 0.008),
                  backward_s=0.020, forward_s=0.010, optimizer_s=0.006, data_s=0.002, world_size=2, workers=1,
                  units=fsdp_units(["layers.0.w", "head.w"]))


def ms(strategy: str, grad_accum: int = 1, cap_bytes: int = 25 * MIB, parts: StepParts = PARTS) -> float:
    return round(simulate_strategy(parts, COSTS, strategy, grad_accum, cap_bytes).step_s * 1e3, 6)


def test_simple_reduces_each_parameter_after_every_micro_steps_backward() -> None:
    # 2 + 10 + 20 + 2 + 2 + 6
    assert ms("simple") == 42.0
    # K = 2: each micro-step is half the compute, and both reduce: 2 + 2 x (5 + 10 + 2 + 2) + 6
    assert ms("simple", 2) == 46.0
    # ga reduces after the last alone: 2 + 2 x 15 + 4 + 6
    assert ms("ga", 2) == 42.0


def test_a_micro_steps_fixed_cost_is_paid_k_times() -> None:
    """6 ms of a micro-step's 30 ms of compute do not shrink with its samples: 2 ms of forward's 10
    and 4 of backward's 20. At K = 2 a micro-step computes 2 + 8 / 2 = 6 ms forward and
    4 + 16 / 2 = 12 ms backward: ga is 2 + 2 x 18 + 4 + 6 = 48 ms, not 42."""
    assert ms("ga", 2, parts=replace(PARTS, micro_fixed_s=0.006)) == 48.0
    assert ms("ga", 1, parts=replace(PARTS, micro_fixed_s=0.006)) == ms("ga", 1)  # at the run's own K, as measured


def test_hook_waits_inside_backward_and_async_hides_what_comes_before_the_last_gradient() -> None:
    # hook: backward to t1's mark at 20 ms, its 2 ms all-reduce; on to backward's end at 34; t0's: 36; +6
    assert ms("hook") == 42.0
    # async: t1's all-reduce 20-22 under backward; t0's issued at backward's end, 32-34; +6
    prediction = simulate_strategy(PARTS, COSTS, "async")
    assert round(prediction.step_s * 1e3, 6) == 40.0 and round(prediction.exposed_s * 1e3, 6) == 2.0
    assert prediction.calls == {"all_reduce": 2}


def test_bucket_and_ddp_launch_each_bucket_once_full() -> None:
    # One 8 MB bucket at backward's end (32 ms): 3 ms; +6
    assert ms("bucket") == 41.0 and ms("ddp") == 41.0
    # A 4 MiB cap (4,194,304 bytes) holds one tensor a bucket: t1's 20-22 hidden, t0's 32-34; +6
    assert ms("bucket", cap_bytes=4 * MIB) == 40.0


def test_zero1_shards_the_optimizer_and_gathers_the_parameters_after_it() -> None:
    # The 8 MB all-reduce to 35 ms; the optimizer steps half (2,000,000 elements padded to a multiple of 2): 3 ms; the 8 MB all-gather 2 ms
    prediction = simulate_strategy(PARTS, COSTS, "zero1")
    assert round(prediction.step_s * 1e3, 6) == 40.0 and prediction.calls == {"all_reduce": 1, "all_gather": 1}


def test_zero2_reduce_scatters_in_backward() -> None:
    # The 8 MB reduce-scatter: 32-34; the optimizer's half, 3 ms; the all-gather, 2 ms
    assert ms("zero2") == 39.0


def test_fsdp_gathers_each_unit_before_its_forward_and_backward_and_scatters_after() -> None:
    """Units: u0 = t0 (layer 0), the root = t1; each unit 4 MB gathered (1.5 ms), 4 MB scattered.
    gloo (no streams), each call holds the host: data 2; the root gathered 2-3.5, its half of the
    forward to 8.5; u0 gathered to 10, its forward to 15. Backward: u0 gathered again 15-16.5
    (the root stays gathered); u0's gradient ready 20 ms of compute later, 36.5; its reduce-scatter
    to 38; the root's to 39.5; the optimizer steps half, 3 ms: 42.5."""
    prediction = simulate_strategy(PARTS, COSTS, "fsdp")
    assert round(prediction.step_s * 1e3, 6) == 42.5
    assert prediction.calls == {"all_gather": 3, "reduce_scatter": 2}
    assert "fsdp: forward split by parameter bytes" in prediction.notes


def test_fsdp_on_streams_gathers_one_unit_ahead() -> None:
    """NCCL: the root's gather 2-3.5 and u0's prefetched behind it, 3.5-5; the root's forward
    to 8.5, u0's to 13.5. Backward: u0 gathered 13.5-15, its backward to 35; its reduce-scatter
    35-36.5 not waited; the root's 36.5-38, waited; the optimizer's half, 41."""
    streams = replace(PARTS, on_streams=True)
    assert ms("fsdp", parts=streams) == 41.0


def test_fsdp_gathers_in_every_micro_step_and_scatters_in_the_last() -> None:
    prediction = simulate_strategy(PARTS, COSTS, "fsdp", grad_accum=2)
    assert prediction.calls == {"all_gather": 6, "reduce_scatter": 2}


def test_the_units_are_the_first_module_lists_children_then_the_root() -> None:
    names = ["embed.weight", "model.layers.0.attn.q", "model.layers.0.mlp.w", "model.layers.1.attn.q", "norm.weight", "lm_head.weight"]
    assert fsdp_units(names) == ((1, 2), (3,), (0, 4, 5))
    assert fsdp_units(["a.weight", "b.weight"]) == ((0, 1),)


def test_padding_and_wrong_input() -> None:
    assert padded(5, 2) == 6 and padded(6, 2) == 6 and padded(1, 4) == 4
    with pytest.raises(ValueError, match="unknown strategy 'zero3'"):
        simulate_strategy(PARTS, COSTS, "zero3")
    with pytest.raises(ValueError, match="grad_accum must be 1 or more"):
        simulate_strategy(PARTS, COSTS, "ddp", 0)
