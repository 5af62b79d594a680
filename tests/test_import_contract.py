"""The headless and UI side never loads torch; the training side never loads the UI; the ground
both stand on (the wire schema and the step figures) loads neither."""

from __future__ import annotations

import subprocess
import sys

import instrumented_ddp
from instrumented_ddp.strategies import STRATEGIES
from launch import REPO_ROOT

#: What both sides import: the wire schema and one rank's step figures (computed at the edge by
#: the ranks, centrally by ddpwatch from full spans).
SHARED_GROUND = {"instrumented_ddp.protocol", "instrumented_ddp.intervals", "instrumented_ddp.step_figures",
                 "instrumented_ddp.bucket_plan"}  # the bucket rule: the strategy uses it, the advisor simulates it


def modules_loaded_by(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    return set(result.stdout.split())


def test_ddpwatch_never_imports_torch() -> None:
    loaded = modules_loaded_by("import ddpwatch.cli, ddpwatch.dashboard.app, ddpwatch.recorder, ddpwatch.exporters, "
                               "ddpwatch.switch_client, ddpwatch.doctor, ddpwatch.profile_check")
    assert "torch" not in loaded
    assert not {m for m in loaded if m.startswith("instrumented_ddp.") and m not in SHARED_GROUND}


def test_training_side_never_imports_the_ui() -> None:
    loaded = modules_loaded_by("import instrumented_ddp.watch, instrumented_ddp.strategies, instrumented_ddp.data, "
                               "instrumented_ddp.gpu_probe")
    assert not {m for m in loaded if m.split(".")[0] in ("textual", "ddpwatch")}


def test_the_shared_ground_loads_neither_side() -> None:
    loaded = modules_loaded_by("import " + ", ".join(sorted(SHARED_GROUND)))
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "textual", "ddpwatch", "numpy", "zmq")}
    assert not {m for m in loaded if m.startswith("instrumented_ddp.") and m not in SHARED_GROUND}


def test_both_sides_agree_on_the_strategy_names() -> None:
    assert tuple(STRATEGIES) == instrumented_ddp.STRATEGY_NAMES


def test_python_dash_m_ddpwatch_is_the_command() -> None:
    """Where pip put no ``ddpwatch`` script on PATH (a ``--target`` install, a GPU box's image)."""
    result = subprocess.run([sys.executable, "-m", "ddpwatch", "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: ddpwatch"), result.stderr[-2000:]
