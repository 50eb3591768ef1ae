"""Silence optimum-rbln's "requires rebel-compiler" ImportWarning under the emulator only.

Why: ``import optimum.rbln`` runs ``check_version_compats()`` (optimum-rbln 0.12.0,
``optimum/rbln/__init__.py``), which installs an ``always`` filter for ImportWarnings of
``optimum.rbln`` in front of every other filter and then warns that rebel-compiler is not
installed. Under the emulator that is expected, and it is repeated by every process that loads
a model (each worker actor, each engine), so the log fills with it. A warnings filter cannot
win (optimum inserts its own first, at import), so this wraps ``warnings.showwarning``, the
stdlib's documented hook for how warnings are shown, and drops exactly that one message.
Every other warning, and this one when the real runtime is missing without the emulator, is
shown as before.
"""

from __future__ import annotations

import warnings
from typing import Any, TextIO

MISSING_COMPILER = "optimum-rbln requires rebel-compiler to be installed."


def silence_missing_compiler_warning() -> None:
    """Install the filtering ``showwarning`` once in this process (idempotent)."""
    shown = warnings.showwarning
    if getattr(shown, "rbln_ray_quiet", False):
        return

    def showwarning(
        message: Warning | str,
        category: type[Warning],
        filename: str,
        lineno: int,
        file: TextIO | None = None,
        line: str | None = None,
    ) -> Any:
        if issubclass(category, ImportWarning) and str(message) == MISSING_COMPILER:
            return None
        return shown(message, category, filename, lineno, file, line)

    showwarning.rbln_ray_quiet = True  # type: ignore[attr-defined]
    warnings.showwarning = showwarning
