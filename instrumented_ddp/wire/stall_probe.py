"""What a rank that has stopped making progress says of itself, inside its heartbeat.

A heartbeat always carries the step and phase its main thread is in (``Heartbeat.phase``). Once
the rank has finished no step for a while (``PROBE_AFTER_S``, or twice its recent median step),
the heartbeat also carries a ``StallProbe``: the collectives it has issued and not seen complete,
how many it has issued on each group, and the main thread's Python stack. The listener pairs the
ranks' probes to name who holds the others up (``ddpwatch.figures.stalls``). The probe is read
by the rank's sender thread from what the timeline keeps anyway, with no signal and no device
sync, so a step that progresses pays nothing for it.
"""

from __future__ import annotations

from typing import Annotated, NamedTuple

import msgspec
from msgspec import Meta

#: A rank that has finished no step for this long (or twice its recent median step, whichever
#: is longer) sends a probe: below the listener's 3 s floor for naming a stall, one heartbeat
#: earlier, so that the stall is named with every rank's probe in hand.
PROBE_AFTER_S = 1.5
MAX_IN_FLIGHT = 8  # the oldest of a rank's collectives in flight: the stall is about the first
MAX_GROUPS = 32
MAX_STACK_LINES = 48  # the innermost frames of the main thread's stack
MAX_LINE = 240
MAX_NAME = 64

Name = Annotated[str, Meta(max_length=MAX_NAME)]
Line = Annotated[str, Meta(max_length=MAX_LINE)]
Count = Annotated[int, Meta(ge=0)]
Seconds = Annotated[float, Meta(ge=0.0, le=1e12)]

#: What a rank's main thread can be doing, as ``Heartbeat.phase`` says it. "between" is a step
#: boundary (the loop's own code before its next forward); "" from a rank that does not say.
PHASES = ("", "data", "forward", "after_forward", "backward", "optimizer", "wait", "between")


class InFlight(NamedTuple):
    """A collective the rank issued and has not seen complete. On the wire, an array.

    ``group``: "" for the strategy's or the model's own process group, else its name (as
    ``StepReport`` spans' queues say). ``seq``: its number among the collectives ddpwatch timed on
    that group since the rank started, 1 for the first: the same collective has the same number
    on every rank of the group, so a rank whose ``StallProbe.issued`` is below it has not reached it.
    One whose work or end event says it finished is not in flight, though the main thread has not
    yet come back to resolve it (``timing.in_flight``)."""

    kind: Name
    tag: Name = ""
    nbytes: Count = 0
    group: Name = ""
    seq: Count = 0
    step: Count = 0
    waited_s: Seconds = 0.0  # since it was issued


class StallProbe(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """A stalled rank's own account (see the module docstring)."""

    idle_s: Seconds  # since the rank last finished a step (or, before its first, since it started)
    in_step: Count = 0  # the step begun and not finished; 0 between steps
    in_flight: Annotated[list[InFlight], Meta(max_length=MAX_IN_FLIGHT)] = msgspec.field(default_factory=list)
    #: Collectives ddpwatch timed on each group since the rank started (the keys as ``InFlight.group``).
    issued: Annotated[dict[Name, Count], Meta(max_length=MAX_GROUPS)] = msgspec.field(default_factory=dict)
    #: The main thread's stack, outermost first, a frame a line: ``file:line function: source``.
    stack: Annotated[list[Line], Meta(max_length=MAX_STACK_LINES)] = msgspec.field(default_factory=list)
    compiling: bool = False  # torch.compile is compiling: a long step, not a stall
    #: The innermost frame of ``stack`` in the user's own code (not torch's, a library's nor
    #: ddpwatch's), as ``stack`` writes it: the line a user wrote that the rank is held at; "" for none.
    place: Line = ""
    #: The main thread's native stack from py-spy, outermost first (``file:line function``), where
    #: the user asked for it (``DDPWATCH_NATIVE_STACKS``) and it has answered.
    native_stack: Annotated[list[Line], Meta(max_length=MAX_STACK_LINES)] = msgspec.field(default_factory=list)
    native_error: Line = ""  # why there is no native stack, where one was asked for
