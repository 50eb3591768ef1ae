"""Sizing the host KV tier (``rbln-ray plan --host-gib``): what a node's host memory holds of
the cached prefixes its devices would otherwise drop, and what a hit there costs.

Why in the planner: the tier trades host DRAM for prefill compute. An operator needs to know
how many prompts' prefixes ``host_gib`` of a node holds against what its devices' KV caches
hold, and how long bringing one back takes over the host link against computing it: the same
cost model the emulator's timing mode charges (:func:`rbln_ray.npu.cost_model.
host_transfer_cost`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rbln_ray.npu.cost_model import DeviceSpec, ModelShape, host_transfer_cost


@dataclass(frozen=True)
class HostTierSizing:
    host_gib: float  # per node
    tier_tokens: int  # tokens of KV the tier holds per node
    device_tokens: int  # tokens of KV the node's devices hold (the plan's replicas on it)
    prompts: float  # prompts of input_len whose whole prefix the tier holds
    load_ms: float  # one prompt's prefix back from the host
    prefill_ms: float  # the same prefix computed

    def to_dict(self) -> dict:
        return asdict(self)


def size_host_tier(
    shape: ModelShape,
    spec: DeviceSpec,
    host_gib: float,
    input_len: int,
    prefill_ms: float,
    kv_per_device_gib: float,
    devices_per_node: int,
) -> HostTierSizing:
    """The tier of ``host_gib`` per node for ``shape``, against ``devices_per_node`` devices
    of ``kv_per_device_gib`` KV each, for prompts of ``input_len`` whose prefill takes
    ``prefill_ms``."""
    per_token = shape.kv_bytes_per_token
    tier_tokens = int(host_gib * (1 << 30) // per_token)
    device_tokens = int(kv_per_device_gib * (1 << 30) * devices_per_node // per_token)
    return HostTierSizing(
        host_gib=host_gib,
        tier_tokens=tier_tokens,
        device_tokens=device_tokens,
        prompts=tier_tokens / max(1, input_len),
        load_ms=host_transfer_cost(shape, input_len, spec) * 1e3,
        prefill_ms=prefill_ms,
    )


def describe(s: HostTierSizing) -> str:
    return (
        f"host KV tier: {s.host_gib:g} GiB per node holds {s.tier_tokens:,} tokens of KV "
        f"({s.prompts:,.0f} prompts' prefixes; the node's devices hold {s.device_tokens:,}); "
        f"a prompt's prefix comes back in {s.load_ms:.1f} ms where computing it takes "
        f"{s.prefill_ms:.0f} ms"
    )
