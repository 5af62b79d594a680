"""A segment: a run of consecutive steps under one strategy and settings, and the labels that
name it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ddpwatch.figures.metrics import SegmentAccumulator
from instrumented_ddp.wire.messages import StepReport

#: The settings a segment's label names: what tells a strategy's segments apart, HSDP's
#: replicas (an attached FSDP2 model on a 2-D mesh: ``fsdp (grad_accum=1, replicas=2)``) and an
#: attached DDP's own communication hook (``ddp (bucket_mb=25.0, comm_hook=fp16_compress_hook, ...)``).
LABELLED_SETTINGS = ("bucket_mb", "comm_hook", "grad_accum", "replicas")


def strategy_label(strategy: str, settings: Mapping[str, Any]) -> str:
    """``bucket (bucket_mb=1.0, grad_accum=1)``: the strategy and the settings that tell its
    segments apart, as the segments table and the timeline's title name them."""
    shown = ", ".join(f"{k}={v}" for k, v in sorted(settings.items()) if k in LABELLED_SETTINGS)
    return f"{strategy} ({shown})" if shown else strategy


def short_strategy_label(strategy: str, settings: Mapping[str, Any]) -> str:
    """``bucket 1 MB``, ``ga accum 2``, ``fsdp 2 replicas``, ``ddp 25 MB fp16_compress``: the same settings as
    ``strategy_label`` in the words a column has room for, an accumulation of 1 (no accumulation)
    left unsaid. The segments table's first column: at 160 columns the long label
    (``bucket (bucket_mb=1.0, grad_accum=1)``) leaves step ms and samples/s no room."""
    words = [strategy]
    if "bucket_mb" in settings:
        cap = settings["bucket_mb"]
        words.append(f"{cap:g} MB" if isinstance(cap, (int, float)) else f"{cap} MB")
    if "comm_hook" in settings:
        words.append(str(settings["comm_hook"]).removesuffix("_hook"))
    if settings.get("grad_accum", 1) != 1:
        words.append(f"accum {settings['grad_accum']}")
    if "replicas" in settings:
        words.append(f"{settings['replicas']} replicas")
    return " ".join(words)


@dataclass
class Segment:
    """A run of consecutive steps under one strategy and settings."""

    index: int
    strategy: str
    settings: dict[str, Any]
    first_step: int
    last_step: int
    #: steps the session no longer keeps, already folded into running figures
    folded: SegmentAccumulator | None = field(default=None, compare=False, repr=False)

    @property
    def folded_records(self) -> int:
        """(rank, step) reports folded so far: the segment's figures change only when this does."""
        return self.folded.records if self.folded is not None else 0

    @property
    def label(self) -> str:
        return strategy_label(self.strategy, self.settings)

    @property
    def short_label(self) -> str:
        return short_strategy_label(self.strategy, self.settings)

    def holds(self, step: int) -> bool:
        return self.first_step <= step <= self.last_step

    def runs(self, report: StepReport) -> bool:
        """Whether ``report`` ran under this segment's strategy and settings."""
        return self.strategy == report.strategy and self.settings == report.settings
