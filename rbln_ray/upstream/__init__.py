"""Adapters to the private internals of the libraries rbln-ray builds on.

Why a layer of its own: vLLM, Ray Serve, Ray's autoscaler, optimum-rbln and torch expose no
public hook for a few things rbln-ray needs (what vLLM's scheduler sees in one step, where
Serve binds a replica's gRPC server, optimum's compile-time wrapper, ...). Every such access
lives in one module per upstream, next to a declaration of exactly what it relies on
(:class:`~rbln_ray.upstream.contract.Requirement`), and ``tests/unit/test_upstream_contracts.py``
checks those declarations in the fast tier: a renamed attribute or a changed signature fails
there, naming the upstream, its installed and pinned versions, and the rbln-ray code that
depends on it, instead of surfacing as wrong tokens deep in an end-to-end test.

Modules: :mod:`.vllm_internals` (scheduler view, preemption, prefix-cache eviction, input
batch), :mod:`.ray_internals` (Serve's replica gRPC bind, the autoscaler's SSH runner and
local node provider), :mod:`.optimum_internals` (compile-time wrapper, Qwen2-VL position
embeddings), :mod:`.torch_internals` (the compile-time ``F.linear`` swap).
"""
