"""Compile a Hugging Face directory of a supported family, as that family needs.

Why a layer over :func:`.optimum_compile.compile_hf_model`: the architecture check, the
per-family optimum options (``DecoderFamily.compile_options``, :mod:`rbln_ray.families`)
and the translation of optimum-rbln's config rejections into one clear error belong to every
compile rbln-ray starts (``rbln-ray compile``, an engine given an uncompiled directory), not
to the emulator, which must compile whatever optimum hands it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from rbln_ray.compile import lora, quantization
from rbln_ray.compile.settings import TRANSLATED, CompileSettings
from rbln_ray.compile.spec_graphs import SpecGraphError
from rbln_ray.families.registry import (
    POOLING_DECODERS,
    DecoderFamily,
    EncoderFamily,
    SpeechFamily,
    UnsupportedModelError,
    VisionFamily,
    embedder_of,
    family_for_dir,
)

logger = logging.getLogger(__name__)


class CompileConfigError(ValueError):
    """optimum-rbln rejected a compile setting or a model config value (message names it)."""


def compile_model(hf_dir: str | Path, out_dir: str | Path, settings: CompileSettings) -> Path:
    """Compile ``hf_dir`` into ``out_dir`` with ``settings`` (``max_seq_len`` filled from the
    model when unset).

    Raises :class:`~rbln_ray.families.registry.UnsupportedModelError` for an architecture
    rbln-ray does not serve as a decoder (before loading any weights) and
    :class:`CompileConfigError` when optimum-rbln rejects a setting or config value.
    """
    from rbln_ray.compile.optimum_compile import compile_hf_model

    hf_dir = Path(hf_dir)
    family = family_for_dir(hf_dir)
    if not isinstance(family, DecoderFamily):
        raise UnsupportedModelError(f"{hf_dir}: {family.architecture} is not a decoder")
    hf_config = json.loads((hf_dir / "config.json").read_text())
    try:
        settings = family.compile_settings(settings.with_max_seq_len(hf_config))
    except ValueError as exc:
        raise CompileConfigError(f"{hf_dir}: {exc}") from None
    refusals = family.refusals(hf_config)
    if refusals:
        raise CompileConfigError(f"{hf_dir} ({family.architecture}): " + "; ".join(refusals))
    for caveat in family.caveats(hf_config):
        logger.warning("%s (%s): %s", hf_dir, family.architecture, caveat)
    rbln_extra, hf_kwargs = family.compile_options(hf_config)
    if settings.spec_tokens and family.sliding_window_used(hf_config):
        raise CompileConfigError(
            f"spec_tokens={settings.spec_tokens}: {hf_dir} ({family.architecture}) compiles "
            "sliding-window layers, whose decode graphs write one token per call; "
            "speculative decoding's verify graphs need several"
        )
    quant = quantization.for_compile(hf_dir, family, hf_config, settings)
    adapters = lora.for_compile(hf_dir, family, hf_config, settings, quant is not None)
    if quant is not None:
        rbln_extra["quantization"] = quant.as_optimum()
    if adapters:
        rbln_extra["lora_config"] = lora.stage_adapters(adapters, Path(out_dir))
    optimum_class = None
    if settings.purpose == "embed":
        embedder = embedder_of(family)
        if embedder is None:
            raise CompileConfigError(
                f"{hf_dir}: rbln-ray compiles no embedding graph for {family.architecture}; "
                "decoder-based embedders: "
                + ", ".join(f"{f.name} ({f.architecture})" for f in POOLING_DECODERS.values())
            )
        if settings.spec_tokens or quant is not None or adapters:
            raise CompileConfigError(
                f"{hf_dir}: purpose=embed compiles no decode graphs: spec_tokens, "
                "quantization, kv_cache_dtype and lora_modules apply to generation only"
            )
        optimum_class = embedder.optimum_class
    try:
        return compile_hf_model(
            hf_dir,
            out_dir,
            settings,
            extra=rbln_extra,
            hf_kwargs=hf_kwargs,
            optimum_class=optimum_class,
        )
    except SpecGraphError as exc:
        raise CompileConfigError(f"spec_tokens={settings.spec_tokens}: {exc}") from None
    except (ValueError, NotImplementedError) as exc:
        # optimum-rbln validates its config (rbln_config classes, _update_rbln_config,
        # attention and sliding-window limits) with ValueError / NotImplementedError.
        logger.debug("optimum-rbln rejected the compile of %s", hf_dir, exc_info=True)
        raise CompileConfigError(_message(family, hf_dir, settings, exc)) from None


def _message(family: DecoderFamily, hf_dir: Path, settings: CompileSettings, exc: Exception) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in sorted(settings.as_dict().items()) if v is not None)
    return (
        f"optimum-rbln cannot compile {hf_dir} ({family.architecture} via "
        f"{family.optimum_class}) with {shown or 'default settings'}: "
        f"{type(exc).__name__}: {exc}"
    )


def compile_directory(
    hf_dir: str | Path, out_dir: str | Path, settings: CompileSettings, *, pipeline_stages: int = 1
) -> str:
    """Compile any HF directory rbln-ray serves (decoder, encoder, vision-language) into
    ``out_dir``; returns what was compiled, for messages. Raises a ``ValueError`` naming the
    problem (an unsupported architecture before any weights load, a setting that does not
    apply to the model's kind, or optimum-rbln's own rejection)."""
    family = family_for_dir(hf_dir)  # raises naming the supported architectures
    if settings.spec_tokens and (not isinstance(family, DecoderFamily) or pipeline_stages > 1):
        what = "a pipeline" if pipeline_stages > 1 else f"{family.architecture} ({family.kind})"
        raise CompileConfigError(
            f"spec_tokens={settings.spec_tokens}: speculative decoding's verify graphs are "
            f"compiled for single-stage decoders only, not for {what}"
        )
    translated = [k for k in TRANSLATED if getattr(settings, k) is not None]
    if translated and (pipeline_stages > 1 or not isinstance(family, DecoderFamily)):
        what = f"{pipeline_stages}-stage pipelines" if pipeline_stages > 1 else family.architecture
        raise CompileConfigError(
            f"{', '.join(translated)}: compiled for single-stage decoders only, not {what}"
        )
    if settings.spec_tokens and translated:
        raise CompileConfigError(
            f"spec_tokens={settings.spec_tokens} with {', '.join(translated)}: verify graphs "
            "are not compiled for quantized or LoRA artifacts yet"
        )
    if pipeline_stages > 1 and not isinstance(family, DecoderFamily):
        raise CompileConfigError(
            f"{family.architecture}: pipeline stages are served for decoders only"
        )
    if settings.purpose != "generate" and (
        pipeline_stages > 1 or not isinstance(family, DecoderFamily)
    ):
        raise CompileConfigError(
            f"{family.architecture}: purpose={settings.purpose} applies to a decoder compiled "
            "as one stage"
        )
    if isinstance(family, EncoderFamily):
        from rbln_ray.compile.encoders import compile_encoder

        compile_encoder(hf_dir, out_dir, settings, family)
        return f"{family.architecture} encoder ({family.task})"
    if isinstance(family, SpeechFamily):
        from rbln_ray.compile.speech import compile_speech

        compile_speech(hf_dir, out_dir, settings, family)
        return f"{family.architecture} (speech to text)"
    if isinstance(family, VisionFamily):
        from rbln_ray.compile.vision import compile_vision_language

        compile_vision_language(hf_dir, out_dir, settings, family)
        return f"{family.architecture} (vision-language)"
    if pipeline_stages > 1:
        from rbln_ray.compile.pipeline_compile import compile_pipeline

        compile_pipeline(hf_dir, out_dir, pipeline_stages, settings)
        return f"{family.architecture}, {pipeline_stages}-stage pipeline"
    compile_model(hf_dir, out_dir, settings)
    return family.architecture
