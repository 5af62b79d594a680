"""The import contract, one rule each way: ``ddpwatch`` imports only ``instrumented_ddp.wire``;
``wire`` imports neither torch nor ``ddpwatch``; the training side never imports Textual; the
dashboard never imports torch. Read twice: from the source (every import statement, those inside
functions too) and from what a fresh interpreter loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import instrumented_ddp
from instrumented_ddp.strategies import STRATEGY_CLASSES, strategy_class
from launch import REPO_ROOT, free_port

WIRE = REPO_ROOT / "instrumented_ddp" / "wire"
#: What both sides import: the wire schema and what both compute alike (one rank's step figures,
#: time ranges, the bucket plan, a median's interval, the command lines' refusals and output paths).
SHARED_GROUND = {"instrumented_ddp", "instrumented_ddp.wire"} | {f"instrumented_ddp.wire.{path.stem}"
                                                                for path in WIRE.glob("*.py") if path.stem != "__init__"}


def imports_in(folder: Path) -> Iterator[tuple[str, str]]:
    """(file, imported module) for every import statement under ``folder``; ``from . import x``
    and its kin resolved to absolute names."""
    for path in sorted(folder.rglob("*.py")):
        module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        package = module if path.stem == "__init__" else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                yield from ((str(path.relative_to(REPO_ROOT)), alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    name = f"{base}.{node.module}" if node.module else base
                else:
                    name = node.module or ""
                yield str(path.relative_to(REPO_ROOT)), name


def top(name: str) -> str:
    return name.split(".")[0]


def test_ddpwatch_imports_of_instrumented_ddp_only_its_wire() -> None:
    wrong = [(path, name) for path, name in imports_in(REPO_ROOT / "ddpwatch")
             if top(name) == "instrumented_ddp" and name != "instrumented_ddp" and not name.startswith("instrumented_ddp.wire")]
    assert not wrong


def test_the_wire_imports_neither_torch_nor_ddpwatch_nor_the_rest_of_instrumented_ddp() -> None:
    wrong = [(path, name) for path, name in imports_in(WIRE)
             if top(name) in ("torch", "ddpwatch", "textual", "numpy", "zmq")
             or (top(name) == "instrumented_ddp" and not name.startswith("instrumented_ddp.wire"))]
    assert not wrong


def test_the_training_side_never_imports_textual_or_ddpwatch() -> None:
    wrong = [(path, name) for path, name in imports_in(REPO_ROOT / "instrumented_ddp") if top(name) in ("textual", "ddpwatch")]
    assert not wrong


@pytest.mark.parametrize("folder", ["ddpwatch", "instrumented_ddp/wire"])
def test_no_torch_import_in(folder: str) -> None:
    assert not [(path, name) for path, name in imports_in(REPO_ROOT / folder) if top(name) == "torch"]


def test_the_subpackages_import_each_other_without_a_cycle() -> None:
    """Rooms (a subpackage, or a module at a package's top) point one way: the layout's arrows
    in docs/architecture.md form no loop."""
    def room(name: str) -> str:
        return ".".join(name.split(".")[:2])

    arrows: dict[str, set[str]] = {}
    for package in ("instrumented_ddp", "ddpwatch"):
        for path, name in imports_in(REPO_ROOT / package):
            source = room(".".join(Path(path).with_suffix("").parts))
            if top(name) in ("instrumented_ddp", "ddpwatch") and room(name) != source:
                arrows.setdefault(source, set()).add(room(name))

    def reaches(start: str, goal: str) -> bool:
        seen, stack = set(), [start]
        while stack:
            for after in arrows.get(stack.pop(), ()):
                if after == goal:
                    return True
                if after not in seen:
                    seen.add(after)
                    stack.append(after)
        return False

    assert not sorted({tuple(sorted((a, b))) for a, targets in arrows.items() for b in targets if reaches(b, a)})


def modules_loaded_by(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=True)
    return set(result.stdout.split())


def test_ddpwatch_never_imports_torch() -> None:
    loaded = modules_loaded_by("import ddpwatch.cli, ddpwatch.dashboard.app, ddpwatch.record.recorder, ddpwatch.export.exporters, "
                               "ddpwatch.control.switch_client, ddpwatch.doctor.checkup, ddpwatch.doctor.profile_check, "
                               "ddpwatch.doctor.profiler_trace, ddpwatch.advisor.tune")
    assert "torch" not in loaded
    assert not {m for m in loaded if m.startswith("instrumented_ddp.") and m not in SHARED_GROUND}


def test_training_side_never_imports_the_ui() -> None:
    loaded = modules_loaded_by("import instrumented_ddp.publish.watch, instrumented_ddp.strategies as s, "
                               "instrumented_ddp.training.data, instrumented_ddp.selfcheck.gpu_probe, "
                               "instrumented_ddp.training.train, instrumented_ddp.selfcheck.overhead_bench, "
                               "instrumented_ddp.attachment; [s.strategy_class(name) for name in s.STRATEGY_CLASSES]")
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
