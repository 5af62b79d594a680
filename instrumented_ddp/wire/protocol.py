"""The wire schema between training ranks and ddpwatch: the one module both sides import.

Standard library and msgpack only, so the dashboard never imports torch. Every message is a
msgpack map ``{"v": version, "type": ..., "rank": r, "seq": n, "dropped": d, "body": {...}}``;
``seq`` counts per rank so the receiver knows what was lost on the way, and ``dropped`` is how
many messages the sender itself discarded (full queue) so far. ``decode`` never trusts its
input: anything malformed raises ``ProtocolError`` with a category the receiver counts.
"""

from __future__ import annotations

import functools
import json
import math
import numbers
import re
import sys
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, NamedTuple

import msgpack

PROTOCOL_VERSION = 1
MAX_DEVICE_EVERY_S = 60.0  # the slowest device sampling a listener may ask of a rank
DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024
#: Characters of what a loop paused training for (``StepReport.paused_for``, ``Heartbeat.pausing``)
#: a rank sends and a listener keeps: a few words ("evaluate, save").
MAX_PAUSED_FOR = 80
#: The largest world a hello may declare, beyond any job run today: a listener keeps and figures
#: each rank of it (a hello of 2**40 ranks hung the recorder listing them).
MAX_WORLD_SIZE = 1 << 17
#: The furthest from zero a time on the wire may be, in seconds (31,700 years): a rank's clocks
#: (``perf_counter``, the epoch's seconds) are far inside it, and a step from -1e308 to 1e308 made
#: the segment's wall time infinite and every export fail to write.
MAX_TIME_S = 1e12
#: The largest bucket cap, in MB: a petabyte, where DDP's reducer overflows its 64-bit bytes at ~8.8e12.
MAX_BUCKET_MB = 1e9
DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
#: What a run that cannot switch (``Hello.switchable`` False) answers, and the dashboard says.
NOT_SWITCHABLE = "this run was not started by ddpwatch: switching is off"

#: What users type; instrumented_ddp agrees. The last three shard state (ZeRO-1, ZeRO-2, FSDP2).
STRATEGY_NAMES = ("simple", "ga", "hook", "async", "bucket", "ddp", "zero1", "zero2", "fsdp")
#: The model's phases, timed from its hooks and its optimizer's.
MODEL_COMPUTE_KINDS = ("forward", "backward", "optimizer")
#: The loop's own compute outside them, where the loop marks it (``Attachment.computing``: a
#: teacher's forward in distillation, an average of the weights after the update); its ``tag``
#: is what the loop said it computes. Compute, not data loading.
LOOP_COMPUTE_KIND = "loop"
COMPUTE_KINDS = (*MODEL_COMPUTE_KINDS, LOOP_COMPUTE_KIND)
#: Collectives. ``nbytes`` of a ``reduce_scatter`` is its input, of an ``all_gather`` its output:
#: the whole tensor, as nccl-tests counts them, so bandwidths compare across kinds; of an
#: ``all_to_all`` its input (all a rank sends), of a ``gather`` or a ``scatter`` one rank's piece
#: times the group's ranks (the root's whole list), the same on every rank. The last four (a
#: ``reduce`` to one rank: a loss reduced to rank 0 for its log; an ``all_to_all``: an exchange
#: between the model's phases; a ``gather`` or ``scatter`` to or from one rank: an evaluation's predictions) are
#: sent only by a loop that issues one: a ddpwatch before them rejects a report holding one as
#: another ddpwatch's (``unknown_type``).
COMM_KINDS = ("all_reduce", "broadcast", "reduce_scatter", "all_gather", "reduce", "all_to_all", "gather", "scatter")
#: The tag of a ``wait`` span that is a barrier the loop issued (``dist.barrier``): the time the rank
#: sat blocked until every rank of its group arrived. A collective with nothing to carry (no bytes,
#: no transfer to tell from waiting), so a wait, and one of the step's timed collectives. A barrier
#: on a group of the loop's own is ``barrier@<group name>`` (``barrier_tag``).
BARRIER_TAG = "barrier"


def barrier_tag(group_name: str = "") -> str:
    """The tag of a barrier's wait: ``BARRIER_TAG`` for the world's, ``barrier@<name>`` for one on
    another group (c10d's name of it, the same on each of its ranks): pairing calls across ranks
    by tag, a barrier of a group then meets only that group's, never another group's or the world's."""
    return f"{BARRIER_TAG}@{group_name}" if group_name else BARRIER_TAG


def is_barrier_wait(span: Any) -> bool:
    """Whether ``span`` (a ``Span``, or a rank's pending one) is the wait of a barrier the loop issued."""
    return bool(span.kind == "wait" and (span.tag == BARRIER_TAG or span.tag.startswith(BARRIER_TAG + "@")))

#: A zero-length mark: when the gradients of parameter ``p<i>`` or bucket ``b<i>`` (the hello's
#: ``bucket_layout``) were all ready in backward, ``nbytes`` of them; the bucket advisor replays
#: backward from these. Not compute, not communication: no figure counts it.
READY_KIND = "ready"
SPAN_KINDS = (*COMPUTE_KINDS, *COMM_KINDS, "wait", "data", READY_KIND)
#: How a newer ddpwatch names a span kind (as this one does: ``all_reduce``), told from garbage: a
#: report holding one is rejected as ``unknown_type``, as a message of a type this one does not know.
_SPAN_KIND_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")


class ProtocolError(ValueError):
    """A message that cannot be accepted; ``category`` names the kind of rejection."""

    def __init__(self, category: str, detail: str) -> None:
        super().__init__(f"{category}: {detail}")
        self.category = category
        self.detail = detail

    def __reduce__(self) -> tuple[type[ProtocolError], tuple[str, str]]:
        """Pickled as made (the dashboard's receiver process hands rejections over)."""
        return type(self), (self.category, self.detail)


class Span(NamedTuple):
    """One time range on a rank's clock (seconds). ``blocking``: the main thread sat in it."""

    kind: str
    start: float
    end: float
    blocking: bool = False
    nbytes: int = 0
    tag: str = ""
    dtype: str = ""

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass(frozen=True)
class Hello:
    """Who a rank is and what it trains: sent first and repeated, so a late dashboard catches up."""

    TYPE: ClassVar[str] = "hello"
    rank: int
    world_size: int
    session: str
    host: str
    pid: int
    device: str
    backend: str
    strategy: str
    settings: dict[str, Any]
    model_parameters: int
    parameter_layout: list[tuple[str, int, str]] = field(default_factory=list)
    bucket_layout: list[list[int]] = field(default_factory=list)
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
    all_reduce_group: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class StepReport:
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
    loop did not mark): they read as the step's data loading, and the dashboard says so."""

    TYPE: ClassVar[str] = "step"
    rank: int
    step: int
    strategy: str
    settings: dict[str, Any]
    start: float
    end: float
    spans: Sequence[Span]  # a list from a rank; the dashboard keeps them packed (``ddpwatch.figures.compact_steps``)
    samples: int
    tokens: int
    loss: float | None = None
    excluded: bool = False
    unresolved: bool = False
    update_skipped: bool = False
    compiling: bool = False
    unresolved_reason: str = ""
    untimed_collectives: int = 0
    untimed_in_data: int = 0
    paused_s: float = 0.0
    paused_for: str = ""
    nograd_forwards: int = 0
    #: Bytes the rank held at the step's end (``instrumented_ddp.resources.memory``: ``parameters``,
    #: ``gradients``, ``optimizer_state``, ``peak``), measured every few steps; empty otherwise.
    memory: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class StepSummary:
    """One rank's step as figures it computed itself (``instrumented_ddp.wire.step_figures``), sent in
    place of the full ``StepReport`` when the dashboard has not asked for this rank's spans: a
    few hundred bytes where a large job's report holds hundreds of spans. It carries everything
    the figures across ranks need: the step window and alignment anchor, and each all-reduce's
    tag and duration (waits, the straggler, a desync). Durations and bandwidths travel as packed
    little-endian float64 (``pack_floats``), bit for bit what the rank computed."""

    TYPE: ClassVar[str] = "summary"
    rank: int
    step: int
    strategy: str
    settings: dict[str, Any]
    start: float
    end: float
    samples: int
    tokens: int
    compute_pct: float
    non_compute_pct: float
    idle_pct: float
    overlap_pct: float
    comm_overhead_pct: float
    anchor: float | None  # end of the step's last all-reduce (None: no all-reduce)
    busbw_gbps: float | None
    all_reduce_tags: Sequence[str]  # a list as decoded; the dashboard's receiver shares one tuple among ranks
    all_reduce_seconds: bytes  # float64 per all-reduce, issue order
    algbw_gbps: bytes  # float64 per measurable all-reduce, issue order
    loss: float | None = None
    excluded: bool = False
    unresolved: bool = False
    calls_by_kind: dict[str, int] = field(default_factory=dict)  # every collective kind's calls
    memory: dict[str, int] = field(default_factory=dict)  # as in ``StepReport``
    update_skipped: bool = False  # as in ``StepReport``
    compiling: bool = False  # as in ``StepReport``
    unresolved_reason: str = ""  # as in ``StepReport``
    untimed_collectives: int = 0  # as in ``StepReport``
    untimed_in_data: int = 0  # as in ``StepReport``
    paused_s: float = 0.0  # as in ``StepReport``
    paused_for: str = ""  # as in ``StepReport``
    nograd_forwards: int = 0  # as in ``StepReport``
    #: The loop's own collectives the step timed (``l<k>``), how many and their summed ms
    #: (``StepFigures.loop_collectives``); 0 from an older sender.
    loop_collectives: int = 0
    loop_collective_ms: float = 0.0
    #: float64 per all-reduce, issue order: its start, seconds after the step's; sent only where
    #: two of them overlap (gloo), or one overlaps a sharded call (HSDP on a GPU), so that two
    #: calls waiting at once are counted once. Empty otherwise, and from an older sender.
    all_reduce_starts: bytes = b""
    #: float64 per measurable collective of each other kind (reduce-scatter, all-gather,
    #: broadcast), issue order: their bandwidths, as ``algbw_gbps`` is the all-reduces'. Empty
    #: from an older sender: the segment's busbw of those kinds is then made of full reports alone.
    other_algbw_gbps: dict[str, bytes] = field(default_factory=dict)
    #: The step's reduce-scatters and all-gathers as the all-reduces are sent: each one's kind and
    #: tag (``all_gather:u0``), float64 duration and, where two overlapped (or one an all-reduce), start. The sharded
    #: strategies' waits and straggler are made of them. The waits of the loop's barriers travel
    #: among them too (``wait:barrier``): every rank joins a barrier as it joins these. Empty from an older sender.
    sharded_tags: Sequence[str] = field(default_factory=list)
    sharded_seconds: bytes = b""
    sharded_starts: bytes = b""
    #: The share of the step window spent in ``data`` with nothing else running (``StepFigures.data_wait_pct``).
    #: 0 from an older sender.
    data_wait_pct: float = 0.0
    #: The loop's own compute the step marked, its ms and what it was (``StepFigures.loop_compute_ms``,
    #: ``loop_computed``). 0 and "" where none was marked, and from an older sender.
    loop_compute_ms: float = 0.0
    loop_computed: str = ""


HELD_STEPS = 64  # recent step reports a rank keeps, so a pinned step's spans can still be sent


@dataclass(frozen=True)
class SpanRequest:
    """What the dashboard (or recorder) wants of one rank's spans; the rank sends a full
    ``StepReport`` for a step when ``full`` is set, when ``sample_every`` divides the step, or
    when the step is in ``pinned_steps`` and still held (a step the user pinned), and a
    ``StepSummary`` otherwise. Sent again every few seconds, so a rank that missed one, or a
    new listener, is set right; a rank that never got one sends everything."""

    TYPE: ClassVar[str] = "span_request"
    full: bool
    sample_every: int = 0
    pinned_steps: list[int] = field(default_factory=list)
    #: Seconds between the rank's device samples (0: its own rate, 5 a second). A large job's
    #: dashboard asks for fewer: at 1,024 ranks they were two thirds of every message.
    device_every_s: float = 0.0


@dataclass(frozen=True)
class Heartbeat:
    """A rank is alive, at ``step``. ``pausing``: what its loop is doing instead of training
    while it does it (an evaluation: ``Attachment.paused``), so that a dashboard can say why no
    step comes; "" while it trains."""

    TYPE: ClassVar[str] = "heartbeat"
    rank: int
    time: float
    step: int
    pausing: str = ""


@dataclass(frozen=True)
class DeviceSample:
    """Readings of a rank's device; a reading the device cannot give is absent, never zero."""

    TYPE: ClassVar[str] = "device"
    rank: int
    time: float
    kind: str  # "gpu" (NVML) or "cpu" (psutil); time is on the rank's span clock (perf_counter)
    readings: dict[str, float]


@dataclass(frozen=True)
class SwitchCommand:
    """Ask every rank to move to another strategy at the next optimizer-step boundary."""

    TYPE: ClassVar[str] = "switch"
    command_id: str
    strategy: str
    bucket_mb: float | None = None
    grad_accum: int | None = None
    #: How long from now its asker waits for the acknowledgement (``ddpwatch switch --timeout``; a
    #: relay's resend says what is left of it), or None: for as long as the run goes on. Rank 0
    #: refuses it once that has passed since it heard it, on every rank alike, rather than switch a
    #: run whose asker was told it had failed (a slow step or a pause held it that long).
    expires_after_s: float | None = None


@dataclass(frozen=True)
class Ack:
    """A rank's acknowledgement of a control command, with the step where it took effect."""

    TYPE: ClassVar[str] = "ack"
    rank: int
    command_id: str
    applied: bool
    step: int
    detail: str = ""
    #: The strategy the command asked for, so that a record says what was refused ("" from a
    #: ddpwatch before it was sent: the summary then says only that a switch was refused).
    strategy: str = ""


@dataclass(frozen=True)
class Goodbye:
    """A rank's last message. ``reason``: ``finished``; ``FAILED`` and what its training raised; or
    ``INTERRUPTED`` and the signal that stopped it from outside (Ctrl-C, torchrun's or a
    scheduler's SIGTERM)."""

    TYPE: ClassVar[str] = "goodbye"
    rank: int
    steps: int
    reason: str = "finished"
    #: The process trains again at once, a run of its own (a Trainer under ``auto_find_batch_size``
    #: begun again after running out of memory): a recorder goes on to it.
    trains_again: bool = False


#: What one evaluation may carry: a few named numbers (a Trainer's ``compute_metrics`` gives a handful).
MAX_EVALUATION_METRICS = 32
MAX_METRIC_NAME = 64  # characters of a metric's name


@dataclass(frozen=True)
class Evaluation:
    """What an evaluation of the model measured after optimizer step ``step``: its held-out loss,
    accuracy, … by name (``metrics``), so the dashboard draws them beside the training loss, and
    the exports keep them with the run's figures. A number may be NaN or infinite: a diverged
    evaluation is news, not a malformed message."""

    TYPE: ClassVar[str] = "evaluation"
    rank: int
    step: int
    metrics: dict[str, float]


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
    did. A dashboard older than this reads such a goodbye as *finished*."""
    return reason.removeprefix(INTERRUPTED) if reason.startswith(INTERRUPTED) else None


def detachment_of(reason: str) -> str | None:
    """Why a goodbye's ``reason`` says ddpwatch stopped watching a rank that trains on, or None
    where it does not. A dashboard older than this reads such a goodbye as *finished*."""
    return reason.removeprefix(DETACHED) if reason.startswith(DETACHED) else None


Message = (Hello | StepReport | StepSummary | Heartbeat | DeviceSample | SwitchCommand | SpanRequest | Ack | Goodbye
           | Evaluation)
MESSAGE_TYPES: dict[str, type] = {cls.TYPE: cls for cls in (
    Hello, StepReport, StepSummary, Heartbeat, DeviceSample, SwitchCommand, SpanRequest, Ack, Goodbye, Evaluation)}
MAX_REQUESTED_STEPS = 64  # steps one SpanRequest may name


def pack_floats(values: Iterable[float]) -> bytes:
    """Little-endian float64, whatever the host's byte order."""
    packed = array("d", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_floats(data: bytes) -> array[float]:
    """``pack_floats`` undone, as C doubles: a listener keeps a 1,024-rank job's durations without
    making a Python float of each. ``data``'s length must be a multiple of 8."""
    values = array("d", data)
    if sys.byteorder == "big":
        values.byteswap()
    return values


@dataclass(frozen=True)
class Envelope:
    message: Message
    rank: int
    seq: int
    dropped: int


def encode(message: Message, seq: int = 0, dropped: int = 0) -> bytes:
    # A shallow map of the fields: msgpack writes tuples (spans, layout entries) as arrays, and
    # no message nests a dataclass, so ``asdict``'s deep copy (most of a summary's cost) is not needed.
    # An optional field at its default is left out, and ``decode`` gives the default back: the same
    # message, and a 2-rank ``bucket`` run's summaries went from 880 to 758 bytes on average.
    cls: type = type(message)
    defaults = _field_defaults(cls)
    body: dict[str, Any] = {}
    for name in _field_names(cls):
        value = getattr(message, name)
        if name not in defaults or type(value) is not type(defaults[name]) or value != defaults[name]:
            body[name] = value
    rank = getattr(message, "rank", -1)
    return msgpack.packb(
        {"v": PROTOCOL_VERSION, "type": message.TYPE, "rank": rank, "seq": seq, "dropped": dropped, "body": body},
        use_bin_type=True,
    )


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(name for name, _, _ in _field_specs(cls))


@functools.cache
def _field_defaults(cls: type) -> dict[str, Any]:
    """Each optional field's default value (a factory's, made once: only compared, never handed out)."""
    defaults: dict[str, Any] = {}
    for spec in fields(cls):
        if spec.default is not MISSING:
            defaults[spec.name] = spec.default
        elif spec.default_factory is not MISSING:
            defaults[spec.name] = spec.default_factory()
    return defaults


def decode(data: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Envelope:
    """Parse and validate one message; raise ``ProtocolError`` for anything else."""
    if len(data) > max_bytes:
        raise ProtocolError("oversized", f"{len(data)} bytes is over the {max_bytes}-byte cap")
    try:
        raw = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except msgpack.ExtraData:
        raise ProtocolError("garbage", "trailing bytes after the message") from None
    except (ValueError, msgpack.UnpackException) as error:
        # msgpack caps a container's declared length at the buffer's: a short prefix says "exceeds".
        text = str(error).lower()
        category = "truncated" if "incomplete" in text or "exceeds max_" in text or isinstance(error, msgpack.OutOfData) else "garbage"
        raise ProtocolError(category, f"not msgpack ({type(error).__name__})") from None
    except Exception as error:  # msgpack raises assorted types on hostile input
        raise ProtocolError("garbage", f"not msgpack ({type(error).__name__})") from None
    if not isinstance(raw, dict):
        raise ProtocolError("garbage", "message is not a map")
    if not _is_int(raw.get("v")) or raw.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("wrong_version", f"version {raw.get('v')!r}, expected {PROTOCOL_VERSION}")
    kind = raw.get("type")
    cls = MESSAGE_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None and isinstance(kind, str) and kind:  # well formed, of a kind a newer ddpwatch sends
        raise ProtocolError("unknown_type", f"unknown message type {kind!r:.40}")
    if cls is None:
        raise ProtocolError("invalid", f"message type {raw.get('type')!r:.40} is not a type's name")
    body = raw.get("body")
    if not isinstance(body, dict):
        raise ProtocolError("invalid", "body is not a map")
    message = _build(cls, body)
    seq, dropped, rank = raw.get("seq"), raw.get("dropped"), raw.get("rank")
    if not (isinstance(seq, int) and isinstance(dropped, int) and isinstance(rank, int)
            and all(_is_int(v) and v >= -1 for v in (seq, dropped, rank))):
        raise ProtocolError("invalid", "seq, dropped and rank must be non-negative integers")
    return Envelope(message, rank, seq, dropped)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)) and math.isfinite(value)


def _is_time(value: Any) -> bool:
    return _is_number(value) and abs(value) < MAX_TIME_S


_TIMES = ("start", "end", "time", "anchor")  # fields on a rank's clock: ``_is_time``

_CHECKS: dict[type, Any] = {int: _is_int, float: _is_number, str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool),
                            bytes: lambda v: isinstance(v, bytes)}


@functools.cache
def _field_specs(cls: type) -> tuple[tuple[str, bool, Callable[[Any], bool]], ...]:
    """(name, optional, value check) per field of a message type, made once per type: a
    1,024-rank job's listener decodes thousands of messages a second."""
    return tuple((spec.name, spec.default is not MISSING or spec.default_factory is not MISSING, _value_check(spec.name))
                 for spec in fields(cls))


def _value_check(name: str) -> Callable[[Any], bool]:
    """One test of a field's value, from ``_FIELD_TYPES``' options (a type, or a tuple of them)."""
    expected = _FIELD_TYPES.get(name)
    tests: list[Callable[[Any], bool]] = []
    for option in expected if isinstance(expected, tuple) else (expected,):
        if option is type(None):
            tests.append(lambda value: value is None)
        elif option is float and name in _TIMES:
            tests.append(_is_time)
        elif option in _CHECKS:
            tests.append(_CHECKS[option])
        elif option is dict:
            tests.append(lambda value: isinstance(value, dict))
        elif option is list:
            tests.append(lambda value: isinstance(value, list))
    if len(tests) == 1:
        return tests[0]
    return lambda value: any(test(value) for test in tests)


def _build(cls: type[Message], body: dict[str, Any]) -> Message:
    values: dict[str, Any] = {}
    plain_class: type = cls  # the cached helpers key on the class
    for name, optional, check in _field_specs(plain_class):
        if name not in body:
            if optional:
                continue
            raise ProtocolError("invalid", f"{cls.TYPE}: missing field {name!r}")
        value = values[name] = body[name]
        if not check(value) and not (name == "loss" and isinstance(value, float)):  # a NaN loss is real news
            raise ProtocolError("invalid", f"{cls.TYPE}.{name} has a bad value {value!r:.40}")
    if "settings" in values:
        _check_settings(cls.TYPE, values["settings"])
    if cls is SwitchCommand and values.get("expires_after_s") is not None and not 0 <= values["expires_after_s"] <= MAX_TIME_S:
        raise ProtocolError("invalid", f"switch.expires_after_s outside 0-{MAX_TIME_S:g} s")
    if cls is DeviceSample and not all(isinstance(k, str) and _is_number(v) for k, v in values["readings"].items()):
        raise ProtocolError("invalid", "device: a reading's name is not a string or its value not a finite number")
    if cls in (StepReport, StepSummary):
        _check_step(values)
        for name in ("calls_by_kind", "memory"):
            _check_counts(cls.TYPE, name, values.get(name, {}))
    if cls is StepReport:
        values["spans"] = [_span(item) for item in values["spans"]]
    if cls is StepSummary:
        _check_summary(values)
    if cls is SpanRequest:
        if values.get("sample_every", 0) < 0 or not all(_is_int(v) and v >= 0 for v in values.get("pinned_steps", [])):
            raise ProtocolError("invalid", "span_request: a negative or non-integer step")
        if len(values.get("pinned_steps", [])) > MAX_REQUESTED_STEPS:
            raise ProtocolError("invalid", f"span_request: over {MAX_REQUESTED_STEPS} steps")
        if not 0.0 <= values.get("device_every_s", 0.0) <= MAX_DEVICE_EVERY_S:
            raise ProtocolError("invalid", f"span_request: device_every_s outside 0-{MAX_DEVICE_EVERY_S:g} s")
    if cls is Evaluation:
        if (problem := metrics_problem(values["metrics"])) is not None:
            raise ProtocolError("invalid", f"evaluation: {problem}")
        if values["step"] < 0:
            raise ProtocolError("invalid", "evaluation: a negative step")
    if cls is Hello:
        if not 0 <= values["rank"] < values["world_size"] <= MAX_WORLD_SIZE:
            raise ProtocolError("invalid", f"hello: world_size outside 1-{MAX_WORLD_SIZE}, or a rank outside it")
        values["parameter_layout"] = [_layout_row(row) for row in values.get("parameter_layout", [])]
        _check_all_reduce_group(values)
    if "rank" in values and values["rank"] < 0:
        raise ProtocolError("invalid", "negative rank")
    try:
        return cls(**values)
    except TypeError as error:
        raise ProtocolError("invalid", str(error)) from None


_FIELD_TYPES: dict[str, Any] = {
    "rank": int, "world_size": int, "pid": int, "model_parameters": int, "total_steps": int, "global_batch": int,
    "node_rank": int, "local_rank": int, "step": int, "samples": int, "tokens": int, "steps": int,
    "grad_accum": (int, type(None)), "session": str, "host": str, "device": str, "backend": str, "strategy": str,
    "command_id": str, "reason": str, "detail": str, "kind": str, "start": float, "end": float, "time": float,
    "loss": (float, type(None)), "bucket_mb": (float, type(None)), "expires_after_s": (float, type(None)), "excluded": bool, "unresolved": bool, "update_skipped": bool, "compiling": bool, "applied": bool, "trains_again": bool,
    "device_note": str, "unresolved_reason": str, "untimed_collectives": int, "untimed_in_data": int, "nograd_forwards": int, "paused_s": float, "paused_for": str, "pausing": str, "switchable": bool, "compute_pct": float, "non_compute_pct": float, "idle_pct": float, "overlap_pct": float,
    "comm_overhead_pct": float, "anchor": (float, type(None)), "busbw_gbps": (float, type(None)),
    "all_reduce_tags": list, "all_reduce_seconds": bytes, "all_reduce_starts": bytes, "algbw_gbps": bytes, "full": bool, "sample_every": int,
    "pinned_steps": list, "device_every_s": float, "calls_by_kind": dict, "memory": dict,
    "settings": dict, "readings": dict, "spans": list, "parameter_layout": list, "bucket_layout": list,
    "all_reduce_group": list, "other_algbw_gbps": dict, "sharded_tags": list, "sharded_seconds": bytes,
    "sharded_starts": bytes, "metrics": dict, "data_wait_pct": float, "loop_collectives": int, "loop_collective_ms": float,
    "loop_compute_ms": float, "loop_computed": str,
}


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


def _check_settings(message: str, settings: dict[Any, Any]) -> None:
    """A strategy's settings: names, each a word, a number, a flag or none; ``grad_accum`` a
    whole number from 1 (or none), ``bucket_mb`` one from 0 (or none). Every listener reads
    them (a segment's label, its micro-steps): ``grad_accum`` of ``"two"`` or NaN raised as the
    report was folded, and the recorder died with the run unwritten."""
    for name, value in settings.items():
        if not isinstance(name, str) or not (value is None or isinstance(value, (str, bool)) or _is_number(value)):
            raise ProtocolError("invalid", f"{message}.settings: a name that is not a string, or a value {value!r:.30} "
                                           "that is not a word, a finite number, a flag or none")
    grad_accum, bucket_mb = settings.get("grad_accum"), settings.get("bucket_mb")
    if grad_accum is not None and not (_is_int(grad_accum) and grad_accum >= 1):
        raise ProtocolError("invalid", f"{message}.settings: grad_accum {grad_accum!r:.30} is not a whole number from 1")
    if bucket_mb is not None and not (_is_number(bucket_mb) and bucket_mb >= 0):  # DDP takes a cap of 0
        raise ProtocolError("invalid", f"{message}.settings: bucket_mb {bucket_mb!r:.30} is not a number from 0")


def _check_all_reduce_group(values: dict[str, Any]) -> None:
    """A hello's ``all_reduce_group``: distinct ranks of its world, its own among them (or none)."""
    group = values.get("all_reduce_group", [])
    if group and not (all(_is_int(r) and 0 <= r < values["world_size"] for r in group)
                      and len(set(group)) == len(group) and values["rank"] in group):
        raise ProtocolError("invalid", "hello: all_reduce_group must be distinct ranks of the world, the sender's among them")


def _check_step(values: dict[str, Any]) -> None:
    if values["end"] < values["start"]:
        raise ProtocolError("invalid", "step ends before it starts")
    if (values["step"] < 0 or values["samples"] < 0 or values["tokens"] < 0 or values.get("untimed_collectives", 0) < 0
            or values.get("nograd_forwards", 0) < 0 or values.get("untimed_in_data", 0) < 0):
        raise ProtocolError("invalid", "negative step, samples, tokens, untimed collectives or forwards without gradients")
    if values.get("untimed_in_data", 0) > values.get("untimed_collectives", 0):
        raise ProtocolError("invalid", "more untimed collectives in the data time than untimed in the step")
    if not 0.0 <= values.get("paused_s", 0.0) < math.inf:
        raise ProtocolError("invalid", "paused_s is negative or not finite")
    if values.get("loop_collectives", 0) < 0 or not 0.0 <= values.get("loop_collective_ms", 0.0) < math.inf:
        raise ProtocolError("invalid", "loop_collectives is negative, or loop_collective_ms negative or not finite")
    if not 0.0 <= values.get("loop_compute_ms", 0.0) < math.inf:
        raise ProtocolError("invalid", "loop_compute_ms is negative or not finite")


MEMORY_KINDS = ("parameters", "gradients", "optimizer_state", "peak")


def _check_counts(message: str, name: str, counts: dict[Any, Any]) -> None:
    """A few named non-negative integers: collective kinds' calls, or memory kinds' bytes."""
    known = COMM_KINDS if name == "calls_by_kind" else MEMORY_KINDS
    if not all(key in known and _is_int(value) and value >= 0 for key, value in counts.items()):
        raise ProtocolError("invalid", f"{message}.{name} holds an unknown name or a bad count")


def _check_summary(values: dict[str, Any]) -> None:
    """A summary's figures must be ones a rank could have computed: percentages in [0, 100]
    (a hair of float rounding over), one duration per tag, every number finite."""
    for name in ("compute_pct", "non_compute_pct", "idle_pct", "overlap_pct", "comm_overhead_pct", "data_wait_pct"):
        if not -1e-6 <= values.get(name, 0.0) <= 100.0 + 1e-6:
            raise ProtocolError("invalid", f"summary.{name} is not a percentage")
    tags, seconds, algbw = values["all_reduce_tags"], values["all_reduce_seconds"], values["algbw_gbps"]
    # C loops throughout: a 1,024-rank job's listener checks a thousand summaries a second
    if not set(map(type, tags)) <= {str}:
        raise ProtocolError("invalid", "summary.all_reduce_tags holds a non-string")
    if len(seconds) != 8 * len(tags) or len(algbw) % 8 or len(algbw) > len(seconds):
        raise ProtocolError("invalid", "summary: durations do not match the tags")
    _check_non_negative("duration or bandwidth", seconds + algbw)
    for kind, packed in values.get("other_algbw_gbps", {}).items():
        if (kind not in COMM_KINDS or kind == "all_reduce" or not isinstance(packed, bytes) or len(packed) % 8
                or len(packed) > 8 * values.get("calls_by_kind", {}).get(kind, 0)):
            raise ProtocolError("invalid", "summary.other_algbw_gbps: an unknown kind, or more bandwidths than its calls")
        _check_non_negative("bandwidth", packed)
    _check_starts("all_reduce", values.get("all_reduce_starts", b""), seconds)
    tags, seconds = values.get("sharded_tags", []), values.get("sharded_seconds", b"")
    if not set(map(type, tags)) <= {str} or len(seconds) != 8 * len(tags):
        raise ProtocolError("invalid", "summary: sharded_seconds do not match sharded_tags")
    _check_non_negative("reduce-scatter, all-gather or barrier duration", seconds)
    _check_starts("sharded", values.get("sharded_starts", b""), seconds)


def _check_non_negative(what: str, packed: bytes) -> None:
    """Whole float64s (the caller checked the lengths), none negative, and a finite sum: no NaN
    or infinity (nor values so large they overflow it). C loops: a 1,024-rank job's listener
    checks a thousand summaries a second."""
    if not _plainly_valid(packed) and (min(floats := unpack_floats(packed)) < 0 or not math.isfinite(sum(floats))):
        raise ProtocolError("invalid", f"summary: a negative or non-finite {what}")


def _check_starts(name: str, starts: bytes, seconds: bytes) -> None:
    """A summary's ``<name>_starts``: none, or one per duration, each finite (seconds after the
    step's start: may be negative, never NaN)."""
    if starts and len(starts) != len(seconds):
        raise ProtocolError("invalid", f"summary: {name}_starts do not match the tags")
    if starts and not _plainly_valid(starts) and not math.isfinite(sum(map(abs, unpack_floats(starts)))):
        raise ProtocolError("invalid", f"summary: a non-finite {name} start")


def _plainly_valid(packed: bytes) -> bool:
    """Every little-endian float64 in ``packed`` has its top byte under 0x7F: sign bit clear and
    exponent under 0x7F0, so each is non-negative and finite (below 2**1009). False sends the
    bytes to the exact check, which also takes -0.0 and huge finite values."""
    return not packed or max(packed[7::8]) < 0x7F


def _layout_row(row: Any) -> tuple[str, int, str]:
    if not (isinstance(row, (list, tuple)) and len(row) == 3 and isinstance(row[0], str) and _is_int(row[1]) and isinstance(row[2], str)):
        raise ProtocolError("invalid", "a parameter layout row is [name, numel, dtype]")
    return (row[0], row[1], row[2])


def _span(item: Any) -> Span:
    if not isinstance(item, (list, tuple)) or not 3 <= len(item) <= 7:
        raise ProtocolError("invalid", "a span is a list of 3 to 7 items")
    kind, start, end, *rest = item
    if kind not in SPAN_KINDS:
        if isinstance(kind, str) and _SPAN_KIND_NAME.fullmatch(kind):  # a newer ddpwatch's kind
            raise ProtocolError("unknown_type", f"a span of a kind this ddpwatch does not know, {kind!r}")
        raise ProtocolError("invalid", f"unknown span kind {kind!r:.30}")
    if not (_is_time(start) and _is_time(end)) or end < start:
        raise ProtocolError("invalid", f"{kind} span has bad times")
    span = Span(kind, float(start), float(end), *rest)
    if not isinstance(span.blocking, bool) or not _is_int(span.nbytes) or span.nbytes < 0:
        raise ProtocolError("invalid", f"{kind} span has bad flags or bytes")
    if not isinstance(span.tag, str) or not isinstance(span.dtype, str):
        raise ProtocolError("invalid", f"{kind} span has a bad tag or dtype")
    return span


# -- who may talk: ZeroMQ CURVE keys, shared as files ---------------------------------------------


@dataclass(frozen=True)
class ClientKeys:
    """What a rank (or ``ddpwatch switch``) needs to talk to a dashboard that authenticates:
    the dashboard's public key and the client key pair it accepts. Z85 text, as ZeroMQ uses."""

    server_public: str
    client_public: str
    client_secret: str

    def socket_options(self) -> list[tuple[str, bytes]]:
        """(pyzmq socket attribute, value) pairs that make a socket this CURVE client."""
        return [("curve_serverkey", self.server_public.encode()), ("curve_publickey", self.client_public.encode()),
                ("curve_secretkey", self.client_secret.encode())]


def load_client_keys(path: str) -> ClientKeys:
    """Read a client key file written by ``ddpwatch --keys``; a one-line error if it is unusable."""
    try:
        with open(path, encoding="utf-8") as file:
            data = json.load(file)
        return ClientKeys(data["server_public"], data["client_public"], data["client_secret"])
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise ValueError(f"cannot read CURVE client keys from {path}: {error}") from None


def bucket_mb_problem(bucket_mb: object, name: str = "bucket_mb") -> str | None:
    """Why ``bucket_mb`` cannot be a bucket cap, or None: the one rule of ``wrap``, train.py,
    ``ddpwatch switch`` and ``tune`` and the dashboard's picker, each saying it of its own
    ``name`` (a flag: ``--bucket-mb``). An infinite cap passed ``> 0`` and then broke the
    ``int()`` of bytes inside ``wrap`` (and inside DDP), a traceback on every rank."""
    if isinstance(bucket_mb, bool) or not isinstance(bucket_mb, numbers.Real):  # numpy's numbers too
        return f"{name} must be a number of MB, not {bucket_mb!r}"
    megabytes = float(bucket_mb)
    if not (math.isfinite(megabytes) and megabytes > 0):
        return f"{name} must be a positive, finite number of MB, not {megabytes:g}"
    if megabytes > MAX_BUCKET_MB:  # DDP's C++ reducer takes the bytes as a 64-bit integer: a TypeError on every rank
        return f"{name} must be at most {MAX_BUCKET_MB:g} MB (a petabyte), not {megabytes:g}"
    return None


def address_problem(address: str) -> str | None:
    """Why ``address`` is not a ZeroMQ endpoint we can use, or None."""
    if address.startswith(("ipc://", "inproc://")):
        return None
    if not address.startswith("tcp://") or ":" not in address[len("tcp://"):]:
        return f"{address!r} is not an address like tcp://127.0.0.1:5555"
    port = address.rsplit(":", 1)[1]
    return None if port == "*" or (port.isdigit() and 0 < int(port) < 65536) else f"{address!r} has no valid port"


def is_loopback(address: str) -> bool:
    """Addresses nobody else on the network can reach: loopback TCP, IPC, in-process."""
    if address.startswith(("ipc://", "inproc://")):
        return True
    if not address.startswith("tcp://"):
        return False
    host = address[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    return host in ("localhost", "::1") or host.startswith("127.")


def routing_id(session: str, rank: int) -> bytes:
    """The ZeroMQ routing id a rank's socket carries: how the dashboard's ROUTER tells ranks apart
    (and finds rank 0 to send it commands), and which run a message comes from (``run_of_sender``)."""
    return f"rank-{rank}-{session}".encode()


def run_of_sender(peer: bytes) -> str:
    """The run (its session id, as its hello names it) whose rank sent with routing id ``peer``; ""
    for a peer that is no rank (``ddpwatch switch``, a raw socket). The listener learns from it
    which run each message belongs to, whatever the message says, so two runs sending to one
    address at once are told apart even between their hellos."""
    prefix, _, rest = peer.partition(b"-")
    rank, _, session = rest.partition(b"-")
    if prefix != b"rank" or not rank.isdigit() or not session:
        return ""
    return session.decode("utf-8", errors="replace")
