"""Train a tiny Llama a few optimizer steps under one or more strategies; used by the tests both
inside a process group (each rank takes its slice of every global micro-batch) and as the
one-process reference (the whole global batch)."""

from __future__ import annotations

import argparse
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForSequenceClassification

import instrumented_ddp
from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed
from instrumented_ddp.timing.timeline import StepTimeline

VOCAB, LABELS, SEQ = 97, 5, 12


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    settings: dict[str, Any] = dict(  # untyped: transformers 5's typed LlamaConfig does not name num_labels (models.py)
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_labels=LABELS, pad_token_id=0,
    )
    config = LlamaConfig(**settings)
    return LlamaForSequenceClassification(config)


def global_micro_batches(seed: int, steps: int, grad_accum: int, global_batch: int) -> list[list[dict]]:
    """``steps`` optimizer steps of ``grad_accum`` micro-batches of global_batch/grad_accum rows."""
    generator = torch.Generator().manual_seed(seed + 1)
    micro = global_batch // grad_accum
    return [
        [
            {
                "input_ids": torch.randint(1, VOCAB, (micro, SEQ), generator=generator),
                "labels": torch.randint(0, LABELS, (micro,), generator=generator),
            }
            for _ in range(grad_accum)
        ]
        for _ in range(steps)
    ]


def rank_slice(batch: dict, rank: int, world_size: int) -> dict:
    rows = batch["labels"].shape[0] // world_size
    return {k: v[rank * rows : (rank + 1) * rows] for k, v in batch.items()}


def train(model: nn.Module, steps: list[list[dict]], rank: int, world_size: int, timeline: StepTimeline | None = None) -> None:
    """The training loop every strategy shares (as in train.py)."""
    strategy = model if isinstance(model, instrumented_ddp.DataParallelStrategy) else None  # else one process's model
    optimizer = (strategy.make_optimizer(torch.optim.AdamW, lr=1e-2) if strategy is not None
                 else torch.optim.AdamW(model.parameters(), lr=1e-2))
    for number, micro_batches in enumerate(steps, start=1):
        if timeline is not None:
            assert strategy is not None, "a timeline times a strategy's steps"
            timeline.begin_step(number, strategy.name, strategy.settings)
        for index, batch in enumerate(micro_batches):
            last = index == len(micro_batches) - 1
            skip = strategy is not None and not last and not strategy.syncs_every_micro_step
            with strategy.no_sync() if strategy is not None and skip else nullcontext():
                loss = model(**rank_slice(batch, rank, world_size)).loss / len(micro_batches)
                loss.backward()
                if strategy is not None:
                    strategy.finish_gradient_sync()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        if timeline is not None:
            timeline.end_step(samples=0, tokens=0)
            assert len(timeline.completed_reports()) <= 1


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", nargs="+", required=True, help="strategy:grad_accum:bucket_mb[:timed]")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--global-batch", type=int, default=8)
    args = parser.parse_args()
    context = init_distributed("cpu")
    results = {}
    for run in args.runs:
        strategy, grad_accum, bucket_mb, *timed = run.split(":")
        timeline = StepTimeline(context.rank) if timed else None
        model = make_model(seed=1234 + context.rank)  # ranks start different: wrap must broadcast
        model = instrumented_ddp.wrap(model, strategy, bucket_mb=float(bucket_mb), **({"timeline": timeline} if timed else {}))
        steps = global_micro_batches(7, args.steps, int(grad_accum), args.global_batch)
        train(model, steps, context.rank, context.world_size, timeline)
        bare = instrumented_ddp.unwrap(model)
        results[run] = {k: v.detach().clone() for k, v in bare.state_dict().items()}
    torch.save(results, args.out.with_suffix(f".rank{context.rank}.pt"))
    shutdown_distributed()


if __name__ == "__main__":
    main()
    exit_process(0)
