"""instrumented_ddp: nine data-parallel strategies behind one non-intrusive API.

    model = instrumented_ddp.wrap(model, strategy="bucket", bucket_mb=25)
    ...
    model = instrumented_ddp.unwrap(model)   # the bare model again, no hooks left

A loop ddpwatch did not write is watched with one line after its own DDP wrap:

    watch = instrumented_ddp.attach(ddp_model, optimizer, address="tcp://127.0.0.1:5555")

The strategies (and torch) load on first use, so ``ddpwatch`` can import
``instrumented_ddp.wire`` without importing torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from instrumented_ddp.wire.kinds import STRATEGY_NAMES

if TYPE_CHECKING:
    import torch
    from torch import nn

    from instrumented_ddp.attachment.attachment import Attachment
    from instrumented_ddp.attachment.disabled_watch import DisabledWatch
    from instrumented_ddp.strategies import DataParallelStrategy


def wrap(model: nn.Module, strategy: str, **settings: Any) -> DataParallelStrategy:
    """Wrap ``model`` in the named strategy; a collective every rank must call together."""
    from instrumented_ddp.strategies import strategy_class

    try:
        cls = strategy_class(strategy)
    except KeyError:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGY_NAMES)}") from None
    return cls(model, **settings)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare model, with every hook of its strategy removed (a bare model is returned as is)."""
    from instrumented_ddp.strategies import DataParallelStrategy

    return model.unwrap() if isinstance(model, DataParallelStrategy) else model


def attach(model: nn.Module, optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *,
           address: str | None = None, watch_key: str | None = None, total_steps: int = 0) -> Attachment | DisabledWatch:
    """Watch a user's own ``DistributedDataParallel`` loop (see ``instrumented_ddp.attachment.attachment``).
    The signature is ``attachment.attach``'s, spelled out (not ``**options``) so that a user's
    editor and type checker read it here, where the package loads torch only on first use.
    ``address`` and ``watch_key`` left None are read from ``DDPWATCH_ADDRESS`` and ``DDPWATCH_KEY``;
    ``DDPWATCH_DISABLE=1`` returns a watch that does nothing."""
    from instrumented_ddp.attachment.attachment import attach as attach_to

    return attach_to(model, optimizer, address=address, watch_key=watch_key, total_steps=total_steps)


def __getattr__(name: str) -> Any:
    if name == "DataParallelStrategy":
        from instrumented_ddp.strategies import DataParallelStrategy

        return DataParallelStrategy
    raise AttributeError(f"module 'instrumented_ddp' has no attribute {name!r}")


__all__ = ["STRATEGY_NAMES", "DataParallelStrategy", "attach", "unwrap", "wrap"]
