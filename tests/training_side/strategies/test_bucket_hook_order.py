"""``bucket`` pairs the right gradients even when hooks fire in a different order on each rank."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch import REPO_ROOT, describe_failure, run_ranks
from workers.hook_order import TwoBranches, batches, train

WORKER = REPO_ROOT / "tests" / "support" / "workers" / "hook_order.py"


def run_two_ranks(strategy: str, tmp_path: Path) -> list[dict]:
    out = tmp_path / strategy
    results = run_ranks(WORKER, ["--out", str(out), "--strategy", strategy], world_size=2)
    assert all(r.returncode == 0 for r in results), describe_failure(results)
    return [torch.load(out.with_suffix(f".rank{rank}.pt")) for rank in range(2)]


def one_process_reference() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = TwoBranches()
    train(model, batches(rank=0, world_size=1))
    return model.state_dict()


@pytest.fixture(scope="module")
def bucket_runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return run_two_ranks("bucket", tmp_path_factory.mktemp("bucket"))


def test_hooks_fire_in_different_orders_on_the_two_ranks(bucket_runs: list[dict]) -> None:
    assert bucket_runs[0]["order"] != bucket_runs[1]["order"]


def test_bucket_matches_one_process_despite_hook_order(bucket_runs: list[dict]) -> None:
    expected = one_process_reference()
    for run in bucket_runs:
        for name, tensor in run["state"].items():
            torch.testing.assert_close(tensor, expected[name], rtol=1e-5, atol=1e-6)


def test_hook_order_mismatch_corrupts_per_parameter_hooks(tmp_path: Path) -> None:
    """The hazard the fixed bucket order removes: ``hook`` reduces in firing order, so same-shaped
    gradients of different parameters are averaged together and training silently diverges."""
    runs = run_two_ranks("hook", tmp_path)
    expected = one_process_reference()
    assert not torch.allclose(runs[0]["state"]["a.weight"], expected["a.weight"], atol=1e-4)
