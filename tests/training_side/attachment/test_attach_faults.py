"""A loop ``attach`` watches never raises because of ddpwatch: where ddpwatch's own code raises in
one of its hooks, the rank stops being watched, says so in one line and in its goodbye, and the
loop trains on exactly as it would have unwatched. And the loop's own errors, caught by the loop,
leave the watching as it was: a marked block that raised was what it was marked as."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from attach_helpers import attach_for_test, attached, make_ddp, train
from instrumented_ddp.wire.messages import Goodbye, StepReport
from instrumented_ddp.wire.kinds import LOOP_COMPUTE_KIND


def test_ddpwatch_raising_in_the_optimizers_hook_stops_watching_and_the_loop_trains_on_unchanged(
        one_rank_group: None, sent: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    """The step's end raising (at step 2, inside the loop's ``optimizer.step()``): before, the
    loop raised there, and at every step after it."""
    ddp, optimizer = make_ddp()
    watch = attach_for_test(ddp, optimizer)
    original = watch.timeline.end_step

    def end_step(*args: Any, **kwargs: Any) -> None:
        if watch._steps == 2:
            raise RuntimeError("a fault of ddpwatch's")
        original(*args, **kwargs)

    watch.timeline.end_step = end_step  # type: ignore[method-assign]
    train(ddp, optimizer, steps=4)
    assert capsys.readouterr().err == (
        "instrumented_ddp.attach: rank 0: ddpwatch raised RuntimeError: a fault of ddpwatch's in _after_optimizer_step: "
        "this rank is no longer watched and trains on unwatched (a fault of ddpwatch's: please report it with this line)\n")
    assert not watch._handles and not ddp._forward_pre_hooks and not optimizer._optimizer_step_post_hooks  # at step 3's forward
    assert [m.step for m in sent if isinstance(m, StepReport)] == [1]
    assert [(m.steps, m.reason) for m in sent if isinstance(m, Goodbye)] == [
        (1, "detached: RuntimeError: a fault of ddpwatch's")]

    unwatched, unwatched_optimizer = make_ddp()
    train(unwatched, unwatched_optimizer, steps=4)
    assert all(torch.equal(a, b) for a, b in zip(ddp.parameters(), unwatched.parameters(), strict=True))


def test_a_pause_and_a_marked_compute_block_that_raise_into_the_loop_are_still_a_pause_and_compute(
        one_rank_group: None, sent: list[Any]) -> None:
    """A checkpoint that failed to write, the loop catching the error: the pause did not end,
    the heartbeats went on saying *save*, and its time read as the next step's data loading."""
    ddp, optimizer = make_ddp()
    with attached(ddp, optimizer) as watch:
        train(ddp, optimizer, steps=1)
        with pytest.raises(OSError, match="disk full"):
            with watch.paused("save"):
                raise OSError("disk full")
        assert watch.watch.pausing == ""
        train(ddp, optimizer, steps=1)
        with pytest.raises(ValueError, match="nan in the average"):
            with watch.computing("ema"):
                raise ValueError("nan in the average")
        train(ddp, optimizer, steps=1)
    reports = {m.step: m for m in sent if isinstance(m, StepReport)}
    assert (reports[2].paused_for, reports[3].paused_for) == ("save", "")
    assert [span.tag for span in reports[3].spans if span.kind == LOOP_COMPUTE_KIND] == ["ema"]


class FailsOnThreeSamples(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 3:
            raise ValueError("a bad batch")
        return self.layer(x).mean()


def test_a_forward_that_raised_and_was_skipped_leaves_the_next_update_a_step_not_one_inside_a_forward(
        one_rank_group: None, sent: list[Any], capsys: pytest.CaptureFixture[str]) -> None:
    """A forward that raises never runs its post-hook: the update after it read as one inside the
    model's forward (PyTorch Lightning's manual optimization), and the next forward detached,
    saying so."""
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(FailsOnThreeSamples())
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    with attached(ddp, optimizer) as watch:
        for step in range(4):
            optimizer.zero_grad()
            for micro in range(2):
                try:
                    ddp(torch.randn(3 if (step, micro) == (1, 1) else 4, 8)).backward()
                except ValueError:
                    pass  # skipped, as a loop skips a batch that ran out of memory
            optimizer.step()
        assert watch._handles
    assert capsys.readouterr().err == ""
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [(r.step, r.settings["grad_accum"], r.samples) for r in reports] == [(1, 2, 8), (2, 1, 4), (3, 2, 8), (4, 2, 8)]


class Critic(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.hidden, self.out = torch.nn.Linear(8, 64), torch.nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


@pytest.mark.filterwarnings("ignore:Grad strides do not match bucket view strides")  # DDP's, of the penalty's graph
def test_a_gradient_penaltys_backward_and_the_losss_are_both_timed_in_one_micro_step(
        one_rank_group: None, sent: list[Any]) -> None:
    """WGAN-GP's penalty: ``torch.autograd.grad`` of the output, then the loss's ``backward()``.
    Before, the penalty's took the step's one backward, and the loss's backward (with every
    bucket's all-reduce) went untimed inside the update."""
    torch.manual_seed(0)
    ddp = torch.nn.parallel.DistributedDataParallel(Critic(), bucket_cap_mb=0.001)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    with attached(ddp, optimizer):
        for _ in range(4):
            optimizer.zero_grad()
            x = torch.randn(16, 8, requires_grad=True)
            out = ddp(x)
            (gradient,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            (out.mean() + ((gradient.norm(dim=1) - 1) ** 2).mean()).backward()
            optimizer.step()
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert len(reports) == 4
    for report in reports:
        penalty, loss = [s for s in report.spans if s.kind == "backward"]
        (update,) = [s for s in report.spans if s.kind == "optimizer"]
        reductions = [s for s in report.spans if s.kind == "all_reduce"]
        assert report.settings["grad_accum"] == 1 and penalty.end <= loss.start and loss.end <= update.start
        assert reductions  # one bucket: DDP's first holds 1 MiB
        assert all(loss.start <= s.start <= loss.end for s in reductions)
        assert all(report.start <= s.start for s in report.spans)
