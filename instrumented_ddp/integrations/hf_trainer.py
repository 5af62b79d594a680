"""ddpwatch inside a Hugging Face ``Trainer``: one callback that attaches to the DDP it builds.

    trainer = Trainer(model=model, args=args, train_dataset=train)
    trainer.add_callback(DDPWatchCallback(trainer, address="tcp://127.0.0.1:5555"))
    trainer.train()

What this relies on (``test_attach_end_to_end`` pins it):

- ``Trainer`` wraps the model in ``DistributedDataParallel`` inside ``train()``, through
  ``accelerator.prepare``, and sets ``trainer.model_wrapped`` to it before ``on_train_begin``: that
  is the first event at which the DDP exists, so the callback attaches there. The callbacks are
  handed the *unwrapped* model, never the Trainer, hence the trainer given to the callback. Under
  ``torch_compile`` Accelerate compiles the DDP, and ``model_wrapped`` is the compiled module
  holding it (``attach_problems.compiled_module``).
- Its optimizer is Accelerate's ``AcceleratedOptimizer``, whose ``step()`` calls the torch
  optimizer's (kept as ``.optimizer``) once per optimizer step; ``attach`` hooks that one.
- With gradient accumulation the Trainer runs the micro-batches before the last under DDP's
  ``no_sync``, and forward goes through the DDP wrapper; evaluation runs the unwrapped model, so
  it is not counted as training.
- Between two steps (``_maybe_log_save_evaluate``, after ``on_step_end``) it logs, evaluates,
  calling ``on_evaluate`` at the end, and saves a checkpoint, calling ``on_save`` after: the
  callback marks each a pause (``Attachment.pause_ends``), so the next step begins there and its
  data loading is not the evaluation's seconds (nor its step time, p95 and samples/s).
  ``on_evaluate`` is given the evaluation's ``metrics`` (what the Trainer logs): the callback sends
  what they say of the model (``quality_metrics``) for the dashboard's Loss tab.
- Under ``auto_find_batch_size`` an out-of-memory error inside ``train()`` is caught by Accelerate,
  which calls the training loop again at a smaller batch: ``on_train_end`` never comes, and the
  second ``on_train_begin`` finds a new DDP over the same model (transformers 5.24): the callback
  ends the first run there, as failed (``begun_again_because``), and attaches anew.
- Under FSDP2 (``fsdp_config={"fsdp_version": 2}``) Accelerate shards the model in place with
  ``fully_shard`` and ``model_wrapped`` is that model: attached as ``attach`` takes any FSDP2
  model. Accelerate shards on GPUs only (on CPU the same arguments train with DDP), so the suite
  pins this path with a stand-in Trainer; ``examples/hf_trainer.py --fsdp`` runs a real one on a
  GPU.
"""

from __future__ import annotations

import numbers
import sys
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from instrumented_ddp.attachment.problems import compiled_module, is_fsdp2
from instrumented_ddp.attachment.attachment import AttachError, Attachment, attach
from instrumented_ddp.attachment.disabled_watch import DisabledWatch
from instrumented_ddp.wire.messages import FAILED, MAX_EVALUATION_METRICS, MAX_METRIC_NAME


class DDPWatchCallback(TrainerCallback):
    """Attaches ddpwatch to the Trainer's DDP (or FSDP2) model at ``on_train_begin``; detaches at
    ``on_train_end``; marks its evaluations and checkpoints between steps as pauses of training,
    and sends what each evaluation measured.
    Where the Trainer built no DDP, the run is trained as usual, with one line
    saying why there is nothing to watch: one process (Accelerate wraps a model in DDP only for
    two or more, torchrun's one process included), or another wrapper (FSDP1, DeepSpeed), which
    ``attach`` does not watch; so is a model ``attach`` refuses (a DDP given a communication hook
    through Accelerate's ``DistributedDataParallelKwargs``). Raising there would stop a training
    run for its telemetry. A second ``train()`` attaches again to the DDP the first one built."""

    def __init__(self, trainer: Any = None, *, address: str | None = None, watch_key: str | None = None) -> None:
        """``address`` and ``watch_key`` as ``attach`` takes them: None reads ``DDPWATCH_ADDRESS``
        and ``DDPWATCH_KEY``; under ``DDPWATCH_DISABLE=1`` the Trainer trains unwatched."""
        self.trainer = trainer
        self.address = address
        self.watch_key = watch_key
        self.attachment: Attachment | DisabledWatch | None = None

    def set_trainer(self, trainer: Any) -> None:
        """For a callback made before its Trainer (as transformers' own ``JITCheckpointCallback``)."""
        self.trainer = trainer

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if self.trainer is None:
            raise AttachError("DDPWatchCallback: it needs the Trainer, whose DDP model the callbacks are not given: "
                              "trainer.add_callback(DDPWatchCallback(trainer, address=...))")
        if self.attachment is not None:  # the train() it was attached for raised, and training begins again
            self.attachment.detach(begun_again_because(args, state), trains_again=True)  # a recorder goes on to it
            self.attachment = None
        wrapped = compiled_module(getattr(self.trainer, "model_wrapped", None))  # under torch_compile
        if not isinstance(wrapped, DistributedDataParallel) and not is_fsdp2(wrapped):
            print(f"ddpwatch: {unwatched_because(wrapped)}: training goes on unwatched", file=sys.stderr, flush=True)
            return
        try:
            self.attachment = attach(wrapped, optimizer if optimizer is not None else self.trainer.optimizer,
                                     address=self.address, watch_key=self.watch_key, total_steps=steps_to_take(state))
        except AttachError as refused:  # e.g. a built-in C++ comm hook on the DDP: said, and the Trainer trains
            print(f"ddpwatch: {refused}: training goes on unwatched", file=sys.stderr, flush=True)

    def computing(self, what: str) -> AbstractContextManager[None]:
        """``Attachment.computing`` for a Trainer subclass's own compute while the callback is
        attached: a teacher's forward in its ``compute_loss`` (unmarked, before the student's it
        reads as data loading, after it as idle time)::

            watch = DDPWatchCallback(trainer)
            trainer.add_callback(watch)
            ...  # in the subclass's compute_loss:
            with watch.computing("teacher forward"), torch.no_grad():
                teacher_logits = self.teacher(**inputs).logits

        Where nothing is watched (no DDP, outside ``train()``), a block that only runs."""
        return self.attachment.computing(what) if self.attachment is not None else nullcontext()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """The Trainer's own flow callback, called first, has said by now whether an evaluation
        or a checkpoint follows this step: the rank's heartbeats say so while it runs."""
        self._pausing_if_told(control)

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._pausing_if_told(control)  # as at a step's end, for an epoch's evaluation or checkpoint

    def _pausing_if_told(self, control: Any) -> None:
        if self.attachment is not None and (getattr(control, "should_evaluate", False) or getattr(control, "should_save", False)):
            self.attachment.pause_begins("evaluate" if control.should_evaluate else "save")

    def on_evaluate(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        if self.attachment is not None:
            self.attachment.pause_ends("evaluate")
            if measured := quality_metrics(metrics):  # the Loss tab draws them beside the training loss
                self.attachment.record_evaluation(measured)
            if getattr(control, "should_save", False):  # a checkpoint follows
                self.attachment.pause_begins("save")

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.attachment is not None:
            self.attachment.pause_ends("save")

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.attachment is not None:
            self.attachment.detach()
            self.attachment = None


def quality_metrics(metrics: Any) -> dict[str, float]:
    """What a Trainer's evaluation measured of the model (``eval_loss``, ``compute_metrics``'
    accuracy, …): its numbers less the epoch and the speed figures (``eval_runtime``,
    ``…_per_second``: the pause already says how long it took), as transformers'
    ``default_compute_objective`` leaves them out; names or counts the wire refuses are left out
    too, never raised: an evaluation's log line must not stop the training."""
    if not isinstance(metrics, dict):
        return {}
    measured = {name: float(value) for name, value in metrics.items()
                if isinstance(name, str) and 0 < len(name) <= MAX_METRIC_NAME and name != "epoch"
                and not name.endswith(("_runtime", "_per_second", "_model_preparation_time"))
                and isinstance(value, numbers.Real) and not isinstance(value, bool)}
    return dict(list(measured.items())[:MAX_EVALUATION_METRICS])


def begun_again_because(args: Any, state: Any) -> str:
    """The goodbye of a run whose ``train()`` never reached ``on_train_end``, said when training
    begins again: under ``auto_find_batch_size`` Accelerate catches an out-of-memory error, shrinks
    the batch by a tenth and calls the training loop again, on a new DDP over the same model and the same
    optimizer. Left attached, the old hooks would go on counting that optimizer's steps with none
    of the new DDP's forwards or all-reduces, and the new run would be refused its address."""
    if getattr(args, "auto_find_batch_size", False):
        batch = getattr(state, "train_batch_size", None)
        return (f"{FAILED}out of memory: the Trainer began again at a batch of {batch} (auto_find_batch_size)"
                if isinstance(batch, int) else f"{FAILED}out of memory: the Trainer began again at a smaller batch (auto_find_batch_size)")
    return f"{FAILED}train() raised, and training began again"


def steps_to_take(state: Any) -> int:
    """The optimizer steps this ``train()`` will take, for the dashboard's progress and ETA (0:
    unknown): the Trainer's ``max_steps`` less the ``global_step`` a run resumed from a
    checkpoint starts at (attached steps count from 1: the ETA must not count the resumed ones
    again)."""
    planned, done = getattr(state, "max_steps", 0), getattr(state, "global_step", 0)
    if not isinstance(planned, int) or planned <= 0:
        return 0
    return max(planned - done, 0) if isinstance(done, int) else planned


def unwatched_because(wrapped: Any) -> str:
    """Why a Trainer's model cannot be attached to, when it is not a DDP, in words."""
    processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if processes == 1:
        return ("one process, so the Trainer built no DistributedDataParallel and there is no communication "
                "to watch (launch two or more with torchrun)")
    return (f"the Trainer wrapped the model as {type(wrapped).__name__}, neither DistributedDataParallel nor "
            "FSDP2's fully_shard (FSDP1 or DeepSpeed?), which ddpwatch's Trainer callback watches")
