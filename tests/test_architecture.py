"""The layout's rules, checked on the source: no import cycle among project modules, components that know nothing
of Prefect or of the recipes above them, and no private name imported across modules.

Imports are read statically (every `from ... import` anywhere in a module, lazy ones inside functions included;
those under `if TYPE_CHECKING:` run nothing and are left out). Run `python tests/test_architecture.py` for the
import graph's size and any cycle.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("components", "stages", "flows", "dreamgym")


def _module(path: Path) -> str:
    return ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


MODULES = {_module(p): p for package in PACKAGES if (REPO / package).is_dir()
           for p in sorted((REPO / package).rglob("*.py"))}


def runtime_imports(node: ast.AST) -> list[ast.ImportFrom]:
    """The absolute `from ... import` statements under `node`, lazy ones inside functions included, those under
    `if TYPE_CHECKING:` (which run nothing) left out."""
    skipped = {id(inner) for branch in ast.walk(node) if isinstance(branch, ast.If)
               and "TYPE_CHECKING" in ast.unparse(branch.test) for inner in ast.walk(branch)}
    return [inner for inner in ast.walk(node) if id(inner) not in skipped and isinstance(inner, ast.ImportFrom)
            and inner.module and not inner.level]


def imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every runtime `from module import name` in a file."""
    return [(node.module, alias.name) for node in runtime_imports(ast.parse(path.read_text(encoding="utf-8")))
            for alias in node.names]


def import_graph() -> dict[str, set[str]]:
    """Project module -> the project modules it imports (`from package import module` counts as the module)."""
    graph: dict[str, set[str]] = {}
    for module, path in MODULES.items():
        targets = {f"{source}.{name}" if f"{source}.{name}" in MODULES else source for source, name in imports(path)}
        graph[module] = {target for target in targets if target in MODULES and target != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle() -> None:
    assert not cycles(import_graph()), "import cycles (break them by moving what both sides need down a level)"


def test_components_know_nothing_of_prefect_or_the_recipes_above_them() -> None:
    above = ("prefect", "flows", "stages", "dreamgym")
    offending = [f"{module}: from {source} import {name}" for module, path in MODULES.items()
                 if module.startswith("components") for source, name in imports(path)
                 if source.split(".")[0] in above]
    assert not offending, offending


def test_only_flows_import_prefect() -> None:
    offending = [module for module, path in MODULES.items() if not module.startswith("flows")
                 and any(source.split(".")[0] == "prefect" for source, _ in imports(path))]
    assert not offending, f"Prefect belongs in flows/: {offending}"


def test_no_private_name_is_imported_across_modules() -> None:
    """Product code, benchmarks and research scripts share only public names (a test may reach into its module)."""
    files = [*MODULES.values(), *(path for folder in ("benchmarks", "research")
                                   for path in sorted((REPO / folder).glob("*.py")))]
    offending = [f"{path.relative_to(REPO)}: from {source} import {name}" for path in files
                 for source, name in imports(path)
                 if source.split(".")[0] in PACKAGES and name.startswith("_") and not name.startswith("__")]
    assert not offending, f"make these public (or keep their use inside their module): {offending}"


if __name__ == "__main__":
    graph = import_graph()
    found = cycles(graph)
    for component in found:
        print("cycle:", " <-> ".join(component))
    print(f"{len(graph)} modules, {sum(map(len, graph.values()))} imports between them, {len(found)} cycles")
    sys.exit(1 if found else 0)
