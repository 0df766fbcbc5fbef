"""The import rules of ARCHITECTURE.md, checked on the source: no import circle between riskserve's modules
and no import from a package into one it may not use (an upward import).

Every ``import`` statement counts, wherever it is: at the top, inside a function, under
``TYPE_CHECKING``. A lazy import hides a circle from Python, not from a reader.
"""

from __future__ import annotations

import ast
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "riskserve"

BELOW_SERVING = frozenset(
    {"state", "audit", "learning", "schema", "features", "wrappers", "platform", "proto"}
)

ALLOWED: dict[str, frozenset[str]] = {
    # the ground floor: imports nothing of riskserve above it
    "platform": frozenset(),
    "proto": frozenset(),
    # model backends and the feature encoding: the ground floor only
    "features": frozenset({"platform"}),
    "wrappers": frozenset({"platform"}),
    # what a pipeline is (checks a model's settings with its backend's settings class)
    "schema": frozenset({"features", "wrappers", "platform"}),
    # online learning as a library: the feedback log (labels joined to the audit trail), the learner,
    # label admission
    "learning": frozenset({"state", "audit", "schema", "features", "wrappers", "platform"}),
    # the decision audit trail as a library: its store, journal, writer, reader, export
    "audit": frozenset({"state", "platform"}),
    # what must survive a node: the state database (SQLite or PostgreSQL) and the versions record
    "state": frozenset({"platform"}),
    # what happens to one decision
    "serving": BELOW_SERVING - {"serving"},
    # a program calling the gRPC service
    "client": frozenset({"platform", "proto"}),
    # running a system: everything below
    "operations": BELOW_SERVING | {"serving", "client"},
    # the demo and the command line sit on top
    "demo": BELOW_SERVING | {"serving", "client", "operations"},
    "cli": BELOW_SERVING | {"serving", "client", "operations", "demo"},
}
"""Package -> the other riskserve packages its modules may import (its own modules always)."""


@dataclass(frozen=True)
class Import:
    """One import statement of one module, resolved to the riskserve module it loads."""

    module: str
    target: str
    line: int

    def __str__(self) -> str:
        return f"{self.module} (line {self.line}) imports {self.target}"


def module_name(path: Path, root: Path) -> str:
    """``riskserve/serving/flow.py`` -> ``riskserve.serving.flow``; a package's ``__init__``: the package."""
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def read_sources(root: Path = ROOT) -> dict[str, str]:
    """Module name -> source of every module under ``root`` (generated protobuf code included)."""
    return {module_name(path, root): path.read_text() for path in sorted(root.rglob("*.py"))}


def _resolve(name: str, modules: Mapping[str, object]) -> str | None:
    """The deepest known module ``name`` refers to (``a.b.C`` -> ``a.b`` when ``C`` is a class)."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(sources: Mapping[str, str], top: str = "riskserve") -> Iterator[Import]:
    """Every import of a module of ``top`` by a module of ``sources``, wherever it is in the file."""
    for module, source in sources.items():
        is_package = module == top or _is_package(module, sources)
        package = module if is_package else module.rpartition(".")[0]
        for node in ast.walk(ast.parse(source, filename=module)):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*anchor, base] if base else anchor)
                names = [f"{base}.{alias.name}" for alias in node.names]
            for name in names:
                if name != top and not name.startswith(f"{top}."):
                    continue
                target = _resolve(name, sources)
                if target is not None and target != module:
                    yield Import(module, target, node.lineno)


def _is_package(module: str, sources: Mapping[str, str]) -> bool:
    return any(other.startswith(f"{module}.") for other in sources)


def package_of(module: str) -> str:
    """The layer of a module: ``riskserve.serving.flow`` -> ``serving``, ``riskserve.cli`` -> ``cli``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def layer_violations(imports: list[Import]) -> list[str]:
    """Each import from a package into one ARCHITECTURE.md does not allow it to use."""
    problems = []
    for found in imports:
        source, target = package_of(found.module), package_of(found.target)
        if source == target or target == "riskserve":
            continue
        allowed = ALLOWED.get(source)
        if allowed is None:
            problems.append(
                f"{found}: package '{source}' has no layer in ARCHITECTURE.md (add it to ALLOWED)"
            )
        elif target not in allowed:
            may = f"only {', '.join(sorted(allowed))}" if allowed else "nothing of riskserve"
            problems.append(f"{found}: '{source}' may import {may}")
    return problems


def circles(imports: list[Import]) -> list[list[Import]]:
    """One import circle per strongly connected group of modules (Tarjan), as the imports that close it."""
    graph: dict[str, dict[str, Import]] = {}
    for found in imports:
        graph.setdefault(found.module, {}).setdefault(found.target, found)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.add(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(group)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return [_cycle_in(graph, group) for group in groups]


def _cycle_in(graph: Mapping[str, Mapping[str, Import]], group: set[str]) -> list[Import]:
    """One concrete circle through a strongly connected group: follow edges inside it until one repeats."""
    start = min(group)
    path = [start]
    while True:
        nxt = min(target for target in graph[path[-1]] if target in group)
        if nxt in path:
            cycle = [*path[path.index(nxt) :], nxt]
            return [graph[a][b] for a, b in itertools.pairwise(cycle)]
        path.append(nxt)


def _report(what: str, problems: list[str]) -> str:
    return f"{len(problems)} {what} (see ARCHITECTURE.md):\n  " + "\n  ".join(problems)


def test_no_module_imports_upward() -> None:
    problems = layer_violations(list(imports_of(read_sources())))
    assert not problems, _report("import(s) break the layer rules", problems)


def test_no_import_circles() -> None:
    found = circles(list(imports_of(read_sources())))
    problems = [" -> ".join(str(step) for step in cycle) for cycle in found]
    assert not problems, _report("import circle(s)", problems)


def test_every_package_has_a_layer() -> None:
    packages = {package_of(module) for module in read_sources()} - {"riskserve"}
    assert packages <= set(ALLOWED), f"packages without a layer in ARCHITECTURE.md: {packages - set(ALLOWED)}"


_SYNTHETIC = {
    "riskserve": "",
    "riskserve.platform": "",
    "riskserve.platform.host": "def f():\n    from riskserve.wrappers.thing import Thing\n",
    "riskserve.wrappers": "",
    "riskserve.wrappers.thing": "from riskserve.platform import host\nThing = 1\n",
    "riskserve.schema": "",
    "riskserve.schema.a": "from riskserve.schema.b import B\nA = 1\n",
    "riskserve.schema.b": (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import A\nB = 1\n"
    ),
}


def test_the_checks_catch_a_lazy_upward_import_and_a_type_checking_circle() -> None:
    """The checker itself: a function-level upward import and a circle closed under TYPE_CHECKING
    (a relative import at that) are both reported, naming module, line and target."""
    imports = list(imports_of(_SYNTHETIC))
    assert layer_violations(imports) == [
        "riskserve.platform.host (line 2) imports riskserve.wrappers.thing: "
        "'platform' may import nothing of riskserve"
    ]
    found = circles(imports)
    modules = sorted({step.module for cycle in found for step in cycle})
    assert modules == ["riskserve.platform.host", "riskserve.schema.a", "riskserve.schema.b",
                       "riskserve.wrappers.thing"]  # fmt: skip
    closing = "riskserve.schema.b (line 3) imports riskserve.schema.a"
    assert any(str(step) == closing for cycle in found for step in cycle)


@pytest.mark.parametrize("module", ["riskserve.serving.flow", "riskserve.cli", "riskserve.platform.runner"])
def test_real_modules_are_read(module: str) -> None:
    """The walk sees the real tree (a wrong root would make every check above pass vacuously)."""
    imports = [found for found in imports_of(read_sources()) if found.module == module]
    assert imports, f"no riskserve imports found in {module}"


def test_the_schema_loads_and_checks_a_pipeline_without_importing_ray() -> None:
    """What a pipeline is stays pure data and checks: loading the shipped YAMLs imports no Ray."""
    import subprocess
    import sys

    code = (
        "import sys; from pathlib import Path; from riskserve.schema.pipeline import load_pipeline; "
        "from riskserve.schema.pools import check_pools; "
        "specs = [load_pipeline(p) for p in sorted(Path('deploy/pipelines').glob('*.yaml'))]; "
        "check_pools(specs); print(len(specs), 'ray' in sys.modules)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
        cwd=ROOT.parent,
    )  # fmt: skip
    assert done.stdout.split() == ["2", "False"]
