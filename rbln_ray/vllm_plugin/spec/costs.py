"""The cost model's prior for the speculative-decoding policy: seconds of a decode or
verify call of an artifact, from its ``config.json`` shape on its NPU kind."""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from rbln_ray.npu.cost_model import DeviceSpec, ModelShape, decode_cost, verify_cost


def cost_prior(artifact: Any):
    """``prior(kind, batch, context, width) -> seconds`` for ``artifact``'s graphs."""
    config = json.loads((artifact.path / "config.json").read_text())
    shape = ModelShape.from_hf_config(config, name=artifact.path.name)
    spec = DeviceSpec.from_env()
    devices = artifact.num_devices

    @lru_cache(maxsize=4096)
    def prior(kind: str, batch: int, context: int, width: int) -> float:
        context = (context // 64) * 64  # a prior, not a measurement: coarse is enough
        if kind == "verify" and width > 1:
            return verify_cost(shape, batch, context, width, spec, devices).seconds
        return decode_cost(shape, batch, context, spec, devices).seconds

    return prior
