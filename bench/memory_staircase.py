"""The seed's memory staircase, measured: bytes each rank holds under all nine strategies.

    torchrun --nproc_per_node=2 bench/memory_staircase.py                          # the tiny model
    torchrun --nproc_per_node=2 bench/memory_staircase.py --hidden 768 --layers 12  # ~80 M parameters

Each strategy wraps a fresh copy of the same model, trains two optimizer steps (AdamW), and
``instrumented_ddp.memory.held_memory`` counts what rank 0 then holds between steps, from the
tensors it holds. ``peak`` is the allocator's peak on a GPU and the process's resident set on a
CPU (process-wide, so on a CPU it only grows from one strategy to the next).
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import instrumented_ddp  # noqa: E402
from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed  # noqa: E402
from instrumented_ddp.memory import held_memory  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=192)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
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
    rows = []
    for strategy in instrumented_ddp.STRATEGY_NAMES:
        wrapped = instrumented_ddp.wrap(copy.deepcopy(model), strategy, bucket_mb=25.0)
        optimizer = wrapped.make_optimizer(torch.optim.AdamW, lr=1e-4)
        for _ in range(2):
            wrapped(**batch).loss.backward()
            wrapped.finish_gradient_sync()
            optimizer.step()
            optimizer.zero_grad(set_to_none=False)
        rows.append((strategy, held_memory(wrapped)))
        instrumented_ddp.unwrap(wrapped)
        del wrapped, optimizer
    if context.is_main:
        parameters = sum(p.numel() for p in model.parameters())
        print(f"{parameters / 1e6:.1f} M parameters (hidden {args.hidden}, {args.layers} layers), {context.world_size} ranks "
              f"on {context.device.type}; MiB rank 0 holds after 2 AdamW steps; share = of ddp's")
        print(f"{'strategy':8} {'params':>8} {'grads':>8} {'optim':>8} {'peak':>8}  share P/G/O")
        ddp = dict(rows)["ddp"]
        for strategy, held in rows:
            shares = "/".join(f"{getattr(held, k) / getattr(ddp, k):.2f}" for k in ("parameters", "gradients", "optimizer_state"))
            print(f"{strategy:8} " + " ".join(f"{getattr(held, k) / 2**20:8.1f}" for k in held._fields) + f"  {shares}")
    shutdown_distributed()
    exit_process(0)


if __name__ == "__main__":
    main()
