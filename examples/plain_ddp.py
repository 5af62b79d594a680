"""
PyTorch's DDP tutorial loop, watched by ddpwatch with one added line (``instrumented_ddp.attach``).

    ddpwatch &                                                   # the dashboard, listening
    torchrun --nproc_per_node=2 examples/plain_ddp.py            # CPU (gloo) or one GPU per rank (NCCL)
    torchrun --nproc_per_node=2 examples/plain_ddp.py --grad-accum 4 --bucket-mb 1
    torchrun --nproc_per_node=2 examples/plain_ddp.py --compile inductor   # torch.compile(ddp_model)
    torchrun --nproc_per_node=2 examples/plain_ddp.py --eval-every 50      # evaluations marked as pauses
    torchrun --nproc_per_node=2 examples/plain_ddp.py --comm-hook fp16     # DDP's gradient compression hook
    torchrun --nproc_per_node=2 examples/plain_ddp.py --zero               # ZeRO-1: PyTorch's ZeroRedundancyOptimizer
    torchrun --nproc_per_node=2 examples/plain_ddp.py --ema 0.999          # an average of the weights, marked as compute
    torchrun --nproc_per_node=2 examples/plain_ddp.py --experts            # a mixture of experts' all-to-alls in the forward

The model is the tutorial's ToyModel made deeper (``--layers``) so that DDP has several buckets
to show; the data is random, the same on every run. Everything but the ``attach`` and ``detach``
lines (and the optional ``record_loss`` and ``record_evaluation``, for the Loss tab, ``paused``,
around an evaluation, and ``computing``, around the average of the weights) is the loop you already have.
"""

from __future__ import annotations

import argparse
import os
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.nn.parallel import DistributedDataParallel as DDP

import instrumented_ddp
from instrumented_ddp.distributed import exit_process
from instrumented_ddp.wire.output_paths import outputs_problem
from instrumented_ddp.wire.messages import bucket_mb_problem
from instrumented_ddp.wire.endpoints import DEFAULT_ADDRESS


#: DDP's communication hooks that ``--comm-hook`` registers (gradient compression), each watched as it is.
COMM_HOOKS = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook,
              "powersgd": powerSGD_hook.powerSGD_hook}


class AllToAll(torch.autograd.Function):
    """An equal share of a rank's tokens to every rank, as a mixture of experts dispatches them
    (and combines them back): ``dist.all_to_all_single`` forward and, for the gradients, backward,
    as Megatron's and DeepSpeed's expert layers write it."""

    @staticmethod
    def forward(ctx: Any, tokens: torch.Tensor) -> torch.Tensor:
        exchanged = torch.empty_like(tokens)
        dist.all_to_all_single(exchanged, tokens.contiguous())
        return exchanged

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> torch.Tensor:
        exchanged = torch.empty_like(gradient)
        dist.all_to_all_single(exchanged, gradient.contiguous())
        return exchanged


class ExpertExchange(nn.Module):
    """A layer reached through a mixture of experts' communication, with uniform routing: its
    tokens are dispatched to every rank, computed, and combined back, two all-to-alls in the
    forward and two in the backward. The layer here is replicated and averaged by DDP like the
    rest, where a real expert layer keeps each rank's own experts: the traffic is what it shows."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return AllToAll.apply(self.layer(AllToAll.apply(tokens)))


class ToyModel(nn.Module):
    def __init__(self, width: int, layers: int, experts: bool = False) -> None:
        super().__init__()
        hidden = (ExpertExchange(nn.Linear(width, width)) if experts else nn.Linear(width, width) for _ in range(layers))
        self.net = nn.Sequential(nn.Linear(10, width), nn.ReLU(), *(m for layer in hidden for m in (layer, nn.ReLU())))
        self.head = nn.Linear(width, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))


def comm_hook_problem(hook: str | None, on_gpu: bool, bucket_mb: float, model: nn.Module) -> str | None:
    """Why ``--comm-hook`` cannot run here: the bf16 hook needs NCCL; on gloo PowerSGD issues a
    bucket's later all-reduces from completion callbacks on gloo's threads, in no fixed order
    across ranks once there are two buckets (gloo aborts: a collective mismatch)."""
    if hook == "bf16" and not on_gpu:
        return "--comm-hook bf16: DDP's bf16_compress_hook needs NCCL (CUDA GPUs); on the CPU use fp16"
    gradient_mb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    if hook == "powersgd" and not on_gpu and bucket_mb < gradient_mb:
        return (f"--comm-hook powersgd on gloo needs every gradient in one bucket ({gradient_mb:.2f} MB here): "
                f"a --bucket-mb of {bucket_mb:g} makes several, whose collectives PowerSGD issues in no fixed order")
    return None


def evaluate(model: nn.Module, loss_fn: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """The mean loss over held-out batches, averaged over the ranks."""
    model.eval()
    with torch.no_grad():
        total = sum(loss_fn(model(inputs), labels) for inputs, labels in batches) / len(batches)
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    model.train()
    return total.item() / dist.get_world_size()


def main() -> None:
    parser = argparse.ArgumentParser(description="PyTorch's DDP tutorial loop, watched by ddpwatch")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank, per micro-step")
    parser.add_argument("--grad-accum", type=int, default=1, help="micro-steps per optimizer step (no_sync before the last)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    parser.add_argument("--comm-hook", choices=sorted(COMM_HOOKS), default=None,
                        help="register this DDP communication hook before attach (bf16: NCCL only; PowerSGD: rank 1, "
                             "compressing from step 4, so that --profile's steps 4-8 are compressed ones; on gloo with every gradient in one bucket)")
    parser.add_argument("--experts", action="store_true",
                        help="reach each hidden layer through a mixture of experts' all-to-alls (dispatch, combine: uniform "
                             "routing), which ddpwatch times inside the forward; --batch-size must divide by the ranks")
    parser.add_argument("--zero", action="store_true",
                        help="shard the optimizer with PyTorch's ZeroRedundancyOptimizer (ZeRO-1 over the same SGD): "
                             "each step then broadcasts every rank's updated parameters")
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="evaluate 8 held-out batches every N optimizer steps, marked as a pause of training (default 0: never)")
    parser.add_argument("--ema", type=float, default=0.0, metavar="DECAY",
                        help="keep an exponential moving average of the weights, updated after each step, marked as "
                             "the loop's own compute (default 0: none)")
    parser.add_argument("--watch", default=DEFAULT_ADDRESS, metavar="ADDRESS", help="where ddpwatch listens")
    parser.add_argument("--no-watch", action="store_true", help="the same loop without attach")
    parser.add_argument("--save-final", default=None, metavar="FILE", help="rank 0 saves the final parameters here")
    parser.add_argument("--profile", default=None, metavar="DIR", help="torch.profiler traces of steps 4-8, one per rank")
    parser.add_argument("--compile", default=None, metavar="BACKEND",
                        help="torch.compile the DDP model with this backend (inductor on a GPU; aot_eager needs no compiler)")
    args = parser.parse_args()
    for flag in ("steps", "batch_size", "grad_accum", "width", "layers"):  # one line, exit 2, before any process group, as train.py
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
    if not 0 <= args.ema < 1:
        parser.error(f"--ema must be a decay in [0, 1) (0: no average), not {args.ema}")
    if args.eval_every < 0:
        parser.error(f"--eval-every must be 0 (never) or more, not {args.eval_every}")
    if problem := bucket_mb_problem(args.bucket_mb, "--bucket-mb"):  # inf went on into DDP's traceback
        parser.error(problem)
    if problem := outputs_problem(args.profile, args.save_final):  # else a traceback at step 8 or after the last step
        parser.error(problem)
    if args.compile and args.compile not in torch._dynamo.list_backends(exclude_tags=()):  # else Dynamo's traceback at step 1
        parser.error(f"--compile {args.compile}: torch.compile has no such backend (inductor, aot_eager, ...: "
                     "torch._dynamo.list_backends(exclude_tags=()) lists them)")

    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if args.experts and args.batch_size % ranks:  # else each rank's all_to_all_single error at the first forward
        parser.error(f"--experts sends every rank an equal share of each batch: --batch-size {args.batch_size} does not "
                     f"divide by {ranks} ranks")
    on_gpu = torch.cuda.is_available()
    if problem := comm_hook_problem(args.comm_hook, on_gpu, args.bucket_mb, ToyModel(args.width, args.layers)):
        parser.error(problem)  # else each rank's traceback, or gloo's abort on mismatched collectives
    dist.init_process_group("nccl" if on_gpu else "gloo")
    rank = dist.get_rank()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank % torch.cuda.device_count()) if on_gpu else torch.device("cpu")
    if on_gpu:
        torch.cuda.set_device(device)

    torch.manual_seed(0)
    model = ToyModel(args.width, args.layers, args.experts).to(device)
    ddp_model = DDP(model, device_ids=[device.index] if on_gpu else None, bucket_cap_mb=args.bucket_mb)
    if args.comm_hook == "powersgd":
        ddp_model.register_comm_hook(powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=3),
                                     powerSGD_hook.powerSGD_hook)
    elif args.comm_hook:
        ddp_model.register_comm_hook(None, COMM_HOOKS[args.comm_hook])
    if args.compile:  # attach takes the compiled module: the steps in which Dynamo compiles are marked and left out
        ddp_model = torch.compile(ddp_model, backend=args.compile)
    loss_fn = nn.MSELoss()
    if args.zero:
        optimizer = ZeroRedundancyOptimizer(ddp_model.parameters(), optimizer_class=torch.optim.SGD, lr=0.001)
    else:
        optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(args.ema)) if args.ema else None
    watch = None if args.no_watch else instrumented_ddp.attach(ddp_model, optimizer, address=args.watch, total_steps=args.steps)  # <- ddpwatch

    data = torch.Generator().manual_seed(1 + rank)
    held_out_data = torch.Generator().manual_seed(1000 + rank)
    held_out = [(torch.randn(args.batch_size, 10, generator=held_out_data).to(device),
                 torch.randn(args.batch_size, 5, generator=held_out_data).to(device)) for _ in range(8 if args.eval_every else 0)]
    profiler = None
    if args.profile:
        profiler = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=2, warmup=1, active=5, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(args.profile, worker_name=f"rank{rank}"))
        profiler.start()
    for step in range(args.steps):
        optimizer.zero_grad()
        for micro in range(args.grad_accum):
            inputs = torch.randn(args.batch_size, 10, generator=data).to(device)
            labels = torch.randn(args.batch_size, 5, generator=data).to(device)
            with ddp_model.no_sync() if micro < args.grad_accum - 1 else nullcontext():
                loss = loss_fn(ddp_model(inputs), labels) / args.grad_accum
                if watch is not None:
                    watch.record_loss(loss * args.grad_accum)  # <- optional: the dashboard's Loss tab
                loss.backward()
        optimizer.step()
        if ema is not None:
            with watch.computing("ema") if watch is not None else nullcontext():  # <- optional: compute, not data loading
                ema.update_parameters(model)
        if args.eval_every and (step + 1) % args.eval_every == 0:
            with watch.paused("evaluate") if watch is not None else nullcontext():  # <- optional: not the next step's data
                eval_loss = evaluate(ddp_model, loss_fn, held_out)
            if watch is not None:
                watch.record_evaluation({"eval_loss": eval_loss})  # <- optional: drawn under the training loss
            if rank == 0:
                print(f"step {step + 1}: held-out loss {eval_loss:.4f}")
        if profiler is not None:
            profiler.step()
    if profiler is not None:
        profiler.stop()

    if watch is not None:
        watch.detach()  # <- ddpwatch: goodbye now (the end of the process would send it too)
    if rank == 0:  # what ddpwatch's all-reduces per step should match: DDP's own buckets
        logged = getattr(ddp_model, "_orig_mod", ddp_model)._get_ddp_logging_data()
        sizes = logged.get("rebuilt_bucket_sizes") or logged["bucket_sizes"]
        print(f"DDP reduced gradients in {len(sizes.split(','))} bucket(s) of {sizes} bytes")
    if args.save_final and rank == 0:
        torch.save(model.state_dict(), args.save_final)
    dist.barrier()
    dist.destroy_process_group()
    exit_process(0)  # skips a gloo teardown race at interpreter exit (see instrumented_ddp.distributed)


if __name__ == "__main__":
    main()
