"""Compile a Hugging Face decoder directory with optimum-rbln's own code path.

Why: engines given an HF directory, the CLI, tests and demos need compiled artifacts, on an
RBLN host and under the emulator alike; going through optimum's real
``from_pretrained(export=True)`` + ``save_pretrained`` keeps the artifact identical in layout
to one compiled on an RBLN host (only the ``.rbln`` payloads differ under the emulator).
With ``spec_tokens`` set, speculative decoding's verify graphs are compiled inside the same
optimum compile (:mod:`rbln_ray.compile.spec_graphs`) and saved beside optimum's files.
"""

from __future__ import annotations

import logging
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from rbln_ray.compile import spec_graphs
from rbln_ray.compile.settings import CompileSettings
from rbln_ray.emulator.switch import require_runtime
from rbln_ray.upstream import optimum_internals

logger = logging.getLogger(__name__)


def compile_hf_model(
    hf_dir: str | Path,
    out_dir: str | Path,
    settings: CompileSettings,
    *,
    extra: dict[str, Any] | None = None,
    hf_kwargs: dict[str, Any] | None = None,
    optimum_class: str | None = None,
) -> Path:
    """Compile ``hf_dir`` to ``out_dir`` with ``RBLNAutoModelForCausalLM`` (or the optimum-rbln
    class named ``optimum_class``, e.g. an embedder's ``RBLNQwen3Model``); returns ``out_dir``.

    ``extra`` are further ``rbln_config`` entries (a family's, e.g. ``phases``); ``hf_kwargs``
    go to the Hugging Face loading as they are (e.g. ``dtype``).
    """
    require_runtime("compile a model")
    from optimum.rbln import RBLNAutoModelForCausalLM

    from rbln_ray.upstream.optimum_models import rbln_class

    cls = rbln_class(optimum_class) if optimum_class else RBLNAutoModelForCausalLM
    kwargs = settings.rbln_kwargs(**(extra or {}))
    kwargs.update(hf_kwargs or {})
    logger.info("compiling %s -> %s (%s)", hf_dir, out_dir, kwargs)
    verify: dict[str, Any] = {}
    with ExitStack() as stack:
        if settings.spec_tokens:
            cls = optimum_internals.decoder_class(hf_dir)  # the causal LM's own class
            build = spec_graphs.build_verify_graphs(settings.spec_tokens)
            stack.enter_context(optimum_internals.extra_graphs(cls, build, verify))
        model = cls.from_pretrained(str(hf_dir), export=True, **kwargs)
    out = Path(out_dir)
    model.save_pretrained(out)
    del model
    if settings.spec_tokens:
        spec_graphs.save_verify_graphs(out, verify, settings.spec_tokens)
    return out
