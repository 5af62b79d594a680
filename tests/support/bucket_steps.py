"""Made-up bucket steps the advisor's and the slowdown's tests share: a 4 MiB model of four 1 MiB
tensors, backward on a rank's clock with its ready marks and all-reduces, and a session of two caps."""

from __future__ import annotations

from msgspec.structs import replace

from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import Hello, Span, StepReport

MIB = 1024 * 1024


def two_bucket_step(end_s: float = 0.172) -> StepReport:
    """Forward 10-100 ms; backward from 100 ms; b0 (2 MiB) ready at 120 and all-reduced 120-136,
    beside backward; b1 ready at 146, backward's last gradient, all-reduced 146-162 after it."""
    spans = [Span("forward", 0.010, 0.100), Span("backward", 0.100, 0.162),
             Span("ready", 0.120, 0.120, False, 2 * MIB, "b0"), Span("ready", 0.146, 0.146, False, 2 * MIB, "b1"),
             Span("all_reduce", 0.120, 0.136, False, 2 * MIB, "b0", "float32"),
             Span("all_reduce", 0.146, 0.162, False, 2 * MIB, "b1", "float32"),
             Span("wait", 0.146, 0.162, True), Span("optimizer", 0.162, end_s)]
    return StepReport(rank=0, step=3, strategy="bucket", settings={"bucket_mb": 2.0}, start=0.0, end=end_s,
                      spans=spans, samples=4, tokens=0)
LAYOUT = [(f"layer{i}.weight", MIB // 4, "float32") for i in range(4)]  # four 1 MiB tensors


def bucket_step(rank: int = 0, step: int = 3, marks: str = "b", transfer_s: tuple[float, float] = (0.016, 0.016)) -> StepReport:
    """The simulator tests' backward on a rank's clock: backward from 0.100 s; [p3,p2] complete at
    0.120 (b0), [p1,p0] at 0.140 (b1, where compute ends); on one stream the all-reduces run
    0.120-0.136 and 0.140-0.156, the wait 0.140-0.156; the step 0.000-0.170."""
    spans = [Span("forward", 0.01, 0.1), Span("backward", 0.1, 0.156)]
    if marks == "b":
        spans += [Span("ready", 0.12, 0.12, False, 2 * MIB, "b0"), Span("ready", 0.14, 0.14, False, 2 * MIB, "b1")]
    elif marks == "p":
        spans += [Span("ready", 0.1 + 0.01 * (4 - i), 0.1 + 0.01 * (4 - i), False, MIB, f"p{i}") for i in range(4)]
    spans += [Span("all_reduce", 0.12, 0.12 + transfer_s[0], False, 2 * MIB, "b0", "float32"),
              Span("all_reduce", 0.14, 0.14 + transfer_s[1], False, 2 * MIB, "b1", "float32"),
              Span("wait", 0.14, 0.156, True), Span("optimizer", 0.156, 0.17)]
    return StepReport(rank=rank, step=step, strategy="bucket", settings={"bucket_mb": 2.0}, start=0.0, end=0.17,
                      spans=spans, samples=4, tokens=0)


def hello(rank: int, cap_mb: float, layout: list[list[int]], backend: str = "gloo") -> Envelope:
    """A bucket rank's hello at ``cap_mb`` with the four 1 MiB tensors in ``layout``'s buckets."""
    return Envelope(Hello(rank, 2, "s", "h", 1, "cpu", backend, "bucket", {"bucket_mb": cap_mb, "grad_accum": 1}, 4 * MIB,
                          parameter_layout=LAYOUT, bucket_layout=layout), rank, 0, 0)


def one_bucket(rank: int, step: int, cap_mb: float) -> StepReport:
    """Every gradient in one 4 MiB bucket ready at 40 ms, its all-reduce 40-60 ms after backward;
    the step 170 ms."""
    spans = [Span("forward", 0.01, 0.1), Span("backward", 0.1, 0.16), Span("ready", 0.14, 0.14, False, 4 * MIB, "b0"),
             Span("all_reduce", 0.14, 0.16, False, 4 * MIB, "b0", "float32"), Span("wait", 0.14, 0.16, True),
             Span("optimizer", 0.16, 0.17)]
    return StepReport(rank=rank, step=step, strategy="bucket", settings={"bucket_mb": cap_mb}, start=0.0, end=0.17,
                      spans=spans, samples=4, tokens=0)


def slowed_session() -> Session:
    """Two segments of the same 90 ms forward. At 4 MB one bucket after backward: backward's 40 ms
    alone, the step 170 ms. At 2 MB b0's 2 MiB all-reduce runs beside backward and backward ends
    at 46 ms, the step 172 ms (``test_compute_slowdown.two_bucket_step``)."""
    session = Session()

    for rank in (0, 1):
        session.ingest(hello(rank, 4.0, [[3, 2, 1, 0]], "nccl"), received_at=0.0)
    for step in (1, 2, 3, 4):
        for rank in (0, 1):
            session.ingest(Envelope(one_bucket(rank, step, 4.0), rank, step, 0), received_at=0.0)
    for rank in (0, 1):
        session.ingest(hello(rank, 2.0, [[3, 2], [1, 0]], "nccl"), received_at=0.0)
    for step in (5, 6, 7, 8):
        for rank in (0, 1):
            session.ingest(Envelope(replace(two_bucket_step(), rank=rank, step=step), rank, step, 0), received_at=0.0)
    return session
