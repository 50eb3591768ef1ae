"""The staged compiled directory's manifest, ``rbln_pipeline.json``.

Why a manifest of its own (and not a ``rbln_config.json``): optimum-rbln must never try to load
a staged directory as one of its models, and rbln-ray must know at a glance that the directory
holds S stage graphs. The keys that configure vLLM (``batch_size``, ``max_seq_len``,
``kvcache_block_size``, ``kvcache_num_blocks``, ``decoder_batch_sizes``, ...) are spelled
exactly as in optimum's ``rbln_config.json``, so :class:`~rbln_ray.compile.artifact.
CompiledArtifact` reads either file with the same code and the platform syncs vLLM's config
from it unchanged.

Layout of a staged directory::

    config.json, generation_config.json, tokenizer files   (copied from the HF directory)
    rbln_pipeline.json                                      (this manifest)
    stage_0/prefill.rbln, stage_0/decoder_batch_<b>.rbln    (one dir per stage)
    ...
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rbln_ray.common.artifact_files import PIPELINE_MANIFEST as MANIFEST

FORMAT = "rbln-ray-pipeline/1"


@dataclass(frozen=True)
class StageSpec:
    """One pipeline stage: which decoder layers it owns and where its graphs are."""

    index: int
    layer_start: int  # first decoder layer (inclusive)
    layer_end: int  # last decoder layer (exclusive)
    has_embedding: bool
    has_lm_head: bool
    subdir: str
    num_devices: int = 1
    input_names: tuple[str, ...] = ()  # non-KV prefill inputs, in call order
    kv_names: tuple[str, ...] = ()


@dataclass(frozen=True)
class PipelineManifest:
    """Everything needed to configure vLLM and load the stages of a staged artifact."""

    architecture: str
    num_hidden_layers: int
    hidden_size: int
    vocab_size: int
    batch_size: int
    max_seq_len: int
    kvcache_block_size: int
    kvcache_num_blocks: int
    attn_impl: str
    kvcache_partition_len: int | None
    prefill_chunk_size: int
    decoder_batch_sizes: tuple[int, ...]
    stages: tuple[StageSpec, ...]
    format: str = FORMAT
    cls_name: str = "RBLNPipelineDecoder"
    npu: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    # Sequences the KV cache holds: micro-batches x batch_size (None: batch_size).
    max_num_seqs: int | None = None

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / MANIFEST
        raw = asdict(self)
        raw["num_devices"] = self.stages[0].num_devices if self.stages else 1
        raw["num_stages"] = self.num_stages
        path.write_text(json.dumps(raw, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> PipelineManifest:
        path = Path(directory) / MANIFEST
        raw = json.loads(path.read_text())
        if raw.get("format") != FORMAT:
            raise ValueError(f"{path}: format {raw.get('format')!r}, expected {FORMAT!r}")
        raw.pop("num_devices", None)
        raw.pop("num_stages", None)
        stages = tuple(
            StageSpec(
                **{
                    **s,
                    "input_names": tuple(s.get("input_names", ())),
                    "kv_names": tuple(s.get("kv_names", ())),
                }
            )
            for s in raw.pop("stages")
        )
        raw["decoder_batch_sizes"] = tuple(raw["decoder_batch_sizes"])
        return cls(stages=stages, **raw)


def is_pipeline_dir(path: str | Path) -> bool:
    return (Path(path) / MANIFEST).is_file()


def split_layers(num_layers: int, stages: int, head_layers: float = 0.0) -> list[tuple[int, int]]:
    """Contiguous layer ranges with the slowest stage as fast as possible.

    Why by cost, not only by count: decoder layers cost the same, but the last stage also
    runs the LM head, which on large vocabularies weighs several layers (Llama-3-8B's is
    ~2.4 layers of weights), and a pipeline runs at its slowest stage's pace. ``head_layers``
    is that cost in layers; 0 splits evenly, earlier stages taking the remainder.
    """
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {stages} stages")

    def even(layers: int, parts: int) -> list[int]:
        base, extra = divmod(layers, parts)
        return [base + (1 if s < extra else 0) for s in range(parts)]

    sizes = even(num_layers, stages)
    if stages > 1 and head_layers > 0:

        def slowest(last: int) -> float:
            return max(-(-(num_layers - last) // (stages - 1)), last + head_layers)

        last = min(range(1, num_layers - stages + 2), key=lambda m: (slowest(m), -m))
        sizes = even(num_layers - last, stages - 1) + [last]
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges
