"""The doctor's profile check for a user's own loop: an attached example's reports against its kernels.

``ddpwatch doctor`` holds train.py's strategies against torch.profiler's CUDA kernels; this holds
``instrumented_ddp.attach`` there the same way, on ``examples/plain_ddp.py`` or
``examples/plain_fsdp.py`` (both take ``--profile DIR``: steps 4-8, one trace per rank), recorded by
``ddpwatch record``. Per rank: collectives per step by kind (all-reduce, all-gather,
reduce-scatter) exactly against the NCCL kernels, each collective's duration within 20 % or 50 µs,
Compute% and Overlap% within 5 points (noted, not checked, with ``--sharing``: ranks that
time-slice one GPU), and, given the same loop profiled with ``--no-watch``, no device sync that
attaching adds. Exits 1 on a miss, as the doctor does.

    ddpwatch record --listen tcp://127.0.0.1:5599 --out run --idle-exit 30 &
    torchrun --nproc_per_node=2 examples/plain_fsdp.py --steps 10 --watch tcp://127.0.0.1:5599 --profile prof
    torchrun --nproc_per_node=2 examples/plain_fsdp.py --steps 10 --no-watch --profile prof-unwatched
    python bench/attach_check.py run prof --unwatched prof-unwatched

The examples' loops count iterations from 0 and call ``profiler.step()`` after each, and attach
numbers its steps from 1, so ProfilerStep#N is step N + 1, as for train.py.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpwatch.doctor.checkup import COLLECTIVE_FLOOR_US, Section, _trace_file, profile_sections, render  # noqa: E402
from ddpwatch.doctor.profile_check import RankComparison, compare_rank, render_steps, syncs_per_iteration  # noqa: E402
from ddpwatch.doctor.profiler_trace import load_trace  # noqa: E402
from ddpwatch.record.recorder import load_session  # noqa: E402
from ddpwatch.ingest.session_file import session_file_in  # noqa: E402


def outside_lines(comparison: RankComparison) -> list[str]:
    """Each collective whose duration missed: where its kernel began and ended against its span
    (a kernel that began late in a span that ended with it waited for the GPU, not the wire)."""
    return [f"  step {p.step} {p.kind} #{p.index}: span {p.ddpwatch_ms:.3f} ms, kernel {p.profiler_ms:.3f} ms, "
            f"kernel start {p.start_difference_us:+.1f} µs and end {p.end_difference_us:+.1f} µs from the span's"
            for p in comparison.missed]


def check(session_dir: Path, profile: Path, unwatched: Path | None, label: str, sharing: bool) -> tuple[list[Section], list[str]]:
    """One section per rank of the recorded run, and each rank's step-by-step rows."""
    session = load_session(session_file_in(session_dir))
    ranks = sorted({rank for step_ranks in session.reports.values() for rank in step_ranks})
    if not ranks:
        raise ValueError(f"{session_dir}: no step report was recorded")
    comparisons, steps = [], []
    for rank in ranks:
        reports = [step_ranks[rank] for _, step_ranks in sorted(session.reports.items()) if rank in step_ranks]
        twin = syncs_per_iteration(load_trace(_trace_file(unwatched, rank))) if unwatched is not None else None
        comparison = compare_rank(load_trace(_trace_file(profile, rank)), reports, rank=rank, unwatched_syncs=twin,
                                  duration_floor_us=COLLECTIVE_FLOOR_US)
        comparisons.append(comparison)
        steps.append(f"{label}, rank {rank}:\n{render_steps(comparison)}" + "".join(f"\n{line}" for line in outside_lines(comparison)))
    return profile_sections(label, comparisons, len(ranks), sharing_gpus=sharing), steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="an attached example's reports held against torch.profiler's kernels")
    parser.add_argument("session", type=Path, help="the ddpwatch record --out directory of the watched run")
    parser.add_argument("profile", type=Path, help="the watched run's --profile directory")
    parser.add_argument("--unwatched", type=Path, default=None, help="the same loop's --profile directory, run with --no-watch")
    parser.add_argument("--label", default="attached loop")
    parser.add_argument("--sharing", action="store_true", help="the ranks shared a GPU: Compute%% and Overlap%% noted, not checked")
    parser.add_argument("--steps", action="store_true", help="also print each rank's step-by-step comparison")
    args = parser.parse_args(argv)
    try:
        sections, steps = check(args.session, args.profile, args.unwatched, args.label, args.sharing)
    except (OSError, ValueError, RuntimeError) as error:
        print(f"attach_check: {error}", file=sys.stderr)
        return 2
    if args.steps:
        print("\n\n".join(steps), end="\n\n")
    print(render(sections))
    return 0 if all(section.passed for section in sections) else 1


if __name__ == "__main__":
    sys.exit(main())
