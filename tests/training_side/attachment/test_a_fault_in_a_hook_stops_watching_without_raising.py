"""``never_raises_into_the_loop`` and ``HookFaults``: ddpwatch's own code raising in a hook of the
loop's says so in one line and makes every hook a no-op, the loop never sees the error, and the
attachment detaches at the first forward hook (at once where the forward's own hook raised)."""

from __future__ import annotations

import pytest

from instrumented_ddp.attachment.hook_faults import HookFaults, never_raises_into_the_loop


class Hooks:
    """Two hooks as ``PhaseHooks`` has them: an optimizer's, and a forward's, which detaches."""

    def __init__(self) -> None:
        self.faults = HookFaults(rank=3)
        self.detached: list[str] = []
        self.ran: list[str] = []

    def detach(self, reason: str) -> None:
        self.detached.append(reason)

    @never_raises_into_the_loop(detaches_here=False)
    def _after_optimizer_step(self, error: Exception | None = None) -> str:
        self.ran.append("step")
        if error is not None:
            raise error
        return "stepped"

    @never_raises_into_the_loop(detaches_here=True)
    def _before_forward(self, error: Exception | None = None) -> str:
        self.ran.append("forward")
        if error is not None:
            raise error
        return "forward"


def test_an_optimizer_hook_that_raises_says_so_once_and_the_next_forward_hook_detaches(
        capsys: pytest.CaptureFixture[str]) -> None:
    hooks = Hooks()
    assert hooks._after_optimizer_step() == "stepped"
    assert hooks._after_optimizer_step(OverflowError("a count too large\nand more")) is None
    assert capsys.readouterr().err == (
        "instrumented_ddp.attach: rank 3: ddpwatch raised OverflowError: a count too large in _after_optimizer_step: "
        "this rank is no longer watched and trains on unwatched (a fault of ddpwatch's: please report it with this line)\n")
    assert hooks.detached == []  # torch is looping over the optimizer's hooks: not removed there
    assert hooks._after_optimizer_step() is None and hooks._before_forward() is None  # no-ops from now on
    assert hooks.ran == ["step", "step"]
    assert hooks.detached == ["detached: OverflowError: a count too large"]
    assert capsys.readouterr().err == ""


def test_a_forward_hook_that_raises_detaches_at_once() -> None:
    hooks = Hooks()
    assert hooks._before_forward(ValueError("boom")) is None
    assert hooks.detached == ["detached: ValueError: boom"]


def test_an_error_without_a_message_is_named_by_its_type() -> None:
    faults = HookFaults(rank=0)
    faults.error = RuntimeError()
    assert faults.reason() == "detached: RuntimeError"
