"""Compile on first use: an uncompiled Hugging Face directory becomes a cached artifact.

The cache is keyed by a hash of the model's files, the compile settings and the target NPU
(an ATOM artifact does not run on REBEL), so a restart never recompiles and two engines
starting at once compile once (a file lock; the loser reuses the winner's directory).
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

from rbln_ray.common.paths import atomic_dir, cache_dir, file_lock
from rbln_ray.compile import lora
from rbln_ray.compile.artifact import is_compiled_dir
from rbln_ray.compile.settings import CompileSettings
from rbln_ray.families.registry import family_for_dir

logger = logging.getLogger(__name__)

# Joins the cache key: bumped when what a compile writes changes (2: .rbln digests), so an
# old cache entry is never loaded by code that expects the new layout.
ARTIFACT_FORMAT = 2


def content_hash(model_dir: Path) -> str:
    """Hash of the files that define a model (config, weights, tokenizer), by content."""
    h = hashlib.sha256()
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.suffix in (".json", ".safetensors", ".bin", ".model", ".txt"):
            h.update(path.name.encode())
            with path.open("rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


def target_npu() -> str:
    """The NPU a compile in this process targets: what ``rebel.get_npu_name(0)`` reports
    (optimum-rbln compiles for it), ``"none"`` without a runtime."""
    from rbln_ray.emulator import ensure_runtime

    if ensure_runtime() == "none":
        return "none"
    import rebel

    return rebel.get_npu_name(0) or "unknown"


def resolve_compiled_dir(model: str | Path, settings: CompileSettings | None = None) -> Path:
    """The compiled artifact for ``model``: itself if compiled, else a cached compile of it."""
    model_dir = Path(model)
    if not model_dir.is_dir():
        raise FileNotFoundError(
            f"model {str(model)!r} is not a local directory; rbln-ray loads local compiled "
            "(or HF) directories only"
        )
    family_for_dir(model_dir)  # raises naming the supported architectures
    if is_compiled_dir(model_dir):
        return model_dir
    hf_config = json.loads((model_dir / "config.json").read_text())
    settings = (settings or CompileSettings()).with_max_seq_len(hf_config)
    keyed = settings.cache_fields()
    if settings.lora_modules:  # adapters by content, not by where they are
        keyed["lora_modules"] = lora.modules_key(settings.lora_modules)
    key = hashlib.sha256(
        (
            content_hash(model_dir)
            + json.dumps(keyed, sort_keys=True)
            + target_npu()
            + f"format-{ARTIFACT_FORMAT}"
        ).encode()
    ).hexdigest()[:16]
    out = cache_dir() / "compiled" / f"{model_dir.name}-{key}"
    with file_lock(out.with_name(out.name + ".lock")):
        if is_compiled_dir(out):
            logger.info("using cached compiled model %s", out)
            return out
        from rbln_ray.compile.family_compile import compile_directory

        logger.info(
            "compiling %s for RBLN (%s) into %s; this runs once per model and settings",
            model_dir,
            settings,
            out,
        )
        started = time.monotonic()
        with atomic_dir(out) as tmp:
            compile_directory(model_dir, tmp, settings)
            lora.relocate(tmp, out)  # the adapter copies' paths once renamed to out
        logger.info("compiled %s in %.1f s", out.name, time.monotonic() - started)
    return out
