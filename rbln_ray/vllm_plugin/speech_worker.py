"""RBLN speech worker: :class:`~rbln_ray.vllm_plugin.worker.RBLNWorker` for a compiled
speech encoder-decoder (Whisper).

What differs from a decoder's worker: vLLM's blocks are the compiled self-attention blocks
themselves (one whole sequence each, ``batch_size`` of them plus vLLM's null block, so a
block id names a decoder row, :mod:`.speech_runner`), the cross-attention KV lives in the
compiled static buffer (vLLM is told of no cross-attention layer), and the model serves
transcription only (as vLLM's own runner reports for Whisper).
"""

from __future__ import annotations

from rbln_ray.compile.speech import SpeechArtifact
from rbln_ray.vllm_plugin.loader import load_compiled_model
from rbln_ray.vllm_plugin.platform import compiled_model
from rbln_ray.vllm_plugin.speech_runner import RBLNSpeechRunner
from rbln_ray.vllm_plugin.worker import RBLNWorker


class RBLNSpeechWorker(RBLNWorker):
    """Loads the compiled speech model on this process's RBLN devices and runs steps."""

    artifact: SpeechArtifact  # type: ignore[assignment]
    model_runner: RBLNSpeechRunner  # type: ignore[assignment]

    def _resolve_artifact(self) -> None:
        art = compiled_model(self.vllm_config)
        if not isinstance(art, SpeechArtifact):
            raise RuntimeError(f"the speech worker was given {art.path}, not a speech model")
        self.artifact = art

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        model = load_compiled_model(self.artifact, self.device_ids)
        self.model_runner = RBLNSpeechRunner(self.vllm_config, self.artifact, model)

    @property
    def prepare_ahead(self) -> None:
        """A step's inputs need the previous step's tokens: nothing to build ahead."""
        return None

    def _kv_blocks(self) -> tuple[int, int, str]:
        rows = self.artifact.batch_size
        held = f"the compiled speech model has {rows} rows"
        return self.artifact.kvcache_block_size, rows, held

    def get_supported_tasks(self) -> tuple[str, ...]:
        return ("transcription",)
