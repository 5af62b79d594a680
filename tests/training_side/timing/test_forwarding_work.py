"""``collectives.ForwardingWork``: the works ddpwatch hands back in place of torch's (a timed
wait) are ``dist.Work``s themselves, and answer as the work they stand for."""

from __future__ import annotations

from typing import Any, cast

import pytest
import torch
import torch.distributed as dist

from instrumented_ddp.timing.collectives import (
    FORWARDED_WORK_METHODS,
    FORWARDED_WORK_PROPERTIES,
    EndsWhenWaited,
    ForwardingWork,
    forward_members,
)


class RecordingWork:
    """Answers any method with its name and what it was given."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: (name, args, kwargs)


def test_every_method_and_property_of_a_work_but_boxing_is_the_stood_for_works_own() -> None:
    """``dist.Work``'s own methods would answer for an empty work that never completes: each is
    handed on, those of a later torch too (read off ``dist.Work``: torch 2.14's ``timeout``
    property failed this), and any other attribute."""
    stand_in = ForwardingWork(cast(dist.Work, RecordingWork()))
    public = {name for name in dir(dist.Work) if not name.startswith("__")}
    forwarded = set(FORWARDED_WORK_METHODS) | set(FORWARDED_WORK_PROPERTIES)
    assert forwarded == public - {"boxed", "unbox", "_pybind11_conduit_v1_"}
    assert "wait" in FORWARDED_WORK_METHODS and "is_completed" in FORWARDED_WORK_METHODS
    for name in forwarded:  # a property reads the recording work's attribute: its recording method
        assert getattr(stand_in, name)(1, key=2) == (name, (1,), {"key": 2})
    assert stand_in.not_a_work_method() == ("not_a_work_method", (), {})


class WorkOfALaterTorch:
    """A base with what a later ``dist.Work`` may add: a method, a read-only property (torch
    2.14's ``timeout``, which raises on an empty work), a settable one."""

    def __init__(self) -> None:
        self._priority = 0

    def describe(self) -> str:
        return "an empty work"

    @property
    def timeout(self) -> float:
        raise RuntimeError("This Backend doesn't support getTimeout.")

    @property
    def priority(self) -> int:
        return self._priority

    @priority.setter
    def priority(self, value: int) -> None:
        self._priority = value


def test_a_later_works_methods_and_properties_are_the_stood_for_works_own() -> None:
    class StandIn(WorkOfALaterTorch):
        def __init__(self, work: WorkOfALaterTorch) -> None:
            super().__init__()
            self.work = work

    class Running(WorkOfALaterTorch):
        timeout = 1800.0

        def describe(self) -> str:
            return "a running all-reduce"

    methods, properties = forward_members(StandIn, WorkOfALaterTorch)
    assert (methods, properties) == (["describe"], ["priority", "timeout"])
    work = Running()
    stand_in = StandIn(work)
    assert stand_in.describe() == "a running all-reduce" and stand_in.timeout == 1800.0
    stand_in.priority = 3
    assert work.priority == 3 and stand_in.priority == 3 and stand_in._priority == 0
    with pytest.raises(AttributeError):
        stand_in.timeout = 5.0  # type: ignore[misc]


def test_a_timed_work_is_a_dist_work_that_completes_as_torchs_and_unboxes_to_itself(one_rank_group: None) -> None:
    """FSDP2 waits for an asynchronous all-gather (``unshard(async_op=True)``) only where its work
    ``isinstance(work, dist.Work)``: a plain wrapper was never waited for, and the parameters
    were read before gloo had gathered them (``tests/support/workers/attach_bitwise.py``, *fsdp2
    prefetched*)."""
    reduced = torch.ones(3)
    work = dist.all_reduce(reduced, async_op=True)
    waited: list[bool] = []
    stand_in = EndsWhenWaited(work, lambda: waited.append(True))
    assert isinstance(stand_in, dist.Work)
    assert stand_in.wait() is True and waited == [True]
    assert stand_in.is_completed() and stand_in.exception() is None
    assert not dist.Work().is_completed()  # what the base class would have said
    assert torch.equal(stand_in.result()[0], reduced) and torch.equal(stand_in.get_future().value()[0], reduced)
    assert dist.Work.unbox(stand_in.boxed()) is stand_in
