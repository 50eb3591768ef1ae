"""Torch dtypes from the names optimum-rbln and the emulator store in configs and graphs."""

from __future__ import annotations

from typing import Any


def torch_dtype(name: Any) -> Any:
    """``torch.float16`` from ``"float16"``, ``"torch.float16"`` or the dtype itself."""
    import torch

    if isinstance(name, torch.dtype):
        return name
    return getattr(torch, str(name).replace("torch.", ""))
