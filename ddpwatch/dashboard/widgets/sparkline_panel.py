"""Labelled sparklines: device utilization per rank, and loss and step time over steps."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Label, Sparkline

from ..snapshot import DeviceSeries


class SparklineRow(VerticalScroll):
    """A label with the latest value over a sparkline."""

    DEFAULT_CSS = "SparklineRow { height: 3; } SparklineRow > Label { width: 1fr; height: 1; }"

    def compose(self) -> ComposeResult:
        self._label, self._sparkline = Label(), Sparkline([])
        yield self._label
        yield self._sparkline

    def show(self, label: str, values: tuple[float, ...], unit: str = "") -> None:
        if not self.is_mounted or (label, values) == getattr(self, "_shown", None):
            return
        self._shown = (label, values)
        latest = f"{values[-1]:.3g}{unit}" if values else "—"
        low_high = f" (min {min(values):.3g}, max {max(values):.3g})" if values else ""
        self._label.update(f"{label}: [b]{latest}[/b]{low_high}", layout=False)  # one line, full width
        self._sparkline.data = list(values) or [0.0]


class DevicePanel(VerticalScroll):
    """One sparkline per rank: GPU utilization through NVML, or CPU% where there is no GPU."""

    def show(self, series: tuple[DeviceSeries, ...]) -> None:
        rows: list[SparklineRow] = getattr(self, "_rows", [])
        if len(rows) != len(series):
            self.remove_children()
            self._rows = [SparklineRow() for _ in series]
            self.mount_all(self._rows)
            return  # filled on the next frame, once mounted
        for row, item in zip(rows, series):
            row.show(f"rank {item.rank} {item.label}", item.values, "%")


class TrendsPanel(VerticalScroll):
    def compose(self) -> ComposeResult:
        self._loss, self._step = SparklineRow(id="loss-trend"), SparklineRow(id="step-trend")
        yield self._loss
        yield self._step

    def show(self, loss: tuple[float, ...], step_ms: tuple[float, ...]) -> None:
        self._loss.show("loss (mean over ranks)", loss)
        self._step.show("step time", step_ms, " ms")
