"""A stalled run named while it stalls, end to end: a user's own DDP loop attached on gloo ranks
(``workers/hang_probe.py``) recorded by ``ddpwatch record``, made to stall each way: one rank
sleeping before its backward while the others wait in DDP's first bucket (behind); every rank
held in one all-reduce over a slow link (in_collective, ``workers/slow_link.py``); one rank
issuing an all-reduce the others never issue (desync); a rank killed while the others wait
(lost). The recorder must say who, in what and where within the stall threshold plus a
heartbeat, keep ``stalls.json`` while it lasts, and say when it ends; a marked pause of the same
length must name nothing."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path
from collections.abc import Callable
from typing import Any

import pytest
from launch import REPO_ROOT, Recorder, RankGroup, run_ranks

HANG_PROBE = REPO_ROOT / "tests" / "support" / "workers" / "hang_probe.py"
SLEEP_S = 8.0
#: Named within the 3 s floor plus a heartbeat (1 s) and the watch's half-second look, with a
#: second to spare for the recorder's own loop on a loaded machine.
NAMED_WITHIN_S = 5.5


def recorded(tmp_path: Path, nproc: int, *args: str) -> tuple[dict, str]:
    summary, err, _ = recorded_with_output(tmp_path, nproc, *args)
    return summary, err


def recorded_with_output(tmp_path: Path, nproc: int, *args: str) -> tuple[dict, str, str]:
    """summary.json, the recorder's stderr and every rank's stdout of one recorded run."""
    with Recorder(tmp_path / "out", "--idle-exit", "30") as recorder:
        ranks = run_ranks(HANG_PROBE, ["--address", recorder.address, "--steps", "16", *args], world_size=nproc, timeout_s=120)
        assert all(rank.returncode == 0 for rank in ranks), [rank.stdout[-2000:] + rank.stderr[-2000:] for rank in ranks]
        err = recorder.wait(60)
    return json.loads((tmp_path / "out" / "summary.json").read_text()), err, "".join(rank.stdout for rank in ranks)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("nproc", "sleeper"), [(2, 1), (3, 2)])
def test_a_rank_sleeping_before_its_backward_is_named_behind_with_its_stack(tmp_path: Path, nproc: int, sleeper: int,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """With ``DDPWATCH_NATIVE_STACKS=1``: the sleeper's native stack, from py-spy, too."""
    monkeypatch.setenv("DDPWATCH_NATIVE_STACKS", "1")
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
    refused = stall["native_errors"].get(str(sleeper), "")
    if refused.startswith("py-spy could not read this process"):
        pytest.skip(f"this system refuses ptrace: {refused}")
    native = stall["native_stacks"][str(sleeper)]
    assert any("hang_probe.py" in line for line in native) and any("sleep" in line for line in native[-3:]), native


@pytest.mark.timeout(240)
def test_a_marked_pause_of_ten_seconds_and_a_compiling_step_name_no_stall(tmp_path: Path) -> None:
    """The pause comes after step 5, the compile in step 10; each outlasts the moment a stall
    would be named (the 3 s floor, a heartbeat and a look), so a stall missed is no luck."""
    summary, err, out = recorded_with_output(tmp_path, 2, "--pause-s", "10", "--compile-step", "10")
    compiles = [float(line.split()[2]) for line in out.splitlines() if line.startswith("compiling took")]
    assert len(compiles) == 2 and min(compiles) >= NAMED_WITHIN_S - 1.0, compiles
    assert summary["stalls"] == [] and "STALL" not in err
    assert not (tmp_path / "out" / "stalls.json").exists()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nproc", [2, 3])
def test_every_rank_held_in_one_slow_collective_is_named_in_collective(tmp_path: Path, nproc: int) -> None:
    summary, err = recorded(tmp_path, nproc, "--slow-step", "12", "--slow-s", str(SLEEP_S))
    [stall] = summary["stalls"]
    assert (stall["kind"], stall["culprits"], stall["waiting"], stall["step"]) == ("in_collective", [], list(range(nproc)), 12)
    assert stall["collective"] == {"kind": "all_reduce", "tag": "l0", "bytes": 4, "group": "group slowlink", "seq": 1}
    assert stall["named_after_s"] <= NAMED_WITHIN_S
    assert SLEEP_S - 1.0 <= stall["duration_s"] <= SLEEP_S + 2.0
    assert all("dist.all_reduce(loss.detach().clone(), group=slow)" in stall["places"][str(rank)] for rank in range(nproc))
    assert "STALL: every rank has been in all_reduce l0 (#1 on group slowlink) of step 12" in err
    assert "the stall at step 12 ended" in err


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("nproc", "culprits"), [(2, [0, 1]), (3, [1])])
def test_an_all_reduce_one_rank_alone_issues_is_named_a_desync_with_both_sides(tmp_path: Path, nproc: int,
                                                                                culprits: list[int]) -> None:
    """Rank 1 issues an all-reduce on a group of every rank that the others never use, before its
    backward of step 12; the others wait in DDP's b0. Neither side can go on: the stall reads
    desync, each side's collective and call site in it (two ranks: no majority to tell which)."""
    with Recorder(tmp_path / "out", "--idle-exit", "30") as recorder:
        group = RankGroup([str(HANG_PROBE), "--address", recorder.address, "--steps", "16", "--extra-all-reduce-rank", "1",
                           "--extra-step", "12", "--extra-group", "side"], nproc)
        try:
            stall = stall_in(tmp_path / "out" / "stalls.json", group, 90,
                             lambda stall: stall["kind"] == "desync" and len(stall["in_flight"]) == nproc)
        finally:
            group.stop()
    assert (stall["culprits"], stall["step"], stall["duration_s"]) == (culprits, 12, None)
    assert stall["named_after_s"] <= NAMED_WITHIN_S
    sides = {int(rank): (call["tag"], call["group"]) for rank, call in stall["in_flight"].items()}
    assert sides[1][0] == "l0" and sides[1][1].startswith("group ")  # the side group's first
    assert all(sides[rank] == ("b0", "default") for rank in range(nproc) if rank != 1)
    assert "dist.all_reduce(torch.ones(1), group=side)" in stall["places"]["1"]
    assert "loss.backward()" in stall["places"]["0"]


def stall_kind_in(path: Path, kind: str, group: RankGroup, within_s: float) -> dict[str, Any]:
    """The stall of ``stalls.json`` once it reads ``kind``, the recorder's file polled as a user would."""
    return stall_in(path, group, within_s, lambda stall: stall["kind"] == kind, lost_ok=kind == "lost")


def stall_in(path: Path, group: RankGroup, within_s: float, wanted: Callable[[dict[str, Any]], bool],
             lost_ok: bool = False) -> dict[str, Any]:
    """The latest stall of ``stalls.json`` once ``wanted`` says it is the one, the file polled as a user would."""
    deadline = time.monotonic() + within_s
    while True:
        stalls = json.loads(path.read_text())["stalls"] if path.exists() else []
        if stalls and wanted(stalls[-1]):
            return stalls[-1]
        assert time.monotonic() < deadline, stalls
        assert all(rank.poll() is None for rank in group.ranks[1:]) or lost_ok, "a rank ended"
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
