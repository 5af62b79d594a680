"""Which gradients travel together: the ``bucket`` strategy's rule and DistributedDataParallel's.

Pure (no torch), so the strategy that buckets and the advisor that predicts other caps
(``ddpwatch.advisor.bucket_sim``) use one rule and cannot drift apart. Tensors are given by size and by
a key (device and dtype): a bucket never mixes keys.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

#: DDP's ``_DEFAULT_FIRST_BUCKET_BYTES`` (``kDefaultFirstBucketBytes`` in reducer.hpp): the cap of
#: its first bucket when ``bucket_cap_mb`` is left unset, so the first all-reduce starts early.
DDP_DEFAULT_FIRST_BUCKET_BYTES = 1024 * 1024


class TensorSize(NamedTuple):
    nbytes: int
    key: str = ""  # device and dtype: a change of key closes the bucket


def plan_bucket_strategy(tensors: Sequence[TensorSize], cap_bytes: int) -> list[list[int]]:
    """The ``bucket`` strategy's plan: indices into ``tensors`` (module order), taken in reverse
    (about the order backward produces gradients), a bucket closed *before* a tensor that would
    take it past ``cap_bytes`` (strictly) or that has another key. A tensor larger than the cap
    sits alone. The plan depends only on the model, so every rank builds the same one."""
    plan: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index in reversed(range(len(tensors))):
        size, key = tensors[index]
        if current and (tensors[current[0]].key != key or current_bytes + size > cap_bytes):
            plan.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
    if current:
        plan.append(current)
    return plan


def plan_ddp(tensors: Sequence[TensorSize], order: Sequence[int], cap_bytes: int, first_cap_bytes: int) -> list[list[int]]:
    """DistributedDataParallel's plan after it rebuilt its buckets (its second iteration on):
    ``compute_bucket_assignment_by_size`` over the tensors in ``order``, the order their gradients
    became ready in the first backward. One open bucket per key; a tensor is added, *then* the
    bucket closes once it holds at least its limit (so a bucket may pass the cap by its last
    tensor). Each key's first bucket has ``first_cap_bytes`` as its limit, the later ones
    ``cap_bytes``. Buckets still open at the end follow, in the order their keys first came.
    DDP sets ``first_cap_bytes`` to 1 MiB (``DDP_DEFAULT_FIRST_BUCKET_BYTES``) when
    ``bucket_cap_mb`` is not given, and to the cap when it is."""
    plan: list[list[int]] = []
    open_buckets: dict[str, tuple[list[int], int]] = {}
    closed_per_key: dict[str, int] = {}
    for index in order:
        size, key = tensors[index]
        members, held = open_buckets.get(key, ([], 0))
        members.append(index)
        held += size
        limit = first_cap_bytes if closed_per_key.get(key, 0) == 0 else cap_bytes
        if held >= limit:
            plan.append(members)
            closed_per_key[key] = closed_per_key.get(key, 0) + 1
            open_buckets[key] = ([], 0)
        else:
            open_buckets[key] = (members, held)
    plan.extend(members for members, _ in open_buckets.values() if members)
    return plan
