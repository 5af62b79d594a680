"""The devices tab's series, made from a snapshot's device samples and kept while those are."""

from __future__ import annotations

from ddpwatch.dashboard.views.snapshot_parts import DeviceSeries
from ddpwatch.dashboard.widgets.sparkline_list import Series


class DeviceSeriesCache:
    """Turns a snapshot's ``DeviceSeries`` into the sparklines' ``Series``, made again only when
    they are new: a series per rank made and compared every frame costs more than drawing them."""

    def __init__(self) -> None:
        self._shown: tuple[tuple[DeviceSeries, ...] | None, tuple[Series, ...]] = (None, ())
        self._made: dict[int, tuple[DeviceSeries, Series]] = {}  # rank -> (its series, as drawn)

    def clear(self) -> None:
        """Forgets every series made (a new run on screen)."""
        self._made.clear()
        self._shown = (None, ())

    def series(self, devices: tuple[DeviceSeries, ...]) -> tuple[Series, ...]:
        """The devices tab's series, the same tuple while ``devices`` is the same (a large job's
        are kept for ``LARGE_JOB_ROWS_REFRESH_S``)."""
        if self._shown[0] is not devices:
            self._shown = (devices, tuple(self._series_of(d) for d in devices))
        return self._shown[1]

    def _series_of(self, device: DeviceSeries) -> Series:
        """One rank's series, the same object while its ``DeviceSeries`` is (the sparklines then
        compare it by identity, and no garbage is made for a rank that sent nothing new)."""
        kept = self._made.get(device.rank)
        if kept is None or kept[0] is not device:
            kept = self._made[device.rank] = (device, Series(f"rank {device.rank} {device.label}", device.values, "%"))
        return kept[1]
