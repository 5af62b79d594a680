"""What a W&B offline run wrote, read back from its ``run-<id>.wandb`` file: the file is W&B's
transaction log, a LevelDB-style log (32 KiB blocks of records, each a 7-byte header of CRC,
length and type; the CRC is zlib's CRC-32 of the type byte and the data) of ``wandb_internal_pb2.Record`` protobufs after a 7-byte ``:W&B`` header.
wandb 0.31 ships no reader of its own (``wandb sync`` reads it in Go), so the tests read it here."""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wandb.proto import wandb_internal_pb2

HEADER = b":W&B\xe1\xbe\x00"  # ident, magic 0xBEE1 (little-endian), version 0
BLOCK = 32768
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path: Path) -> Iterator[Any]:
    data = path.read_bytes()
    assert data[:len(HEADER)] == HEADER, data[:16]
    pos, pending = len(HEADER), b""
    while pos + 7 <= len(data):
        left = BLOCK - pos % BLOCK
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        checksum, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:
            pos += left
            continue
        payload = data[pos + 7:pos + 7 + length]
        assert zlib.crc32(bytes([kind]) + payload) == checksum, f"{path}: a record at byte {pos} fails its CRC"
        pos += 7 + length
        if kind == FULL:
            yield _record(payload)
        elif kind == FIRST:
            pending = payload
        elif kind == MIDDLE:
            pending += payload
        elif kind == LAST:
            yield _record(pending + payload)


def _record(payload: bytes) -> Any:
    record = wandb_internal_pb2.Record()  # type: ignore[attr-defined]  # protobuf's generated classes
    record.ParseFromString(payload)
    return record


def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


def history(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """Each ``run.log`` as (step, {key: value})."""
    rows = []
    for record in records(path):
        if record.WhichOneof("record_type") == "history":
            items = {_key(item): json.loads(item.value_json) for item in record.history.item}
            rows.append((record.history.step.num, {k: v for k, v in items.items() if not k.startswith("_")}))
    return rows


def updated(path: Path, kind: str) -> dict[str, Any]:
    """The run's ``summary`` or ``config`` as its last updates left it."""
    out: dict[str, Any] = {}
    for record in records(path):
        if record.WhichOneof("record_type") == kind:
            for item in getattr(record, kind).update:
                out[_key(item)] = json.loads(item.value_json)
    return out


def summary(path: Path) -> dict[str, Any]:
    return updated(path, "summary")


def run_config(path: Path) -> dict[str, Any]:
    return updated(path, "config")


def run_names(path: Path) -> tuple[str, str]:
    """(project, display name) as the run's records last said them (a name set after
    ``wandb.init`` comes as a later run record)."""
    runs = [record.run for record in records(path) if record.WhichOneof("record_type") == "run"]
    assert runs, f"{path} has no run record"
    return runs[0].project, next((run.display_name for run in reversed(runs) if run.display_name), "")
