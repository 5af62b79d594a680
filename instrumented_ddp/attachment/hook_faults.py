"""ddpwatch's own faults inside the hooks it puts on a user's loop: a hook must never make the
loop raise (nor raise again at every step after), so where ddpwatch's code raises in one, the
rank stops being watched, said in one line, and training goes on unwatched."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

from instrumented_ddp.publish import stop_signals
from instrumented_ddp.wire.messages import DETACHED


class HookFaults:
    """What ddpwatch's own code raised in a hook of rank ``rank``'s loop, where it did."""

    def __init__(self, rank: int) -> None:
        self._rank = rank
        self.error: Exception | None = None

    def stop_watching_after(self, error: Exception, where: str) -> None:
        """ddpwatch's own code raised ``error`` in the hook ``where``: every hook is a no-op from
        now on (``never_raises_into_the_loop`` removes them), said in one line on this rank."""
        self.error = error
        try:
            print(f"instrumented_ddp.attach: rank {self._rank}: ddpwatch raised "
                  f"{self.reason().removeprefix(DETACHED)} in {where}: this rank is no longer watched and trains on "
                  "unwatched (a fault of ddpwatch's: please report it with this line)", file=sys.stderr, flush=True)
        except Exception:  # no stderr to say it on: the goodbye still says it
            pass

    def reason(self) -> str:
        """The goodbye of a rank whose watching stopped on ``error``: *detached: OverflowError: …*."""
        first_line = next(iter(str(self.error).splitlines()), "")
        return f"{DETACHED}{type(self.error).__name__}" + (f": {first_line[:200]}" if first_line else "")


class GuardedHooks(Protocol):
    """What holds hooks guarded by ``never_raises_into_the_loop`` (``PhaseHooks``)."""

    faults: HookFaults

    def detach(self, reason: str) -> None: ...


_Hook = TypeVar("_Hook", bound=Callable[..., Any])


def never_raises_into_the_loop(detaches_here: bool) -> Callable[[_Hook], _Hook]:
    """A hook of the loop's model, its optimizers or its backward, which must never make the
    loop raise: where ddpwatch's own code raises in it, the rank stops being watched
    (``HookFaults``). The hooks are removed at once where ``detaches_here`` (a forward's: torch
    copies its hooks before it calls them), else at the next forward or the exit, whichever comes
    first, since an optimizer's hooks are called from a loop over the very dict removing them
    would change; until then each is a no-op. A SIGTERM or a Ctrl-C that comes inside one is
    raised as it returns (``stop_signals.held``): a step's report is never made and left unsent."""

    def guard(hook: _Hook) -> _Hook:
        @functools.wraps(hook)
        def guarded(self: GuardedHooks, *args: Any, **kwargs: Any) -> Any:
            if self.faults.error is None:
                try:
                    with stop_signals.held:  # a SIGTERM or Ctrl-C lands in the loop's code, not mid-report
                        return hook(self, *args, **kwargs)
                except Exception as error:
                    self.faults.stop_watching_after(error, hook.__name__)
            if detaches_here:
                try:
                    self.detach(self.faults.reason())
                except Exception:  # what is left of the watch goes with the process
                    pass
            return None

        return cast(_Hook, guarded)

    return guard
