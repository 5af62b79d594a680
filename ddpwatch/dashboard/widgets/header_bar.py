"""Session, world size, strategy and settings, progress with ETA, global throughput."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.containers import Horizontal
from textual.widgets import ProgressBar, Static

from instrumented_ddp.wire.messages import NOT_SWITCHABLE

from ddpwatch.dashboard.views.snapshot_parts import HeaderData


def format_eta(seconds: float | None) -> str:
    if seconds is None:
        return "ETA —"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"ETA {minutes}:{secs:02d}"


class HeaderBar(Horizontal):
    """Two lines: the first says which run and where it comes from (fixed), the second what it is
    doing now (strategy, step, ETA, throughput, what watching costs it, then the strategy's settings), so that each is cut
    at its end on a narrow terminal and the live figures are never the part cut. A run that
    cannot switch gets a third line saying why, alone on it so that nothing before it pushes it
    out of view."""

    def compose(self) -> ComposeResult:
        self._text = Static(id="header-text")
        self._progress = ProgressBar(show_eta=False, id="header-progress")
        yield self._text
        yield self._progress

    def show(self, data: HeaderData, source: str, source_ended: bool = False) -> None:
        """``source_ended``: nothing more will come from the feed (a replay at its end). A run
        recorded without its goodbyes (a demo quit, a job killed) then reads "ended", with no ETA,
        not "live" as if it still trained. A run over says so here, not only in the ranks table."""
        mode = ("paused" if not data.following else "failed" if data.failed else "interrupted" if data.interrupted
                else "finished" if data.finished else "ended" if source_ended
                else "stalled" if data.stalled_s is not None
                else "live")  # failed: a rank's training raised; interrupted: a signal stopped one (the warnings say)
        eta = None if mode in ("ended", "failed", "interrupted") else data.eta_s  # a run that will not go on
        # Last on the line: an attached DDP's hook makes them long, and a narrow header cuts them,
        # not the step, ETA and samples/s.
        settings = f" · {data.settings}" if data.settings else ""
        # Its own line: at the end of either other line, after the session's name or the
        # settings, a narrow terminal cuts it.
        cannot_switch = "" if data.switchable else f"\n[b]{NOT_SWITCHABLE}[/b]"
        # A stalled run has no rate and no ETA to give: how long no step has come, instead.
        progress = (f"[b red]stalled {data.stalled_s:.0f} s[/b red]" if data.stalled_s is not None and data.following
                    else f"{format_eta(eta)} · {'—' if data.samples_per_s is None else f'{data.samples_per_s:.1f}'} samples/s")
        # After the rate, before the settings: the first line's source (a recording's path) is
        # long enough to push it out of view there.
        cost = f" · {data.watch_overhead.short()}" if data.watch_overhead is not None else ""
        text = (
            f"[b]ddpwatch[/b] {data.session} · {data.world_size} rank{'' if data.world_size == 1 else 's'} · "
            f"[i]{mode}[/i] · [dim]{source}[/dim]\n"
            f"[b]{data.strategy}[/b] · step {data.step}/{data.total_steps or '?'} · {progress}{cost}{settings}{cannot_switch}"
        )
        self.set_class(not data.switchable, "-not-switchable")
        if text != getattr(self, "_shown", None):  # fixed size (see dashboard.tcss): no layout pass
            self._shown = text
            self._text.update(text, layout=False)
            self._progress.update(total=data.total_steps or None, progress=data.step)
