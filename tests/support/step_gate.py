"""A gate on a run's steps, so that a test switching strategies live paces the run by what it has
seen land rather than racing it: ``workers/gated_train.py`` holds each rank before a step's batch
until the gate file allows that step.

A switch needs steps to land (the ranks agree on it at step boundaries), so a gated run is not just
held while a switch is pending: ``StepGate`` lets it through one step at a time, each once rank 0
has waited ``RELEASE_PAUSE_S`` at the gate. Steps that slow are longer than
``watch.AGREEMENT_EVERY_S`` (0.2 s), so the ranks agree at every boundary, and a switch sent after
the last one's acknowledgement is announced at the next boundary and applied at the one after: two
steps later on any box (three where the command reached rank 0 after the boundary). Free-running,
56 steps of 0.1 s once ended before the ninth switch landed: a switch took about 0.6 s, whatever
the step. The run's end waits for the test's last ``allow``."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Protocol

from ddpwatch.control.switch_client import request_switch
from gate_files import waiting_file, write_whole
from instrumented_ddp.wire.messages import Ack
from instrumented_ddp.wire.curve_keys import ClientKeys
from instrumented_ddp.publish.watch import AGREEMENT_EVERY_S
from launch import QUICK_EVAL, REPO_ROOT, RankGroup


class Running(Protocol):
    """What the gate asks of the run it paces: whether it has ended (``RankGroup``, a ``Popen``)."""

    def poll(self) -> int | None: ...


GATED_TRAIN = REPO_ROOT / "tests" / "support" / "workers" / "gated_train.py"
#: How long rank 0 waits at the gate before the next step is let through: longer than the spacing
#: rank 0 gives the agreements, so that they come at every step.
RELEASE_PAUSE_S = AGREEMENT_EVERY_S + 0.05
#: How often the test reads where rank 0 waits.
POLL_S = 0.02


class StepGate:
    """The test's side of the gate: what it allows, and where rank 0 last waited."""

    def __init__(self, path: Path, allowed: int = 0) -> None:
        self.path = path
        self.allowed = 0
        self._held_since: float | None = None  # when rank 0 was first seen held at the step it waits for
        self.allow(allowed)

    def allow(self, step: int) -> None:
        """Let the run take every step up to ``step`` (never fewer than already allowed)."""
        self.allowed = max(self.allowed, step)
        write_whole(self.path, str(self.allowed))

    def waiting_at(self) -> int:
        """The step rank 0 last waited at the gate for (0 before it first did)."""
        waiting = waiting_file(self.path)
        return int(waiting.read_text()) if waiting.exists() else 0

    def step_through(self, step: int, training: Running) -> None:
        """Let the run through to ``step`` one step at a time (``RELEASE_PAUSE_S`` held before each),
        until rank 0 waits for the step after it."""
        while self.waiting_at() <= step:
            self._release_when_held(training, step)
            time.sleep(POLL_S)

    def switch(self, address: str, strategy: str, bucket_mb: float | None, grad_accum: int | None, training: Running,
               last_step: int, keys: ClientKeys | None = None, timeout_s: float = 120) -> Ack:
        """``request_switch``, letting the run through one step at a time until it is acknowledged;
        fails if it has not landed by ``last_step``."""
        answer: list[Ack | BaseException] = []

        def ask() -> None:
            try:
                answer.append(request_switch(address, strategy, bucket_mb, grad_accum, timeout_s, keys=keys))
            except BaseException as error:  # handed to the test's thread, raised there
                answer.append(error)

        asking = threading.Thread(target=ask, daemon=True)
        asking.start()
        while asking.is_alive():
            self._release_when_held(training, last_step, f"the switch to {strategy}")
            asking.join(POLL_S)
        if isinstance(answer[0], BaseException):
            raise answer[0]
        return answer[0]

    def _release_when_held(self, training: Running, last_step: int, waiting_for: str = "") -> None:
        """The next step, once rank 0 has waited for it ``RELEASE_PAUSE_S``; never past ``last_step``."""
        assert training.poll() is None, f"the run ended while the test waited for {waiting_for or f'step {last_step}'}"
        if self.waiting_at() <= self.allowed:
            self._held_since = None
            return
        self._held_since = self._held_since if self._held_since is not None else time.monotonic()
        if time.monotonic() - self._held_since >= RELEASE_PAUSE_S:
            assert self.allowed < last_step, f"{waiting_for} had not landed by step {last_step}"
            self.allow(self.allowed + 1)
            self._held_since = None


def start_gated_ranks(gate: StepGate, args: list[str], log: Path, nproc: int = 2) -> RankGroup:
    """``start_ranks`` with the gate: ``train.py ARGS`` whose steps wait for ``gate``."""
    return RankGroup([str(GATED_TRAIN), str(gate.path), *QUICK_EVAL, *args], nproc, log)
