"""
A Hugging Face ``Trainer`` watched by ddpwatch: one ``add_callback`` line.

    ddpwatch &                                                    # the dashboard, listening
    torchrun --nproc_per_node=2 examples/hf_trainer.py            # CPU (gloo) or one GPU per rank
    torchrun --nproc_per_node=2 examples/hf_trainer.py --grad-accum 2 --bucket-mb 1
    torchrun --nproc_per_node=2 examples/hf_trainer.py --eval-every 10        # evaluations: pauses, not data
    torchrun --nproc_per_node=2 examples/hf_trainer.py --fsdp                 # FSDP2 through the Trainer (GPUs)

The model is ddpwatch's tiny SmolLM2-shaped classifier and the data its built-in reviews, so it
runs offline; swap in your own model and dataset, the callback line stays the same.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import datasets
import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import EvalPrediction, Trainer, TrainerCallback, TrainingArguments

from instrumented_ddp.training import data
from instrumented_ddp.training import data_cache
from instrumented_ddp.training import models
from instrumented_ddp.distributed import exit_process
from instrumented_ddp.integrations import DDPWatchCallback
from instrumented_ddp.wire.output_paths import outputs_problem
from instrumented_ddp.wire.messages import bucket_mb_problem
from instrumented_ddp.wire.endpoints import DEFAULT_ADDRESS


def accuracy(prediction: EvalPrediction) -> dict[str, float]:
    """The share of held-out reviews whose stars the model got right: the Trainer logs it as
    ``eval_accuracy``, and the callback sends it beside ``eval_loss`` (chance: 0.2)."""
    return {"accuracy": float((prediction.predictions.argmax(-1) == prediction.label_ids).mean())}


class ProfileSteps(TrainerCallback):
    """torch.profiler over optimizer steps 4-8, one trace per rank (to hold ddpwatch against)."""

    def __init__(self, directory: str) -> None:
        rank = int(os.environ.get("RANK", "0"))
        self.profiler = torch.profiler.profile(
            schedule=torch.profiler.schedule(wait=2, warmup=1, active=5, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(directory, worker_name=f"rank{rank}"))

    def on_train_begin(self, *args: object, **kwargs: object) -> None:
        self.profiler.start()

    def on_step_end(self, *args: object, **kwargs: object) -> None:
        self.profiler.step()

    def on_train_end(self, *args: object, **kwargs: object) -> None:
        self.profiler.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description="A Hugging Face Trainer watched by ddpwatch")
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="per rank, per micro-step")
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=None, help="DDP's bucket_cap_mb (default: DDP's 25)")
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="evaluate the 200 held-out reviews every N optimizer steps (eval_strategy='steps'; default 0: never)")
    parser.add_argument("--watch", default=DEFAULT_ADDRESS, metavar="ADDRESS", help="where ddpwatch listens")
    parser.add_argument("--no-watch", action="store_true", help="the same Trainer without the callback")
    parser.add_argument("--save-final", default=None, metavar="FILE", help="rank 0 saves the final parameters here")
    parser.add_argument("--profile", default=None, metavar="DIR", help="torch.profiler traces of steps 4-8, one per rank")
    parser.add_argument("--fsdp", action="store_true",
                        help="shard with FSDP2 through the Trainer's own fsdp_config (one unit per decoder layer); GPUs only")
    args = parser.parse_args()
    for flag in ("steps", "batch_size", "grad_accum"):  # one line, exit 2, before any process group, as train.py
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
    if args.eval_every < 0:
        parser.error(f"--eval-every must be 0 (never) or more, not {args.eval_every}")
    if args.bucket_mb is not None and (problem := bucket_mb_problem(args.bucket_mb, "--bucket-mb")):
        parser.error(problem)
    if problem := outputs_problem(args.profile, args.save_final):  # else a traceback at step 8 or after the last step
        parser.error(problem)
    if args.fsdp and args.bucket_mb is not None:
        parser.error("--bucket-mb is DDP's bucket cap: FSDP has no buckets (it gathers and reduces one unit at a time)")
    if args.fsdp and not torch.cuda.is_available():  # Accelerate takes FSDP only in its GPU branch: this would be DDP
        parser.error("--fsdp needs CUDA: Accelerate shards with FSDP only on GPUs (on the CPU the Trainer would train with DDP)")

    datasets.disable_progress_bars()
    # train.py's built-in reviews (kept on disk after the first run): 2000 to train on, 200 held out
    tokenized, tokenizer, problem = data_cache.builtin_reviews_tokenized(0, 64, data_cache.cache_folder())
    if problem and int(os.environ.get("RANK", "0")) == 0:  # only slower: said once, as train.py says it
        print(f"hf_trainer.py: note: {problem}", file=sys.stderr)
    tokenized = datasets.DatasetDict(train=tokenized["train"].select(range(2000)), test=tokenized["test"].select(range(200)))
    torch.manual_seed(0)
    model = models.build_built_in_model("tiny", len(tokenizer), data.NUM_LABELS, tokenizer.pad_token_id)

    scratch = tempfile.TemporaryDirectory(prefix="hf_trainer_")  # the Trainer wants an output_dir; it saves nothing here
    training = TrainingArguments(
        output_dir=scratch.name, max_steps=args.steps, learning_rate=5e-4,
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        ddp_bucket_cap_mb=args.bucket_mb, ddp_find_unused_parameters=False,  # every parameter gets a gradient
        use_cpu=not torch.cuda.is_available(),
        **({"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}} if args.fsdp else {}),  # units: _no_split_modules
        save_strategy="no", eval_strategy="steps" if args.eval_every else "no", eval_steps=args.eval_every or None,
        per_device_eval_batch_size=args.batch_size, report_to=[], logging_steps=max(1, args.steps // 10), disable_tqdm=True, seed=0,
    )
    trainer = Trainer(model=model, args=training, train_dataset=tokenized["train"],
                      eval_dataset=tokenized["test"] if args.eval_every else None, compute_metrics=accuracy)
    if not args.no_watch:
        trainer.add_callback(DDPWatchCallback(trainer, address=args.watch))  # <- ddpwatch
    if args.profile:
        trainer.add_callback(ProfileSteps(args.profile))
    trainer.train()

    rank = int(os.environ.get("RANK", "0"))
    final = {name: value.full_tensor() if hasattr(value, "full_tensor") else value  # FSDP2's DTensor shards, gathered
             for name, value in model.state_dict().items()} if args.save_final else {}  # by every rank, in one order
    if rank == 0:
        if isinstance(trainer.model_wrapped, DistributedDataParallel):  # one process: the Trainer builds none
            logged = trainer.model_wrapped._get_ddp_logging_data()  # what ddpwatch's all-reduces should match
            sizes = logged.get("rebuilt_bucket_sizes") or logged["bucket_sizes"]
            print(f"DDP reduced gradients in {len(sizes.split(','))} bucket(s) of {sizes} bytes")
        elif args.fsdp:  # each unit: one all-gather before its forward, one before its backward, one reduce-scatter
            units = sum(type(module).__name__.startswith("FSDP") for module in trainer.model_wrapped.modules())
            print(f"FSDP2 sharded the model in {units} unit(s)")
        if args.save_final:
            torch.save(final, args.save_final)
    if torch.distributed.is_initialized():  # one process (python, not torchrun): the Trainer made no group
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    scratch.cleanup()  # exit_process skips the interpreter's own cleanup
    sys.stdout.flush()
    exit_process(0)  # skips a gloo teardown race at interpreter exit (see instrumented_ddp.distributed)


if __name__ == "__main__":
    main()
