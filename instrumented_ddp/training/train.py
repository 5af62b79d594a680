"""
Train a small transformer with one of nine data-parallel strategies, watched by ddpwatch.

    python train.py                                           # one process, CPU or one GPU
    torchrun --nproc_per_node=2 train.py --strategy async     # two ranks on this machine
    torchrun --nproc_per_node=4 train.py --strategy bucket --bucket-mb 5 --grad-accum 2
    # two nodes: run on each, with its --node_rank
    torchrun --nnodes=2 --node_rank=0 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=HOST:29500 train.py --strategy ddp
    torchrun --nproc_per_node=2 -m instrumented_ddp.training.train     # the same script, from an installed ddpwatch

The default model is SmolLM2's architecture shrunk to ~2.4 M parameters and the default data a
generated Yelp-style review set, so a fresh machine trains at once; --model and --dataset take
real Hugging Face names. Every run ends by checking that all ranks hold identical parameters.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import sys
import time
from contextlib import nullcontext
from typing import TYPE_CHECKING, Iterator

import torch

import instrumented_ddp
from instrumented_ddp.distributed import DistributedContext, exit_process, init_distributed, resolve_device, shutdown_distributed
from instrumented_ddp.resources.memory import MemorySampler, reset_peak
from instrumented_ddp.wire.one_line_errors import OneLineErrorParser
from instrumented_ddp.wire.output_paths import outputs_problem
from instrumented_ddp.wire.messages import bucket_mb_problem
from instrumented_ddp.publish.watch_environment import (
    WatchEnvironmentError, unwatched_blocks, watch_address, watch_key_file, watching_disabled)
from instrumented_ddp.wire.endpoints import DEFAULT_ADDRESS, address_problem, is_loopback
from instrumented_ddp.wire.curve_keys import load_client_keys
from instrumented_ddp.training.replicas import gather_digests, ranks_that_differ
from instrumented_ddp.publish.stop_signals import held, hold_ctrl_c, stop_on_sigterm
from instrumented_ddp.strategies import strategy_class
from instrumented_ddp.publish.watch import Watch, parameter_layout, parameter_rows

if TYPE_CHECKING:
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import PreTrainedTokenizerBase

    from instrumented_ddp.wire.messages import SwitchCommand
    from instrumented_ddp.strategies.base import DataParallelStrategy


def build_parser() -> argparse.ArgumentParser:
    """train.py's options (the docs' command-line reference is written from this parser)."""
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--strategy", default="async", choices=instrumented_ddp.STRATEGY_NAMES, help="default async")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=16, help="global batch per optimizer step")
    parser.add_argument("--grad-accum", type=int, default=None, help="micro-steps per optimizer step (default 2 for ga, else 1)")
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="bucket cap, MB, for bucket, ddp, zero1 and zero2")
    parser.add_argument("--lr", type=float, default=5e-4, help="AdamW's learning rate")
    parser.add_argument("--seed", type=int, default=0, help="the model's initialisation and the data's shuffle")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--model", default="tiny", help="'tiny' (~2.4 M parameters), 'small' (SmolLM2-135M's shape, ~106 M), or a Hugging Face name or local path")
    parser.add_argument("--dataset", default="builtin", help="'builtin', 'yelp_review_full', or a local path")
    parser.add_argument("--max-length", type=int, default=64, help="tokens per example")
    parser.add_argument("--eval-examples", type=int, default=None, metavar="N",
                        help="held-out examples evaluated after training (default: the whole test split; 0: no eval)")
    parser.add_argument("--log-every", type=int, default=10, help="rank 0 prints loss and samples/s every N steps")
    parser.add_argument("--save-final", default=None, help="rank 0 writes the final state_dict here")
    parser.add_argument("--watch", default=None, metavar="ADDRESS",
                        help=f"where ddpwatch listens (default: $DDPWATCH_ADDRESS, else {DEFAULT_ADDRESS})")
    parser.add_argument("--watch-key", default=None, metavar="FILE",
                        help="CURVE client keys (client.json) of a dashboard beyond loopback (default: $DDPWATCH_KEY)")
    parser.add_argument("--no-watch", action="store_true", help="no timing, no telemetry (also: DDPWATCH_DISABLE=1)")
    parser.add_argument("--unwatched", default=None, metavar="EVERY[:LENGTH]",
                        help="every EVERY steps, LENGTH steps (default 4) run unwatched, so the run measures what "
                             "watching costs it (default 100:4, also: DDPWATCH_UNWATCHED; 0: off)")
    parser.add_argument("--profile", default=None, metavar="DIR", help="torch.profiler traces of steps 4-8 (TensorBoard/HTA format)")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.grad_accum is None:
        args.grad_accum = 2 if args.strategy == "ga" else 1
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    for flag in ("steps", "batch_size", "grad_accum", "max_length", "log_every"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.eval_examples is not None and args.eval_examples < 0:
        parser.error("--eval-examples must be 0 or more")
    if not (math.isfinite(args.lr) and args.lr >= 0):  # nan or inf would train on to nan parameters, silently
        parser.error(f"--lr must be a finite number, 0 or more, not {args.lr:g}")
    if problem := bucket_mb_problem(args.bucket_mb, "--bucket-mb"):
        parser.error(problem)
    args.watch, args.watch_key = watch_address(args.watch), watch_key_file(args.watch_key)
    try:
        args.no_watch = args.no_watch or watching_disabled()
        args.unwatched_blocks = unwatched_blocks(args.unwatched)
    except WatchEnvironmentError as error:
        parser.error(str(error))
    args.watch_keys = None
    if not args.no_watch and (problem := address_problem(args.watch)):
        parser.error(f"--watch: {problem}")
    if args.watch_key and not args.no_watch:
        try:
            args.watch_keys = load_client_keys(args.watch_key)
        except ValueError as error:
            parser.error(str(error))
    elif not args.no_watch and not is_loopback(args.watch):
        parser.error(f"--watch {args.watch} is not loopback: pass --watch-key FILE (the dashboard's client.json)")
    if problem := accumulation_problem(args.batch_size, world_size, args.grad_accum):
        parser.error(f"--{problem}")
    if problem := unavailable_strategy(args.strategy):
        parser.error(f"--strategy {problem}")
    # here, not as a traceback when the profiler writes at step 8 or the state_dict after the last step
    if problem := outputs_problem(args.profile, args.save_final):
        parser.error(problem)
    try:  # init_distributed's own rule, checked here before any process group (there it is a traceback)
        resolve_device(args.device, 0)
    except ValueError as error:
        parser.error(str(error))
    return args


def unavailable_strategy(name: str) -> str | None:
    """Why this torch cannot run the strategy ``name``, None where it can (``fsdp`` needs FSDP2's
    custom comms, torch 2.9): a one-line error at start, a refused switch mid-run."""
    try:
        strategy_class(name)
    except ImportError as error:
        return str(error)
    return None


def accumulation_problem(batch_size: int, world_size: int, grad_accum: int) -> str | None:
    """Each rank splits its share of the global batch into ``grad_accum`` equal micro-batches.

    The message names the two nearest batch sizes that do divide: the default 16 on three ranks is
    the first thing a user launching ``--nproc_per_node=3`` meets.
    """
    if grad_accum < 1:
        return f"grad-accum must be at least 1, not {grad_accum}"
    multiple = world_size * grad_accum
    if batch_size % multiple:
        below, above = batch_size - batch_size % multiple, batch_size - batch_size % multiple + multiple
        nearest = f"{below} or {above}" if below else f"{above}"
        return (f"batch-size {batch_size} does not divide by world size {world_size} x grad-accum {grad_accum}: "
                f"use a multiple of {multiple} ({nearest})")
    return None


def load_model_and_data(args: argparse.Namespace, context: DistributedContext,
                        ) -> tuple[torch.nn.Module, DataLoader, DataLoader, DistributedSampler]:
    """Tokenizer, model and loaders; every rank builds the same ones (the data is deterministic)."""
    import datasets

    from instrumented_ddp.training import data
    from instrumented_ddp.training import data_cache
    from instrumented_ddp.training import models

    datasets.disable_progress_bars()
    tokenizer: PreTrainedTokenizerBase
    if args.dataset == "builtin" and args.model in models.BUILT_IN_SHAPES:  # the same every run: kept on disk
        tokenized, tokenizer, problem = data_cache.builtin_reviews_tokenized(args.seed, args.max_length, data_cache.cache_folder())
        if problem and context.is_main:
            print(f"train.py: note: {problem}", file=sys.stderr)
        torch.manual_seed(args.seed)
        model = models.build_built_in_model(args.model, len(tokenizer), data.NUM_LABELS, tokenizer.pad_token_id)
    elif args.model in models.BUILT_IN_SHAPES:
        reviews = data.load_reviews(args.dataset, seed=args.seed)
        torch.manual_seed(args.seed)
        tokenizer = data.build_tokenizer(reviews["train"]["text"])
        model = models.build_built_in_model(args.model, len(tokenizer), data.NUM_LABELS, tokenizer.pad_token_id)
        tokenized = data.tokenize_reviews(reviews, tokenizer, args.max_length)
    else:  # the model first: one that cannot be loaded is said before the data is built or fetched
        torch.manual_seed(args.seed)
        bundle = models.load_pretrained(args.model, data.NUM_LABELS)
        model, tokenizer = bundle.model, bundle.tokenizer
        reviews = data.load_reviews(args.dataset, seed=args.seed)
        tokenized = data.tokenize_reviews(reviews, tokenizer, args.max_length)
    if args.eval_examples is not None:  # the first N: yelp's test split is 50,000 reviews, long to evaluate on a CPU
        tokenized["test"] = tokenized["test"].select(range(min(args.eval_examples, len(tokenized["test"]))))
    rank_batch = args.batch_size // context.world_size  # split into --grad-accum micro-batches per step
    train_loader, eval_loader, sampler = data.make_loaders(tokenized, rank_batch, context.rank, context.world_size, args.seed,
                                                           pin_memory=context.device.type == "cuda")
    return model.to(context.device), train_loader, eval_loader, sampler


def endless(loader: DataLoader, sampler: DistributedSampler) -> Iterator[dict[str, torch.Tensor]]:
    """Batches forever, reshuffling each epoch the same way on every rank."""
    epoch = 0
    while True:
        sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader: DataLoader, device: torch.device) -> tuple[float, float]:
    """Accuracy and mean loss over every rank's held-out examples."""
    model.eval()
    counts = torch.zeros(3, dtype=torch.float64, device=device)  # right, examples, summed loss
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        output = model(**batch)
        predictions = output.logits.argmax(dim=-1)
        counts += torch.stack([(predictions == batch["labels"]).sum().double(), torch.tensor(float(len(predictions)), device=device,
                               dtype=torch.float64), output.loss.double() * len(predictions)])
    torch.distributed.all_reduce(counts)
    model.train()
    right, examples, loss = counts.tolist()
    return right / examples, loss / examples


def switch_strategy(model: DataParallelStrategy, optimizer: torch.optim.Optimizer, command: SwitchCommand, args: argparse.Namespace,
                    context: DistributedContext, watch: Watch) -> tuple[DataParallelStrategy, torch.optim.Optimizer, str]:
    """Re-wrap the model at this optimizer-step boundary, with a new optimizer holding the old
    one's state (gathered from shards or scattered to them); every rank runs this with the same command."""
    # ``is None``, not falsiness: a cap or micro-step count of 0 is refused in the acknowledgement, not applied as the old one
    grad_accum = command.grad_accum if command.grad_accum is not None else (
        2 if command.strategy == "ga" and args.grad_accum == 1 else args.grad_accum)
    bucket_mb = command.bucket_mb if command.bucket_mb is not None else args.bucket_mb
    problem = (
        f"unknown strategy {command.strategy!r}" if command.strategy not in instrumented_ddp.STRATEGY_NAMES
        else unavailable_strategy(command.strategy)
        or accumulation_problem(args.batch_size, context.world_size, grad_accum)
        or bucket_mb_problem(bucket_mb)
    )
    if problem:
        watch.acknowledge(command, False, watch.steps + 1, problem)
        return model, optimizer, f"switch to {command.strategy} refused: {problem}"
    carried = model.full_optimizer_state()  # Adam's moments, whole, whichever strategy sharded them
    bare = instrumented_ddp.unwrap(model)  # every earlier step already finished its communication
    model = instrumented_ddp.wrap(bare, command.strategy, bucket_mb=bucket_mb, timeline=watch.timeline)
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=args.lr, state=carried)
    args.strategy, args.bucket_mb, args.grad_accum = command.strategy, bucket_mb, grad_accum
    watch.update_hello(strategy=command.strategy, settings={"grad_accum": grad_accum, "bucket_mb": bucket_mb},
                       bucket_layout=getattr(model, "bucket_layout", []))
    watch.acknowledge(command, True, watch.steps + 1)
    return model, optimizer, f"switched to {command.strategy} (bucket_mb={bucket_mb:g}, grad_accum={grad_accum})"


def free_the_strategy_before(device: torch.device) -> None:
    """After a switch, once only the new strategy is held: free what the old one left in reference
    cycles (FSDP2 keeps its sharded copy in torch's own) with one full collection, then start the
    new strategy's allocator peak (the memory column's, on a GPU) there. Its wrap starts one while
    the old strategy and the gathered optimizer state are still allocated beside it, a peak that
    would read the switch, not the strategy's own steps."""
    gc.collect()
    reset_peak(device)


def loss_text(watch: Watch, loss: torch.Tensor, grad_accum: int) -> str:
    """A watched run prints the loss of its latest resolved step report, which costs nothing;
    ``.item()`` on a CUDA loss makes the host wait for the GPU, so only unwatched runs pay it."""
    if watch.latest_loss is not None:
        step, value = watch.latest_loss
        return f"loss {value:.4f} (rank 0, step {step})"
    if watch.publisher is not None:
        return "loss pending (rank 0)"
    return f"loss {loss.item() * grad_accum:.4f} (rank 0)"


def start_profiler(directory: str, context: DistributedContext) -> torch.profiler.profile:
    """PyTorch's own profiler over steps 4-8, one trace per rank, to hold ddpwatch's figures against."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if context.device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    profiler = torch.profiler.profile(
        activities=activities,
        schedule=torch.profiler.schedule(wait=2, warmup=1, active=5, repeat=1),
        on_trace_ready=torch.profiler.tensorboard_trace_handler(directory, worker_name=f"rank{context.rank}"),
    )
    profiler.start()
    return profiler


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()  # torchrun's stop of the ranks left: an exception, so the watch sends what it holds and why
    hold_ctrl_c()  # a Ctrl-C as a step's report is sent: raised once it is sent
    context = init_distributed(args.device)
    say = print if context.is_main else (lambda *a, **k: None)
    try:
        model, train_loader, eval_loader, sampler = load_model_and_data(args, context)
    except RuntimeError as error:  # DataUnavailableError, ModelUnavailableError: one line each
        print(f"train.py: error: {error}", file=sys.stderr)
        shutdown_distributed()
        return 2
    watch = Watch.disabled() if args.no_watch else Watch.start(args.watch, context, {
        "strategy": args.strategy, "settings": {"grad_accum": args.grad_accum, "bucket_mb": args.bucket_mb},
        "model_parameters": sum(p.numel() for p in model.parameters()), "parameter_layout": parameter_layout(model), "parameter_rows": parameter_rows(model),
        "total_steps": args.steps, "global_batch": args.batch_size,
    }, keys=args.watch_keys, unwatched=args.unwatched_blocks)
    timeline = watch.timeline
    parameters = sum(p.numel() for p in model.parameters())  # before a sharded strategy holds them
    model = instrumented_ddp.wrap(model, args.strategy, bucket_mb=args.bucket_mb, timeline=timeline)
    layout = getattr(model, "bucket_layout", [])
    watch.update_hello(bucket_layout=layout)
    layout_sent = bool(layout)  # ddp's comes a few steps in
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=args.lr)  # the sharded strategies shard it
    batches = endless(train_loader, sampler)
    memory = MemorySampler()  # bytes held per rank, every few steps, for the memory columns
    profiler = start_profiler(args.profile, context) if args.profile else None
    say(
        f"{args.strategy}: {context.world_size} rank(s) on {context.device.type} ({context.backend}), "
        f"{parameters / 1e6:.2f} M parameters, global batch {args.batch_size} "
        f"in {args.grad_accum} micro-step(s); " + ("not watched" if args.no_watch else f"streaming to {args.watch}")
    )

    started = last_log = time.perf_counter()
    last_logged_step = 0
    with watch.sends_failure():  # a dead peer, torchrun's SIGTERM: what was queued still goes out
        for step in range(1, args.steps + 1):
            command = watch.agree_on_command()  # a switch asked for from ddpwatch, the same on every rank
            if command is not None:
                model, optimizer, detail = switch_strategy(model, optimizer, command, args, context, watch)
                free_the_strategy_before(context.device)
                layout_sent = bool(getattr(model, "bucket_layout", []))
                say(f"step {step}: {detail}")
            timeline.begin_step(step, model.name, {**model.settings, "grad_accum": args.grad_accum})
            with timeline.phase("data"):
                rank_batch = next(batches)
                samples, tokens = len(rank_batch["labels"]), int(rank_batch["attention_mask"].sum())
                rank_batch = {k: v.to(context.device, non_blocking=True) for k, v in rank_batch.items()}
            for micro in range(args.grad_accum):
                batch = {k: v.chunk(args.grad_accum)[micro] for k, v in rank_batch.items()}
                skip_sync = micro < args.grad_accum - 1 and not model.syncs_every_micro_step
                with model.no_sync() if skip_sync else nullcontext():
                    loss = model(**batch).loss / args.grad_accum  # forward: timed by the wrapper
                    with timeline.phase("backward"):
                        loss.backward()
                    model.finish_gradient_sync()
            with timeline.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=False)  # keeps bucket gradient views in place
            with held:  # a SIGTERM or Ctrl-C lands after the step is counted and its report queued, not between
                timeline.end_step(samples, tokens, loss.detach() * args.grad_accum, excluded=model.excluded_from_statistics,
                                  memory=memory.sample(model) if not args.no_watch else None)
                watch.step_done()
            if not layout_sent and (layout := getattr(model, "bucket_layout", [])):  # DDP rebuilt its buckets
                watch.update_hello(bucket_layout=layout)  # which parameters each b<i> holds: the advisor reads it
                layout_sent = True
            if profiler is not None:
                profiler.step()

            if context.is_main and (step % args.log_every == 0 or step == args.steps):
                now = time.perf_counter()
                rate = (step - last_logged_step) * args.batch_size / (now - last_log)  # the last line too, however few steps
                eta = (now - started) / step * (args.steps - step)
                dropped = f" | telemetry dropped {watch.dropped}" if watch.dropped else ""
                say(f"step {step}/{args.steps} | {loss_text(watch, loss, args.grad_accum)} | "
                    f"{rate:.1f} samples/s | ETA {eta:.0f}s{dropped}")
                last_log, last_logged_step = now, step
        if profiler is not None:
            profiler.stop()
        bare = instrumented_ddp.unwrap(model)  # whole parameters again, also after a sharded strategy
        if args.eval_examples == 0:
            say("eval skipped (--eval-examples 0)")
        else:
            watch.pausing = "evaluate"  # the heartbeats say so while it runs: the goodbye comes after it
            accuracy, eval_loss = evaluate(bare, eval_loader, context.device)
            watch.record_evaluation({"eval_loss": eval_loss, "eval_accuracy": accuracy})  # the Loss tab, the exports
            examples = len(eval_loader.dataset)  # type: ignore[arg-type]  # torch's Dataset type has no __len__; a datasets.Dataset has
            say(f"eval accuracy {accuracy:.3f} on {examples} held-out examples (chance 0.200), loss {eval_loss:.4f}")
        watch.refuse_commands("training has ended: no step is left to switch at")  # asked after the last step: answered
    watch.close()

    differing = ranks_that_differ(gather_digests(bare))
    if differing:
        say(f"train.py: error: parameters differ from rank 0 on rank(s) {', '.join(map(str, differing))}")
    elif context.is_main:
        say(f"parameters identical on all {context.world_size} rank(s)")
    if args.save_final and context.is_main:
        torch.save(bare.state_dict(), args.save_final)
        say(f"saved final state_dict to {args.save_final}")
    shutdown_distributed()
    return 1 if differing else 0


if __name__ == "__main__":
    exit_process(main())  # see exit_process: skips a gloo teardown race at interpreter exit
