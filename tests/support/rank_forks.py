"""Ranks forked by ``rank_forkserver`` (which has torch, transformers and datasets imported), each
behind a small ``subprocess.Popen``-like handle, for ``launch.run_ranks``.

The server is started at the first rank asked for and stopped at the end of the suite
(``conftest.py``). ``DDPWATCH_TEST_FORK_RANKS=0`` turns it off: every rank is then its own
``python`` process, as a user starts it. A rank whose environment differs from the server's in
what the preloaded libraries read when imported (anything but ``RANKISH_KEYS`` and ``DDPWATCH_*``)
is never forked: ``fork_rank`` answers None and the caller starts a process.
"""

from __future__ import annotations

import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

SERVER = Path(__file__).with_name("rank_forkserver.py")
SWITCH = "DDPWATCH_TEST_FORK_RANKS"
#: What torchrun sets per rank, read by a rank at its start, never by an import; and pytest's
#: name of the test running.
RANKISH_KEYS = frozenset({"RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                          "PYTEST_CURRENT_TEST"})


def _differs_only_where_a_rank_reads(env: dict[str, str], base: dict[str, str]) -> bool:
    changed = {key for key in env.keys() | base.keys() if env.get(key) != base.get(key)}
    return all(key in RANKISH_KEYS or key.startswith("DDPWATCH_") for key in changed)


class ForkedRank:
    """One forked rank: ``pid`` (its own session), ``poll``, ``wait``, ``communicate`` (its whole
    stdout and stderr, kept in files while it runs, so it never blocks on a full pipe)."""

    def __init__(self, args: list[str], connection: socket.socket, out: IO[bytes], err: IO[bytes]) -> None:
        self.args = args
        self.returncode: int | None = None
        self._connection = connection
        self._out, self._err = out, err
        self.pid = int(self._receive(timeout_s=60.0)["pid"])

    def _receive(self, timeout_s: float | None) -> dict[str, int]:
        readable, _, _ = select.select([self._connection], [], [], timeout_s)
        if not readable:
            raise subprocess.TimeoutExpired(self.args, timeout_s or 0.0)
        message = self._connection.recv(4096)
        if not message:
            raise RuntimeError(f"the rank fork server went away while {self.args[0]} ran")
        return json.loads(message)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.returncode = int(self._receive(timeout_s=0)["returncode"])
            except subprocess.TimeoutExpired:
                return None
            self._connection.close()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = int(self._receive(timeout_s=timeout)["returncode"])
            self._connection.close()
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        texts = []
        for file in (self._out, self._err):
            if file.closed:  # one log for both: written by the rank, read by whoever reads the log
                texts.append("")
                continue
            file.seek(0)
            texts.append(file.read().decode(errors="replace"))
            file.close()
        return texts[0], texts[1]


class RankForkServer:
    """The server process and the environment it was started with (its ranks' base)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self._folder = tempfile.mkdtemp(prefix="rank-forkserver-")
        self.socket_path = os.path.join(self._folder, "socket")
        self.process = subprocess.Popen([sys.executable, str(SERVER), self.socket_path], env=self.env,
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)

    def _connect(self, timeout_s: float = 120.0) -> socket.socket:
        deadline = time.monotonic() + timeout_s
        while True:
            connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            try:
                connection.connect(self.socket_path)
                return connection
            except (FileNotFoundError, ConnectionRefusedError):
                connection.close()
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the rank fork server did not start (exit {self.process.poll()})") from None
                time.sleep(0.05)

    def fork(self, argv: list[str], cwd: Path, env: dict[str, str], log: Path | None = None) -> ForkedRank:
        out: IO[bytes]
        err: IO[bytes]
        if log is not None:  # both streams appended to it, as torchrun's ranks write to its own output
            out = err = open(log, "ab")
        else:
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
        connection = self._connect()
        request = json.dumps({"argv": [str(arg) for arg in argv], "cwd": str(cwd), "env": env}).encode()
        socket.send_fds(connection, [request], [out.fileno(), err.fileno()])
        if log is not None:
            out.close()  # the rank holds its own
        return ForkedRank([sys.executable, *map(str, argv)], connection, out, err)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for leftover in (self.socket_path, self._folder):
            try:
                os.unlink(leftover) if leftover == self.socket_path else os.rmdir(leftover)
            except OSError:
                pass


_base_env: dict[str, str] | None = None
_server: RankForkServer | None = None


def serve_ranks_with(base_env: dict[str, str]) -> None:
    """Ranks may be forked from now on, from a server started (at the first) with ``base_env``."""
    global _base_env
    _base_env = dict(base_env)


def fork_rank(argv: list[str], cwd: Path, env: dict[str, str], log: Path | None = None) -> ForkedRank | None:
    """``python ARGV`` forked from the server (stdout and stderr appended to ``log`` where given,
    else kept for ``communicate``), or None where forking is turned off, not set up
    (``serve_ranks_with``), or ``env`` differs from the server's where an import reads it."""
    global _server
    if _base_env is None or os.environ.get(SWITCH, "1") == "0":
        return None
    if not _differs_only_where_a_rank_reads(env, _base_env):
        return None
    if _server is None or _server.process.poll() is not None:
        _server = RankForkServer(_base_env)
    return _server.fork(argv, cwd, env, log)


def stop_server() -> None:
    """Stop the server (the ranks it forked are their callers' to stop) and fork no more."""
    global _server, _base_env
    _base_env = None
    if _server is not None:
        _server.stop()
        _server = None
