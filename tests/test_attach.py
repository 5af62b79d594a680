"""``instrumented_ddp.attach``: a user's own DDP loop watched in one line, and each misuse refused
in one line with nothing changed. In one process over a one-rank gloo group; the two-rank runs
through torchrun are in ``test_attach_end_to_end.py``."""

from __future__ import annotations

import contextlib
import gc
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import _global_optimizer_post_hooks

import instrumented_ddp
from ddpwatch import exporters
from ddpwatch.recorder import load_session
from ddpwatch.session import Session
from instrumented_ddp import attachment, stop_signals
from instrumented_ddp.attachment import NOT_SWITCHABLE, AttachError, Attachment
from instrumented_ddp.protocol import Ack, Envelope, Evaluation, Goodbye, Hello, StepReport, SwitchCommand
from launch import REPO_ROOT, Recorder, free_port


class Output(dict):
    """What a Hugging Face model returns: a dict whose items are also attributes."""

    __getattr__ = dict.get


class TinyClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> Output:
        logits = self.head(self.body(self.embed(input_ids)).mean(dim=1))
        return Output(loss=nn.functional.cross_entropy(logits, labels), logits=logits)


def make_ddp(bucket_mb: float = 0.001) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(TinyClassifier(), bucket_cap_mb=bucket_mb)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)


def batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[0, 4:] = 0  # two padding positions: tokens are the mask's sum, 22
    return {"input_ids": torch.randint(0, 50, (4, 6), generator=generator), "attention_mask": mask,
            "labels": torch.randint(0, 3, (4,), generator=generator)}


def train(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, steps: int, grad_accum: int = 1,
          no_sync: bool = True) -> None:
    """The user's loop: nothing in it knows about ddpwatch. ``no_sync=False``: gradients are
    accumulated without DDP's ``no_sync``, so every micro-step's backward reduces them."""
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(grad_accum):
            with ddp.no_sync() if no_sync and micro < grad_accum - 1 else torch.enable_grad():
                (ddp(**batch(step * grad_accum + micro)).loss / grad_accum).backward()
        optimizer.step()


def untouched(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, comm_hooks: int = 0) -> bool:
    return (not ddp._forward_hooks and not ddp._forward_pre_hooks and len(ddp._comm_hooks) == comm_hooks
            and not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks)


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every message an attachment publishes, in order."""
    messages: list[Any] = []
    original = Attachment.__init__

    def init(self: Attachment, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        monkeypatch.setattr(self.watch.publisher, "publish", messages.append)

    monkeypatch.setattr(Attachment, "__init__", init)
    return messages


def attach_for_test(ddp: DistributedDataParallel, optimizer: Any) -> Attachment:
    return instrumented_ddp.attach(ddp, optimizer, address=f"tcp://127.0.0.1:{free_port()}")  # nobody listens


@contextmanager
def attached(ddp: DistributedDataParallel, optimizer: Any) -> Iterator[Attachment]:
    """Attached for the block, detached after it whatever happens."""
    watch = attach_for_test(ddp, optimizer)
    try:
        yield watch
    finally:
        watch.detach()


def test_an_attached_loop_reports_every_phase_of_every_step(one_rank_group: None, sent: list[Any]) -> None:
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer):
        train(ddp, optimizer, steps=4, grad_accum=2)
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.step for r in reports] == [1, 2, 3, 4]
    assert [r.excluded for r in reports] == [True, False, False, False]  # DDP's first iteration
    buckets = len(ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))  # after DDP's first iteration
    assert buckets == 3
    for report in reports:
        assert report.strategy == "ddp" and report.settings["grad_accum"] == 2
        assert report.samples == 8 and report.tokens == 2 * 22 and report.loss is not None
        kinds = [s.kind for s in report.spans]
        assert kinds.count("forward") == kinds.count("backward") == 2 and kinds.count("optimizer") == 1
        assert kinds.count("all_reduce") == (1 if report.excluded else buckets)  # DDP's first: one bucket of all
        assert kinds.count("wait") == 1  # no_sync: one backward of the two communicates
        # the gap after the previous step's optimizer, and the one between the two micro-steps
        assert kinds.count("data") == (2 if report.step > 1 else 1)
        forward, backward = (next(s for s in report.spans if s.kind == k) for k in ("forward", "backward"))
        (optimizer_span,) = [s for s in report.spans if s.kind == "optimizer"]
        assert forward.end <= backward.start and backward.end <= optimizer_span.start
        (wait,) = [s for s in report.spans if s.kind == "wait"]
        last_backward = [s for s in report.spans if s.kind == "backward"][-1]
        assert wait.blocking and last_backward.start <= wait.start and abs(wait.end - last_backward.end) < 1e-3
        assert report.start <= report.spans[0].start and optimizer_span.end <= report.end
    hellos = [m for m in sent if isinstance(m, Hello)]
    assert hellos and not hellos[-1].switchable and hellos[-1].global_batch == 8
    # DDP's own buckets (gradient-ready order: the head's first), every parameter once
    assert len(hellos[-1].bucket_layout) == buckets
    assert sorted(i for bucket in hellos[-1].bucket_layout for i in bucket) == list(range(len(list(ddp.parameters()))))
    assert hellos[-1].bucket_layout[0][0] == len(list(ddp.parameters())) - 1
    assert isinstance(sent[-1], Goodbye)


def test_the_loops_own_collectives_are_timed_where_it_issues_them_and_a_barrier_counted_untimed_in_its_step(
        one_rank_group: None, sent: list[Any]) -> None:
    """A loss all-reduced every other step before the update (as a gradient norm would be) is
    timed as the loop's (``l0``: blocking, its 4 bytes; ``collective_stand_ins``); in step 5 an
    asynchronous one is too, not blocking, and the loop's wait for it is a ``wait`` span of the
    step after its issue, ending once it has (``WaitedByTheLoop``). A barrier in step 3 cannot be
    (no span kind): it is counted in its step (``issued_collectives``), as are the two broadcasts
    DDP issues itself in its second forward, where it rebuilds its buckets (their count, then
    their order). DDP's buckets are timed as always."""
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
    assert [r.untimed_collectives for r in reports] == [0, 2, 1, 0, 0]
    loops = [[(s.kind, s.tag, s.nbytes, s.dtype, s.blocking) for s in r.spans if s.tag.startswith("l")] for r in reports]
    assert loops == [[], [("all_reduce", "l0", 4, "float32", True)], [], [("all_reduce", "l0", 4, "float32", True)],
                     [("all_reduce", "l0", 4, "float32", False)]]
    assert [sum(s.kind == "all_reduce" and s.tag.startswith("b") for s in r.spans) for r in reports] == [1, 3, 3, 3, 3]
    assert [[s.blocking for s in r.spans if s.kind == "wait"] for r in reports] == [[True]] * 4 + [[True, True]]  # DDP's; the loop's
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
            watch.timeline.open_collective = opening
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
    from instrumented_ddp.collective_stand_ins import LoopCall

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
    issued in its forward: untimed, not in its data. The loop's collectives here are barriers,
    which ddpwatch cannot time (no span kind; the others it can: the next tests)."""
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer):
        for step in range(1, 5):
            if step >= 2:
                dist.barrier()  # before the step's first forward: its data
            optimizer.zero_grad()
            for micro in range(2):
                with ddp.no_sync() if micro == 0 else contextlib.nullcontext():
                    ddp(**batch(step)).loss.backward()
                if micro == 0 and step == 3:
                    dist.barrier()  # between the micro-steps: data too
            if step == 4:
                dist.barrier()  # before the update: the optimizer's
            optimizer.step()
            dist.barrier()  # after the update: the next step's data
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.untimed_collectives for r in reports] == [0, 1 + 1 + 2, 1 + 1 + 1, 1 + 1 + 1]
    assert [r.untimed_in_data for r in reports] == [0, 2, 3, 2]
    assert [sum(s.kind == "all_reduce" for s in r.spans) for r in reports] == [1, 3, 3, 3]  # DDP's buckets: timed


def test_the_loops_synchronous_collectives_in_its_data_time_are_timed_there_as_collectives_of_their_kind(
        one_rank_group: None, sent: list[Any]) -> None:
    """The Trainer's gathers before each forward (``all_gather`` on gloo, ``all_gather_into_tensor``
    on NCCL, as Accelerate's ``gather`` picks), a broadcast and a reduce-scatter, in the data gap: spans of their
    kind inside the ``data`` span, numbered ``l0, l1, ...`` in each step, with the bytes
    nccl-tests counts (an all-gather's output, a reduce-scatter's input); none left untimed. Not the loop's and so not
    timed: what an evaluation issues inside ``paused`` (the pause's, in no step), and a call on
    another thread (counted). The user's tensors hold what torch's own functions give."""
    ddp, optimizer = make_ddp()
    gathered: list[list[float]] = []
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
            gathered.append([*labels[0].tolist(), *into.tolist(), float(seed), *scattered.tolist()])
            optimizer.zero_grad()
            ddp(**batch(step)).loss.backward()
            optimizer.step()
            if step == 2:
                with watch.paused("evaluate"):
                    dist.all_reduce(torch.ones(1))
                elsewhere = threading.Thread(target=lambda: dist.all_reduce(torch.ones(1)))
                elsewhere.start()
                elsewhere.join()
    assert gathered == [[s, s, 2.0 * s, 2.0 * s, 2.0 * s, s, 3.0 * s, 3.0 * s] for s in (1.0, 2.0, 3.0)]
    reports = [m for m in sent if isinstance(m, StepReport)]
    # step 1's gathers come before its first forward, before the step began: issued outside any step
    assert [[(s.kind, s.tag, s.nbytes, s.dtype, s.blocking) for s in r.spans if s.tag.startswith("l")] for r in reports] == [
        [], *[[("all_gather", "l0", 8, "float32", True), ("all_gather", "l1", 24, "float64", True),
               ("broadcast", "l2", 8, "int64", True), ("reduce_scatter", "l3", 8, "float32", True)]] * 2]
    for report in reports[1:]:
        (data,) = [s for s in report.spans if s.kind == "data"]
        assert all(data.start <= s.start <= s.end <= data.end for s in report.spans if s.tag.startswith("l"))
    assert [(r.untimed_collectives, r.untimed_in_data) for r in reports] == [(0, 0), (2, 0), (1, 1)]  # DDP's broadcasts; the thread's


def test_a_loops_gaps_are_data_before_a_forward_and_optimizer_after_the_last_backward(
        one_rank_group: None, sent: list[Any]) -> None:
    """What a user's loop does between the hooks is named by what comes next: before a forward it
    is ``data`` (the loader of the next micro-batch), after the step's last backward it is part of
    ``optimizer`` (gradient clipping, AMP's unscaling), never an unnamed gap counted as idle."""
    loader_s, clipping_s = 0.02, 0.03
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer):
        for step in range(3):
            optimizer.zero_grad()
            for micro in range(2):
                time.sleep(loader_s)  # the loader
                with ddp.no_sync() if micro == 0 else torch.enable_grad():
                    (ddp(**batch(2 * step + micro)).loss / 2).backward()
            time.sleep(clipping_s)  # clipping, unscaling
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            optimizer.step()
    for report in (m for m in sent if isinstance(m, StepReport)):
        spans = sorted(report.spans, key=lambda s: s.start)
        data = [s for s in spans if s.kind == "data"]
        assert len(data) == (2 if report.step > 1 else 1) and all(s.end - s.start >= loader_s for s in data)
        backwards = [s for s in spans if s.kind == "backward"]
        (second_forward,) = [s for s in spans if s.kind == "forward" and s.start > backwards[0].end]
        assert any(s.start == backwards[0].end and s.end == second_forward.start for s in data)
        (optimizer_span,) = [s for s in spans if s.kind == "optimizer"]
        assert optimizer_span.start == backwards[-1].end and optimizer_span.end - optimizer_span.start >= clipping_s


def test_the_trainers_evaluation_and_checkpoint_between_steps_are_a_pause_not_the_next_steps_data(
        one_rank_group: None, sent: list[Any]) -> None:
    """As ``Trainer`` runs them after a step (``_maybe_log_save_evaluate``): an evaluation of the
    unwrapped model with a gather of its metrics, ending in ``on_evaluate``, then a checkpoint,
    ending in ``on_save``. The next step begins where the checkpoint ended; the pause runs from
    the step before's end, for both, and its gather is not the step's. Its data loading is the
    loader's alone again (it read the evaluation's seconds)."""
    from instrumented_ddp.integrations import DDPWatchCallback

    eval_s, save_s, loader_s = 0.15, 0.05, 0.01
    ddp, optimizer = make_ddp()
    callback = DDPWatchCallback(SimpleNamespace(model_wrapped=ddp, optimizer=optimizer), address=f"tcp://127.0.0.1:{free_port()}")
    callback.on_train_begin(None, SimpleNamespace(max_steps=4, global_step=0), None)
    for step in range(1, 5):
        optimizer.zero_grad()
        time.sleep(loader_s)
        ddp(**batch(step)).loss.backward()
        optimizer.step()
        if step == 2:
            with torch.no_grad():
                ddp.module(**batch(99))
            dist.all_reduce(torch.ones(1))  # gather_for_metrics
            time.sleep(eval_s)
            callback.on_evaluate(None, None, None, metrics={"eval_loss": 0.25, "eval_accuracy": 1, "eval_runtime": eval_s,
                                                            "eval_samples_per_second": 80.0, "epoch": 0.5})
            time.sleep(save_s)
            callback.on_save(None, None, None)
    callback.on_train_end(None, None, None)
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.paused_for for r in reports] == ["", "", "evaluate, save", ""]
    second, third = reports[1], reports[2]
    assert third.paused_s >= eval_s + save_s
    paused_from = third.start - third.paused_s  # where step 3 was begun: step 2's end, its report sent between
    assert second.end <= paused_from < second.end + eval_s / 2
    (data,) = [s for s in third.spans if s.kind == "data"]
    assert third.start <= data.start and data.end - data.start < loader_s + eval_s / 2
    assert third.untimed_collectives == 0 and not third.excluded
    assert all(r.paused_s == 0.0 for r in reports if r is not third)
    # what it measured, after step 2, for the Loss tab: the speed figures and the epoch left out
    assert [m for m in sent if isinstance(m, Evaluation)] == [Evaluation(0, 2, {"eval_loss": 0.25, "eval_accuracy": 1.0})]


def test_while_the_loop_pauses_its_heartbeats_say_what_for_and_training_again_clears_it(one_rank_group: None) -> None:
    """``paused`` says it for the block; the Trainer callback from ``on_step_end``, where the
    Trainer's flow callback has set ``should_evaluate`` (and ``should_save``), to ``on_evaluate``
    (then ``save`` until ``on_save``); a training forward clears what a pause begun said."""
    from instrumented_ddp.integrations import DDPWatchCallback

    ddp, optimizer = make_ddp()
    callback = DDPWatchCallback(SimpleNamespace(model_wrapped=ddp, optimizer=optimizer), address=f"tcp://127.0.0.1:{free_port()}")
    callback.on_train_begin(None, SimpleNamespace(max_steps=3, global_step=0), None)
    watch = callback.attachment
    try:
        train(ddp, optimizer, steps=1)
        with watch.paused("evaluate"):
            assert watch.watch.pausing == "evaluate"
        assert watch.watch.pausing == ""
        callback.on_step_end(None, None, SimpleNamespace(should_evaluate=False, should_save=False))
        assert watch.watch.pausing == ""
        callback.on_step_end(None, None, SimpleNamespace(should_evaluate=True, should_save=True))
        assert watch.watch.pausing == "evaluate"
        callback.on_evaluate(None, None, SimpleNamespace(should_evaluate=False, should_save=True), metrics={})
        assert watch.watch.pausing == "save"
        callback.on_save(None, None, SimpleNamespace(should_evaluate=False, should_save=False))
        assert watch.watch.pausing == ""
        callback.on_step_end(None, None, SimpleNamespace(should_evaluate=False, should_save=True))  # save_strategy BEST
        train(ddp, optimizer, steps=1)  # no save came: the next training forward
        assert watch.watch.pausing == ""
    finally:
        callback.on_train_end(None, None, None)


def test_a_pause_marked_in_a_plain_loop_between_micro_steps_leaves_its_step_out_and_a_bad_label_is_one_line(
        one_rank_group: None, sent: list[Any]) -> None:
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer) as watch:
        train(ddp, optimizer, steps=2)
        with pytest.raises(AttachError, match=r"^paused: expected what the loop pauses for, in words"):
            with watch.paused(3):  # type: ignore[arg-type]
                pass
        optimizer.zero_grad()
        with ddp.no_sync():
            (ddp(**batch(5)).loss / 2).backward()
        with watch.paused("checkpoint"):
            torch.save(ddp.module.state_dict(), io.BytesIO())
        (ddp(**batch(6)).loss / 2).backward()
        optimizer.step()
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [(r.step, r.excluded, r.paused_for, r.paused_s) for r in reports] == [
        (1, True, "", 0.0), (2, False, "", 0.0), (3, True, "checkpoint", 0.0)]


def test_forwards_without_gradients_in_a_steps_data_gap_are_counted_unless_a_pause_holds_them(
        one_rank_group: None, sent: list[Any]) -> None:
    """An evaluation the loop did not mark reads as the next step's data loading: its no-grad
    forwards are counted there (two before step 1, three after step 2, one between step 4's
    micro-steps), so the dashboard can say why that step's data was slow. Counted nowhere: those
    in a marked pause (after step 3), those the Trainer runs before ``on_evaluate`` (a pause not
    said to begin, after step 4), and a no-grad forward inside the step's training (between its
    forward and backward: a reference model's logits)."""
    ddp, optimizer = make_ddp()

    def evaluate(forwards: int) -> None:
        with torch.no_grad():
            for i in range(forwards):
                ddp(**batch(100 + i))

    with attached(ddp, optimizer) as watch:
        evaluate(2)
        train(ddp, optimizer, steps=2)
        evaluate(3)
        train(ddp, optimizer, steps=1)
        with watch.paused("evaluate"):
            evaluate(4)
        train(ddp, optimizer, steps=1)
        evaluate(5)
        watch.pause_ends("evaluate")  # the Trainer's on_evaluate, its on_step_end having said nothing
        optimizer.zero_grad()
        with ddp.no_sync():
            (ddp(**batch(7)).loss / 2).backward()
        evaluate(1)
        output = ddp(**batch(8))
        evaluate(1)  # between the forward and its backward
        (output.loss / 2).backward()
        optimizer.step()
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [(r.step, r.nograd_forwards, r.paused_for) for r in reports] == [
        (1, 2, ""), (2, 0, ""), (3, 3, ""), (4, 0, "evaluate"), (5, 1, "evaluate")]


def test_ddps_first_iteration_is_excluded_where_every_micro_step_reduces(one_rank_group: None, sent: list[Any]) -> None:
    """Accumulating without ``no_sync``, step 1 reduced four times, the first on DDP's one bucket
    of every gradient, and was counted: it was asked whether DDP was still on its first buckets
    as it ended, after the rebuild (a 2-rank run of examples/plain_ddp.py so: 35.73 all-reduces
    a step against 4 x 9 = 36)."""
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer):
        train(ddp, optimizer, steps=3, grad_accum=4, no_sync=False)
    reports = [m for m in sent if isinstance(m, StepReport)]
    buckets = len(ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
    assert [r.excluded for r in reports] == [True, False, False]
    assert [sum(s.kind == "all_reduce" for s in r.spans) for r in reports] == [1 + 3 * buckets, 4 * buckets, 4 * buckets]


def test_accumulating_without_no_sync_is_a_note_and_a_finding_of_its_segment(one_rank_group: None, sent: list[Any]) -> None:
    """The reports of such a loop, as the dashboard and the exporters read them: steps 2-3 (step 1
    is DDP's first iteration), 4 micro-steps each reducing, 3 x buckets all-reduces before the
    last. The same loop with no_sync: nothing said."""
    for no_sync in (False, True):
        sent.clear()
        ddp, optimizer = make_ddp()
        with attached(ddp, optimizer):
            train(ddp, optimizer, steps=3, grad_accum=4, no_sync=no_sync)
        buckets = len(ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
        session = Session()
        for sequence, message in enumerate(m for m in sent if isinstance(m, (Hello, StepReport, Goodbye))):
            assert session.ingest(Envelope(message, 0, sequence, 0), received_at=0.0) is None
        found = exporters.summary(session)["segments"][0]["early_reductions"]
        if no_sync:
            assert not session.early_reductions and found is None
            continue
        assert session.early_reductions.text().startswith(
            f"gradients were all-reduced in 4 of 4 micro-steps a step (2 steps: 2-3): {3 * buckets} all-reduces a step "
            "before the last micro-step")
        assert found["steps"] == [2, 3] and found["early_all_reduces"] == 3 * buckets


def test_with_two_optimizers_the_one_stepped_first_falls_inside_the_attached_ones_optimizer_phase(
        one_rank_group: None, sent: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    """A loop with two optimizers (Muon's matrices and AdamW's rest, say) attaches the one it steps
    last: the step ends when that one returns, and the other's step, after the last backward,
    is inside ``optimizer``."""
    other_step_s = 0.03
    ddp, _ = make_ddp()
    head = list(ddp.module.head.parameters())
    first = torch.optim.SGD([p for p in ddp.parameters() if all(p is not h for h in head)], lr=0.1)
    last = torch.optim.AdamW(head, lr=1e-3)
    first.register_step_pre_hook(lambda *_: time.sleep(other_step_s))  # a slow first optimizer
    with attached(ddp, last):
        for step in range(3):
            ddp(**batch(step)).loss.backward()
            first.step()
            last.step()
            first.zero_grad()
            last.zero_grad()
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert len(reports) == 3
    for report in reports:
        (backward,) = [s for s in report.spans if s.kind == "backward"]
        (optimizer_span,) = [s for s in report.spans if s.kind == "optimizer"]
        assert optimizer_span.start == backward.end and optimizer_span.end - optimizer_span.start >= other_step_s
    assert capsys.readouterr().err == ""  # inside the update: nothing to say


def test_an_optimizer_not_attached_that_steps_the_model_after_the_attached_one_is_told_of_in_one_line_once(
        one_rank_group: None, sent: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    """Attached with the optimizer it steps first, a loop's other optimizer steps in the next
    step's data gap: its time reads as data loading, its state is not counted. Said once, in one
    line naming the fix; training goes on. Another model's optimizer stepping there is not this
    model's, and after ``detach`` torch's global hook is gone."""
    ddp, _ = make_ddp()
    body, head = two_optimizers(ddp)
    other_model = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    hooks_before = len(_global_optimizer_post_hooks)
    with attached(ddp, body):
        for step in range(3):
            ddp(**batch(step)).loss.backward()
            body.step()
            head.step()
            other_model.step()
            body.zero_grad()
            head.zero_grad()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "instrumented_ddp.attach: AdamW, not attached, steps this model after the attached SGD, so its "
        "step() reads as the next step's data loading and its state is not counted: pass attach a list of every "
        "optimizer the loop steps (the SGD and the AdamW) to time each one's step as the update")
    assert [m.step for m in sent if isinstance(m, StepReport)] == [1, 2, 3]
    assert len(_global_optimizer_post_hooks) == hooks_before


def two_optimizers(ddp: DistributedDataParallel) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """SGD with momentum over the body, AdamW over the head: two optimizers over one model."""
    head = list(ddp.module.head.parameters())
    body = [p for p in ddp.parameters() if all(p is not h for h in head)]
    return torch.optim.SGD(body, lr=0.1, momentum=0.9), torch.optim.AdamW(head, lr=1e-3)


def test_with_the_optimizers_listed_the_update_ends_when_each_has_stepped_in_either_order_and_each_ones_state_counts(
        one_rank_group: None, sent: list[Any]) -> None:
    """``attach(model, [muon, adamw])``: the loop need not say which it steps last, and the memory
    column holds every optimizer's state, where one attached optimizer held only its own."""
    slow_s = 0.03
    ddp, _ = make_ddp()
    body, head = two_optimizers(ddp)
    body.register_step_pre_hook(lambda *_: time.sleep(slow_s))
    with attached(ddp, [body, head]) as watch:
        assert watch.optimizers == (body, head)
        for step in range(4):
            ddp(**batch(step)).loss.backward()
            for optimizer in (body, head) if step < 2 else (head, body):  # the order changes halfway
                optimizer.step()
                optimizer.zero_grad()
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.step for r in reports] == [1, 2, 3, 4]
    for report in reports:
        assert [s.kind for s in report.spans if s.kind in ("data", "forward", "backward", "optimizer")] == (
            ["forward", "backward", "optimizer"] if report.step == 1 else ["data", "forward", "backward", "optimizer"])
        (backward,) = [s for s in report.spans if s.kind == "backward"]
        (update,) = [s for s in report.spans if s.kind == "optimizer"]
        assert update.start == backward.end and update.end - update.start >= slow_s  # both steps inside it
    # 2,979 float32 parameters, 51 of them the head's (2 tensors), 2,928 the body's (5 tensors):
    # SGD's momentum for the body, AdamW's two moments and a float32 step count per head tensor
    assert reports[1].memory["optimizer_state"] == 2_928 * 4 + 2 * 51 * 4 + 2 * 4


def test_a_listed_optimizer_that_sits_out_an_update_leaves_the_step_ended_where_the_other_returned(
        one_rank_group: None, sent: list[Any]) -> None:
    """An optimizer stepped every other update (one of the list): the step whose update it sat
    out ended where the last that stepped returned, found only at the next training forward, where
    a pause of training ends (step 3), or at ``detach`` (step 5); the loop's loss all-reduce after
    that return is the next step's, in its data time, as after a full update."""
    ddp, _ = make_ddp()
    body, head = two_optimizers(ddp)
    with attached(ddp, [body, head]) as watch:
        for step in range(5):
            loss = ddp(**batch(step)).loss
            loss.backward()
            body.step()
            if step % 2 == 1:
                head.step()
            dist.all_reduce(loss.detach())  # for the log
            body.zero_grad()
            head.zero_grad()
            if step == 2:
                with watch.paused("evaluate"):
                    time.sleep(0.01)
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.step for r in reports] == [1, 2, 3, 4, 5]
    for report in reports:
        assert [s.kind for s in report.spans if s.kind in ("data", "forward", "backward", "optimizer")] == (
            ["forward", "backward", "optimizer"] if report.step == 1 else ["data", "forward", "backward", "optimizer"])
        (update,) = [s for s in report.spans if s.kind == "optimizer"]
        if report.step % 2 == 1:  # the head sat out its update: the step ended where the body's step returned
            assert report.end == update.end
        loop_calls = [s for s in report.spans if s.tag.startswith("l")]
        if report.step in (1, 4):  # step 4 begins where the pause ended: the all-reduce before it is the pause's
            assert loop_calls == []
        else:  # the step before's log all-reduce, inside this one's data
            (log,) = loop_calls
            (data,) = [s for s in report.spans if s.kind == "data"]
            assert log.kind == "all_reduce" and data.start <= log.start and log.end <= data.end
    # none but DDP's two broadcasts of its rebuilt buckets' order, issued in C++ at step 2's backward
    assert [r.untimed_collectives for r in reports] == [0, 2, 0, 0, 0]
    assert reports[1].start == reports[0].end  # step 2 began where step 1 ended, at the body's return
    assert reports[3].paused_for == "evaluate" and reports[3].paused_s >= 0.01
    assert reports[3].start - reports[3].paused_s == pytest.approx(reports[2].end)  # the pause ran from step 3's end


@pytest.mark.parametrize("optimizer_kind", ["AdamW", "LBFGS"])
def test_a_closure_stepping_the_optimizer_reports_one_step_per_step_with_the_update_after_its_backward(
        one_rank_group: None, sent: list[Any], optimizer_kind: str) -> None:
    """``optimizer.step(closure)`` runs the step's forward and backward inside ``step()``, after its
    pre-hook (PyTorch Lightning's automatic optimization does; LBFGS evaluates the closure up to
    ``max_iter`` times, clearing gradients before each). Before, the first two steps came as one
    report and every ``optimizer`` span began before its step's forward."""
    ddp, _ = make_ddp()
    optimizer = (torch.optim.LBFGS(ddp.parameters(), lr=0.1, max_iter=3) if optimizer_kind == "LBFGS"
                 else torch.optim.AdamW(ddp.parameters(), lr=1e-3))
    evaluations: list[int] = []
    with attached(ddp, optimizer):
        for step in range(4):
            evaluations.append(0)

            def closure() -> torch.Tensor:
                evaluations[-1] += 1
                optimizer.zero_grad()
                loss = ddp(**batch(step)).loss
                loss.backward()
                return loss

            optimizer.step(closure)
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.step for r in reports] == [1, 2, 3, 4]
    assert [sum(s.kind == "forward" for s in r.spans) for r in reports] == evaluations
    assert optimizer_kind == "AdamW" or max(evaluations) > 1  # LBFGS did evaluate again inside one step
    for report in reports:
        last_backward = max((s for s in report.spans if s.kind == "backward"), key=lambda s: s.end)
        (optimizer_span,) = [s for s in report.spans if s.kind == "optimizer"]
        assert optimizer_span.start == last_backward.end and optimizer_span.end <= report.end


def test_a_forward_no_backward_follows_is_not_a_micro_step_nor_part_of_the_batch_or_loss(
        one_rank_group: None, sent: list[Any]) -> None:
    """An evaluation run with gradients enabled (no ``torch.no_grad()``) between steps: its forward
    is compute the rank did, so it stays a ``forward`` span, but no gradient reaches its output,
    so it is not a micro-step, and its samples and loss are not the step's. Before, each such
    step read ``grad_accum=3`` (a segment of its own) and half again the samples."""
    ddp, optimizer = make_ddp()
    train_losses: list[list[float]] = []
    with attached(ddp, optimizer):
        for step in range(3):
            ddp(**batch(100 + step))  # the evaluation: gradients enabled, no backward
            optimizer.zero_grad()
            train_losses.append([])
            for micro in range(2):
                with ddp.no_sync() if micro == 0 else torch.enable_grad():
                    loss = ddp(**batch(2 * step + micro)).loss
                    train_losses[-1].append(loss.item())
                    (loss / 2).backward()
            optimizer.step()
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.step for r in reports] == [1, 2, 3]
    for report, losses in zip(reports, train_losses, strict=True):
        assert report.settings["grad_accum"] == 2 and report.samples == 8 and report.tokens == 2 * 22
        assert sum(s.kind == "forward" for s in report.spans) == 3
        assert report.loss == pytest.approx(sum(losses) / 2)

def test_a_step_the_loss_scaler_skips_is_reported_on_its_own_ending_where_its_backward_did(
        one_rank_group: None, sent: list[Any]) -> None:
    """``GradScaler`` finds the inf in step 3's gradients and does not call ``optimizer.step()``, so
    no step hook fires; the next forward finds the reduced gradients cleared and ends step 3 where
    its last backward ended. Before, steps 3 and 4 came as one report of four micro-steps and twice
    the all-reduces."""
    ddp, optimizer = make_ddp()
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
    with attached(ddp, optimizer):
        for step in range(5):
            optimizer.zero_grad()
            for micro in range(2):
                with ddp.no_sync() if micro == 0 else torch.enable_grad():
                    loss = ddp(**batch(2 * step + micro)).loss / 2
                    scaler.scale(loss * float("inf") if step == 2 else loss).backward()
            scaler.step(optimizer)
            scaler.update()
            dist.all_reduce(loss.detach().clone())  # for the log: the next step's data time, timed
            dist.all_reduce(loss.detach().clone(), async_op=True).wait()  # timed too, its wait a span
            dist.barrier()  # and one that cannot be, counted
    assert scaler.get_scale() == 8.0  # it did find the inf, once, and halved its scale
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.step for r in reports] == [1, 2, 3, 4, 5]
    assert [r.update_skipped for r in reports] == [False, False, True, False, False]
    # step 3, found ended at its backward, does not take the collectives logged after it: step 4's
    # data time does, the timed ones' spans and the wait with them (step 2's 3 untimed: the barrier
    # before it, and DDP's two rebuilt-bucket broadcasts)
    assert [(r.untimed_collectives, r.untimed_in_data) for r in reports] == [(0, 0), (3, 1), (1, 1), (1, 1), (1, 1)]
    assert [[s.tag for s in r.spans if s.tag.startswith("l")] for r in reports] == [[], *[["l0", "l1"]] * 4]
    buckets = len(ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
    for report in reports[1:]:
        kinds = [s.kind for s in report.spans]
        assert report.settings["grad_accum"] == 2 and report.samples == 8
        assert kinds.count("forward") == kinds.count("backward") == 2 and kinds.count("all_reduce") == buckets + 2
        assert kinds.count("optimizer") == (0 if report.step == 3 else 1)
        assert kinds.count("wait") == 2  # DDP's after its last bucket; the loop's for its asynchronous all-reduce
    skipped, after = reports[2], reports[3]
    last_backward = max((s for s in skipped.spans if s.kind == "backward"), key=lambda s: s.end)
    assert skipped.end == last_backward.end == after.start
    assert all(s.end <= skipped.end for s in skipped.spans)  # its wait too: nothing outside its window
    first_data = min((s for s in after.spans if s.kind == "data"), key=lambda s: s.start)
    assert first_data.start == after.start  # the scaler's check, zero_grad and the loader: the next step's data
    carried = [s for s in after.spans if s.tag in ("l0", "l1") or (s.kind == "wait" and s.start < first_data.end)]
    assert len(carried) == 3 and all(first_data.start <= s.start <= s.end <= first_data.end for s in carried)


def test_the_attached_hook_leaves_parameters_bitwise_those_of_plain_ddp(one_rank_group: None) -> None:
    watched, watched_optimizer = make_ddp()
    plain, plain_optimizer = make_ddp()
    with attached(watched, watched_optimizer):
        train(watched, watched_optimizer, steps=3, grad_accum=2)
    train(plain, plain_optimizer, steps=3, grad_accum=2)
    for a, b in zip(watched.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_sparse_embedding_trains_attached_bitwise_and_its_gradient_is_counted_sparse(
        one_rank_group: None, sent: list[Any]) -> None:
    """DDP all-reduces a ``sparse=True`` embedding's gradient as it is; counting the memory held
    asked a sparse tensor for its storage and raised in the user's ``optimizer.step()``."""
    def make() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = TinyClassifier()
        model.embed = nn.Embedding(50, 16, sparse=True)
        ddp = DistributedDataParallel(model, bucket_cap_mb=0.001)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)

    (watched, watched_optimizer), (plain, plain_optimizer) = make(), make()
    with attached(watched, watched_optimizer):
        train(watched, watched_optimizer, steps=3)
    train(plain, plain_optimizer, steps=3)
    for a, b in zip(watched.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    reports = [m for m in sent if isinstance(m, StepReport)]
    buckets = len(watched._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
    assert [sum(s.kind == "all_reduce" for s in r.spans) for r in reports][1:] == [buckets] * 2
    held = reports[1].memory  # a strategy's second step is measured
    # the table's gradient, summed by the all-reduce, is a row of 16 floats and an int64 index per distinct
    # token of the step's batch, not the 50 x 16 floats of the table
    rows = len(batch(1)["input_ids"].unique())
    assert held is not None and held["parameters"] - held["gradients"] == 50 * 16 * 4 - rows * (16 * 4 + 8)


def test_a_zero_redundancy_optimizers_state_is_counted_where_it_keeps_it(one_rank_group: None, sent: list[Any],
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """PyTorch's ZeRO-1 beside DDP keeps its shard's state in the optimizer it steps (``.optim``),
    none in its own ``state``: the memory column read 0 bytes of optimizer state."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    torch.manual_seed(0)
    ddp = DistributedDataParallel(TinyClassifier(), bucket_cap_mb=0.001)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)
    with attached(ddp, optimizer):
        train(ddp, optimizer, steps=2)
    held = [m for m in sent if isinstance(m, StepReport)][1].memory
    # 2,979 parameters (embedding 50 x 16, 16 x 64 + 64, 64 x 16 + 16, 16 x 3 + 3) in float32: 11,916 bytes;
    # one rank holds all of AdamW's state: two moments of each, and a float32 step count for each of the 7 tensors
    assert held["parameters"] == 11_916
    assert held["optimizer_state"] == 2 * 11_916 + 7 * 4
    assert capsys.readouterr().err == ""  # the shard's optimizer steps inside ZeRO's step(): not another optimizer


def test_a_zero_redundancy_optimizers_broadcasts_are_timed_in_its_step_and_their_waits_are_not_its_compute(
        one_rank_group: None, sent: list[Any]) -> None:
    """PyTorch's ZeRO-1 broadcasts each rank's updated slice of the parameters from inside
    ``step()``, asynchronously, one call per parameter, and waits for them all there: counted
    untimed before, their time read as the optimizer's compute. Each is now a span of the loop's
    (``l0``-``l6``: the 7 parameters' bytes), and each wait a ``wait`` span inside the
    optimizer phase. Training is bitwise that of the same loop unattached."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    def make() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(TinyClassifier(), bucket_cap_mb=0.001)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-3)

    watched, watched_optimizer = make()
    with attached(watched, watched_optimizer):
        train(watched, watched_optimizer, steps=3)
    plain, plain_optimizer = make()
    train(plain, plain_optimizer, steps=3)
    assert all(torch.equal(a, b) for a, b in zip(watched.parameters(), plain.parameters(), strict=True))
    reports = [m for m in sent if isinstance(m, StepReport)]
    sizes = [p.numel() * 4 for p in watched.parameters()]
    for report in reports:
        loops = [s for s in report.spans if s.tag.startswith("l")]
        assert [(s.kind, s.tag, s.blocking) for s in loops] == [("broadcast", f"l{i}", False) for i in range(len(sizes))]
        assert sorted(s.nbytes for s in loops) == sorted(sizes)  # in ZeRO's order: its partition sorts by size
        (optimizer_phase,) = [s for s in report.spans if s.kind == "optimizer"]
        waits = [s for s in report.spans if s.kind == "wait" and s.start >= optimizer_phase.start]
        assert len(waits) == len(sizes) and all(s.blocking and s.end <= optimizer_phase.end for s in waits)
        assert all(optimizer_phase.start <= s.start for s in loops)
        assert report.untimed_collectives == (2 if report.step == 2 else 0)  # DDP's rebuilt-bucket broadcasts


class CheckpointedBody(nn.Module):
    """Reentrant activation checkpointing (``use_reentrant=True``): each checkpointed layer's
    backward runs as a backward of its own, nested in the step's, and the DDP buckets whose last
    gradient comes from it are launched there; the head is not checkpointed, so its bucket is
    launched in the step's own backward, before them."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.head = nn.Linear(16, 400)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.body:
            x = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=True)
        return self.head(x)


@pytest.mark.timeout(60, method="thread")  # a hang is in C++: a signal would never be handled
def test_reentrant_checkpointing_trains_attached_bitwise_with_every_bucket_reported(
        one_rank_group: None, sent: list[Any]) -> None:
    """DDP ends its backward in whichever backward launched its last bucket, here a nested one:
    a bucket's future that only the step's own backward's end would complete hung it."""
    def make() -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        torch.manual_seed(0)
        ddp = DistributedDataParallel(CheckpointedBody(), bucket_cap_mb=0.001)
        return ddp, torch.optim.SGD(ddp.parameters(), lr=0.1)

    def train_checkpointed(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> None:
        data = torch.Generator().manual_seed(1)
        for _ in range(4):
            x = torch.randn(8, 16, generator=data).requires_grad_()  # reentrant checkpointing needs an input that does
            ddp(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()

    (watched, watched_optimizer), (plain, plain_optimizer) = make(), make()
    with attached(watched, watched_optimizer):
        train_checkpointed(watched, watched_optimizer)
    train_checkpointed(plain, plain_optimizer)
    for a, b in zip(watched.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    # a bucket closes once it reaches 1,048 bytes: the head's bias (1,600) and weight (25,600) each alone,
    # then each body layer's weight and bias (1,024 + 64) together: five buckets
    buckets = len(watched._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
    assert buckets == 5
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [sum(s.kind == "all_reduce" for s in r.spans) for r in reports][1:] == [buckets] * 3


def test_an_attached_run_refuses_a_switch_and_says_why(one_rank_group: None, sent: list[Any]) -> None:
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer) as watch:
        watch.publisher.commands.put(SwitchCommand("c1", "bucket", 5.0, None))
        train(ddp, optimizer, steps=1)
    (ack,) = [m for m in sent if isinstance(m, Ack)]
    assert not ack.applied and ack.command_id == "c1" and ack.detail == NOT_SWITCHABLE


def test_detach_removes_the_hooks_and_ddp_averages_on_untimed(one_rank_group: None, sent: list[Any]) -> None:
    ddp, optimizer = make_ddp()
    watch = attach_for_test(ddp, optimizer)
    train(ddp, optimizer, steps=2)
    watch.detach()
    watch.detach()  # twice is harmless
    reports = len([m for m in sent if isinstance(m, StepReport)])
    assert untouched(ddp, optimizer, comm_hooks=1)  # DDP cannot drop a communication hook
    assert "_distributed_broadcast_coalesced" not in ddp.__dict__
    train(ddp, optimizer, steps=2)
    assert len([m for m in sent if isinstance(m, StepReport)]) == reports
    assert not watch.timing.timeline.has_pending()


def test_a_detached_ddp_and_its_model_are_freed_once_the_loop_drops_them(
        one_rank_group: None, sent: list[Any]) -> None:
    """DDP's C++ reducer holds the communication hook, which held the timing, which held the DDP:
    a cycle through C++ that Python's collector cannot see. Every attached DDP, with its model,
    its bucket copy of every gradient and its process group (a gloo thread each, kept past
    ``destroy_process_group``), lived until the process ended, detached or not: a Trainer's
    ``train()`` or a hyperparameter search's trials leaked one each (on a GPU, its memory). Found
    by the suite: the 27 gloo threads this file left slowed the dashboard's keyboard tests that
    ran after it fivefold (Textual's pilot waits for the process to be idle)."""
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer):
        train(ddp, optimizer, steps=2)
    wrapper, model = weakref.ref(ddp), weakref.ref(ddp.module)
    del ddp, optimizer
    gc.collect()
    assert wrapper() is None and model() is None


def test_attached_again_after_detach_times_the_hook_ddp_kept_bitwise(one_rank_group: None, sent: list[Any]) -> None:
    """A Trainer's second ``train()`` hands its callback the same DDP, whose hook is ddpwatch's
    from the first: that attach was refused (as a user's own hook, "remove the register_comm_hook
    call"), which stopped the Trainer."""
    ddp, optimizer = make_ddp()
    plain, plain_optimizer = make_ddp()
    with attached(ddp, optimizer):
        train(ddp, optimizer, steps=2)
    train(ddp, optimizer, steps=1)  # between the two: averaged untimed
    first_run = len(sent)
    with attached(ddp, optimizer) as again:
        train(ddp, optimizer, steps=2)
    for steps in (2, 1, 2):  # the same batches
        train(plain, plain_optimizer, steps=steps)
    for a, b in zip(ddp.parameters(), plain.parameters(), strict=True):
        assert torch.equal(a, b)
    assert isinstance(sent[first_run], Hello)  # a new run on the dashboard
    reports = [m for m in sent[first_run:] if isinstance(m, StepReport)]
    buckets = len(ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
    assert [(r.step, r.excluded, sum(s.kind == "all_reduce" for s in r.spans)) for r in reports] == [(1, False, buckets), (2, False, buckets)]
    assert untouched(ddp, optimizer, comm_hooks=1) and again.timing is ddp._ddpwatch_timing


MISUSES = {
    "a module that is not DDP": ("not DistributedDataParallel: wrap it first", lambda ddp, opt: (ddp.module, opt)),
    "DDP with a built-in hook": ("has the built-in communication hook 'BuiltinCommHookType.ALLREDUCE', which runs in C++",
                                 lambda ddp, opt: (ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE), (ddp, opt))[1]),
    "after the first backward": ("training has already begun", lambda ddp, opt: (train(ddp, opt, steps=1), (ddp, opt))[1]),
    "an optimizer that is not one": ("not a torch.optim.Optimizer", lambda ddp, opt: (ddp, object())),
    "no optimizer in the list": ("no optimizer given", lambda ddp, opt: (ddp, [])),
    "a list with one that is not one": ("not a torch.optim.Optimizer", lambda ddp, opt: (ddp, [opt, object()])),
    "an optimizer listed twice": ("an optimizer is given twice", lambda ddp, opt: (ddp, [opt, opt])),
    "another model's optimizer": ("steps none of this model's parameters",
                                  lambda ddp, opt: (ddp, torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))),
    "an optimizer without step hooks": ("HooklessOptimizer that never ran torch.optim.Optimizer.__init__",
                                        lambda ddp, opt: (ddp, HooklessOptimizer(opt))),
}


class HooklessOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that never ran its ``__init__`` (so has no step hooks), and
    keeps what it steps where ddpwatch does not look. Before, ``attach`` raised an
    ``AttributeError`` from torch's ``register_step_pre_hook``, its comm hook already in DDP."""

    def __init__(self, stepped: torch.optim.Optimizer) -> None:
        self.stepped, self.param_groups = stepped, stepped.param_groups

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.stepped.step()


@pytest.mark.parametrize("misuse", MISUSES)
def test_each_misuse_gets_one_line_naming_the_fix_and_changes_nothing(one_rank_group: None, misuse: str) -> None:
    expected, set_up = MISUSES[misuse]
    ddp, optimizer = make_ddp()
    model, given_optimizer = set_up(ddp, optimizer)
    hooks_before = len(ddp._comm_hooks)
    with pytest.raises(AttachError) as caught:
        instrumented_ddp.attach(model, given_optimizer, address=f"tcp://127.0.0.1:{free_port()}")
    message = str(caught.value)
    assert message.startswith("instrumented_ddp.attach: ") and "\n" not in message and expected in message
    assert untouched(ddp, optimizer, comm_hooks=hooks_before)
    train(ddp, optimizer, steps=1)  # the run goes on as before


def sharded_classifier(root: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The classifier sharded with FSDP2 as a user does it: each part, then (``root``) the whole."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyClassifier()
    for part in (model.embed, model.body, model.head):
        fully_shard(part)
    if root:
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")  # a Linear on 3-D input: no in-place op follows
def test_an_fsdp2_model_is_attached_as_fsdp_and_each_misuse_of_it_is_one_line(one_rank_group: None, sent: list[Any],
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``fully_shard`` models are attached like DDP ones and reported as ``fsdp`` (their comms, which
    one rank does not issue, and bitwise training are pinned on three ranks in
    ``test_attach_end_to_end.py``). Sharded parts under an unsharded root, FSDP1, a unit whose
    comm someone else set, a unit of several param groups (faked: they need per-parameter meshes)
    and a torch without FSDP's custom comms (where a DDP is still attached) are refused in one
    line, with nothing changed."""
    from instrumented_ddp.fsdp_timing import TimedAllGather

    model, optimizer = sharded_classifier()
    with attached(model, optimizer):
        for step in range(2):
            optimizer.zero_grad()
            model(**batch(step)).loss.backward()
            optimizer.step()
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [(r.step, r.strategy, r.settings, r.samples) for r in reports] == [(step, "fsdp", {"grad_accum": 1}, 4) for step in (1, 2)]
    assert [s.kind for s in reports[1].spans] == ["data", "forward", "backward", "optimizer"]
    weights = 4 * sum(p.numel() for p in TinyClassifier().parameters())  # one rank: its shards are whole
    assert reports[0].memory == {}  # measured at a segment's second step, then every tenth, as train.py does
    assert (reports[1].memory["parameters"], reports[1].memory["gradients"], reports[1].memory["optimizer_state"]) == (
        weights, weights, 2 * weights + 4 * len(list(model.parameters())))  # read as step() returns; AdamW: two moments, a step count
    sent.clear()
    with attached(model, optimizer):  # again (a Trainer's second train()): its units' comms are ddpwatch's, kept
        optimizer.zero_grad()
        model(**batch(2)).loss.backward()
        optimizer.step()
    assert [(m.step, m.strategy) for m in sent if isinstance(m, StepReport)] == [(1, "fsdp")]

    from instrumented_ddp.integrations import DDPWatchCallback

    class ShardingTrainer:  # what Accelerate's FSDP2 leaves the Trainer (it shards on GPUs only: not run here)
        model_wrapped, optimizer = sharded_classifier()

    callback = DDPWatchCallback(ShardingTrainer(), address=f"tcp://127.0.0.1:{free_port()}")
    callback.on_train_begin(None, SimpleNamespace(max_steps=30), None)  # the Trainer's TrainerState
    try:
        assert callback.attachment is not None and callback.attachment.model is ShardingTrainer.model_wrapped
        assert callback.attachment.watch.publisher.hello.total_steps == 30  # the header read "step 60/?" and "ETA —"
    finally:
        callback.on_train_end(None, None, None)

    def refused(model: Any, optimizer: Any) -> str:
        hooks = (len(model._forward_hooks), len(model._forward_pre_hooks))  # FSDP's own are there
        with pytest.raises(AttachError) as caught:
            instrumented_ddp.attach(model, optimizer, address=f"tcp://127.0.0.1:{free_port()}")
        assert (len(model._forward_hooks), len(model._forward_pre_hooks)) == hooks and not optimizer._optimizer_step_pre_hooks
        assert "\n" not in str(caught.value)
        return str(caught.value)

    with pytest.raises(AttachError, match=r"total_steps must be a whole number of optimizer steps, 0 or more \(0: unknown\), not -1"):
        instrumented_ddp.attach(*sharded_classifier(), address=f"tcp://127.0.0.1:{free_port()}", total_steps=-1)
    assert "call fully_shard(model) on the root too" in refused(*sharded_classifier(root=False))
    fsdp1 = type("FullyShardedDataParallel", (nn.Module,), {})()
    assert "FSDP1's FullyShardedDataParallel, which ddpwatch cannot time" in refused(fsdp1, optimizer)
    model, optimizer = sharded_classifier()

    class UsersAllGather(TimedAllGather):
        pass

    users = UsersAllGather(None, 0)
    model.body.set_custom_all_gather(users)
    assert "already has the custom comm UsersAllGather" in refused(model, optimizer)
    assert model.body._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm is users

    from instrumented_ddp import fsdp_timing

    with monkeypatch.context() as patched:  # per-parameter meshes (shard_placement_fn): FSDP makes a param group each
        patched.setattr(fsdp_timing, "param_groups", lambda unit: 2)
        assert "has parameters on more than one mesh (shard_placement_fn)" in refused(*sharded_classifier())
    monkeypatch.setitem(sys.modules, "instrumented_ddp.fsdp_timing", None)  # a torch before FSDP's custom comms
    assert "has no FSDP custom comms (FSDPModule.set_custom_all_gather, torch 2.9)" in refused(*sharded_classifier())
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer):  # DDP needs none of it
        train(ddp, optimizer, steps=1)


def test_attaching_twice_or_beyond_loopback_without_keys_is_refused(one_rank_group: None) -> None:
    ddp, optimizer = make_ddp()
    with pytest.raises(AttachError, match="not loopback: pass watch_key="):
        instrumented_ddp.attach(ddp, optimizer, address="tcp://10.1.2.3:5555")
    assert untouched(ddp, optimizer)
    with attached(ddp, optimizer):
        with pytest.raises(AttachError, match="already attached"):
            attach_for_test(ddp, optimizer)


def test_a_second_model_attached_to_the_address_of_a_live_one_is_refused_and_another_address_is_not(
        one_rank_group: None) -> None:
    """A GAN's two DDPs attached to one dashboard: the second was another run, which the dashboard
    leaves out whole (a warning there, nothing here). Refused in one line; free again once the
    first detaches."""
    (generator, g_optimizer), (critic, c_optimizer) = make_ddp(), make_ddp()
    address = f"tcp://127.0.0.1:{free_port()}"
    first = instrumented_ddp.attach(generator, g_optimizer, address=address)
    try:
        with pytest.raises(AttachError, match=rf"^instrumented_ddp.attach: another model of this process is attached to "
                                              rf"{re.escape(address)}, and a dashboard watches one run: detach that one "
                                              r"first \(its watch.detach\(\)\), or attach this one to another address, "
                                              r"with a dashboard of its own \(ddpwatch --listen ADDRESS\)$"):
            instrumented_ddp.attach(critic, c_optimizer, address=address)
        assert untouched(critic, c_optimizer)
        with attached(critic, c_optimizer):  # another address
            pass
    finally:
        first.detach()
    instrumented_ddp.attach(critic, c_optimizer, address=address).detach()


def test_attach_without_a_process_group_says_how_to_make_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attachment.dist, "is_initialized", lambda: False)
    with pytest.raises(AttachError, match=r"no process group: call torch.distributed.init_process_group\(\)"):
        instrumented_ddp.attach(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


def test_an_accelerate_style_optimizer_wrapper_is_seen_through(one_rank_group: None, sent: list[Any]) -> None:
    """Accelerate's ``AcceleratedOptimizer`` keeps the torch optimizer as ``.optimizer`` and
    calls its ``step()``: the step hooks go on that one."""
    ddp, optimizer = make_ddp()

    class Wrapped:
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner

        def step(self) -> None:
            self.optimizer.step()

        def zero_grad(self) -> None:
            self.optimizer.zero_grad()

    with attached(ddp, Wrapped(optimizer)):
        train(ddp, Wrapped(optimizer), steps=2)  # type: ignore[arg-type]
    assert [m.step for m in sent if isinstance(m, StepReport)] == [1, 2]


def test_pytorchs_post_local_sgd_optimizer_is_seen_through_and_its_averaging_timed_as_the_loops(
        one_rank_group: None, sent: list[Any]) -> None:
    """``PostLocalSGDOptimizer`` keeps the torch optimizer as ``.optim`` and never runs
    ``Optimizer.__init__`` (attach raised torch's ``AttributeError``): the step hooks go on the one
    it wraps, and the parameters its averager all-reduces after that one's step (every second step
    once its 2 warm-up steps are done) are the loop's collective in the next step's data time."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    runs = {mode: make_ddp() for mode in ("watched", "plain")}
    local = {mode: PostLocalSGDOptimizer(optim=optimizer, averager=PeriodicModelAverager(period=2, warmup_steps=2))
             for mode, (_, optimizer) in runs.items()}
    with attached(runs["watched"][0], local["watched"]) as watch:
        assert watch.optimizers == (runs["watched"][1],)
        for mode in ("watched", "plain"):
            train(runs[mode][0], local[mode], steps=6)  # type: ignore[arg-type]
    for watched, plain in zip(runs["watched"][0].parameters(), runs["plain"][0].parameters(), strict=True):
        assert torch.equal(watched, plain)
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [(r.step, [s.tag for s in r.spans if s.tag.startswith("l")]) for r in reports] == [
        (1, []), (2, []), (3, []), (4, ["l0"]), (5, []), (6, ["l0"])]
    (averaged,) = [s for s in reports[3].spans if s.tag == "l0"]
    assert averaged.kind == "all_reduce" and averaged.blocking and averaged.end <= next(
        s for s in reports[3].spans if s.kind == "forward").start


class BufferedClassifier(TinyClassifier):
    """With a buffer, which DDP broadcasts from rank 0 at each forward (``broadcast_buffers``)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros(1))


def test_a_compiled_ddp_is_attached_and_compiles_what_it_does_unattached(one_rank_group: None, sent: list[Any]) -> None:
    """``torch.compile(ddp_model)`` (a loop's, or Accelerate's under the Trainer's ``torch_compile``,
    which the Trainer keeps as ``model_wrapped``) is an ``OptimizedModule`` holding the DDP: attach
    and the Trainer callback attach to that DDP (before, attach said to wrap the model in DDP, and
    the callback named ``OptimizedModule`` as FSDP or DeepSpeed and left the run unwatched).

    Dynamo traces a compiled module's forward hooks, and DDP's buffer broadcast, with the
    forward. Before, it traced into attach's hooks and its timed broadcast and broke the graph at
    each ``time.perf_counter``, compiling more graphs, and guarded on the stamp the pre-hook had
    left, a float new each step, so a later step compiled again. They now run outside what Dynamo
    traces (``torch.compiler.disable``): the compiled run compiles what it does unattached, once,
    and the only graph breaks attach adds are the calls into them."""
    from torch._dynamo.utils import counters

    from instrumented_ddp.integrations import DDPWatchCallback

    def compiled(attach: bool) -> tuple[tuple[int, int, int], set[str]]:
        """Graphs and captured calls of the first 2 steps, from a clean cache, then the frames
        Dynamo compiled in 2 more (a recompile is one); and the graph breaks' reasons."""
        torch._dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        ddp = DistributedDataParallel(BufferedClassifier(), bucket_cap_mb=25.0)
        optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        model = torch.compile(ddp, backend="eager")  # at 25 MB: at the default 1 KB torch's compiled DDP refuses the layout
        with attached(model, optimizer) if attach else contextlib.nullcontext() as watch:
            assert watch is None or watch.model is ddp
            train(model, optimizer, steps=2)  # type: ignore[arg-type]
            stats, frames = dict(counters["stats"]), counters["frames"]["ok"]
            train(model, optimizer, steps=2)  # type: ignore[arg-type]
        return (stats["unique_graphs"], stats["calls_captured"], counters["frames"]["ok"] - frames), set(counters["graph_break"])

    try:
        (attached_run, attached_breaks), (plain_run, plain_breaks) = compiled(attach=True), compiled(attach=False)
    finally:
        torch._dynamo.reset()
    assert attached_run == plain_run
    assert attached_run[2] == 0
    added = attached_breaks - plain_breaks
    assert added and all("torch.compiler.disable" in reason for reason in added), added
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.step for r in reports] == [1, 2, 3, 4]
    assert [r.compiling for r in reports] == [True, False, False, False]  # the only graph is compiled in step 1
    assert all(sum(s.tag == "buffers" for s in r.spans) == 1 for r in reports)
    assert [sum(s.kind == "all_reduce" for s in r.spans) for r in reports] == [1, 1, 1, 1]  # 25 MB: one bucket of all

    class CompilingTrainer:
        model_wrapped, optimizer = make_ddp(bucket_mb=25.0)
        model_wrapped = torch.compile(model_wrapped, backend="eager")

    callback = DDPWatchCallback(CompilingTrainer(), address=f"tcp://127.0.0.1:{free_port()}")
    callback.on_train_begin(None, None, None)
    try:
        assert callback.attachment is not None and callback.attachment.model is CompilingTrainer.model_wrapped._orig_mod
    finally:
        callback.on_train_end(None, None, None)


def test_a_loss_computed_outside_the_model_is_recorded_with_one_optional_line(one_rank_group: None, sent: list[Any]) -> None:
    """The tutorial's ``loss_fn(ddp_model(x), y)``: the model returns logits, so the loop hands the
    loss over (``record_loss``), as a tensor or as the number ``loss.item()`` gives (refused before:
    an exception in the user's loop); each step reports its micro-steps' mean. A wrong value is one
    line. Where the model returns a loss too, the one handed over is the one reported."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with attached(ddp, optimizer) as watch:
        for wrong, what in (([1.0], "a list"), (torch.ones(2), "a tensor of shape (2,)"), (True, "a bool")):
            with pytest.raises(AttachError, match=re.escape(f"record_loss: expected the loss as a one-element tensor or a number, got {what}")):
                watch.record_loss(wrong)  # type: ignore[arg-type]
        for step in range(3):
            for micro in range(2):
                with ddp.no_sync() if micro == 0 else torch.enable_grad():
                    logits = ddp(torch.ones(3, 4))
                    loss = logits.square().mean() * 0 + (step + micro)  # losses 0, 1 then 1, 2 then 2, 3
                    number = loss.item() if micro == 0 else np.float32(loss.item())  # numpy's scalar is not a float
                    watch.record_loss(loss if step == 0 else number if step == 1 or micro == 0 else loss)
                    loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.loss for r in reports] == [pytest.approx(0.5), pytest.approx(1.5), pytest.approx(2.5)]  # tensors, numbers, both

    sent.clear()
    ddp, optimizer = make_ddp()  # its forward returns a loss as well
    with attached(ddp, optimizer) as watch:
        loss = ddp(**batch(0)).loss
        watch.record_loss(torch.tensor(7.0))
        loss.backward()
        optimizer.step()
    (report,) = [m for m in sent if isinstance(m, StepReport)]
    assert report.loss == pytest.approx(7.0)


def test_the_loss_reported_is_the_forwards_though_the_loop_scales_it_in_place_before_backward(
        one_rank_group: None, sent: list[Any]) -> None:
    """The Trainer multiplies the model's loss by the process count in place (``loss *=
    num_processes``, under ``average_tokens_across_devices``) and a loop may divide it by its
    accumulation (``loss /= 2``): read at the step's end, the loss was the scaled one (an HF
    Trainer on 2 ranks read 3.29 where its model returned 1.64)."""
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer):
        returned = []
        for micro in range(2):
            with ddp.no_sync() if micro == 0 else torch.enable_grad():
                loss = ddp(**batch(micro)).loss
                returned.append(loss.item())
                loss *= 2  # the Trainer's scaling
                loss /= 4  # a loop's accumulation
                loss.backward()
        optimizer.step()
    (report,) = [m for m in sent if isinstance(m, StepReport)]
    assert report.loss == pytest.approx(sum(returned) / 2) and report.loss != pytest.approx(sum(returned) / 4)
    sent.clear()
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer) as watch:
        loss = ddp(**batch(0)).loss
        recorded = torch.tensor(5.0)
        watch.record_loss(recorded)
        recorded += 1  # changed after it was handed over
        loss.backward()
        optimizer.step()
    (report,) = [m for m in sent if isinstance(m, StepReport)]
    assert report.loss == pytest.approx(5.0)  # the one handed over, as it was then


def test_an_evaluation_the_loop_measured_is_sent_with_the_step_it_followed_and_a_wrong_one_is_one_line(
        one_rank_group: None, sent: list[Any]) -> None:
    """``record_evaluation``: numbers, numpy's scalars and one-element tensors, after the steps
    done so far; anything else is refused in one line naming what was wrong, and nothing is sent.
    Once detached, nothing is sent either (the goodbye was the last message)."""
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer) as watch:
        watch.record_evaluation({"eval_loss": torch.tensor(0.5)})  # before any step: after step 0
        train(ddp, optimizer, steps=2)
        watch.record_evaluation({"eval_loss": np.float32(0.25), "accuracy": 1, "perplexity": float("inf")})
        for wrong, why in (([0.5], "expected the metrics as a mapping of names to numbers, got a list"),
                           ({}, "expected the metrics as a non-empty mapping of names to numbers, got dict"),
                           ({"eval_loss": "0.5"}, "metric 'eval_loss' is not a number: '0.5'"),
                           ({"eval_loss": torch.ones(2)}, "metric 'eval_loss' is not a number: tensor([1., 1.])"),
                           ({f"m{i}": 1.0 for i in range(33)}, "33 metrics is over the 32 one evaluation may carry")):
            with pytest.raises(AttachError, match=f"^{re.escape(f'record_evaluation: {why}')}$"):
                watch.record_evaluation(wrong)  # type: ignore[arg-type]
    watch.record_evaluation({"eval_loss": 0.1})
    evaluations = [m for m in sent if isinstance(m, Evaluation)]
    assert evaluations == [Evaluation(0, 0, {"eval_loss": 0.5}),
                           Evaluation(0, 2, {"eval_loss": 0.25, "accuracy": 1.0, "perplexity": float("inf")})]


@pytest.mark.parametrize("given", [0.3, 25.0, 0.05, 1.0, 2.83, 0.001])
def test_the_bucket_cap_reported_is_the_one_ddp_was_given_not_its_bytes_over_a_mebibyte(given: float) -> None:
    """DDP keeps ``int(bucket_cap_mb * 2**20)`` bytes: 0.3 MB is 314,572 bytes, which read back
    as 0.2999992370605469 MB; the segment label says ``bucket_mb=0.3``."""
    assert attachment.megabytes_given(int(given * 1024 * 1024)) == given


def test_the_trainer_callback_without_its_trainer_says_how_to_give_it() -> None:
    from instrumented_ddp.integrations import DDPWatchCallback

    with pytest.raises(AttachError, match=r"trainer.add_callback\(DDPWatchCallback\(trainer, address=...\)\)"):
        DDPWatchCallback().on_train_begin(None, None, None)


class UnwrappedTrainer:
    """What a Trainer holds when Accelerate built no DDP: the model itself."""

    model_wrapped = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model_wrapped.parameters(), lr=0.1)


ONE_PROCESS = ("ddpwatch: one process, so the Trainer built no DistributedDataParallel and there is no communication "
               "to watch (launch two or more with torchrun): training goes on unwatched\n")


def test_the_trainer_callback_in_one_process_trains_on_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """``python script.py`` with no torchrun: the Trainer does not wrap, there is no group."""
    from instrumented_ddp.integrations import DDPWatchCallback

    callback = DDPWatchCallback(UnwrappedTrainer())
    callback.on_train_begin(None, None, None)
    callback.on_train_end(None, None, None)
    assert callback.attachment is None
    assert capsys.readouterr().err == ONE_PROCESS


def test_the_trainer_callback_under_a_one_process_torchrun_trains_on_and_says_so(
        one_rank_group: None, capsys: pytest.CaptureFixture[str]) -> None:
    """``torchrun --nproc_per_node=1``: a process group exists, but Accelerate wraps a model in DDP
    only for two processes or more (seen on an H100: the callback's ``attach`` raised, and the
    Trainer stopped before its first step)."""
    from instrumented_ddp.integrations import DDPWatchCallback

    callback = DDPWatchCallback(UnwrappedTrainer())
    callback.on_train_begin(None, None, None)
    assert callback.attachment is None
    assert capsys.readouterr().err == ONE_PROCESS


def test_the_trainer_callback_on_another_wrapper_trains_on_and_names_it(capsys: pytest.CaptureFixture[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two or more processes and neither DDP nor FSDP2: the Trainer chose FSDP1 or DeepSpeed."""
    from instrumented_ddp import integrations
    from instrumented_ddp.integrations import DDPWatchCallback

    monkeypatch.setattr(integrations.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(integrations.dist, "get_world_size", lambda: 4)
    callback = DDPWatchCallback(UnwrappedTrainer())
    callback.on_train_begin(None, None, None)
    assert callback.attachment is None
    assert capsys.readouterr().err == ("ddpwatch: the Trainer wrapped the model as Linear, neither DistributedDataParallel "
                                       "nor FSDP2's fully_shard (FSDP1 or DeepSpeed?), which ddpwatch's Trainer callback "
                                       "watches: training goes on unwatched\n")


def test_the_trainer_callback_on_a_ddp_attach_refuses_trains_on_and_says_why(
        one_rank_group: None, capsys: pytest.CaptureFixture[str]) -> None:
    """A DDP given a built-in C++ hook before ``on_train_begin`` (Accelerate's Python ones are
    watched: ``test_attach_comm_hook.py``): the refusal raised there and stopped the Trainer."""
    from instrumented_ddp.integrations import DDPWatchCallback

    ddp, optimizer = make_ddp()
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    callback = DDPWatchCallback(SimpleNamespace(model_wrapped=ddp, optimizer=optimizer), address=f"tcp://127.0.0.1:{free_port()}")
    callback.on_train_begin(None, SimpleNamespace(max_steps=3), None)
    train(ddp, optimizer, steps=1)
    callback.on_train_end(None, None, None)
    assert callback.attachment is None and untouched(ddp, optimizer)
    assert capsys.readouterr().err == (
        "ddpwatch: instrumented_ddp.attach: this DistributedDataParallel has the built-in communication hook "
        "'BuiltinCommHookType.FP16_COMPRESS', which runs in C++ where ddpwatch cannot see its all-reduces: register its "
        "Python equivalent instead (torch.distributed.algorithms.ddp_comm_hooks.default_hooks: allreduce_hook, "
        "fp16_compress_hook), or none, to watch this run: training goes on unwatched\n")


def test_a_loop_that_raises_says_goodbye_as_failed_with_what_it_raised(one_rank_group: None, sent: list[Any],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Python calls ``sys.excepthook`` on an exception no one caught, then the exit's handlers, one
    of which detaches: its goodbye said *finished*, and the dashboard showed the rank so."""
    shown: list[BaseException] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, trace: shown.append(error))  # the interpreter's printer
    ddp, optimizer = make_ddp()
    watch = attach_for_test(ddp, optimizer)
    train(ddp, optimizer, steps=2)
    error = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB\n(the rest of torch's message)")
    sys.excepthook(RuntimeError, error, None)  # what the interpreter does with the loop's exception
    watch._detach_at_exit()  # then its exit's handlers
    assert shown == [error]  # still printed, by the hook that was there before
    (goodbye,) = [m for m in sent if isinstance(m, Goodbye)]
    assert (goodbye.steps, goodbye.reason) == (2, "failed: RuntimeError: CUDA out of memory. Tried to allocate 2.00 GiB")
    assert sys.excepthook is not watch._note_uncaught and sys.excepthook.__name__ == "<lambda>"  # detach put it back


def test_a_loop_stopped_by_a_signal_says_goodbye_as_interrupted_not_failed(one_rank_group: None, sent: list[Any],
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C at torchrun sends every rank SIGINT (``KeyboardInterrupt``, through the excepthook);
    torchrun's stop of the ranks left, or a scheduler's preemption, SIGTERM, which attach turns
    into ``StoppedBySignal`` (a ``SystemExit``: the excepthook never sees it). Before, the first
    read *failed: KeyboardInterrupt* (a cause named where there was none) and the second *lost*."""
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, trace: None)  # the interpreter's printer
    monkeypatch.setattr(stop_signals, "received", None)

    def goodbye_after(stop: Any) -> tuple[int, str]:
        ddp, optimizer = make_ddp()
        watch = attach_for_test(ddp, optimizer)
        assert signal.getsignal(signal.SIGTERM) is stop_signals._stop  # the script set no handler: ours
        train(ddp, optimizer, steps=2)
        stop()
        watch._detach_at_exit()  # the exit's handlers
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the last detach gave the default back
        (goodbye,) = [m for m in sent if isinstance(m, Goodbye)]
        sent.clear()
        return goodbye.steps, goodbye.reason

    def sigterm() -> None:
        with pytest.raises(stop_signals.StoppedBySignal) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100):  # the handler runs in this thread between two bytecodes: after a sleep at worst
                time.sleep(0.05)
        assert stopped.value.code == 128 + signal.SIGTERM  # the shell's exit code for it

    assert goodbye_after(lambda: sys.excepthook(KeyboardInterrupt, KeyboardInterrupt(), None)) == (
        2, "interrupted: SIGINT (KeyboardInterrupt, Ctrl-C)")
    assert goodbye_after(sigterm) == (2, "interrupted: SIGTERM")


def test_a_script_that_handles_sigterm_itself_keeps_its_handler(one_rank_group: None, sent: list[Any]) -> None:
    """A checkpoint on preemption is the script's: attach changes no handler it set."""
    def checkpoint_and_exit(signum: int, frame: Any) -> None:
        raise AssertionError("not called here")

    previous = signal.signal(signal.SIGTERM, checkpoint_and_exit)
    try:
        ddp, optimizer = make_ddp()
        with attached(ddp, optimizer):
            assert signal.getsignal(signal.SIGTERM) is checkpoint_and_exit
        assert signal.getsignal(signal.SIGTERM) is checkpoint_and_exit
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_trainer_callback_begun_again_after_an_out_of_memory_error_ends_the_failed_run_and_watches_the_new_one(
        one_rank_group: None, sent: list[Any]) -> None:
    """``auto_find_batch_size``: Accelerate catches the out-of-memory error (no ``on_train_end``),
    shrinks the batch and runs the training loop again, on a new DDP over the same module and the
    same optimizer (seen with transformers 5.24). Before, the first attachment stayed: its
    optimizer hooks counted the new run's steps with no forward, backward or all-reduce in them
    (Idle% 90), and the new DDP was refused its address, so trained unwatched."""
    from instrumented_ddp.integrations import DDPWatchCallback

    first, optimizer = make_ddp()
    trainer = SimpleNamespace(model_wrapped=first, optimizer=optimizer)
    callback = DDPWatchCallback(trainer, address=f"tcp://127.0.0.1:{free_port()}")
    args = SimpleNamespace(auto_find_batch_size=True)
    callback.on_train_begin(args, SimpleNamespace(max_steps=4, global_step=0, train_batch_size=8), None)
    train(first, optimizer, steps=2)  # then out of memory, caught by Accelerate
    trainer.model_wrapped = second = DistributedDataParallel(first.module, bucket_cap_mb=0.001)
    second.zero_grad()  # the Trainer's model.zero_grad() before on_train_begin
    callback.on_train_begin(args, SimpleNamespace(max_steps=4, global_step=0, train_batch_size=7), None)
    assert not first._forward_hooks and not first._forward_pre_hooks  # the failed run's DDP left alone
    assert len(optimizer._optimizer_step_pre_hooks) == len(optimizer._optimizer_step_post_hooks) == 1  # the new run's
    train(second, optimizer, steps=3)
    callback.on_train_end(args, None, None)
    goodbyes = [m for m in sent if isinstance(m, Goodbye)]
    assert [(g.steps, g.reason, g.trains_again) for g in goodbyes] == [
        (2, "failed: out of memory: the Trainer began again at a batch of 7 (auto_find_batch_size)", True),
        (3, "finished", False)]
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.step for r in reports] == [1, 2, 1, 2, 3]
    assert all({"forward", "backward", "all_reduce"} <= {s.kind for s in r.spans} for r in reports)


def test_the_trainer_callback_begun_again_after_train_raised_says_so() -> None:
    from instrumented_ddp.integrations import begun_again_because

    assert begun_again_because(SimpleNamespace(auto_find_batch_size=False), None) == (
        "failed: train() raised, and training began again")
    assert begun_again_because(SimpleNamespace(auto_find_batch_size=True), SimpleNamespace(train_batch_size=None)) == (
        "failed: out of memory: the Trainer began again at a smaller batch (auto_find_batch_size)")


def test_the_trainer_callback_plans_the_steps_a_resumed_run_has_left() -> None:
    """``trainer.train(resume_from_checkpoint=...)``: the Trainer's state is at the checkpoint's
    global step when ``on_train_begin`` runs; the attached steps count from 1, so the progress and
    ETA counted the steps already trained again."""
    from instrumented_ddp.integrations import steps_to_take

    assert steps_to_take(SimpleNamespace(max_steps=1000, global_step=600)) == 400
    assert steps_to_take(SimpleNamespace(max_steps=30, global_step=0)) == 30
    assert steps_to_take(SimpleNamespace(max_steps=-1, global_step=0)) == 0  # unknown
    assert steps_to_take(None) == 0


END_WITHOUT_DETACH = """
import sys
import time
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import instrumented_ddp
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
ddp = DistributedDataParallel(torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
watch = instrumented_ddp.attach(ddp, optimizer, address=sys.argv[1])
deadline = time.monotonic() + 30
while watch.publisher.sent == 0 and time.monotonic() < deadline:  # connected (nothing is queued before)
    time.sleep(0.01)
for _ in range(3):
    ddp(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_the_end_of_the_process_says_goodbye_without_detach(tmp_path: Path) -> None:
    """A user who never calls ``detach``: the recorder still hears every step and the goodbye."""
    with Recorder(tmp_path / "session", "--idle-exit", "20") as recorder:
        subprocess.run([sys.executable, "-c", END_WITHOUT_DETACH, recorder.address], cwd=REPO_ROOT,
                       env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, timeout=120)
        assert "every rank said goodbye" in recorder.wait()
    session = load_session(tmp_path / "session" / "session.ddpwatch")
    assert sorted(session.reports) == [1, 2, 3] and not session.ranks[0].hello.switchable


TRAIN_UNTIL_STOPPED = END_WITHOUT_DETACH + """
print("trained 3 steps", flush=True)
while True:  # until a signal stops it
    ddp(torch.randn(8, 4)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_a_process_sent_sigterm_exits_at_once_and_its_goodbye_says_interrupted(tmp_path: Path) -> None:
    """torchrun's SIGTERM (the ranks left when one fails, its own Ctrl-C) or a scheduler's: by
    default it killed the process with no exit handler run, and the rank read *lost*."""
    with Recorder(tmp_path / "session", "--idle-exit", "20") as recorder:
        process = subprocess.Popen([sys.executable, "-c", TRAIN_UNTIL_STOPPED, recorder.address], cwd=REPO_ROOT,
                                   env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE, text=True)
        try:
            assert process.stdout.readline() == "trained 3 steps\n"
            process.send_signal(signal.SIGTERM)
            assert process.wait(30) == 128 + signal.SIGTERM  # a shell's code for SIGTERM; no traceback
        finally:
            process.kill()
            process.stdout.close()
        err = recorder.wait()
    assert "every rank said goodbye" in err
    (line,) = [line for line in err.splitlines() if "interrupted" in line]
    session = load_session(tmp_path / "session" / "session.ddpwatch")
    steps = session.ranks[0].goodbye.steps
    assert line == f"ddpwatch record: rank 0 interrupted after step {steps}: SIGTERM" and steps >= 3
    assert session.status(0) == "interrupted" and sorted(session.reports)[-1] == steps
