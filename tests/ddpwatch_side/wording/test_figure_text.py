"""How the figures are written (``ddpwatch/wording/figure_text.py``), hand-worked."""

from __future__ import annotations

from ddpwatch.wording.figure_text import busbw_text, gbps_text, held_text, kinds_text, mib_text


def test_a_bandwidth_under_a_hundredth_keeps_two_significant_digits() -> None:
    # 3.125 rounds to two decimals; 0.000123 would read 0.00 so: two significant digits; 0 stays 0.00
    assert [gbps_text(v) for v in (3.125, 0.01, 0.000123, 0.0)] == ["3.12", "0.01", "0.00012", "0.00"]


def test_memory_is_written_to_the_tenth_of_a_mib_then_to_the_kib_then_as_under_a_thousandth() -> None:
    # 9.3 MiB; 16 KiB = 0.0156 MiB -> 0.016; 512 bytes = 0.00049 MiB -> <0.001
    assert [mib_text(v) for v in (9.3, 0.0156, 0.00049, 0.0)] == ["9.3", "0.016", "<0.001", "0.0"]
    assert held_text({"parameters": 2**20, "optimizer_state": 3 * 2**19}) == "1.0/0.0/1.5"  # no gradients held: 0


def test_the_kinds_are_named_short_the_all_reduces_first_and_the_rest_by_name() -> None:
    assert kinds_text({"broadcast": 1.0, "all_to_all": 2.5, "all_reduce": 9.0}) == "A2A 2.5 BC 1"
    assert busbw_text(1.5, {"scatter": None, "gather": 0.25}) == "AR 1.50 GA 0.25"  # a kind with no bandwidth is left out
