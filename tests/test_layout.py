"""The code's shape, as docs/DEVELOPMENT.md states it: small modules and functions, strategies as units."""

from __future__ import annotations

import ast
from pathlib import Path

from launcher import strategies
from tests.conftest import ROOT

PACKAGE = ROOT / "launcher"
GENERATED = {PACKAGE / "cli" / "help_data.py"}  # written by launcher.cli.helpgen from the schema


def _modules(under: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in under.rglob("*.py") if p not in GENERATED)


def _project_modules() -> list[Path]:
    """The package, and the code beside it that users and reviewers read: recipes, benchmarks, tests."""
    return [p for d in (PACKAGE, ROOT / "recipes", ROOT / "benchmarks", ROOT / "tests") for p in _modules(d)]


def test_no_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in _project_modules() if (n := p.read_text().count("\n")) > 400}
    assert not long, f"split these modules: {long}"


def test_no_function_is_over_60_lines():
    long = {}
    for path in _project_modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > 60:
                long[f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    assert not long, f"split these functions: {long}"


def test_config_and_cli_branch_on_no_strategy_name_and_test_no_strategy_attribute():
    names = set(strategies.available())
    found = []
    for path in _modules(PACKAGE / "config") + _modules(PACKAGE / "cli"):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Compare):
                literals = [c.value for c in ast.walk(node) if isinstance(c, ast.Constant)]
                found += [f"{where} compares with {v!r}" for v in literals if v in names]
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("hasattr", "getattr") and node.args:
                if "strategy" in ast.unparse(node.args[0]):
                    found.append(f"{where} {ast.unparse(node)}")
    assert not found, "dispatch through the strategy unit instead: " + "; ".join(found)


def test_tests_start_dlaunch_processes_through_the_helpers_that_pin_the_device():
    """On a GPU machine ``auto`` picks cuda, and ``cluster=1x2`` then asks for two GPUs: every command a test
    starts goes through ``tests.conftest.dlaunch`` or ``command``, which add ``cluster.device=cpu`` unless the
    test names a device (issue 15, a hermetic suite). An argv that spells the module itself bypasses them."""
    helpers = {ROOT / "tests" / "conftest.py", ROOT / "tests" / "prewarmed.py"}
    found = []
    for path in sorted((ROOT / "tests").rglob("*.py")):
        if path in helpers:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.List, ast.Tuple)):
                words = [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
                if any(w.startswith(("launcher.cli.main", "launcher.cli.entry")) for w in words) and "-m" in words:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, "start dlaunch through tests.conftest.command(...): " + ", ".join(found)
