"""How many collectives this process issued in a step, in every process group it belongs to.

Why: ``attach`` times the collectives of the DDP or FSDP it is attached to, and nothing else. A
user's script issues its own as well, and they are real communication inside the step: the
Hugging Face Trainer all-gathers each batch's label count, and at each logging step the loss and
the step's floating-point operations, and under FSDP2 its gradient clipping all-reduces the norm
of the sharded gradients; DDP with ``find_unused_parameters=True`` all-reduces its map of used
parameters. Their time falls in whichever phase or gap issued them: as compute inside a phase, as
data loading before a forward (``StepCallCounts``). Counting them tells the user they are there.

Each backend keeps a count of the collectives issued on it, the one ``ProcessGroupNCCL`` calls
``seqCollective_`` and gloo ``seq_`` (``Backend._get_sequence_number_for_group``): a counter read,
no communication, nothing waited for. What the step issued is the sum of the counts' growth over
every group in ``torch.distributed`` (a group made in the step counts from 0); what ddpwatch did
not time is that less the collectives it timed. On gloo the count includes point-to-point sends
and receives; NCCL counts those apart (``seqP2P_``), so they are not in it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

#: The device types whose backends a group may hold apart ("cpu:gloo,cuda:nccl" holds two).
_DEVICE_TYPES = ("cpu", "cuda")


def process_groups() -> list[Any]:
    """Every process group this process made (the default one included), as torch keeps them."""
    from torch.distributed.distributed_c10d import _world

    return list(_world.pg_map)


def backends_of(group: Any) -> list[Any]:
    """The distinct backends of ``group``: one, or one per device type it was given."""
    found: list[Any] = []
    for device_type in _DEVICE_TYPES:
        try:
            backend = group._get_backend(torch.device(device_type))
        except Exception:  # no backend for this device type
            continue
        if not any(backend is known for known in found):
            found.append(backend)
    return found


class IssuedCollectives:
    """Collectives issued since the last ``since_last``, summed over every process group."""

    def __init__(self, groups: Callable[[], Iterable[Any]] = process_groups) -> None:
        self._groups = groups
        self._backends: dict[Any, list[Any]] = {}  # per group, found once
        self._counts: dict[Any, int] | None = None  # per backend, at the last look (None: no look yet)
        self.readable = True  # False once a backend could not say: counts are then never reported

    def _read(self) -> dict[Any, int] | None:
        counts: dict[Any, int] = {}
        try:
            self._backends = {group: self._backends.get(group) or backends_of(group) for group in self._groups()}
            for backends in self._backends.values():
                for backend in backends:
                    counts[backend] = int(backend._get_sequence_number_for_group())
        except Exception:  # a backend without a count (a third-party one): say nothing rather than guess
            self.readable = False
            return None
        return counts

    def since_last(self) -> int | None:
        """Collectives issued since the last call; None on the first call or where they cannot be read."""
        if not self.readable:
            return None
        counts = self._read()
        if counts is None:
            return None
        before, self._counts = self._counts, counts
        if before is None:
            return None
        return sum(count - before.get(backend, 0) for backend, count in counts.items())


class StepCallCounts:
    """The calls one step issued and timed: what it issued beyond what ddpwatch timed, and how
    much of that in its data time.

    Why: a collective the loop issues between a backward and the next forward (a loss
    all-reduced for logging after the update, the Trainer's gather of each batch's label count
    before its forward) falls in the step's ``data`` span: its time, a wait in it for a slower
    rank included, reads as the loader's, so a straggler reads as slow data loading on every
    other rank. One issued inside a phase reads as compute. So the count is read where each data
    gap begins and where it ends (a counter read each, ``IssuedCollectives``); what ddpwatch
    timed in the gap (an FSDP all-gather its pre-forward hook issued before ours ran) is not
    the loop's. ``timed``: how many collectives the current step has timed so far."""

    def __init__(self, issued: IssuedCollectives, timed: Callable[[], int]) -> None:
        self._issued, self._timed = issued, timed
        self._total: int | None = 0  # issued in the step so far (None: not countable)
        self._in_data = 0  # of which in its data gaps, less what was timed there
        self._timed_at_gap: int | None = None  # the step's timed count where the open gap began (None: no gap open)

    def restart(self, in_gap: bool) -> None:
        """Count from now: at the first step's first forward, or where a pause between steps
        ended (``in_gap``: the next step's data gap begins here)."""
        self._issued.since_last()
        self._total, self._in_data = 0, 0
        self._timed_at_gap = self._timed() if in_gap else None

    def _look(self) -> int:
        issued = self._issued.since_last()
        if issued is None:
            self._total = None
            return 0
        if self._total is not None:
            self._total += issued
        return issued

    def gap_begins(self) -> None:
        """A backward ended: a data gap begins, until a forward ends it (or the update cancels it)."""
        self._look()
        self._timed_at_gap = self._timed()

    def gap_cancelled(self) -> None:
        """The update began: what the loop issues from here is the optimizer phase's."""
        self._timed_at_gap = None

    def _untimed_in_gap(self, issued: int) -> int:
        """Of ``issued``, the collectives issued since the open gap began, those ddpwatch did
        not time there (0 where no gap is open)."""
        if self._timed_at_gap is None:
            return 0
        return max(0, issued - (self._timed() - self._timed_at_gap))

    def gap_ends(self) -> None:
        """A training forward begins: what was issued since the gap began, less what was timed
        there, was issued in the data time."""
        self._in_data += self._untimed_in_gap(self._look())
        self._timed_at_gap = None

    def step_ends(self, gap_to_next: bool = False) -> tuple[int | None, int]:
        """The step's count (None where not countable) and how many of them came in its data
        time; the next step, begun here, opens with a data gap. ``gap_to_next``: the step is
        found to have ended at its last backward only now (its update skipped): what was issued
        since that backward, in the open gap, is the next step's, in its data time where untimed;
        what was timed there goes to the next step with its spans (``StepTimeline.end_step``'s
        ``carried``), and so opens the next step's gap as already timed."""
        issued = self._look()
        carried, carried_untimed, carried_timed = 0, 0, 0
        if gap_to_next and self._timed_at_gap is not None:
            carried, carried_untimed = issued, self._untimed_in_gap(issued)
            carried_timed = self._timed() - self._timed_at_gap
        counted = (None if self._total is None else self._total - carried, self._in_data)
        self._total, self._in_data, self._timed_at_gap = carried, carried_untimed, carried_timed
        return counted
