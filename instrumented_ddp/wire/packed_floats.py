"""Durations and bandwidths as they travel in a summary: packed little-endian float64.

Packed, a rank's figures arrive bit for bit as it computed them, and a listener keeps a large
job's durations as C doubles without making a Python float of each.
"""

from __future__ import annotations

import math
import sys
from array import array
from collections.abc import Iterable


def pack_floats(values: Iterable[float]) -> bytes:
    """Little-endian float64, whatever the host's byte order."""
    packed = array("d", values)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_floats(data: bytes) -> array[float]:
    """``pack_floats`` undone, as C doubles. ``data``'s length must be a multiple of 8."""
    values = array("d", data)
    if sys.byteorder == "big":
        values.byteswap()
    return values


def all_non_negative_and_finite(packed: bytes) -> bool:
    """Whether every float64 in ``packed`` (whole ones: the caller checks the length) is
    non-negative and their sum finite: no NaN or infinity, nor values so large they overflow it.
    A listener checks a thousand summaries a second at 1,024 ranks, so the loops run in C."""
    return _plainly_valid(packed) or (min(floats := unpack_floats(packed)) >= 0 and math.isfinite(sum(floats)))


def all_finite(packed: bytes) -> bool:
    """Whether every float64 in ``packed`` (whole ones) is finite, of either sign."""
    return _plainly_valid(packed) or math.isfinite(sum(map(abs, unpack_floats(packed))))


def _plainly_valid(packed: bytes) -> bool:
    """Every little-endian float64 in ``packed`` has its top byte under 0x7F: sign bit clear and
    exponent under 0x7F0, so each is non-negative and finite (below 2**1009). False sends the
    bytes to the exact check, which also takes -0.0 and huge finite values."""
    return not packed or max(packed[7::8]) < 0x7F
