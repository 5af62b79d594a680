"""The collectives an attached loop issues itself (a loss all-reduced for the log, the Trainer's
gathers, a broadcast): timed where it issues them as collectives of their kind, ``l<k>``, or
counted where they cannot be, in the queue of their own process group. In one process over a
one-rank gloo group."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import threading
from msgspec.structs import replace
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from instrumented_ddp.timing import collective_stand_ins, users_code
from instrumented_ddp.wire.messages import StepReport
from attach_helpers import attached, batch, make_ddp, sharded_classifier


def test_the_loops_own_collectives_are_timed_where_it_issues_them_and_a_barrier_as_its_wait(
        one_rank_group: None, sent: list[Any]) -> None:
    """A loss all-reduced every other step before the update (as a gradient norm would be) is
    timed as the loop's (``l0``: blocking, its 4 bytes; ``collective_stand_ins``); in step 5 an
    asynchronous one is too, not blocking, and the loop's wait for it is a ``wait`` span of the
    step after its issue, ending once it has (``WaitedByTheLoop``). A barrier in step 3 carries
    nothing: it is the time the rank sat in it, a blocking ``wait`` tagged ``barrier``, one of the
    step's timed collectives (counted untimed before). The two broadcasts DDP issues itself in
    its second forward, where it rebuilds its buckets (their count, then their order), are
    counted untimed in their step (``issued_collectives``). DDP's buckets are timed as always."""
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer):
        for step in range(1, 6):
            optimizer.zero_grad()
            ddp(**batch(step)).loss.backward()
            if step % 2 == 0:
                dist.all_reduce(torch.ones(1))
            if step == 3:
                dist.barrier()
            if step == 5:
                reduced = torch.ones(1)
                work = dist.all_reduce(reduced, async_op=True)
                assert work.wait() is True and work.is_completed() and reduced.item() == 1.0
            optimizer.step()
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.untimed_collectives for r in reports] == [0, 2, 0, 0, 0]
    assert [[(s.kind, s.blocking) for s in r.spans if s.tag == "barrier"] for r in reports] == [[], [], [("wait", True)], [], []]
    loops = [[(s.kind, s.tag, s.nbytes, s.dtype, s.blocking) for s in r.spans if s.tag.startswith("l")] for r in reports]
    assert loops == [[], [("all_reduce", "l0", 4, "float32", True)], [], [("all_reduce", "l0", 4, "float32", True)],
                     [("all_reduce", "l0", 4, "float32", False)]]
    assert [sum(s.kind == "all_reduce" and s.tag.startswith("b") for s in r.spans) for r in reports] == [1, 3, 3, 3, 3]
    assert [[s.blocking for s in r.spans if s.kind == "wait" and s.tag != "barrier"] for r in reports] == [[True]] * 4 + [[True, True]]  # DDP's; the loop's
    (issued,) = [s for s in reports[4].spans if s.tag == "l0"]
    (backward,) = [s for s in reports[4].spans if s.kind == "backward"]
    (waited,) = [s for s in reports[4].spans if s.kind == "wait" and s.start >= backward.end]
    (optimizer_phase,) = [s for s in reports[4].spans if s.kind == "optimizer"]
    # the gap after the last backward is the optimizer's: the wait is blocked time inside it, not its compute
    assert optimizer_phase.start <= issued.start <= waited.start and issued.end <= waited.end <= optimizer_phase.end


def test_the_loops_asynchronous_collective_waited_on_another_thread_is_timed_and_that_wait_is_no_steps(
        one_rank_group: None, sent: list[Any]) -> None:
    """A loop may hand its work to a thread of its own (a logger waiting for a loss all-reduced
    in the background): the collective is the loop's, timed, but that thread's wait blocks no
    step of the loop's, and the CPU clock's looks are the loop thread's alone. A gloo
    reduce-scatter, whose end only its wait gives, ends there."""
    ddp, optimizer = make_ddp()
    results: list[list[float]] = []
    with attached(ddp, optimizer) as watch:
        clock = watch.timeline.clock
        looked_from: set[int] = set()
        for name in ("stamp", "poll"):
            def looking(*args: Any, _original: Any = getattr(clock, name), **kwargs: Any) -> Any:
                looked_from.add(threading.get_ident())
                return _original(*args, **kwargs)
            setattr(clock, name, looking)
        for step in range(1, 4):
            optimizer.zero_grad()
            ddp(**batch(step)).loss.backward()
            reduced, scattered = torch.full((2,), float(step)), torch.zeros(1)
            works = [dist.all_reduce(reduced, async_op=True),
                     dist.reduce_scatter_tensor(scattered, torch.full((1,), 2.0 * step), async_op=True)]
            waiter = threading.Thread(target=lambda: [work.wait() for work in works])
            waiter.start()
            waiter.join()
            results.append([*reduced.tolist(), *scattered.tolist()])
            optimizer.step()
    assert results == [[s, s, 2 * s] for s in (1.0, 2.0, 3.0)]
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [[(s.kind, s.tag, s.blocking) for s in r.spans if s.tag.startswith("l")] for r in reports] == [
        [("all_reduce", "l0", False), ("reduce_scatter", "l1", False)]] * 3
    assert [sum(s.kind == "wait" for s in r.spans) for r in reports] == [1, 1, 1]  # DDP's alone
    assert looked_from == {threading.get_ident()}
    assert all(s.start <= s.end for r in reports for s in r.spans)


def test_the_loops_collective_on_another_process_group_waits_in_that_groups_queue_not_ddps(
        one_rank_group: None, sent: list[Any]) -> None:
    """Each process group has its own gloo threads and its own NCCL stream: a loop's collective
    on DDP's group (the default, named or not) waits in DDP's queue, "", and one on any other
    group (a metric on a gloo side group) in that group's, so that replaying the queues for
    starts (``StepTimeline``) never makes it wait for DDP's buckets, nor them for it. An FSDP2
    model's own group is its mesh's shard dimension: here the default group."""
    side, other = dist.new_group([0]), dist.new_group([0])
    models: list[tuple[Any, Any]] = [make_ddp(), sharded_classifier()]
    for model, optimizer in models:
        queues: list[tuple[str, str]] = []
        with attached(model, optimizer) as watch:
            def opening(kind: str, nbytes: int, tag: str, *args: Any, _open: Any = watch.timeline.open_collective,
                        **kwargs: Any) -> Any:
                queues.append((tag, kwargs.get("queue", "")))
                return _open(kind, nbytes, tag, *args, **kwargs)
            watch.timeline.open_collective = opening  # type: ignore[method-assign]  # the watcher's own, seen on its way
            optimizer.zero_grad()
            model(**batch(1)).loss.backward()
            dist.all_reduce(torch.ones(1))
            dist.all_reduce(torch.ones(1), group=dist.group.WORLD)
            dist.all_reduce(torch.ones(1), group=side)
            dist.all_reduce(torch.ones(1), group=other, async_op=True).wait()
            dist.broadcast(torch.ones(1), src=0, group=side)
            optimizer.step()
        assert [q for q in queues if q[0].startswith("l")] == [
            ("l0", ""), ("l1", ""), ("l2", f"group {side.group_name}"), ("l3", f"group {other.group_name}"),
            ("l4", f"group {side.group_name}")]
        assert all(queue == "" for tag, queue in queues if not tag.startswith("l"))  # DDP's buckets


def test_on_a_gpu_the_loops_collective_is_timed_only_on_cuda_tensors_through_nccl_and_else_counted(
        one_rank_group: None, sent: list[Any]) -> None:
    """A GPU step is timed by CUDA events and NCCL's durations: a metric all-reduced on the CPU
    over a gloo side group has neither (with NCCL timing on, gloo's work has no duration and the
    step went out unresolved), so it is counted untimed there. The host's clock, on the CPU,
    times any call; on a GPU a call on CUDA tensors is timed where its group's CUDA backend is
    NCCL (a gloo group reduces CUDA tensors too, and is not)."""
    from instrumented_ddp.timing.collective_stand_ins import LoopCall

    class NcclGroup:
        def _get_backend(self, device: torch.device) -> Any:
            return SimpleNamespace(name=lambda: "nccl" if device.type == "cuda" else "gloo")

    def call(device: str, group: Any = None) -> LoopCall:
        return LoopCall("all_reduce", 4, "float32", group, False, device)

    ddp, optimizer = make_ddp()
    nccl = NcclGroup()
    with attached(ddp, optimizer) as watch:
        assert watch._on_the_steps_clock(call("cpu")) and watch._on_the_steps_clock(call("cpu", nccl))
        watch.device = torch.device("cuda")  # what a model on a GPU is attached on
        assert not watch._on_the_steps_clock(call("cpu")) and not watch._on_the_steps_clock(call("cpu", nccl))
        assert not watch._on_the_steps_clock(call("cuda"))  # the default group here is gloo's
        assert watch._on_the_steps_clock(call("cuda", nccl)) and watch._on_the_steps_clock(call("cuda", nccl))
        for step in range(1, 3):
            optimizer.zero_grad()
            ddp(**batch(step)).loss.backward()
            dist.all_reduce(torch.ones(1))  # a CPU metric: counted, not timed
            optimizer.step()
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [[s.tag for s in r.spans if s.tag.startswith("l")] for r in reports] == [[], []]
    assert [r.untimed_collectives for r in reports] == [1, 3]  # and step 2's DDP's two rebuild broadcasts


def test_the_loops_collectives_coalesced_by_torch_pass_through_and_are_counted(one_rank_group: None,
                                                                                sent: list[Any]) -> None:
    """Inside ``_coalescing_manager`` torch issues nothing at each call, only one coalesced
    collective at the block's end: a call timed as the loop's there waited on an ``_IllegalWork``
    (ValueError), and the next block found the first one's op list left behind. Each block's one
    collective is counted untimed; the user's tensors hold what torch gives them."""
    ddp, optimizer = make_ddp()
    reduced: list[list[float]] = []
    with attached(ddp, optimizer):
        for step in range(1, 4):
            optimizer.zero_grad()
            ddp(**batch(step)).loss.backward()
            one, two = torch.full((2,), float(step)), torch.full((3,), 2.0 * step)
            with dist._coalescing_manager(async_ops=step == 3) as coalesced:
                dist.all_reduce(one)
                dist.all_reduce(two)
            if step == 3:
                coalesced.wait()
            reduced.append([*one.tolist(), *two.tolist()])
            optimizer.step()
    assert reduced == [[s, s, 2 * s, 2 * s, 2 * s] for s in (1.0, 2.0, 3.0)]
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [[s.tag for s in r.spans if s.tag.startswith("l")] for r in reports] == [[], [], []]
    assert [r.untimed_collectives for r in reports] == [1, 2 + 1, 1]  # step 2: DDP's two rebuilt-bucket broadcasts too


def test_the_loops_own_collectives_between_a_backward_and_the_next_forward_are_counted_as_in_its_data(
        one_rank_group: None, sent: list[Any]) -> None:
    """Where the loop's own collective falls says what its time reads as: in the data gap before a
    forward (a loss all-reduced for logging after the update, which is the next step's gap; a
    gather before the forward, as the Trainer's label count; one between two micro-steps) it
    reads as data loading, a wait in it for a slower rank included; before the update, as the
    optimizer's. Two micro-steps a step. Step 2 also holds DDP's two rebuilt-bucket broadcasts,
    issued in its forward: untimed, not in its data. The loop's collectives here are issued
    through the process group itself (``group.allreduce``, as a hook may), which ddpwatch cannot
    time (the functions of ``torch.distributed`` it can: the next tests)."""

    def untimed() -> None:
        dist.distributed_c10d._get_default_group().allreduce([torch.ones(1)]).wait()

    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer):
        for step in range(1, 5):
            if step >= 2:
                untimed()  # before the step's first forward: its data
            optimizer.zero_grad()
            for micro in range(2):
                with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    ddp(**batch(step)).loss.backward()
                if micro == 0 and step == 3:
                    untimed()  # between the micro-steps: data too
            if step == 4:
                untimed()  # before the update: the optimizer's
            optimizer.step()
            untimed()  # after the update: the next step's data
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.untimed_collectives for r in reports] == [0, 1 + 1 + 2, 1 + 1 + 1, 1 + 1 + 1]
    assert [r.untimed_in_data for r in reports] == [0, 2, 3, 2]
    assert [sum(s.kind == "all_reduce" for s in r.spans) for r in reports] == [1, 3, 3, 3]  # DDP's buckets: timed


def test_the_loops_synchronous_collectives_in_its_data_time_are_timed_there_as_collectives_of_their_kind(
        one_rank_group: None, sent: list[Any]) -> None:
    """The Trainer's gathers before each forward (``all_gather`` on gloo, ``all_gather_into_tensor``
    on NCCL, as Accelerate's ``gather`` picks), a broadcast, a reduce-scatter of each form, a reduce,
    an all-to-all of each form, a gather and a scatter, in the data gap: spans of their
    kind inside the ``data`` span, numbered ``l0, l1, ...`` in each step, with the bytes
    nccl-tests counts (an all-gather's output, a reduce-scatter's and an all-to-all's input, a
    gather's and a scatter's piece times the ranks: here one); none left untimed. Not the loop's and so not
    timed: what an evaluation issues inside ``paused`` (the pause's, in no step), and a call on
    another thread (counted). The user's tensors hold what torch's own functions give."""
    ddp, optimizer = make_ddp()
    gathered: list[list[float]] = []
    exchanged: list[list[float]] = []
    with attached(ddp, optimizer) as watch:
        for step in range(1, 4):
            labels = [torch.zeros(2)]
            dist.all_gather(labels, torch.full((2,), float(step)))
            into = torch.zeros(3, dtype=torch.float64)
            dist.all_gather_into_tensor(into, torch.full((3,), 2.0 * step, dtype=torch.float64))
            seed = torch.tensor([step], dtype=torch.int64)
            dist.broadcast(seed, src=0)
            scattered = torch.zeros(2)
            dist.reduce_scatter_tensor(scattered, torch.full((2,), 3.0 * step))  # gloo's work has no future
            listed = torch.zeros(3)
            dist.reduce_scatter(listed, [torch.full((3,), 4.0 * step)])  # the list form: one tensor a rank
            logged = torch.full((1,), 5.0 * step, dtype=torch.float64)
            dist.reduce(logged, dst=0)  # a loss reduced to rank 0 for its log
            gathered.append([*labels[0].tolist(), *into.tolist(), float(seed), *scattered.tolist(), *listed.tolist(), float(logged)])
            dispatched = torch.zeros(2)
            dist.all_to_all_single(dispatched, torch.full((2,), 6.0 * step))  # a mixture of experts' dispatch
            combined = [torch.zeros(3)]
            dist.all_to_all(combined, [torch.full((3,), 7.0 * step)])  # and its combine, in the list form
            predictions = [torch.zeros(2)]
            dist.gather(torch.full((2,), 8.0 * step), predictions, dst=0)  # an evaluation's predictions to rank 0
            shard = torch.zeros(3)
            dist.scatter(shard, [torch.full((3,), 9.0 * step)], src=0)
            exchanged.append([*dispatched.tolist(), *combined[0].tolist(), *predictions[0].tolist(), *shard.tolist()])
            optimizer.zero_grad()
            ddp(**batch(step)).loss.backward()
            optimizer.step()
            if step == 2:
                with watch.paused("evaluate"):
                    dist.all_reduce(torch.ones(1))
                elsewhere = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1)))
                elsewhere.start()
                elsewhere.join()
    assert gathered == [[s, s, 2.0 * s, 2.0 * s, 2.0 * s, s, 3.0 * s, 3.0 * s, 4.0 * s, 4.0 * s, 4.0 * s, 5.0 * s] for s in (1.0, 2.0, 3.0)]
    assert exchanged == [[6.0 * s] * 2 + [7.0 * s] * 3 + [8.0 * s] * 2 + [9.0 * s] * 3 for s in (1.0, 2.0, 3.0)]
    reports = [m for m in sent if isinstance(m, StepReport)]
    # step 1's gathers come before its first forward, before the step began: issued outside any step
    assert [[(s.kind, s.tag, s.nbytes, s.dtype, s.blocking) for s in r.spans if s.tag.startswith("l")] for r in reports] == [
        [], *[[("all_gather", "l0", 8, "float32", True), ("all_gather", "l1", 24, "float64", True),
               ("broadcast", "l2", 8, "int64", True), ("reduce_scatter", "l3", 8, "float32", True),
               ("reduce_scatter", "l4", 12, "float32", True), ("reduce", "l5", 8, "float64", True),
               ("all_to_all", "l6", 8, "float32", True), ("all_to_all", "l7", 12, "float32", True),
               ("gather", "l8", 8, "float32", True), ("scatter", "l9", 12, "float32", True)]] * 2]
    for report in reports[1:]:
        (data,) = [s for s in report.spans if s.kind == "data"]
        assert all(data.start <= s.start <= s.end <= data.end for s in report.spans if s.tag.startswith("l"))
    assert [(r.untimed_collectives, r.untimed_in_data) for r in reports] == [(0, 0), (2, 0), (1, 1)]  # DDP's broadcasts; the thread's


class ExpertExchange(torch.nn.Module):
    """A mixture of experts' dispatch and combine around its experts, as most exchange tokens:
    ``torch.distributed.nn``'s all-to-all, whose backward all-to-alls the gradients back."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.Linear(16, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        from torch.distributed.nn.functional import all_to_all_single

        # the group named at each call: the function's default is the world at its module's first
        # import, here an earlier test's group, destroyed since (whose counts are no longer read)
        dispatched = all_to_all_single(torch.empty_like(tokens), tokens, group=dist.group.WORLD)
        return all_to_all_single(torch.empty_like(tokens), self.experts(dispatched), group=dist.group.WORLD)


def test_collectives_inside_the_training_forward_are_timed_there_blocking_and_the_backwards_are_counted(
        one_rank_group: None, sent: list[Any]) -> None:
    """A mixture of experts' all-to-alls in its forward (two a step: dispatch, combine) were counted
    untimed, their time read as the forward's compute. They are the loop's blocking spans inside the
    forward's, 256 bytes each (4 pooled sequences of 16 float32s), which the step's Compute% leaves
    out. Their backward's two all-to-alls run inside autograd: still counted untimed, as a
    SyncBatchNorm's backward all-reduce is. Training is the unwatched loop's, bit for bit."""
    from attach_helpers import Output, TinyClassifier
    from instrumented_ddp.wire.step_figures import step_figures

    class ClassifierWithExperts(TinyClassifier):
        def __init__(self) -> None:
            super().__init__()
            self.exchange = ExpertExchange()

        def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> Output:
            logits = self.head(self.exchange(self.body(self.embed(input_ids)).mean(dim=1)))
            return Output(loss=torch.nn.functional.cross_entropy(logits, labels), logits=logits)

    def run(watched: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(ClassifierWithExperts(), bucket_cap_mb=0.001)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        with attached(ddp, optimizer) if watched else contextlib.nullcontext():
            for step in range(1, 5):
                optimizer.zero_grad()
                ddp(**batch(step)).loss.backward()
                optimizer.step()
        return [p.detach().clone() for p in ddp.parameters()]

    watched = run(watched=True)
    assert all(torch.equal(a, b) for a, b in zip(watched, run(watched=False), strict=True))
    reports = [m for m in sent if isinstance(m, StepReport)]
    loops = [[(s.kind, s.tag, s.nbytes, s.blocking) for s in r.spans if s.tag.startswith("l")] for r in reports]
    assert loops == [[("all_to_all", "l0", 256, True), ("all_to_all", "l1", 256, True)]] * 4
    assert [r.untimed_collectives for r in reports] == [2, 2 + 2, 2, 2]  # the backward's; step 2: DDP's rebuilt buckets too
    for report in reports:
        (forward,) = [s for s in report.spans if s.kind == "forward"]
        exchanges = [s for s in report.spans if s.tag.startswith("l")]
        assert all(forward.start <= s.start <= s.end <= forward.end for s in exchanges)
        share = 100.0 * sum(s.end - s.start for s in exchanges) / (report.end - report.start)
        untimed = replace(report, spans=[s for s in report.spans if s not in exchanges])  # as it read before
        assert step_figures(untimed).compute_pct - step_figures(report).compute_pct == pytest.approx(share, abs=1e-6)


def _users_module(folder: Path, name: str) -> ModuleType:
    """A module of the user's, from ``folder``, that imported torch's all-reduce by name before
    anything was attached (``from torch.distributed import all_reduce``), as a script does."""
    path = folder / f"{name}.py"
    path.write_text("from torch.distributed import all_reduce as reduce_for_the_log\n\n\n"
                    "def log(loss):\n    reduce_for_the_log(loss)\n")
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_an_all_reduce_the_users_module_imported_by_name_before_attaching_is_timed_and_torchs_again_after(
        one_rank_group: None, sent: list[Any], tmp_path: Path) -> None:
    """``from torch.distributed import all_reduce`` holds torch's function, where the module's
    look-up finds the stand-in: such a call was counted untimed, a rank waiting in it for a slower
    one read as loading its data. The user's modules have the name rebound while attached."""
    users = _users_module(tmp_path, "users_logging_module")
    try:
        ddp, optimizer = make_ddp()
        with attached(ddp, optimizer):
            assert users.reduce_for_the_log is collective_stand_ins.STAND_INS["all_reduce"]
            for step in range(1, 4):
                optimizer.zero_grad()
                ddp(**batch(step)).loss.backward()
                users.log(torch.ones(1))
                optimizer.step()
        assert users.reduce_for_the_log is dist.distributed_c10d.all_reduce  # torch's again once detached
    finally:
        del sys.modules["users_logging_module"]
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.untimed_collectives for r in reports] == [0, 2, 0]  # step 2: DDP's rebuilt-bucket broadcasts, as always
    assert [[(s.kind, s.tag, s.nbytes) for s in r.spans if s.tag.startswith("l")] for r in reports] == [
        [("all_reduce", "l0", 4)]] * 3


def test_a_librarys_module_and_a_name_someone_else_stood_in_for_first_are_left_alone(
        one_rank_group: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A library's module (under site-packages) looks the functions up as it runs, or is torch's
    own: rebound, its inner calls would be timed twice. And where another tool put its function
    in ``torch.distributed`` first, it may call the one it imported: that, made ours, would call
    theirs again, without end."""
    library = _users_module(tmp_path, "installed_library_module")
    monkeypatch.setattr(users_code, "library_folders", lambda: (str(tmp_path) + os.sep,))
    try:
        user = object()
        collective_stand_ins.stand_in(user)
        try:
            assert library.reduce_for_the_log is dist.distributed_c10d.all_reduce
        finally:
            collective_stand_ins.stand_down(user)
        monkeypatch.undo()

        def theirs(*args: Any, **kwargs: Any) -> Any:
            return library.reduce_for_the_log(*args, **kwargs)

        monkeypatch.setattr(dist, "all_reduce", theirs)
        collective_stand_ins.stand_in(user)
        try:
            assert library.reduce_for_the_log is dist.distributed_c10d.all_reduce
            dist.all_reduce(torch.ones(1))  # ours, then theirs, then torch's: once
        finally:
            collective_stand_ins.stand_down(user)
        assert dist.all_reduce is theirs
    finally:
        del sys.modules["installed_library_module"]


def test_a_barrier_is_timed_as_the_wait_it_is_where_a_collective_would_be_and_else_counted(
        one_rank_group: None, sent: list[Any]) -> None:
    """``dist.barrier()`` carries nothing: in a step, on the loop's thread, it is a blocking
    ``wait`` tagged ``barrier`` inside the phase it falls in (after the update: the next step's
    data, whose Data wait% it is not part of), and one of the step's timed collectives; so is
    an asynchronous barrier's, where the loop waits for its work (before, it passed through
    untimed). One on a group of the loop's own is tagged with the group's name. One whose work is
    never waited for, and one from another thread, pass through untimed, counted in their step, as before."""
    ddp, optimizer = make_ddp()
    side = dist.new_group([0])
    with attached(ddp, optimizer):
        for step in range(1, 5):
            optimizer.zero_grad()
            ddp(**batch(step)).loss.backward()
            optimizer.step()
            if step == 1:
                dist.barrier(async_op=True)  # never waited for: counted in step 2, untimed
            if step == 2:
                dist.barrier()  # after the update: step 3's data gap
            if step == 3:
                assert dist.barrier(async_op=True).wait()
                dist.barrier(group=side)  # on a group of the loop's own: tagged with its name
                helper = threading.Thread(target=dist.barrier)
                helper.start()
                helper.join()
    reports = [m for m in sent if isinstance(m, StepReport)]
    barriers = [[s for s in r.spans if s.tag.startswith("barrier")] for r in reports]
    assert [[(s.kind, s.tag, s.blocking, s.nbytes) for s in found] for found in barriers] == [
        [], [], [("wait", "barrier", True, 0)], [("wait", "barrier", True, 0), ("wait", f"barrier@{side.group_name}", True, 0)]]
    for step in (2, 3):  # in the next step's data gap
        (data,) = [s for s in reports[step].spans if s.kind == "data"]
        assert all(data.start <= waited.start <= waited.end <= data.end for waited in barriers[step])
    assert [r.untimed_collectives for r in reports] == [0, 3, 0, 1]  # step 2: DDP's rebuilt-bucket broadcasts and the unwaited; 4: the thread's
