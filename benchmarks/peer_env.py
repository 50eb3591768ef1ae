"""Running processes in the vllm-rbln side environment (``make peer-env``).

Why: Rebellions' vllm-rbln 0.12.0 and rbln-ray both register a vLLM platform plugin named
``rbln``, so vllm-rbln lives in its own venv (``.venv-vllm-rbln``, built by
``scripts/peer_env.sh``) where rbln-ray is not installed. The emulator reaches it only
through ``PYTHONPATH`` (a directory holding a link to the ``rbln_ray`` package, plus the
``rebel`` import shim) with ``RBLN_RAY_DEVICE=emulated``; vllm-rbln itself runs unmodified.

Environment:

=========================  ====================================  ==========================
``RBLN_RAY_PEER_VENV``     ``<repo>/.venv-vllm-rbln``            the side environment
=========================  ====================================  ==========================
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV_ENV = "RBLN_RAY_PEER_VENV"
SHIM = ROOT / "rbln_ray" / "emulator" / "_shim"
# Variables of the calling (project) environment a side-env process must not inherit.
_DROP = ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", "VLLM_PLUGINS")


def peer_venv() -> Path:
    return Path(os.environ.get(VENV_ENV) or ROOT / ".venv-vllm-rbln")


def peer_python() -> Path:
    """The side environment's interpreter, or an error saying how to build it."""
    python = peer_venv() / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(
            f"no vllm-rbln side environment at {peer_venv()} ({VENV_ENV}); build it with "
            "`make peer-env` (part of `make setup`)"
        )
    return python


def peer_site_packages() -> Path:
    """Where vllm-rbln and its optimum-rbln are installed in the side environment."""
    return next((peer_venv() / "lib").glob("python3*/site-packages"))


def peer_env(**extra: str) -> dict[str, str]:
    """Environment for a side-env process: the emulator on ``PYTHONPATH``, nothing else."""
    env = {k: v for k, v in os.environ.items() if k not in _DROP}
    env.update(
        # The side env's directory holding only a link to the `rbln_ray` package: the repo
        # root itself holds `rbln_ray.egg-info`, which would expose rbln-ray's plugin there.
        PYTHONPATH=os.pathsep.join([str(peer_venv() / "rbln-ray-path"), str(SHIM)]),
        RBLN_RAY_DEVICE="emulated",
        OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
        TOKENIZERS_PARALLELISM="false",
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env
