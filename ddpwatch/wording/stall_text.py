"""The words for a stall: one line that names who holds the run, in what, and where.

"rank 1 has not reached all_reduce b0 (#21 on the default group) of step 21, which rank 0 has
waited in for 12 s; rank 1 is at hang_probe.py:31 main: time.sleep(40)". Made from a stall as
``stalls.json`` holds it (``figures.stalls.Stall.as_dict``), so the dashboard, the recorder and
summary.md say the same. A rank's place is the innermost frame of its stack in the user's own
code, as the rank itself told it (``StallProbe.place``), or else its innermost frame.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from ddpwatch.wording.rank_lists import rank_list

def place_of(stall: Mapping[str, Any], rank: int | str) -> str:
    """Where a rank of the stall is held: its place, else its stack's innermost frame ("" for none)."""
    place = stall.get("places", {}).get(str(rank), "")
    stack = stall.get("stacks", {}).get(str(rank), [])
    return str(place) if place else (str(stack[-1]) if stack else "")


def call_text(call: Mapping[str, Any]) -> str:
    """``all_reduce b0 (#21 on the default group)``."""
    name = str(call.get("group", "default"))
    group = "the default group" if name == "default" else name if name.startswith("group ") else f"group {name}"
    return f"{call['kind']} {call.get('tag') or '(untagged)'} (#{call.get('seq', 0)} on {group})"


def stall_line(stall: Mapping[str, Any], held_s: float) -> str:
    """The stall in one line; ``held_s``: how long it has lasted (or lasted)."""
    kind, step, held = stall["kind"], stall["step"], f"{held_s:.0f} s"
    culprits, waiting, call = list(stall["culprits"]), list(stall["waiting"]), stall.get("collective")
    where = _places(culprits, stall)
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
        text = f"every rank has been in {call_text(call)} of step {step} for {held}: the collective itself is slow, or its link"
        place = next((place for rank in waiting if (place := place_of(stall, rank))), "")
        return f"{text}; issued at {place}" if place else text
    sides = "; ".join(f"rank {rank} in {call_text(side)}{_from(place_of(stall, rank))}"
                      for rank, side in sorted(stall.get("in_flight", {}).items(), key=lambda item: int(item[0])))
    return f"the ranks are in different collectives at step {step} for {held}: {sides}"


def _places(ranks: Sequence[int], stall: Mapping[str, Any]) -> str:
    parts = []
    for rank in ranks:
        place, phase = place_of(stall, rank), stall.get("phases", {}).get(str(rank), "")
        if place:
            parts.append(f"rank {rank} is at {place}")
        elif phase:
            parts.append(f"rank {rank} is in {phase.replace('_', ' ')}")
    return "; ".join(parts)


def _have(ranks: Sequence[int]) -> str:
    return "has" if len(ranks) == 1 else "have"


def _from(place: str) -> str:
    return f", from {place}" if place else ""
