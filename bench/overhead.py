"""What watching costs: step time instrumented / uninstrumented, per strategy, side by side.

    python bench/overhead.py                  # relaunches itself on 2 ranks with torchrun
    python bench/overhead.py --steps 8 --rounds 6

For each strategy the same wrapped model runs alternating blocks of steps, one block with the
timeline and a publisher streaming to an address where no dashboard listens (the common case),
the next with timing off (``--no-watch``); alternating cancels drift in machine load. The ratio
of the median step times is printed (goal: at most 1.03).
"""

from __future__ import annotations

import argparse
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    watched = Watch.start(f"tcp://127.0.0.1:{args.port}", context, {
        "strategy": "bench", "settings": {}, "model_parameters": 0})
    rows = []
    for strategy in instrumented_ddp.STRATEGY_NAMES:
        times: dict[str, list[float]] = {"watched": [], "plain": []}
        for round_index in range(2 * args.rounds):
            mode = "watched" if round_index % 2 == 0 else "plain"
            timeline = watched.timeline if mode == "watched" else Watch.disabled().timeline
            wrapped = instrumented_ddp.wrap(model, strategy, bucket_mb=1.0, timeline=timeline)
            for step in range(args.steps + 1):  # the first step of a block warms up
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
                if step:
                    times[mode].append(time.perf_counter() - started)
            model = instrumented_ddp.unwrap(wrapped)
        watched_ms, plain_ms = (1000 * statistics.median(times[m]) for m in ("watched", "plain"))
        rows.append((strategy, watched_ms, plain_ms, watched_ms / plain_ms))
    watched.close()
    if context.is_main:
        print(f"{'strategy':8} {'watched ms':>11} {'plain ms':>9} {'ratio':>6}   ({args.rounds} x {args.steps} steps each, "
              f"{context.world_size} ranks, micro-batch {args.micro_batch}x64, telemetry dropped {watched.dropped})")
        for strategy, watched_ms, plain_ms, ratio in rows:
            print(f"{strategy:8} {watched_ms:11.1f} {plain_ms:9.1f} {ratio:6.3f}")
    shutdown_distributed()
    exit_process(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6, help="timed steps per block")
    parser.add_argument("--rounds", type=int, default=5, help="blocks per mode and strategy")
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
