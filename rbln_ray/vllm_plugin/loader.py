"""Model loading: compiled directory → optimum-rbln model on the pinned RBLN devices.

An uncompiled Hugging Face directory is compiled on first use into a cache keyed by a hash
of its contents, the compile settings and the target NPU (an ATOM artifact does not run on
REBEL), then reused, so a restart never recompiles.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rbln_ray.models.tokenizer import atomic_dir, cache_dir
from rbln_ray.models.zoo import UnsupportedModelError, family_for_dir
from rbln_ray.vllm_plugin.artifact import CompiledArtifact, is_compiled_dir

logger = logging.getLogger(__name__)

# The families rbln-ray serves live in rbln_ray.models.zoo (one table for the loader, the
# CLI and the README's support matrix).
__all__ = ["CompileSettings", "UnsupportedModelError", "check_architecture"]


@dataclass(frozen=True)
class CompileSettings:
    """How an HF directory is compiled when no compiled artifact is given."""

    batch_size: int = 4
    max_seq_len: int | None = None  # default: the model's max_position_embeddings (≤ 4096)
    attn_impl: str = "eager"
    kvcache_partition_len: int | None = None
    num_devices: int = 1
    use_attention_mask: bool = False
    decoder_batch_sizes: tuple[int, ...] | None = None  # default: optimum's ([batch_size])
    # default: optimum's (eager: one block per sequence; flash: as many as DRAM holds)
    kvcache_num_blocks: int | None = None

    def __post_init__(self) -> None:
        if self.attn_impl not in ("eager", "flash_attn"):
            raise ValueError(f"attn_impl must be 'eager' or 'flash_attn', not {self.attn_impl!r}")
        if self.batch_size < 1 or self.num_devices < 1:
            raise ValueError("batch_size and num_devices must be >= 1")

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> CompileSettings:
        raw = dict(raw or {})
        unknown = set(raw) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown RBLN compile settings {sorted(unknown)}; "
                f"known: {sorted(cls.__dataclass_fields__)}"
            )
        if raw.get("decoder_batch_sizes") is not None:
            raw["decoder_batch_sizes"] = tuple(raw["decoder_batch_sizes"])
        return cls(**raw)


def check_architecture(hf_config_path: Path) -> str:
    """Return the model's architecture or raise naming the supported ones (see the zoo)."""
    return family_for_dir(Path(hf_config_path).parent).architecture


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


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock so two engines never compile the same artifact at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


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
    if is_compiled_dir(model_dir):
        check_architecture(model_dir / "config.json")
        return model_dir
    check_architecture(model_dir / "config.json")
    settings = settings or CompileSettings()
    if settings.max_seq_len is None:
        hf = json.loads((model_dir / "config.json").read_text())
        settings = CompileSettings(
            **{
                **asdict(settings),
                "max_seq_len": min(hf.get("max_position_embeddings", 4096), 4096),
            }
        )
    key = hashlib.sha256(
        (
            content_hash(model_dir) + json.dumps(asdict(settings), sort_keys=True) + target_npu()
        ).encode()
    ).hexdigest()[:16]
    out = cache_dir() / "compiled" / f"{model_dir.name}-{key}"
    with _file_lock(out.with_name(out.name + ".lock")):
        if is_compiled_dir(out):
            logger.info("using cached compiled model %s", out)
            return out
        from rbln_ray.models.compile import compile_model

        logger.info(
            "compiling %s for RBLN (%s) into %s; this runs once per model and settings",
            model_dir,
            settings,
            out,
        )
        started = time.monotonic()
        with atomic_dir(out) as tmp:
            compile_model(
                model_dir,
                tmp,
                batch_size=settings.batch_size,
                max_seq_len=settings.max_seq_len,
                attn_impl=settings.attn_impl,
                kvcache_partition_len=settings.kvcache_partition_len,
                num_devices=settings.num_devices,
                use_attention_mask=settings.use_attention_mask,
                decoder_batch_sizes=settings.decoder_batch_sizes,
                **(
                    {"kvcache_num_blocks": settings.kvcache_num_blocks}
                    if settings.kvcache_num_blocks is not None
                    else {}
                ),
            )
        logger.info("compiled %s in %.1f s", out.name, time.monotonic() - started)
    return out


def load_compiled_model(artifact: CompiledArtifact, device_ids: Sequence[int]) -> Any:
    """Load the optimum-rbln model with runtimes on ``device_ids`` (visible-device indices)."""
    from rbln_ray.emulator import ensure_runtime

    if ensure_runtime() == "none":
        raise RuntimeError(
            "no RBLN runtime in this process: install rebel-compiler (ATOM host) or set "
            "RBLN_RAY_DEVICE=emulated"
        )
    from optimum.rbln import RBLNAutoModelForCausalLM

    device: int | list[int] = device_ids[0] if len(device_ids) == 1 else list(device_ids)
    logger.info("loading %s on RBLN device(s) %s", artifact.path, device)
    return RBLNAutoModelForCausalLM.from_pretrained(
        str(artifact.path), export=False, rbln_device=device
    )
