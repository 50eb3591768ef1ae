"""Compile a Hugging Face decoder directory with optimum-rbln's own code path.

Why: tests, demos and the CLI need compiled artifacts; going through optimum's real
``from_pretrained(export=True)`` + ``save_pretrained`` keeps the artifact identical in layout
to one compiled on an RBLN host (only the ``.rbln`` payloads differ under the emulator).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rbln_ray.emulator.switch import ensure_runtime

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
    **rbln_kwargs: Any,
) -> Path:
    """Compile ``hf_dir`` to ``out_dir`` with ``RBLNAutoModelForCausalLM``; returns ``out_dir``.

    Extra ``rbln_kwargs`` are passed as ``rbln_<name>`` (e.g. ``kvcache_num_blocks=8``);
    ``hf_kwargs`` go to the Hugging Face loading as they are (e.g. ``dtype``).
    Runtimes are not created by default, so compiling needs no free device.
    """
    if ensure_runtime() == "none":
        raise RuntimeError(
            "no rebel runtime: install rebel-compiler or set RBLN_RAY_DEVICE=emulated"
        )
    from optimum.rbln import RBLNAutoModelForCausalLM

    kwargs: dict[str, Any] = {
        "rbln_batch_size": batch_size,
        "rbln_max_seq_len": max_seq_len,
        "rbln_attn_impl": attn_impl,
        "rbln_num_devices": num_devices,
        "rbln_use_attention_mask": use_attention_mask,
        "rbln_create_runtimes": create_runtimes,
    }
    if kvcache_partition_len is not None:
        kwargs["rbln_kvcache_partition_len"] = kvcache_partition_len
    if decoder_batch_sizes is not None:
        kwargs["rbln_decoder_batch_sizes"] = list(decoder_batch_sizes)
    kwargs.update({f"rbln_{k}": v for k, v in rbln_kwargs.items()})
    kwargs.update(hf_kwargs or {})
    logger.info("compiling %s -> %s (%s)", hf_dir, out_dir, kwargs)
    model = RBLNAutoModelForCausalLM.from_pretrained(str(hf_dir), export=True, **kwargs)
    out = Path(out_dir)
    model.save_pretrained(out)
    del model
    return out
