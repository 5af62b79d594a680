"""``ddpwatch tune``: drive a running job through bucket caps with live switches, measure each,
and hold the advisor's predictions against what was measured.

It listens like ``ddpwatch record`` (the ranks stream to it, and it records the session), and
switches the run through the same relay the dashboard uses. Each cap's prediction is made
*before* the run is switched to it, from what the run had measured until then; each cap's
measured step time is the median of that segment's steps after its first (the first carries
the switch). Without ``--sizes`` it runs the predicted best and its neighbours (half and
twice), probing a quarter and four times the starting cap first when the cost model cannot be
fitted from the starting cap alone. At the end it switches the run to the measured best.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from instrumented_ddp.wire.messages import NOT_SWITCHABLE, Ack

from ddpwatch.advisor.advice import Advice, advice_for_session
from ddpwatch.advisor.bucket_sim import MIB
from ddpwatch.control.relay import Relay, new_command
from ddpwatch.figures.order_statistics import intervals_apart
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.segments import Segment

TUNE_FILE_NAME = "tune.json"


@dataclass
class TunedCap:
    cap_mb: float
    predicted_ms: float | None  # None: no cost model could be fitted before it ran
    measured_ms: float | None = None
    steps: int = 0
    #: A 90 % interval for the measured median (``instrumented_ddp.wire.median_interval``'s rule): caps whose
    #: intervals overlap are not told apart by this many steps.
    measured_interval_ms: tuple[float, float] | None = None
    #: Where ``predicted_ms`` is None, the advisor's reason then (the table says the first below it)
    no_prediction_because: str = ""
    #: The share of backward's compute the prediction took as lost while an all-reduce runs beside
    #: it (``compute_slowdown``); None: not yet fitted, backward replayed as measured.
    predicted_lost_share: float | None = None

    @property
    def error(self) -> float | None:
        """(predicted − measured) / measured."""
        if self.predicted_ms is None or not self.measured_ms:
            return None
        return (self.predicted_ms - self.measured_ms) / self.measured_ms


@dataclass
class SweepDriver:
    """The state machine ``record`` calls after each receive (see ``recorder.record``)."""

    strategy: str
    steps_per_size: int
    sizes: list[float] | None = None  # MB; None: the predicted best and its neighbours
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    results: list[TunedCap] = field(default_factory=list)
    failure: str | None = None  # why the sweep could not run (the command exits 2)
    start_mb: float | None = None
    _queue: list[float] = field(default_factory=list)
    _planned: bool = False
    _probed: bool = False
    _waiting_for: tuple[str, TunedCap | None] | None = None  # (command id, the cap it measures)
    _final: bool = False
    connect_timeout_s: float = 120.0
    _started: float | None = None

    def __call__(self, session: Session, relay: Relay) -> str | None:
        now = time.monotonic()
        self._started = now if self._started is None else self._started
        hello = next((s.hello for _, s in sorted(session.ranks.items()) if s.hello), None)
        if hello is None and now - self._started > self.connect_timeout_s:
            self.failure = f"no run connected within {self.connect_timeout_s:g} s: nothing switched"
            return self.failure
        if hello is not None and not hello.switchable:
            self.failure = f"the run cannot switch ({NOT_SWITCHABLE}): nothing switched"
            return self.failure
        if session.finished:
            return "the run ended before the sweep did"
        if self._waiting_for is not None:
            return self._follow_switch(session, relay)
        segment = session.segments[-1] if session.segments else None
        if segment is None or _counted_steps(session, segment) < self.steps_per_size:
            return None
        if self.start_mb is None:
            self.start_mb = float(segment.settings.get("bucket_mb") or 25.0)
            if segment.strategy != self.strategy:  # its steps are another strategy's: the start is measured switched
                self.log(f"ddpwatch tune: the run trains {segment.strategy}; measuring the starting cap under {self.strategy}")
                self._switch_to(self.start_mb, session, relay)
                return None
            start = _predicted(session, self.start_mb)
            self._measure(session, segment, start)
            self.results.append(start)
        if not self._planned and not self._queue:  # a probe still queued is run before planning again
            self._plan(session)
        if self._queue:
            self._switch_to(self._queue.pop(0), session, relay)
            return None
        if not self._final:
            return self._finish(relay)
        return "sweep done"

    def _plan(self, session: Session) -> None:
        """The sizes to run: given, or the predicted best and its neighbours once a model fits and
        the caps run say how the all-reduces beside backward slow it. From one cap they cannot
        (``compute_slowdown`` needs two), so a start whose cost model already fits is probed too:
        a plan made at the start alone replays backward as measured there, and names caps too
        small."""
        assert self.start_mb is not None
        if self.sizes is not None:
            self._queue, self._planned = [s for s in self.sizes if s != self.start_mb], True
            return
        advice = advice_for_session(session)
        if isinstance(advice, Advice) and (advice.slowdown is not None or self._probed):
            best = advice.best.cap_bytes / MIB
            self._queue = [mb for mb in (best / 2, best, best * 2) if not self._measured_already(mb)]
            self._planned = True
            slowed = (f"; backward at {1 - advice.slowdown.lost_share:.0%} of its speed beside an all-reduce, "
                      f"fitted over {advice.slowdown.segments} segments" if advice.slowdown is not None else "")
            self.log(f"ddpwatch tune: predicted best {best:.3g} MB ({advice.words}{slowed}); running it and its neighbours")
        elif not self._probed:
            why = ("the caps run do not yet say how the all-reduces beside backward slow it" if isinstance(advice, Advice)
                   else f"no cost model yet ({advice})")
            self._queue, self._probed = [self.start_mb / 4, self.start_mb * 4], True
            self.log(f"ddpwatch tune: {why}; probing {self.start_mb / 4:.3g} and {self.start_mb * 4:.3g} MB")
        else:
            self._planned = True
            self.log(f"ddpwatch tune: still no cost model ({advice}); the sweep ends with what it measured")

    def _measured_already(self, cap_mb: float) -> bool:
        return any(abs(r.cap_mb - cap_mb) <= 1e-9 * cap_mb for r in self.results)

    def unmeasured(self) -> list[float]:
        """The caps the sweep meant to measure and did not, in MB: the run ended (or went silent)
        first. ``--sizes`` not yet measured, or the planned ones still queued and the one switched
        to; a sweep whose plan was never made (the starting cap not measured) left out nothing
        it had named, but measured nothing either (the table says so: one row or none)."""
        if self.sizes is not None:
            return [mb for mb in self.sizes if not self._measured_already(mb)]
        switched = [self._waiting_for[1].cap_mb] if self._waiting_for is not None and self._waiting_for[1] is not None else []
        return switched + self._queue

    def _switch_to(self, cap_mb: float, session: Session, relay: Relay) -> None:
        tuned = _predicted(session, cap_mb)
        command = new_command(self.strategy, bucket_mb=cap_mb)
        relay.request(command)
        self._waiting_for = (command.command_id, tuned)
        predicted = (f"{tuned.predicted_ms:.1f} ms predicted" if tuned.predicted_ms is not None
                     else f"no prediction: {tuned.no_prediction_because}")
        self.log(f"ddpwatch tune: switching to {self.strategy} at {cap_mb:.3g} MB ({predicted})")

    def _follow_switch(self, session: Session, relay: Relay) -> str | None:
        """After a switch: its acknowledgement, then the steps that measure it."""
        assert self._waiting_for is not None
        command_id, tuned = self._waiting_for
        state = switch_state(session, relay, command_id, self.steps_per_size)
        if state.refused:
            self.failure = state.refused
            return self.failure
        if state.ack is not None and tuned is None:  # the final switch to the best: done
            self._waiting_for = None
            return "sweep done"
        if state.segment is None or tuned is None:
            return None
        segment = state.segment
        self._measure(session, segment, tuned)
        self.results.append(tuned)
        self.log(f"ddpwatch tune: {tuned.cap_mb:.3g} MB measured {tuned.measured_ms:.1f} ms over {tuned.steps} steps")
        self._waiting_for = None
        if not self._queue and not self._planned:
            self._plan(session)
        return None

    def _measure(self, session: Session, segment: Segment, tuned: TunedCap) -> None:
        figures = session.segment_figures(segment, per_rank=False)
        tuned.measured_ms, tuned.steps = figures.step_ms_p50, figures.steps
        tuned.measured_interval_ms = figures.step_ms_p50_interval

    def _finish(self, relay: Relay) -> str | None:
        """Leave the run at the measured best."""
        self._final = True
        measured = [r for r in self.results if r.measured_ms]
        best = min(measured, key=lambda r: r.measured_ms or 0.0)
        if best.cap_mb == self.results[-1].cap_mb:
            return "sweep done"
        command = new_command(self.strategy, bucket_mb=best.cap_mb)
        relay.request(command)
        self._waiting_for = (command.command_id, None)
        self.log(f"ddpwatch tune: leaving the run at the measured best, {best.cap_mb:.3g} MB")
        return None


@dataclass(frozen=True)
class SwitchState:
    """Where a switch a sweep asked for stands: rank 0's acknowledgement once it came (``refused``:
    why not applied, "" otherwise), and the segment it began once that has the counted steps
    that measure it."""

    ack: Ack | None
    segment: Segment | None
    refused: str = ""


def switch_state(session: Session, relay: Relay, command_id: str, steps: int) -> SwitchState:
    ack = next((a for a in relay.acks if a.command_id == command_id and a.rank == 0), None)
    if ack is None:
        return SwitchState(None, None)
    if not ack.applied:
        return SwitchState(ack, None, f"rank 0 refused the switch: {ack.detail}")
    segment = next((s for s in reversed(session.segments) if s.first_step >= ack.step), None)
    if segment is None or _counted_steps(session, segment) < steps:
        segment = None
    return SwitchState(ack, segment)


def _counted_steps(session: Session, segment: Segment) -> int:
    return session.segment_figures(segment, per_rank=False).steps


def _predicted(session: Session, cap_mb: float) -> TunedCap:
    """``cap_mb`` with the advisor's step time for it now, or its reason for none."""
    advice = advice_for_session(session, caps=[max(1, int(cap_mb * MIB))])
    if not isinstance(advice, Advice):
        return TunedCap(cap_mb, None, no_prediction_because=advice)
    lost = advice.slowdown.lost_share if advice.slowdown is not None else None
    return TunedCap(cap_mb, advice.predictions[0].step_s * 1e3, predicted_lost_share=lost)


def told_apart(a: TunedCap, b: TunedCap) -> bool | None:
    """Whether two caps' measured medians differ by more than their steps' spread: their 90 %
    intervals do not overlap (a conservative test: overlapping intervals may still differ).
    None where either has no interval (a tune.json without them)."""
    if a.measured_interval_ms is None or b.measured_interval_ms is None:
        return None
    return intervals_apart(a.measured_interval_ms, b.measured_interval_ms)


def table(results: Sequence[TunedCap], start_mb: float | None) -> list[str]:
    """The sweep as printed and written: cap, predicted, measured with its 90 % interval, error;
    then the measured best, its gain over the starting cap and the caps its steps do not tell
    apart from it, and the predicted best with the prediction's median absolute error."""
    lines = [f"{'cap MB':>8} {'predicted ms':>13} {'measured ms':>12} {'90 % interval':>15} {'error':>7}"]
    for r in sorted(results, key=lambda r: r.cap_mb):
        predicted = f"{r.predicted_ms:.1f}" if r.predicted_ms is not None else "—"
        measured = f"{r.measured_ms:.1f}" if r.measured_ms is not None else "—"
        interval = f"{r.measured_interval_ms[0]:.1f}–{r.measured_interval_ms[1]:.1f}" if r.measured_interval_ms else "—"
        error = f"{r.error:+.1%}" if r.error is not None else "—"
        lines.append(f"{r.cap_mb:8.3g} {predicted:>13} {measured:>12} {interval:>15} {error:>7}")
    if unpredicted := [r for r in sorted(results, key=lambda r: r.cap_mb) if r.predicted_ms is None and r.no_prediction_because]:
        caps = ", ".join(f"{r.cap_mb:.3g}" for r in unpredicted)
        lines.append(f"no prediction for {caps} MB (the advisor, asked for {unpredicted[0].cap_mb:.3g} MB: "
                     f"{unpredicted[0].no_prediction_because})")
    measured_caps = [r for r in results if r.measured_ms]
    if measured_caps:
        best = min(measured_caps, key=lambda r: r.measured_ms or 0.0)
        start = next((r for r in results if r.cap_mb == start_mb), None)
        if best is start:
            gain = ", the starting cap"
        elif start is not None and start.measured_ms:
            gain = f", {1 - (best.measured_ms or 0) / start.measured_ms:.1%} faster than the starting {start.cap_mb:.3g} MB"
        else:
            gain = ""
        tied = [f"{r.cap_mb:.3g}" for r in sorted(measured_caps, key=lambda r: r.cap_mb) if r is not best and told_apart(r, best) is False]
        ties = f"; not told apart from {', '.join(tied)} MB (90 % intervals overlap)" if tied else ""
        lines.append(f"measured best: {best.cap_mb:.3g} MB at {best.measured_ms:.1f} ms{gain}{ties}")
        if start is not None and start is not best and told_apart(start, best) is False:
            lines.append(f"(the steps do not tell it from the starting {start.cap_mb:.3g} MB: "
                         "more steps a cap, --steps-per-size, narrow the intervals)")
        with_prediction = [r for r in results if r.predicted_ms is not None]
        if with_prediction:
            predicted_best = min(with_prediction, key=lambda r: r.predicted_ms or 0.0)
            errors = [abs(r.error) for r in with_prediction if r.error is not None]
            median = f"{statistics.median(errors):.1%}" if errors else "—"
            lines.append(f"predicted best among these: {predicted_best.cap_mb:.3g} MB; median |error| {median}")
    return lines


def write_results(out_dir: Path, results: Sequence[TunedCap], start_mb: float | None) -> None:
    """``tune.json``, and the same table in summary.json (``tune``) and summary.md."""
    rows = [{**asdict(r), "error": r.error} for r in results]
    (out_dir / TUNE_FILE_NAME).write_text(json.dumps({"start_mb": start_mb, "caps": rows}, indent=1))
    summary_json = out_dir / "summary.json"
    if summary_json.exists():
        summary = json.loads(summary_json.read_text())
        summary["tune"] = {"start_mb": start_mb, "caps": rows}
        summary_json.write_text(json.dumps(summary, indent=1))
    summary_md = out_dir / "summary.md"
    if summary_md.exists():
        lines = table(results, start_mb)
        summary_md.write_text(summary_md.read_text() + "\n## ddpwatch tune\n\n```\n" + "\n".join(lines) + "\n```\n")
