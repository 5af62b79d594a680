"""``ddpwatch demo``: the dashboard plus a 2-process CPU training run it starts and stops itself."""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

#: train.py as a module of the package (``torchrun -m``): an installed ddpwatch has it, where a
#: clone's top-level ``train.py`` is not installed.
TRAIN_MODULE = "instrumented_ddp.training.train"
TRAIN_DEFAULT_BATCH = 16  # train.py's --batch-size default: the global batch (not imported: train.py imports torch)
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _set_parent_death_signal() -> None:
    """Runs in torchrun's process before it starts: however the demo ends (a closed terminal,
    kill -9), the kernel then sends torchrun SIGTERM and torchrun stops its ranks. Elsewhere than
    Linux only quitting the dashboard stops the run."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):
        pass


def free_loopback_address() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{sock.getsockname()[1]}"


@dataclass
class TrainingRun:
    """The torchrun the demo started, where its output goes, and whether the demo is stopping it
    (its end is then no failure to report)."""

    process: subprocess.Popen[bytes]
    log_path: Path
    stopping: threading.Event = field(default_factory=threading.Event)


def start_training(address: str, log_path: Path, nproc: int, steps: int, strategy: str) -> TrainingRun:
    """torchrun in its own process group (so quitting the dashboard stops every rank), output to a
    log. Start it before anything starts threads: the hook that ties it to the demo runs between
    fork and exec."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", TRAIN_MODULE, "--strategy", strategy, "--steps", str(steps), "--batch-size", str(batch_size_for(nproc)),
               "--watch", address]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                   preexec_fn=_set_parent_death_signal if sys.platform == "linux" else None)
    return TrainingRun(process, log_path)


def batch_size_for(nproc: int) -> int:
    """The global batch nearest train.py's 16 that ``nproc`` ranks split evenly into ``ga``'s two
    micro-steps too (so ``--strategy ga`` and a live switch to it run): train.py refuses a batch
    that does not divide by the world size, as 16 does not by 3 ranks."""
    unit = 2 * nproc
    return max(unit, round(TRAIN_DEFAULT_BATCH / unit) * unit)


#: A rank's reason: train.py's one-line refusal ("train.py: error: …") or an exception's last line
#: ("ValueError: …"); torchrun's own summary after it ("…ChildFailedError:") says only that a rank failed.
REASON = re.compile(r"^(\S+: error: .+|[\w.]*(Error|Exception): .+)$")


def last_error_line(log_path: Path, limit: int = 300) -> str | None:
    """The last line of the log that gives a rank's reason (``REASON``), cut to ``limit``
    characters; None where there is none or no log."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    found = next((line.strip() for line in reversed(lines) if REASON.match(line.strip()) and "ChildFailedError" not in line), None)
    return found[:limit] if found else None


def report_if_training_fails(run: TrainingRun, report: Callable[[str], None]) -> threading.Thread:
    """Waits for torchrun in a thread and, if it ends with an error before the demo stops it,
    hands ``report`` one line naming its exit code and log, so that a run that fails at start
    (a strategy this torch cannot run, a port taken) does not leave the dashboard "waiting for a
    run…" with nothing saying why. A run the demo stopped (``stop_training``) reports nothing."""
    def wait() -> None:
        code = run.process.wait()
        if code != 0 and not run.stopping.is_set():
            reason = last_error_line(run.log_path)
            report(f"the demo's training run exited with code {code}{f' ({reason})' if reason else ''}: "
                   f"its output is in {run.log_path}")

    thread = threading.Thread(target=wait, name="ddpwatch-demo-training", daemon=True)
    thread.start()
    return thread


def stop_training(run: TrainingRun) -> None:
    run.stopping.set()
    process = run.process
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
