"""bench/overhead.py as a lent GPU's session runs it (``bench/gpu_session.sh overhead``): every
``attach`` strategy in one process, one after another. Each attachment is detached once its steps
are timed; before, the second was refused (one attachment an address) and the run died there,
which only a GPU session would have found."""

import os
import subprocess
import sys

from launch import REPO_ROOT, free_port


def test_every_attach_strategy_is_timed_in_one_process() -> None:
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(REPO_ROOT / "bench" / "overhead.py"), "--steps", "1",
                           "--strategies", "attach,attach-zero,attach-fsdp", "--port", str(free_port())],
                          env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split()[0] for line in done.stdout.splitlines()[1:]]
    assert rows == ["attach", "attach-zero", "attach-fsdp"], done.stdout
