"""The module graph of flare (src/) and the paper suite (paper/src/), read with `ast`: every import statement in a
file — at module level, under `if TYPE_CHECKING:` and `try:`, and inside functions and classes. A type-checking
import is still an edge a type checker and a reader follow, and a lazy import inside a function is still an edge
the program follows when the function runs: a circle hidden in either is still a circle.

Importing `a.b.c` also runs `a` and `a.b`, so an edge goes to every package on the way."""
import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"flare": ROOT / "src", "flare_paper": ROOT / "paper" / "src"}  # each package and its source root
FILES = [p for package, root in PACKAGES.items() for p in sorted((root / package).rglob("*.py"))]


def module_name(path: Path) -> str:
    root = next(root for package, root in PACKAGES.items() if path.is_relative_to(root / package))
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in FILES}


def imported(node: ast.stmt, module: str, is_package: bool) -> list[str]:
    """The project's modules an import statement names."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return [f"{target}.{a.name}" if f"{target}.{a.name}" in MODULES else target for a in node.names]


def edges(path: Path) -> set[str]:
    """Every project module the file imports, wherever the import statement stands."""
    module = module_name(path)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        for name in imported(node, module, path.name == "__init__.py"):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # `import a.b.c` runs a, a.b and a.b.c
                target = ".".join(parts[:i])
                if target in MODULES and target != module and not module.startswith(target + "."):
                    out.add(target)
    return out


GRAPH = {m: edges(p) for m, p in MODULES.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of the graph as [a, b, …, a], or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for dep in sorted(graph.get(m, ())):
            if dep not in graph:
                continue
            if state.get(dep) == 1:
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_graph_is_read():
    """The reader sees the registry under the config, a type-checking import and an import inside a function (the
    test means something)."""
    assert "flare.registry" in GRAPH["flare.config.schema"]
    assert "flare.report.report" in GRAPH["flare.cli"]  # `flare report`'s lazy import, inside a function
    probe = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from flare.config import Config\n"
    nodes = list(ast.walk(ast.parse(probe)))
    assert "flare.config" in [n for node in nodes for n in imported(node, "flare.registry", False)]


def test_no_import_circle_type_checking_imports_included():
    circle = find_circle(GRAPH)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_the_circle_finder_names_a_circle():
    graph = {**GRAPH, "flare.registry": GRAPH["flare.registry"] | {"flare.config"}}
    circle = find_circle(graph)
    assert circle is not None and circle[0] == circle[-1] and {"flare.registry", "flare.config"} <= set(circle)


def test_the_registry_is_the_bottom_floor():
    """registry.py imports only the errors module: the registries' entry types live with the types they name."""
    assert GRAPH["flare.registry"] <= {"flare", "flare.errors"}


@pytest.mark.parametrize("module", sorted(m for m in GRAPH if m.split(".")[0] == "flare"))
def test_flare_never_imports_the_paper_package(module):
    """flare_paper depends on flare, never the other way: not at module level, not inside a function."""
    path = MODULES[module]
    names = [n for node in ast.walk(ast.parse(path.read_text()))
             for n in imported(node, module, path.name == "__init__.py")]
    assert not [n for n in names if n.split(".")[0] == "flare_paper"]
