"""``ddp``: PyTorch's own DistributedDataParallel, for reference."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, ClassVar

from torch.nn.parallel import DistributedDataParallel

from .base import DataParallelStrategy


class NativeDDP(DataParallelStrategy):
    """``torch.nn.parallel.DistributedDataParallel`` with ``bucket_cap_mb`` passed through.

    DDP broadcasts the state itself when it is built and averages inside backward, so
    ``finish_gradient_sync`` has nothing to do. Parameters that get no gradient in a step hang
    plain DDP; models that have them need ``find_unused_parameters=True`` (pass it to ``wrap``).
    The DDP object is kept out of the module tree, so dropping it on ``unwrap`` removes its hooks
    and the state dict keeps the bare model's keys under ``module.``.
    """

    name: ClassVar[str] = "ddp"

    def __init__(self, module: Any, *, find_unused_parameters: bool = False, **settings: Any) -> None:
        self._find_unused_parameters = find_unused_parameters
        super().__init__(module, **settings)

    def _broadcast_state(self) -> None:
        """DistributedDataParallel's constructor broadcasts rank 0's state."""

    def _attach(self) -> None:
        device = next(self.module.parameters()).device
        ddp = DistributedDataParallel(
            self.module,
            device_ids=[device.index] if device.type == "cuda" else None,
            process_group=self.process_group,
            bucket_cap_mb=self.bucket_mb,
            find_unused_parameters=self._find_unused_parameters,
        )
        object.__setattr__(self, "ddp", ddp)  # not a submodule: see the class docstring

    def _detach(self) -> None:
        object.__delattr__(self, "ddp")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def no_sync(self) -> AbstractContextManager[None]:
        return self.ddp.no_sync()
