"""ZeRO-1, ZeRO-2 and FSDP2 give what one process gives, in float64, on 2 and 3 ranks: the final
parameters, the gradient slice each rank holds, and a run switched through five strategies with
its optimizer state carried; and each holds the share of memory its stage promises."""

from __future__ import annotations

import copy
from typing import Any, cast

import pytest
import torch

import instrumented_ddp
from instrumented_ddp.strategies.zero2 import ShardedGradients
from launch import REPO_ROOT, describe_failure, run_ranks
from workers.sharded_runs import LR, SWITCHES
from workers.strategy_runs import global_micro_batches, make_model, rank_slice

WORKER = REPO_ROOT / "tests" / "support" / "workers" / "sharded_runs.py"
STEPS, GLOBAL_BATCH = 5, 12
SHARDED = [f"{strategy}:{accum}" for strategy in ("zero1", "zero2", "fsdp") for accum in (1, 2)]
#: Timed through a timeline: gloo's reduce-scatter once gave other numbers timed (a second thread waited on it).
TIMED = ["zero1:2:timed", "zero2:2:timed", "fsdp:2:timed", "switched:2:timed"]
RUNS = [*SHARDED, *TIMED, "ddp:1", "switched:1"]
TIGHT: dict[str, Any] = {"rtol": 1e-9, "atol": 1e-12}


def reference(grad_accum: int, world_size: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """One process, float64, the whole global batch: first-step gradients and final parameters.

    The batch goes through in the ranks' slices and their gradients are summed, then divided by
    the world size, as the ranks do: Hugging Face's RMSNorm computes in float32 even in a float64
    model, so scaling each slice's loss by 1/3 instead would differ by ~1e-8 (by nothing at 1/2,
    a power of two), which Adam then carries into every parameter."""
    model = make_model(seed=1234).double()  # rank 0's initial parameters, which every strategy starts from
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    first: dict[str, torch.Tensor] = {}
    for number, micro_batches in enumerate(global_micro_batches(7, STEPS, grad_accum, GLOBAL_BATCH)):
        for batch in micro_batches:
            for rank in range(world_size):
                (model(**rank_slice(batch, rank, world_size)).loss / len(micro_batches)).backward()
        for parameter in model.parameters():
            assert parameter.grad is not None
            parameter.grad /= world_size
        if number == 0:
            first = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
    return first, model.state_dict()


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def ranks_results(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("sharded") / "runs"
    results = run_ranks(WORKER, ["--out", str(out), "--steps", str(STEPS), "--global-batch", str(GLOBAL_BATCH),
                                 "--runs", *RUNS], world_size=request.param)
    assert all(r.returncode == 0 for r in results), describe_failure(results)
    return [torch.load(out.with_suffix(f".rank{rank}.pt")) for rank in range(request.param)]


@pytest.mark.parametrize("run", [*SHARDED, *TIMED, "switched:1"])
def test_final_parameters_equal_one_process(ranks_results: list[dict], run: str) -> None:
    _, expected = reference(int(run.split(":")[1]), len(ranks_results))
    for rank, results in enumerate(ranks_results):
        for name, tensor in results[run]["state"].items():
            torch.testing.assert_close(tensor, expected[name], **TIGHT, msg=f"{run} rank {rank} {name}")


@pytest.mark.parametrize("run", SHARDED)
def test_each_rank_holds_its_slice_of_the_averaged_gradients(ranks_results: list[dict], run: str) -> None:
    first, _ = reference(int(run.split(":")[1]), len(ranks_results))
    world_size = len(ranks_results)
    for rank, results in enumerate(ranks_results):
        held = results[run]["gradients"]
        if "fsdp" in held:
            for name, local in held["fsdp"].items():  # FSDP2 shards dim 0 as torch.chunk does
                torch.testing.assert_close(local, torch.chunk(first[name], world_size)[rank], **TIGHT, msg=f"{run} {name}")
            continue
        for bucket in held["flat"]:
            whole = torch.cat([first[name].reshape(-1) for name, _, _ in bucket["members"]])
            whole = torch.cat([whole, whole.new_zeros(bucket["grad"].numel() * world_size - whole.numel())])
            expected = whole[bucket["start"] : bucket["start"] + bucket["grad"].numel()]
            torch.testing.assert_close(bucket["grad"], expected, **TIGHT, msg=f"{run} rank {rank}")


def test_switched_run_ends_where_the_unswitched_one_does(ranks_results: list[dict]) -> None:
    assert len(SWITCHES) == STEPS  # one step under each strategy
    for results in ranks_results:
        for name, tensor in results["switched:1"]["state"].items():
            torch.testing.assert_close(tensor, results["ddp:1"]["state"][name], **TIGHT, msg=name)


@pytest.mark.parametrize("strategy, sharded", [
    ("zero1", {"optimizer_state"}), ("zero2", {"optimizer_state", "gradients"}),
    ("fsdp", {"optimizer_state", "gradients", "parameters"}),
])
def test_memory_staircase(ranks_results: list[dict], strategy: str, sharded: set[str]) -> None:
    """Measured bytes: a sharded kind ~1/N of ddp's (shards are padded to equal size), the others as ddp's."""
    world_size = len(ranks_results)
    for rank, results in enumerate(ranks_results):
        ddp, held = results["ddp:1"]["held"], results[f"{strategy}:1"]["held"]
        for kind in ("parameters", "gradients", "optimizer_state"):
            ratio = held[kind] / ddp[kind]
            if kind in sharded:
                assert 1 / world_size * 0.9 <= ratio <= 1 / world_size * 1.12, (rank, kind, ratio)
            else:
                assert 0.99 <= ratio <= 1.12, (rank, kind, ratio)


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_a_sharded_strategy_without_its_optimizer_says_how_to_make_it(one_rank_group: None, strategy: str) -> None:
    """An optimizer built over model.parameters() would step whole parameters the shards then
    overwrite: the first synchronising backward says so, in one line, instead."""
    model = instrumented_ddp.wrap(torch.nn.Linear(4, 2), strategy)
    model(torch.ones(3, 4)).sum().backward()
    with pytest.raises(RuntimeError, match=rf"^{strategy} shards the optimizer state: make the optimizer with "
                                           r"model\.make_optimizer\(torch\.optim\.AdamW, lr=\.\.\.\)$"):
        model.finish_gradient_sync()
    optimizer = model.make_optimizer(torch.optim.SGD, lr=0.1)
    model.finish_gradient_sync()
    optimizer.step()
    assert [p.shape for p in optimizer.param_groups[0]["params"]] == [torch.Size([10])]  # one bucket's slice: 8 + 2
    assert instrumented_ddp.unwrap(model).weight.shape == (2, 4)


def test_a_switch_into_fsdp_leaves_no_gradient_of_the_strategy_before_held(one_rank_group: None) -> None:
    """After ``bucket`` the bare model's parameters held their full gradients (views of the
    buckets) through the whole ``fsdp`` segment: more gradient memory than ``ddp``'s (a review's
    2-rank run: 6.04 MiB held against 2.01 for ``fsdp`` from the start)."""
    torch.manual_seed(0)
    model = instrumented_ddp.wrap(torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)), "bucket", bucket_mb=1e-4)
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    model.finish_gradient_sync()
    optimizer.step()
    carried = model.full_optimizer_state()
    bare = instrumented_ddp.unwrap(model)
    assert all(p.grad is not None for p in bare.parameters())
    sharded = instrumented_ddp.wrap(bare, "fsdp")
    assert all(p.grad is None for p in bare.parameters())
    assert instrumented_ddp.unwrap(sharded) is bare and carried


class WithAnUnusedHead(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.head, self.unused = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def test_fsdps_state_carried_into_zero1_keeps_every_stepped_parameters_moments_beside_one_never_stepped(
        one_rank_group: None) -> None:
    """FSDP steps no parameter that no rank gave a gradient: its state is empty, and zero1 reset
    the whole bucket it shares (at 25 MB the whole model) instead of that parameter alone (a
    review's 2-rank run: *params with state 6 of 8*, then *0 of 8* in zero1)."""
    torch.manual_seed(0)
    model = instrumented_ddp.wrap(WithAnUnusedHead(), "fsdp")
    optimizer = model.make_optimizer(torch.optim.AdamW, lr=1e-3)
    for _ in range(3):
        model(torch.randn(4, 4)).sum().backward()
        model.finish_gradient_sync()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    carried = model.full_optimizer_state()
    assert [bool(entry) for entry in carried] == [True, True, True, True, False, False]
    zero1 = instrumented_ddp.wrap(instrumented_ddp.unwrap(model), "zero1", bucket_mb=25)
    zero1.make_optimizer(torch.optim.AdamW, lr=1e-3, state=carried)
    after = zero1.full_optimizer_state()
    for was, now in zip(carried, after, strict=True):
        assert torch.equal(now["exp_avg"], was["exp_avg"]) if was else not now["exp_avg"].any()
    assert all(float(entry["step"]) == 3.0 for entry in after)


class SeenCompleted:
    """A ``Work`` as NCCL's reads once its kernel has ended: ``is_completed()`` is True (an event
    query on NCCL; gloo's reduce-scatter, torch 2.13, never says so, even after ``wait()``).
    ``reads_completed=False``: one still running, as far as a look can tell."""

    def __init__(self, work: torch.distributed.Work, reads_completed: bool = True) -> None:
        work.wait()
        self.reads_completed = reads_completed

    def is_completed(self) -> bool:
        return self.reads_completed

    def wait(self) -> bool:
        return True


@pytest.mark.parametrize("first_reads_completed, held, settled_in_backward", [
    (True, [1, 1, 1], 3),
    (False, [1, 2, 3], 0),  # the oldest still running holds the later ones back: settled in order
], ids=["each-reads-completed", "the-first-still-running"])
def test_zero2_gives_back_each_full_bucket_once_its_reduce_scatter_is_seen_done(
        one_rank_group: None, monkeypatch: pytest.MonkeyPatch, first_reads_completed: bool, held: list[int],
        settled_in_backward: int) -> None:
    """Each parameter its own bucket (a 1-byte cap), launched by its own gradient's hook, in
    reverse order: the fc2 weight, the fc1 bias, the fc1 weight. Each reduce-scatter reads
    done by the next look, which is the end of its own hook, so every earlier bucket has given
    its full buffer back when the next one launches: one full buffer held at each launch,
    where waiting until the end of backward held 1, 2, 3 — as it still does when the first
    bucket's collective never reads done, since buckets are settled oldest first. Either way
    the slices, some averaged in backward, are the gradients one process gets (one rank: the
    slice is the whole, padded), and every full buffer is gone once the sync is finished."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1, bias=False))
    reference = copy.deepcopy(model)
    wrapped = cast(ShardedGradients, instrumented_ddp.wrap(model, "zero2", bucket_mb=1 / 2**20))
    optimizer = wrapped.make_optimizer(torch.optim.SGD, lr=0.1)
    issue, launch = wrapped._collective, wrapped._launch

    def collective(*args, **kwargs) -> SeenCompleted:  # noqa: ANN002, ANN003
        work = issue(*args, **kwargs)
        assert work is not None  # zero2 issues its reduce-scatters asynchronously
        return SeenCompleted(work, first_reads_completed or kwargs["tag"] != "b0")

    monkeypatch.setattr(wrapped, "_collective", collective)
    held_at_launch: list[int] = []

    def counting_launch(bucket) -> None:  # noqa: ANN001
        held_at_launch.append(sum(b.buffer is not None for b in wrapped.buckets))
        launch(bucket)

    monkeypatch.setattr(wrapped, "_launch", counting_launch)
    batch = torch.randn(5, 4)
    wrapped(batch).sum().backward()
    assert held_at_launch == held
    assert wrapped._next_to_settle == settled_in_backward
    wrapped.finish_gradient_sync()
    assert all(b.buffer is None for b in wrapped.buckets)
    reference(batch).sum().backward()
    expected = [p.grad.reshape(-1) for p in reversed(list(reference.parameters()))]
    assert [len(b.parameters) for b in wrapped.buckets] == [1, 1, 1]
    for shard, gradient in zip(wrapped.shards, expected, strict=True):
        torch.testing.assert_close(shard.shard.grad, gradient)
    optimizer.step()
