"""The emulator loads a compiled file (a pickle) only if it can trust it: owner, modes of the
file and its directory, and the digest written beside it at save time."""

from __future__ import annotations

import os

import pytest

from rbln_ray.emulator.trusted_files import (
    UntrustedArtifactError,
    digest_path,
    opened_trusted,
    write_digest,
)


def check_trusted(path) -> None:
    with opened_trusted(path):
        pass


@pytest.fixture
def artifact(tmp_path):
    folder = tmp_path / "compiled"
    folder.mkdir(mode=0o755)
    path = folder / "prefill.rbln"
    path.write_bytes(b"a pickle, for all the loader knows")
    path.chmod(0o644)
    write_digest(path)
    return path


def test_a_file_the_emulator_saved_is_trusted(artifact) -> None:
    check_trusted(artifact)


def test_an_altered_or_unrecorded_file_is_refused(artifact) -> None:
    with artifact.open("ab") as f:
        f.write(b" and then some")
    with pytest.raises(UntrustedArtifactError, match="does not match its recorded digest"):
        check_trusted(artifact)
    digest_path(artifact).unlink()
    with pytest.raises(UntrustedArtifactError, match="has no digest"):
        check_trusted(artifact)


@pytest.mark.parametrize("target", ["file", "directory"])
def test_a_file_others_may_write_is_refused(artifact, target: str) -> None:
    where = artifact if target == "file" else artifact.parent
    os.chmod(where, 0o777 if target == "directory" else 0o666)
    with pytest.raises(UntrustedArtifactError, match="writable by other users"):
        check_trusted(artifact)


def test_the_file_loaded_is_the_file_checked(artifact) -> None:
    """Once checked, the path the loader gets names the checked file, even if the artifact's
    path is made to name another file before the load (no time-of-check/time-of-use gap)."""
    with opened_trusted(artifact) as checked:
        swapped = artifact.with_name("evil.rbln")
        swapped.write_bytes(b"code the owner never compiled")
        os.replace(swapped, artifact)  # the path now names another file
        with open(checked, "rb") as f:
            assert f.read() == b"a pickle, for all the loader knows"


def test_a_symbolic_link_is_refused(artifact) -> None:
    link = artifact.with_name("link.rbln")
    link.symlink_to(artifact)
    write_digest(artifact)
    digest_path(artifact).rename(digest_path(link))
    with pytest.raises(UntrustedArtifactError, match="symbolic link"):
        check_trusted(link)
