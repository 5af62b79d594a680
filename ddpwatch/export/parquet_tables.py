"""steps.parquet and collectives.parquet: a session's steps and timed collectives as tables, for
DuckDB, pandas or Polars (the ``parquet`` extra: pyarrow).

``steps.parquet`` holds a row per rank per kept step, with the figures the segments fold
(``StepFigures``), so that a ``GROUP BY rank`` over the counted rows gives back summary.json's
per-rank ``steps`` and ``step_ms_mean``. ``collectives.parquet`` holds a row per collective a
rank timed in a step it sent whole (a summarized step's spans are not kept, and have no rows).
Times are seconds on rank 0's clock (``clock_offsets``, the trace's rule) from the session's first
step start. Column names and meanings are documented in docs/guide/recording.md; both files carry
them in their schema's metadata too.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

from msgspec.structs import replace

from instrumented_ddp.wire.kinds import COMM_KINDS, is_barrier_wait
from instrumented_ddp.wire.step_figures import all_reduces, counted, sharded_collectives

from ddpwatch.figures.cross_rank import call_waits, shard_groups
from ddpwatch.ingest.session import Session

__all__ = ["COLLECTIVE_COLUMNS", "PARQUET_EXTRA", "STEP_COLUMNS", "collective_rows", "step_rows", "write_parquet_tables"]

PARQUET_EXTRA = "steps.parquet and collectives.parquet need pyarrow, the parquet extra: pip install 'ddpwatch[parquet]'"
MEMORY_COLUMNS = {"parameters": "parameters_bytes", "gradients": "gradients_bytes",
                  "optimizer_state": "optimizer_state_bytes", "peak": "peak_bytes"}

#: (name, arrow type, meaning): the schema of steps.parquet, in column order.
STEP_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("session", "string", "the run's session id"),
    ("segment", "int32", "the segment's index (a switch begins one)"),
    ("strategy", "string", "the strategy the rank ran the step under"),
    ("step", "int64", "the optimizer step, from 1"),
    ("rank", "int32", "the rank"),
    ("host", "string", "the rank's host, as its hello says"),
    ("node_rank", "int32", "the rank's node, as its hello says"),
    ("counted", "bool", "whether the step enters the figures: neither excluded nor unresolved"),
    ("excluded", "bool", "left out of the figures (DDP's first iteration, a compile, a pause inside the step)"),
    ("unresolved", "bool", "some of the step's marks never resolved"),
    ("compiling", "bool", "torch.compile compiled in the step"),
    ("update_skipped", "bool", "gradients reduced, then cleared with no optimizer step"),
    ("spans_kept", "bool", "the step's spans are kept: its collectives are in collectives.parquet"),
    ("start_s", "float64", "the step's start, s on rank 0's clock from the session's first step"),
    ("step_ms", "float64", "the step's window on the rank, ms (null where not counted)"),
    ("compute_pct", "float64", "Compute%"),
    ("non_compute_pct", "float64", "Non_Compute%: exposed communication"),
    ("idle_pct", "float64", "Idle%"),
    ("data_wait_pct", "float64", "Data wait%"),
    ("overlap_pct", "float64", "Overlap%: the step's communication hidden behind compute"),
    ("comm_overhead_pct", "float64", "Comm_overhead%: the step's communication, merged, in the window"),
    ("all_reduce_calls", "int32", "all-reduces in the step"),
    ("all_reduce_ms", "float64", "their summed durations, ms"),
    ("busbw_gbps", "float64", "the step's median all-reduce busbw, GB/s (null: none measurable)"),
    ("waited_for_others_ms", "float64", "ms the rank waited in collectives for others"),
    ("others_waited_ms", "float64", "ms the others waited for this rank"),
    ("collectives", "int32", "collectives of every kind in the step"),
    ("samples", "int64", "samples the rank trained on"),
    ("tokens", "int64", "tokens the rank trained on"),
    ("loss", "float64", "the step's loss, where the rank sent one"),
    ("paused_s", "float64", "the loop's pause of training before the step, s"),
    *((column, "int64", f"bytes of {kind.replace('_', ' ')} held at the step's end, where measured")
      for kind, column in MEMORY_COLUMNS.items()),
)

#: (name, arrow type, meaning): the schema of collectives.parquet, in column order.
COLLECTIVE_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("session", "string", "the run's session id"),
    ("segment", "int32", "the segment's index"),
    ("step", "int64", "the optimizer step"),
    ("rank", "int32", "the rank"),
    ("kind", "string", "all_reduce, reduce_scatter, all_gather, broadcast, ... or barrier"),
    ("tag", "string", "which call (a bucket b<i>, a parameter p<i>, an FSDP unit, a barrier's group)"),
    ("bytes", "int64", "the bytes it carried (a reduce-scatter's input, an all-gather's output)"),
    ("dtype", "string", "the tensor's dtype"),
    ("blocking", "bool", "the training thread sat in it"),
    ("start_s", "float64", "its start, s on rank 0's clock from the session's first step"),
    ("duration_ms", "float64", "its duration on the rank, ms"),
    ("wait_ms", "float64", "ms of it the rank waited for the last rank to arrive (its duration less the "
                           "call's shortest over its group); null where not paired: another kind, or a "
                           "step some rank did not send whole"),
)


def step_rows(session: Session, offsets: dict[int, float], origin: float) -> list[dict[str, Any]]:
    """steps.parquet's rows, in step then rank order."""
    rows: list[dict[str, Any]] = []
    for step in sorted(session.reports):
        segment = session.segment_of(step)
        figures = session.step_figures(step)
        waited, waited_on = session.step_waits(step)
        for rank, report in sorted(session.reports[step].items()):
            hello = state.hello if (state := session.ranks.get(rank)) is not None else None
            f = figures.get(rank)
            row: dict[str, Any] = {
                "session": session.session_id, "segment": segment.index if segment is not None else None,
                "strategy": report.strategy, "step": step, "rank": rank,
                "host": hello.host if hello else None, "node_rank": hello.node_rank if hello else None,
                "counted": counted(report), "excluded": report.excluded, "unresolved": report.unresolved,
                "compiling": report.compiling, "update_skipped": report.update_skipped,
                "spans_kept": session.has_spans(step, rank),
                "start_s": report.start + offsets.get(rank, 0.0) - origin,
                "samples": report.samples, "tokens": report.tokens, "loss": report.loss, "paused_s": report.paused_s,
                **{column: report.memory.get(kind) for kind, column in MEMORY_COLUMNS.items()}}
            if f is not None:
                row.update(step_ms=f.step_ms, compute_pct=f.compute_pct, non_compute_pct=f.non_compute_pct,
                           idle_pct=f.idle_pct, data_wait_pct=f.data_wait_pct, overlap_pct=f.overlap_pct,
                           comm_overhead_pct=f.comm_overhead_pct, all_reduce_calls=f.all_reduce_calls,
                           all_reduce_ms=f.all_reduce_ms, busbw_gbps=f.busbw_gbps,
                           waited_for_others_ms=waited.get(rank, 0.0), others_waited_ms=waited_on.get(rank, 0.0),
                           collectives=sum(f.calls_by_kind.values()))
            rows.append(row)
    return rows


def collective_rows(session: Session, offsets: dict[int, float], origin: float) -> list[dict[str, Any]]:
    """collectives.parquet's rows, in step, rank and start order. A call's wait is paired as the
    figures pair it: all-reduces within the all-reduce groups; reduce-scatters, all-gathers and
    barriers within the shard groups; over a step every rank of which was kept whole and counted."""
    rows: list[dict[str, Any]] = []
    groups = session.all_reduce_groups()
    for step in sorted(session.reports):
        segment = session.segment_of(step)
        kept = session.reports[step]
        # each report's spans read once, into a list: a packed report makes new ``Span`` objects on
        # every reading, and a call's wait is found by the very object ``all_reduces`` returns
        whole = {rank: replace(report, spans=list(report.spans)) for rank, report in kept.items()
                 if session.has_spans(step, rank)}
        if not whole:
            continue
        figures = session.step_figures(step)
        reduced: dict[int, dict[int, float]] = {}
        sharded: dict[int, dict[int, float]] = {}
        if len(whole) == len(kept) and set(whole) <= set(figures):
            reduced = call_waits(session.counted_calls(step), groups)
            sharded = call_waits({rank: f.sharded_calls for rank, f in figures.items() if f.sharded_calls.tags},
                                 shard_groups(groups))
        for rank, record in sorted(whole.items()):
            waits = _keyed_by_span(all_reduces(record), reduced.get(rank, {}))
            waits.update(_keyed_by_span(sharded_collectives(record), sharded.get(rank, {})))
            for span in sorted(record.spans, key=lambda s: s.start):
                barrier = is_barrier_wait(span)
                if span.kind not in COMM_KINDS and not barrier:
                    continue
                rows.append({"session": session.session_id, "segment": segment.index if segment is not None else None,
                             "step": step, "rank": rank, "kind": "barrier" if barrier else span.kind, "tag": span.tag,
                             "bytes": span.nbytes, "dtype": span.dtype, "blocking": span.blocking,
                             "start_s": span.start + offsets.get(rank, 0.0) - origin,
                             "duration_ms": 1000.0 * (span.end - span.start), "wait_ms": waits.get(id(span))})
    return rows


def _keyed_by_span(calls: list[Any], waits: dict[int, float]) -> dict[int, float]:
    """Each call's wait (by its index among ``calls``), keyed by the span object's id."""
    return {id(span): waits[index] for index, span in enumerate(calls) if index in waits}


def write_parquet_tables(session: Session, out_dir: Path, offsets: dict[int, float]) -> dict[str, Path]:
    """Write both tables into ``out_dir``, each atomically; name -> path of those written.
    ``offsets``: each rank's clock onto rank 0's (``exporters.clock_offsets``). Raises
    ``ImportError`` with ``PARQUET_EXTRA`` where pyarrow is missing."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(PARQUET_EXTRA) from None
    starts = [report.start + offsets.get(rank, 0.0) for reports in session.reports.values() for rank, report in reports.items()]
    origin = min(starts) if starts else 0.0
    paths = {}
    for name, columns, rows in (("steps.parquet", STEP_COLUMNS, step_rows(session, offsets, origin)),
                                ("collectives.parquet", COLLECTIVE_COLUMNS, collective_rows(session, offsets, origin))):
        schema = pa.schema([pa.field(column, getattr(pa, "bool_" if kind == "bool" else kind)(), metadata={"meaning": meaning})
                            for column, kind, meaning in columns])
        table = pa.Table.from_pylist(rows, schema=schema)
        fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".tmp")
        os.close(fd)
        try:
            pq.write_table(table, tmp)
            os.replace(tmp, out_dir / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        paths[name] = out_dir / name
    return paths
