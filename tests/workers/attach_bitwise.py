"""Plain DDP and the same DDP with ddpwatch attached, trained side by side on this rank's data,
with gradients copied into DDP's buckets and with gradients as views of them; prints for each
whether every parameter ended bit for bit the same on every rank (rank 0)."""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import instrumented_ddp
from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    args = parser.parse_args()
    context = init_distributed("cpu")
    for view in (False, True):
        same = train_side_by_side(view, args.address, context.rank)
        agreed = torch.tensor([int(same)])
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
        if context.is_main:
            print(f"gradient_as_bucket_view={view}: bitwise equal on every rank: {bool(agreed.item())}")
    shutdown_distributed()
    exit_process(0)


def train_side_by_side(view: bool, address: str, rank: int) -> bool:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    pair = {mode: DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.01,
                                          gradient_as_bucket_view=view) for mode in ("plain", "watched")}
    optimizers = {mode: torch.optim.SGD(pair[mode].parameters(), lr=0.1) for mode in pair}
    watch = instrumented_ddp.attach(pair["watched"], optimizers["watched"], address=address)
    data = torch.Generator().manual_seed(1 + rank)
    for _ in range(4):
        x, y = torch.randn(16, 32, generator=data), torch.randint(0, 3, (16,), generator=data)
        for mode in pair:
            nn.functional.cross_entropy(pair[mode](x), y).backward()
            optimizers[mode].step()
            optimizers[mode].zero_grad(set_to_none=not view)  # views stay views
    watch.detach()
    return all(torch.equal(a, b) for a, b in zip(pair["plain"].parameters(), pair["watched"].parameters()))


if __name__ == "__main__":
    main()
