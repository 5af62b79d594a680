"""``attach``: watching a training loop ddpwatch did not write, one line after the user's own wrap."""

from instrumented_ddp.attachment.attachment import NOT_SWITCHABLE, AttachError, Attachment, attach

__all__ = ["NOT_SWITCHABLE", "AttachError", "Attachment", "attach"]
