"""Which RBLN runtime the CLI uses: the real ``rebel`` when present, else the emulator."""

from __future__ import annotations

import logging

logger = logging.getLogger("rbln_ray.cli")


def choose_runtime() -> str:
    """Apply ``RBLN_RAY_DEVICE`` (default for the CLI: emulated when no real runtime exists)."""
    from rbln_ray.common import envs
    from rbln_ray.emulator import ensure_runtime, real_rebel_spec

    if not envs.is_set("RBLN_RAY_DEVICE") and real_rebel_spec() is None:
        envs.export("RBLN_RAY_DEVICE", "emulated")
        logger.info(
            "no RBLN runtime (rebel-compiler) found: using emulated ATOM devices "
            "(set RBLN_RAY_DEVICE=rbln to require real hardware)"
        )
    return ensure_runtime()
