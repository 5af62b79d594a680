"""``LiveOutputs``: every output is fed, and one that raises is said in one line and dropped
while the others go on."""

from __future__ import annotations

from ddpwatch.export.live_outputs import LiveOutputs
from ddpwatch.ingest.session import Session


class Output:
    def __init__(self, name: str, fails_at: int | None = None) -> None:
        self.name, self.fails_at = name, fails_at
        self.looks = self.finishes = self.closes = 0

    def look(self, session: Session, now: float) -> None:
        self.looks += 1
        if self.looks == self.fails_at:
            raise OSError("No space left on device")

    def finish(self, session: Session, now: float) -> None:
        self.finishes += 1

    def close(self) -> None:
        self.closes += 1


def test_an_output_that_raises_is_said_once_and_dropped_and_the_others_go_on() -> None:
    lines: list[str] = []
    healthy, failing = Output("--prometheus"), Output("--tensorboard", fails_at=2)
    outputs = LiveOutputs([healthy, failing], lines.append)
    session = Session()
    for now in range(4):
        outputs.look(session, float(now))
    outputs.finish(session, 4.0)
    outputs.close()
    assert lines == ["ddpwatch: --tensorboard stopped: OSError: No space left on device; the rest goes on"]
    assert (healthy.looks, healthy.finishes, healthy.closes) == (4, 1, 1)
    assert (failing.looks, failing.finishes, failing.closes) == (2, 0, 1)  # closed once, when dropped
    assert not outputs
