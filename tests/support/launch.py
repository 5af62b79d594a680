"""Start a group of ranks the way torchrun does (RANK, WORLD_SIZE, MASTER_* in the environment),
on a free loopback port, and always clean up."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import rank_forks

REPO_ROOT = Path(__file__).resolve().parents[2]


def wait_for(condition: Callable[[], bool], seconds: float = 10.0) -> bool:
    """Poll ``condition`` until it holds or ``seconds`` pass; its last answer."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.005)
    return condition()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rank_environment(rank: int, world_size: int, port: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        PYTHONFAULTHANDLER="1",
        PYTHONPATH=python_path(),
    )
    return env


def python_path() -> str:
    """``PYTHONPATH`` for a process the tests start: this tree and its tests' helpers (a worker's
    ``from workers...``, ``gate_files``) ahead of what the suite was given."""
    return os.pathsep.join([str(REPO_ROOT), str(REPO_ROOT / "tests" / "support"), os.environ.get("PYTHONPATH", "")])


def one_process_environment() -> dict[str, str]:
    """What ``python SCRIPT`` on its own gets: the ranks' environment with no rank in it."""
    return {key: value for key, value in rank_environment(0, 1, 0).items() if key not in rank_forks.RANKISH_KEYS}


def run_ranks(
    script: Path, args: list[str], world_size: int = 2, timeout_s: float = 240.0, cwd: Path = REPO_ROOT,
) -> list[subprocess.CompletedProcess[str]]:
    """Run ``script`` on ``world_size`` ranks; kill every rank if one fails or time runs out."""
    group = RankGroup([str(script), *args], world_size, cwd=cwd)
    try:
        group.wait(timeout_s)
    except subprocess.TimeoutExpired:
        pass  # each rank's output so far, and its status once killed, tell the test what happened
    finally:
        group.stop()
    results = []
    for rank in group.ranks:
        out, err = rank.communicate()
        results.append(subprocess.CompletedProcess(rank.args, rank.wait(), out, err))
    return results


def start_rank(argv: list[str], cwd: Path, env: dict[str, str],
               log: Path | None = None) -> subprocess.Popen[str] | rank_forks.ForkedRank:
    """``python ARGV`` in its own session: forked from the suite's rank fork server where it can be
    (``rank_forks``: the ~6.5 s of imports a rank starts with, saved), else a process of its own.
    Its stdout and stderr appended to ``log`` where given, else kept for ``communicate``."""
    forked = rank_forks.fork_rank(argv, cwd, env, log)
    if forked is not None:
        return forked
    if log is None:
        return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    with open(log, "ab") as out:  # the child holds its own copy
        return subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)


#: How long torchrun lets the ranks it stops after one failed end on SIGTERM before it sends
#: SIGKILL (``PContext.close``'s ``timeout``, through ``os.killpg`` of each rank's session).
TERM_GRACE_S = 30.0


class RankGroup:
    """``python ARGV`` on ``nproc`` ranks started as torchrun would start them (``start_rank``), their
    output appended to ``log`` where given, else kept for each rank's ``communicate``; behind what
    the tests used of torchrun's process: ``poll`` and ``wait`` (the first failing rank's status,
    the others stopped as torchrun stops them: SIGTERM, then SIGKILL after ``TERM_GRACE_S``), and
    ``stop`` (a test's own end: SIGKILL at once)."""

    def __init__(self, argv: list[str], nproc: int, log: Path | None = None, cwd: Path = REPO_ROOT) -> None:
        port = free_port()
        if log is not None and log != Path(os.devnull):
            log.write_bytes(b"")
        self.argv = argv
        self.ranks = [start_rank(argv, cwd, rank_environment(rank, nproc, port), log) for rank in range(nproc)]
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            codes = [rank.poll() for rank in self.ranks]
            failed = next((code for code in codes if code not in (None, 0)), None)
            if failed is not None:
                self.stop(grace_s=TERM_GRACE_S)
                self.returncode = failed
            elif all(code == 0 for code in codes):
                self.returncode = 0
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.argv, timeout or 0.0)
            time.sleep(0.05)
        return self.returncode  # type: ignore[return-value]

    def stop(self, grace_s: float = 0.0) -> None:
        """SIGKILL to every rank left; with ``grace_s``, SIGTERM first, and SIGKILL only to those
        still there ``grace_s`` later."""
        live = [rank for rank in self.ranks if rank.poll() is None]
        if grace_s > 0:
            _signal_sessions(live, signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while any(rank.poll() is None for rank in live) and time.monotonic() < deadline:
                time.sleep(0.05)
        _signal_sessions([rank for rank in live if rank.poll() is None], signal.SIGKILL)
        for rank in self.ranks:
            rank.wait()


def _signal_sessions(ranks: list[subprocess.Popen[str] | rank_forks.ForkedRank], signum: int) -> None:
    """``signum`` to each rank's session (a rank may end between its poll and this: nothing to do)."""
    for rank in ranks:
        try:
            os.killpg(rank.pid, signum)
        except ProcessLookupError:
            pass


def start_ranks(args: list[str], log: Path | None = None, nproc: int = 2) -> RankGroup:
    """``train.py ARGS`` (with ``QUICK_EVAL``) on ranks started as torchrun starts them, without
    its launcher (~2.5 s) and forked where they can be (``start_rank``), output to ``log``: for
    runs whose subject is the script; ``RankGroup`` stops the ranks left when one fails as torchrun
    does. Stop it with ``stop``."""
    return RankGroup([str(REPO_ROOT / "train.py"), *QUICK_EVAL, *args], nproc, log if log is not None else Path(os.devnull))


def run_as_torchrun_would(args: list[str], nproc: int = 2, timeout_s: float = 300.0) -> subprocess.CompletedProcess[str]:
    """``[script, *args]`` on ranks started with the environment torchrun gives them, without
    torchrun: its launcher took ~2.5 s of every run on two cores before the ranks started. The
    ranks' output joined, rank 0's first; the first failing rank's exit status."""
    ranks = run_ranks(Path(args[0]), args[1:], world_size=nproc, timeout_s=timeout_s)
    failed = next((rank.returncode for rank in ranks if rank.returncode != 0), 0)
    return subprocess.CompletedProcess(ranks[0].args, failed, "".join(rank.stdout for rank in ranks),
                                       describe_failure(ranks) if failed else "".join(rank.stderr for rank in ranks))


def describe_failure(results: list[subprocess.CompletedProcess[str]]) -> str:
    return "\n".join(
        f"--- rank {rank} exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}" for rank, r in enumerate(results)
    )


#: train.py's eval after training, on a few held-out examples: the whole test split is 4.5 s of a
#: 4-step run's 14 s, and no test but the learning one reads the accuracy.
QUICK_EVAL = ("--eval-examples", "32")


def wait_for_line(log: Path, text: str, process: RankGroup, timeout_s: float = 120) -> None:
    """Until ``text`` is in the log of a run ``start_ranks`` started; the run ending or the time
    running out first fails the test with the log's tail."""
    deadline = time.monotonic() + timeout_s
    while text not in (log.read_text() if log.exists() else ""):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:] if log.exists() else "no log"
        time.sleep(0.1)


class Recorder:
    """``ddpwatch record`` in a subprocess on a free port, stopped and reaped on exit."""

    def __init__(self, out_dir: Path, *extra: str, bind_host: str = "127.0.0.1", env: dict[str, str] | None = None) -> None:
        port = free_port()
        self.address = f"tcp://127.0.0.1:{port}"  # where senders connect: always loopback here
        self.out_dir = out_dir
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddpwatch.cli", "record", "--listen", f"tcp://{bind_host}:{port}", "--out", str(out_dir), *extra],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            env={**os.environ, **env} if env else None,
        )
        assert self.proc.stderr is not None  # stderr=PIPE
        self.notices: list[str] = []  # the lines before "listening on ...": a CURVE notice, the --prometheus URL
        line = self.proc.stderr.readline()  # "listening on ..." once bound
        while line and "listening" not in line and len(self.notices) < 3:
            self.notices.append(line)
            line = self.proc.stderr.readline()
        assert "listening" in line, "".join(self.notices) + line + self.proc.stderr.read()

    def wait(self, timeout_s: float = 60.0) -> str:
        try:
            _, err = self.proc.communicate(timeout=timeout_s)
        finally:
            self.kill()
        return err

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def __enter__(self) -> "Recorder":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        self.proc.communicate()


class DashboardProcess:
    """The real ``ddpwatch`` (the dashboard, or ``demo``) in a subprocess on a pseudo-terminal
    (Textual needs one), its screen output drained so it never blocks; stopped and reaped on exit."""

    def __init__(self, *args: str, columns: int = 160, rows: int = 50) -> None:
        import fcntl
        import pty
        import struct
        import termios
        import threading

        master, slave = pty.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ddpwatch.cli", *args],
            cwd=REPO_ROOT, stdin=slave, stdout=slave, stderr=slave, start_new_session=True,
            env=dict(os.environ, TERM="xterm-256color", COLUMNS=str(columns), LINES=str(rows)),
        )
        os.close(slave)
        self._master = master
        self.screen_bytes = 0
        self.screen_tail = b""  # the last of what it drew: says what went wrong when a test fails
        self._drain = threading.Thread(target=self._read_screen, daemon=True)
        self._drain.start()

    def _read_screen(self) -> None:
        while True:
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # the terminal closed: the dashboard is gone
                return
            if not chunk:
                return
            self.screen_bytes += len(chunk)
            self.screen_tail = (self.screen_tail + chunk)[-20_000:]

    def press(self, keys: str) -> None:
        os.write(self._master, keys.encode())

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)

    def wait(self, timeout_s: float = 30.0) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            self.kill()
            self.proc.wait()

    def __enter__(self) -> "DashboardProcess":
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()
        self.proc.wait()
        os.close(self._master)
