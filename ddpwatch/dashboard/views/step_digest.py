"""What the dashboard keeps of one step for its trends, its header and the straggler rule."""

from __future__ import annotations

from dataclasses import dataclass

from instrumented_ddp.wire import step_figures
from instrumented_ddp.wire.messages import StepReport


@dataclass(frozen=True)
class StepDigest:
    """What the trends, the header and the straggler rule need from one step, so a frame reads
    ``TREND_POINTS`` of these rather than every rank's report of as many steps. Only reports
    that are ``metrics.counted`` enter it."""

    step: int
    seen: int  # reports the step had when this was made (counted or not): the cache key
    ranks: int  # counted reports it was computed from
    loss: float | None  # mean over ranks that reported one (NaN left out)
    step_ms: float  # mean over ranks
    wall_s: float  # the slowest rank's window: the step took that long for everyone
    samples: int
    times: dict[int, step_figures.StepTimes]  # per rank, to put the ranks on one clock


def digest_of(step: int, reports: dict[int, StepReport], figures: dict[int, step_figures.StepFigures]) -> StepDigest:
    """``figures``: the session's step figures, which exist for counted reports only."""
    counted = [(r, figures[rank]) for rank, r in reports.items() if rank in figures and step_figures.counted(r)]
    losses = [r.loss for r, _ in counted if r.loss is not None and r.loss == r.loss]
    windows = [f.step_ms for _, f in counted]
    return StepDigest(step, len(reports), len(counted), sum(losses) / len(losses) if losses else None,
                      sum(windows) / len(windows) if windows else 0.0, max(windows, default=0.0) / 1000,
                      sum(f.samples for _, f in counted), {f.rank: f.times for _, f in counted})
