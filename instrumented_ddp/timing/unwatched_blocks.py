"""Which steps a rank runs unwatched, so that the run measures what watching costs it.

Now and then a short block of steps skips every mark but the step's own window (its start and
end, the two stamps any step has): no phase, collective, ready mark, poll or completion
callback is recorded, and the step goes out as a report with no spans, marked ``unwatched``.
The listener compares those steps' wall times with the watched steps around them
(``ddpwatch.figures.watch_overhead``): what the difference holds is what the timeline costs the
step. Every rank decides from the step number alone, so all ranks leave the same steps
unwatched with no agreement between them, and a collective that waits for a slower rank waits
alike in both kinds of step.

What an unwatched step still does, and the measurement therefore cannot see: the hooks
installed for the whole run (a DDP communication hook is called into Python whether or not the
step is timed), the switch agreement, and sending the step's small report. ``bench/overhead.py``
measures those against a copy with no instrumentation at all.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Steps between the starts of two unwatched blocks: 4 steps in 100 leave 96 % of the steps in
#: every figure and give a measurement from 40 unwatched steps by step 1,000.
UNWATCHED_EVERY_STEPS = 100
#: Steps in a block: enough that one slow step (a loader's hiccup) does not decide a block.
UNWATCHED_BLOCK_STEPS = 4


@dataclass(frozen=True)
class UnwatchedBlocks:
    """``length`` unwatched steps out of every ``every``; the first block begins at step
    ``every // 2`` (past the first steps, which warm up), the next ``every`` steps later.
    ``every`` 0: no step is ever unwatched (the self-measurement is off)."""

    every: int = UNWATCHED_EVERY_STEPS
    length: int = UNWATCHED_BLOCK_STEPS

    def __post_init__(self) -> None:
        if self.every < 0 or (self.every > 0 and not 1 <= self.length < self.every):
            raise ValueError(f"unwatched blocks of {self.length} steps every {self.every}: the blocks must "
                             "hold at least 1 step and fewer than every (every 0 turns them off)")

    @property
    def on(self) -> bool:
        return self.every > 0

    def holds(self, step: int) -> bool:
        """Whether ``step`` (counted from 1, as the timeline counts steps) runs unwatched."""
        if self.every <= 0:
            return False
        offset = step - self.every // 2
        return offset >= 0 and offset % self.every < self.length


#: The self-measurement off: every step watched.
NEVER_UNWATCHED = UnwatchedBlocks(every=0)




#: Where a job sets the schedule for a script the user cannot pass flags to
#: (``publish.watch_environment``); ``train.py --unwatched`` wins over it.
UNWATCHED_ENV = "DDPWATCH_UNWATCHED"


def parse_unwatched(text: str) -> UnwatchedBlocks:
    """``EVERY`` or ``EVERY:LENGTH`` (``100``, ``100:4``); ``0`` or ``off``: never unwatched; ""
    the default. Raises ``ValueError`` in one line for anything else."""
    text = text.strip().lower()
    if text == "":
        return UnwatchedBlocks()
    if text in ("0", "off"):
        return NEVER_UNWATCHED
    every_text, _, length_text = text.partition(":")
    try:
        every, length = int(every_text), int(length_text) if length_text else UNWATCHED_BLOCK_STEPS
    except ValueError:
        raise ValueError(f"unwatched blocks {text!r}: give EVERY or EVERY:LENGTH in steps (100, 100:4), or 0 "
                         "to measure nothing") from None
    if every == 0:
        return NEVER_UNWATCHED
    return UnwatchedBlocks(every, length)
