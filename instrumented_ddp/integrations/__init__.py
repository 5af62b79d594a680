"""ddpwatch inside other frameworks' loops: the Hugging Face ``Trainer`` callback."""

from instrumented_ddp.integrations.hf_trainer import DDPWatchCallback

__all__ = ["DDPWatchCallback"]
