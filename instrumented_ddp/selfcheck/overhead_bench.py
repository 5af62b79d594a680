"""What watching costs: step time instrumented / uninstrumented, per strategy, side by side.

    python bench/overhead.py                  # relaunches itself on 2 ranks with torchrun
    python bench/overhead.py --steps 80
    python bench/overhead.py --device cuda --ranks 1   # on a GPU: NCCL, blocks of steps
    python bench/overhead.py --device cuda --ranks 1 --model small --micro-batch 64 --seq-len 512
    python -m instrumented_ddp.selfcheck.overhead_bench --device cuda --ranks 1   # the same, installed (no clone)

The bench is a module of the package so that ``ddpwatch doctor`` runs it from an installed
ddpwatch; ``bench/overhead.py``, beside the other benches, runs it from a clone.

For each strategy two identical copies of the model are wrapped side by side, one with the
timeline and a publisher streaming to an address where no dashboard listens (the common case),
one with timing off (``--no-watch``), and their steps alternate, so drift in machine load hits
both alike. A watched step does all a watched train.py step does: the command agreement, the
timeline, publishing the reports that resolved. Printed per strategy: the median step times, the
median of the paired ratios (goal: at most 1.02) and a 90 % interval for it; then the training
thread's CPU time per step (``time.thread_time``) watched and plain, and the median of the paired
differences, what watching adds to the thread, with its interval: steadier than the wall-time
ratio on a machine whose other processes take the cores at random. ``attach`` is a
user's own loop on torch's DDP, attached against not attached (see ``attached_and_plain_ddp``);
``attach-zero`` the same loop stepping torch's ZeRO-1, whose broadcasts are then the loop's own
collectives, timed with their waits (``attached_and_plain_ddp``);
``attach-fsdp`` the same loop on a model sharded with FSDP2's ``fully_shard``, ``attach-hsdp`` on
a 2-D mesh of 2 replicas (HSDP: each shard's gradients all-reduced across the replicas too).
``--a-a`` leaves both copies unwatched (not for ``attach``): the ratio it prints is the bench's
own noise and order bias, the floor a watched ratio is read against. ``--listener`` has a
``ddpwatch record`` listen at ``--port`` for the whole run, as a user watching their job has a
dashboard: the watched copy's reports are then encoded and sent (every span: a recorder asks for
all of them), where with nobody listening the sender only counts them. The header line says how
many messages went out, so a run that meant to be listened to and was not shows it.

What watching costs is host time: a little per mark and per collective, and more per step for
the agreement and the report. A step the host is the bottleneck of
(the tiny model, every kernel a launch) pays it in full; a step the GPU is the bottleneck of
(``--model small`` at a training batch) hides it while the host runs ahead. The doctor
measures both.

On the CPU every step is timed on its own. On a GPU the host runs ahead of the device, and a
step's cost is only seen once the device catches up: the modes alternate in blocks of
``--block`` steps, each block ended by one ``torch.cuda.synchronize()`` (the harness's, both
modes alike), and a step's time is its block's time over the block's length.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, NoReturn

from instrumented_ddp.timing.unwatched_blocks import UNWATCHED_ENV
from instrumented_ddp.wire.median_interval import median_with_interval
from instrumented_ddp.wire.one_line_errors import OneLineErrorParser
from instrumented_ddp.wire.kinds import STRATEGY_NAMES

#: How the ranks run this bench: as the package's module (``torchrun -m``), installed or not.
MODULE = "instrumented_ddp.selfcheck.overhead_bench"


def measure(args: argparse.Namespace) -> None:
    import torch

    import instrumented_ddp
    from instrumented_ddp.distributed import exit_process, init_distributed, shutdown_distributed
    from instrumented_ddp.training.models import build_built_in_model
    from instrumented_ddp.resources.memory import MemorySampler
    from instrumented_ddp.publish.watch import Watch

    # Every watched step watched: the bench measures watching whole, against no watching at all
    # (the run's own self-measurement, ``timing.unwatched_blocks``, is what it would check).
    os.environ[UNWATCHED_ENV] = "0"
    context = init_distributed(args.device)
    on_gpu = context.device.type == "cuda"
    block = args.block if on_gpu else 1
    torch.manual_seed(0)
    vocab = 256 if args.model == "tiny" else 4096  # train.py's tokenizer has 4096
    model = build_built_in_model(args.model, vocab_size=vocab, num_labels=5).to(context.device)
    batch = {"input_ids": torch.randint(1, vocab, (args.micro_batch, args.seq_len), device=context.device),
             "labels": torch.randint(0, 5, (args.micro_batch,), device=context.device)}
    watches = {"watched": Watch.disabled() if args.a_a else Watch.start(f"tcp://127.0.0.1:{args.port}", context, {
        "strategy": "bench", "settings": {}, "model_parameters": 0}), "plain": Watch.disabled()}
    watched = watches["watched"]

    def timed_rounds(step_of: dict[str, Callable[[int], None]]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        """Blocks of steps, the modes alternating; a step's time is its block's over its length.
        Returns the wall times and the training thread's CPU times (``time.thread_time``), each
        by mode: the thread's CPU time leaves out what other processes take of the cores."""
        times: dict[str, list[float]] = {"watched": [], "plain": []}
        cpu: dict[str, list[float]] = {"watched": [], "plain": []}
        for round_ in range(2 * (args.steps // block + 2)):  # the first round of each mode is warm-up
            mode = "watched" if round_ % 2 == 0 else "plain"
            started, cpu_started = time.perf_counter(), time.thread_time()
            for step in range(round_ * block, (round_ + 1) * block):
                step_of[mode](step)
            if on_gpu:
                torch.cuda.synchronize()
            if round_ >= 2:
                times[mode].append((time.perf_counter() - started) / block)
                cpu[mode].append((time.thread_time() - cpu_started) / block)
        return times, cpu

    rows = []
    for strategy in args.strategies.split(","):
        if strategy in ATTACH_KINDS:
            if strategy == "attach":
                steps, attachment = attached_and_plain_ddp(model, batch, context, args.port)
            elif strategy == "attach-zero":
                steps, attachment = attached_and_plain_ddp(model, batch, context, args.port, zero=True)
            elif strategy == "attach-fsdp":
                steps, attachment = attached_and_plain_fsdp(model, batch, args.port)
            else:  # attach-hsdp
                from torch.distributed.device_mesh import init_device_mesh

                replicas = 2 if context.world_size % 2 == 0 else context.world_size
                mesh = init_device_mesh(context.device.type, (replicas, context.world_size // replicas),
                                        mesh_dim_names=("replicate", "shard"))
                steps, attachment = attached_and_plain_fsdp(model, batch, args.port, mesh)
            times, cpu = timed_rounds(steps)
            attachment.detach()  # one attachment an address: the next attach strategy's is refused while it lives
        else:
            models = {mode: instrumented_ddp.wrap(copy.deepcopy(model), strategy, bucket_mb=1.0, timeline=watches[mode].timeline)
                      for mode in watches}
            optimizers = {mode: models[mode].make_optimizer(torch.optim.AdamW, lr=1e-4) for mode in models}
            memory = MemorySampler()  # what train.py measures every tenth step

            def watched_train_step(mode: str, step: int) -> None:
                wrapped, watch, optimizer = models[mode], watches[mode], optimizers[mode]
                timeline = watch.timeline
                watch.agree_on_command()
                loss = marked_train_step(wrapped, timeline, optimizer, batch, step, strategy)
                timeline.end_step(args.micro_batch, args.micro_batch * args.seq_len, loss.detach(),
                                  memory=memory.sample(wrapped) if watch.publisher is not None else None)
                watch.step_done()

            times, cpu = timed_rounds({mode: functools.partial(watched_train_step, mode) for mode in watches})
            for wrapped in models.values():
                instrumented_ddp.unwrap(wrapped)
        watched_ms, plain_ms = (1000 * statistics.median(times[m]) for m in ("watched", "plain"))
        ratio, low, high = median_with_interval([w / p for w, p in zip(times["watched"], times["plain"], strict=True)])
        added_cpu = median_with_interval([1000 * (w - p) for w, p in zip(cpu["watched"], cpu["plain"], strict=True)])
        rows.append((strategy, watched_ms, plain_ms, ratio, low, high, 1000 * statistics.median(cpu["watched"]),
                     1000 * statistics.median(cpu["plain"]), *added_cpu))
    watched.close()
    if context.is_main:
        print(f"{'strategy':11} {'watched ms':>11} {'plain ms':>9} {'ratio':>6} {'90% interval':>13} "
              f"{'cpu ms w':>9} {'cpu ms p':>9} {'added cpu ms':>12} {'90% interval':>16}   ({args.steps} steps each, "
              f"alternating, {context.world_size} ranks on {context.device.type}, {args.model} model, "
              f"micro-batch {args.micro_batch}x{args.seq_len}, blocks of {block}, telemetry dropped {watched.dropped}, "
              f"sent {watched.publisher.sent if watched.publisher is not None else 0}; cpu: the training thread's, "
              "time.thread_time)")
        for strategy, watched_ms, plain_ms, ratio, low, high, cpu_w, cpu_p, added, added_low, added_high in rows:
            print(f"{strategy:11} {watched_ms:11.1f} {plain_ms:9.1f} {ratio:6.3f} {low:6.3f}-{high:6.3f} "
                  f"{cpu_w:9.2f} {cpu_p:9.2f} {added:+12.3f} {added_low:+7.3f} to {added_high:+.3f}")
    shutdown_distributed()
    exit_process(0)


def attached_and_plain_ddp(model: Any, batch: dict[str, Any], context: Any, port: int,
                           zero: bool = False) -> tuple[dict[str, Callable[[int], None]], Any]:
    """``attach``: a user's own loop on a DDP model with ddpwatch attached, against the same loop
    on an identical DDP model without it. The loop is the user's: nothing in it is ddpwatch's.
    ``zero`` (``attach-zero``): the loop steps PyTorch's ZeRO-1, whose broadcasts of the updated
    parameters, one asynchronous call per parameter inside ``step()``, are timed as the loop's
    with their waits (``users_steps_one_attached``)."""
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [context.device.index] if context.device.type == "cuda" else None
    models = {mode: DistributedDataParallel(copy.deepcopy(model), device_ids=device_ids, bucket_cap_mb=1.0)
              for mode in ("watched", "plain")}
    return users_steps_one_attached(models, batch, port, zero=zero)


def attached_and_plain_fsdp(model: Any, batch: dict[str, Any], port: int, mesh: Any = None) -> tuple[dict[str, Callable[[int], None]], Any]:
    """``attach-fsdp``: the user's loop on a model sharded with FSDP2 (each decoder layer, then the
    root), attached, against an identical sharded model without it; on ``mesh`` where given
    (``attach-hsdp``: 2-D)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    models = {}
    for mode in ("watched", "plain"):
        sharded = copy.deepcopy(model)
        for layer in next(m for m in sharded.modules() if isinstance(m, nn.ModuleList)):
            fully_shard(layer, mesh=mesh)
        models[mode] = fully_shard(sharded, mesh=mesh)
    return users_steps_one_attached(models, batch, port)


def users_steps_one_attached(models: dict[str, Any], batch: dict[str, Any], port: int,
                             zero: bool = False) -> tuple[dict[str, Callable[[int], None]], Any]:
    """A user's step (forward, backward, AdamW) for each of the two models, the ``watched`` one
    attached: nothing in the step is ddpwatch's. ``zero``: AdamW sharded by PyTorch's
    ``ZeroRedundancyOptimizer``, the unwatched copy stepped inside a pause of the watched loop:
    on the same thread, in the watched loop's step, its broadcasts would be timed as that loop's
    (the pause's two marks fall in the unwatched copy's time, against it). Returns the steps and the attachment, which the caller
    detaches once they are timed."""
    import torch

    import instrumented_ddp

    def optimizer_of(model: Any) -> Any:
        if zero:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            return ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-4)
        return torch.optim.AdamW(model.parameters(), lr=1e-4)

    optimizers = {mode: optimizer_of(models[mode]) for mode in models}
    attachment = instrumented_ddp.attach(models["watched"], optimizers["watched"], address=f"tcp://127.0.0.1:{port}")

    def user_step(mode: str, _step: int) -> None:
        models[mode](**batch).loss.backward()
        optimizers[mode].step()
        optimizers[mode].zero_grad(set_to_none=False)

    def unwatched_step_in_a_pause(step: int) -> None:
        with attachment.paused("the unwatched copy's step"):
            user_step("plain", step)

    steps: dict[str, Callable[[int], None]] = {mode: functools.partial(user_step, mode) for mode in models}
    if zero:
        steps["plain"] = unwatched_step_in_a_pause
    return steps, attachment


def marked_train_step(wrapped: Any, timeline: Any, optimizer: Any, batch: dict[str, Any], step: int, strategy: str) -> Any:
    """One step as train.py marks it, up to its end: forward, backward, the gradient sync and the
    optimizer. Returns the loss; the caller ends the step with what it measures."""
    timeline.begin_step(step, strategy, {})
    loss = wrapped(**batch).loss
    with timeline.phase("backward"):
        loss.backward()
    wrapped.finish_gradient_sync()
    with timeline.phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    return loss


#: The user's own loops the bench times against themselves unattached (``attached_and_plain_*``).
ATTACH_KINDS = ("attach", "attach-zero", "attach-fsdp", "attach-hsdp")


def main(argv: list[str] | None = None) -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40, help="timed steps per mode and strategy")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--model", default="tiny", choices=["tiny", "small"], help="built-in shapes (instrumented_ddp/training/models.py)")
    parser.add_argument("--ranks", type=int, default=2, help="processes (not --nproc: torchrun 2.11 reads that as its own --nproc-per-node)")
    parser.add_argument("--port", type=int, default=5599, help="where no dashboard listens")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--strategies", default="simple,ga,hook,async,bucket,ddp,attach",
                        help="comma-separated; 'attach' is a user's own DDP loop with instrumented_ddp.attach, "
                             "'attach-zero' the same stepping torch's ZeroRedundancyOptimizer, "
                             "'attach-fsdp' the same on FSDP2, 'attach-hsdp' on FSDP2's 2-D mesh of 2 replicas")
    parser.add_argument("--block", type=int, default=5, help="steps per alternating block on a GPU")
    parser.add_argument("--a-a", action="store_true", help="both copies unwatched: the bench's own noise floor")
    parser.add_argument("--listener", action="store_true",
                        help="a `ddpwatch record` listens at --port (as a dashboard would): the reports are encoded and sent")
    args = parser.parse_args(argv)
    if problem := arguments_problem(args):
        parser.error(problem)
    if "RANK" in os.environ:
        measure(args)
        return
    if not args.listener:
        relaunch_on_ranks(["-m", MODULE], args.ranks, argv)
    with tempfile.TemporaryDirectory(prefix="overhead-listener-") as out:
        listener = subprocess.Popen([sys.executable, "-m", "ddpwatch", "record", "--listen", f"tcp://127.0.0.1:{args.port}",
                                     "--out", out, "--idle-exit", "600"], stdout=subprocess.DEVNULL)
        try:
            relaunch_on_ranks(["-m", MODULE], args.ranks, argv)
        finally:
            listener.send_signal(signal.SIGINT)  # it writes its exports and exits
            try:
                listener.wait(60)
            except subprocess.TimeoutExpired:
                listener.kill()


def arguments_problem(args: argparse.Namespace) -> str | None:
    """What is wrong with the bench's arguments, in one line, or None: refused before any rank
    starts (a strategy it does not know would fail on every rank, a traceback each; ``--steps 0``
    would time a step anyway)."""
    for flag in ("steps", "micro_batch", "seq_len", "ranks", "block"):
        if getattr(args, flag) < 1:
            return f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}"
    if not 0 < args.port < 65536:
        return f"--port must be a TCP port, 1-65535, not {args.port}"
    strategies = args.strategies.split(",")
    unknown = [name for name in strategies if name not in (*STRATEGY_NAMES, *ATTACH_KINDS)]
    if unknown:
        return (f"--strategies: unknown {', '.join(map(repr, unknown))}; choose from "
                f"{', '.join((*STRATEGY_NAMES, *ATTACH_KINDS))}")
    if args.a_a and set(ATTACH_KINDS) & set(strategies):
        return "--a-a compares two unwatched copies of a strategy; attach has none: leave it out of --strategies"
    return None


def relaunch_on_ranks(target: list[str], ranks: int, arguments: list[str] | None = None) -> NoReturn:
    """Run ``target`` (a script's path, or ``-m`` and a module) with ``arguments`` (default: this
    process's) under torchrun on ``ranks`` processes, one thread each (the ranks share the
    machine's cores), and exit with its status."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               *target, *(sys.argv[1:] if arguments is None else arguments)]
    sys.exit(subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS="1")).returncode)


if __name__ == "__main__":
    main()
