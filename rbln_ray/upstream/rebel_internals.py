"""Rebellions' ``rebel`` runtime internals rbln-ray relies on: the on-device KV block copy.

Why an internal: a prefix-cache hit whose KV lives in another request's compiled block is
copied on the device, block to block, by ``rebel.Runtime._copy_kv_cache(src, dst, length)``,
the same private method Rebellions' own vllm-rbln calls for it
(``model_executor/models/optimum/model_base.py``); ``rebel`` has no public one. Every copy
rbln-ray makes (the model runner's, a speculative draft model's, a pipeline stage's) goes
through :func:`copy_kv_cache`, so the requirement below is the one place that names it. The
emulator provides the method with the same signature (:mod:`rbln_ray.emulator.runtime`),
which is what the contract test checks in an environment without a real ``rebel``.
"""

from __future__ import annotations

from typing import Any

from rbln_ray.upstream.contract import Requirement, Upstream

UPSTREAM = Upstream("rebel", "rebel-compiler", "0.12.0")
USERS = "rbln_ray/vllm_plugin/model_runner.py, vllm_plugin/spec/proposers.py, pipeline/stage.py"
# Called positionally, as vllm-rbln calls it (the real runtime's parameter names are not
# documented): that it exists and is callable is what can be required.
REQUIREMENTS: tuple[Requirement, ...] = (Requirement("rebel:Runtime._copy_kv_cache", USERS),)


def copy_kv_cache(runtime: Any, src: int, dst: int, tokens: int) -> None:
    """Copy the first ``tokens`` KV slots of compiled block ``src`` into block ``dst``, on the
    device, for every layer of ``runtime``'s graph (its static KV buffers)."""
    runtime._copy_kv_cache(src, dst, tokens)
