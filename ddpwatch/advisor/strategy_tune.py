"""``ddpwatch tune --strategies``: drive a running job through strategies and accumulations with
live switches, measure each, and hold the strategy simulator's predictions against them.

Each choice's prediction is made *before* the run is switched to it, from what the run had
measured until then (``strategy_advice``, on the segment then current); its measured step is the
median of its segment's counted steps, and its held and peak memory the most any rank reported
in it. The run's own starting choice, where it is one of those asked for, is measured first
where it stands. At the end the run is left on the fastest measured choice whose peak fits the
memory budget.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from instrumented_ddp.wire.messages import NOT_SWITCHABLE

from ddpwatch.advisor.bucket_sim import MIB
from ddpwatch.advisor.tune import TUNE_FILE_NAME, switch_state
from ddpwatch.advisor.strategy_advice import StrategyAdvice, StrategyRow, strategy_advice
from ddpwatch.control.relay import Relay, new_command
from ddpwatch.figures.kind_costs import KindCost
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.segments import Segment


@dataclass
class TunedStrategy:
    strategy: str
    grad_accum: int
    predicted_ms: float | None = None  # None: no prediction could be made before it ran
    measured_ms: float | None = None
    predicted_held_mib: float | None = None
    measured_held_mib: float | None = None
    predicted_peak_mib: float | None = None
    measured_peak_mib: float | None = None
    steps: int = 0
    no_prediction_because: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def error(self) -> float | None:
        """(predicted − measured) / measured, of the step."""
        if self.predicted_ms is None or not self.measured_ms:
            return None
        return (self.predicted_ms - self.measured_ms) / self.measured_ms

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "error": self.error}


@dataclass
class StrategySweep:
    """The state machine ``record`` calls after each receive (as ``tune.SweepDriver``)."""

    strategies: Sequence[str]
    grad_accums: Sequence[int]
    steps_per_choice: int
    budget_mib: float | None = None
    log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)
    connect_timeout_s: float = 120.0
    results: list[TunedStrategy] = field(default_factory=list)
    failure: str | None = None
    _queue: list[tuple[str, int]] = field(default_factory=list)
    _started: float | None = None
    _planned: bool = False
    _waiting_for: tuple[str, TunedStrategy | None] | None = None
    _final: bool = False
    _costs: dict[str, KindCost] = field(default_factory=dict)  # the latest fitted: for a segment whose calls cannot be

    def __call__(self, session: Session, relay: Relay) -> str | None:
        now = time.monotonic()
        self._started = now if self._started is None else self._started
        hello = next((s.hello for _, s in sorted(session.ranks.items()) if s.hello), None)
        if hello is None:
            if now - self._started > self.connect_timeout_s:
                self.failure = f"no run connected within {self.connect_timeout_s:g} s: nothing switched"
                return self.failure
            return None
        if not hello.switchable:
            self.failure = f"the run cannot switch ({NOT_SWITCHABLE}): nothing switched"
            return self.failure
        if session.finished:
            return "the run ended before the sweep did"
        if not self._planned:
            if problem := self._plan(session, hello.global_batch):
                self.failure = problem
                return problem
        if self._waiting_for is not None:
            return self._follow_switch(session, relay)
        segment = session.segments[-1] if session.segments else None
        if segment is None or session.segment_figures(segment, per_rank=False).steps < self.steps_per_choice:
            return None
        if self._queue:
            self._switch_to(*self._queue.pop(0), session, relay)
            return None
        if not self._final:
            return self._finish(relay)
        return "sweep done"

    def _plan(self, session: Session, global_batch: int) -> str | None:
        """The choices in order, the run's own first where it is one; or why none can run."""
        world = session.world_size
        for k in self.grad_accums:
            if global_batch and global_batch % (world * k):
                return f"--grad-accum {k} does not divide the global batch of {global_batch} over {world} ranks: nothing switched"
        choices = [(s, k) for s in self.strategies for k in self.grad_accums]
        segment = session.segments[-1] if session.segments else None
        if segment is not None and session.segment_figures(segment, per_rank=False).steps >= self.steps_per_choice:
            own = (segment.strategy, int(segment.settings.get("grad_accum") or 1))
            if own in choices:
                choices.remove(own)
                self.results.append(self._measured(session, segment, self._predicted(session, *own)))
                self.log(f"ddpwatch tune: the run trains {own[0]} at K={own[1]}: measured where it stands")
            self._queue, self._planned = choices, True
        return None

    def _predicted(self, session: Session, strategy: str, k: int) -> TunedStrategy:
        advice = strategy_advice(session, [strategy], [k], self.budget_mib, self._costs)
        if isinstance(advice, StrategyAdvice):
            self._costs = advice.costs
        if not isinstance(advice, StrategyAdvice) or not advice.rows:
            why = advice if isinstance(advice, str) else "; ".join(advice.refused) or "no row"
            return TunedStrategy(strategy, k, no_prediction_because=why)
        row: StrategyRow = advice.rows[0]
        return TunedStrategy(strategy, k, row.predicted_ms, predicted_held_mib=row.predicted_held_mib,
                             predicted_peak_mib=row.predicted_peak_mib, notes=list(row.notes))

    def _switch_to(self, strategy: str, k: int, session: Session, relay: Relay) -> None:
        tuned = self._predicted(session, strategy, k)
        command = new_command(strategy, grad_accum=k)
        relay.request(command)
        self._waiting_for = (command.command_id, tuned)
        said = f"{tuned.predicted_ms:.1f} ms predicted" if tuned.predicted_ms is not None else f"no prediction: {tuned.no_prediction_because}"
        self.log(f"ddpwatch tune: switching to {strategy} at K={k} ({said})")

    def _follow_switch(self, session: Session, relay: Relay) -> str | None:
        """After a switch: its acknowledgement, then the steps that measure it."""
        assert self._waiting_for is not None
        command_id, tuned = self._waiting_for
        state = switch_state(session, relay, command_id, self.steps_per_choice)
        if state.refused:
            self.failure = state.refused
            return self.failure
        if state.ack is not None and tuned is None:  # the final switch, to the fastest: done
            self._waiting_for = None
            return "sweep done"
        if state.segment is None or tuned is None:
            return None
        self.results.append(self._measured(session, state.segment, tuned))
        self._waiting_for = None
        self.log(f"ddpwatch tune: {tuned.strategy} at K={tuned.grad_accum} measured {tuned.measured_ms:.1f} ms "
                 f"over {tuned.steps} steps")
        return None

    def _measured(self, session: Session, segment: Segment, tuned: TunedStrategy) -> TunedStrategy:
        figures = session.segment_figures(segment, include_pending=False, per_rank=False)
        tuned.measured_ms, tuned.steps = figures.step_ms_p50, figures.steps
        memory = figures.memory or measured_in(session, segment)
        held = sum(memory.get(kind, 0) for kind in ("parameters", "gradients", "optimizer_state"))
        tuned.measured_held_mib = held / MIB if held else None
        tuned.measured_peak_mib = memory["peak"] / MIB if memory.get("peak") else None
        return tuned

    def _finish(self, relay: Relay) -> str | None:
        """Leave the run on the fastest measured choice that fits."""
        self._final = True
        fits = [r for r in self.results if r.measured_ms and (self.budget_mib is None or (r.measured_peak_mib or r.measured_held_mib or 0) <= self.budget_mib)]
        if not fits:
            self.log("ddpwatch tune: no choice measured fits the budget; the run stays where it is")
            return "sweep done"
        best = min(fits, key=lambda r: r.measured_ms or 0.0)
        if self.results and best is self.results[-1]:
            return "sweep done"
        command = new_command(best.strategy, grad_accum=best.grad_accum)
        relay.request(command)
        self._waiting_for = (command.command_id, None)
        self.log(f"ddpwatch tune: leaving the run on the measured fastest that fits, {best.strategy} at K={best.grad_accum}")
        return None


def strategy_table(results: Sequence[TunedStrategy]) -> list[str]:
    """The sweep as printed and written: each choice predicted against measured, step and memory;
    then the measured fastest and the step prediction's median |error|."""
    def cell(value: float | None, digits: int = 1) -> str:
        return f"{value:.{digits}f}" if value is not None else "—"

    lines = [f"{'strategy':>9} {'K':>2} {'pred ms':>8} {'meas ms':>8} {'error':>7} {'pred held':>10} {'meas held':>10} "
             f"{'pred peak':>10} {'meas peak':>10}  (MiB a rank)"]
    for r in results:
        error = f"{r.error:+.1%}" if r.error is not None else "—"
        lines.append(f"{r.strategy:>9} {r.grad_accum:>2} {cell(r.predicted_ms):>8} {cell(r.measured_ms):>8} {error:>7} "
                     f"{cell(r.predicted_held_mib, 2):>10} {cell(r.measured_held_mib, 2):>10} "
                     f"{cell(r.predicted_peak_mib):>10} {cell(r.measured_peak_mib):>10}")
    for r in results:
        if r.predicted_ms is None and r.no_prediction_because:
            lines.append(f"no prediction for {r.strategy} at K={r.grad_accum}: {r.no_prediction_because}")
    derived = sorted({note for r in results for note in r.notes})
    if derived:
        lines.append("modelled, not measured: " + "; ".join(derived))
    measured = [r for r in results if r.measured_ms]
    if measured:
        best = min(measured, key=lambda r: r.measured_ms or 0.0)
        lines.append(f"measured fastest: {best.strategy} at K={best.grad_accum}, {best.measured_ms:.1f} ms")
    errors = [abs(r.error) for r in results if r.error is not None]
    if errors:
        lines.append(f"step time: median |error| {statistics.median(errors):.1%} over {len(errors)} choices")
    return lines


def write_strategy_results(out_dir: Path, results: Sequence[TunedStrategy]) -> None:
    """``tune.json``'s ``strategies``, and the same list in summary.json (``tune``) and summary.md."""
    rows = [r.as_dict() for r in results]
    (out_dir / TUNE_FILE_NAME).write_text(json.dumps({"strategies": rows}, indent=1))
    summary_json = out_dir / "summary.json"
    if summary_json.exists():
        summary = json.loads(summary_json.read_text())
        summary["tune"] = {"strategies": rows}
        summary_json.write_text(json.dumps(summary, indent=1))
    summary_md = out_dir / "summary.md"
    if summary_md.exists():
        text = "\n".join(strategy_table(results))
        summary_md.write_text(summary_md.read_text() + "\n## ddpwatch tune --strategies\n\n```\n" + text + "\n```\n")


def measured_in(session: Session, segment: Segment) -> dict[str, int]:
    """The most any rank held, per memory kind, as its newest report within ``segment``'s steps
    measured it: a rank measures memory on the second step of each strategy and every few after
    (``instrumented_ddp.resources.memory``), and that step may be one the figures leave out (a
    step still waiting for a rank, or one excluded from the statistics)."""
    most: dict[str, int] = {}
    for state in session.ranks.values():
        if state.memory and segment.first_step <= state.memory_step <= segment.last_step:
            for kind, nbytes in state.memory.items():
                most[kind] = max(nbytes, most.get(kind, 0))
    return most
