"""What the warnings panel says of a session, in plain words. Faults: lost and failed ranks (and the
live ranks a lost one holds in a collective), steps sent unresolved, telemetry dropped or rejected,
all-reduce groups the hellos contradict. Notes, not faults: ranks a recording ends with, reports that came late, device notes, skipped optimizer updates, steps that compiled,
collectives not timed, ranks whose steps stopped while the others' went on.

Pure functions of the session and of the time on its arrivals' clock (``heard``); the snapshot
builder puts the desync and the straggler it keeps cached among them and paces how often they
are made. Many ranks saying the same thing say it in one line (a node gone takes eight at once,
and a thousand lines would each change every frame).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from instrumented_ddp.wire.codec import PROTOCOL_VERSION

from ddpwatch.figures.compact_steps import StepSet
from ddpwatch.wording.figure_text import ONE_RANK_NOTE
from ddpwatch.wording.rank_lists import (FEW_RANKS, detached_ranks_lines, failed_ranks_lines, heard_until_text, held_by_lost_lines,
                                 interrupted_ranks_lines, lost_ranks_lines, ranks_text, runs_text, step_range_text)
from ddpwatch.ingest.session import Session


def lost_rank_lines(session: Session, heard: float) -> list[str]:
    """The ranks silent past ``LOST_AFTER_S`` at ``heard`` (``rank_lists.lost_ranks_lines``), the live
    ranks they hold in a collective (``Session.ranks_held_by_lost``), then the ranks whose goodbye
    said their training failed, and why (``rank_lists.failed_ranks_lines``)."""
    held, lost = session.ranks_held_by_lost(heard)
    return (lost_ranks_lines({rank: heard - last_seen for rank, last_seen in lost.items()}) + held_by_lost_lines(held, lost, heard)
            + failed_ranks_lines(session.failed_ranks, session.first_failed_rank))


def reporting_fault_lines(session: Session) -> list[str]:
    """What went wrong in what the ranks reported: steps sent unresolved, telemetry discarded by
    a sender or lost in transit, all-reduce groups the hellos contradict, rejected messages."""
    lines = []
    unresolved = {rank: state.unresolved for rank, state in sorted(session.ranks.items()) if state.unresolved}
    reasons = Counter(session.ranks[rank].unresolved_reason for rank in unresolved if session.ranks[rank].unresolved_reason)
    if len(unresolved) > FEW_RANKS:
        why = f"; most often: {reasons.most_common(1)[0][0]}" if reasons else ""
        lines.append(f"{len(unresolved)} ranks sent {sum(unresolved.values())} steps unresolved (timing marks never "
                     f"completed; left out of the figures): ranks {ranks_text(unresolved)}{why}")
    else:
        lines += [f"rank {rank}: {n} step{'s' if n != 1 else ''} sent unresolved (left out of the figures): "
                  + (session.ranks[rank].unresolved_reason or "timing marks never completed") for rank, n in unresolved.items()]
    dropped = {r: s.sender_dropped for r, s in session.ranks.items() if s.sender_dropped}
    lost = {r: s.lost_messages for r, s in session.ranks.items() if s.lost_messages}
    if len(dropped) + len(lost) > FEW_RANKS:
        parts = [f"{sum(d.values())} {what} by {len(d)} rank{'s' if len(d) != 1 else ''} ({ranks_text(d)})"
                 for d, what in ((dropped, "discarded"), (lost, "lost in transit")) if d]
        lines.append("telemetry dropped: " + ", ".join(parts) + " (training was not slowed)")
    elif dropped or lost:
        parts = [f"rank {r} discarded {n}" for r, n in sorted(dropped.items())]
        parts += [f"{n} from rank {r} lost in transit" for r, n in sorted(lost.items())]
        lines.append("telemetry dropped: " + ", ".join(parts) + " (training was not slowed)")
    if session.all_reduce_groups_problem:
        lines.append(session.all_reduce_groups_problem)
    lines += [f"another run ({other}) is sending here while run {session.session_id} goes on: "
              + (f"its {count} message{'s' if count != 1 else ''} so far left out, none mixed into this run's figures"
                 if session.runs_told_apart else "its reports are mixed in with this run's or rejected")
              + "; give each run its own address (ddpwatch --listen, train.py --watch)"
              for other, count in session.other_runs.items()]
    lines += rejected_lines(session.rejected)
    if session.unfoldable_error:  # a fault of ddpwatch's, or a check it lacks: what raised, to report
        lines.append(f"a message that passed every check raised as it was read, and was left out (the last: "
                     f"{session.unfoldable_error}): please report it")
    return lines


def rejected_lines(rejected: Mapping[str, int]) -> list[str]:
    """The messages the receiver rejected, by category (``codec.ProtocolError``). Two are not
    malformed but another ddpwatch's, and say so: a message of a type this one does not know
    (a newer ddpwatch's, say its ``evaluation`` messages) or a report holding a span of a kind
    it does not know (its ``loop`` spans, say), and one in another wire version; called
    *malformed* they would read as if the network or a sender were broken, where the fix is to
    run one ddpwatch version on the ranks and here."""
    lines = []
    if newer := rejected.get("unknown_type", 0):
        lines.append(f"{newer} message(s) of a type, or holding a span of a kind, this ddpwatch does not know, left out: "
                     "the ranks run a newer ddpwatch than this dashboard (the session file keeps them; upgrade ddpwatch "
                     "here to see them)")
    if other := rejected.get("wrong_version", 0):
        lines.append(f"{other} message(s) in another version of ddpwatch's wire format than this dashboard's "
                     f"({PROTOCOL_VERSION}), left out: run the same ddpwatch version on the ranks and here")
    malformed = {category: n for category, n in rejected.items() if category not in ("unknown_type", "wrong_version") and n}
    if malformed:
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(malformed.items()))
        lines.append(f"rejected {sum(malformed.values())} malformed message(s): {kinds}")
    return lines


def cut_ranks_lines(session: Session, heard: float) -> list[str]:
    """Ranks a recording ends with, heard to its end and without a goodbye (``Session.status``'s
    ``cut``): a replay at its end does not show them live under a header that says "ended"."""
    cut = {rank: state.last_step for rank, state in sorted(session.ranks.items())
           if session.status(rank, heard, recording_ended=True) == "cut"}
    if not cut:
        return []
    return [f"the recording ends before {heard_until_text(cut)} said goodbye: how the run went on is not in it "
            "(a dashboard or recorder stopped before the run ended, or the job was killed)"]


def note_lines(session: Session, heard: float, recording_ended: bool = False) -> list[str]:
    """Not faults: ranks a recording ends with (``recording_ended``: a replay at its end;
    ``cut_ranks_lines``), ranks a signal stopped (Ctrl-C, a SIGTERM: ``rank_lists.interrupted_ranks_lines``),
    ranks ddpwatch stopped watching as they trained on (``rank_lists.detached_ranks_lines``),
    steps whose optimizer update was skipped, steps in which torch.compile compiled, accumulating
    steps that all-reduced before their last micro-step (``accumulation``), ranks whose
    steps stopped while the others' went on, reports that came late (heartbeats run ahead of
    reports still resolving), why a rank's device readings are not what its device suggests; a
    run of one rank, whose figures of communication are empty."""
    lines = cut_ranks_lines(session, heard) if recording_ended else []
    lines += interrupted_ranks_lines(session.interrupted_ranks)
    lines += detached_ranks_lines(session.detached_ranks)
    if session.world_size == 1:
        lines.append(ONE_RANK_NOTE)
    if session.skipped_updates:
        lines.append(skipped_updates_text(session.skipped_updates))
    if session.compiling_steps:
        lines.append(compiling_steps_text(session.compiling_steps))
    if session.untimed_collectives.steps:
        lines.append(untimed_collectives_text(session.untimed_collectives.steps, session.untimed_collectives.most,
                                              session.untimed_in_data.steps, session.untimed_in_data.most))
    if session.paused_steps:
        lines.append(paused_steps_text(session.paused_steps, list(session.paused_for), session.paused_longest_s))
    if session.nograd_forwards.steps:
        lines.append(nograd_forwards_text(session.nograd_forwards.steps, session.nograd_forwards.most))
    if session.early_reductions:
        lines.append(session.early_reductions.text())
    lines += pausing_lines(session, heard)
    stopped = session.stopped_ranks(heard)
    if stopped:
        lines.append(stopped_ranks_text(stopped, max(state.last_step for state in session.ranks.values())))
    late = {rank: state for rank, state in sorted(session.ranks.items()) if state.late}
    if len(late) > FEW_RANKS:
        total, unused = sum(s.late for s in late.values()), sum(s.late_unused for s in late.values())
        tail = f"; {unused} came after their step was folded and are left out" if unused else ""
        lines.append(f"{len(late)} ranks sent {total} step reports late ({total - unused} used{tail}): ranks {ranks_text(late)}")
    else:
        for rank, state in late.items():
            used = state.late - state.late_unused
            tail = f"; {state.late_unused} came after their step was folded and are left out" if state.late_unused else ""
            lines.append(f"rank {rank}: {state.late} step report{'s' if state.late != 1 else ''} arrived late "
                         f"({used} used{tail})")
    noted: dict[str, list[tuple[int, str]]] = {}  # a note -> the (rank, device) it came from
    for rank, state in sorted(session.ranks.items()):
        if state.hello is not None and state.hello.device_note:
            noted.setdefault(state.hello.device_note, []).append((rank, state.hello.device))
    for note, ranks in noted.items():  # a thousand GPUs without NVML say it once
        if len(ranks) > FEW_RANKS:
            lines.append(f"{len(ranks)} ranks ({ranks_text(rank for rank, _ in ranks)}): {note}")
        else:
            lines += [f"rank {rank} ({device}): {note}" for rank, device in ranks]
    return lines


def stopped_ranks_text(stopped: dict[int, int], newest: int) -> str:
    """One line for the ranks whose steps stopped while the others reached ``newest``."""
    steps = sorted(set(stopped.values()))
    at = step_range_text(steps[0], steps[-1])
    who = f"rank {next(iter(stopped))} has" if len(stopped) == 1 else f"{len(stopped)} ranks ({ranks_text(stopped)}) have"
    return (f"{who} passed no step since {at} while the others reached {newest}: out of data under DDP's join() "
            "(uneven inputs), or out of the training loop")


def compiling_steps_text(steps: StepSet) -> str:
    """One line for the steps in which torch.compile compiled: a compiled model's first steps,
    and any recompile after them, which is worth finding (``TORCH_LOGS=recompiles`` says which
    guard failed)."""
    count = len(steps)
    return (f"torch.compile compiled in {count} step{'s' if count != 1 else ''} ({runs_text(steps.ranges())}): left out of "
            "the figures; past the first steps it recompiled (TORCH_LOGS=recompiles says why)")


def untimed_collectives_text(steps: StepSet, most: int, in_data: StepSet | None = None, most_in_data: int = 0) -> str:
    """One line for the steps in which ranks issued collectives ddpwatch does not time: an attached
    script's own (a Trainer's loss and token counts gathered for logging, a gradient norm of sharded
    gradients), or DDP's own: the broadcast of its rebuilt buckets in its second step, the
    all-reduce of its map of used parameters every step under ``find_unused_parameters=True``.
    ``in_data``: the steps in which some came in the data time, before a forward
    (``StepReport.untimed_in_data``), and the most of one rank in one step: those read as data
    loading, and so does a wait in them for a slower rank, and the line says so apart from the
    others, whose time reads as compute."""
    count = len(steps)
    where = "their time reads as compute"
    if in_data:
        where = (f"in {len(in_data)} of these steps ({runs_text(in_data.ranges())}) up to {most_in_data} a step were issued "
                 "before a forward, in the data time, and read as data loading, a wait in them for a slower rank included; "
                 "the others' time reads as compute")
    return (f"collectives not timed in {count} step{'s' if count != 1 else ''} ({runs_text(steps.ranges())}), up to {most} "
            "a step on a rank: issued outside DDP's buckets and FSDP's gathers and reductions (by the script itself, "
            f"or by DDP: its rebuilt buckets, its map of used parameters under find_unused_parameters=True): {where}")


def pausing_lines(session: Session, heard: float) -> list[str]:
    """A line for each thing live ranks' loops are doing now instead of training (their
    heartbeats' ``pausing``: a Trainer's evaluation), and for how long: no step comes meanwhile,
    which would otherwise read as a hang through a long evaluation."""
    by_what: dict[str, list[int]] = {}
    for rank, state in sorted(session.ranks.items()):
        if state.pausing and session.status(rank, heard) == "live":
            by_what.setdefault(state.pausing, []).append(rank)
    lines = []
    for what, ranks in by_what.items():
        since = min(session.ranks[rank].pausing_since for rank in ranks)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks_text(ranks)}"
        lines.append(f"{who}: the loop has paused training ({what}) for {max(heard - since, 0.0):.0f} s: "
                     "no step comes until it trains again")
    return lines


def paused_steps_text(steps: StepSet, what: list[str], longest_s: float) -> str:
    """One line for the steps before which the loop paused training: a Trainer's evaluation or
    checkpoint, or what a loop marked with ``Attachment.paused``. Kept out of the step times, or
    they would read as a data-loading stall."""
    count = len(steps)
    doing = ", ".join(what) or "its own work"
    return (f"the loop paused training ({doing}) before {count} step{'s' if count != 1 else ''} ({runs_text(steps.ranges())}), "
            f"up to {longest_s:.2f} s: left out of the step times and of samples/s")


def nograd_forwards_text(steps: StepSet, most: int) -> str:
    """One line for the steps whose data loading held forwards of the model without gradients:
    an evaluation the loop did not mark. Its time is in the step's ``data`` span, so the step
    reads as a loader stall; ``watch.paused`` takes it out. Said, not guessed away: forwards
    without gradients can belong to training too (a reinforcement-learning loop's rollouts)."""
    count = len(steps)
    return (f"the model ran forwards without gradients before {count} step{'s' if count != 1 else ''} "
            f"({runs_text(steps.ranges())}), up to {most} a step on a rank: an evaluation? Their time reads as data "
            "loading; mark it with `with watch.paused(\"evaluate\"):` to leave it out of the step")


def skipped_updates_text(steps: StepSet) -> str:
    """One line for the steps whose optimizer update was skipped."""
    count = len(steps)
    return (f"optimizer update skipped in {count} step{'s' if count != 1 else ''} ({runs_text(steps.ranges())}): gradients reduced, "
            "then cleared with no optimizer.step(), as a loss scaler does when it finds inf or NaN")
