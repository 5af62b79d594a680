"""Prove at the end of a run that every rank holds the same model.

Data parallelism is only correct while the replicas stay identical; a strategy bug shows up
as ranks that silently drift apart, so every run ends by comparing a digest of each rank's
parameters and buffers.
"""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn


def state_digest(module: nn.Module) -> str:
    """SHA-256 of every parameter's and buffer's bytes, in state-dict order."""
    digest = hashlib.sha256()
    for name, tensor in module.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def ranks_that_differ(digests: list[str]) -> list[int]:
    """Ranks whose digest is not rank 0's."""
    return [rank for rank, digest in enumerate(digests) if digest != digests[0]]


def gather_digests(module: nn.Module) -> list[str]:
    """Every rank's digest, on every rank (a collective)."""
    digests: list[str] = [""] * dist.get_world_size()
    dist.all_gather_object(digests, state_digest(module))
    return digests
