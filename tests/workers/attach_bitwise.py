"""Plain DDP and the same DDP with ddpwatch attached, trained side by side on this rank's data,
with gradients copied into DDP's buckets, with gradients as views of them, and with
``static_graph=True``; prints for each whether every parameter ended bit for bit the same on
every rank, and which steps the attached run excluded with how many all-reduces each (rank 0)."""

from __future__ import annotations

import argparse
import copy
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import instrumented_ddp
from instrumented_ddp.protocol import StepReport
from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    args = parser.parse_args()
    context = init_distributed("cpu")
    for option in ({"gradient_as_bucket_view": False}, {"gradient_as_bucket_view": True}, {"static_graph": True}):
        same, reports = train_side_by_side(option, args.address, context.rank)
        agreed = torch.tensor([int(same)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if context.is_main:
            (name, value), = option.items()
            print(f"{name}={value}: bitwise equal on every rank: {bool(agreed.item())}")
            print(f"{name}={value}: excluded {[r.excluded for r in reports]}, "
                  f"all-reduces {[sum(s.kind == 'all_reduce' for s in r.spans) for r in reports]}")
    shutdown_distributed()
    exit_process(0)


def train_side_by_side(option: dict[str, bool], address: str, rank: int) -> tuple[bool, list[StepReport]]:
    """``static_graph``: DDP's first iteration reduces every bucket from an end-of-backward
    callback and waits for them in that same call (the attached run hung there)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    pair = {mode: DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.01, **option) for mode in ("plain", "watched")}
    optimizers = {mode: torch.optim.SGD(pair[mode].parameters(), lr=0.1) for mode in pair}
    watch = instrumented_ddp.attach(pair["watched"], optimizers["watched"], address=address)
    sent: list[Any] = []
    watch.publisher.publish = sent.append  # nobody listens: the reports are read here
    view = option.get("gradient_as_bucket_view", False)
    data = torch.Generator().manual_seed(1 + rank)
    for _ in range(4):
        x, y = torch.randn(16, 32, generator=data), torch.randint(0, 3, (16,), generator=data)
        for mode in pair:
            nn.functional.cross_entropy(pair[mode](x), y).backward()
            optimizers[mode].step()
            optimizers[mode].zero_grad(set_to_none=not view)  # views stay views
    watch.detach()
    same = all(torch.equal(a, b) for a, b in zip(pair["plain"].parameters(), pair["watched"].parameters()))
    return same, [m for m in sent if isinstance(m, StepReport)]


if __name__ == "__main__":
    main()
