"""``ddpwatch --help`` and every command's ``--help`` end with one example of that command, one
that parses and passes the checks made before the command runs; ``ddpwatch --version`` prints the
installed package's version, the one ``pyproject.toml`` declares."""

from __future__ import annotations

import argparse
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from ddpwatch.cli import build_parser, main, needs_out, refuse_unread_options

REPO_ROOT = Path(__file__).resolve().parents[2]


def subcommands() -> list[str]:
    (commands,) = (action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    return sorted(commands.choices)


def pyproject_version() -> str:
    return str(tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["version"])


def help_lines(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """What ``ddpwatch ARGV --help`` prints, a line each; it exits 0."""
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    return capsys.readouterr().out.rstrip("\n").splitlines()


def example_in(lines: list[str]) -> list[str]:
    """The example the help ends with, as words: the last line, under the one ``example:`` heading."""
    assert lines[-2] == "example:" and lines.count("example:") == 1, lines[-3:]
    return shlex.split(lines[-1])


def test_the_command_list_is_the_one_these_tests_walk() -> None:
    assert subcommands() == ["compare", "demo", "doctor", "record", "replay", "summary", "switch", "tune"]


@pytest.mark.parametrize("command", subcommands())
def test_each_commands_help_ends_with_one_example_of_that_command(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    lines = help_lines([command], capsys)
    assert lines[-1].strip().startswith(f"ddpwatch {command} ")
    words = example_in(lines)
    parser = build_parser()
    args = parser.parse_args(words[1:])
    assert args.command == command
    refuse_unread_options(args, parser)  # neither raises: the example runs as far as the command itself
    needs_out(args)


def test_the_top_level_help_ends_with_one_example_of_the_dashboard(capsys: pytest.CaptureFixture[str]) -> None:
    lines = help_lines([], capsys)
    assert lines[-1].strip().startswith("ddpwatch ")
    words = example_in(lines)
    parser = build_parser()
    args = parser.parse_args(words[1:])
    assert args.command is None  # no command: the live dashboard
    refuse_unread_options(args, parser)


def test_version_prints_the_pyproject_version_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    assert capsys.readouterr().out == f"ddpwatch {pyproject_version()}\n"


def test_python_dash_m_ddpwatch_version_prints_it_too() -> None:
    result = subprocess.run([sys.executable, "-m", "ddpwatch", "--version"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"ddpwatch {pyproject_version()}\n", "")
