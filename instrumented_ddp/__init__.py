"""instrumented_ddp: six data-parallel strategies behind one non-intrusive API.

    model = instrumented_ddp.wrap(model, strategy="bucket", bucket_mb=25)
    ...
    model = instrumented_ddp.unwrap(model)   # the bare model again, no hooks left
"""

from __future__ import annotations

from typing import Any

from torch import nn

from .strategies import STRATEGIES, DataParallelStrategy

STRATEGY_NAMES: tuple[str, ...] = tuple(STRATEGIES)


def wrap(model: nn.Module, strategy: str, **settings: Any) -> DataParallelStrategy:
    """Wrap ``model`` in the named strategy; a collective every rank must call together."""
    try:
        cls = STRATEGIES[strategy]
    except KeyError:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGY_NAMES)}") from None
    return cls(model, **settings)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model, with every hook of its strategy removed (a bare model is returned as is)."""
    return model.unwrap() if isinstance(model, DataParallelStrategy) else model


__all__ = ["STRATEGY_NAMES", "DataParallelStrategy", "unwrap", "wrap"]
