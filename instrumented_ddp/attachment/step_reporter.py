"""What the watch of an attached loop is told as each step ends, beside the step's report."""

from __future__ import annotations

from typing import Protocol

import torch.distributed as dist

from instrumented_ddp.publish.watch import Watch
from instrumented_ddp.resources.memory import HoldsTrainingState, MemorySampler
from instrumented_ddp.wire.messages import NOT_SWITCHABLE


class HasBucketLayout(Protocol):
    """The model's timing, as far as the hello is concerned (``DDPTiming``, ``FSDPTiming``)."""

    def bucket_layout(self) -> list[list[int]]: ...


class StepReporter:
    """At each step's end: the memory the rank holds (every few steps, as train.py measures), the
    hello's global batch (after the first step) and DDP's bucket layout (once DDP has rebuilt its
    buckets: which parameters each ``b<i>`` holds, which the advisor reads), the step's report
    released, and a refusal for any switch command that came (the loop is the user's)."""

    def __init__(self, watch: Watch, holder: HoldsTrainingState, timing: HasBucketLayout) -> None:
        self._watch, self._holder, self._timing = watch, holder, timing
        self._memory = MemorySampler()
        self._bucket_layout_sent = False

    def memory(self) -> dict[str, int] | None:
        """Bytes held by the model's parameters, gradients and optimizer state, on the steps
        sampled; None on the others, or where nothing is published."""
        return self._memory.sample(self._holder) if self._watch.publisher is not None else None

    def reported(self, step: int, samples: int) -> None:
        """Step ``step``, of ``samples`` samples on this rank, is on the timeline."""
        if step == 1 and self._watch.publisher is not None:
            self._watch.update_hello(global_batch=samples * dist.get_world_size())
        if not self._bucket_layout_sent and (layout := self._timing.bucket_layout()):
            self._watch.update_hello(bucket_layout=layout)
            self._bucket_layout_sent = True
        self._watch.step_done()
        self._watch.refuse_commands(NOT_SWITCHABLE)
