"""Our ``bucket`` strategy against PyTorch's DDP at the same cap, unwatched, side by side.

    python bench/bucket_vs_ddp.py                      # 2 ranks on the CPU, tiny model, 1 MB buckets
    python bench/bucket_vs_ddp.py --bucket-mb 4 --steps 120

Two copies of the model, one wrapped in ``bucket``, one in ``ddp``, neither timed, their steps
alternating one by one (AdamW, ``zero_grad(set_to_none=False)`` as train.py does), so drift in
the machine's load hits both alike. Prints each one's median step time and the median of the
paired ratios bucket / ddp with its 90 % interval (goal: at most 1.00).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
from instrumented_ddp.wire.median_interval import median_with_interval  # noqa: E402 (the repository is on the path only now)
from instrumented_ddp.selfcheck.overhead_bench import relaunch_on_ranks  # noqa: E402


def measure(args: argparse.Namespace) -> None:
    import torch

    import instrumented_ddp
    from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed
    from instrumented_ddp.training.models import build_built_in_model

    context = init_distributed("cpu")
    torch.manual_seed(0)
    model = build_built_in_model(args.model, vocab_size=4096, num_labels=5)
    batch = {"input_ids": torch.randint(1, 4096, (args.micro_batch, args.seq_len)),
             "labels": torch.randint(0, 5, (args.micro_batch,))}
    wrapped = {name: instrumented_ddp.wrap(copy.deepcopy(model), name, bucket_mb=args.bucket_mb) for name in ("bucket", "ddp")}
    optimizers = {name: wrapped[name].make_optimizer(torch.optim.AdamW, lr=1e-4) for name in wrapped}
    times: dict[str, list[float]] = {name: [] for name in wrapped}
    for round_ in range(2 * (args.steps + 3)):
        name = ("bucket", "ddp")[round_ % 2]
        started = time.perf_counter()
        loss = wrapped[name](**batch).loss
        loss.backward()
        wrapped[name].finish_gradient_sync()
        optimizers[name].step()
        optimizers[name].zero_grad(set_to_none=False)
        if round_ >= 6:  # three warm-up steps each (DDP rebuilds its buckets after its first)
            times[name].append(time.perf_counter() - started)
    ratio, low, high = median_with_interval([b / d for b, d in zip(times["bucket"], times["ddp"], strict=True)])
    if context.is_main:
        print(f"bucket {1000 * statistics.median(times['bucket']):.1f} ms, ddp {1000 * statistics.median(times['ddp']):.1f} ms, "
              f"bucket/ddp {ratio:.3f} ({low:.3f}-{high:.3f}) over {args.steps} alternating steps each, "
              f"{context.world_size} ranks on cpu, {args.model} model, {args.bucket_mb:g} MB buckets")
    for strategy in wrapped.values():
        instrumented_ddp.unwrap(strategy)
    shutdown_distributed()
    exit_process(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--bucket-mb", type=float, default=1.0)
    parser.add_argument("--model", default="tiny", choices=["tiny", "small"])
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    if "RANK" in os.environ:
        measure(args)
        return
    relaunch_on_ranks([__file__], args.ranks)


if __name__ == "__main__":
    main()
