"""The replayed step's clock (``ddpwatch.advisor.replay_clock``), hand-worked with a cost of
1 ms per MB (and nothing per call)."""

from __future__ import annotations

from ddpwatch.advisor.replay_clock import ReplayClock

MB = 1_000_000


def per_mb(kind: str, nbytes: int) -> float:
    return nbytes / MB * 0.001


def test_a_synchronous_call_blocks_the_main_thread_and_is_exposed() -> None:
    clock = ReplayClock(per_mb)
    clock.compute(0.010)
    clock.call("all_reduce", 5 * MB)  # 10 ms + 5 ms
    assert abs(clock.now - 0.015) < 1e-12 and abs(clock.exposed_s - 0.005) < 1e-12 and clock.calls == 1


def test_an_asynchronous_call_hides_behind_compute_and_one_worker_runs_them_in_order() -> None:
    clock = ReplayClock(per_mb, workers=1)
    first = clock.issue("all_reduce", 4 * MB)  # 0 to 4 ms
    second = clock.issue("reduce_scatter", 4 * MB)  # behind it: 4 to 8 ms
    clock.compute(0.006)
    clock.wait(second)  # 6 ms of compute hid 6 of the 8 ms: 2 ms exposed
    assert (round(first, 6), round(second, 6), round(clock.now, 6), round(clock.exposed_s, 6)) == (0.004, 0.008, 0.008, 0.002)
    assert clock.comm_s == {"all_reduce": 0.004, "reduce_scatter": 0.004}


def test_two_workers_run_two_calls_at_once_but_start_them_in_issue_order() -> None:
    clock = ReplayClock(per_mb, workers=2)
    assert round(clock.issue("all_reduce", 4 * MB), 6) == 0.004
    assert round(clock.issue("all_reduce", 1 * MB), 6) == 0.001  # the second worker: 0 to 1 ms
    assert round(clock.issue("all_reduce", 1 * MB), 6) == 0.002  # the first free: 1 to 2 ms


def test_compute_beside_a_transfer_runs_slower_by_the_lost_share() -> None:
    """A 10 ms transfer from 0; a quarter of compute lost beside it: 10 ms of compute takes
    7.5 ms of it in those 10 ms, and the last 2.5 ms after: 12.5 ms, 2.5 ms slowed."""
    clock = ReplayClock(per_mb, lost_share=0.25)
    clock.issue("all_reduce", 10 * MB)
    clock.compute(0.010)
    assert abs(clock.now - 0.0125) < 1e-12 and abs(clock.slowed_s - 0.0025) < 1e-12
