"""The nine data-parallel strategies, by the names users type.

Each strategy's module is imported when the strategy is first asked for (``strategy_class``):
``fsdp`` is built on FSDP2 and its custom comms (torch 2.9), the others on nothing newer than
DDP's own API, so a torch without FSDP2 still runs them and says in one line why not ``fsdp``.
"""

from __future__ import annotations

import importlib

import torch

from instrumented_ddp.strategies.base import DataParallelStrategy

#: Where each strategy lives, (module here, class), in ``kinds.STRATEGY_NAMES`` order.
STRATEGY_CLASSES: dict[str, tuple[str, str]] = {
    "simple": ("simple", "SimpleAllReduce"),
    "ga": ("simple", "GradientAccumulation"),
    "hook": ("hooks", "PerParameterHook"),
    "async": ("hooks", "AsyncPerParameterHook"),
    "bucket": ("bucket", "BucketedAsyncHook"),
    "ddp": ("native", "NativeDDP"),
    "zero1": ("zero1", "ShardedOptimizerState"),
    "zero2": ("zero2", "ShardedGradients"),
    "fsdp": ("fsdp", "FullyShardedFSDP2"),
}


def strategy_class(name: str) -> type[DataParallelStrategy]:
    """The class of the strategy called ``name`` (``KeyError`` for a name not in the table); an
    ``ImportError`` in one line, naming this torch, where it lacks what the strategy is built on."""
    module_name, class_name = STRATEGY_CLASSES[name]
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ImportError as error:
        raise ImportError(f"strategy {name!r} needs what torch {torch.__version__} lacks ({error}); "
                          "the other strategies and attach() run without it") from error
    return getattr(module, class_name)


__all__ = ["STRATEGY_CLASSES", "DataParallelStrategy", "strategy_class"]
