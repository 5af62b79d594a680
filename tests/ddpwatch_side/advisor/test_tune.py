"""``ddpwatch tune``'s sweep against a made-up run: the switches it asks for, in order, what it
measures for each cap, the prediction made before each switch, the table, and the refusals."""

from __future__ import annotations

import subprocess
import sys
from msgspec.structs import replace

import pytest

from ddpwatch.ingest.receiver import ingest
from ddpwatch.ingest.session import Session
from ddpwatch.advisor.tune import SweepDriver, TunedCap, _predicted, table, told_apart
from instrumented_ddp.wire.codec import encode
from instrumented_ddp.wire.messages import Ack, SwitchCommand
from launch import REPO_ROOT
from synthetic_session import hello
from bucket_steps import LAYOUT, MIB, bucket_step, slowed_session


class FakeRelay:
    """What the sweep needs of ``control.SwitchRelay``: requests out, acknowledgements in."""

    def __init__(self) -> None:
        self.requested: list[SwitchCommand] = []
        self.acks: list[Ack] = []

    def request(self, command: SwitchCommand, requester: bytes | None = None) -> None:
        self.requested.append(command)


class MadeUpRun:
    """Two ranks stepping 0.2 s apart; at ``step_ms`` per cap, the step's end moved accordingly."""

    def __init__(self, session: Session, step_ms: dict[float, float], switchable: bool = True) -> None:
        self.session, self.step_ms, self.step, self.seq = session, step_ms, 0, 0
        for rank in (0, 1):
            self.send(replace(hello(rank, strategy="bucket"), parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]],
                              settings={"grad_accum": 1, "bucket_mb": 0.25}, switchable=switchable))

    def send(self, message: object) -> None:
        self.seq += 1
        ingest(self.session, [encode(message, seq=self.seq)])  # type: ignore[arg-type]

    def steps(self, count: int, cap_mb: float) -> None:
        for _ in range(count):
            self.step += 1
            shift = self.step * 0.5
            for rank in (0, 1):
                report = bucket_step(rank, self.step)
                report = replace(report, start=shift, end=shift + self.step_ms[cap_mb] / 1e3, settings={"bucket_mb": cap_mb, "grad_accum": 1},
                                 spans=[s._replace(start=s.start + shift, end=s.end + shift) for s in report.spans])
                self.send(report)

    def resized_steps(self, cap_mb: float, second_bucket_grows: bool, count: int = 4) -> None:
        """``count`` steps at ``cap_mb``, each rank's hello first saying the cap it trains at now,
        every step 170 ms; with ``second_bucket_grows`` b1's all-reduce moves 4 MiB in 30 ms, so
        the cost model sees two sizes."""
        for rank in (0, 1):
            self.send(replace(hello(rank, strategy="bucket"), parameter_layout=LAYOUT, bucket_layout=[[3, 2], [1, 0]],
                              settings={"grad_accum": 1, "bucket_mb": cap_mb}))
        for _ in range(count):
            self.step += 1
            shift = self.step * 0.5
            for rank in (0, 1):
                report = bucket_step(rank, self.step)
                spans = [s._replace(nbytes=4 * MIB, end=s.start + 0.030) if s.tag == "b1" and second_bucket_grows else s
                         for s in report.spans]
                self.send(replace(report, start=shift, end=shift + 0.17, settings={"bucket_mb": cap_mb, "grad_accum": 1},
                                  spans=[s._replace(start=s.start + shift, end=s.end + shift) for s in spans]))


def test_the_sweep_switches_to_each_size_in_turn_and_measures_it_after_its_acknowledgement() -> None:
    session, relay = Session(), FakeRelay()
    run = MadeUpRun(session, {0.25: 200.0, 1.0: 180.0, 4.0: 190.0})
    driver = SweepDriver("bucket", steps_per_size=3, sizes=[1.0, 4.0], log=lambda line: None)
    run.steps(2, 0.25)
    assert driver(session, relay) is None and not relay.requested  # the starting cap: 3 steps to measure
    run.steps(2, 0.25)
    assert driver(session, relay) is None
    (first,) = relay.requested
    assert (first.strategy, first.bucket_mb) == ("bucket", 1.0)
    run.steps(3, 0.25)  # the switch not acknowledged yet: nothing more happens
    assert driver(session, relay) is None and len(relay.requested) == 1
    relay.acks.append(Ack(0, first.command_id, True, run.step + 1))
    run.steps(3, 1.0)
    assert driver(session, relay) is None  # 1 MB measured ...
    assert driver(session, relay) is None and relay.requested[-1].bucket_mb == 4.0  # ... and on to 4 MB
    relay.acks.append(Ack(0, relay.requested[-1].command_id, True, run.step + 1))
    run.steps(3, 4.0)
    driver(session, relay)
    assert driver(session, relay) is None and relay.requested[-1].bucket_mb == 1.0  # left at the measured best
    relay.acks.append(Ack(0, relay.requested[-1].command_id, True, run.step + 1))
    assert driver(session, relay) == "sweep done"
    assert [(r.cap_mb, r.measured_ms) for r in driver.results] == [(0.25, pytest.approx(200.0)), (1.0, pytest.approx(180.0)),
                                                                  (4.0, pytest.approx(190.0))]
    # every step of a cap alike: its interval is that one step time
    assert [r.measured_interval_ms for r in driver.results[1:]] == [pytest.approx((180.0, 180.0)), pytest.approx((190.0, 190.0))]
    assert all(r.predicted_ms is None for r in driver.results)  # one size of all-reduce: no cost model fits


def test_a_run_on_another_strategy_has_its_starting_cap_measured_under_the_swept_one() -> None:
    """A run on ``simple`` (train.py's default strategy is another than the sweep's): its steps
    were taken as the ``bucket`` sweep's starting cap, and the run could be left there at a
    setup never measured (*measured best: 25 MB at 150.0 ms, the starting cap*: simple's)."""
    session, relay = Session(), FakeRelay()
    run = MadeUpRun(session, {0.25: 150.0, 1.0: 180.0})
    for rank in (0, 1):
        run.send(replace(hello(rank, strategy="simple"), parameter_layout=LAYOUT, settings={"grad_accum": 1}))
    for _ in range(4):
        run.step += 1
        for rank in (0, 1):
            run.send(replace(bucket_step(rank, run.step), strategy="simple", settings={"grad_accum": 1}))
    driver = SweepDriver("bucket", steps_per_size=3, sizes=[1.0], log=lambda line: None)
    assert driver(session, relay) is None and driver.results == []
    (first,) = relay.requested
    assert (first.strategy, first.bucket_mb) == ("bucket", 25.0)  # the starting cap, under bucket
    relay.acks.append(Ack(0, first.command_id, True, run.step + 1))
    run.step_ms[25.0] = 200.0
    run.steps(3, 25.0)
    assert driver(session, relay) is None and [r.cap_mb for r in driver.results] == [25.0]
    assert driver(session, relay) is None and relay.requested[-1].bucket_mb == 1.0  # then the sizes asked for


def test_a_cost_model_that_fits_only_after_the_second_probe_still_plans_the_predicted_best() -> None:
    """Without ``--sizes``: the quarter probe (one size of all-reduce still: no model) marked the
    sweep planned, *the sweep ends with what it measured*, yet the x4 probe ran, and where its
    4 MiB call made the model fit, nothing planned the predicted best and its neighbours."""
    session, relay = Session(), FakeRelay()
    run = MadeUpRun(session, {1.0: 170.0, 0.25: 170.0, 4.0: 170.0})

    lines: list[str] = []
    driver = SweepDriver("bucket", steps_per_size=3, log=lines.append)
    run.resized_steps(1.0, second_bucket_grows=False)
    driver(session, relay)
    for _ in range(2):  # the two probes
        relay.acks.append(Ack(0, relay.requested[-1].command_id, True, run.step + 1))
        cap = relay.requested[-1].bucket_mb
        assert cap is not None  # the sweep names a cap in every switch
        run.resized_steps(cap, second_bucket_grows=cap == 4.0)  # the x4 probe's 4 MiB call: a second size
        driver(session, relay)
        driver(session, relay)
    assert [c.bucket_mb for c in relay.requested[:2]] == [0.25, 4.0]
    assert any(line.startswith("ddpwatch tune: predicted best") for line in lines)
    assert len(relay.requested) == 3 and relay.requested[2].bucket_mb not in (1.0, 0.25, 4.0)  # not back to a probe


def test_each_prediction_keeps_the_share_of_compute_it_took_as_lost_beside_an_all_reduce() -> None:
    """``test_advisor.slowed_session``: 0.375 lost, so 4 MB is predicted at the 170 ms it ran;
    tune.json keeps the share with the prediction. With one segment there is nothing to fit."""
    tuned = _predicted(slowed_session(), 4.0)
    assert tuned.predicted_ms == pytest.approx(170.0) and tuned.predicted_lost_share == pytest.approx(0.375)
    session = Session()
    run = MadeUpRun(session, {0.25: 200.0})
    run.steps(4, 0.25)
    assert _predicted(session, 1.0).predicted_lost_share is None


def test_a_start_whose_cost_model_fits_is_probed_before_the_plan_until_the_slowdown_can_be_read() -> None:
    """From 4 MB (and 0.25 MB) the start's own buckets came in two sizes, the cost model fitted at
    once, and tune planned from that one cap, where nothing says how the all-reduces beside
    backward slow it: it named 0.707-2 MB where 4-8 MB measured fastest. Now it probes a quarter
    and four times the start first; here the probes' steps are the start's again (no slowdown to
    read even then), and it plans with what it has rather than probe again."""
    session, relay = Session(), FakeRelay()
    run = MadeUpRun(session, {1.0: 170.0, 0.25: 170.0, 4.0: 170.0})

    lines: list[str] = []
    driver = SweepDriver("bucket", steps_per_size=3, log=lines.append)
    run.resized_steps(1.0, second_bucket_grows=True)  # 2 and 4 MiB at every cap: a model at the start
    driver(session, relay)
    assert [c.bucket_mb for c in relay.requested] == [0.25]  # the first probe, though a cost model fits
    assert any("do not yet say how the all-reduces beside backward slow it; probing 0.25 and 4 MB" in line for line in lines)
    for _ in range(2):
        relay.acks.append(Ack(0, relay.requested[-1].command_id, True, run.step + 1))
        cap = relay.requested[-1].bucket_mb
        assert cap is not None
        run.resized_steps(cap, second_bucket_grows=True)
        driver(session, relay)
        driver(session, relay)
    assert [c.bucket_mb for c in relay.requested[:2]] == [0.25, 4.0]
    assert any(line.startswith("ddpwatch tune: predicted best") for line in lines) and len(relay.requested) == 3


def test_a_run_that_cannot_switch_or_refuses_ends_the_sweep_with_nothing_switched() -> None:
    session, relay = Session(), FakeRelay()
    MadeUpRun(session, {0.25: 200.0}, switchable=False)
    driver = SweepDriver("bucket", steps_per_size=3, sizes=[1.0], log=lambda line: None)
    assert "cannot switch" in (driver(session, relay) or "") and driver.failure and not relay.requested

    session, relay = Session(), FakeRelay()
    run = MadeUpRun(session, {0.25: 200.0})
    run.steps(4, 0.25)
    driver = SweepDriver("bucket", steps_per_size=3, sizes=[1.0], log=lambda line: None)
    driver(session, relay)
    relay.acks.append(Ack(0, relay.requested[0].command_id, False, 5, "bucket size must be positive"))
    assert driver(session, relay) == "rank 0 refused the switch: bucket size must be positive"


def test_a_run_that_ends_mid_sweep_leaves_the_caps_not_measured_named() -> None:
    """``--sizes 0.1,1,5,25`` on a 20-step job: the table had two rows and exit 0, with no word
    of the two caps the run ended before."""
    session, relay = Session(), FakeRelay()
    run = MadeUpRun(session, {0.25: 200.0, 1.0: 180.0})
    driver = SweepDriver("bucket", steps_per_size=3, sizes=[1.0, 4.0], log=lambda line: None)
    assert driver.unmeasured() == [1.0, 4.0]
    run.steps(4, 0.25)
    driver(session, relay)
    relay.acks.append(Ack(0, relay.requested[0].command_id, True, run.step + 1))
    run.steps(1, 1.0)  # the job's last step: one after the switch, not the 3 a cap takes
    assert driver(session, relay) is None
    assert [r.cap_mb for r in driver.results] == [0.25] and driver.unmeasured() == [1.0, 4.0]

    session, relay = Session(), FakeRelay()
    run = MadeUpRun(session, {0.25: 200.0})
    planned = SweepDriver("bucket", steps_per_size=3, log=lambda line: None)  # no --sizes: what it planned
    run.steps(4, 0.25)
    planned(session, relay)  # no cost model from one size: it probes a quarter and four times the start
    assert relay.requested[-1].bucket_mb == 0.0625 and planned.unmeasured() == [0.0625, 1.0]


def test_the_table_gives_each_cap_its_error_the_measured_best_and_the_median_error() -> None:
    """Errors: (190 - 200) / 200 = -5 %, (170 - 180) / 180 = -5.6 %, (209 - 190) / 190 = +10 %:
    median |error| 5.6 %. Best measured: 1 MB, 10 % faster than the starting 0.25 MB. Its steps'
    interval, 176-186 ms, lies below 0.25 MB's (195-205) but overlaps 4 MB's (181-199)."""
    results = [TunedCap(0.25, 190.0, 200.0, 8, (195.0, 205.0)), TunedCap(4.0, 209.0, 190.0, 8, (181.0, 199.0)),
               TunedCap(1.0, 170.0, 180.0, 8, (176.0, 186.0))]
    lines = table(results, start_mb=0.25)
    assert lines[1].split() == ["0.25", "190.0", "200.0", "195.0–205.0", "-5.0%"]
    assert lines[2].split() == ["1", "170.0", "180.0", "176.0–186.0", "-5.6%"]
    assert lines[4] == ("measured best: 1 MB at 180.0 ms, 10.0% faster than the starting 0.25 MB; "
                        "not told apart from 4 MB (90 % intervals overlap)")
    assert lines[5] == "predicted best among these: 1 MB; median |error| 5.6%"
    assert table(results, start_mb=1.0)[4].startswith("measured best: 1 MB at 180.0 ms, the starting cap; not told apart")
    from_4_mb = table(results, start_mb=4.0)  # 4 MB's interval overlaps the best's: a hint, before the predicted best
    assert from_4_mb[5] == "(the steps do not tell it from the starting 4 MB: more steps a cap, --steps-per-size, narrow the intervals)"
    assert from_4_mb[6].startswith("predicted best among these")


def test_the_table_says_why_a_cap_had_no_prediction() -> None:
    """A "—" in the predicted column came with no reason (a sweep started at 0.25 MB on the
    tiny model: its all-reduces of 6 KB to 0.4 MB did not take longer as they grew)."""
    why = "the all-reduces of 0.00586-0.375 MB did not take longer as they grew"
    results = [TunedCap(0.25, None, 200.0, 8, (195.0, 205.0), no_prediction_because=why),
               TunedCap(4.0, None, 190.0, 8, (181.0, 199.0), no_prediction_because=why + ", still"),
               TunedCap(1.0, 170.0, 180.0, 8, (176.0, 186.0))]
    lines = table(results, start_mb=0.25)
    assert lines[1].split()[1] == "—" and lines[4] == f"no prediction for 0.25, 4 MB (the advisor, asked for 0.25 MB: {why})"
    assert table(results[2:], start_mb=1.0)[2].startswith("measured best")  # every cap predicted: no such line


def test_caps_are_told_apart_only_where_their_intervals_do_not_overlap() -> None:
    assert told_apart(TunedCap(1.0, None, 180.0, 8, (176.0, 186.0)), TunedCap(4.0, None, 190.0, 8, (186.5, 199.0)))
    assert told_apart(TunedCap(1.0, None, 180.0, 8, (176.0, 186.0)), TunedCap(4.0, None, 190.0, 8, (186.0, 199.0))) is False
    assert told_apart(TunedCap(1.0, None, 180.0, 8), TunedCap(4.0, None, 190.0, 8, (186.5, 199.0))) is None


@pytest.mark.parametrize(("flags", "says"), [
    (["--sizes", "1,-2"], "every cap must be a positive, finite number of MB"),
    (["--sizes", "1,inf"], "every cap must be a positive, finite number of MB"),  # was sent, and dropped by rank 0
    (["--sizes", "one"], "is not a comma-separated list of MB"),
    (["--strategy", "async"], "invalid choice: 'async'"),
    (["--steps-per-size", "1"], "--steps-per-size must be at least 2"),
])
def test_bad_flags_get_one_line_and_exit_2(tmp_path, flags: list[str], says: str) -> None:  # noqa: ANN001
    result = subprocess.run([sys.executable, "-m", "ddpwatch.cli", "tune", "--out", str(tmp_path), *flags],
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and says in result.stderr
    assert len(result.stderr.strip().splitlines()[-1]) > 0


def test_no_run_connecting_is_one_line_and_exit_2(tmp_path) -> None:  # noqa: ANN001
    from launch import free_port

    result = subprocess.run([sys.executable, "-m", "ddpwatch.cli", "tune", "--listen", f"tcp://127.0.0.1:{free_port()}",
                             "--out", str(tmp_path), "--wait", "1"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1] == "ddpwatch tune: error: no run connected within 1 s: nothing switched"
