"""The one process-wide change rbln-ray makes to torch: ``F.linear`` swapped for RBLN's linear
op while a graph is traced for compilation.

Why: optimum-rbln compiles a decoder with ``torch.nn.functional.linear`` replaced by
``torch.ops.rbln_custom_ops.linear`` for the duration of the compile
(``RBLNDecoderOnlyModelForCausalLM._compile_model``), so every linear layer becomes the
RBLN op in the graph. A pipeline stage is compiled the same way. The swap is global (torch
offers no scoped override of a Python function), so it is taken under a lock and undone on
every exit, error included; another thread that calls ``F.linear`` meanwhile gets the RBLN
op, which computes the same result.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from rbln_ray.upstream.contract import Requirement, Upstream

UPSTREAM = Upstream("torch", "torch", "2.13.0")
REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement("torch.nn.functional:linear", "rbln_ray/compile/pipeline_compile.py", "attribute"),
)

_SWAP = threading.Lock()


@contextmanager
def rbln_linear_while_compiling() -> Iterator[None]:
    """``torch.nn.functional.linear`` is ``torch.ops.rbln_custom_ops.linear`` inside the block
    (the RBLN runtime, real or emulated, registers the op) and the original after it."""
    import torch

    with _SWAP:
        original = torch.nn.functional.linear
        torch.nn.functional.linear = torch.ops.rbln_custom_ops.linear
        try:
            yield
        finally:
            torch.nn.functional.linear = original
