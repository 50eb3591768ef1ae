"""Compile a Hugging Face decoder directory with optimum-rbln's own code path.

Why: engines given an HF directory, the CLI, tests and demos need compiled artifacts, on an
RBLN host and under the emulator alike; going through optimum's real
``from_pretrained(export=True)`` + ``save_pretrained`` keeps the artifact identical in layout
to one compiled on an RBLN host (only the ``.rbln`` payloads differ under the emulator).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rbln_ray.compile.settings import rbln_kwargs
from rbln_ray.emulator.switch import require_runtime

logger = logging.getLogger(__name__)


def compile_hf_model(
    hf_dir: str | Path,
    out_dir: str | Path,
    batch_size: int,
    max_seq_len: int,
    attn_impl: str = "eager",
    kvcache_partition_len: int | None = None,
    num_devices: int = 1,
    decoder_batch_sizes: list[int] | None = None,
    use_attention_mask: bool = False,
    create_runtimes: bool = False,
    hf_kwargs: dict[str, Any] | None = None,
    **extra: Any,
) -> Path:
    """Compile ``hf_dir`` to ``out_dir`` with ``RBLNAutoModelForCausalLM``; returns ``out_dir``.

    ``extra`` settings are passed as ``rbln_<name>`` (e.g. ``kvcache_num_blocks=8``);
    ``hf_kwargs`` go to the Hugging Face loading as they are (e.g. ``dtype``).
    Runtimes are not created by default, so compiling needs no free device.
    """
    require_runtime("compile a model")
    from optimum.rbln import RBLNAutoModelForCausalLM

    kwargs = rbln_kwargs(
        batch_size=batch_size,
        max_seq_len=max_seq_len,
        attn_impl=attn_impl,
        kvcache_partition_len=kvcache_partition_len,
        num_devices=num_devices,
        decoder_batch_sizes=decoder_batch_sizes,
        use_attention_mask=use_attention_mask,
        create_runtimes=create_runtimes,
        **extra,
    )
    kwargs.update(hf_kwargs or {})
    logger.info("compiling %s -> %s (%s)", hf_dir, out_dir, kwargs)
    model = RBLNAutoModelForCausalLM.from_pretrained(str(hf_dir), export=True, **kwargs)
    out = Path(out_dir)
    model.save_pretrained(out)
    del model
    return out
