"""Which ``.rbln`` files the emulator agrees to load.

Why: an emulated compiled model is a ``torch.save`` pickle of the traced module, loaded with
``weights_only=False``, so loading a file runs whatever code its writer put in it. On a host
shared with other users a file they can write (a world-writable cache, a directory someone
else owns) would be code execution in the serving process. So a file is loaded only if this
user (or root) owns it and no other user may write it or its directory; and it must match the
SHA-256 digest the emulator wrote next to it when it saved the file (a truncated or altered
file is refused before it is unpickled).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

DIGEST_SUFFIX = ".sha256"


class UntrustedArtifactError(PermissionError):
    """A compiled file the emulator refuses to load (the message says why)."""


def digest_path(path: Path) -> Path:
    return path.with_name(path.name + DIGEST_SUFFIX)


def file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_digest(path: Path) -> None:
    """Record ``path``'s digest beside it (at save time), readable by its owner's group."""
    target = digest_path(path)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tmp.write_text(file_digest(path) + "\n")
    os.replace(tmp, target)


def _check_owner_and_mode(path: Path) -> None:
    info = path.stat()
    uid = os.getuid()
    if info.st_uid not in (uid, 0):
        raise UntrustedArtifactError(
            f"{path} is owned by uid {info.st_uid}, not by this user ({uid}) or root: the "
            "emulator loads only artifacts it can trust (they are pickles)"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UntrustedArtifactError(
            f"{path} is writable by other users (mode {stat.filemode(info.st_mode)}); "
            f"chmod go-w it to load it"
        )


def check_trusted(path: str | os.PathLike[str]) -> None:
    """Raise :class:`UntrustedArtifactError` unless ``path`` may be unpickled (module
    docstring): owner, modes of it and its directory, and its recorded digest."""
    path = Path(path)
    _check_owner_and_mode(path)
    _check_owner_and_mode(path.parent)
    recorded = digest_path(path)
    if not recorded.is_file():
        raise UntrustedArtifactError(
            f"{path} has no digest ({recorded.name}): it was not written by this emulator's "
            "compile (or predates digests); compile it again"
        )
    _check_owner_and_mode(recorded)
    if recorded.read_text().strip() != file_digest(path):
        raise UntrustedArtifactError(f"{path} does not match its recorded digest: altered")
