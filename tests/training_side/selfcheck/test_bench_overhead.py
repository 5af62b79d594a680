"""bench/overhead.py as a lent GPU's session runs it (``bench/gpu_session.sh overhead``): every
``attach`` strategy in one process, one after another. Each attachment is detached once its steps
are timed; before, the second was refused (one attachment an address) and the run died there,
which only a GPU session would have found."""

import os
import subprocess
import sys

import pytest

from instrumented_ddp.selfcheck.overhead_bench import main
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


@pytest.mark.parametrize(("argv", "said"), [
    (["--strategies", "nosuch,ddp"], "--strategies: unknown 'nosuch'; choose from simple, ga, hook, async, bucket, ddp, "
                                     "zero1, zero2, fsdp, attach, attach-zero, attach-fsdp, attach-hsdp"),
    (["--steps", "0"], "--steps must be at least 1, not 0"),  # timed a step anyway
    (["--ranks", "0"], "--ranks must be at least 1, not 0"),  # torchrun's traceback
    (["--port", "70000"], "--port must be a TCP port, 1-65535, not 70000"),
    (["--a-a", "--strategies", "ddp,attach"], "--a-a compares two unwatched copies of a strategy; attach has none: "
                                              "leave it out of --strategies"),
])
def test_a_wrong_flag_is_refused_in_one_line_before_any_rank_starts(argv: list[str], said: str,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The doctor runs the bench from an installed ddpwatch, and users may too: an unknown strategy
    failed on every rank, a traceback each, after torchrun had started them."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f": error: {said}")
