"""The flags of what a listener feeds (``--prometheus``, ``--prometheus-linger``): a wrong one,
or a port already taken, is one line and exit 2 before anything listens; a command that does
not read one refuses it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ddpwatch.cli import main


def one_error_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.mark.parametrize(("flags", "says"), [
    (["--prometheus", "localhost:"], "ddpwatch record: error: --prometheus 'localhost:': give HOST:PORT"),
    (["--prometheus", "127.0.0.1:9400", "--prometheus-linger", "-1"],
     "ddpwatch record: error: --prometheus-linger must be 0 or more seconds"),
])
def test_a_wrong_flag_is_one_line_and_exit_2(flags: list[str], says: str, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    assert one_error_line(["record", "--out", str(tmp_path), "--wait", "1", *flags], capsys).startswith(says)
    assert not (tmp_path / "session.ddpwatch").exists()  # refused before anything listened


def test_a_port_taken_is_one_line_and_exit_2_before_listening(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_error_line(["tune", "--out", str(tmp_path), "--prometheus", f"127.0.0.1:{port}"], capsys)
    assert line.startswith(f"ddpwatch tune: error: --prometheus 127.0.0.1:{port}: cannot listen there")


def test_a_command_that_serves_no_metrics_refuses_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error_line(["--prometheus", "127.0.0.1:9400", "summary", "nowhere"], capsys)
    assert line == ("ddpwatch summary: error: --prometheus does nothing for summary: it is not one of its options "
                    "(`ddpwatch summary --help` lists them)")
