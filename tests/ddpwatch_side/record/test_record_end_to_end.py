"""Training on two ranks, recorded by ``ddpwatch record``: every strategy trains with identical
replicas, exact collective counts, true overlap, exports.

Each distinct run is made once per module (``recordings``) and every test that needs it reads it:
a run is ~11 s on two cores, and a run is worth several assertions. The ranks are started with the
environment torchrun gives them (``launch.run_ranks``), not by torchrun itself, whose launcher
added ~1.3 s to each of these runs on two cores; train.py under torchrun is what the switching,
fault, key and two-node tests run."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

import instrumented_ddp
from ddpwatch.record.recorder import load_session
from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.kinds import COMM_KINDS
from launch import QUICK_EVAL, REPO_ROOT, Recorder, describe_failure, run_ranks

TRAIN = REPO_ROOT / "train.py"
PARAMETER_TENSORS = 57  # the tiny SmolLM2: embeddings, 6 layers x 9, final norm, score


class Recording(NamedTuple):
    session: Session
    summary: dict
    stdout: str  # rank 0's, the rank train.py prints on
    directory: Path  # the recorder's: session file and exports
    final: Path  # train.py --save-final


Record = Callable[..., Recording]


@pytest.fixture(scope="module")
def recordings(tmp_path_factory: pytest.TempPathFactory) -> Record:
    """``record(*train_args)``: a 4-step, 2-rank run of train.py watched by ``ddpwatch record``,
    made the first time those arguments are asked for."""
    made: dict[tuple[str, ...], Recording] = {}

    def record(*train_args: str) -> Recording:
        if train_args not in made:
            made[train_args] = record_training(tmp_path_factory.mktemp("run"), *train_args)
        return made[train_args]

    return record


def record_training(tmp_path: Path, *train_args: str, steps: int = 4) -> Recording:
    final = tmp_path / "final.pt"
    with Recorder(tmp_path / "session", "--idle-exit", "20") as recorder:
        ranks = run_ranks(TRAIN, [*QUICK_EVAL, "--steps", str(steps), "--batch-size", "8", "--log-every", "2",
                                  "--watch", recorder.address, "--save-final", str(final), *train_args])
        assert all(rank.returncode == 0 for rank in ranks), describe_failure(ranks)
        log = recorder.wait()
    assert "every rank said goodbye" in log, log
    summary = json.loads((tmp_path / "session" / "summary.json").read_text())
    return Recording(load_session(tmp_path / "session" / "session.ddpwatch"), summary, ranks[0].stdout, tmp_path / "session", final)


#: The run each strategy is proven on below (the same arguments: the same run).
STRATEGY_RUNS = {
    # simple with 2 micro-steps: one run shows both its replicas and that it reduces after each micro-step
    "simple": ("--strategy", "simple", "--grad-accum", "2"), "ga": ("--strategy", "ga", "--grad-accum", "2"),
    "hook": ("--strategy", "hook", "--grad-accum", "1"), "async": ("--strategy", "async", "--grad-accum", "1"),
    "bucket": ("--strategy", "bucket", "--bucket-mb", "1"), "ddp": ("--strategy", "ddp", "--bucket-mb", "1"),
    "zero1": ("--strategy", "zero1", "--bucket-mb", "1"), "zero2": ("--strategy", "zero2", "--bucket-mb", "1"),
    "fsdp": ("--strategy", "fsdp",),
}


def test_every_strategy_has_a_recorded_run() -> None:
    assert sorted(STRATEGY_RUNS) == sorted(instrumented_ddp.STRATEGY_NAMES)


@pytest.mark.parametrize("strategy", list(STRATEGY_RUNS))
def test_every_strategy_trains_under_torchrun_with_identical_replicas(recordings: Record, strategy: str) -> None:
    run = recordings(*STRATEGY_RUNS[strategy])
    assert "parameters identical on all 2 rank(s)" in run.stdout
    assert "step 4/4" in run.stdout
    # the held-out evaluation after the last step, sent before the goodbye: the figures the log prints
    (evaluation,) = run.summary["evaluations"]
    accuracy = float(run.stdout.split("eval accuracy ")[1].split()[0])
    assert evaluation["step"] == 4 and list(evaluation["metrics"]) == ["eval_loss", "eval_accuracy"]
    assert round(evaluation["metrics"]["eval_accuracy"], 3) == accuracy and evaluation["metrics"]["eval_loss"] > 0
    assert torch.load(run.final)["score.weight"].shape == (5, 192)


def all_reduce_calls(session: Session) -> dict[int, Counter]:
    """step -> Counter(rank -> all_reduce spans)."""
    return {
        step: Counter({rank: sum(s.kind == "all_reduce" for s in report.spans) for rank, report in ranks.items()})
        for step, ranks in session.reports.items()
    }


@pytest.mark.parametrize(("strategy", "grad_accum", "per_step"), [
    ("hook", 1, PARAMETER_TENSORS), ("async", 1, PARAMETER_TENSORS),
    ("ga", 2, PARAMETER_TENSORS),  # one synchronising micro-step in two
    ("simple", 2, 2 * PARAMETER_TENSORS),  # the baseline reduces after every micro-step: a tensor's call each
])
def test_all_reduce_count_per_step_is_exact_on_both_ranks(recordings: Record, strategy: str, grad_accum: int, per_step: int) -> None:
    session, summary, *_ = recordings("--strategy", strategy, "--grad-accum", str(grad_accum))
    counts = all_reduce_calls(session)
    assert sorted(counts) == [1, 2, 3, 4]
    for step, per_rank in counts.items():
        assert per_rank == Counter({0: per_step, 1: per_step}), f"step {step}"
    (segment,) = summary["segments"]
    # Step 1 also carries wrap()'s state broadcast, so it is left out of the figures.
    assert segment["excluded_steps"] == [1]
    assert segment["all_reduce_calls"] == per_step  # per rank per step
    assert segment["all_reduce_calls_total"] == 2 * 3 * per_step
    assert segment["desyncs"] == []


def calls_by_kind(session: Session, step: int, rank: int) -> Counter:
    return Counter(s.kind for s in session.reports[step][rank].spans if s.kind in COMM_KINDS)


DECODER_LAYERS = 6  # the tiny SmolLM2: FSDP shards each layer and the root


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "fsdp"])
def test_sharded_strategies_issue_exact_collectives_of_each_kind_and_hold_their_share(recordings: Record, strategy: str) -> None:
    session, summary, *_ = recordings(*STRATEGY_RUNS[strategy])
    buckets = len(session.ranks[0].hello.bucket_layout)
    expected = {
        "zero1": Counter(all_reduce=buckets, all_gather=buckets),  # bucket's all-reduces, then the updated shards
        "zero2": Counter(reduce_scatter=buckets, all_gather=buckets),
        # each layer gathered for forward and again for backward; the root stays gathered between them
        "fsdp": Counter(all_gather=2 * DECODER_LAYERS + 1, reduce_scatter=DECODER_LAYERS + 1),
    }[strategy]
    for step in (2, 3, 4):  # step 1 also carries the wrap-time broadcast
        assert calls_by_kind(session, step, 0) == calls_by_kind(session, step, 1) == expected, step
    (segment,) = summary["segments"]
    assert segment["calls_by_kind"] == {kind: float(n) for kind, n in sorted(expected.items())}
    assert segment["desyncs"] == []
    ddp = recordings(*STRATEGY_RUNS["ddp"]).summary["segments"][0]["memory"]
    halved = {"zero1": {"optimizer_state"}, "zero2": {"optimizer_state", "gradients"},
              "fsdp": {"optimizer_state", "gradients", "parameters"}}[strategy]
    for kind in ("parameters", "gradients", "optimizer_state"):  # measured on step 2, from the tensors held
        share = segment["memory"][kind] / ddp[kind]
        assert (0.45 <= share <= 0.56) if kind in halved else (0.99 <= share <= 1.05), (kind, share)


def test_bucket_reduces_once_per_bucket_and_overlaps_backward(recordings: Record) -> None:
    session, summary, *_ = recordings(*STRATEGY_RUNS["bucket"])
    buckets = len(session.ranks[0].hello.bucket_layout)
    assert buckets > 1
    assert all(c == Counter({0: buckets, 1: buckets}) for c in all_reduce_calls(session).values())
    assert summary["segments"][0]["overlap_pct"] > 5
    assert_async_collectives_complete_during_backward(session)


def test_async_and_ddp_overlap_while_simple_does_not(recordings: Record) -> None:
    overlaps = {}
    for strategy in ("simple", "async", "ddp"):
        session, summary, *_ = recordings(*STRATEGY_RUNS[strategy])
        overlaps[strategy] = summary["segments"][0]["overlap_pct"]
        if strategy != "simple":
            assert_async_collectives_complete_during_backward(session)
    assert overlaps["simple"] == 0.0
    assert overlaps["async"] > 0 and overlaps["ddp"] > 0, overlaps


def test_native_ddp_first_iteration_is_excluded_and_buckets_counted(recordings: Record) -> None:
    session, summary, *_ = recordings(*STRATEGY_RUNS["ddp"])
    assert all(report.excluded == (step == 1) for step, ranks in session.reports.items() for report in ranks.values())
    counts = all_reduce_calls(session)
    assert counts[1] == Counter({0: 1, 1: 1})  # one bucket holding every gradient, before the rebuild
    later = {c[0] for step, c in counts.items() if step > 1}
    assert len(later) == 1 and later.pop() > 1
    # the hello learns DDP's rebuilt buckets a few steps in: b<i> is the i-th, for the advisor
    layout = session.ranks[0].hello.bucket_layout
    assert len(layout) == counts[2][0] and sorted(i for bucket in layout for i in bucket) == list(range(PARAMETER_TENSORS))
    assert summary["segments"][0]["excluded_steps"] == [1]
    # DDP waits for its last buckets inside backward: that time is a blocking wait, not compute
    for step, ranks in session.reports.items():
        for report in ranks.values():
            backward = next(s for s in report.spans if s.kind == "backward")
            waits = [s for s in report.spans if s.kind == "wait" and s.blocking]
            assert waits and all(backward.start <= w.start <= w.end <= backward.end + 0.01 for w in waits), step


def assert_async_collectives_complete_during_backward(session: Session) -> None:
    """Some all-reduce was issued inside backward and completed later, still inside backward."""
    for ranks in session.reports.values():
        for report in ranks.values():
            backward = [s for s in report.spans if s.kind == "backward"]
            for span in report.spans:
                if span.kind == "all_reduce" and not span.blocking and span.end > span.start:
                    if any(b.start <= span.start and span.end < b.end for b in backward):
                        return
    raise AssertionError("no asynchronous all-reduce completed while backward went on")


def test_exports_are_valid_and_summary_prints_the_table(recordings: Record) -> None:
    import subprocess
    import sys

    session, summary, _, directory, _ = recordings(*STRATEGY_RUNS["async"])
    trace = json.loads((directory / "trace.json").read_text())
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("ph") == "M" and e["name"] == "process_name"}
    assert len(names) == 2 and all(name.startswith("rank ") for name in names)
    for key in ("strategy", "world_size", "first_step", "last_step", "compute_pct", "non_compute_pct", "idle_pct",
                "overlap_pct", "comm_overhead_pct", "all_reduce_calls", "all_reduce_ms", "step_ms_p50", "step_ms_p95",
                "samples_per_s", "per_rank"):
        assert key in summary["segments"][0], key
    segment = summary["segments"][0]
    assert segment["compute_pct"] + segment["non_compute_pct"] + segment["idle_pct"] == pytest.approx(100)
    printed = subprocess.run([sys.executable, "-m", "ddpwatch.cli", "summary", str(directory)],
                             capture_output=True, text=True, cwd=REPO_ROOT, check=True).stdout
    assert "| Compute% | Non_Compute% | Idle% | Data wait% | Overlap% | Comm_overhead% |" in printed
    assert "| async" in printed


@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_duckdb_over_the_parquet_tables_gives_back_the_summarys_per_rank_figures(recordings: Record, strategy: str) -> None:
    """A per-rank GROUP BY over steps.parquet's counted rows is summary.json's per-rank steps and
    mean step time; collectives.parquet holds each counted step's collectives of each kind, as
    many as ``calls_by_kind`` counts, every one of them paired (its wait known)."""
    import duckdb

    _, summary, _, directory, _ = recordings(*STRATEGY_RUNS[strategy])
    steps, collectives = directory / "steps.parquet", directory / "collectives.parquet"
    got = duckdb.sql(f"SELECT rank, count(*), avg(step_ms) FROM '{steps}' WHERE counted GROUP BY rank ORDER BY rank").fetchall()
    per_rank = summary["segments"][0]["per_rank"]
    assert [(rank, n) for rank, n, _ in got] == [(int(rank), f["steps"]) for rank, f in sorted(per_rank.items())]
    assert [mean for *_, mean in got] == pytest.approx([f["step_ms_mean"] for _, f in sorted(per_rank.items())], rel=1e-9)
    assert len(got) == 2 and all(n >= 3 for _, n, _ in got)
    counts = dict(duckdb.sql(f"SELECT kind, count(*) / count(DISTINCT (c.rank, c.step)) FROM '{collectives}' c "
                             f"JOIN '{steps}' s USING (rank, step) WHERE s.counted GROUP BY kind").fetchall())
    assert counts == pytest.approx(summary["segments"][0]["calls_by_kind"])
    assert duckdb.sql(f"SELECT count(*) FROM '{collectives}' c JOIN '{steps}' s USING (rank, step) "
                      "WHERE s.counted AND c.wait_ms IS NULL AND c.kind IN ('all_reduce', 'reduce_scatter', 'all_gather')"
                      ).fetchall() == [(0,)]
