"""The flags of what a listener feeds (``--prometheus``, ``--tensorboard``, ``--wandb``): a wrong
one, a port already taken or a missing extra is one line and exit 2 before anything listens; a
command that does not read one refuses it."""

from __future__ import annotations

import builtins
import socket
from pathlib import Path
from typing import Any

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


@pytest.mark.parametrize(("flags", "module", "extra"), [(["--tensorboard", "board"], "tensorboard", "tensorboard"),
                                                        (["--wandb"], "wandb", "wandb")])
def test_a_missing_extra_is_one_line_naming_it_and_exit_2(flags: list[str], module: str, extra: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    real_import = builtins.__import__

    def without(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == module or name.startswith(module + "."):
            raise ImportError(f"No module named {module!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", without)
    line = one_error_line(["record", "--out", str(tmp_path / "out"), *flags], capsys)
    assert line == f"ddpwatch record: error: {flags[0]} needs the {extra} extra: pip install 'ddpwatch[{extra}]'"


def test_naming_a_wandb_run_without_wandb_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    line = one_error_line(["record", "--out", str(tmp_path), "--wandb-run", "mine"], capsys)
    assert line == "ddpwatch record: error: --wandb-project and --wandb-run name the run --wandb logs to: give --wandb too"
