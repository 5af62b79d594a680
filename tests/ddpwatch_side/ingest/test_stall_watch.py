"""When a session names a stall, what it says, and when it ends (``ddpwatch.ingest.stall_watch``),
on a made-up clock: two ranks step every 0.1 s, then rank 1 stops before its backward."""

from __future__ import annotations

from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import Goodbye, Heartbeat, Message
from instrumented_ddp.wire.stall_probe import InFlight, StallProbe
from synthetic_session import hello

B0 = InFlight("all_reduce", "b0", 4_194_304, "", seq=21, step=21, waited_s=0.0)
SLEEPING = ["hang_probe.py:31 main: time.sleep(40)"]


class Feed:
    def __init__(self) -> None:
        self.session = Session()
        self.seq = {0: 0, 1: 0}

    def send(self, message: Message, at: float) -> None:
        rank = message.rank
        self.session.ingest(Envelope(message, rank, self.seq[rank], 0), received_at=at)
        self.seq[rank] += 1

    def beat(self, at: float, steps: int, phase: str, probe: StallProbe | None = None, rank: int | None = None,
             pausing: str = "") -> None:
        for r in (0, 1) if rank is None else (rank,):
            self.send(Heartbeat(r, at, steps, pausing, phase, probe), at)


def twenty_steps() -> Feed:
    """Hellos at 0, then steps 1-20 done every 0.1 s (heartbeats carry the steps done)."""
    feed = Feed()
    for rank in (0, 1):
        feed.send(hello(rank, world_size=2), 0.0)
    for step in range(1, 21):
        feed.beat(step * 0.1, step, "between")
    return feed


def stalled_at_step_21(feed: Feed, until: float, probes: bool = True) -> None:
    """From 2.0 s on, no step ends: rank 0 waits in b0, rank 1 sleeps before its backward."""
    t = 2.0
    while t <= until:
        idle = t - 2.0
        waiting = StallProbe(idle, 21, [B0._replace(waited_s=idle)], {"": 21}) if probes and idle >= 1.5 else None
        sleeping = StallProbe(idle, 21, [], {"": 20}, SLEEPING) if probes and idle >= 1.5 else None
        feed.beat(t, 20, "backward", waiting, rank=0)
        feed.beat(t, 20, "forward", sleeping, rank=1)
        t = round(t + 0.5, 3)


def test_a_stall_is_named_after_three_seconds_with_the_rank_behind_and_its_stack() -> None:
    feed = twenty_steps()
    stalled_at_step_21(feed, until=4.5)
    assert feed.session.stall_watch.stalls == []  # 2.5 s without a step: not yet
    stalled_at_step_21(feed, until=5.5)
    [stall] = feed.session.stall_watch.stalls
    assert (stall.verdict.kind, stall.verdict.culprits, stall.verdict.waiting, stall.step) == ("behind", (1,), (0,), 21)
    assert stall.verdict.collective is not None and stall.verdict.collective.tag == "b0"
    assert stall.named_after_s == 3.0 and stall.stacks == {1: SLEEPING} and stall.ended_at is None
    record = stall.as_dict()
    assert (record["kind"], record["culprits"], record["waiting"], record["duration_s"]) == ("behind", [1], [0], None)
    assert record["collective"] == {"kind": "all_reduce", "tag": "b0", "bytes": 4_194_304, "group": "default", "seq": 21}


def test_the_stall_ends_when_a_step_is_finished_again_and_keeps_its_duration() -> None:
    feed = twenty_steps()
    stalled_at_step_21(feed, until=6.0)
    feed.beat(42.0, 21, "between")
    [stall] = feed.session.stall_watch.stalls
    assert stall.ended_at == 42.0 and stall.as_dict()["duration_s"] == 40.0
    assert feed.session.stall_watch.current is None


def test_a_marked_pause_is_no_stall() -> None:
    feed = twenty_steps()
    t = 2.0
    while t <= 12.0:
        feed.beat(t, 20, "paused", pausing="evaluate")
        t += 0.5
    assert feed.session.stall_watch.stalls == []


def test_a_killed_rank_reads_lost_and_the_other_waits_for_it() -> None:
    feed = twenty_steps()
    t = 2.0
    while t <= 6.0:  # rank 1 is silent from 2.0 s on
        idle = t - 2.0
        feed.beat(t, 20, "backward", StallProbe(idle, 21, [B0._replace(waited_s=idle)], {"": 21}) if idle >= 1.5 else None, rank=0)
        t += 0.5
    [stall] = feed.session.stall_watch.stalls
    assert (stall.verdict.kind, stall.verdict.culprits, stall.verdict.waiting) == ("lost", (1,), (0,))


def test_ranks_that_said_goodbye_take_no_part_and_a_run_that_ended_ends_its_stall() -> None:
    feed = twenty_steps()
    stalled_at_step_21(feed, until=6.0)
    for rank in (0, 1):
        feed.send(Goodbye(rank, 20), 7.0)
    feed.session.stall_watch.look(7.0, force=True)
    [stall] = feed.session.stall_watch.stalls
    assert stall.ended_at == 7.0


def test_the_threshold_follows_the_segments_p95_step() -> None:
    feed = twenty_steps()
    assert feed.session.stall_watch.p95_step_s() is None  # heartbeats only: no report folded


def test_the_stall_is_said_in_one_line_naming_the_rank_its_collective_and_its_place() -> None:
    from ddpwatch.wording.stall_text import place_of, stall_line

    feed = twenty_steps()
    stalled_at_step_21(feed, until=12.0)
    [stall] = feed.session.stall_watch.stalls
    assert stall_line(stall.as_dict(), stall.duration_s(14.0)) == ("rank 1 has not reached all_reduce b0 (#21 on the default group) of step 21, "
                                       "which rank 0 has waited in for 12 s; rank 1 is at hang_probe.py:31 main: time.sleep(40)")
    stack = ["hang_probe.py:40 main: loss.backward()", "autograd/graph.py:200 backward: _engine_run"]
    assert place_of({"stacks": {"1": stack}, "places": {"1": stack[0]}}, 1) == stack[0]  # the rank's own word
    assert place_of({"stacks": {"1": stack}}, 1) == stack[1]  # else the innermost frame
    assert place_of({}, 1) == ""
