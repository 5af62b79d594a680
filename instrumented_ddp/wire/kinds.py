"""The names both sides read alike: strategies, the kinds of a span, a barrier's tag, memory kinds.

A newer ddpwatch may add a kind; ``messages`` tells such a name from garbage.
"""

from __future__ import annotations

from typing import Any

#: What users type; instrumented_ddp agrees. The last three shard state (ZeRO-1, ZeRO-2, FSDP2).
STRATEGY_NAMES = ("simple", "ga", "hook", "async", "bucket", "ddp", "zero1", "zero2", "fsdp")
#: The model's phases, timed from its hooks and its optimizer's.
MODEL_COMPUTE_KINDS = ("forward", "backward", "optimizer")
#: The loop's own compute outside them, where the loop marks it (``Attachment.computing``: a
#: teacher's forward in distillation, an average of the weights after the update); its ``tag``
#: is what the loop said it computes. Compute, not data loading.
LOOP_COMPUTE_KIND = "loop"
COMPUTE_KINDS = (*MODEL_COMPUTE_KINDS, LOOP_COMPUTE_KIND)
#: Collectives. ``nbytes`` of a ``reduce_scatter`` is its input, of an ``all_gather`` its output:
#: the whole tensor, as nccl-tests counts them, so bandwidths compare across kinds; of an
#: ``all_to_all`` its input (all a rank sends), of a ``gather`` or a ``scatter`` one rank's piece
#: times the group's ranks (the root's whole list), the same on every rank. The last four (a
#: ``reduce`` to one rank: a loss reduced to rank 0 for its log; an ``all_to_all``: an exchange
#: between the model's phases; a ``gather`` or ``scatter`` to or from one rank: an evaluation's
#: predictions) are sent only by a loop that issues one: a ddpwatch that does not know them
#: rejects a report holding one as another ddpwatch's (``unknown_type``).
COMM_KINDS = ("all_reduce", "broadcast", "reduce_scatter", "all_gather", "reduce", "all_to_all", "gather", "scatter")
#: The tag of a ``wait`` span that is a barrier the loop issued (``dist.barrier``): the time the rank
#: sat blocked until every rank of its group arrived. A collective with nothing to carry (no bytes,
#: no transfer to tell from waiting), so a wait, and one of the step's timed collectives. A barrier
#: on a group of the loop's own is ``barrier@<group name>`` (``barrier_tag``).
BARRIER_TAG = "barrier"
#: A zero-length mark: when the gradients of parameter ``p<i>`` or bucket ``b<i>`` (the hello's
#: ``bucket_layout``) were all ready in backward, ``nbytes`` of them; the bucket advisor replays
#: backward from these. Not compute, not communication: no figure counts it.
READY_KIND = "ready"
SPAN_KINDS = (*COMPUTE_KINDS, *COMM_KINDS, "wait", "data", READY_KIND)
#: What a step's ``memory`` may name: bytes a rank held (``instrumented_ddp.resources.memory``).
MEMORY_KINDS = ("parameters", "gradients", "optimizer_state", "peak")


def barrier_tag(group_name: str = "") -> str:
    """The tag of a barrier's wait: ``BARRIER_TAG`` for the world's, ``barrier@<name>`` for one on
    another group (c10d's name of it, the same on each of its ranks): pairing calls across ranks
    by tag, a barrier of a group then meets only that group's, never another group's or the world's."""
    return f"{BARRIER_TAG}@{group_name}" if group_name else BARRIER_TAG


def is_barrier_wait(span: Any) -> bool:
    """Whether ``span`` (a ``Span``, or a rank's pending one) is the wait of a barrier the loop issued."""
    return bool(span.kind == "wait" and (span.tag == BARRIER_TAG or span.tag.startswith(BARRIER_TAG + "@")))
