"""Fail when a module of ``rbln_ray`` imports a package above its own layer.

Why: the layers (docs/ARCHITECTURE.md) only stay a stack if something checks them. Every
``import`` and ``from ... import`` is counted, including those inside functions (lazy imports
are still dependencies) and relative ones; ``TYPE_CHECKING`` blocks too (a type is an
interface dependency). Packages in one layer may not import each other either.

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
    if problems:
        print(f"{len(problems)} import(s) against the layer order")
        return 1
    print("layer order holds")
    return 0


if __name__ == "__main__":
    sys.exit(main())
