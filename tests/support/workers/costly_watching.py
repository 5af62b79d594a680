"""A training script whose watching costs a known amount: ``python costly_watching.py STEP_MS
COST_MS SCRIPT ARGS…`` runs SCRIPT (``examples/plain_ddp.py``, ``train.py``) as its own
``__main__``.

Every step sleeps STEP_MS inside its window, watched or not (the work of a longer step, beside
which a small model's own noise on this box is small), and a watched step COST_MS more, in the
timeline's ``end_step``: a fake cost of watching, which the run's self-measurement
(``DDPWATCH_UNWATCHED``, ``train.py --unwatched``) must read as COST_MS over the step's wall."""

from __future__ import annotations

import runpy
import sys
import time
from typing import Any

from instrumented_ddp.timing.timeline import StepTimeline


def make_watching_cost(step_s: float, cost_s: float) -> None:
    begin, end = StepTimeline.begin_step, StepTimeline.end_step

    def begin_step(self: StepTimeline, *args: Any, **kwargs: Any) -> None:
        begin(self, *args, **kwargs)
        time.sleep(step_s)

    def end_step(self: StepTimeline, *args: Any, **kwargs: Any) -> None:
        if self.watching and self.in_step:
            time.sleep(cost_s)
        end(self, *args, **kwargs)

    StepTimeline.begin_step = begin_step  # type: ignore[method-assign]
    StepTimeline.end_step = end_step  # type: ignore[method-assign]


if __name__ == "__main__":
    step_ms, cost_ms, script = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    make_watching_cost(step_ms / 1000, cost_ms / 1000)
    sys.argv = [script, *sys.argv[4:]]
    runpy.run_path(script, run_name="__main__")
