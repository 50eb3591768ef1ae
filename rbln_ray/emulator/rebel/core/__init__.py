"""``rebel.core``: the emulated subset (``torch_compile``; see that module)."""

from rbln_ray.emulator.rebel.core import torch_compile

__all__ = ["torch_compile"]
