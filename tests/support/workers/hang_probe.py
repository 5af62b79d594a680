"""A user's own DDP loop, attached, that can be made to stall: run on gloo ranks started as torchrun
starts them. ``--sleep-rank R --sleep-step S --sleep-s T``: rank R sleeps T s after its forward of
step S, before its backward, while the others wait in DDP's first bucket (a rank "behind").
``--extra-all-reduce-rank R --extra-step S``: rank R issues one all-reduce of its own before its
backward of step S that the others never issue (a "desync"). ``--pause-s T``: every rank spends T s
in a marked pause after step 5, an evaluation (no stall)."""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import instrumented_ddp
from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sleep-rank", type=int, default=-1)
    parser.add_argument("--sleep-step", type=int, default=20)
    parser.add_argument("--sleep-s", type=float, default=0.0)
    parser.add_argument("--extra-all-reduce-rank", type=int, default=-1)
    parser.add_argument("--extra-step", type=int, default=20)
    parser.add_argument("--pause-s", type=float, default=0.0)
    args = parser.parse_args()
    context = init_distributed("cpu")
    torch.manual_seed(context.rank)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
    ddp = DistributedDataParallel(model, bucket_cap_mb=1)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    watch = instrumented_ddp.attach(ddp, optimizer, address=args.address, total_steps=args.steps)
    for step in range(1, args.steps + 1):
        loss = ddp(torch.randn(16, 32)).square().mean()
        if context.rank == args.sleep_rank and step == args.sleep_step:
            time.sleep(args.sleep_s)  # the line a stall's stack must name
        if context.rank == args.extra_all_reduce_rank and step == args.extra_step:
            dist.all_reduce(torch.ones(1))  # one the other ranks never issue
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step == 5 and args.pause_s:
            with watch.paused("evaluate"):
                time.sleep(args.pause_s)
        print(f"step {step} done", flush=True)
    watch.detach()
    shutdown_distributed()
    exit_process(0)


if __name__ == "__main__":
    main()
