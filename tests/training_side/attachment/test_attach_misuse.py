"""Each misuse of ``attach`` refused in one line naming the fix, with nothing changed and the
run training on after it. In one process over a one-rank gloo group (FSDP2's misuses are in
``test_attach.py``, beside its attach)."""

from __future__ import annotations

import inspect
import re
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch import nn

import instrumented_ddp
from instrumented_ddp.attachment import attachment
from instrumented_ddp.attachment.attachment import AttachError
from launch import free_port
from attach_helpers import attach_for_test, attached, make_ddp, train, untouched


def trained_one_step(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
    train(ddp, optimizer, steps=1)
    return ddp, optimizer


MISUSES = {
    "a module that is not DDP": ("not DistributedDataParallel: wrap it first", lambda ddp, opt: (ddp.module, opt)),
    "DDP with a built-in hook": ("has the built-in communication hook 'BuiltinCommHookType.ALLREDUCE', which runs in C++",
                                 lambda ddp, opt: (ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE), (ddp, opt))[1]),
    "after the first backward": ("training has already begun", lambda ddp, opt: trained_one_step(ddp, opt)),
    "an optimizer that is not one": ("not a torch.optim.Optimizer", lambda ddp, opt: (ddp, object())),
    "no optimizer in the list": ("no optimizer given", lambda ddp, opt: (ddp, [])),
    "a list with one that is not one": ("not a torch.optim.Optimizer", lambda ddp, opt: (ddp, [opt, object()])),
    "an optimizer listed twice": ("an optimizer is given twice", lambda ddp, opt: (ddp, [opt, opt])),
    "an optimizer without step hooks": ("HooklessOptimizer that never ran torch.optim.Optimizer.__init__",
                                        lambda ddp, opt: (ddp, HooklessOptimizer(opt))),
}


class HooklessOptimizer(torch.optim.Optimizer):
    """A ``torch.optim.Optimizer`` that never ran its ``__init__`` (so has no step hooks), and
    keeps what it steps where ddpwatch does not look. Before, ``attach`` raised an
    ``AttributeError`` from torch's ``register_step_pre_hook``, its comm hook already in DDP."""

    def __init__(self, stepped: torch.optim.Optimizer) -> None:
        self.stepped, self.param_groups = stepped, stepped.param_groups

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.stepped.step()


@pytest.mark.parametrize("misuse", MISUSES)
def test_each_misuse_gets_one_line_naming_the_fix_and_changes_nothing(one_rank_group: None, misuse: str) -> None:
    expected, set_up = MISUSES[misuse]
    ddp, optimizer = make_ddp()
    model, given_optimizer = set_up(ddp, optimizer)
    hooks_before = len(ddp._comm_hooks)
    with pytest.raises(AttachError) as caught:
        instrumented_ddp.attach(model, given_optimizer, address=f"tcp://127.0.0.1:{free_port()}")
    message = str(caught.value)
    assert message.startswith("instrumented_ddp.attach: ") and "\n" not in message and expected in message
    assert untouched(ddp, optimizer, comm_hooks=hooks_before)
    train(ddp, optimizer, steps=1)  # the run goes on as before


def test_attaching_twice_or_beyond_loopback_without_keys_is_refused(one_rank_group: None) -> None:
    ddp, optimizer = make_ddp()
    with pytest.raises(AttachError, match="not loopback: pass watch_key="):
        instrumented_ddp.attach(ddp, optimizer, address="tcp://10.1.2.3:5555")
    assert untouched(ddp, optimizer)
    with attached(ddp, optimizer):
        with pytest.raises(AttachError, match="already attached"):
            attach_for_test(ddp, optimizer)


def test_a_second_model_attached_to_the_address_of_a_live_one_is_refused_and_another_address_is_not(
        one_rank_group: None) -> None:
    """A GAN's two DDPs attached to one dashboard: the second was another run, which the dashboard
    leaves out whole (a warning there, nothing here). Refused in one line; free again once the
    first detaches."""
    (generator, g_optimizer), (critic, c_optimizer) = make_ddp(), make_ddp()
    address = f"tcp://127.0.0.1:{free_port()}"
    first = instrumented_ddp.attach(generator, g_optimizer, address=address)
    try:
        with pytest.raises(AttachError, match=rf"^instrumented_ddp.attach: another model of this process is attached to "
                                              rf"{re.escape(address)}, and a dashboard watches one run: detach that one "
                                              r"first \(its watch.detach\(\)\), or attach this one to another address, "
                                              r"with a dashboard of its own \(ddpwatch --listen ADDRESS\)$"):
            instrumented_ddp.attach(critic, c_optimizer, address=address)
        assert untouched(critic, c_optimizer)
        with attached(critic, c_optimizer):  # another address
            pass
    finally:
        first.detach()
    instrumented_ddp.attach(critic, c_optimizer, address=address).detach()


def test_attach_without_a_process_group_says_how_to_make_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attachment.dist, "is_initialized", lambda: False)
    with pytest.raises(AttachError, match=r"no process group: call torch.distributed.init_process_group\(\)"):
        instrumented_ddp.attach(nn.Linear(2, 2), torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1))


def test_the_packages_attach_has_attachments_own_signature_and_refuses_a_misspelt_option() -> None:
    # ``instrumented_ddp.attach`` took ``**options`` and handed them on: a user's type checker and
    # editor saw no ``address`` or ``total_steps``, and a list of optimizers read as a type error.
    assert inspect.signature(instrumented_ddp.attach) == inspect.signature(attachment.attach)
    with pytest.raises(TypeError, match="adress"):
        instrumented_ddp.attach(nn.Linear(1, 1), torch.optim.SGD(nn.Linear(1, 1).parameters()), adress="tcp://127.0.0.1:1")  # type: ignore[call-arg]
