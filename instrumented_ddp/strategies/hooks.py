"""``hook`` and ``async``: reduce each gradient from its post-accumulate-grad hook."""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from instrumented_ddp.strategies.base import DataParallelStrategy


class PerParameterHook(DataParallelStrategy):
    """A synchronous all-reduce inside each parameter's post-accumulate-grad hook.

    The hook blocks backward for the whole collective, so nothing overlaps: the timing layer
    must subtract that blocked time from backward. Like the blog's version it assumes
    every rank produces gradients for the same parameters in the same order (a static graph);
    a parameter that got no gradient on *every* rank is reduced as zeros in
    ``finish_gradient_sync``. A parameter used on some ranks only desynchronises the collectives:
    use ``bucket`` or ``ddp`` for such models.
    """

    name: ClassVar[str] = "hook"
    async_op: ClassVar[bool] = False

    def _attach(self) -> None:
        self._parameters_in_order = self.trainable_parameters()
        self._index_of = {id(p): i for i, p in enumerate(self._parameters_in_order)}
        self._pending: list[tuple[torch.Tensor, dist.Work | None]] = []  # (parameter, its all-reduce)
        self._reduced: set[int] = set()
        self._handles: list[RemovableHandle] = [
            p.register_post_accumulate_grad_hook(self._on_gradient_ready) for p in self._parameters_in_order
        ]

    def _detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _on_gradient_ready(self, parameter: torch.Tensor) -> None:
        if self._sync_enabled:
            self._reduce(parameter, ready=True)

    def _reduce(self, parameter: torch.Tensor, ready: bool = False) -> None:
        index = self._index_of[id(parameter)]
        work = self._all_reduce(self._gradient_or_zeros(parameter), tag=f"p{index}", async_op=self.async_op, marks_ready=ready)
        self._pending.append((parameter, work))
        self._reduced.add(index)

    def finish_gradient_sync(self) -> None:
        if not self._sync_enabled:
            return
        for index, parameter in enumerate(self._parameters_in_order):
            if index not in self._reduced:
                self._reduce(parameter)
        self._wait_all([work for _, work in self._pending])
        for reduced, _ in self._pending:
            gradient = reduced.grad
            assert gradient is not None, "_reduce gave it one (zeros where backward gave none)"
            gradient.div_(self.world_size)
        self._pending.clear()
        self._reduced.clear()


class AsyncPerParameterHook(PerParameterHook):
    """The same hooks with ``async_op=True``; every collective is waited before the optimizer."""

    name: ClassVar[str] = "async"
    async_op: ClassVar[bool] = True
