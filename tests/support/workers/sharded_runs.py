"""The sharded strategies in float64 on the ranks of a process group: final parameters, the
gradient slice each rank holds after the first step's backward, the bytes each rank holds, and a
run switched ddp -> zero1 -> zero2 -> fsdp -> bucket one step apart, its optimizer state carried."""

from __future__ import annotations

import argparse
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import instrumented_ddp
from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed
from instrumented_ddp.resources.memory import held_memory
from instrumented_ddp.strategies.fsdp import FullyShardedFSDP2
from instrumented_ddp.strategies.zero1 import ShardedOptimizerState
from instrumented_ddp.timing.timeline import StepTimeline

sys.path.insert(0, str(Path(__file__).parents[1]))  # a script here, or imported by the tests for its constants
from workers.strategy_runs import global_micro_batches, make_model, rank_slice  # noqa: E402

LR = 1e-2
SWITCHES = ("ddp", "zero1", "zero2", "fsdp", "bucket")


def held_gradients(model: instrumented_ddp.DataParallelStrategy) -> dict:
    """What this rank holds of the averaged gradients, and where each piece sits in the model."""
    if isinstance(model, FullyShardedFSDP2):
        names = [name for name, _ in model.module.named_parameters()]
        return {"fsdp": {name: p.grad._local_tensor.clone() if isinstance(p.grad, DTensor) else None
                         for name, p in zip(names, model.sharded.parameters(), strict=True)}}
    assert isinstance(model, ShardedOptimizerState), model.name  # zero1, zero2: a flat shard per bucket
    index_of = {id(p): name for name, p in model.module.named_parameters()}
    return {"flat": [
        {"start": shard.start, "grad": shard.shard.grad.clone(),
         "members": [(index_of[id(p)], start, numel) for p, (start, numel) in zip(bucket.parameters, shard.offsets, strict=True)]}
        for bucket, shard in zip(model.buckets, model.shards, strict=True)
    ]}


def one_step(model, optimizer, micro_batches: list[dict], rank: int, world_size: int, on_synced=None) -> None:
    for index, batch in enumerate(micro_batches):
        skip = index < len(micro_batches) - 1
        with model.no_sync() if skip else nullcontext():
            (model(**rank_slice(batch, rank, world_size)).loss / len(micro_batches)).backward()
            model.finish_gradient_sync()
    if on_synced is not None:
        on_synced()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", nargs="+", required=True,
                        help="strategy:grad_accum[:timed], or 'switched:<grad_accum>[:timed]'")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--global-batch", type=int, default=12)
    args = parser.parse_args()
    context = init_distributed("cpu")
    results = {}
    for run in args.runs:
        strategy, grad_accum, *timed = run.split(":")
        timing = {"timeline": StepTimeline(context.rank)} if timed else {}  # timed collectives must change no number
        steps = global_micro_batches(7, args.steps, int(grad_accum), args.global_batch)
        first = SWITCHES[0] if strategy == "switched" else strategy
        model = instrumented_ddp.wrap(make_model(seed=1234 + context.rank).double(), first, bucket_mb=0.002, **timing)
        optimizer = model.make_optimizer(torch.optim.AdamW, lr=LR)
        result: dict = {}
        for number, micro_batches in enumerate(steps):
            if strategy == "switched" and number > 0:
                carried = model.full_optimizer_state()
                model = instrumented_ddp.wrap(instrumented_ddp.unwrap(model), SWITCHES[number % len(SWITCHES)],
                                              bucket_mb=0.002, **timing)
                optimizer = model.make_optimizer(torch.optim.AdamW, lr=LR, state=carried)
            capture = (lambda: result.update(gradients=held_gradients(model))) if number == 0 and strategy in ("zero1", "zero2", "fsdp") else None
            if timed:
                timing["timeline"].begin_step(number + 1, model.name, {})
            one_step(model, optimizer, micro_batches, context.rank, context.world_size, capture)
            if timed:
                timing["timeline"].end_step(0, 0)
                timing["timeline"].completed_reports()
        result["held"] = held_memory(model)._asdict()
        bare = instrumented_ddp.unwrap(model)
        result["state"] = {k: v.detach().clone() for k, v in bare.state_dict().items()}
        results[run] = result
    torch.save(results, args.out.with_suffix(f".rank{context.rank}.pt"))
    shutdown_distributed()


if __name__ == "__main__":
    main()
    exit_process(0)
