"""What a rank's heartbeat says of its progress (``instrumented_ddp.publish.stall_probing``): its
phase always, and once it has finished no step for a while, the collectives in flight with their
numbers and the main thread's stack, read from the sender's thread."""

from __future__ import annotations

import threading
import time
from typing import Any

from instrumented_ddp.publish.stall_probing import StallProbing
from instrumented_ddp.timing.clocks import HostClock
from instrumented_ddp.timing.timeline import StepTimeline
from instrumented_ddp.wire.stall_probe import PROBE_AFTER_S, InFlight, StallProbe


class Work:
    """A gloo work as the clock sees one: completed once told."""

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def from_another_thread(probing: StallProbing) -> tuple[str, StallProbe | None]:
    """``state`` as the sender thread calls it, while this (the main) thread goes on."""
    answer: list[tuple[str, StallProbe | None]] = []
    sender = threading.Thread(target=lambda: answer.append(probing.state()))
    sender.start()
    sender.join()
    return answer[0]


def test_while_steps_finish_a_heartbeat_carries_the_phase_alone() -> None:
    timeline = StepTimeline(0, HostClock())
    probing = StallProbing(timeline, lambda: 3)
    timeline.begin_step(4, "bucket", {})
    with timeline.phase("backward"):
        assert from_another_thread(probing) == ("backward", None)
    assert from_another_thread(probing) == ("", None)


def test_a_rank_idle_past_the_threshold_says_what_is_in_flight_and_where_its_main_thread_is() -> None:
    timeline = StepTimeline(0, HostClock())
    probing = StallProbing(timeline, lambda: 20)
    assert probing.state()[1] is None
    timeline.begin_step(21, "bucket", {})
    done, waiting = Work(), Work()
    first = timeline.open_collective("all_reduce", 4096, "b0", "float32", blocking=False)
    timeline.close_collective(first, done)
    second = timeline.open_collective("all_reduce", 8192, "b1", "float32", blocking=False)
    timeline.close_collective(second, waiting)
    done.done = True  # the main thread has not looked since: only the sender's own ask says so
    probing._progress_at -= PROBE_AFTER_S + 0.5  # as if 2 s had passed since step 20 ended
    answer: list[Any] = []
    release = threading.Event()

    def sender() -> None:
        time.sleep(0.05)  # the main thread is in ``sleeping_before_backward`` by now
        answer.append(probing.state())
        release.set()

    def sleeping_before_backward() -> None:
        release.wait(10)

    thread = threading.Thread(target=sender)
    thread.start()
    sleeping_before_backward()
    thread.join()
    phase, probe = answer[0]
    assert phase == "" and probe is not None
    assert probe.idle_s >= PROBE_AFTER_S and probe.in_step == 21 and probe.issued == {"": 2}
    assert [(call.tag, call.seq, call.step) for call in probe.in_flight] == [("b1", 2, 21)]  # b0 completed
    assert probe.in_flight[0] == InFlight("all_reduce", "b1", 8192, "", 2, 21, probe.in_flight[0].waited_s)
    assert any("sleeping_before_backward: release.wait(10)" in line for line in probe.stack), probe.stack
    assert probe.place.endswith("sleeping_before_backward: release.wait(10)"), probe  # not threading.py's wait inside it
    assert not probe.compiling


def test_a_synchronous_collective_is_in_flight_until_it_returns() -> None:
    timeline = StepTimeline(0, HostClock())
    probing = StallProbing(timeline, lambda: 0)
    probing.state()  # the first heartbeat: the rank's progress is counted from it
    probing._progress_at -= 10.0
    timeline.begin_step(1, "simple", {})
    span = timeline.open_collective("all_reduce", 4, "p0", "float32", blocking=True)
    [call] = from_another_thread(probing)[1].in_flight
    assert (call.tag, call.seq) == ("p0", 1)
    timeline.close_collective(span, None)
    assert from_another_thread(probing)[1].in_flight == []


def test_each_group_numbers_its_own_collectives() -> None:
    timeline = StepTimeline(0, HostClock())
    timeline.begin_step(1, "fsdp", {})
    spans = [timeline.open_collective("all_reduce", 4, f"u{i}", "float32", blocking=False, queue=queue)
             for i, queue in enumerate(["", "replicas", "", "replicas", "replicas"])]
    assert [span.seq for span in spans] == [1, 1, 2, 2, 3] and timeline.issued == {"": 2, "replicas": 3}


def test_the_wait_before_probing_grows_with_a_slow_rank_steps() -> None:
    steps = [0]
    probing = StallProbing(StepTimeline(0, HostClock()), lambda: steps[0])
    probing.state()
    for _ in range(3):  # steps of 1.2 s each
        probing._progress_at -= 1.2
        steps[0] += 1
        probing.state()
    assert abs(probing.probe_after_s() - 2.4) < 0.05


def test_a_marked_pause_is_neither_idle_time_nor_a_step() -> None:
    """Steps of 0.1 s, then a 10 s evaluation in ``watch.paused``: no probe while it lasts, none
    just after, and the wait before probing still follows the 0.1 s steps."""
    steps, pausing = [1], [""]
    probing = StallProbing(StepTimeline(0, HostClock()), lambda: steps[0], lambda: pausing[0])
    probing.state()
    for _ in range(3):
        probing._progress_at -= 1.0
        steps[0] += 10
        probing.state()
    pausing[0] = "evaluate"
    probing._progress_at -= 10.0
    assert probing.state()[1] is None  # 10 s without a step, paused: no probe
    pausing[0] = ""
    probing._progress_at -= 1.0
    assert probing.state()[1] is None  # the heartbeat after the pause starts the clock again
    steps[0] += 10
    probing._progress_at -= 1.0
    probing.state()
    assert probing.probe_after_s() == PROBE_AFTER_S  # twice 0.1 s is below the floor: the pause took no part
