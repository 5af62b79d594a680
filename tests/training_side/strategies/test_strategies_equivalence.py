"""The DDP paper's first design goal: every strategy gives the parameters one process would."""

from __future__ import annotations


import pytest
import torch

from launch import REPO_ROOT, describe_failure, run_ranks
from workers.strategy_runs import global_micro_batches, make_model, train

WORKER = REPO_ROOT / "tests" / "support" / "workers" / "strategy_runs.py"
STEPS, GLOBAL_BATCH = 3, 8
RUNS = [
    "simple:1:25", "ga:1:25", "hook:1:25", "async:1:25", "bucket:1:25", "ddp:1:25",
    "simple:2:25", "ga:2:25", "async:2:25", "bucket:2:0.01", "ddp:2:0.01", "bucket:1:0.002",
    # timed: the strategies' collectives go through the timeline (ddp on the CPU through a
    # ForwardingGroup: DDP's own reducer, no communication hook)
    "simple:1:25:timed", "hook:1:25:timed", "bucket:2:0.01:timed", "ddp:1:0.01:timed", "ddp:2:0.01:timed",
]


def reference_state(grad_accum: int) -> dict[str, torch.Tensor]:
    model = make_model(seed=1234)  # rank 0's initial parameters, which wrap broadcasts
    train(model, global_micro_batches(7, STEPS, grad_accum, GLOBAL_BATCH), rank=0, world_size=1)
    return model.state_dict()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("equivalence") / "params"
    results = run_ranks(WORKER, ["--out", str(out), "--steps", str(STEPS), "--runs", *RUNS], world_size=2)
    assert all(r.returncode == 0 for r in results), describe_failure(results)
    return [torch.load(out.with_suffix(f".rank{rank}.pt")) for rank in range(2)]


@pytest.mark.parametrize("run", RUNS)
def test_two_ranks_match_one_process(two_rank_results: list[dict], run: str) -> None:
    grad_accum = int(run.split(":")[1])
    expected = reference_state(grad_accum)
    for rank, results in enumerate(two_rank_results):
        for name, tensor in results[run].items():
            torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=2e-6, msg=f"{run} rank {rank} {name}")


def test_ranks_end_bitwise_identical(two_rank_results: list[dict]) -> None:
    for run in RUNS:
        for name, tensor in two_rank_results[0][run].items():
            assert torch.equal(tensor, two_rank_results[1][run][name]), f"{run}: {name} differs between ranks"


def test_watched_ddp_ends_bitwise_identical_to_unwatched_ddp(two_rank_results: list[dict]) -> None:
    """Watching DDP on the CPU leaves its arithmetic alone: the reducer still scales each gradient
    as it copies it into the bucket and sums, exactly as when nothing watches."""
    for rank, results in enumerate(two_rank_results):
        for name, tensor in results["ddp:2:0.01:timed"].items():
            assert torch.equal(tensor, results["ddp:2:0.01"][name]), f"rank {rank} {name}"
