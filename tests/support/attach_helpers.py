"""What the attach tests share: a tiny classifier that returns a Hugging Face-style output with
its loss, the user's DDP and loop over it (nothing in them knows about ddpwatch), and attaching
for a block."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import instrumented_ddp
from instrumented_ddp.attachment.attachment import Attachment
from launch import free_port


class Output(dict):
    """What a Hugging Face model returns: a dict whose items are also attributes."""

    __getattr__ = dict.get


class TinyClassifier(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.body = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
        self.head = nn.Linear(16, 3)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, labels: torch.Tensor) -> Output:
        logits = self.head(self.body(self.embed(input_ids)).mean(dim=1))
        return Output(loss=nn.functional.cross_entropy(logits, labels), logits=logits)


def make_ddp(bucket_mb: float = 0.001) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    torch.manual_seed(0)
    ddp = DistributedDataParallel(TinyClassifier(), bucket_cap_mb=bucket_mb)
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3)


def batch(seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    mask = torch.ones(4, 6, dtype=torch.long)
    mask[0, 4:] = 0  # two padding positions: tokens are the mask's sum, 22
    return {"input_ids": torch.randint(0, 50, (4, 6), generator=generator), "attention_mask": mask,
            "labels": torch.randint(0, 3, (4,), generator=generator)}


def train(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, steps: int, grad_accum: int = 1,
          no_sync: bool = True) -> None:
    """The user's loop: nothing in it knows about ddpwatch. ``no_sync=False``: gradients are
    accumulated without DDP's ``no_sync``, so every micro-step's backward reduces them."""
    for step in range(steps):
        optimizer.zero_grad()
        for micro in range(grad_accum):
            with ddp.no_sync() if no_sync and micro < grad_accum - 1 else torch.enable_grad():
                (ddp(**batch(step * grad_accum + micro)).loss / grad_accum).backward()
        optimizer.step()


def untouched(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer, comm_hooks: int = 0) -> bool:
    return (not ddp._forward_hooks and not ddp._forward_pre_hooks and len(ddp._comm_hooks) == comm_hooks
            and not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks)


def attach_for_test(model: nn.Module, optimizer: Any) -> Attachment:
    watch = instrumented_ddp.attach(model, optimizer, address=f"tcp://127.0.0.1:{free_port()}")  # nobody listens
    assert isinstance(watch, Attachment), "DDPWATCH_DISABLE is set where the tests run"
    return watch


@contextmanager
def attached(model: nn.Module, optimizer: Any) -> Iterator[Attachment]:
    """Attached for the block, detached after it whatever happens."""
    watch = attach_for_test(model, optimizer)
    try:
        yield watch
    finally:
        watch.detach()


def two_optimizers(ddp: DistributedDataParallel) -> tuple[torch.optim.Optimizer, torch.optim.Optimizer]:
    """SGD with momentum over the body, AdamW over the head: two optimizers over one model."""
    head = list(ddp.module.head.parameters())
    body = [p for p in ddp.parameters() if all(p is not h for h in head)]
    return torch.optim.SGD(body, lr=0.1, momentum=0.9), torch.optim.AdamW(head, lr=1e-3)


def sharded_classifier(root: bool = True) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The classifier sharded with FSDP2 as a user does it: each part, then (``root``) the whole."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = TinyClassifier()
    for part in (model.embed, model.body, model.head):
        fully_shard(part)
    if root:
        fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)
