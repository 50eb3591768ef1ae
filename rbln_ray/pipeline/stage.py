"""Running one pipeline stage's compiled graphs on this process's devices.

``StageModel`` owns one stage's runtimes (a prefill graph and one decode graph per compiled
decoder batch size, all sharing the stage's static KV buffers) and exposes them with the same
interface as an optimum-rbln model (``prefill_decoder(...)`` and ``decoders[bs](...)``
returning ``.logits``), so the unchanged
:class:`~rbln_ray.vllm_plugin.model_runner.RBLNModelRunner` drives every pipeline rank: the
first feeds it token ids, later ranks the previous rank's hidden states (moved rank to rank
by Ray, see ``RBLNRayExecutor``), and ``.logits`` holds this stage's output (hidden states,
or logits on the last stage).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
import torch.nn.functional as F

from rbln_ray.compile.pipeline_manifest import PipelineManifest, StageSpec
from rbln_ray.upstream import rebel_internals

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepPlan:
    """What every stage needs besides its input tensor, for one scheduler step."""

    kind: str  # "prefill" | "decode"
    cache_position: torch.Tensor  # prefill [1, L]; decode [bs, 1]
    block_tables: torch.Tensor  # prefill [nblk]; decode [bs, nblk]
    query_length: int = 1  # prefill: valid tokens (before chunk padding)


class StageModel:
    """One stage's runtimes on ``device_ids`` (indices into this process's visible devices)."""

    def __init__(self, directory: Path, manifest: PipelineManifest, spec: StageSpec, device):
        import rebel

        self.manifest = manifest
        self.spec = spec
        stage_dir = Path(directory) / spec.subdir
        kwargs = {"tensor_type": "pt", "device": device}
        self.prefill_rt = rebel.Runtime(
            rebel.RBLNCompiledModel(stage_dir / "prefill.rbln"), **kwargs
        )
        self.decode_rts = {
            bs: rebel.Runtime(
                rebel.RBLNCompiledModel(stage_dir / f"decoder_batch_{bs}.rbln"), **kwargs
            )
            for bs in manifest.decoder_batch_sizes
        }
        self.device_seconds = 0.0
        self.decoders = _Decoders(self)
        logger.info(
            "pipeline stage %d (layers %d-%d) loaded on device %s",
            spec.index,
            spec.layer_start,
            spec.layer_end - 1,
            device,
        )

    @classmethod
    def load(cls, directory: str | Path, stage: int, device_ids: Sequence[int]) -> StageModel:
        manifest = PipelineManifest.load(directory)
        device: int | list[int] = device_ids[0] if len(device_ids) == 1 else list(device_ids)
        return cls(Path(directory), manifest, manifest.stages[stage], device)

    def copy_kv_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """On-device KV copies for this stage's layers (its runtimes share one load)."""
        for src, dst, tokens in copies:
            rebel_internals.copy_kv_cache(self.prefill_rt, src, dst, tokens)

    def prefill_decoder(self, input_ids, cache_position, block_tables, **_: Any):
        """optimum's prefill call: ``input_ids`` are token ids on the first stage, hidden
        states (padded to whole chunks by the previous stage) on later ones."""
        plan = StepPlan("prefill", cache_position, block_tables, int(cache_position.shape[1]))
        return SimpleNamespace(logits=self.run(plan, input_ids))

    def run(self, plan: StepPlan, x: torch.Tensor) -> torch.Tensor:
        """Stage forward: token ids (stage 0) or hidden states in; hidden states or, on the
        last stage, logits (``[1, 1, V]`` prefill, ``[bs, 1, V]`` decode) out."""
        start = time.perf_counter()
        try:
            if plan.kind == "prefill":
                return self._prefill(plan, x)
            return self.decode_rts[x.shape[0]](x, plan.cache_position, plan.block_tables)
        finally:
            self.device_seconds += time.perf_counter() - start

    def _prefill(self, plan: StepPlan, x: torch.Tensor) -> torch.Tensor:
        """Chunked exactly like optimum's ``prefill_forward``: pad to whole chunks (padding
        positions 0), run the chunks in order; the last stage keeps the last chunk's logits,
        selected at the last valid token by ``query_position``."""
        chunk = self.manifest.prefill_chunk_size
        length = plan.query_length
        padding = (chunk - length) % chunk
        cache_position = F.pad(plan.cache_position, (0, padding))
        if self.spec.has_embedding and x.shape[1] < length + padding:
            x = F.pad(x, (0, padding))
        outs = []
        for step in range(0, length, chunk):
            s, e = step, step + chunk
            args = [x[:, s:e], cache_position[:, s:e], plan.block_tables]
            if self.spec.has_lm_head:
                q = (length - 1) % chunk if e >= length else chunk - 1
                args.append(torch.tensor(q, dtype=torch.int16))
            outs.append(self.prefill_rt(*args))
        if self.spec.has_lm_head:
            return outs[-1]
        return torch.cat(outs, dim=1)


class _Decoders:
    """``model.decoders[bs](...)``, as optimum-rbln models expose it."""

    def __init__(self, stage: StageModel) -> None:
        self._stage = stage

    def __getitem__(self, bs: int):
        def call(input_ids, cache_position, block_tables, attention_mask=None, **_: Any):
            if attention_mask is not None:
                raise NotImplementedError("pipeline stages are compiled without attention masks")
            plan = StepPlan("decode", cache_position, block_tables)
            return SimpleNamespace(logits=self._stage.run(plan, input_ids))

        return call
