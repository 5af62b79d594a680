"""The messages between training ranks and ddpwatch, each a schema and the rules beside it.

Every message is a frozen ``msgspec.Struct``: its field types, with their ranges
(``Annotated[..., msgspec.Meta(...)]``), are what ``codec.decode`` checks as it reads one, so a
message a listener accepts is one a rank could have sent. What field types cannot say (an end
before its start, durations that do not match their tags, a newer ddpwatch's span kind) is each
message's ``refusal``, beside it, which the decoder calls: never the constructor, so that a rank
building a message never raises because of its telemetry. An optional field at its default is
left off the wire and read back as the default.
"""

from __future__ import annotations

import math
import numbers
import re
import sys
from collections.abc import Mapping, Sequence
from operator import gt, itemgetter
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, NamedTuple, TypeAlias

import msgspec
from msgspec import Meta

from instrumented_ddp.wire.kinds import COMM_KINDS, MEMORY_KINDS, SPAN_KINDS
from instrumented_ddp.wire.packed_floats import all_finite, all_non_negative_and_finite
from instrumented_ddp.wire.stall_probe import StallProbe

#: Characters of what a loop paused training for (``StepReport.paused_for``, ``Heartbeat.pausing``)
#: a rank sends and a listener keeps: a few words ("evaluate, save").
MAX_PAUSED_FOR = 80
#: The largest world a hello may declare, beyond any job run today: a listener keeps, figures and
#: lists each rank of it.
MAX_WORLD_SIZE = 1 << 17
#: The furthest from zero a time on the wire may be, in seconds (31,700 years): a rank's clocks
#: (``perf_counter``, the epoch's seconds) are far inside it, and a segment's wall time made of
#: such times stays finite, as every export (JSON has no infinity) needs.
MAX_TIME_S = 1e12
HELD_STEPS = 64  # recent step reports a rank keeps, so a pinned step's spans can still be sent
MAX_REQUESTED_STEPS = 64  # steps one SpanRequest may name
MAX_DEVICE_EVERY_S = 60.0  # the slowest device sampling a listener may ask of a rank
#: What one evaluation may carry: a few named numbers (a Trainer's ``compute_metrics`` gives a handful).
MAX_EVALUATION_METRICS = 32
MAX_METRIC_NAME = 64  # characters of a metric's name
#: What a run that cannot switch (``Hello.switchable`` False) answers, and the dashboard says.
NOT_SWITCHABLE = "this run was not started by ddpwatch: switching is off"

_LARGEST = sys.float_info.max
#: A finite number: NaN and the infinities fall outside these bounds.
Finite = Annotated[float, Meta(ge=-_LARGEST, le=_LARGEST)]
#: A time on a rank's clock, in seconds: finite and within ``MAX_TIME_S`` of zero.
Time = Annotated[float, Meta(gt=-MAX_TIME_S, lt=MAX_TIME_S)]
Seconds = Annotated[float, Meta(ge=0.0, le=_LARGEST)]  # a length of time (or ms): non-negative, finite
Percentage = Annotated[float, Meta(ge=-1e-6, le=100.0 + 1e-6)]  # a hair of float rounding over
Count = Annotated[int, Meta(ge=0)]
Rank = Annotated[int, Meta(ge=0)]
WorldSize = Annotated[int, Meta(ge=1, le=MAX_WORLD_SIZE)]
if TYPE_CHECKING:  # a sender fills these maps with names as plain strings
    CommKind: TypeAlias = str
    MemoryKind: TypeAlias = str
else:  # on the wire, a name outside them is refused
    CommKind = Literal[COMM_KINDS]
    MemoryKind = Literal[MEMORY_KINDS]
#: Names each with a count (a collective kind's calls, a memory kind's bytes); the wording of a refusal.
COUNTS_REFUSED = "holds an unknown name or a bad count"
SETTINGS_REFUSED = "a name that is not a string, or a value that is not a word, a finite number, a flag or none"


class Refusal(NamedTuple):
    """Why a decoded message is not accepted: the category the receiver counts, and in words."""

    category: str
    detail: str


def invalid(detail: str) -> Refusal:
    return Refusal("invalid", detail)


class WireMessage(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    """What every message is. Not tracked by the garbage collector: a message holds lists and
    maps of plain values, never itself, and a listener keeps a large job's reports by the million."""

    TYPE: ClassVar[str]
    #: The words for a field the schema refuses inside (a key or an item), where msgspec's own say less.
    FIELD_REFUSALS: ClassVar[Mapping[str, str]] = {}

    def refusal(self) -> Refusal | None:
        """What makes this message, its fields each of the right type, one no rank sends (or one
        a newer ddpwatch sends), or None."""
        return None


class Span(NamedTuple):
    """One time range on a rank's clock (seconds). ``blocking``: the main thread sat in it. On
    the wire, an array of its items; a reader takes 3 to 7, the others at their defaults."""

    kind: str
    start: Time
    end: Time
    blocking: bool = False
    nbytes: Count = 0
    tag: str = ""
    dtype: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


class Hello(WireMessage, frozen=True):
    """Who a rank is and what it trains: sent first and repeated, so a late dashboard catches up."""

    TYPE: ClassVar[str] = "hello"
    FIELD_REFUSALS: ClassVar[Mapping[str, str]] = {"settings": SETTINGS_REFUSED}
    rank: Rank
    world_size: WorldSize
    session: str
    host: str
    pid: int
    device: str
    backend: str
    strategy: str
    settings: dict[str, Any]
    model_parameters: int
    parameter_layout: list[tuple[str, int, str]] = msgspec.field(default_factory=list)
    bucket_layout: list[list[int]] = msgspec.field(default_factory=list)
    total_steps: int = 0
    global_batch: int = 0
    node_rank: int = 0
    local_rank: int = 0
    #: Why this rank's device samples are not what its device would suggest (a CUDA rank that
    #: cannot use NVML says why here and sends CPU readings); empty when all is as expected.
    device_note: str = ""
    #: False for a run ddpwatch did not start (``instrumented_ddp.attach``): its loop is the
    #: user's, so it cannot re-wrap the model at a step boundary, and the dashboard offers no switch.
    switchable: bool = True
    #: The ranks this rank's all-reduces meet, itself among them, where not every rank: HSDP's
    #: replicas of its shard, a DDP built on a subgroup. Empty: the world. The dashboard pairs
    #: waits within it and counts busbw over its size (``Session.all_reduce_groups``).
    all_reduce_group: list[Rank] = msgspec.field(default_factory=list)
    #: Each trainable parameter's dim 0, in ``parameter_layout``'s order (0 for a 0-d tensor):
    #: fsdp shards rows, padding each parameter's to a multiple of the world, so the memory it
    #: holds is exact only from them. Empty from an older sender, or where the lengths differ.
    parameter_rows: list[Count] = msgspec.field(default_factory=list)
    #: The rank leaves ``unwatched_steps`` steps unwatched every ``unwatched_every``
    #: (``instrumented_ddp.timing.unwatched_blocks``), by which the run measures what watching
    #: costs it; 0: it never does (turned off, or an older sender).
    unwatched_every: Count = 0
    unwatched_steps: Count = 0

    def refusal(self) -> Refusal | None:
        """Its settings readable, its rank inside its world, and its all-reduce group distinct
        ranks of that world, its own among them (or none)."""
        if (refused := settings_refusal(self.TYPE, self.settings)) is not None:
            return refused
        if self.rank >= self.world_size:
            return invalid(f"hello: world_size outside 1-{MAX_WORLD_SIZE}, or a rank outside it")
        group = self.all_reduce_group
        if group and not (max(group) < self.world_size and len(set(group)) == len(group) and self.rank in group):
            return invalid("hello: all_reduce_group must be distinct ranks of the world, the sender's among them")
        return None


class StepReport(WireMessage, frozen=True):
    """Everything one rank did in one optimizer step. ``excluded``: left out of the statistics
    (native DDP's first iteration, which reduces one bucket before buckets are rebuilt; the step
    that carries a wrap-time state broadcast). ``unresolved``: some of the step's marks never
    resolved (a completion that never came, a callback that failed): the report holds only the
    spans that did, is sent anyway rather than holding back every later step, and is left out of
    the statistics and counted. ``update_skipped``: the step's gradients were reduced and then
    cleared without an optimizer step (an attached loop whose loss scaler found inf or NaN): its
    time counts like any step's, and the dashboard and exports say which steps they were.
    ``compiling``: torch.compile compiled during the step (its first steps, or a recompile): the
    step is also ``excluded``, and the dashboard and exports say which steps they were.
    ``unresolved_reason``: why, in one line (the first mark that failed and its error, or how
    long the marks were waited for), so that a user is told more than that it happened.
    ``untimed_collectives``: collectives the rank issued in the step besides those it timed, an
    attached script's own (``instrumented_ddp.attachment.issued_collectives``); 0 where none or not counted.
    ``untimed_in_data``: how many of those were issued in the step's ``data`` time (before its
    first forward, or between a micro-step's backward and the next forward: a loss all-reduced
    for logging after the update, the Trainer's gather of each batch's label count): their time,
    a wait in them for a slower rank included, reads as the loader's, not as compute.
    ``paused_s``: how long the loop paused training before the step began, doing what
    ``paused_for`` names (a Trainer's evaluation or checkpoint: ``Attachment.paused``): the pause
    ends where ``start`` is, so it is in no figure of the step, and is taken out of the wall time
    that samples/s divide by. A pause inside a step (between its micro-steps) is in its window,
    and the step is ``excluded``. ``nograd_forwards``: forwards of an attached model run without
    gradients before the step's training began and outside a marked pause (an evaluation the
    loop did not mark): they read as the step's data loading, and the dashboard says so.
    ``unwatched``: the rank timed the step's window alone, to measure what watching costs
    (``instrumented_ddp.timing.unwatched_blocks``): it has no spans, is in no figure, and its wall
    time is held against the watched steps around it (``ddpwatch.figures.watch_overhead``)."""

    TYPE: ClassVar[str] = "step"
    FIELD_REFUSALS: ClassVar[Mapping[str, str]] = {"settings": SETTINGS_REFUSED, "memory": COUNTS_REFUSED}
    rank: Rank
    step: Count
    strategy: str
    settings: dict[str, Any]
    start: Time
    end: Time
    spans: Sequence[Span]  # a list from a rank; the dashboard keeps them packed (``ddpwatch.figures.compact_steps``)
    samples: Count
    tokens: Count
    loss: float | None = None  # NaN or an infinity is news (a diverged loss), not a malformed report
    excluded: bool = False
    unresolved: bool = False
    update_skipped: bool = False
    compiling: bool = False
    unresolved_reason: str = ""
    untimed_collectives: Count = 0
    untimed_in_data: Count = 0
    paused_s: Seconds = 0.0
    paused_for: str = ""
    nograd_forwards: Count = 0
    unwatched: bool = False
    #: Bytes the rank held at the step's end (``instrumented_ddp.resources.memory``: ``parameters``,
    #: ``gradients``, ``optimizer_state``, ``peak``), measured every few steps; empty otherwise.
    memory: dict[MemoryKind, Count] = msgspec.field(default_factory=dict)

    def refusal(self) -> Refusal | None:
        """Readable settings, a window that ends after it starts, and spans each of a kind this
        ddpwatch knows that end after they start (a kind named as a newer ddpwatch names one is
        ``unknown_type``: the dashboard says it comes from a newer ddpwatch)."""
        return settings_refusal(self.TYPE, self.settings) or window_refusal(self) or _spans_refusal(self.spans)


_KIND, _START, _END = itemgetter(0), itemgetter(1), itemgetter(2)
_KNOWN_SPAN_KINDS = frozenset(SPAN_KINDS)
#: How a newer ddpwatch names a span kind (as this one does: ``all_reduce``), told from garbage.
_SPAN_KIND_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _spans_refusal(spans: Sequence[Span]) -> Refusal | None:
    """The first span, in order, of a kind this ddpwatch does not know or that ends before it
    starts, or None. Checked in C first: a report holds hundreds of spans."""
    if set(map(_KIND, spans)) <= _KNOWN_SPAN_KINDS and not any(map(gt, map(_START, spans), map(_END, spans))):
        return None
    for span in spans:
        if span.kind not in _KNOWN_SPAN_KINDS:
            if _SPAN_KIND_NAME.fullmatch(span.kind):
                return Refusal("unknown_type", f"a span of a kind this ddpwatch does not know, {span.kind!r}")
            return invalid(f"unknown span kind {span.kind!r:.30}")
        if span.end < span.start:
            return invalid(f"{span.kind} span has bad times")
    return None


class StepSummary(WireMessage, frozen=True):
    """One rank's step as figures it computed itself (``instrumented_ddp.wire.step_figures``), sent in
    place of the full ``StepReport`` when the dashboard has not asked for this rank's spans: a
    few hundred bytes where a large job's report holds hundreds of spans. It carries everything
    the figures across ranks need: the step window and alignment anchor, and each all-reduce's
    tag and duration (waits, the straggler, a desync). Durations and bandwidths travel as packed
    little-endian float64 (``packed_floats``), bit for bit what the rank computed."""

    TYPE: ClassVar[str] = "summary"
    FIELD_REFUSALS: ClassVar[Mapping[str, str]] = {"settings": SETTINGS_REFUSED, "memory": COUNTS_REFUSED,
                                                    "calls_by_kind": COUNTS_REFUSED}
    rank: Rank
    step: Count
    strategy: str
    settings: dict[str, Any]
    start: Time
    end: Time
    samples: Count
    tokens: Count
    compute_pct: Percentage
    non_compute_pct: Percentage
    idle_pct: Percentage
    overlap_pct: Percentage
    comm_overhead_pct: Percentage
    anchor: Time | None  # end of the step's last all-reduce (None: no all-reduce)
    busbw_gbps: Finite | None
    all_reduce_tags: Sequence[str]  # a list as decoded; the dashboard's receiver shares one tuple among ranks
    all_reduce_seconds: bytes  # float64 per all-reduce, issue order
    algbw_gbps: bytes  # float64 per measurable all-reduce, issue order
    loss: float | None = None  # as in ``StepReport``
    excluded: bool = False
    unresolved: bool = False
    calls_by_kind: dict[CommKind, Count] = msgspec.field(default_factory=dict)  # every collective kind's calls
    memory: dict[MemoryKind, Count] = msgspec.field(default_factory=dict)  # as in ``StepReport``
    update_skipped: bool = False  # as in ``StepReport``
    compiling: bool = False  # as in ``StepReport``
    unresolved_reason: str = ""  # as in ``StepReport``
    untimed_collectives: Count = 0  # as in ``StepReport``
    untimed_in_data: Count = 0  # as in ``StepReport``
    paused_s: Seconds = 0.0  # as in ``StepReport``
    paused_for: str = ""  # as in ``StepReport``
    nograd_forwards: Count = 0  # as in ``StepReport``
    #: The loop's own collectives the step timed (``l<k>``), how many and their summed ms
    #: (``StepFigures.loop_collectives``); 0 from an older sender.
    loop_collectives: Count = 0
    loop_collective_ms: Seconds = 0.0
    #: float64 per all-reduce, issue order: its start, seconds after the step's; sent only where
    #: two of them overlap (gloo), or one overlaps a sharded call (HSDP on a GPU), so that two
    #: calls waiting at once are counted once. Empty otherwise, and from an older sender.
    all_reduce_starts: bytes = b""
    #: float64 per measurable collective of each other kind (reduce-scatter, all-gather,
    #: broadcast), issue order: their bandwidths, as ``algbw_gbps`` is the all-reduces'. Empty
    #: from an older sender: the segment's busbw of those kinds is then made of full reports alone.
    other_algbw_gbps: dict[CommKind, bytes] = msgspec.field(default_factory=dict)
    #: The step's reduce-scatters and all-gathers as the all-reduces are sent: each one's kind and
    #: tag (``all_gather:u0``), float64 duration and, where two overlapped (or one an all-reduce), start. The sharded
    #: strategies' waits and straggler are made of them. The waits of the loop's barriers travel
    #: among them too (``wait:barrier``): every rank joins a barrier as it joins these. Empty from an older sender.
    sharded_tags: Sequence[str] = msgspec.field(default_factory=list)
    sharded_seconds: bytes = b""
    sharded_starts: bytes = b""
    #: The share of the step window spent in ``data`` with nothing else running (``StepFigures.data_wait_pct``).
    #: 0 from an older sender.
    data_wait_pct: Percentage = 0.0
    #: The loop's own compute the step marked, its ms and what it was (``StepFigures.loop_compute_ms``,
    #: ``loop_computed``). 0 and "" where none was marked, and from an older sender.
    loop_compute_ms: Seconds = 0.0
    loop_computed: str = ""

    def refusal(self) -> Refusal | None:
        """Readable settings, a window that ends after it starts, and figures a rank could have
        computed: one duration per tag, at most one bandwidth per duration (per call, of the
        other kinds), each non-negative, every start finite."""
        return settings_refusal(self.TYPE, self.settings) or window_refusal(self) or _figures_refusal(self)


def _figures_refusal(summary: StepSummary) -> Refusal | None:
    tags, seconds, algbw = summary.all_reduce_tags, summary.all_reduce_seconds, summary.algbw_gbps
    if len(seconds) != 8 * len(tags) or len(algbw) % 8 or len(algbw) > len(seconds):
        return invalid("summary: durations do not match the tags")
    if not all_non_negative_and_finite(seconds + algbw):
        return invalid("summary: a negative or non-finite duration or bandwidth")
    for kind, packed in summary.other_algbw_gbps.items():
        if kind == "all_reduce" or len(packed) % 8 or len(packed) > 8 * summary.calls_by_kind.get(kind, 0):
            return invalid("summary.other_algbw_gbps: an unknown kind, or more bandwidths than its calls")
        if not all_non_negative_and_finite(packed):
            return invalid("summary: a negative or non-finite bandwidth")
    if len(summary.sharded_seconds) != 8 * len(summary.sharded_tags):
        return invalid("summary: sharded_seconds do not match sharded_tags")
    if not all_non_negative_and_finite(summary.sharded_seconds):
        return invalid("summary: a negative or non-finite reduce-scatter, all-gather or barrier duration")
    return _starts_refusal("all_reduce", summary.all_reduce_starts, seconds) or _starts_refusal(
        "sharded", summary.sharded_starts, summary.sharded_seconds)


def _starts_refusal(name: str, starts: bytes, seconds: bytes) -> Refusal | None:
    """A summary's ``<name>_starts``: none, or one per duration, each finite (seconds after the
    step's start: may be negative, never NaN)."""
    if starts and len(starts) != len(seconds):
        return invalid(f"summary: {name}_starts do not match the tags")
    if starts and not all_finite(starts):
        return invalid(f"summary: a non-finite {name} start")
    return None


def window_refusal(step: StepReport | StepSummary) -> Refusal | None:
    """A step's window ends after it starts, and its untimed collectives in the data time are some of its untimed ones."""
    if step.end < step.start:
        return invalid("step ends before it starts")
    if step.untimed_in_data > step.untimed_collectives:
        return invalid("more untimed collectives in the data time than untimed in the step")
    return None


def settings_refusal(message: str, settings: dict[str, Any]) -> Refusal | None:
    """A strategy's settings: each a word, a finite number, a flag or none; ``grad_accum`` a whole
    number from 1 (or none), ``bucket_mb`` a number from 0 (or none). Every listener reads them
    as it folds a report (a segment's label, its micro-steps), and the refusal names the value."""
    for value in settings.values():
        if not (value is None or isinstance(value, (str, bool)) or _is_number(value)):
            return invalid(f"{message}.settings: a name that is not a string, or a value {value!r:.30} "
                           "that is not a word, a finite number, a flag or none")
    grad_accum, bucket_mb = settings.get("grad_accum"), settings.get("bucket_mb")
    if grad_accum is not None and not (type(grad_accum) is int and grad_accum >= 1):
        return invalid(f"{message}.settings: grad_accum {grad_accum!r:.30} is not a whole number from 1")
    if bucket_mb is not None and not (_is_number(bucket_mb) and bucket_mb >= 0):  # DDP takes a cap of 0
        return invalid(f"{message}.settings: bucket_mb {bucket_mb!r:.30} is not a number from 0")
    return None


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class SpanRequest(WireMessage, frozen=True):
    """What the dashboard (or recorder) wants of one rank's spans; the rank sends a full
    ``StepReport`` for a step when ``full`` is set, when ``sample_every`` divides the step, or
    when the step is in ``pinned_steps`` and still held (a step the user pinned), and a
    ``StepSummary`` otherwise. Sent again every few seconds, so a rank that missed one, or a
    new listener, is set right; a rank that never got one sends everything."""

    TYPE: ClassVar[str] = "span_request"
    full: bool
    sample_every: Count = 0
    pinned_steps: Annotated[list[Count], Meta(max_length=MAX_REQUESTED_STEPS)] = msgspec.field(default_factory=list)
    #: Seconds between the rank's device samples (0: its own rate, 5 a second). A large job's
    #: dashboard asks for fewer, so that device samples do not outnumber its steps.
    device_every_s: Annotated[float, Meta(ge=0.0, le=MAX_DEVICE_EVERY_S)] = 0.0


class Heartbeat(WireMessage, frozen=True):
    """A rank is alive, at ``step``. ``pausing``: what its loop is doing instead of training
    while it does it (an evaluation: ``Attachment.paused``), so that a dashboard can say why no
    step comes; "" while it trains. ``phase``: what its main thread is in (``stall_probe.PHASES``;
    "" from an older rank). ``probe``: only from a rank that has finished no step for a while,
    its collectives in flight and its stack (``stall_probe``)."""

    TYPE: ClassVar[str] = "heartbeat"
    rank: Rank
    time: Time
    step: int
    pausing: str = ""
    phase: Annotated[str, Meta(max_length=16)] = ""
    probe: StallProbe | None = None


class DeviceSample(WireMessage, frozen=True):
    """Readings of a rank's device; a reading the device cannot give is absent, never zero. Each
    is finite: the dashboard formats it as a number, the trace writes it as JSON."""

    TYPE: ClassVar[str] = "device"
    rank: Rank
    time: Time
    kind: str  # "gpu" (NVML) or "cpu" (psutil); time is on the rank's span clock (perf_counter)
    readings: dict[str, Finite]


#: The largest bucket cap, in MB: a petabyte, where DDP's reducer overflows its 64-bit bytes at ~8.8e12.
MAX_BUCKET_MB = 1e9


class SwitchCommand(WireMessage, frozen=True):
    """Ask every rank to move to another strategy at the next optimizer-step boundary."""

    TYPE: ClassVar[str] = "switch"
    command_id: str
    strategy: str
    bucket_mb: Finite | None = None
    grad_accum: int | None = None
    #: How long from now its asker waits for the acknowledgement (``ddpwatch switch --timeout``; a
    #: relay's resend says what is left of it), or None: for as long as the run goes on. Rank 0
    #: refuses it once that has passed since it heard it, on every rank alike, rather than switch a
    #: run whose asker was told it had failed (a slow step or a pause held it that long).
    expires_after_s: Annotated[float, Meta(ge=0.0, le=MAX_TIME_S)] | None = None


def bucket_mb_problem(bucket_mb: object, name: str = "bucket_mb") -> str | None:
    """Why ``bucket_mb`` cannot be a bucket cap, or None: the one rule of ``wrap``, train.py,
    ``ddpwatch switch`` and ``tune`` and the dashboard's picker, each saying it of its own
    ``name`` (a flag: ``--bucket-mb``). A cap must be finite for the ``int()`` of its bytes inside
    ``wrap`` and inside DDP to hold on every rank."""
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, numbers.Real):  # numpy's numbers too
        return f"{name} must be a number of MB, not {bucket_mb!r}"
    megabytes = float(bucket_mb)
    if not (math.isfinite(megabytes) and megabytes > 0):
        return f"{name} must be a positive, finite number of MB, not {megabytes:g}"
    if megabytes > MAX_BUCKET_MB:  # DDP's C++ reducer takes the bytes as a 64-bit integer: a TypeError on every rank
        return f"{name} must be at most {MAX_BUCKET_MB:g} MB (a petabyte), not {megabytes:g}"
    return None


class Ack(WireMessage, frozen=True):
    """A rank's acknowledgement of a control command, with the step where it took effect."""

    TYPE: ClassVar[str] = "ack"
    rank: Rank
    command_id: str
    applied: bool
    step: int
    detail: str = ""
    #: The strategy the command asked for, so that a record says what was refused ("" from an
    #: older ddpwatch, which does not send it: the summary then says only that a switch was refused).
    strategy: str = ""


class Goodbye(WireMessage, frozen=True):
    """A rank's last message. ``reason``: ``finished``; ``FAILED`` and what its training raised; or
    ``INTERRUPTED`` and the signal that stopped it from outside (Ctrl-C, torchrun's or a
    scheduler's SIGTERM)."""

    TYPE: ClassVar[str] = "goodbye"
    rank: Rank
    steps: int
    reason: str = "finished"
    #: The process trains again at once, a run of its own (a Trainer under ``auto_find_batch_size``
    #: begun again after running out of memory): a recorder goes on to it.
    trains_again: bool = False


FAILED = "failed: "  # a goodbye's reason when the rank's training raised: "failed: RuntimeError: ..."
INTERRUPTED = "interrupted: "  # when a signal stopped it: "interrupted: SIGTERM" (``stop_signals``)
#: When watching stopped while the rank trains on, unwatched: "detached: the optimizer stepped
#: inside the model's forward" (``attach`` on a loop it cannot read, or its own code raising).
DETACHED = "detached: "


def failure_of(reason: str) -> str | None:
    """What a goodbye's ``reason`` says the rank's training raised, or None where it did not."""
    return reason.removeprefix(FAILED) if reason.startswith(FAILED) else None


def interruption_of(reason: str) -> str | None:
    """The signal a goodbye's ``reason`` says stopped the rank from outside, or None where none
    did. An older dashboard reads such a goodbye as *finished*."""
    return reason.removeprefix(INTERRUPTED) if reason.startswith(INTERRUPTED) else None


def detachment_of(reason: str) -> str | None:
    """Why a goodbye's ``reason`` says ddpwatch stopped watching a rank that trains on, or None
    where it does not. An older dashboard reads such a goodbye as *finished*."""
    return reason.removeprefix(DETACHED) if reason.startswith(DETACHED) else None


class Evaluation(WireMessage, frozen=True):
    """What an evaluation of the model measured after optimizer step ``step``: its held-out loss,
    accuracy, … by name (``metrics``), so the dashboard draws them beside the training loss, and
    the exports keep them with the run's figures. A number may be NaN or infinite: a diverged
    evaluation is news, not a malformed message."""

    TYPE: ClassVar[str] = "evaluation"
    rank: Rank
    step: Count
    metrics: dict[str, float]

    def refusal(self) -> Refusal | None:
        """A few named numbers (``metrics_problem``)."""
        problem = metrics_problem(self.metrics)
        return None if problem is None else invalid(f"evaluation: {problem}")


def metrics_problem(metrics: object) -> str | None:
    """What is wrong with an evaluation's ``metrics``, in words, or None: at most
    ``MAX_EVALUATION_METRICS`` names of 1 to ``MAX_METRIC_NAME`` characters, each a number (an
    int or a float, NaN and infinities included; not a bool). The listener's check and the
    sender's (``Attachment.record_evaluation`` says it to the user in one line) are this one."""
    if not isinstance(metrics, dict) or not metrics:
        return f"expected the metrics as a non-empty mapping of names to numbers, got {type(metrics).__name__}"
    if len(metrics) > MAX_EVALUATION_METRICS:
        return f"{len(metrics)} metrics is over the {MAX_EVALUATION_METRICS} one evaluation may carry"
    for name, value in metrics.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_METRIC_NAME:
            return f"a metric's name must be 1-{MAX_METRIC_NAME} characters, got {name!r:.80}"
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return f"metric {name!r} is not a number: {value!r:.40}"
    return None


Message = (Hello | StepReport | StepSummary | Heartbeat | DeviceSample | SwitchCommand | SpanRequest | Ack | Goodbye
           | Evaluation)
MESSAGE_TYPES: dict[str, type[WireMessage]] = {cls.TYPE: cls for cls in (
    Hello, StepReport, StepSummary, Heartbeat, DeviceSample, SwitchCommand, SpanRequest, Ack, Goodbye, Evaluation)}
