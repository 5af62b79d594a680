"""The live feed in a process of its own: receiving, recording, decoding and figuring off the UI's core.

Decoding a large job's messages at their rate, and figuring each report before the session can
fold it, would take the UI's GIL for much of every second, beside the frames. Here a child
process binds the socket, appends every message to the session file as it comes, decodes it,
relays switch commands and span requests, and figures each step report with the session's own
``prepare_report``; the UI process gets batches of ``Arrival``s (pickled: loading a prepared
report is much cheaper than decoding and figuring it) and folds them, figures included.

Nothing is dropped between the two: the child blocks on a full pipe, and the parent stops reading
while ``MAX_BACKLOG`` arrivals wait to be folded, so a dashboard that cannot keep up holds its
backlog in ZeroMQ's queues (bounded; overflow counted by the ranks as dropped), never in an
unbounded list of decoded messages.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
import threading
import time
from collections import defaultdict, deque
from msgspec.structs import replace
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, NamedTuple

from instrumented_ddp.wire.codec import DEFAULT_MAX_MESSAGE_BYTES, Envelope
from instrumented_ddp.wire.messages import Hello, StepReport, StepSummary, SwitchCommand
from instrumented_ddp.wire.messages import HELD_STEPS

from instrumented_ddp.wire.curve_keys import ServerKeys
from ddpwatch.figures.compact_steps import PackedSpans, TagSequences
from ddpwatch.ingest.step_store import prepare_report
from ddpwatch.control.span_requests import SpanWish
from ddpwatch.dashboard.feeds import Arrival, Feed, Listener

#: Arrivals the UI may have waiting before the feed stops reading from the child: decoded and
#: figured, an arrival takes several times its bytes, and what waits beyond them waits as bytes.
MAX_BACKLOG = 4096  # a 1,024-rank job's sampled step (2,048 arrivals: summaries, then spans) twice
BATCH_MAX = 64  # arrivals per pickled batch: loading one holds the UI's GIL (64 full reports: ~9 ms)
#: Messages taken from the socket at a time: what waits beyond them waits in ZeroMQ's queue as
#: bytes, not decoded here, where thousands of decoded full reports held at once take gigabytes.
RECEIVE_MAX = 256
START_TIMEOUT_S = 30.0  # a spawned child imports the dashboard's modules before it binds
STOP_TIMEOUT_S = 5.0


class ProcessFeed(Feed):
    """A ``Listener`` in a child process, which also figures each step report; the same
    interface to the app as ``LiveFeed``."""

    can_switch = True

    def __init__(self, address: str, session_file: Path, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 keys: ServerKeys | None = None) -> None:
        super().__init__()
        self.session_file = session_file
        self.description = f"listening on {address}{' (CURVE)' if keys else ''} · recording {session_file}"
        self._send_lock = threading.Lock()
        self._wish: SpanWish | None = None
        self._hellos: dict[int, Hello] = {}  # each rank's hello as last handed over (see SameHello)
        context = mp.get_context("spawn")  # a fork would copy the parent's threads' locks and ZeroMQ state
        self._connection, child_end = context.Pipe(duplex=True)
        self._process = context.Process(target=serve, args=(address, session_file, max_message_bytes, keys, child_end),
                                        name="ddpwatch-receiver", daemon=True)
        self._process.start()
        child_end.close()
        # The child binds: an address in use or refused is raised here, as LiveFeed raises it.
        if not self._connection.poll(START_TIMEOUT_S):
            self._process.kill()
            raise OSError(f"cannot listen on {address}: the receiver process did not start within {START_TIMEOUT_S:g} s")
        try:
            status, detail = self._connection.recv()
        except EOFError:
            status, detail = "error", f"cannot listen on {address}: the receiver process ended at start (exit code {self._process.exitcode})"
        if status != "ready":
            self._process.join(STOP_TIMEOUT_S)
            raise OSError(detail)

    @property
    def pid(self) -> int | None:
        """The receiver process (``bench/dashboard_load.py`` reports its CPU beside the UI's)."""
        return self._process.pid

    def request_switch(self, command: SwitchCommand) -> None:
        self._tell("switch", command)

    def want_spans(self, wish: SpanWish) -> None:
        if wish != self._wish:  # asked every frame; sent when it changes
            self._wish = wish
            self._tell("wish", wish)

    def _tell(self, kind: str, value: Any) -> None:
        with self._send_lock:
            try:
                self._connection.send((kind, value))
            except (OSError, ValueError):  # the child is gone: the feed thread says so
                pass

    def stop(self) -> None:
        """The child receives what is queued, records it, hands it over and exits; the feed thread
        reads to its last batch, so what arrived before the stop is folded (and exported)."""
        self._stop.set()
        self._tell("stop", None)
        if self._thread is not None:
            self._thread.join(STOP_TIMEOUT_S)
        self._process.join(STOP_TIMEOUT_S)
        if self._process.is_alive():
            self._process.kill()
        self._connection.close()

    def _run(self) -> None:
        while True:
            while len(self._items) >= MAX_BACKLOG and not self._stop.is_set():  # the UI is behind: the
                time.sleep(0.01)  # child, then ZeroMQ's queues, hold the rest
            try:
                data = self._connection.recv_bytes()
            except (EOFError, OSError):
                if not self._stop.is_set():  # said where the address is (the header), for as long as it lasts
                    self._process.join(1.0)
                    self.description = (f"the receiver process ended (exit code {self._process.exitcode}): nothing more "
                                        f"is received; {self.session_file} holds what came before")
                return
            batch: list[Arrival] | None = pickle.loads(data)
            if batch is None:  # the child's last word after a stop
                return
            self._items.extend(self._with_hellos(batch))

    def _with_hellos(self, batch: list[Arrival]) -> list[Arrival]:
        """Each ``SameHello`` back as the rank's hello handed over before it (the very object: the
        session and the ranks table see nothing new), in order, so one earlier in the batch counts."""
        for index, arrival in enumerate(batch):
            item = arrival.item
            if type(item) is Envelope:
                message = item.message
                if type(message) is Hello:
                    self._hellos[message.rank] = message
                elif type(message) is SameHello:
                    batch[index] = arrival._replace(item=replace(item, message=self._hellos[message.rank]))
        return batch


def serve(address: str, session_file: Path, max_message_bytes: int, keys: ServerKeys | None, connection: Connection) -> None:
    """The child: bind, then receive, record, decode, figure and hand over until told to stop."""
    try:
        listener = Listener(address, session_file, max_message_bytes, keys)
    except OSError as error:
        connection.send(("error", str(error)))
        return
    connection.send(("ready", ""))
    job = KnownJob()
    stopping = False
    try:
        while True:
            batch = [job.prepared(arrival) for arrival in listener.receive(timeout_ms=0 if stopping else 20, limit=RECEIVE_MAX)]
            for start in range(0, len(batch), BATCH_MAX):
                connection.send_bytes(pickle.dumps(batch[start:start + BATCH_MAX], protocol=pickle.HIGHEST_PROTOCOL))
            if stopping and not batch:
                break
            while not stopping and connection.poll(0):
                kind, value = connection.recv()
                if kind == "switch":
                    listener.relay.request(value)
                elif kind == "wish":
                    listener.requester.want(value)
                elif kind == "stop":
                    stopping = True
            listener.tick()
        connection.send_bytes(pickle.dumps(None))
    except (BrokenPipeError, EOFError, OSError):  # the parent is gone: nobody to hand anything to
        pass
    finally:
        listener.close()


class SameHello(NamedTuple):
    """Handed over in place of a rank's hello equal to the one handed over before it: every rank
    repeats its hello every 2 s, and a hello holds its parameter and bucket layouts (about a
    hundred objects), so a large job's repeated hellos, loaded in the UI, would fill much of
    what its cycle collector scans."""

    rank: int


class KnownJob:
    """What the child knows of the job to figure reports as the session would: the world the
    ranks' hellos declare, as the session counts it (the largest; the session refigures a full
    report whose world turns out different), and each rank's recent summarized steps (the spans that
    follow one are kept, not figured). A summary's tags are handed over as one tuple shared by
    every rank that issued the same calls (``TagSequences``), which a pickled batch holds once,
    and its packed floats not at all, the prepared figures and calls holding them; a repeated
    hello as a ``SameHello``."""

    def __init__(self) -> None:
        self.declared_world = 0
        self.tag_sequences = TagSequences()
        self.hellos: dict[int, Hello] = {}  # each rank's hello as last handed over in full
        self.summarized: defaultdict[int, deque[int]] = defaultdict(lambda: deque(maxlen=HELD_STEPS))

    def prepared(self, arrival: Arrival) -> Arrival:
        """The arrival with its step report figured (``prepare_report``) and its spans packed."""
        item = arrival.item
        if not isinstance(item, Envelope):
            return arrival
        message = item.message
        if isinstance(message, Hello) and 0 <= message.rank < message.world_size:
            self.declared_world = max(self.declared_world, message.world_size)
            if self.hellos.get(message.rank) == message:
                # Not a wire message: only this pipe carries it, and ``_with_hellos`` puts the hello back.
                return arrival._replace(item=replace(item, message=SameHello(message.rank)))
            self.hellos[message.rank] = message
        if isinstance(message, StepSummary):
            self.summarized[message.rank].append(message.step)
        elif isinstance(message, StepReport) and message.step in self.summarized.get(message.rank, ()):
            # The spans of a step already summarized: the session keeps them and figures nothing.
            return arrival._replace(item=replace(item, message=replace(message, spans=PackedSpans(message.spans))))
        if not isinstance(message, (StepReport, StepSummary)) or not self.declared_world:
            return arrival
        try:
            prepared = prepare_report(message, self.declared_world)
        except Exception:  # figures the session would also fail on: it judges the message itself
            return arrival
        if isinstance(message, StepReport):  # its spans go over once, packed (named tuples pickle slowly)
            item = replace(item, message=prepared.report)
        else:  # its durations and bandwidths go over once, in the prepared calls and figures (the
            # session never figures a summary again: a rank's figures do not depend on the world)
            tags = self.tag_sequences.shared(prepared.calls.tags)
            item = replace(item, message=replace(message, all_reduce_tags=tags, all_reduce_seconds=b"", algbw_gbps=b""))
            prepared = prepared._replace(calls=prepared.calls._replace(tags=tags))
        return arrival._replace(item=item, prepared=prepared)
