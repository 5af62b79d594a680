"""FSDP's collectives, seen through its custom-comm hooks (``fsdp_timing``): timed as what blocks and what does not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from instrumented_ddp.timing import fsdp_timing
from instrumented_ddp.strategies import fsdp


@pytest.mark.parametrize("comm, extra", [(fsdp_timing.TimedAllGather, {}), (fsdp_timing.TimedReduceScatter, {"op": "sum"})])
@pytest.mark.parametrize("on_gpu, blocking", [(False, True), (True, False)])
def test_a_gpu_collective_on_fsdps_stream_blocks_no_compute_and_a_gloo_call_does(
        monkeypatch: pytest.MonkeyPatch, comm: type, extra: dict, on_gpu: bool, blocking: bool) -> None:
    """On a GPU FSDP issues them on its own streams, so they overlap compute (marked blocking,
    they once read Overlap% 0 against the kernels' 93 on an H100); on gloo the call holds the
    training thread."""
    seen: dict = {}
    monkeypatch.setattr(fsdp_timing, "timed_collective", lambda *args, **kwargs: seen.update(args=args, **kwargs))
    tensor = SimpleNamespace(is_cuda=on_gpu)
    comm(timeline=None, unit=3)(torch.empty(0), tensor, group=None, **extra)
    assert seen["blocking"] is blocking and seen["tag"] == "u3" and seen["async_op"] is False
    assert seen["args"][1] == comm.__name__.removeprefix("Timed").replace("AllGather", "all_gather").replace(
        "ReduceScatter", "reduce_scatter")


def test_hsdps_all_reduce_across_replicas_and_ddps_bucket_ask_for_timing_in_their_own_group(one_rank_group: None) -> None:
    """Both are asynchronous works of a group that need not be the default one (the replicate
    group; a DDP's own ``process_group``): the clock is asked to time that group before the call.
    On NCCL it turns timing on there (``test_timeline_cuda.py``); without it, on a lent H200 every step
    of an attached HSDP run went out unresolved, its all-reduces' durations unreadable."""
    import torch.distributed as dist

    from instrumented_ddp.timing.collectives import timed_all_reduce_result
    from instrumented_ddp.timing.clocks import HostClock
    from instrumented_ddp.timing.timeline import StepTimeline

    class AskedClock(HostClock):
        def __init__(self) -> None:
            super().__init__()
            self.asked: list = []

        def time_collectives_in(self, group: object) -> None:
            self.asked.append(group)

    clock = AskedClock()
    timeline = StepTimeline(rank=0, clock=clock)
    replicas, own = dist.new_group([0]), dist.new_group([0])
    timeline.begin_step(1, "fsdp", {})
    options = dist.AllreduceOptions()
    fsdp_timing.TimedReplicaAllReduce(timeline, 0)(replicas, [torch.ones(4)], options).wait()
    timed_all_reduce_result(timeline, torch.ones(4), tag="b0", group=own, op=dist.ReduceOp.SUM).wait()
    assert clock.asked == [replicas, own]


def test_units_are_the_decoder_layers_then_the_root() -> None:
    layers = torch.nn.ModuleList([torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)])
    root = torch.nn.Sequential(torch.nn.Embedding(4, 2), torch.nn.Sequential(layers))
    assert fsdp.sharding_units(root) == [layers[0], layers[1], root]


def test_eval_and_train_reach_the_sharded_copy_that_runs(one_rank_group: None) -> None:
    import instrumented_ddp

    model = instrumented_ddp.wrap(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Dropout(0.5)), "fsdp")
    model.eval()
    assert not model.sharded.training and not any(m.training for m in model.sharded.modules())
    assert torch.equal(model(torch.ones(2, 4)), model(torch.ones(2, 4)))  # dropout off: it is the copy that runs
    model.train()
    assert model.sharded.training
    (linear, _) = instrumented_ddp.unwrap(model).children()
    assert isinstance(linear, torch.nn.Linear) and linear.weight.shape == (4, 4)
