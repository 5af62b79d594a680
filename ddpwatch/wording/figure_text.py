"""How the figures are written, on screen and in summary.md alike: call counts, collective kinds,
bandwidths, memory held, and the note a one-rank run gets. Pure: numbers in, short text out.
"""

from __future__ import annotations

from collections.abc import Mapping

#: A one-rank all-reduce is a local blip inside backward: Overlap% reads 100 and busbw 0 (nccl-tests'
#: bus factor for one rank), true by their definitions and telling nothing. The dashboard's notes
#: and summary.md say so.
ONE_RANK_NOTE = ("one rank: its collectives move nothing, so Overlap%, busbw and waits say nothing about communication "
                 "(torchrun --nproc_per_node=2 or more)")

#: How the segments table and summary.md name the collectives that are not all-reduces.
KIND_SHORT = {"all_reduce": "AR", "reduce_scatter": "RS", "all_gather": "AG", "broadcast": "BC", "reduce": "RD",
              "all_to_all": "A2A", "gather": "GA", "scatter": "SC"}


def calls_text(calls_per_rank_per_step: float) -> str:
    """A per-rank-per-step call count: a whole number as one ("57"), a mean that is not whole with
    up to two decimals ("56.5")."""
    text = f"{calls_per_rank_per_step:.2f}".rstrip("0").rstrip(".")
    return text if text not in ("", "-0") else "0"


def kinds_text(calls_by_kind: Mapping[str, float]) -> str:
    """Calls per rank per step of every kind but all-reduce (which has its own column), as
    ``RS 3 AG 5``; a dash when there are none."""
    parts = [f"{KIND_SHORT.get(kind, kind)} {calls_text(n)}" for kind, n in sorted(calls_by_kind.items())
             if kind != "all_reduce" and n > 0]
    return " ".join(parts) or "—"


def busbw_text(all_reduce_gbps: float | None, other_gbps: Mapping[str, float | None]) -> str:
    """Each collective kind's busbw, GB/s, the all-reduces' first, as ``AR 3.12 AG 0.32 RS 0.16``
    (``Figures.busbw_gbps``, ``SegmentFigures.other_busbw_gbps``); a dash without any."""
    by_kind = {"all_reduce": all_reduce_gbps, **dict(sorted(other_gbps.items()))}
    return " ".join(f"{KIND_SHORT.get(kind, kind)} {gbps_text(value)}" for kind, value in by_kind.items() if value is not None) or "—"


def gbps_text(gbps: float) -> str:
    """Two decimals, or two significant digits under 0.01 GB/s, so that a collective of a few
    hundred bytes (DDP's broadcast of its buffers each forward) does not read "0.00", as if
    nothing moved."""
    return f"{gbps:.2f}" if gbps >= 0.01 or gbps == 0 else f"{gbps:.2g}"


def held_text(memory: Mapping[str, int]) -> str:
    """Parameters/gradients/optimizer state held, MiB, as ``9.3/9.3/18.6``: the memory staircase of
    DDP, ZeRO-1, ZeRO-2 and FSDP read across a row; a dash before any measurement. Under 0.1 MiB
    to the KiB (``0.016``), under that ``<0.001``, so that a small model's 16 KB does not read
    0.0, as if nothing were held."""
    if not memory:
        return "—"
    return "/".join(mib_text(memory.get(kind, 0) / 2**20) for kind in ("parameters", "gradients", "optimizer_state"))


def mib_text(mib: float) -> str:
    """One memory figure of ``held_text``, in MiB."""
    if mib >= 0.1 or mib == 0:
        return f"{mib:.1f}"
    return f"{mib:.3f}" if mib >= 0.001 else "<0.001"
