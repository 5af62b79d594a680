"""What watching costs: step time instrumented / uninstrumented, per strategy, side by side.

    python bench/overhead.py                  # relaunches itself on 2 ranks with torchrun
    python bench/overhead.py --steps 80

For each strategy two identical copies of the model are wrapped side by side, one with the
timeline and a publisher streaming to an address where no dashboard listens (the common case),
one with timing off (``--no-watch``), and their steps alternate one by one, so drift in machine
load hits both alike. The ratio of the median step times is printed (goal: at most 1.03).
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))


def measure(args: argparse.Namespace) -> None:
    import torch

    import instrumented_ddp
    from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed
    from instrumented_ddp.models import build_tiny_model
    from instrumented_ddp.watch import Watch

    context = init_distributed("cpu")
    torch.manual_seed(0)
    model = build_tiny_model(vocab_size=256, num_labels=5)
    batch = {"input_ids": torch.randint(1, 256, (args.micro_batch, 64)), "labels": torch.randint(0, 5, (args.micro_batch,))}
    watched = Watch.start(f"tcp://127.0.0.1:{args.port}", context, {
        "strategy": "bench", "settings": {}, "model_parameters": 0})
    rows = []
    for strategy in instrumented_ddp.STRATEGY_NAMES:
        times: dict[str, list[float]] = {"watched": [], "plain": []}
        timelines = {"watched": watched.timeline, "plain": Watch.disabled().timeline}
        models = {mode: instrumented_ddp.wrap(copy.deepcopy(model), strategy, bucket_mb=1.0, timeline=timelines[mode])
                  for mode in ("watched", "plain")}
        optimizers = {mode: torch.optim.AdamW(models[mode].parameters(), lr=1e-4) for mode in models}
        for step in range(2 * (args.steps + 2)):  # the first two of each are warm-up
            mode = "watched" if step % 2 == 0 else "plain"
            wrapped, timeline, optimizer = models[mode], timelines[mode], optimizers[mode]
            started = time.perf_counter()
            timeline.begin_step(step, strategy, {})
            loss = wrapped(**batch).loss
            with timeline.phase("backward"):
                loss.backward()
            wrapped.finish_gradient_sync()
            with timeline.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)
            timeline.end_step(args.micro_batch, args.micro_batch * 64, loss.detach())
            if mode == "watched":
                watched.step_done()
            if step >= 4:
                times[mode].append(time.perf_counter() - started)
        for wrapped in models.values():
            instrumented_ddp.unwrap(wrapped)
        watched_ms, plain_ms = (1000 * statistics.median(times[m]) for m in ("watched", "plain"))
        rows.append((strategy, watched_ms, plain_ms, watched_ms / plain_ms))
    watched.close()
    if context.is_main:
        print(f"{'strategy':8} {'watched ms':>11} {'plain ms':>9} {'ratio':>6}   ({args.steps} steps each, alternating, "
              f"{context.world_size} ranks, micro-batch {args.micro_batch}x64, telemetry dropped {watched.dropped})")
        for strategy, watched_ms, plain_ms, ratio in rows:
            print(f"{strategy:8} {watched_ms:11.1f} {plain_ms:9.1f} {ratio:6.3f}")
    shutdown_distributed()
    exit_process(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per mode and strategy")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--port", type=int, default=5599, help="where no dashboard listens")
    args = parser.parse_args()
    if "RANK" in os.environ:
        measure(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
               __file__, *sys.argv[1:]]
    sys.exit(subprocess.run(command, env=env).returncode)


if __name__ == "__main__":
    main()
