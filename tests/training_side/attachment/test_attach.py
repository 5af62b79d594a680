"""``instrumented_ddp.attach``: a user's own DDP (or FSDP2) loop watched in one line: every phase
of every step, pauses, accumulation, the loss and evaluations, detach, compiled and checkpointed
models. In one process over a one-rank gloo group; the two-rank runs through torchrun are in
``test_attach_end_to_end.py``, the update's optimizers in ``test_attach_optimizers.py``, the
loop's own collectives in ``test_attach_loop_collectives.py``, misuses in ``test_attach_misuse.py``,
the Trainer callback in ``test_trainer_callback.py``, how a run ends in ``test_attach_goodbye.py``."""

from __future__ import annotations

import contextlib
import gc
import io
import re
import sys
import time
import weakref
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

import instrumented_ddp
from ddpwatch.export import exporters
from ddpwatch.ingest.session import Session
from instrumented_ddp.attachment import attached_model
from instrumented_ddp.attachment.attachment import AttachError
from instrumented_ddp.wire.messages import NOT_SWITCHABLE
from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import Ack, Evaluation, Goodbye, Hello, StepReport, SwitchCommand
from launch import free_port
from attach_helpers import (TinyClassifier, attach_for_test, attached, batch, make_ddp, sharded_classifier, train,
                            untouched)


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


def test_accumulating_with_nanogpts_flag_instead_of_no_sync_reads_as_no_sync(one_rank_group: None, sent: list[Any]) -> None:
    """nanoGPT does not enter ``no_sync``: it sets ``require_backward_grad_sync`` itself, true only
    for the last micro-step. Each step then reduces once, DDP's buckets after the last backward,
    with one wait, its four micro-steps counted, and nothing is said of early reductions."""
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer):
        for step in range(3):
            for micro in range(4):
                ddp.require_backward_grad_sync = micro == 3
                (ddp(**batch(4 * step + micro)).loss / 4).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    buckets = len(ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.settings["grad_accum"] for r in reports] == [4, 4, 4]
    for report in reports[1:]:
        kinds = [s.kind for s in report.spans]
        assert kinds.count("all_reduce") == buckets and kinds.count("wait") == 1 and kinds.count("backward") == 4
        (wait,) = [s for s in report.spans if s.kind == "wait"]
        last_backward = max((s for s in report.spans if s.kind == "backward"), key=lambda s: s.end)
        assert last_backward.start <= wait.start and wait.end <= last_backward.end  # the last micro-step's
    session = Session()
    for sequence, message in enumerate(m for m in sent if isinstance(m, (Hello, StepReport, Goodbye))):
        assert session.ingest(Envelope(message, 0, sequence, 0), received_at=0.0) is None
    assert not session.early_reductions


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


@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module .* returned a view tensor")  # a Linear on 3-D input: no in-place op follows
def test_an_fsdp2_model_is_timed_on_the_device_fsdp_computes_on_not_where_its_shards_are_kept(
        one_rank_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``CPUOffloadPolicy`` FSDP keeps the shards on the host and computes on its device (a
    GPU): read off the shards, a GPU run was timed on the host's clock. Its device is faked here
    as FSDP keeps it on a GPU run (no GPU here)."""
    model, _ = sharded_classifier()
    assert attached_model.compute_device(model, model, sharded=True) == torch.device("cpu")
    monkeypatch.setattr(cast(FSDPModule, model)._get_fsdp_state(), "_device", torch.device("cuda", 0))
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert attached_model.compute_device(model, model, sharded=True) == torch.device("cuda", 0)


def test_an_fsdp2_model_is_attached_as_fsdp_and_each_misuse_of_it_is_one_line(one_rank_group: None, sent: list[Any],
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """``fully_shard`` models are attached like DDP ones and reported as ``fsdp`` (their comms, which
    one rank does not issue, and bitwise training are pinned on three ranks in
    ``test_attach_end_to_end.py``). Sharded parts under an unsharded root, FSDP1, a unit whose
    comm someone else set, a unit of several param groups (faked: they need per-parameter meshes)
    and a torch without FSDP's custom comms (where a DDP is still attached) are refused in one
    line, with nothing changed."""
    from instrumented_ddp.timing.fsdp_timing import TimedAllGather

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
    body = cast(FSDPModule, model.body)
    body.set_custom_all_gather(users)
    assert "already has the custom comm UsersAllGather" in refused(model, optimizer)
    assert body._get_fsdp_state()._fsdp_param_groups[0]._all_gather_comm is users

    from instrumented_ddp.timing import fsdp_timing

    with monkeypatch.context() as patched:  # per-parameter meshes (shard_placement_fn): FSDP makes a param group each
        patched.setattr(fsdp_timing, "param_groups", lambda unit: 2)
        assert "has parameters on more than one mesh (shard_placement_fn)" in refused(*sharded_classifier())
    monkeypatch.setitem(sys.modules, "instrumented_ddp.timing.fsdp_timing", None)  # a torch before FSDP's custom comms
    assert "has no FSDP custom comms (FSDPModule.set_custom_all_gather, torch 2.9)" in refused(*sharded_classifier())
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer):  # DDP needs none of it
        train(ddp, optimizer, steps=1)


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
        model = cast(nn.Module, torch.compile(ddp, backend="eager"))  # an OptimizedModule; at 25 MB: at the default 1 KB torch's compiled DDP refuses the layout
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
        model_wrapped: Any
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
    optimizer: torch.optim.Optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
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
    assert attached_model.megabytes_given(int(given * 1024 * 1024)) == given


def test_an_attached_ddp_at_its_default_cap_says_its_first_bucket_and_one_given_a_cap_does_not(one_rank_group: None) -> None:
    """torch caps DDP's first bucket at 1 MiB where ``bucket_cap_mb`` was not given, every bucket
    at the cap where it was: the advisor simulates what the settings say (``first_bucket_mb``)."""
    default = DistributedDataParallel(TinyClassifier())
    given = DistributedDataParallel(TinyClassifier(), bucket_cap_mb=25)
    assert attached_model.first_bucket_setting(default) == {"first_bucket_mb": 1.0}
    assert attached_model.first_bucket_setting(given) == {}
