"""vLLM worker for one pipeline stage: one vLLM pipeline-parallel rank, one Ray actor.

Every rank keeps vLLM's request state, builds each step's inputs (positions, block tables,
padding rows: the same on every rank, since they follow from the scheduler output alone) and
runs its own layers with the unchanged ``RBLNModelRunner`` over a
:class:`~rbln_ray.pipeline.stage.StageModel`. The first rank embeds token ids, every later one
takes the previous rank's hidden states, and the last one samples; ranks before the last
learn the sampled tokens from the next scheduler output (vLLM's pipeline-parallel contract).
Each rank hands the step and its hidden states straight to the next rank's actor, so they
move worker to worker, never through vLLM's engine process, and vLLM's batch queue keeps one
micro-batch in every stage.
"""

from __future__ import annotations

import logging
import pickle
from typing import Any

import numpy as np
import torch
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput

from rbln_ray.pipeline.stage import StageModel
from rbln_ray.vllm_plugin.model_runner import RBLNModelRunner
from rbln_ray.vllm_plugin.worker import RBLNWorker

logger = logging.getLogger(__name__)


class PipelineWorker(RBLNWorker):
    """Loads stage ``rank`` of a staged artifact and runs it as pipeline rank ``rank``."""

    stage: StageModel
    next_stage: Any = None  # the Ray actor of rank + 1 (None on the last rank)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        from rbln_ray.emulator import require_runtime

        require_runtime("load a pipeline stage")
        self.stage = StageModel.load(self.artifact.path, self.rank, self.device_ids)
        self.model_runner = RBLNModelRunner(
            self.vllm_config,
            self.artifact,
            self.stage,
            self.layout,
            first_stage=self.rank == 0,
            last_stage=self.rank == self.artifact.num_stages - 1,
        )

    def set_next_stage(self, actor: Any) -> None:
        """The successor rank's actor (the executor wires every rank to the next)."""
        self.next_stage = actor

    def execute_stage(  # type: ignore[override]
        self,
        step: bytes,
        grammar_output: GrammarOutput | None,
        hidden: np.ndarray | None = None,
    ) -> Any:
        """This rank's share of one step, then the step goes to the next rank directly: the
        returned ref resolves to the last rank's output. Returning at once (not waiting for
        the next rank) frees this stage for the next micro-batch.

        The step arrives pickled once by the executor and is forwarded as the same bytes;
        hidden states travel as numpy arrays, which Ray serialises without pickling (a torch
        tensor goes through ``torch.save``). Re-serialising both at every boundary was, when
        measured, half of a rank's host time per step.
        """
        scheduler_output: SchedulerOutput = pickle.loads(step)  # from our own executor
        x = None if hidden is None else torch.from_numpy(hidden.copy())
        output = super().execute_stage(scheduler_output, grammar_output, x)
        if self.next_stage is None:
            return output
        out = None if output is None else output.numpy()
        return self.next_stage.execute_method.remote("execute_stage", step, grammar_output, out)

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
