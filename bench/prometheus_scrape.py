"""What ``--prometheus`` costs at a large job: the scrape's size and time, and the listener's time
to make the families it serves.

    python bench/prometheus_scrape.py [--ranks 1024] [--steps 20] [--spans 40] [--scrapes 20]

A session of ``--ranks`` ranks is folded from what ``bench/ingest.py``'s simulated ranks send
(a bucketed run on GPUs: phases, all-reduces, heartbeats, NVML samples), without goodbyes, so
every rank reads live. Printed: the series and samples ``/metrics`` serves, per rank; the bytes
of one scrape; the median time of ``metric_families`` (paid by the listener once a second,
``PUBLISH_EVERY_S``, or as seldom as ``LISTENER_SHARE`` asks) and of a whole scrape over HTTP on loopback (paid by prometheus_client's
thread, beside the listener).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ingest import rank_stream  # noqa: E402

from ddpwatch.export.prometheus_endpoint import LISTENER_SHARE, PUBLISH_EVERY_S, PrometheusEndpoint  # noqa: E402
from ddpwatch.export.prometheus_metrics import metric_families  # noqa: E402
from ddpwatch.ingest.receiver import ingest  # noqa: E402
from ddpwatch.ingest.session import Session  # noqa: E402
from instrumented_ddp.wire.codec import encode  # noqa: E402
from instrumented_ddp.wire.messages import Goodbye  # noqa: E402


def session_of(ranks: int, steps: int, spans: int) -> Session:
    session = Session(keep_steps=120)
    streams = [rank_stream(rank, ranks, steps, spans) for rank in range(ranks)]
    seq = [0] * ranks
    for batches in zip(*streams, strict=True):  # step by step, every rank: as they arrive
        messages = []
        for rank, batch in enumerate(batches):
            for message in batch:
                if not isinstance(message, Goodbye):
                    messages.append(encode(message, seq[rank], 0))
                    seq[rank] += 1
        ingest(session, messages)
    return session


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--spans", type=int, default=40, help="spans per step report (phases and all-reduces)")
    parser.add_argument("--scrapes", type=int, default=20)
    args = parser.parse_args()
    started = time.perf_counter()
    session = session_of(args.ranks, args.steps, args.spans)
    print(f"session: {args.ranks} ranks x {args.steps} steps folded in {time.perf_counter() - started:.1f} s")
    now = time.monotonic()
    made = []
    for _ in range(5):
        begun = time.perf_counter()
        families = metric_families(session, now)
        made.append(time.perf_counter() - begun)
    samples = sum(len(family.samples) for family in families)
    per_rank = sum(len(family.samples) for family in families if family.samples and "host" in family.samples[0].labels)
    endpoint = PrometheusEndpoint("127.0.0.1:0")
    try:
        endpoint.publish(session, now)
        times, size = [], 0
        for _ in range(args.scrapes):
            begun = time.perf_counter()
            with urllib.request.urlopen(endpoint.url, timeout=30) as response:
                size = len(response.read())
            times.append(time.perf_counter() - begun)
    finally:
        endpoint.close()
    print(f"families: {len(families)}; samples: {samples} ({per_rank / args.ranks:.1f} per rank, "
          f"{samples - per_rank} of the run)")
    print(f"scrape: {size / 1e6:.2f} MB ({size / args.ranks / 1e3:.1f} kB per rank), "
          f"median {statistics.median(times) * 1e3:.0f} ms over {args.scrapes} (min {min(times) * 1e3:.0f} ms)")
    every_s = max(PUBLISH_EVERY_S, statistics.median(made) / LISTENER_SHARE)  # PrometheusEndpoint.publish's rule
    print(f"listener: metric_families median {statistics.median(made) * 1e3:.0f} ms, made every {every_s:.1f} s "
          f"(PUBLISH_EVERY_S {PUBLISH_EVERY_S:g} s, or longer to keep to {LISTENER_SHARE:.0%} of the listener's time: "
          f"{statistics.median(made) / every_s * 100:.1f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
