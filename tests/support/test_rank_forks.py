"""A rank forked from the suite's fork server (``rank_forks``) runs its script as ``python SCRIPT``
would: same argv, folder, environment, output, exit status, session; and is never forked where
its environment differs where an import reads it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import rank_forks
from launch import rank_environment, start_rank, wait_for

SCRIPT = """\
import os, sys
print("argv", sys.argv[1:], "cwd", os.getcwd(), "rank", os.environ["RANK"], "path0", sys.path[0])
print("session leader", os.getsid(0) == os.getpid(), "stdin", sys.stdin.read() == "")
print("torch imported before my first line", "torch" in sys.modules)
print("to stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("the script failed")
if sys.argv[1] == "hang":
    import time
    print("hanging", flush=True)
    time.sleep(600)
sys.exit(int(sys.argv[1]))
"""


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "scripts" / "probe.py"
    path.parent.mkdir()
    path.write_text(SCRIPT)
    return path


def test_a_forked_rank_runs_its_script_as_python_would(script: Path, tmp_path: Path) -> None:
    rank = start_rank([str(script), "3"], tmp_path, rank_environment(1, 2, 12345))
    assert isinstance(rank, rank_forks.ForkedRank)
    out, err = rank.communicate(timeout=60)
    assert rank.returncode == 3
    assert out.splitlines() == [
        f"argv ['3'] cwd {tmp_path} rank 1 path0 {script.parent}",
        "session leader True stdin True",
        "torch imported before my first line True",
    ]
    assert err == "to stderr\n"


def test_an_exception_leaving_the_script_prints_its_traceback_and_exits_1(script: Path, tmp_path: Path) -> None:
    rank = start_rank([str(script), "raise"], tmp_path, rank_environment(0, 2, 12345))
    out, err = rank.communicate(timeout=60)
    assert rank.returncode == 1
    assert err.splitlines()[-1] == "ValueError: the script failed"
    assert "Traceback (most recent call last):" in err


def test_a_forked_rank_killed_through_its_session_reads_as_killed_by_the_signal(script: Path, tmp_path: Path) -> None:
    rank = start_rank([str(script), "hang"], tmp_path, rank_environment(0, 2, 12345))
    assert rank.poll() is None
    assert wait_for(lambda: _printed(rank), 60)
    os.killpg(rank.pid, signal.SIGKILL)
    assert rank.wait(timeout=30) == -signal.SIGKILL
    assert rank.poll() == -signal.SIGKILL


def _printed(rank: rank_forks.ForkedRank | subprocess.Popen[str]) -> bool:
    assert isinstance(rank, rank_forks.ForkedRank)
    rank._out.seek(0)
    return b"hanging" in rank._out.read()


def test_a_rank_whose_environment_an_import_would_read_differently_is_started_as_a_process(
        script: Path, tmp_path: Path) -> None:
    differing = dict(rank_environment(0, 2, 12345), HF_HUB_OFFLINE="1", DDPWATCH_ANYTHING="x")
    rank = start_rank([str(script), "0"], tmp_path, differing)
    assert isinstance(rank, subprocess.Popen)
    out, _ = rank.communicate(timeout=60)
    assert rank.returncode == 0 and "torch imported before my first line False" in out
    assert rank.args == [sys.executable, str(script), "0"]
