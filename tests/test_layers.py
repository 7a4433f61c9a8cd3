"""The layering of docs/architecture.md, checked on the code: no module imports from
a layer above its own or from a sibling layer, and no modules import each other in
a circle. Every import counts: at module level, inside functions, and those made for
type checking only."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("pipeline", "consumers", "sinks")
# (layer, rank, module prefixes): a module may import its own layer and any of lower
# rank; layers of one rank are siblings and may not import each other.
LAYERS = (
    ("core", 0, ("pipeline.core",)),
    ("model", 1, ("pipeline.model",)),
    ("kafka", 1, ("pipeline.kafka",)),
    ("storage", 1, ("sinks",)),
    ("worker", 2, ("consumers",)),
    ("applications", 3, ("pipeline.cli", "pipeline.status", "pipeline.audit", "pipeline.search")),
)
PACKAGE_ROOTS = {"pipeline": "applications", "consumers": "worker", "sinks": "storage"}
MAX_LINES = 600


def modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            name = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found[name.removesuffix(".__init__")] = path
    return found


def layer_of(module: str) -> tuple[str, int]:
    for layer, rank, prefixes in LAYERS:
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return layer, rank
    root = PACKAGE_ROOTS[module]  # a package's own __init__
    return root, next(rank for layer, rank, _ in LAYERS if layer == root)


def imports(known: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports (a name imported from a package that
    is a module of its own counts as that module)."""
    edges: dict[str, set[str]] = defaultdict(set)
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{alias.name}" for alias in node.names]
                targets.append(node.module)
            for target in targets:
                while target and target not in known:
                    target = target.rpartition(".")[0]
                if target and target != name and not name.startswith(target + "."):
                    edges[name].add(target)
    return edges


def test_no_import_runs_up_a_layer_or_across_to_a_sibling() -> None:
    known = modules()
    wrong = []
    for source, targets in imports(known).items():
        source_layer, source_rank = layer_of(source)
        for target in targets:
            target_layer, target_rank = layer_of(target)
            if target_layer != source_layer and target_rank >= source_rank:
                wrong.append(f"{source} ({source_layer}) imports {target} ({target_layer})")
    assert not wrong, "\n".join(sorted(wrong))


def test_no_modules_import_each_other_in_a_circle() -> None:
    edges = imports(modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in edges.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(modules()):
        if module not in index:
            visit(module)
    assert not circles, circles


def test_no_module_outgrows_what_a_reader_holds() -> None:
    too_long = []
    for folder in (*PACKAGES, "scripts"):
        for path in (REPO / folder).rglob("*.py"):
            lines = len(path.read_text().splitlines())
            if lines > MAX_LINES:
                too_long.append(f"{path.relative_to(REPO)}: {lines}")
    assert not too_long, too_long
