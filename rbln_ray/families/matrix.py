"""The support matrices of the docs and the README's catalogue, rendered from the registry (a
test keeps the pages' copies equal to these: ``tests/unit/test_families.py``)."""

from __future__ import annotations

from rbln_ray.families.registry import (
    DECODERS,
    ENCODERS,
    POOLING_DECODERS,
    SPEECH,
    UNSUPPORTED,
    VISION,
    DecoderFamily,
    Family,
)


def _test_id(family: Family, variant: str) -> str:
    ref = family.verified_by.get(variant)
    if not ref:
        return "not verified"
    file, _, case = ref.partition("::")
    name = file.split("/")[-1]
    return f"`{name}[{case.partition('[')[2]}`" if "[" in case else f"`{name}`"


def _decoder_test_id(family: DecoderFamily, attn_impl: str) -> str:
    """What verifies a decoder with ``attn_impl``, or that it is refused (not exact)."""
    if attn_impl in family.refused_attn:
        return "refused at compile (not exact)"
    return _test_id(family, attn_impl)


def decoder_matrix() -> str:
    sliding = {
        "full": "no",
        "hybrid": "hybrid (per `layer_types`)",
        "optional": "every layer, if `sliding_window` is set",
    }
    prefix_caching = {
        "full": "on",
        "hybrid": "off (sliding window)",
        "optional": "on; off with a sliding window",
    }
    rows = [
        "| family | HF architecture | sliding window | MoE | soft-capping | prefix caching "
        "| chunked prefill | eager verified by | flash_attn verified by |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for f in DECODERS.values():
        prefix = prefix_caching[f.attention]
        if not f.prefill_resumable:
            prefix = "off (prefill restarts at 0)"
        moe = ("yes, MXFP4" if f.moe.endswith("mxfp4") else "yes") if f.moe else "no"
        rows.append(
            f"| {f.name} | `{f.architecture}` | {sliding[f.attention]} | {moe} "
            f"| {f.softcap or 'no'} | {prefix} "
            f"| {'on' if f.prefill_resumable else 'off (whole prompt)'} "
            f"| {_decoder_test_id(f, 'eager')} | {_decoder_test_id(f, 'flash_attn')} |"
        )
    return "\n".join(rows)


def encoder_matrix() -> str:
    """Pooling models: the encoders, then the decoders read as embedders or rerankers."""
    tasks = {
        "embed": "`embed`, `/v1/score` (cosine)",
        "classify": "`classify`, `/v1/score`, `/v1/rerank` (cross-encoder)",
    }
    rows = [
        "| family | HF architecture | optimum-rbln class | tasks | e.g. | verified by |",
        "|---|---|---|---|---|---|",
    ]
    for f in [*ENCODERS.values(), *POOLING_DECODERS.values()]:
        arch = f"`{f.architecture}`"
        if f in POOLING_DECODERS.values() and f.hf_overrides:
            arch += " (a causal LM checkpoint, with vLLM's `hf_overrides`)"
        rows.append(
            f"| {f.name} | {arch} | `{f.optimum_class}` | {tasks[f.task]} "
            f"| {f.examples} | {_test_id(f, '')} |"
        )
    return "\n".join(rows)


def speech_matrix() -> str:
    rows = [
        "| family | HF architecture | optimum-rbln class | tasks | e.g. | verified by |",
        "|---|---|---|---|---|---|",
    ]
    for f in SPEECH.values():
        rows.append(
            f"| {f.name} | `{f.architecture}` | `{f.optimum_class}` | {', '.join(f.tasks)} "
            f"| {f.examples} | {_test_id(f, '')} |"
        )
    for v in VISION.values():
        if v.transcribes:  # a decoder over audio features, behind the same routes
            rows.append(
                f"| {v.name} | `{v.architecture}` | `{v.optimum_class}` | transcribe, "
                f"translate | {v.examples} | {_test_id(v, '')} |"
            )
    return "\n".join(rows)


def vision_matrix() -> str:
    rows = [
        "| family | HF architecture | optimum-rbln class | vision tower | language model "
        "| images | videos | prefix caching | chunked prefill | verified by |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in VISION.values():
        if f.transcribes:
            continue  # in the speech matrix
        on = {True: "on", False: "off"}
        rows.append(
            f"| {f.name} | `{f.architecture}` | `{f.optimum_class}` | `{f.vision_tower}` "
            f"| {f.language_family} | {'yes' if 'image' in f.inputs else 'no'} "
            f"| {'yes' if 'video' in f.inputs else 'no'} | {on[f.prefix_caching]} "
            f"| {on[f.chunked_prefill]} | {_test_id(f, '')} |"
        )
    return "\n".join(rows)


def matrices() -> dict[str, str]:
    """Every support matrix, by what it lists."""
    return {
        "decoders": decoder_matrix(),
        "encoders": encoder_matrix(),
        "vision": vision_matrix(),
        "speech": speech_matrix(),
    }


def catalogue() -> str:
    """The README's table: every family by kind (HF architectures), and what is refused; the
    matrices above say how each is served and which test verifies it."""

    def names(families) -> str:
        return ", ".join(f"`{f.architecture}`" for f in families)

    speech = [*SPEECH.values(), *(v for v in VISION.values() if v.transcribes)]
    rows = [
        "| kind | families (HF architecture) | details |",
        "|---|---|---|",
        f"| decoder-only LLMs | {names(DECODERS.values())} "
        "| [Models and families](docs/guides/models.md) |",
        f"| vision-language | {names(v for v in VISION.values() if not v.transcribes)} "
        "| [Vision-language models](docs/guides/vision-language.md) |",
        f"| embeddings and rerankers | {names([*ENCODERS.values(), *POOLING_DECODERS.values()])}"
        " | [Embeddings and rerankers](docs/guides/pooling.md) |",
        f"| speech to text | {names(speech)} | [Speech to text](docs/guides/speech.md) |",
        f"| refused, with the reason | {', '.join(f'`{a}`' for a in UNSUPPORTED)} "
        "| [Models and families](docs/guides/models.md) |",
    ]
    return "\n".join(rows)
