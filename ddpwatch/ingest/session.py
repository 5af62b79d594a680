"""What the receiver knows about one training session, fed message by message.

The dashboard, the headless recorder and replay all fold the same messages into this state and
ask ``metrics`` for figures, so the live screen and the exported summary cannot disagree.
"""

from __future__ import annotations

import bisect
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

from ddpwatch.figures import accumulation
from ddpwatch.figures import metrics
from ddpwatch.figures.compact_steps import NO_SPANS, PackedSpans, StepSet, TagSequences
from ddpwatch.figures.compute_slowdown import MEASURED_STRATEGIES, SlowdownMemory, backward_beside
from ddpwatch.figures.cost_model import StepCollectives, TransferMemory, call_sizes
from ddpwatch.ingest.evaluations import Evaluations
from instrumented_ddp.wire.protocol import (
    MAX_PAUSED_FOR,
    Ack,
    DeviceSample,
    Envelope,
    Evaluation,
    Goodbye,
    Heartbeat,
    Hello,
    Message,
    StepReport,
    StepSummary,
    SwitchCommand,
    failure_of,
    detachment_of,
    interruption_of,
)
from instrumented_ddp.wire.step_figures import NO_CALLS, call_times, float_array, report_without_spans, summary_calls, summary_figures

MIN_DETAIL_STEPS = 8  # steps whose details a session with ``detail_rank_steps`` keeps, however many ranks
FOLD_LAG = 20  # a step still missing a rank this far behind the newest is folded as it is
LOST_AFTER_S = 2.5  # heartbeats come every second: a killed rank shows as lost within 3 s
STOPPED_STEPS = 5  # ranks move in step (each step's collectives need them all): this far behind, one has stopped
STOPPED_AFTER_S = 3.0  # ... and unmoved this long: not a rank whose reports are still resolving
STEP_REORDER_SLACK = 2  # a report this many steps behind the rank's newest is neither late nor backwards
#: A segment extends across at most this many steps no report has come for yet (a rank's dropped
#: ones): further, the gap may hold another strategy's steps, whose reports are still to come.
SEGMENT_GAP_STEPS = 4
FORGET_DETAILED_EVERY = 64  # steps: how often the ranks' record of sampled steps' spans drops those not kept
DEVICE_SAMPLES_PER_RANK = 600  # kept per rank (the dashboard's series, trace.json's device counters) ...
MIN_DEVICE_SAMPLES = 8  # ... or, in a session with ``device_samples`` set, that many over all ranks, this many at least


NO_FLOATS = float_array(())


class PreparedReport(NamedTuple):
    """What the session figures from a step report before it folds it in: the rank's figures,
    its collectives' times, and the report as kept (spans packed; a summary's none). Pure, so a
    receiver process can figure it off the UI's core (``dashboard/process_feed.py``)."""

    figures: metrics.StepFigures
    calls: metrics.CallTimes
    report: StepReport
    world_size: int  # the world it was figured for: a session of another size figures again


def prepare_report(message: StepReport | StepSummary, world_size: int) -> PreparedReport:
    """A summary comes figured by its rank (the same ``step_figures`` code); a full report is
    figured here, while its spans are still ``Span`` objects (packed, each reading makes them again)."""
    if isinstance(message, StepSummary):
        calls = summary_calls(message)
        figures, report = summary_figures(message, calls), report_without_spans(message)
    else:
        (figures, calls), report = metrics.figures_and_calls(message, world_size), message
    spans = PackedSpans(report.spans) if len(report.spans) else NO_SPANS  # one object for every summary's none
    return PreparedReport(figures, calls, replace(report, spans=spans), world_size)


@dataclass
class Segment:
    """A run of consecutive steps under one strategy and settings."""

    index: int
    strategy: str
    settings: dict[str, Any]
    first_step: int
    last_step: int
    #: steps the session no longer keeps, already folded into running figures
    folded: metrics.SegmentAccumulator | None = field(default=None, compare=False, repr=False)

    @property
    def folded_records(self) -> int:
        """(rank, step) reports folded so far: the segment's figures change only when this does."""
        return self.folded.records if self.folded is not None else 0

    @property
    def label(self) -> str:
        return strategy_label(self.strategy, self.settings)

    @property
    def short_label(self) -> str:
        return short_strategy_label(self.strategy, self.settings)


#: The settings a segment's label names: what tells a strategy's segments apart, HSDP's
#: replicas (an attached FSDP2 model on a 2-D mesh: ``fsdp (grad_accum=1, replicas=2)``) and an
#: attached DDP's own communication hook (``ddp (bucket_mb=25.0, comm_hook=fp16_compress_hook, ...)``).
LABELLED_SETTINGS = ("bucket_mb", "comm_hook", "grad_accum", "replicas")


PAUSE_KINDS_KEPT = 8  # what a run's loop paused for, named: evaluate, save, ... (a sender could name thousands)


def note_pause_kinds(kinds: dict[str, None], paused_for: str) -> None:
    """Add what one report's pause was for (``StepReport.paused_for``: "evaluate, save") to
    ``kinds``, in the order first heard, up to ``PAUSE_KINDS_KEPT`` of them, each cut to
    ``MAX_PAUSED_FOR`` characters, as a rank's timeline cuts the whole."""
    for what in paused_for.split(", "):
        if what and len(kinds) < PAUSE_KINDS_KEPT:
            kinds[what[:MAX_PAUSED_FOR]] = None


def strategy_label(strategy: str, settings: Mapping[str, Any]) -> str:
    """``bucket (bucket_mb=1.0, grad_accum=1)``: the strategy and the settings that tell its
    segments apart, as the segments table and the timeline's title name them."""
    shown = ", ".join(f"{k}={v}" for k, v in sorted(settings.items()) if k in LABELLED_SETTINGS)
    return f"{strategy} ({shown})" if shown else strategy


def short_strategy_label(strategy: str, settings: Mapping[str, Any]) -> str:
    """``bucket 1 MB``, ``ga accum 2``, ``fsdp 2 replicas``, ``ddp 25 MB fp16_compress``: the same settings as
    ``strategy_label`` in the words a column has room for, an accumulation of 1 (no accumulation)
    left unsaid. The segments table's first column: at 160 columns the long label
    (``bucket (bucket_mb=1.0, grad_accum=1)``) pushed step ms and samples/s out of view."""
    words = [strategy]
    if "bucket_mb" in settings:
        cap = settings["bucket_mb"]
        words.append(f"{cap:g} MB" if isinstance(cap, (int, float)) else f"{cap} MB")
    if "comm_hook" in settings:
        words.append(str(settings["comm_hook"]).removesuffix("_hook"))
    if settings.get("grad_accum", 1) != 1:
        words.append(f"accum {settings['grad_accum']}")
    if "replicas" in settings:
        words.append(f"{settings['replicas']} replicas")
    return " ".join(words)


def goodbyes_saying(said: Callable[[str], str | None], goodbyes: Iterable[tuple[int, Goodbye | None]]
                    ) -> dict[int, tuple[int, str]]:
    """``{rank: (steps done, what)}`` for each goodbye whose reason ``said`` reads (``failure_of``,
    ``interruption_of``), by rank: the session's and a summary's goodbyes alike."""
    return {rank: (goodbye.steps, what) for rank, goodbye in sorted(goodbyes, key=lambda pair: pair[0])
            if goodbye is not None and (what := said(goodbye.reason)) is not None}


def ranks_left_behind(last_steps: Mapping[int, int]) -> dict[int, int]:
    """The ranks ``STOPPED_STEPS`` or more behind the newest step any rank passed, with the step
    each is at: the one rule the dashboard's note (``Session.stopped_ranks``, which also asks
    that the rank be unmoved a while and not lost) and summary.md (from summary.json) apply."""
    newest = max(last_steps.values(), default=0)
    return {rank: step for rank, step in sorted(last_steps.items()) if newest - step >= STOPPED_STEPS}


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


@dataclass
class RankState:
    hello: Hello | None = None
    last_seen: float = 0.0
    last_seq: int = -1
    lost_messages: int = 0  # sequence gaps seen by the receiver
    sender_dropped: int = 0  # what the rank's own queue discarded
    last_step: int = 0  # the newest step it is known to have passed (reports and heartbeats)
    last_step_at: float = 0.0  # when ``last_step`` last moved, on the session's clock
    last_reported: int = -1  # the newest step it sent a report for
    reported: StepSet = field(default_factory=StepSet)
    summarized: StepSet = field(default_factory=StepSet)  # ... of which first as a StepSummary
    detailed: StepSet = field(default_factory=StepSet)  # ... whose spans came after the summary
    details_unused: int = 0  # spans that came after the session forgot their step
    late: int = 0  # reports for a step it had already passed (not rejected: see Session.ingest)
    late_unused: int = 0  # ... of which came after the session had folded their step
    unresolved: int = 0  # reports whose timing marks never all resolved (left out of the figures)
    unresolved_reason: str = ""  # why, as the newest such report said
    goodbye: Goodbye | None = None
    devices: deque[DeviceSample] = field(default_factory=lambda: deque(maxlen=DEVICE_SAMPLES_PER_RANK))
    devices_received: int = 0  # ever appended to ``devices``: how many are new since a count
    memory: dict[str, int] = field(default_factory=dict)  # bytes held, from its newest report that measured them
    memory_step: int = -1
    pausing: str = ""  # what its loop pauses training for now, as its newest heartbeat said (``Heartbeat.pausing``)
    pausing_since: float = 0.0  # when a heartbeat first said it, on the session's clock


class Session:
    """State of one session: hellos, step reports grouped into segments, device samples.

    A step is folded into its segment's running figures as soon as every rank has reported it
    (or once it is ``FOLD_LAG`` steps behind the newest, for a rank that died), so segment figures
    cost O(ranks), not O(steps). With ``keep_steps`` (the dashboard) only that many recent steps'
    reports stay in memory, for the timeline and trends; without it (the recorder) every report
    is kept for the exports.

    With ``detail_rank_steps`` as well, a folded step's details (its spans, each all-reduce's
    duration, each call's bandwidth) are kept for only that many reports' worth of recent steps
    (at least ``MIN_DETAIL_STEPS``); its figures, window and cross-rank waits stay for all
    ``keep_steps``. A 64-rank job keeps every detail of 120 steps; a 1,024-rank job sending 300
    all-reduces a step would otherwise hold ~2 GiB of them. A step pinned later gets its spans
    back from the ranks. With ``device_samples``, the ranks' device samples kept are bounded the
    same way: that many over all ranks (at least ``MIN_DEVICE_SAMPLES`` each), instead of
    ``DEVICE_SAMPLES_PER_RANK`` each (at 1,024 ranks, 600 each were ~300 MiB and 1.8M objects
    for the cycle collector to scan).
    """

    def __init__(self, keep_steps: int | None = None, detail_rank_steps: int | None = None,
                 device_samples: int | None = None) -> None:
        self.keep_steps = keep_steps
        self.detail_rank_steps = detail_rank_steps
        self.device_samples = device_samples
        self._detail_steps: deque[int] = deque()  # kept steps whose details are kept, in arrival order
        self._details_forgotten: set[int] = set()
        self._waits: dict[int, tuple[int, dict[int, float], dict[int, float]]] = {}  # step -> (reports, waited, waited for)
        self._folded_steps = StepSet()  # in runs: a set of every step grew with the run
        self._figures: dict[int, dict[int, metrics.StepFigures]] = {}  # step -> rank -> figures (kept steps)
        self._calls: dict[int, dict[int, metrics.CallTimes]] = {}  # step -> rank -> all-reduces (kept steps)
        self._times: dict[int, dict[int, metrics.StepTimes]] = {}  # step -> rank -> window and anchor (kept steps)
        self._declared_world = 0
        self._groups: metrics.Groups | None = None  # ``all_reduce_groups``, as the hellos last named them
        self._groups_problem: str | None = None  # why the named groups are not used, if they are not
        self._groups_stale = False
        self._groups_world = 0  # the world they were made a partition of
        self._tag_sequences = TagSequences()
        self._unfolded: list[int] = []  # steps with reports not yet folded, oldest first
        self.ranks: dict[int, RankState] = defaultdict(RankState)
        self.reports: dict[int, dict[int, StepReport]] = defaultdict(dict)  # step -> rank -> report
        self.segments: list[Segment] = []
        self.acks: list[Ack] = []
        self.transfer_memory = TransferMemory()  # the advisor's transfers of sizes its recent steps lack
        self.slowdown_memory = SlowdownMemory()  # each bucketed segment's backward beside its all-reduces
        self.rejected: Counter[str] = Counter()
        #: What the last message that passed every check and still raised as it was folded raised
        #: (``rejected["unfoldable"]`` counts them): said on the dashboard, so a fault is seen.
        self.unfoldable_error = ""
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
        #: What the run's evaluations measured, by the step each followed.
        self.evaluations = Evaluations()
        #: The rank whose goodbye said its training failed before any other's did: the cause,
        #: where the others' next collectives then failed on a dead peer (``failed_ranks_lines``).
        self.first_failed_rank: int | None = None
        self.messages = 0
        self.details = 0  # spans received after their step's summary (a view that drew the step redraws it)
        self.session_id = ""
        #: Messages of another run (its session id -> how many) heard while this one went on, left
        #: out: the dashboard's warnings name it (``is_another_run``; a run that is over gives way
        #: instead). Its hellos, always; its other messages where the sender's run is known.
        self.other_runs: Counter[str] = Counter()
        #: Whether messages came with the run that sent them (``ingest``'s ``run``: a live listener,
        #: a recording made since): then another run's reports are left out, not mixed in.
        self.runs_told_apart = False

    # -- feeding ---------------------------------------------------------------------------------
    def ingest(self, envelope: Envelope, received_at: float | None = None, prepared: PreparedReport | None = None,
               run: str = "") -> str | None:
        """Fold one decoded message in; returns the rejection category of a well-formed message
        whose values cannot be true here (and counts it; a message of another run: ``other_runs``), else None. ``prepared``: a step report's
        ``prepare_report``, made elsewhere (used when figured for this session's world size).
        ``run``: the run whose rank sent it, where the listener knew (``protocol.run_of_sender``):
        a message of a run other than this session's is left out, whatever it is, so a second
        script sending to the same address never mixes its reports into this run's figures."""
        now = time.monotonic() if received_at is None else received_at
        message = envelope.message
        if isinstance(message, SwitchCommand):
            self.messages += 1
            return None
        if run:
            self.runs_told_apart = True
            self.session_id = self.session_id or run  # the run heard first, before any hello
        if other := self.other_run(message, run):
            self.other_runs[other] += 1  # not "malformed": a second script pointed at the same address
            return "another_run"
        problem = self._impossible(envelope)
        if problem is not None:
            self.reject(problem)
            if (state := self.ranks.get(envelope.rank)) is not None:
                state.last_seq = max(state.last_seq, envelope.seq)  # rejected, not lost: not counted twice
            return problem
        try:
            self._take(envelope, now, prepared)
        except Exception as error:  # a message no check foresaw: one rejected, never the listener lost
            self.unfoldable_error = f"{type(envelope.message).TYPE} from rank {envelope.rank}: {type(error).__name__}: {error}"[:200]
            self.reject("unfoldable")
            return "unfoldable"
        return None

    def _take(self, envelope: Envelope, now: float, prepared: PreparedReport | None) -> None:
        message = envelope.message
        self.messages += 1
        rank = self.ranks[envelope.rank]
        if envelope.seq > rank.last_seq + 1 and rank.last_seq >= 0:
            rank.lost_messages += envelope.seq - rank.last_seq - 1
        rank.last_seq = max(rank.last_seq, envelope.seq)
        rank.sender_dropped = max(rank.sender_dropped, envelope.dropped)
        rank.last_seen = now
        passed = rank.last_step
        if isinstance(message, Hello):
            self._note_hello(rank, message)
        elif isinstance(message, (StepReport, StepSummary)):
            self._receive_report(rank, message, prepared)
        elif isinstance(message, DeviceSample):
            rank.devices.append(message)
            rank.devices_received += 1
            if self.device_samples is not None:
                while len(rank.devices) > max(MIN_DEVICE_SAMPLES, self.device_samples // max(self.world_size, 1)):
                    rank.devices.popleft()
        elif isinstance(message, Heartbeat):
            rank.last_step = max(rank.last_step, message.step)
            pausing = message.pausing[:MAX_PAUSED_FOR]
            if pausing != rank.pausing:
                rank.pausing, rank.pausing_since = pausing, now
        elif isinstance(message, Ack):
            self.acks.append(message)
        elif isinstance(message, Evaluation):
            self.evaluations.add(message)
        elif isinstance(message, Goodbye):
            rank.goodbye = message
            if self.first_failed_rank is None and failure_of(message.reason) is not None:
                self.first_failed_rank = message.rank
        if rank.last_step != passed:
            rank.last_step_at = now

    def _note_hello(self, rank: RankState, hello: Hello) -> None:
        """Ranks repeat their hello every few seconds (1,024 ranks: 500 a second): the declared
        world is recomputed over all ranks only when the largest may have shrunk."""
        previous, rank.hello = rank.hello, hello
        self.session_id = hello.session
        if previous is None or previous.all_reduce_group != hello.all_reduce_group:
            self._groups_stale = True
        if hello.world_size >= self._declared_world:
            self._declared_world = hello.world_size
        elif previous is not None and previous.world_size == self._declared_world:
            self._declared_world = max((r.hello.world_size for r in self.ranks.values() if r.hello), default=0)

    def reject(self, category: str) -> None:
        self.rejected[category] += 1

    def _impossible(self, envelope: Envelope) -> str | None:
        """Valid on the wire, impossible in this session: a rank outside the world, a message whose
        body names another rank than its envelope, a step the rank already reported
        (``step_repeated``), a report older than the rank's own earlier reports
        (``step_backwards``: a rank's reports leave it in step order on one connection).

        A report for a step the rank has passed (its heartbeats, sent from another thread, run
        ahead of reports that wait for their marks to resolve) is not impossible: it is late, and
        ``_receive_report`` counts it."""
        message = envelope.message
        world = self._declared_world_size()
        if world and envelope.rank >= world and not isinstance(message, Hello):
            return "unknown_rank"
        if envelope.rank < 0:  # a listener's own (a span request relayed), not a rank's
            return "unknown_rank"
        if getattr(message, "rank", envelope.rank) != envelope.rank:
            return "rank_mismatch"
        if isinstance(message, Hello) and not 0 <= message.rank < message.world_size:
            return "unknown_rank"
        if isinstance(message, (StepReport, StepSummary)) and envelope.rank in self.ranks:
            state = self.ranks[envelope.rank]
            if message.step in state.reported:
                return None if self._is_detail(state, message) else "step_repeated"
            if message.step < state.last_reported - STEP_REORDER_SLACK:
                return "step_backwards"
        return None

    @staticmethod
    def _is_detail(rank: RankState, message: StepReport | StepSummary) -> bool:
        """The spans of a step the rank sent as a summary (the dashboard asked for them since):
        the step's figures are in already, so only its spans are new."""
        return isinstance(message, StepReport) and message.step in rank.summarized and message.step not in rank.detailed

    def _receive_detail(self, rank: RankState, report: StepReport, prepared: PreparedReport | None = None) -> None:
        """Put the spans in the kept report; its figures stay as the summary gave them (equal by
        construction: one ``step_figures``). A step the session forgot gets nothing, and is counted."""
        rank.detailed.add(report.step)
        kept = self.reports.get(report.step, {})
        if report.rank not in kept:
            rank.details_unused += 1
            return
        kept[report.rank] = prepared.report if prepared is not None else replace(report, spans=PackedSpans(report.spans))
        self._note_early_reductions(report)
        if report.step in self._details_forgotten:  # pinned after its details were forgotten
            self._calls.setdefault(report.step, {})[report.rank] = call_times(report)
        self.details += 1

    def _receive_report(self, rank: RankState, report: StepReport | StepSummary, prepared: PreparedReport | None = None) -> None:
        """Count what a report says about its rank, then use it if its step is still open.

        Late: the rank had passed the step by more than the reorder slack, or the session had
        stopped waiting for it. If the step is not folded yet the report is used like any other;
        once folded (every other rank reported it ``FOLD_LAG`` steps ago, or the session forgot
        it), the segment's running figures cannot take it back in, so it is counted and dropped.
        """
        if self._is_detail(rank, report):
            self._receive_detail(rank, report, prepared)  # type: ignore[arg-type]
            return
        folded = report.step in self._folded_steps
        if folded or report.step < rank.last_step - STEP_REORDER_SLACK:
            rank.late += 1
            rank.late_unused += folded
        if report.unresolved:
            rank.unresolved += 1
            rank.unresolved_reason = report.unresolved_reason or rank.unresolved_reason
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
            self._note_early_reductions(report)
        rank.reported.add(report.step)
        if isinstance(report, StepSummary):
            rank.summarized.add(report.step)
        rank.last_reported = max(rank.last_reported, report.step)
        rank.last_step = max(rank.last_step, report.step)
        if report.memory and report.step >= rank.memory_step:
            rank.memory, rank.memory_step = dict(report.memory), report.step
        if not folded:
            self._add_report(report, prepared)

    def _note_early_reductions(self, report: StepReport) -> None:
        """Read an accumulating step's spans for all-reduces before its last micro-step
        (``accumulation``): the first counted report with spans of each step."""
        if accumulation.reads(report) and self.early_reductions.wants(report.step):
            self.early_reductions.note(report.step, accumulation.micro_step_reduction(report.spans), report.strategy)

    def _declared_world_size(self) -> int:
        """The world the hellos declare (0 before any): kept up to date on each hello, since every
        message asks for it."""
        return self._declared_world

    def _add_report(self, message: StepReport | StepSummary, prepared: PreparedReport | None = None) -> None:
        # A report that enters no figure keeps none: the ranks table shows a dash for it.
        # A full report is figured for a world size (bandwidths); a summary came figured by its rank.
        if prepared is None or (prepared.world_size != self.world_size and isinstance(message, StepReport)):
            prepared = prepare_report(message, self.world_size)
        figures, calls, report = prepared.figures, prepared.calls, prepared.report
        if metrics.counted(message):
            self._figures.setdefault(message.step, {})[message.rank] = figures
        if report.step not in self._calls and self.detail_rank_steps is not None:
            self._detail_steps.append(report.step)
        self._calls.setdefault(report.step, {})[report.rank] = calls._replace(tags=self._tag_sequences.shared(calls.tags))
        self._times.setdefault(report.step, {})[report.rank] = figures.times
        if report.step not in self.reports:
            bisect.insort(self._unfolded, report.step)
        self.reports[report.step][report.rank] = report
        self._place_report(report)
        self._fold_finished_steps(report.step)
        if self.keep_steps is not None:
            while len(self.reports) > self.keep_steps:
                oldest = min(self.reports)
                if oldest % FORGET_DETAILED_EVERY == 0:
                    for state in self.ranks.values():
                        state.detailed.forget_below(oldest)  # a detail of a step not kept is unused anyway
                self._fold(oldest)
                del self.reports[oldest]
                self._figures.pop(oldest, None)
                self._calls.pop(oldest, None)
                self._times.pop(oldest, None)
                self._waits.pop(oldest, None)
                self._details_forgotten.discard(oldest)
        self._forget_old_details()

    def _forget_old_details(self) -> None:
        if self.detail_rank_steps is None:  # then nothing is queued in ``_detail_steps``
            return
        keep = max(MIN_DETAIL_STEPS, self.detail_rank_steps // max(self.world_size, 1))
        while len(self._detail_steps) > keep and self._detail_steps[0] in self._folded_steps:
            self._forget_details(self._detail_steps.popleft())

    def _forget_details(self, step: int) -> None:
        """Drop a folded step's spans, durations and bandwidths; its waits are made first."""
        if step not in self.reports:  # forgotten whole already (``keep_steps``)
            return
        self.step_waits(step)
        self._calls.pop(step, None)
        self._details_forgotten.add(step)
        kept = self.reports[step]
        for rank, report in kept.items():
            if len(report.spans):
                kept[rank] = replace(report, spans=NO_SPANS)
        figures = self._figures.get(step, {})
        for rank, f in figures.items():
            if len(f.algbw_gbps) or f.other_algbw_gbps or f.sharded_calls.tags:
                figures[rank] = replace(f, algbw_gbps=NO_FLOATS, other_algbw_gbps={}, sharded_calls=NO_CALLS)

    def step_waits(self, step: int) -> tuple[dict[int, float], dict[int, float]]:
        """``metrics.waits_both_ways`` of a kept step's counted calls: how long each rank waited
        for others, and how long the others waited for it. Made once per set of reports (at 1,024
        ranks a pass is ~60 ms), and kept after the step's calls are forgotten."""
        seen = len(self.reports.get(step, {}))
        cached = self._waits.get(step)
        if cached is None or (cached[0] != seen and step in self._calls):
            counted = self.counted_calls(step)
            cached = (seen, *metrics.step_waits(counted, self.step_figures(step), self.all_reduce_groups()))
            if step in self.reports:
                self._waits[step] = cached
        return cached[1], cached[2]

    def _place_report(self, report: StepReport) -> None:
        for segment in self.segments:
            if segment.first_step <= report.step <= segment.last_step:
                if segment.strategy == report.strategy and segment.settings == report.settings:
                    return
        self._place_in_segment(report)

    def _fold_finished_steps(self, newest: int) -> None:
        world = self._declared_world_size() or 10**9  # before any hello, only age folds a step
        while self._unfolded:
            step = self._unfolded[0]
            if len(self.reports.get(step, {})) < world and step > newest - FOLD_LAG:
                return
            self._fold(step)

    def _fold(self, step: int) -> None:
        if step in self._folded_steps:
            return
        if self._unfolded and self._unfolded[0] == step:
            self._unfolded.pop(0)
        elif step in self._unfolded:
            self._unfolded.remove(step)
        self._folded_steps.add(step)
        figures = self.step_figures(step)
        segment = self.segment_of(step)
        if segment is not None and figures:
            if segment.folded is None:
                segment.folded = metrics.SegmentAccumulator(self.world_size, self.all_reduce_groups())
            else:
                segment.folded.regroup(self.world_size, self.all_reduce_groups())
            segment.folded.add_step(figures, self.counted_calls(step), self.step_waits(step)[0])
        self.transfer_memory.add_step(self.step_collectives(step), self.world_size, self.all_reduce_groups())
        if segment is not None and segment.strategy in MEASURED_STRATEGIES:
            self._remember_backward_beside(step, segment.index)

    def _remember_backward_beside(self, step: int, segment: int) -> None:
        """The step's first rank's forward, backward and how long an all-reduce ran beside that
        backward, for the advisor's compute slowdown (``compute_slowdown``): a few passes over that
        one report's spans, whatever the number of ranks."""
        reports = self.reports.get(step, {})
        first = min(reports, default=None)
        if first is None or not metrics.counted(reports[first]):
            return
        if (point := backward_beside(reports[first])) is not None:
            self.slowdown_memory.add(segment, point)

    def step_figures(self, step: int) -> dict[int, metrics.StepFigures]:
        """Each rank's figures for a kept step, computed once as its report arrived (the fold, the
        ranks table and the exports all ask); reports that are not ``metrics.counted`` have none."""
        return self._figures.get(step, {})

    def step_times(self, step: int) -> dict[int, metrics.StepTimes]:
        """A kept step's windows and alignment anchors of every report, by rank (a summary's too)."""
        return self._times.get(step, {})

    def step_calls(self, step: int) -> dict[int, metrics.CallTimes]:
        """A kept step's all-reduces of every report, counted or not (the timeline draws both)."""
        return self._calls.get(step, {})

    def counted_calls(self, step: int) -> dict[int, metrics.CallTimes]:
        """A kept step's all-reduces (``metrics.call_times``) of the reports that may enter a
        figure, by rank: what waits, the straggler and a desync are judged from."""
        figured, calls = self._figures.get(step, {}), self._calls.get(step, {})
        return {rank: calls[rank] for rank in figured if rank in calls}

    def step_collectives(self, step: int) -> StepCollectives:
        """A kept step's all-reduces as the cost model reads them: the durations figured as each
        report or summary arrived (``counted_calls``: no span read again), and the sizes from the
        first counted report held in full. Above 64 ranks the dashboard asks most ranks for
        summaries only; read from spans, a step counted only where every rank had sent them, one
        step in 25, and an Advisor refresh at 256 ranks with spans every step took 0.21 s, most of it here."""
        calls = self.counted_calls(step)
        sized = next((report for rank, report in self.reports.get(step, {}).items() if rank in calls and len(report.spans)), None)
        return StepCollectives(calls, call_sizes(sized) if sized is not None else {})

    def has_spans(self, step: int, rank: int) -> bool:
        """Whether the kept report holds its spans (sent in full, or asked for after its summary,
        and not forgotten since)."""
        report = self.reports.get(step, {}).get(rank)
        if report is None or (step in self._details_forgotten and not len(report.spans)):
            return False
        return rank not in self.ranks or step not in self.ranks[rank].summarized or step in self.ranks[rank].detailed

    def is_folded(self, step: int) -> bool:
        """Whether the step is already in its segment's running figures."""
        return step in self._folded_steps

    def desync_range(self) -> metrics.DesyncRange | None:
        """Every desynchronised step folded so far, over all segments: kept until the run ends,
        however long ago the step left the screen."""
        return metrics.DesyncRange.combine(s.folded.desync for s in self.segments if s.folded is not None)

    def segment_of(self, step: int) -> Segment | None:
        return next((s for s in self.segments if s.first_step <= step <= s.last_step), None)

    def all_reduce_groups(self) -> metrics.Groups | None:
        """Who meets whom in the all-reduces, as the ranks' hellos say (``Hello.all_reduce_group``:
        HSDP's replicas of one shard, a DDP on a subgroup), the ranks no hello names yet one group
        of their own; None, every rank, as for most runs, and where the hellos contradict each
        other (``all_reduce_groups_problem``: ``metrics.groups_of_the_world``). Made again only
        when a hello names another group than before, or the world grows."""
        if self._groups_stale or self._groups_world != self.world_size:
            named = (r.hello.all_reduce_group for r in self.ranks.values() if r.hello and r.hello.all_reduce_group)
            self._groups, self._groups_problem = metrics.groups_of_the_world(named, self.world_size)
            self._groups_stale, self._groups_world = False, self.world_size
        return self._groups

    @property
    def all_reduce_groups_problem(self) -> str | None:
        """Why the groups the hellos name are not used (they overlap), in one line; else None."""
        self.all_reduce_groups()
        return self._groups_problem

    def _place_in_segment(self, report: StepReport) -> None:
        """Extend the neighbouring segment with the same settings, or start a new one. The one
        before the step extends across steps no report has come for yet, where no segment lies
        between: a rank's report dropped (its sender's queue full) or still on its way while
        another rank's next one came split the segment in two for good, each figured from part
        of its steps (two rows of the same strategy in summary.md). Up to ``SEGMENT_GAP_STEPS``.
        """
        def same(segment: Segment) -> bool:
            return segment.strategy == report.strategy and segment.settings == report.settings

        before = max((s for s in self.segments if s.last_step < report.step), key=lambda s: s.last_step, default=None)
        holding = any(s.first_step <= report.step <= s.last_step for s in self.segments)
        if before is not None and same(before) and not holding and report.step - before.last_step <= SEGMENT_GAP_STEPS + 1:
            before.last_step = report.step
            return
        for segment in self.segments:
            if same(segment) and report.step == segment.first_step - 1:
                segment.first_step = report.step
                return
        segment = Segment(0, report.strategy, dict(report.settings), report.step, report.step)
        self.segments.append(segment)
        self.segments.sort(key=lambda s: s.first_step)
        for index, seg in enumerate(self.segments):
            seg.index = index

    # -- reading -----------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self._declared_world_size() or len(self.ranks)

    @property
    def finished(self) -> bool:
        """Every rank of the world said goodbye."""
        return self.world_size > 0 and all((state := self.ranks.get(r)) is not None and state.goodbye is not None
                                           for r in range(self.world_size))

    @property
    def trains_again(self) -> bool:
        """Every rank said goodbye saying its process trains again at once, a run of its own
        (``Goodbye.trains_again``: a Trainer begun again after running out of memory)."""
        return self.finished and all(state.goodbye is not None and state.goodbye.trains_again for state in self.ranks.values())

    def is_another_run(self, hello: Hello) -> bool:
        """A hello of a run other than the one this session holds (its ranks carry another session id)."""
        return bool(self.session_id) and hello.session != self.session_id

    def other_run(self, message: Message, run: str = "") -> str:
        """The run other than this session's that ``message`` comes from, or "": the run its rank
        sent from (``run``, where known), else the run its hello names. The one rule by which
        ``ingest`` leaves a message out and ``next_run`` begins a session."""
        if run and self.session_id and run != self.session_id:
            return run
        return message.session if isinstance(message, Hello) and self.is_another_run(message) else ""

    def over(self, now: float) -> bool:
        """Every rank of the world said goodbye or is lost at ``now``: nothing more will come of
        this run, and a new run may begin the next session (``next_run``)."""
        ranks = range(self.world_size)
        return bool(ranks) and all(r in self.ranks and self.status(r, now) != "live" for r in ranks)

    def next_run(self, message: Message, now: float, run: str = "") -> str:
        """The run that ``message``, arriving at ``now`` from ``run`` (where known), begins once this
        one is over, or "": its hello, or any message of its where the sender's run is known (its
        step reports may come before its next hello). The one rule by which the dashboard and
        ``recorder.load_session`` start a session of its own for it (a script run again into a
        dashboard left open)."""
        other = self.other_run(message, run)
        return other if other and self.over(now) else ""

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

    def stopped_ranks(self, now: float) -> dict[int, int]:
        """Ranks not lost whose steps stopped while the others' went on: the step each is at, for
        those ``STOPPED_STEPS`` or more behind the newest and unmoved for ``STOPPED_AFTER_S``. The
        collectives of a step hold every rank to it, so a rank left behind is one the others no
        longer need: out of data under DDP's ``join()`` (uneven inputs), which shadows their
        collectives outside any step, or a loop that left the training step."""
        behind = ranks_left_behind({rank: state.last_step for rank, state in self.ranks.items()})
        return {rank: step for rank, step in behind.items()
                if now - self.ranks[rank].last_step_at >= STOPPED_AFTER_S and self.status(rank, now) != "lost"}

    def ranks_held_by_lost(self, now: float) -> tuple[dict[int, int], dict[int, float]]:
        """Live ranks that have passed no step since a lost rank went silent, unmoved for
        ``STOPPED_AFTER_S``, with the step each is at; and every lost rank, with when each was
        last heard (what the lines of lost ranks say too: one pass over the ranks for both). Every collective of a step needs every rank, so a rank that dies or freezes
        holds the others in their next one, heartbeating (their sender is a thread of its own)
        but passing no step: until the process group's timeout, unless the launcher stops them
        (gloo fails a collective at once on a peer whose connection closes, but not one whose
        send was half written when it did: it waits out its timeout). A rank passed its last
        step no later than its lost peer died, at most ``LOST_AFTER_S`` after that peer was
        last heard; a rank that went on past that is training without it (the lost one's
        telemetry alone went silent), and is not said held; nor is one that has passed no step
        at all (still starting: loading its data, compiling)."""
        lost = {rank: state.last_seen for rank, state in sorted(self.ranks.items()) if self.status(rank, now) == "lost"}
        if not lost:
            return {}, {}
        died_by = min(lost.values()) + LOST_AFTER_S
        held = {rank: state.last_step for rank, state in sorted(self.ranks.items())
                if rank not in lost and self.status(rank, now) == "live" and state.last_step > 0
                and state.last_step_at <= died_by and now - state.last_step_at >= STOPPED_AFTER_S}
        return held, lost

    @property
    def failed_ranks(self) -> dict[int, tuple[int, str]]:
        """Ranks whose goodbye says their training failed: ``{rank: (steps done, why)}``."""
        return goodbyes_saying(failure_of, ((rank, state.goodbye) for rank, state in self.ranks.items()))

    @property
    def interrupted_ranks(self) -> dict[int, tuple[int, str]]:
        """Ranks whose goodbye says a signal stopped them from outside (Ctrl-C, torchrun's or a
        scheduler's SIGTERM): ``{rank: (steps done, which signal)}``."""
        return goodbyes_saying(interruption_of, ((rank, state.goodbye) for rank, state in self.ranks.items()))

    @property
    def detached_ranks(self) -> dict[int, tuple[int, str]]:
        """Ranks whose goodbye says ddpwatch stopped watching them while they trained on
        (``protocol.DETACHED``): ``{rank: (steps done, why)}``."""
        return goodbyes_saying(detachment_of, ((rank, state.goodbye) for rank, state in self.ranks.items()))

    def status(self, rank: int, now: float | None = None, recording_ended: bool = False) -> str:
        """``live``, ``lost`` (nothing heard for ``LOST_AFTER_S``), or, once it said goodbye,
        ``finished``, ``failed`` (its training raised: the goodbye says what), ``interrupted``
        (a signal stopped it) or ``detached`` (ddpwatch stopped watching it; it trains on). ``recording_ended``: nothing more will come (a replay at the end of
        its file): a rank heard to the end without a goodbye is ``cut``, not ``live``: the
        recording stopped before its run did, and how the run went on is not in it."""
        state = self.ranks[rank]
        if state.goodbye is not None:
            reason = state.goodbye.reason
            return ("failed" if failure_of(reason) is not None else "interrupted" if interruption_of(reason) is not None
                    else "detached" if detachment_of(reason) is not None else "finished")
        now = time.monotonic() if now is None else now
        return "lost" if now - state.last_seen > LOST_AFTER_S else "cut" if recording_ended else "live"

    def segment_reports(self, segment: Segment, include_excluded: bool = False) -> list[StepReport]:
        """Kept reports of the segment; ``include_excluded=False``: only those ``metrics.counted``
        (neither excluded nor unresolved)."""
        return [
            report
            for step in range(segment.first_step, segment.last_step + 1)
            for report in self.reports.get(step, {}).values()
            if include_excluded or metrics.counted(report)
        ]

    def segment_figures(self, segment: Segment, include_pending: bool = True,
                        per_rank: bool = True) -> metrics.SegmentFigures:
        """Folded steps plus the few still waiting for a rank; the live dashboard leaves those out
        (``include_pending=False``): at 64 ranks there is always one, and adding it costs a copy.
        ``per_rank=False`` leaves ``per_rank`` empty, for a caller that shows only the totals."""
        pending = [step for step in self._unfolded if segment.first_step <= step <= segment.last_step
                   and self.step_figures(step)] if include_pending else []
        if segment.folded is not None and not pending:
            return segment.folded.figures(per_rank)
        accumulator = (segment.folded.copy() if segment.folded is not None
                       else metrics.SegmentAccumulator(self.world_size, self.all_reduce_groups()))
        for step in pending:
            accumulator.add_step(self.step_figures(step), self.counted_calls(step))
        return accumulator.figures(per_rank)

    def segment_data_wait_by_rank(self, segment: Segment) -> dict[int, float]:
        """Each rank's Data wait% over the segment's folded steps (``segment_figures`` with
        ``include_pending=False``, as the dashboard's rows are made), without the per-rank figures."""
        return segment.folded.data_wait_by_rank() if segment.folded is not None else {}

    def latest_complete_step(self) -> int | None:
        """The newest step every live rank has reported."""
        expected = self.world_size
        for step in sorted(self.reports, reverse=True):
            if len(self.reports[step]) >= expected:
                return step
        return None
