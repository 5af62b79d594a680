"""Two same-shaped branches whose backward order depends on the rank, so post-accumulate-grad
hooks fire in a different order on each rank; records that order and the trained parameters."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import nn

import instrumented_ddp
from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed


class TwoBranches(nn.Module):
    def __init__(self, first_branch: str = "a") -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.first_branch = first_branch

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Autograd runs the most recently created node first, so the branch computed second
        # gets its gradients first.
        if self.first_branch == "a":
            y_a = self.a(x)
            y_b = self.b(x)
        else:
            y_b = self.b(x)
            y_a = self.a(x)
        return (y_a * 1.5 + y_b * 0.5).pow(2).mean()


def batches(rank: int, world_size: int, steps: int = 3, global_rows: int = 8) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(99)
    rows = global_rows // world_size
    return [torch.randn(global_rows, 16, generator=generator)[rank * rows : (rank + 1) * rows] for _ in range(steps)]


def train(model: nn.Module, inputs: list[torch.Tensor]) -> None:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in inputs:
        model(x).backward()
        if isinstance(model, instrumented_ddp.DataParallelStrategy):
            model.finish_gradient_sync()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--strategy", required=True)
    args = parser.parse_args()
    context = init_distributed("cpu")
    torch.manual_seed(0)
    bare = TwoBranches(first_branch="a" if context.rank == 0 else "b")
    order: list[str] = []
    for name, parameter in bare.named_parameters():
        parameter.register_post_accumulate_grad_hook(lambda _p, name=name: order.append(name))
    model = instrumented_ddp.wrap(bare, args.strategy, bucket_mb=16 * 16 * 4 / 2**20)  # one weight a bucket
    train(model, batches(context.rank, context.world_size))
    state = {k: v.clone() for k, v in instrumented_ddp.unwrap(model).state_dict().items()}
    torch.save({"order": order[:4], "state": state}, args.out.with_suffix(f".rank{context.rank}.pt"))
    shutdown_distributed()


if __name__ == "__main__":
    main()
    exit_process(0)
