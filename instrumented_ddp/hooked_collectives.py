"""The all-reduces a user's own DDP communication hook issues, timed as it issues them.

Why: DDP takes one communication hook, for good (its C++ reducer refuses a second), and
``DDPTiming`` times DDP's buckets through a hook of its own. A run that compresses its gradients
already has one: ``fp16_compress_hook``, ``bf16_compress_hook``, PowerSGD, or Accelerate's
``DistributedDataParallelKwargs(comm_hook=...)``, which registers one of those as it prepares the
model, before a Trainer callback could attach. Those are the runs whose users most want to see
their communication, and ``attach`` refused them.

Every hook PyTorch ships issues its collectives through ``torch.distributed.all_reduce``, looked
up on the module at each call (``dist.all_reduce(...)``). While a DDP with a hook of its own is
attached, that name is this module's ``all_reduce``, which hands the call to the watching
``DDPTiming`` when it is made on the thread running a watched backward, inside the autograd engine
(DDP calls its hook there, as each bucket becomes ready) and asynchronously (a hook returns a
future, so it never blocks);
any other call, from any other thread or outside a backward, goes to torch's own function
untouched, one dictionary lookup later. So a ``SyncBatchNorm``'s blocking all-reduce in backward,
or a loop's all-reduce of its loss, is not taken for the hook's.

Not seen, and so counted among the step's untimed collectives (``IssuedCollectives``): a hook
that calls the process group itself (``group.allreduce``) or a function it imported by name
before ``attach``; what a hook issues from a completion callback on another thread (PowerSGD's
second and third all-reduces of a bucket on gloo, whose futures complete on gloo's thread; on
NCCL a future completes as the collective is enqueued, so those run at once, on the backward's
thread, and are seen); and all-gathers (the experimental quantization hooks). DDP's built-in C++
hooks (``_register_builtin_comm_hook``) issue nothing in Python at all: ``attach`` refuses them.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

#: What times one all-reduce issued in a watched backward: given torch's own ``all_reduce`` and
#: the call's tensor, op and group, it issues the collective and returns its work.
Timer = Callable[[Callable[..., Any], torch.Tensor, Any, Any], Any]

#: torch's ``all_reduce``, while this module's stands in for it (None: it does not).
_torch_all_reduce: Callable[..., Any] | None = None
#: The timer of each thread running a watched backward, by thread ident.
_timers: dict[int, Timer] = {}
#: The ``DDPTiming`` objects that need this module's ``all_reduce`` in place (by id).
_users: set[int] = set()
_lock = threading.Lock()


def all_reduce(tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM, group: Any = None, async_op: bool = False,
               *more: Any, **extra: Any) -> Any:
    """``torch.distributed.all_reduce``, timed where a watched backward's hook issued it. Arguments
    a later torch may add (``more``, ``extra``) pass the call through untimed, never refused."""
    original = _torch_all_reduce if _torch_all_reduce is not None else dist.distributed_c10d.all_reduce
    timer = _timers.get(threading.get_ident())
    if timer is None or not async_op or more or extra or torch._C._current_graph_task_id() == -1:
        return original(tensor, op, group, async_op, *more, **extra)
    return timer(original, tensor, op, group)


def stand_in(user: object) -> None:
    """Put this module's ``all_reduce`` in ``torch.distributed`` for ``user`` (a ``DDPTiming``
    watching a hook), if it is not there yet."""
    global _torch_all_reduce
    with _lock:
        _users.add(id(user))
        if _torch_all_reduce is None:
            current = dist.all_reduce  # ours already, where a stand-in put over ours kept it (``stand_down``)
            _torch_all_reduce = current if current is not all_reduce else dist.distributed_c10d.all_reduce
            dist.all_reduce = all_reduce


def stand_down(user: object) -> None:
    """``user`` no longer needs it: once no one does, torch's own is back, unless someone else
    has put a function of theirs there since (theirs stays; this one, left behind it, passes
    every call through)."""
    global _torch_all_reduce
    with _lock:
        _users.discard(id(user))
        if _users or _torch_all_reduce is None:
            return
        if dist.all_reduce is all_reduce:
            dist.all_reduce = _torch_all_reduce
        _torch_all_reduce = None


def watch_thread(timer: Timer) -> int:
    """Time the hook's all-reduces issued on this thread with ``timer`` (a backward began on it);
    returns the thread's ident, for ``unwatch_thread``."""
    ident = threading.get_ident()
    _timers[ident] = timer
    return ident


def unwatch_thread(ident: int | None) -> None:
    """That backward ended (possibly on another thread than the one it began on)."""
    if ident is not None:
        _timers.pop(ident, None)


def hook_name(hook: Any) -> str:
    """A communication hook's name as a user wrote it: ``fp16_compress_hook``, PowerSGD's
    ``powerSGD_hook``; the function under a ``functools.partial``; the wrapper's inner function
    for ``fp16_compress_wrapper(hook)`` (``fp16_compress_wrapper_hook``)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    return str(getattr(hook, "__name__", None) or type(hook).__name__)
