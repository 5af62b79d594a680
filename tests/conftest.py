"""Fixtures shared by the test modules: a temp folder and compiled modules for the processes they start, a one-rank group,
and what an attachment sends."""

from __future__ import annotations

import compileall
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist


@pytest.fixture(scope="session", autouse=True)
def child_processes_keep_their_temp_files_here() -> Iterator[None]:
    """The processes the tests start get a temp folder of their own, removed at the end:
    torchrun makes a ``torchelastic_*`` folder of rank logs in the temp folder at every launch
    and never removes it (about 35 a suite run, 599 left in /tmp here before this). The built-in
    data they keep (``instrumented_ddp.training.data_cache``) goes there too: built by the suite's first run,
    read by the rest, never read from a cache the user's own runs left."""
    folder = tempfile.mkdtemp(prefix="ddpwatch-tests-")
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("TMPDIR", folder)
            patch.setenv("DDPWATCH_DATA_CACHE", os.path.join(folder, "data-cache"))
            yield
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def the_projects_modules_are_compiled_once_for_every_process_the_tests_start() -> None:
    """Where ``PYTHONDONTWRITEBYTECODE`` is set (this machine's environment sets it), no process
    keeps what it compiles: every process the suite starts compiled instrumented_ddp (~0.3 s)
    and a dashboard ddpwatch (~0.2 s) again. Compiled here once, they read the bytecode (a source
    edited later is compiled afresh by each, as before: the bytecode names its source's mtime)."""
    root = Path(__file__).resolve().parents[1]
    for package in ("instrumented_ddp", "ddpwatch"):
        compileall.compile_dir(root / package, quiet=1)


@pytest.fixture(scope="session", autouse=True)
def ranks_are_forked_from_a_process_that_has_imported_torch(child_processes_keep_their_temp_files_here: None) -> Iterator[None]:
    """``launch.run_ranks`` forks its ranks from one process that has imported torch, transformers
    and datasets (``rank_forks``), started at the first rank with the suite's environment and
    stopped at its end: each rank saves the ~6.5 s of CPU those imports took."""
    import launch
    import rank_forks

    rank_forks.serve_ranks_with(launch.rank_environment(0, 1, 0))
    try:
        yield
    finally:
        rank_forks.stop_server()


@pytest.fixture
def host_time(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The host's clock inside ``instrumented_ddp.timing.clocks``, set by the test (``timeline_fakes.FakeHostTime``)."""
    from instrumented_ddp.timing import clocks
    from timeline_fakes import FakeHostTime

    fake = FakeHostTime()
    monkeypatch.setattr(clocks, "time", fake)
    return fake


@pytest.fixture
def one_rank_group() -> Iterator[None]:
    """A one-rank gloo process group for the test's duration."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def sent(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every message an attachment (``instrumented_ddp.attach``) publishes, in order."""
    from instrumented_ddp.attachment.attachment import Attachment

    messages: list[Any] = []
    original = Attachment.__init__

    def init(self: Attachment, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        monkeypatch.setattr(self.watch.publisher, "publish", messages.append)

    monkeypatch.setattr(Attachment, "__init__", init)
    return messages
