"""What a watched step costs the device: the command agreement never touches the GPU, NCCL
timing is read from the environment as PyTorch reads it, the loss printed comes from reports."""

from __future__ import annotations

import queue
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from instrumented_ddp.publish import watch as watch_module
from instrumented_ddp.wire.messages import Ack, Span, StepReport, SwitchCommand
from instrumented_ddp.publish.watch import Watch, control_group, turn_on_nccl_timing


class RecordingDist:
    """Stands in for ``torch.distributed`` inside ``watch``: records what each collective got.
    Rank 0's announcement, as every rank receives it, is ``flags_from_rank0`` in turn: a command
    flag, or (flag, boundaries to the agreement after next); what rank 0 sent is in ``sent``."""

    def __init__(self, rank: int, flags_from_rank0: list[int | tuple[int, int]], command: SwitchCommand | None = None) -> None:
        self.rank, self.flags, self.command = rank, list(flags_from_rank0), command
        self.calls: list[tuple[Any, ...]] = []
        self.groups_made: list[dict[str, Any]] = []
        self.sent: list[list[int]] = []
        self.objects_sent: list[Any] = []  # rank 0's command broadcasts

    def get_rank(self) -> int:
        return self.rank

    def broadcast(self, tensor: torch.Tensor, src: int, group: Any = None, async_op: bool = False) -> Any:
        self.calls.append(("broadcast", tensor.device.type, group, async_op))
        self.sent.append(tensor.tolist())
        received = self.flags.pop(0)
        tensor.copy_(torch.tensor(received if isinstance(received, tuple) else (received, 1)))
        return SimpleNamespace(wait=lambda: self.calls.append(("wait",)))

    def broadcast_object_list(self, box: list[Any], src: int, group: Any = None, device: Any = None) -> None:
        self.calls.append(("broadcast_object_list", device, group))
        if self.rank == src:
            self.objects_sent.append(box[0])
        else:
            box[0] = self.command

    def new_group(self, **kwargs: Any) -> str:
        self.groups_made.append(kwargs)
        return "gloo-control-group"


def stand_in(**members: Any) -> Any:
    """A stand-in for a timeline or a publisher with only the members a test reaches (typed Any:
    it is not the class, and mypy would hold it to every member)."""
    return SimpleNamespace(**members)


def _watch_on_rank(rank: int, fake: RecordingDist, monkeypatch: pytest.MonkeyPatch) -> Watch:
    monkeypatch.setattr(watch_module, "dist", fake)
    watch = Watch(timeline=stand_in(completed_reports=list, has_pending=lambda: False))
    watch.publisher = stand_in(commands=queue.Queue(), command_deadlines={}, publish=lambda message: None,
                               close=lambda *a, **k: None, connected=True)  # a dashboard is connected: see the test of spacing without one
    watch._control = control_group()
    return watch


def test_agreement_uses_cpu_tensors_in_a_gloo_control_group_and_applies_a_command_one_step_later(
        monkeypatch: pytest.MonkeyPatch) -> None:
    command = SwitchCommand("c1", "bucket", bucket_mb=4.0)
    fake = RecordingDist(rank=1, flags_from_rank0=[1, 0], command=command)
    watch = _watch_on_rank(1, fake, monkeypatch)
    group = "gloo-control-group"

    assert watch.agree_on_command() is None  # rank 0 announces it: nobody waits for that broadcast
    assert fake.calls == [("broadcast", "cpu", group, True)]
    assert watch.agree_on_command() == command  # ... and every rank applies it at the next boundary
    assert fake.calls[1:] == [("wait",), ("broadcast_object_list", None, group), ("broadcast", "cpu", group, True)]
    assert fake.groups_made == [{"backend": "gloo"}]


def test_a_step_without_a_command_costs_one_broadcast_nobody_waits_for_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = RecordingDist(rank=0, flags_from_rank0=[0, 0, 0])
    watch = _watch_on_rank(0, fake, monkeypatch)
    assert [watch.agree_on_command() for _ in range(3)] == [None, None, None]
    assert fake.calls == [("broadcast", "cpu", "gloo-control-group", True), ("wait",)] * 2 + [
        ("broadcast", "cpu", "gloo-control-group", True)]
    watch.close()  # the last announcement is waited for before the group can go
    assert fake.calls[-1] == ("wait",)


def test_rank0_announces_the_command_it_heard_and_does_not_announce_it_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    command = SwitchCommand("c1", "bucket")
    fake = RecordingDist(rank=0, flags_from_rank0=[1, 0], command=command)
    watch = _watch_on_rank(0, fake, monkeypatch)
    watch.publisher.commands.put(command)
    assert watch.agree_on_command() is None
    assert watch._announced is not None and watch._announced[2] == command
    published: list[Ack] = []
    watch.publisher.publish = published.append  # type: ignore[method-assign]  # a stand-in's, not the publisher's
    watch.publisher.hello = SimpleNamespace(rank=0)
    watch.publisher.commands.put(command)  # resent by the dashboard before the switch landed
    assert watch.agree_on_command() == command
    assert watch._announced is not None and watch._announced[2] is None  # agreed on: never announced again
    assert published == []  # ... and not acknowledged for a step the switch has not reached yet
    watch.acknowledge(command, True, step=7)  # the switch landed on step 7 (train.py's ack)
    watch.steps = 9
    watch.publisher.commands.put(command)  # resent again, the ack lost on the way
    fake.flags.append(0)
    watch.agree_on_command()
    assert published == [Ack(0, "c1", True, 7, "", "bucket")] * 2  # the same ack, the step it landed on, what it asked for


def _rank0_hearing(command: SwitchCommand, seconds_left: float, monkeypatch: pytest.MonkeyPatch,
                   flags: list[int | tuple[int, int]]) -> tuple[Watch, RecordingDist, list[Ack]]:
    """Rank 0 with ``command`` in its queue, heard with ``seconds_left`` of its asker's wait."""
    fake = RecordingDist(rank=0, flags_from_rank0=flags, command=command)
    watch = _watch_on_rank(0, fake, monkeypatch)
    published: list[Ack] = []
    watch.publisher.publish = published.append  # type: ignore[method-assign]  # a stand-in's, not the publisher's
    watch.publisher.hello = SimpleNamespace(rank=0)
    watch.publisher.commands.put(command)
    watch.publisher.command_deadlines[command.command_id] = time.monotonic() + seconds_left
    return watch, fake, published


def test_a_command_whose_askers_wait_is_over_when_rank0_reads_it_is_refused_and_never_announced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``ddpwatch switch`` said it failed (no acknowledgement within its --timeout) while a long
    step or a pause held rank 0: the run used to switch anyway, later."""
    command = SwitchCommand("c1", "zero1", expires_after_s=30.0)
    watch, fake, published = _rank0_hearing(command, -0.1, monkeypatch, flags=[0])
    watch.steps = 6
    assert watch.agree_on_command() is None
    assert fake.sent == [[0, 1]]  # announced: no command
    assert published == [Ack(0, "c1", False, 7, watch_module.EXPIRED, "zero1")]
    watch.publisher.commands.put(command)  # resent: answered the same, never announced
    fake.flags.append(0)
    watch.agree_on_command()
    assert published == [Ack(0, "c1", False, 7, watch_module.EXPIRED, "zero1")] * 2 and fake.sent[-1][0] == 0


def test_a_command_announced_in_time_whose_wait_is_over_where_it_would_apply_is_applied_nowhere(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Announced at one agreement, applied at the next (two steps of 20 s later): rank 0 checks the
    wait again there and sends the other ranks no command, so none applies it."""
    command = SwitchCommand("c1", "zero1", expires_after_s=30.0)
    watch, fake, published = _rank0_hearing(command, 0.2, monkeypatch, flags=[1, 0])
    assert watch.agree_on_command() is None and fake.sent == [[1, 1]]
    time.sleep(0.3)
    watch.steps = 2
    assert watch.agree_on_command() is None
    assert fake.objects_sent == [None] and published == [Ack(0, "c1", False, 3, watch_module.EXPIRED, "zero1")]


def test_a_rank_told_no_command_where_one_was_announced_applies_none(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = RecordingDist(rank=1, flags_from_rank0=[1, 0], command=None)  # rank 0 found it expired
    watch = _watch_on_rank(1, fake, monkeypatch)
    assert [watch.agree_on_command(), watch.agree_on_command()] == [None, None]
    assert ("broadcast_object_list", None, "gloo-control-group") in fake.calls


def test_a_command_heard_within_its_askers_wait_is_applied(monkeypatch: pytest.MonkeyPatch) -> None:
    command = SwitchCommand("c1", "zero1", expires_after_s=30.0)
    watch, fake, published = _rank0_hearing(command, 30.0, monkeypatch, flags=[1, 0])
    assert [watch.agree_on_command(), watch.agree_on_command()] == [None, command]
    assert fake.objects_sent == [command] and published == []  # train.py acknowledges once it has switched


def test_ranks_skip_the_boundaries_between_agreements_rank0_announced(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0 said at the second agreement (boundary 1) that the one after next is 3 boundaries
    on: the ranks agree at 0, 1, 2 (told at 0: 1 on), then at 5; 3 and 4 cost nothing."""
    fake = RecordingDist(rank=1, flags_from_rank0=[(0, 1), (0, 3), (0, 1), (0, 1)])
    watch = _watch_on_rank(1, fake, monkeypatch)
    agreed = []
    for boundary in range(6):
        before = len(fake.calls)
        assert watch.agree_on_command() is None
        agreed += [boundary] if len(fake.calls) > before else []
    assert agreed == [0, 1, 2, 5]


def test_rank0_spaces_agreements_by_its_own_step_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 50 ms: after the first agreement (nothing measured yet: 1) rank 0 announces
    0.2 s / 50 ms = 4 boundaries; steps of 1 ms are capped at MAX_AGREEMENT_PERIOD."""
    clock = iter([10.0, 10.05, 10.1, 10.101])
    fake = RecordingDist(rank=0, flags_from_rank0=[(0, 1), (0, 1), (0, 1), (0, 1)])
    watch = _watch_on_rank(0, fake, monkeypatch)
    watch._clock = lambda: next(clock)
    for _ in range(4):
        watch.agree_on_command()
    assert [interval for _, interval in fake.sent] == [1, 4, 4, watch_module.MAX_AGREEMENT_PERIOD]
    assert 0.2 / 0.05 == 4 and watch_module.AGREEMENT_EVERY_S == 0.2


def test_rank0_spaces_agreements_wider_while_no_dashboard_is_connected(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 100 ms with nobody connected: 1.0 s / 100 ms = 10 boundaries between agreements;
    once a dashboard is connected, 0.2 s / 100 ms = 2."""
    clock = iter([10.0, 10.1, 10.2, 10.3])
    fake = RecordingDist(rank=0, flags_from_rank0=[(0, 1)] * 4)
    watch = _watch_on_rank(0, fake, monkeypatch)
    watch.publisher.connected = False
    watch._clock = lambda: next(clock)
    for _ in range(3):
        watch.agree_on_command()
    watch.publisher.connected = True
    watch.agree_on_command()
    assert [interval for _, interval in fake.sent] == [1, 10, 10, 2]
    assert watch_module.AGREEMENT_UNWATCHED_EVERY_S == 1.0


def test_a_command_announced_before_a_long_interval_lands_at_the_next_agreement(monkeypatch: pytest.MonkeyPatch) -> None:
    command = SwitchCommand("c1", "ddp")
    fake = RecordingDist(rank=1, flags_from_rank0=[(0, 1), (1, 4), (0, 1)], command=command)
    watch = _watch_on_rank(1, fake, monkeypatch)
    assert [watch.agree_on_command() for _ in range(3)] == [None, None, command]


@pytest.mark.parametrize(("value", "enabled"), [("1", True), ("true", True), ("Y", True), ("0", False), ("no", False)])
def test_nccl_timing_set_in_the_environment_is_read_as_pytorch_reads_it(
        monkeypatch: pytest.MonkeyPatch, value: str, enabled: bool) -> None:
    monkeypatch.setenv("TORCH_NCCL_ENABLE_TIMING", value)
    monkeypatch.setattr(watch_module, "dist", SimpleNamespace(group=SimpleNamespace(WORLD=None)))  # touched: AttributeError
    assert turn_on_nccl_timing("nccl") is enabled


@pytest.mark.parametrize(("backend", "refuses", "enabled"), [("nccl", False, True), ("nccl", True, False), ("gloo", False, False)])
def test_nccl_timing_unset_is_turned_on_for_the_default_nccl_group(
        monkeypatch: pytest.MonkeyPatch, backend: str, refuses: bool, enabled: bool) -> None:
    turned_on = []

    def enable() -> None:
        if refuses:
            raise RuntimeError("Backend nccl is missing implementation of enableCollectivesTiming.")
        turned_on.append(True)

    monkeypatch.delenv("TORCH_NCCL_ENABLE_TIMING", raising=False)
    monkeypatch.setattr(watch_module, "dist", SimpleNamespace(group=SimpleNamespace(WORLD=SimpleNamespace(_enable_collectives_timing=enable))))
    assert turn_on_nccl_timing(backend) is enabled
    assert turned_on == ([True] if enabled else [])


def test_latest_loss_comes_from_the_newest_report_that_has_one() -> None:
    def report(step: int, loss: float | None) -> StepReport:
        return StepReport(0, step, "ddp", {}, 0.0, 1.0, [Span("forward", 0.0, 1.0)], 1, 1, loss)

    pending = [[report(1, 2.0), report(2, 1.5), report(3, None)], []]
    watch = Watch(timeline=stand_in(completed_reports=lambda: pending.pop(0)))
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
    timeline = stand_in(completed_reports=lambda: pending.pop(0) if pending else [], has_pending=lambda: True)
    publisher = stand_in(publish=sent.append, close=lambda steps, reason, trains_again: closed.append((steps, reason)))
    watch = Watch(timeline, publisher)
    watch.steps = 6
    started = time.monotonic()
    with pytest.raises(RuntimeError), watch.sends_failure():
        raise RuntimeError("[../third_party/gloo/transport/tcp/pair.cc:534] Connection closed by peer\nmore detail")
    assert time.monotonic() - started < 0.5  # a step that can no longer resolve is not waited for
    assert sent == [report]
    assert closed == [(6, "failed: RuntimeError: [../third_party/gloo/transport/tcp/pair.cc:534] Connection closed by peer")]


def test_nothing_is_sent_when_training_inside_ends_normally() -> None:
    watch = Watch(stand_in(completed_reports=list), stand_in(close=lambda *a: pytest.fail("closed")))
    with watch.sends_failure():
        pass
