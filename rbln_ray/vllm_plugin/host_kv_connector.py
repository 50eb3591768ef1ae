"""``RBLNHostKVConnector``: the host KV tier (:mod:`rbln_ray.vllm_plugin.host_tier`) as a vLLM
KV connector, switched on the way GPU users switch on CPU offloading::

    LLM(model=DIR, kv_transfer_config={"kv_connector": "RBLNHostKVConnector",
                                       "kv_role": "kv_both",
                                       "kv_connector_extra_config": {"host_gib": 64}})
    vllm serve DIR --kv-transfer-config '{"kv_connector": "RBLNHostKVConnector", ...}'

(the Serve config's ``engine_kwargs`` take the same dict). The platform plugin registers the
name with vLLM's ``KVConnectorFactory`` (:func:`register`).

How the work divides, and why not vLLM's worker-side connector hooks: vLLM's scheduler asks
the connector how many tokens past its own prefix cache a waiting request can load
(:meth:`get_num_new_matched_tokens`: the longest run of the request's vLLM block hashes the
tier holds, segment by segment, as the RBLN block plan can place them) and counts them as
computed, in its prefix-cache metrics as external hits (``vllm:external_prefix_cache_*``).
Where those tokens go on the device, and which device blocks must be saved before they are
reused, only the RBLN block plan knows (:class:`~rbln_ray.vllm_plugin.kv_blocks.
OuterBlockManager`); the step's saves and loads travel to the workers in that plan, and the
model runner moves them through Rebellions' runtime transfers (``_fetch_kv_cache`` /
``_update_kv_cache``, :mod:`rbln_ray.vllm_plugin.host_transfer`). vLLM's per-layer worker
hooks (``start_load_kv``, ``save_kv_layer``) address vLLM-owned KV tensors; on RBLN the KV
lives inside the compiled runtime, so they have nothing to do here.

Prefill/decode disaggregation rides on the same tier: a prefill engine (``kv_role:
kv_producer``, or any engine for a request with vLLM's ``kv_transfer_params:
{"do_remote_decode": true}``) saves a prompt's full blocks to the tier right after the step
that computes its last chunk, before its first token leaves the engine, and says so in the
answer's ``kv_transfer_params``; a decode engine on the same tier then finds those blocks as
it finds any prefix (:meth:`get_num_new_matched_tokens`) and loads them.

Settings (``kv_connector_extra_config``): ``host_gib`` (the tier's size on the node, GiB;
default 4), ``root`` (a tmpfs directory; the Serve app names one per Ray node),
``write_through`` (default false: a block's KV is saved when its device reuses the block;
true: every prompt's KV is saved once computed, as vLLM's offloading connector stores
computed blocks, so the node's other replicas find it while this device still holds it, at
one more transfer per prompt).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from rbln_ray.vllm_plugin.host_tier import DEFAULT_ROOT, HostKVTier, hash_bytes, model_key

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger(__name__)

CONNECTOR = "RBLNHostKVConnector"
DEFAULT_HOST_GIB = 4.0


def register() -> None:
    """Make ``kv_connector: RBLNHostKVConnector`` known to vLLM (its public factory)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    with contextlib.suppress(ValueError):  # already registered (the plugin loads per process)
        KVConnectorFactory.register_connector(CONNECTOR, __name__, "RBLNHostKVConnector")


def tier_settings(kv: Any) -> tuple[Path, int] | None:
    """(root, capacity in bytes) of the tier a ``kv_transfer_config`` switches on, or None."""
    if kv is None or kv.kv_connector != CONNECTOR:
        return None
    extra = kv.kv_connector_extra_config or {}
    gib = float(extra.get("host_gib", DEFAULT_HOST_GIB))
    if gib <= 0:
        raise ValueError(f"{CONNECTOR}: host_gib must be positive, not {gib}")
    return tier_root(extra), int(gib * (1 << 30))


def write_through(extra: dict[str, Any]) -> bool:
    """The ``write_through`` setting of a connector config's ``kv_connector_extra_config``.
    Anything but a boolean is refused by name: a quoted ``"false"`` must not switch it on."""
    value = extra.get("write_through", False)
    if not isinstance(value, bool):
        raise ValueError(f"{CONNECTOR}: write_through must be true or false, not {value!r}")
    return value


def tier_root(extra: dict[str, Any], node_id: str | None = None) -> Path:
    """Where a connector config (its ``kv_connector_extra_config``) keeps the tier on Ray node
    ``node_id`` (default: the node :func:`on_node` recorded): its ``root`` when it gives one
    (the same path on every node), else a directory per node, so the replicas of one node
    share its tier, another node's are its own, and several raylets on one machine stay apart
    as nodes of a cluster would."""
    if extra.get("root"):
        return Path(extra["root"])
    node = node_id or extra.get("node_id")
    return DEFAULT_ROOT / node if node else DEFAULT_ROOT


def on_node(kv_transfer_config: Any, node_id: str) -> Any:
    """``kv_transfer_config`` of an engine on Ray node ``node_id``: the node is recorded, for
    :func:`tier_root` and for a prefill's answer (where its KV is)."""
    if kv_transfer_config is None or kv_transfer_config.kv_connector != CONNECTOR:
        return kv_transfer_config
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    extra["node_id"] = node_id
    kv_transfer_config.kv_connector_extra_config = extra
    return kv_transfer_config


def open_tier(vllm_config: VllmConfig) -> HostKVTier | None:
    """The node's tier for this engine's model, if the config switches it on."""
    from rbln_ray.vllm_plugin.platform import compiled_dir

    return tier_for(vllm_config.kv_transfer_config, compiled_dir(vllm_config))


def tier_for(kv_transfer_config: Any, model_dir: str | Path) -> HostKVTier | None:
    """The tier ``kv_transfer_config`` switches on for the compiled model at ``model_dir``
    (also what a Serve replica's cache report reads: :mod:`rbln_ray.serve.kv_events`)."""
    settings = tier_settings(kv_transfer_config)
    if settings is None:
        return None
    from rbln_ray.compile.artifact import load_artifact

    root, capacity = settings
    return HostKVTier(root, capacity, model_key(load_artifact(model_dir).kv_identity()))


class RBLNHostKVMetadata(KVConnectorMetadata):
    """Nothing per step: the step's saves and loads travel in the RBLN block plan."""


class RBLNHostKVConnector(KVConnectorBase_V1):
    """vLLM KV connector of the host KV tier (module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        self.tier = open_tier(vllm_config) if role == KVConnectorRole.SCHEDULER else None
        self.block_size = vllm_config.cache_config.block_size
        self._per_outer = 1
        self._outer_size = self.block_size
        self._exported: dict[str, int] = {}  # request -> prompt tokens its prefill exported
        kv = vllm_config.kv_transfer_config
        extra = (kv.kv_connector_extra_config or {}) if kv else {}
        self.node_id = extra.get("node_id")
        self.write_through = write_through(extra)

    def set_layout(self, outer_size: int, per_outer: int) -> None:
        """The RBLN block plan's sizes (the scheduler sets them: loads fill whole segments)."""
        self._outer_size, self._per_outer = outer_size, per_outer

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int, bool]:
        if self.tier is None:
            return 0, False
        held = self.held_blocks(request.block_hashes, num_computed_tokens // self.block_size)
        tokens = held * self.block_size
        # vLLM computes at least the last prompt token itself
        while tokens and num_computed_tokens + tokens >= request.num_tokens:
            tokens -= self.block_size
        return max(0, tokens), False

    def held_blocks(self, hashes: Sequence[Hashable], first: int) -> int:
        """vLLM blocks past the first ``first`` the tier can place, segment by segment (a
        segment loads from one entry, from its start)."""
        k, covered = self._per_outer, first
        while covered < len(hashes):
            j = covered // k
            segment = hashes[j * k : min((j + 1) * k, len(hashes))]
            hit = self.tier.segment_hit(segment, j * self._outer_size) if self.tier else None
            if hit is None or j * k + hit.blocks <= covered:
                break
            covered = j * k + hit.blocks
            if hit.blocks < len(segment):
                break
        return covered - first

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int):
        return None

    def exported(self, req_id: str, tokens: int) -> None:
        """The scheduler planned saving ``tokens`` of ``req_id``'s prompt to the tier after
        its last prefill chunk (prefill/decode disaggregation)."""
        self._exported[req_id] = self._exported.get(req_id, 0) + tokens

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, Any]:
        """A prefill engine's answer carries what a decode engine needs, in vLLM's
        ``kv_transfer_params`` (the response field P/D proxies forward): the prompt's KV is in
        the node's tier by now (saved before the step's output left the workers), so the
        device blocks need not wait. A decode engine on the same node finds it by the
        prompt's own block hashes; one on another node has it fetched first, by the node and
        the hashes named here (:mod:`rbln_ray.serve.kv_handover`)."""
        tokens = self._exported.pop(request.request_id, None)
        if tokens is None:
            return False, None
        blocks = request.block_hashes[: tokens // self.block_size]
        return False, {
            "do_remote_prefill": True,
            "host_tier": self.tier.root.name if self.tier is not None else None,
            "node_id": self.node_id,
            "exported_tokens": tokens,
            "block_hashes": [hash_bytes(h).hex() for h in blocks],
        }

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return RBLNHostKVMetadata()

    def shutdown(self) -> None:
        if self.tier is not None:
            self.tier.close()

    # ------------------------------------------------------------------ worker side
    # The RBLN model runner moves KV from the step's block plan (module docstring).
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kw: Any):
        return None

    def wait_for_save(self) -> None:
        return None
