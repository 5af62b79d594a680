"""How often Python's cycle collector makes a full pass while the dashboard runs."""

from __future__ import annotations

import gc

from ddpwatch.dashboard.views.snapshot_parts import SMALL_JOB_MAX_RANKS

#: Younger collections between two full passes of Python's cycle collector (its default: 10). A
#: full pass scans every tracked object, and at the default it comes often enough to drop frames;
#: objects made before the first frame (imports, widgets) are frozen out of it. Textual's strips
#: form reference cycles, so a much longer wait lets their garbage pile up.
FULL_COLLECTION_AFTER = 100  # a full pass about every 6 s at 64 ranks
#: The same above ``SMALL_JOB_MAX_RANKS`` ranks: the session then holds hundreds of thousands of
#: objects (ranks x kept steps), a full pass freezes the screen, and it must come seldom; a large
#: job's fewer frames a second make fewer strips, so their garbage does not pile up meanwhile.
LARGE_JOB_FULL_COLLECTION_AFTER = 1000  # a full pass about every 75 s at 1,024 ranks


class CollectorTuning:
    """Freezes what exists at ``start`` out of the cycle collector and spaces its full passes
    (``FULL_COLLECTION_AFTER``, ``LARGE_JOB_FULL_COLLECTION_AFTER`` once a large job shows
    itself); ``stop`` puts the collector back as ``start`` found it."""

    def __init__(self) -> None:
        self._thresholds = gc.get_threshold()
        self.full_collection_after = 0  # set at start

    def start(self) -> None:
        """Collects, freezes what is left, and sets the small job's full-pass threshold."""
        self._thresholds = gc.get_threshold()
        gc.collect()
        gc.freeze()
        self.full_collection_after = FULL_COLLECTION_AFTER  # a large job's, once it shows itself
        gc.set_threshold(*self._thresholds[:2], self.full_collection_after)

    def note_ranks(self, ranks: int) -> None:
        """Sets the large job's threshold, once, when more than ``SMALL_JOB_MAX_RANKS`` ranks are known."""
        if self.full_collection_after == FULL_COLLECTION_AFTER and ranks > SMALL_JOB_MAX_RANKS:
            self.full_collection_after = LARGE_JOB_FULL_COLLECTION_AFTER
            gc.set_threshold(*self._thresholds[:2], self.full_collection_after)

    def stop(self) -> None:
        """Unfreezes and restores the thresholds ``start`` found."""
        gc.unfreeze()
        gc.set_threshold(*self._thresholds)
