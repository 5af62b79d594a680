"""A replay judges a rank's silence on the recording's clock, not on the replay's."""

from __future__ import annotations

import time
from pathlib import Path

from ddpwatch.dashboard.feeds import ReplayFeed
from ddpwatch.dashboard.views.snapshot import SnapshotBuilder
from ddpwatch.ingest.session import Session
from ddpwatch.ingest.session_file import SESSION_FILE_NAME, SessionWriter
from instrumented_ddp.wire.codec import Envelope, encode
from instrumented_ddp.wire.messages import Heartbeat, Message
from synthetic_session import hello, session_messages

T0 = 1_800_000_000.0  # the recorder stamps each message with time.time()


def recorded(path: Path, heard_until: dict[int, int], last_s: int) -> None:
    """Each rank's hello at T0, then a heartbeat a second up to its ``heard_until`` second; one
    more heartbeat of rank 0 at ``last_s``, the recording's end."""
    writer = SessionWriter(path)
    seq = dict.fromkeys(heard_until, 0)
    records: list[tuple[float, int, Message]] = [(T0, rank, hello(rank)) for rank in heard_until]
    records += [(T0 + s, rank, Heartbeat(rank, T0 + s, 0)) for rank, until in heard_until.items() for s in range(1, until + 1)]
    records.append((T0 + last_s, 0, Heartbeat(0, T0 + last_s, 0)))
    for at, rank, message in sorted(records, key=lambda record: (record[0], record[1])):
        writer.append(encode(message, seq[rank], 0), at)
        seq[rank] += 1
    writer.close()


def played(feed: ReplayFeed, timeout_s: float = 30.0) -> Session:
    deadline = time.monotonic() + timeout_s
    while not feed.ended:
        assert time.monotonic() < deadline, "the replay did not finish"
        time.sleep(0.01)
    session = Session()
    for arrival in feed.drain():
        assert isinstance(arrival.item, Envelope)
        session.ingest(arrival.item, arrival.at)
    return session


def test_a_replay_that_ended_keeps_its_ranks_as_the_recording_left_them(tmp_path: Path) -> None:
    """Rank 0 heard to the recording's end (10 s), rank 1 silent after 4 s: at the end rank 0 is
    live and rank 1 lost, 6 s silent, however long after the replay we look. Before, arrivals
    were stamped with the replay's clock: both ranks read lost 2.5 s after the replay ended."""
    path = tmp_path / SESSION_FILE_NAME
    recorded(path, {0: 9, 1: 4}, last_s=10)
    feed = ReplayFeed(path, speed=0)
    feed.start()
    session = played(feed)
    heard = feed.heard_clock()
    assert heard == T0 + 10
    time.sleep(0.05)
    assert feed.heard_clock() == heard  # the clock stopped with the recording
    assert feed.description == f"replayed {path} to its end"  # the header's "replaying …" said it went on
    snapshot = SnapshotBuilder(session).build(now=time.monotonic() + 60, heard_now=heard)
    assert [(row.rank, row.status) for row in snapshot.ranks] == [(0, "live"), (1, "lost")]
    assert snapshot.warnings == ("rank 1 lost: nothing heard from it for 6.0 s",)


def test_a_rank_heard_to_the_end_of_a_recording_without_a_goodbye_reads_cut_and_a_note_says_so(tmp_path: Path) -> None:
    """A recording stopped while its run trained (a demo quit, a recorder stopped, a job killed):
    at the end of its replay the ranks heard to the end read "live" under a header that said
    "ended", as if the run still trained, and nothing said the recording was cut short. A rank
    silent long before the end is still lost: the recording holds its silence."""
    path = tmp_path / SESSION_FILE_NAME
    recorded(path, {0: 9, 1: 4}, last_s=10)
    feed = ReplayFeed(path, speed=0)
    feed.start()
    session = played(feed)
    snapshot = SnapshotBuilder(session).build(now=time.monotonic(), heard_now=feed.heard_clock(), recording_ended=feed.ended)
    assert [(row.rank, row.status) for row in snapshot.ranks] == [(0, "cut"), (1, "lost")]
    assert snapshot.warnings == ("rank 1 lost: nothing heard from it for 6.0 s",)
    assert snapshot.notes[0] == ("the recording ends before rank 0 (last heard at step 0) said goodbye: how the run "
                                 "went on is not in it (a dashboard or recorder stopped before the run ended, or the job was killed)")


def test_a_replays_clock_runs_at_its_speed_between_messages(tmp_path: Path) -> None:
    """The next message is 100 recorded seconds away: 0.2 s of waiting at speed 4 moves the clock
    at least 0.8 recorded seconds past the last message, and never further than 4 × the wait."""
    path = tmp_path / SESSION_FILE_NAME
    recorded(path, {0: 0}, last_s=100)
    feed = ReplayFeed(path, speed=4)
    started = time.monotonic()
    feed.start()
    try:
        while feed.heard_clock() == 0.0:  # nothing played yet
            assert time.monotonic() - started < 30
            time.sleep(0.01)
        time.sleep(0.2)
        heard, waited = feed.heard_clock(), time.monotonic() - started
        assert 0.2 * 4 <= heard - T0 <= waited * 4
    finally:
        feed.stop()


def test_replay_takes_its_output_directory_after_the_session_as_well_as_before() -> None:
    """``ddpwatch replay SESSION --out DIR`` was refused (unrecognized arguments): only the form
    with ``--out`` before the command took it, and the export key's hint did not say which."""
    from ddpwatch.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["replay", "runs/a", "--out", "exports"]).out == Path("exports")
    assert parser.parse_args(["--out", "exports", "replay", "runs/a"]).out == Path("exports")
    assert parser.parse_args(["replay", "runs/a"]).out is None
    assert parser.parse_args(["demo", "--out", "exports"]).out == Path("exports")  # the demo likewise


def test_only_a_file_holding_a_ddpwatch_message_is_taken_for_a_session(tmp_path: Path) -> None:
    """Any file reads as records until one is cut short, so a wrong file (empty, or whole records
    of something else) is told apart by its messages: one that decodes is enough, a rogue's
    rejected message before it included, as the recorder writes those too."""
    from ddpwatch.ingest.session_file import not_a_session_file

    empty = tmp_path / "empty.ddpwatch"
    empty.write_bytes(b"")
    assert not_a_session_file(empty).endswith(" is empty: nothing was recorded there (no rank connected?)")
    (tmp_path / "notes.txt").write_text("a few words, shorter than a record's length says")
    assert not_a_session_file(tmp_path / "notes.txt").endswith(" is not a ddpwatch session (a recording's session.ddpwatch): "
                                                               "not one whole record")
    other = SessionWriter(tmp_path / "other.ddpwatch")
    other.append(b"not msgpack at all \xc1", 1.0)
    other.append(b"\x93\x01\x02", 1.5)
    other.close()
    assert not_a_session_file(tmp_path / "other.ddpwatch").endswith(": no ddpwatch message in its 2 records")
    session = SessionWriter(tmp_path / SESSION_FILE_NAME)
    session.append(b"\xc1", 1.0)  # garbage a rogue sent, recorded first
    session.append(session_messages(steps=1)[0], 1.1)
    session.close()
    assert not_a_session_file(tmp_path / SESSION_FILE_NAME) is None
