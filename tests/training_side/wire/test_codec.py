"""The codec's bytes: each message as plain msgpack writes its map, a field equal to its default
left out, and a refusal named as a plain msgpack reader meets it first."""

from __future__ import annotations

import enum
import math
import pickle
from typing import Any

import msgpack
import msgspec
import pytest

from instrumented_ddp.wire.codec import PROTOCOL_VERSION, Envelope, ProtocolError, decode, encode
from instrumented_ddp.wire.messages import (Ack, DeviceSample, Evaluation, Goodbye, Heartbeat, Hello, Span, SpanRequest,
                                            StepReport, SwitchCommand)
from instrumented_ddp.wire.step_figures import summarize

HELLO = Hello(1, 2, "abc", "node-7", 42, "cpu", "gloo", "bucket", {"bucket_mb": 25.0}, 4_900, [("w", 1024, "float32")], [[0]])
STEP = StepReport(1, 7, "async", {"grad_accum": 1}, 10.0, 10.5, [
    Span("data", 10.0, 10.01), Span("forward", 10.01, 10.1), Span("backward", 10.1, 10.3),
    Span("all_reduce", 10.15, 10.35, False, 4096, "p3", "float32"), Span("optimizer", 10.35, 10.5)], 8, 1024, loss=2.75)
SUMMARY = summarize(STEP, world_size=2)
MESSAGES: list[Any] = [HELLO, STEP, SUMMARY, SpanRequest(full=False, sample_every=20, pinned_steps=[5]), Heartbeat(0, 1.5, 3),
                       DeviceSample(0, 12.5, "gpu", {"gpu_util_pct": 87.0}), SwitchCommand("c", "bucket", 12.5, 4, 29.5),
                       Ack(1, "c", True, 12, "from step 12"), Goodbye(1, 50, "interrupted: SIGTERM"),
                       Evaluation(1, 40, {"eval_loss": 0.41})]


def _as_msgpack_writes_it(message: Any, seq: int, dropped: int) -> bytes:
    """The envelope and the body as dicts, a field left out where it equals its default."""
    body = {}
    for field in msgspec.structs.fields(type(message)):
        value = getattr(message, field.name)
        default = field.default_factory() if field.default_factory is not msgspec.NODEFAULT else field.default
        if field.required or type(value) is not type(default) or value != default:
            body[field.name] = value
    envelope = {"v": PROTOCOL_VERSION, "type": message.TYPE, "rank": getattr(message, "rank", -1), "seq": seq,
                "dropped": dropped, "body": body}
    return msgpack.packb(envelope, use_bin_type=True)


@pytest.mark.parametrize("message", MESSAGES, ids=lambda m: type(m).TYPE)
def test_every_message_is_the_bytes_msgpack_writes_for_its_map(message: Any) -> None:
    """A session file, and a peer of any version, read the same bytes whichever encoder wrote them."""
    assert encode(message, seq=300, dropped=2) == _as_msgpack_writes_it(message, 300, 2)


def test_a_field_equal_to_its_default_is_left_out_though_it_is_another_object() -> None:
    computed = msgspec.structs.replace(SUMMARY, data_wait_pct=float("0"), paused_s=-0.0, loop_compute_ms=1.0 - 1.0)
    body = msgpack.unpackb(encode(computed))["body"]
    assert not {"data_wait_pct", "paused_s", "loop_compute_ms"} & set(body)
    finished = Goodbye(0, 5, "".join(["fin", "ished"]))
    assert "reason" not in msgpack.unpackb(encode(finished))["body"] and decode(encode(finished)).message == finished
    assert msgpack.unpackb(encode(Goodbye(0, 5, "failed: E")))["body"]["reason"] == "failed: E"


def test_a_subclass_of_a_plain_number_or_word_travels_as_the_plain_one() -> None:
    class Kind(str, enum.Enum):
        GPU = "gpu"

    class Reading(float):
        pass

    sample = DeviceSample(0, 1.0, Kind.GPU, {"power_w": Reading(410.5)})
    assert decode(encode(sample)).message == DeviceSample(0, 1.0, "gpu", {"power_w": 410.5})
    with pytest.raises(TypeError):
        encode(DeviceSample(0, 1.0, "gpu", {"power_w": object()}))  # type: ignore[dict-item]


def test_a_field_this_ddpwatch_does_not_know_is_read_past() -> None:
    """A newer ddpwatch's field: the rest of its message is read as this one knows it."""
    raw = msgpack.unpackb(encode(Heartbeat(0, 2.5, 3)))
    raw["body"]["queue_depth"] = {"sent": [1, 2]}
    assert decode(msgpack.packb(raw, use_bin_type=True)).message == Heartbeat(0, 2.5, 3)


@pytest.mark.parametrize(("raw", "category"), [
    ({"v": 2, "type": "heartbeat", "rank": 0, "seq": 0, "dropped": 0, "body": {1: 2}}, "garbage"),  # not "wrong_version"
    ({"v": 1, "type": "heartbeat", "rank": 0, "seq": 0, "dropped": 0, "body": {"rank": 0, "time": {0.5: 1}, "step": 1}},
     "garbage"),
    ({"v": 1, "type": "heartbeat", "rank": 0, "seq": 0, "dropped": 0, "body": {"rank": 0, "time": "1", "step": 1}}, "invalid"),
])
def test_a_map_keyed_by_other_than_strings_is_garbage_whatever_else_is_wrong(raw: dict[Any, Any], category: str) -> None:
    with pytest.raises(ProtocolError) as refused:
        decode(msgpack.packb(raw, use_bin_type=True))
    assert refused.value.category == category


def test_a_refusal_names_the_message_and_its_field() -> None:
    raw = msgpack.unpackb(encode(STEP))
    del raw["body"]["tokens"]
    with pytest.raises(ProtocolError, match="^invalid: step: missing field 'tokens'$"):
        decode(msgpack.packb(raw, use_bin_type=True))
    raw = msgpack.unpackb(encode(STEP))
    raw["body"]["spans"][2][1] = math.inf
    with pytest.raises(ProtocolError, match=r"^invalid: step\.spans\[2\]\[1\]: Expected `float` < 1000000000000\.0$"):
        decode(msgpack.packb(raw, use_bin_type=True))
    raw = msgpack.unpackb(encode(SpanRequest(full=False)))
    raw["body"]["pinned_steps"] = list(range(65))
    with pytest.raises(ProtocolError, match="^invalid: span_request.pinned_steps: Expected `array` of length <= 64$"):
        decode(msgpack.packb(raw, use_bin_type=True))


def test_an_envelope_pickles_as_made() -> None:
    """The dashboard's receiver process hands decoded messages over a pipe."""
    envelope = decode(encode(STEP, seq=4, dropped=1))
    assert pickle.loads(pickle.dumps(envelope)) == envelope == Envelope(STEP, 1, 4, 1)
    assert isinstance(pickle.loads(pickle.dumps(envelope)).message, StepReport)
