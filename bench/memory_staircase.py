"""The memory staircase of the sharded strategies, measured: bytes each rank holds under all nine strategies.

    torchrun --nproc_per_node=2 bench/memory_staircase.py                          # the tiny model
    torchrun --nproc_per_node=2 bench/memory_staircase.py --hidden 768 --layers 12  # ~80 M parameters

Each strategy wraps a fresh copy of the same model, trains two optimizer steps (AdamW), and
``instrumented_ddp.resources.memory.held_memory`` counts what rank 0 then holds between steps, from the
tensors it holds. ``peak`` is the allocator's peak on a GPU and the process's resident set on a
CPU (process-wide, so on a CPU it only grows from one strategy to the next).

``--step-peak``: a third step is profiled (``torch.profiler`` with ``profile_memory``: every
allocation and free on the rank's device, CPU or GPU, gloo's threads included), and for each
strategy it prints how far the bytes allocated in the step rose above what the rank held as the
step began, in which phase, and the allocations alive at that moment by size (MiB x how many,
the five largest sizes by total, 0.25 MiB or more): what sets each strategy's peak, which the
allocator's one number does not say.
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
from collections import Counter
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import instrumented_ddp  # noqa: E402
from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed  # noqa: E402
from instrumented_ddp.resources.memory import allocation_peak, held_memory  # noqa: E402


PHASES = ("forward", "backward", "gradient sync", "optimizer")


def train_step(wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> None:
    with torch.profiler.record_function("forward"):
        loss = wrapped(**batch).loss
    with torch.profiler.record_function("backward"):
        loss.backward()
        del loss
    with torch.profiler.record_function("gradient sync"):
        wrapped.finish_gradient_sync()
    with torch.profiler.record_function("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)


def step_peak(wrapped: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor],
              device: torch.device) -> str:
    """One profiled step: its peak above its start, the phase it fell in, and what was alive then,
    from the profiler's raw allocation records on the device, every thread's (``allocation_peak``)."""
    from torch._C._profiler import _EventType

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities, profile_memory=True) as prof:
        train_step(wrapped, optimizer, batch)
    events, pending = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while pending:
        node = pending.pop()
        pending.extend(node.children)
        if node.tag == _EventType.Allocation and node.extra_fields.device.type == device.type:
            events.append((node.start_time_ns, node.extra_fields.alloc_size, node.extra_fields.ptr))
    peak = allocation_peak(events)
    start_ns = prof.profiler.kineto_results.trace_start_ns()
    phase = next((event.name for event in prof.events() if event.name in PHASES
                  and event.time_range.start * 1000 <= peak.at - start_ns <= event.time_range.end * 1000), "?")
    sizes = Counter(round(size / 2**20, 2) for size in peak.alive.values() if size >= 2**18)
    largest = sorted(sizes.items(), key=lambda item: -item[0] * item[1])[:5]
    return f"+{peak.rise / 2**20:.1f} MiB in {phase}: " + ", ".join(f"{mib:g} x {count}" for mib, count in largest)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    parser.add_argument("--strategies", default=",".join(instrumented_ddp.STRATEGY_NAMES))
    parser.add_argument("--step-peak", action="store_true", help="profile a third step: its peak and what sets it")
    args = parser.parse_args()
    context = init_distributed(args.device)
    torch.manual_seed(0)
    heads = max(args.hidden // 64, 1)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 8 // 3,
                         num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(heads // 3, 1),
                         num_labels=5, pad_token_id=0)
    model = LlamaForSequenceClassification(config).to(context.device)
    batch = {"input_ids": torch.randint(1, args.vocab, (2, 32), device=context.device),
             "labels": torch.randint(0, 5, (2,), device=context.device)}
    rows, peaks = [], {}
    for strategy in args.strategies.split(","):
        wrapped = instrumented_ddp.wrap(copy.deepcopy(model), strategy, bucket_mb=args.bucket_mb)
        optimizer = wrapped.make_optimizer(torch.optim.AdamW, lr=1e-4)
        for _ in range(2):
            train_step(wrapped, optimizer, batch)
        rows.append((strategy, held_memory(wrapped)))
        if args.step_peak:
            peaks[strategy] = step_peak(wrapped, optimizer, batch, context.device)
        instrumented_ddp.unwrap(wrapped)
        del wrapped, optimizer
        gc.collect()  # FSDP2's copy waits in torch's reference cycles: the next strategy's peak is its own
    if context.is_main:
        parameters = sum(p.numel() for p in model.parameters())
        base = "ddp" if "ddp" in dict(rows) else rows[0][0]  # the shares' reference: ddp, or the first one run
        print(f"{parameters / 1e6:.1f} M parameters (hidden {args.hidden}, {args.layers} layers), {context.world_size} ranks "
              f"on {context.device.type}; MiB rank 0 holds after 2 AdamW steps; share = of {base}'s")
        print(f"{'strategy':8} {'params':>8} {'grads':>8} {'optim':>8} {'peak':>8}  share P/G/O")
        reference = dict(rows)[base]
        for strategy, held in rows:
            shares = "/".join(f"{getattr(held, k) / getattr(reference, k):.2f}" for k in ("parameters", "gradients", "optimizer_state"))
            print(f"{strategy:8} " + " ".join(f"{getattr(held, k) / 2**20:8.1f}" for k in held._fields) + f"  {shares}")
        for strategy, peak in peaks.items():
            print(f"{strategy:8} step peak {peak}")
    shutdown_distributed()
    exit_process(0)


if __name__ == "__main__":
    main()
