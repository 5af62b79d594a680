"""``ddpwatch doctor``: does ddpwatch tell the truth on this GPU machine? One command that says.

It runs the package's modules (``-m instrumented_ddp.training.train``, as ``ddpwatch demo`` does, and
``-m instrumented_ddp.selfcheck.overhead_bench``), so an installed ddpwatch runs it without a clone:

1. ``python -m instrumented_ddp.selfcheck.gpu_probe`` (torch lives there, never here): the GPUs torch
   sees, NVML's readings of a GPU it keeps busy, read by the same reader a rank's sampler uses,
   and the device synchronisations ``torch.cuda.set_sync_debug_mode`` counts in watched steps.
   No CUDA: one line, exit 2, nothing checked.
2. Profiled runs of ``train.py --model small`` on NCCL (two ranks where there are two GPUs, else
   one; ``ranks=2`` on one GPU makes them share it, which checks the collectives but not the GPU
   time figures, see ``profile_sections``), recorded by ``ddpwatch record`` while ``torch.profiler`` traces steps 4-8 of the same
   run; ``profile_check`` holds ddpwatch's figures against the profiler's CUDA kernels:
   collectives per step exactly, each collective's duration within 20 %, Compute% and
   Overlap% within 5 points, and no device sync that watching adds: the same script is also
   profiled unwatched (``--no-watch``), and each iteration's syncs are held against its
   twin's (a model may sync on its own: transformers checks a padding mask with two
   ``.item()``-like syncs a forward; DDP's runtime logging syncs events over its first 10
   iterations). With two ranks, once with NCCL's own timing (``TORCH_NCCL_ENABLE_TIMING=1``:
   NCCL's durations replayed over the stream) and once without (``=0``: end events recorded in
   completion callbacks), so both ways ddpwatch times an asynchronous collective are checked. One rank checks no collective: NCCL runs a one-rank all-reduce without a kernel.
   The step is a training step the GPU is the bottleneck of (64 sequences of 512 tokens a
   rank): on a step the host is the bottleneck of, the GPU idles between kernels inside
   forward and backward, and ddpwatch's compute, timed by CUDA events at phase boundaries,
   counts those gaps as compute (see the README: what the events can and cannot see).
3. ``bench/overhead.py --device cuda`` (``instrumented_ddp.selfcheck.overhead_bench``): watched against unwatched step time, alternating, on
   the same training shape (at most 1.02: the check), and on the tiny model whose every
   kernel is a launch, where the host's per-step cost shows in full (reported, not checked).
4. The run's own measurement of what watching costs it (``summary.json``'s ``watch_overhead``): a
   recorded ``train.py --model tiny`` run that leaves 4 steps in 20 unwatched, beside the bench's
   tiny-model ratio for the same strategy. It reads what the timeline costs; the bench also
   counts what an unwatched step still runs (the hooks installed for the run), so it reads the
   same or less.

It prints one table and exits 1 on any miss. The checks are pure functions of what the runs
produced, tested on the CPU with made-up probe answers, traces and bench output.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddpwatch.demo import TRAIN_MODULE
from ddpwatch.doctor.profile_check import Check, RankComparison, format_table, value_text

#: The overhead runs' bench (``bench/overhead.py`` in a clone), run as the package's module.
OVERHEAD_MODULE = "instrumented_ddp.selfcheck.overhead_bench"
OVERHEAD_GOAL = 1.02
PROFILED_RUN_STEPS = 10  # train.py profiles steps 4-8
#: The doctor's training step, per rank: the small model (~110M parameters) on 64 sequences of
#: 512 tokens keeps a GPU busy, so the host runs ahead of it.
BATCH_PER_RANK, SEQUENCE_LENGTH = 64, 512
#: A GPU kept busy by matrix products reads well above this; an idle or wrong GPU reads 0.
BUSY_UTILIZATION_PCT = 50.0
PLAUSIBLE_POWER_W = (1.0, 2000.0)
#: The self-measured run: 240 steps, 4 in 20 unwatched, give the figure from 48 unwatched steps.
SELF_MEASURED_STEPS, SELF_MEASURED_EVERY, SELF_MEASURED_LENGTH = 240, 20, 4


@dataclass(frozen=True)
class Section:
    """A titled group of checks in the doctor's table (one probe, one rank of one run, ...)."""

    title: str
    checks: tuple[Check, ...]
    notes: tuple[str, ...] = ()

    @property
    def passed(self) -> bool:
        return all(check.passed for check in self.checks)


# -- the checks: pure ------------------------------------------------------------------------------


def nvml_checks(nvml: dict[str, Any]) -> tuple[Check, ...]:
    """NVML's readings of a GPU the probe kept busy: there, on the right GPU, and plausible."""
    if nvml.get("note"):
        return (Check("NVML readings", None, None, "read", False, "", nvml["note"]),)
    samples: list[dict[str, float]] = nvml.get("samples", [])
    if not samples:
        return (Check("NVML readings", 0, None, "read", False, "", "no sample came back"),)

    def values(name: str) -> list[float]:
        return [sample[name] for sample in samples if name in sample]

    checks = []
    utilization = values("gpu_util_pct")
    busiest = max(utilization, default=None)
    checks.append(Check("GPU utilization while busy", busiest, None, f"> {BUSY_UTILIZATION_PCT:g} %",
                        busiest is not None and BUSY_UTILIZATION_PCT < busiest <= 100.0, "%",
                        f"{len(utilization)} of {len(samples)} samples" + ("" if utilization else ": absent")
                        + ("; an idle reading means NVML looks at another GPU" if busiest is not None and busiest <= BUSY_UTILIZATION_PCT else "")))
    both = [(s["mem_used_bytes"], s["mem_total_bytes"]) for s in samples if "mem_used_bytes" in s and "mem_total_bytes" in s]
    memory_ok = bool(both) and all(0 < used <= total for used, total in both)  # each sample's own pair
    checks.append(Check("memory used / total", None, None, "0 < used <= total", memory_ok, "",
                        f"{both[-1][0] / 2**30:.1f} / {both[-1][1] / 2**30:.1f} GiB" if both else "absent"))
    power = values("power_w")
    low, high = PLAUSIBLE_POWER_W
    checks.append(Check("power", max(power, default=None), None, f"{low:g}-{high:g} W or not supported",
                        all(low <= w <= high for w in power), "",
                        "W" if power else "not supported on this GPU (absent, not zero)"))
    links = {name: values(name) for name in ("pcie_tx_bytes_per_s", "pcie_rx_bytes_per_s",
                                              "nvlink_tx_bytes_per_s", "nvlink_rx_bytes_per_s")}
    read = [name for name, got in links.items() if got]
    checks.append(Check("PCIe / NVLink throughput", None, None, ">= 0 where supported",
                        all(v >= 0 for got in links.values() for v in got), "",
                        ("read: " + ", ".join(read)) if read else "none supported (absent, not zero)"))
    return tuple(checks)


def sync_checks(sync: dict[str, Any]) -> tuple[Check, ...]:
    """Device synchronisations torch's sync debug mode saw in watched steps: none allowed."""
    count, steps = sync.get("syncs"), sync.get("steps", 0)
    detail = f"over {steps} watched steps" + (": " + "; ".join(sync.get("examples", [])) if count else "")
    return (Check("device syncs in watched steps", count, 0, "0", count == 0, "", detail),)


_OVERHEAD_ROW = re.compile(r"^(?P<strategy>[a-z0-9]+)\s+(?P<watched>[\d.]+)\s+(?P<plain>[\d.]+)\s+(?P<ratio>[\d.]+)"
                           r"(\s+(?P<low>[\d.]+)\s*-\s*(?P<high>[\d.]+))?\s*$")


def overhead_checks(bench_output: str, goal: float = OVERHEAD_GOAL) -> tuple[Check, ...]:
    """One check per strategy row of ``bench/overhead.py``'s table."""
    checks = []
    for line in bench_output.splitlines():
        if match := _OVERHEAD_ROW.match(line.strip()):
            ratio = float(match["ratio"])
            interval = f", 90% interval {match['low']}-{match['high']}" if match["low"] else ""
            checks.append(Check(f"overhead {match['strategy']}", ratio, None, f"<= {goal:g}", ratio <= goal, "x",
                                f"{match['watched']} ms watched, {match['plain']} ms not{interval}"))
    return tuple(checks) or (Check("overhead", None, None, f"<= {goal:g}", False, "x", "bench/overhead.py printed no table"),)


#: What a one-rank run cannot compare: NCCL runs a one-rank all-reduce without launching a kernel.
COLLECTIVE_CHECKS = ("collectives per step", "collective duration", "Overlap%")
#: What ranks sharing a GPU cannot compare: the GPU time-slices their processes, so a rank's own
#: kernels stop while another rank's run, inside phases ddpwatch's events see as one block.
GPU_TIME_CHECKS = ("Compute%", "Overlap%")
#: NCCL's start event is recorded on its stream before the kernel launches, so a span leads its
#: kernel by tens of µs (30-45 on an H100), most of a 5 µs broadcast: a duration also passes
#: within this many µs.
COLLECTIVE_FLOOR_US = 50.0


def profile_sections(label: str, comparisons: Sequence[RankComparison], world_size: int,
                     sharing_gpus: bool = False) -> list[Section]:
    """A profiled run's comparisons, one section per rank; a one-rank run keeps only the checks
    that have something on the profiler's side, ranks sharing a GPU report its time figures
    without checking them."""
    sections = []
    for comparison in comparisons:
        checks, notes = comparison.checks, list(comparison.notes)
        if world_size == 1:
            checks = tuple(c for c in checks if not c.name.startswith(COLLECTIVE_CHECKS))
            notes.append("one rank: collective checks left out (NCCL launches no kernel for a one-rank all-reduce)")
        elif sharing_gpus:
            notes.extend(f"{c.name} {value_text(c.ddpwatch, c.unit)} vs {value_text(c.profiler, c.unit)} from kernels "
                         f"({c.detail}): not checked, the ranks time-slice one GPU (a rank's kernels wait while "
                         "another's run, inside phases its events time as one)" for c in checks if c.name in GPU_TIME_CHECKS)
            checks = tuple(c for c in checks if c.name not in GPU_TIME_CHECKS)
        sections.append(Section(f"{label}, rank {comparison.rank}", checks, tuple(notes)))
    return sections


def render(sections: Sequence[Section]) -> str:
    """The doctor's table, its verdict line, then the notes."""
    rows = [[section.title, check.name, value_text(check.ddpwatch, check.unit), value_text(check.profiler, check.unit),
             check.tolerance, "ok" if check.passed else "FAIL", check.detail]
            for section in sections for check in section.checks]
    lines = format_table(["run", "check", "ddpwatch", "reference", "expected", "result", "detail"], rows, right={2, 3})
    missed = [f"{s.title}: {c.name}" for s in sections for c in s.checks if not c.passed]
    total = sum(len(s.checks) for s in sections)
    lines.append(f"verdict: FAIL - {len(missed)} of {total} checks missed: " + "; ".join(missed) if missed
                 else f"verdict: PASS - all {total} checks held")
    lines.extend(f"{s.title}: {note}" for s in sections for note in s.notes)
    return "\n".join(lines)


def probe_summary(probe: dict[str, Any]) -> str:
    names = ", ".join(f"cuda:{d['index']} {d['name']} ({d['memory_bytes'] / 2**30:.0f} GiB)" for d in probe.get("devices", []))
    return f"torch {probe['torch']}, CUDA {probe.get('cuda')}, NCCL {probe.get('nccl')}; {names}"


# -- running it ------------------------------------------------------------------------------------

def run_probe() -> dict[str, Any]:
    result = subprocess.run([sys.executable, "-m", "instrumented_ddp.selfcheck.gpu_probe"], capture_output=True, text=True, timeout=600)
    if result.returncode != 0:
        raise RuntimeError(f"the GPU probe failed: {(result.stderr.strip().splitlines() or ['no output'])[-1]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def batch_per_rank(world_size: int, gpus: int) -> int:
    """Ranks that share a GPU split the doctor's per-GPU batch, so each GPU does one step's work."""
    ranks_per_gpu = -(-world_size // max(gpus, 1))
    return max(1, BATCH_PER_RANK // ranks_per_gpu)


def _train(world_size: int, gpus: int, strategy: str, profile: Path, watch: list[str], env: dict[str, str]) -> None:
    """One profiled ``train.py`` run at the doctor's training shape."""
    training = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world_size}",
         "-m", TRAIN_MODULE, "--device", "cuda", "--model", "small", "--strategy", strategy,
         "--steps", str(PROFILED_RUN_STEPS), "--batch-size", str(batch_per_rank(world_size, gpus) * world_size),
         "--max-length", str(SEQUENCE_LENGTH), "--log-every", "1000", "--profile", str(profile), *watch],
        capture_output=True, text=True, env=env, timeout=900)
    if training.returncode != 0:
        raise RuntimeError(f"train.py failed: {(training.stderr.strip().splitlines() or ['no output'])[-1]}")


def _trace_file(profile: Path, rank: int) -> Path:
    found = sorted(profile.glob(f"rank{rank}.*.json*"))
    if not found:
        raise RuntimeError(f"no profiler trace for rank {rank} in {profile}")
    return found[-1]


def unwatched_syncs(workdir: Path, world_size: int, gpus: int, strategy: str) -> dict[int, dict[int, tuple[str, ...]]]:
    """rank -> ProfilerStep#N -> the syncs the same run makes with ``--no-watch``."""
    from ddpwatch.doctor.profile_check import syncs_per_iteration
    from ddpwatch.doctor.profiler_trace import load_trace

    profile = workdir / "profile-unwatched"
    _train(world_size, gpus, strategy, profile, ["--no-watch"], dict(os.environ))
    return {rank: syncs_per_iteration(load_trace(_trace_file(profile, rank))) for rank in range(world_size)}


def profiled_run(workdir: Path, world_size: int, gpus: int, strategy: str, nccl_timing: bool,
                 unwatched: dict[int, dict[int, tuple[str, ...]]] | None = None) -> list[RankComparison]:
    """``train.py`` on NCCL, recorded and profiled at once; each rank's report against its trace
    (and its syncs against the unwatched run's, where there is one)."""
    from ddpwatch.doctor.profile_check import compare_rank
    from ddpwatch.doctor.profiler_trace import load_trace
    from ddpwatch.record.recorder import load_session

    out, profile = workdir / "session", workdir / "profile"
    with recording(out) as address:
        _train(world_size, gpus, strategy, profile, ["--watch", address],
               dict(os.environ, TORCH_NCCL_ENABLE_TIMING="1" if nccl_timing else "0"))
    session = load_session(out / "session.ddpwatch")
    comparisons = []
    for rank in range(world_size):
        reports = [ranks[rank] for _, ranks in sorted(session.reports.items()) if rank in ranks]
        comparisons.append(compare_rank(load_trace(_trace_file(profile, rank)), reports, rank=rank,
                                        unwatched_syncs=(unwatched or {}).get(rank), duration_floor_us=COLLECTIVE_FLOOR_US))
    return comparisons


def run_overhead(steps: int, strategies: Sequence[str], training_shape: bool) -> str:
    """``bench/overhead.py`` on one GPU: at the doctor's training shape, or on the tiny model."""
    shape = (["--model", "small", "--micro-batch", str(BATCH_PER_RANK), "--seq-len", str(SEQUENCE_LENGTH)]
             if training_shape else [])
    result = subprocess.run([sys.executable, "-m", OVERHEAD_MODULE, "--device", "cuda", "--ranks", "1",
                             "--steps", str(steps), "--strategies", ",".join(strategies), *shape],
                            capture_output=True, text=True, timeout=900)
    return result.stdout


def self_measured_checks(summary: dict[str, Any], strategy: str, bench_output: str) -> tuple[Check, ...]:
    """The run's own ``watch_overhead`` (its newest segment's), beside ``bench/overhead.py``'s
    tiny-model ratio for ``strategy`` as a percentage: held when the run measured itself."""
    segments = summary.get("segments") or [{}]
    cost = segments[-1].get("watch_overhead")
    bench = next((c.ddpwatch for c in overhead_checks(bench_output) if c.name == f"overhead {strategy}" and c.ddpwatch is not None), None)
    bench_pct = None if bench is None else 100.0 * (bench - 1.0)
    name = f"self-measured overhead, {strategy}"
    if not cost:
        return (Check(name, None, bench_pct, "measured", False, "%", "the run measured nothing: no unwatched step was counted"),)
    low, high = cost["interval_pct"]
    return (Check(name, float(cost["pct"]), bench_pct, "measured", True, "%",
                  f"90 % interval {low:.1f} to {high:.1f} %, from {cost['unwatched_steps']} unwatched steps; reference: "
                  "bench/overhead.py's tiny-model ratio, which also counts the hooks an unwatched step still runs"),)


@contextmanager
def recording(out: Path) -> Iterator[str]:
    """``ddpwatch record`` into ``out`` while the block runs; yields the address it listens at and
    waits, after the block, for it to end (every rank said goodbye)."""
    from ddpwatch.demo import free_loopback_address

    address = free_loopback_address()
    recorder = subprocess.Popen([sys.executable, "-m", "ddpwatch.cli", "record", "--listen", address, "--out", str(out),
                                 "--idle-exit", "30"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        yield address
        recorder.wait(120)
    finally:
        if recorder.poll() is None:
            recorder.kill()
            recorder.wait()


def self_measured_run(workdir: Path, strategy: str) -> dict[str, Any]:
    """A recorded one-rank ``train.py --model tiny`` on the GPU that leaves steps unwatched: its
    summary.json."""
    out = workdir / "session"
    with recording(out) as address:
        training = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
             "-m", TRAIN_MODULE, "--device", "cuda", "--model", "tiny", "--strategy", strategy,
             "--steps", str(SELF_MEASURED_STEPS), "--unwatched", f"{SELF_MEASURED_EVERY}:{SELF_MEASURED_LENGTH}",
             "--eval-examples", "0", "--log-every", "1000", "--watch", address],
            capture_output=True, text=True, timeout=900)
        if training.returncode != 0:
            raise RuntimeError(f"train.py failed: {(training.stderr.strip().splitlines() or ['no output'])[-1]}")
    return dict(json.loads((out / "summary.json").read_text()))


def overhead_notes(bench_output: str) -> tuple[str, ...]:
    """The launch-bound tiny model's ratios, reported beside the checked ones."""
    rows = [f"{c.name.removeprefix('overhead ')} {c.ddpwatch:.3f} ({c.detail})" for c in overhead_checks(bench_output)
            if c.ddpwatch is not None]
    return ("tiny model, every kernel a launch (the host's per-step cost in full; not checked): " + "; ".join(rows),) if rows \
        else ("tiny model: bench/overhead.py printed no table",)


def doctor(strategies: Sequence[str] = ("bucket", "ddp"), overhead_steps: int = 20, keep: Path | None = None,
           ranks: int | None = None) -> int:
    """The whole check; the exit status: 0 all held, 1 a miss, 2 nothing could be checked.

    ``ranks`` (default: one per GPU, at most two) above the GPUs' count makes ranks share a GPU
    (see ``instrumented_ddp.distributed.gpu_sharing_env``): on a one-GPU machine that is the only
    way to see NCCL kernels of collectives. ``overhead_steps=0`` leaves the overhead runs out."""
    probe = run_probe()
    if not probe.get("cuda_available"):
        print(f"ddpwatch doctor: no CUDA GPU on this machine (torch {probe['torch']}: torch.cuda.is_available() is False); "
              "nothing to check")
        return 2
    print(f"ddpwatch doctor: {probe_summary(probe)}", flush=True)
    sections = [Section("probe: NVML on cuda:0", nvml_checks(probe["nvml"])),
                Section("probe: watched steps", sync_checks(probe["sync_check"]))]
    gpus = len(probe["devices"])
    world_size = ranks or min(2, gpus)
    ranks_text = f"{world_size} rank(s)" if world_size <= gpus else f"{world_size} ranks sharing {gpus} GPU(s)"
    modes = (True, False) if world_size > 1 else (True,)
    with tempfile.TemporaryDirectory(prefix="ddpwatch-doctor-") as scratch:
        root = keep or Path(scratch)
        for strategy in strategies:
            print(f"ddpwatch doctor: {ranks_text} {strategy}, unwatched ...", flush=True)
            try:
                unwatched = unwatched_syncs(root / f"{strategy}-{world_size}-unwatched", world_size, gpus, strategy)
            except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as error:
                unwatched = None
                sections.append(Section(f"{ranks_text} {strategy}, unwatched",
                                        (Check("unwatched reference run", None, None, "ran", False, "", str(error)),)))
            for nccl_timing in modes:
                label = f"{ranks_text} {strategy}, NCCL timing {'on' if nccl_timing else 'off'}"
                print(f"ddpwatch doctor: {label} ...", flush=True)
                workdir = root / f"{strategy}-{world_size}-timing-{'on' if nccl_timing else 'off'}"
                try:
                    sections += profile_sections(label, profiled_run(workdir, world_size, gpus, strategy, nccl_timing, unwatched),
                                                 world_size, sharing_gpus=world_size > gpus)
                except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as error:
                    sections.append(Section(label, (Check("profiled run", None, None, "ran", False, "", str(error)),)))
    if overhead_steps > 0:
        print("ddpwatch doctor: overhead ...", flush=True)
        tiny = run_overhead(overhead_steps, ("simple", "ga", "hook", "async", "bucket", "ddp"), training_shape=False)
        sections.append(Section(f"overhead, 1 GPU, {BATCH_PER_RANK}x{SEQUENCE_LENGTH} small model",
                                overhead_checks(run_overhead(overhead_steps, strategies, training_shape=True)),
                                overhead_notes(tiny)))
        print("ddpwatch doctor: self-measured overhead ...", flush=True)
        label = f"1 GPU, tiny model, {SELF_MEASURED_LENGTH} steps in {SELF_MEASURED_EVERY} unwatched"
        with tempfile.TemporaryDirectory(prefix="ddpwatch-doctor-self-") as scratch:
            try:
                checks = self_measured_checks(self_measured_run(keep or Path(scratch), "bucket"), "bucket", tiny)
            except (RuntimeError, OSError, ValueError, subprocess.TimeoutExpired) as error:
                checks = (Check("self-measured overhead, bucket", None, None, "measured", False, "%", str(error)),)
        sections.append(Section(label, checks))
    print(render(sections))
    return 0 if all(section.passed for section in sections) else 1
