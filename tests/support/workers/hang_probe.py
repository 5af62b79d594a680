"""A user's own DDP loop, attached, that can be made to stall: run on gloo ranks started as torchrun
starts them. ``--sleep-rank R --sleep-step S --sleep-s T``: rank R sleeps T s after its forward of
step S, before its backward, while the others wait in DDP's first bucket (a rank "behind").
``--extra-all-reduce-rank R --extra-step S``: rank R issues one all-reduce of its own before its
backward of step S that the others never issue (a "desync"; ``--extra-group side``: on a group
of every rank that only R uses, so that gloo waits instead of failing on the sizes).
``--slow-step S --slow-s T``: every rank all-reduces its loss over a slow link at step S, which
completes T s late (every rank "in_collective"). ``--pause-s T``: every rank spends T s in a
marked pause after step 5, an evaluation; ``--compile-step S``: every rank compiles a function
in step S, for seconds (neither is a stall)."""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import instrumented_ddp
from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed
from slow_link import slow_link_group

COMPILED_OPS = 400  # about 7 s to trace, two ranks at once on the two-core CI machine


def long_to_compile(x: torch.Tensor) -> torch.Tensor:
    """Seconds for dynamo to trace: a compiling step far longer than the stall threshold."""
    for i in range(COMPILED_OPS):
        x = torch.sin(x) * 1.01 + i
    return x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--sleep-rank", type=int, default=-1)
    parser.add_argument("--sleep-step", type=int, default=20)
    parser.add_argument("--sleep-s", type=float, default=0.0)
    parser.add_argument("--extra-all-reduce-rank", type=int, default=-1)
    parser.add_argument("--extra-step", type=int, default=20)
    parser.add_argument("--extra-group", choices=("default", "side"), default="default")
    parser.add_argument("--slow-step", type=int, default=-1)
    parser.add_argument("--slow-s", type=float, default=0.0)
    parser.add_argument("--pause-s", type=float, default=0.0)
    parser.add_argument("--compile-step", type=int, default=-1)
    args = parser.parse_args()
    context = init_distributed("cpu")
    torch.manual_seed(context.rank)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 1))
    ddp = DistributedDataParallel(model, bucket_cap_mb=1)
    side = dist.new_group() if args.extra_group == "side" else None  # every rank makes it; one uses it
    slow = slow_link_group() if args.slow_step > 0 else None
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01)
    watch = instrumented_ddp.attach(ddp, optimizer, address=args.address, total_steps=args.steps)
    for step in range(1, args.steps + 1):
        loss = ddp(torch.randn(16, 32)).square().mean()
        if context.rank == args.sleep_rank and step == args.sleep_step:
            time.sleep(args.sleep_s)  # the line a stall's stack must name
        if context.rank == args.extra_all_reduce_rank and step == args.extra_step:
            dist.all_reduce(torch.ones(1), group=side)  # one the other ranks never issue
        if step == args.compile_step:
            began = time.perf_counter()
            torch.compile(long_to_compile, backend="aot_eager", dynamic=False)(torch.randn(8))
            print(f"compiling took {time.perf_counter() - began:.1f} s", flush=True)
        if slow is not None and step == args.slow_step:
            slow.delay_s = args.slow_s
            dist.all_reduce(loss.detach().clone(), group=slow)  # every rank held in it
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
