"""The package's layers: imports point down only (no cycle), and no module grows past one job's size.

Every import of every module is read from its source (function-local imports and imports under
`if TYPE_CHECKING:` included: a type hint that points up is still a layer pointing the wrong way), resolved to a module of the package, and the
graph is searched for cycles. A package's `__init__` counts as a module: importing it imports all it
re-exports, so a submodule that imports its own package's `__init__` is a cycle too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "wna16_loader"
MAX_LINES = 450  # "a module over ~400 lines is two jobs"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def import_nodes(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement, wherever it stands."""
    return [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The package modules that module `name` imports."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in import_nodes(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
            continue
        base = node.module or ""
        if node.level:
            anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join(anchor + ([base] if base else []))
        for alias in node.names:  # `from . import x` imports module x; `from . import NAME` the package itself
            targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {t for t in targets if t in known and t != name}


def graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imported(name, path, set(mods)) for name, path in mods.items()}


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_import_cycle() -> None:
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def test_cycle_finder_finds_a_planted_cycle() -> None:
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycle(edges) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_relative_imports_resolve() -> None:
    """`from ..x import y` in a subpackage and `from . import z` in an __init__ resolve to package modules."""
    mods = modules()
    edges = graph()
    assert "wna16_loader.loader" in edges["wna16_loader.preshard.writing"]
    assert "wna16_loader.presharded" in edges["wna16_loader.loader"]
    assert "wna16_loader.formats.gptq" in edges["wna16_loader.formats"]
    assert "wna16_loader.formats" not in edges["wna16_loader.formats.autoround"]  # `from . import awq, gptq`
    assert set(edges) == set(mods)


@pytest.mark.parametrize("low, high", [
    ("wna16_loader.presharded", "wna16_loader.loader"),
    ("wna16_loader.results", "wna16_loader.loader"),
    ("wna16_loader.loader", "wna16_loader.preshard"),
    ("wna16_loader.fused", "wna16_loader.loader"),
    ("wna16_loader.sharding", "wna16_loader.checkpoint"),
    ("wna16_loader.device", "wna16_loader.checkpoint"),  # the device policy sits under checkpoint IO and the writer
    ("wna16_loader.device", "wna16_loader.fused"),
    ("wna16_loader.standin", "wna16_loader.device"),  # the test stand-in needs nothing of the package
])
def test_layers_point_down(low: str, high: str) -> None:
    """The read side of a pre-sharded output and the load results sit below the loader, and so on."""
    edges = graph()
    seen, todo = set(), [low]
    while todo:
        node = todo.pop()
        seen.add(node)
        todo.extend(edges[node] - seen)
    assert high not in seen, f"{low} reaches {high}"


def test_no_module_is_two_jobs() -> None:
    long = {name: n for name, path in modules().items()
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines (split them by job): {long}"
