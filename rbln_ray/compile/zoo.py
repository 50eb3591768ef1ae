"""The model zoo: which Hugging Face architectures rbln-ray serves, through which optimum-rbln
class, and what each family's compiled graphs need from the serving side.

Why one table: the loader (engine start), ``rbln-ray compile`` / ``build-model`` and the
README's support matrix all answer "is this model supported, and how is it compiled"; they
read it here, so they cannot disagree (a test renders the matrix from this table and compares
it with the README). :func:`get_rbln_model_info` is the lookup Rebellions' vllm-rbln exposes
under the same name (``utils/optimum/registry.py``).

A family is *supported* when a tiny model of it, built locally by
:func:`rbln_ray.models.build_tiny_model`, compiled with optimum-rbln 0.12 on the emulator and
served by ``vllm.LLM`` is greedy token-exact against transformers (``verified_by`` names the
test). optimum-rbln classes rbln-ray cannot build and so cannot verify are listed in
:data:`UNVERIFIED` with the reason; they are refused with that reason rather than served
unchecked.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rbln_ray.compile.encoders import ENCODERS

GREEDY_TEST = "tests/vllm_plugin/test_zoo_greedy.py::test_family_greedy_matches_transformers"
# The four families verified before the zoo, by the original greedy test.
LLM_GREEDY_TEST = "tests/vllm_plugin/test_llm_greedy.py::test_llm_greedy_matches_transformers"


@dataclass(frozen=True)
class ModelFamily:
    """One decoder-only family optimum-rbln 0.12 exports as a causal LM."""

    name: str  # rbln-ray's family name (``rbln-ray build-model <name>``)
    architecture: str  # transformers class, ``config.json`` ``architectures[0]``
    optimum_class: str  # the optimum-rbln class that compiles and runs it
    model_type: str  # ``config.json`` ``model_type``
    # Attention of the family's checkpoints: "full"; "hybrid" (some layers use a
    # sliding-window KV cache, compiled to paged_sliding_window_attn_*); "optional" (every
    # layer slides when config.json sets sliding_window, optimum's cache_impl
    # "sliding_window"; else full).
    attention: str = "full"
    softcap: str = ""  # logit soft-capping optimum compiles for the family, if any
    moe: bool = False  # experts compiled to custom_moe_glu / custom_moe_glu_mxfp4
    # The compiled prefill can start at a multiple of prefill_chunk_size other than 0, which
    # chunked prefill across steps and prefix caching need. False for RBLNGemma3ForCausalLM:
    # its prefill (RBLNDecoderOnlyChunkedMultimodalPrefillMixin) builds the attention mask
    # from position 0 whatever cache_position says.
    prefill_resumable: bool = True
    # attn_impl -> the test that verifies it token-exact under vLLM (None: not verified).
    verified_by: Mapping[str, str] = field(default_factory=dict)
    notes: str = ""

    @property
    def config_class(self) -> str:
        """The optimum-rbln config class name an artifact's ``rbln_config.json`` records."""
        return self.optimum_class + "Config"

    def compile_options(
        self, hf_config: Mapping[str, Any], settings: Any
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """(extra ``rbln_config`` entries, extra Hugging Face loading options) this family is
        compiled with, given its ``config.json`` and the requested ``CompileSettings``.

        - gemma3: optimum-rbln 0.12 forces ``use_attention_mask`` and ``use_position_ids``
          on for Gemma3, and without an ``image_prefill`` phase that makes its attention ops
          prefill *bidirectionally* (``is_bidirectional=True``, ``use_bidirectional_prefill``),
          which a text-only causal LM is not. Compiled with the phases optimum's own
          ``RBLNGemma3ForConditionalGeneration`` gives its language model (prefill,
          image_prefill, decode; embeddings on the host), the text prefill is causal.
        - gpt_oss: optimum-rbln loads gpt-oss in bfloat16 whatever the checkpoint says;
          load it in the checkpoint's own dtype (bfloat16 for OpenAI's, float32 for the
          tiny test model, whose transformers reference runs in float32).
        """
        if self.name == "gemma3":
            chunk = 256  # RBLNGemma3ForCausalLMConfig's prefill_chunk_size
            return {
                "phases": ["prefill", "image_prefill", "decode"],
                "image_prefill_chunk_size": chunk,
                "use_inputs_embeds": True,
            }, {}
        if self.name == "gpt_oss":
            dtype = hf_config.get("dtype") or hf_config.get("torch_dtype")
            return {}, ({"dtype": dtype} if dtype else {})
        return {}, {}

    def caveats(self, hf_config: Mapping[str, Any]) -> list[str]:
        """Config values optimum-rbln 0.12 compiles without error but does not honour."""
        out = []
        softcap = hf_config.get("attn_logit_softcapping")
        if self.name == "gemma2" and softcap is not None:
            out.append(
                f"attn_logit_softcapping={softcap} is not compiled (optimum-rbln 0.12's "
                "attention ops have no soft-capping): attention differs from transformers'"
            )
        return out


def _both(family: str) -> dict[str, str]:
    return {impl: f"{GREEDY_TEST}[{family}-{impl}]" for impl in ("eager", "flash_attn")}


FAMILIES: dict[str, ModelFamily] = {
    f.name: f
    for f in (
        ModelFamily(
            "llama",
            "LlamaForCausalLM",
            "RBLNLlamaForCausalLM",
            "llama",
            verified_by={
                "eager": f"{LLM_GREEDY_TEST}[llama-eager]",
                "flash_attn": f"{LLM_GREEDY_TEST}[llama-flash_attn]",
            },
        ),
        ModelFamily(
            "qwen2",
            "Qwen2ForCausalLM",
            "RBLNQwen2ForCausalLM",
            "qwen2",
            verified_by={
                "eager": f"{LLM_GREEDY_TEST}[qwen2-eager]",
                "flash_attn": f"{GREEDY_TEST}[qwen2-flash_attn]",
            },
        ),
        ModelFamily(
            "qwen3",
            "Qwen3ForCausalLM",
            "RBLNQwen3ForCausalLM",
            "qwen3",
            verified_by={
                "eager": f"{GREEDY_TEST}[qwen3-eager]",
                "flash_attn": f"{LLM_GREEDY_TEST}[qwen3-flash_attn]",
            },
        ),
        ModelFamily(
            "mistral",
            "MistralForCausalLM",
            "RBLNMistralForCausalLM",
            "mistral",
            attention="optional",
            verified_by=_both("mistral"),
            notes="verified with sliding_window set (every layer slides)",
        ),
        ModelFamily(
            "gemma", "GemmaForCausalLM", "RBLNGemmaForCausalLM", "gemma", verified_by=_both("gemma")
        ),
        ModelFamily(
            "gemma2",
            "Gemma2ForCausalLM",
            "RBLNGemma2ForCausalLM",
            "gemma2",
            attention="hybrid",
            softcap="final logits",
            verified_by=_both("gemma2"),
            notes="final-logit soft-capping compiled; attention-logit soft-capping is not "
            "(optimum-rbln 0.12 drops attn_logit_softcapping): the tiny model sets it to None",
        ),
        ModelFamily(
            "gemma3",
            "Gemma3ForCausalLM",
            "RBLNGemma3ForCausalLM",
            "gemma3_text",
            attention="hybrid",
            prefill_resumable=False,
            verified_by=_both("gemma3"),
            notes="text-only; prompts are prefilled whole (no chunked prefill across steps)",
        ),
        ModelFamily(
            "gpt2", "GPT2LMHeadModel", "RBLNGPT2LMHeadModel", "gpt2", verified_by=_both("gpt2")
        ),
        ModelFamily("opt", "OPTForCausalLM", "RBLNOPTForCausalLM", "opt", verified_by=_both("opt")),
        ModelFamily("phi", "PhiForCausalLM", "RBLNPhiForCausalLM", "phi", verified_by=_both("phi")),
        ModelFamily(
            "mixtral",
            "MixtralForCausalLM",
            "RBLNMixtralForCausalLM",
            "mixtral",
            moe=True,
            verified_by=_both("mixtral"),
        ),
        ModelFamily(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            "RBLNQwen2MoeForCausalLM",
            "qwen2_moe",
            moe=True,
            verified_by=_both("qwen2_moe"),
        ),
        ModelFamily(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "RBLNQwen3MoeForCausalLM",
            "qwen3_moe",
            moe=True,
            verified_by=_both("qwen3_moe"),
        ),
        ModelFamily(
            "gpt_oss",
            "GptOssForCausalLM",
            "RBLNGptOssForCausalLM",
            "gpt_oss",
            attention="hybrid",
            moe=True,
            verified_by=_both("gpt_oss"),
            notes="MXFP4 experts (custom_moe_glu_mxfp4), attention sinks",
        ),
    )
}

# optimum-rbln 0.12 causal-LM classes rbln-ray does not serve, and why.
UNVERIFIED: dict[str, str] = {
    "ExaoneForCausalLM": "RBLNExaoneForCausalLM compiles EXAONE 3.x, whose modeling code is "
    "Hub remote code only (transformers 5.15.1 ships exaone4/exaone4_5/exaone_moe, not "
    "'exaone'), so no tiny model can be built here to verify it",
    "MidmLMHeadModel": "RBLNMidmLMHeadModel compiles Mi:dm, whose modeling code is Hub remote "
    "code only (no 'midm' in transformers 5.15.1), so no tiny model can be built here",
    "Gemma4ForCausalLM": "RBLNGemma4ForCausalLM (per-layer inputs, heterogeneous KV caches) is "
    "outside this zoo's scope",
    "Qwen3_5ForCausalLM": "RBLNQwen3_5ForCausalLM needs hybrid linear attention "
    "(rbln.tri_recur_update), which the emulator does not provide",
}


def sliding_window_used(family: ModelFamily, hf_config: Mapping[str, Any]) -> bool:
    """Whether a model of ``family`` with this ``config.json`` compiles sliding-window
    layers (and so serves without prefix caching)."""
    if family.attention == "hybrid":
        return True
    return family.attention == "optional" and hf_config.get("sliding_window") is not None


def support_matrix() -> str:
    """The README's support matrix (Markdown), rendered from :data:`FAMILIES`; a test keeps
    the README's copy equal to it."""

    def test_id(f: ModelFamily, impl: str) -> str:
        ref = f.verified_by.get(impl)
        if not ref:
            return "not verified"
        file, _, case = ref.partition("::")
        return f"`{file.split('/')[-1]}[{case.partition('[')[2]}`"

    sliding = {
        "full": "no",
        "hybrid": "hybrid (per `layer_types`)",
        "optional": "every layer, if `sliding_window` is set",
    }
    rows = [
        "| family | HF architecture | sliding window | MoE | soft-capping | prefix caching "
        "| chunked prefill | eager verified by | flash_attn verified by |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in FAMILIES.values():
        prefix = {
            "full": "on",
            "hybrid": "off (sliding window)",
            "optional": "on; off with a sliding window",
        }[f.attention]
        if not f.prefill_resumable:
            prefix = "off (prefill restarts at 0)"
        moe = ("yes, MXFP4" if f.name == "gpt_oss" else "yes") if f.moe else "no"
        rows.append(
            f"| {f.name} | `{f.architecture}` | {sliding[f.attention]} | {moe} "
            f"| {f.softcap or 'no'} | {prefix} "
            f"| {'on' if f.prefill_resumable else 'off (whole prompt)'} "
            f"| {test_id(f, 'eager')} | {test_id(f, 'flash_attn')} |"
        )
    return "\n".join(rows)


class UnsupportedModelError(ValueError):
    """The model's architecture is not one rbln-ray serves."""


def supported_architectures() -> list[str]:
    return [f.architecture for f in FAMILIES.values()]


def family(name: str) -> ModelFamily:
    if name not in FAMILIES:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def family_for_architectures(archs: Iterable[str], where: str = "model") -> ModelFamily:
    """The family of the first supported architecture, else an error naming the supported
    ones (and why, for optimum classes rbln-ray does not verify)."""
    archs = list(archs)
    by_arch = {f.architecture: f for f in FAMILIES.values()}
    for arch in archs:
        if arch in by_arch:
            return by_arch[arch]
    reasons = [f"{a}: {UNVERIFIED[a]}" for a in archs if a in UNVERIFIED]
    raise UnsupportedModelError(
        f"{where}: architecture {archs or 'unknown'} is not supported by rbln-ray"
        + (f" ({'; '.join(reasons)})" if reasons else "")
        + f"; supported: {', '.join(supported_architectures())}"
        + f"; for embeddings and scores: {', '.join(f.architecture for f in ENCODERS.values())}"
    )


def family_for_config(config: Mapping[str, Any] | Any, where: str = "model") -> ModelFamily:
    archs = config.get("architectures") if isinstance(config, Mapping) else None
    if archs is None and not isinstance(config, Mapping):
        archs = getattr(config, "architectures", None)
    return family_for_architectures(archs or [], where)


def family_for_dir(model_dir: str | Path) -> ModelFamily:
    """The family of an HF or compiled model directory (its ``config.json``)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise UnsupportedModelError(f"{model_dir}: no config.json")
    return family_for_config(json.loads(path.read_text()), where=str(model_dir))


def family_for_config_class(cls_name: str) -> ModelFamily | None:
    """The family of a compiled artifact from its ``rbln_config.json`` ``cls_name``."""
    for f in FAMILIES.values():
        if f.config_class == cls_name:
            return f
    return None


def get_rbln_model_info(config: Mapping[str, Any] | Any) -> tuple[str, str]:
    """(family name, optimum-rbln class name) of an HF config, as vllm-rbln's function of the
    same name returns; raises :class:`UnsupportedModelError` naming the supported ones."""
    f = family_for_config(config)
    return f.name, f.optimum_class
