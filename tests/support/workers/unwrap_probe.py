"""Wrap, train a step, unwrap; then a backward on rank-specific data must stay local."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

import instrumented_ddp
from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed
from workers.strategy_runs import global_micro_batches, make_model, rank_slice, train


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    context = init_distributed("cpu")
    grads = {}
    for strategy in instrumented_ddp.STRATEGY_NAMES:
        model = instrumented_ddp.wrap(make_model(seed=5), strategy, bucket_mb=0.01)
        train(model, global_micro_batches(3, 1, 1, 8), context.rank, context.world_size)
        bare = instrumented_ddp.unwrap(model)
        bare.zero_grad(set_to_none=True)
        local = rank_slice(global_micro_batches(100 + context.rank, 1, 1, 8)[0][0], 0, 1)
        bare(**local).loss.backward()
        grads[strategy] = {n: p.grad.clone() for n, p in bare.named_parameters()}
        grads[strategy + ":input"] = local
    torch.save(grads, args.out.with_suffix(f".rank{context.rank}.pt"))
    shutdown_distributed()


if __name__ == "__main__":
    main()
    exit_process(0)
