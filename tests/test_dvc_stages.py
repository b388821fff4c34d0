"""dvc.yaml lists, for each stage, every project module the stage runs, so editing one makes `dvc repro` rerun it.

Found statically: the stage's recipe `stages/<name>.py` (what `dreamgym stage NAME` imports), then every project
module it imports (`from stages... import`, `from components... import`, `from components.x import module`), lazy
imports inside functions included, transitively (imports under TYPE_CHECKING run nothing and are left out). A
module missing from the list is a stage DVC calls up to date while its code changed; one listed in excess reruns
the stage for nothing.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from tests.test_architecture import runtime_imports

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("components", "stages")  # the code a stage runs; dreamgym/ (the command) and flows/ call stages


def _module_file(module: str) -> str | None:
    path = Path(*module.split(".")).with_suffix(".py")
    return path.as_posix() if (REPO / path).is_file() else None


# A toolbox module (the params-to-objects builders; the simulator server, whose bundle serving the RL stages do not
# run) is followed function by function: a stage depends on the functions it calls (and theirs), not on every module
# some other function imports.
TOOLBOXES = ("components/builders.py", "components/simulator/server.py")


def _runtime_imports(node: ast.AST) -> list[ast.ImportFrom]:
    """The project imports under `node` that run (`test_architecture.runtime_imports` of stages' code)."""
    return [inner for inner in runtime_imports(node) if inner.module.split(".")[0] in PACKAGES]


def _targets(node: ast.ImportFrom) -> list[tuple[str, str]]:
    """(file, name) per imported name: `from components.x import name`, or `from components import x` (a module)."""
    targets = []
    for alias in node.names:
        if module := _module_file(f"{node.module}.{alias.name}"):
            targets.append((module, ""))
        elif module := _module_file(node.module):
            targets.append((module, alias.name))
    return targets


def _toolbox_files(file: str, names: set[str]) -> set[str]:
    """What the functions `names` of a toolbox module import, following the calls between its functions."""
    tree = ast.parse((REPO / file).read_text(encoding="utf-8"))
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    module_level = ast.Module(body=[node for node in tree.body if isinstance(node, ast.ImportFrom)], type_ignores=[])
    files = {target for node in _runtime_imports(module_level) for target, _ in _targets(node)}
    seen, todo = set(), [name for name in names if name in functions]
    while todo:
        function = functions[todo.pop()]
        if function.name in seen:
            continue
        seen.add(function.name)
        files |= {target for node in _runtime_imports(function) for target, _ in _targets(node)}
        todo += [node.id for node in ast.walk(function) if isinstance(node, ast.Name) and node.id in functions]
    return files


def code_of_stage(name: str) -> set[str]:
    """stages/<name>.py and every project file it imports, transitively (toolboxes: only what the used functions
    import)."""
    seen: set[str] = set()
    toolbox_names: dict[str, set[str]] = {toolbox: set() for toolbox in TOOLBOXES}
    todo = [f"stages/{name}.py"]
    while todo:
        file = todo.pop()
        if file in seen:
            continue
        seen.add(file)
        for node in _runtime_imports(ast.parse((REPO / file).read_text(encoding="utf-8"))):
            for target, imported_name in _targets(node):
                if target in TOOLBOXES:
                    toolbox_names[target].add(imported_name)
                    seen.add(target)
                else:
                    todo.append(target)
    for toolbox, names in toolbox_names.items():
        for file in _toolbox_files(toolbox, names) if names else ():
            todo.append(file)
    while todo:  # what the toolboxes' functions import, transitively
        file = todo.pop()
        if file not in seen:
            seen.add(file)
            todo += [target for node in _runtime_imports(ast.parse((REPO / file).read_text(encoding="utf-8")))
                     for target, _ in _targets(node)]
    return seen


DVC_STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text(encoding="utf-8"))["stages"]


def _code_deps(stage: str) -> set[str]:
    return {dep for dep in DVC_STAGES[stage].get("deps", []) if dep.split("/")[0] in PACKAGES}


@pytest.mark.parametrize("stage", sorted(DVC_STAGES))
def test_dvc_stage_lists_the_code_it_runs(stage: str) -> None:
    assert (REPO / "stages" / f"{stage}.py").is_file(), f"dvc.yaml {stage!r}: no stages/{stage}.py runs it"
    listed, runs = _code_deps(stage), code_of_stage(stage)
    assert not runs - listed, f"dvc.yaml {stage!r}: add to its deps {sorted(runs - listed)} (the stage runs them)"
    assert not listed - runs, f"dvc.yaml {stage!r}: drop from its deps {sorted(listed - runs)} (it never runs them)"


# Stages whose recipe runs other stages' recipes (correction rounds: synthetic RL, sim-to-real, ... round after round)
COMPOSITE = {"correction_rounds"}


def test_a_stage_file_is_the_dependency_of_its_stage_alone() -> None:
    """Editing one stage's recipe (its report text, say) reruns that stage and no other, but the composite stages
    that run it: no other stage file imports another, so each stages/<name>.py is in the deps of its own DVC stage
    and, at most, of the composites."""
    recipes = {f"stages/{path.name}" for path in (REPO / "stages").glob("*.py") if path.stem in DVC_STAGES}
    assert recipes == {f"stages/{stage}.py" for stage in DVC_STAGES}
    for recipe in sorted(recipes):
        users = [stage for stage in DVC_STAGES if recipe in _code_deps(stage) and stage not in COMPOSITE]
        assert users == [Path(recipe).stem] or (not users and Path(recipe).stem in COMPOSITE), \
            f"{recipe} is in the deps of {users}: only its own stage (and a composite) may import it"


def test_every_stage_has_a_flow_and_a_command() -> None:
    """The stage names the flows and `dreamgym stage` offer are dvc.yaml's, in the same order."""
    from stages.common import STAGES

    assert list(STAGES) == list(DVC_STAGES)
