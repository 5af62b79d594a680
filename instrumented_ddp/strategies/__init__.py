"""The six data-parallel strategies, by the names users type."""

from __future__ import annotations

from .base import DataParallelStrategy
from .bucket import BucketedAsyncHook
from .hooks import AsyncPerParameterHook, PerParameterHook
from .native import NativeDDP
from .simple import GradientAccumulation, SimpleAllReduce

STRATEGIES: dict[str, type[DataParallelStrategy]] = {
    cls.name: cls
    for cls in (
        SimpleAllReduce,
        GradientAccumulation,
        PerParameterHook,
        AsyncPerParameterHook,
        BucketedAsyncHook,
        NativeDDP,
    )
}

__all__ = ["STRATEGIES", "DataParallelStrategy"]
