"""A process that imports torch, transformers and datasets once, then forks a rank from itself
for every rank the suite starts (``rank_forks`` is its client).

Why: a rank spent ~6.5 s of CPU importing them (torch 2.4 s, transformers' Llama 3.5 s, datasets
0.6 s) before its first line of training; with two ranks on two cores that was ~6.5 s of every
run, ~40 runs a suite. A forked rank starts with them imported, and then runs its script as
``python SCRIPT ARGS`` would: ``__main__``, ``sys.argv``, ``sys.path[0]``, its working folder,
its environment, its own session (so ``killpg`` stops it), stdout and stderr to the files it is
given, its exit status (or signal) reported back to the client.

Only imports happen here, never a tensor operation, a thread or a process group: what a fork
cannot carry (OpenMP's workers, a communicator) is never started before the fork. The client
forks only ranks whose environment equals this process's but for what a rank's own start reads
(``RANK``, ``MASTER_PORT``, ..., ``DDPWATCH_*``); others are started as processes, as before.

Protocol, over a ``SOCK_SEQPACKET`` Unix socket (one message a packet): the client sends a JSON
request ``{"argv": [script, *args], "cwd": ..., "env": {...}}`` with two file descriptors (stdout,
stderr); the server answers ``{"pid": N}``, then ``{"returncode": R}`` when the rank ends
(``-signal`` if a signal ended it, as ``subprocess`` says).
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import socket
import sys
from dataclasses import dataclass

#: What every rank of the suite imports before it trains: the slow part of its start.
PRELOADED = (
    "torch", "torch.distributed", "torch.distributed.fsdp", "torch.profiler", "numpy", "zmq", "msgpack",
    "tokenizers", "datasets", "transformers", "transformers.models.llama.modeling_llama",
)


@dataclass
class Request:
    argv: list[str]
    cwd: str
    env: dict[str, str]
    stdout: int
    stderr: int


def main(socket_path: str) -> None:
    _die_with_parent()
    for name in PRELOADED:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(socket_path)
    listener.listen(64)
    request = serve(listener)  # returns only in a forked rank
    run_as_python_would(request)


def serve(listener: socket.socket) -> Request:
    """Fork a rank for every request; report each rank's end to its client. Returns in the rank."""
    clients: dict[int, socket.socket] = {}  # rank pid -> the connection its request came on
    while True:
        readable, _, _ = select.select([listener], [], [], 0.02)
        if readable:
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
            request_fields = json.loads(message)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                for other in clients.values():
                    other.close()
                return Request(**request_fields, stdout=fds[0], stderr=fds[1])
            for fd in fds:
                os.close(fd)
            _send(connection, {"pid": pid})
            clients[pid] = connection
        _reap(clients)


def _reap(clients: dict[int, socket.socket]) -> None:
    while clients:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = clients.pop(pid, None)
        if connection is not None:
            _send(connection, {"returncode": os.waitstatus_to_exitcode(status)})
            connection.close()


def _send(connection: socket.socket, message: dict[str, int]) -> None:
    try:
        connection.send(json.dumps(message).encode())
    except OSError:  # a client that went away: the rank goes on; nobody waits for its end
        pass


def run_as_python_would(request: Request) -> None:
    """Become ``python ARGV`` started in ``request.cwd`` with ``request.env``: then run the script;
    an exception or ``SystemExit`` leaving it ends this process as it would have ended that one."""
    import runpy

    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(request.stdout, 1)
    os.dup2(request.stderr, 2)
    for fd in (null, request.stdout, request.stderr):
        os.close(fd)
    os.chdir(request.cwd)
    os.environ.clear()
    os.environ.update(request.env)
    script = request.argv[0]
    sys.argv = list(request.argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


def _die_with_parent() -> None:
    """A suite killed outright takes this server with it (Linux's PR_SET_PDEATHSIG; forked ranks
    do not inherit it, and run_ranks stops those)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    main(sys.argv[1])
