"""A stalled run named while it stalls, end to end: a user's own DDP loop attached on gloo ranks
(``workers/hang_probe.py``) recorded by ``ddpwatch record``, one rank made to sleep before its
backward while the others wait in DDP's first bucket. The recorder must say who, in what and
where within the stall threshold plus a heartbeat, keep ``stalls.json`` while it lasts, and say
when it ends; a marked pause of the same length must name nothing."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
from launch import REPO_ROOT, Recorder, RankGroup, run_ranks

HANG_PROBE = REPO_ROOT / "tests" / "support" / "workers" / "hang_probe.py"
SLEEP_S = 8.0
#: Named within the 3 s floor plus a heartbeat (1 s) and the watch's half-second look, with a
#: second to spare for the recorder's own loop on a loaded machine.
NAMED_WITHIN_S = 5.5


def recorded(tmp_path: Path, nproc: int, *args: str) -> tuple[dict, str]:
    with Recorder(tmp_path / "out", "--idle-exit", "30") as recorder:
        ranks = run_ranks(HANG_PROBE, ["--address", recorder.address, "--steps", "16", *args], world_size=nproc, timeout_s=120)
        assert all(rank.returncode == 0 for rank in ranks), [rank.stdout[-2000:] + rank.stderr[-2000:] for rank in ranks]
        err = recorder.wait(60)
    return json.loads((tmp_path / "out" / "summary.json").read_text()), err


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("nproc", "sleeper"), [(2, 1), (3, 2)])
def test_a_rank_sleeping_before_its_backward_is_named_behind_with_its_stack(tmp_path: Path, nproc: int, sleeper: int) -> None:
    summary, err = recorded(tmp_path, nproc, "--sleep-rank", str(sleeper), "--sleep-step", "12", "--sleep-s", str(SLEEP_S))
    [stall] = summary["stalls"]
    assert (stall["kind"], stall["culprits"], stall["step"]) == ("behind", [sleeper], 12), stall
    assert stall["waiting"] == [rank for rank in range(nproc) if rank != sleeper]
    assert stall["collective"]["kind"] == "all_reduce" and stall["collective"]["tag"] == "b0"
    assert stall["named_after_s"] <= NAMED_WITHIN_S
    assert SLEEP_S - 1.0 <= stall["duration_s"] <= SLEEP_S + 2.0
    assert any("hang_probe.py" in line and "time.sleep(args.sleep_s)" in line for line in stall["stacks"][str(sleeper)])
    assert f"STALL: rank {sleeper} has not reached all_reduce b0" in err and "hang_probe.py" in err
    assert "the stall at step 12 ended" in err
    assert json.loads((tmp_path / "out" / "stalls.json").read_text())["stalls"] == summary["stalls"]


@pytest.mark.timeout(240)
def test_a_marked_pause_as_long_names_no_stall(tmp_path: Path) -> None:
    summary, err = recorded(tmp_path, 2, "--pause-s", str(SLEEP_S))
    assert summary["stalls"] == [] and "STALL" not in err
    assert not (tmp_path / "out" / "stalls.json").exists()


def stall_kind_in(path: Path, kind: str, group: RankGroup, within_s: float) -> dict[str, Any]:
    """The stall of ``stalls.json`` once it reads ``kind``, the recorder's file polled as a user would."""
    deadline = time.monotonic() + within_s
    while True:
        stalls = json.loads(path.read_text())["stalls"] if path.exists() else []
        if stalls and stalls[-1]["kind"] == kind:
            return stalls[-1]
        assert time.monotonic() < deadline, stalls
        assert all(rank.poll() is None for rank in group.ranks[1:]) or kind == "lost", "a rank ended"
        time.sleep(0.1)


@pytest.mark.timeout(240)
def test_a_rank_killed_while_the_others_wait_turns_the_stall_lost(tmp_path: Path) -> None:
    """Rank 1 sleeps (behind, named in stalls.json); then it is killed by SIGKILL: the same stall
    reads lost, rank 1 silent, rank 0 waiting in b0, while the job is still there to be looked at."""
    with Recorder(tmp_path / "out", "--idle-exit", "30") as recorder:
        group = RankGroup([str(HANG_PROBE), "--address", recorder.address, "--steps", "16", "--sleep-rank", "1",
                           "--sleep-step", "12", "--sleep-s", "60"], 2)
        try:
            behind = stall_kind_in(tmp_path / "out" / "stalls.json", "behind", group, within_s=90)
            assert behind["culprits"] == [1]
            os.killpg(group.ranks[1].pid, signal.SIGKILL)
            lost = stall_kind_in(tmp_path / "out" / "stalls.json", "lost", group, within_s=20)
        finally:
            group.stop()
    assert (lost["culprits"], lost["step"], lost["duration_s"]) == ([1], 12, None)
    assert lost["waiting"] in ([0], [])  # rank 0 waits in b0, unless gloo already failed it on the reset
