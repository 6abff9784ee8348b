"""kiln's import graph has no circles and keeps its layers (DESIGN.md, "Import rules").

The graph is read from the source with `ast`, not by importing: every `import` and `from ... import` in
kiln/**/*.py counts, at module level or inside a function (a lazy import still ties the two modules), under
`if TYPE_CHECKING:` too (a type-only import is still a dependency a reader must follow). Relative imports
are resolved. `from kiln.a import b` is an edge to the module `kiln.a.b` when there is one, else to
`kiln.a` (its `__init__`); a package's parents run first when Python imports it, but that is not an edge
here, so a package `__init__` that re-exports its children makes no circle of its own.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kiln"

# ---- the rules, as data ------------------------------------------------------------------------------

# The torch-free core: these modules, and every kiln module they import (transitively), import no torch, so
# the scheduler and its data run and are tested without a device and hand the runner plain data.
TORCH_FREE = (
    "kiln.runtime.core.scheduler",
    "kiln.runtime.core.block_manager",
    "kiln.runtime.core.block_table",
    "kiln.runtime.core.request",
    "kiln.runtime.core.sampling_params",
    "kiln.runtime.core.outputs",
    "kiln.runtime.core.request_failure",
)

# (importer prefix, imported prefix, why): no module under the first may import one under the second.
FORBIDDEN = (
    # Operators know tensors, not requests, engines, servers or builds.
    ("kiln.plugins", "kiln.runtime", "plugins are below the runtime"),
    ("kiln.plugins", "kiln.serve", "plugins are below serve"),
    ("kiln.plugins", "kiln.builder", "plugins are below the builder"),
    # Builder and runtime meet only in engine_format/ (the engine directory).
    ("kiln.runtime", "kiln.builder", "the runtime reads engines through kiln.engine_format"),
    # The builder uses the formats, not the other way round.
    ("kiln.quant", "kiln.builder", "the builder imports kiln.quant"),
    # The checkpoint readers (plain HF and the pre-quantized formats) are below the builder that uses them.
    # Not ("kiln.checkpoints", "kiln.quant"): a pre-quantized reader names the engine's scheme as a
    # QuantSpec and refuses with QuantError, so it sees quant's types, only those (CHECKPOINTS_SEE_OF_QUANT).
    ("kiln.checkpoints", "kiln.builder", "the builder imports kiln.checkpoints"),
    # A server loads engines; it never builds one (shared helpers live in engine_format/ or below).
    ("kiln.serve", "kiln.builder", "serve is beside the builder, not above it"),
    # The runtime's layers, each importing only those below it: core < sampling < worker < engine.
    ("kiln.runtime.core", "kiln.runtime.sampling", "core is plain data and policy, below sampling"),
    ("kiln.runtime.core", "kiln.runtime.worker", "core is below the worker"),
    ("kiln.runtime.core", "kiln.runtime.engine", "core is below the engine"),
    ("kiln.runtime.sampling", "kiln.runtime.worker", "sampling turns logits into tokens; it never runs the network"),
    ("kiln.runtime.sampling", "kiln.runtime.engine", "sampling is below the engine"),
    ("kiln.runtime.worker", "kiln.runtime.engine", "the worker runs steps; the engine drives it, never the reverse"),
    ("kiln.runtime.distributed", "kiln.runtime.engine", "tensor-parallel ranks are workers"),
    # Measuring tools use the public API; nothing of kiln's own depends on them.
    ("kiln.runtime", "kiln.bench", "bench is above the runtime"),
    ("kiln.serve", "kiln.bench", "bench is a client of serve"),
)

# The kiln.runtime modules serve may import; anything else in kiln.runtime is the engine's inside.
SERVE_SEES_OF_RUNTIME = frozenset({
    # The public API (kiln.runtime's __all__ and the failures serve maps to 4xx / 5xx).
    "kiln.runtime",
    "kiln.runtime.engine.async_llm",
    "kiln.runtime.core.outputs",
    "kiln.runtime.core.sampling_params",
    "kiln.runtime.core.guided_decoding",
    "kiln.runtime.core.request_failure",
    "kiln.runtime.options",  # RuntimeOptions: the one list of runtime options (ServeConfig.runtime, the Triton model)
    "kiln.runtime.speculative",  # its __init__: SpeculativeConfig, for the --speculative-* options
    "kiln.runtime.engine.detokenizer",  # PROMPT_CONTEXT_TOKENS: an echoed prompt decodes as generated text does
})

# The kiln.quant modules the checkpoint readers may import: the types a pre-quantized reader answers in.
CHECKPOINTS_SEE_OF_QUANT = frozenset({
    "kiln.quant.spec",  # QuantSpec: the kiln scheme a reader says the engine gets (quant_spec)
    "kiln.quant.base",  # QuantError: what the builder turns into a BuildError naming the file and field
    "kiln.quant.selection",  # DEFAULT_EXCLUDED: the layers kiln leaves unquantized unless a checkpoint says
})

# Circles still allowed, each as the sorted list of its modules, with the reason. Empty: there are none.
KNOWN_CYCLES: dict[tuple[str, ...], str] = {}


# ---- the graph ---------------------------------------------------------------------------------------

def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_names(module: str, path: Path) -> list[str]:
    """Every dotted name `module` imports anywhere in its source, relative imports made absolute."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            names += [f"{base}.{alias.name}" for alias in node.names]
    return names


def _graph_of(package: Path) -> tuple[dict[str, frozenset[str]], dict[str, frozenset[str]]]:
    """(module -> the package's modules it imports, module -> the top-level outside packages it imports)."""
    modules = {_module_name(p, package): p for p in sorted(package.rglob("*.py")) if "__pycache__" not in p.parts}
    edges, outside = {}, {}
    for module, path in modules.items():
        inner, outer = set(), set()
        for name in _imported_names(module, path):
            if name.split(".")[0] != package.name:
                outer.add(name.split(".")[0])
                continue
            while name not in modules:  # `from kiln.a import Name` -> kiln.a; `import kiln.a.b` -> kiln.a.b
                name = name.rsplit(".", 1)[0]
            if name != module:
                inner.add(name)
        edges[module], outside[module] = frozenset(inner), frozenset(outer)
    return edges, outside


@cache
def _graph() -> tuple[dict[str, frozenset[str]], dict[str, frozenset[str]]]:
    return _graph_of(PACKAGE)


def _cycles(edges: dict[str, frozenset[str]]) -> list[list[str]]:
    """One import path (a -> b -> ... -> a) through every strongly connected group of modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm; the graph is a few hundred modules deep at most
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_path_around(group, edges) for group in groups]


def _path_around(group: list[str], edges: dict[str, frozenset[str]]) -> list[str]:
    """A shortest circle through the group's first module, as the list of modules along it."""
    start, members = group[0], set(group)
    previous = {start: None}
    frontier = [start]
    while frontier:
        following = []
        for v in frontier:
            for w in sorted(edges[v] & members):
                if w == start:
                    path = [v]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if w not in previous:
                    previous[w] = v
                    following.append(w)
        frontier = following
    raise AssertionError(f"no circle through {start}")


def _reachable(module: str, edges: dict[str, frozenset[str]]) -> dict[str, str | None]:
    """Every kiln module `module` imports, directly or not, each with the module that imports it."""
    seen: dict[str, str | None] = {module: None}
    todo = [module]
    while todo:
        v = todo.pop()
        for w in sorted(edges[v]):
            if w not in seen:
                seen[w] = v
                todo.append(w)
    return seen


def _chain(target: str, seen: dict[str, str | None]) -> str:
    path = [target]
    while seen[path[-1]] is not None:
        path.append(seen[path[-1]])
    return " -> ".join(reversed(path))


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


# ---- the tests ---------------------------------------------------------------------------------------

def test_the_graph_sees_the_package():
    edges, outside = _graph()
    assert len(edges) > 100
    assert "kiln.runtime.core.scheduler" in edges["kiln.runtime.engine.engine"]
    assert "torch" in outside["kiln.runtime.worker.engine_loader"]


def test_no_import_circles():
    cycles = [c for c in _cycles(_graph()[0]) if tuple(sorted(set(c))) not in KNOWN_CYCLES]
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", TORCH_FREE)
def test_the_core_imports_no_torch(module):
    edges, outside = _graph()
    assert module in edges, f"{module} is in TORCH_FREE but not in the package"
    seen = _reachable(module, edges)
    torch_users = [_chain(m, seen) for m in sorted(seen) if "torch" in outside[m]]
    assert not torch_users, f"{module} imports torch through: " + "; ".join(torch_users)


@pytest.mark.parametrize(("importer", "imported", "why"), FORBIDDEN)
def test_forbidden_imports(importer, imported, why):
    edges, _ = _graph()
    leaks = [f"{m} -> {t}" for m in sorted(edges) if _under(m, importer) for t in sorted(edges[m])
             if _under(t, imported)]
    assert not leaks, f"{importer} must not import {imported} ({why}): " + ", ".join(leaks)


def _reaches_beyond(importer: str, imported: str, allowed: frozenset[str], table: str) -> list[str]:
    """The imports from modules under `importer` of modules under `imported` that `allowed` (named `table`,
    whose entries must exist) does not list."""
    edges, _ = _graph()
    missing = sorted(m for m in allowed if m not in edges)
    assert not missing, f"{table} names modules that do not exist: {missing}"
    return [f"{m} -> {t}" for m in sorted(edges) if _under(m, importer) for t in sorted(edges[m])
            if _under(t, imported) and t not in allowed]


def test_serve_sees_only_the_runtime_modules_it_is_allowed():
    reaches = _reaches_beyond("kiln.serve", "kiln.runtime", SERVE_SEES_OF_RUNTIME, "SERVE_SEES_OF_RUNTIME")
    assert not reaches, ("serve imports runtime modules outside SERVE_SEES_OF_RUNTIME (import the public name, "
                         "or add the module there with its reason): " + ", ".join(reaches))


def test_checkpoints_see_only_the_quant_types_they_answer_in():
    reaches = _reaches_beyond("kiln.checkpoints", "kiln.quant", CHECKPOINTS_SEE_OF_QUANT, "CHECKPOINTS_SEE_OF_QUANT")
    assert not reaches, ("kiln.checkpoints imports kiln.quant modules beyond its types (a reader maps a "
                         "layout; quantization math stays in kiln.quant or kiln.plugins): " + ", ".join(reaches))


def test_the_checker_finds_a_circle_through_a_lazy_relative_import(tmp_path):
    """The checker itself: a circle closed by a function-level import is found and printed as a path."""
    package = tmp_path / "kiln"
    (package / "a").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "a" / "__init__.py").write_text("")
    (package / "a" / "x.py").write_text("import torch\n\nfrom .y import f\n")
    (package / "a" / "y.py").write_text("def f():\n    from kiln.a import x\n")
    edges, outside = _graph_of(package)
    assert _cycles(edges) == [["kiln.a.x", "kiln.a.y", "kiln.a.x"]]
    assert outside["kiln.a.x"] == {"torch"}
