"""Rebellions' ``rebel`` runtime internals rbln-ray relies on: the on-device KV block copy, and
the host <-> device KV transfers of the host KV tier.

Why an internal: a prefix-cache hit whose KV lives in another request's compiled block is
copied on the device, block to block, by ``rebel.Runtime._copy_kv_cache(src, dst, length)``,
the same private method Rebellions' own vllm-rbln calls for it
(``model_executor/models/optimum/model_base.py``); ``rebel`` has no public one. Every copy
rbln-ray makes (the model runner's, a speculative draft model's, a pipeline stage's) goes
through :func:`copy_kv_cache`, so the requirement below is the one place that names it. The
emulator provides the method with the same signature (:mod:`rbln_ray.emulator.runtime`),
which is what the contract test checks in an environment without a real ``rebel``.

The host KV tier (:mod:`rbln_ray.vllm_plugin.host_transfer`) moves a block's slots between the
device and a host tensor mirroring the whole KV cache with ``_fetch_kv_cache`` /
``_update_kv_cache(host, block, offset, size, layer_name)`` and sizes that tensor with
``_get_kv_cache_size(layer_name)``: the signatures of Rebellions' runtime as its public
KV-cache hook for vllm-rbln calls them (:mod:`rbln_ray.emulator.kv_host`).
"""

from __future__ import annotations

from typing import Any

from rbln_ray.upstream.contract import Requirement, Upstream

UPSTREAM = Upstream("rebel", "rebel-compiler", "0.12.0")
USERS = "rbln_ray/vllm_plugin/model_runner.py, vllm_plugin/spec/proposers.py, pipeline/stage.py"
TIER = "rbln_ray/vllm_plugin/host_transfer.py"
# Called positionally, as vllm-rbln calls them (the real runtime's parameter names are not
# documented): that they exist and are callable is what can be required.
REQUIREMENTS: tuple[Requirement, ...] = (
    Requirement("rebel:Runtime._copy_kv_cache", USERS),
    Requirement("rebel:Runtime._fetch_kv_cache", TIER),
    Requirement("rebel:Runtime._update_kv_cache", TIER),
    Requirement("rebel:Runtime._get_kv_cache_size", TIER),
)


def copy_kv_cache(runtime: Any, src: int, dst: int, tokens: int) -> None:
    """Copy the first ``tokens`` KV slots of compiled block ``src`` into block ``dst``, on the
    device, for every layer of ``runtime``'s graph (its static KV buffers)."""
    runtime._copy_kv_cache(src, dst, tokens)


def kv_cache_size(runtime: Any) -> int:
    """Bytes of every KV buffer of ``runtime``'s load: the host mirror the transfers need."""
    return int(runtime._get_kv_cache_size(None))


def fetch_kv_cache(runtime: Any, host: Any, block: int, tokens: int) -> None:
    """Copy the first ``tokens`` slots of compiled block ``block`` (every layer) from the
    device into the same place of ``host`` (a mirror of the whole KV cache)."""
    runtime._fetch_kv_cache(host, block, 0, tokens, None)


def update_kv_cache(runtime: Any, host: Any, block: int, tokens: int) -> None:
    """The reverse of :func:`fetch_kv_cache`: ``host``'s slots into the device's block."""
    runtime._update_kv_cache(host, block, 0, tokens, None)
