"""``ddpwatch tune --strategies`` on a real run: two gloo ranks of ``train.py``'s tiny model,
started on ddp, switched live to zero2 and measured; tune.json and summary.json hold a row per
choice with the predicted and measured step and memory; wrong input is one line, exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from launch import REPO_ROOT, free_port, run_ranks

FIELDS = {"strategy", "grad_accum", "predicted_ms", "measured_ms", "predicted_held_mib", "measured_held_mib",
          "predicted_peak_mib", "measured_peak_mib"}


def tune(out: Path, *args: str, steps: int = 40) -> tuple[subprocess.CompletedProcess[str], list[subprocess.CompletedProcess[str]]]:
    address = f"tcp://127.0.0.1:{free_port()}"
    process = subprocess.Popen([sys.executable, "-m", "ddpwatch.cli", "tune", "--listen", address, "--out", str(out),
                                "--idle-exit", "10", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ranks = run_ranks(REPO_ROOT / "train.py", ["--strategy", "ddp", "--steps", str(steps), "--watch", address,
                                                   "--device", "cpu", "--bucket-mb", "1"], world_size=2, timeout_s=240)
        out_text, err_text = process.communicate(timeout=90)
    finally:
        process.kill()
    return subprocess.CompletedProcess(process.args, process.returncode, out_text, err_text), ranks


@pytest.mark.timeout(300)
def test_the_run_is_switched_to_each_strategy_and_each_is_predicted_then_measured(tmp_path: Path) -> None:
    done, ranks = tune(tmp_path / "out", "--strategies", "ddp,zero2", "--steps-per-size", "4")
    assert all(rank.returncode == 0 for rank in ranks), [rank.stderr[-2000:] for rank in ranks]
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads((tmp_path / "out" / "tune.json").read_text())["strategies"]
    assert [(row["strategy"], row["grad_accum"]) for row in rows] == [("ddp", 1), ("zero2", 1)]
    for row in rows:
        assert FIELDS <= set(row) and row["measured_ms"] > 0 and row["predicted_ms"] is not None, row
        assert abs(row["predicted_held_mib"] - row["measured_held_mib"]) <= 0.02 * row["measured_held_mib"], row
    assert rows[1]["measured_held_mib"] < rows[0]["measured_held_mib"]  # zero2 holds a shard of gradients and state
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["tune"]["strategies"] == rows
    assert "switching to zero2 at K=1" in done.stderr and "median |error|" in done.stdout


@pytest.mark.timeout(300)
def test_a_k_that_does_not_divide_the_batch_is_one_line_and_nothing_is_switched(tmp_path: Path) -> None:
    done, ranks = tune(tmp_path / "out", "--strategies", "zero1", "--grad-accum", "1,3", steps=12)
    assert done.returncode == 2 and all(rank.returncode == 0 for rank in ranks)
    assert "error: --grad-accum 3 does not divide the global batch of 16 over 2 ranks: nothing switched" in done.stderr
    assert "switching" not in done.stderr


@pytest.mark.parametrize(("args", "said"), [
    (["--strategies", "ddp,zero3"], "unknown strategy zero3"),
    (["--strategies", "ddp", "--grad-accum", "0"], "every micro-step count must be 1 or more"),
    (["--strategies", "ddp", "--memory-budget", "0"], "the memory budget must be a positive number of GiB"),
    (["--strategies", "ddp", "--sizes", "1,4"], "--sizes sweeps caps; --strategies sweeps strategies: give one"),
    (["--grad-accum", "2"], "--grad-accum goes with --strategies"),
])
def test_wrong_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], said: str) -> None:
    done = subprocess.run([sys.executable, "-m", "ddpwatch.cli", "tune", "--out", str(tmp_path / "out"),
                           "--listen", f"tcp://127.0.0.1:{free_port()}", "--wait", "1", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and said in done.stderr, done.stderr
