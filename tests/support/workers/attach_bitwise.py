"""Plain DDP and the same DDP with ddpwatch attached, trained side by side on this rank's data,
with gradients copied into DDP's buckets, with gradients as views of them, with
``static_graph=True``, and in Accelerate's accumulation loop (also with its fp16 compression
hook, ``DistributedDataParallelKwargs(comm_hook=...)``), and with PyTorch's ZeRO-1; prints for each whether every
parameter ended bit for bit the same on every rank, and which steps the attached run excluded
with how many all-reduces each (rank 0). Then the same for a model sharded with FSDP2's
``fully_shard``, attached against not, with its all-gathers and reduce-scatters per step (also
with the loop prefetching each layer asynchronously), and
for the same model replicated across every rank on a 2-D mesh (HSDP), with its all-reduces
across the replicas. Last, a loop whose rank 1 loads slowly and which all-gathers a count before
each forward, as the Trainer does: each rank's gather and data time, as JSON (``slow loader:``)."""

from __future__ import annotations

import argparse
import copy
import json
import time
from typing import Any, cast

import torch
import torch.distributed as dist
from accelerate import Accelerator, DistributedDataParallelKwargs
from accelerate.utils import DDPCommunicationHookType
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import instrumented_ddp
from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed
from instrumented_ddp.wire.messages import StepReport


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True)
    args = parser.parse_args()
    context = init_distributed("cpu")
    for option in ({"gradient_as_bucket_view": False}, {"gradient_as_bucket_view": True}, {"static_graph": True}):
        same, reports, _ = train_side_by_side(option, args.address, context.rank)
        (name, value), = option.items()
        say(f"{name}={value}", same, f"excluded {[r.excluded for r in reports]}, "
            f"all-reduces {[sum(s.kind == 'all_reduce' for s in r.spans) for r in reports]}")
    halves = [dist.new_group([0, 1]), dist.new_group(list(range(2, context.world_size)))]  # a DDP on each
    same, reports, group = train_side_by_side({"process_group": halves[context.rank >= 2]}, args.address, context.rank)
    say("subgroup", same, f"all-reduce group {group}, "
        f"all-reduces {[sum(s.kind == 'all_reduce' for s in r.spans) for r in reports]}")
    same, reports = train_zero_one_then_the_other(args.address, context.rank)
    say("zero", same, f"broadcasts {[[s.tag for s in r.spans if s.kind == 'broadcast'] for r in reports]}, "
        f"blocking {sorted({s.blocking for r in reports for s in r.spans if s.tag.startswith('l')})}, "
        f"waits in the optimizer {[loop_waits_in_the_optimizer(r) for r in reports]}, "
        f"untimed {[r.untimed_collectives for r in reports]}")
    same, reports = train_accelerate_side_by_side(args.address, context.rank)
    say("accelerate", same, f"excluded {[r.excluded for r in reports]}, grad_accum {[r.settings['grad_accum'] for r in reports]}, "
        f"all-reduces {[sum(s.kind == 'all_reduce' for s in r.spans) for r in reports]}")
    same, reports = train_accelerate_side_by_side(args.address, context.rank, DDPCommunicationHookType.FP16)
    all_reduces = [[s for s in r.spans if s.kind == "all_reduce"] for r in reports]
    say("accelerate fp16", same, f"settings {reports[-1].settings}, excluded {[r.excluded for r in reports]}, "
        f"all-reduces {[[(s.tag, s.dtype, s.nbytes) for s in spans] for spans in all_reduces]}, "
        f"untimed {[r.untimed_collectives for r in reports]}")
    same, reports, _ = train_fsdp2_side_by_side(args.address, context.rank)
    say("fsdp2", same, f"strategy {sorted({r.strategy for r in reports})}, excluded {[r.excluded for r in reports]}, "
        f"grad_accum {[r.settings['grad_accum'] for r in reports]}, "
        f"all-gathers {[sum(s.kind == 'all_gather' and not s.tag.startswith('l') for s in r.spans) for r in reports]}, "
        f"reduce-scatters {[sum(s.kind == 'reduce_scatter' for s in r.spans) for r in reports]}, "
        f"tags {sorted({s.tag for r in reports for s in r.spans if s.kind == 'reduce_scatter'})}, "
        f"the loop's {[sum(s.tag.startswith('l') for s in r.spans) for r in reports]}")
    same, reports, _ = train_fsdp2_side_by_side(args.address, context.rank, prefetch=True)
    say("fsdp2 prefetched", same, f"all-gathers {[sum(s.tag.startswith('u') for s in r.spans if s.kind == 'all_gather') for r in reports]}, "
        f"blocking {sorted({s.blocking for r in reports for s in r.spans if s.kind == 'all_gather' and s.tag.startswith('u')})}, "
        f"the loop's {[[(s.kind, s.blocking) for s in r.spans if s.tag.startswith('l')].count(('all_gather', False)) for r in reports]}")
    replicas = init_device_mesh("cpu", (context.world_size, 1), mesh_dim_names=("replicate", "shard"))
    same, reports, group = train_fsdp2_side_by_side(args.address, context.rank, mesh=replicas)
    say("hsdp", same, f"settings {reports[-1].settings}, all-reduce group {group}, excluded {[r.excluded for r in reports]}, "
        f"reduce-scatters {[sum(s.kind == 'reduce_scatter' for s in r.spans) for r in reports]}, "
        f"all-reduces {[sum(s.kind == 'all_reduce' for s in r.spans) for r in reports]}, "
        f"tags {sorted({s.tag for r in reports for s in r.spans if s.kind == 'all_reduce'})}, "
        f"blocking {sorted({s.blocking for r in reports for s in r.spans if s.kind == 'all_reduce'})}")
    timed = loop_gather_after_a_slow_loader(args.address, context.rank)
    every_rank: list[Any] = [None] * context.world_size
    dist.all_gather_object(every_rank, timed)
    if context.rank == 0:
        print(f"slow loader: {json.dumps(every_rank)}")
    shutdown_distributed()
    exit_process(0)


def say(run: str, same: bool, reports: str) -> None:
    """Rank 0 prints whether ``same`` held on every rank (a collective: every rank calls it), then
    what its attached run reported."""
    agreed = torch.tensor([int(same)])
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN)
    if dist.get_rank() == 0:
        print(f"{run}: bitwise equal on every rank: {bool(agreed.item())}")
        print(f"{run}: {reports}")


def train_side_by_side(option: dict[str, Any], address: str, rank: int) -> tuple[bool, list[StepReport], list[int]]:
    """``static_graph``: DDP's first iteration reduces every bucket from an end-of-backward
    callback and waits for them in that same call (the attached run hung there). Also returns
    the attached run's hello's ``all_reduce_group``."""
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
    same = all(torch.equal(a, b) for a, b in zip(pair["plain"].parameters(), pair["watched"].parameters(), strict=True))
    return same, [m for m in sent if isinstance(m, StepReport)], watch.publisher.hello.all_reduce_group


def train_zero_one_then_the_other(address: str, rank: int) -> tuple[bool, list[StepReport]]:
    """PyTorch's ZeRO-1 (``ZeroRedundancyOptimizer`` over SGD) beside DDP, attached, then the same
    unattached, on the same data: one after the other, since the unattached one's broadcasts,
    issued in the attached loop's step, would be timed as the loop's."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    trained = {}
    sent: list[Any] = []
    for mode in ("watched", "plain"):
        ddp = DistributedDataParallel(copy.deepcopy(model), bucket_cap_mb=0.01)
        optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.SGD, lr=0.1)
        watch = instrumented_ddp.attach(ddp, optimizer, address=address) if mode == "watched" else None
        if watch is not None:
            watch.publisher.publish = sent.append
        data = torch.Generator().manual_seed(1 + rank)
        for _ in range(4):
            x, y = torch.randn(16, 32, generator=data), torch.randint(0, 3, (16,), generator=data)
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        if watch is not None:
            watch.detach()
        trained[mode] = ddp
    same = all(torch.equal(a, b) for a, b in zip(trained["plain"].parameters(), trained["watched"].parameters(), strict=True))
    return same, [m for m in sent if isinstance(m, StepReport)]


def loop_waits_in_the_optimizer(report: StepReport) -> int:
    """How many ``wait`` spans lie inside the step's optimizer phase: the loop's, for its broadcasts."""
    (optimizer,) = [s for s in report.spans if s.kind == "optimizer"]
    return sum(s.kind == "wait" and optimizer.start <= s.start <= s.end <= optimizer.end for s in report.spans)


SLOW_LOADER_S = 0.1  # rank 1's loader, every step


def loop_gather_after_a_slow_loader(address: str, rank: int) -> list[dict[str, Any]]:
    """4 steps of an attached DDP whose rank 1 sleeps ``SLOW_LOADER_S`` as it loads, then
    all-gathers a count before the forward (the Trainer's label count): per step, the loop's
    timed gathers (kind, tag, ms), the data span's ms, and the ms from the gather's end to the
    data span's end, on this rank."""
    torch.manual_seed(0)
    ddp = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 3)))
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    watch = instrumented_ddp.attach(ddp, optimizer, address=address)
    sent: list[Any] = []
    watch.publisher.publish = sent.append
    for _ in range(4):
        if rank == 1:
            time.sleep(SLOW_LOADER_S)
        counts = [torch.zeros(1) for _ in range(dist.get_world_size())]
        dist.all_gather(counts, torch.ones(1))
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(torch.randn(16, 32)), torch.randint(0, 3, (16,))).backward()
        optimizer.step()
    watch.detach()
    steps = []
    for report in (m for m in sent if isinstance(m, StepReport) and m.step > 1):  # step 1's gather came before it began
        (data,) = [s for s in report.spans if s.kind == "data"]
        loop = [s for s in report.spans if s.tag.startswith("l")]
        steps.append({"loop": [(s.kind, s.tag, 1000 * (s.end - s.start)) for s in loop], "data_ms": 1000 * (data.end - data.start),
                      "after_last_ms": 1000 * (data.end - loop[-1].end) if loop else None})
    return steps


def train_accelerate_side_by_side(address: str, rank: int, comm_hook: DDPCommunicationHookType | None = None
                                  ) -> tuple[bool, list[StepReport]]:
    """The README's Accelerate use: ``attach`` on what ``accelerator.prepare`` returns (a DDP and an
    ``AcceleratedOptimizer``), in Accelerate's own accumulation loop (``accumulate``, ``backward``:
    two micro-steps, the first under ``no_sync``, the inner optimizer stepped on the second).
    ``comm_hook``: the hook Accelerate registers on both DDPs as it prepares them."""
    handlers = [DistributedDataParallelKwargs(comm_hook=comm_hook)] if comm_hook is not None else []
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, kwargs_handlers=handlers)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    pair = {}
    for mode in ("plain", "watched"):
        copy_of = copy.deepcopy(model)
        pair[mode] = accelerator.prepare(copy_of, torch.optim.SGD(copy_of.parameters(), lr=0.1))
    watch = instrumented_ddp.attach(*pair["watched"], address=address)
    sent: list[Any] = []
    watch.publisher.publish = sent.append
    for ddp, optimizer in pair.values():  # one after the other: the accumulation count is the Accelerator's
        data = torch.Generator().manual_seed(1 + rank)
        for _ in range(8):  # micro-steps: 4 optimizer steps
            x, y = torch.randn(16, 32, generator=data), torch.randint(0, 3, (16,), generator=data)
            with accelerator.accumulate(ddp):
                accelerator.backward(nn.functional.cross_entropy(ddp(x), y))
                optimizer.step()
                optimizer.zero_grad()
    watch.detach()
    (plain, _), (watched, _) = pair["plain"], pair["watched"]
    same = all(torch.equal(a, b) for a, b in zip(plain.parameters(), watched.parameters(), strict=True))
    return same, [m for m in sent if isinstance(m, StepReport)]


def train_fsdp2_side_by_side(address: str, rank: int, mesh: Any = None, prefetch: bool = False
                             ) -> tuple[bool, list[StepReport], list[int]]:
    """A model the user shards with FSDP2 (each layer, then the root), attached, against the same
    model sharded and not attached: two micro-steps a step, the first without gradient sync.
    ``mesh``: FSDP's (default: every rank, one dimension). ``prefetch``: the loop all-gathers each
    layer itself before the forward, asynchronously (``unshard(async_op=True)``, FSDP2's explicit
    prefetch), and FSDP waits for it at the layer's forward. Also returns the attached run's
    hello's ``all_reduce_group``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 3))
    pair: dict[str, nn.Sequential] = {}
    for mode in ("plain", "watched"):
        sharded = copy.deepcopy(model)
        for layer in (sharded[0], sharded[2], sharded[4]):
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)  # in place: the module, its class now FSDP's too
        pair[mode] = sharded
    optimizers = {mode: torch.optim.SGD(pair[mode].parameters(), lr=0.1) for mode in pair}
    watch = instrumented_ddp.attach(pair["watched"], optimizers["watched"], address=address)
    sent: list[Any] = []
    watch.publisher.publish = sent.append
    data = torch.Generator().manual_seed(1 + rank)
    for _ in range(4):
        batches = [(torch.randn(16, 32, generator=data), torch.randint(0, 3, (16,), generator=data)) for _ in range(2)]
        for mode, sharded in pair.items():
            for micro, (x, y) in enumerate(batches):
                cast(FSDPModule, sharded).set_requires_gradient_sync(micro == 1)
                if prefetch:
                    for layer in (sharded[0], sharded[2], sharded[4]):
                        cast(FSDPModule, layer).unshard(async_op=True)
                (nn.functional.cross_entropy(sharded(x), y) / 2).backward()
            optimizers[mode].step()
            optimizers[mode].zero_grad()
    watch.detach()
    same = all(torch.equal(cast(DTensor, a).full_tensor(), cast(DTensor, b).full_tensor())  # FSDP2's parameters are DTensors
               for a, b in zip(pair["plain"].parameters(), pair["watched"].parameters(), strict=True))
    return same, [m for m in sent if isinstance(m, StepReport)], watch.publisher.hello.all_reduce_group


if __name__ == "__main__":
    main()
