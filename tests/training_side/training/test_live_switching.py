"""Switching strategies while two ranks train (a dashboard that comes and goes mid-run: test_faults)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ddpwatch.record.recorder import load_session
from ddpwatch.control.switch_client import request_switch
from instrumented_ddp.publish.watch import EXPIRED
from launch import REPO_ROOT, Recorder, run_as_torchrun_would, start_ranks, wait_for_line
from step_gate import StepGate, start_gated_ranks

TRAIN = str(REPO_ROOT / "train.py")
#: Every strategy once, into and out of the sharded ones, ending where it began; one micro-step
#: throughout (ga too), so that every segment averages the same sums as the unswitched run.
SWITCHES = (("ga", None), ("hook", None), ("async", None), ("bucket", 1.0), ("ddp", 1.0), ("zero1", 1.0),
            ("zero2", 1.0), ("fsdp", None), ("simple", None))
#: The run's steps wait at a gate (``step_gate``) until the last switch has landed, let through one
#: at a time: the switches land two steps apart from step 4 (at 20 the last; 28 if each took three),
#: however fast the box.
STEPS = 32
#: A line a step, as the unswitched run's, whose end the switched run's must equal.
COMMON = ["--steps", str(STEPS), "--batch-size", "8", "--grad-accum", "1", "--log-every", "1", "--seed", "3"]


@pytest.mark.timeout(400)
def test_switching_live_through_all_nine_ends_bitwise_where_the_unswitched_run_does(tmp_path: Path) -> None:
    """Into and out of the sharded strategies too: AdamW's state is gathered from shards and
    scattered to them at each switch (``full_optimizer_state``), so the run ends bit for bit where
    the same two ranks end unswitched. With two ranks and one micro-step every strategy's average
    is order-free (a + b, halved), so only a real difference in the numbers can differ (one
    process would differ by fp32 noise that Adam grows to ~1e-3 over the run; ``simple`` with
    accumulation averages each micro-step, other sums again). Accumulation across switches is
    proven in float64 in ``test_sharded_strategies``."""
    gate = StepGate(tmp_path / "gate")
    with Recorder(tmp_path / "session", "--idle-exit", "30") as recorder:
        training = start_gated_ranks(gate, ["--strategy", "simple", *COMMON, "--watch", recorder.address,
                                            "--save-final", str(tmp_path / "switched.pt")], tmp_path / "train.log")
        try:
            gate.step_through(1, training)  # step 2 begun: the first switch lands at step 4 at the earliest
            # Asked while the run is held (a long step, a pause) by an asker that waits 1 s: it is
            # told the switch will not be applied, and rank 0, hearing it late, refuses it.
            expired = request_switch(recorder.address, "ddp", 1.0, 1, timeout_s=1.0)
            assert not expired.applied and expired.detail.endswith("its asker waits (it will not be applied)"), expired
            acks = {}
            for strategy, bucket_mb in SWITCHES:
                # Each switch is sent once the one before is acknowledged (applied at step s), so it
                # lands at s + 2 at the earliest: every segment has its second step, where its memory
                # is measured.
                acks[strategy] = gate.switch(recorder.address, strategy, bucket_mb, 1, training, last_step=STEPS - 2)
                assert acks[strategy].applied, acks[strategy]
            gate.allow(STEPS)
            assert training.wait(300) == 0, (tmp_path / "train.log").read_text()[-3000:]
        finally:
            training.stop()
        recorder.wait()
    log = (tmp_path / "train.log").read_text()
    print(f"switches applied at steps {[acks[strategy].step for strategy, _ in SWITCHES]} of {STEPS}")
    assert "parameters identical on all 2 rank(s)" in log
    segments = json.loads((tmp_path / "session" / "summary.json").read_text())["segments"]
    assert [s["strategy"] for s in segments] == ["simple", *(strategy for strategy, _ in SWITCHES)]
    assert [s["first_step"] for s in segments[1:]] == [acks[strategy].step for strategy, _ in SWITCHES]
    refusals = [ack for ack in load_session(tmp_path / "session" / "session.ddpwatch").acks if ack.command_id == expired.command_id]
    # each resend it heard answered alike; and "ddp" never ran early (the segments above)
    assert refusals and {(ack.rank, ack.applied, ack.detail) for ack in refusals} == {(0, False, EXPIRED)}
    held = {s["strategy"]: s["memory"] for s in segments if s["memory"]}  # measured on each segment's 2nd step
    assert held["zero1"]["optimizer_state"] < 0.6 * held["ddp"]["optimizer_state"]
    assert held["zero2"]["gradients"] < 0.6 * held["ddp"]["gradients"]
    assert held["fsdp"]["parameters"] < 0.6 * held["ddp"]["parameters"]
    calls = {s["strategy"]: s["calls_by_kind"] for s in segments}
    assert set(calls["zero2"]) == {"reduce_scatter", "all_gather"} and set(calls["fsdp"]) == {"reduce_scatter", "all_gather"}

    # Unswitched on bucket, whose step is 40 % shorter than simple's here: any strategy ends where any
    # other does (the average is order-free), and where the switched run does only if no switch lost a bit.
    reference = tmp_path / "unswitched.pt"
    result = run_as_torchrun_would([TRAIN, "--eval-examples", "0", "--strategy", "bucket", "--bucket-mb", "1", *COMMON, "--no-watch",
                           "--save-final", str(reference)])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval skipped (--eval-examples 0)" in result.stdout
    switched, expected = torch.load(tmp_path / "switched.pt"), torch.load(reference)
    for name, tensor in expected.items():
        assert torch.equal(switched[name], tensor), (name, float((switched[name] - tensor).abs().max()))


@pytest.mark.timeout(300)
def test_switches_racing_the_end_of_training_apply_on_every_rank_or_none(tmp_path: Path) -> None:
    """Commands keep coming until the run is over: each lands on the same step on every rank, or
    on none (the run ended first: refused, *training has ended*, or acknowledged by nobody); the
    run still finishes cleanly."""
    with Recorder(tmp_path / "session", "--idle-exit", "30") as recorder:
        training = start_ranks(["--strategy", "simple", "--steps", "25", "--batch-size", "8", "--log-every", "10",
                                   "--watch", recorder.address], tmp_path / "train.log")
        applied: list[int] = []
        refused: list[str] = []
        try:
            wait_for_line(tmp_path / "train.log", "step 10/25", training)
            cycle = ["async", "bucket", "hook", "ddp", "ga", "simple"]
            index = 0
            while training.poll() is None:
                try:
                    ack = request_switch(recorder.address, cycle[index % len(cycle)], 1.0, 1, timeout_s=3)
                    if ack.applied:
                        applied.append(ack.step)
                    else:
                        refused.append(ack.detail)
                except TimeoutError:
                    pass  # the run ended before rank 0 could take it: applied nowhere
                index += 1
            assert training.wait(60) == 0, (tmp_path / "train.log").read_text()[-3000:]
        finally:
            training.stop()
        recorder.wait()
    assert "parameters identical on all 2 rank(s)" in (tmp_path / "train.log").read_text()
    session = load_session(tmp_path / "session" / "session.ddpwatch")
    for step, ranks in session.reports.items():
        assert len({(r.strategy, tuple(sorted(r.settings.items()))) for r in ranks.values()}) == 1, step
    assert applied and all(step in session.reports for step in applied)
    assert all(why.startswith(APPLIED_NOWHERE) for why in refused), refused


#: The answers of a switch asked as the run ends that no rank applied: rank 0's, the relay's.
APPLIED_NOWHERE = ("training has ended: no step is left to switch at", "the run it was sent to is over",
                   "no rank 0 acknowledged the command within the 3 s its asker waits",
                   "no run is training there now: the last one's rank 0 said goodbye",
                   "ddpwatch record stopped before rank 0 acknowledged it")
