"""A user's DDP with a communication hook of its own (gradient compression) is attached: DDP keeps
the hook, and the all-reduces it issues are timed as it issues them (``hooked_collectives``).
In one process over a one-rank gloo group; three ranks under Accelerate's fp16 hook are in
``test_attach_end_to_end.py``."""

from __future__ import annotations

import contextlib
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from instrumented_ddp.timing import collective_stand_ins
from instrumented_ddp.timing import hooked_collectives
from instrumented_ddp.wire.messages import Hello, StepReport
from launch import free_port
from attach_helpers import attached, make_ddp, train, untouched

TORCHS_ALL_REDUCE = dist.distributed_c10d.all_reduce


def hooked_pair(hook: Any, state: Any = None, bucket_mb: float = 0.001) -> dict[str, tuple[DistributedDataParallel, torch.optim.Optimizer]]:
    """Two DDPs of the same model with the same hook: ``watched`` and ``plain``, each with its optimizer."""
    runs = {}
    for mode in ("watched", "plain"):
        runs[mode] = make_ddp(bucket_mb)
        runs[mode][0].register_comm_hook(state() if callable(state) else state, hook)
    return runs


def assert_bitwise(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for x, y in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(x, y)


def test_an_fp16_hooks_all_reduces_are_timed_in_the_dtype_and_bytes_it_sends(one_rank_group: None, sent: list[Any]) -> None:
    ddp, optimizer = make_ddp()
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    with attached(ddp, optimizer):
        assert dist.all_reduce is collective_stand_ins.all_reduce
        train(ddp, optimizer, steps=3, grad_accum=2)
    assert dist.all_reduce is TORCHS_ALL_REDUCE  # torch's own again once detached
    hello = next(m for m in sent if isinstance(m, Hello))
    assert hello.settings == {"bucket_mb": 0.001, "grad_accum": 1, "comm_hook": "fp16_compress_hook"}
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [(r.step, r.excluded, r.settings["grad_accum"]) for r in reports] == [(1, True, 2), (2, False, 2), (3, False, 2)]
    float32_bytes = [int(size) for size in ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(", ")]
    for report in reports[1:]:
        hooked = [s for s in report.spans if s.kind == "all_reduce"]
        # one all-reduce a bucket, in DDP's bucket order, each half its bucket: the hook sends float16
        assert [(s.tag, s.dtype, s.nbytes, s.blocking) for s in hooked] == [
            (f"h{k}", "float16", size // 2, False) for k, size in enumerate(float32_bytes)]
        waits = [s for s in report.spans if s.kind == "wait"]
        # from the last one's issue, which is its start unless gloo's worker was still busy with the
        # one before (then it starts later: it failed 2 runs in 8 with the box loaded, ``==`` asked)
        last_backward = [s for s in report.spans if s.kind == "backward"][-1]
        assert len(waits) == 1 and waits[0].blocking and last_backward.start <= waits[0].start <= hooked[-1].start
    assert [r.untimed_collectives for r in reports[1:]] == [2, 0]  # step 2's: DDP broadcasts its rebuilt buckets


def test_an_attached_ddp_with_its_own_hook_trains_bitwise_as_unattached_and_again_after_detach(
        one_rank_group: None, sent: list[Any]) -> None:
    """The hook is the user's: nothing ddpwatch does changes a bit. A second ``attach`` (a
    Trainer's second ``train()``) times the same hook again."""
    runs = hooked_pair(default_hooks.fp16_compress_hook)
    ddp, optimizer = runs["watched"]
    with attached(ddp, optimizer):
        train(ddp, optimizer, steps=2, grad_accum=2)
    train(ddp, optimizer, steps=1)  # between the two: the hook alone, untimed
    first_run = len(sent)
    with attached(ddp, optimizer):
        train(ddp, optimizer, steps=2)
    plain, plain_optimizer = runs["plain"]
    train(plain, plain_optimizer, steps=2, grad_accum=2)
    train(plain, plain_optimizer, steps=1)
    train(plain, plain_optimizer, steps=2)
    assert_bitwise(ddp, plain)
    assert untouched(ddp, optimizer, comm_hooks=1)  # the user's hook, and no other
    again = [m for m in sent[first_run:] if isinstance(m, StepReport)]
    assert [r.settings.get("comm_hook") for r in again] == ["fp16_compress_hook"] * 2
    assert all({s.dtype for s in r.spans if s.kind == "all_reduce"} == {"float16"} for r in again)


def test_the_hooks_all_reduce_is_issued_whatever_ddpwatchs_bookkeeping_raises(one_rank_group: None, sent: list[Any],
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Training never fails because of telemetry: a timeline that cannot open the span still
    issues the user's all-reduce, and the run trains on as unwatched."""
    runs = hooked_pair(default_hooks.fp16_compress_hook)
    ddp, optimizer = runs["watched"]
    with attached(ddp, optimizer) as watch:
        def broken(*_args: Any, **_kwargs: Any) -> None:
            raise RuntimeError("a bug in ddpwatch")

        monkeypatch.setattr(watch.timeline, "open_collective", broken)
        train(ddp, optimizer, steps=3)
    train(*runs["plain"], steps=3)
    assert_bitwise(ddp, runs["plain"][0])
    assert [r.step for r in sent if isinstance(r, StepReport)] == [1, 2, 3]


def test_powersgds_collectives_are_each_timed_or_counted_untimed(one_rank_group: None, sent: list[Any]) -> None:
    """PowerSGD (compressing from its 3rd iteration) all-reduces a bucket's vectors, then its P
    matrices, then its Q matrices, the last two from completion callbacks: on gloo those run on
    gloo's thread, unseen, unless the collective before had completed when the callback was
    chained (then at once, on the backward's thread, seen). Which is a race; that every one is
    either timed or counted untimed is not. One bucket: PowerSGD's callbacks wait on gloo's
    workers, which several buckets can all hold."""
    runs = hooked_pair(powerSGD_hook.powerSGD_hook, bucket_mb=25,  # a state each: PowerSGD keeps its iteration count in it
                       state=lambda: powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=3))
    ddp, optimizer = runs["watched"]
    with attached(ddp, optimizer):
        train(ddp, optimizer, steps=5)
    train(*runs["plain"], steps=5)
    assert_bitwise(ddp, runs["plain"][0])
    reports = [m for m in sent if isinstance(m, StepReport)]
    issued = [sum(s.kind == "all_reduce" for s in r.spans) + r.untimed_collectives for r in reports]
    # one plain all-reduce a step for 3 steps (step 2's 2 more: DDP broadcasting its rebuilt buckets), then 3:
    # the vectors, P and Q; the first always seen (issued in the hook), P and Q where the race went our way
    assert issued == [1, 3, 1, 3, 3]
    assert all(sum(s.kind == "all_reduce" for s in r.spans) >= 1 for r in reports[3:])
    assert {r.settings["comm_hook"] for r in reports} == {"powerSGD_hook"}


class AllReduceInBackward(torch.autograd.Function):
    """An all-reduce issued inside backward, as a SyncBatchNorm's or a hook's is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, async_op: bool) -> torch.Tensor:  # noqa: ANN401
        ctx.async_op = async_op
        return x.clone()

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN401
        work = dist.all_reduce(gradient.clone(), async_op=ctx.async_op)
        if work is not None:
            work.wait()
        return gradient, None


def test_post_local_sgds_all_reduces_on_its_subgroup_wait_in_that_groups_queue_not_ddps(one_rank_group: None) -> None:
    """PostLocalSGD all-reduces each bucket on DDP's group for its first iterations, then on an
    intra-node subgroup (``post_localSGD_hook``): each call is timed in its own group's queue
    (``collectives.queue_of``), since each group has its own gloo threads and NCCL stream, and the
    training is the unattached hook's, bit for bit."""
    from torch.distributed.algorithms.ddp_comm_hooks import post_localSGD_hook

    subgroup = dist.new_group([0])
    runs = hooked_pair(post_localSGD_hook.post_localSGD_hook,
                       lambda: post_localSGD_hook.PostLocalSGDState(process_group=None, subgroup=subgroup, start_localSGD_iter=3))
    queues: list[tuple[str, str]] = []
    with attached(*runs["watched"]) as watch:
        def opening(kind: str, nbytes: int, tag: str, *args: Any, _open: Any = watch.timeline.open_collective,
                    **kwargs: Any) -> Any:
            queues.append((tag, kwargs.get("queue", "")))
            return _open(kind, nbytes, tag, *args, **kwargs)
        watch.timeline.open_collective = opening  # type: ignore[method-assign]  # the watcher's own, seen on its way
        for mode in ("watched", "plain"):
            train(*runs[mode], steps=5)
    assert_bitwise(runs["watched"][0], runs["plain"][0])
    # one bucket before DDP rebuilds them after its first step, three after; DDP's group for three steps
    group = f"group {subgroup.group_name}"
    assert [queue for tag, queue in queues if tag.startswith("h")] == [""] * (1 + 3 + 3) + [group] * (3 + 3)


def test_only_asynchronous_all_reduces_inside_a_watched_threads_backward_are_the_hooks(one_rank_group: None) -> None:
    """What the stand-in takes for the hook's: an asynchronous all-reduce on the watched thread,
    inside the autograd engine. Passed through untimed: one outside a backward (the loop's own
    loss all-reduce), a blocking one inside (a SyncBatchNorm's), and one from another thread
    (PowerSGD's callbacks on gloo's)."""
    timed: list[tuple[int, bool]] = []

    def timer(all_reduce: Any, tensor: torch.Tensor, op: Any, group: Any) -> Any:
        timed.append((tensor.numel(), threading.get_ident() == watched))
        return all_reduce(tensor, op=op, group=group, async_op=True)

    owner = object()
    collective_stand_ins.stand_in(owner)
    watched = hooked_collectives.watch_thread(timer, frozenset())
    try:
        dist.all_reduce(torch.ones(2), async_op=True).wait()  # outside any backward
        x = torch.ones(3, requires_grad=True)
        AllReduceInBackward.apply(x, False).sum().backward()  # blocking, in backward
        assert timed == []
        AllReduceInBackward.apply(x, True).sum().backward()  # asynchronous, in backward: the hook's kind
        assert timed == [(3, True)]
        elsewhere = threading.Thread(target=lambda: AllReduceInBackward.apply(x, True).sum().backward())
        elsewhere.start()
        elsewhere.join()
        assert timed == [(3, True)]
    finally:
        hooked_collectives.unwatch_thread(watched, timer)
        collective_stand_ins.stand_down(owner)
    assert dist.all_reduce is TORCHS_ALL_REDUCE


def test_a_stand_in_put_over_ours_stays_when_we_stand_down(one_rank_group: None) -> None:
    """Someone else's wrapper of ``dist.all_reduce``, put there after ours, is theirs to remove:
    ours, left under it, passes every call through; standing in again later never takes ours
    for torch's."""
    owner = object()
    collective_stand_ins.stand_in(owner)
    theirs = lambda *args, **kwargs: collective_stand_ins.all_reduce(*args, **kwargs)  # noqa: E731
    dist.all_reduce = theirs
    try:
        collective_stand_ins.stand_down(owner)
        assert dist.all_reduce is theirs
        tensor = torch.ones(2)
        dist.all_reduce(tensor)
        assert torch.equal(tensor, torch.ones(2))
        dist.all_reduce = collective_stand_ins.all_reduce  # they put back what they found: ours
        collective_stand_ins.stand_in(owner)
        collective_stand_ins.stand_down(owner)
        assert dist.all_reduce is TORCHS_ALL_REDUCE
    finally:
        dist.all_reduce = TORCHS_ALL_REDUCE


def test_a_hook_registered_after_attach_is_refused_saying_to_register_it_before(one_rank_group: None) -> None:
    """DDP's own refusal said only that ``register_comm_hook`` *can only be called once*."""
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer):
        for register in (lambda: ddp.register_comm_hook(None, default_hooks.fp16_compress_hook),
                         lambda: ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)):
            with pytest.raises(RuntimeError, match="^DistributedDataParallel.register_comm_hook after instrumented_ddp.attach: "
                                                   ".* register yours before attach"):
                register()
        train(ddp, optimizer, steps=1)  # on, with ddpwatch's hook
    assert len(ddp._comm_hooks) == 1


@pytest.mark.parametrize(("hook", "name"), [(default_hooks.bf16_compress_hook, "bf16_compress_hook"),
                                            (default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
                                             "fp16_compress_wrapper_hook")])
def test_the_hook_is_named_as_the_user_wrote_it(hook: Any, name: str) -> None:
    assert hooked_collectives.hook_name(hook) == name


def test_the_trainer_callback_watches_a_ddp_accelerate_gave_a_compression_hook(one_rank_group: None, sent: list[Any]) -> None:
    """Accelerate registers ``DistributedDataParallelKwargs(comm_hook=...)``'s hook in ``prepare``,
    before ``on_train_begin``: ``attach`` refused it, and the run went unwatched."""
    from instrumented_ddp.integrations import DDPWatchCallback

    ddp, optimizer = make_ddp()
    ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    callback = DDPWatchCallback(SimpleNamespace(model_wrapped=ddp, optimizer=optimizer), address=f"tcp://127.0.0.1:{free_port()}")
    callback.on_train_begin(None, SimpleNamespace(max_steps=3), None)
    assert callback.attachment is not None
    train(ddp, optimizer, steps=2)
    callback.on_train_end(None, None, None)
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.settings["comm_hook"] for r in reports] == ["fp16_compress_hook"] * 2
    assert {s.dtype for s in reports[-1].spans if s.kind == "all_reduce"} == {"float16"}


def test_two_hooked_ddps_in_one_backward_each_time_their_own_all_reduces(
        one_rank_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A GAN: the generator's step runs one backward through the discriminator and the
    generator, two attached DDPs each with an fp16 hook, both watching the thread. Each
    all-reduce is its own model's: the discriminator's 9 float32 gradients travel as 18 bytes, the
    generator's 72 as 144, in every step of each."""
    torch.manual_seed(0)
    generator_ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
    discriminator_ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizers = {}
    for ddp in (generator_ddp, discriminator_ddp):
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        optimizers[ddp] = torch.optim.SGD(ddp.parameters(), lr=0.1)
    reports: dict[str, list[StepReport]] = {"generator": [], "discriminator": []}
    with contextlib.ExitStack() as watches:
        for name, ddp in (("generator", generator_ddp), ("discriminator", discriminator_ddp)):
            watch = watches.enter_context(attached(ddp, optimizers[ddp]))
            monkeypatch.setattr(watch.watch.publisher, "publish",
                                lambda message, into=reports[name]: into.append(message) if isinstance(message, StepReport) else None)
        for step in range(4):
            noise = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            optimizers[discriminator_ddp].zero_grad()
            discriminator_ddp(generator_ddp(noise).detach()).mean().backward()  # through the discriminator alone
            optimizers[discriminator_ddp].step()
            optimizers[generator_ddp].zero_grad()
            (-discriminator_ddp(generator_ddp(noise)).mean()).backward()  # through both
            optimizers[generator_ddp].step()
    hooked = {name: [[(s.tag, s.nbytes) for s in r.spans if s.tag.startswith("h")] for r in rs] for name, rs in reports.items()}
    assert len(hooked["generator"]) == 4 and all(spans == [("h0", 144)] for spans in hooked["generator"]), hooked
    assert len(hooked["discriminator"]) >= 4 and all(spans == [("h0", 18)] for spans in hooked["discriminator"]), hooked


def test_a_hooks_call_is_timed_by_the_watcher_whose_parameters_gradient_is_being_accumulated(one_rank_group: None) -> None:
    """Two backwards watched on one thread: a call made while the engine accumulates ``a``'s
    gradient is the watcher of ``a``'s, ``b``'s of ``b``'s, and one for ``c``, which no watcher
    holds (a DDP nobody attached), passes untimed; before, the watcher begun last took all three.
    Outside an accumulation (a DDP launching a bucket at the end of backward) the only watcher
    takes it, and with two, none."""
    parameters = {name: torch.nn.Parameter(torch.ones(size)) for name, size in (("a", 2), ("b", 3), ("c", 4))}
    timed: list[tuple[str, int]] = []

    def timer_of(name: str) -> Any:
        def timer(all_reduce: Any, tensor: torch.Tensor, op: Any, group: Any) -> Any:
            timed.append((name, tensor.numel()))
            return all_reduce(tensor, op=op, group=group, async_op=True)
        return timer

    def all_reduce_its_gradient(parameter: torch.Tensor) -> None:  # as a hook does, as DDP accumulates it
        dist.all_reduce(parameter.grad.clone(), async_op=True).wait()

    for parameter in parameters.values():
        parameter.register_post_accumulate_grad_hook(all_reduce_its_gradient)
    timers = {name: timer_of(name) for name in ("a", "b")}
    owner = object()
    collective_stand_ins.stand_in(owner)
    watched = {name: hooked_collectives.watch_thread(timers[name], frozenset({id(parameters[name])})) for name in ("a", "b")}
    try:
        sum(p.sum() for p in parameters.values()).backward()
        assert sorted(timed) == [("a", 2), ("b", 3)]
        x = torch.ones(5, requires_grad=True)
        AllReduceInBackward.apply(x, True).sum().backward()  # not in an accumulation, two watching: untimed
        assert len(timed) == 2
        hooked_collectives.unwatch_thread(watched.pop("a"), timers["a"])
        AllReduceInBackward.apply(x, True).sum().backward()
        assert timed[2:] == [("b", 5)]
    finally:
        for name, ident in watched.items():
            hooked_collectives.unwatch_thread(ident, timers[name])
        collective_stand_ins.stand_down(owner)
    assert hooked_collectives._watchers == {}
