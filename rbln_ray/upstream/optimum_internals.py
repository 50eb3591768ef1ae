"""optimum-rbln 0.12 internals rbln-ray relies on: the compile-time wrapper its decoder classes
build, the converted modules inside it, and Qwen2-VL's host-side position embeddings.

Why internals: a pipeline stage compiles a slice of optimum's converted decoder (its layers
call the same ``rbln_custom_ops`` attention kernels as optimum's own graphs, so a staged model
is token-exact with an unstaged one and runs on an ATOM unchanged); optimum has no public
"compile these layers" entry, so :mod:`rbln_ray.compile.pipeline_compile` builds the wrapper
optimum would build (:func:`compile_wrapper`) and :mod:`rbln_ray.compile.stage_graph` reads the
modules named below. Qwen2-VL's graphs take M-RoPE cos/sin computed on the host by a private
method of optimum's model (:func:`qwen2_vl_position_embeddings`).
"""

from __future__ import annotations

from typing import Any

from rbln_ray.upstream.contract import Requirement, Upstream

UPSTREAM = Upstream("optimum-rbln", "optimum-rbln", "0.12.0")
DECODER = "optimum.rbln.transformers.models.decoderonly"
ARCH = f"{DECODER}.decoderonly_architecture"
PIPELINE_PY = "rbln_ray/compile/pipeline_compile.py"
STAGE_PY = "rbln_ray/compile/stage_graph.py"
QWEN2_VL_PY = "rbln_ray/families/qwen2_vl.py"
RUNNER_PY = "rbln_ray/vllm_plugin/model_runner.py"
MODELS_PY = "rbln_ray/upstream/optimum_models.py"
GENERIC = "optimum.rbln.transformers.modeling_generic"

REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement(
        f"{DECODER}.modeling_decoderonly:RBLNDecoderOnlyModelForCausalLM._wrap_model_if_needed",
        PIPELINE_PY,
        params=("model", "rbln_config"),
    ),
    Requirement(
        "optimum.rbln.modeling_base:RBLNBaseModel.prepare_rbln_config",
        PIPELINE_PY,
        params=("rbln_config",),
    ),
    Requirement(
        "optimum.rbln.modeling_base:RBLNBaseModel.update_rbln_config",
        PIPELINE_PY,
        params=("preprocessors", "model", "model_config", "rbln_config"),
    ),
    Requirement("optimum.rbln.modeling_base:normalize_contiguous_", PIPELINE_PY),
    Requirement("optimum.rbln.utils.runtime_utils:compiler_num_devices_kwarg", PIPELINE_PY),
    # what the compile swaps in for F.linear (torch_internals.rbln_linear_while_compiling)
    Requirement(
        f"{DECODER}.modeling_decoderonly:RBLNDecoderOnlyModelForCausalLM._compile_model",
        PIPELINE_PY,
        "source mentions",
        ("torch.nn.functional.linear = torch.ops.rbln_custom_ops.linear",),
    ),
    Requirement(f"{ARCH}:DecoderOnlyWrapper.model", STAGE_PY, "instance attribute"),
    Requirement(f"{ARCH}:DecoderOnlyWrapper.rotary_emb", STAGE_PY, "instance attribute"),
    Requirement(f"{ARCH}:DecoderOnlyForCausalLM.model", STAGE_PY, "instance attribute"),
    Requirement(f"{ARCH}:DecoderOnlyForCausalLM.lm_head", STAGE_PY, "instance attribute"),
    Requirement(f"{ARCH}:DecoderOnlyModel.layers", STAGE_PY, "instance attribute"),
    Requirement(f"{ARCH}:DecoderOnlyModel.max_seq_len", STAGE_PY, "instance attribute"),
    Requirement(f"{ARCH}:DecoderOnlyModel.attn_impl", STAGE_PY, "attribute"),
    Requirement(f"{ARCH}:DecoderOnlyModel.hidden_multiplier", STAGE_PY, "attribute"),
    Requirement(f"{ARCH}:DecoderOnlyModel.get_embedding", STAGE_PY),
    Requirement(f"{ARCH}:DecoderOnlyModel.get_last_layernorm", STAGE_PY),
    Requirement(f"{ARCH}:DecoderOnlyLayer.phase", STAGE_PY, "attribute"),
    Requirement(
        f"{ARCH}:DecoderOnlyLayer.forward",
        STAGE_PY,
        params=(
            "hidden_states",
            "attention_mask",
            "seq_positions",
            "past_key_values",
            "cos",
            "sin",
            "block_tables",
        ),
    ),
    Requirement(
        f"{ARCH}:slice_and_unsqueeze_cos_sin", STAGE_PY, params=("cos", "sin", "cache_position")
    ),
    # The serving contract every optimum-rbln decoder keeps (vllm-rbln calls it too).
    Requirement(
        f"{DECODER}.modeling_decoderonly:RBLNDecoderOnlyModelForCausalLM.prefill_decoder",
        RUNNER_PY,
        "instance attribute",
    ),
    Requirement(
        f"{DECODER}.modeling_decoderonly:RBLNDecoderOnlyModelForCausalLM.decoders",
        RUNNER_PY,
        "instance attribute",
    ),
    *(
        Requirement(
            f"optimum.rbln.transformers.models.{module}:{cls}._get_position_embeddings",
            QWEN2_VL_PY,
            params=("hidden_states", "position_ids"),
        )
        for module, cls in (
            ("qwen2_vl.modeling_qwen2_vl", "RBLNQwen2VLForConditionalGeneration"),
            ("qwen2_5_vl.modeling_qwen2_5_vl", "RBLNQwen2_5_VLForConditionalGeneration"),
            ("qwen3_vl.modeling_qwen3_vl", "RBLNQwen3VLForConditionalGeneration"),
            ("qwen3_vl_moe.modeling_qwen3_vl_moe", "RBLNQwen3VLMoeForConditionalGeneration"),
            ("qwen3_5.modeling_qwen3_5", "RBLNQwen3_5ForConditionalGeneration"),
        )
    ),
    # rbln-ray's encoder classes (optimum_models): optimum's generic encoders, subclassed,
    # registered through its auto classes, ModernBERT compiled with its masked LM's wrapper.
    Requirement("optimum.rbln:RBLNAutoModel.register", MODELS_PY, params=("rbln_cls", "exist_ok")),
    Requirement("optimum.rbln:RBLNAutoConfig.register", MODELS_PY, params=("config", "exist_ok")),
    Requirement(f"{GENERIC}:RBLNModelForSequenceClassification", MODELS_PY, "attribute"),
    Requirement(
        f"{GENERIC}:RBLNTransformerEncoderForFeatureExtraction._wrap_model_if_needed",
        MODELS_PY,
        params=("model", "rbln_config"),
    ),
    Requirement(
        f"{GENERIC}:RBLNTransformerEncoderForFeatureExtraction.get_pytorch_model", MODELS_PY
    ),
    Requirement(
        "optimum.rbln.transformers.models.modernbert.modernbert_architecture:"
        "ModernBertModelWrapper",
        MODELS_PY,
        params=("model", "rbln_config"),
    ),
)


def compile_wrapper(cls: Any, model: Any, rbln_config: Any) -> Any:
    """The ``DecoderOnlyWrapper`` optimum's decoder class ``cls`` compiles for ``model``: the
    HF layers converted to RBLN attention layers, with their rotary embedding."""
    return cls._wrap_model_if_needed(model, rbln_config)


def qwen2_vl_position_embeddings(model: Any, dtype: Any, position_ids: Any) -> Any:
    """``[2, batch, 1, length, head_dim]`` cos/sin of ``[3, batch, length]`` M-RoPE positions,
    as an ``RBLNQwen2VLForConditionalGeneration`` (or a later Qwen family's model: each
    encodes its own M-RoPE variant, sections or interleaved) computes them for its graphs."""
    import torch

    return model._get_position_embeddings(torch.zeros(1, dtype=dtype), position_ids)
