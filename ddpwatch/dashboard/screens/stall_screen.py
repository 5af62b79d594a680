"""``w``: the stall view: per rank, its phase, the collective it waits in, its numbers, its stack."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.content import Content
from textual.screen import ModalScreen
from textual.widgets import Static

from ddpwatch.wording.stall_text import call_text, place_of

STACK_LINES = 12  # the innermost frames shown of each rank's stack


def stall_view_text(stall: Mapping[str, Any] | None, line: str) -> Content:
    """The stall as styled text: its line, then a block per rank (culprits first). None: there is
    no stall to show, said as such."""
    if stall is None:
        return Content.assemble(("No stall", "bold"), "\n\nThe run is not stalled: every rank finishes its steps.\n\n",
                                ("escape to close", "dim"))
    culprits = list(stall["culprits"])
    ranks = sorted({int(r) for key in ("phases", "stacks", "in_flight", "issued") for r in stall.get(key, {})}
                   | set(culprits) | set(stall["waiting"]), key=lambda r: (r not in culprits, r))
    parts: list[str | tuple[str, str]] = [(f"Stall: {stall['kind']}", "bold"), "\n", line, "\n"]
    for rank in ranks:
        key = str(rank)
        role = "holds the others" if rank in culprits else "waits" if rank in stall["waiting"] else ""
        parts += ["\n", (f"rank {rank}", "bold"), f"  {role}\n" if role else "\n"]
        phase = stall.get("phases", {}).get(key)
        if phase:
            parts.append(f"  phase: {phase.replace('_', ' ')}\n")
        call = stall.get("in_flight", {}).get(key)
        parts.append(f"  in flight: {call_text(call)}, {call['waited_s']:.1f} s\n" if call else "  in flight: nothing\n")
        issued = stall.get("issued", {}).get(key)
        if issued:
            parts.append("  issued: " + ", ".join(f"{n} on {group}" for group, n in issued.items()) + "\n")
        stack = stall.get("stacks", {}).get(key, [])
        if stack:
            here = place_of(stall, rank)
            for frame in stack[-STACK_LINES:]:
                parts.append((f"    {frame}\n", "bold") if frame == here else f"    {frame}\n")
        native = stall.get("native_stacks", {}).get(key, [])
        if native:
            parts.append("  native:\n")
            parts += [f"    {frame}\n" for frame in native[-STACK_LINES:]]
        elif stall.get("native_errors", {}).get(key):
            parts.append(f"  native: {stall['native_errors'][key]}\n")
    parts += ["\n", ("escape to close", "dim")]
    return Content.assemble(*parts)


class StallScreen(ModalScreen[None]):
    BINDINGS = [("escape,w,q", "dismiss", "close")]

    def __init__(self, stall: Mapping[str, Any] | None, line: str) -> None:
        super().__init__()
        self.stall, self.line = stall, line

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="stall-box"):
            yield Static(stall_view_text(self.stall, self.line), id="stall-text")

    def action_dismiss(self) -> None:  # type: ignore[override]
        self.dismiss(None)
