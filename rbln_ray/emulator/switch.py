"""The ``RBLN_RAY_DEVICE`` switch: real ``rebel``, the emulator, or whatever is available.

Why: optimum-rbln does ``import rebel`` at import time, so every process that may import it
(driver, vLLM's spawned engine, Ray actors) must settle this first. ``auto`` (default) uses a
real ``rebel`` when importable and never turns the emulator on by itself; ``emulated`` turns
it on (refusing if a real ``rebel`` is already imported); ``rbln`` demands the real runtime.

Activation reaches child processes through the environment: ``activate()`` sets
``RBLN_RAY_DEVICE=emulated`` and prepends a shim directory to ``PYTHONPATH`` whose ``rebel``
package re-activates the emulator on import (only while ``RBLN_RAY_DEVICE=emulated``; in any
other mode the shim hands over to a real ``rebel`` elsewhere on ``sys.path``, or fails).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import os
import sys
from pathlib import Path
from typing import Literal

from rbln_ray.common import envs
from rbln_ray.emulator.quiet import silence_missing_compiler_warning

logger = logging.getLogger(__name__)

MODE_ENV = "RBLN_RAY_DEVICE"
MODES = ("auto", "emulated", "rbln")
SHIM_DIR = str(Path(__file__).resolve().parent / "_shim")
# Where `rbln_ray` was imported from, symlinks kept (a side environment imports it through a
# directory that links to the package alone: see benchmarks/peer_env.py).
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Mode = Literal["auto", "emulated", "rbln"]
# Submodules of the emulated package, registered under ``rebel.<name>`` too, so that
# ``import rebel.core.torch_compile`` finds the very module objects ``rebel`` holds (the
# import system would otherwise load second copies from ``rebel.__path__``).
SUBMODULES = ("compile_context", "core", "core.torch_compile")


class RuntimeSelectionError(RuntimeError):
    """The requested ``RBLN_RAY_DEVICE`` mode cannot be honoured in this process."""


def mode() -> Mode:
    value = envs.get(MODE_ENV)
    if value not in MODES:
        raise RuntimeSelectionError(f"{MODE_ENV}={value!r}; expected one of {', '.join(MODES)}")
    return value  # type: ignore[return-value]


def is_emulated() -> bool:
    """Whether ``import rebel`` in this process resolves to the emulator."""
    module = sys.modules.get("rebel")
    return bool(module is not None and getattr(module, "__rbln_ray_emulated__", False))


def real_rebel_spec() -> importlib.machinery.ModuleSpec | None:
    """Spec of a real ``rebel`` (not the emulator or its shim), imported or importable."""
    module = sys.modules.get("rebel")
    if module is not None:
        return None if getattr(module, "__rbln_ray_emulated__", False) else module.__spec__
    paths = [p for p in sys.path if os.path.abspath(p or ".") != SHIM_DIR]
    return importlib.machinery.PathFinder.find_spec("rebel", paths)


def _propagate() -> None:
    envs.export(MODE_ENV, "emulated")
    parts = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    for extra in (PROJECT_ROOT, SHIM_DIR):
        if extra not in parts:
            parts.insert(0, extra)
    os.environ["PYTHONPATH"] = os.pathsep.join(parts)


def activate(propagate: bool = True) -> None:
    """Make ``import rebel`` give the emulator in this process (and, by env, its children)."""
    if is_emulated():
        if propagate:
            _propagate()
        silence_missing_compiler_warning()
        return
    if "rebel" in sys.modules:
        spec = sys.modules["rebel"].__spec__
        raise RuntimeSelectionError(
            f"a real rebel ({spec.origin if spec else '?'}) is already imported in this "
            "process; refusing to switch it for the emulator"
        )
    from rbln_ray.emulator import rebel as emulated

    sys.modules["rebel"] = emulated
    for name in SUBMODULES:
        sys.modules[f"rebel.{name}"] = importlib.import_module(f"{emulated.__name__}.{name}")
    if propagate:
        _propagate()
    silence_missing_compiler_warning()
    logger.info("rebel emulator active (%s)", emulated.__version__)


def ensure_runtime() -> Literal["rbln", "emulated", "none"]:
    """Apply ``RBLN_RAY_DEVICE``; call before importing optimum.rbln. Returns what is in use."""
    wanted = mode()
    if wanted == "emulated":
        activate()
        return "emulated"
    if wanted == "rbln":
        if is_emulated():
            raise RuntimeSelectionError(
                f"{MODE_ENV}=rbln but the rebel emulator is already active in this process"
            )
        if real_rebel_spec() is None:
            raise RuntimeSelectionError(
                f"{MODE_ENV}=rbln but no real 'rebel' (rebel-compiler) is importable; install it "
                f"or set {MODE_ENV}=emulated to use the CPU emulator"
            )
        return "rbln"
    if is_emulated():
        return "emulated"
    return "rbln" if real_rebel_spec() is not None else "none"


def require_runtime(purpose: str) -> Literal["rbln", "emulated"]:
    """:func:`ensure_runtime`, raising when there is none: ``purpose`` says what needed it."""
    runtime = ensure_runtime()
    if runtime == "none":
        raise RuntimeSelectionError(
            f"no RBLN runtime in this process to {purpose}: install rebel-compiler (RBLN host) "
            f"or set {MODE_ENV}=emulated to use the CPU emulator"
        )
    return runtime
