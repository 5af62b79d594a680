"""
A plain FSDP2 loop (``fully_shard``), watched by ddpwatch with one added line (``instrumented_ddp.attach``).

    ddpwatch &                                                   # the dashboard, listening
    torchrun --nproc_per_node=2 examples/plain_fsdp.py           # CPU (gloo) or one GPU per rank (NCCL)
    torchrun --nproc_per_node=2 examples/plain_fsdp.py --grad-accum 4
    torchrun --nproc_per_node=4 examples/plain_fsdp.py --replicas 2   # HSDP: 2 replicas of 2 shards

``plain_ddp.py``'s model and loop, sharded instead of replicated: each hidden block a unit, then
the root (the head), as FSDP2 wants. The dashboard shows each unit's all-gather before its forward
and again before its backward, its reduce-scatter as backward leaves it, and what a rank holds
(the memory column: a shard of the parameters, gradients and optimizer state). With ``--replicas``
the mesh is 2-D (HSDP): sharded within a replica, and after each unit's reduce-scatter its shard
all-reduced across the replicas.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import instrumented_ddp
from instrumented_ddp.distributed import exit_process
from instrumented_ddp.wire.output_paths import outputs_problem
from instrumented_ddp.wire.endpoints import DEFAULT_ADDRESS


class ToyModel(nn.Module):
    """``plain_ddp.py``'s, its hidden layers as blocks FSDP can shard one by one."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(10, width), nn.ReLU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def main() -> None:
    parser = argparse.ArgumentParser(description="A plain FSDP2 loop, watched by ddpwatch")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank, per micro-step")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (no gradient sync before the last)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--replicas", type=int, default=1,
                        help="HSDP: replicas of each shard (the world size must be a multiple); 1 shards over every rank")
    parser.add_argument("--watch", default=DEFAULT_ADDRESS, metavar="ADDRESS", help="where ddpwatch listens")
    parser.add_argument("--no-watch", action="store_true", help="the same loop without attach")
    parser.add_argument("--profile", default=None, metavar="DIR", help="torch.profiler traces of steps 4-8, one per rank")
    args = parser.parse_args()
    for flag in ("steps", "batch_size", "grad_accum", "width", "layers", "replicas"):  # one line, exit 2, before any process group, as train.py
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
    if problem := outputs_problem(args.profile):  # else a traceback at step 8
        parser.error(problem)

    on_gpu = torch.cuda.is_available()
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank = dist.get_rank()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)
    world = dist.get_world_size()
    if args.replicas < 1 or world % args.replicas:
        parser.error(f"--replicas {args.replicas}: the world size, {world}, must be a multiple of it")
    mesh = None  # FSDP's default: one dimension, every rank (a 1 x N mesh would all-reduce across 1 replica)
    if args.replicas > 1:
        mesh = init_device_mesh(device.type, (args.replicas, world // args.replicas), mesh_dim_names=("replicate", "shard"))

    torch.manual_seed(0)
    model = ToyModel(args.width, args.layers).to(device)
    for block in [model.stem, *model.blocks]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the root: the head, and the last word on when to reshard
    loss_fn = nn.MSELoss()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    watch = None if args.no_watch else instrumented_ddp.attach(model, optimizer, address=args.watch, total_steps=args.steps)  # <- ddpwatch

    data = torch.Generator().manual_seed(1 + rank)
    profiler = None
    if args.profile:  # what bench/attach_check.py holds ddpwatch's figures against, as plain_ddp.py's
        profiler = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=2, warmup=1, active=5, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(args.profile, worker_name=f"rank{rank}"))
        profiler.start()
    for _ in range(args.steps):
        optimizer.zero_grad()
        for micro in range(args.grad_accum):
            inputs = torch.randn(args.batch_size, 10, generator=data).to(device)
            labels = torch.randn(args.batch_size, 5, generator=data).to(device)
            model.set_requires_gradient_sync(micro == args.grad_accum - 1)  # reduce-scatter on the last micro-step only
            loss = loss_fn(model(inputs), labels) / args.grad_accum
            if watch is not None:
                watch.record_loss(loss * args.grad_accum)  # <- optional: the dashboard's Loss tab
            loss.backward()
        optimizer.step()
        if profiler is not None:
            profiler.step()
    if profiler is not None:
        profiler.stop()

    if watch is not None:
        watch.detach()  # <- ddpwatch: goodbye now (the end of the process would send it too)
    dist.barrier()
    dist.destroy_process_group()
    exit_process(0)  # skips a gloo teardown race at interpreter exit (see instrumented_ddp.distributed)


if __name__ == "__main__":
    main()
