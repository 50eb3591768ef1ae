"""Compiling a vision-language model, and its HF processor.

Why apart from the decoder compile: optimum-rbln compiles a vision-language model as several
graphs (the vision tower, the projector, and a decoder-only language model that takes
``inputs_embeds``), saved as submodule directories of one artifact. The compile settings are
the language model's; the family's code (its contract, :class:`rbln_ray.families.contract.
VisionCode`) may adjust or refuse them (``compile_settings``: Qwen3.5 compiles flash
attention and one full-batch decode graph only) and adds what its tower needs
(``vision_rbln_config``) and what its artifact needs after saving (``after_compile``).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rbln_ray.compile.settings import CompileSettings
from rbln_ray.families.registry import VisionFamily, vision_for_dir

logger = logging.getLogger(__name__)


def compile_vision_language(
    hf_dir: str | Path, out_dir: str | Path, settings: CompileSettings, family: VisionFamily
) -> Path:
    """Compile ``hf_dir`` with its optimum-rbln class; returns ``out_dir``.

    The compile settings are the language model's: batch, length, attention, KV blocks. It
    is compiled with ``use_inputs_embeds``, as optimum-rbln requires for every vision-language
    model, and what the family's module requires of it (``language_rbln_config``); the vision
    tower with optimum's defaults (one image per call) plus what the family's module adds.
    """
    from rbln_ray.emulator.switch import require_runtime

    require_runtime("compile a model")
    import optimum.rbln

    hf_config = json.loads((Path(hf_dir) / "config.json").read_text())
    text_config = hf_config.get("text_config") or hf_config
    code = family.code()
    settings = code.compile_settings(settings)  # what the family compiles (or refuses)
    language = settings.with_max_seq_len(text_config).rbln_config(use_inputs_embeds=True)
    # what the family's decoder must be compiled with whatever the settings say (e.g.
    # PaliGemma's prefix-LM prefill takes an attention mask)
    language.update(code.language_rbln_config(hf_dir, language))
    logger.info("compiling %s %s -> %s (language model %s)", family.name, hf_dir, out_dir, language)
    if family.language_submodule:
        rbln_config: dict[str, Any] = {family.language_submodule: language}
    else:
        rbln_config = dict(language)
    vision = code.vision_rbln_config(hf_dir)
    logger.info("vision tower %s: %s", family.vision_tower, vision or "optimum's defaults")
    rbln_config.update(vision)
    cls = getattr(optimum.rbln, family.optimum_class)
    config = code.hf_config(hf_dir)
    model = cls.from_pretrained(
        str(hf_dir),
        export=True,
        rbln_create_runtimes=False,
        rbln_config=rbln_config,
        **({"config": config} if config is not None else {}),
    )
    out = Path(out_dir)
    model.save_pretrained(out)
    code.after_compile(hf_dir, out)
    return out


def load_hf_processor(model_dir: str | Path) -> Any:
    """The HF processor of a vision-language directory (HF or compiled), as its family loads
    it (its contract's ``load_processor``: e.g. Qwen2-VL's image-only processor)."""
    family = vision_for_dir(model_dir)
    if family is None:
        raise ValueError(f"{model_dir} is not a vision-language model rbln-ray serves")
    return family.code().load_processor(model_dir)
