"""ddpwatch inside other frameworks' loops: the Hugging Face ``Trainer`` callback
(``DDPWatchCallback``) and the PyTorch Lightning one (``DDPWatchLightningCallback``).

Each is imported when first asked for, with its framework: a Lightning run does not import
transformers, and the Trainer's callback works where Lightning (the ``lightning`` extra) is not
installed."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from instrumented_ddp.integrations.hf_trainer import DDPWatchCallback
    from instrumented_ddp.integrations.lightning import DDPWatchLightningCallback

__all__ = ["DDPWatchCallback", "DDPWatchLightningCallback"]


def __getattr__(name: str) -> Any:
    if name == "DDPWatchCallback":
        from instrumented_ddp.integrations.hf_trainer import DDPWatchCallback

        return DDPWatchCallback
    if name == "DDPWatchLightningCallback":
        from instrumented_ddp.integrations.lightning import DDPWatchLightningCallback

        return DDPWatchLightningCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
