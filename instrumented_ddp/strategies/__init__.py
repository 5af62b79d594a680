"""The nine data-parallel strategies, by the names users type."""

from __future__ import annotations

from .base import DataParallelStrategy
from .bucket import BucketedAsyncHook
from .fsdp import FullyShardedFSDP2
from .hooks import AsyncPerParameterHook, PerParameterHook
from .native import NativeDDP
from .simple import GradientAccumulation, SimpleAllReduce
from .zero1 import ShardedOptimizerState
from .zero2 import ShardedGradients

STRATEGIES: dict[str, type[DataParallelStrategy]] = {
    cls.name: cls
    for cls in (
        SimpleAllReduce,
        GradientAccumulation,
        PerParameterHook,
        AsyncPerParameterHook,
        BucketedAsyncHook,
        NativeDDP,
        ShardedOptimizerState,
        ShardedGradients,
        FullyShardedFSDP2,
    )
}

__all__ = ["STRATEGIES", "DataParallelStrategy"]
