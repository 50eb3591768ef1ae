"""Vision-language models: which architectures rbln-ray serves with image inputs, and how
they are compiled.

Why apart from :mod:`.zoo`: optimum-rbln compiles a vision-language model as several graphs
(the vision tower, the projector, and a decoder-only language model that takes
``inputs_embeds``), saved as submodule directories of one artifact. The language model is an
ordinary compiled decoder, so the scheduler, the KV block mapping and decoding are the text
path's; what differs is the prefill, whose input embeddings carry the image features at the
image placeholder tokens. Where the decoder lives differs by family: LLaVA's is a submodule
(its own ``rbln_config.json`` under ``language_model/``); Qwen2-VL's is the artifact itself
(``RBLNQwen2VLForConditionalGeneration`` is a decoder-only causal LM whose submodule is the
vision tower, ``visual/``), and its graphs take one more input, the M-RoPE position
embeddings (``position_emb``, cos and sin of the 3-D positions), with every prefill and decode.

Supported means what it means in the zoo: a tiny model of the family, built locally by
:func:`rbln_ray.models.build_tiny_vlm`, compiled with optimum-rbln 0.12 on the emulator and
served by ``vllm.LLM`` with ``multi_modal_data`` is greedy token-exact against transformers'
``generate`` on the same processor inputs (``tests/vllm_plugin/test_vision_language.py``).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rbln_ray.common.artifact_files import RBLN_CONFIG, architectures
from rbln_ray.compile.settings import CompileSettings

logger = logging.getLogger(__name__)

# Where an HF directory keeps its image processor's settings (transformers 4, 5).
PREPROCESSOR_CONFIG, PROCESSOR_CONFIG = "preprocessor_config.json", "processor_config.json"


@dataclass(frozen=True)
class VisionLanguageFamily:
    """One image-text-to-text architecture optimum-rbln 0.12 compiles."""

    name: str  # rbln-ray's family name (``rbln-ray build-model <name>``)
    architecture: str  # ``config.json`` ``architectures[0]``
    optimum_class: str
    vision_tower: str  # what encodes the image (the optimum-rbln class of the tower)
    language_family: str  # the zoo family of its language model
    # The submodule (and nested rbln_config key) holding the decoder; "" when the artifact's
    # top level is the decoder (Qwen2-VL).
    language_submodule: str = "language_model"
    # The vision tower's submodule, when it takes compile settings of its own ("" otherwise).
    vision_submodule: str = ""

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
    # Qwen/Qwen2-VL-*: a ViT with 2-D rotary positions whose merger maps 2 x 2 patches to one
    # token, and a Qwen2 LM with M-RoPE; images of any size (resized to multiples of 28 px
    # within the processor's pixel budget), so an image is a variable number of tokens.
    "qwen2_vl": VisionLanguageFamily(
        name="qwen2_vl",
        architecture="Qwen2VLForConditionalGeneration",
        optimum_class="RBLNQwen2VLForConditionalGeneration",
        vision_tower="RBLNQwen2VisionTransformerPretrainedModel",
        language_family="qwen2",
        language_submodule="",
        vision_submodule="visual",
    ),
}


def vision_family_for_dir(model_dir: str | Path) -> VisionLanguageFamily | None:
    """The vision-language family of an HF or compiled directory, or None for anything else."""
    by_arch = {f.architecture: f for f in VISION_FAMILIES.values()}
    return next((by_arch[a] for a in architectures(model_dir) if a in by_arch), None)


def vision_max_patches(model_dir: str | Path) -> int | None:
    """How many patches one image may have for a Qwen2-VL-style vision tower (its compiled
    ``max_seq_len``), or None for families whose tower takes one fixed image size.

    A compiled directory answers from its ``rbln_config.json`` (the largest compiled length);
    an HF directory with what :func:`compile_vision_language` compiles for it: the image
    processor's pixel budget ``max_pixels`` in patches (``max_pixels / patch_size^2``), so
    every image the processor can produce fits.
    """
    family = vision_family_for_dir(model_dir)
    if family is None or not family.vision_submodule:
        return None
    path = Path(model_dir)
    compiled = path / RBLN_CONFIG
    if compiled.is_file():
        visual = json.loads(compiled.read_text()).get(family.vision_submodule) or {}
        lengths = visual.get("max_seq_len")
        if lengths:
            return max(lengths) if isinstance(lengths, list) else int(lengths)
    settings = image_processor_settings(path)
    max_pixels = (settings.get("size") or {}).get("longest_edge") or settings.get("max_pixels")
    if not max_pixels:
        raise ValueError(f"{path}: its image processor names no max_pixels (size.longest_edge)")
    return int(max_pixels) // int(settings.get("patch_size", 14)) ** 2


def image_processor_settings(model_dir: str | Path) -> dict[str, Any]:
    """An HF directory's saved image processor settings: ``preprocessor_config.json``, or
    (as transformers 5 saves a processor) the ``image_processor`` of
    ``processor_config.json``."""
    path = Path(model_dir)
    if (path / PREPROCESSOR_CONFIG).is_file():
        return json.loads((path / PREPROCESSOR_CONFIG).read_text())
    if (path / PROCESSOR_CONFIG).is_file():
        settings = json.loads((path / PROCESSOR_CONFIG).read_text()).get("image_processor")
        if settings:
            return settings
    raise FileNotFoundError(f"{path} has no image processor settings ({PREPROCESSOR_CONFIG})")


def compile_vision_language(
    hf_dir: str | Path, out_dir: str | Path, settings: CompileSettings
) -> Path:
    """Compile ``hf_dir`` with its optimum-rbln class; returns ``out_dir``.

    The compile settings are the language model's: batch, length, attention, KV blocks. It
    is compiled with ``use_inputs_embeds``, as optimum-rbln requires for every vision-language
    model; the vision tower with optimum's defaults (one image per call), and for Qwen2-VL with the
    sequence length of the largest image its processor produces (:func:`vision_max_patches`;
    optimum-rbln has no default for it).
    """
    from rbln_ray.emulator.switch import require_runtime

    family = vision_family_for_dir(hf_dir)
    if family is None:
        raise ValueError(f"{hf_dir} is not a vision-language model rbln-ray compiles")
    require_runtime("compile a model")
    import optimum.rbln

    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    text_config = hf_config.get("text_config") or hf_config
    language = settings.with_max_seq_len(text_config).rbln_config(use_inputs_embeds=True)
    logger.info("compiling %s %s -> %s (language model %s)", family.name, hf_dir, out_dir, language)
    if family.language_submodule:
        rbln_config: dict[str, Any] = {family.language_submodule: language}
    else:
        rbln_config = dict(language)
    if family.vision_submodule:
        patches = vision_max_patches(hf_dir)
        logger.info("vision tower %s: up to %d patches per image", family.vision_tower, patches)
        rbln_config[family.vision_submodule] = {"max_seq_len": patches}
    cls = getattr(optimum.rbln, family.optimum_class)
    model = cls.from_pretrained(
        str(hf_dir), export=True, rbln_create_runtimes=False, rbln_config=rbln_config
    )
    out = Path(out_dir)
    model.save_pretrained(out)
    if family.name == "qwen2_vl":
        # optimum saves the processors AutoProcessor loads, and transformers' Qwen2-VL one
        # needs torchvision: save the image-only one, or the artifact has no image processor
        from rbln_ray.compile.qwen2_vl_processor import load_processor

        load_processor(hf_dir).save_pretrained(out)
    return out


def load_hf_processor(model_dir: str | Path) -> Any:
    """The HF processor of a vision-language directory (HF or compiled): transformers'
    ``AutoProcessor``, or for Qwen2-VL its image-only processor
    (:mod:`rbln_ray.compile.qwen2_vl_processor`)."""
    family = vision_family_for_dir(model_dir)
    if family is not None and family.name == "qwen2_vl":
        from rbln_ray.compile.qwen2_vl_processor import load_processor

        return load_processor(model_dir)
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(model_dir))
