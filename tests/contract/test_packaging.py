"""What a user's ``pip install`` (a wheel, not this tree) carries besides the modules: the suite
runs from an editable install, which reads the tree, so a file the wheel left out went unseen."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from launch import REPO_ROOT

PACKAGES = ("instrumented_ddp", "ddpwatch")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built once from a copy (a build in the tree leaves build/ there), offline: no
    build isolation, no dependencies."""
    tmp_path = tmp_path_factory.mktemp("wheel")
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO_ROOT / name, source / name)
    for package in PACKAGES:
        shutil.copytree(REPO_ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
                            "-w", str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-3000:]
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    return wheel


def test_the_wheel_carries_the_dashboards_styles_and_both_packages_type_hints(wheel: Path) -> None:
    carried = set(zipfile.ZipFile(wheel).namelist())
    styles = {path.relative_to(REPO_ROOT).as_posix() for package in PACKAGES for path in (REPO_ROOT / package).rglob("*.tcss")}
    assert styles and styles <= carried, styles - carried  # without them the dashboard does not start
    assert {f"{package}/py.typed" for package in PACKAGES} <= carried  # PEP 561: users' type checkers read our hints


def test_the_installed_wheel_runs_the_training_script_and_the_overhead_bench_the_demo_and_the_doctor_start(
        wheel: Path, tmp_path: Path) -> None:
    """``ddpwatch demo`` and ``doctor`` start train.py (and the doctor ``bench/overhead.py``); from a
    wheel they said *train.py not found: run it from a clone*, both scripts being the clone's.
    They run them as the package's modules, which the wheel carries."""
    from ddpwatch.demo import TRAIN_MODULE
    from ddpwatch.doctor.checkup import OVERHEAD_MODULE

    installed, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(installed),
                           str(wheel)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    env = dict(os.environ, PYTHONPATH=str(installed))  # ahead of the editable install's path to this tree
    for module, option in ((TRAIN_MODULE, "--strategy"), (OVERHEAD_MODULE, "--strategies")):
        code = (f"import importlib.util, runpy, sys; print(importlib.util.find_spec({module!r}).origin); "
                f"sys.argv[1:] = ['--help']; runpy.run_module({module!r}, run_name='__main__')")  # as python -m does
        helped = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=elsewhere, env=env, timeout=120)
        assert helped.returncode == 0, helped.stderr[-3000:]
        ran_from, usage = helped.stdout.split("\n", 1)
        assert Path(ran_from).is_relative_to(installed), ran_from  # the wheel's copy, not this tree's
        assert option in usage
