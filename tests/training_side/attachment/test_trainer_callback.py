"""``instrumented_ddp.integrations.DDPWatchCallback`` in one process: where the Trainer built no
DDP it says why in one line and training goes on, a refused attach the same, a ``train()`` begun
again after a failure ends the failed run, and a resumed run plans the steps it has left. The
Trainer through torchrun is in ``test_attach_end_to_end.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from instrumented_ddp.attachment.attachment import AttachError
from instrumented_ddp.wire.messages import Goodbye, StepReport
from launch import free_port
from attach_helpers import make_ddp, train, untouched


def test_the_trainer_callback_without_its_trainer_says_how_to_give_it() -> None:
    from instrumented_ddp.integrations import DDPWatchCallback

    with pytest.raises(AttachError, match=r"trainer.add_callback\(DDPWatchCallback\(trainer, address=...\)\)"):
        DDPWatchCallback().on_train_begin(None, None, None)


class UnwrappedTrainer:
    """What a Trainer holds when Accelerate built no DDP: the model itself."""

    model_wrapped = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model_wrapped.parameters(), lr=0.1)


ONE_PROCESS = ("ddpwatch: one process, so the Trainer built no DistributedDataParallel and there is no communication "
               "to watch (launch two or more with torchrun): training goes on unwatched\n")


def test_the_trainer_callback_in_one_process_trains_on_and_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """``python script.py`` with no torchrun: the Trainer does not wrap, there is no group."""
    from instrumented_ddp.integrations import DDPWatchCallback

    callback = DDPWatchCallback(UnwrappedTrainer())
    callback.on_train_begin(None, None, None)
    callback.on_train_end(None, None, None)
    assert callback.attachment is None
    assert capsys.readouterr().err == ONE_PROCESS


def test_the_trainer_callback_under_a_one_process_torchrun_trains_on_and_says_so(
        one_rank_group: None, capsys: pytest.CaptureFixture[str]) -> None:
    """``torchrun --nproc_per_node=1``: a process group exists, but Accelerate wraps a model in DDP
    only for two processes or more (seen on an H100: the callback's ``attach`` raised, and the
    Trainer stopped before its first step)."""
    from instrumented_ddp.integrations import DDPWatchCallback

    callback = DDPWatchCallback(UnwrappedTrainer())
    callback.on_train_begin(None, None, None)
    assert callback.attachment is None
    assert capsys.readouterr().err == ONE_PROCESS


def test_the_trainer_callback_on_another_wrapper_trains_on_and_names_it(capsys: pytest.CaptureFixture[str],
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Two or more processes and neither DDP nor FSDP2: the Trainer chose FSDP1 or DeepSpeed."""
    from instrumented_ddp.integrations import hf_trainer as integrations
    from instrumented_ddp.integrations import DDPWatchCallback

    monkeypatch.setattr(integrations.dist, "is_initialized", lambda: True)
    monkeypatch.setattr(integrations.dist, "get_world_size", lambda: 4)
    callback = DDPWatchCallback(UnwrappedTrainer())
    callback.on_train_begin(None, None, None)
    assert callback.attachment is None
    assert capsys.readouterr().err == ("ddpwatch: the Trainer wrapped the model as Linear, neither DistributedDataParallel "
                                       "nor FSDP2's fully_shard (FSDP1 or DeepSpeed?), which ddpwatch's Trainer callback "
                                       "watches: training goes on unwatched\n")


def test_the_trainer_callback_on_a_ddp_attach_refuses_trains_on_and_says_why(
        one_rank_group: None, capsys: pytest.CaptureFixture[str]) -> None:
    """A DDP given a built-in C++ hook before ``on_train_begin`` (Accelerate's Python ones are
    watched: ``test_attach_comm_hook.py``): the refusal raised there and stopped the Trainer."""
    from instrumented_ddp.integrations import DDPWatchCallback

    ddp, optimizer = make_ddp()
    ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)
    callback = DDPWatchCallback(SimpleNamespace(model_wrapped=ddp, optimizer=optimizer), address=f"tcp://127.0.0.1:{free_port()}")
    callback.on_train_begin(None, SimpleNamespace(max_steps=3), None)
    train(ddp, optimizer, steps=1)
    callback.on_train_end(None, None, None)
    assert callback.attachment is None and untouched(ddp, optimizer)
    assert capsys.readouterr().err == (
        "ddpwatch: instrumented_ddp.attach: this DistributedDataParallel has the built-in communication hook "
        "'BuiltinCommHookType.FP16_COMPRESS', which runs in C++ where ddpwatch cannot see its all-reduces: register its "
        "Python equivalent instead (torch.distributed.algorithms.ddp_comm_hooks.default_hooks: allreduce_hook, "
        "fp16_compress_hook), or none, to watch this run: training goes on unwatched\n")


def test_the_trainer_callback_begun_again_after_an_out_of_memory_error_ends_the_failed_run_and_watches_the_new_one(
        one_rank_group: None, sent: list[Any]) -> None:
    """``auto_find_batch_size``: Accelerate catches the out-of-memory error (no ``on_train_end``),
    shrinks the batch and runs the training loop again, on a new DDP over the same module and the
    same optimizer (seen with transformers 5.24). Before, the first attachment stayed: its
    optimizer hooks counted the new run's steps with no forward, backward or all-reduce in them
    (Idle% 90), and the new DDP was refused its address, so trained unwatched."""
    from instrumented_ddp.integrations import DDPWatchCallback

    first, optimizer = make_ddp()
    trainer = SimpleNamespace(model_wrapped=first, optimizer=optimizer)
    callback = DDPWatchCallback(trainer, address=f"tcp://127.0.0.1:{free_port()}")
    args = SimpleNamespace(auto_find_batch_size=True)
    callback.on_train_begin(args, SimpleNamespace(max_steps=4, global_step=0, train_batch_size=8), None)
    train(first, optimizer, steps=2)  # then out of memory, caught by Accelerate
    trainer.model_wrapped = second = DistributedDataParallel(first.module, bucket_cap_mb=0.001)
    second.zero_grad()  # the Trainer's model.zero_grad() before on_train_begin
    callback.on_train_begin(args, SimpleNamespace(max_steps=4, global_step=0, train_batch_size=7), None)
    assert not first._forward_hooks and not first._forward_pre_hooks  # the failed run's DDP left alone
    assert len(optimizer._optimizer_step_pre_hooks) == len(optimizer._optimizer_step_post_hooks) == 1  # the new run's
    train(second, optimizer, steps=3)
    callback.on_train_end(args, None, None)
    goodbyes = [m for m in sent if isinstance(m, Goodbye)]
    assert [(g.steps, g.reason, g.trains_again) for g in goodbyes] == [
        (2, "failed: out of memory: the Trainer began again at a batch of 7 (auto_find_batch_size)", True),
        (3, "finished", False)]
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [r.step for r in reports] == [1, 2, 1, 2, 3]
    assert all({"forward", "backward", "all_reduce"} <= {s.kind for s in r.spans} for r in reports)


def test_the_trainer_callback_begun_again_after_train_raised_says_so() -> None:
    from instrumented_ddp.integrations.hf_trainer import begun_again_because

    assert begun_again_because(SimpleNamespace(auto_find_batch_size=False), None) == (
        "failed: train() raised, and training began again")
    assert begun_again_because(SimpleNamespace(auto_find_batch_size=True), SimpleNamespace(train_batch_size=None)) == (
        "failed: out of memory: the Trainer began again at a smaller batch (auto_find_batch_size)")


def test_the_trainer_callback_plans_the_steps_a_resumed_run_has_left() -> None:
    """``trainer.train(resume_from_checkpoint=...)``: the Trainer's state is at the checkpoint's
    global step when ``on_train_begin`` runs; the attached steps count from 1, so the progress and
    ETA counted the steps already trained again."""
    from instrumented_ddp.integrations.hf_trainer import steps_to_take

    assert steps_to_take(SimpleNamespace(max_steps=1000, global_step=600)) == 400
    assert steps_to_take(SimpleNamespace(max_steps=30, global_step=0)) == 30
    assert steps_to_take(SimpleNamespace(max_steps=-1, global_step=0)) == 0  # unknown
    assert steps_to_take(None) == 0


def test_the_trainer_callback_marks_a_subclasss_own_compute_while_attached_and_only_runs_it_otherwise(
        one_rank_group: None, sent: list[Any]) -> None:
    """A distilling Trainer's ``compute_loss`` runs its teacher inside ``callback.computing``: a
    ``loop`` span of the step while attached; before ``on_train_begin`` and after
    ``on_train_end`` the block runs, and nothing is sent."""
    from instrumented_ddp.integrations import DDPWatchCallback

    ddp, optimizer = make_ddp()
    callback = DDPWatchCallback(SimpleNamespace(model_wrapped=ddp, optimizer=optimizer),
                                address=f"tcp://127.0.0.1:{free_port()}")
    ran: list[str | int] = []
    with callback.computing("teacher forward"):
        ran.append("before")
    callback.on_train_begin(None, SimpleNamespace(max_steps=3), None)
    for step in range(3):
        optimizer.zero_grad()
        with callback.computing("teacher forward"):
            ran.append(step)
        train(ddp, optimizer, steps=1)
    callback.on_train_end(None, None, None)
    with callback.computing("teacher forward"):
        ran.append("after")
    assert ran == ["before", 0, 1, 2, "after"]
    reports = [m for m in sent if isinstance(m, StepReport)]
    assert [[s.tag for s in r.spans if s.kind == "loop"] for r in reports] == [[], ["teacher forward"], ["teacher forward"]]
