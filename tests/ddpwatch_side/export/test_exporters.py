"""Exports of a hand-made two-rank session whose figures can be checked with pencil and paper.

Timeline of one step on rank 0, in ms from the step start (window 0-100):

* "simple" (steps 0-2): forward 0-30, backward 30-80 holding two blocking all-reduces 50-60 and
  70-80, optimizer 85-95.  Compute 70, comm 20 -> 70% / 20% / 10% idle, no overlap.
* "bucket" (steps 3-5, step 3 excluded): forward 0-30, backward 30-80, async all-reduces 50-65
  and 60-85 (overlapping each other), wait 80-85, optimizer 85-95.

Rank 1 does the same on a clock 100 s ahead, except that its step and forward start 5 ms
earlier: aligning by step starts would then be 5 ms off, aligning by the last all-reduce is exact.
"""

from __future__ import annotations

import csv
import io
import itertools
import json
import threading
from collections import defaultdict
from collections.abc import Callable
from msgspec.structs import replace
from pathlib import Path
from typing import Any

import pytest

from ddpwatch.export import exporters
from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.codec import Envelope, encode
from instrumented_ddp.wire.messages import Ack, DeviceSample, Evaluation, Goodbye, Hello, Span, StepReport

SETTINGS: dict[str, dict[str, Any]] = {"simple": {"grad_accum": 1}, "bucket": {"grad_accum": 1, "bucket_mb": 25.0}}
HOSTS = {0: "host-a", 1: "host-b"}
CLOCK = {0: 1000.0, 1: 1100.0}  # rank 1's clock is 100 s ahead
US = 1e-6


def ms(x: float) -> float:
    return x / 1000.0


def step_spans(strategy: str, t0: float, early: float, straggle_ms: float = 0.0) -> list[Span]:
    """``straggle_ms``: the first all-reduce starts that much earlier (it waits for the other rank)."""
    if strategy == "simple":
        comm = [Span("all_reduce", t0 + ms(50 - straggle_ms), t0 + ms(60), True, 1_000_000, "p0", "float32"),
                Span("all_reduce", t0 + ms(70), t0 + ms(80), True, 1_000_000, "p1", "float32")]
    else:
        comm = [Span("all_reduce", t0 + ms(50), t0 + ms(65), False, 4_000_000, "b0", "float32"),
                Span("all_reduce", t0 + ms(60), t0 + ms(85), False, 4_000_000, "b1", "float32"),
                Span("wait", t0 + ms(80), t0 + ms(85), True)]
    return [Span("forward", t0 - early, t0 + ms(30)), Span("backward", t0 + ms(30), t0 + ms(80)),
            *comm, Span("optimizer", t0 + ms(85), t0 + ms(95))]


def make_session(desync: bool = False, keep_steps: int | None = None, straggle_ms: float = 0.0,
                 unresolved: bool = False, alone: bool = False, sharded: bool = False, steps: int = 6) -> Session:
    """``straggle_ms``: rank 1 waits that long for rank 0 in each "simple" step; ``unresolved``: rank 1's
    step 4 is sent with one all-reduce that never completed; ``alone``: each rank's hello says its
    all-reduces meet no other rank (each on a one-rank group); ``sharded``: each "bucket" step also
    reduce-scatters 8 MB in 4 ms and all-gathers it in 2 ms; ``steps``: how many are sent (with 4, the
    "bucket" segment holds only its excluded first step)."""
    session = Session(keep_steps)
    seq: dict[int, int] = defaultdict(int)

    def send(rank: int, message, skip: int = 0, dropped: int = 0) -> None:
        seq[rank] += skip
        session.ingest(Envelope(message, rank, seq[rank], dropped), received_at=0.0)
        seq[rank] += 1

    for rank in (0, 1):
        send(rank, Hello(rank=rank, world_size=2, session="sess-1", host=HOSTS[rank], pid=4000 + rank,
                         device="cpu", backend="gloo", strategy="simple", settings=SETTINGS["simple"],
                         model_parameters=10, global_batch=8, node_rank=rank, all_reduce_group=[rank] if alone else []))
    for step in range(steps):
        strategy = "simple" if step < 3 else "bucket"
        for rank in (0, 1):
            early = ms(5) if rank == 1 else 0.0
            t0 = CLOCK[rank] + 0.2 * step
            spans = step_spans(strategy, t0, early, straggle_ms if rank == 1 else 0.0)
            if sharded and strategy == "bucket":
                spans += [Span("reduce_scatter", t0 + ms(40), t0 + ms(44), False, 8_000_000, "b0", "float32"),
                          Span("all_gather", t0 + ms(86), t0 + ms(88), True, 8_000_000, "b0", "float32")]
            if desync and rank == 1 and step == 1:
                spans = [s for s in spans if s.tag != "p1"]
            gone = unresolved and rank == 1 and step == 4
            if gone:
                spans = [s for s in spans if s.tag != "b1"]
            report = StepReport(rank=rank, step=step, strategy=strategy, settings=SETTINGS[strategy],
                                start=t0 - early, end=t0 + ms(100), spans=spans, samples=4, tokens=512,
                                loss=1.0, excluded=step == 3, unresolved=gone,
                                unresolved_reason="1 timing mark had not completed 8 steps later" if gone else "")
            send(rank, report, skip=2 if (rank == 1 and step == 2) else 0, dropped=3 if rank == 0 else 0)
    send(0, DeviceSample(rank=0, time=CLOCK[0] + 0.05, kind="cpu", readings={"cpu_pct": 50.0, "rss_mb": 300.0}))
    session.reject("garbage")
    return session


@pytest.fixture(scope="module")
def session() -> Session:
    return make_session()


@pytest.fixture(scope="module")
def data(session: Session) -> dict:
    return exporters.summary(session)


# --- summary.json ------------------------------------------------------------------------------


def test_summary_is_strict_json_and_round_trips(data: dict) -> None:
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert data["session"] == "sess-1" and data["world_size"] == 2
    assert [r["host"] for r in data["ranks"]] == ["host-a", "host-b"]
    assert data["ranks"][1] == {"rank": 1, "host": "host-b", "device": "cpu", "backend": "gloo",
                                "node_rank": 1, "pid": 4001, "device_note": "", "unresolved_steps": 0, "unresolved_reason": "",
                                "last_step": 5, "goodbye": None}
    assert data["desync"] is None


def test_summary_segments_and_figures(data: dict) -> None:
    simple, bucket = data["segments"]
    for key in ("index", "strategy", "settings", "world_size", "first_step", "last_step", "excluded_steps",
                "compute_pct", "non_compute_pct", "idle_pct", "overlap_pct", "comm_overhead_pct",
                "all_reduce_calls", "all_reduce_ms", "step_ms_p50", "step_ms_p95", "samples_per_s", "per_rank"):
        assert key in simple and key in bucket, key
    assert (simple["strategy"], simple["first_step"], simple["last_step"]) == ("simple", 0, 2)
    assert (bucket["strategy"], bucket["first_step"], bucket["last_step"]) == ("bucket", 3, 5)
    assert bucket["settings"] == {"grad_accum": 1, "bucket_mb": 25.0}
    assert simple["excluded_steps"] == [] and bucket["excluded_steps"] == [3]
    assert simple["all_reduce_calls_total"] == 12 and bucket["all_reduce_calls_total"] == 8  # step 3 left out
    rank0 = simple["per_rank"]["0"]
    assert rank0["compute_pct"] == pytest.approx(70.0)
    assert rank0["non_compute_pct"] == pytest.approx(20.0)
    assert rank0["all_reduce_ms"] == pytest.approx(20.0)
    assert bucket["per_rank"]["0"]["overlap_pct"] == pytest.approx(100 * 30 / 35)  # 50-80 of 50-85
    assert bucket["per_rank"]["0"]["hidden_comm_pct"] == pytest.approx(30.0)  # 50-80 of the 100 ms window
    assert simple["compute_pct"] == pytest.approx((70.0 + 100 * 75 / 105) / 2)


def test_summary_svg_draws_each_segment_as_its_window_as_long_as_its_time_per_sample(data: dict) -> None:
    import xml.etree.ElementTree as ElementTree

    root = ElementTree.fromstring(exporters.summary_svg(data))
    ns = {"svg": "http://www.w3.org/2000/svg"}
    simple, bucket = data["segments"]
    labels = [t.text for t in root.findall("svg:text", ns)]
    assert "simple (grad_accum=1) (0-2)" in labels and "bucket (bucket_mb=25.0, grad_accum=1) (3-5)" in labels
    hidden = [r for r in root.findall("svg:rect", ns) if r.get("class") == "hidden"]
    assert len(hidden) == 1  # simple hides nothing: no rect drawn for it
    # each bar as long as its time per sample against the slowest segment's
    length = min(simple["samples_per_s"], bucket["samples_per_s"]) / bucket["samples_per_s"]
    assert float(hidden[0].attrib["width"]) == pytest.approx(480 * length * bucket["hidden_comm_pct"] / 100, abs=0.01)


def test_summary_telemetry(data: dict) -> None:
    tele = data["telemetry"]
    assert tele["rejected"] == {"garbage": 1}
    assert tele["late_reports"] == {"0": 0, "1": 0} and tele["late_unused"] == {"0": 0, "1": 0}
    assert tele["lost_messages"] == {"0": 0, "1": 2}
    assert tele["sender_dropped"] == {"0": 3, "1": 0}


def test_samples_per_s_is_over_the_wall_time_from_first_step_start_to_last_step_end(data: dict) -> None:
    # simple, steps 0-2: rank 0 from 1000.000 to 1000.500 s; rank 1 (aligned: -100 s) from 999.995
    # -> 0.505 s for 2 ranks x 3 steps x 4 samples = 24 (the sum of step windows, 3 x 0.105 s, gave 76.2/s)
    simple, bucket = data["segments"]
    assert simple["wall_s"] == pytest.approx(0.505)
    assert simple["samples_per_s"] == pytest.approx(24 / 0.505)
    assert simple["tokens_per_s"] == pytest.approx(3072 / 0.505)
    # bucket: step 3 excluded; steps 4-5 from 1000.795 to 1001.100 -> 16 samples over 0.305 s
    assert bucket["samples_per_s"] == pytest.approx(16 / 0.305)
    assert simple["per_rank"]["1"]["samples_per_s"] == pytest.approx(12 / 0.505)


def test_all_reduce_calls_mean_per_rank_per_step_and_the_total_is_an_integer(data: dict) -> None:
    simple, bucket = data["segments"]
    assert simple["all_reduce_calls"] == 2.0 and bucket["all_reduce_calls"] == 2.0
    assert simple["all_reduce_calls_total"] == 12 and isinstance(simple["all_reduce_calls_total"], int)


def test_a_desync_stays_in_the_exports_after_its_step_was_forgotten() -> None:
    session = make_session(desync=True, keep_steps=2)
    assert 1 not in session.reports  # the dashboard keeps only its last steps
    data = exporters.summary(session)
    counts = {"step": 1, "calls_per_rank": {"0": 2, "1": 1}, "kind": "all_reduce"}
    expected = {"first_step": 1, "last_step": 1, "steps": 1, "first": counts, "last": counts}
    assert data["desync"] == expected and data["segments"][0]["desync"] == expected
    assert "DESYNC at step 1" in exporters.summary_markdown(data)


def test_straggler_rank_follows_the_dashboards_rule() -> None:
    # rank 1 waits 0.5 ms of each 105 ms step for rank 0: under 10 % -> nobody (it used to name rank 0)
    noise = exporters.summary(make_session(straggle_ms=0.5))["segments"][0]
    assert noise["straggler_rank"] is None and noise["straggler"] is None
    # 15 ms of each 105 ms step (14 %) over steps 0-2 -> rank 0, in summary.json and summary.md
    data = exporters.summary(make_session(straggle_ms=15.0))
    slow = data["segments"][0]
    assert slow["straggler_rank"] == 0
    assert slow["straggler"] == {"rank": 0, "first_step": 0, "last_step": 2, "steps": 3,
                                 "waited_ms_per_step": pytest.approx(15.0), "share_pct": pytest.approx(100 * 15 / 105)}
    assert ("- segment 0: rank 0 is a straggler: over steps 0-2 the others waited 15.0 ms a step for it "
            "(14% of step time)") in exporters.summary_markdown(data)


def test_unresolved_steps_are_counted_per_rank_listed_per_segment_and_left_out() -> None:
    data = exporters.summary(make_session(unresolved=True))
    bucket = data["segments"][1]
    assert data["ranks"][1]["unresolved_steps"] == 1 and data["ranks"][0]["unresolved_steps"] == 0
    assert bucket["unresolved_steps"] == [4] and bucket["excluded_steps"] == [3]
    assert bucket["desync"] is None  # rank 1's step 4 lacks b1 because it never completed, not a desync
    assert bucket["all_reduce_calls_total"] == 6  # 2 + 2 at step 5, 2 at step 4 (rank 0 only)
    assert bucket["per_rank"]["1"]["steps"] == 1
    assert "- segment 1: steps sent unresolved 4" in exporters.summary_markdown(data)
    assert data["ranks"][1]["unresolved_reason"] == "1 timing mark had not completed 8 steps later"
    assert ("- rank 1: why its steps were sent unresolved (the last to say): 1 timing mark had not completed 8 steps later"
            in exporters.summary_markdown(data))


def test_steps_whose_update_was_skipped_are_listed_per_segment() -> None:
    session = make_session()
    for rank in (0, 1):  # the ranks skip together: their gradients were all-reduced before the scaler looked
        report = session.reports[4][rank]
        session.reports[4][rank] = replace(report, update_skipped=True)
    data = exporters.summary(session)
    assert [seg["update_skipped_steps"] for seg in data["segments"]] == [[], [4]]
    assert ("- segment 1: steps without an optimizer update (gradients reduced, then cleared with no optimizer.step(): "
            "a loss scaler that found inf or NaN) 4") in exporters.summary_markdown(data)


def test_steps_in_which_torch_compile_compiled_are_listed_per_segment() -> None:
    session = make_session()
    for rank in (0, 1):
        session.reports[5][rank] = replace(session.reports[5][rank], compiling=True, excluded=True)
    data = exporters.summary(session)
    assert [seg["compiling_steps"] for seg in data["segments"]] == [[], [5]]
    assert "- segment 1: steps in which torch.compile compiled (excluded) 5" in exporters.summary_markdown(data)


def test_steps_with_collectives_not_timed_are_listed_per_segment_with_the_most_in_a_step() -> None:
    session = make_session()
    for step, untimed in ((4, 3), (5, 4)):
        for rank in (0, 1):
            session.reports[step][rank] = replace(session.reports[step][rank], untimed_collectives=untimed)
    data = exporters.summary(session)
    assert [seg["untimed_collective_steps"] for seg in data["segments"]] == [[], [4, 5]]
    assert [seg["untimed_collectives_most"] for seg in data["segments"]] == [0, 4]
    assert ("- segment 1: steps with collectives ddpwatch did not time (outside DDP's buckets and FSDP's gathers and "
            "reductions; up to 4 a step on a rank) 4-5") in exporters.summary_markdown(data)
    assert [seg["untimed_in_data_steps"] for seg in data["segments"]] == [[], []]
    assert "issued before a forward" not in exporters.summary_markdown(data)


def test_steps_with_untimed_collectives_in_the_data_time_are_listed_per_segment_with_the_most_in_a_step() -> None:
    session = make_session()
    for step, in_data in ((2, 0), (4, 1), (5, 2)):  # step 2: issued in a phase, compute
        for rank in (0, 1):
            session.reports[step][rank] = replace(session.reports[step][rank], untimed_collectives=3, untimed_in_data=in_data)
    data = exporters.summary(session)
    assert [seg["untimed_in_data_steps"] for seg in data["segments"]] == [[], [4, 5]]
    assert [seg["untimed_in_data_most"] for seg in data["segments"]] == [0, 2]
    assert ("- segment 1: steps with such collectives issued before a forward, in the data time (up to 2 a step on a "
            "rank: their time, a wait in them for a slower rank included, reads as data loading) 4-5"
            ) in exporters.summary_markdown(data)


def test_steps_whose_data_held_forwards_without_gradients_are_listed_per_segment_with_the_most_in_a_step() -> None:
    session = make_session()
    for step, forwards in ((4, 8), (5, 0)):
        for rank in (0, 1):
            session.reports[step][rank] = replace(session.reports[step][rank], nograd_forwards=forwards + rank)
    data = exporters.summary(session)
    assert [seg["nograd_forward_steps"] for seg in data["segments"]] == [[], [4, 5]]
    assert [seg["nograd_forwards_most"] for seg in data["segments"]] == [0, 9]
    assert ("- segment 1: steps whose data loading held forwards of the model without gradients (up to 9 a step on a "
            "rank: an evaluation the loop did not mark with watch.paused; their time reads as data loading) 4-5"
            ) in exporters.summary_markdown(data)


def test_steps_the_loop_paused_before_are_listed_per_segment_with_their_seconds_and_drawn_in_the_trace() -> None:
    """Pauses before steps 4 (rank 0: 2.0 s, rank 1: 2.5 s) and 5 (1.0 s both): 2.5 + 1.0 = 3.5 s
    in all, each step counted once at its longest rank; against the segment's 0.305 s of training
    (steps 3-5 of the synthetic run, its figures folded before the pauses were written in), 3.5 /
    (0.305 + 3.5) = 92.0 % of its time; the trace puts each before its step."""
    session = make_session()
    for step, seconds, what in ((4, 2.0, "evaluate"), (5, 1.0, "save")):
        for rank in (0, 1):
            session.reports[step][rank] = replace(session.reports[step][rank], paused_s=seconds + 0.5 * rank * (step == 4),
                                                  paused_for=what)
    data = exporters.summary(session)
    segment = data["segments"][1]
    assert (segment["paused_steps"], segment["paused_for"], segment["paused_s"]) == ([4, 5], ["evaluate", "save"], 3.5)
    assert data["segments"][0]["paused_steps"] == []
    assert segment["wall_s"] == pytest.approx(0.305) and segment["paused_pct"] == pytest.approx(100 * 3.5 / 3.805)
    assert ("- segment 1: steps the loop paused training before (evaluate, save; 3.50 s in all, 92.0 % of the segment's "
            "time, left out of step times and samples/s) 4-5") in exporters.summary_markdown(data)
    pauses = [e for e in exporters.chrome_trace(session)["traceEvents"] if e.get("name", "").startswith("paused")]
    step_of = {(e["pid"], e["args"]["step"]): e for e in exporters.chrome_trace(session)["traceEvents"]
               if e.get("cat") == "step"}
    assert sorted((e["pid"], e["args"]["step"], e["dur"]) for e in pauses) == [
        (1, 4, 2_000_000.0), (1, 5, 1_000_000.0), (2, 4, 2_500_000.0), (2, 5, 1_000_000.0)]
    assert all(e["ts"] + e["dur"] == pytest.approx(step_of[(e["pid"], e["args"]["step"])]["ts"]) for e in pauses)


def test_a_rank_whose_steps_stopped_before_the_others_is_named() -> None:
    """DDP's join() with uneven inputs: rank 1's last step is 4 where rank 0 went on to 10."""
    session = make_session()
    session.ranks[0].last_step, session.ranks[1].last_step = 10, 4
    data = exporters.summary(session)
    assert [r["last_step"] for r in data["ranks"]] == [10, 4]
    assert ("- rank 1 passed no step after 4 while the others reached 10: out of data under DDP's join() (uneven "
            "inputs), or out of the training loop") in exporters.summary_markdown(data)
    session.ranks[1].last_step = 6  # 4 behind: ranks of one job move together, but not this far apart
    assert "passed no step" not in exporters.summary_markdown(exporters.summary(session))


def test_ranks_the_record_holds_no_goodbye_of_are_said_with_where_they_were_last_heard() -> None:
    """``ddpwatch summary`` of a recording cut short (a demo quit, a job killed) printed its table
    and said nothing of the cut. A rank that said goodbye is not named; a summary written before
    ranks carried their goodbye names none (it cannot tell)."""
    session = make_session()  # neither rank said goodbye; both were last heard at step 5
    said = ("- no goodbye from 2 ranks (0-1; last heard at step 5): this record ends before the run did (written while it "
            "trained, or a dashboard or recorder stopped first), or a rank died without one (a job killed, a rank lost)")
    assert said in exporters.summary_markdown(exporters.summary(session)).splitlines()
    session.ranks[0].goodbye = Goodbye(0, 5)
    assert "- no goodbye from rank 1 (last heard at step 5): this record" in exporters.summary_markdown(exporters.summary(session))
    session.ranks[1].goodbye = Goodbye(1, 5)
    assert "no goodbye" not in exporters.summary_markdown(exporters.summary(session))
    older = exporters.summary(make_session())
    for rank in older["ranks"]:
        del rank["goodbye"]
    assert "no goodbye" not in exporters.summary_markdown(older)


def test_the_runs_evaluations_are_in_summary_json_and_a_table_of_summary_md() -> None:
    """What a Trainer's evaluations measured was in its log alone."""
    session = make_session()
    assert exporters.summary(session)["evaluations"] == [] and "Evaluations" not in exporters.summary_markdown(exporters.summary(session))
    for rank in (1, 0):
        session.ingest(Envelope(Evaluation(rank, 3, {"eval_loss": 0.5 + rank, "eval_accuracy": 0.75}), rank, 90, 0))
    session.ingest(Envelope(Evaluation(0, 5, {"eval_loss": float("nan")}), 0, 91, 0))
    data = exporters.summary(session)
    assert json.loads(json.dumps(data, allow_nan=False)) == data
    assert data["evaluations"] == [{"step": 3, "rank": 0, "metrics": {"eval_loss": 0.5, "eval_accuracy": 0.75}},
                                   {"step": 5, "rank": 0, "metrics": {"eval_loss": None}}]
    assert exporters.summary_markdown(data).endswith(
        "Evaluations, after the step each followed:\n\n| after step | eval_loss | eval_accuracy |\n|---|---|---|\n"
        "| 3 | 0.5 | 0.75 |\n| 5 | not finite | — |\n")


def test_refused_switches_are_listed_once_each_with_the_strategy_asked_where_it_would_have_landed_and_why() -> None:
    """An applied switch starts a segment; a refused one left no mark on the exports (it showed in
    the session file's acknowledgements alone). Every rank refuses a command that cannot apply, and
    rank 0 answers each resend alike: one line each. An Ack from before it carried the strategy
    says only that a switch was refused."""
    session = make_session()
    assert exporters.summary(session)["refused_switches"] == []
    unknown = "unknown strategy 'zero9'"
    for rank, seq in ((1, 90), (0, 90), (0, 91)):
        session.ingest(Envelope(Ack(rank, "c-1", False, 4, unknown, "zero9"), rank, seq, 0))
    session.ingest(Envelope(Ack(0, "c-2", True, 5, "", "bucket"), 0, 92, 0))
    session.ingest(Envelope(Ack(0, "c-3", False, 6, "expired: its asker stopped waiting"), 0, 93, 0))
    data = exporters.summary(session)
    assert data["refused_switches"] == [{"step": 4, "strategy": "zero9", "detail": unknown},
                                        {"step": 6, "strategy": "", "detail": "expired: its asker stopped waiting"}]
    lines = exporters.summary_markdown(data).splitlines()
    assert [line for line in lines if "refused at step" in line] == [
        "- switch to zero9 refused at step 4: unknown strategy 'zero9'",
        "- a switch refused at step 6: expired: its asker stopped waiting"]


def test_device_note_is_kept_per_rank() -> None:
    session = Session()
    note = "NVML unavailable: libnvidia-ml.so not found; sending CPU readings"
    session.ingest(Envelope(Hello(rank=0, world_size=1, session="s", host="h", pid=1, device="cuda:0", backend="nccl",
                                  strategy="simple", settings={}, model_parameters=1, device_note=note), 0, 0, 0))
    assert exporters.summary(session)["ranks"][0]["device_note"] == note


# --- summary.md / summary.csv ------------------------------------------------------------------


def test_markdown_table(data: dict) -> None:
    text = exporters.summary_markdown(data)
    lines = text.splitlines()
    assert lines[0].startswith("# ")
    header = ("| Segment | Steps | Compute% | Non_Compute% | Idle% | Data wait% | Overlap% | Comm_overhead% "
              "| all_reduce calls / rank / step | all_reduce_ms | step ms p50 | step ms p95 | samples/s | busbw GB/s "
              "| other busbw GB/s | other collectives / rank / step | held P/G/O MiB |")
    assert header in lines
    rows = [line for line in lines[lines.index(header) + 2:] if line.startswith("| ")]
    assert len(rows) == 2
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    assert cells[:3] == ["simple (grad_accum=1)", "0-2", "70.71"]
    assert cells[8] == "2"  # per rank per step, as in summary.json and on the dashboard (was 6.0: over 3 steps)
    assert [c.strip() for c in rows[1].strip("|").split("|")][8] == "2"
    assert cells[-2:] == ["—", "—"]  # no reduce-scatter, all-gather or broadcast; memory not measured
    assert "Comm_overhead%" in text.split(header)[1] and "excluded" in text
    assert "DESYNC" not in text
    assert lines[0].endswith(f"({data['world_size']} ranks)")
    one_rank = exporters.summary_markdown({**data, "world_size": 1}).splitlines()
    assert one_rank[0].endswith("(1 rank)")  # read "1 ranks"
    assert one_rank[2] == "*One rank: its collectives move nothing, so Overlap%, busbw and waits say nothing about communication (torchrun --nproc_per_node=2 or more).*"
    assert "One rank" not in text
    # bucket's b0 (15 ms) and b1 (25 ms) overlap for 5 ms: all_reduce_ms is their sum, 40, and says so
    assert [c.strip() for c in rows[1].strip("|").split("|")][9] == "40.00" and "all_reduce_ms is that sum" in text


def test_a_busbw_under_a_hundredth_of_a_gb_per_s_reads_to_two_significant_digits_not_as_zero(data: dict) -> None:
    """PowerSGD's all-reduces of its small P and Q vectors (an H200, 2026-11-29) read "0.00" in
    summary.md's busbw column, as if nothing had moved, where the dashboard and the other kinds'
    column already said two significant digits."""
    busbw_column = exporters.COLUMNS.index("busbw GB/s")
    small = {**data, "segments": [{**data["segments"][1], "busbw_gbps": 0.0031}]}
    row = next(line for line in exporters.summary_markdown(small).splitlines() if line.startswith("| bucket"))
    assert [c.strip() for c in row.strip("|").split("|")][busbw_column] == "0.0031"
    assert "0.0031" in exporters.summary_csv(small).splitlines()[1].split(",")  # raw in the CSV, as before


def test_the_exports_say_within_which_groups_the_all_reduces_meet_where_not_the_world(data: dict) -> None:
    """Where the hellos name groups (HSDP's replicas, a DDP on a subgroup), busbw and waits were
    figured within them: summary.json lists them and summary.md says so; a run over the world, neither."""
    assert data["all_reduce_groups"] is None and "groups of ranks" not in exporters.summary_markdown(data)
    alone = exporters.summary(make_session(straggle_ms=3.0, alone=True))
    assert alone["all_reduce_groups"] == [[0], [1]]
    assert ("All-reduces meet within 2 groups of ranks, as the ranks said (HSDP's replicas of one shard, a DDP on a "
            "subgroup): 0; 1.") in exporters.summary_markdown(alone)
    assert "shard group" not in exporters.summary_markdown(alone)  # no reduce-scatter or all-gather to count
    sharded = exporters.summary(make_session(alone=True, sharded=True))
    assert "over a shard group, one rank of each of these groups where they are one size (2 ranks" in exporters.summary_markdown(sharded)
    assert alone["segments"][0]["waited_for_others_ms"] == 0.0  # nobody to wait for in a group of one
    assert alone["segments"][0]["busbw_gbps"] == 0.0  # a one-rank all-reduce moves nothing over a bus


def test_the_exports_give_the_busbw_of_reduce_scatters_and_all_gathers_beside_the_all_reduces() -> None:
    """8 MB in 4 ms is 2 GB/s of algbw, in 2 ms 4 GB/s; over 2 ranks the bus factor of either kind
    is (2-1)/2: RS 1.00, AG 2.00. A segment without them shows a dash, as does the all-reduce
    column where a sharded strategy issued none (before, the only busbw shown: n/a)."""
    data = exporters.summary(make_session(sharded=True))
    simple, sharded = data["segments"]
    assert simple["other_busbw_gbps"] == {}
    assert sharded["other_busbw_gbps"] == pytest.approx({"reduce_scatter": 1.0, "all_gather": 2.0})
    rows = [line for line in exporters.summary_markdown(data).splitlines() if line.startswith("| ")][1:]
    column = exporters.COLUMNS.index("other busbw GB/s")
    assert [[c.strip() for c in row.strip("|").split("|")][column] for row in rows] == ["—", "AG 2.00 RS 1.00"]
    csv_rows = list(csv.DictReader(io.StringIO(exporters.summary_csv(data))))
    assert json.loads(csv_rows[1]["other busbw GB/s"]) == pytest.approx({"all_gather": 2.0, "reduce_scatter": 1.0})


def test_a_segment_without_a_counted_step_shows_no_figures_rather_than_zeros() -> None:
    """A "bucket" segment of one excluded step: summary.json says it counted no step, and the
    table's cells say n/a (blank in the CSV); before, they read 0.00 Compute%, 0.00 step ms, as measured."""
    data = exporters.summary(make_session(steps=4))
    simple, bucket = data["segments"]
    assert (simple["steps"], bucket["steps"], bucket["excluded_steps"]) == (3, 0, [3])
    rows = [line for line in exporters.summary_markdown(data).splitlines() if line.startswith("| ")][1:]
    cells = [c.strip() for c in rows[1].strip("|").split("|")]
    assert cells[:2] == ["bucket (bucket_mb=25.0, grad_accum=1)", "3-3"] and set(cells[2:]) == {"n/a"}
    assert [c.strip() for c in rows[0].strip("|").split("|")][2] == "70.71"
    csv_rows = list(csv.DictReader(io.StringIO(exporters.summary_csv(data))))
    assert {csv_rows[1][column] for column in exporters.COLUMNS[2:]} == {""}
    svg = exporters.summary_svg(data)  # the bar says so too, where it read "Overlap 0 %" beside no bar
    assert svg.count("no counted step") == 1 and svg.count(">Overlap ") == 1


def test_markdown_reports_desync() -> None:
    text = exporters.summary_markdown(exporters.summary(make_session(desync=True)))
    assert text.splitlines()[2] == ("**ERROR: DESYNC at step 1: the ranks issued different all-reduce counts "
                                    "(rank 0: 2, rank 1: 1)**")
    assert "- segment 0: DESYNC at step 1: the ranks issued different all-reduce counts (rank 0: 2, rank 1: 1)" in text


def test_csv_rows(data: dict) -> None:
    rows = list(csv.DictReader(io.StringIO(exporters.summary_csv(data))))
    assert len(rows) == 2
    assert [r["strategy"] for r in rows] == ["simple", "bucket"]
    assert json.loads(rows[1]["settings"]) == {"grad_accum": 1, "bucket_mb": 25.0}
    assert float(rows[0]["all_reduce calls / rank / step"]) == 2.0
    assert float(rows[0]["Compute%"]) == pytest.approx((70.0 + 100 * 75 / 105) / 2, abs=1e-4)


# --- trace.json --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trace(session: Session) -> dict:
    return json.loads(json.dumps(exporters.chrome_trace(session), allow_nan=False))


def test_trace_processes_and_events(trace: dict) -> None:
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e["ph"] == "M" and e["name"] == "process_name"}
    assert sorted(names.values()) == ["rank 0 (host-a)", "rank 1 (host-b)"]
    complete = [e for e in events if e["ph"] == "X"]
    assert len(complete) == 2 * (3 * 5 + 3 * 6) + 12  # spans + one step event per rank and step
    assert all(e["dur"] >= 0 and "ts" in e and "step" in e["args"] for e in complete)
    threads = {(e["pid"], e["tid"]) for e in events if e["ph"] == "M" and e["name"] == "thread_name"}
    assert {(e["pid"], e["tid"]) for e in complete} <= threads
    comm = [e for e in complete if e["name"] == "all_reduce"]
    assert comm[0]["args"]["bytes"] in (1_000_000, 4_000_000) and comm[0]["args"]["dtype"] == "float32"
    assert any(e["ph"] == "C" for e in events)


def test_trace_aligns_ranks_on_last_all_reduce(trace: dict) -> None:
    pid = {e["args"]["name"][:6]: e["pid"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    last: dict[tuple[int, int], float] = {}
    starts: dict[tuple[int, int], float] = {}
    for e in trace["traceEvents"]:
        if e["ph"] == "X" and e["name"] == "all_reduce":
            key = (e["pid"], e["args"]["step"])
            last[key] = max(last.get(key, float("-inf")), e["ts"] + e["dur"])
        if e["ph"] == "X" and e["name"].startswith("step "):
            starts[(e["pid"], e["args"]["step"])] = e["ts"]
    for step in range(6):
        assert last[(pid["rank 1"], step)] == pytest.approx(last[(pid["rank 0"], step)], abs=1.0)  # 1 µs
        assert starts[(pid["rank 0"], step)] - starts[(pid["rank 1"], step)] == pytest.approx(5000, abs=1.0)
    assert min(e["ts"] for e in trace["traceEvents"] if e["ph"] == "X") == pytest.approx(0.0)


def test_trace_lanes_never_overlap(trace: dict) -> None:
    lanes: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            lanes[(e["pid"], e["tid"])].append((e["ts"], e["ts"] + e["dur"]))
    for spans in lanes.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-6 for a, b in itertools.pairwise(spans))
    bucket_ars = [e for e in trace["traceEvents"]
                  if e["ph"] == "X" and e["name"] == "all_reduce" and e["args"]["step"] == 4 and e["pid"] == 1]
    assert len(bucket_ars) == 2 and bucket_ars[0]["tid"] != bucket_ars[1]["tid"]


def test_clock_offsets_fall_back_to_step_starts() -> None:
    session = Session()
    for rank in (0, 1):
        t0 = CLOCK[rank]
        session.ingest(Envelope(StepReport(rank=rank, step=0, strategy="none", settings={}, start=t0,
                                           end=t0 + 0.1, spans=[Span("forward", t0, t0 + 0.05)], samples=1,
                                           tokens=1), rank, 0, 0), received_at=0.0)
    assert exporters.clock_offsets(session) == {0: 0.0, 1: pytest.approx(-100.0)}


# --- writing -----------------------------------------------------------------------------------


def test_write_exports(session: Session, tmp_path: Path) -> None:
    out = tmp_path / "run"
    paths = exporters.write_exports(session, out)
    assert sorted(paths) == ["collectives.parquet", "steps.parquet", "summary.csv", "summary.json", "summary.md",
                             "summary.svg", "trace.json"]
    assert sorted(p.name for p in out.iterdir()) == sorted(paths)  # no temp files left behind
    assert json.loads(paths["summary.json"].read_text()) == exporters.summary(session)
    assert "traceEvents" in json.loads(paths["trace.json"].read_text())
    assert paths["summary.md"].read_text() == exporters.summary_markdown(exporters.summary(session))
    assert "](summary.svg)" in paths["summary.md"].read_text()
    assert paths["summary.svg"].read_text() == exporters.summary_svg(exporters.summary(session))
    exporters.write_exports(session, out)  # overwriting works and still leaves no temp files
    assert len(list(out.iterdir())) == 7


def test_an_export_that_cannot_be_made_is_said_and_the_others_are_written(
        session: Session, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every text was made before any was written: one that raised lost them all."""
    def chrome_trace(_session: Session) -> dict[str, Any]:
        return {"traceEvents": [{"ts": float("inf")}]}  # JSON holds no infinity

    monkeypatch.setattr(exporters, "chrome_trace", chrome_trace)
    said: list[str] = []
    paths = exporters.write_exports(session, tmp_path, on_error=said.append)
    assert sorted(paths) == ["collectives.parquet", "steps.parquet", "summary.csv", "summary.json", "summary.md", "summary.svg"]
    assert said == ["trace.json could not be made: ValueError: Out of range float values are not JSON compliant"]


# --- the headless recorder ---------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_session_file_of_two_runs_one_after_the_other_loads_as_the_last_run(tmp_path: Path) -> None:
    """A script run twice into one open dashboard: its file holds both. Read back (``ddpwatch
    summary`` without a summary.json), the second run's reports went into the first run's session,
    rejected as repeated steps; now the second run, begun once the first was over, is the session."""
    from ddpwatch.record.recorder import load_session
    from ddpwatch.ingest.session_file import SESSION_FILE_NAME, SessionWriter
    from synthetic_session import hello, session_messages

    second = {rank: replace(hello(rank), session="second-session") for rank in (0, 1)}
    writer = SessionWriter(tmp_path / SESSION_FILE_NAME)
    for index, data in enumerate(session_messages(steps=10) + session_messages(steps=4, hellos=second)):
        writer.append(data, 1_800_000_000.0 + index * 0.01)
    writer.close()
    session = load_session(tmp_path / SESSION_FILE_NAME)
    assert session.session_id == "second-session" and not session.rejected and not session.other_runs
    assert sorted(session.reports) == [1, 2, 3, 4] and session.finished


def test_ddpwatch_summary_prints_every_run_of_a_session_oldest_first(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A dashboard left open over two runs: its file holds both, and it wrote the first one's exports
    in a folder named after it beside the second's. ``ddpwatch summary`` printed the last run alone."""
    from ddpwatch import cli
    from ddpwatch.record.recorder import load_runs
    from ddpwatch.ingest.session_file import SESSION_FILE_NAME, SessionWriter
    from synthetic_session import hello, session_messages

    second = {rank: replace(hello(rank), session="second-session") for rank in (0, 1)}
    writer = SessionWriter(tmp_path / SESSION_FILE_NAME)
    for index, data in enumerate(session_messages(steps=10) + session_messages(steps=4, hellos=second)):
        writer.append(data, 1_800_000_000.0 + index * 0.01)
    writer.close()
    first, last = load_runs(tmp_path / SESSION_FILE_NAME)
    assert (sorted(first.reports), sorted(last.reports)) == (list(range(1, 11)), [1, 2, 3, 4])

    def printed(path: Path) -> list[str]:
        assert cli.main(["summary", str(path)]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("# ddpwatch session")]

    both = [f"# ddpwatch session {first.session_id} (2 ranks)", "# ddpwatch session second-session (2 ranks)"]
    assert printed(tmp_path / SESSION_FILE_NAME) == both
    exporters.write_exports(first, tmp_path / first.session_id)  # as the dashboard leaves them
    exporters.write_exports(last, tmp_path)
    assert printed(tmp_path) == both


def _send_later(address: str, messages: list[bytes]) -> threading.Thread:
    """A thread that sends ``messages`` to ``address`` from one socket once the recorder is bound."""
    import time

    import zmq

    def send() -> None:
        context = zmq.Context()
        sender = context.socket(zmq.DEALER)
        sender.setsockopt(zmq.LINGER, 1000)
        sender.connect(address)
        time.sleep(0.5)  # the recorder binds first
        for data in messages:
            sender.send(data)
        sender.close()
        context.term()

    thread = threading.Thread(target=send)
    thread.start()
    return thread


def test_the_recorder_says_a_desync_and_the_late_and_unresolved_counts_when_it_stops(tmp_path: Path) -> None:
    from ddpwatch.record.recorder import StopRule, record
    from launch import free_port
    from synthetic_session import session_messages

    def skip_a_call(report: StepReport) -> StepReport:
        if report.rank == 1 and report.step == 3:
            return replace(report, spans=[s for s in report.spans if s.tag != "p3"])
        return replace(report, unresolved=True) if report.rank == 0 and report.step == 8 else report

    address = f"tcp://127.0.0.1:{free_port()}"
    lines: list[str] = []
    thread = _send_later(address, session_messages(edit=skip_a_call))
    record(address, tmp_path, StopRule(idle_exit_s=10.0), log=lines.append)
    thread.join()
    assert "every rank said goodbye" in lines[-2] and "0 rejected, 0 late, 1 unresolved step(s)" in lines[-2]
    assert lines[-1] == ("ddpwatch record: ERROR: DESYNC at step 3: the ranks issued different all-reduce counts "
                         "(rank 0: 4, rank 1: 3)")
    assert json.loads((tmp_path / "summary.json").read_text())["desync"]["first_step"] == 3


@pytest.mark.timeout(60)
def test_the_recorder_told_to_record_two_runs_writes_each_and_goes_on_past_the_first_goodbyes(tmp_path: Path) -> None:
    """A process that trains twice (a Trainer's second ``train()``): the recorder stopped at the
    first run's goodbyes and the second went unrecorded. With ``runs=2`` the first run's exports
    go in a folder named after it and the second's beside it, as the dashboard leaves them; told
    two and sent one, it stops once the ranks are silent, that run's exports in place."""
    from ddpwatch import cli
    from ddpwatch.record.recorder import StopRule, record
    from launch import free_port
    from synthetic_session import hello, session_messages

    second = {rank: replace(hello(rank), session="second-session") for rank in (0, 1)}
    address = f"tcp://127.0.0.1:{free_port()}"
    thread = _send_later(address, session_messages(steps=10) + session_messages(steps=4, hellos=second))
    lines: list[str] = []
    last = record(address, tmp_path / "two", StopRule(idle_exit_s=10.0), log=lines.append, runs=2)
    thread.join()
    assert last.session_id == "second-session" and sorted(last.reports) == [1, 2, 3, 4] and not last.rejected
    assert lines[1] == (f"ddpwatch record: run fixed-session is over; its exports are in {tmp_path / 'two' / 'fixed-session'} "
                        "(summary.json, summary.md, summary.svg, summary.csv, trace.json, steps.parquet, collectives.parquet); now recording run second-session")
    assert "every rank said goodbye" in lines[-1]
    first = json.loads((tmp_path / "two" / "fixed-session" / "summary.json").read_text())
    assert (first["session"], first["segments"][-1]["last_step"]) == ("fixed-session", 10)
    assert json.loads((tmp_path / "two" / "summary.json").read_text())["session"] == "second-session"
    assert cli.main(["summary", str(tmp_path / "two")]) == 0

    address = f"tcp://127.0.0.1:{free_port()}"
    thread = _send_later(address, session_messages(steps=3))
    lines = []
    only = record(address, tmp_path / "one", StopRule(idle_exit_s=1.0), log=lines.append, runs=2)
    thread.join()
    assert only.session_id == "fixed-session" and "no message for 1 s" in lines[-1]
    assert json.loads((tmp_path / "one" / "summary.json").read_text())["session"] == "fixed-session"


@pytest.mark.timeout(60)
def test_the_recorder_follows_a_run_whose_goodbyes_say_it_trains_again_without_counting_it(tmp_path: Path) -> None:
    """A Trainer under ``auto_find_batch_size`` ran out of memory and began again at a smaller
    batch: ``record`` (one run) stopped at the failed attempt's goodbyes, and the training that
    came of it went unrecorded unless the user had guessed ``--runs 2``."""
    from ddpwatch.record.recorder import StopRule, record
    from launch import free_port
    from synthetic_session import hello, session_messages

    oom = "failed: out of memory: the Trainer began again at a batch of 7 (auto_find_batch_size)"
    second = {rank: replace(hello(rank), session="second-session") for rank in (0, 1)}
    messages = [*session_messages(steps=3, goodbye=False), *(encode(Goodbye(rank, 3, oom, trains_again=True), 90, 0) for rank in (0, 1)),
                *session_messages(steps=4, hellos=second)]
    address = f"tcp://127.0.0.1:{free_port()}"
    thread = _send_later(address, messages)
    lines: list[str] = []
    last = record(address, tmp_path, StopRule(idle_exit_s=10.0), log=lines.append)
    thread.join()
    assert last.session_id == "second-session" and sorted(last.reports) == [1, 2, 3, 4] and "every rank said goodbye" in lines[-1]
    assert lines[1].startswith(f"ddpwatch record: run fixed-session is over, and trains again ({oom}); its exports are in "
                               f"{tmp_path / 'fixed-session'}")
    first = json.loads((tmp_path / "fixed-session" / "summary.json").read_text())
    assert [rank["goodbye"]["reason"] for rank in first["ranks"]] == [oom, oom]


def test_trace_puts_every_collective_kind_in_the_communication_lane() -> None:
    """ZeRO and FSDP's all-gathers and reduce-scatters are communication, not data loading."""
    session = Session()
    session.ingest(Envelope(Hello(rank=0, world_size=1, session="s", host="h", pid=1, device="cpu", backend="gloo",
                                  strategy="fsdp", settings={}, model_parameters=10), 0, 0, 0), received_at=0.0)
    spans = [Span("all_gather", 0.00, 0.01, True, 4096, "u0", "float32"), Span("forward", 0.01, 0.02),
             Span("reduce_scatter", 0.03, 0.04, True, 4096, "u0", "float32"), Span("data", 0.05, 0.06)]
    session.ingest(Envelope(StepReport(0, 1, "fsdp", {}, 0.0, 0.07, spans, 1, 1), 0, 1, 0), received_at=0.0)
    lanes = {e["name"]: e["tid"] // 100 for e in exporters.chrome_trace(session)["traceEvents"] if e["ph"] == "X"}
    assert lanes["all_gather"] == lanes["reduce_scatter"] == 2 and lanes["data"] == 4


def test_trace_puts_the_loops_marked_compute_in_the_compute_lane_named_as_the_loop_said() -> None:
    """``Attachment.computing("ema")``'s span: compute (lane 1), named *loop: ema*."""
    session = Session()
    session.ingest(Envelope(Hello(rank=0, world_size=1, session="s", host="h", pid=1, device="cpu", backend="gloo",
                                  strategy="ddp", settings={}, model_parameters=10), 0, 0, 0), received_at=0.0)
    spans = [Span("loop", 0.00, 0.01, tag="ema"), Span("data", 0.01, 0.02), Span("forward", 0.02, 0.03)]
    session.ingest(Envelope(StepReport(0, 1, "ddp", {}, 0.0, 0.03, spans, 1, 1), 0, 1, 0), received_at=0.0)
    lanes = {e["name"]: e["tid"] // 100 for e in exporters.chrome_trace(session)["traceEvents"] if e["ph"] == "X"}
    assert lanes["loop: ema"] == lanes["forward"] == 1 and lanes["data"] == 4


def test_trace_names_a_barriers_wait_in_the_wait_lane_and_leaves_other_waits_unnamed() -> None:
    """A barrier the loop issued is a blocking wait tagged ``barrier``: *wait: barrier* in the wait
    lane (3), where DDP's wait for its last bucket stays *wait*."""
    session = Session()
    session.ingest(Envelope(Hello(rank=0, world_size=1, session="s", host="h", pid=1, device="cpu", backend="gloo",
                                  strategy="ddp", settings={}, model_parameters=10), 0, 0, 0), received_at=0.0)
    spans = [Span("data", 0.00, 0.02), Span("wait", 0.005, 0.015, True, tag="barrier"), Span("forward", 0.02, 0.03),
             Span("wait", 0.03, 0.035, True)]
    session.ingest(Envelope(StepReport(0, 1, "ddp", {}, 0.0, 0.04, spans, 1, 1), 0, 1, 0), received_at=0.0)
    lanes = {e["name"]: e["tid"] // 100 for e in exporters.chrome_trace(session)["traceEvents"] if e["ph"] == "X"}
    assert lanes["wait: barrier"] == lanes["wait"] == 3


def two_attached_ranks(spans_of: Callable[[int, int, float], list[Span]]) -> Session:
    """Two ranks of an attached DDP loop, two 100 ms steps each, each step's spans
    ``spans_of(rank, step, its start)`` on the rank's own clock."""
    session = Session()
    for rank in (0, 1):
        session.ingest(Envelope(Hello(rank=rank, world_size=2, session="sess-1", host=HOSTS[rank], pid=1, device="cpu",
                                      backend="gloo", strategy="ddp", settings={"grad_accum": 1}, model_parameters=10),
                                rank, 0, 0), received_at=0.0)
    for step in (1, 2):
        for rank in (0, 1):
            t0 = CLOCK[rank] + 0.2 * step
            session.ingest(Envelope(StepReport(rank=rank, step=step, strategy="ddp", settings={"grad_accum": 1}, start=t0,
                                               end=t0 + ms(100), spans=spans_of(rank, step, t0), samples=4, tokens=0),
                                    rank, step, 0), received_at=0.0)
    return session


def test_the_loops_marked_compute_is_given_per_segment_with_what_it_was() -> None:
    """Two steps of 100 ms on two ranks of a loop that averages its weights after each update
    (``watch.computing("ema")``, 10 ms) and, on rank 1's second step, also runs a teacher in two
    4 ms blocks (``teacher forward``). A block past the step's end counts only inside it: rank 0's
    second average runs 5 ms past its end and counts 5. So 10, 5, 10 and 18 ms: a mean of 10.75 ms
    a step; rank 0's 7.5, rank 1's 14.0. The names each once, in the order first heard."""
    def spans_of(rank: int, step: int, t0: float) -> list[Span]:
        spans = [Span("loop", t0, t0 + ms(10), tag="ema"), Span("data", t0 + ms(10), t0 + ms(20)),
                 Span("forward", t0 + ms(20), t0 + ms(40)), Span("backward", t0 + ms(40), t0 + ms(90)),
                 Span("all_reduce", t0 + ms(80), t0 + ms(95), False, 4_000_000, "b0", "float32")]
        if (rank, step) == (1, 2):
            spans += [Span("loop", t0 + ms(12), t0 + ms(16), tag="teacher forward"),
                      Span("loop", t0 + ms(16), t0 + ms(20), tag="teacher forward")]
        if (rank, step) == (0, 2):
            spans[0] = Span("loop", t0 + ms(95), t0 + ms(105), tag="ema")
        return spans

    data = exporters.summary(two_attached_ranks(spans_of))
    (segment,) = data["segments"]
    assert segment["loop_compute_ms"] == pytest.approx((10 + 10 + 5 + 18) / 4)
    assert [segment["per_rank"][rank]["loop_compute_ms"] for rank in sorted(segment["per_rank"])] == pytest.approx([7.5, 14.0])
    assert segment["loop_computed"] == ["ema", "teacher forward"]
    assert ("- segment 0: the loop's own compute, marked with watch.computing (ema, teacher forward): 10.8 ms a step "
            "(mean of ranks) of a 100 ms step (p50), in Compute%, not data loading") in exporters.summary_markdown(data)


def test_the_loops_own_timed_collectives_are_given_per_segment_with_the_rank_that_spent_longest_in_them() -> None:
    """Two steps of an attached loop that all-gathers a count before each forward (``l0``): rank 0
    waits 40 ms in it for rank 1, whose own gather takes 1 ms; DDP's bucket (``b0``) is not the
    loop's. Worked by hand: 1 a step on a rank; (40 + 1) / 2 = 20.5 ms a step, the mean of ranks;
    rank 0's 40 the longest."""
    def spans_of(rank: int, _step: int, t0: float) -> list[Span]:
        gather = (t0, t0 + ms(40)) if rank == 0 else (t0 + ms(39), t0 + ms(40))
        return [Span("data", t0, t0 + ms(40), False), Span("all_gather", *gather, True, 16, "l0", "float32"),
                Span("forward", t0 + ms(40), t0 + ms(60), False), Span("backward", t0 + ms(60), t0 + ms(90), False),
                Span("all_reduce", t0 + ms(80), t0 + ms(95), False, 4_000_000, "b0", "float32")]

    data = exporters.summary(two_attached_ranks(spans_of))
    (segment,) = data["segments"]
    assert segment["loop_collectives"] == pytest.approx(1.0) and segment["loop_collective_ms"] == pytest.approx(20.5)
    assert [segment["per_rank"][rank]["loop_collective_ms"] for rank in sorted(segment["per_rank"])] == pytest.approx([40.0, 1.0])
    assert segment["all_reduce_calls"] == pytest.approx(1.0)  # DDP's bucket alone
    assert ("- segment 0: the loop's own collectives, timed where it issued them (the Trainer's all-gathers, a loss "
            "all-reduce, a metric gathered to rank 0, a mixture of experts' all-to-alls in its forward): 1 a step on a rank, 20.5 ms a step (mean of ranks, 40.0 ms on rank 0), a wait in them for a "
            "slower rank included") in exporters.summary_markdown(data)
