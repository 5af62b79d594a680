"""
A PyTorch Lightning ``Trainer`` watched by ddpwatch: one callback in its ``callbacks``.

    ddpwatch &                                                       # the dashboard, listening
    torchrun --nproc-per-node 2 examples/lightning_ddp.py            # CPU (gloo) or one GPU per rank (NCCL)
    torchrun --nproc-per-node 2 examples/lightning_ddp.py --grad-accum 2 --bucket-mb 1
    torchrun --nproc-per-node 2 examples/lightning_ddp.py --eval-every 50   # validations: pauses, not data
    torchrun --nproc-per-node 2 examples/lightning_ddp.py --fsdp2           # FSDP2 through ModelParallelStrategy

The model is plain_ddp.py's ToyModel in a LightningModule; the data is random, the same on every
run, and no file is written (no logger, no checkpoints). Needs the lightning extra
(``pip install 'ddpwatch[lightning]'``).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.pytorch.strategies import ModelParallelStrategy, Strategy

from instrumented_ddp.distributed import exit_process
from instrumented_ddp.integrations import DDPWatchLightningCallback
from instrumented_ddp.wire.messages import bucket_mb_problem
from instrumented_ddp.wire.output_paths import outputs_problem


class ToyModel(pl.LightningModule):
    """plain_ddp.py's MLP (10 inputs, ``layers`` hidden layers of ``width``, 5 outputs) trained
    with SGD on the mean squared error; under ``ModelParallelStrategy`` each linear layer and the
    network holding them are FSDP2 units."""

    def __init__(self, width: int, layers: int, lr: float = 0.001) -> None:
        super().__init__()
        hidden = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())]
        self.net = nn.Sequential(nn.Linear(10, width), nn.ReLU(), *hidden, nn.Linear(width, 5))
        self.lr = lr

    def configure_model(self) -> None:
        """Under ``--fsdp2`` (``ModelParallelStrategy``): each layer, then the network holding them, sharded with FSDP2."""
        strategy = self.trainer.strategy
        if isinstance(strategy, ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            mesh = strategy.device_mesh["data_parallel"]
            for layer in self.net:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.net(inputs)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, labels = batch
        loss = nn.functional.mse_loss(self(inputs), labels)
        self.log("train_loss", loss)  # the dashboard reads the loss training_step returns
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        inputs, labels = batch
        self.log("val_loss", nn.functional.mse_loss(self(inputs), labels), sync_dist=True)  # sent to the Loss tab

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


class DDPBuckets(pl.Callback):
    """What ddpwatch's all-reduces per step should match: DDP's own buckets, read at the end of
    training, before Lightning unwraps the model."""

    def __init__(self) -> None:
        self.sizes = ""

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if isinstance(trainer.strategy.model, DistributedDataParallel):
            logged = trainer.strategy.model._get_ddp_logging_data()
            self.sizes = str(logged.get("rebuilt_bucket_sizes") or logged["bucket_sizes"])


def random_batches(samples: int, seed: int) -> TensorDataset:
    """``samples`` random inputs and targets, the same for a ``seed`` on every rank and every run."""
    data = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(samples, 10, generator=data), torch.randn(samples, 5, generator=data))


def main() -> None:
    parser = argparse.ArgumentParser(description="A PyTorch Lightning Trainer watched by ddpwatch")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (the Trainer's max_steps)")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank, per micro-step")
    parser.add_argument("--grad-accum", type=int, default=1, help="the Trainer's accumulate_grad_batches (no_sync before the last)")
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=float, default=25.0, help="DDP's bucket_cap_mb")
    parser.add_argument("--eval-every", type=int, default=0, metavar="N",
                        help="validate 8 held-out batches every N optimizer steps, a pause of training (default 0: never)")
    parser.add_argument("--fsdp2", action="store_true",
                        help="shard with FSDP2's fully_shard through Lightning's ModelParallelStrategy instead of DDP")
    parser.add_argument("--watch", default=None, metavar="ADDRESS",
                        help="where ddpwatch listens (default: DDPWATCH_ADDRESS, else ddpwatch's own default)")
    parser.add_argument("--no-watch", action="store_true", help="the same Trainer without the callback")
    parser.add_argument("--save-final", default=None, metavar="FILE", help="rank 0 saves the final parameters here")
    args = parser.parse_args()
    for flag in ("steps", "batch_size", "grad_accum", "width", "layers"):  # one line, exit 2, before any process group
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1, not {getattr(args, flag)}")
    if args.eval_every < 0:
        parser.error(f"--eval-every must be 0 (never) or more, not {args.eval_every}")
    if problem := bucket_mb_problem(args.bucket_mb, "--bucket-mb"):
        parser.error(problem)
    if problem := outputs_problem(None, args.save_final):  # else a traceback after the last step
        parser.error(problem)

    # Quiet: Lightning's notes on the hardware, the ranks and the small data loader, not the run's.
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", message=r".*(does not have many workers|LeafSpec|no `val_dataloader`).*")
    ranks, per_node = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    strategy: str | Strategy = "auto"  # python, not torchrun: one process, no DDP (the callback says so)
    if args.fsdp2:
        strategy = ModelParallelStrategy(data_parallel_size=ranks, tensor_parallel_size=1)
    elif ranks > 1:
        from lightning.pytorch.strategies import DDPStrategy

        strategy = DDPStrategy(bucket_cap_mb=args.bucket_mb)
    buckets = DDPBuckets()
    callbacks: list[pl.Callback] = [buckets]
    if not args.no_watch:
        callbacks.append(DDPWatchLightningCallback(address=args.watch))  # <- ddpwatch
    trainer = pl.Trainer(
        accelerator="auto", devices=per_node, num_nodes=max(ranks // per_node, 1), strategy=strategy,
        max_steps=args.steps, accumulate_grad_batches=args.grad_accum, callbacks=callbacks,
        val_check_interval=args.eval_every * args.grad_accum if args.eval_every else None,  # in batches
        check_val_every_n_epoch=None if args.eval_every else 1, limit_val_batches=8 if args.eval_every else 0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    torch.manual_seed(0)  # the same weights on every rank (DDP would broadcast rank 0's; FSDP2 shards what each built)
    model = ToyModel(args.width, args.layers)
    # One epoch longer than the run: validation comes only every --eval-every steps, never at an epoch's end.
    train = DataLoader(random_batches((args.steps * args.grad_accum + 1) * args.batch_size * ranks, seed=1), batch_size=args.batch_size)
    held_out = DataLoader(random_batches(8 * args.batch_size * ranks, seed=1000), batch_size=args.batch_size)
    trainer.fit(model, train, held_out if args.eval_every else None)

    final = {name: value.full_tensor() if hasattr(value, "full_tensor") else value  # FSDP2's DTensor shards, gathered
             for name, value in model.state_dict().items()} if args.save_final else {}  # by every rank, in one order
    if trainer.is_global_zero:
        if buckets.sizes:
            print(f"DDP reduced gradients in {len(buckets.sizes.split(','))} bucket(s) of {buckets.sizes} bytes")
        if args.save_final:
            torch.save(final, args.save_final)
    if dist.is_initialized():  # one process (python, not torchrun): Lightning made no group
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    exit_process(0)  # skips a gloo teardown race at interpreter exit (see instrumented_ddp.distributed)


if __name__ == "__main__":
    main()
