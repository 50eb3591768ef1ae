"""Compile a Hugging Face directory of a supported family, as that family needs.

Why a layer over :func:`.optimum_compile.compile_hf_model`: the architecture check, the
per-family optimum options (:meth:`rbln_ray.compile.zoo.ModelFamily.compile_options`) and the
translation of optimum-rbln's config rejections into one clear error belong to every
compile rbln-ray starts (``rbln-ray compile``, an engine given an uncompiled directory), not
to the emulator, which must compile whatever optimum hands it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from rbln_ray.compile.zoo import ModelFamily, family_for_dir

logger = logging.getLogger(__name__)


class CompileConfigError(ValueError):
    """optimum-rbln rejected a compile setting or a model config value (message names it)."""


def compile_model(hf_dir: str | Path, out_dir: str | Path, **settings: Any) -> Path:
    """Compile ``hf_dir`` into ``out_dir``; ``settings`` as for ``compile_hf_model``.

    Raises :class:`~rbln_ray.compile.zoo.UnsupportedModelError` for an architecture rbln-ray
    does not serve (before loading any weights) and :class:`CompileConfigError` when
    optimum-rbln rejects a setting or config value.
    """
    from rbln_ray.compile.optimum_compile import compile_hf_model

    hf_dir = Path(hf_dir)
    family = family_for_dir(hf_dir)
    hf_config = json.loads((hf_dir / "config.json").read_text())
    for caveat in family.caveats(hf_config):
        logger.warning("%s (%s): %s", hf_dir, family.architecture, caveat)
    rbln_extra, hf_kwargs = family.compile_options(hf_config, settings)
    try:
        return compile_hf_model(hf_dir, out_dir, hf_kwargs=hf_kwargs, **{**settings, **rbln_extra})
    except (ValueError, NotImplementedError) as exc:
        # optimum-rbln validates its config (rbln_config classes, _update_rbln_config,
        # attention and sliding-window limits) with ValueError / NotImplementedError.
        logger.debug("optimum-rbln rejected the compile of %s", hf_dir, exc_info=True)
        raise CompileConfigError(_message(family, hf_dir, settings, exc)) from None


def _message(family: ModelFamily, hf_dir: Path, settings: dict[str, Any], exc: Exception) -> str:
    shown = ", ".join(f"{k}={v}" for k, v in sorted(settings.items()) if v is not None)
    return (
        f"optimum-rbln cannot compile {hf_dir} ({family.architecture} via "
        f"{family.optimum_class}) with {shown or 'default settings'}: "
        f"{type(exc).__name__}: {exc}"
    )
