"""Messages to bytes and back, and the decoder that trusts nothing.

Every message travels as a msgpack map ``{"v": version, "type": ..., "rank": r, "seq": n,
"dropped": d, "body": {...}}``; ``seq`` counts per rank so the receiver knows what was lost on the
way, and ``dropped`` is how many messages the sender itself discarded (full queue) so far.
``decode`` reads the envelope with the body left as bytes, then the body with the decoder of its
type (the schema in ``messages`` is the validation), then the message's own ``refusal``; anything
malformed raises ``ProtocolError`` with a category the receiver counts: ``oversized``, ``garbage``,
``truncated``, ``wrong_version``, ``unknown_type`` (a newer ddpwatch's message or span kind) or
``invalid``.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from instrumented_ddp.wire.messages import MESSAGE_TYPES, Message, WireMessage

PROTOCOL_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 8 * 1024 * 1024


class ProtocolError(ValueError):
    """A message that cannot be accepted; ``category`` names the kind of rejection."""

    def __init__(self, category: str, detail: str) -> None:
        super().__init__(f"{category}: {detail}")
        self.category = category
        self.detail = detail

    def __reduce__(self) -> tuple[type[ProtocolError], tuple[str, str]]:
        """Pickled as made (the dashboard's receiver process hands rejections over)."""
        return type(self), (self.category, self.detail)


class Envelope(msgspec.Struct, frozen=True, gc=False):
    """A decoded message and what its envelope said: the sending rank (-1: none), its ``seq`` and
    ``dropped``."""

    message: Message
    rank: int
    seq: int
    dropped: int


class _Outgoing(msgspec.Struct):
    """The envelope as written: every field, in this order."""

    v: int
    type: str
    rank: int
    seq: int
    dropped: int
    body: msgspec.Raw


class _Incoming(msgspec.Struct):
    """The envelope as read: each field unchecked until ``decode`` reaches it, in the order a
    rejection names them, and the body left as bytes until its type is known."""

    v: Any = None
    type: Any = None
    rank: Any = None
    seq: Any = None
    dropped: Any = None
    body: msgspec.Raw = msgspec.Raw(b"")


_PLAIN_TYPES: tuple[type[Any], ...] = (int, float, str, bytes, dict, list, tuple)


def _as_plain(value: Any) -> Any:
    """A subclass of a plain type (numpy's float64, an ``IntEnum``, a ``str`` enum) as that type,
    as msgpack writes it; anything else cannot be sent."""
    for plain in _PLAIN_TYPES:
        if isinstance(value, plain):
            return plain(value)
    raise TypeError(f"a {type(value).__name__} cannot travel on the wire")


_ENCODER = msgspec.msgpack.Encoder(enc_hook=_as_plain)
_ENVELOPE = msgspec.msgpack.Decoder(_Incoming)
_UNTYPED = msgspec.msgpack.Decoder()
_BODIES = {name: (cls, msgspec.msgpack.Decoder(cls)) for name, cls in MESSAGE_TYPES.items()}
#: Per message type, the optional fields whose default a value can equal without being it (a float,
#: a word): ``omit_defaults`` leaves out the default object itself (or an empty list or map) only, so
#: ``encode`` puts the default in place of an equal value first.
_EQUAL_DEFAULTS = {cls: tuple((field.name, field.default) for field in msgspec.structs.fields(cls)
                              if type(field.default) is float or (type(field.default) is str and field.default))
                   for cls in MESSAGE_TYPES.values()}
_MISSING_FIELD = re.compile(r"Object missing required field `(\w+)`$")
_WHERE = re.compile(r" - at `(key` in `)?\$\.(\w+)([^`]*)`$")
_MAP_HEADS = frozenset((*range(0x80, 0x90), 0xDE, 0xDF))  # fixmap, map 16, map 32


def encode(message: Message, seq: int = 0, dropped: int = 0) -> bytes:
    """``message`` in its envelope. An optional field equal to its default, and of its type, is
    left out, and ``decode`` gives the default back: the same message in fewer bytes."""
    shared = {name: default for name, default in _EQUAL_DEFAULTS[type(message)]
              if (value := getattr(message, name)) is not default and type(value) is type(default) and value == default}
    if shared:
        message = msgspec.structs.replace(message, **shared)
    body = _ENCODER.encode(message)
    if body[0] == 0xDE and body[1] == 0 and body[2] < 16:  # a map 16 sized for every field, fewer sent
        body = bytes((0x80 | body[2],)) + body[3:]  # the smallest header, as msgpack writes a map
    return _ENCODER.encode(_Outgoing(PROTOCOL_VERSION, message.TYPE, getattr(message, "rank", -1), seq, dropped,
                                     msgspec.Raw(body)))


def decode(data: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Envelope:
    """Parse and validate one message; raise ``ProtocolError`` for anything else. Whatever else is
    wrong, bytes that are not one whole msgpack value whose maps are keyed by strings (or bytes)
    are ``truncated`` or ``garbage``, as a reader of plain msgpack finds first."""
    if len(data) > max_bytes:
        raise ProtocolError("oversized", f"{len(data)} bytes is over the {max_bytes}-byte cap")
    try:
        return _read(data)
    except ProtocolError as refused:
        rejection = _unreadable(data) or refused
    raise rejection


def _read(data: bytes) -> Envelope:
    """The envelope's checks in order (version, type, body, counters), each refused as it comes."""
    try:
        wire = _ENVELOPE.decode(data)
    except msgspec.ValidationError:
        raise ProtocolError("garbage", "message is not a map keyed by names") from None
    except msgspec.DecodeError as error:
        raise _parse_error(error) from None
    if type(wire.v) is not int or wire.v != PROTOCOL_VERSION:
        raise ProtocolError("wrong_version", f"version {wire.v!r}, expected {PROTOCOL_VERSION}")
    kind = wire.type
    known = _BODIES.get(kind) if type(kind) is str else None
    if known is None:
        if type(kind) is str and kind:  # well formed, of a kind a newer ddpwatch sends
            raise ProtocolError("unknown_type", f"unknown message type {kind!r:.40}")
        raise ProtocolError("invalid", f"message type {kind!r:.40} is not a type's name")
    cls, decoder = known
    body = memoryview(wire.body)
    if not body or body[0] not in _MAP_HEADS:
        raise ProtocolError("invalid", "body is not a map")
    try:
        message: WireMessage = decoder.decode(body)
    except msgspec.ValidationError as error:
        raise ProtocolError("invalid", _field_refusal(cls, str(error))) from None
    except msgspec.DecodeError as error:
        raise _parse_error(error) from None
    if (refused := message.refusal()) is not None:
        raise ProtocolError(*refused)
    seq, dropped, rank = wire.seq, wire.dropped, wire.rank
    if not (type(seq) is int and type(dropped) is int and type(rank) is int and min(seq, dropped, rank) >= -1):
        raise ProtocolError("invalid", "seq, dropped and rank must be non-negative integers")
    return Envelope(message, rank, seq, dropped)  # type: ignore[arg-type]  # one of MESSAGE_TYPES


def _field_refusal(cls: type[WireMessage], error: str) -> str:
    """msgspec's words for a body it refused, said of the message's field: the field's own words
    (``FIELD_REFUSALS``) where the fault is inside it, msgspec's otherwise."""
    if missing := _MISSING_FIELD.match(error):
        return f"{cls.TYPE}: missing field {missing[1]!r}"
    if not (where := _WHERE.search(error)):
        return f"{cls.TYPE}: {error}"
    a_key, name, inside = where.groups()
    if (a_key or inside) and name in cls.FIELD_REFUSALS:
        return f"{cls.TYPE}.{name}: {cls.FIELD_REFUSALS[name]}"
    return f"{cls.TYPE}.{name}{inside}{' (a key)' if a_key else ''}: {error[:where.start()]}"


def _parse_error(error: msgspec.DecodeError) -> ProtocolError:
    text = str(error)
    if "truncated" in text:
        return ProtocolError("truncated", "not msgpack (cut short)")
    if "trailing characters" in text:
        return ProtocolError("garbage", "trailing bytes after the message")
    return ProtocolError("garbage", f"not msgpack ({text})")


def _unreadable(data: bytes) -> ProtocolError | None:
    """Why ``data`` read untyped is not one whole msgpack value whose maps are keyed by strings
    or bytes, or None. Read only for a message already refused: the rejection to count."""
    try:
        value = _UNTYPED.decode(data)
    except msgspec.DecodeError as error:
        return _parse_error(error)
    except Exception as error:  # hostile input: a key that cannot be hashed, nesting too deep
        return ProtocolError("garbage", f"not msgpack ({type(error).__name__})")
    pending = [value]
    while pending:
        item = pending.pop()
        if type(item) is dict:
            if not all(type(key) is str or type(key) is bytes for key in item):
                return ProtocolError("garbage", "not msgpack (a map key that is not a string)")
            pending.extend(item.values())
        elif type(item) is list:
            pending.extend(item)
    return None
