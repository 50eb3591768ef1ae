"""vLLM worker for one pipeline stage (one Ray actor per stage, see RBLNRayExecutor).

Design: stage 0's worker is the *coordinator*. It keeps vLLM's request state, builds each
step's inputs and samples on the host with the unchanged ``RBLNModelRunner``, whose "model"
is a :class:`~rbln_ray.pipeline.stage.PipelineModel` that runs stage 0 locally and chains
stages 1..S-1 through Ray refs. Why stage 0 and not the last stage: stage 0 needs the token
ids anyway (it embeds them), so request state, sampling and the next step's inputs stay in
one process and only hidden states and the final logits cross stage boundaries; the engine
process (the driver) sends one step to one worker, as with S = 1. Stages 1..S-1 are
stateless between steps apart from their KV buffers: they only run ``run_stage``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from rbln_ray.pipeline.stage import PipelineModel, StageModel, StepPlan
from rbln_ray.vllm_plugin.model_runner import RBLNModelRunner
from rbln_ray.vllm_plugin.worker import RBLNWorker

logger = logging.getLogger(__name__)


class PipelineWorker(RBLNWorker):
    """Loads stage ``rank`` of a staged artifact; rank 0 also drives vLLM steps."""

    stage: StageModel
    pipeline: PipelineModel | None = None

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        from rbln_ray.emulator import ensure_runtime

        if ensure_runtime() == "none":
            raise RuntimeError("no RBLN runtime in this process (set RBLN_RAY_DEVICE=emulated?)")
        self.stage = StageModel.load(self.artifact.path, self.rank, self.device_ids)
        if self.rank == 0:
            self.pipeline = PipelineModel(self.stage)
            self.model_runner = RBLNModelRunner(
                self.vllm_config, self.artifact, self.pipeline, self.layout
            )

    def set_pipeline_peers(self, peers: list[Any]) -> None:
        """Actor handles of stages 1..S-1 (executor calls this on stage 0 after loading)."""
        if self.pipeline is None:
            raise RuntimeError(f"stage {self.rank} is not the coordinating stage")
        self.pipeline.peers = list(peers)
        logger.info("pipeline stage 0 chained to %d peer stage(s)", len(peers))

    def copy_kv_blocks(self, copies: list[tuple[int, int, int]]) -> None:
        """This stage's share of a prefix-cache KV copy (called by stage 0 through Ray)."""
        self.stage.copy_kv_blocks(copies)

    def run_stage(self, plan: StepPlan, x: torch.Tensor) -> torch.Tensor:
        """One step's forward through this stage (called by stage 0 through Ray)."""
        return self.stage.run(plan, x)

    def step_stats(self) -> dict:
        if self.rank == 0:
            return {**super().step_stats(), "stage_device_seconds": self.stage.device_seconds}
        return {"stage": self.rank, "stage_device_seconds": self.stage.device_seconds}

    def device_info(self) -> dict:
        spec = self.stage.spec
        return {
            **super().device_info(),
            "stage": spec.index,
            "layers": [spec.layer_start, spec.layer_end],
        }

    def shutdown(self) -> None:
        self.pipeline = None
        self.stage = None  # type: ignore[assignment]
        super().shutdown()
