"""ddpwatch inside a PyTorch Lightning ``Trainer``: one callback that attaches to the model it trains.

    trainer = lightning.pytorch.Trainer(strategy="ddp", callbacks=[DDPWatchLightningCallback()])
    trainer.fit(model, train_loader)

What this relies on (Lightning 2.6; ``test_lightning_callback`` pins it):

- ``DDPStrategy.setup`` wraps the LightningModule in ``DistributedDataParallel`` during ``fit``,
  as ``trainer.strategy.model``, with the optimizers (``trainer.optimizers``, torch's own, each
  stepped through a ``LightningOptimizer``) built after it; ``on_train_start`` comes after the
  sanity check's validation, before the first training batch: no backward has run, and the
  callback attaches there. At the end of ``fit`` the strategy unwraps the model again, after
  ``on_train_end``, where the callback detaches. A ``fit`` that raises calls ``on_exception``:
  detached there, the goodbye saying what it raised.
- Each ``training_step`` runs through the DDP wrapper (Lightning's ``_ForwardRedirection`` puts it
  in place of the module's ``forward``), so DDP's forward hooks see it, its ``(batch, batch_idx)``
  and the loss it returns. Under automatic optimization the forward and backward run in a closure
  inside ``optimizer.step(closure)``, which ``attach`` follows; with ``accumulate_grad_batches``
  the batches before the last of a step run under DDP's ``no_sync``, read as micro-steps.
- Manual optimization (``automatic_optimization = False``) runs ``training_step`` whole, its
  ``manual_backward`` and ``step()`` calls, inside DDP's forward, where forward, backward and
  update cannot be told apart: refused in one line before attaching.
- Validation between batches (``val_check_interval``, or at an epoch's end) runs between
  ``on_validation_start`` and ``on_validation_end``, its forwards through the DDP wrapper under
  ``no_grad``: marked a pause of training (``Attachment.pause_begins``/``pause_ends``). What it
  logged is in ``trainer.callback_metrics`` by ``on_validation_end``, as new values of the names
  it logged: those are sent (``record_evaluation``) for the dashboard's Loss tab. A checkpoint
  calls ``on_save_checkpoint`` before it writes and no hook after: its pause ends at the next
  ``on_train_batch_start`` (after that batch was fetched), or at the next validation's start.
- ``ModelParallelStrategy`` leaves the LightningModule unwrapped (``trainer.strategy.model`` is the
  module itself) and the user shards it in ``configure_model``; with FSDP2's ``fully_shard`` on the
  layers and on one module holding them, that module is the model ``attach`` watches (it runs on
  the CPU with gloo as well). ``FSDPStrategy`` wraps the model in FSDP1's
  ``FullyShardedDataParallel``, which ``attach`` does not watch: refused in one line (Lightning
  also refuses it on the CPU).
- ``trainer.estimated_stepping_batches`` (``max_steps``, or the epochs' batches over the
  accumulation) less ``trainer.global_step`` (a run resumed from a checkpoint starts there) is
  the steps the run will take, for the dashboard's progress and ETA.

Nothing here raises into training: a model the callback cannot watch gets one line on stderr,
and training goes on unwatched.
"""

from __future__ import annotations

import math
import numbers
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from instrumented_ddp.attachment.attachment import AttachError, Attachment, attach
from instrumented_ddp.attachment.disabled_watch import DisabledWatch
from instrumented_ddp.attachment.problems import compiled_module, is_fsdp2
from instrumented_ddp.publish.watch import goodbye_reason
from instrumented_ddp.wire.messages import MAX_EVALUATION_METRICS, MAX_METRIC_NAME

#: What constructing the callback says where Lightning is not installed.
NEEDS_THE_EXTRA = "ddpwatch: the Lightning callback needs the lightning extra: pip install 'ddpwatch[lightning]'"

if TYPE_CHECKING:
    from lightning.pytorch import Callback, LightningModule, Trainer

    HAS_LIGHTNING = True
else:
    try:
        from lightning.pytorch import Callback
    except ImportError:  # the lightning extra is not installed: the class still defines, and refuses to be made
        Callback, HAS_LIGHTNING = object, False
    else:
        HAS_LIGHTNING = True


class DDPWatchLightningCallback(Callback):
    """Attaches ddpwatch at ``on_train_start`` to the DDP model Lightning's ``DDPStrategy`` built
    (or the FSDP2 model a ``ModelParallelStrategy``'s ``configure_model`` sharded); detaches at
    ``on_train_end``, or at ``on_exception``; marks validations and checkpoints between steps as
    pauses of training, and sends what each validation logged. ``address`` and ``watch_key`` go
    to ``attach`` as given (None: ``DDPWATCH_ADDRESS`` and ``DDPWATCH_KEY``, else the default).
    Where there is nothing it can watch (one process, FSDP1, manual optimization, a model
    ``attach`` refuses), one line says why and training goes on unwatched. A second ``fit``
    attaches again."""

    def __init__(self, *, address: str | None = None, watch_key: str | None = None) -> None:
        if not HAS_LIGHTNING:
            raise ImportError(NEEDS_THE_EXTRA)
        super().__init__()
        self.address = address
        self.watch_key = watch_key
        self.attachment: Attachment | DisabledWatch | None = None
        self._before_validation: dict[str, Any] = {}
        self._saving = False

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.attachment is not None:  # a fit that neither ended nor raised through Lightning: its run ends here
            self.attachment.detach()
            self.attachment = None
        model, unwatched = watched_model(trainer, pl_module)
        if model is None:
            if trainer.is_global_zero:  # the Trainer's settings, the same on every rank: said once
                print(f"ddpwatch: {unwatched}: training goes on unwatched", file=sys.stderr, flush=True)
            return
        try:
            self.attachment = attach(model, list(trainer.optimizers), address=self.address, watch_key=self.watch_key,
                                     total_steps=steps_to_take(trainer))
        except AttachError as refused:  # said on each rank that got it: a key file may be missing on one node alone
            print(f"ddpwatch: {refused}: training goes on unwatched", file=sys.stderr, flush=True)
        self._saving = False

    def computing(self, what: str) -> AbstractContextManager[None]:
        """``Attachment.computing`` for the LightningModule's own compute outside its forward while
        the callback is attached (an average of the weights in ``on_train_batch_end``); where
        nothing is watched, a block that only runs."""
        return self.attachment.computing(what) if self.attachment is not None else nullcontext()

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self._save_ended()

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.attachment is None or trainer.sanity_checking:
            return
        self._save_ended()
        self.attachment.pause_begins("validate")
        self._before_validation = dict(trainer.callback_metrics)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.attachment is None or trainer.sanity_checking:
            return
        self.attachment.pause_ends("validate")
        if measured := validation_metrics(self._before_validation, trainer.callback_metrics):
            self.attachment.record_evaluation(measured)  # the Loss tab draws them beside the training loss
        self._before_validation = {}

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        if self.attachment is not None:
            self.attachment.pause_begins("save")
            self._saving = True

    def _save_ended(self) -> None:
        """A checkpoint saved since the last step: its pause ends here (Lightning has no hook after the write)."""
        if self._saving and self.attachment is not None:
            self.attachment.pause_ends("save")
        self._saving = False

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.attachment is not None:
            self.attachment.detach()
            self.attachment = None

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        if self.attachment is not None:
            self.attachment.detach(goodbye_reason(exception))
            self.attachment = None


def watched_model(trainer: Any, pl_module: Any) -> tuple[nn.Module | None, str]:
    """The model ``attach`` watches in this ``fit``, or None and why there is none, in words."""
    strategy = trainer.strategy
    model, unwatched = _model_in(strategy)
    if model is not None and not getattr(pl_module, "automatic_optimization", True):
        return None, ("manual optimization (automatic_optimization = False): Lightning runs training_step whole, its "
                      "manual_backward and step(), inside the model's forward, where ddpwatch cannot tell forward, "
                      "backward and update apart")
    return model, unwatched


def _model_in(strategy: Any) -> tuple[nn.Module | None, str]:
    """The DDP or FSDP2 model in ``strategy.model`` (under ``ModelParallelStrategy`` the one
    ``fully_shard`` root inside the LightningModule), or None and why there is none."""
    model = compiled_module(getattr(strategy, "model", None))  # torch.compile's wrapper, looked through
    if isinstance(model, DistributedDataParallel):
        return model, ""
    if isinstance(model, nn.Module) and any(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules()):
        return None, (f"Lightning's {type(strategy).__name__} wraps the model in FSDP1's FullyShardedDataParallel, which "
                      "ddpwatch cannot time: use ModelParallelStrategy and shard with FSDP2's fully_shard in "
                      "configure_model to watch it")
    if isinstance(model, nn.Module) and is_fsdp2(model):
        return model, ""
    roots = sharded_roots(model) if isinstance(model, nn.Module) else []
    if len(roots) == 1:
        return roots[0], ""
    if roots:
        return None, (f"the LightningModule holds {len(roots)} separate fully_shard roots "
                      f"({', '.join(type(root).__name__ for root in roots[:4])}), and ddpwatch watches one model: "
                      "call fully_shard on the module that holds them too, in configure_model")
    processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if processes == 1:
        return None, ("one process, so Lightning built no DistributedDataParallel and there is no communication to "
                      "watch (launch two or more with torchrun)")
    return None, (f"Lightning's {type(strategy).__name__} trains the model as {type(model).__name__}, neither "
                  "DistributedDataParallel nor FSDP2's fully_shard, which ddpwatch's Lightning callback watches")


def sharded_roots(model: nn.Module) -> list[nn.Module]:
    """The outermost FSDP2 modules inside ``model``: under ``ModelParallelStrategy``, what its
    ``configure_model`` sharded (``fully_shard(self.model)``) is one, and holds the rest."""
    inner: set[int] = set()
    roots = []
    for module in model.modules():
        if id(module) in inner or not is_fsdp2(module):
            continue
        roots.append(module)
        inner.update(id(m) for m in module.modules())
    return roots


def steps_to_take(trainer: Any) -> int:
    """The optimizer steps this ``fit`` will take, for the dashboard's progress and ETA (0:
    unknown): the Trainer's estimate (``max_steps``, or its epochs' batches over
    ``accumulate_grad_batches``), less the ``global_step`` a run resumed from a checkpoint
    starts at (attached steps count from 1)."""
    try:
        planned: Any = trainer.estimated_stepping_batches
    except Exception:  # Lightning cannot estimate it (an accumulation that changes by epoch): the limit, if any
        planned = getattr(trainer, "max_steps", -1)
    if isinstance(planned, float) and math.isfinite(planned):
        planned = int(planned)
    if isinstance(planned, bool) or not isinstance(planned, int) or planned <= 0:
        return 0
    done = getattr(trainer, "global_step", 0)
    return max(planned - done, 0) if isinstance(done, int) else planned


def validation_metrics(before: dict[str, Any], after: Any) -> dict[str, float]:
    """What a validation logged (``self.log("val_loss", ...)``): the names of
    ``trainer.callback_metrics`` whose values it set, new or renewed (a training metric logged
    before it keeps its value), as numbers. Names or counts the wire refuses are left out, never
    raised: a validation's log must not stop the training."""
    if not isinstance(after, dict):
        return {}
    measured: dict[str, float] = {}
    for name, value in after.items():
        if before.get(name) is value or not isinstance(name, str) or not 0 < len(name) <= MAX_METRIC_NAME:
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            measured[name] = float(value)
    return dict(list(measured.items())[:MAX_EVALUATION_METRICS])
