"""Watching never hurts training: a rank killed mid-run is seen as lost, and nothing recorded is lost."""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import pytest

from ddpwatch.dashboard.feeds import LiveFeed
from ddpwatch.export.exporters import write_exports
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.rank_liveness import LOST_AFTER_S
from ddpwatch.ingest.session_file import read_session_file
from instrumented_ddp.wire.codec import Envelope, decode
from launch import QUICK_EVAL, REPO_ROOT, free_port, start_ranks, wait_for_line
from step_gate import StepGate, start_gated_ranks


class WatchedRun:
    """A group of ranks streaming to the dashboard's own feed, folded into a session as it comes;
    on exit the group is killed if still there and the feed stopped. The ranks are started as
    torchrun would start them (``start_ranks``: without its launcher, forked), and stopped as it
    would stop them once one fails."""

    def __init__(self, tmp_path: Path, nproc: int, args: list[str]) -> None:
        address = f"tcp://127.0.0.1:{free_port()}"
        self.nproc = nproc
        self.feed = LiveFeed(address, tmp_path / "session.ddpwatch")
        self.feed.start()
        self.session = Session()
        self.accepted = 0
        self.training = start_ranks([*args, "--watch", address], nproc=nproc)

    def pump(self) -> None:
        for arrived_at, item, prepared, run in self.feed.drain():
            if isinstance(item, Envelope) and self.session.ingest(item, arrived_at, prepared, run) is None:
                self.accepted += 1

    def wait_until_streaming(self, steps: int = 5, seconds: float = 120) -> None:
        """Every rank said hello and the run reached ``steps``."""
        deadline = time.monotonic() + seconds
        session = self.session
        while not (len(session.ranks) == self.nproc and all(s.hello for s in session.ranks.values())
                   and session.reports and max(session.reports) >= steps):
            assert time.monotonic() < deadline and self.training.poll() is None
            self.pump()
            time.sleep(0.05)

    def __enter__(self) -> WatchedRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.training.stop()
        time.sleep(0.3)  # what the ranks sent last is still on its way
        self.pump()
        self.feed.stop()
        self.pump()


@pytest.mark.timeout(300)
def test_a_frozen_rank_is_lost_within_three_seconds_its_peer_is_said_held_and_killed_both_end_saying_why(tmp_path: Path) -> None:
    """Rank 1 frozen (SIGSTOP) is silent as a killed rank is, and its peer waits in the step's
    collective for it, heartbeating: lost within 3 s, and rank 0 said held by it, not taken for
    a slow step. Then rank 1 is killed: rank 0's collective fails on the dead peer (*failed: …
    Connection reset by peer*), or, where its send to rank 1 was half written (likely here: the
    frozen peer read nothing more), gloo's wait for that send outlasts the death until the
    process group's timeout (30 min) and the launcher's stop ends it (*interrupted: SIGTERM*, 2 s
    after, from the watch thread, its main thread blocked in C++; the ranks are stopped as
    torchrun stops them, ``RankGroup``: SIGTERM to those left once one failed). Either way it
    says goodbye and ends: nothing of ddpwatch's holds it."""
    with WatchedRun(tmp_path, 2, ["--strategy", "async", "--steps", "500", "--batch-size", "8"]) as run:
        run.wait_until_streaming()
        session = run.session
        survivor, frozen = session.ranks[0].hello.pid, session.ranks[1].hello.pid
        os.kill(frozen, signal.SIGSTOP)
        frozen_at = time.monotonic()
        while not session.ranks_held_by_lost(time.monotonic())[0]:
            run.pump()
            assert time.monotonic() - frozen_at < 15.0, f"rank 0 never said held: rank 1 {session.status(1)}"
            time.sleep(0.05)
        # By the session's own clock: rank 1's last message came as it froze, and it reads lost LOST_AFTER_S after.
        lost_after = session.ranks[1].last_seen + LOST_AFTER_S - frozen_at
        assert lost_after <= 3.0, f"rank 1 marked lost {lost_after:.2f} s after SIGSTOP"
        held, lost = session.ranks_held_by_lost(time.monotonic())
        assert list(held) == [0] and list(lost) == [1] and session.status(0) == "live"
        assert held[0] >= 5 and held[0] == max(session.reports)  # at the newest step: the next one's collective holds it
        os.kill(frozen, signal.SIGKILL)
        killed_at = time.monotonic()
        while session.ranks[0].goodbye is None or _alive(survivor):  # it must not hang on the dead peer
            run.training.poll()  # the launcher sees rank 1's death, and stops what is left
            run.pump()
            assert time.monotonic() - killed_at < 60, "rank 0 neither said goodbye nor ended within 60 s of its peer's death"
            time.sleep(0.05)
        rank0_ended_after = time.monotonic() - killed_at
    goodbye = session.ranks[0].goodbye
    print(f"rank 1 lost {lost_after:.2f} s after SIGSTOP; rank 0 said held at step {held[0]}; "
          f"ended {rank0_ended_after:.2f} s after the kill, saying {goodbye.reason!r}")
    assert goodbye.reason.startswith("failed: ") or goodbye.reason == "interrupted: SIGTERM", goodbye
    recorded = list(read_session_file(tmp_path / "session.ddpwatch"))
    assert len(recorded) == run.accepted + sum(session.rejected.values())  # every message that arrived is on disk
    paths = write_exports(session, tmp_path)
    assert all(path.stat().st_size > 0 for path in paths.values())
    assert all(0 in ranks for step, ranks in session.reports.items())  # rank 0 kept reporting until the end


@pytest.mark.timeout(300)
def test_training_finishes_normally_when_the_recorder_is_killed_mid_run(tmp_path: Path) -> None:
    from launch import Recorder, run_as_torchrun_would

    with Recorder(tmp_path / "session") as recorder:
        import threading

        def kill_after_first_messages() -> None:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                file = tmp_path / "session" / "session.ddpwatch"
                if file.exists() and file.stat().st_size > 20_000:
                    break
                time.sleep(0.1)
            recorder.kill(signal.SIGKILL)

        killer = threading.Thread(target=kill_after_first_messages)
        killer.start()
        result = run_as_torchrun_would([str(REPO_ROOT / "train.py"), *QUICK_EVAL, "--strategy", "bucket", "--steps", "30",
                                         "--batch-size", "8", "--log-every", "10", "--watch", recorder.address])
        killer.join()
    assert recorder.proc.returncode == -signal.SIGKILL
    assert result.returncode == 0, result.stderr[-3000:]
    assert "parameters identical on all 2 rank(s)" in result.stdout
    assert list(read_session_file(tmp_path / "session" / "session.ddpwatch"))  # what it had flushed survives


@pytest.mark.timeout(300)
@pytest.mark.parametrize("order", ["switch_then_kill", "kill_at_first_ack"])
def test_a_switch_sent_as_a_rank_dies_lands_on_every_rank_or_none_and_nothing_hangs(tmp_path: Path, order: str) -> None:
    """Three ranks, so two survive: a rank on another strategy than its peers would deadlock or
    average the wrong gradients. The agreement is a broadcast every rank joins, so a dead peer
    must make it fail everywhere rather than reach some ranks only. (A third order, the kill
    before the switch, was run too until the suite neared its 15 minutes: a command reaches rank
    0 within a 50 ms poll and the next agreement comes a step (~0.2 s) later, so
    ``switch_then_kill`` meets the same dead peer at the agreement; both read "switched
    nowhere", and the ~16 s run of three ranks bought nothing the other two do not.)"""
    from ddpwatch.control.relay import new_command

    with WatchedRun(tmp_path, 3, ["--strategy", "simple", "--steps", "500", "--batch-size", "12"]) as run:
        run.wait_until_streaming()
        session, feed = run.session, run.feed
        command = new_command("bucket")
        victim = session.ranks[1].hello.pid
        if order == "switch_then_kill":
            feed.request_switch(command)
            time.sleep(0.05)  # the relay thread sends it within one 50 ms poll
            os.kill(victim, signal.SIGKILL)
        else:  # kill_at_first_ack, mid-switch: one rank has re-wrapped its model, others may not have
            feed.request_switch(command)
            deadline = time.monotonic() + 60
            while not any(ack.command_id == command.command_id for ack in session.acks):
                assert time.monotonic() < deadline and run.training.poll() is None
                run.pump()
                time.sleep(0.001)
            os.kill(victim, signal.SIGKILL)
        killed_at = time.monotonic()
        run.training.wait(120)  # well inside the 300 s process-group timeout: a dead peer fails the broadcast at once
        ended_after = time.monotonic() - killed_at
    training = run.training
    assert training.returncode != 0  # a rank died: the run failed
    applied = {ack.rank: ack.step for ack in session.acks if ack.command_id == command.command_id and ack.applied}
    for step, reports in session.reports.items():
        assert len({r.strategy for r in reports.values()}) == 1, f"step {step}: ranks on different strategies"
        for rank, report in reports.items():
            if any(step >= at for at in applied.values()):
                assert report.strategy == "bucket", f"rank {rank} ran step {step} on {report.strategy} after a rank switched"
    switched = {rank for reports in session.reports.values() for rank, r in reports.items() if r.strategy == "bucket"}
    outcome = f"switched on ranks {sorted(set(applied) | switched)}" if applied or switched else "switched nowhere"
    print(f"{order}: {outcome}; the ranks ended {ended_after:.1f} s after the kill")


@pytest.mark.timeout(300)
def test_the_dashboard_started_late_then_killed_and_restarted_never_pauses_training_and_counts_what_it_missed(tmp_path: Path) -> None:
    """The real Textual dashboard (in a pseudo-terminal), first started after training did (the
    ranks ran with nothing listening), then killed by SIGKILL and started again on the same
    address while two ranks train: each one picks the run up, hellos included."""
    from ddpwatch.record.recorder import load_session
    from launch import DashboardProcess

    address = f"tcp://127.0.0.1:{free_port()}"
    first_file, second_file = tmp_path / "first" / "session.ddpwatch", tmp_path / "second" / "session.ddpwatch"
    # 70 steps: the second dashboard had its 5 steps by step ~44 of 100 (the first drew from 10 to 28,
    # with 100 KB of the run to wait for, now 50 KB): the run went on 50 steps more for nothing.
    # The run waits at step 13 until the first dashboard has heard it: a dashboard slow to start on a
    # loaded machine must not find a run that ended unwatched, and the 58 steps left fill its 50 KB.
    gate = StepGate(tmp_path / "gate", allowed=12)
    training = start_gated_ranks(gate, ["--strategy", "async", "--steps", "70", "--batch-size", "8", "--log-every", "10",
                                        "--watch", address], tmp_path / "train.log")
    try:
        wait_for_line(tmp_path / "train.log", "step 10/70 ", training)  # unwatched so far
        with DashboardProcess("--listen", address, "--out", str(tmp_path / "first")) as first:
            deadline = time.monotonic() + 120
            while not (first_file.exists() and first_file.stat().st_size > 0):  # it heard the ranks (their hellos)
                assert time.monotonic() < deadline and training.poll() is None and first.proc.poll() is None
                time.sleep(0.1)
            gate.allow(70)
            while not (first_file.exists() and first_file.stat().st_size > 50_000):
                assert time.monotonic() < deadline and training.poll() is None and first.proc.poll() is None
                time.sleep(0.1)
            first.kill(signal.SIGKILL)
            assert first.wait(10) == -signal.SIGKILL and first.screen_bytes > 0  # it was drawing
        time.sleep(1.0)  # nothing listens for a while: the ranks must neither wait nor pile up
        with DashboardProcess("--listen", address, "--out", str(tmp_path / "second")) as second:
            deadline = time.monotonic() + 60
            while True:
                assert time.monotonic() < deadline and second.proc.poll() is None
                picked_up = load_session(second_file) if second_file.exists() else None
                if picked_up and all(picked_up.ranks[r].hello for r in (0, 1)) and len(picked_up.reports) >= 5:
                    break
                time.sleep(0.2)
            second.press("q")
            assert second.wait(30) == 0
        assert training.wait(240) == 0, (tmp_path / "train.log").read_text()[-3000:]
    finally:
        training.stop()
    assert "parameters identical on all 2 rank(s)" in (tmp_path / "train.log").read_text()
    before, after = load_session(first_file), load_session(second_file)  # the killed one's file reads to its last flush
    assert all(before.ranks[r].hello for r in (0, 1))  # the late one learned the run as the restarted one did
    assert min(before.reports) > 5  # ... from a run well past its first steps (sent to nobody, not queued)
    assert (tmp_path / "second" / "summary.json").is_file()  # the new dashboard's exports, written on quit
    starts = {step: ranks[0].start for session in (before, after) for step, ranks in session.reports.items() if 0 in ranks}
    last_seen = max(step for step, ranks in before.reports.items() if 0 in ranks)
    first_again = min(step for step, ranks in after.reports.items() if 0 in ranks)
    assert first_again > last_seen
    per_step = sorted(starts[b] - starts[a] for a, b in itertools.pairwise(sorted(starts)) if b == a + 1)
    typical = per_step[len(per_step) // 2]
    across_outage = (starts[first_again] - starts[last_seen]) / (first_again - last_seen)
    assert across_outage < 2.0 * typical, f"steps took {across_outage:.3f} s while no dashboard ran, {typical:.3f} s otherwise"
    missed = {r: after.ranks[r].sender_dropped for r in (0, 1)}
    assert all(n > 0 for n in missed.values()), missed  # what had nowhere to go is counted, and shown
    first_seq: dict[int, int] = {}
    for _, data in read_session_file(second_file):
        envelope = decode(data)
        first_seq.setdefault(envelope.rank, envelope.seq)
    unseen = {r: first_seq[r] - before.ranks[r].last_seq - 1 for r in (0, 1)}
    assert all(unseen[r] >= missed[r] for r in (0, 1))  # the counted drops are among the messages neither saw
    print(f"steps {last_seen + 1}-{first_again - 1} went unseen; {across_outage:.3f} s a step across the outage vs "
          f"{typical:.3f} s typical; messages neither dashboard got {unseen}, of which the ranks counted {missed} "
          "as discarded")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie is gone, only not yet reaped
        return stat.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.timeout(200)
@pytest.mark.parametrize("ending", ["quit", "sigkill"])
def test_the_demo_takes_its_training_run_with_it_however_it_ends(tmp_path: Path, ending: str) -> None:
    """``q`` stops the run; so does a closed terminal or kill -9 of the demo (the kernel tells
    torchrun its parent died), instead of two ranks training on for 2000 steps unseen."""
    from ddpwatch.record.recorder import load_session
    from launch import DashboardProcess

    session_file = tmp_path / "demo" / "session.ddpwatch"
    with DashboardProcess("--out", str(tmp_path / "demo"), "demo", "--steps", "2000") as demo:
        deadline = time.monotonic() + 120
        while True:
            assert time.monotonic() < deadline and demo.proc.poll() is None
            session = load_session(session_file) if session_file.exists() else None
            if session and len(session.ranks) == 2 and all(s.hello for s in session.ranks.values()) and session.reports:
                break
            time.sleep(0.2)
        ranks = [state.hello.pid for state in session.ranks.values()]
        assert all(_alive(pid) for pid in ranks)
        if ending == "quit":
            demo.press("q")
            assert demo.wait(60) == 0
        else:
            demo.kill(signal.SIGKILL)
            demo.wait(10)
        ended = time.monotonic()
        while any(_alive(pid) for pid in ranks):
            assert time.monotonic() - ended < 30, "the demo's ranks outlived it"
            time.sleep(0.1)
        print(f"{ending}: both ranks gone {time.monotonic() - ended:.1f} s after the demo ended")
    if ending == "quit":
        assert (tmp_path / "demo" / "summary.json").is_file(), demo.screen_tail.decode(errors="replace")[-3000:]
