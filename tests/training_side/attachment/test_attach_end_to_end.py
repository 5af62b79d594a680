"""The examples a user copies, run as torchrun runs them (two gloo ranks given torchrun's environment,
without its launcher: ``launch.run_as_torchrun_would``), recorded by ``ddpwatch record``. One
watched run per example serves every assertion about it."""

from __future__ import annotations

import json
import re
import statistics
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ddpwatch.record.recorder import load_session
from ddpwatch.ingest.session import Session
from launch import REPO_ROOT, Recorder, free_port, one_process_environment, run_as_torchrun_would, start_rank
from profiler_events import LOOK_SLACK_S, assert_all_reduces_hold_against_the_profiler, rank_reports

PROFILED_STEPS = range(4, 9)  # the examples' profiler schedule: wait 2, warmup 1, active 5
EXAMPLES = {  # each with two buckets or more, an accumulation (no_sync) in every step, an evaluation after step 10
    "plain_ddp": [str(REPO_ROOT / "examples" / "plain_ddp.py"), "--steps", "12", "--bucket-mb", "1", "--grad-accum", "2",
                  "--eval-every", "10", "--ema", "0.9"],
    "hf_trainer": [str(REPO_ROOT / "examples" / "hf_trainer.py"), "--steps", "12", "--bucket-mb", "1", "--grad-accum", "2",
                   "--eval-every", "10"],
}


@dataclass
class ExampleRuns:
    example: str  # a key of EXAMPLES
    session: Session
    summary: dict
    buckets: int  # DDP's own count, printed by the example from _get_ddp_logging_data()
    watched_final: Path
    unwatched_final: Path
    profile: Path


@pytest.fixture(scope="module", params=list(EXAMPLES))
def example_runs(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> ExampleRuns:
    """The example watched (and profiled), and the same example without ddpwatch."""
    command = EXAMPLES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    with Recorder(out / "session", "--idle-exit", "20") as recorder:
        watched = run_as_torchrun_would([*command, "--watch", recorder.address, "--save-final", str(out / "watched.pt"),
                                "--profile", str(out / "profile")])
        assert watched.returncode == 0, watched.stderr[-3000:]
        recorder.wait()
    unwatched = run_as_torchrun_would([*command, "--no-watch", "--save-final", str(out / "unwatched.pt")])
    assert unwatched.returncode == 0, unwatched.stderr[-3000:]
    buckets = int(re.search(r"DDP reduced gradients in (\d+) bucket", watched.stdout).group(1))
    return ExampleRuns(request.param, load_session(out / "session" / "session.ddpwatch"), json.loads((out / "session" / "summary.json").read_text()),
                       buckets, out / "watched.pt", out / "unwatched.pt", out / "profile")


def test_all_reduces_per_step_are_ddps_buckets_on_every_rank(example_runs: ExampleRuns) -> None:
    runs = example_runs
    assert runs.buckets > 1
    (segment,) = runs.summary["segments"]
    assert segment["strategy"] == "ddp" and segment["settings"] == {"bucket_mb": 1.0, "grad_accum": 2}
    assert segment["excluded_steps"] == [1] and segment["all_reduce_calls"] == runs.buckets
    for step in range(2, 13):
        counts = {rank: sum(s.kind == "all_reduce" for s in report.spans) for rank, report in runs.session.reports[step].items()}
        assert counts == {0: runs.buckets, 1: runs.buckets}, step
    for figures in [segment, *segment["per_rank"].values()]:
        assert figures["compute_pct"] + figures["non_compute_pct"] + figures["idle_pct"] == pytest.approx(100.0)
    assert all(not rank.hello.switchable for rank in runs.session.ranks.values())


def trainer_gathers_a_step() -> int:
    """The all-gathers the installed transformers' Trainer issues in a step, logging every step:
    the loss and the step's floating-point operations for the log (``store_flos``), and, where it
    averages tokens across devices (``average_tokens_across_devices``: transformers 4.57 and 5, on
    by default; not in 4.45), the batch's label count before the step's first forward."""
    import dataclasses

    from transformers import TrainingArguments

    defaults = {field.name: field.default for field in dataclasses.fields(TrainingArguments)}
    return 2 + bool(defaults.get("average_tokens_across_devices", False))


def trainer_evaluates_after_its_last_step(steps: int = 12, eval_every: int = 10) -> bool:
    """Whether the installed transformers' Trainer evaluates after its last step too where that
    step is not one of its step-based evaluations: ``DefaultFlowCallback`` does from transformers
    5 on, not in 4.57 (asked, not assumed: the suite runs on both)."""
    import tempfile

    from transformers import TrainerControl, TrainerState, TrainingArguments
    from transformers.trainer_callback import DefaultFlowCallback

    with tempfile.TemporaryDirectory() as scratch:
        args = TrainingArguments(output_dir=scratch, max_steps=steps, eval_strategy="steps", eval_steps=eval_every,
                                 save_strategy="no", report_to=[])
    state = TrainerState(global_step=steps, max_steps=steps, eval_steps=eval_every, logging_steps=1, save_steps=500)
    return bool(DefaultFlowCallback().on_step_end(args, state, TrainerControl()).should_evaluate)


def test_the_evaluation_between_steps_is_a_pause_before_the_next_step_not_its_data(example_runs: ExampleRuns) -> None:
    """The evaluation after step 10 (``watch.paused`` in the DDP example; in the Trainer's, its own
    ``_maybe_log_save_evaluate`` then ``on_evaluate``, as the installed transformers calls them):
    step 11 begins where it ended, on both ranks, and its gathers are not step 11's. What it
    measured (the DDP example's ``record_evaluation``, the Trainer's own metrics from
    ``on_evaluate``) is in the summary after step 10, less the Trainer's speed figures; a Trainer
    that evaluates after its last step (12) as well (``trainer_evaluates_after_its_last_step``) has
    that one there too."""
    evaluations = example_runs.summary["evaluations"]
    at_the_end = example_runs.example == "hf_trainer" and trainer_evaluates_after_its_last_step()
    assert [e["step"] for e in evaluations] == ([10, 12] if at_the_end else [10])
    measured = {"eval_loss", "eval_accuracy"} if example_runs.example == "hf_trainer" else {"eval_loss"}  # its compute_metrics
    assert all(set(e["metrics"]) == measured and e["metrics"]["eval_loss"] > 0 for e in evaluations)
    (segment,) = example_runs.summary["segments"]
    assert (segment["paused_steps"], segment["paused_for"]) == ([11], ["evaluate"]) and segment["paused_s"] > 0
    for rank, report in example_runs.session.reports[11].items():
        assert report.paused_s > 0 and report.start - report.paused_s >= example_runs.session.reports[10][rank].end - 1e-3
        assert report.untimed_collectives <= max(r.untimed_collectives for r in example_runs.session.reports[9].values())


def test_the_average_of_the_weights_the_loop_marks_is_compute_where_each_step_begins(example_runs: ExampleRuns) -> None:
    """The DDP example's ``--ema``, updated after each ``step()`` inside ``watch.computing("ema")``:
    each step's window begins at the update before's return, so from step 2 each holds the one
    the step before ended with, one ``loop`` span at its start, outside its data. Step 11 holds
    none: the average after step 10 came before the evaluation's pause, and is the pause's. The
    Trainer example marks nothing, and none of its steps holds such a span."""
    marks = example_runs.example == "plain_ddp"
    for step, reports in example_runs.session.reports.items():
        for report in reports.values():
            marked = [s for s in report.spans if s.kind == "loop"]
            assert [s.tag for s in marked] == (["ema"] if marks and step not in (1, 11) else []), step
            data = [(s.start, s.end) for s in report.spans if s.kind == "data"]
            assert all(end <= m.start or m.end <= start for m in marked for start, end in data), step


def test_parameters_are_bitwise_those_of_the_run_without_ddpwatch(example_runs: ExampleRuns) -> None:
    watched, unwatched = torch.load(example_runs.watched_final), torch.load(example_runs.unwatched_final)
    assert watched.keys() == unwatched.keys()
    assert all(torch.equal(watched[name], unwatched[name]) for name in watched)


def test_all_reduces_and_overlap_hold_against_the_profiler(example_runs: ExampleRuns) -> None:
    """Each rank's recorded all-reduces of the profiled steps against the profiler's gloo events:
    the same count, each end within the CPU clock's resolution, the summed time, and the
    Overlap% figured from the profiler's starts (put on ddpwatch's clock) within 5 points, in the median step, of
    ddpwatch's own (``assert_all_reduces_hold_against_the_profiler``)."""
    runs = example_runs
    for rank in (0, 1):
        (trace_file,) = runs.profile.glob(f"rank{rank}.*.json")
        events = json.loads(trace_file.read_text())["traceEvents"]
        profiled = sorted((e for e in events if e.get("name") == "gloo:all_reduce"), key=lambda e: e["ts"])
        reports = rank_reports([runs.session.reports[step][rank] for step in PROFILED_STEPS])
        recorded = sorted((s for report in reports for s in report.spans if s.kind == "all_reduce"), key=lambda s: s.start)
        assert len(recorded) == len(profiled) == runs.buckets * len(PROFILED_STEPS)
        assert_all_reduces_hold_against_the_profiler(reports, recorded, profiled)


def test_the_loops_own_gathers_hold_against_the_profiler(example_runs: ExampleRuns) -> None:
    """Each of the Trainer's gathers in the profiled steps (3 a step, ``trainer_gathers_a_step``,
    timed as the loop's: ``l<k>``)
    is one of the profiler's ``gloo:all_gather`` events, in order, and their ends agree: put on
    one clock by the median offset, the median distance of an end from its event's is within the
    CPU clock's slack (``LOOK_SLACK_S``). Measured by hand: most within 70 us, a few 1.2-1.7 ms
    where the training thread woke late from its wait; an end found at the next look instead of
    at the wait's return was early by half the gather, 0.1-6 ms, every one. The DDP example
    gathers nothing, and nothing is taken for a gather."""
    runs = example_runs
    for rank in (0, 1):
        (trace_file,) = runs.profile.glob(f"rank{rank}.*.json")
        events = sorted((e for e in json.loads(trace_file.read_text())["traceEvents"] if e.get("name") == "gloo:all_gather"),
                        key=lambda e: e["ts"])
        spans = sorted((s for step in PROFILED_STEPS for s in runs.session.reports[step][rank].spans if s.tag.startswith("l")),
                       key=lambda s: s.start)
        assert len(spans) == len(events) == (trainer_gathers_a_step() * len(PROFILED_STEPS) if runs.example == "hf_trainer" else 0)
        if spans:
            differences = [e["ts"] + e["dur"] - s.end * 1e6 for s, e in zip(spans, events, strict=True)]
            offset = statistics.median(differences)
            assert statistics.median(abs(d - offset) for d in differences) <= LOOK_SLACK_S * 1e6, differences


@pytest.fixture(scope="module")
def three_rank_worker() -> subprocess.CompletedProcess[str]:
    """``tests/support/workers/attach_bitwise.py`` on three ranks: one run for every scenario it runs."""
    result = run_as_torchrun_would([str(REPO_ROOT / "tests" / "support" / "workers" / "attach_bitwise.py"), "--address", f"tcp://127.0.0.1:{free_port()}"],
                          nproc=3)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_a_rank_waiting_in_the_loops_gather_for_a_slow_loader_reads_as_waiting_not_as_its_own_loading(
        three_rank_worker: subprocess.CompletedProcess[str]) -> None:
    """Rank 1 loads for 100 ms before the loop's all-gather, each step, on three ranks. The others
    wait for it in the gather, which is timed (``l0``) and ends where their data time ends (the
    forward follows it at once): their data time is that wait, not a loader; rank 1's own gather
    is short, its data time its loader. Untimed, all three read the same data time, and no rank
    could be named the straggler. (An end found at the next look, as before the loop's wait was
    looked around, is the middle of the look before, at the gather's start at the latest, and
    this one: half the gather or more before the data's end. A third leaves room for the
    scheduler of a loaded box between the gather and the forward.)"""
    (line,) = [line for line in three_rank_worker.stdout.splitlines() if line.startswith("slow loader: ")]
    ranks = json.loads(line.removeprefix("slow loader: "))
    slow_ms = 100.0
    for rank, steps in enumerate(ranks):
        assert [[(kind, tag) for kind, tag, _ in step["loop"]] for step in steps] == [[("all_gather", "l0")]] * 3, ranks
        for step in steps:
            gather_ms = step["loop"][0][2]
            if rank == 1:
                assert step["data_ms"] >= slow_ms and gather_ms < step["data_ms"] - slow_ms / 2, ranks
            else:
                assert gather_ms >= slow_ms / 2 and step["after_last_ms"] < gather_ms / 3, ranks


def test_attached_hook_is_bitwise_plain_ddp_at_a_world_size_that_is_not_a_power_of_two(
        three_rank_worker: subprocess.CompletedProcess[str]) -> None:
    """Three ranks: scaling by 1/3 and dividing by 3 round differently, so the hook must do what
    DDP's default does for the model's gradient layout (multiply while copying; divide in place
    where gradients are views of the bucket). One run, both layouts, and a ``static_graph`` DDP,
    whose first iteration reduces every bucket at the end of backward and waits for them in the
    same call (an attached one hung there), and whose buckets are rebuilt after its second
    (a one-rank group cannot show it: there DDP's static graph issues no all-reduce); and the
    README's Accelerate use, attached to what ``accelerator.prepare`` returns, also with Accelerate's
    fp16 compression hook (the user's own hook, kept and timed); a DDP built on a
    subgroup; PyTorch's ZeRO-1 (``ZeroRedundancyOptimizer``); and a model sharded with FSDP2, attached against not, then replicated on a 2-D mesh
    (HSDP)."""
    result = three_rank_worker
    assert "gradient_as_bucket_view=False: bitwise equal on every rank: True" in result.stdout
    assert "gradient_as_bucket_view=True: bitwise equal on every rank: True" in result.stdout
    assert "static_graph=True: bitwise equal on every rank: True" in result.stdout
    # one bucket of every gradient for two steps, then DDP's rebuilt two: in ready order (the last layer first),
    # a bucket closed once it reaches 0.01 MB (10,486 bytes): the last layer (780) and the middle weight (16,384)
    # reach it; the rest (8,704) is the second
    assert "static_graph=True: excluded [True, True, False, False], all-reduces [1, 1, 2, 2]" in result.stdout
    # a DDP built on a subgroup (ranks 0 and 1; rank 2 alone): its hello names the ranks its all-reduces meet
    assert "subgroup: bitwise equal on every rank: True" in result.stdout
    assert "subgroup: all-reduce group [0, 1], all-reduces [1, 2, 2, 2]" in result.stdout
    # PyTorch's ZeRO-1 beside DDP: in each step the 6 parameters' broadcasts (each from the rank whose
    # slice holds it), asynchronous, timed as the loop's (l0-l5), and ZeRO's 6 waits for them blocked time
    # inside the optimizer phase; step 2's 2 untimed are DDP's broadcasts of its rebuilt buckets
    assert "zero: bitwise equal on every rank: True" in result.stdout
    assert ("zero: broadcasts " + str([[f"l{i}" for i in range(6)]] * 4) + ", blocking [False], "
            "waits in the optimizer [6, 6, 6, 6], untimed [0, 2, 0, 0]") in result.stdout
    # Accelerate's own loop on what accelerator.prepare returned: one report per optimizer step of two
    # micro-steps, the model's 25 KB in one bucket at Accelerate's default cap
    assert "accelerate: bitwise equal on every rank: True" in result.stdout
    assert "accelerate: excluded [True, False, False, False], grad_accum [2, 2, 2, 2], all-reduces [1, 1, 1, 1]" in result.stdout
    # the same with Accelerate's fp16 compression hook (DistributedDataParallelKwargs(comm_hook=FP16)), which
    # DDP keeps: its one all-reduce a step timed as the hook issues it, in float16, half the gradients'
    # 6,467 float32 elements (32x64+64 + 64x64+64 + 64x3+3): 12,934 bytes; step 2's 2 untimed are DDP's
    # broadcasts of its rebuilt buckets; Accelerate gives DDP no cap, so its first bucket is 1 MiB (first_bucket_mb)
    assert "accelerate fp16: bitwise equal on every rank: True" in result.stdout
    assert ("accelerate fp16: settings {'bucket_mb': 25.0, 'grad_accum': 2, 'first_bucket_mb': 1.0, 'comm_hook': 'fp16_compress_hook'}, "
            "excluded [True, False, False, False], all-reduces [" + ", ".join(["[('h0', 'float16', 12934)]"] * 4) + "], "
            "untimed [0, 2, 0, 0]") in result.stdout
    # FSDP2, each Linear a unit and the root holding none: per micro-step each unit all-gathered before its
    # forward and again before its backward (3 + 3, twice a step), and reduce-scattered once a step, on the
    # micro-step that syncs; timed through FSDP's custom comms, the training bit for bit unattached FSDP's.
    # The unattached model, trained by the same loop after the attached one's update, is in the attached
    # one's data time: its forwards' all-gathers (3 a micro-step, synchronous) are the loop's there, from
    # step 2 (its backwards' are in a backward, not the loop's: counted untimed)
    assert "fsdp2: bitwise equal on every rank: True" in result.stdout
    assert ("fsdp2: strategy ['fsdp'], excluded [False, False, False, False], grad_accum [2, 2, 2, 2], "
            "all-gathers [12, 12, 12, 12], reduce-scatters [3, 3, 3, 3], tags ['u0', 'u1', 'u2'], "
            "the loop's [0, 6, 6, 6]") in result.stdout
    # the same, the loop prefetching each layer itself (unshard(async_op=True), FSDP2's explicit prefetch):
    # FSDP waits for such an all-gather only where its work is a dist.Work, and read the parameters before
    # gloo had gathered them (bitwise False) where ddpwatch handed it a plain wrapper (collectives.ForwardingWork).
    # The attached model's prefetches are its own (u0-u2, not blocking), the unattached one's the loop's
    assert "fsdp2 prefetched: bitwise equal on every rank: True" in result.stdout
    assert "fsdp2 prefetched: all-gathers [12, 12, 12, 12], blocking [False, True], the loop's [0, 6, 6, 6]" in result.stdout
    # the same model replicated on every rank (HSDP on a 3 x 1 mesh): FSDP skips the reduce-scatter of a
    # one-rank shard group and all-reduces each unit's gradients across the 3 replicas, once a step, with a
    # plain dist.all_reduce that no FSDP hook takes: timed through the forwarding group standing for the
    # replicate dimension (before, not one all-reduce was reported), the training bit for bit unattached HSDP's
    assert "hsdp: bitwise equal on every rank: True" in result.stdout
    # its segment says how many replicas there are, and its hello which ranks its all-reduces meet
    assert ("hsdp: settings {'grad_accum': 2, 'replicas': 3}, all-reduce group [0, 1, 2], excluded [False, False, False, False], "
            "reduce-scatters [0, 0, 0, 0], all-reduces [3, 3, 3, 3], "
            "tags ['u0', 'u1', 'u2'], blocking [True]") in result.stdout


@pytest.mark.parametrize("replicas", [1, 2])
def test_the_fsdp_example_reports_every_units_collectives_and_its_shards(tmp_path: Path, replicas: int) -> None:
    """``examples/plain_fsdp.py`` as a user runs it: 2 gloo ranks, recorded. Its units are the stem,
    the 8 blocks and the root (the head): in each micro-step the root and the 9 others are gathered
    before their forward and the 9 again before their backward (the root stays gathered), and on
    the step's last micro-step each of the 10 is reduce-scattered. Each rank holds half the model.
    ``--replicas 2`` on 2 ranks is HSDP on a 2 x 1 mesh: a one-rank shard is whole, so FSDP
    gathers nothing and skips the reduce-scatter, each unit's gradients are all-reduced across the
    2 replicas instead, each rank holds the whole model, and the segment says ``replicas=2``. (``--replicas 1`` once built a
    1 x 2 mesh, which all-reduced each unit across its one replica: 10 all-reduces a step.)"""
    width, layers = 64, 8
    command = [str(REPO_ROOT / "examples" / "plain_fsdp.py"), "--steps", "6", "--grad-accum", "2",
               "--width", str(width), "--layers", str(layers), "--replicas", str(replicas)]
    with Recorder(tmp_path / "session", "--idle-exit", "20") as recorder:
        run = run_as_torchrun_would([*command, "--watch", recorder.address])
        assert run.returncode == 0, run.stderr[-3000:]
        recorder.wait()
    session = load_session(tmp_path / "session" / "session.ddpwatch")
    assert sum(session.rejected.values()) == 0 and sorted(session.reports) == [1, 2, 3, 4, 5, 6]
    units = layers + 2
    collectives = (2 * (1 + 2 * (layers + 1)), units, 0) if replicas == 1 else (0, 0, units)
    for step, reports in session.reports.items():
        assert sorted(reports) == [0, 1]
        for report in reports.values():
            kinds = [s.kind for s in report.spans]
            assert (report.strategy, report.settings["grad_accum"], report.settings.get("replicas")) == (
                "fsdp", 2, None if replicas == 1 else replicas)
            assert (kinds.count("all_gather"), kinds.count("reduce_scatter"), kinds.count("all_reduce")) == collectives
    weights = 4 * ((10 + 1) * width + layers * (width + 1) * width + (width + 1) * 5)
    held = [state.memory["parameters"] for state in session.ranks.values()]
    shards = 2 // replicas
    assert all(weights / shards <= h < weights / shards + 4 * 64 * units for h in held), (held, weights)  # a shard, padded per unit



def test_collectives_the_script_issues_itself_are_timed_as_its_own_or_counted(example_runs: ExampleRuns,
                                                                                request: pytest.FixtureRequest) -> None:
    """Each step's collectives beyond DDP's buckets, the same on both ranks. The Trainer, with
    logging every step (12 steps: ``logging_steps`` 1), all-gathers the batch's label count before
    each forward (``average_tokens_across_devices``), then after each update the loss and the
    step's floating-point operations for the log (``store_flos``): 3 a step
    (``trainer_gathers_a_step``: 2 in transformers 4.45, which gathers no label count), each synchronous, so
    timed as the loop's (``collective_stand_ins``): ``all_gather`` spans ``l0``-``l2`` inside the
    step's data time, from step 2 (step 1's label count comes before its first forward, before
    the step began; its log falls in step 2); the log after step 10 runs in the pause its
    evaluation ends, whose collectives are the pause's: step 11 holds its label count alone.
    Counted untimed (``issued_collectives``), in both examples: the two broadcasts DDP issues in
    step 2's forward, from C++, where it rebuilds its buckets (their count, then their order);
    none in the data time."""
    runs = example_runs
    untimed = {step: {rank: (report.untimed_collectives, report.untimed_in_data) for rank, report in reports.items()}
               for step, reports in sorted(runs.session.reports.items())}
    assert all(by_rank[0] == by_rank[1] for by_rank in untimed.values())
    per_step = [by_rank[0][0] for by_rank in untimed.values()]
    in_data = [by_rank[0][1] for by_rank in untimed.values()]
    assert per_step == [0, 2] + [0] * 10 and in_data == [0] * 12
    loop_calls = []
    for step, reports in sorted(runs.session.reports.items()):
        timed = {rank: [(s.kind, s.tag) for s in report.spans if s.tag.startswith("l")] for rank, report in reports.items()}
        assert timed[0] == timed[1], step
        loop_calls.append(len(timed[0]))
        assert all(kind == "all_gather" for kind, _ in timed[0])
        for report in reports.values():
            data = [s for s in report.spans if s.kind == "data"]
            assert all(any(d.start <= s.start <= s.end <= d.end for d in data) for s in report.spans if s.tag.startswith("l"))
    gathers = trainer_gathers_a_step()  # 3: its log's two after the update (step 11's in the pause), its label count
    assert loop_calls == ([0] * 12 if "plain_ddp" in request.node.name else [0] + [gathers] * 9 + [gathers - 2, gathers])
    (segment,) = runs.summary["segments"]
    assert segment["untimed_collective_steps"] == [step for step, n in zip(range(1, 13), per_step, strict=True) if n]
    assert segment["untimed_collectives_most"] == max(per_step)
    assert segment["untimed_in_data_steps"] == [step for step, n in zip(range(1, 13), in_data, strict=True) if n]


@pytest.mark.timeout(200)
def test_the_trainer_example_run_as_one_process_trains_unwatched_saying_why_and_ends_cleanly(tmp_path: Path) -> None:
    """``python examples/hf_trainer.py``, no torchrun: the Trainer builds no DDP, so there is no
    communication to watch (said in one line, training goes on); the Trainer makes no process
    group either, and the example's last barrier once ended such a run in a traceback after its
    final state was saved."""
    run = start_rank([str(REPO_ROOT / "examples" / "hf_trainer.py"), "--steps", "3", "--watch", f"tcp://127.0.0.1:{free_port()}",
                      "--save-final", str(tmp_path / "final.pt")], REPO_ROOT, one_process_environment())
    out, err = run.communicate(timeout=180)
    assert run.returncode == 0, err[-3000:]
    assert err.splitlines() == ["ddpwatch: one process, so the Trainer built no DistributedDataParallel and there is no "
                                "communication to watch (launch two or more with torchrun): training goes on unwatched"]
    assert "'train_loss'" in out  # the Trainer's own end-of-training log: it ran its three steps
    final = torch.load(tmp_path / "final.pt")
    assert final and all(isinstance(tensor, torch.Tensor) for tensor in final.values())


def test_a_mixture_of_experts_all_to_alls_are_timed_inside_the_forward_on_every_rank(tmp_path: Path) -> None:
    """``plain_ddp.py --experts``: each of its 2 hidden layers reached through a dispatch and a combine
    all-to-all, 4 a step in the forward, each a blocking span of the loop's inside the forward's on
    both ranks (counted untimed before, read as forward compute); the backward's 4 counted untimed
    (and DDP's 2 rebuilt-bucket broadcasts in step 2). Watched, the final parameters are the unwatched run's."""
    command = [str(REPO_ROOT / "examples" / "plain_ddp.py"), "--experts", "--steps", "6", "--layers", "2", "--width", "64"]
    with Recorder(tmp_path / "session", "--idle-exit", "20") as recorder:
        watched = run_as_torchrun_would([*command, "--watch", recorder.address, "--save-final", str(tmp_path / "watched.pt")])
        assert watched.returncode == 0, watched.stderr[-3000:]
        recorder.wait()
    unwatched = run_as_torchrun_would([*command, "--no-watch", "--save-final", str(tmp_path / "unwatched.pt")])
    assert unwatched.returncode == 0, unwatched.stderr[-3000:]
    final = [torch.load(tmp_path / f"{run}.pt") for run in ("watched", "unwatched")]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])
    session = load_session(tmp_path / "session" / "session.ddpwatch")
    for step in range(1, 7):
        for rank, report in session.reports[step].items():
            (forward,) = [s for s in report.spans if s.kind == "forward"]
            exchanges = [s for s in report.spans if s.tag.startswith("l")]
            assert [(s.kind, s.tag, s.blocking) for s in exchanges] == [("all_to_all", f"l{k}", True) for k in range(4)], (step, rank)
            assert all(forward.start <= s.start <= s.end <= forward.end for s in exchanges), (step, rank)
            assert report.untimed_collectives == 4 + 2 * (step == 2), (step, rank)
