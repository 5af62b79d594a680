"""``ddpwatch switch``: one request to the dashboard or recorder, one acknowledgement back."""

from __future__ import annotations

import time

import zmq

from instrumented_ddp.wire.codec import ProtocolError, decode, encode
from instrumented_ddp.wire.messages import Ack, bucket_mb_problem
from instrumented_ddp.wire.kinds import STRATEGY_NAMES
from instrumented_ddp.wire.curve_keys import ClientKeys

from ddpwatch.control.relay import ACK_GRACE_S, new_command


def validate_switch(strategy: str, bucket_mb: float | None, grad_accum: int | None) -> None:
    if strategy not in STRATEGY_NAMES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGY_NAMES)}")
    if bucket_mb is not None and (problem := bucket_mb_problem(bucket_mb, "--bucket-mb")):
        raise ValueError(problem)
    if grad_accum is not None and grad_accum < 1:
        raise ValueError("--grad-accum must be at least 1")


def request_switch(address: str, strategy: str, bucket_mb: float | None, grad_accum: int | None, timeout_s: float,
                   keys: ClientKeys | None = None) -> Ack:
    """Send the command and wait for rank 0's acknowledgement (the relay resends it meanwhile).
    The command says it expires after ``timeout_s``: rank 0 applies it within that or refuses it,
    and the wait goes on ``ACK_GRACE_S`` longer for that answer (or the relay's, that it gave up),
    so that a command this says failed never switches the run later."""
    validate_switch(strategy, bucket_mb, grad_accum)
    command = new_command(strategy, bucket_mb, grad_accum, expires_after_s=timeout_s)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.IMMEDIATE, 1)  # writable only once connected (and, with keys, authenticated)
    for name, value in keys.socket_options() if keys else []:
        setattr(socket, name, value)
    try:
        socket.connect(address)
        if not socket.poll(int(timeout_s * 1000), zmq.POLLOUT):  # never delivered: the plain timeout, no grace
            raise TimeoutError(f"nothing answered at {address} within {timeout_s:g} s (is ddpwatch or ddpwatch record "
                               "listening there, and, beyond loopback, is --key its client.json?)")
        socket.send(encode(command))  # the socket stays open until the reply
        deadline = time.monotonic() + timeout_s + ACK_GRACE_S + 1.0  # the relay gives up 1 s before this
        while (left := deadline - time.monotonic()) > 0:
            if not socket.poll(int(left * 1000)):
                break
            try:
                reply = decode(socket.recv()).message
            except ProtocolError:
                continue
            if isinstance(reply, Ack) and reply.command_id == command.command_id:
                return reply
        raise TimeoutError(f"no acknowledgement from {address} within {timeout_s:g} s (is ddpwatch or ddpwatch record listening there, and training running?)")
    finally:
        context.destroy(linger=0)
