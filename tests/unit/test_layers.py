"""The house's layers, checked on cobali's import graph (every import, lazy and TYPE_CHECKING ones included):
no module imports a layer above its own or another package of its own layer, and no imports go in a circle."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "cobali"

# Top down. A module may import its own package and anything in a lower layer.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("faces",),  # the console script and a module per subcommand: run, bench, serve's flags, simulate, synth-model...
    ("ray",),  # scale-out of the serve and batch faces
    ("config",),  # every flag, and the typed configs built from them once at the edge; also from env and files
    ("http", "batch", "sim"),  # the server, offline batch jobs, the simulator
    ("harness",),  # workloads, latency figures, results files, and the one driver of a workload through an engine
    ("__init__",),  # the package's own names: the engine, its configs, the offline API, its outputs
    ("frontend",),  # what the faces hand the engine and get back: inputs, templates, the client, the offline API
    ("engine",),
    ("structured",),  # constraints on llguidance: grammars, their compiler, the masks sampling applies
    ("backends",),
)
RANK = {part: len(LAYERS) - i for i, layer in enumerate(LAYERS) for part in layer}

# The HTTP layer sees the engine only through the frontend (cobali/frontend/interface.py re-exports the engine's
# values it needs): never the engine's modules or a backend. Besides itself and the frontend it may import
# structured outputs' grammar types and limits, and the harness's timings and results files.
HTTP_MAY_IMPORT = frozenset({"http", "frontend", "structured", "harness"})


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """cobali module -> the cobali modules it imports."""
    files = {module_name(p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        targets = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from cobali.x import y` imports the module cobali.x.y when there is one.
                targets |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module
                            for a in node.names}
        graph[name] = {t for t in targets if t in files and t != name}
    return graph


def part_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    wrong = []
    for source, targets in graph.items():
        for target in targets:
            a, b = part_of(source), part_of(target)
            if a != b and RANK[b] >= RANK[a]:
                wrong.append(f"{source} -> {target}")
    return sorted(wrong)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for succ in graph[node]:
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in stack:
                low[node] = min(low[node], index[succ])
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


def test_every_part_of_the_package_has_a_layer() -> None:
    parts = {part_of(m) for m in import_graph()}
    assert parts <= set(RANK), f"modules outside every layer: {sorted(parts - set(RANK))}"


def test_no_upward_or_sideways_import() -> None:
    assert upward_imports(import_graph()) == []


def http_imports_below_the_frontend(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{source} -> {target}" for source, targets in graph.items() if part_of(source) == "http"
                  for target in targets if part_of(target) not in HTTP_MAY_IMPORT)


def test_the_http_layer_imports_only_the_frontend() -> None:
    assert http_imports_below_the_frontend(import_graph()) == []


def test_no_import_circle() -> None:
    assert circles(import_graph()) == []


def modules_importing(package: str, root: Path = PACKAGE) -> set[str]:
    found = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
            if any(n and n.split(".")[0] == package for n in names):
                found.add(module_name(path))
    return found


def test_only_the_llama_cpp_backend_imports_llama_cpp() -> None:
    importers = modules_importing("llama_cpp")
    assert importers and all(m.startswith("cobali.backends.llama_cpp.") for m in importers), sorted(importers)


def test_the_checks_see_a_planted_upward_import_and_circle(tmp_path: Path) -> None:
    graph = import_graph()
    graph["cobali.engine.kv"] = graph["cobali.engine.kv"] | {"cobali.http.config"}
    graph["cobali.engine.plan"] = graph["cobali.engine.plan"] | {"cobali.engine.kv_tier"}
    assert upward_imports(graph) == ["cobali.engine.kv -> cobali.http.config"]
    graph["cobali.http.routes.chat"] = graph["cobali.http.routes.chat"] | {"cobali.engine.engine"}
    assert "cobali.http.routes.chat -> cobali.engine.engine" in http_imports_below_the_frontend(graph)
    assert ["cobali.engine.kv_tier", "cobali.engine.plan"] in circles(graph)
