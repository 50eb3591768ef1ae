"""The worker side of the host KV tier: one RBLN block's cached prefix between the device and
the node's tier (:mod:`rbln_ray.vllm_plugin.host_tier`), through Rebellions' runtime
transfers.

Why a staging buffer: ``rebel.Runtime._fetch_kv_cache(host, block, offset, size, None)`` and
``_update_kv_cache`` move the slots of one block between the device and a host tensor that
mirrors the *whole* KV cache (every layer's K and V buffer back to back, each
``[num_blocks, Hkv, 1, block, D]``; :mod:`rbln_ray.emulator.kv_host`). The worker keeps one
such mirror and packs the block's slots into a compact entry (and back), so the tier stores
only what it holds: ``tokens x`` the model's KV bytes per token.

The layout is derived from the artifact (blocks, block size) and the model's config (layers,
KV heads), and checked against the runtime's own size (``_get_kv_cache_size``): an artifact
whose KV is not ``2 x layers`` equal paged buffers (sliding-window or state layers) cannot
use the tier, and says so at start.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from rbln_ray.upstream import rebel_internals
from rbln_ray.vllm_plugin.host_tier import HostKVTier
from rbln_ray.vllm_plugin.kv_blocks import HostLoad, HostSave

logger = logging.getLogger(__name__)


class HostTierUnsupported(ValueError):
    """An artifact whose KV layout the host tier cannot move (the message says why)."""


@dataclass(frozen=True)
class KVLayout:
    """The paged KV buffers as raw bytes: ``buffers`` of ``[blocks, heads, 1, slots, row]``."""

    buffers: int
    blocks: int
    heads: int
    slots: int
    row: int  # bytes of one head's K (or V) of one token

    @property
    def buffer_bytes(self) -> int:
        return self.blocks * self.heads * self.slots * self.row

    def tokens_bytes(self, tokens: int) -> int:
        """Bytes of ``tokens`` slots in every buffer (an entry's payload)."""
        return self.buffers * self.heads * tokens * self.row


def kv_layout(runtime: Any, artifact: Any, hf_config: Any) -> KVLayout:
    """The runtime's paged KV buffers, from the artifact and the model config, checked
    against the runtime's own size."""
    if artifact.cache_impl != "static" or artifact.state_slots:
        raise HostTierUnsupported(
            f"the host KV tier moves paged KV blocks; {artifact.path.name} also keeps "
            f"{'per-sequence state rows' if artifact.state_slots else artifact.cache_impl} KV"
        )
    layers = int(hf_config.num_hidden_layers)
    heads = int(getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads)
    blocks, slots = artifact.kvcache_num_blocks, artifact.kvcache_block_size
    total = rebel_internals.kv_cache_size(runtime)
    per_row, rest = divmod(total, 2 * layers * blocks * heads * slots)
    if rest or per_row <= 0:
        raise HostTierUnsupported(
            f"{artifact.path.name}: {total} KV bytes are not 2 x {layers} layers of "
            f"[{blocks} blocks, {heads} heads, {slots} slots] buffers"
        )
    return KVLayout(2 * layers, blocks, heads, slots, per_row)


class HostTransfer:
    """Saves and loads one worker's blocks (module docstring)."""

    def __init__(self, runtime: Any, layout: KVLayout, tier: HostKVTier) -> None:
        self.runtime, self.layout, self.tier = runtime, layout, tier
        self._mirror = torch.empty(layout.buffers * layout.buffer_bytes, dtype=torch.uint8)
        self.seconds = 0.0  # spent in transfers (saves and loads)

    def _views(self) -> list[torch.Tensor]:
        n, size = self.layout, self.layout.buffer_bytes
        return [
            self._mirror[i * size : (i + 1) * size].view(n.blocks, n.heads, 1, n.slots, n.row)
            for i in range(n.buffers)
        ]

    def save(self, save: HostSave) -> bool:
        """Copy a block's cached slots to the tier; False (logged) if it failed."""
        began = time.perf_counter()
        try:
            rebel_internals.fetch_kv_cache(self.runtime, self._mirror, save.block, save.tokens)
            payload = b"".join(
                view[save.block, :, :, : save.tokens, :].contiguous().numpy().tobytes()
                for view in self._views()
            )
            self.tier.put(save.start, save.hashes, save.tokens, payload)
        except Exception:  # noqa: BLE001 - a lost save costs a recompute later, never a step
            logger.warning("host KV tier: could not save block %d", save.block, exc_info=True)
            return False
        finally:
            self.seconds += time.perf_counter() - began
        return True

    def load(self, load: HostLoad) -> bool:
        """Copy a tier entry into its block; False if the entry is gone or unreadable (the
        caller then computes those tokens)."""
        began = time.perf_counter()
        try:
            payload = self.tier.read(load.entry, load.tokens)
            if payload is None:
                return False
            stored = len(payload) // self.layout.buffers  # the entry may hold more tokens
            if stored < self.layout.tokens_bytes(load.tokens) // self.layout.buffers:
                return False
            raw = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            heads, row = self.layout.heads, self.layout.row
            for i, view in enumerate(self._views()):
                part = raw[i * stored : (i + 1) * stored].view(heads, 1, -1, row)
                view[load.block, :, :, : load.tokens, :] = part[:, :, : load.tokens, :]
            rebel_internals.update_kv_cache(self.runtime, self._mirror, load.block, load.tokens)
        except Exception:  # noqa: BLE001 - a failed load is a recompute, never a wrong token
            logger.warning("host KV tier: could not load entry %d", load.entry, exc_info=True)
            return False
        finally:
            self.seconds += time.perf_counter() - began
        return True
