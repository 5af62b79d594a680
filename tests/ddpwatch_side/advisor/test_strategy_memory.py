"""What each strategy holds per rank (``ddpwatch.advisor.strategy_memory``), hand-worked on
two ranks for a model of two float32 parameters: ``layers.0.w`` of 1000 x 1000 and ``head.w`` of
101 x 9901 (1,000,001 elements, so a flat bucket of both, 2,000,001 elements, pads to 2,000,002)."""

from __future__ import annotations

import pytest

from ddpwatch.advisor.strategy_memory import HeldMemory, held_memory, predicted_peak, transient_bytes

LAYOUT = [("layers.0.w", 1_000_000, "float32"), ("head.w", 1_000_001, "float32")]
ROWS = [1000, 101]
FULL = 2_000_001 * 4  # 8,000,004 bytes


def test_the_replicated_strategies_hold_everything_and_two_moments() -> None:
    expected = HeldMemory(FULL, FULL, 2 * FULL + 2 * 4)  # two 4-byte step scalars
    for strategy in ("simple", "ga", "hook", "async", "bucket", "ddp"):
        assert held_memory(strategy, LAYOUT, 2) == expected, strategy


def test_zero1_pads_the_bucket_and_steps_one_shard_and_zero2_keeps_only_its_gradient_shard() -> None:
    # One bucket of 2,000,001 elements padded to 2,000,002: 8,000,008 bytes; a shard is 1,000,001
    # elements, 4,000,004 bytes; its moments 8,000,008 and one step scalar
    assert held_memory("zero1", LAYOUT, 2) == HeldMemory(8_000_008, 8_000_008, 8_000_012)
    assert held_memory("zero2", LAYOUT, 2) == HeldMemory(8_000_008, 4_000_004, 8_000_012)
    # At a 4 MiB cap each parameter is a bucket: 1,000,000 and 1,000,001 -> 1,000,002 elements
    assert held_memory("zero1", LAYOUT, 2, cap_bytes=4 * 1024 * 1024).parameters == (1_000_000 + 1_000_002) * 4


def test_fsdp_pads_each_parameters_rows_and_the_moments_are_the_ranks_own_rows() -> None:
    """layers.0.w: 500 rows a rank, 2,000,000 bytes; head.w: ceil(101/2) = 51 rows of 9901, 2,019,804
    bytes padded. Rank 0 steps 500 and 51 rows: 2 x 2,000,000 + 2 x 2,019,804 + 8 = 8,039,616;
    rank 1 has 50 of head.w's rows: 2 x 2,000,000 + 2 x 1,980,200 + 8 = 7,960,408."""
    assert held_memory("fsdp", LAYOUT, 2, rows=ROWS) == HeldMemory(4_019_804, 4_019_804, 8_039_616)
    assert held_memory("fsdp", LAYOUT, 2, rank=1, rows=ROWS).optimizer_state == 7_960_408
    # Without the rows, each parameter is taken as 1-D: 500,000 and 500,001 elements a rank
    assert held_memory("fsdp", LAYOUT, 2).parameters == (500_000 + 500_001) * 4


def test_each_strategys_transient_buffers_follow_the_stated_rule() -> None:
    assert transient_bytes("ddp", LAYOUT, 2) == FULL  # the reducer's buckets
    assert transient_bytes("zero2", LAYOUT, 2) == 8_000_008  # the padded bucket during backward
    assert transient_bytes("zero2", LAYOUT, 2, grad_accum=2) == 8_000_008 + FULL  # and the accumulated gradients
    # fsdp: the root (head.w) gathered, 2 x 2,019,804 = 4,039,608; layer 0 gathered, 4,000,000; the
    # reduce-scatter's input of the largest unit, 4,039,608
    assert transient_bytes("fsdp", LAYOUT, 2, rows=ROWS) == 4_039_608 + 4_000_000 + 4_039_608
    assert transient_bytes("bucket", LAYOUT, 2) == 0
    # On the CPU the figure is the resident memory at the step's end: only DDP's buckets remain
    assert transient_bytes("zero2", LAYOUT, 2, device_peak=False) == 0 and transient_bytes("ddp", LAYOUT, 2, device_peak=False) == FULL


def test_a_peak_is_predicted_from_the_one_measured() -> None:
    """ddp measured 100,000,000 bytes at its peak: it held 8,000,004 x 2 + 16,000,016 and its
    buckets 8,000,004, so the rest is 59,999,972; zero2 holds 20,000,024 and allocates 8,000,008."""
    assert predicted_peak("zero2", LAYOUT, 2, "ddp", 100_000_000) == 59_999_972 + 20_000_024 + 8_000_008
    assert predicted_peak("ddp", LAYOUT, 2, "ddp", 100_000_000) == 100_000_000


def test_an_unknown_strategy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown strategy 'zero3'"):
        held_memory("zero3", LAYOUT, 2)
