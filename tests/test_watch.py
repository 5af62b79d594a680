"""What a watched step costs the device: the command agreement never touches the GPU, NCCL
timing is read from the environment as PyTorch reads it, the loss printed comes from reports."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from instrumented_ddp import watch as watch_module
from instrumented_ddp.protocol import Span, StepReport, SwitchCommand
from instrumented_ddp.watch import Watch, control_group, nccl_timing_enabled


class RecordingDist:
    """Stands in for ``torch.distributed`` inside ``watch``: records what each collective got."""

    def __init__(self, rank: int, flag_from_rank0: int, command: SwitchCommand | None = None) -> None:
        self.rank, self.flag, self.command = rank, flag_from_rank0, command
        self.calls: list[tuple[str, Any, Any]] = []
        self.groups_made: list[dict[str, Any]] = []

    def get_rank(self) -> int:
        return self.rank

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None) -> None:
        self.calls.append(("broadcast", tensor.device.type, group))
        tensor.fill_(self.flag)

    def broadcast_object_list(self, box: list[Any], src: int, group: Any = None, device: Any = None) -> None:
        self.calls.append(("broadcast_object_list", device, group))
        box[0] = self.command

    def new_group(self, **kwargs: Any) -> str:
        self.groups_made.append(kwargs)
        return "gloo-control-group"


def _watch_on_rank(rank: int, fake: RecordingDist, monkeypatch: pytest.MonkeyPatch) -> Watch:
    monkeypatch.setattr(watch_module, "dist", fake)
    watch = Watch(timeline=SimpleNamespace(completed_reports=list))
    watch.publisher = SimpleNamespace(commands=queue.Queue(), publish=lambda message: None)
    watch._control = control_group("nccl")
    return watch


def test_agreement_on_an_nccl_run_uses_cpu_tensors_in_a_gloo_control_group(monkeypatch: pytest.MonkeyPatch) -> None:
    command = SwitchCommand("c1", "bucket", bucket_mb=4.0)
    fake = RecordingDist(rank=1, flag_from_rank0=1, command=command)
    watch = _watch_on_rank(1, fake, monkeypatch)

    assert watch.agree_on_command() == command
    assert fake.groups_made == [{"backend": "gloo"}]
    assert fake.calls == [("broadcast", "cpu", "gloo-control-group"), ("broadcast_object_list", None, "gloo-control-group")]


def test_agreement_without_a_command_is_one_cpu_broadcast(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = RecordingDist(rank=0, flag_from_rank0=0)
    watch = _watch_on_rank(0, fake, monkeypatch)
    assert watch.agree_on_command() is None
    assert fake.calls == [("broadcast", "cpu", "gloo-control-group")]


def test_a_gloo_run_agrees_in_its_default_group(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = RecordingDist(rank=0, flag_from_rank0=0)
    monkeypatch.setattr(watch_module, "dist", fake)
    assert control_group("gloo") is None and fake.groups_made == []


@pytest.mark.parametrize(("value", "enabled"), [("1", True), ("true", True), ("Y", True), ("0", False), ("", False), ("no", False)])
def test_nccl_timing_is_read_from_the_environment(monkeypatch: pytest.MonkeyPatch, value: str, enabled: bool) -> None:
    monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", value)
    assert nccl_timing_enabled() is enabled


def test_latest_loss_comes_from_the_newest_report_that_has_one() -> None:
    def report(step: int, loss: float | None) -> StepReport:
        return StepReport(0, step, "ddp", {}, 0.0, 1.0, [Span("forward", 0.0, 1.0)], 1, 1, loss)

    pending = [[report(1, 2.0), report(2, 1.5), report(3, None)], []]
    watch = Watch(timeline=SimpleNamespace(completed_reports=lambda: pending.pop(0)))
    watch.step_done()
    assert watch.latest_loss == (2, 1.5)
    watch.step_done()
    assert watch.latest_loss == (2, 1.5)


def test_a_failure_inside_training_sends_what_resolved_and_a_goodbye_naming_it() -> None:
    """A dead peer fails the next collective at once; the reports already queued must still go."""
    sent: list[Any] = []
    closed: list[tuple[int, str]] = []
    report = StepReport(0, 7, "async", {}, 0.0, 1.0, [], 1, 1)
    pending = [[report]]
    timeline = SimpleNamespace(completed_reports=lambda: pending.pop(0) if pending else [], has_pending=lambda: True)
    publisher = SimpleNamespace(publish=sent.append, close=lambda steps, reason: closed.append((steps, reason)))
    watch = Watch(timeline, publisher)
    watch.steps = 6
    started = time.monotonic()
    with pytest.raises(RuntimeError), watch.sends_failure():
        raise RuntimeError("[../third_party/gloo/transport/tcp/pair.cc:534] Connection closed by peer\nmore detail")
    assert time.monotonic() - started < 0.5  # a step that can no longer resolve is not waited for
    assert sent == [report]
    assert closed == [(6, "failed: RuntimeError: [../third_party/gloo/transport/tcp/pair.cc:534] Connection closed by peer")]


def test_nothing_is_sent_when_training_inside_ends_normally() -> None:
    watch = Watch(SimpleNamespace(completed_reports=list), SimpleNamespace(close=lambda *a: pytest.fail("closed")))
    with watch.sends_failure():
        pass
