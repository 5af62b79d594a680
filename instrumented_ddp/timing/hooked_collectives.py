"""The all-reduces a user's own DDP communication hook issues, timed as it issues them.

Why: DDP takes one communication hook, for good (its C++ reducer refuses a second), and
``DDPTiming`` times DDP's buckets through a hook of its own. A run that compresses its gradients
already has one: ``fp16_compress_hook``, ``bf16_compress_hook``, PowerSGD, or Accelerate's
``DistributedDataParallelKwargs(comm_hook=...)``, which registers one of those as it prepares the
model, before a Trainer callback could attach. Those are the runs whose users most want to see
their communication.

Every hook PyTorch ships issues its collectives through ``torch.distributed.all_reduce``, looked
up on the module at each call (``dist.all_reduce(...)``). While a model is attached, that name is
``collective_stand_ins.all_reduce``, which asks ``backward_timer`` here for the watching
``DDPTiming`` of a call made on the thread running a watched backward, inside the autograd engine
(DDP calls its hook there, as each bucket becomes ready) and asynchronously (a hook returns a
future, so it never blocks). Any other call is not the hook's: a ``SyncBatchNorm``'s blocking
all-reduce in backward, or a loop's all-reduce of its loss (timed as the loop's, where it may be).

Not seen, and so counted among the step's untimed collectives (``IssuedCollectives``): a hook
that calls the process group itself (``group.allreduce``) or a function it imported by name
before ``attach``; what a hook issues from a completion callback on another thread (PowerSGD's
second and third all-reduces of a bucket on gloo, whose futures complete on gloo's thread; on
NCCL a future completes as the collective is enqueued, so those run at once, on the backward's
thread, and are seen); and all-gathers (the experimental quantization hooks). DDP's built-in C++
hooks (``_register_builtin_comm_hook``) issue nothing in Python at all: ``attach`` refuses them.

Which DDP's hook issued a call: one backward may run through two DDPs with hooks of their own (a
GAN's generator step runs through the discriminator too), and an all-reduce does not say. DDP
calls a hook as the last gradient of a bucket is accumulated, inside that parameter's
``AccumulateGrad`` node, so the call belongs to the watched DDP holding the parameter the engine
is accumulating (``torch._C._current_autograd_node``); a call made elsewhere (DDP launching a
bucket at the end of backward) is the only watcher's, or, where several watch, untimed and counted.
A call from a DDP nobody attached passes untimed too: timed, it would read as the attached model's.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

import torch

#: What times one all-reduce issued in a watched backward: given torch's own ``all_reduce`` and
#: the call's tensor, op and group, it issues the collective and returns its work.
Timer = Callable[[Callable[..., Any], torch.Tensor, Any, Any], Any]


class Watcher(NamedTuple):
    """A backward watched on a thread: what times its hook's calls, and the ids of its DDP's parameters."""

    timer: Timer
    parameters: frozenset[int]


#: The watchers of each thread running a watched backward, by thread ident: one, or several where
#: one backward runs through several hooked DDPs.
_watchers: dict[int, list[Watcher]] = {}
#: The autograd node the engine runs on this thread now (None outside one); absent from an older torch.
_current_autograd_node: Callable[[], Any] | None = getattr(torch._C, "_current_autograd_node", None)


def backward_timer() -> Timer | None:
    """The timer of an asynchronous all-reduce issued now, where it is a watched DDP's hook's:
    on a thread running a watched backward, inside the autograd engine (``owner`` says whose);
    else None (``collective_stand_ins`` asks, for every asynchronous all-reduce)."""
    watchers = _watchers.get(threading.get_ident())
    if not watchers or torch._C._current_graph_task_id() == -1:
        return None
    return owner(watchers)


def owner(watchers: list[Watcher]) -> Timer | None:
    """The timer of the watched DDP whose parameter's gradient the engine is accumulating now
    (DDP calls its hook there), or None where it is another DDP's; outside an accumulation, the
    only watcher's, or None where several watch."""
    node = _current_autograd_node() if _current_autograd_node is not None else None
    variable = getattr(node, "variable", None) if type(node).__name__ == "AccumulateGrad" else None
    if variable is None:
        return watchers[0].timer if len(watchers) == 1 else None
    holders = [watcher.timer for watcher in watchers if id(variable) in watcher.parameters]
    return holders[0] if len(holders) == 1 else None


def watch_thread(timer: Timer, parameters: frozenset[int]) -> int:
    """Time with ``timer`` the all-reduces the hook of the DDP holding ``parameters`` (their ids)
    issues on this thread, where a backward began; returns the thread's ident, for ``unwatch_thread``."""
    ident = threading.get_ident()
    _watchers.setdefault(ident, []).append(Watcher(timer, parameters))
    return ident


def unwatch_thread(ident: int | None, timer: Timer) -> None:
    """That backward ended (possibly on another thread than the one it began on): ``timer`` no
    longer watches the thread it began on. (A bound method is made anew at each look-up: the
    timer is found equal, not the same object.)"""
    if ident is None:
        return
    watchers = _watchers.get(ident)
    if watchers is None:
        return
    watchers[:] = [watcher for watcher in watchers if watcher.timer != timer]
    if not watchers:
        _watchers.pop(ident, None)


def hook_name(hook: Any) -> str:
    """A communication hook's name as a user wrote it: ``fp16_compress_hook``, PowerSGD's
    ``powerSGD_hook``; the function under a ``functools.partial``; the wrapper's inner function
    for ``fp16_compress_wrapper(hook)`` (``fp16_compress_wrapper_hook``)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return str(getattr(hook, "__name__", None) or type(hook).__name__)
