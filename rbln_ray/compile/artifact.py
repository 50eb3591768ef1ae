"""The compiled optimum-rbln artifact, read once from its ``rbln_config.json``.

Why: the compiled directory is the source of truth for everything shape-related (batch size,
maximum length, KV block size and count). vLLM's scheduler must be configured from it, not
from user guesses, or it would schedule work the compiled graphs cannot run.

A directory is read by one dispatch: the family registry is asked once which family it is
(:func:`rbln_ray.families.registry.artifact_family`), the record's ``artifact`` names how it
is read (:data:`READERS`), and the reader gets the record, so it asks nothing more.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rbln_ray.common.artifact_files import PIPELINE_MANIFEST, RBLN_CONFIG
from rbln_ray.compile.encoders import EncoderArtifact
from rbln_ray.compile.lora import LoRAInfo
from rbln_ray.compile.quantization import QuantSpec
from rbln_ray.compile.spec_graphs import VerifyGraph, read_manifest
from rbln_ray.compile.speech import SpeechArtifact
from rbln_ray.families.registry import (
    DECODERS,
    DecoderFamily,
    Family,
    PoolingDecoderFamily,
    VisionFamily,
    artifact_family,
)

# A staged (pipeline-parallel) directory's manifest has the same shape keys as rbln_config.json
# (see pipeline_manifest.py), so one reader serves both.


class ArtifactError(ValueError):
    """A directory is not a usable compiled optimum-rbln decoder model."""


@dataclass(frozen=True)
class CompiledArtifact:
    """What rbln-ray needs to know about a compiled decoder-only model directory."""

    path: Path
    cls_name: str
    batch_size: int
    max_seq_len: int
    kvcache_block_size: int
    kvcache_num_blocks: int
    attn_impl: str
    prefill_chunk_size: int
    decoder_batch_sizes: tuple[int, ...]
    num_devices: int
    use_attention_mask: bool
    requires_batch_sort: bool
    num_stages: int = 1  # > 1: a staged directory (pipeline_manifest), one worker per stage
    # KV cache kind (optimum's cache_impl): "static" (every layer paged over the compiled
    # blocks), "sliding_window" (every layer keeps a window in a per-sequence slot) or
    # "hybrid" (both kinds of layers; gemma2/gemma3/gpt-oss).
    cache_impl: str = "static"
    sliding_window: int | None = None
    use_position_ids: bool = False  # decode also takes position_ids and a [B, S] mask
    # The compiled prefill can start mid-prompt (a multiple of prefill_chunk_size); False for
    # families whose prefill cannot (rbln_ray.families.registry.DecoderFamily).
    prefill_resumable: bool = True
    # Sequences in flight: batch_size, or for a pipeline every micro-batch's (vLLM keeps one
    # micro-batch of up to batch_size rows in each stage).
    max_num_seqs: int = 0
    # A vision-language model (rbln_ray.families.registry.VisionFamily): its family name.
    # The fields above are then its language model's; the tower and projector are its other
    # graphs.
    vision_family: str = ""
    dtype: str = "float32"  # what the compiled graphs compute in (optimum's rbln_config dtype)
    lora: LoRAInfo | None = None  # compiled-in LoRA adapters (rbln_ray.compile.lora)
    quantization: QuantSpec | None = None  # quantized weights / KV (compile.quantization)
    # Speculative decoding's verify graphs (rbln_ray.compile.spec_graphs), if compiled.
    verify_graphs: tuple[VerifyGraph, ...] = ()
    # A decoder compiled for embeddings (rbln_ray.families.registry.PoolingDecoderFamily, e.g.
    # RBLNQwen3Model: its prefill returns every position's hidden state, it has no decode
    # graph): the family's name. "" for a causal LM.
    pooling: str = ""
    # Some layers keep a per-sequence state in one row per compiled batch slot (Qwen3.5's
    # linear attention, optimum's linear_attention_layers): a prefill names the row
    # (batch_idx) and every decode step runs the full batch, device row i on state row i.
    state_slots: bool = False

    def __post_init__(self) -> None:
        if not self.max_num_seqs:
            object.__setattr__(self, "max_num_seqs", self.batch_size)

    @property
    def uses_global_cache(self) -> bool:
        """Some layers attend over paged blocks (``block_tables`` inputs)."""
        return self.cache_impl in ("static", "hybrid")

    @property
    def uses_local_cache(self) -> bool:
        """Some layers keep a sliding window in a per-sequence slot (``local_block_tables``
        inputs: one slot of ``batch_size``, pinned to a request for its life)."""
        return self.cache_impl in ("sliding_window", "hybrid")

    @property
    def is_multimodal(self) -> bool:
        """Prompts may carry images (a compiled vision-language model)."""
        return bool(self.vision_family)

    @property
    def spec_tokens(self) -> int:
        """Draft tokens one verify call scores per sequence at every compiled decode batch
        (0: no verify graphs)."""
        widths = {}
        for g in self.verify_graphs:
            widths[g.batch] = max(widths.get(g.batch, 0), g.width)
        if not widths or set(widths) != set(self.decoder_batch_sizes):
            return 0
        return min(widths.values()) - 1

    def kv_identity(self) -> dict:
        """What makes this artifact's KV reusable by another engine: its directory, its
        config's content and every compiled graph file's size and modification time (a
        recompiled or different model never shares KV; rbln_ray.vllm_plugin.host_tier)."""
        config = self.path / RBLN_CONFIG
        graphs = sorted(self.path.rglob("*.rbln"))
        return {
            "path": str(self.path.resolve()),
            "config": config.read_text() if config.is_file() else "",
            "graphs": [(str(g.relative_to(self.path)), g.stat().st_size, g.stat().st_mtime_ns)
                       for g in graphs],  # fmt: skip
        }

    @property
    def blocks_per_seq(self) -> int:
        """Block-table width: KV blocks one sequence of ``max_seq_len`` tokens spans."""
        return -(-self.max_seq_len // self.kvcache_block_size)

    @classmethod
    def load(cls, path: str | Path, family: Family | None = None) -> CompiledArtifact:
        """The artifact of ``path``, a compiled decoder (or a vision-language model's, or a
        pooling decoder's) of ``family`` (looked up when not given)."""
        path = Path(path)
        cfg_path = config_path(path)
        if not cfg_path.is_file():
            raise ArtifactError(f"{path} has no {RBLN_CONFIG}: not a compiled optimum-rbln model")
        raw = json.loads(cfg_path.read_text())
        if family is None:
            family = artifact_family(path, raw.get("cls_name", ""))
        vision = family if isinstance(family, VisionFamily) else None
        if vision is not None:
            submodule = vision.language_submodule
            if raw.get("cls_name") != vision.config_class or (submodule and submodule not in raw):
                raise ArtifactError(
                    f"{cfg_path} was compiled as {raw.get('cls_name')!r}; "
                    f"{vision.architecture} is served from {vision.config_class}"
                )
            if submodule:  # the decoder the scheduler and runner drive (else the top level)
                raw = raw[submodule]
        if "kvcache_block_size" not in raw or "decoder_batch_sizes" not in raw:
            raise ArtifactError(
                f"{cfg_path} ({raw.get('cls_name', '?')}) is not a decoder-only causal LM artifact"
            )
        compile_cfgs = raw.get("_compile_cfgs") or [{}]
        num_devices = (
            raw.get("tensor_parallel_size")
            or raw.get("num_devices")
            or compile_cfgs[0].get("num_devices")
            or compile_cfgs[0].get("tensor_parallel_size")
            or 1
        )
        return cls(
            path=path,
            cls_name=raw.get("cls_name", ""),
            batch_size=int(raw["batch_size"]),
            max_seq_len=int(raw["max_seq_len"]),
            kvcache_block_size=int(raw["kvcache_block_size"]),
            kvcache_num_blocks=int(raw["kvcache_num_blocks"]),
            attn_impl=raw.get("attn_impl", "eager"),
            prefill_chunk_size=int(raw.get("prefill_chunk_size", 128)),
            # None for an embedder (no decode graph)
            decoder_batch_sizes=tuple(sorted(int(b) for b in raw["decoder_batch_sizes"] or ())),
            num_devices=int(num_devices),
            use_attention_mask=bool(raw.get("use_attention_mask")),
            requires_batch_sort=bool(raw.get("_requires_batch_sort")),
            num_stages=int(raw.get("num_stages", 1)),
            max_num_seqs=int(raw.get("max_num_seqs") or raw["batch_size"]),
            cache_impl=raw.get("cache_impl") or "static",
            sliding_window=raw.get("sliding_window"),
            use_position_ids=bool(raw.get("use_position_ids")),
            prefill_resumable=_prefill_resumable(family),
            vision_family=vision.name if vision is not None else "",
            dtype=raw.get("dtype") or "float32",
            lora=LoRAInfo.from_rbln_config(raw.get("lora_config")),
            quantization=QuantSpec.from_rbln_config(raw.get("quantization")),
            verify_graphs=read_manifest(path),
            pooling=family.name if isinstance(family, PoolingDecoderFamily) else "",
            state_slots=bool(raw.get("linear_attention_layers")),
        )


def _prefill_resumable(family: Family) -> bool:
    """Whether the compiled prefill can start mid-prompt: its decoder family's say (a
    vision-language model's language family, a pooling family's decoder); True for a
    language model rbln-ray serves no text-only family of."""
    decoder: Family | None = family
    if isinstance(family, VisionFamily):
        decoder = DECODERS.get(family.language_family)
    elif isinstance(family, PoolingDecoderFamily):
        decoder = DECODERS.get(family.decoder_family)
    return decoder.prefill_resumable if isinstance(decoder, DecoderFamily) else True


def config_path(path: Path) -> Path:
    """The file a compiled directory's shape is read from: a staged directory's manifest, else
    optimum's ``rbln_config.json``."""
    manifest = path / PIPELINE_MANIFEST
    return manifest if manifest.is_file() else path / RBLN_CONFIG


# How each kind of artifact (a family record's ``artifact``) is read.
READERS = {
    "decoder": CompiledArtifact.load,
    "encoder": EncoderArtifact.load,
    "speech": SpeechArtifact.load,
}


# Parsed artifacts of this process, by directory and the version of its config file: the
# platform, scheduler, executor, worker and Serve builder all ask for the same one.
_PARSED: dict[tuple[str, int], CompiledArtifact | EncoderArtifact | SpeechArtifact] = {}


def load_artifact(path: str | Path) -> CompiledArtifact | EncoderArtifact | SpeechArtifact:
    """A compiled directory's artifact, parsed once per process, as its family's record says
    (a decoder's, an encoder's or a speech model's): the registry is asked once."""
    path = Path(path)
    config = config_path(path)
    if not config.is_file():
        raise ArtifactError(f"{path} has no {RBLN_CONFIG}: not a compiled optimum-rbln model")
    key = (str(path.resolve()), config.stat().st_mtime_ns)
    art = _PARSED.get(key)
    if art is None:
        cls_name = json.loads(config.read_text()).get("cls_name", "")
        family = artifact_family(path, cls_name)
        art = READERS[family.artifact](path, family)
        _PARSED[key] = art
    return art


def is_compiled_dir(path: str | Path) -> bool:
    return (Path(path) / RBLN_CONFIG).is_file() or (Path(path) / PIPELINE_MANIFEST).is_file()
