"""``rebel.compile_context``: groups graphs that share weights and static (KV) buffers."""

from __future__ import annotations

import torch

from rbln_ray.emulator.compiled_model import CompileGroup


class CompileContext:
    """Graphs compiled with the same context share weights and the marked static tensors."""

    def __init__(self, use_weight_sharing: bool = True, **kwargs: object):
        self.use_weight_sharing = use_weight_sharing
        self.group = CompileGroup()

    def mark_static_address(self, tensor: torch.Tensor, name: str | None = None) -> None:
        """Declare ``tensor`` (an input named ``name``) a buffer every graph of the group shares."""
        key = name or f"static_{len(self.group.static_names)}"
        self.group.static_names[key] = tensor
