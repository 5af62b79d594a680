"""``torch.distributed``'s collective functions, stood in for while a model is attached, so that
the collectives a user's own code issues are timed where ddpwatch can tell whose they are.

Why: ``attach`` times what DDP itself issues (its buckets, through a communication hook of
ddpwatch's; its buffer broadcasts). A user's script issues more, in two places:

* **their communication hook** (gradient compression: ``fp16_compress_hook``, PowerSGD), whose
  asynchronous all-reduces inside a watched backward are the buckets' (``hooked_collectives``
  says which watched DDP issued one);
* **their loop**, between the model's phases: the Trainer's gather of the label count before
  each forward and of the loss and FLOPs for its log, a loop's all-reduce of its loss, a
  broadcast of a random seed. Untimed, their time would read as data loading (before a forward)
  or as the optimizer's (before ``step()``), and a rank waiting in one for a slower rank's loader
  as a slow loader itself, so that no straggler could be named. Timed, they are collectives like any other (spans of their kind,
  tagged ``l<k>``, the k-th of the step, in M and in the waits that name a straggler).

Every library PyTorch users train with looks these functions up on the module at each call
(``dist.all_reduce(...)``; Accelerate's ``gather`` reads ``torch.distributed.all_gather_into_tensor``
as it runs), which is what makes a stand-in see them; torch's own functions calling each other
inside ``distributed_c10d`` are not seen, so nothing is timed twice (``all_gather_object``'s
inner gathers, for one, are not: it is counted untimed). A user's own script may
have imported a function by name before attaching (``from torch.distributed import all_reduce``),
holding torch's function where the module's look-up would find ours: the user's own modules
(``__main__`` and those loaded from outside the interpreter's library folders) have such names
rebound to ours while the stand-ins are in place (``_rebind_users_names``); a library's are
left alone. A *synchronous* call of the
loop ddpwatch issues asynchronously and waits for itself, which is what torch's synchronous path
does (``work.wait()``: on the CPU until it completes, on NCCL the current stream waiting for
it), so the user's code sees the same thing. An *asynchronous* one (``ZeroRedundancyOptimizer``'s
broadcasts in its ``step()``, a loss all-reduced while the next batch loads) is issued as asked
and timed as the strategies' are, its work handed back in a wrapper whose ``wait()`` is a
``wait`` span: blocked, not compute (``collectives.WaitedByTheLoop``). One inside the training
forward (a mixture of experts' all-to-alls, a ``SyncBatchNorm``'s gathers) is the loop's too, a
blocking span inside the forward's. Anything inside a backward (autograd's: their backward
all-to-alls, a ``SyncBatchNorm``'s all-reduce), in a pause of training, on another thread, inside
``_coalescing_manager``, or while ``torch.compile`` traces passes through untimed, and is counted.

The stand-ins are in place while anyone needs them (``stand_in``/``stand_down``) and pass every
call they do not time to torch's own function, looked up once.
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from instrumented_ddp.timing import hooked_collectives, users_code

class Collective(NamedTuple):
    """What a stood-in function issues: its span's kind (``step_figures.COMM_KINDS``; ``BARRIER`` for a
    barrier), and which of its arguments holds the bytes that count (nccl-tests': an all-gather's
    output, a reduce-scatter's and an all-to-all's input, the whole tensor otherwise; "" for a
    barrier, which carries nothing). ``per_rank``: that argument is one rank's piece (a gather's,
    a scatter's; only the root holds the list), so the bytes are it times the group's ranks, as
    nccl-tests counts them, the same on every rank."""

    kind: str
    counted: str
    per_rank: bool = False


#: ``Collective.kind`` of a barrier: a collective with nothing to carry, timed as the wait it is
#: (an asynchronous one's where the loop waits for its work: ``LoopWork._time_barrier``).
BARRIER = "barrier"

#: The functions stood in for, those this torch has (``*_single``: the names torch 2.13 prefers
#: to ``*_tensor``), by name.
COLLECTIVES = {name: collective for name, collective in {
    "barrier": Collective(BARRIER, ""),
    "all_reduce": Collective("all_reduce", "tensor"),
    "all_gather": Collective("all_gather", "tensor_list"),
    "all_gather_into_tensor": Collective("all_gather", "output_tensor"),
    "all_gather_single": Collective("all_gather", "output_tensor"),
    "broadcast": Collective("broadcast", "tensor"),
    "reduce": Collective("reduce", "tensor"),  # a loss reduced to rank 0 for its log
    "reduce_scatter": Collective("reduce_scatter", "input_list"),  # a ZeRO written by hand, one tensor a rank
    "reduce_scatter_tensor": Collective("reduce_scatter", "input"),
    "reduce_scatter_single": Collective("reduce_scatter", "input"),
    "all_to_all": Collective("all_to_all", "input_tensor_list"),  # the loop's, a mixture of experts' in its forward
    "all_to_all_single": Collective("all_to_all", "input"),
    "gather": Collective("gather", "tensor", per_rank=True),  # an evaluation's predictions to rank 0
    "scatter": Collective("scatter", "tensor", per_rank=True),
}.items() if hasattr(dist.distributed_c10d, name)}


class LoopCall(NamedTuple):
    """A collective the loop issued: its kind (``BARRIER`` for a barrier), the bytes nccl-tests
    counts, their dtype, its process group (None: the default group), whether the loop asked for
    it asynchronously (``async_op=True``: it waits for the work itself), and the type of the
    device its tensors are on ("cpu": a metric over a gloo side group in a GPU run; "" for a
    barrier, which has none)."""

    kind: str
    nbytes: int
    dtype: str
    group: Any
    async_op: bool
    device: str


#: What a loop timer returns where it issued nothing: torch's own function issues the call.
NOT_TIMED: Any = object()

#: What times a loop's collective: given the call and a function issuing it asynchronously
#: (returning its work), issues it and returns what torch's function would have (a synchronous
#: call: None, once waited for; an asynchronous one: a work the loop waits on); or returns
#: ``NOT_TIMED``, having issued nothing, where it is not to be timed.
LoopTimer = Callable[[LoopCall, Callable[[], Any]], Any]

#: torch's own functions, by name, while ours stand in for them (c10d's where ``torch.distributed``
#: had none by that name: ``stand_down`` puts a function back, never None).
_torch_functions: dict[str, Callable[..., Any]] = {}
#: Who needs the stand-ins in place (by id): attachments, and DDPs timing a hook of the user's.
_users: set[int] = set()
#: The loop timers of each thread an attached loop trains on, by thread ident, the latest
#: attachment's last (two models attached to two dashboards from one loop: a GAN's).
_loop_timers: dict[int, list[LoopTimer]] = {}
#: Names in the user's own modules that held torch's function and hold ours while the stand-ins
#: are in place: (module, attribute, the collective's name).
_rebound: list[tuple[ModuleType, str, str]] = []
_lock = threading.Lock()


def torch_function(name: str) -> Callable[..., Any]:
    """torch's own ``name``, whether a stand-in is in place or not."""
    return _torch_functions.get(name) or getattr(dist.distributed_c10d, name)


class _Parameters(NamedTuple):
    names: tuple[str, ...]  # every parameter, in order
    positional: int  # how many of them may be given by position
    defaults: dict[str, Any]


@functools.cache
def _parameters(name: str) -> _Parameters | None:
    """torch's ``name``'s parameters, read once; None where one could not be passed by name."""
    parameters = list(inspect.signature(getattr(dist.distributed_c10d, name)).parameters.values())
    if any(p.kind not in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) for p in parameters):
        return None
    return _Parameters(tuple(p.name for p in parameters), sum(p.kind == p.POSITIONAL_OR_KEYWORD for p in parameters),
                       {p.name: p.default for p in parameters if p.default is not p.empty})


def _arguments(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
    """A call's arguments by name, defaults filled in, as torch's ``name`` reads them: what
    ``inspect.Signature.bind`` gives, at a fraction of its cost (ZeroRedundancyOptimizer makes
    a call per parameter a step). None where torch's function would refuse them (it then says
    why) or where a later torch's takes others: the call passes through, never refused here."""
    parameters = _parameters(name)
    if parameters is None or len(args) > parameters.positional:
        return None
    arguments = dict(zip(parameters.names, args, strict=False))  # the first len(args) names: the rest came by keyword or not at all
    for key, value in kwargs.items():
        if key in arguments or key not in parameters.names:
            return None
        arguments[key] = value
    for key, default in parameters.defaults.items():
        arguments.setdefault(key, default)
    return arguments if len(arguments) == len(parameters.names) else None


@functools.wraps(dist.distributed_c10d.all_reduce)
def all_reduce(*args: Any, **kwargs: Any) -> Any:
    """``torch.distributed.all_reduce``: a hook's in a watched backward, timed as the bucket it
    reduces; else a loop's, timed where it may be; else torch's, untouched, with the arguments
    as given (Dynamo, tracing a compiled loop, reads them as torch's function would be given them)."""
    original = torch_function("all_reduce")
    if torch.compiler.is_compiling():  # first: Dynamo cannot trace a thread's ident (a graph break; fullgraph fails)
        return original(*args, **kwargs)
    arguments = _arguments("all_reduce", args, kwargs)
    if arguments is not None and arguments["async_op"] and (timer := hooked_collectives.backward_timer()) is not None:
        return timer(original, arguments["tensor"], arguments["op"], arguments["group"])
    return _issued_by_the_loop("all_reduce", original, args, kwargs, arguments)


def _stand_in_for(name: str) -> Callable[..., Any]:
    """The stand-in for one of the other collectives: a loop's, timed where it may be."""

    @functools.wraps(getattr(dist.distributed_c10d, name))
    def collective(*args: Any, **kwargs: Any) -> Any:
        original = torch_function(name)
        if torch.compiler.is_compiling():  # first: Dynamo cannot trace a thread's ident (a graph break; fullgraph fails)
            return original(*args, **kwargs)
        return _issued_by_the_loop(name, original, args, kwargs)

    return collective


STAND_INS: dict[str, Callable[..., Any]] = {"all_reduce": all_reduce,
                                            **{name: _stand_in_for(name) for name in COLLECTIVES if name != "all_reduce"}}


#: ``_issued_by_the_loop``'s ``arguments`` where the caller has not read them.
_UNREAD: Any = object()


def _issued_by_the_loop(name: str, original: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
                        arguments: Any = _UNREAD) -> Any:
    """Issue a call that is not a hook's, outside code ``torch.compile`` traces (each stand-in
    asks that first): timed by the thread's loop timer where there is one, outside a backward;
    else untimed. ``arguments``: ``_arguments`` of the call, where the stand-in read them already
    (``all_reduce``, asking whether a hook issued it); read here otherwise, and only for a call a
    loop timer may time. Whatever reading the call raises passes it on untimed: torch says what
    is wrong with it, as it would have."""
    timers = _loop_timers.get(threading.get_ident())
    if not timers or torch._C._current_graph_task_id() != -1:
        return original(*args, **kwargs)
    try:
        if arguments is _UNREAD:
            arguments = _arguments(name, args, kwargs)
        call = None
        if (arguments is not None and not dist.distributed_c10d._rank_not_in_group(arguments["group"])
                and not _coalescing(arguments["group"])):
            kind, counted, per_rank = COLLECTIVES[name]
            if not counted:  # a barrier: nothing to carry, only the time the loop sits in it
                call = LoopCall(kind, 0, "", arguments["group"], bool(arguments["async_op"]), "")
            else:
                first = _first_tensor(arguments[counted])
                nbytes = _counted_bytes(arguments[counted]) * (dist.get_world_size(arguments["group"]) if per_rank else 1)
                call = LoopCall(kind, nbytes, str(first.dtype).removeprefix("torch."),
                                arguments["group"], bool(arguments["async_op"]), first.device.type)
                arguments["async_op"] = True
    except Exception:
        call = None
    if call is None:  # issued once, outside the ``try``: an error of torch's is the user's, never a second call
        return original(*args, **kwargs)
    result = timers[-1](call, lambda: original(**arguments))
    return original(*args, **kwargs) if result is NOT_TIMED else result


def _coalescing(group: Any) -> bool:
    """Whether ``group`` (None: the default one) is inside ``_coalescing_manager``: torch then
    issues nothing at the call, keeping it for one coalesced collective at the block's end (made
    in C++, no stand-in sees it: counted untimed), and an asynchronous call's work may not even
    be waited for (``_IllegalWork``). Such a call passes through."""
    c10d = dist.distributed_c10d
    return (group if group is not None else c10d._get_default_group()) in c10d._world.pg_coalesce_state


def _first_tensor(value: Any) -> torch.Tensor:
    return value[0] if isinstance(value, (list, tuple)) else value


def _counted_bytes(value: Any) -> int:
    tensors = value if isinstance(value, (list, tuple)) else [value]
    return sum(t.numel() * t.element_size() for t in tensors)


def time_loop_calls(timer: LoopTimer) -> int:
    """Time with ``timer`` the loop's collectives on this thread, the one it trains
    on; returns the thread's ident, for ``stop_timing_loop_calls``."""
    ident = threading.get_ident()
    _loop_timers.setdefault(ident, []).append(timer)
    return ident


def stop_timing_loop_calls(ident: int | None, timer: LoopTimer) -> None:
    """``timer`` no longer times that thread's calls: the attachment before it does again, if
    one is still there. (A bound method is made anew at each look-up: found equal, not the same.)"""
    if ident is None:
        return
    timers = _loop_timers.get(ident)
    if timers is None:
        return
    timers[:] = [t for t in timers if t != timer]
    if not timers:
        _loop_timers.pop(ident, None)


def _traceable_remaps() -> dict[Any, Any]:
    """Dynamo's table of the collectives it traces into a compiled graph (rewritten as
    functional collectives), by function; {} where torch has none."""
    try:
        from torch.distributed._functional_collectives import traceable_collective_remaps
    except ImportError:
        return {}
    return traceable_collective_remaps if isinstance(traceable_collective_remaps, dict) else {}


def stand_in(user: object) -> None:
    """Put the stand-ins in ``torch.distributed`` for ``user``, where they are not yet.

    Each also goes into Dynamo's table of traceable collectives beside torch's function: a loop
    compiled with ``torch.compile`` that calls ``dist.all_reduce`` then has the call rewritten
    into its graph as torch's own is, not inlined (Dynamo checks ``self.fn in (dist.all_reduce,
    ...)`` by the module's name; a stand-in inlined leaves a ``ReduceOp`` unconverted: ``fullgraph``
    fails, and every other compiled loop takes a graph break). Names the user's own modules
    imported before this hold ours too (``_rebind_users_names``)."""
    with _lock:
        _users.add(id(user))
        remaps = _traceable_remaps()
        placed = False
        for name, ours in STAND_INS.items():
            if name in _torch_functions:
                continue
            placed = True
            current = getattr(dist, name, None)  # ours already, where a stand-in put over ours kept it (``stand_down``)
            _torch_functions[name] = current if current is not None and current is not ours else getattr(dist.distributed_c10d, name)
            if (traced := remaps.get(getattr(dist.distributed_c10d, name))) is not None:
                remaps[ours] = traced
            setattr(dist, name, ours)
        if placed:  # once a name is ours, a module importing it after this gets ours
            _rebind_users_names()


def stand_down(user: object) -> None:
    """``user`` no longer needs them: once no one does, torch's own are back, except where
    someone else has put a function of theirs there since (theirs stays; ours, left behind it,
    passes every call through)."""
    with _lock:
        _users.discard(id(user))
        if _users:
            return
        remaps = _traceable_remaps()
        for name, ours in STAND_INS.items():
            if name in _torch_functions and getattr(dist, name) is ours:
                setattr(dist, name, _torch_functions[name])
                remaps.pop(ours, None)  # left where someone's put over ours still calls it
        for module, attribute, name in _rebound:
            if getattr(module, attribute, None) is STAND_INS[name]:  # else the user has bound it to something since
                setattr(module, attribute, _torch_functions[name])
        _rebound.clear()
        _torch_functions.clear()


def _users_modules() -> Iterator[ModuleType]:
    """The modules of the user's own code: ``__main__`` (their script, however started) and those
    loaded from outside the interpreter's library folders (a project's modules beside the script,
    one installed editable), ddpwatch's own left out: they issue their collectives untimed on purpose."""
    libraries = users_code.library_folders()
    for name, module in list(sys.modules.items()):
        if not isinstance(module, ModuleType) or name.split(".")[0] in users_code.NOT_USERS:
            continue
        path = getattr(module, "__file__", None)
        if name == "__main__" or (isinstance(path, str) and not os.path.abspath(path).startswith(libraries)):
            yield module


def _rebind_users_names() -> None:
    """Each name in the user's own modules that holds torch's own function for a collective stood
    in for (``from torch.distributed import all_reduce``, run before the stand-ins went in) is
    bound to ours, noted for ``stand_down``: unseen, such a call would be counted untimed, and a
    rank waiting in it for a slower one would read as its own data loading. Only where torch's function is
    what ours calls (nobody put a function of theirs in ``torch.distributed`` first: theirs may
    call the one it imported, which would then be ours, calling theirs again). Found by identity:
    a user's object is never hashed or compared."""
    originals = {id(function): (function, name) for name in STAND_INS
                 if _torch_functions.get(name) is (function := getattr(dist.distributed_c10d, name))}
    if not originals:
        return
    for module in _users_modules():
        try:
            namespace = list(vars(module).items())
        except Exception:  # a module whose namespace cannot be read: left alone
            continue
        for attribute, value in namespace:
            found = originals.get(id(value))
            if found is not None and found[0] is value:
                setattr(module, attribute, STAND_INS[found[1]])
                _rebound.append((module, attribute, found[1]))
