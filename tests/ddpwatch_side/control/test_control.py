"""Where the switch relay sends a command: rank 0 of the run on screen, even while another run talks."""

from __future__ import annotations

from ddpwatch.control.relay import ACK_GRACE_S, GIVE_UP_AFTER_S, RANK0_QUIET_AFTER_S, SwitchRelay, new_command
from instrumented_ddp.wire.codec import Envelope, decode, encode
from instrumented_ddp.wire.messages import Ack, Goodbye, Heartbeat, Message
from instrumented_ddp.wire.endpoints import routing_id


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def relay_and_sent() -> tuple[SwitchRelay, list[bytes], FakeClock]:
    sent: list[bytes] = []
    clock = FakeClock()
    def send(peer: bytes, data: bytes) -> bool:
        sent.append(peer)
        return True

    relay = SwitchRelay(send, clock=clock)
    return relay, sent, clock


def heard(relay: SwitchRelay, peer: bytes, message: Heartbeat | Goodbye) -> None:
    relay.note(peer, Envelope(message, message.rank, 0, 0))


A0, B0 = routing_id("run-a", 0), routing_id("run-b", 0)


def test_a_command_goes_to_rank_0_of_the_run_heard_first_while_another_run_talks() -> None:
    relay, sent, clock = relay_and_sent()
    heard(relay, A0, Heartbeat(0, 1.0, 3))
    heard(relay, B0, Heartbeat(0, 1.0, 1))  # a second script pointed at the same address
    clock.now += 1.0
    heard(relay, B0, Heartbeat(0, 2.0, 2))
    relay.request(new_command("bucket", 1.0))
    assert sent == [A0]  # before, the last rank 0 to speak: run B's


def test_the_other_runs_rank_0_takes_the_commands_once_the_first_said_goodbye_or_fell_silent() -> None:
    relay, sent, clock = relay_and_sent()
    heard(relay, A0, Heartbeat(0, 1.0, 3))
    heard(relay, A0, Goodbye(0, 3))
    heard(relay, B0, Heartbeat(0, 1.0, 1))
    assert relay.rank0 == B0

    relay, sent, clock = relay_and_sent()
    heard(relay, A0, Heartbeat(0, 1.0, 3))  # then killed: no goodbye
    clock.now += RANK0_QUIET_AFTER_S - 0.1
    heard(relay, B0, Heartbeat(0, 1.0, 1))
    assert relay.rank0 == A0
    clock.now += 0.2
    heard(relay, B0, Heartbeat(0, 1.0, 2))
    assert relay.rank0 == B0


def test_a_rank_0_whose_run_is_not_known_is_taken_as_it_speaks() -> None:
    """A sender without a rank's routing id (ZeroMQ's own id, a tool of the user's): the last one heard."""
    relay, sent, clock = relay_and_sent()
    heard(relay, A0, Heartbeat(0, 1.0, 3))
    heard(relay, b"\x00k\x8bEg", Heartbeat(0, 1.0, 1))
    assert relay.rank0 == b"\x00k\x8bEg"


def test_a_command_for_a_run_that_ended_is_refused_to_its_asker_not_sent_on_to_the_next_run() -> None:
    """Asked in run A's last moments (its final evaluation, no step left to switch at): once A's
    rank 0 said goodbye, B's took the commands, and the pending one went to B, switching a run no
    one had asked to switch."""
    relay, sent, clock = relay_and_sent()
    answers: list[bytes] = []
    def send(peer: bytes, data: bytes) -> bool:
        if peer == b"asker":
            answers.append(data)
        else:
            sent.append(peer)
        return True

    relay._send = send
    heard(relay, A0, Heartbeat(0, 1.0, 3))
    command = new_command("zero1")
    relay.request(command, requester=b"asker")
    assert sent == [A0]
    heard(relay, A0, Goodbye(0, 3))
    heard(relay, B0, Heartbeat(0, 1.0, 1))
    clock.now += 1.5
    relay.tick()
    assert sent == [A0] and not relay.pending
    (answer,) = [decode(data).message for data in answers]
    assert (answer.command_id, answer.applied) == (command.command_id, False)
    assert answer.detail.startswith("the run it was sent to is over")


def test_a_command_no_rank_0_acknowledged_is_given_up_when_ddpwatch_switch_stops_waiting() -> None:
    """It was resent for a minute, twice as long as ``ddpwatch switch`` waits: a run that came up
    after the asker was told it failed still applied it."""
    relay, sent, clock = relay_and_sent()
    relay.request(new_command("zero1"))
    clock.now += GIVE_UP_AFTER_S + 0.1
    relay.tick()
    heard(relay, A0, Heartbeat(0, 1.0, 1))
    relay.tick()
    assert GIVE_UP_AFTER_S == 30.0 and not relay.pending and sent == []


def relay_keeping_what_it_sends() -> tuple[SwitchRelay, list[tuple[bytes, Message]], FakeClock]:
    """A relay whose sends are decoded and kept, to rank 0 and to the asker alike."""
    relay, _, clock = relay_and_sent()
    kept: list[tuple[bytes, Message]] = []

    def send(peer: bytes, data: bytes) -> bool:
        kept.append((peer, decode(data).message))
        return True

    relay._send = send
    return relay, kept, clock


def test_each_resend_of_a_command_with_a_wait_says_what_is_left_of_it() -> None:
    """Rank 0 counts the wait from when it hears the command: a resend that said the whole 30 s
    again, heard first (the first send lost, or rank 0 not yet known), would let it apply the
    command up to 30 s after its asker gave up."""
    relay, kept, clock = relay_keeping_what_it_sends()
    heard(relay, A0, Heartbeat(0, 1.0, 3))
    relay.request(new_command("zero1", expires_after_s=30.0), requester=b"asker")
    clock.now += 1.0
    relay.tick()
    clock.now += 2.5
    relay.tick()
    assert [(peer, message.expires_after_s) for peer, message in kept] == [(A0, 30.0), (A0, 29.0), (A0, 26.5)]


def test_a_command_with_a_wait_is_given_up_once_that_wait_and_the_acks_grace_are_over() -> None:
    """Rank 0 applies it up to its expiry and acknowledges it once re-wrapped: the relay waits
    ``ACK_GRACE_S`` more for that ack before it tells the asker it will not be applied; a command
    waited for 120 s is not given up at 30 (``ddpwatch switch --timeout 120`` was, before)."""
    relay, kept, clock = relay_keeping_what_it_sends()
    relay.request(new_command("zero1", expires_after_s=120.0), requester=b"asker")  # no rank 0 heard yet
    clock.now += 120.0 + ACK_GRACE_S - 0.1
    relay.tick()
    assert relay.pending and kept == []
    clock.now += 0.2
    relay.tick()
    ((asker, answer),) = kept
    assert asker == b"asker" and isinstance(answer, Ack) and not answer.applied
    assert answer.detail == "no rank 0 acknowledged the command within the 120 s its asker waits (it will not be applied)"
    assert not relay.pending and GIVE_UP_AFTER_S < 120.0


def test_a_command_asked_once_rank_0_said_goodbye_is_refused_at_once_not_at_the_askers_timeout() -> None:
    """Nothing answers it until another run speaks: ``ddpwatch switch`` after a run's end waited
    its whole --timeout to hear so."""
    relay, kept, _ = relay_keeping_what_it_sends()
    heard(relay, A0, Heartbeat(0, 1.0, 3))
    heard(relay, A0, Goodbye(0, 3))
    relay.request(new_command("zero1", expires_after_s=30.0), requester=b"asker")
    ((asker, answer),) = kept
    assert asker == b"asker" and isinstance(answer, Ack) and not answer.applied and not relay.pending
    assert answer.detail == "no run is training there now: the last one's rank 0 said goodbye"


def test_a_command_sent_to_a_rank_0_that_then_said_goodbye_is_refused_at_the_next_tick() -> None:
    relay, kept, _ = relay_keeping_what_it_sends()
    heard(relay, A0, Heartbeat(0, 1.0, 3))
    relay.request(new_command("zero1", expires_after_s=30.0), requester=b"asker")
    heard(relay, A0, Goodbye(0, 3))
    relay.tick()
    (_, answer) = kept[-1]
    assert [peer for peer, _ in kept] == [A0, b"asker"] and isinstance(answer, Ack) and not answer.applied
    assert answer.detail.startswith("the run it was sent to is over") and not relay.pending


def test_a_relay_that_stops_refuses_what_is_pending_and_what_arrived_unread_never_sending_it_on() -> None:
    """The recorder stops once every rank said goodbye: a ``ddpwatch switch`` asking just then
    heard nothing and waited out its timeout; sent on to a rank 0 still training (a recorder
    stopped by Ctrl-C), a command refused to its asker could have been applied after all."""
    relay, kept, _ = relay_keeping_what_it_sends()
    heard(relay, A0, Heartbeat(0, 1.0, 3))
    pending, unread = new_command("zero1", expires_after_s=30.0), new_command("ddp", expires_after_s=30.0)
    relay.request(pending, requester=b"first")
    relay.stop([(b"second", encode(unread)), (b"noise", b"\x00not msgpack")], "ddpwatch record stopped")
    answers = {peer: message for peer, message in kept if peer != A0}
    assert [peer for peer, _ in kept] == [A0, b"second", b"first"] and set(answers) == {b"first", b"second"}
    assert {(a.command_id, a.applied, a.detail) for a in answers.values() if isinstance(a, Ack)} == {
        (pending.command_id, False, "ddpwatch record stopped"), (unread.command_id, False, "ddpwatch record stopped")}
    assert not relay.pending
