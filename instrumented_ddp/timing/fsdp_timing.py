"""Timing FSDP2's collectives: the comms a ``fully_shard`` model issues, through FSDP's own hooks.

FSDP2 lets a caller replace each unit's all-gather and reduce-scatter
(``FSDPModule.set_custom_all_gather``/``set_custom_reduce_scatter``). ``TimedAllGather`` and
``TimedReduceScatter`` issue the call as FSDP's defaults do (same collective, same group, a
plain output tensor allocated as the default allocates it) and record it on a timeline. The
``fsdp`` strategy uses them on the copy it shards; ``FSDPTiming`` on a model the user sharded
(``attach``). On a 2-D mesh (HSDP: sharded within a replica, replicated across) FSDP also
all-reduces each unit's reduce-scattered gradients across the replicas, with a plain
``dist.all_reduce`` on the replicate dimension's group and no hook to take it: that group is
swapped for a ``ForwardingGroup`` that hands the call to ``TimedReplicaAllReduce``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter  # FSDP2's comm interfaces

from instrumented_ddp.timing.collectives import timed_collective
from instrumented_ddp.timing.forwarding_group import ForwardingGroup
from instrumented_ddp.timing.timeline import NULL_TIMELINE, NullTimeline, StepTimeline

#: FSDP2's own comms, by class name (``_fsdp_param_group``): any other was set by someone else.
DEFAULT_COMMS = frozenset({"DefaultAllGather", "DefaultReduceScatter"})

#: The queue HSDP's all-reduces across replicas wait in (``StepTimeline.open_collective``): the
#: replicate dimension's process group, whose gloo threads or NCCL stream are not the shard
#: group's, which the all-gathers and reduce-scatters share.
REPLICAS_QUEUE = "replicas"


class _TimedComm:
    """What FSDP's default comms do besides the call: allocate a plain tensor per call. Holds the
    unit's tag, and says whether a call blocks compute: on a GPU FSDP issues it on its own stream
    (the span's end mark lands there, after the collective), and the compute stream waits only
    where FSDP makes it wait, which the forward's own events time; on gloo the call holds the
    training thread. ``timeline`` may be swapped for ``NULL_TIMELINE``: the comm then issues
    its collective untimed (``FSDPTiming.stop_timing``)."""

    def __init__(self, timeline: Any, unit: int) -> None:
        self.timeline, self.tag = timeline, f"u{unit}"
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    @staticmethod
    def blocks_compute(input_tensor: torch.Tensor, async_op: bool) -> bool:
        return not async_op and not input_tensor.is_cuda


class TimedAllGather(_TimedComm, AllGather):
    """FSDP's all-gather of one unit's parameters, issued as the default does and timed."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> dist.Work | None:
        self.calls += 1
        return timed_collective(self.timeline, "all_gather", input_tensor, output=output_tensor, tag=self.tag,
                                async_op=async_op, group=group, blocking=self.blocks_compute(input_tensor, async_op))


class TimedReduceScatter(_TimedComm, ReduceScatter):
    """FSDP's reduce-scatter of one unit's gradients, issued as the default does and timed."""

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: Any, async_op: bool = False) -> dist.Work | None:
        self.calls += 1
        return timed_collective(self.timeline, "reduce_scatter", input_tensor, output=output_tensor, tag=self.tag,
                                async_op=async_op, group=group, op=op, blocking=self.blocks_compute(input_tensor, async_op))


class TimedReplicaAllReduce(_TimedComm):
    """HSDP's all-reduce of one unit's reduce-scattered gradients across its replicas: the
    watcher of the ``ForwardingGroup`` that stands for the replicate dimension's group. FSDP's
    ``dist.all_reduce`` call reaches it as ``group.allreduce``; it issues the same all-reduce,
    FSDP's op untouched, on the group it stands for, and hands back the work for that call to
    wait on. The call is synchronous, so on gloo it holds the training thread; on a GPU it runs
    on FSDP's all-reduce stream and blocks no compute."""

    def __call__(self, group: dist.ProcessGroup, tensors: list[torch.Tensor], options: dist.AllreduceOptions) -> dist.Work:
        self.calls += 1
        (tensor,) = tensors
        work = timed_collective(self.timeline, "all_reduce", tensor, tag=self.tag, async_op=True, group=group,
                                op=options.reduceOp, blocking=not tensor.is_cuda, queue=REPLICAS_QUEUE)
        # None only from a group this rank is not in; FSDP all-reduces on its own replicate group.
        assert work is not None, "an asynchronous all-reduce on this rank's own group gives a work"
        return work


def time_replica_all_reduces(unit: FSDPModule, timed: TimedReplicaAllReduce) -> bool:
    """Route the all-reduces across replicas of ``unit`` (HSDP) through ``timed``: its param
    groups' replicate group becomes a ``ForwardingGroup`` watched by it. FSDP builds a mesh's
    groups once per ``fully_shard`` call, so each unit has its own; one already forwarding (a
    mesh shared with another unit, in a torch that shares it) keeps its first unit's tag.
    False where ``unit`` is not replicated (a 1-D mesh: nothing to time)."""
    meshes = _replicated_meshes(unit)
    for mesh_info in meshes:
        if not isinstance(mesh_info.replicate_process_group, ForwardingGroup):
            forwarding = ForwardingGroup(mesh_info.replicate_process_group)
            forwarding.watcher = timed
            mesh_info.replicate_process_group = forwarding
    return bool(meshes)


def replica_ranks(model: nn.Module) -> list[int]:
    """The ranks this rank's replicas of its shard are on, its own among them, where a
    ``fully_shard`` model is on a 2-D mesh (HSDP: the replicate dimension's group, which FSDP
    all-reduces across); [] on a 1-D mesh (sharded over every rank). A ``ForwardingGroup``,
    which ``torch.distributed`` does not know, is read through to the group it stands for."""
    for unit in fsdp_units(model):
        for mesh_info in _replicated_meshes(unit):
            replicas = mesh_info.replicate_process_group
            return dist.get_process_group_ranks(getattr(replicas, "inner", replicas))
    return []


def shard_group(model: nn.Module) -> dist.ProcessGroup | None:
    """The process group the model's all-gathers and reduce-scatters run on (its mesh's shard
    dimension: the default group where a 1-D mesh covers every rank); None where FSDP keeps no
    param group to read it from (a model with no parameters of its own)."""
    for unit in fsdp_units(model):
        for group in _fsdp_param_groups(unit):
            return group.mesh_info.shard_process_group
    return None


def _replicated_meshes(unit: FSDPModule) -> list[Any]:
    """The mesh infos of ``unit``'s param groups that have a replicate dimension (HSDP): FSDP's
    private ``mesh_info.replicate_process_group`` is read here only."""
    return [group.mesh_info for group in _fsdp_param_groups(unit)
            if getattr(group.mesh_info, "replicate_process_group", None) is not None]


def fsdp_units(model: nn.Module) -> list[FSDPModule]:
    """The model's ``fully_shard`` units, the root last (as the ``fsdp`` strategy numbers them:
    ``u<i>``, the root taking what is left, embeddings and head)."""
    units: list[FSDPModule] = [m for m in model.modules() if isinstance(m, FSDPModule)]
    return [*units[1:], units[0]] if units and units[0] is model else units


def _fsdp_param_groups(unit: FSDPModule) -> list[Any]:
    """FSDP's param groups of ``unit``, a private attribute: a list in newer torch, one group (or
    None) in older."""
    state = unit._get_fsdp_state()
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def custom_comms(unit: FSDPModule) -> list[str]:
    """Comms someone already set on ``unit`` (``set_custom_all_gather`` and the like, or FSDP's
    symmetric-memory ones): their class names. Where a torch keeps none, nothing is found."""
    names = [type(getattr(g, attribute)).__name__ for g in _fsdp_param_groups(unit)
             for attribute in ("_all_gather_comm", "_reduce_scatter_comm") if hasattr(g, attribute)]
    return [name for name in names if name not in DEFAULT_COMMS]


def param_groups(unit: FSDPModule) -> int:
    """How many param groups FSDP made for ``unit``: more than one (per-parameter meshes through
    ``shard_placement_fn``) and FSDP refuses a custom comm."""
    return len(_fsdp_param_groups(unit))


class FSDPTiming:
    """The timed all-gathers and reduce-scatters of a model its user sharded with ``fully_shard``:
    each unit's comms replaced by timed ones that issue what FSDP's defaults issue, tagged
    ``u<i>`` by unit, and on a 2-D mesh (HSDP) its all-reduces across replicas, tagged alike.
    What ``attach`` asks of a timing, as ``DDPTiming`` answers it for DDP."""

    #: FSDP has no first iteration unlike the others (DDP's is one bucket of everything).
    on_first_buckets = False

    def __init__(self, model: nn.Module, timeline: StepTimeline | NullTimeline) -> None:
        self.model, self.timeline = model, timeline
        self.units = fsdp_units(model)
        self._comms: list[_TimedComm] = []
        self._reductions_at_backward_start = 0

    def install(self) -> None:
        for index, unit in enumerate(self.units):
            gather, scatter = TimedAllGather(self.timeline, index), TimedReduceScatter(self.timeline, index)
            unit.set_custom_all_gather(gather)
            unit.set_custom_reduce_scatter(scatter)
            self._comms += [gather, scatter]
            replicas = TimedReplicaAllReduce(self.timeline, index)
            if time_replica_all_reduces(unit, replicas):
                self._comms.append(replicas)

    def resume(self, timeline: StepTimeline | NullTimeline) -> None:
        """Time the units' comms on ``timeline`` again, after ``stop_timing`` (a second ``attach``)."""
        for comm in self._comms:
            comm.timeline = timeline
        self.timeline = timeline

    def stop_timing(self) -> None:
        """FSDP has no way back to its default comms but to set them again, a private class: the
        timed ones stay and go on issuing the same collectives, untimed (the all-reduces across
        replicas too, through their forwarding groups)."""
        for comm in self._comms:
            comm.timeline = NULL_TIMELINE
        self.timeline = NULL_TIMELINE

    def bucket_layout(self) -> list[list[int]]:
        """FSDP has units, not buckets: the advisor has nothing to read."""
        return []

    def backward_began(self) -> None:
        self._reductions_at_backward_start = self._reductions()

    def backward_ended(self) -> bool:
        """Called when backward has ended (FSDP's own end-of-backward callback, which waits for
        its reduce-scatters, has run): True when this backward reduced gradients (not under
        ``set_requires_gradient_sync(False)``): reduce-scattered them, or, on a mesh with one rank
        per replica, where FSDP skips the reduce-scatter, all-reduced them across replicas."""
        self.timeline.poll()
        return self._reductions() > self._reductions_at_backward_start

    def _reductions(self) -> int:
        return sum(comm.calls for comm in self._comms if isinstance(comm, (TimedReduceScatter, TimedReplicaAllReduce)))
