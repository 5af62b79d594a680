"""``?``: every key the dashboard knows."""

from __future__ import annotations

import textwrap

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static

from instrumented_ddp.wire.kinds import STRATEGY_NAMES

KEYS = [
    ("?", "this help"),
    ("q", "quit (the session is already on disk)"),
    ("space", "pause / follow the latest step"),
    ("← / →", "previous / next step (pauses)"),
    ("end", "back to the latest step"),
    ("shift ← / →", "ranks table: a column left / right (the rank stays in view)"),
    ("s", "pick a strategy and settings to switch to"),
    # from the list the keys are bound from (``DashboardApp.BINDINGS``), so it names every strategy
    (f"1 … {len(STRATEGY_NAMES)}", f"switch to {', '.join(STRATEGY_NAMES)}"),
    ("+ / -", "double / halve bucket_mb (switches)"),
    ("] / [", "grad_accum + 1 / - 1 (switches)"),
    ("e", "export summary.json/.md/.csv/.svg, trace.json and an SVG screenshot"),
    ("w", "the stall view: each rank's phase, collective in flight, its numbers and stack"),
    ("t / T", "side panel: next / previous tab (devices, loss, heatmap, stragglers, advisor)"),
    ("h", "heatmap tab: exposed comm % / step time / waited ms"),
    ("b", "advisor tab: switch to the predicted best bucket cap"),
    ("B", "advisor tab: switch to the fastest strategy that fits the memory budget"),
    ("> / <", "replay: twice / half the speed"),
    ("mouse", "click a rank row to highlight it in the timeline; click tabs; scroll any panel"),
]


KEY_WIDTH = 11
#: ``#help-box``'s 80 columns less its border and padding (``dashboard.tcss``).
TEXT_WIDTH = 80 - 2 - 4


def help_text(switching_off: str | None = None) -> Content:
    """The keys as styled text, not markup: a key such as ``] / [`` is not a tag to escape (an
    escaped ``[`` at the end of a key would still meet the closing ``[/b]``). A long
    description wraps under itself, not under the keys. ``switching_off``: why this run's switch
    keys are not offered (a replay, a run ddpwatch did not start), said first: the list names
    them all the same."""
    parts: list[str | tuple[str, str]] = [("ddpwatch keys", "bold"), "\n\n"]
    if switching_off:
        parts += [(line + "\n", "italic") for line in textwrap.wrap(f"Not offered here ({switching_off}): s, 1 … "
                                                                      f"{len(STRATEGY_NAMES)}, + -, ] [ and b.", TEXT_WIDTH)]
        parts += ["\n"]
    indent = " " * (KEY_WIDTH + 2)
    for key, what in KEYS:
        lines = textwrap.wrap(what, TEXT_WIDTH - len(indent))
        parts += [(key.rjust(KEY_WIDTH), "bold"), f"  {lines[0]}\n", *(f"{indent}{line}\n" for line in lines[1:])]
    parts += ["\n", ("escape to close", "dim")]
    return Content.assemble(*parts)


class HelpScreen(ModalScreen[None]):
    BINDINGS = [("escape,question_mark,q", "dismiss", "close")]

    def __init__(self, switching_off: str | None = None) -> None:
        super().__init__()
        self.switching_off = switching_off

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box"):
            yield Static(help_text(self.switching_off), id="help-text")

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)
