"""rbln-ray's cache directory and the atomic-directory idiom every builder uses.

Why here: compiled artifacts (loader), built test models (models), device locks (emulator)
all live under one cache root, and each is written by possibly concurrent processes.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from rbln_ray.common import envs


def cache_root() -> Path:
    """``RBLN_RAY_CACHE``, else ``$XDG_CACHE_HOME/rbln-ray`` (``~/.cache/rbln-ray``)."""
    root = envs.get("RBLN_RAY_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "rbln-ray"
    )
    return Path(root)


def cache_dir() -> Path:
    """The cache root, created if missing."""
    path = cache_root()
    path.mkdir(parents=True, exist_ok=True)
    return path


@contextlib.contextmanager
def atomic_dir(final: Path) -> Iterator[Path]:
    """Yield a temporary sibling directory and rename it to ``final`` when done.

    Concurrent builders (several test processes, Ray actors) never see a half-written
    directory; if another process won the race, its result is kept.
    """
    tmp = final.with_name(f"{final.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock on ``path``: two processes never build the same thing at once (the
    second waits, then finds the first one's result)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
