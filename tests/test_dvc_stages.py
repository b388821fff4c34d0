"""dvc.yaml lists, for each stage, every project module the stage runs, so editing one makes `dvc repro` rerun it.

Found statically: the stage's function in components/stages.py, the stages.py functions it calls and the names it
uses from stages.py's imports, then every `components` module those import, transitively (imports under
TYPE_CHECKING run nothing and are left out). A module missing from the list is a stage DVC calls up to date while
its code changed; one listed in excess reruns the stage for nothing.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
STAGES = REPO / "components" / "stages.py"


def _module_file(module: str) -> str | None:
    path = Path(*module.split(".")).with_suffix(".py")
    return str(path) if (REPO / path).is_file() else None


def _imports(node: ast.AST) -> list[tuple[str, str]]:
    """The project files imported under `node`, each with the name its import binds (two may bind one name)."""
    skipped = {id(inner) for branch in ast.walk(node) if isinstance(branch, ast.If)
               and "TYPE_CHECKING" in ast.unparse(branch.test) for inner in ast.walk(branch)}
    bound: list[tuple[str, str]] = []
    for inner in ast.walk(node):
        if id(inner) in skipped or not isinstance(inner, ast.ImportFrom) or not inner.module:
            continue
        if not inner.module.startswith("components"):
            continue
        for alias in inner.names:  # `from components.x import name`, or `from components import x` (a module)
            file = _module_file(f"{inner.module}.{alias.name}") or _module_file(inner.module)
            if file:
                bound.append((alias.asname or alias.name, file))
    return bound


def _closure(files: set[str]) -> set[str]:
    seen: set[str] = set()
    todo = list(files)
    while todo:
        file = todo.pop()
        if file not in seen:
            seen.add(file)
            todo += [imported for _, imported in _imports(ast.parse((REPO / file).read_text()))]
    return seen


def code_of_stage(name: str) -> set[str]:
    tree = ast.parse(STAGES.read_text())
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    module_imports = _imports(ast.Module(body=[n for n in tree.body if isinstance(n, ast.ImportFrom)],
                                         type_ignores=[]))
    files: set[str] = set()
    seen, todo = set(), [name]
    while todo:
        function = functions[todo.pop()]
        if function.name in seen:
            continue
        seen.add(function.name)
        files |= {file for _, file in _imports(function)}
        used = {node.id for node in ast.walk(function) if isinstance(node, ast.Name)}
        files |= {file for bound, file in module_imports if bound in used}
        todo += [called for called in used if called in functions]
    return _closure(files) | {"components/stages.py"}


DVC_STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]


@pytest.mark.parametrize("stage", sorted(DVC_STAGES))
def test_dvc_stage_lists_the_code_it_runs(stage: str) -> None:
    listed = {dep for dep in DVC_STAGES[stage].get("deps", []) if dep.startswith("components/")}
    runs = code_of_stage(stage)
    assert not runs - listed, f"dvc.yaml {stage!r}: add to its deps {sorted(runs - listed)} (the stage runs them)"
    assert not listed - runs, f"dvc.yaml {stage!r}: drop from its deps {sorted(listed - runs)} (it never runs them)"
