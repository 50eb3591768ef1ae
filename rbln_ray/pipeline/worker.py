"""vLLM worker for one pipeline stage: one vLLM pipeline-parallel rank, one Ray actor.

Every rank keeps vLLM's request state, builds each step's inputs (positions, block tables,
padding rows: the same on every rank, since they follow from the scheduler output alone) and
runs its own layers with the unchanged ``RBLNModelRunner`` over a
:class:`~rbln_ray.pipeline.stage.StageModel`. The first rank embeds token ids, every later one
takes the previous rank's hidden states, and the last one samples; ranks before the last
learn the sampled tokens from the next scheduler output (vLLM's pipeline-parallel contract).
``RBLNRayExecutor`` passes each rank's output to the next as a Ray object reference, so
hidden states move worker to worker, never through vLLM's engine process, and vLLM's batch
queue keeps one micro-batch in every stage.
"""

from __future__ import annotations

import logging

from rbln_ray.pipeline.stage import StageModel
from rbln_ray.vllm_plugin.model_runner import RBLNModelRunner
from rbln_ray.vllm_plugin.worker import RBLNWorker

logger = logging.getLogger(__name__)


class PipelineWorker(RBLNWorker):
    """Loads stage ``rank`` of a staged artifact and runs it as pipeline rank ``rank``."""

    stage: StageModel

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        from rbln_ray.emulator import ensure_runtime

        if ensure_runtime() == "none":
            raise RuntimeError("no RBLN runtime in this process (set RBLN_RAY_DEVICE=emulated?)")
        self.stage = StageModel.load(self.artifact.path, self.rank, self.device_ids)
        self.model_runner = RBLNModelRunner(
            self.vllm_config,
            self.artifact,
            self.stage,
            self.layout,
            first_stage=self.rank == 0,
            last_stage=self.rank == self.artifact.num_stages - 1,
        )

    def step_stats(self) -> dict:
        return {**super().step_stats(), "stage_device_seconds": self.stage.device_seconds}

    def device_info(self) -> dict:
        spec = self.stage.spec
        return {
            **super().device_info(),
            "stage": spec.index,
            "layers": [spec.layer_start, spec.layer_end],
        }

    def shutdown(self) -> None:
        self.stage = None  # type: ignore[assignment]
        super().shutdown()
