"""The two ways ddpwatch sees a DDP's buckets on the CPU, side by side: which costs less.

    python bench/ddp_watch_paths.py               # relaunches itself on 2 ranks with torchrun
    python bench/ddp_watch_paths.py --steps 400

Two identical copies of the tiny model, both wrapped by the ``ddp`` strategy and both watched
(a timeline each, nothing published): one as shipped, DDP built on a ``ForwardingGroup`` (DDP's
own reduction, the group shows each bucket), one with a communication hook instead, as an
``attach``-ed DDP is watched (the hook scales each filled bucket, a second pass DDP's reducer
folds into its copy). Their steps alternate one by one. Printed: each path's median step time,
the median of the paired ratios (forwarding group over hook: below 1 means the forwarding group
is cheaper) with its 90 % interval, and whether the two copies' parameters ended bitwise equal.
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
from instrumented_ddp.selfcheck.overhead_bench import marked_train_step, relaunch_on_ranks  # noqa: E402


def measure(steps: int) -> None:
    import torch

    import instrumented_ddp
    from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed
    from instrumented_ddp.timing.forwarding_group import ForwardingGroup
    from instrumented_ddp.training.models import build_built_in_model
    from instrumented_ddp.strategies.native import NativeDDP
    from instrumented_ddp.timing.timeline import StepTimeline

    context = init_distributed("cpu")
    torch.manual_seed(0)
    model = build_built_in_model("tiny", vocab_size=256, num_labels=5)
    batch = {"input_ids": torch.randint(1, 256, (4, 64)), "labels": torch.randint(0, 5, (4,))}
    timelines = {path: StepTimeline(context.rank) for path in ("forwarding group", "hook")}
    models = {"forwarding group": instrumented_ddp.wrap(copy.deepcopy(model), "ddp", bucket_mb=1.0,
                                                        timeline=timelines["forwarding group"])}
    as_shipped = NativeDDP._group_for_ddp
    NativeDDP._group_for_ddp = lambda strategy: strategy.process_group  # DDP on gloo's group: DDPTiming hooks it
    try:
        models["hook"] = instrumented_ddp.wrap(copy.deepcopy(model), "ddp", bucket_mb=1.0, timeline=timelines["hook"])
    finally:
        NativeDDP._group_for_ddp = as_shipped
    assert isinstance(models["forwarding group"].ddp.process_group, ForwardingGroup)
    assert not isinstance(models["hook"].ddp.process_group, ForwardingGroup)
    optimizers = {path: wrapped.make_optimizer(torch.optim.AdamW, lr=1e-4) for path, wrapped in models.items()}

    times: dict[str, list[float]] = {path: [] for path in models}
    for step in range(2 * steps + 4):  # the first step of each path is DDP's warm-up, excluded
        path = "forwarding group" if step % 2 == 0 else "hook"
        timeline, wrapped, optimizer = timelines[path], models[path], optimizers[path]
        started = time.perf_counter()
        loss = marked_train_step(wrapped, timeline, optimizer, batch, step, "ddp")
        timeline.end_step(4, 256, loss.detach())
        timeline.completed_reports()  # what the publisher would take
        if step >= 4:
            times[path].append(time.perf_counter() - started)
    equal = all(torch.equal(a, b) for a, b in zip(models["forwarding group"].parameters(), models["hook"].parameters(), strict=True))
    ratio, low, high = median_with_interval([a / b for a, b in zip(times["forwarding group"], times["hook"], strict=True)])
    if context.is_main:
        print(f"forwarding group {1000 * statistics.median(times['forwarding group']):.1f} ms, "
              f"hook {1000 * statistics.median(times['hook']):.1f} ms, ratio {ratio:.3f} ({low:.3f}-{high:.3f}), "
              f"{steps} steps each, {context.world_size} ranks; parameters bitwise equal: {equal}")
    for wrapped in models.values():
        instrumented_ddp.unwrap(wrapped)
    shutdown_distributed()
    exit_process(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="timed steps per path")
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    if "RANK" in os.environ:
        measure(args.steps)
        return
    relaunch_on_ranks([__file__], args.ranks)


if __name__ == "__main__":
    main()
