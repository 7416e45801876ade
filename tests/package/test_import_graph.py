"""The package imports in the direction of its layers: at every level, the parts of a
package (its subpackages and modules) import one another without a loop.

Imports are read from the source (module level and inside functions alike: a lazy import
is a dependency all the same); imports under ``if TYPE_CHECKING:`` are type hints only and
do not count. A loop between two parts is reported with the imports that close it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import archserve

PACKAGE_ROOT = Path(archserve.__file__).parent


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE_ROOT.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden.update(id(inner) for stmt in node.body for inner in ast.walk(stmt))
    return hidden


def _imported_names(path: Path, module: str) -> set[str]:
    """Every archserve name ``module`` imports (a module, or a name inside one)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    hidden = _type_checking_nodes(tree)
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in hidden:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] == "archserve"}


def import_graph() -> dict[str, set[str]]:
    """module -> the archserve modules it imports."""
    paths = {_module_name(p): p for p in PACKAGE_ROOT.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        targets = set()
        for name in _imported_names(path, module):
            while name and name not in paths:      # a name inside a module -> the module
                name = name.rpartition(".")[0]
            if name and name != module:
                targets.add(name)
        graph[module] = targets
    return graph


def _part_of(module: str, package: str) -> str | None:
    """The child of ``package`` (subpackage or module) that ``module`` is in; the package's
    own ``__init__`` is a part of its own. None: not inside ``package``."""
    if module == package:
        return package + ".__init__"
    if not module.startswith(package + "."):
        return None
    return package + "." + module[len(package) + 1:].split(".")[0]


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def loops_between_parts(graph: dict[str, set[str]]) -> list[str]:
    """Every loop among the parts of any package, as text naming the imports in it."""
    packages = sorted({module.rsplit(".", depth)[0] for module in graph
                       for depth in range(1, module.count(".") + 1)})
    problems = []
    for package in packages:
        edges: dict[str, set[str]] = {}
        why: dict[tuple[str, str], str] = {}
        for module, targets in graph.items():
            source = _part_of(module, package)
            if source is None:
                continue
            for target in targets:
                dest = _part_of(target, package)
                if dest is not None and dest != source:
                    edges.setdefault(source, set()).add(dest)
                    why.setdefault((source, dest), f"{module} -> {target}")
        for cycle in _cycles(edges):
            members = set(cycle)
            links = sorted(why[(a, b)] for a in cycle for b in edges.get(a, ()) if b in members)
            problems.append(f"{package}: {' <-> '.join(cycle)} ({'; '.join(links)})")
    return problems


def test_the_graph_sees_the_imports_it_should():
    """The reader finds module-level, relative-free and lazy imports, and skips type
    hints: a few edges known from the source."""
    graph = import_graph()
    assert "archserve.kernels.registry" in graph["archserve.kernels.catalog"]
    # A lazy import inside a function counts.
    assert "archserve.distributed.mp_executor" in graph["archserve.distributed.executor_backends"]
    # The models name ModelConfig under TYPE_CHECKING only; ModelConfig's module imports
    # leaves only: its attention facts and the compressed-attention layer kinds.
    assert graph["archserve.models.config"] == {
        "archserve.models.attention_facts", "archserve.kernels.compressed_attention.layout"}
    for leaf in graph["archserve.models.config"]:
        assert graph[leaf] == set(), leaf


def test_a_loop_is_found():
    """The check itself: a loop between two packages, one between two modules of one
    package, and none where the imports point one way."""
    graph = {"archserve.a.x": {"archserve.b.y"}, "archserve.b.y": {"archserve.a.z"},
             "archserve.a.z": set(), "archserve.c.p": {"archserve.c.q"},
             "archserve.c.q": {"archserve.c.p"}, "archserve.d.e.f": {"archserve.d.g"},
             "archserve.d.g": set()}
    problems = loops_between_parts(graph)
    assert [p.split(" (")[0] for p in problems] == [
        "archserve: archserve.a <-> archserve.b",
        "archserve.c: archserve.c.p <-> archserve.c.q"]
    assert "archserve.b.y -> archserve.a.z" in problems[0]


def test_no_import_loop_between_the_parts_of_any_package():
    problems = loops_between_parts(import_graph())
    assert not problems, "import loops:\n" + "\n".join(problems)
