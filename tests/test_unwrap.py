"""``unwrap`` leaves the bare model with no hooks: a backward after it communicates nothing."""

from __future__ import annotations

import pytest
import torch

import instrumented_ddp
from launch import REPO_ROOT, describe_failure, run_ranks

WORKER = REPO_ROOT / "tests" / "workers" / "unwrap_probe.py"


@pytest.fixture(scope="module")
def grads_after_unwrap(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("unwrap") / "grads"
    results = run_ranks(WORKER, ["--out", str(out)], world_size=2)
    assert all(r.returncode == 0 for r in results), describe_failure(results)
    return [torch.load(out.with_suffix(f".rank{rank}.pt")) for rank in range(2)]


@pytest.mark.parametrize("strategy", instrumented_ddp.STRATEGY_NAMES)
def test_backward_after_unwrap_keeps_local_gradients(grads_after_unwrap: list[dict], strategy: str) -> None:
    rank0, rank1 = (g[strategy] for g in grads_after_unwrap)
    differing = [name for name in rank0 if not torch.allclose(rank0[name], rank1[name])]
    # Every parameter still averaged would mean a hook survived; the two ranks saw different data.
    assert len(differing) >= len(rank0) - 1, f"{strategy}: gradients still averaged after unwrap"
