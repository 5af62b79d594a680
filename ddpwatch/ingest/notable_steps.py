"""The steps worth a note on the dashboard, counted as their reports arrive: skipped optimizer
updates, torch.compile compiling, collectives no strategy timed, pauses of training, forwards
without gradients, accumulating steps that all-reduced early.

Kept over the whole run, however long ago the step left the screen: the notes name every such
step, each as a run of steps (``StepSet``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddpwatch.figures import accumulation
from ddpwatch.figures.compact_steps import StepSet
from instrumented_ddp.wire.messages import MAX_PAUSED_FOR, StepReport, StepSummary

PAUSE_KINDS_KEPT = 8  # what a run's loop paused for, named: evaluate, save, ... (a sender could name thousands)


def note_pause_kinds(kinds: dict[str, None], paused_for: str) -> None:
    """Add what one report's pause was for (``StepReport.paused_for``: "evaluate, save") to
    ``kinds``, in the order first heard, up to ``PAUSE_KINDS_KEPT`` of them, each cut to
    ``MAX_PAUSED_FOR`` characters, as a rank's timeline cuts the whole."""
    for what in paused_for.split(", "):
        if what and len(kinds) < PAUSE_KINDS_KEPT:
            kinds[what[:MAX_PAUSED_FOR]] = None


@dataclass
class CountedSteps:
    """Steps in which a rank counted something it reports per step (``StepReport.untimed_collectives``,
    ``nograd_forwards``), and the most one rank counted in one step: what a note says of them."""

    steps: StepSet = field(default_factory=StepSet)
    most: int = 0

    def note(self, step: int, count: int) -> None:
        if count:
            self.steps.add(step)
            self.most = max(self.most, count)


class NotableSteps:
    """What the run's reports said of their steps beyond the figures, over every rank."""

    def __init__(self) -> None:
        #: Steps any rank reported with its optimizer update skipped (``StepReport.update_skipped``).
        self.skipped_updates = StepSet()
        #: Steps any rank reported torch.compile compiling in (``StepReport.compiling``).
        self.compiling_steps = StepSet()
        #: Steps in which a rank issued collectives it did not time (``StepReport.untimed_collectives``:
        #: an attached script's own), and the most one rank issued in one step.
        self.untimed_collectives = CountedSteps()
        #: ... of which issued in the step's data time (``StepReport.untimed_in_data``: read as the loader's).
        self.untimed_in_data = CountedSteps()
        #: Steps before which a rank's loop paused training (``StepReport.paused_s``: an
        #: evaluation, a checkpoint), what for, and the longest pause of one rank.
        self.paused_steps = StepSet()
        self.paused_for: dict[str, None] = {}  # in the order first heard
        self.paused_longest_s = 0.0
        #: Steps whose data gap held forwards without gradients outside a marked pause
        #: (``StepReport.nograd_forwards``: an evaluation the loop did not mark), and the most of one rank.
        self.nograd_forwards = CountedSteps()
        #: Accumulating steps that all-reduced before their last micro-step (no ``no_sync``).
        self.early_reductions = accumulation.EarlyReductions()

    def note(self, report: StepReport | StepSummary) -> None:
        """Count what one report (not a detail: see ``RankState.is_detail``) says of its step."""
        if report.update_skipped:
            self.skipped_updates.add(report.step)
        if report.compiling:
            self.compiling_steps.add(report.step)
        self.untimed_collectives.note(report.step, report.untimed_collectives)
        self.untimed_in_data.note(report.step, report.untimed_in_data)
        if report.paused_s or report.paused_for:
            self.paused_steps.add(report.step)
            note_pause_kinds(self.paused_for, report.paused_for)
            self.paused_longest_s = max(self.paused_longest_s, report.paused_s)
        self.nograd_forwards.note(report.step, report.nograd_forwards)
        if isinstance(report, StepReport):
            self.note_early_reductions(report)

    def note_early_reductions(self, report: StepReport) -> None:
        """Read an accumulating step's spans for all-reduces before its last micro-step
        (``accumulation``): the first counted report with spans of each step, sent whole or as
        the detail of a summary."""
        if accumulation.reads(report) and self.early_reductions.wants(report.step):
            self.early_reductions.note(report.step, accumulation.micro_step_reduction(report.spans), report.strategy)
