"""Which ``.rbln`` files the emulator agrees to load.

Why: an emulated compiled model is a ``torch.save`` pickle of the traced module, loaded with
``weights_only=False``, so loading a file runs whatever code its writer put in it. On a host
shared with other users a file they can write (a world-writable cache, a directory someone
else owns) would be code execution in the serving process. So a file is loaded only if this
user (or root) owns it and no other user may write it or its directory; and it must match the
SHA-256 digest the emulator wrote next to it when it saved the file (a truncated or altered
file is refused before it is unpickled).

Why the file is checked and loaded through one open descriptor (:func:`opened_trusted`): a
check by path followed by a load by path leaves a gap in which the path can be made to name
another file (a rename or a symlink swapped in). The file is opened once, without following
a symlink; its owner and mode are read from that descriptor, its digest is computed from it,
and the loader opens ``/proc/self/fd/N``, which is that same open file whatever its path
names by then.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import stat
from collections.abc import Iterator
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


def _check_owner_and_mode(path: Path, info: os.stat_result | None = None) -> None:
    info = path.stat() if info is None else info
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


def _fd_digest(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    for chunk in iter(lambda: os.read(fd, 1 << 20), b""):
        h.update(chunk)
    os.lseek(fd, 0, os.SEEK_SET)
    return h.hexdigest()


def _open_nofollow(path: Path) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if os.path.islink(path):
            raise UntrustedArtifactError(f"{path} is a symbolic link: refused") from exc
        raise


@contextlib.contextmanager
def opened_trusted(path: str | os.PathLike[str]) -> Iterator[str]:
    """A path that names ``path``'s file as it was checked (``/proc/self/fd/N`` of the one
    descriptor the checks read), while the context is open; raises
    :class:`UntrustedArtifactError` unless it may be unpickled (module docstring)."""
    path = Path(path)
    _check_owner_and_mode(path.parent)
    fd = _open_nofollow(path)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UntrustedArtifactError(f"{path} is not a regular file")
        _check_owner_and_mode(path, info)
        recorded = digest_path(path)
        if not recorded.is_file():
            raise UntrustedArtifactError(
                f"{path} has no digest ({recorded.name}): it was not written by this "
                "emulator's compile (or predates digests); compile it again"
            )
        digest_fd = _open_nofollow(recorded)
        try:
            _check_owner_and_mode(recorded, os.fstat(digest_fd))
            expected = os.read(digest_fd, 1024).decode(errors="replace").strip()
        finally:
            os.close(digest_fd)
        if expected != _fd_digest(fd):
            raise UntrustedArtifactError(f"{path} does not match its recorded digest: altered")
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)
