"""Where ddpwatch's collective spans sit against NCCL's kernels, from a kept doctor run.

``ddpwatch doctor --keep DIR`` keeps each profiled run's session and traces; this prints, per
run and rank, the spread (quantiles) of each collective's duration error and of the kernel's
start and end against the span's, so a pass or a miss of the doctor's "within 20 %" can be read
as a distribution: a lead at the start (NCCL's start event is recorded before its kernel
launches) differs from a late end. Where two ranks shared one GPU (``--ranks 2`` on one GPU),
it also says how much of a rank's step window its own compute kernels, the other rank's, and
either covered: the gap between "own" and "either" is time the GPU spent on the other rank.

    python bench/doctor_pairs.py DIR
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddpwatch.doctor.checkup import _trace_file  # noqa: E402
from ddpwatch.doctor.profile_check import RankComparison, compare_rank  # noqa: E402
from ddpwatch.doctor.profiler_trace import ProfilerTrace, load_trace  # noqa: E402
from ddpwatch.record.recorder import load_session  # noqa: E402
from instrumented_ddp.wire.time_ranges import clip, merge, total_length  # noqa: E402

QUANTILES = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)


def quantiles(values: Sequence[float]) -> str:
    ordered = sorted(values)
    return " ".join(f"{ordered[round(q * (len(ordered) - 1))]:9.1f}" for q in QUANTILES)


def compute_kernels(trace: ProfilerTrace) -> list[tuple[float, float]]:
    return merge([(k.start_us, k.end_us) for k in trace.kernels if not k.collective])


def covered(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    return total_length(clip(merge(intervals), lo, hi))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kept", type=Path, help="the directory given to ddpwatch doctor --keep")
    args = parser.parse_args(argv)
    runs = sorted(args.kept.glob("*-timing-*"))
    if not runs:
        print(f"doctor_pairs: no '<strategy>-<ranks>-timing-on|off' run in {args.kept}", file=sys.stderr)
        return 2
    print(f"quantiles {'/'.join(f'{q:g}' for q in QUANTILES)}")
    for run in runs:
        session = load_session(run / "session" / "session.ddpwatch")
        ranks = sorted({rank for per_rank in session.reports.values() for rank in per_rank})
        traces = {rank: load_trace(_trace_file(run / "profile", rank)) for rank in ranks}
        comparisons: dict[int, RankComparison] = {}
        for rank in ranks:
            reports = [per_rank[rank] for _, per_rank in sorted(session.reports.items()) if rank in per_rank]
            comparisons[rank] = compare_rank(traces[rank], reports, rank=rank)
            pairs = comparisons[rank].pairs
            print(f"{run.name} rank {rank}: {len(pairs)} collectives")
            print(f"  duration error %   {quantiles([100 * p.error for p in pairs])}")
            print(f"  kernel start - span start µs {quantiles([p.start_difference_us for p in pairs])}")
            print(f"  kernel end - span end µs     {quantiles([p.end_difference_us for p in pairs])}")
        if len(ranks) == 2:
            for rank in ranks:
                other = ranks[1 - ranks.index(rank)]
                own, theirs = compute_kernels(traces[rank]), compute_kernels(traces[other])
                shares = []
                for row in comparisons[rank].rows:
                    report = session.reports[row.step][rank]
                    lo, hi = report.start * 1e6 + row.offset_us, report.end * 1e6 + row.offset_us
                    shares.append([covered(own, lo, hi) / (hi - lo), covered(theirs, lo, hi) / (hi - lo),
                                   covered(own + theirs, lo, hi) / (hi - lo)])
                own_pct, their_pct, either_pct = (100 * statistics.fmean(s[i] for s in shares) for i in range(3))
                print(f"  rank {rank}'s step windows: its compute kernels {own_pct:.1f} %, rank {other}'s {their_pct:.1f} %, "
                      f"either {either_pct:.1f} % (one GPU shared: the profiler's clock is the same for both)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
