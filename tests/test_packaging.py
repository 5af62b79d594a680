"""What a user's ``pip install`` (a wheel, not this tree) carries besides the modules: the suite
runs from an editable install, which reads the tree, so a file the wheel left out went unseen."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from launch import REPO_ROOT

PACKAGES = ("instrumented_ddp", "ddpwatch")


def test_the_wheel_carries_the_dashboards_styles_and_both_packages_type_hints(tmp_path: Path) -> None:
    # Built from a copy (a build in the tree leaves build/ there), offline: no build isolation, no dependencies.
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
    carried = set(zipfile.ZipFile(wheel).namelist())
    styles = {path.relative_to(REPO_ROOT).as_posix() for package in PACKAGES for path in (REPO_ROOT / package).rglob("*.tcss")}
    assert styles and styles <= carried, styles - carried  # without them the dashboard does not start
    assert {f"{package}/py.typed" for package in PACKAGES} <= carried  # PEP 561: users' type checkers read our hints
