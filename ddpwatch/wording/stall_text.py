"""The words for a stall: one line that names who holds the run, in what, and where.

"rank 1 has not reached all_reduce b0 (#21 on the default group) of step 21, which rank 0 has
waited in for 12 s; rank 1 is at hang_probe.py:31 main: time.sleep(40)". Made from a stall as
``stalls.json`` holds it (``figures.stalls.Stall.as_dict``), so the dashboard, the recorder and
summary.md say the same. A rank's place is the innermost frame of its stack outside torch and
ddpwatch, the line a user wrote, or else the innermost frame.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ddpwatch.wording.rank_lists import rank_list

#: Frames in these are the libraries', not the user's: the place named is the innermost frame outside them.
LIBRARY_PARTS = ("torch/", "instrumented_ddp/", "ddpwatch/", "threading.py", "contextlib.py")


def place_in(stack: Sequence[str]) -> str:
    """Where a stack says its thread is: the innermost frame outside the libraries ("" for none)."""
    for line in reversed(stack):
        if not any(part in line.split(":", 1)[0] for part in LIBRARY_PARTS):
            return line
    return stack[-1] if stack else ""


def call_text(call: Mapping[str, Any]) -> str:
    """``all_reduce b0 (#21 on the default group)``."""
    group = "the default group" if call.get("group", "default") == "default" else f"group {call['group']}"
    return f"{call['kind']} {call.get('tag') or '(untagged)'} (#{call.get('seq', 0)} on {group})"


def stall_line(stall: Mapping[str, Any], held_s: float) -> str:
    """The stall in one line; ``held_s``: how long it has lasted (or lasted)."""
    kind, step, held = stall["kind"], stall["step"], f"{held_s:.0f} s"
    culprits, waiting, call = list(stall["culprits"]), list(stall["waiting"]), stall.get("collective")
    stacks, phases = stall.get("stacks", {}), stall.get("phases", {})
    where = _places(culprits, stacks, phases)
    if kind == "lost":
        text = f"{rank_list(culprits)} went silent at step {step}"
        if waiting and call:
            text += f"; {rank_list(waiting)} {_have(waiting)} waited in {call_text(call)} for {held}"
        return text
    if kind == "behind" and call:
        text = (f"{rank_list(culprits)} {_have(culprits)} not reached {call_text(call)} of step {step}, which "
                f"{rank_list(waiting)} {_have(waiting)} waited in for {held}")
        return f"{text}; {where}" if where else text
    if kind == "behind":
        text = f"no rank is in a collective, and no step has ended for {held} (step {step})"
        return f"{text}; {where}" if where else text
    if kind == "in_collective" and call:
        return f"every rank has been in {call_text(call)} of step {step} for {held}: the collective itself is slow"
    sides = "; ".join(f"rank {rank} in {call_text(side)}{_from(stacks.get(rank, []))}"
                      for rank, side in sorted(stall.get("in_flight", {}).items(), key=lambda item: int(item[0])))
    return f"the ranks are in different collectives at step {step} for {held}: {sides}"


def _places(ranks: Sequence[int], stacks: Mapping[str, list[str]], phases: Mapping[str, str]) -> str:
    parts = []
    for rank in ranks:
        place, phase = place_in(stacks.get(str(rank), [])), phases.get(str(rank), "")
        if place:
            parts.append(f"rank {rank} is at {place}")
        elif phase:
            parts.append(f"rank {rank} is in {phase.replace('_', ' ')}")
    return "; ".join(parts)


def _have(ranks: Sequence[int]) -> str:
    return "has" if len(ranks) == 1 else "have"


def _from(stack: Sequence[str]) -> str:
    place = place_in(stack)
    return f", from {place}" if place else ""
