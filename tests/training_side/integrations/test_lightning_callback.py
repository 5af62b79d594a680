"""``instrumented_ddp.integrations.DDPWatchLightningCallback``: in one process, a real Lightning
``Trainer`` on a one-rank gloo group (DDP, FSDP2 through ``ModelParallelStrategy``) watched, its
validations paused and sent, a ``fit`` that raises detached as failed, the address and the off
switch read from the environment; what it cannot watch (one process, FSDP1, manual optimization,
several ``fully_shard`` roots) said in one line while training goes on; and the one line where
Lightning is not installed. Then ``examples/lightning_ddp.py`` on two gloo ranks as torchrun starts
them, recorded by ``ddpwatch record``, under DDP and under FSDP2: each step's collectives counted
on both ranks, the final parameters bit for bit the unwatched run's.

Lightning is in the ``test`` extra: where it is missing these tests fail, never skip."""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import instrumented_ddp.integrations as integrations
from ddpwatch.ingest.session import Session
from ddpwatch.record.recorder import load_session
from instrumented_ddp.attachment.attachment import Attachment
from instrumented_ddp.attachment.disabled_watch import DisabledWatch
from instrumented_ddp.integrations import DDPWatchLightningCallback
from instrumented_ddp.integrations import lightning as lightning_callback
from instrumented_ddp.wire.messages import Evaluation, Goodbye, StepReport
from launch import REPO_ROOT, Recorder, free_port, run_as_torchrun_would

NEEDS_THE_EXTRA = "ddpwatch: the Lightning callback needs the lightning extra: pip install 'ddpwatch[lightning]'"
ONE_PROCESS = ("ddpwatch: one process, so Lightning built no DistributedDataParallel and there is no communication "
               "to watch (launch two or more with torchrun): training goes on unwatched")


class Regression(pl.LightningModule):
    """Two linear layers on fixed random data; ``fails_at``: the batch whose ``training_step``
    raises; ``sharded``: ``configure_model`` shards each layer and the network with FSDP2."""

    def __init__(self, fails_at: int = -1, sharded: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
        self.fails_at, self.sharded = fails_at, sharded

    def configure_model(self) -> None:
        strategy = self.trainer.strategy
        if self.sharded and isinstance(strategy, ModelParallelStrategy):
            from torch.distributed.fsdp import fully_shard

            mesh = strategy.device_mesh["data_parallel"]
            for layer in (self.net[0], self.net[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(self.net, mesh=mesh)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        if batch_idx == self.fails_at:
            raise RuntimeError("the loader gave a batch of NaNs")
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.log("train_loss", loss)  # in callback_metrics too: not an evaluation's
        return loss

    def validation_step(self, batch: list[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", nn.functional.mse_loss(self.net(batch[0]), batch[1]), sync_dist=True)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class ManualRegression(Regression):
    """Manual optimization: ``training_step`` backs up and steps itself, inside DDP's forward."""

    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        assert isinstance(optimizer, pl.core.optimizer.LightningOptimizer)
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(self.net(batch[0]), batch[1])
        self.manual_backward(loss)
        optimizer.step()
        return loss


def loader(samples: int = 64) -> torch.utils.data.DataLoader:
    data = torch.Generator().manual_seed(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(samples, 4, generator=data),
                                                                      torch.randn(samples, 2, generator=data)), batch_size=4)


def trainer_of(strategy: Any, callbacks: list[pl.Callback], **settings: Any) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, callbacks=callbacks, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, **settings)


class TheDDP(pl.Callback):
    """What Lightning trained: its DDP, and the buckets DDP reduced in, read before Lightning unwraps it."""

    def __init__(self) -> None:
        self.model: Any = None
        self.buckets = 0

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.model = trainer.strategy.model
        if isinstance(self.model, DistributedDataParallel):
            self.buckets = len(self.model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))


@pytest.fixture(autouse=True)
def lightning_leaves_the_threads_as_they_are(monkeypatch: pytest.MonkeyPatch) -> None:
    """A DDP strategy without ``OMP_NUM_THREADS`` sets it, and torch's threads, for the rest of the
    process (``_set_num_threads_if_needed``): set here to what torch has, and put back after."""
    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", str(torch.get_num_threads())))


@pytest.fixture
def lightning_on_the_group(one_rank_group: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning on the test's one-rank group: it finds the group made, and, ``LOCAL_RANK`` set,
    starts no process of its own (nor writes the launcher's variables into the environment)."""
    monkeypatch.setenv("LOCAL_RANK", "0")


def attach_spy(monkeypatch: pytest.MonkeyPatch) -> list[tuple[nn.Module, int]]:
    """What the callback gives ``attach``, as it gives it: the model and the steps planned."""
    given: list[tuple[nn.Module, int]] = []
    original = lightning_callback.attach

    def attach(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        given.append((model, kwargs["total_steps"]))
        return original(model, *args, **kwargs)

    monkeypatch.setattr(lightning_callback, "attach", attach)
    return given


def ddpwatch_lines(capsys: pytest.CaptureFixture[str]) -> list[str]:
    """What ddpwatch said on stderr (Lightning's own notes left out)."""
    return [line for line in capsys.readouterr().err.splitlines() if "ddpwatch" in line or "instrumented_ddp" in line]


class PausingSeen(pl.Callback):
    """What the watch says the loop pauses for (``watch.pausing``: the rank's heartbeats say it,
    and the loop's collectives under it are not the step's) at each training batch's start, each
    validation batch's start (the sanity check's left out) and each checkpoint's save, read after
    the ddpwatch callback's own hook ran (it comes first in ``callbacks``): ``"hook:pausing"``."""

    def __init__(self, watcher: DDPWatchLightningCallback) -> None:
        self.watcher = watcher
        self.seen: list[str] = []

    def _read(self, hook: str) -> None:
        attachment = self.watcher.attachment
        self.seen.append(f"{hook}:{attachment.watch.pausing if isinstance(attachment, Attachment) else '(none)'}")

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int) -> None:
        self._read("train")

    def on_validation_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int,
                                  dataloader_idx: int = 0) -> None:
        if not trainer.sanity_checking:
            self._read("validate")

    def on_save_checkpoint(self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._read("save")


def test_without_lightning_making_the_callback_says_how_to_install_it_and_the_trainers_callback_still_imports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning is the ``lightning`` extra: where it is not installed (hidden here), the module
    imports, the Hugging Face callback beside it too, and making the Lightning callback is one
    line naming the install."""
    for name in [name for name in sys.modules if name == "lightning" or name.startswith("lightning.")]:
        monkeypatch.setitem(sys.modules, name, None)  # None: "not installed" to import
    monkeypatch.delitem(sys.modules, "instrumented_ddp.integrations.lightning")
    monkeypatch.delattr(integrations, "lightning")
    hidden = importlib.import_module("instrumented_ddp.integrations.lightning")
    with pytest.raises(ImportError) as refused:
        hidden.DDPWatchLightningCallback()
    assert str(refused.value) == NEEDS_THE_EXTRA
    assert integrations.DDPWatchCallback.__name__ == "DDPWatchCallback"


def test_in_one_process_the_trainer_trains_on_and_one_line_says_why_nothing_is_watched(
        capsys: pytest.CaptureFixture[str]) -> None:
    """``python script.py``: Lightning's single-device strategy, no DDP and no process group."""
    callback = DDPWatchLightningCallback(address=f"tcp://127.0.0.1:{free_port()}")
    trainer = trainer_of("auto", [callback], max_steps=3)
    trainer.fit(Regression(), loader())
    assert trainer.global_step == 3 and callback.attachment is None
    assert ddpwatch_lines(capsys) == [ONE_PROCESS]


def test_a_watched_ddp_fit_reports_each_step_pauses_its_validation_sends_what_it_logged_and_ends(
        lightning_on_the_group: None, sent: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``DDPStrategy`` on one rank, two batches a step (``accumulate_grad_batches``: DDP's
    ``no_sync`` before the second), validated after steps 2 and 4 (and once before training, the
    sanity check): attached at ``on_train_start`` to Lightning's DDP with the steps it will take,
    every step reported with its micro-steps and the loss ``training_step`` returned, step 3
    beginning where the first validation's pause ended, each validation's ``val_loss`` sent alone
    (``train_loss`` was logged before it), and detached at ``on_train_end``."""
    given = attach_spy(monkeypatch)
    callback, ddp = DDPWatchLightningCallback(address=f"tcp://127.0.0.1:{free_port()}"), TheDDP()
    pausing = PausingSeen(callback)
    trainer = trainer_of(DDPStrategy(bucket_cap_mb=0.0001), [callback, ddp, pausing], max_steps=4, accumulate_grad_batches=2,
                         val_check_interval=4, check_val_every_n_epoch=None, limit_val_batches=2, num_sanity_val_steps=1)
    trainer.fit(Regression(), loader(), loader(8))
    assert [(model, steps) for model, steps in given] == [(ddp.model, 4)] and ddp.buckets > 1
    assert callback.attachment is None and trainer.global_step == 4
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.step for r in reports] == [1, 2, 3, 4]
    for report in reports:
        kinds = [s.kind for s in report.spans]
        assert report.strategy == "ddp" and report.settings["grad_accum"] == 2 and report.samples == 8
        assert kinds.count("forward") == kinds.count("backward") == 2 and report.loss is not None
        assert kinds.count("all_reduce") == (1 if report.step == 1 else ddp.buckets)  # DDP's first: one bucket of all
    assert [(r.step, r.paused_for, r.paused_s > 0) for r in reports if r.paused_for] == [(3, "validate", True)]
    assert pausing.seen == (["train:"] * 4 + ["validate:validate"] * 2) * 2  # two batches a step, two a validation
    evaluations = [m for m in sent if isinstance(m, Evaluation)]
    assert [(e.step, list(e.metrics)) for e in evaluations] == [(2, ["val_loss"]), (4, ["val_loss"])]
    assert [(g.steps, g.reason) for g in sent if isinstance(g, Goodbye)] == [(4, "finished")]


def test_a_checkpoint_between_steps_is_a_pause_until_the_next_batch(lightning_on_the_group: None, sent: list[Any],
                                                                     tmp_path: Path) -> None:
    """``ModelCheckpoint`` saves after steps 2 and 4 (``on_save_checkpoint`` before it writes, no
    hook after): said from there, and step 3 begins at the next ``on_train_batch_start``, its pause
    named ``save``."""
    callback = DDPWatchLightningCallback(address=f"tcp://127.0.0.1:{free_port()}")
    saving = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    pausing = PausingSeen(callback)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ddp", callbacks=[callback, pausing, saving], max_steps=4,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), loader())
    assert sorted(path.name for path in tmp_path.iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [(r.step, r.paused_for, r.paused_s > 0) for r in reports if r.paused_for] == [(3, "save", True)]
    assert pausing.seen == ["train:", "train:", "save:save"] * 2
    assert [(g.steps, g.reason) for g in sent if isinstance(g, Goodbye)] == [(4, "finished")]


def test_a_fit_that_raises_is_detached_as_failed_and_raises_on(lightning_on_the_group: None, sent: list[Any]) -> None:
    """The third batch's ``training_step`` raises: Lightning calls ``on_exception`` and raises
    again, and the goodbye, after the two steps done, says what it raised."""
    callback = DDPWatchLightningCallback(address=f"tcp://127.0.0.1:{free_port()}")
    trainer = trainer_of("ddp", [callback], max_steps=6)
    with pytest.raises(RuntimeError, match="a batch of NaNs"):
        trainer.fit(Regression(fails_at=2), loader())
    assert callback.attachment is None
    assert [(g.steps, g.reason) for g in sent if isinstance(g, Goodbye)] == [
        (2, "failed: RuntimeError: the loader gave a batch of NaNs")]


def test_an_fsdp2_model_parallel_fit_is_watched_at_the_root_its_configure_model_sharded(
        lightning_on_the_group: None, sent: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``ModelParallelStrategy`` (it runs on the CPU with gloo) leaves the LightningModule
    unwrapped; ``configure_model`` shards each layer and the network: the network is what
    ``attach`` watches, as FSDP, each step's phases reported (a one-rank shard is whole: FSDP
    gathers and reduce-scatters nothing; two ranks: ``examples/lightning_ddp.py --fsdp2``)."""
    given = attach_spy(monkeypatch)
    callback, module = DDPWatchLightningCallback(address=f"tcp://127.0.0.1:{free_port()}"), Regression(sharded=True)
    trainer = trainer_of(ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1), [callback], max_steps=3)
    trainer.fit(module, loader())
    assert [(model, steps) for model, steps in given] == [(module.net, 3)]
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [(r.step, r.strategy) for r in reports] == [(1, "fsdp"), (2, "fsdp"), (3, "fsdp")]
    assert all({"forward", "backward", "optimizer"} <= {s.kind for s in r.spans} for r in reports)
    assert [(g.steps, g.reason) for g in sent if isinstance(g, Goodbye)] == [(3, "finished")]


def test_manual_optimization_is_refused_in_one_line_and_trains_on(lightning_on_the_group: None,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """``automatic_optimization = False`` runs the whole step inside DDP's forward: refused before
    attaching, the DDP and the optimizer left as Lightning made them."""
    callback, trained = DDPWatchLightningCallback(address=f"tcp://127.0.0.1:{free_port()}"), TheDDP()
    trainer = trainer_of("ddp", [callback, trained], max_steps=3)
    trainer.fit(ManualRegression(), loader())
    assert trainer.global_step == 3 and callback.attachment is None
    ddp = trained.model
    assert isinstance(ddp, DistributedDataParallel) and not ddp._forward_hooks and not ddp._forward_pre_hooks
    assert ddpwatch_lines(capsys) == [
        "ddpwatch: manual optimization (automatic_optimization = False): Lightning runs training_step whole, its "
        "manual_backward and step(), inside the model's forward, where ddpwatch cannot tell forward, backward and "
        "update apart: training goes on unwatched"]


def test_a_model_attach_refuses_trains_on_and_one_line_says_why(lightning_on_the_group: None,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """Whatever ``attach`` refuses (an address that is not one, here) is said on the rank that got
    it, and Lightning trains as if the callback were not there."""
    callback = DDPWatchLightningCallback(address="localhost:5555")
    trainer = trainer_of("ddp", [callback], max_steps=2)
    trainer.fit(Regression(), loader())
    assert trainer.global_step == 2 and callback.attachment is None
    assert ddpwatch_lines(capsys) == ["ddpwatch: instrumented_ddp.attach: 'localhost:5555' is not an address like "
                                      "tcp://127.0.0.1:5555: training goes on unwatched"]


class AttachmentsSeen(pl.Callback):
    """What ``watcher.attachment`` is at each batch's end; each batch's end an exponential average
    of the weights, run in ``watcher.computing("ema")``, and counted in ``averaged``."""

    def __init__(self, watcher: DDPWatchLightningCallback) -> None:
        self.watcher = watcher
        self.attachments: list[Any] = []
        self.averaged = 0
        self._average: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self.attachments.append(self.watcher.attachment)
        with self.watcher.computing("ema"), torch.no_grad():
            weights = [p.detach() for p in pl_module.parameters()]
            self._average = [0.9 * a + 0.1 * w for a, w in zip(self._average or weights, weights, strict=True)]
            self.averaged += 1


def test_the_callbacks_own_compute_is_a_loop_span_of_the_next_step_while_attached_and_only_runs_otherwise(
        lightning_on_the_group: None, sent: list[Any]) -> None:
    """A weight average at each batch's end, after its update, in ``callback.computing("ema")``:
    a ``loop`` span of the step that update began (step 1 has none before it); before the ``fit``
    and after it the block runs, and nothing is sent."""
    callback = DDPWatchLightningCallback(address=f"tcp://127.0.0.1:{free_port()}")
    seen, ran = AttachmentsSeen(callback), []
    with callback.computing("ema"):
        ran.append("before")
    trainer_of("ddp", [callback, seen], max_steps=3).fit(Regression(), loader())
    with callback.computing("ema"):
        ran.append("after")
    assert ran == ["before", "after"] and seen.averaged == 3 and callback.attachment is None
    assert len(seen.attachments) == 3 and all(isinstance(a, Attachment) for a in seen.attachments)
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [[s.tag for s in r.spans if s.kind == "loop"] for r in reports] == [[], ["ema"], ["ema"]]


def test_without_an_address_the_callback_attaches_where_ddpwatch_address_says(
        lightning_on_the_group: None, sent: list[Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """``address`` left out goes to ``attach`` as None, which reads ``DDPWATCH_ADDRESS``."""
    address = f"tcp://127.0.0.1:{free_port()}"
    monkeypatch.setenv("DDPWATCH_ADDRESS", address)
    callback = DDPWatchLightningCallback()
    seen = AttachmentsSeen(callback)
    trainer_of("ddp", [callback, seen], max_steps=2).fit(Regression(), loader())
    assert [a.address for a in seen.attachments] == [address, address]
    assert [(g.steps, g.reason) for g in sent if isinstance(g, Goodbye)] == [(2, "finished")]


def test_under_ddpwatch_disable_the_callback_watches_nothing_and_its_calls_only_run(
        lightning_on_the_group: None, sent: list[Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """``DDPWATCH_DISABLE=1``: ``attach`` gives a ``DisabledWatch``, on which the callback's pauses
    (a validation, a checkpoint), its evaluation and ``computing`` do nothing but run; no hook on
    Lightning's DDP, nothing sent, no line said, the training Lightning's own."""
    monkeypatch.setenv("DDPWATCH_DISABLE", "1")
    callback, trained = DDPWatchLightningCallback(address=f"tcp://127.0.0.1:{free_port()}"), TheDDP()
    seen = AttachmentsSeen(callback)
    saving = pl.callbacks.ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2, save_top_k=-1)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy="ddp", callbacks=[callback, trained, seen, saving],
                         max_steps=4, val_check_interval=2, check_val_every_n_epoch=None, limit_val_batches=1,
                         logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Regression(), loader(), loader(8))
    assert trainer.global_step == 4 and seen.averaged == 4 and "val_loss" in trainer.callback_metrics
    assert sorted(path.name for path in tmp_path.iterdir()) == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt"]
    assert [type(a) for a in seen.attachments] == [DisabledWatch] * 4 and callback.attachment is None
    assert isinstance(trained.model, DistributedDataParallel)
    assert not trained.model._forward_hooks and not trained.model._forward_pre_hooks
    assert sent == [] and ddpwatch_lines(capsys) == []


def test_lightnings_fsdp1_strategy_is_refused_in_one_line_naming_what_to_use(one_rank_group: None,
                                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """Lightning builds ``FSDPStrategy`` on GPUs only, so a ``fit`` with it cannot run here: the
    callback is given, as ``on_train_start`` finds them there, a real ``FSDPStrategy`` holding the
    module wrapped in FSDP1's real ``FullyShardedDataParallel`` (FSDP1 runs on the CPU)."""
    from torch.distributed.fsdp import FullyShardedDataParallel

    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        pl.Trainer(accelerator="cpu", devices=1, strategy=FSDPStrategy(), logger=False)
    module = Regression()
    wrapped = FullyShardedDataParallel(module, device_id=torch.device("cpu"))
    strategy = FSDPStrategy()
    strategy.model = wrapped
    trainer = SimpleNamespace(strategy=strategy, optimizers=[torch.optim.SGD(wrapped.parameters(), lr=0.1)],
                              is_global_zero=True)
    callback = DDPWatchLightningCallback(address=f"tcp://127.0.0.1:{free_port()}")
    callback.on_train_start(trainer, module)  # type: ignore[arg-type]  # the Trainer's two fields the callback reads
    assert callback.attachment is None
    assert not wrapped._forward_pre_hooks and not wrapped._forward_hooks and not module._forward_pre_hooks
    assert ddpwatch_lines(capsys) == [
        "ddpwatch: Lightning's FSDPStrategy wraps the model in FSDP1's FullyShardedDataParallel, which ddpwatch cannot "
        "time: use ModelParallelStrategy and shard with FSDP2's fully_shard in configure_model to watch it: training "
        "goes on unwatched"]


def test_several_fully_shard_roots_are_refused_in_one_line_naming_the_fix(one_rank_group: None,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """``configure_model`` sharded the layers and nothing holding them: three models, not one."""
    from torch.distributed.fsdp import fully_shard

    module = Regression()
    for layer in (module.net[0], module.net[2]):
        fully_shard(layer)
    trainer = SimpleNamespace(strategy=SimpleNamespace(model=module), optimizers=[torch.optim.SGD(module.parameters(), lr=0.1)],
                              is_global_zero=True)
    callback = DDPWatchLightningCallback(address=f"tcp://127.0.0.1:{free_port()}")
    callback.on_train_start(trainer, module)  # type: ignore[arg-type]  # the stand-in
    assert callback.attachment is None
    assert ddpwatch_lines(capsys) == [
        "ddpwatch: the LightningModule holds 2 separate fully_shard roots (FSDPLinear, FSDPLinear), and ddpwatch "
        "watches one model: call fully_shard on the module that holds them too, in configure_model: training goes on "
        "unwatched"]


class DeepSpeedEngine(nn.Module):
    """A wrapper neither DDP nor FSDP2, as the callback sees it (its name: DeepSpeed's, which
    Lightning's ``DeepSpeedStrategy`` puts in ``strategy.model``; DeepSpeed is not installed)."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


def test_a_wrapper_neither_ddp_nor_fsdp2_on_two_ranks_is_named_in_one_line(one_rank_group: None,
                                                                          monkeypatch: pytest.MonkeyPatch,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """On two ranks (the group's size, as the callback asks it, says two), a strategy whose model
    is another wrapper: the line names the strategy and the wrapper, and nothing is attached."""
    monkeypatch.setattr(lightning_callback.dist, "get_world_size", lambda *_: 2)
    module = Regression()
    strategy = type("DeepSpeedStrategy", (SimpleNamespace,), {})(model=DeepSpeedEngine(module))
    trainer = SimpleNamespace(strategy=strategy, optimizers=[torch.optim.SGD(module.parameters(), lr=0.1)],
                              is_global_zero=True)
    callback = DDPWatchLightningCallback(address=f"tcp://127.0.0.1:{free_port()}")
    callback.on_train_start(trainer, module)  # type: ignore[arg-type]  # the Trainer's two fields the callback reads
    assert callback.attachment is None
    assert ddpwatch_lines(capsys) == [
        "ddpwatch: Lightning's DeepSpeedStrategy trains the model as DeepSpeedEngine, neither DistributedDataParallel "
        "nor FSDP2's fully_shard, which ddpwatch's Lightning callback watches: training goes on unwatched"]


def test_a_second_fit_with_the_same_callback_is_watched_again(lightning_on_the_group: None, sent: list[Any]) -> None:
    """Two ``Trainer``s, one callback: each ``fit`` a run of its own, from hello to goodbye."""
    callback = DDPWatchLightningCallback(address=f"tcp://127.0.0.1:{free_port()}")
    for steps in (2, 3):
        trainer_of("ddp", [callback], max_steps=steps).fit(Regression(), loader())
        assert callback.attachment is None
    assert [m.step for m in sent if isinstance(m, StepReport)] == [1, 2, 1, 2, 3]
    assert [(g.steps, g.reason) for g in sent if isinstance(g, Goodbye)] == [(2, "finished"), (3, "finished")]


def test_the_steps_to_take_are_the_trainers_estimate_less_those_a_resumed_run_has_done() -> None:
    def trainer(estimate: Any, max_steps: int = -1, global_step: int = 0) -> Any:
        return SimpleNamespace(estimated_stepping_batches=estimate, max_steps=max_steps, global_step=global_step)

    class Unestimated:
        max_steps, global_step = 50, 10

        @property
        def estimated_stepping_batches(self) -> int:
            raise ValueError("accumulate_grad_batches changes by epoch")

    steps_to_take = lightning_callback.steps_to_take
    assert steps_to_take(trainer(30)) == 30
    assert steps_to_take(trainer(1000, global_step=600)) == 400  # resumed from a checkpoint at step 600
    assert steps_to_take(trainer(float("inf"))) == 0  # max_epochs=-1, no max_steps: unknown
    assert steps_to_take(Unestimated()) == 40


def test_what_a_validation_logged_is_its_new_values_as_numbers() -> None:
    kept = torch.tensor(0.5)
    before = {"train_loss": kept}
    after = {"train_loss": kept, "val_loss": torch.tensor(0.25), "val_acc": 0.75, "flag": True, "x" * 65: 1.0,
             "matrix": torch.ones(2, 2)}
    assert lightning_callback.validation_metrics(before, after) == {"val_loss": 0.25, "val_acc": 0.75}


# -- the example, two ranks as torchrun starts them --------------------------------------------------

EXAMPLE_SCRIPT = REPO_ROOT / "examples" / "lightning_ddp.py"
#: DDP: two batches a step, small buckets (several a step), a validation after step 10.
DDP_RUN = ["--steps", "12", "--grad-accum", "2", "--width", "256", "--layers", "4", "--bucket-mb", "0.25",
           "--eval-every", "10"]
#: FSDP2 through ModelParallelStrategy: 2 hidden layers and the two ends, each its own fully_shard unit.
FSDP2_RUN = ["--fsdp2", "--steps", "4", "--width", "64", "--layers", "2"]


@dataclass
class ExampleRuns:
    """One run of the example watched and recorded, and the same run with ``--no-watch``."""

    session: Session
    summary: dict[str, Any]
    stdout: str  # rank 0's first
    watched_final: dict[str, torch.Tensor]
    unwatched_final: dict[str, torch.Tensor]


def run_the_example(out: Path, args: list[str]) -> ExampleRuns:
    """``examples/lightning_ddp.py ARGS`` on two ranks, recorded by ``ddpwatch record`` on a free
    port until every rank said goodbye; then with ``--no-watch``. Each saves its final parameters."""
    with Recorder(out / "session", "--idle-exit", "20") as recorder:
        watched = run_as_torchrun_would([str(EXAMPLE_SCRIPT), *args, "--watch", recorder.address,
                                         "--save-final", str(out / "watched.pt")], timeout_s=120)
        assert watched.returncode == 0, watched.stderr[-3000:]
        recorder.wait()
    unwatched = run_as_torchrun_would([str(EXAMPLE_SCRIPT), *args, "--no-watch", "--save-final", str(out / "unwatched.pt")],
                                      timeout_s=120)
    assert unwatched.returncode == 0, unwatched.stderr[-3000:]
    return ExampleRuns(load_session(out / "session" / "session.ddpwatch"),
                       json.loads((out / "session" / "summary.json").read_text()), watched.stdout,
                       torch.load(out / "watched.pt"), torch.load(out / "unwatched.pt"))


@pytest.fixture(scope="module")
def ddp_runs(tmp_path_factory: pytest.TempPathFactory) -> ExampleRuns:
    """The example under DDP, watched and unwatched: once for every assertion on it."""
    return run_the_example(tmp_path_factory.mktemp("lightning_ddp"), DDP_RUN)


@pytest.fixture(scope="module")
def fsdp2_runs(tmp_path_factory: pytest.TempPathFactory) -> ExampleRuns:
    """The example under FSDP2 (``--fsdp2``), watched and unwatched."""
    return run_the_example(tmp_path_factory.mktemp("lightning_fsdp2"), FSDP2_RUN)


def initial_parameters(width: int, layers: int) -> dict[str, torch.Tensor]:
    """The example's ``ToyModel`` as each rank builds it before training (``torch.manual_seed(0)``)."""
    spec = importlib.util.spec_from_file_location("lightning_ddp_example", EXAMPLE_SCRIPT)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    return dict(example.ToyModel(width, layers).state_dict())


def assert_trained_bit_for_bit_as_unwatched(runs: ExampleRuns, width: int, layers: int) -> None:
    """Every parameter (``layers`` + 2 linear layers' weights and biases) equal, bit for bit, to
    the unwatched run's, and moved by training from where both began."""
    watched, unwatched, initial = runs.watched_final, runs.unwatched_final, initial_parameters(width, layers)
    assert watched.keys() == unwatched.keys() == initial.keys() and len(watched) == 2 * (layers + 2)
    assert [name for name in watched if not torch.equal(watched[name], unwatched[name])] == []
    assert [name for name in watched if torch.equal(watched[name], initial[name])] == []


def test_the_examples_all_reduces_per_step_are_ddps_buckets_on_both_ranks(ddp_runs: ExampleRuns) -> None:
    """Every step on both ranks, DDP's buckets in each from step 2 (step 1 is DDP's first
    iteration, one bucket of everything, excluded); Lightning's own broadcasts (a stop flag
    before each batch: two a step, step 1's first before the step began) timed as the loop's
    collectives; counted untimed, only the two broadcasts DDP issues from C++ in step 2's forward
    where it rebuilds its buckets (the validation's ``sync_dist`` all-reduces are the pause's);
    the planned steps from ``max_steps``; the validation after step 10 a pause before step 11,
    its ``val_loss`` sent."""
    runs = ddp_runs
    found = re.search(r"DDP reduced gradients in (\d+) bucket", runs.stdout)
    assert found is not None, runs.stdout[-3000:]
    buckets = int(found.group(1))  # DDP's own count, printed by rank 0 from _get_ddp_logging_data()
    assert buckets > 1
    assert sorted(runs.session.reports) == list(range(1, 13))
    (segment,) = runs.summary["segments"]
    assert segment["strategy"] == "ddp" and segment["settings"] == {"bucket_mb": 0.25, "grad_accum": 2}
    assert segment["excluded_steps"] == [1] and segment["all_reduce_calls"] == buckets
    for step, reports in runs.session.reports.items():
        counts = {rank: sum(s.kind == "all_reduce" for s in report.spans) for rank, report in reports.items()}
        assert counts == ({0: 1, 1: 1} if step == 1 else {0: buckets, 1: buckets}), step
        loops = {rank: [s.kind for s in report.spans if s.tag.startswith("l")] for rank, report in reports.items()}
        assert loops == {rank: ["broadcast"] * (1 if step == 1 else 2) for rank in (0, 1)}, step  # step 1's first: before it
        untimed = {rank: report.untimed_collectives for rank, report in reports.items()}
        assert untimed == {rank: 2 if step == 2 else 0 for rank in (0, 1)}, step  # DDP's bucket rebuild, from C++
        assert all(report.loss is not None and report.samples == 2 * 32 for report in reports.values()), step
    assert (segment["paused_steps"], segment["paused_for"]) == ([11], ["validate"])
    assert [(e["step"], list(e["metrics"])) for e in runs.summary["evaluations"]] == [(10, ["val_loss"])]
    assert all(rank.hello.total_steps == 12 and not rank.hello.switchable for rank in runs.session.ranks.values())


def test_the_examples_ddp_parameters_are_bitwise_those_of_the_unwatched_run(ddp_runs: ExampleRuns) -> None:
    assert_trained_bit_for_bit_as_unwatched(ddp_runs, width=256, layers=4)


def test_the_examples_fsdp2_steps_gather_and_reduce_scatter_each_unit_on_both_ranks_bitwise_as_unwatched(
        fsdp2_runs: ExampleRuns) -> None:
    """``--fsdp2``: ``ModelParallelStrategy``, 4 ``fully_shard`` units in one root. Each step on
    both ranks reported as ``fsdp``: each unit all-gathered for the forward and again for the
    backward, and its gradients reduce-scattered once; no training loss (the sharded root's forward
    returns its output); the final parameters, gathered from the shards, the unwatched run's."""
    runs, units = fsdp2_runs, 2 + 2
    assert sorted(runs.session.reports) == [1, 2, 3, 4]
    (segment,) = runs.summary["segments"]
    assert segment["strategy"] == "fsdp" and segment["world_size"] == 2 and segment["excluded_steps"] == []
    for step, reports in runs.session.reports.items():
        kinds = {rank: [s.kind for s in report.spans] for rank, report in reports.items()}
        assert {rank: (k.count("all_gather"), k.count("reduce_scatter"), k.count("all_reduce"))
                for rank, k in kinds.items()} == {0: (2 * units, units, 0), 1: (2 * units, units, 0)}, step
        assert all(r.strategy == "fsdp" and r.loss is None and r.samples == 32 for r in reports.values()), step
    assert all(rank.hello.total_steps == 4 for rank in runs.session.ranks.values())
    assert_trained_bit_for_bit_as_unwatched(runs, width=64, layers=2)
