"""What marks an attached loop's update: the optimizers ``attach`` was given (one, or a list in
any order, one sitting out an update), one that was not (told of in one line), a closure
stepping the optimizer, a loss scaler's skipped step, and the optimizers that wrap another:
PyTorch's ZeRO-1 and ``PostLocalSGDOptimizer``, Accelerate's. In one process over a one-rank gloo
group."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.optim.optimizer import _global_optimizer_post_hooks

from instrumented_ddp.wire.messages import Goodbye, StepReport
from attach_helpers import TinyClassifier, attach_for_test, attached, batch, make_ddp, train, two_optimizers


def test_with_two_optimizers_the_one_stepped_first_falls_inside_the_attached_ones_optimizer_phase(
        one_rank_group: None, sent: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    """A loop with two optimizers (Muon's matrices and AdamW's rest, say) attaches the one it steps
    last: the step ends when that one returns, and the other's step, after the last backward,
    is inside ``optimizer``."""
    other_step_s = 0.03
    ddp, _ = make_ddp()
    first, last = two_optimizers(ddp)
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
            dist.barrier()  # timed as the wait it is
    assert scaler.get_scale() == 8.0  # it did find the inf, once, and halved its scale
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.step for r in reports] == [1, 2, 3, 4, 5]
    assert [r.update_skipped for r in reports] == [False, False, True, False, False]
    # step 3, found ended at its backward, does not take the collectives logged after it: step 4's
    # data time does, the timed ones' spans, the wait and the barrier's wait with them (step 2's 2
    # untimed: DDP's two rebuilt-bucket broadcasts)
    assert [(r.untimed_collectives, r.untimed_in_data) for r in reports] == [(0, 0), (2, 0), (0, 0), (0, 0), (0, 0)]
    assert [sum(s.tag == "barrier" for s in r.spans) for r in reports] == [0, 1, 1, 1, 1]
    assert [[s.tag for s in r.spans if s.tag.startswith("l")] for r in reports] == [[], *[["l0", "l1"]] * 4]
    buckets = len(ddp._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
    for report in reports[1:]:
        kinds = [s.kind for s in report.spans]
        assert report.settings["grad_accum"] == 2 and report.samples == 8
        assert kinds.count("forward") == kinds.count("backward") == 2 and kinds.count("all_reduce") == buckets + 2
        assert kinds.count("optimizer") == (0 if report.step == 3 else 1)
        assert kinds.count("wait") == 3  # DDP's after its last bucket; the loop's for its asynchronous all-reduce; the barrier
    skipped, after = reports[2], reports[3]
    last_backward = max((s for s in skipped.spans if s.kind == "backward"), key=lambda s: s.end)
    assert skipped.end == last_backward.end == after.start
    assert all(s.end <= skipped.end for s in skipped.spans)  # its wait too: nothing outside its window
    first_data = min((s for s in after.spans if s.kind == "data"), key=lambda s: s.start)
    assert first_data.start == after.start  # the scaler's check, zero_grad and the loader: the next step's data
    carried = [s for s in after.spans if s.tag in ("l0", "l1") or (s.kind == "wait" and s.start < first_data.end)]
    assert len(carried) == 4 and all(first_data.start <= s.start <= s.end <= first_data.end for s in carried)


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
            train(runs[mode][0], local[mode], steps=6)
    for watched, plain in zip(runs["watched"][0].parameters(), runs["plain"][0].parameters(), strict=True):
        assert torch.equal(watched, plain)
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [(r.step, [s.tag for s in r.spans if s.tag.startswith("l")]) for r in reports] == [
        (1, []), (2, []), (3, []), (4, ["l0"]), (5, []), (6, ["l0"])]
    (averaged,) = [s for s in reports[3].spans if s.tag == "l0"]
    assert averaged.kind == "all_reduce" and averaged.blocking and averaged.end <= next(
        s for s in reports[3].spans if s.kind == "forward").start


class StepsInsideItsForward(nn.Module):
    """A training step run whole inside the model's forward, as PyTorch Lightning's manual
    optimization runs ``training_step`` (``manual_backward``, ``step()``) inside DDP's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.net = TinyClassifier()
        self.optimizer = torch.optim.SGD(self.net.parameters(), lr=0.1)

    def forward(self, **inputs: torch.Tensor) -> torch.Tensor:
        self.optimizer.step()  # the gradients of the loop's backward before (Lightning's runs inside too)
        self.optimizer.zero_grad()
        return self.net(**inputs).loss


def test_a_loop_that_steps_inside_the_models_forward_is_told_it_cannot_be_watched_and_trains_on_detached(
        one_rank_group: None, sent: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    """Read as written, such a loop gave steps cut in the middle of a forward, all excluded, no
    figures (seen with a Lightning GAN, two optimizers, 2 CPU ranks): one line, a goodbye, and
    the loop goes on as before."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(StepsInsideItsForward(), bucket_cap_mb=0.001)
    watch = attach_for_test(ddp, ddp.module.optimizer)
    for step in range(3):
        ddp(**batch(step)).backward()
    assert capsys.readouterr().err == (
        "instrumented_ddp.attach: the optimizer stepped inside the model's forward (a training step run whole inside "
        "it, as PyTorch Lightning's manual optimization runs training_step inside DDP's forward), where ddpwatch "
        "cannot tell forward, backward and update apart: detached, training goes on unwatched\n")
    assert not watch._handles and not ddp._forward_hooks and not ddp.module.optimizer._optimizer_step_pre_hooks
    assert [m for m in sent if isinstance(m, StepReport)] == []
    assert [(m.steps, m.reason) for m in sent if isinstance(m, Goodbye)] == [
        (0, "detached: the optimizer stepped inside the model's forward")]
