"""The held-memory arithmetic against what the ranks count from their tensors: two gloo ranks of
``train.py``'s tiny model under fsdp (each parameter's rows padded, each rank's own moments),
recorded, every memory sample's parameters, gradients and optimizer state equal to the bytes
``strategy_memory.held_memory`` makes of the hello."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import REPO_ROOT, Recorder, run_ranks

from ddpwatch.advisor.strategy_memory import held_memory
from ddpwatch.ingest.session_file import read_session_file
from instrumented_ddp.wire.codec import decode
from instrumented_ddp.wire.messages import Hello, StepReport, StepSummary


@pytest.mark.timeout(240)
def test_fsdp_holds_exactly_what_the_arithmetic_says_on_every_rank(tmp_path: Path) -> None:
    with Recorder(tmp_path / "out", "--idle-exit", "20") as recorder:
        ranks = run_ranks(REPO_ROOT / "train.py", ["--strategy", "fsdp", "--steps", "3", "--watch", recorder.address,
                                                   "--device", "cpu"], world_size=2, timeout_s=180)
        assert all(rank.returncode == 0 for rank in ranks), [rank.stderr[-2000:] for rank in ranks]
        recorder.wait(60)
    hello, held = None, {}
    for _, data in read_session_file(tmp_path / "out" / "session.ddpwatch"):
        message = decode(data).message
        if isinstance(message, Hello):
            hello = message
        elif isinstance(message, (StepReport, StepSummary)) and message.memory:
            held[message.rank] = (message.memory["parameters"], message.memory["gradients"], message.memory["optimizer_state"])
    assert hello is not None and sorted(held) == [0, 1] and hello.parameter_rows
    for rank, measured in held.items():
        predicted = held_memory("fsdp", hello.parameter_layout, 2, rank=rank, rows=hello.parameter_rows)
        assert (predicted.parameters, predicted.gradients, predicted.optimizer_state) == measured, rank
    assert held[0][2] != held[1][2]  # the last rank holds fewer rows of some parameter: its moments differ
