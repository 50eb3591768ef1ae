"""How many CPU threads an emulated device computes with.

Why: in compute mode an emulated device's speed is the host CPU's, so it must not depend on
what the *host-side* software chose for its own threads. vllm-rbln 0.12.0, for instance, sets
its worker's torch threads to max(2, cpus // 2); rbln-ray's worker uses
``RBLN_RAY_EMULATOR_THREADS`` (default 1) for the whole process. With the variable set, every
emulated device call (a ``rebel.Runtime`` call, a graph compiled by ``rbln_backend``) runs
with exactly that many torch threads, whoever the caller is, and the caller's setting is
restored afterwards; unset, calls use the calling process's setting.

===============================  =========  ================================================
``RBLN_RAY_EMULATOR_THREADS``    (unset)    torch threads of one emulated device call
===============================  =========  ================================================

``torch.set_num_threads`` is process-wide: concurrent device calls from several host threads
of one process share the setting (they ask for the same number, so that is harmless).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from rbln_ray.common import envs

THREADS_ENV = "RBLN_RAY_EMULATOR_THREADS"


def wanted() -> int | None:
    """``RBLN_RAY_EMULATOR_THREADS`` (None: leave torch's thread count alone)."""
    return envs.get(THREADS_ENV)


@contextlib.contextmanager
def device_threads() -> Iterator[None]:
    """Run the enclosed device computation with ``RBLN_RAY_EMULATOR_THREADS`` threads."""
    want = wanted()
    before = torch.get_num_threads()
    if want is None or want == before:
        yield
        return
    torch.set_num_threads(want)
    try:
        yield
    finally:
        torch.set_num_threads(before)
