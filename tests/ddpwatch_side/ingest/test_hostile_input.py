"""Bad input never takes the receiver down: floods, garbage, wrong flags everywhere."""

from __future__ import annotations

import json
import runpy
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgpack
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpwatch.dashboard.feeds import LiveFeed
from instrumented_ddp.wire.step_figures import step_figures
from ddpwatch.ingest.session import Session
from instrumented_ddp.wire.codec import Envelope
from instrumented_ddp.wire.messages import Span, StepReport
from launch import REPO_ROOT, free_port
from synthetic_session import session_messages


@pytest.mark.timeout(120)
def test_a_flood_of_garbage_from_one_sender_leaves_the_valid_stream_intact(tmp_path: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"
    feed = LiveFeed(address, tmp_path / "session.ddpwatch", max_message_bytes=4096)
    feed.start()
    context = zmq.Context()
    try:
        flooder, honest = context.socket(zmq.DEALER), context.socket(zmq.DEALER)
        for socket in (flooder, honest):
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
        valid = session_messages(steps=30)
        honest_stream = iter(valid)
        for index in range(20_000):  # garbage, truncated and oversized, interleaved with the real stream
            flooder.send([b"\x00garbage", valid[5][:7], b"x" * 5000][index % 3])
            if index % 400 == 0:
                honest.send(next(honest_stream))
        for data in honest_stream:
            honest.send(data)
        session, deadline = Session(), time.monotonic() + 30
        while sum(len(r) for r in session.reports.values()) < 60 and time.monotonic() < deadline:
            for arrived_at, item, prepared, run in feed.drain():
                if isinstance(item, Envelope):
                    session.ingest(item, arrived_at, prepared, run)
                else:
                    session.reject(item.category)
            time.sleep(0.05)
    finally:
        feed.stop()
        context.destroy(linger=0)
    assert sorted(session.reports) == list(range(1, 31)) and all(len(r) == 2 for r in session.reports.values())
    assert session.rejected["garbage"] > 0 and session.rejected["truncated"] > 0
    assert session.rejected["garbage"] + session.rejected["truncated"] + session.rejected["oversized"] <= 20_000


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["switch", "zero3"], "unknown strategy 'zero3'"),
        (["switch", "bucket", "--bucket-mb", "-1"], "--bucket-mb must be a positive, finite number of MB, not -1"),
        (["switch", "bucket", "--timeout", "inf"], "--timeout must be a positive, finite number of seconds"),  # was a traceback
        (["switch", "bucket", "--bucket-mb", "1e400"], "not inf"),  # was sent, dropped by rank 0 as invalid: a 30 s wait
        (["summary", "/no/such/session"], "holds no summary.json and no session file"),
        (["replay", "/no/such/session"], "holds no session file"),
        # any file reads as records until one is cut short: an empty dashboard, an empty table, unexplained
        (["replay", "README.md"], "README.md is not a ddpwatch session (a recording's session.ddpwatch): not one whole record"),
        (["summary", "pyproject.toml"], "pyproject.toml is not a ddpwatch session"),
        (["compare", "/no/such/session", "/tmp"], "/no/such/session holds no summary.json and no session file"),
        (["compare", "tests/support"], "holds no summary.json and no session file"),
        (["compare", "a", "b", "--fail-if-slower", "-5"], "--fail-if-slower must be a percentage, 0 or more, not -5"),
        (["replay", "/no/such/session", "--speed", "nan"], "--speed must be 0 (as fast as possible) or a positive, finite number"),
        (["record", "--out", "/tmp/x", "--until-steps", "0"], "--until-steps must be positive"),
        (["record", "--out", "/tmp/x", "--wait", "0"], "--wait must be positive"),
        (["record", "--out", "/tmp/x", "--idle-exit", "-1"], "--idle-exit must be positive"),
        (["record", "--out", "/tmp/x", "--runs", "0"], "--runs must be positive"),
        (["record", "--out", "/tmp/x", "--until-seconds", "nan"], "--until-seconds must be positive"),  # nan passed "<= 0"
        (["tune", "--out", "/tmp/x", "--idle-exit", "0"], "--idle-exit must be positive"),
        (["record", "--out", "/tmp/x", "--max-message-bytes", "0"], "--max-message-bytes must be positive"),  # every message rejected
        (["--max-message-bytes", "-1"], "--max-message-bytes must be positive"),  # the dashboard, before it takes the terminal
        (["record", "--out", "/tmp/x", "--listen", "tcp://0.0.0.0:5599"], "needs authentication"),
        (["record", "--out", "/tmp/x", "--listen", "not-an-address"], "cannot listen on not-an-address"),
        (["demo", "--steps", "0"], "--steps and --nproc must be at least 1"),
        (["demo", "--strategy", "zero3"], "unknown strategy 'zero3'"),  # before, a dashboard waiting for ever
        # before: the receiver ended unseen, and quitting said "session recorded in README.md/x", exit 0
        (["--out", "README.md/x"], "--out README.md/x: README.md is a file, not a directory"),
        (["record", "--out", "README.md", "--wait", "1"], "--out README.md: README.md is a file, not a directory"),
        (["record", "--out", "/tmp/x", "--keys", "README.md"], "--keys README.md: README.md is a file, not a directory"),
        (["doctor", "--keep", "README.md/runs"], "--keep README.md/runs: README.md is a file, not a directory"),  # even with no GPU
    ],
)
def test_wrong_cli_input_gets_a_one_line_error_and_a_non_zero_exit(args: list[str], message: str) -> None:
    result = subprocess.run([sys.executable, "-m", "ddpwatch.cli", *args], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], result.stderr


@pytest.mark.parametrize(
    ("example", "args", "message"),
    [
        pytest.param("hf_trainer.py", ["--fsdp"], "--fsdp needs CUDA: Accelerate shards with FSDP only on GPUs (on the CPU "
                     "the Trainer would train with DDP)", marks=pytest.mark.skipif(shutil.which("nvidia-smi") is not None,
                                                                                  reason="a CUDA machine runs --fsdp")),
        ("hf_trainer.py", ["--fsdp", "--bucket-mb", "1"], "--bucket-mb is DDP's bucket cap: FSDP has no buckets (it gathers "
         "and reduces one unit at a time)"),
        ("hf_trainer.py", ["--grad-accum", "0"], "--grad-accum must be at least 1, not 0"),
        ("hf_trainer.py", ["--eval-every", "-1"], "--eval-every must be 0 (never) or more, not -1"),
        ("plain_ddp.py", ["--eval-every", "-1"], "--eval-every must be 0 (never) or more, not -1"),
        ("plain_ddp.py", ["--ema", "1"], "--ema must be a decay in [0, 1) (0: no average), not 1.0"),
        ("plain_ddp.py", ["--bucket-mb", "inf"], "--bucket-mb must be a positive, finite number of MB, not inf"),  # was DDP's traceback
        ("plain_ddp.py", ["--comm-hook", "bf16"],  # was each rank's TypeError from DDP's hook at its first backward
         "--comm-hook bf16: DDP's bf16_compress_hook needs NCCL (CUDA GPUs); on the CPU use fp16"),
        ("plain_ddp.py", ["--comm-hook", "powersgd", "--bucket-mb", "1"],  # was gloo's abort on mismatched collectives
         "--comm-hook powersgd on gloo needs every gradient in one bucket (8.05 MB here): a --bucket-mb of 1 makes several, "
         "whose collectives PowerSGD issues in no fixed order"),
        ("plain_ddp.py", ["--compile", "inductr"], "--compile inductr: torch.compile has no such backend (inductor, aot_eager, ...: "
         "torch._dynamo.list_backends(exclude_tags=()) lists them)"),
        ("plain_fsdp.py", ["--layers", "0"], "--layers must be at least 1, not 0"),
        ("plain_fsdp.py", ["--profile", "README.md"], "--profile README.md: README.md is a file, not a directory"),  # was a traceback at step 8
        ("plain_ddp.py", ["--save-final", "README.md/final.pt"], "--save-final README.md/final.pt: README.md is a file, not a directory"),  # was one after the last step
    ],
)
def test_an_example_refuses_a_wrong_flag_in_one_line_before_any_process_group(
        example: str, args: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """In this process, as ``python examples/hf_trainer.py`` would (a process of its own spent 11 s
    importing transformers to print one line, the others 3-5 s importing torch): refused while
    parsing, before any process group (without torchrun, one made first would fail there) or
    Trainer."""
    monkeypatch.setattr(sys, "argv", [example, *args])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(REPO_ROOT / "examples" / example), run_name="__main__")
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"{example}: error: {message}"


def test_experts_whose_batch_does_not_split_over_the_ranks_is_refused_in_one_line(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """Each rank's all_to_all_single raised at the first forward instead."""
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun --nproc_per_node=2 sets it
    monkeypatch.setattr(sys, "argv", ["plain_ddp.py", "--experts", "--batch-size", "31"])
    with pytest.raises(SystemExit) as exited:
        runpy.run_path(str(REPO_ROOT / "examples" / "plain_ddp.py"), run_name="__main__")
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "plain_ddp.py: error: --experts sends every rank an equal share of each batch: --batch-size 31 does not divide by 2 ranks")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["tune", "--out", "x", "--steps-per-size", "x"], "ddpwatch tune: error: argument --steps-per-size: invalid int value: 'x'"),
        (["record", "--out", "x", "--bogus"], "ddpwatch: error: unrecognized arguments: --bogus"),
        (["nosuch"], "ddpwatch: error: argument COMMAND: invalid choice: 'nosuch' (choose from 'replay', 'demo', 'record', "
                     "'switch', 'tune', 'doctor', 'summary', 'compare')"),
    ],
)
def test_a_wrong_flag_to_ddpwatch_is_refused_in_exactly_one_line(argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse printed its usage first: five lines before ``tune``'s reason, the reason last."""
    from ddpwatch.cli import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err == said + "\n"


@pytest.mark.parametrize("command", [["record", "--out", "d"], ["tune", "--out", "d"], ["switch", "ddp"]])
def test_an_option_given_before_the_command_is_the_one_the_command_uses(command: list[str]) -> None:
    """The subcommand's own default overwrote it: ``ddpwatch --listen tcp://HOST:PORT record``
    listened on the default address, ``ddpwatch --listen ... switch ddp`` switched the job there."""
    from ddpwatch.cli import build_parser

    parser = build_parser()
    args = parser.parse_args(["--listen", "tcp://127.0.0.1:1111", *command])
    assert args.listen == "tcp://127.0.0.1:1111"
    assert parser.parse_args([*command, "--listen", "tcp://127.0.0.1:2222"]).listen == "tcp://127.0.0.1:2222"
    assert parser.parse_args(command).listen == "tcp://127.0.0.1:5555"
    if command[0] != "switch":
        given = parser.parse_args(["--keys", "k", "--max-message-bytes", "7", *command])
        assert (given.keys, given.max_message_bytes) == (Path("k"), 7)


@pytest.mark.parametrize("command", ["record", "tune"])
def test_out_is_required_and_taken_before_the_command_or_after_it(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse's ``required=True`` on the command's own ``--out`` refused ``ddpwatch --out DIR
    record``: *the following arguments are required: --out*, given but before the command."""
    from ddpwatch.cli import build_parser, main

    parser = build_parser()
    assert parser.parse_args(["--out", "before", command]).out == Path("before")
    assert parser.parse_args([command, "--out", "after"]).out == Path("after")
    assert main([command]) == 2  # refused before anything listens
    assert capsys.readouterr().err.startswith(f"ddpwatch {command}: error: --out DIR is required: the directory for the session file")


def test_every_command_says_which_top_level_options_it_reads() -> None:
    """A command missing from ``READS`` would raise a KeyError before it ran, whatever was typed."""
    import argparse

    from ddpwatch.cli import READS, build_parser

    (commands,) = (action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    assert set(READS) == {*commands.choices, "dashboard"}


@pytest.mark.parametrize(("argv", "option"), [(["--listen", "tcp://127.0.0.1:1111", "demo"], "--listen"),
                                               (["--keys", "k", "switch", "ddp"], "--keys"),
                                               (["--out", "o", "summary", "s"], "--out"),
                                               (["--max-message-bytes", "7", "replay", "s"], "--max-message-bytes")])
def test_an_option_the_command_does_not_read_is_refused_in_one_line(argv: list[str], option: str,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Before, ignored without a word: ``ddpwatch --listen ADDRESS demo`` listened on a port of its own."""
    from ddpwatch.cli import main

    assert main(argv) == 2
    command = next(word for word in argv if word in ("demo", "switch", "summary", "replay"))
    assert capsys.readouterr().err == (f"ddpwatch {command}: error: {option} does nothing for {command}: it is not one "
                                       f"of its options (`ddpwatch {command} --help` lists them)\n")


def test_a_summary_piped_into_a_reader_that_stopped_is_no_error(tmp_path: Path) -> None:
    """``ddpwatch summary DIR | head -1``: the reader closes the pipe before the table is written.
    Before, that printed "ddpwatch summary: error: [Errno 32] Broken pipe" and exited 2. Here the
    pipe is closed before the command has even started writing, so its write always fails."""
    from ddpwatch.export import exporters
    from ddpwatch.ingest.receiver import ingest

    session = Session()
    ingest(session, session_messages(steps=4))
    (tmp_path / "summary.json").write_text(json.dumps(exporters.summary(session)))
    summary = subprocess.Popen([sys.executable, "-m", "ddpwatch.cli", "summary", str(tmp_path)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    summary.stdout.close()
    _, stderr = summary.communicate(timeout=60)
    assert summary.returncode == 0 and stderr == ""


def test_record_gives_up_when_no_rank_connects_within_its_wait(tmp_path: Path) -> None:
    """A job that died before its first message leaves ``record --wait`` ending on its own, exit
    2, its last line saying why (``--idle-exit`` counts only once a rank has spoken)."""
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "ddpwatch.cli", "record", "--listen", f"tcp://127.0.0.1:{free_port()}",
                             "--out", str(tmp_path), "--wait", "1"], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines()[-1] == "ddpwatch record: error: no rank connected within 1 s"
    assert "stopped (no rank connected within 1 s); 0 messages" in result.stderr
    assert time.monotonic() - started < 30


def test_a_rank_whose_every_message_is_rejected_is_said_so_once_not_as_no_rank_at_all(tmp_path: Path) -> None:
    """Ranks of another ddpwatch version: every message refused, and the recorder said *no rank
    connected* (with ``--wait``) or sat silent until stopped, nothing logged of why."""
    from ddpwatch.record.recorder import StopRule, record

    address = f"tcp://127.0.0.1:{free_port()}"

    def newer_rank() -> None:
        context = zmq.Context()
        dealer = context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(address)
        for seq in range(30):  # a heartbeat in wire version 2, for 1.5 s: the recorder is listening by then
            dealer.send(msgpack.packb({"v": 2, "type": "heartbeat", "rank": 0, "seq": seq, "dropped": 0,
                                       "body": {"rank": 0, "time": time.time(), "step": seq}}))
            time.sleep(0.05)
        context.destroy(linger=0)

    sender = threading.Thread(target=newer_rank)
    sender.start()
    lines: list[str] = []
    session = record(address, tmp_path, StopRule(idle_exit_s=1.0, connect_within_s=60.0), log=lines.append)
    sender.join()
    assert session.messages == 0 and session.rejected["wrong_version"] >= 1
    assert lines.count("ddpwatch record: rejected a message (wrong_version: version 2, expected 1); "
                       "later ones of the kind are counted") == 1
    assert lines[-1].startswith("ddpwatch record: stopped (no message for 1 s); 0 messages")


def test_a_switch_command_before_any_rank_is_no_rank_having_spoken() -> None:
    """``ddpwatch switch`` sent to a recorder before the run started: it was counted as a rank
    speaking, and ``--idle-exit`` ended the recording before the run came (the README: it counts
    only once a rank has spoken)."""
    from ddpwatch.record.recorder import StopRule
    from instrumented_ddp.wire.messages import SwitchCommand

    session = Session()
    session.ingest(Envelope(SwitchCommand(command_id="c-1", strategy="zero1"), -1, 0, 0))
    assert StopRule(idle_exit_s=1.0).reached(session, started=0.0, last_message=0.0) is None


def test_record_stopped_by_ctrl_c_before_its_wait_is_no_error(tmp_path: Path) -> None:
    """Ctrl-C before ``--wait`` ran out is the user's stop, not a run that never connected."""
    recorder = subprocess.Popen([sys.executable, "-m", "ddpwatch.cli", "record", "--listen", f"tcp://127.0.0.1:{free_port()}",
                                 "--out", str(tmp_path), "--wait", "60"], stderr=subprocess.PIPE, text=True, cwd=REPO_ROOT)
    try:
        assert "listening on" in recorder.stderr.readline()
        recorder.send_signal(signal.SIGINT)
        _, stderr = recorder.communicate(timeout=30)
    finally:
        recorder.kill()
    assert recorder.returncode == 0, stderr
    assert "stopped (SIGINT)" in stderr and "error" not in stderr


finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False)


@settings(max_examples=300, deadline=None)
@given(
    window=st.tuples(finite, finite),
    spans=st.lists(st.tuples(st.sampled_from(["forward", "backward", "optimizer", "all_reduce", "broadcast", "wait", "data"]),
                             finite, finite, st.booleans()), max_size=12),
)
def test_step_figures_stay_in_range_and_add_up_for_any_timeline(window: tuple[float, float], spans: list) -> None:
    start, end = sorted(window)
    record = StepReport(0, 1, "simple", {}, start, end, [Span(k, min(a, b), max(a, b), blocking) for k, a, b, blocking in spans], 1, 1)
    figures = step_figures(record, world_size=2)
    parts = (figures.compute_pct, figures.non_compute_pct, figures.idle_pct)
    assert all(0.0 <= p <= 100.0 + 1e-9 for p in (*parts, figures.overlap_pct, figures.comm_overhead_pct))
    if end > start:
        assert sum(parts) == pytest.approx(100.0, abs=1e-6)


@settings(max_examples=200, deadline=None)
@given(calls=st.lists(st.lists(st.tuples(st.sampled_from(["", "p0", "p1", "b0", "state"]), st.floats(0, 10)), max_size=8),
                      min_size=2, max_size=4))
def test_waits_are_never_negative_for_any_tags_and_durations(calls: list) -> None:
    from ddpwatch.figures.cross_rank import calls_of, cross_rank_waits

    records = {rank: StepReport(rank, 1, "simple", {}, 0.0, 100.0,
                                [Span("all_reduce", float(i), float(i) + d, False, 0, tag) for i, (tag, d) in enumerate(spans)], 1, 1)
               for rank, spans in enumerate(calls)}
    waits = cross_rank_waits(calls_of(records))
    assert sorted(waits) == list(range(len(calls))) and all(w >= 0.0 for w in waits.values())
