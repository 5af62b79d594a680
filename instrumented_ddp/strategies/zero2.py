"""``zero2``: ``zero1`` with the gradients sharded too (ZeRO stage 2)."""

from __future__ import annotations

from typing import ClassVar

import torch

from instrumented_ddp.strategies.bucket import GradientBucket
from instrumented_ddp.strategies.zero1 import ShardedOptimizerState


class ShardedGradients(ShardedOptimizerState):
    """Each bucket is reduce-scattered instead of all-reduced, as soon as its gradients are
    ready in backward (overlapped, as in ``bucket``): a rank receives only the sum of its own
    slice, half the traffic of an all-reduce, and releases the bucket's full gradients once
    the slice has arrived, so between steps it holds 1/N of the gradients. During backward a
    bucket's full buffer exists from its first ready gradient until its reduce-scatter is seen
    done: each later gradient's hook looks (``_settle_completed_buckets``), so backward holds only
    the full buffers of the buckets still in flight; waiting for the end of backward would hold
    all of them at once, the bytes ``zero1`` keeps for good. gloo's reduce-scatter never reads
    completed (torch 2.13), so there every bucket still waits for the end of backward.
    A parameter that got no gradient is reduced as zeros, as in ``bucket``.
    """

    name: ClassVar[str] = "zero2"

    def _attach(self) -> None:
        super()._attach()
        self.gradient_shards = [torch.zeros_like(shard.shard) for shard in self.shards]
        for bucket in self.buckets:
            bucket.release()

    def _launch(self, bucket: GradientBucket) -> None:
        bucket.work = self._collective("reduce_scatter", bucket.allocated_buffer, output=self.gradient_shards[bucket.index],
                                       tag=f"b{bucket.index}", async_op=True)
        self._next_to_launch += 1

    def _launch_ready_buckets(self) -> None:
        super()._launch_ready_buckets()
        self._settle_completed_buckets()

    def _settle_completed_buckets(self) -> None:
        """Settle, oldest first, the launched buckets whose reduce-scatter has completed: a look
        (``Work.is_completed``: on NCCL an event query, no device sync), never a wait. The
        ``wait()`` that follows returns at once; gloo copies the slice into the shard there, and
        on NCCL it orders the division after the collective on the current stream and lets go of
        the input NCCL keeps for the allocator (``WorkNCCL::synchronizeStream`` unstashes it), so
        the buffer's memory is free though a timeline still holds the work until its step resolves."""
        while self._next_to_settle < self._next_to_launch:
            bucket = self.buckets[self._next_to_settle]
            work = bucket.work
            assert work is not None, "a launched bucket holds its reduce-scatter's work"
            if not work.is_completed():
                return
            work.wait()
            self._settle(bucket)
            self._next_to_settle += 1

    def _average(self, bucket: GradientBucket) -> None:
        self.gradient_shards[bucket.index].div_(self.world_size)
        bucket.release()

    def _point_shard_gradients(self) -> None:
        for shard, gradient in zip(self.shards, self.gradient_shards, strict=True):
            shard.shard.grad = gradient

    def _zero_full_gradients(self) -> None:
        """Released when their slices arrived: there is nothing left to zero."""
