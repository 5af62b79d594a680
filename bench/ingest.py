"""How many messages and span events per second the ``ddpwatch record`` path sustains.

Each rank sends a StepReport per step, so the receiver's load is ranks x steps/s x spans; this
says how large a run one recorder can follow. ``--senders`` spawned processes simulate the ranks,
one DEALER socket each as real ranks: Hello, a StepReport per step, a Heartbeat every 10 steps, a
DeviceSample every 2, Goodbye. They are encoded before the start and sent BLOCKING, so nothing
is dropped and the pace is what the receiver keeps up with. The main process runs the loop of
``ddpwatch/record/recorder.py`` (receive -> ingest -> SessionWriter, switch relay) until every rank said
goodbye, timed from the first batch to the last.

Reading it: messages/s and events/s are sustained while sharing the CPU with the senders (a lower
bound); receiver CPU near 100% means the receiver set the pace. A run needs ranks x steps/s x
(spans + 1) events/s. lost, rejected, sender drops must be 0 (else exit 1). Peak RSS holds every
report in memory plus the imports ("before"; torch comes with them).

``--baseline-tree DIR`` measures another checkout beside this one in the same invocation (a
``git worktree`` of an earlier commit): ``--rounds`` runs of each, alternating, each in a process
of its own running that tree's own ``bench/ingest.py`` with the same arguments; it prints each
run, the medians and their ratio, in messages per second and in messages per second of the
receiver's CPU (the steadier of the two on a machine busy with other work).
"""

from __future__ import annotations

import argparse
import functools
import multiprocessing as mp
import resource
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from multiprocessing.synchronize import Barrier
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import zmq  # noqa: E402
from ddpwatch.control.relay import SwitchRelay  # noqa: E402
from ddpwatch.ingest.receiver import TelemetryReceiver, ingest  # noqa: E402
from ddpwatch.ingest.session import Session  # noqa: E402
from ddpwatch.ingest.session_file import SESSION_FILE_NAME, SessionWriter  # noqa: E402
from instrumented_ddp.wire.codec import encode  # noqa: E402
from instrumented_ddp.wire.messages import DeviceSample, Goodbye, Heartbeat, Hello, Message, Span, StepReport  # noqa: E402
from instrumented_ddp.wire.endpoints import routing_id  # noqa: E402

STEP_S = 0.1  # simulated step length on the rank's clock
IDLE_ABORT_S = 15.0
SETTINGS = {"bucket_mb": 25.0, "grad_accum": 1}
LAYOUT = [("embed.weight", 3_145_728, "float32")] + [
    (f"layers.{i}.{name}", numel, "float32")
    for i in range(7)
    for name, numel in (("ln1.weight", 768), ("ln1.bias", 768), ("attn.qkv.weight", 1_769_472), ("attn.out.weight", 589_824),
                        ("ln2.weight", 768), ("ln2.bias", 768), ("mlp.fc.weight", 2_359_296), ("mlp.proj.weight", 2_359_296))
]  # 57 entries, a small GPT


def step_report(rank: int, step: int, spans_per_step: int) -> StepReport:
    """A step of a bucketed run: phases, then ``spans_per_step - 5`` all-reduces issued while backward
    runs. Made from one template per span count (a 300-span report 271 -> ~70 us): at 1,024 ranks the
    load bench's senders made a report per rank per step, and building them took more of this
    machine's cores than the dashboard under test."""
    t = 1000.0 + step * STEP_S + rank * 1e-4
    new = tuple.__new__  # Span is a named tuple: this skips its argument parsing
    spans = [new(Span, (kind, t + start, t + end, blocking, nbytes, tag, dtype))
             for kind, start, end, blocking, nbytes, tag, dtype in _span_template(spans_per_step)]
    return StepReport(rank, step, "bucket", SETTINGS, t, t + STEP_S * 0.96, spans, 32, 32 * 512, 3.2 - step * 1e-3)


@functools.cache
def _span_template(spans_per_step: int) -> tuple[tuple[str, float, float, bool, int, str, str], ...]:
    """A step's spans as offsets from its start."""
    spans = [Span("data", 0.0, 0.002, True), Span("forward", 0.002, 0.032, True), Span("backward", 0.032, 0.082, True)]
    comms = max(0, spans_per_step - 5)
    for i in range(comms):  # buckets reduced while backward runs, the last ones after it
        start = 0.035 + i * 0.05 / max(comms, 1)
        spans.append(Span("all_reduce", start, start + 0.004, False, 4 * 1_048_576 + i * 4096, f"b{i}", "float32"))
    spans += [Span("wait", 0.082, 0.088, True), Span("optimizer", 0.088, 0.095, True)]
    return tuple(tuple(span) for span in spans[:spans_per_step])  # type: ignore[misc]


def rank_stream(rank: int, world: int, steps: int, spans_per_step: int) -> Iterator[list[Message]]:
    """What one rank sends, as one list of messages per step (Hello first, Goodbye last)."""
    buckets = [list(range(i, min(i + 8, len(LAYOUT)))) for i in range(0, len(LAYOUT), 8)]
    yield [Hello(rank, world, "bench", "localhost", 10_000 + rank, f"cuda:{rank % 8}", "nccl", "bucket", SETTINGS,
                 sum(n for _, n, _ in LAYOUT), LAYOUT, buckets, steps, 32 * world, rank // 8, rank % 8)]
    for step in range(steps):
        batch: list[Message] = [step_report(rank, step, spans_per_step)]
        t = 1000.0 + (step + 1) * STEP_S
        if step % 10 == 0:
            batch.append(Heartbeat(rank, t, step))
        if step % 2 == 0:
            batch.append(DeviceSample(rank, t, "gpu", {"gpu_util_pct": 87.0, "mem_used_bytes": 6.1e10, "power_w": 512.0}))
        yield batch
    yield [Goodbye(rank, steps)]


def sender(address: str, ranks: list[int], world: int, steps: int, spans_per_step: int, start: Barrier) -> None:
    context = zmq.Context()
    sockets = [context.socket(zmq.DEALER) for _ in ranks]
    for rank, dealer in zip(ranks, sockets, strict=True):
        dealer.setsockopt(zmq.ROUTING_ID, routing_id("bench", rank))
        dealer.connect(address)
    encoded: list[list[list[bytes]]] = []  # per rank, per step (see the module docstring)
    for rank in ranks:
        seq, per_step = 0, []
        for batch in rank_stream(rank, world, steps, spans_per_step):
            per_step.append([encode(message, seq + i, 0) for i, message in enumerate(batch)])
            seq += len(batch)
        encoded.append(per_step)
    start.wait()
    for step in range(steps + 2):  # the ranks advance together, step by step
        for dealer, per_step in zip(sockets, encoded, strict=True):
            for data in per_step[step]:
                dealer.send(data)  # blocking: waits at the high-water mark, never drops
    for dealer in sockets:
        dealer.close(linger=-1)  # wait until everything queued is delivered
    context.term()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--spans-per-step", type=int, default=64)
    parser.add_argument("--senders", type=int, default=2)
    parser.add_argument("--out-dir", type=Path, default=None, help="keep the session file here")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="a checkout to measure beside this one (its bench/ingest.py), runs alternating")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each tree with --baseline-tree (default 3)")
    args = parser.parse_args()
    if args.baseline_tree is not None:
        same = ["--ranks", str(args.ranks), "--steps", str(args.steps), "--spans-per-step", str(args.spans_per_step),
                "--senders", str(args.senders)]
        return side_by_side(args.baseline_tree, same, args.rounds)
    address = f"tcp://127.0.0.1:{free_port()}"
    receiver = TelemetryReceiver(address)
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="ddpwatch-bench-"))
    writer = SessionWriter(out_dir / SESSION_FILE_NAME)
    session = Session()
    relay = SwitchRelay(receiver.send)
    ctx = mp.get_context("spawn")
    start = ctx.Barrier(args.senders + 1)
    workers = [ctx.Process(target=sender, args=(address, list(range(i, args.ranks, args.senders)), args.ranks,
                                                args.steps, args.spans_per_step, start), daemon=True)
               for i in range(args.senders)]
    first = last = cpu_first = cpu_last = 0.0
    aborted = ""
    try:
        for worker in workers:
            worker.start()
        start.wait(timeout=120)
        rss_before = int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize() / 2**20
        last_message = time.monotonic()
        while not session.finished:  # the recorder's loop (ddpwatch/record/recorder.py)
            batch = receiver.receive(timeout_ms=200)
            if batch:
                if not first:
                    first, cpu_first = time.perf_counter(), time.process_time()
                last_message = time.monotonic()
                for peer, data in batch:
                    for envelope in ingest(session, [data], writer):
                        relay.note(peer, envelope)
                last, cpu_last = time.perf_counter(), time.process_time()
            relay.tick()
            writer.flush_if_due()
            if time.monotonic() - last_message > IDLE_ABORT_S:
                aborted = f"no message for {IDLE_ABORT_S:g} s"
                break
    finally:
        writer.close()
        receiver.close()
        for worker in workers:
            worker.join(timeout=10)
            worker.terminate()  # only if it hangs
            worker.join()
        file_mib = (out_dir / SESSION_FILE_NAME).stat().st_size / 2**20
        if args.out_dir is None:
            shutil.rmtree(out_dir, ignore_errors=True)
    seconds = max(last - first, 1e-9)
    received = writer.records
    events = sum(len(r.spans) for by_rank in session.reports.values() for r in by_rank.values())
    rejected = sum(session.rejected.values())
    lost = sum(r.lost_messages for r in session.ranks.values())
    drops = sum(r.sender_dropped for r in session.ranks.values())
    expected = args.ranks * (2 + args.steps + len(range(0, args.steps, 10)) + len(range(0, args.steps, 2)))
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(f"""ddpwatch ingest benchmark (receive -> ingest -> SessionWriter)
  ranks             {args.ranks} (simulated by {args.senders} sender processes)
  steps             {args.steps} ({args.spans_per_step} spans per step)
  messages          {received:,} of {expected:,} expected
  events (spans)    {events:,}
  seconds           {seconds:.3f}
  messages/s        {received / seconds:,.0f}
  events/s          {events / seconds:,.0f}
  receiver CPU      {100 * (cpu_last - cpu_first) / seconds:.0f}% of one core (near 100%: the receiver is the limit)
  rejected          {rejected}
  lost              {lost}
  sender drops      {drops}
  peak RSS          {peak_mib:.1f} MiB (before: {rss_before:.1f} MiB)
  session file      {file_mib:.1f} MiB{f' in {out_dir}' if args.out_dir else ''}""")
    if aborted or lost or rejected or drops or received != expected or any(w.exitcode != 0 for w in workers):
        print(f"FAILED: {aborted or 'messages lost, rejected or missing, or a sender failed'}", file=sys.stderr)
        return 1
    return 0


def side_by_side(baseline: Path, same: list[str], rounds: int) -> int:
    """``rounds`` runs of this tree's benchmark and of ``baseline``'s, alternating which goes
    first, each a process of its own; the medians of each and this tree's over the baseline's."""
    scripts = {"this tree": Path(__file__).resolve(), "baseline": (baseline / "bench" / "ingest.py").resolve()}
    if not scripts["baseline"].is_file():
        print(f"FAILED: {baseline} holds no bench/ingest.py", file=sys.stderr)
        return 1
    measured: dict[str, list[tuple[float, float]]] = {name: [] for name in scripts}
    for round_ in range(rounds):
        for name in sorted(scripts, reverse=round_ % 2 == 0):  # "this tree" first in even rounds
            result = subprocess.run([sys.executable, str(scripts[name]), *same], capture_output=True, text=True)
            if result.returncode != 0:
                print(f"FAILED: {name} run {round_ + 1}:\n{result.stdout}{result.stderr}", file=sys.stderr)
                return 1
            rate, cpu_share = read_rates(result.stdout)
            measured[name].append((rate, rate / cpu_share))
            print(f"  run {round_ + 1}  {name:<9}  {rate:9,.0f} messages/s  {rate / cpu_share:9,.0f} per receiver CPU-second",
                  flush=True)
    medians = {name: (statistics.median(r for r, _ in runs), statistics.median(c for _, c in runs))
               for name, runs in measured.items()}
    (now, now_cpu), (before, before_cpu) = medians["this tree"], medians["baseline"]
    print(f"""ddpwatch ingest benchmark, this tree beside {baseline} ({' '.join(same)}; median of {rounds})
  messages/s                      this tree {now:,.0f}   baseline {before:,.0f}   ratio {now / before:.2f}x
  per receiver CPU-second         this tree {now_cpu:,.0f}   baseline {before_cpu:,.0f}   ratio {now_cpu / before_cpu:.2f}x""")
    return 0


def read_rates(output: str) -> tuple[float, float]:
    """(messages/s, receiver CPU as a share of one core) from one run's printout."""
    lines = {line.strip().split("  ")[0]: line for line in output.splitlines() if line.startswith("  ")}
    rate = float(lines["messages/s"].split()[-1].replace(",", ""))
    cpu_share = float(lines["receiver CPU"].split()[2].rstrip("%")) / 100
    return rate, max(cpu_share, 1e-9)


if __name__ == "__main__":
    sys.exit(main())
