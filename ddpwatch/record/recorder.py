"""``ddpwatch record``: receive a session headless, log it to disk, write the exports at the end."""

from __future__ import annotations

import signal
import sys
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

from instrumented_ddp.wire.codec import DEFAULT_MAX_MESSAGE_BYTES, ProtocolError
from instrumented_ddp.wire.endpoints import run_of_sender

from ddpwatch.figures.cross_rank import DesyncRange
from instrumented_ddp.wire.curve_keys import ServerKeys
from ddpwatch.control.relay import SwitchRelay
from ddpwatch.export.exporters import write_exports
from ddpwatch.export.live_outputs import LiveOutputs
from ddpwatch.record.live_faults import LiveFaultReporter
from ddpwatch.record.live_stalls import LiveStallReporter
from ddpwatch.wording.rank_lists import detached_ranks_lines, failed_ranks_lines, interrupted_ranks_lines
from ddpwatch.ingest.receiver import TelemetryReceiver, log_and_decode
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.session_file import SESSION_FILE_NAME, SessionWriter, read_session_records
from ddpwatch.control.span_requests import SpanRequester, SpanWish


@dataclass
class StopRule:
    """When a recording ends: every rank said goodbye, or a limit was reached."""

    until_steps: int | None = None
    until_seconds: float | None = None
    idle_exit_s: float = 15.0  # every rank silent this long after the session began
    connect_within_s: float | None = None  # no message at all this long after listening began (None: wait on)

    def reached(self, session: Session, started: float, last_message: float, runs_to_come: bool = False) -> str | None:
        """Why the recording ends now, or None. ``runs_to_come``: a run that ends is not the last
        one awaited (``record``'s ``runs``), so its goodbyes end nothing; silence still does."""
        now = time.monotonic()
        if session.finished and not runs_to_come:
            return "every rank said goodbye"
        latest = session.latest_complete_step()
        if self.until_steps is not None and latest is not None and latest >= self.until_steps:
            return f"step {self.until_steps} reached"
        if self.until_seconds is not None and now - started >= self.until_seconds:
            return f"{self.until_seconds:g} s elapsed"
        # a rank spoke (a switch command sent before any run is no rank); one whose every message is refused did
        heard = bool(session.ranks) or bool(session.rejected)
        if heard and now - last_message >= self.idle_exit_s:
            return f"no message for {self.idle_exit_s:g} s"
        if self.connect_within_s is not None and not heard and now - started >= self.connect_within_s:
            return f"no rank connected within {self.connect_within_s:g} s"
        return None


def record(
    listen: str,
    out_dir: Path,
    rule: StopRule,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True),
    keys: ServerKeys | None = None,
    sample_every: int | None = None,
    drive: Callable[[Session, SwitchRelay], str | None] | None = None,
    command: str = "ddpwatch record",
    runs: int = 1,
    outputs: LiveOutputs | None = None,
) -> Session:
    """Every rank's every span by default, so a recording loses nothing; ``sample_every``: the
    spans of every N-th step only, summaries (exact figures) of the rest. ``drive``: called
    after each receive with the session and the switch relay (``ddpwatch tune`` switches the run
    through it); a line it returns ends the recording, said as the reason. ``command``: the name
    its lines begin with (``ddpwatch tune`` records through this too). ``runs``: how many runs
    to record, one after another, from the same address (a process that trains more than once:
    a Trainer's second ``train()``, ``hyperparameter_search``'s trials); a run that begins once
    the one before is over gets a session of its own, as on the dashboard, and the one before's
    exports go in a folder named after it, beside the last run's. A run whose every goodbye says
    its process trains again (``Session.trains_again``: a Trainer begun again after running out
    of memory) is followed the same way, and not counted: the recording is of the training that
    came of it. ``outputs``: fed the session at every turn of the loop and each run's once it is
    over, after its exports (``--prometheus``, ``--tensorboard``, ``--wandb``); the caller
    closes them. Returns the last run's."""
    session = Session()
    runs_left = runs  # this one included
    receiver = TelemetryReceiver(listen, max_message_bytes, keys)
    relay = SwitchRelay(receiver.send)
    requester = SpanRequester(receiver.send, SpanWish.everything() if sample_every is None else SpanWish.sampled(sample_every))
    writer = SessionWriter(out_dir / SESSION_FILE_NAME)
    stop_requested: list[str] = []

    def say_fault(line: str) -> None:
        log(f"{command}: WARNING: {line}")

    faults = LiveFaultReporter(say_fault)  # a lost rank, the live ranks it holds: said as they happen
    stalls = LiveStallReporter(lambda line: log(f"{command}: {line}"), out_dir)  # a stall, and what holds it

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stop_requested.append(signal.Signals(signum).name)

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    log(f"{command}: listening on {listen}, writing {out_dir}")
    started = last_message = time.monotonic()
    reason = None
    try:
        while reason is None:
            batch = receiver.receive(timeout_ms=200)
            if batch:
                last_message = time.monotonic()
                for peer, data in batch:
                    run = run_of_sender(peer)
                    envelope = log_and_decode(data, writer, max_message_bytes, run)
                    if isinstance(envelope, ProtocolError):
                        session.reject(envelope.category)
                        if session.rejected[envelope.category] == 1:  # said once a kind, as it happens
                            log(f"{command}: rejected a message ({envelope}); later ones of the kind are counted")
                        continue
                    # next_run first: cheap for a message of this run, where trains_again looks at every rank
                    if ((next_run := session.next_run(envelope.message, time.monotonic(), run))
                            and (runs_left > 1 or session.trains_again)):
                        again = session.trains_again  # the same training begun again: not one of the runs asked for
                        if not again:
                            runs_left -= 1
                        folder = out_dir / (session.session_id or "run")
                        paths = write_exports(session, folder)
                        if outputs:
                            outputs.finish(session, time.monotonic())
                        why = Counter(state.goodbye.reason for state in session.ranks.values()  # every rank's: trains_again
                                      if state.goodbye is not None).most_common(1)[0][0] if again else ""
                        log(f"{command}: run {session.session_id} is over{f', and trains again ({why})' if again else ''}; "
                            f"its exports are in {folder} ({', '.join(p.name for p in paths.values())}); "
                            f"now recording run {next_run}")
                        session = Session()
                        faults = LiveFaultReporter(say_fault)
                        stalls = LiveStallReporter(lambda line: log(f"{command}: {line}"), out_dir)
                    if session.ingest(envelope, run=run) is None:
                        relay.note(peer, envelope)
                        requester.note(peer, envelope)
            for _ in range(receiver.take_refused_handshakes()):
                session.reject("unauthenticated")
            relay.tick()
            requester.tick()
            writer.flush_if_due()
            faults.look(session, time.monotonic())
            stalls.look(session, time.monotonic())
            if outputs:
                outputs.look(session, time.monotonic())
            reason = stop_requested[0] if stop_requested else rule.reached(session, started, last_message,
                                                                           runs_left > 1 or session.trains_again)
            if reason is None and drive is not None:
                reason = drive(session, relay)
    finally:
        relay.stop(receiver.last_arrivals(), f"{command} stopped before rank 0 acknowledged it: nothing relays it now")
        writer.close()
        receiver.close()
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    paths = write_exports(session, out_dir)
    if outputs:
        outputs.finish(session, time.monotonic())
    late = sum(state.late for state in session.ranks.values())
    unresolved = sum(state.unresolved for state in session.ranks.values())
    log(f"{command}: stopped ({reason}); {session.messages} messages, "
        f"{sum(session.rejected.values())} rejected, {late} late, {unresolved} unresolved step(s); "
        f"wrote {', '.join(p.name for p in paths.values())}")
    desync = DesyncRange.combine(session.segment_figures(seg, per_rank=False).desync for seg in session.segments)
    if desync is not None:  # the run's one error: said where a headless user looks, not only in the files
        log(f"{command}: ERROR: {desync.describe()}")
    for line in failed_ranks_lines(session.failed_ranks, session.first_failed_rank):  # a rank whose training raised, and what
        log(f"{command}: ERROR: {line}")
    for line in interrupted_ranks_lines(session.interrupted_ranks):  # Ctrl-C, torchrun's or a scheduler's SIGTERM
        log(f"{command}: {line}")
    for line in detached_ranks_lines(session.detached_ranks):  # ddpwatch stopped watching; the training went on
        log(f"{command}: {line}")
    for segment in session.segments:  # what watching cost, where the run measured it
        if (cost := session.watch_overhead(segment)) is not None:
            log(f"{command}: {segment.label}, steps {segment.first_step}-{segment.last_step}: {cost.sentence()}")
    return session


def load_runs(path: Path, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Iterator[Session]:
    """Rebuild the session of each run in the file, in order, as it was folded, each message at the
    time it was recorded. A run whose hello came once the one before was over (a script run again
    with the dashboard left open, a Trainer's second ``train()``) begins a session of its own, as
    on the dashboard, whose exports at exit are that run's: read as one session, its reports would
    mix with the first run's."""
    session = Session()
    for received_at, data, run in read_session_records(path):
        envelope = log_and_decode(data, max_message_bytes=max_message_bytes)
        if isinstance(envelope, ProtocolError):
            session.reject(envelope.category)
            continue
        if session.next_run(envelope.message, received_at, run):
            yield session
            session = Session()
        session.ingest(envelope, received_at, run=run)
    yield session


def load_session(path: Path, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Session:
    """The session of the file's last run (``load_runs``): the one the recording's exports are of."""
    return deque(load_runs(path, max_message_bytes), maxlen=1)[0]
