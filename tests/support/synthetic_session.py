"""A small, fixed two-rank session as raw wire messages, edits of it, and the dashboard's snapshot
of such messages, for dashboard and export tests."""

from __future__ import annotations

from collections.abc import Callable, Collection
from msgspec.structs import replace

from ddpwatch.dashboard.views.snapshot import SnapshotBuilder
from ddpwatch.dashboard.views.snapshot_parts import Snapshot
from ddpwatch.ingest.receiver import ingest
from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.codec import encode
from instrumented_ddp.wire.messages import DeviceSample, Goodbye, Hello, Message, Span, StepReport, StepSummary

LAYOUT = [(f"layer{i}.weight", 1000, "float32") for i in range(4)]


def hello(rank: int, strategy: str = "simple", world_size: int = 2, device: str = "cpu", device_note: str = "") -> Hello:
    return Hello(rank=rank, world_size=world_size, session="fixed-session", host="node-a", pid=100 + rank, device=device,
                 backend="gloo", strategy=strategy, settings={"grad_accum": 1, "bucket_mb": 25.0},
                 model_parameters=4000, parameter_layout=LAYOUT, total_steps=10, global_batch=8, device_note=device_note)


def step_report(rank: int, step: int, strategy: str) -> StepReport:
    """simple: four blocking all-reduces after backward; bucket: two async ones inside backward."""
    t0 = 100.0 + step * 0.2 + (rank % 7) * 0.003  # the ranks' clocks a little off
    spans = [Span("data", t0, t0 + 0.005), Span("forward", t0 + 0.005, t0 + 0.045)]
    if strategy == "simple":
        spans.append(Span("backward", t0 + 0.045, t0 + 0.125))
        spans += [Span("all_reduce", t0 + 0.125 + 0.01 * i, t0 + 0.134 + 0.01 * i, True, 4000, f"p{i}", "float32") for i in range(4)]
        end_comm = t0 + 0.165
    else:
        spans.append(Span("backward", t0 + 0.045, t0 + 0.135))
        spans += [Span("all_reduce", t0 + 0.08, t0 + 0.11, False, 8000, "b0", "float32"),
                  Span("all_reduce", t0 + 0.115, t0 + 0.15, False, 8000, "b1", "float32"),
                  Span("wait", t0 + 0.135, t0 + 0.15, True)]
        end_comm = t0 + 0.15
    spans.append(Span("optimizer", end_comm, end_comm + 0.02))
    return StepReport(rank=rank, step=step, strategy=strategy, settings={"grad_accum": 1} if strategy == "simple" else {"bucket_mb": 1.0, "grad_accum": 1},
                      start=t0, end=end_comm + 0.02, spans=spans, samples=4, tokens=256, loss=2.0 - 0.1 * step)


#: A step report as sent instead: changed, summarized at the edge, or None (not sent).
Edit = Callable[[StepReport], StepReport | StepSummary | None]


def waiting_ranks(ms: float, ranks: Collection[int] = (1,)) -> Callable[[StepReport], StepReport]:
    """An edit: the first all-reduce of each step of each of ``ranks`` starts ``ms`` earlier, so
    that rank waits that long in it for the others."""
    def edit(report: StepReport) -> StepReport:
        if report.rank not in ranks:
            return report
        spans = list(report.spans)
        first = next(i for i, span in enumerate(spans) if span.kind == "all_reduce")
        spans[first] = spans[first]._replace(start=spans[first].start - ms / 1000)
        return replace(report, spans=spans)
    return edit


def session_messages(steps: int = 10, goodbye: bool = True, world_size: int = 2, edit: Edit | None = None,
                     hellos: dict[int, Hello] | None = None) -> list[bytes]:
    """``edit``: changes a step report before it is sent (None: not sent); ``hellos``: sent instead
    of the default hello of those ranks."""
    messages: list[bytes] = []
    ranks = range(world_size)
    seq = dict.fromkeys(ranks, 0)

    def add(rank: int, message: Message) -> None:
        messages.append(encode(message, seq[rank], 0))
        seq[rank] += 1

    for rank in ranks:
        add(rank, (hellos or {}).get(rank) or hello(rank, world_size=world_size))
    for step in range(1, steps + 1):
        strategy = "simple" if step <= steps // 2 else "bucket"
        for rank in ranks:
            report = step_report(rank, step, strategy)
            sent = edit(report) if edit is not None else report
            if sent is not None:
                add(rank, sent)
            add(rank, DeviceSample(rank, 100.0 + step * 0.2, "cpu", {"process_cpu_pct": 40.0 + 5 * step + rank, "host_cpu_pct": 70.0, "rss_bytes": 5e8}))
    if goodbye:
        for rank in ranks:
            add(rank, Goodbye(rank, steps))
    return messages


def desync_at_3_4_and_a_straggler(report: StepReport) -> StepReport:
    """Two warnings: rank 1 issues one all-reduce fewer in steps 3 and 4 (a desync), and waits
    30 ms a step for rank 0 (a straggler)."""
    report = waiting_ranks(30.0)(report)
    if report.rank == 1 and report.step in (3, 4):
        return replace(report, spans=[s for s in report.spans if s.tag != "p3"])
    return report


def snapshot_of(messages: list[bytes], keep_steps: int | None = 120) -> tuple[Session, Snapshot]:
    """``messages`` taken in by a session (``keep_steps``: its bound), and the dashboard's snapshot of it."""
    session = Session(keep_steps)
    ingest(session, messages)
    return session, SnapshotBuilder(session).build()
