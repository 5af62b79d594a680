"""``unwrap`` leaves the bare model with no hooks: a backward after it communicates nothing."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch

import instrumented_ddp
from instrumented_ddp.strategies.base import DataParallelStrategy
from launch import REPO_ROOT, describe_failure, run_ranks

WORKER = REPO_ROOT / "tests" / "support" / "workers" / "unwrap_probe.py"


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


def one_step(wrapped: DataParallelStrategy, optimizer: torch.optim.Optimizer) -> None:
    wrapped(torch.randn(4, 8)).sum().backward()
    wrapped.finish_gradient_sync()
    optimizer.step()


@pytest.mark.parametrize("strategy", instrumented_ddp.STRATEGY_NAMES)
def test_unwrap_and_del_free_the_strategy_and_its_optimizer_without_the_cyclic_collector(
        one_rank_group: None, strategy: str) -> None:
    # zero1 and zero2 once kept themselves and their optimizer alive in a cycle (the optimizer's
    # step hook held the strategy): on a GPU the strategy wrapped next read them in its peak
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    torch.optim.AdamW(torch.nn.Linear(1, 1).parameters())  # a process's first optimizer leaves torch's lazy import in a cycle
    gc.collect()
    gc.disable()  # a collection in between would free a cycle, and the test could not fail
    try:
        wrapped = instrumented_ddp.wrap(model, strategy)
        optimizer = wrapped.make_optimizer(torch.optim.AdamW, lr=1e-3)
        one_step(wrapped, optimizer)
        alive: list[weakref.ref[Any]] = [weakref.ref(wrapped), weakref.ref(optimizer)]
        instrumented_ddp.unwrap(wrapped)
        del wrapped, optimizer
        assert [ref() is None for ref in alive] == [True, True], f"{strategy}: strategy, optimizer freed"
    finally:
        gc.enable()


@pytest.mark.parametrize("strategy", ["zero1", "zero2"])
def test_an_optimizer_stepped_after_unwrap_gathers_nothing(one_rank_group: None, strategy: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    wrapped = instrumented_ddp.wrap(torch.nn.Sequential(torch.nn.Linear(8, 1)), strategy)
    optimizer = wrapped.make_optimizer(torch.optim.SGD, lr=0.1)
    one_step(wrapped, optimizer)
    issued: list[str] = []
    monkeypatch.setattr(wrapped, "_collective", lambda kind, *args, **kwargs: issued.append(kind))
    instrumented_ddp.unwrap(wrapped)
    optimizer.step()
    assert issued == []
