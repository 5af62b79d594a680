"""The live dashboard under load: 64 simulated ranks at a realistic step rate, for a while.

    python bench/dashboard_load.py [--ranks 64] [--seconds 60] [--step-s 0.1] [--spans 64]
    python bench/dashboard_load.py --ranks 1024 --step-s 1 --spans 300   # a large job's stream

Sender processes pace each simulated rank at one step report per ``--step-s`` (plus heartbeats
and device samples, as real ranks send) into the dashboard's own live feed; the dashboard runs
headless (Textual's test driver) at its normal 10 fps. Printed: messages/s and spans/s received,
frames drawn per second and the time our frame code takes, and the process RSS over the run —
which stays flat once the session starts folding old steps (the session file keeps growing).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from pathlib import Path

import zmq

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "bench")]

from ingest import rank_stream  # noqa: E402  (the same realistic per-rank stream)

from ddpwatch.dashboard.app import DashboardApp  # noqa: E402
from ddpwatch.dashboard.feeds import LiveFeed  # noqa: E402
from ddpwatch.demo import free_loopback_address  # noqa: E402
from instrumented_ddp.protocol import encode  # noqa: E402
from instrumented_ddp.telemetry import routing_id  # noqa: E402


def paced_sender(address: str, ranks: list[int], world: int, steps: int, step_s: float, spans: int) -> None:
    context = zmq.Context()
    sockets = {rank: context.socket(zmq.DEALER) for rank in ranks}
    streams = {rank: rank_stream(rank, world, steps, spans) for rank in ranks}
    seqs = dict.fromkeys(ranks, 0)
    for rank, dealer in sockets.items():
        dealer.setsockopt(zmq.ROUTING_ID, routing_id("bench", rank))
        dealer.connect(address)
    started = time.monotonic()
    for step in range(steps + 2):
        for rank in ranks:
            for message in next(streams[rank]):
                sockets[rank].send(encode(message, seqs[rank], 0))
                seqs[rank] += 1
        delay = started + (step + 1) * step_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    context.destroy(linger=2000)


def rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


async def watch(args: argparse.Namespace, directory: Path) -> None:
    address = free_loopback_address()
    app = DashboardApp(LiveFeed(address, directory / "session.ddpwatch"), export_on_exit=False)
    steps = int(args.seconds / args.step_s)
    groups = [list(range(args.ranks))[i :: args.senders] for i in range(args.senders)]
    senders = [mp.get_context("spawn").Process(target=paced_sender, args=(address, g, args.ranks, steps, args.step_s, args.spans))
               for g in groups]
    for process in senders:  # before the app takes the terminal: they connect once it listens
        process.start()
    async with app.run_test(size=(200, 60)) as pilot:
        started, samples = time.monotonic(), []
        while any(p.is_alive() for p in senders) or not app.session.finished:
            await pilot.pause(5.0)
            samples.append((time.monotonic() - started, rss_mib(), app.frames, app.frame_seconds))
            if time.monotonic() - started > args.seconds * 2 + 30:
                break
        for process in senders:
            process.join(5)
        elapsed = time.monotonic() - started
        session = app.session
        spans = sum(len(r.spans) for ranks in session.reports.values() for r in ranks.values())
        print(f"ddpwatch dashboard under load: {args.ranks} ranks x {steps} steps, one every {args.step_s:g} s, "
              f"{args.spans} spans a report")
        sent = args.ranks * (steps + -(-steps // 10) + -(-steps // 2) + 2)  # reports, heartbeats, samples, hello, goodbye
        print(f"  messages received   {session.messages:,} of {sent:,} sent, in {elapsed:.1f} s = "
              f"{session.messages / elapsed:,.0f}/s (~{session.messages * args.ranks * steps / sent * args.spans / elapsed:,.0f} "
              f"spans/s, reports being that share of the messages); "
              f"rejected {sum(session.rejected.values())}, "
              f"lost {sum(s.lost_messages for s in session.ranks.values())}")
        print(f"  frames              {app.frames} = {app.frames / elapsed:.1f}/s, our frame code "
              f"{1000 * app.frame_seconds / max(app.frames, 1):.1f} ms on average")
        print(f"  steps kept in memory {len(session.reports)} (spans {spans:,}); session file "
              f"{(directory / 'session.ddpwatch').stat().st_size / 2**20:.1f} MiB")
        print("  RSS over the run     " + ", ".join(f"{t:.0f}s {rss:.0f} MiB" for t, rss, _, _ in samples))
        windows = zip([(0.0, 0.0, 0, 0.0), *samples], samples)
        print("  frames/s, 5 s windows " + ", ".join(f"{(f1 - f0) / (t1 - t0):.1f}" for (t0, _, f0, _), (t1, _, f1, _) in windows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--step-s", type=float, default=0.1)
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--spans", type=int, default=64, help="spans per step report (a 7B DDP job: hundreds of buckets)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        asyncio.run(watch(args, Path(directory)))


if __name__ == "__main__":
    main()
