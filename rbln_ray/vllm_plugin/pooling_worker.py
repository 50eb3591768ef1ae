"""RBLN pooling worker: :class:`~rbln_ray.vllm_plugin.worker.RBLNWorker` for a compiled encoder,
or a decoder read as an embedder or reranker.

What differs from a decoder's worker: no KV cache for vLLM to plan (an empty KV spec makes
vLLM treat the model as attention-free; a decoder's compiled KV blocks are reused by every
prompt, none kept between steps), the tasks come from vLLM's pooler, and a step returns its
pooled output at once (nothing to sample afterwards).
"""

from __future__ import annotations

from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

from rbln_ray.compile.artifact import CompiledArtifact
from rbln_ray.compile.encoders import EncoderArtifact
from rbln_ray.vllm_plugin.decoder_pooling_runner import RBLNDecoderPoolingRunner
from rbln_ray.vllm_plugin.loader import load_compiled_model
from rbln_ray.vllm_plugin.platform import compiled_model, pooling_decoder
from rbln_ray.vllm_plugin.pooling_runner import RBLNPoolingRunner
from rbln_ray.vllm_plugin.worker import RBLNWorker


class RBLNPoolingWorker(RBLNWorker):
    """Loads the compiled pooling model on this process's RBLN devices and pools scheduler
    steps."""

    artifact: EncoderArtifact | CompiledArtifact  # type: ignore[assignment]
    model_runner: RBLNPoolingRunner | RBLNDecoderPoolingRunner  # type: ignore[assignment]

    def _resolve_artifact(self) -> None:
        self.artifact = compiled_model(self.vllm_config)
        self.family = pooling_decoder(self.vllm_config)
        if isinstance(self.artifact, CompiledArtifact) and self.family is None:
            raise RuntimeError("the pooling worker was given a decoder artifact to generate with")

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        model = load_compiled_model(self.artifact, self.device_ids)
        if isinstance(self.artifact, EncoderArtifact):
            self.model_runner = RBLNPoolingRunner(self.vllm_config, self.artifact, model)
        else:
            self.model_runner = RBLNDecoderPoolingRunner(
                self.vllm_config, self.artifact, self.family, model
            )

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
