"""optimum-rbln 0.12 internals rbln-ray relies on: the compile-time wrapper its decoder classes
build, the converted modules inside it, and Qwen2-VL's host-side position embeddings.

Why internals: a pipeline stage compiles a slice of optimum's converted decoder (its layers
call the same ``rbln_custom_ops`` attention kernels as optimum's own graphs, so a staged model
is token-exact with an unstaged one and runs on an ATOM unchanged); optimum has no public
"compile these layers" entry, so :mod:`rbln_ray.compile.pipeline_compile` builds the wrapper
optimum would build (:func:`compile_wrapper`) and :mod:`rbln_ray.compile.stage_graph` reads the
modules named below. The Qwen families' graphs take M-RoPE cos/sin computed on the host by a
private method of optimum's model (:func:`qwen2_vl_position_embeddings`); which optimum
classes those are is the family registry's fact (its records' ``mrope``), passed down as data
(:func:`position_embedding_requirements`), since this layer is below the registry.
Speculative decoding's verify graphs are compiled inside optimum's own decoder compile
(:func:`extra_graphs`), so they share its weights and static KV buffers.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from rbln_ray.upstream.contract import Requirement, Upstream

UPSTREAM = Upstream("optimum-rbln", "optimum-rbln", "0.12.0")
DECODER = "optimum.rbln.transformers.models.decoderonly"
ARCH = f"{DECODER}.decoderonly_architecture"
PIPELINE_PY = "rbln_ray/compile/pipeline_compile.py"
STAGE_PY = "rbln_ray/compile/stage_graph.py"
QWEN_VL_PY = "rbln_ray/families/qwen_vl_base.py"
RUNNER_PY = "rbln_ray/vllm_plugin/model_runner.py"
SPEC_PY = "rbln_ray/compile/spec_graphs.py"
MODELING = f"{DECODER}.modeling_decoderonly:RBLNDecoderOnlyModelForCausalLM"
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
    # extra_graphs: optimum's decoder compile, hooked for the length of one compile
    Requirement(f"{MODELING}.get_compiled_model", SPEC_PY, params=("model", "rbln_config")),
    Requirement(
        f"{MODELING}.get_compiled_model",
        SPEC_PY,
        "source mentions",
        (
            "cls._get_compile_context(",
            "cls._compile_model(",
            "if rbln_config.is_auto_num_blocks:",
            "cls.set_kvcache_num_blocks_after_compilation(compiled_models, rbln_config)",
            "return compiled_models",
        ),
    ),
    Requirement(
        f"{MODELING}._get_compile_context", SPEC_PY, params=("compile_config", "example_inputs")
    ),
    Requirement(
        f"{MODELING}._compile_model",
        SPEC_PY,
        params=(
            "wrapped_model",
            "compile_config",
            "example_inputs",
            "compile_context",
            "rbln_config",
            "quantization",
            "phase",
        ),
    ),
    Requirement(
        f"{MODELING}.set_kvcache_num_blocks_after_compilation",
        SPEC_PY,
        params=("compiled_models", "rbln_config"),
    ),
    Requirement(
        f"{MODELING}.get_input_info",
        SPEC_PY,
        params=("batch_size", "query_length", "rbln_config", "model_config"),
    ),
    Requirement(
        "optimum.rbln.configuration_utils:RBLNCompileConfig.get_dummy_inputs",
        SPEC_PY,
        params=("fill", "static_tensors"),
    ),
    Requirement(
        "optimum.rbln.transformers.models.auto.auto_factory:_BaseAutoModelClass.get_rbln_cls",
        SPEC_PY,
        params=("pretrained_model_name_or_path",),
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


def position_embedding_requirements(optimum_classes: Iterable[str]) -> tuple[Requirement, ...]:
    """What :func:`qwen2_vl_position_embeddings` relies on in each of ``optimum_classes`` (the
    optimum-rbln classes of the families whose decoders take M-RoPE cos/sin: the registry's
    records with ``mrope``, which the contract test passes)."""
    return tuple(
        Requirement(
            f"optimum.rbln:{cls}._get_position_embeddings",
            QWEN_VL_PY,
            params=("hidden_states", "position_ids"),
        )
        for cls in optimum_classes
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


# extra_graphs changes class attributes of optimum's classes: one compile at a time.
_EXTRA_GRAPHS = threading.Lock()
_HOOKED = ("get_compiled_model", "_get_compile_context", "_compile_model")
_BLOCKS = "set_kvcache_num_blocks_after_compilation"


@dataclass
class GraphCompiler:
    """What :func:`extra_graphs`' builder gets: optimum's own compile context, static KV
    tensors and compile-time wrapper of the model being compiled."""

    cls: Any
    model: Any  # the Hugging Face model
    rbln_config: Any
    context: Any
    static_tensors: dict[str, Any]
    wrapped: Any

    def input_info(self, batch_size: int, query_length: int) -> list[tuple[str, list[int], str]]:
        """optimum's input declaration of a graph (``query_length`` > 1 means prefill)."""
        return self.cls.get_input_info(
            batch_size=batch_size,
            query_length=query_length,
            rbln_config=self.rbln_config,
            model_config=self.model.config,
        )

    def compile(self, name: str, input_info: list[tuple[str, list[int], str]], phase: str) -> Any:
        """Compile the wrapper in ``phase`` for ``input_info`` in optimum's context: the graph
        shares the other graphs' weights and static KV tensors."""
        from optimum.rbln.configuration_utils import RBLNCompileConfig

        first = self.rbln_config.compile_cfgs[0]
        config = RBLNCompileConfig(
            compiled_model_name=name,
            input_info=input_info,
            npu=first.npu,
            num_devices=first.num_devices,
        )
        example = config.get_dummy_inputs(fill=0, static_tensors=self.static_tensors)
        return self.cls._compile_model(
            self.wrapped,
            config,
            example,
            self.context,
            self.rbln_config,
            self.rbln_config.quantization,
            phase=phase,
        )


@dataclass
class _Capture:
    context: Any = None
    static_tensors: dict[str, Any] = field(default_factory=dict)
    wrapped: Any = None
    added: dict[str, Any] = field(default_factory=dict)


def decoder_class(hf_dir: Any) -> Any:
    """The optimum-rbln class ``RBLNAutoModelForCausalLM`` compiles ``hf_dir`` with."""
    from optimum.rbln import RBLNAutoModelForCausalLM

    return RBLNAutoModelForCausalLM.get_rbln_cls(str(hf_dir), export=True)


@contextmanager
def extra_graphs(
    cls: Any, build: Callable[[GraphCompiler], dict[str, Any]], sink: dict[str, Any]
) -> Iterator[None]:
    """Inside the block, ``cls.from_pretrained(export=True)`` also compiles the graphs
    ``build`` returns, in optimum's own compile context, and puts them in ``sink`` (not in
    optimum's model: optimum's loader requires every graph it lists, so they are saved and
    loaded beside it).

    When optimum sizes the KV cache itself (``kvcache_num_blocks`` automatic), the graphs
    are added before it measures the compiled graphs' memory, so their memory is counted and
    their KV inputs are resized with the others. Four class attributes of ``cls`` are
    hooked for the block and restored on every exit, error included; compiles of ``cls``
    in other threads wait (a lock)."""
    capture = _Capture()
    originals = {name: getattr(cls, name) for name in (*_HOOKED, _BLOCKS)}
    state = {"model": None, "auto": False}

    def add(rbln_config: Any, compiled: dict[str, Any]) -> None:
        if capture.added:
            return
        if capture.wrapped is None or capture.context is None:
            raise RuntimeError(f"{cls.__name__}: optimum compiled no decoder graph to extend")
        compiler = GraphCompiler(
            cls,
            state["model"],
            rbln_config,
            capture.context,
            capture.static_tensors,
            capture.wrapped,
        )
        capture.added.update(build(compiler))
        compiled.update(capture.added)

    def get_compiled_model(klass: Any, model: Any, rbln_config: Any) -> Any:
        state["model"] = model
        state["auto"] = rbln_config.is_auto_num_blocks  # optimum resolves it inside
        compiled = originals["get_compiled_model"](model, rbln_config)
        add(rbln_config, compiled)  # explicit block count: nothing to resize
        for name in capture.added:
            sink[name] = compiled.pop(name)
        return compiled

    def get_compile_context(klass: Any, compile_config: Any, example_inputs: Any) -> Any:
        context, static = originals["_get_compile_context"](compile_config, example_inputs)
        capture.context, capture.static_tensors = context, static
        return context, static

    def compile_model(klass: Any, wrapped_model: Any, *args: Any, **kwargs: Any) -> Any:
        capture.wrapped = wrapped_model
        return originals["_compile_model"](wrapped_model, *args, **kwargs)

    def set_blocks(klass: Any, compiled_models: dict[str, Any], rbln_config: Any) -> Any:
        if state["auto"]:
            add(rbln_config, compiled_models)
        return originals[_BLOCKS](compiled_models, rbln_config)

    hooks = {
        "get_compiled_model": get_compiled_model,
        "_get_compile_context": get_compile_context,
        "_compile_model": compile_model,
        _BLOCKS: set_blocks,
    }
    with _EXTRA_GRAPHS:
        own = {name: cls.__dict__[name] for name in hooks if name in cls.__dict__}
        try:
            for name, hook in hooks.items():
                setattr(cls, name, classmethod(hook))
            yield
        finally:
            for name in hooks:
                if name in own:
                    setattr(cls, name, own[name])
                elif name in cls.__dict__:
                    delattr(cls, name)
