"""The package's layers: imports point down only (no cycle), and no module grows past one job's size.

Every import of every module is read from its source (function-local imports and imports under
`if TYPE_CHECKING:` included: a type hint that points up is still a layer pointing the wrong way), resolved to a module of the package, and the
graph is searched for cycles. A package's `__init__` counts as a module: importing it imports all it
re-exports, so a submodule that imports its own package's `__init__` is a cycle too.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "wna16_loader"
MAX_LINES = 400  # "a module over ~400 lines is two jobs"


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
    assert "wna16_loader.load.experts" in edges["wna16_loader.preshard.writing"]
    assert "wna16_loader.load.presharded" in edges["wna16_loader.load.experts"]
    assert "wna16_loader.formats.gptq" in edges["wna16_loader.formats"]
    assert "wna16_loader.formats" not in edges["wna16_loader.formats.autoround"]  # `from . import awq, gptq`
    assert set(edges) == set(mods)


# The layers, lowest first: a module may import its own layer and the ones before it, never one after.
# `errors`, `logs` and `version` import nothing of the package, so every layer may use them.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "logs", "version"),
    ("formats",),    # format declarations and bit packing
    ("models",),     # families table, layer rules, config resolver, tensor names
    ("parallel",),   # ParallelConfig and the rank maths
    ("layouts",),    # engine MoE methods' parameter layouts (data) and the re-lay maths
    ("storage",),    # file mappings, the checkpoint index, the Hub resolver
    ("load",),       # plan, reads, fused layout and writer, ledger, device policy, load_experts
    ("engine",),     # the weight_loader hook, name mapping, FusedMoEExperts, model-level loading
    ("preshard",),   # wna16-shard
    ("integrations",),  # engine plugins (vLLM's --load-format wna16); each imports its engine, nothing imports them
    ("testing",),    # synthetic checkpoints, the GPU stand-in, the demo
    ("usage", "cli", "tables", ""),  # entry points and the public API (`wna16_loader/__init__.py`)
)


def unit(module: str) -> str:
    """The layer unit of a module: its first name below the package ('' for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def layer_of(module: str) -> int:
    rank = {name: i for i, names in enumerate(LAYERS) for name in names}
    if unit(module) not in rank:
        raise AssertionError(f"{module} is in no layer of tests/test_imports.py LAYERS: put it in a folder")
    return rank[unit(module)]


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    """Every import of a module from a layer above its own."""
    return sorted(f"{low} imports {high}" for low, targets in edges.items() for high in targets
                  if layer_of(high) > layer_of(low))


def test_every_module_is_in_a_layer() -> None:
    for name in modules():
        layer_of(name)


def test_layers_point_down() -> None:
    assert not upward_imports(graph()), "imports pointing up:\n" + "\n".join(upward_imports(graph()))


def test_a_planted_upward_import_is_caught(tmp_path: Path) -> None:
    """Plant `from ..engine.hook import ...` in a copy of a load module: the check names it."""
    edges = graph()
    path = PACKAGE / "load" / "plan.py"
    planted = tmp_path / "plan.py"
    planted.write_text(path.read_text(encoding="utf-8") + "\nfrom ..engine.hook import TensorStore\n")
    edges["wna16_loader.load.plan"] = imported("wna16_loader.load.plan", planted, set(edges))
    assert upward_imports(edges) == ["wna16_loader.load.plan imports wna16_loader.engine.hook"]


def test_the_base_modules_import_nothing_of_the_package() -> None:
    edges = graph()
    assert all(not edges[f"wna16_loader.{name}"] for name in LAYERS[0])


@pytest.mark.parametrize("low, high", [
    ("wna16_loader.load.device", "wna16_loader.storage.index"),  # the device policy needs no checkpoint IO
    ("wna16_loader.load.device", "wna16_loader.load.fused"),
    ("wna16_loader.load.presharded", "wna16_loader.load.experts"),
    ("wna16_loader.load.outputs", "wna16_loader.load.presharded"),  # the manifest side below a rank's tensors
    ("wna16_loader.load.results", "wna16_loader.load.experts"),
    ("wna16_loader.testing.standin", "wna16_loader.load.device"),  # the test stand-in needs nothing of the package
])
def test_modules_within_a_layer_point_down(low: str, high: str) -> None:
    """Inside a layer too: the read side of a pre-sharded output and the load results sit below the loader."""
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


INTERNALS = PACKAGE.parent / "docs" / "internals.md"
CODE_MAP = ("<!-- code-map: checked by tests/test_imports.py -->", "<!-- /code-map -->")


def code_map(text: str) -> set[str]:
    """Every module the code map of docs/internals.md names, as 'folder.module' ('module' at the top)."""
    rows = text.split(CODE_MAP[0])[1].split(CODE_MAP[1])[0].strip().splitlines()[2:]
    named, folder = set(), ""
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        if cells[0]:
            folder = "" if cells[0] == "(top)" else cells[0].strip("`/")
        for module in re.findall(r"`([a-z_]+)`", cells[1]):
            named.add(f"{folder}.{module}" if folder else module)
    return named


def package_modules() -> set[str]:
    """Every module of the package as 'folder.module'; a folder's own `__init__` is the folder, not a row."""
    out = set()
    for name, path in modules().items():
        rel = name.removeprefix("wna16_loader").lstrip(".")
        if path.name != "__init__.py" or not rel:
            out.add(rel or "__init__")
    return out


def test_the_code_map_matches_the_folders() -> None:
    named, present = code_map(INTERNALS.read_text(encoding="utf-8")), package_modules()
    assert named == present, (f"docs/internals.md code map names modules that do not exist: {sorted(named - present)}; "
                              f"modules missing from it: {sorted(present - named)}")


def test_the_code_map_check_can_fail() -> None:
    text = INTERNALS.read_text(encoding="utf-8").replace("| | `bulk` |", "| | `gc` |")
    assert "storage.gc" in code_map(text) and "storage.bulk" not in code_map(text)


def test_every_layer_folder_is_a_code_map_folder() -> None:
    folders = {name.split(".")[0] for name in code_map(INTERNALS.read_text(encoding="utf-8")) if "." in name}
    assert folders == {unit for names in LAYERS for unit in names if unit} - {"errors", "logs", "version", "cli",
                                                                              "usage", "tables"}
