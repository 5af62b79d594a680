"""``ddpwatch doctor``'s judgement, on made-up probe answers, comparisons and bench output; and
what it says on a machine without a GPU (this one), for real."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddpwatch.doctor import checkup as doctor_module
from ddpwatch.doctor.checkup import Section, nvml_checks, overhead_checks, profile_sections, render, sync_checks
from ddpwatch.doctor.clock_pairing import ClockOffset
from ddpwatch.doctor.profile_check import Check, RankComparison
from launch import REPO_ROOT

GIB = 2**30


def busy_sample(**changes: float) -> dict[str, float]:
    sample = {"gpu_util_pct": 98.0, "mem_util_pct": 40.0, "mem_used_bytes": 3.0 * GIB, "mem_total_bytes": 80.0 * GIB,
              "power_w": 410.0, "pcie_tx_bytes_per_s": 2.0e6, "pcie_rx_bytes_per_s": 1.0e6}
    sample.update(changes)
    return sample


def failed(checks: tuple[Check, ...]) -> list[str]:
    return [check.name for check in checks if not check.passed]


def test_busy_gpu_read_through_nvml_passes() -> None:
    checks = nvml_checks({"note": "", "samples": [busy_sample(gpu_util_pct=61.0), busy_sample()]})
    assert failed(checks) == []
    assert checks[0].ddpwatch == 98.0  # the busiest sample


def test_an_idle_reading_of_a_busy_gpu_fails_as_the_wrong_gpu() -> None:
    """What reading NVML's device 0 gives where CUDA_VISIBLE_DEVICES made another GPU cuda:0."""
    checks = nvml_checks({"note": "", "samples": [busy_sample(gpu_util_pct=0.0)] * 3})
    assert failed(checks) == ["GPU utilization while busy"]
    assert "another GPU" in checks[0].detail


def test_power_that_is_not_supported_is_absent_and_passes_but_an_impossible_one_fails() -> None:
    absent = [{k: v for k, v in busy_sample().items() if k != "power_w"}]
    assert failed(nvml_checks({"note": "", "samples": absent})) == []
    assert failed(nvml_checks({"note": "", "samples": [busy_sample(power_w=0.0)]})) == ["power"]


def test_memory_used_beyond_total_fails() -> None:
    assert failed(nvml_checks({"note": "", "samples": [busy_sample(mem_used_bytes=90.0 * GIB)]})) == ["memory used / total"]


def test_memory_used_is_held_against_its_own_samples_total() -> None:
    """A sample that read one of the two (the other's call failed that once) is left out, not
    paired with the next sample's: 90 GiB used of 80 read as 90 of 96 before."""
    samples = [{k: v for k, v in busy_sample(mem_total_bytes=96.0 * GIB).items() if k != "mem_used_bytes"},
               busy_sample(mem_used_bytes=90.0 * GIB)]
    checks = nvml_checks({"note": "", "samples": samples})
    assert failed(checks) == ["memory used / total"]
    assert checks[1].detail == "90.0 / 80.0 GiB"


def test_nvml_not_used_fails_with_the_ranks_reason() -> None:
    note = "NVML not used for cuda:0 (nvmlInit failed: Driver Not Loaded); sending CPU readings instead"
    (check,) = nvml_checks({"note": note, "samples": []})
    assert not check.passed and check.detail == note


def test_syncs_in_watched_steps_fail_and_are_named() -> None:
    assert failed(sync_checks({"steps": 8, "syncs": 0, "examples": []})) == []
    (check,) = sync_checks({"steps": 8, "syncs": 8, "examples": ["called a synchronizing CUDA operation"]})
    assert not check.passed and "synchronizing" in check.detail


BENCH_OUTPUT = """\
strategy  watched ms  plain ms  ratio  90% interval   (40 steps each, alternating, 1 ranks on cuda, micro-batch 4x64, blocks of 5, telemetry dropped 0)
simple          41.2      40.9  1.007  0.990- 1.020
ga              41.0      40.8  1.005  0.998- 1.011
hook            52.3      50.1  1.044  1.030- 1.061
async           38.0      37.9  1.003  0.991- 1.012
bucket          20.1      20.0  1.005  0.999- 1.008
ddp             19.8      19.9  0.995  0.980- 1.004
"""


def test_overhead_is_checked_per_strategy_against_the_goal() -> None:
    checks = overhead_checks(BENCH_OUTPUT)
    assert [c.name for c in checks] == [f"overhead {s}" for s in ("simple", "ga", "hook", "async", "bucket", "ddp")]
    assert failed(checks) == ["overhead hook"]
    assert checks[2].ddpwatch == pytest.approx(1.044) and checks[2].detail.endswith("90% interval 1.030-1.061")
    assert [c.ddpwatch for c in overhead_checks("bucket  20.1  20.0  1.005\n")] == [pytest.approx(1.005)]  # before the interval


def test_overhead_without_a_table_fails() -> None:
    (check,) = overhead_checks("Traceback (most recent call last): ...")
    assert not check.passed


def comparison(rank: int, *names_that_fail: str) -> RankComparison:
    names = ("profiled steps reported", "collectives per step", "collective duration", "Compute%", "Overlap%",
             "device syncs per step")
    checks = tuple(Check(name, 1.0, 1.0, "-", name not in names_that_fail) for name in names)
    return RankComparison(rank, ClockOffset(0.0, {}, 0, "launch-paired"), (), (), checks, ("offset from 40 pairs",))


def test_a_one_rank_run_leaves_out_what_the_profiler_cannot_see() -> None:
    (section,) = profile_sections("1 rank(s) bucket", [comparison(0, "collective duration")], world_size=1)
    assert [c.name for c in section.checks] == ["profiled steps reported", "Compute%", "device syncs per step"]
    assert section.passed and any("one rank" in note for note in section.notes)
    two = profile_sections("2 rank(s) bucket", [comparison(0), comparison(1, "collective duration")], world_size=2)
    assert [s.passed for s in two] == [True, False] and len(two[1].checks) == 6


def test_the_table_names_every_miss_in_its_verdict() -> None:
    sections = [Section("probe: watched steps", sync_checks({"steps": 8, "syncs": 0})),
                Section("overhead, 1 GPU", overhead_checks(BENCH_OUTPUT))]
    text = render(sections)
    assert text.splitlines()[0].split() == ["run", "check", "ddpwatch", "reference", "expected", "result", "detail"]
    assert "verdict: FAIL - 1 of 7 checks missed: overhead, 1 GPU: overhead hook" in text
    assert "verdict: PASS - all 1 checks held" in render(sections[:1])


def _probe(devices: int) -> dict[str, Any]:
    return {"torch": "2.13.0+cu128", "cuda_available": True, "cuda": "12.8", "nccl": "2.27.5",
            "devices": [{"index": i, "name": "NVIDIA H100 80GB HBM3", "memory_bytes": 80 * GIB} for i in range(devices)],
            "nvml": {"note": "", "samples": [busy_sample()]}, "sync_check": {"steps": 8, "syncs": 0, "examples": []}}


def test_ranks_sharing_a_gpu_report_its_time_figures_unchecked_and_check_the_collectives() -> None:
    shared = profile_sections("2 ranks sharing 1 GPU(s) bucket", [comparison(0, "Compute%", "Overlap%")], world_size=2,
                              sharing_gpus=True)
    assert [c.name for c in shared[0].checks] == ["profiled steps reported", "collectives per step", "collective duration",
                                                  "device syncs per step"]
    assert shared[0].passed and sum("time-slice one GPU" in note for note in shared[0].notes) == 2
    (failing,) = profile_sections("2 ranks sharing 1 GPU(s) bucket", [comparison(0, "collective duration")], world_size=2,
                                  sharing_gpus=True)
    assert not failing.passed


def test_ranks_sharing_a_gpu_split_its_batch() -> None:
    assert doctor_module.batch_per_rank(2, 2) == doctor_module.BATCH_PER_RANK
    assert doctor_module.batch_per_rank(2, 1) == doctor_module.BATCH_PER_RANK // 2
    assert doctor_module.batch_per_rank(3, 2) == doctor_module.BATCH_PER_RANK // 2


@pytest.mark.parametrize(("devices", "ranks", "failing", "status"),
                         [(2, None, (), 0), (2, None, ("Compute%",), 1), (1, None, ("Overlap%",), 0),
                          (1, 2, ("Compute%",), 0), (1, 2, ("collectives per step",), 1)])
def test_doctor_runs_both_timing_modes_on_two_ranks_and_exits_by_the_verdict(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], devices: int, ranks: int | None,
        failing: tuple[str, ...], status: int) -> None:
    runs: list[tuple[int, str, bool | None]] = []

    world = ranks or devices
    unwatched: dict[int, dict[int, tuple[str, ...]]] = {rank: {3: ("cudaStreamSynchronize",)} for rank in range(world)}

    def fake_unwatched(workdir: Path, world_size: int, gpus: int, strategy: str) -> dict[int, dict[int, tuple[str, ...]]]:
        assert gpus == devices
        runs.append((world_size, strategy, None))
        return unwatched

    def fake_run(workdir: Path, world_size: int, gpus: int, strategy: str, nccl_timing: bool,
                 reference: Any) -> list[RankComparison]:
        assert reference is unwatched  # each watched run's syncs are held against the unwatched twin
        runs.append((world_size, strategy, nccl_timing))
        return [comparison(rank, *failing) for rank in range(world_size)]

    def fake_overhead(steps: int, strategies: tuple[str, ...], training_shape: bool) -> str:
        # the launch-bound tiny model's 1.044 is reported, not checked
        return BENCH_OUTPUT.replace("1.044", "1.004") if training_shape else BENCH_OUTPUT

    monkeypatch.setattr(doctor_module, "run_probe", lambda: _probe(devices))
    monkeypatch.setattr(doctor_module, "unwatched_syncs", fake_unwatched)
    monkeypatch.setattr(doctor_module, "profiled_run", fake_run)
    monkeypatch.setattr(doctor_module, "run_overhead", fake_overhead)
    monkeypatch.setattr(doctor_module, "self_measured_run", lambda workdir, strategy: SELF_MEASURED_SUMMARY)
    assert doctor_module.doctor(["bucket"], ranks=ranks) == status
    expected_runs = ([(2, "bucket", None), (2, "bucket", True), (2, "bucket", False)] if world == 2
                     else [(1, "bucket", None), (1, "bucket", True)])
    assert runs == expected_runs
    out = capsys.readouterr().out
    assert "NVIDIA H100 80GB HBM3" in out and ("verdict: PASS" in out) == (status == 0)
    assert "tiny model, every kernel a launch" in out and "hook 1.044" in out
    assert ("2 ranks sharing 1 GPU(s) bucket, NCCL timing off, rank 1" in out) == (ranks == 2)
    assert "1 GPU, tiny model, 4 steps in 20 unwatched" in out and "self-measured overhead, bucket" in out


SELF_MEASURED_SUMMARY = {"segments": [{"watch_overhead": {"pct": 0.42, "interval_pct": [0.1, 0.9], "unwatched_steps": 48}}]}


def test_the_run_s_own_measurement_is_shown_beside_the_bench_s_ratio() -> None:
    (check,) = doctor_module.self_measured_checks(SELF_MEASURED_SUMMARY, "bucket", BENCH_OUTPUT)
    assert check.passed and check.ddpwatch == pytest.approx(0.42) and check.profiler == pytest.approx(0.5)  # bench 1.005
    assert check.detail.startswith("90 % interval 0.1 to 0.9 %, from 48 unwatched steps")
    (unmeasured,) = doctor_module.self_measured_checks({"segments": [{"watch_overhead": None}]}, "bucket", BENCH_OUTPUT)
    assert not unmeasured.passed and "no unwatched step" in unmeasured.detail
    (empty,) = doctor_module.self_measured_checks({"segments": []}, "bucket", "")
    assert not empty.passed and empty.profiler is None


def test_doctor_without_overhead_steps_runs_no_overhead(monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(doctor_module, "run_probe", lambda: _probe(1))
    monkeypatch.setattr(doctor_module, "unwatched_syncs", lambda *args: {})
    monkeypatch.setattr(doctor_module, "profiled_run", lambda *args: [comparison(0)])

    def no_overhead(*args: Any) -> str:
        raise AssertionError("overhead ran with overhead_steps=0")

    monkeypatch.setattr(doctor_module, "run_overhead", no_overhead)
    assert doctor_module.doctor(["bucket"], overhead_steps=0) == 0
    assert "overhead" not in capsys.readouterr().out


def test_doctor_on_a_machine_without_a_gpu_says_so_in_one_line() -> None:
    result = subprocess.run([sys.executable, "-m", "ddpwatch.cli", "doctor"], capture_output=True, text=True, cwd=REPO_ROOT,
                            timeout=120)
    assert result.returncode == 2
    assert result.stdout.strip().count("\n") == 0 and "no CUDA GPU on this machine" in result.stdout


@pytest.mark.parametrize("argv", [["--ranks", "0"], ["--overhead-steps", "2"]])
def test_doctor_refuses_a_bad_flag_in_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from ddpwatch.cli import main

    assert main(["doctor", *argv]) != 0
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and argv[0] in err
