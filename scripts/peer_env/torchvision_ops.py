"""Start-up hook of the vllm-rbln side environment ONLY (installed there by peer_env.sh as
``_rbln_ray_peer_torchvision.py`` plus a ``.pth`` line that imports it).

Why: vllm-rbln 0.12.0's model registry imports vLLM processors that import torchvision at
top level. PyPI's torchvision 0.28.0 wheel is a CUDA build whose C extension (``_C.so``)
cannot load beside torch 2.13.0+cpu; torchvision then only warns, but its
``_meta_registrations`` unconditionally calls ``torch.library.register_fake`` for
``torchvision::nms`` and ``torchvision::qnms``, which raises ``RuntimeError: operator
torchvision::nms does not exist`` (pytorch/pytorch#122494, pytorch/vision#8985) when the
extension did not define them. Everything else in torchvision guards on ``_has_ops()``.

The fix: define those two operator *schemas* (the same signatures torchvision's C++ code
registers) after ``torchvision.extension`` tried to load ``_C.so`` and just before
``torchvision._meta_registrations`` runs, so the fake-kernel registration finds them.
No kernel is registered: calling ``torchvision.ops.nms`` still fails loudly
(``_assert_has_ops``), which is right, since nothing in a text-only LLM run needs it.

Cost: a ``.pth`` runs in every interpreter of the side env, so this module stays tiny and
imports nothing heavy; torch is imported only when something imports torchvision.
"""

from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder

_SCHEMAS = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
_TRIGGER = "torchvision._meta_registrations"
_LIBRARY = None  # keeps the torch.library.Library (and its definitions) alive


def define_schemas() -> None:
    """Define ``torchvision::nms``/``qnms`` when torchvision's extension failed to load.

    Called just before ``torchvision._meta_registrations`` runs, i.e. after
    ``torchvision.extension`` tried to load ``_C.so``: a working extension owns the
    namespace and is left alone.
    """
    global _LIBRARY
    import torch
    import torchvision.extension

    if torchvision.extension._has_ops() or _LIBRARY is not None:
        return
    lib = torch.library.Library("torchvision", "DEF")
    for schema in _SCHEMAS:
        lib.define(schema)
    _LIBRARY = lib


class _BeforeMetaRegistrations(MetaPathFinder):
    """Runs :func:`define_schemas` once, when torchvision imports its fake-kernel module."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != _TRIGGER:
            return None
        sys.meta_path.remove(self)
        define_schemas()
        return None  # the normal finders import the real module next


if _TRIGGER not in sys.modules:
    sys.meta_path.insert(0, _BeforeMetaRegistrations())
