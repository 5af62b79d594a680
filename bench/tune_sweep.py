"""The bucket advisor held against a measured sweep, in one command.

    python bench/tune_sweep.py                                   # 2 ranks, tiny model, 6 caps 0.05-25 MB
    python bench/tune_sweep.py --sizes 0.25,1,4 --steps-per-size 12 --ranks 2
    python bench/tune_sweep.py --strategy ddp                   # torch's DDP at each cap
    python bench/tune_sweep.py --auto 25                        # tune picks the caps, starting at 25 MB

Starts ``ddpwatch tune`` on a free port and ``train.py --strategy bucket`` (or ``ddp``) under torchrun
streaming to it, long enough for the sweep; prints tune's table (cap, the prediction made before
the run was switched to it, the measured median step, the error), the measured best and its
gain over the starting cap, and the median absolute error. Everything tune wrote (the session,
the exports, ``tune.json``) is left in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.05,0.1,0.25,1,4,25", help="caps in MB, the first is where training starts")
    parser.add_argument("--steps-per-size", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--strategy", default="bucket", choices=["bucket", "ddp"], help="the strategy trained and switched between caps")
    parser.add_argument("--auto", type=float, default=None, metavar="START_MB",
                        help="no --sizes: tune runs the predicted best and its neighbours, training starting at START_MB")
    parser.add_argument("--out", type=Path, default=None, help="where tune writes (default: a new temporary directory)")
    args = parser.parse_args()
    if args.auto is not None and args.auto <= 0:
        parser.error(f"--auto takes the starting cap in MB, above 0, not {args.auto:g}")
    sizes = [float(s) for s in args.sizes.split(",")]
    start_mb, caps = (args.auto, 6) if args.auto is not None else (sizes[0], len(sizes))  # auto: the start, 2 probes, 3 picks
    out = args.out or Path(tempfile.mkdtemp(prefix="tune_sweep_"))
    address = f"tcp://127.0.0.1:{free_port()}"
    steps = (caps + 2) * (args.steps_per_size + 6)  # each cap's steps, the switches' own, and some to spare
    chosen = [] if args.auto is not None else ["--sizes", args.sizes]
    tune = subprocess.Popen([sys.executable, "-m", "ddpwatch.cli", "tune", "--listen", address, "--out", str(out), *chosen,
                             "--steps-per-size", str(args.steps_per_size), "--strategy", args.strategy],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    training = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
                                 str(REPO_ROOT / "train.py"), "--strategy", args.strategy, "--bucket-mb", str(start_mb),
                                 "--model", args.model, "--steps", str(steps), "--log-every", str(steps), "--watch", address],
                                cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        table, _ = tune.communicate(timeout=3600)
    finally:
        training.wait(timeout=3600)
    print(f"ddpwatch tune, {args.strategy}, {args.ranks} ranks, {args.model} model, {args.steps_per_size} steps per cap (written to {out}):")
    print(table, end="")
    return tune.returncode


if __name__ == "__main__":
    sys.exit(main())
