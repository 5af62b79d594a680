"""The stand-ins for ``torch.distributed``'s collective functions (``collective_stand_ins``): which
calls of a loop they hand to a loop timer, what they pass through to torch's own function, and
how they come and go. In one process over a one-rank gloo group; what an attached loop's timer
does with a call is in ``test_attach_loop_collectives.py``."""

from __future__ import annotations

import inspect
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist

from instrumented_ddp.timing import collective_stand_ins
from instrumented_ddp.timing.collective_stand_ins import STAND_INS, LoopCall

TORCHS = {name: getattr(dist.distributed_c10d, name) for name in STAND_INS}


def timer_recording(into: list[tuple[str, LoopCall]], name: str, times: bool = True) -> Any:
    """A loop timer that notes each call it is given under ``name`` and issues it (``times``) or
    declines it (then the stand-in issues it untimed)."""

    def timer(call: LoopCall, issue: Any) -> Any:
        into.append((name, call))
        if not times:
            return collective_stand_ins.NOT_TIMED
        work = issue()
        return work if call.async_op else work.wait() and None

    return timer


T = torch.ones(2)
CALLS = [  # (name, args, kwargs): as scripts and libraries write them, and wrong ones
    ("all_reduce", (T,), {}), ("all_reduce", (T, dist.ReduceOp.MAX), {"async_op": True}),
    ("all_reduce", (), {"tensor": T, "group": None}), ("broadcast", (T, 0), {}),
    ("broadcast", (), {"tensor": T, "src": 1, "group": None, "async_op": True}),  # ZeroRedundancyOptimizer's
    ("all_gather", ([T], T), {}), ("all_gather_into_tensor", (T, T), {"async_op": True}),
    ("reduce_scatter_tensor", (T, T), {"op": dist.ReduceOp.SUM}), ("reduce_scatter", (T, [T]), {"async_op": True}),
    ("reduce", (T, 0), {}), ("reduce", (T,), {"dst": 1, "op": dist.ReduceOp.SUM, "async_op": True}),
    ("all_to_all_single", (T, T), {}), ("all_to_all_single", (T, T, [1, 1], [1, 1]), {"async_op": True}),
    ("all_to_all", ([T], [T]), {}), ("gather", (T, [T], 0), {}), ("gather", (T,), {"dst": 0}),
    ("scatter", (T,), {"scatter_list": [T], "src": 0, "async_op": True}), ("scatter", (T, None, 0, None, False, None), {}),
    ("all_reduce", (T,), {"tensor": T}),  # given twice
    ("all_reduce", (T,), {"bogus": 1}), ("all_gather", ([T],), {}),  # unknown; missing
    ("broadcast", (T, 0, None, False, None, "extra"), {}),  # too many
]


@pytest.mark.parametrize(("name", "args", "kwargs"), CALLS)
def test_a_calls_arguments_are_what_binding_torchs_signature_gives_or_none_where_it_refuses(
        name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """``_arguments`` stands for ``inspect.Signature.bind`` + ``apply_defaults`` (10-20 us a
    call, a ZeRO step making one per parameter): the same arguments by name where binding
    succeeds, None where it raises (the call then passes to torch, which says what is wrong)."""
    try:
        bound = inspect.signature(getattr(dist.distributed_c10d, name)).bind(*args, **kwargs)
    except TypeError:
        expected = None
    else:
        bound.apply_defaults()
        expected = dict(bound.arguments)
    assert collective_stand_ins._arguments(name, args, kwargs) == expected


def test_the_stand_ins_are_in_place_while_anyone_needs_them_and_torchs_own_are_back_after() -> None:
    first, second = object(), object()
    collective_stand_ins.stand_in(first)
    collective_stand_ins.stand_in(second)
    try:
        assert all(getattr(dist, name) is ours for name, ours in STAND_INS.items())
        collective_stand_ins.stand_down(first)
        assert all(getattr(dist, name) is ours for name, ours in STAND_INS.items())
    finally:
        collective_stand_ins.stand_down(second)
    assert all(getattr(dist, name) is TORCHS[name] for name in STAND_INS)


def test_a_name_torch_distributed_lacks_is_given_c10ds_function_back_never_none(monkeypatch: Any) -> None:
    # A torch whose ``torch.distributed`` does not export one of the names (only ``distributed_c10d``
    # has it): standing down put ``None`` there, and the loop's next call raised "not callable".
    name = next(iter(STAND_INS))
    monkeypatch.delattr(dist, name)
    user = object()
    collective_stand_ins.stand_in(user)
    collective_stand_ins.stand_down(user)
    assert getattr(dist, name) is getattr(dist.distributed_c10d, name)
    assert collective_stand_ins.torch_function(name) is getattr(dist.distributed_c10d, name)


def test_a_loops_synchronous_call_goes_to_the_latest_attachments_timer_and_the_earlier_one_times_again_after(
        one_rank_group: None) -> None:
    """Two models attached from one loop (a GAN's, to two dashboards): the call is timed once, by
    the latest; once it stops, by the first again; once both stop, by nobody."""
    seen: list[tuple[str, LoopCall]] = []
    first, second = timer_recording(seen, "first"), timer_recording(seen, "second")
    user = object()
    collective_stand_ins.stand_in(user)
    try:
        ident = collective_stand_ins.time_loop_calls(first)
        collective_stand_ins.time_loop_calls(second)
        tensor = torch.ones(3)
        dist.all_reduce(tensor)
        collective_stand_ins.stop_timing_loop_calls(ident, second)
        dist.all_reduce(tensor)
        collective_stand_ins.stop_timing_loop_calls(ident, first)
        dist.all_reduce(tensor)
        assert torch.equal(tensor, torch.ones(3))  # one rank: a sum is the identity
    finally:
        collective_stand_ins.stand_down(user)
    assert [(name, call.kind, call.nbytes, call.dtype) for name, call in seen] == [
        ("second", "all_reduce", 12, "float32"), ("first", "all_reduce", 12, "float32")]
    assert collective_stand_ins._loop_timers == {}


def test_a_gathers_and_a_scatters_bytes_are_one_ranks_piece_times_the_ranks_and_an_all_to_alls_its_input(
        one_rank_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """nccl-tests' sizes, the same on every rank: a gather of 2 floats a rank over 4 ranks moves
    the root's list of 4 x 8 = 32 bytes, as does a scatter; only the root holds that list, so
    each rank counts its own piece times the group's ranks (one rank here, told it has four).
    An all-to-all counts all a rank sends: its input, 12 bytes of three floats, in either form."""
    seen: list[tuple[str, LoopCall]] = []
    timer = timer_recording(seen, "loop", times=False)  # noted, then issued untimed by the stand-in
    user = object()
    collective_stand_ins.stand_in(user)
    monkeypatch.setattr(collective_stand_ins.dist, "get_world_size", lambda group=None: 4)
    ident = collective_stand_ins.time_loop_calls(timer)
    try:
        piece = torch.ones(2)
        dist.gather(piece, [torch.zeros(2)], dst=0)
        dist.scatter(piece, [torch.ones(2)], src=0)
        dist.all_to_all_single(torch.zeros(3), torch.ones(3))
        dist.all_to_all([torch.zeros(3)], [torch.ones(3)])
    finally:
        collective_stand_ins.stop_timing_loop_calls(ident, timer)
        collective_stand_ins.stand_down(user)
    assert [(call.kind, call.nbytes) for _, call in seen] == [("gather", 32), ("scatter", 32), ("all_to_all", 12), ("all_to_all", 12)]


def test_an_asynchronous_call_is_handed_to_the_timer_which_returns_the_work_the_loop_waits_on(one_rank_group: None) -> None:
    """``async_op=True`` is the loop's to wait for: the timer is told (``LoopCall.async_op``),
    issues it asynchronously as asked, and what it returns is what the loop gets."""
    seen: list[tuple[str, LoopCall]] = []
    timer = timer_recording(seen, "loop")
    user = object()
    collective_stand_ins.stand_in(user)
    ident = collective_stand_ins.time_loop_calls(timer)
    try:
        seed = torch.tensor([7])
        work = dist.broadcast(seed, src=0, async_op=True)
        assert isinstance(work, dist.Work) and work.wait() and seed.item() == 7
        assert dist.broadcast(seed, src=0) is None  # synchronous: what torch's returns
    finally:
        collective_stand_ins.stop_timing_loop_calls(ident, timer)
        collective_stand_ins.stand_down(user)
    assert [(call.kind, call.nbytes, call.dtype, call.async_op) for _, call in seen] == [
        ("broadcast", 8, "int64", True), ("broadcast", 8, "int64", False)]


def test_other_threads_calls_and_calls_a_timer_declines_pass_to_torch_untimed(one_rank_group: None) -> None:
    """A call on a thread no loop trains on is not asked about; a declined call (a forward, a
    pause) is issued by torch's own function, and its result is the user's all the same: an
    asynchronous one's work, a synchronous one's tensors."""
    seen: list[tuple[str, LoopCall]] = []
    declining = timer_recording(seen, "declining", times=False)
    user = object()
    collective_stand_ins.stand_in(user)
    ident = collective_stand_ins.time_loop_calls(declining)
    try:
        elsewhere = threading.Thread(target=lambda: dist.broadcast(torch.ones(2), src=0))
        elsewhere.start()
        elsewhere.join()
        assert seen == []
        work = dist.all_reduce(torch.ones(2), async_op=True)
        assert isinstance(work, dist.Work) and work.wait()
        gathered = [torch.zeros(2)]
        dist.all_gather(gathered, torch.full((2,), 5.0))
        assert torch.equal(gathered[0], torch.full((2,), 5.0))
        assert [(name, call.kind, call.nbytes, call.async_op) for name, call in seen] == [
            ("declining", "all_reduce", 8, True), ("declining", "all_gather", 8, False)]
    finally:
        collective_stand_ins.stop_timing_loop_calls(ident, declining)
        collective_stand_ins.stand_down(user)


def test_an_error_of_torchs_reaches_the_loop_from_one_call_never_a_second(one_rank_group: None, monkeypatch: Any) -> None:
    """torch refusing a call (here one the loop's timer issues) raises to the loop as it would
    have; the call is not made again."""
    calls: list[bool] = []

    def refusing(*args: Any, **kwargs: Any) -> Any:
        calls.append(True)
        raise RuntimeError("refused by torch")

    monkeypatch.setattr(dist, "all_gather", refusing)  # torch's, as the stand-in finds it
    timer = timer_recording([], "loop")
    user = object()
    collective_stand_ins.stand_in(user)
    ident = collective_stand_ins.time_loop_calls(timer)
    try:
        assert dist.all_gather is STAND_INS["all_gather"]
        try:
            dist.all_gather([torch.zeros(2)], torch.ones(2), async_op=True)
        except RuntimeError as error:
            assert str(error) == "refused by torch"
        else:
            raise AssertionError("torch's error did not reach the loop")
    finally:
        collective_stand_ins.stop_timing_loop_calls(ident, timer)
        collective_stand_ins.stand_down(user)
    assert calls == [True] and dist.all_gather is refusing


def test_a_compiled_loop_calling_the_collectives_traces_them_into_its_graph_as_without_the_stand_ins(one_rank_group: None) -> None:
    """``torch.compile(fullgraph=True)`` of a step that all-reduces with an explicit op and
    all-gathers: Dynamo rewrites both into functional collectives, as it does torch's own. Before
    the stand-ins were in Dynamo's table it inlined them, and the all-reduce's ``ReduceOp`` met a
    check made against ``dist.all_reduce`` by name (ours): fullgraph failed (*'RedOpType' object
    has no attribute 'lower'*)."""

    def step(x: torch.Tensor) -> torch.Tensor:
        y = x * 2
        dist.all_reduce(y, dist.ReduceOp.SUM)
        gathered = [torch.zeros(3)]
        dist.all_gather(gathered, y)
        return gathered[0] + 1

    user = object()
    collective_stand_ins.stand_in(user)
    ident = collective_stand_ins.time_loop_calls(timer_recording([], "loop"))
    try:
        torch._dynamo.reset()
        compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
        assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    finally:
        collective_stand_ins._loop_timers.pop(ident, None)
        collective_stand_ins.stand_down(user)
        torch._dynamo.reset()
    from torch.distributed._functional_collectives import traceable_collective_remaps
    assert not set(STAND_INS.values()) & set(traceable_collective_remaps)  # gone with them
