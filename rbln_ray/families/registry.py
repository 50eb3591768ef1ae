"""The family registry: every model family rbln-ray serves, one record each.

Why one registry for every kind (decoders, encoders, vision-language models): the loader,
``rbln-ray compile``, ``rbln-ray build-model``, the platform and the README's support
matrices all ask "is this model supported, how is it compiled, what does it support, how is
a tiny one built, which test verifies it"; they read it here, so they cannot disagree
(``tests/unit/test_families.py`` renders the matrices and compares them with the README).
A family with code of its own (a processor subclass, vLLM's view of a vision-language
architecture, how its prompts become embeddings, how a speech model is compiled) has one
module named after it in this package, which its record names (``module``); what that module
provides is its kind's contract (:mod:`rbln_ray.families.contract`), which :meth:`Family.code`
checks. Facts the layers below this one need (the cost model's gated MLP) are passed down from
here as data (:func:`rbln_ray.npu.cost_model.declare_ungated_mlp`): they cannot ask.
:func:`get_rbln_model_info` is the lookup Rebellions' vllm-rbln exposes under the same name
(``utils/optimum/registry.py``).

A family is *supported* when a tiny model of it, built locally by :mod:`rbln_ray.models`,
compiled with optimum-rbln 0.12 on the emulator and served by ``vllm.LLM`` is greedy
token-exact against transformers (pooling models: equal to plain vLLM-CPU); ``verified_by``
names the test. Architectures optimum-rbln compiles that rbln-ray cannot build here, and so
cannot verify, are in :data:`UNSUPPORTED` with the reason; they are refused with it.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rbln_ray.common.artifact_files import HF_CONFIG, architectures
from rbln_ray.families.contract import FamilyCode, SpeechCode, VisionCode
from rbln_ray.families.tiny import LATER_SHAPE_FIELDS, ROBERTA_PAIR, TinyRecipe
from rbln_ray.npu.cost_model import declare_ungated_mlp

logger = logging.getLogger(__name__)

GREEDY_TEST = "tests/vllm_plugin/test_zoo_greedy.py::test_family_greedy_matches_transformers"
# The four decoder families verified before the zoo, by the original greedy test.
LLM_GREEDY_TEST = "tests/vllm_plugin/test_llm_greedy.py::test_llm_greedy_matches_transformers"
EMBED_TEST = "tests/vllm_plugin/test_embeddings.py"
VISION_TEST = "tests/vllm_plugin/test_vision_language.py"
SPEECH_TEST = "tests/vllm_plugin/test_speech.py"


class UnsupportedModelError(ValueError):
    """The model's architecture is not one rbln-ray serves."""


@dataclass(frozen=True)
class Family:
    """What every kind of family has."""

    kind: ClassVar[str] = ""
    # What a compiled directory of the family is read as (rbln_ray.compile.artifact):
    # "decoder" (a causal LM's KV blocks and graphs), "encoder" or "speech".
    artifact: ClassVar[str] = "decoder"
    # The contract its module's code keeps (rbln_ray.families.contract); a kind whose
    # contract is more than FamilyCode requires a module.
    contract: ClassVar[type[FamilyCode]] = FamilyCode
    name: str  # rbln-ray's family name (``rbln-ray build-model <name>``)
    architecture: str  # transformers class, ``config.json`` ``architectures[0]``
    optimum_class: str  # the optimum-rbln class that compiles and runs it
    # variant (attention implementation, or "" for one) -> the test that verifies it
    verified_by: Mapping[str, str] = field(default_factory=dict)
    notes: str = ""
    module: str = ""  # the family's own module in this package, when it has code
    # The optimum-rbln config class an artifact's ``rbln_config.json`` records (its cls_name).
    config_class: str = field(init=False, default="")

    def __post_init__(self) -> None:
        object.__setattr__(self, "config_class", self.optimum_class + "Config")

    def code(self) -> Any:
        """The family's code (its module's ``CODE``, imported on first use: it may import
        vLLM), checked against its kind's contract."""
        if not self.module:
            raise LookupError(f"family {self.name} has no module of its own")
        found = _CODE.get(self.name)
        if found is None:
            module = importlib.import_module(f"rbln_ray.families.{self.module}")
            found = getattr(module, "CODE", None)
            if not isinstance(found, self.contract):
                raise TypeError(
                    f"{module.__name__}.CODE is {type(found).__name__}, not a "
                    f"{self.contract.__name__} (rbln_ray.families.contract)"
                )
            if found.missing():
                raise TypeError(
                    f"{module.__name__}.CODE ({type(found).__name__}) sets no "
                    f"{', '.join(found.missing())}, which {self.contract.__name__} requires"
                )
            _CODE[self.name] = found
        return found


# Family name -> its checked code (Family.code).
_CODE: dict[str, FamilyCode] = {}


@dataclass(frozen=True)
class DecoderFamily(Family):
    """A decoder-only family optimum-rbln 0.12 exports as a causal LM."""

    kind: ClassVar[str] = "decoder"
    model_type: str = ""  # ``config.json`` ``model_type``
    # Attention of the family's checkpoints: "full"; "hybrid" (some layers use a
    # sliding-window KV cache, compiled to paged_sliding_window_attn_*); "optional" (every
    # layer slides when config.json sets sliding_window, optimum's cache_impl
    # "sliding_window"; else full).
    attention: str = "full"
    softcap: str = ""  # logit soft-capping optimum compiles for the family, if any
    moe: str = ""  # "" or how experts are compiled (custom_moe_glu[_mxfp4])
    # The compiled prefill can start at a multiple of prefill_chunk_size other than 0, which
    # chunked prefill across steps and prefix caching need. False for RBLNGemma3ForCausalLM:
    # its prefill (RBLNDecoderOnlyChunkedMultimodalPrefillMixin) builds the attention mask
    # from position 0 whatever cache_position says.
    prefill_resumable: bool = True
    # rbln_config entries the family is always compiled with (see README, "Model zoo")
    compile_extra: Mapping[str, Any] = field(default_factory=dict)
    # load the checkpoint in its own dtype (optimum-rbln forces bfloat16 for gpt-oss)
    checkpoint_dtype: bool = False
    # config.json keys optimum-rbln 0.12 compiles without error but does not honour -> why
    ignored_config: Mapping[str, str] = field(default_factory=dict)
    # config.json keys that, set (to anything but 0, false or null), cannot be served -> why
    # (refused at compile, naming the key)
    refused_config: Mapping[str, str] = field(default_factory=dict)
    tiny: TinyRecipe = field(default_factory=lambda: TinyRecipe("LlamaConfig"))
    # Compiled LoRA adapters (rbln_ray.compile.lora) and pre-quantized checkpoints
    # (rbln_ray.compile.quantization), verified for the family by tests/emulator/
    # test_lora_quant_graphs.py (greedy against merged / dequantized transformers).
    lora: bool = False
    quantization: bool = False
    # The MLP has a gate (gate/up/down: Llama, Gemma, Mixtral...); False: up and down only
    # (GPT-2, OPT, Phi). The cost model counts its matrices (passed down by model_type).
    gated_mlp: bool = True
    # Linear-attention layers (Qwen3.5's gated delta nets) keep one state row per compiled
    # batch slot, which every decode call runs whole: decode graphs of the full batch only.
    state_rows: bool = False
    # attn_impl -> why optimum-rbln 0.12 compiles the family with it, but not token-exactly
    # (refused at compile, with the reason).
    refused_attn: Mapping[str, str] = field(default_factory=dict)
    # vLLM 0.30's own module for the architecture cannot be imported here (torchvision) or
    # would make vLLM plan its cache as a hybrid model's: vLLM's registry gets rbln-ray's
    # plain declaration of it instead (rbln_ray.vllm_plugin.declarations).
    declared: bool = False

    def compile_options(self, hf_config: Mapping[str, Any]) -> tuple[dict, dict]:
        """(extra ``rbln_config`` entries, extra Hugging Face loading options)."""
        hf_kwargs = {}
        if self.checkpoint_dtype:
            dtype = hf_config.get("dtype") or hf_config.get("torch_dtype")
            hf_kwargs = {"dtype": dtype} if dtype else {}
        return dict(self.compile_extra), hf_kwargs

    def compile_settings(self, settings: Any) -> Any:
        """``settings`` (a :class:`rbln_ray.compile.CompileSettings`) as the family compiles:
        an attention implementation it is not exact with is refused, naming why; state rows
        get decode graphs of the full batch only."""
        why = self.refused_attn.get(settings.attn_impl)
        if why:
            raise ValueError(
                f"{self.architecture}: attn_impl={settings.attn_impl!r} is refused: {why}"
            )
        full = (settings.batch_size,)
        if not self.state_rows or tuple(settings.decoder_batch_sizes or full) == full:
            return settings
        logger.info(
            "%s: decoder_batch_sizes %s -> %s: decode rows are state slots",
            self.architecture,
            settings.decoder_batch_sizes,
            full,
        )
        return settings.model_copy(update={"decoder_batch_sizes": full})

    def refusals(self, hf_config: Mapping[str, Any]) -> list[str]:
        """Why a model with this ``config.json`` is not served (nothing: it is)."""
        return [f"{key}={hf_config[key]!r} is refused: {why}"
                for key, why in self.refused_config.items() if hf_config.get(key)]  # fmt: skip

    def caveats(self, hf_config: Mapping[str, Any]) -> list[str]:
        """Config values optimum-rbln 0.12 compiles without error but does not honour."""
        return [
            f"{key}={hf_config[key]} is not compiled ({why})"
            for key, why in self.ignored_config.items()
            if hf_config.get(key) is not None
        ]

    def sliding_window_used(self, hf_config: Mapping[str, Any]) -> bool:
        """Whether a model of this family with this ``config.json`` compiles sliding-window
        layers (and so serves without prefix caching)."""
        if self.attention == "hybrid":
            return True
        return self.attention == "optional" and hf_config.get("sliding_window") is not None


@dataclass(frozen=True)
class EncoderFamily(Family):
    """An encoder optimum-rbln 0.12 compiles, served for embeddings or scores: one graph of
    ``[batch, max_seq_len]`` tokens, pooling on the host in vLLM's own pooler."""

    kind: ClassVar[str] = "encoder"
    artifact: ClassVar[str] = "encoder"
    input_names: tuple[str, ...] = ("input_ids", "attention_mask")  # graph inputs, in order
    # "embed" (every position's hidden state; vLLM pools and normalises) or "classify" (the
    # classifier's logits, head included: a cross-encoder's score, /v1/score and /v1/rerank)
    task: str = "embed"
    tiny: TinyRecipe = field(default_factory=lambda: TinyRecipe("BertConfig"))
    examples: str = ""  # real checkpoints of the family, for the README


@dataclass(frozen=True)
class PoolingDecoderFamily(Family):
    """A decoder-only checkpoint served for embeddings or scores (``runner="pooling"``): the
    strongest open embedders and rerankers today are causal LMs read another way. Its
    checkpoints declare the decoder's own architecture (``Qwen3ForCausalLM``), so it is found
    by the runner and the config keys vLLM is told about it (:func:`pooling_decoder_for`),
    never by architecture alone."""

    kind: ClassVar[str] = "decoder-pooling"
    decoder_family: str = ""  # the DecoderFamily its checkpoints are
    # "embed" (the hidden state of the last token, normalised by vLLM's pooler) or "classify"
    # (a relevance score from the LM head: /v1/score and /v1/rerank)
    task: str = "embed"
    # What vLLM is told about such a checkpoint (``hf_overrides``, as vLLM documents it for
    # the model); the architecture vLLM then serves is this record's ``architecture``.
    hf_overrides: Mapping[str, Any] = field(default_factory=dict)
    # config keys that mark the checkpoint as this family (set by ``hf_overrides``)
    recognised_by: tuple[str, ...] = ()
    examples: str = ""


@dataclass(frozen=True)
class SpeechFamily(Family):
    """A speech-to-text encoder-decoder: optimum-rbln compiles the audio encoder (which
    writes each request's cross-attention KV into a slot of a static buffer) and a decoder
    of one batch of rows; served through vLLM's transcription front end."""

    kind: ClassVar[str] = "speech"
    artifact: ClassVar[str] = "speech"
    contract: ClassVar[type[FamilyCode]] = SpeechCode
    tasks: tuple[str, ...] = ("transcribe", "translate")
    examples: str = ""


@dataclass(frozen=True)
class VisionFamily(Family):
    """An image-text-to-text family: optimum-rbln compiles the vision tower (and projector)
    and a decoder that takes ``inputs_embeds``; its module holds the rest (processor, vLLM's
    view, prompt embeddings, tiny recipe)."""

    kind: ClassVar[str] = "vision"
    contract: ClassVar[type[FamilyCode]] = VisionCode
    vision_tower: str = ""  # the optimum-rbln class that encodes an image
    # The decoder family of its language model; or, when rbln-ray serves no text-only family
    # of it (optimum-rbln 0.12 compiles EXAONE-4 only inside EXAONE-4.5), its transformers
    # model_type (the family's module builds that config; see tiny_language_family).
    language_family: str = ""
    # The submodule (and nested rbln_config key) holding the decoder; "" when the artifact's
    # top level is the decoder (Qwen2-VL).
    language_submodule: str = "language_model"
    # The vision tower's submodule, when it takes compile settings of its own.
    vision_submodule: str = ""
    inputs: tuple[str, ...] = ("image",)  # media a prompt may carry
    max_images: int | None = None  # images one prompt may carry (None: as many as fit)
    images_at_start: bool = False  # the processor puts every image before the text
    prefix_caching: bool = True
    chunked_prefill: bool = True
    # The class of the family's module vLLM's registry gets for the architecture when vLLM's
    # own module cannot be imported here ("": vLLM's own serves the front end).
    declaration: str = ""
    # The decoder takes the cos/sin of M-RoPE positions (``position_embed``), computed on
    # the host by optimum-rbln's model class (``_get_position_embeddings``: an internal the
    # contract test checks for exactly these families' classes).
    mrope: bool = False
    examples: str = ""  # released checkpoints of the family (the speech matrix names them)
    # The tiny model's cache-key history: bumped when the family's ``tiny_model`` recipe
    # changes after its models were cached (joins the cache key), so they are built again.
    tiny_revision: int = 0

    @property
    def transcribes(self) -> bool:
        """Its prompts carry audio: served behind vLLM's transcription routes (Qwen3-ASR)."""
        return "audio" in self.inputs

    @property
    def tiny_language_family(self) -> str:
        """The decoder family whose tiny shape (``TinyModelSpec``: sizes, layers, heads) the
        tiny model's language model takes: its language family when that is a decoder
        family, else llama's (the family's module builds the config from the sizes)."""
        return self.language_family if self.language_family in DECODERS else "llama"


def _zoo(name: str, arch: str, optimum: str, model_type: str, **kw: Any) -> DecoderFamily:
    verified = kw.pop("verified_by", None) or {
        impl: f"{GREEDY_TEST}[{name}-{impl}]" for impl in ("eager", "flash_attn")
    }
    return DecoderFamily(name, arch, optimum, verified, model_type=model_type, **kw)


HEAD_DIM, WINDOW, HYBRID = "$head_dim", "$window", "$hybrid"
MOE_TOP_K = {"num_experts_per_tok": "$experts_per_token"}
# RoBERTa-style encoders, as the released checkpoints' configs: positions start after the
# padding id (514 for 512 tokens when it is 1), one segment, one relevance logit (rerankers),
# and position_embedding_type, which transformers 5 no longer writes but vLLM 0.30 reads to
# tell Jina's rotary XLM-R apart.
ROBERTA = {
    "max_position_embeddings": "$positions_after_pad",
    "type_vocab_size": 1,
    "bos_token_id": "$bos",
    "eos_token_id": "$eos",
    "num_labels": 1,
    "position_embedding_type": "absolute",
}

_FAMILIES: tuple[Family, ...] = (
    # ---------------------------------------------------------------- decoders
    _zoo(
        "llama",
        "LlamaForCausalLM",
        "RBLNLlamaForCausalLM",
        "llama",
        verified_by={impl: f"{LLM_GREEDY_TEST}[llama-{impl}]" for impl in ("eager", "flash_attn")},
        tiny=TinyRecipe("LlamaConfig", keyed_late=LATER_SHAPE_FIELDS),
        lora=True,
        quantization=True,
    ),
    _zoo(
        "qwen2",
        "Qwen2ForCausalLM",
        "RBLNQwen2ForCausalLM",
        "qwen2",
        verified_by={
            "eager": f"{LLM_GREEDY_TEST}[qwen2-eager]",
            "flash_attn": f"{GREEDY_TEST}[qwen2-flash_attn]",
        },
        tiny=TinyRecipe("Qwen2Config", keyed_late=LATER_SHAPE_FIELDS),
        lora=True,
    ),
    _zoo(
        "qwen3",
        "Qwen3ForCausalLM",
        "RBLNQwen3ForCausalLM",
        "qwen3",
        verified_by={
            "eager": f"{GREEDY_TEST}[qwen3-eager]",
            "flash_attn": f"{LLM_GREEDY_TEST}[qwen3-flash_attn]",
        },
        tiny=TinyRecipe("Qwen3Config", {"head_dim": HEAD_DIM}, keyed_late=LATER_SHAPE_FIELDS),
        # no LoRA: optimum-rbln 0.12's Qwen3Attention never wraps its projections in LoRA
        # layers yet calls them with an adapter id (TypeError at compile)
        quantization=True,
    ),
    # Qwen/Qwen3.5-* language models: mostly linear-attention layers (gated delta nets: a
    # causal convolution and a recurrent state per sequence, not KV blocks), a few full ones
    # with a gated output and rotary over a quarter of the head.
    _zoo(
        "qwen3_5_text",
        "Qwen3_5ForCausalLM",
        "RBLNQwen3_5ForCausalLM",
        "qwen3_5_text",
        verified_by={"flash_attn": f"{GREEDY_TEST}[qwen3_5_text-flash_attn]"},
        # A linear-attention layer's state is built from the prompt's first token: optimum's
        # prefill raises past position 0, and no state is kept for a cached prefix.
        prefill_resumable=False,
        state_rows=True,
        refused_attn={
            "eager": "optimum-rbln 0.12's Qwen3.5 eager attention takes a prefill window's "
            "smallest cache position, which the zero padding of a partial last window makes "
            "0: not token-exact for prompts longer than prefill_chunk_size; compile with "
            "attn_impl='flash_attn'"
        },
        declared=True,
        notes="linear-attention layers keep one state row per sequence: prompts are "
        "prefilled whole, without prefix caching; flash attention only",
        tiny=TinyRecipe(
            "Qwen3_5TextConfig",
            {
                "head_dim": HEAD_DIM,
                "rope_parameters": {
                    "rope_type": "default",
                    "rope_theta": 10_000_000.0,
                    "partial_rotary_factor": 0.25,
                },
                # optimum reads the top-level factor, transformers' rotary the one above
                "partial_rotary_factor": 0.25,
                "layer_types": "$linear_then_full",
                "linear_conv_kernel_dim": 4,
                "linear_key_head_dim": 16,
                "linear_value_head_dim": 16,
                "linear_num_key_heads": 2,
                "linear_num_value_heads": 4,
            },
        ),
    ),
    _zoo(
        "mistral",
        "MistralForCausalLM",
        "RBLNMistralForCausalLM",
        "mistral",
        attention="optional",
        notes="verified with sliding_window set (every layer slides)",
        tiny=TinyRecipe(
            "MistralConfig",
            {"sliding_window": "$sliding_window"},
            keyed_late=LATER_SHAPE_FIELDS,
        ),
    ),
    _zoo(
        "gemma",
        "GemmaForCausalLM",
        "RBLNGemmaForCausalLM",
        "gemma",
        tiny=TinyRecipe("GemmaConfig", {"head_dim": HEAD_DIM}),
    ),
    _zoo(
        "gemma2",
        "Gemma2ForCausalLM",
        "RBLNGemma2ForCausalLM",
        "gemma2",
        attention="hybrid",
        softcap="final logits",
        ignored_config={
            "attn_logit_softcapping": "optimum-rbln 0.12's attention ops have no soft-capping: "
            "attention differs from transformers'"
        },
        notes="final-logit soft-capping compiled; attention-logit soft-capping is not "
        "(optimum-rbln 0.12 drops attn_logit_softcapping): the tiny model sets it to None",
        # optimum compiles no attention-logit soft-capping, so the tiny model has none
        tiny=TinyRecipe(
            "Gemma2Config",
            {
                "head_dim": HEAD_DIM,
                "query_pre_attn_scalar": HEAD_DIM,
                "sliding_window": WINDOW,
                "layer_types": HYBRID,
                "attn_logit_softcapping": None,
                "final_logit_softcapping": 30.0,
            },
        ),
    ),
    _zoo(
        "gemma3",
        "Gemma3ForCausalLM",
        "RBLNGemma3ForCausalLM",
        "gemma3_text",
        attention="hybrid",
        prefill_resumable=False,
        # optimum-rbln 0.12 forces use_attention_mask and use_position_ids on for Gemma3, and
        # without an image_prefill phase that compiles a *bidirectional* prefill, which a
        # text-only causal LM is not; with the phases optimum's own
        # RBLNGemma3ForConditionalGeneration gives its language model (embeddings on the
        # host) the text prefill is causal.
        compile_extra={
            "phases": ["prefill", "image_prefill", "decode"],
            "image_prefill_chunk_size": 256,  # RBLNGemma3ForCausalLMConfig's prefill chunk
            "use_inputs_embeds": True,
        },
        notes="text-only; prompts are prefilled whole (no chunked prefill across steps)",
        tiny=TinyRecipe(
            "Gemma3TextConfig",
            {
                "head_dim": HEAD_DIM,
                "query_pre_attn_scalar": HEAD_DIM,
                "sliding_window": WINDOW,
                "layer_types": HYBRID,
            },
        ),
    ),
    _zoo(
        "gemma4",
        "Gemma4ForCausalLM",
        "RBLNGemma4ForCausalLM",
        "gemma4_text",
        attention="hybrid",
        softcap="final logits",
        prefill_resumable=False,  # as Gemma3's (the same chunked multimodal prefill)
        # as Gemma3's (RBLNGemma4ForCausalLMConfig also requires the attention mask); without
        # embeddings on the host optimum-rbln 0.12 never computes the per-layer inputs (it
        # saves embed_tokens_per_layer only with use_inputs_embeds)
        compile_extra={
            "phases": ["prefill", "image_prefill", "decode"],
            "use_inputs_embeds": True,
            "use_attention_mask": True,
        },
        refused_config={
            "num_kv_shared_layers": "optimum-rbln 0.12 compiles no KV sharing across layers "
            "(transformers builds the shared layers without K and V projections, and "
            "optimum's attention needs them): Gemma 4 E2B and E4B set it",
            "enable_moe_block": "optimum-rbln 0.12 compiles Gemma 4's experts with "
            "custom_moe_glu(hidden_act='gelu'), transformers runs them with tanh-approximated "
            "GELU; which one the ATOM kernel computes is not known here (the emulator's exact "
            "GELU gives logits 1.3e-3 away from transformers' on a tiny model): Gemma 4 "
            "26B-A4B sets it",
        },
        notes="text-only, as the dense checkpoint (31B: full layers with their own head size "
        "and K=V); per-layer inputs compile too, but the checkpoints with them (E2B, E4B) "
        "share KV across layers; prompts are prefilled whole",
        tiny=TinyRecipe(
            "Gemma4TextConfig",
            {
                "head_dim": HEAD_DIM,
                "global_head_dim": "$head_dim_x2",
                "num_global_key_value_heads": 1,
                "attention_k_eq_v": True,
                "hidden_size_per_layer_input": 16,
                "vocab_size_per_layer_input": "$vocab_size",
                "num_kv_shared_layers": 0,
                "enable_moe_block": False,
                "sliding_window": WINDOW,
                "layer_types": HYBRID,
                "final_logit_softcapping": 30.0,
                "tie_word_embeddings": True,
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                    "full_attention": {
                        "rope_type": "proportional",
                        "partial_rotary_factor": 0.25,
                        "rope_theta": 1_000_000.0,
                    },
                },
            },
        ),
    ),
    _zoo(
        "gpt2",
        "GPT2LMHeadModel",
        "RBLNGPT2LMHeadModel",
        "gpt2",
        gated_mlp=False,
        tiny=TinyRecipe(
            "GPT2Config",
            rename={
                "hidden_size": "n_embd",
                "num_hidden_layers": "n_layer",
                "num_attention_heads": "n_head",
                "intermediate_size": "n_inner",
                "max_position_embeddings": "n_positions",
            },
            drop=("num_key_value_heads",),
        ),
    ),
    _zoo(
        "opt",
        "OPTForCausalLM",
        "RBLNOPTForCausalLM",
        "opt",
        gated_mlp=False,
        tiny=TinyRecipe(
            "OPTConfig",
            {"word_embed_proj_dim": "$hidden_size"},
            rename={"intermediate_size": "ffn_dim", "initializer_range": "init_std"},
            drop=("num_key_value_heads",),
        ),
    ),
    _zoo(
        "phi",
        "PhiForCausalLM",
        "RBLNPhiForCausalLM",
        "phi",
        gated_mlp=False,
        # Full multi-head attention and an MLP of 4 x hidden, as Phi-1/2 checkpoints have:
        # vLLM 0.30's Phi reads neither num_key_value_heads nor intermediate_size.
        tiny=TinyRecipe(
            "PhiConfig",
            {
                "num_key_value_heads": "$num_heads",
                "intermediate_size": "$hidden_x4",
                "partial_rotary_factor": 0.5,
            },
            revision=2,
        ),
    ),
    _zoo(
        "mixtral",
        "MixtralForCausalLM",
        "RBLNMixtralForCausalLM",
        "mixtral",
        moe="custom_moe_glu",
        tiny=TinyRecipe(
            "MixtralConfig",
            {
                "intermediate_size": "$intermediate_half",
                "num_local_experts": "$num_experts",
                "sliding_window": None,
                **MOE_TOP_K,
            },
        ),
    ),
    _zoo(
        "qwen2_moe",
        "Qwen2MoeForCausalLM",
        "RBLNQwen2MoeForCausalLM",
        "qwen2_moe",
        moe="custom_moe_glu",
        tiny=TinyRecipe(
            "Qwen2MoeConfig",
            {
                "num_experts": "$num_experts",
                "moe_intermediate_size": "$intermediate_quarter",
                "shared_expert_intermediate_size": "$intermediate_half",
                **MOE_TOP_K,
            },
        ),
    ),
    _zoo(
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "RBLNQwen3MoeForCausalLM",
        "qwen3_moe",
        moe="custom_moe_glu",
        tiny=TinyRecipe(
            "Qwen3MoeConfig",
            {
                "head_dim": HEAD_DIM,
                "num_experts": "$num_experts",
                "moe_intermediate_size": "$intermediate_quarter",
                **MOE_TOP_K,
            },
        ),
    ),
    _zoo(
        "gpt_oss",
        "GptOssForCausalLM",
        "RBLNGptOssForCausalLM",
        "gpt_oss",
        attention="hybrid",
        moe="custom_moe_glu_mxfp4",
        checkpoint_dtype=True,
        notes="MXFP4 experts (custom_moe_glu_mxfp4), attention sinks",
        tiny=TinyRecipe(
            "GptOssConfig",
            {
                "intermediate_size": "$intermediate_half",
                "head_dim": HEAD_DIM,
                "num_local_experts": "$num_experts",
                "sliding_window": WINDOW,
                "layer_types": HYBRID,
                **MOE_TOP_K,
            },
            checkpoint="mxfp4",
        ),
    ),
    # ---------------------------------------------------------------- encoders
    EncoderFamily(
        "bert",
        "BertModel",
        "RBLNBertModel",
        {"": EMBED_TEST},
        input_names=("input_ids", "attention_mask", "token_type_ids"),
        examples="all-MiniLM, bge-small",
    ),
    EncoderFamily(
        "xlm-roberta",
        "XLMRobertaModel",
        "RBLNXLMRobertaModel",
        {"": EMBED_TEST},
        tiny=TinyRecipe("XLMRobertaConfig", ROBERTA, framing=ROBERTA_PAIR),
        examples="bge-m3, multilingual-e5",
    ),
    # Cross-encoder rerankers (no segment ids: RoBERTa has one)
    EncoderFamily(
        "xlm-roberta-reranker",
        "XLMRobertaForSequenceClassification",
        "RBLNXLMRobertaForSequenceClassification",
        {"": EMBED_TEST},
        task="classify",
        tiny=TinyRecipe("XLMRobertaConfig", ROBERTA, framing=ROBERTA_PAIR),
        examples="bge-reranker-v2-m3",
    ),
    EncoderFamily(
        "roberta-reranker",
        "RobertaForSequenceClassification",
        "RBLNRobertaForSequenceClassification",
        {"": EMBED_TEST},
        task="classify",
        tiny=TinyRecipe("RobertaConfig", ROBERTA, framing=ROBERTA_PAIR),
    ),
    # BERT cross-encoders (ms-marco MiniLM): a pair is [CLS] query [SEP] document [SEP], and
    # the segment ids tell the two apart. optimum-rbln 0.12 exports no class for it: rbln-ray's
    # own (rbln_ray/upstream/optimum_models.py) compiles it on optimum's generic path.
    EncoderFamily(
        "bert-reranker",
        "BertForSequenceClassification",
        "RBLNBertForSequenceClassification",
        {"": EMBED_TEST},
        input_names=("input_ids", "attention_mask", "token_type_ids"),
        task="classify",
        tiny=TinyRecipe("BertConfig", {"num_labels": 1}),
        examples="ms-marco-MiniLM-L-6-v2",
    ),
    # ModernBERT embedders: alternating global and local (sliding-window) attention layers;
    # rbln-ray's RBLNModernBertModel, as optimum compiles its masked LM
    EncoderFamily(
        "modernbert",
        "ModernBertModel",
        "RBLNModernBertModel",
        {"": EMBED_TEST},
        tiny=TinyRecipe(
            "ModernBertConfig",
            {
                # head_dim 64 (vLLM's CPU attention's sizes), a window shorter than the test
                # inputs, so the local layers matter
                "num_attention_heads": 2,
                "local_attention": 16,
                "global_attn_every_n_layers": 2,
                "bos_token_id": "$bos",
                "eos_token_id": "$eos",
                "cls_token_id": "$bos",
                "sep_token_id": "$eos",
            },
        ),
        examples="gte-modernbert-base",
    ),
    # ---------------------------------------------------------------- decoder-based pooling
    # Qwen3-Embedding: a Qwen3 causal LM checkpoint whose last token's hidden state is the
    # embedding; optimum's RBLNQwen3Model compiles its prefill to return every position's
    # hidden state (no LM head).
    PoolingDecoderFamily(
        "qwen3-embedding",
        "Qwen3ForCausalLM",
        "RBLNQwen3Model",
        {"": EMBED_TEST},
        decoder_family="qwen3",
        examples="Qwen3-Embedding-0.6B",
    ),
    # Qwen3-Reranker: the causal LM asked "yes" or "no"; vLLM reads it as a classifier whose
    # score is sigmoid(logit("yes") - logit("no")) at the last token. The compiled model is
    # the ordinary causal LM (its prefill's last-token logits).
    PoolingDecoderFamily(
        "qwen3-reranker",
        "Qwen3ForSequenceClassification",
        "RBLNQwen3ForCausalLM",
        {"": EMBED_TEST},
        decoder_family="qwen3",
        task="classify",
        hf_overrides={
            "architectures": ["Qwen3ForSequenceClassification"],
            "classifier_from_token": ["no", "yes"],
            "is_original_qwen3_reranker": True,
        },
        recognised_by=("is_original_qwen3_reranker",),
        examples="Qwen3-Reranker-0.6B",
    ),
    # ---------------------------------------------------------------- speech
    # openai/whisper-*: a log-mel audio encoder run once per request into the request's
    # cross-attention slot, and a decoder whose compiled batch rows step together
    SpeechFamily(
        "whisper",
        "WhisperForConditionalGeneration",
        "RBLNWhisperForConditionalGeneration",
        {"": SPEECH_TEST},
        module="whisper",
        examples="whisper-small, whisper-large-v3",
    ),
    # Qwen/Qwen3-ASR-*-hf: a Qwen3 LM whose prompt carries a clip's audio-tower features at
    # its <|audio_pad|> tokens (no cross-attention), so it is served as a vision-language
    # model is, behind vLLM's transcription routes
    VisionFamily(
        "qwen3_asr",
        "Qwen3ASRForConditionalGeneration",
        "RBLNQwen3ASRForConditionalGeneration",
        {"": SPEECH_TEST},
        module="qwen3_asr",
        declaration="RBLNQwen3ASRDeclaration",
        inputs=("audio",),
        max_images=1,
        vision_tower="RBLNQwen3ASREncoder",
        language_family="qwen3",
        language_submodule="",
        vision_submodule="audio_tower",
        examples="Qwen3-ASR-0.6B-hf, Qwen3-ASR-1.7B-hf",
        notes="one clip per prompt (transformers' processor pairs texts and clips one to "
        "one); the transformers (-hf) checkpoint layout, not the original thinker_config one",
    ),
    # ---------------------------------------------------------------- vision-language
    # llava-hf/llava-1.5-*: a CLIP vision tower, a 2-layer MLP projector, a Llama LM
    VisionFamily(
        "llava",
        "LlavaForConditionalGeneration",
        "RBLNLlavaForConditionalGeneration",
        {"": VISION_TEST},
        module="llava",
        declaration="RBLNLlavaDeclaration",
        vision_tower="RBLNCLIPVisionModel",
        language_family="llama",
    ),
    # Qwen/Qwen2-VL-*: a ViT with 2-D rotary positions whose merger maps 2 x 2 patches to one
    # token, and a Qwen2 LM with M-RoPE; images of any size (an image is a variable number of
    # tokens).
    VisionFamily(
        "qwen2_vl",
        "Qwen2VLForConditionalGeneration",
        "RBLNQwen2VLForConditionalGeneration",
        {"": VISION_TEST},
        module="qwen2_vl",
        mrope=True,
        declaration="RBLNQwen2VLDeclaration",
        inputs=("image", "video"),
        vision_tower="RBLNQwen2VisionTransformerPretrainedModel",
        language_family="qwen2",
        language_submodule="",
        vision_submodule="visual",
    ),
    # Salesforce/blip2-opt-*: a ViT, a Q-Former whose learned queries become the image's
    # tokens, a linear projection, an OPT LM; the processor puts the image before the text.
    VisionFamily(
        "blip2",
        "Blip2ForConditionalGeneration",
        "RBLNBlip2ForConditionalGeneration",
        {"": VISION_TEST},
        module="blip2",
        vision_tower="RBLNBlip2VisionModel",
        language_family="opt",
        max_images=1,
        images_at_start=True,
        notes="one image per prompt, before the text (no placeholder in the prompt)",
    ),
    # llava-hf/llava-v1.6-*: LLaVA over several tiles of an image ("any resolution"); an image
    # is as many tokens as its size and aspect ratio make
    VisionFamily(
        "llava_next",
        "LlavaNextForConditionalGeneration",
        "RBLNLlavaNextForConditionalGeneration",
        {"": VISION_TEST},
        module="llava_next",
        declaration="RBLNLlavaNextDeclaration",
        vision_tower="RBLNCLIPVisionModel",
        language_family="llama",
    ),
    # HuggingFaceM4/Idefics3-*, SmolVLM: an encoder over tiles of an image plus a global tile,
    # a pixel-shuffle connector, a Llama LM (the artifact's text_model)
    VisionFamily(
        "idefics3",
        "Idefics3ForConditionalGeneration",
        "RBLNIdefics3ForConditionalGeneration",
        {"": VISION_TEST},
        module="idefics3",
        declaration="RBLNIdefics3Declaration",
        vision_tower="RBLNIdefics3VisionTransformer",
        language_family="llama",
        language_submodule="text_model",
    ),
    # google/paligemma-*: a SigLIP tower, a linear projector, a Gemma LM reading the whole
    # prompt (image and text) as a bidirectional prefix
    VisionFamily(
        "paligemma",
        "PaliGemmaForConditionalGeneration",
        "RBLNPaliGemmaForConditionalGeneration",
        {"": VISION_TEST},
        module="paligemma",
        declaration="RBLNPaliGemmaDeclaration",
        vision_tower="RBLNSiglipVisionModel",
        language_family="gemma",
        max_images=1,
        images_at_start=True,
        prefix_caching=False,
        chunked_prefill=False,
        tiny_revision=1,  # 1: num_image_tokens on text_config only, as transformers 5 saves it
        notes="prefix-LM: the whole prompt attends bidirectionally, so it is prefilled in one "
        "call from position 0 (no chunked prefill, no prefix caching); one image per prompt, "
        "before the text",
    ),
    # google/gemma-3-*-it: a SigLIP tower, a pooling projector, the Gemma3 LM (sliding and
    # global layers) whose prefill reads each image's tokens bidirectionally
    VisionFamily(
        "gemma3_vl",
        "Gemma3ForConditionalGeneration",
        "RBLNGemma3ForConditionalGeneration",
        {"": VISION_TEST},
        module="gemma3_vl",
        declaration="RBLNGemma3Declaration",
        vision_tower="RBLNSiglipVisionModel",
        language_family="gemma3",
        prefix_caching=False,
        chunked_prefill=False,
        tiny_revision=1,  # 1: Gemma's newline tokens (gemma3_vl.TINY_NEWLINE_TOKENS)
        notes="a prompt is prefilled in one call from position 0 (optimum-rbln's Gemma3 "
        "prefill masks from the call's start and routes image tokens to a bidirectional "
        "graph), so no chunked prefill; no prefix caching (that, and sliding-window layers); "
        "eager attention only",
    ),
    # google/gemma-4-*: a Gemma 4 tower (2-D patch positions, pooled 3 x 3), a projector and
    # the Gemma 4 LM (sliding and full layers, per-layer inputs), prefilled causally
    VisionFamily(
        "gemma4_vl",
        "Gemma4ForConditionalGeneration",
        "RBLNGemma4ForConditionalGeneration",
        {"": VISION_TEST},
        module="gemma4_vl",
        declaration="RBLNGemma4Declaration",
        vision_tower="RBLNGemma4VisionModel",
        language_family="gemma4",
        prefix_caching=False,
        chunked_prefill=False,
        notes="prompts are prefilled whole and causally, as transformers runs a checkpoint "
        "without use_bidirectional_attention (optimum-rbln's image_prefill graphs attend "
        "bidirectionally on every layer: one with 'vision' or 'all' is refused); the text "
        "family's refusals apply (KV sharing: E2B, E4B; experts: 26B-A4B); images only",
    ),
    # Qwen/Qwen2.5-VL-*: Qwen2-VL with a SwiGLU tower whose layers but a few attend within
    # windows; the tower is compiled for a list of lengths (a skinny image pads its windows).
    VisionFamily(
        "qwen2_5_vl",
        "Qwen2_5_VLForConditionalGeneration",
        "RBLNQwen2_5_VLForConditionalGeneration",
        {"": VISION_TEST},
        module="qwen2_5_vl",
        mrope=True,
        declaration="RBLNQwen2_5_VLDeclaration",
        inputs=("image", "video"),
        vision_tower="RBLNQwen2_5_VisionTransformerPretrainedModel",
        language_family="qwen2",
        language_submodule="",
        vision_submodule="visual",
    ),
    # Qwen/Qwen3-VL-*: a ViT over 16-pixel patches whose inner layers' features ("deepstack")
    # are added to the first decoder layers' hidden states at the image's positions; a Qwen3
    # LM with interleaved M-RoPE.
    VisionFamily(
        "qwen3_vl",
        "Qwen3VLForConditionalGeneration",
        "RBLNQwen3VLForConditionalGeneration",
        {"": VISION_TEST},
        module="qwen3_vl",
        mrope=True,
        declaration="RBLNQwen3VLDeclaration",
        inputs=("image", "video"),
        vision_tower="RBLNQwen3VLVisionModel",
        language_family="qwen3",
        language_submodule="",
        vision_submodule="visual",
    ),
    # Qwen/Qwen3-VL-*-A*B: Qwen3-VL with a mixture-of-experts LM (custom_moe_glu)
    VisionFamily(
        "qwen3_vl_moe",
        "Qwen3VLMoeForConditionalGeneration",
        "RBLNQwen3VLMoeForConditionalGeneration",
        {"": VISION_TEST},
        module="qwen3_vl_moe",
        mrope=True,
        declaration="RBLNQwen3VLMoeDeclaration",
        inputs=("image", "video"),
        vision_tower="RBLNQwen3VLMoeVisionModel",
        language_family="qwen3_moe",
        language_submodule="",
        vision_submodule="visual",
    ),
    # Qwen/Qwen3.5-*: Qwen3-VL's tower (no deepstack) before a hybrid LM of gated-delta-net
    # linear-attention layers (per-sequence state rows, not KV blocks) and a few full ones.
    VisionFamily(
        "qwen3_5",
        "Qwen3_5ForConditionalGeneration",
        "RBLNQwen3_5ForConditionalGeneration",
        {"": VISION_TEST},
        module="qwen3_5",
        mrope=True,
        declaration="RBLNQwen3_5Declaration",
        inputs=("image", "video"),
        vision_tower="RBLNQwen3_5VisionModel",
        language_family="qwen3_5_text",
        language_submodule="",
        vision_submodule="visual",
        prefix_caching=False,
        chunked_prefill=False,
        notes="linear-attention layers keep one state row per sequence, built from the "
        "prompt's first token (optimum-rbln's prefill cannot start past 0): prompts are "
        "prefilled whole, without prefix caching; flash attention only",
    ),
    # LGAI-EXAONE/EXAONE-4.5-*: Qwen2.5-VL's windowed tower before an EXAONE-4 LM whose
    # layers alternate sliding-window and full attention (compiled cache_impl "hybrid"), with
    # plain 1-D positions. rbln-ray serves no text-only EXAONE-4 (optimum-rbln 0.12 has none).
    VisionFamily(
        "exaone4_5",
        "Exaone4_5_ForConditionalGeneration",
        "RBLNExaone4_5_ForConditionalGeneration",
        {"": VISION_TEST},
        module="exaone4_5",
        declaration="RBLNExaone4_5Declaration",
        inputs=("image", "video"),
        vision_tower="RBLNExaone4_5_VisionModel",
        language_family="exaone4",
        language_submodule="",
        vision_submodule="visual",
        prefix_caching=False,
        notes="sliding-window layers: a request's cache slot holds only its last window, so "
        "no cached prefix can be adopted",
    ),
)

FAMILIES: dict[str, Family] = {f.name: f for f in _FAMILIES}
DECODERS: dict[str, DecoderFamily] = {f.name: f for f in _FAMILIES if isinstance(f, DecoderFamily)}
ENCODERS: dict[str, EncoderFamily] = {f.name: f for f in _FAMILIES if isinstance(f, EncoderFamily)}
VISION: dict[str, VisionFamily] = {f.name: f for f in _FAMILIES if isinstance(f, VisionFamily)}
POOLING_DECODERS: dict[str, PoolingDecoderFamily] = {
    f.name: f for f in _FAMILIES if isinstance(f, PoolingDecoderFamily)
}
SPEECH: dict[str, SpeechFamily] = {f.name: f for f in _FAMILIES if isinstance(f, SpeechFamily)}
# What an architecture alone names (a pooling decoder's checkpoint is its decoder's).
_BY_ARCH: dict[str, Family] = {
    f.architecture: f for f in _FAMILIES if not isinstance(f, PoolingDecoderFamily)
}
# What a compiled artifact's rbln_config.json cls_name names (the first family compiled with
# that class: a decoder before a pooling family reading the same causal LM).
_BY_CONFIG_CLASS: dict[str, Family] = {}
for _f in _FAMILIES:
    _BY_CONFIG_CLASS.setdefault(_f.config_class, _f)

# The cost model (rbln_ray.npu, below this layer) counts MLP matrices by model_type.
declare_ungated_mlp(f.model_type for f in DECODERS.values() if not f.gated_mlp)

# optimum-rbln 0.12 classes rbln-ray does not serve, and why (refused with the reason).
UNSUPPORTED: dict[str, str] = {
    "ExaoneForCausalLM": "RBLNExaoneForCausalLM compiles EXAONE 3.x, whose modeling code is "
    "Hub remote code only (transformers 5.15.1 ships exaone4/exaone4_5/exaone_moe, not "
    "'exaone'), so no tiny model can be built here to verify it",
    "MidmLMHeadModel": "RBLNMidmLMHeadModel compiles Mi:dm, whose modeling code is Hub remote "
    "code only (no 'midm' in transformers 5.15.1), so no tiny model can be built here",
    # vision-language
    "Qwen3_5MoeForConditionalGeneration": "optimum-rbln 0.12 has no RBLNQwen3_5Moe class",
    "Qwen3_5MoeForCausalLM": "optimum-rbln 0.12 has no RBLNQwen3_5Moe class",
    "T5EncoderModel": "vLLM 0.30 has no T5 model (no front end, and no plain vLLM-CPU "
    "reference to verify against); optimum-rbln 0.12's RBLNT5EncoderModel compiles it",
}


def family(name: str) -> Family:
    """A family by its name (``-`` and ``_`` alike: ``qwen2-vl`` is ``qwen2_vl``)."""
    found = FAMILIES.get(name) or FAMILIES.get(name.replace("-", "_"))
    if found is None:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return found


def family_for_architectures(archs: Iterable[str], where: str = "model") -> Family:
    """The family of the first supported architecture, else an error naming the supported
    ones (and why, for architectures rbln-ray refuses)."""
    archs = list(archs)
    for arch in archs:
        if arch in _BY_ARCH:
            return _BY_ARCH[arch]
    reasons = [f"{a}: {UNSUPPORTED[a]}" for a in archs if a in UNSUPPORTED]
    raise UnsupportedModelError(
        f"{where}: architecture {archs or 'unknown'} is not supported by rbln-ray"
        + (f" ({'; '.join(reasons)})" if reasons else "")
        + f"; supported: {', '.join(f.architecture for f in DECODERS.values())}"
        + f"; for embeddings and scores: {', '.join(f.architecture for f in ENCODERS.values())}"
        + f"; with images: {', '.join(f.architecture for f in VISION.values())}"
        + f"; speech to text: {', '.join(f.architecture for f in SPEECH.values())}"
    )


def family_for_config(config: Mapping[str, Any] | Any, where: str = "model") -> Family:
    archs = config.get("architectures") if isinstance(config, Mapping) else None
    if archs is None and not isinstance(config, Mapping):
        archs = getattr(config, "architectures", None)
    return family_for_architectures(archs or [], where)


def family_for_dir(model_dir: str | Path) -> Family:
    """The family of an HF or compiled model directory (its ``config.json``)."""
    path = Path(model_dir) / HF_CONFIG
    if not path.is_file():
        raise UnsupportedModelError(f"{model_dir}: no {HF_CONFIG}")
    return family_for_config(json.loads(path.read_text()), where=str(model_dir))


def kind_of_dir(model_dir: str | Path) -> Family | None:
    """The family of a directory, or None when it declares no architecture rbln-ray knows."""
    return next((_BY_ARCH[a] for a in architectures(model_dir) if a in _BY_ARCH), None)


def encoder_for_dir(model_dir: str | Path) -> EncoderFamily | None:
    """The encoder family of a directory, or None for anything else."""
    found = kind_of_dir(model_dir)
    return found if isinstance(found, EncoderFamily) else None


def vision_for_dir(model_dir: str | Path) -> VisionFamily | None:
    """The vision-language family of a directory, or None for anything else."""
    found = kind_of_dir(model_dir)
    return found if isinstance(found, VisionFamily) else None


def speech_for_dir(model_dir: str | Path) -> SpeechFamily | None:
    """The speech-to-text family of a directory, or None for anything else."""
    found = kind_of_dir(model_dir)
    return found if isinstance(found, SpeechFamily) else None


def pooling_decoder_for(config: Mapping[str, Any] | Any) -> PoolingDecoderFamily | None:
    """The pooling family of a decoder checkpoint served with ``runner="pooling"``, from its
    config as vLLM sees it (``hf_overrides`` applied), or None when rbln-ray serves no such
    pooling for it: a marked reranker first, else its decoder family's embedder."""

    def get(key: str) -> Any:
        return config.get(key) if isinstance(config, Mapping) else getattr(config, key, None)

    archs = list(get("architectures") or [])
    for f in POOLING_DECODERS.values():
        if f.recognised_by and f.architecture in archs and all(get(k) for k in f.recognised_by):
            return f
    decoder = next((_BY_ARCH[a] for a in archs if a in _BY_ARCH), None)
    return embedder_of(decoder) if isinstance(decoder, DecoderFamily) else None


def embedder_of(decoder: Family) -> PoolingDecoderFamily | None:
    """The embedding family of a decoder family's checkpoints, if rbln-ray serves one."""
    return next(
        (
            f
            for f in POOLING_DECODERS.values()
            if f.decoder_family == decoder.name and f.task == "embed" and not f.recognised_by
        ),
        None,
    )


def family_for_config_class(cls_name: str) -> Family | None:
    """The family of a compiled artifact from its ``rbln_config.json`` ``cls_name``."""
    return _BY_CONFIG_CLASS.get(cls_name)


def artifact_family(model_dir: str | Path, cls_name: str) -> Family:
    """The family a compiled directory is served as, in one lookup: its ``config.json``
    architecture's, except that a decoder's checkpoint compiled as one of its pooling
    families (``cls_name``, its ``rbln_config.json`` class: e.g. ``RBLNQwen3ModelConfig``,
    the Qwen3 embedder) is that family. Raises :class:`UnsupportedModelError` naming the
    supported architectures. The record's ``artifact`` says how to read the directory."""
    found = family_for_dir(model_dir)
    compiled = _BY_CONFIG_CLASS.get(cls_name)
    if (
        isinstance(compiled, PoolingDecoderFamily)
        and isinstance(found, DecoderFamily)
        and compiled.decoder_family == found.name
    ):
        return compiled
    return found


def get_rbln_model_info(config: Mapping[str, Any] | Any) -> tuple[str, str]:
    """(family name, optimum-rbln class name) of an HF config, as vllm-rbln's function of the
    same name returns; raises :class:`UnsupportedModelError` naming the supported ones."""
    f = family_for_config(config)
    return f.name, f.optimum_class
