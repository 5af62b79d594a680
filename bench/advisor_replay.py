"""The bucket advisor's predictions replayed on recorded sweeps, read two ways, against what was measured.

    python bench/tune_sweep.py --out /tmp/sweep1      # record a sweep (repeat for more)
    python bench/advisor_replay.py /tmp/sweep1 /tmp/sweep2 ...
    python bench/advisor_replay.py --profile-steps 5 --first-rank-only /tmp/sweep1 ...   # as it was

Each directory is one ``ddpwatch tune`` run (its session file and ``tune.json``). The session is
folded in again message by message, and each cap is predicted where tune predicted it: when
the segment before it (the starting cap: its own) reached tune's ``--steps-per-size`` counted
steps. The prediction is the advisor's (``advice_for_session``) with the profile read either as
shipped (the first rank and the one whose backward ended last, on one clock, over
``--profile-steps`` counted steps) or from the first rank alone; the measured step is tune's own. So two readings of the advisor can be
compared on the same steps at the same moments, where two live sweeps differ by this box's
noise. Printed: per sweep, each cap's prediction and error and the median |error|; then over
every sweep, the median |error| of all predictions and how many sweeps met 10 %.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from ddpwatch.advisor.advice import PROFILE_STEPS, Advice, advice_for_session, recent_profile_steps  # noqa: E402 (the path is set only now)
from ddpwatch.advisor.bucket_sim import MIB  # noqa: E402
from ddpwatch.ingest.receiver import ingest  # noqa: E402
from ddpwatch.ingest.session import Session  # noqa: E402
from ddpwatch.ingest.session_file import read_session_file, session_file_in  # noqa: E402
from ddpwatch.advisor.tune import TUNE_FILE_NAME  # noqa: E402


def predicted_ms(session: Session, cap_mb: float, profile_steps: int, first_rank_only: bool, slowed: bool = True) -> float | None:
    """``advice_for_session``'s prediction at ``cap_mb``, its profile read over ``profile_steps``
    counted steps, as shipped or from the first rank alone."""
    by_rank, offsets = recent_profile_steps(session, session.segments[-1], profile_steps)
    if first_rank_only:
        by_rank = [{min(reports): reports[min(reports)]} for reports in by_rank]
    advice = advice_for_session(session, caps=[max(1, int(cap_mb * MIB))], profile=(by_rank, offsets), slowed=slowed)
    return advice.predictions[0].step_s * 1e3 if isinstance(advice, Advice) else None


def replay(directory: Path, steps_per_size: int, profile_steps: int, first_rank_only: bool, slowed: bool = True) -> list[float]:
    """Print one sweep's caps, predicted against measured; returns the |errors|."""
    caps = json.loads((directory / TUNE_FILE_NAME).read_text())["caps"]  # in the order run
    order = [float(c["cap_mb"]) for c in caps]
    predicted: dict[float, float | None] = {}
    predicted_from: set[int] = set()  # segments whose moment has come
    session = Session()
    for _, data in read_session_file(session_file_in(directory)):
        ingest(session, [data])
        k = len(session.segments) - 1
        if k < 0 or k >= len(order) or k in predicted_from:
            continue
        segment = session.segments[-1]
        if float(segment.settings.get("bucket_mb") or 25.0) != order[k]:
            continue
        if session.segment_figures(segment, per_rank=False).steps < steps_per_size:
            continue
        predicted_from.add(k)
        for cap in ([order[0]] if k == 0 else []) + ([order[k + 1]] if k + 1 < len(order) else []):
            predicted[cap] = predicted_ms(session, cap, profile_steps, first_rank_only, slowed)
    errors = []
    print(f"{directory}:")
    for row in caps:
        cap, measured = float(row["cap_mb"]), row["measured_ms"]
        guess = predicted.get(cap)
        if guess is None or not measured:
            shown = f"{measured:6.1f} ms" if measured else "—"
            print(f"  {cap:6.3g} MB  predicted      —  measured {shown}")
            continue
        errors.append(abs(guess - measured) / measured)
        print(f"  {cap:6.3g} MB  predicted {guess:6.1f}  measured {measured:6.1f} ms  {(guess - measured) / measured:+6.1%}")
    if errors:
        print(f"  median |error| {statistics.median(errors):.1%}")
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="+", type=Path, help="directories written by ddpwatch tune (bench/tune_sweep.py --out)")
    parser.add_argument("--steps-per-size", type=int, default=10, help="tune's --steps-per-size in those sweeps")
    parser.add_argument("--profile-steps", type=int, default=PROFILE_STEPS, help="counted steps the profile is read over")
    parser.add_argument("--first-rank-only", action="store_true", help="read the profile from the first rank alone")
    parser.add_argument("--unslowed", action="store_true",
                        help="replay backward as measured, not slowed by the all-reduces beside it (as before compute_slowdown)")
    args = parser.parse_args()
    missing = [str(d) for d in args.sweeps if not (d / TUNE_FILE_NAME).is_file()]
    if missing:
        parser.error(f"no {TUNE_FILE_NAME} in {', '.join(missing)}: give directories written by ddpwatch tune")
    every, per_sweep = [], []
    for directory in args.sweeps:
        errors = replay(directory, args.steps_per_size, args.profile_steps, args.first_rank_only, not args.unslowed)
        every += errors
        if errors:
            per_sweep.append(statistics.median(errors))
    reading = "the first rank alone" if args.first_rank_only else "the first rank and the last to end backward"
    if every:
        print(f"profile of {reading} over {args.profile_steps} steps: median |error| {statistics.median(every):.1%} over "
              f"{len(every)} predictions; {sum(e <= 0.10 for e in per_sweep)} of {len(per_sweep)} sweeps within 10 %")


if __name__ == "__main__":
    main()
