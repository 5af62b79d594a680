"""Each figure has one home: ``metrics`` names only what it defines, every import of it names one of
those, and ``figures/`` holds no sentences (their words are ``ddpwatch.wording``'s). Read from the
source, as the import contract is."""

from __future__ import annotations

import ast
from pathlib import Path

from ddpwatch.figures import metrics

REPO_ROOT = Path(__file__).resolve().parents[3]
METRICS = "ddpwatch.figures.metrics"


def defined_at_top(path: Path) -> set[str]:
    """The names a module binds itself at its top level: functions, classes, assignments."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(target.id for target in node.targets if isinstance(target, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def names_taken_from_metrics(tree: ast.Module) -> set[str]:
    """Every name a module takes from ``metrics``: imported from it, or read as an attribute of
    the name it is bound to (``from ddpwatch.figures import metrics``; ``import ... as``)."""
    taken: set[str] = set()
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == METRICS:
            taken.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "ddpwatch.figures":
            bound.update(alias.asname or alias.name for alias in node.names if alias.name == "metrics")
        elif isinstance(node, ast.Import):
            bound.update(alias.asname for alias in node.names if alias.name == METRICS and alias.asname)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound:
            taken.add(node.attr)
    return taken


def python_files() -> list[Path]:
    return [path for folder in ("ddpwatch", "tests", "bench", "examples") for path in sorted((REPO_ROOT / folder).rglob("*.py"))]


def test_metrics_declares_only_the_names_it_defines() -> None:
    own = defined_at_top(REPO_ROOT / "ddpwatch/figures/metrics.py")
    assert set(metrics.__all__) <= own
    for name in metrics.__all__:
        home = getattr(getattr(metrics, name), "__module__", METRICS)
        assert home == METRICS, f"{name} is {home}'s"


def test_every_name_taken_from_metrics_is_defined_there_not_passed_through() -> None:
    """A name metrics imports for its own use (``Straggler``, ``step_waits``) is read from its
    home: one class, one path."""
    own = defined_at_top(REPO_ROOT / "ddpwatch/figures/metrics.py")
    passed_through = {}
    for path in python_files():
        taken = names_taken_from_metrics(ast.parse(path.read_text()))
        if taken - own:
            passed_through[str(path.relative_to(REPO_ROOT))] = sorted(taken - own)
    assert passed_through == {}


def test_the_figures_hold_no_text_functions() -> None:
    """What the figures say in words is ``ddpwatch.wording``'s: no module of ``figures/`` defines
    a top-level ``..._text`` or ``..._lines`` function."""
    found = {f"{path.name}: {name}" for path in sorted((REPO_ROOT / "ddpwatch/figures").glob("*.py"))
             for name in defined_at_top(path) if name.endswith(("_text", "_lines"))}
    assert found == set()
