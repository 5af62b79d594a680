"""``ddpwatch switch``'s side: the command says how long it waits, and an address nobody answers
at fails at the timeout itself, not the grace it gives a delivered command's answer."""

from __future__ import annotations

import threading

import pytest
import zmq

from ddpwatch.control.relay import new_command
from ddpwatch.ingest.receiver import TelemetryReceiver
from ddpwatch.control.switch_client import request_switch
from instrumented_ddp.wire.codec import decode, encode
from instrumented_ddp.wire.messages import Ack, SwitchCommand
from launch import free_port, wait_for


def test_the_command_says_its_askers_wait_and_the_relays_answer_comes_back() -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    context = zmq.Context()
    relay = context.socket(zmq.ROUTER)
    relay.setsockopt(zmq.LINGER, 0)
    relay.bind(address)
    heard: list[SwitchCommand] = []

    def answer() -> None:
        if relay.poll(10_000):
            peer, data = relay.recv_multipart()
            command = decode(data).message
            assert isinstance(command, SwitchCommand)
            heard.append(command)
            relay.send_multipart([peer, encode(Ack(0, command.command_id, True, 12))])

    answering = threading.Thread(target=answer)
    answering.start()
    try:
        ack = request_switch(address, "zero2", 2.0, None, timeout_s=7.5)
    finally:
        answering.join()
        context.destroy(linger=0)
    (command,) = heard
    assert (command.strategy, command.bucket_mb, command.expires_after_s) == ("zero2", 2.0, 7.5)
    assert ack == Ack(0, command.command_id, True, 12)


def test_an_address_nobody_answers_at_fails_at_the_timeout_saying_so() -> None:
    """Never delivered, the command cannot be applied: no grace is waited (with a relay there,
    ``ACK_GRACE_S`` + 1 s more is, for rank 0's answer)."""
    with pytest.raises(TimeoutError, match=r"^nothing answered at tcp://127\.0\.0\.1:\d+ within 0\.2 s \(is ddpwatch"):
        request_switch(f"tcp://127.0.0.1:{free_port()}", "ddp", None, None, timeout_s=0.2)


def test_a_listener_that_stops_reads_what_arrived_and_takes_no_connection_after() -> None:
    """What a stopping recorder answers (``SwitchRelay.stop``): the command already sent; a later
    ``ddpwatch switch`` is not taken in to wait out its grace unanswered, it hears nothing at all."""
    address = f"tcp://127.0.0.1:{free_port()}"
    receiver = TelemetryReceiver(address)
    context = zmq.Context()
    try:
        early = context.socket(zmq.DEALER)
        early.setsockopt(zmq.LINGER, 0)
        early.connect(address)
        command = new_command("ddp", expires_after_s=30.0)
        early.send(encode(command))
        assert wait_for(lambda: receiver._socket.poll(0) != 0)
        (_, data), = receiver.last_arrivals()
        assert decode(data).message == command
        with pytest.raises(TimeoutError, match="^nothing answered at"):
            request_switch(address, "bucket", None, None, timeout_s=0.3)
    finally:
        context.destroy(linger=0)
        receiver.close()
