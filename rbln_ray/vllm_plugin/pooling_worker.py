"""RBLN pooling worker: :class:`~rbln_ray.vllm_plugin.worker.RBLNWorker` for a compiled encoder.

What differs from a decoder's worker: no KV cache at all (an empty KV spec makes vLLM treat the
model as attention-free, so it plans no blocks), the tasks come from vLLM's pooler, and a step
returns its pooled output at once (nothing to sample afterwards).
"""

from __future__ import annotations

from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from rbln_ray.compile.encoders import EncoderArtifact
from rbln_ray.vllm_plugin.loader import load_compiled_model
from rbln_ray.vllm_plugin.platform import compiled_encoder
from rbln_ray.vllm_plugin.pooling_runner import RBLNPoolingRunner
from rbln_ray.vllm_plugin.worker import RBLNWorker


class RBLNPoolingWorker(RBLNWorker):
    """Loads the compiled encoder on this process's RBLN devices and pools scheduler steps."""

    artifact: EncoderArtifact  # type: ignore[assignment]
    model_runner: RBLNPoolingRunner  # type: ignore[assignment]

    def _resolve_artifact(self) -> None:
        encoder = compiled_encoder(self.vllm_config)
        if encoder is None:
            raise RuntimeError("the pooling worker was given a decoder artifact")
        self.artifact = encoder

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        model = load_compiled_model(self.artifact, self.device_ids)
        self.model_runner = RBLNPoolingRunner(self.vllm_config, self.artifact, model)

    @property
    def prepare_ahead(self) -> None:
        """An encoder step depends on no earlier step: nothing to build ahead of it."""
        return None

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        return {}

    def determine_available_memory(self) -> int:
        return 0

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        return

    def get_supported_tasks(self) -> tuple[str, ...]:
        return self.model_runner.supported_tasks

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return EMPTY_MODEL_RUNNER_OUTPUT  # a step's output came back from execute_model
