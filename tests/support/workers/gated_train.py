"""``train.py`` whose ranks take a step's batch only once the test has allowed that step:
``python gated_train.py GATE_FILE TRAIN_ARGS…``.

GATE_FILE holds the last step allowed (the test rewrites it: ``step_gate.StepGate``); rank 0 notes
the step it waits at beside it when it has to wait. A test that switches strategies
live paces the run by what it has seen land, not by the box's speed: free-running, 56 steps of
0.1 s ended before the ninth switch landed, a switch taking about 0.6 s whatever the step."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import torch
from torch.utils.data import DataLoader, DistributedSampler

from gate_files import allowed_step, note_waiting_at
from instrumented_ddp.training import train
from instrumented_ddp.distributed import exit_process

Batch = TypeVar("Batch")

#: How often a rank held at the gate reads it again.
POLL_S = 0.01


def gated(batches: Iterator[Batch], gate: Path, says_where_it_waits: bool) -> Iterator[Batch]:
    """``batches``, step ``s``'s handed out only once the gate allows ``s``."""
    for step, batch in enumerate(batches, start=1):
        if allowed_step(gate) < step and says_where_it_waits:
            note_waiting_at(gate, step)
        while allowed_step(gate) < step:
            time.sleep(POLL_S)
        yield batch


def main(gate: Path) -> int:
    free_running = train.endless

    def gated_endless(loader: DataLoader, sampler: DistributedSampler) -> Iterator[dict[str, torch.Tensor]]:
        return gated(free_running(loader, sampler), gate, os.environ.get("RANK") == "0")

    train.endless = gated_endless  # the same batches, held back at the gate
    return train.main()


if __name__ == "__main__":
    exit_process(main(Path(sys.argv.pop(1))))
