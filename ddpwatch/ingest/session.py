"""What the receiver knows about one training session, fed message by message.

The dashboard, the headless recorder and replay all fold the same messages into this state and
ask ``metrics`` for figures, so the live screen and the exported summary cannot disagree.

``Session`` checks each message (``MessageChecks``) and hands it to the collaborator whose job
it is, then answers every question through them: ``RunIdentity`` (which run it holds),
``RankLiveness`` (the world and how each rank is doing), ``AllReduceGroups`` (who meets whom),
``StepStore`` (the kept reports and their figures), ``SegmentFolding`` (segments and their
running figures), ``NotableSteps`` (the steps a note names), ``StallWatch`` (when no step comes,
and what holds the run).
"""

from __future__ import annotations

import time
from collections import Counter

from ddpwatch.figures.cost_model import StepCollectives
from ddpwatch.figures.cross_rank import DesyncRange, Groups
from ddpwatch.figures.metrics import SegmentFigures
from ddpwatch.figures.watch_overhead import WatchOverhead, WatchOverheadPairing, segment_key
from ddpwatch.ingest.all_reduce_groups import AllReduceGroups
from ddpwatch.ingest.evaluations import Evaluations
from ddpwatch.ingest.message_checks import MessageChecks
from ddpwatch.ingest.notable_steps import NotableSteps
from ddpwatch.ingest.rank_liveness import RankLiveness
from ddpwatch.ingest.rank_state import RankState
from ddpwatch.ingest.run_identity import RunIdentity
from ddpwatch.ingest.segment_folding import SegmentFolding
from ddpwatch.ingest.segments import Segment
from ddpwatch.ingest.stall_watch import StallWatch
from ddpwatch.ingest.step_store import PreparedReport, StepStore
from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import (
    Ack, DeviceSample, Evaluation, Goodbye, Heartbeat, Hello, Message, StepReport, StepSummary, SwitchCommand)
from instrumented_ddp.wire.step_figures import CallTimes, StepFigures, StepTimes, counted

#: What callers import from here, wherever it lives in the collaborators' modules.
__all__ = ["Session"]

UNWATCHED_SAMPLES_KEPT = 64  # unwatched steps whose samples ``unwatched_samples`` keeps: the newest few blocks
FORGET_DETAILED_EVERY = 64  # steps: how often the ranks' record of sampled steps' spans drops those not kept


class Session:
    """State of one session: hellos, step reports grouped into segments, device samples.

    A step is folded into its segment's running figures as soon as every rank has reported it
    (``SegmentFolding``). ``keep_steps`` and ``detail_rank_steps`` bound the steps and the
    details kept (``StepStore``): the dashboard sets them, the recorder keeps every report for
    the exports. With ``device_samples``, the ranks' device samples kept are bounded the same way:
    that many over all ranks (``RankState.add_device_sample``) instead of
    ``DEVICE_SAMPLES_PER_RANK`` each.

    The collaborators' containers are the session's attributes of the same names (``ranks``,
    ``reports``, ``segments``, ...): each collaborator changes them in place, never rebinds them.
    """

    def __init__(self, keep_steps: int | None = None, detail_rank_steps: int | None = None,
                 device_samples: int | None = None) -> None:
        self.device_samples = device_samples
        self.run_identity = RunIdentity()
        self.liveness = RankLiveness()
        self.reduce_groups = AllReduceGroups(self.liveness)
        self.store = StepStore(self.liveness, self.reduce_groups, keep_steps, detail_rank_steps)
        self.folding = SegmentFolding(self.store, self.liveness, self.reduce_groups)
        self.notable = NotableSteps()
        self.checks = MessageChecks(self.liveness)
        self.stall_watch = StallWatch(self.liveness, self.folding.segments)
        self.acks: list[Ack] = []
        #: The unwatched steps' walls against the watched ones around them (``watch_overhead``).
        self.overhead_pairing = WatchOverheadPairing()
        #: Samples of every rank of each recent counted unwatched step, for a rate over recent
        #: steps that holds them (the header's): their steps' time is in its wall.
        self.unwatched_samples: dict[int, int] = {}
        #: What the run's evaluations measured, by the step each followed.
        self.evaluations = Evaluations()
        self.rejected: Counter[str] = Counter()
        #: What the last message that passed every check and still raised as it was folded raised
        #: (``rejected["unfoldable"]`` counts them): said on the dashboard, so a fault is seen.
        self.unfoldable_error = ""
        self.messages = 0
        self.details = 0  # spans received after their step's summary (a view that drew the step redraws it)
        self.ranks = self.liveness.ranks
        self.reports = self.store.reports
        self.segments = self.folding.segments
        self.other_runs = self.run_identity.other_runs
        self.transfer_memory = self.folding.transfer_memory
        self.slowdown_memory = self.folding.slowdown_memory
        notable = self.notable
        self.skipped_updates, self.compiling_steps = notable.skipped_updates, notable.compiling_steps
        self.untimed_collectives, self.untimed_in_data = notable.untimed_collectives, notable.untimed_in_data
        self.paused_steps, self.paused_for = notable.paused_steps, notable.paused_for
        self.nograd_forwards, self.early_reductions = notable.nograd_forwards, notable.early_reductions

    # -- feeding ---------------------------------------------------------------------------------
    def ingest(self, envelope: Envelope, received_at: float | None = None, prepared: PreparedReport | None = None,
               run: str = "") -> str | None:
        """Fold one decoded message in; returns the rejection category of a well-formed message
        whose values cannot be true here (and counts it; a message of another run: ``other_runs``), else None. ``prepared``: a step report's
        ``prepare_report``, made elsewhere (used when figured for this session's world size).
        ``run``: the run whose rank sent it, where the listener knew (``endpoints.run_of_sender``):
        a message of a run other than this session's is left out, whatever it is, so a second
        script sending to the same address never mixes its reports into this run's figures."""
        now = time.monotonic() if received_at is None else received_at
        message = envelope.message
        if isinstance(message, SwitchCommand):
            self.messages += 1
            return None
        if run:
            self.run_identity.hear_sender_run(run)
        if other := self.run_identity.other_run(message, run):
            self.other_runs[other] += 1  # not "malformed": a second script pointed at the same address
            return "another_run"
        problem = self.checks.impossible(envelope)
        if problem is not None:
            self.reject(problem)
            self.liveness.note_rejected(envelope)
            return problem
        try:
            self._fold_in_checked(envelope, now, prepared)
        except Exception as error:  # a message no check foresaw: one rejected, never the listener lost
            self.unfoldable_error = f"{type(envelope.message).TYPE} from rank {envelope.rank}: {type(error).__name__}: {error}"[:200]
            self.reject("unfoldable")
            return "unfoldable"
        return None

    def _fold_in_checked(self, envelope: Envelope, now: float, prepared: PreparedReport | None) -> None:
        """Hand a message that passed every check to the collaborator whose job it is."""
        message = envelope.message
        self.messages += 1
        rank = self.liveness.hear(envelope, now)
        passed = rank.last_step
        if isinstance(message, Hello):
            self.run_identity.hear_hello(message)
            self.reduce_groups.hear_hello(rank.hello, message)
            self.liveness.note_hello(rank, message)
        elif isinstance(message, (StepReport, StepSummary)):
            self._receive_report(rank, message, prepared)
        elif isinstance(message, DeviceSample):
            rank.add_device_sample(message, self.device_samples, self.world_size)
        elif isinstance(message, Heartbeat):
            self.liveness.note_heartbeat(rank, message, now)
        elif isinstance(message, Ack):
            self.acks.append(message)
        elif isinstance(message, Evaluation):
            self.evaluations.add(message)
        elif isinstance(message, Goodbye):
            self.liveness.note_goodbye(rank, message)
        if rank.last_step != passed:
            rank.last_step_at = now
            self.stall_watch.step_finished(now)
        self.stall_watch.look(now)

    def reject(self, category: str) -> None:
        self.rejected[category] += 1

    def _receive_report(self, rank: RankState, report: StepReport | StepSummary, prepared: PreparedReport | None = None) -> None:
        """Count what a report says about its rank and its step, then keep and fold it if its step
        is still open; the spans of a summarized step go into its kept report. An unwatched
        step's window goes to the overhead pairing alone: it is in no other figure, and its
        step lies in its segment."""
        if isinstance(report, StepReport) and report.unwatched:
            rank.note_report(report, self.folding.is_folded(report.step))
            self.folding.add_unwatched(report)
            if counted(report):
                self.overhead_pairing.add_unwatched(report.rank, report.step, report.end - report.start,
                                                    segment_key(report.strategy, report.settings))
                self.unwatched_samples[report.step] = self.unwatched_samples.get(report.step, 0) + report.samples
                if len(self.unwatched_samples) > UNWATCHED_SAMPLES_KEPT:
                    del self.unwatched_samples[min(self.unwatched_samples)]
            return
        if rank.is_detail(report):
            self._receive_detail(rank, report, prepared)
            return
        folded = self.folding.is_folded(report.step)
        rank.note_report(report, folded)
        self.notable.note(report)
        if counted(report):
            self.overhead_pairing.add_watched(report.rank, report.step, report.end - report.start,
                                              segment_key(report.strategy, report.settings))
        if not folded:
            self._keep_report(report, prepared)

    def _receive_detail(self, rank: RankState, report: StepReport, prepared: PreparedReport | None) -> None:
        """Put a summarized step's spans in its kept report; a step the session forgot gets nothing,
        and is counted."""
        rank.detailed.add(report.step)
        if not self.store.keep_spans(report, prepared):
            rank.details_unused += 1
            return
        self.notable.note_early_reductions(report)
        self.details += 1

    def _keep_report(self, message: StepReport | StepSummary, prepared: PreparedReport | None) -> None:
        """Keep a report of an open step, fold what it finished, and forget past ``keep_steps``."""
        self.folding.add(self.store.keep(message, prepared))
        while (oldest := self.store.step_past_keeping()) is not None:
            if oldest % FORGET_DETAILED_EVERY == 0:
                self.liveness.forget_detailed_below(oldest)
            self.folding.fold(oldest)
            self.store.forget_step(oldest)
        self.store.forget_old_details(self.folding.is_folded)

    # -- the run and its ranks -------------------------------------------------------------------
    @property
    def session_id(self) -> str:
        return self.run_identity.session_id

    @property
    def runs_told_apart(self) -> bool:
        return self.run_identity.runs_told_apart

    def next_run(self, message: Message, now: float, run: str = "") -> str:
        """The run that ``message``, arriving at ``now`` from ``run`` (where known), begins once this
        one is over (``RankLiveness.run_is_over``), or "": its hello, or any message of its where
        the sender's run is known (its step reports may come before its next hello). The one rule
        by which the dashboard and ``recorder.load_session`` start a session of its own for it (a
        script run again into a dashboard left open)."""
        other = self.run_identity.other_run(message, run)
        return other if other and self.liveness.run_is_over(now) else ""

    @property
    def world_size(self) -> int:
        return self.liveness.world_size

    @property
    def first_failed_rank(self) -> int | None:
        return self.liveness.first_failed_rank

    @property
    def finished(self) -> bool:
        return self.liveness.finished

    @property
    def trains_again(self) -> bool:
        return self.liveness.trains_again

    def status(self, rank: int, now: float | None = None, recording_ended: bool = False) -> str:
        return self.liveness.status(rank, now, recording_ended)

    def stopped_ranks(self, now: float) -> dict[int, int]:
        return self.liveness.stopped_ranks(now)

    def ranks_held_by_lost(self, now: float) -> tuple[dict[int, int], dict[int, float]]:
        return self.liveness.ranks_held_by_lost(now)

    @property
    def failed_ranks(self) -> dict[int, tuple[int, str]]:
        return self.liveness.failed_ranks

    @property
    def interrupted_ranks(self) -> dict[int, tuple[int, str]]:
        return self.liveness.interrupted_ranks

    @property
    def detached_ranks(self) -> dict[int, tuple[int, str]]:
        return self.liveness.detached_ranks

    def all_reduce_groups(self) -> Groups | None:
        return self.reduce_groups.groups()

    @property
    def all_reduce_groups_problem(self) -> str | None:
        return self.reduce_groups.problem

    def refused_switches(self) -> list[Ack]:
        """Each switch the run refused, once, in the order heard: the lowest rank's answer (every
        rank refuses a command that cannot apply, rank 0 alone one whose asker stopped waiting,
        and it answers each resend of one alike). What the exports list: the segments show only
        the switches that were applied."""
        refused: dict[str, Ack] = {}
        for ack in self.acks:
            if not ack.applied and (ack.command_id not in refused or ack.rank < refused[ack.command_id].rank):
                refused[ack.command_id] = ack
        return list(refused.values())

    @property
    def paused_longest_s(self) -> float:
        return self.notable.paused_longest_s

    # -- steps -----------------------------------------------------------------------------------
    def step_figures(self, step: int) -> dict[int, StepFigures]:
        return self.store.step_figures(step)

    def step_times(self, step: int) -> dict[int, StepTimes]:
        return self.store.step_times(step)

    def step_calls(self, step: int) -> dict[int, CallTimes]:
        return self.store.step_calls(step)

    def counted_calls(self, step: int) -> dict[int, CallTimes]:
        return self.store.counted_calls(step)

    def step_waits(self, step: int) -> tuple[dict[int, float], dict[int, float]]:
        return self.store.step_waits(step)

    def step_collectives(self, step: int) -> StepCollectives:
        return self.store.step_collectives(step)

    def has_spans(self, step: int, rank: int) -> bool:
        return self.store.has_spans(step, rank)

    def latest_complete_step(self) -> int | None:
        return self.store.latest_complete_step()

    # -- segments --------------------------------------------------------------------------------
    def is_folded(self, step: int) -> bool:
        return self.folding.is_folded(step)

    def segment_of(self, step: int) -> Segment | None:
        return self.folding.segment_of(step)

    def desync_range(self) -> DesyncRange | None:
        return self.folding.desync_range()

    def segment_reports(self, segment: Segment, include_excluded: bool = False) -> list[StepReport]:
        return self.folding.segment_reports(segment, include_excluded)

    def segment_figures(self, segment: Segment, include_pending: bool = True,
                        per_rank: bool = True) -> SegmentFigures:
        return self.folding.segment_figures(segment, include_pending, per_rank)

    def watch_overhead(self, segment: Segment) -> WatchOverhead | None:
        """What watching cost the segment's steps, from its unwatched ones (``watch_overhead``);
        None where it has none."""
        return self.overhead_pairing.overhead(segment.first_step, segment.last_step)

    def segment_data_wait_by_rank(self, segment: Segment) -> dict[int, float]:
        return self.folding.segment_data_wait_by_rank(segment)
