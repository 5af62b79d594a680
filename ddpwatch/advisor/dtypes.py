"""Bytes per element of the dtypes a parameter layout names (torch's names, less "torch."): the
hello carries each trainable parameter's numel and dtype, and the advisor works in bytes."""

from __future__ import annotations

ITEM_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
              "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1}
