"""Qwen3.5 on RBLN: Qwen3-VL's tower (:mod:`.qwen3_vl`, without deepstack) before a hybrid
language model whose layers are mostly linear attention (gated delta nets) with a few full
attention layers.

What differs from the Qwen families before it, and why:

* **State slots.** A linear-attention layer carries a convolution state and a recurrent state
  per sequence instead of KV blocks. optimum-rbln 0.12 compiles them as static buffers of one
  row per compiled batch slot: a prefill writes the row its ``batch_idx`` names, and the
  decode graph runs the full compiled batch, reading and writing row i for device row i. So
  the scheduler pins a slot to each request for its life (as for sliding-window layers) and
  the runner lays every decode step out by slot (the artifact's ``state_slots``).
* **Whole prompts.** A prompt's state is built from its first token: optimum's prefill
  raises on a prefill that starts past position 0, and the state after a cached prefix is not
  kept, so chunked prefill and prefix caching are off (the record says so).
* **Compile.** Only ``attn_impl="flash_attn"``: optimum-rbln 0.12's eager attention for
  Qwen3.5 takes a prefill window's smallest cache position, which the zero padding of a
  partial last window makes 0, so a prompt longer than ``prefill_chunk_size`` is not exact;
  flash attention also needs ``kvcache_partition_len`` >= 1024 and two partitions of
  ``max_seq_len``. The decode graph is compiled for the full batch only. Both are the
  text-only family's facts (``qwen3_5_text`` in the registry), which this one compiles.
* **Emulator.** Its linear attention calls ``torch.ops.rbln.tri_recur_update``, its runtime
  orders inputs by ``Runtime._index_to_input_name`` (the graph's used inputs) and its graphs
  declare state masks after the static states; the emulator provides all three
  (:mod:`rbln_ray.emulator.runtime`, :mod:`rbln_ray.emulator.ops`).

Processor, videos, prompt embeddings (no deepstack) and M-RoPE (``Qwen3_5Model.get_rope_index``,
interleaved sections of the rotary part of the head) are Qwen3-VL's.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5Model
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.transformers_utils.configs.qwen3_5 import Qwen3_5Config

from rbln_ray.families import qwen3_vl
from rbln_ray.families.qwen_vl_base import interleaved_mrope_text
from rbln_ray.families.qwen_vl_vllm import QwenVLDummyInputs, QwenVLMultiModalProcessor
from rbln_ray.families.registry import DECODERS, VISION


# ----------------------------------------------------------------------------- runner
class Embedder(qwen3_vl.Embedder):
    """Qwen3-VL's embedder: the tower gives no deepstack features here."""

    ROPE_MODEL = Qwen3_5Model

    def _tower(self, pixels: torch.Tensor, grid: torch.Tensor) -> Any:
        return self.model.visual(pixels, grid_thw=grid.view(1, 3))


# ----------------------------------------------------------------------------- vLLM
class Qwen3_5ProcessingInfo(qwen3_vl.Qwen3VLProcessingInfo):
    # vLLM 0.30 loads qwen3_5 configs with its own class (vllm.transformers_utils.configs)
    CONFIG = Qwen3_5Config


@MULTIMODAL_REGISTRY.register_processor(
    QwenVLMultiModalProcessor, info=Qwen3_5ProcessingInfo, dummy_inputs=QwenVLDummyInputs
)
class RBLNQwen3_5Declaration(qwen3_vl.RBLNQwen3VLDeclaration):
    """``Qwen3_5ForConditionalGeneration`` as vLLM's registry and front end see it on RBLN
    (vLLM 0.30's own ``qwen3_5`` imports torchvision through ``qwen2_vl``)."""

    EMBEDDER = Embedder


# ----------------------------------------------------------------------------- family code
class Qwen3_5(qwen3_vl.Qwen3VL):
    Embedder = Embedder

    def compile_settings(self, settings: Any) -> Any:
        """The language model's settings as its text-only family compiles them (flash
        attention only, decode graphs of the full batch)."""
        return DECODERS[VISION["qwen3_5"].language_family].compile_settings(settings)

    def tiny_model(self, spec: Any, tokenizer: Any) -> tuple[Any, Any]:
        """Qwen3.5's recipe at the spec's shape: Qwen3-VL's tower without deepstack; a
        language model whose layers are linear attention (gated delta nets: a 4-tap causal
        convolution, 2 key and 4 value heads of 16) but the last, full attention with a gated
        output, rotary over a quarter of the head with interleaved M-RoPE sections."""
        import transformers

        language = spec.language
        head_dim = language.hidden_size // language.num_heads
        pairs = int(head_dim * 0.25) // 2  # rotary pairs of the partial rotary dimensions
        temporal = pairs - 2 * (pairs // 4)
        text = dict(
            interleaved_mrope_text(spec, tokenizer),
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10_000_000.0,
                "partial_rotary_factor": 0.25,
                "mrope_section": [temporal, pairs // 4, pairs // 4],
                "mrope_interleaved": True,
            },
            # optimum reads the top-level factor, transformers' rotary the rope_parameters one
            partial_rotary_factor=0.25,
            layer_types=["linear_attention"] * (language.num_layers - 1) + ["full_attention"],
            linear_conv_kernel_dim=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
        )
        vision = self.tiny_vision(spec)
        vision.pop("deepstack_visual_indexes")
        config = transformers.Qwen3_5Config(
            text_config=text,
            vision_config=vision,
            tie_word_embeddings=False,
            **self.token_ids(tokenizer),
        )
        model = transformers.Qwen3_5ForConditionalGeneration(config)
        return model, self.tiny_processor(spec, tokenizer)


CODE = Qwen3_5()
