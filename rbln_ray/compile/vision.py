"""Vision-language models: which architectures rbln-ray serves with image inputs, and how
they are compiled.

Why apart from :mod:`.zoo`: optimum-rbln compiles a vision-language model as several graphs
(the vision tower, the projector, and a decoder-only language model that takes
``inputs_embeds``), saved as submodule directories of one artifact. The language model is an
ordinary compiled decoder (its own ``rbln_config.json`` under ``language_model/``), so the
scheduler, the KV block mapping and decoding are the text path's; what differs is the
prefill, whose input embeddings carry the image features at the image placeholder tokens.

Supported means what it means in the zoo: a tiny model of the family, built locally by
:func:`rbln_ray.models.build_tiny_vlm`, compiled with optimum-rbln 0.12 on the emulator and
served by ``vllm.LLM`` with ``multi_modal_data`` is greedy token-exact against transformers'
``generate`` on the same processor inputs (``tests/vllm_plugin/test_vision_language.py``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rbln_ray.common.artifact_files import architectures
from rbln_ray.compile.settings import rbln_kwargs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VisionLanguageFamily:
    """One image-text-to-text architecture optimum-rbln 0.12 compiles."""

    name: str  # rbln-ray's family name (``rbln-ray build-model <name>``)
    architecture: str  # ``config.json`` ``architectures[0]``
    optimum_class: str
    vision_tower: str  # what encodes the image (the optimum-rbln class of the tower)
    language_family: str  # the zoo family of its language model

    @property
    def config_class(self) -> str:
        return self.optimum_class + "Config"


VISION_FAMILIES: dict[str, VisionLanguageFamily] = {
    # llava-hf/llava-1.5-*: a CLIP vision tower, a 2-layer MLP projector, a Llama LM
    "llava": VisionLanguageFamily(
        name="llava",
        architecture="LlavaForConditionalGeneration",
        optimum_class="RBLNLlavaForConditionalGeneration",
        vision_tower="RBLNCLIPVisionModel",
        language_family="llama",
    ),
}

# The submodule directory (and nested rbln_config key) of every family's language model.
LANGUAGE_MODEL = "language_model"


def vision_family_for_dir(model_dir: str | Path) -> VisionLanguageFamily | None:
    """The vision-language family of an HF or compiled directory, or None for anything else."""
    by_arch = {f.architecture: f for f in VISION_FAMILIES.values()}
    return next((by_arch[a] for a in architectures(model_dir) if a in by_arch), None)


def compile_vision_language(
    hf_dir: str | Path, out_dir: str | Path, *, batch_size: int, max_seq_len: int, **settings: Any
) -> Path:
    """Compile ``hf_dir`` with its optimum-rbln class; returns ``out_dir``.

    The compile settings (those of :class:`~rbln_ray.compile.settings.CompileSettings`) are
    the language model's: batch, length, attention, KV blocks. It is compiled with
    ``use_inputs_embeds``, as optimum-rbln requires for every vision-language model; the
    vision tower with optimum's defaults (one image per call).
    """
    from rbln_ray.emulator.switch import require_runtime

    family = vision_family_for_dir(hf_dir)
    if family is None:
        raise ValueError(f"{hf_dir} is not a vision-language model rbln-ray compiles")
    require_runtime("compile a model")
    import optimum.rbln

    kwargs = rbln_kwargs(batch_size=batch_size, max_seq_len=max_seq_len, **settings)
    kwargs.pop("rbln_create_runtimes")
    language = {key.removeprefix("rbln_"): value for key, value in kwargs.items()}
    language["use_inputs_embeds"] = True
    logger.info("compiling %s %s -> %s (language model %s)", family.name, hf_dir, out_dir, language)
    cls = getattr(optimum.rbln, family.optimum_class)
    model = cls.from_pretrained(
        str(hf_dir),
        export=True,
        rbln_create_runtimes=False,
        rbln_config={LANGUAGE_MODEL: language},
    )
    out = Path(out_dir)
    model.save_pretrained(out)
    return out
