"""The headless and UI side never loads torch; the training side never loads the UI; the ground
both stand on (the wire schema and the step figures) loads neither."""

from __future__ import annotations

import subprocess
import sys

import torch

import instrumented_ddp
from instrumented_ddp.strategies import STRATEGY_CLASSES, strategy_class
from launch import REPO_ROOT, free_port

#: What both sides import: the wire schema and one rank's step figures (computed at the edge by
#: the ranks, centrally by ddpwatch from full spans).
SHARED_GROUND = {"instrumented_ddp.protocol", "instrumented_ddp.intervals", "instrumented_ddp.step_figures",
                 "instrumented_ddp.bucket_plan",  # the bucket rule: the strategy uses it, the advisor simulates it
                 "instrumented_ddp.output_paths",  # where a command will write: train.py's --profile, ddpwatch's --out
                 "instrumented_ddp.one_line_errors",  # train.py's and ddpwatch's flags refused in one line
                 "instrumented_ddp.median_interval"}  # a median's interval: the benches on the ranks, the figures


def modules_loaded_by(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    return set(result.stdout.split())


def test_ddpwatch_never_imports_torch() -> None:
    loaded = modules_loaded_by("import ddpwatch.cli, ddpwatch.dashboard.app, ddpwatch.recorder, ddpwatch.exporters, "
                               "ddpwatch.switch_client, ddpwatch.doctor, ddpwatch.profile_check, ddpwatch.profiler_trace")
    assert "torch" not in loaded
    assert not {m for m in loaded if m.startswith("instrumented_ddp.") and m not in SHARED_GROUND}


def test_training_side_never_imports_the_ui() -> None:
    loaded = modules_loaded_by("import instrumented_ddp.watch, instrumented_ddp.strategies as s, instrumented_ddp.data, "
                               "instrumented_ddp.gpu_probe, instrumented_ddp.train, instrumented_ddp.overhead_bench; "
                               "[s.strategy_class(name) for name in s.STRATEGY_CLASSES]")
    assert not {m for m in loaded if m.split(".")[0] in ("textual", "ddpwatch")}


def test_the_shared_ground_loads_neither_side() -> None:
    loaded = modules_loaded_by("import " + ", ".join(sorted(SHARED_GROUND)))
    assert not {m for m in loaded if m.split(".")[0] in ("torch", "textual", "ddpwatch", "numpy", "zmq")}
    assert not {m for m in loaded if m.startswith("instrumented_ddp.") and m not in SHARED_GROUND}


def test_both_sides_agree_on_the_strategy_names() -> None:
    assert tuple(STRATEGY_CLASSES) == instrumented_ddp.STRATEGY_NAMES
    assert [strategy_class(name).name for name in STRATEGY_CLASSES] == list(instrumented_ddp.STRATEGY_NAMES)


def test_a_torch_without_fsdp2_runs_every_other_strategy_and_refuses_fsdp_in_one_line() -> None:
    """FSDP2 is hidden, as on a torch before it: the eight others are wrapped and step on a
    one-rank group; ``fsdp`` alone is refused, naming the torch (before, importing the
    strategies imported FSDP2 and every strategy failed)."""
    code = """
import os, sys
sys.modules["torch.distributed.fsdp"] = None
import torch, torch.distributed as dist
import instrumented_ddp
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
for name in instrumented_ddp.STRATEGY_NAMES[:-1]:
    model = instrumented_ddp.wrap(torch.nn.Linear(4, 2), name, bucket_mb=1.0) if name in ("bucket", "ddp", "zero1", "zero2") \
        else instrumented_ddp.wrap(torch.nn.Linear(4, 2), name)
    model(torch.ones(3, 4)).sum().backward()
    instrumented_ddp.unwrap(model)
    print("ran", name)
try:
    instrumented_ddp.wrap(torch.nn.Linear(4, 2), "fsdp")
except ImportError as error:
    print("refused:", error)
dist.destroy_process_group()
"""
    result = subprocess.run([sys.executable, "-c", code, str(free_port())], capture_output=True, text=True, cwd=REPO_ROOT,
                            timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = result.stdout.splitlines()
    assert lines[:-1] == [f"ran {name}" for name in instrumented_ddp.STRATEGY_NAMES[:-1]]
    assert lines[-1].startswith(f"refused: strategy 'fsdp' needs what torch {torch.__version__} lacks (")


def test_python_dash_m_ddpwatch_is_the_command() -> None:
    """Where pip put no ``ddpwatch`` script on PATH (a ``--target`` install, a GPU box's image)."""
    result = subprocess.run([sys.executable, "-m", "ddpwatch", "--help"], cwd=REPO_ROOT, capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0 and result.stdout.startswith("usage: ddpwatch"), result.stderr[-2000:]
