"""The strategy simulator held against a measured sweep, in one command.

    python bench/strategy_sweep.py                       # 2 ranks, tiny model: ddp,zero1,zero2,fsdp x K 1,2
    python bench/strategy_sweep.py --strategies ddp,zero2 --grad-accum 1 --steps-per-choice 12

Starts ``ddpwatch tune --strategies`` on a free port and ``train.py`` under torchrun streaming
to it, on the first strategy, long enough for the sweep; prints tune's table (each choice's
step, held and peak memory predicted before the run was switched to it against those measured,
the step's error), the measured fastest and the step's median absolute error. Everything tune
wrote (the session, the exports, ``tune.json``) is left in ``--out``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tune_sweep import REPO_ROOT, free_port  # the cap sweep's twin: bench/ is this script's folder on sys.path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--strategies", default="ddp,zero1,zero2,fsdp", help="the first is where training starts")
    parser.add_argument("--grad-accum", default="1,2")
    parser.add_argument("--steps-per-choice", type=int, default=10)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--bucket-mb", default="1", help="the cap every bucketed strategy runs at")
    parser.add_argument("--out", type=Path, default=None, help="where tune writes (default: a new temporary directory)")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    choices = len(strategies) * len(args.grad_accum.split(","))
    out = args.out or Path(tempfile.mkdtemp(prefix="strategy_sweep_"))
    address = f"tcp://127.0.0.1:{free_port()}"
    steps = (choices + 2) * (args.steps_per_choice + 8)  # each choice's steps, the switches' own, and some to spare
    tune = subprocess.Popen([sys.executable, "-m", "ddpwatch.cli", "tune", "--listen", address, "--out", str(out),
                             "--strategies", args.strategies, "--grad-accum", args.grad_accum,
                             "--steps-per-size", str(args.steps_per_choice), "--idle-exit", "15"],
                            cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    training = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
                                 str(REPO_ROOT / "train.py"), "--strategy", strategies[0], "--bucket-mb", args.bucket_mb,
                                 "--model", args.model, "--steps", str(steps), "--log-every", str(steps), "--watch", address],
                                cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        table, _ = tune.communicate(timeout=3600)
    finally:
        training.wait(timeout=3600)
    print(f"ddpwatch tune --strategies, {args.ranks} ranks, {args.model} model, {args.steps_per_choice} steps a choice, "
          f"buckets of {args.bucket_mb} MB (written to {out}):")
    print(table, end="")
    return tune.returncode


if __name__ == "__main__":
    sys.exit(main())
