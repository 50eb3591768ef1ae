"""Fail when a module of ``rbln_ray`` imports a package above its own layer, or when modules
import each other in a circle.

Why: the layers (docs/ARCHITECTURE.md) only stay a stack if something checks them. Every
``import`` and ``from ... import`` is counted, including those inside functions (lazy imports
are still dependencies) and relative ones; ``TYPE_CHECKING`` blocks too (a type is an
interface dependency). Packages in one layer may not import each other either. Inside a
package the layer order says nothing, so a circle of modules (``a`` imports ``b``, which
imports ``a``, perhaps lazily to dodge the import-time failure) is checked on its own: such a
pair is one job split over two files, or a dependency pointing the wrong way.

Run: ``python scripts/check_layers.py`` (``make lint`` does); exit status 1 lists violations.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

# Lowest first. A package may import packages of lower layers and its own package only.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("common",),
    ("upstream",),
    ("npu",),
    ("emulator",),
    ("families",),
    ("compile",),
    ("models",),
    ("vllm_plugin",),
    ("executor", "pipeline"),
    ("serve", "planning", "cluster"),
    ("client", "cli"),
)
RANK = {package: rank for rank, layer in enumerate(LAYERS) for package in layer}


def imported_packages(path: Path, package_parts: list[str]) -> list[tuple[int, str]]:
    """(line, top-level rbln_ray package) of every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package_parts[: len(package_parts) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            # ``from rbln_ray import serve`` / ``from . import x``: the names are modules.
            if module == "rbln_ray" or not node.module:
                names = [f"{module}.{alias.name}" for alias in node.names]
            else:
                names = [module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "rbln_ray" and len(parts) > 1:
                found.append((node.lineno, parts[1]))
    return found


def _modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file of every module of ``rbln_ray`` (a package is its
    ``__init__.py``)."""
    found = {}
    for path in sorted((root / "rbln_ray").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def imported_modules(path: Path, module: str, modules: dict[str, Path]) -> set[str]:
    """The ``rbln_ray`` modules ``path`` (module ``module``) imports: ``from pkg import name``
    counts as ``pkg.name`` when that is a module, else as ``pkg``."""

    def known(name: str) -> str:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name

    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(known(a.name) for a in node.names if a.name.startswith("rbln_ray."))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source != "rbln_ray" and not source.startswith("rbln_ray."):
                continue
            for alias in node.names:
                name = f"{source}.{alias.name}"
                found.add(name if name in modules else known(source))
    found.discard(module)
    found.discard("")
    return found


def circles(root: Path) -> list[list[str]]:
    """Every set of modules that import each other in a circle (the strongly connected
    components of the import graph with more than one module), sorted."""
    modules = _modules(root)
    graph = {m: imported_modules(p, m, modules) for m, p in modules.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Tarjan's algorithm, iterative: (module, its remaining successors)
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
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

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def violations(root: Path) -> list[str]:
    package_root = root / "rbln_ray"
    problems = []
    for path in sorted(package_root.rglob("*.py")):
        rel = path.relative_to(root)
        parts = list(rel.with_suffix("").parts)
        if len(parts) < 3:  # rbln_ray/__init__.py and top-level modules: the package facade
            continue
        own = parts[1]
        if own not in RANK:
            problems.append(f"{rel}: package {own!r} is not in any layer (scripts/check_layers.py)")
            continue
        package_parts = parts[:-1]
        for line, dep in imported_packages(path, package_parts):
            if dep == own:
                continue
            if dep not in RANK:
                problems.append(f"{rel}:{line}: imports rbln_ray.{dep}, which is in no layer")
            elif RANK[dep] >= RANK[own]:
                problems.append(
                    f"{rel}:{line}: {own} (layer {RANK[own]}) imports {dep} (layer {RANK[dep]}): "
                    "against the layer order in docs/ARCHITECTURE.md"
                )
    return problems


def main() -> int:
    root = Path(__file__).resolve().parents[1]
    problems = violations(root)
    for problem in problems:
        print(problem)
    loops = circles(root)
    for loop in loops:
        print(f"import circle: {' <-> '.join(loop)}")
    if problems:
        print(f"{len(problems)} import(s) against the layer order")
    if loops:
        print(f"{len(loops)} import circle(s) between modules")
    if problems or loops:
        return 1
    print("layer order holds; no import circles")
    return 0


if __name__ == "__main__":
    sys.exit(main())
