"""The live dashboard under load: simulated ranks sending what real ranks send, for a while.

    python bench/dashboard_load.py [--ranks 64] [--seconds 60] [--step-s 0.1] [--collectives 59]
    python bench/dashboard_load.py --ranks 1024 --seconds 300 --step-s 1 --collectives 300   # a large job
    python bench/dashboard_load.py --ranks 1024 --step-s 1 --collectives 300 --all-reduce-groups 8   # DP x 8-way TP

Sender processes simulate the ranks, one DEALER socket each, at a real rank's rates: a step every
``--step-s`` with ``--collectives`` all-reduces (plus five phase spans), a heartbeat every
``HEARTBEAT_EVERY_S``, a device sample every ``SAMPLE_EVERY_S`` (or as seldom as the listener asks,
as a real rank's sampler does), the hello every ``HELLO_EVERY_S``.
Each simulated rank answers the dashboard's span requests with the ranks' own ``SpanPolicy``
(full spans where asked, else a summary it figures itself), so what arrives is what a real job
of that size would send. The dashboard runs headless (Textual's test driver) at its normal
10 fps on its own live feed. Printed: messages received of those sent, lost and rejected; frames
drawn per second and the time our frame code takes; the RSS over the run.

The senders share this machine's cores with the dashboard, and they do the work a real job
spreads over its ranks (encoding, sending; summarising only the first step, then shifting it,
see ``SimulatedRank.summarize``): a lower bound for the dashboard. The CPU line says how much
each side took; a run that takes longer than ``--seconds`` means the senders fell behind.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from collections import Counter
from msgspec.structs import replace
from multiprocessing.queues import Queue
from pathlib import Path

import psutil
import zmq

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "bench")]

from ingest import LAYOUT, SETTINGS, step_report  # noqa: E402  (the same realistic per-rank messages)

from ddpwatch.dashboard.app import DashboardApp  # noqa: E402
from ddpwatch.dashboard.feeds import LiveFeed  # noqa: E402
from ddpwatch.dashboard.process_feed import ProcessFeed  # noqa: E402
from ddpwatch.demo import free_loopback_address  # noqa: E402
from instrumented_ddp.resources.device_sampler import SAMPLE_EVERY_S  # noqa: E402
from instrumented_ddp.wire.codec import ProtocolError, decode, encode
from instrumented_ddp.wire.messages import (
    DeviceSample, Goodbye, Heartbeat, Hello, Message, SpanRequest, StepReport, StepSummary)
from instrumented_ddp.publish.span_policy import SpanPolicy  # noqa: E402
from instrumented_ddp.wire.step_figures import summarize  # noqa: E402
from instrumented_ddp.publish.publisher import HEARTBEAT_EVERY_S, HELLO_EVERY_S  # noqa: E402
from instrumented_ddp.wire.endpoints import routing_id  # noqa: E402

PHASE_SPANS = 5  # data, forward, backward, wait, optimizer


class SimulatedRank:
    """One rank's socket, sequence numbers and span policy."""

    def __init__(self, context: zmq.Context, address: str, rank: int, world: int, steps: int, groups: int = 1) -> None:
        self.rank = rank
        self.seq = 0
        self.sent = 0
        self.policy = SpanPolicy(world, self.summarize)
        self._summary: StepSummary | None = None
        self.hello = Hello(rank, world, "bench", "localhost", 10_000 + rank, f"cuda:{rank % 8}", "nccl", "bucket",
                           SETTINGS, sum(n for _, n, _ in LAYOUT), LAYOUT,
                           [list(range(i, min(i + 8, len(LAYOUT)))) for i in range(0, len(LAYOUT), 8)],
                           steps, 32 * world, rank // 8, rank % 8,
                           all_reduce_group=list(range(rank % groups, world, groups)) if groups > 1 else [])
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.ROUTING_ID, routing_id("bench", rank))
        self.socket.connect(address)

    def summarize(self, report: StepReport, world: int) -> StepSummary:
        """The rank's first step is figured (``summarize``); later ones, whose spans are the same
        shifted in time, are that summary shifted. A real rank figures every step on its own
        core; 1,024 simulated ranks figuring 300 all-reduces each would need more than this
        machine's two cores, and the senders would set the pace instead of the dashboard."""
        if self._summary is None:
            self._summary = summarize(report, world)
        first = self._summary
        shift = report.start - first.start
        return replace(first, step=report.step, start=report.start, end=report.end, loss=report.loss,
                       anchor=None if first.anchor is None else first.anchor + shift)

    def send(self, message: Message) -> None:
        self.socket.send(encode(message, self.seq, 0))  # blocking: a loss would be the dashboard's
        self.seq += 1
        self.sent += 1

    def read_requests(self) -> None:
        while self.socket.poll(0):
            try:
                message = decode(self.socket.recv(zmq.NOBLOCK)).message
            except ProtocolError:
                continue
            if isinstance(message, SpanRequest):
                for report in self.policy.on_request(message):
                    self.send(report)


def paced_sender(address: str, ranks: list[int], world: int, steps: int, step_s: float, collectives: int,
                 sent: Queue, groups: int = 1) -> None:
    """Each tick: requests read, then whatever is due (device samples, heartbeats, hellos, a step)
    from every rank in turn."""
    # Each simulated rank holds its last 64 reports for pins, as a real rank does: 512 ranks in one
    # process hold ~10M spans, and the cycle collector's passes over them cost this process more
    # than making the reports did. A real rank holds one rank's; nothing here forms a cycle.
    gc.disable()
    context = zmq.Context()
    simulated = [SimulatedRank(context, address, rank, world, steps, groups) for rank in ranks]
    tick_s = min(step_s, SAMPLE_EVERY_S)
    due = {"sample": 0.0, "heartbeat": 0.0, "hello": 0.0, "step": 0.0}
    every = {"sample": SAMPLE_EVERY_S, "heartbeat": HEARTBEAT_EVERY_S, "hello": HELLO_EVERY_S, "step": step_s}
    started, tick, step = time.monotonic(), 0, 0
    while step < steps:
        # as a real rank's sampler does: as often as the listener asks, never more often than its own rate
        every["sample"] = max(SAMPLE_EVERY_S, simulated[0].policy.request.device_every_s)
        now = tick * tick_s
        now_due = {kind for kind, at in due.items() if now >= at - 1e-9}
        for rank in simulated:
            rank.read_requests()
            if "hello" in now_due:
                rank.send(rank.hello)
            if "sample" in now_due:
                rank.send(DeviceSample(rank.rank, 1000.0 + now, "gpu", {"gpu_util_pct": 87.0, "mem_used_bytes": 6.1e10, "power_w": 512.0}))
            if "heartbeat" in now_due:
                rank.send(Heartbeat(rank.rank, 1000.0 + now, step))
            if "step" in now_due:
                for message in rank.policy.messages_for(step_report(rank.rank, step, collectives + PHASE_SPANS)):
                    rank.send(message)
        for kind in now_due:
            due[kind] += every[kind]
        step += "step" in now_due
        tick += 1
        delay = started + tick * tick_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    for rank in simulated:
        rank.read_requests()
        rank.send(Goodbye(rank.rank, steps))
    sent.put((sum(r.sent for r in simulated), sum(r.policy.summaries for r in simulated), time.process_time()))
    context.destroy(linger=5000)


class CollectorTime:
    """The UI process's time in Python's cycle collector, by generation (``gc.callbacks``): its
    full passes scan every object the session keeps, and stop the frames while they run."""

    def __init__(self) -> None:
        self.seconds = [0.0, 0.0, 0.0]
        self.passes = [0, 0, 0]
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.seconds[info["generation"]] += time.perf_counter() - self._started
            self.passes[info["generation"]] += 1

    def describe(self, elapsed: float) -> str:
        return ", ".join(f"generation {g}: {n} passes, {1000 * s / max(n, 1):.1f} ms each, {s / elapsed:.1%} of the run"
                         for g, (n, s) in enumerate(zip(self.passes, self.seconds, strict=True)))


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def watch(args: argparse.Namespace, directory: Path) -> None:
    address = free_loopback_address()
    feed = (ProcessFeed if args.feed == "process" else LiveFeed)(address, directory / "session.ddpwatch")
    app = DashboardApp(feed, export_on_exit=False)
    collector = CollectorTime()
    gc.callbacks.append(collector)
    steps = int(args.seconds / args.step_s)
    groups = [list(range(args.ranks))[i :: args.senders] for i in range(args.senders)]
    spawn = mp.get_context("spawn")
    counts: Queue = spawn.Queue()
    senders = [spawn.Process(target=paced_sender, args=(address, g, args.ranks, steps, args.step_s, args.collectives, counts,
                                                        args.all_reduce_groups))
               for g in groups]
    for process in senders:  # before the app takes the terminal: they connect once it listens
        process.start()
    async with app.run_test(size=(200, 60)) as pilot:
        started, samples, cpu_started = time.monotonic(), [], time.process_time()
        receiver = psutil.Process(feed.pid) if isinstance(feed, ProcessFeed) and feed.pid else None
        receiver_cpu_started = sum(receiver.cpu_times()[:2]) if receiver else 0.0
        while any(p.is_alive() for p in senders) or not app.session.finished:
            await pilot.pause(5.0)
            samples.append((time.monotonic() - started, rss_mib(), app.frames, app.frame_seconds))
            if time.monotonic() - started > args.seconds * 2 + 30:
                break
        totals = [counts.get(timeout=10) for _ in senders]
        for process in senders:
            process.join(5)
        elapsed = time.monotonic() - started
        dashboard_cpu = time.process_time() - cpu_started
        receiver_cpu = sum(receiver.cpu_times()[:2]) - receiver_cpu_started if receiver else 0.0
        session = app.session
        sent, summaries, senders_cpu = (sum(t[i] for t in totals) for i in range(3))
        spans = sum(len(r.spans) for ranks in session.reports.values() for r in ranks.values())
        print(f"ddpwatch dashboard under load: {args.ranks} ranks x {steps} steps, one every {args.step_s:g} s, "
              f"{args.collectives} all-reduces a step"
              + (f", in {args.all_reduce_groups} groups of {args.ranks // args.all_reduce_groups}" if args.all_reduce_groups > 1 else ""))
        print(f"  messages received   {session.messages:,} of {sent:,} sent, in {elapsed:.1f} s = "
              f"{session.messages / elapsed:,.0f}/s; steps sent as summaries {summaries:,} of {args.ranks * steps:,}, "
              f"spans sent after their summary (pinned) {session.details:,}; "
              f"rejected {sum(session.rejected.values())}, lost {sum(s.lost_messages for s in session.ranks.values())}")
        print(f"  CPU                 dashboard {dashboard_cpu / elapsed:.0%} of a core (UI), its receiver process "
              f"{receiver_cpu / elapsed:.0%}, its {args.senders} senders "
              f"{senders_cpu / elapsed:.0%} (the ranks' share of the work: summaries, encoding)")
        print(f"  frames              {app.frames} = {app.frames / elapsed:.1f}/s, our frame code "
              f"{1000 * app.frame_seconds / max(app.frames, 1):.1f} ms on average; left to fold at the end {len(app._arrivals):,}")
        print("  frame code by part  " + ", ".join(f"{part} {1000 * seconds / max(app.frames, 1):.1f} ms"
                                                  for part, seconds in app.frame_parts.items()))
        print(f"  cycle collector     {collector.describe(elapsed)}")
        tracked = Counter(type(o).__name__ for o in gc.get_objects())
        print(f"  objects it tracks   {sum(tracked.values()):,} at the end: "
              + ", ".join(f"{name} {n:,}" for name, n in tracked.most_common(10)))
        print(f"  steps kept in memory {len(session.reports)} (spans {spans:,}); session file "
              f"{(directory / 'session.ddpwatch').stat().st_size / 2**20:.1f} MiB")
        print(f"  RSS over the run ({args.feed} feed" + (", UI process; the receiver's at the end "
              f"{receiver.memory_info().rss / 2**20:.0f} MiB)  " if receiver else ")  ")
              + ", ".join(f"{t:.0f}s {rss:.0f} MiB" for t, rss, _, _ in samples))
        windows = itertools.pairwise([(0.0, 0.0, 0, 0.0), *samples])
        print("  frames/s, 5 s windows " + ", ".join(f"{(f1 - f0) / (t1 - t0):.1f}" for (t0, _, f0, _), (t1, _, f1, _) in windows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--collectives", type=int, default=59, help="all-reduces per step (a 7B DDP job: hundreds of buckets)")
    parser.add_argument("--feed", default="process", choices=["process", "thread"],
                        help="the receiver in its own process (as `ddpwatch` runs it) or a thread of the UI's (LiveFeed)")
    parser.add_argument("--all-reduce-groups", type=int, default=1, metavar="G",
                        help="the hellos name G all-reduce groups, rank r in group r %% G (the data-parallel groups "
                             "of a 2-D mesh with G-way tensor parallelism); 1: the world")
    args = parser.parse_args()
    if args.all_reduce_groups < 1 or args.ranks % args.all_reduce_groups:
        parser.error(f"--all-reduce-groups must divide --ranks ({args.ranks})")
    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(watch(args, Path(directory)))


if __name__ == "__main__":
    main()
