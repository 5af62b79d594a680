"""``issued_collectives``: what a step issued, read from each backend's own count, on hand-made groups."""

from __future__ import annotations

from typing import Any

import torch

from instrumented_ddp.attachment.issued_collectives import IssuedCollectives, StepCallCounts, backends_of


class FakeBackend:
    def __init__(self, issued: int = 0) -> None:
        self.issued = issued

    def _get_sequence_number_for_group(self) -> int:
        return self.issued


class FakeGroup:
    """A group with a backend per device type, as ``ProcessGroup._get_backend`` answers."""

    def __init__(self, **backends: FakeBackend) -> None:
        self.backends = backends

    def _get_backend(self, device: torch.device) -> FakeBackend:
        if device.type not in self.backends:
            raise RuntimeError(f"no backend for {device.type}")
        return self.backends[device.type]


def test_the_first_look_is_the_baseline_and_each_later_one_the_growth_since_the_last() -> None:
    backend = FakeBackend(issued=7)  # made before the first look: not counted
    issued = IssuedCollectives(lambda: [FakeGroup(cpu=backend)])
    assert issued.since_last() is None
    backend.issued += 3
    assert issued.since_last() == 3
    assert issued.since_last() == 0


def test_a_group_made_after_the_first_look_counts_from_zero_and_groups_add_up() -> None:
    world = FakeGroup(cpu=FakeBackend(issued=5))
    groups: list[Any] = [world]
    issued = IssuedCollectives(lambda: groups)
    issued.since_last()
    groups.append(FakeGroup(cpu=FakeBackend(issued=2)))  # made in the step: both its collectives are the step's
    world.backends["cpu"].issued += 1
    assert issued.since_last() == 3


def test_a_group_with_a_backend_per_device_counts_each_once_and_a_shared_one_once() -> None:
    gloo, nccl = FakeBackend(), FakeBackend()
    shared = FakeBackend()
    groups = [FakeGroup(cpu=gloo, cuda=nccl), FakeGroup(cpu=shared, cuda=shared)]
    assert backends_of(groups[0]) == [gloo, nccl] and backends_of(groups[1]) == [shared]
    issued = IssuedCollectives(lambda: groups)
    issued.since_last()
    gloo.issued, nccl.issued, shared.issued = 1, 2, 4
    assert issued.since_last() == 7


def test_a_backend_that_cannot_say_turns_the_count_off_for_good() -> None:
    class Mute(FakeBackend):
        def _get_sequence_number_for_group(self) -> int:
            raise NotImplementedError("this backend keeps no sequence number")

    groups: list[Any] = [FakeGroup(cpu=FakeBackend())]
    issued = IssuedCollectives(lambda: groups)
    issued.since_last()
    groups.append(FakeGroup(cpu=Mute()))
    assert issued.since_last() is None and not issued.readable
    groups.pop()
    assert issued.since_last() is None  # a guess from half the groups would be wrong: nothing is said


def test_a_steps_collectives_in_its_data_gaps_are_those_issued_there_less_those_timed_there() -> None:
    """A step of two micro-steps, hand-worked. Gap before the first forward: 3 issued, of
    which 1 timed there (an FSDP all-gather its pre-forward hook issued before ours ran): 2 the
    loop's. Forward and backward: 5 issued, 4 timed. Gap between the micro-steps: 1. Before the
    update, after the last backward (the gap cancelled): 1, the optimizer's. In all 10 issued, 5
    timed: 5 untimed, 3 of them in the data time."""
    backend = FakeBackend()
    timed = [0]
    step = StepCallCounts(IssuedCollectives(lambda: [FakeGroup(cpu=backend)]), lambda: timed[0])
    step.restart(in_gap=True)  # a pause ended: the step's first gap begins
    backend.issued += 3
    timed[0] += 1
    step.gap_ends()
    backend.issued += 5
    timed[0] += 4
    step.gap_begins()
    backend.issued += 1
    step.gap_ends()
    step.gap_begins()
    step.gap_cancelled()
    backend.issued += 1
    assert step.step_ends() == (10, 3)
    timed[0] = 0  # the next step's timeline, begun where this one ended
    backend.issued += 2  # its first gap, in which nothing was timed
    step.gap_ends()
    assert step.step_ends() == (2, 2)


def test_a_step_without_a_gap_counts_nothing_in_data_and_an_uncountable_one_says_none() -> None:
    backend = FakeBackend()
    step = StepCallCounts(IssuedCollectives(lambda: [FakeGroup(cpu=backend)]), lambda: 0)
    step.restart(in_gap=False)  # the first step's first forward
    backend.issued += 4
    step.gap_ends()  # not after a gap: nothing in data
    assert step.step_ends() == (4, 0)
    unreadable = StepCallCounts(IssuedCollectives(lambda: [FakeGroup(cpu=object())]), lambda: 0)  # type: ignore[arg-type]
    unreadable.restart(in_gap=False)
    assert unreadable.step_ends() == (None, 0)


def test_a_step_found_ended_at_its_backward_leaves_the_open_gaps_collectives_to_the_next_steps_data() -> None:
    """A loss scaler skipped the update: the step is found to have ended at its backward only at
    the next forward. Of its 6 collectives, the 2 issued after that backward (a log's all-reduce)
    are the next step's, in its data time; 4 timed in the backward stay the step's."""
    backend = FakeBackend()
    timed = [0]
    step = StepCallCounts(IssuedCollectives(lambda: [FakeGroup(cpu=backend)]), lambda: timed[0])
    step.restart(in_gap=False)
    backend.issued += 4
    timed[0] += 4
    step.gap_begins()
    backend.issued += 2
    assert step.step_ends(gap_to_next=True) == (4, 0)
    timed[0] = 0
    step.gap_ends()  # the next step's first forward
    assert step.step_ends() == (2, 2)
