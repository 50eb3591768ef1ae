"""Contract: every private access of :mod:`rbln_ray.upstream` still finds what it relies on in
the installed vLLM, Ray, optimum-rbln, torch and transformers, and the adapters behave as
their callers assume. A failure names the upstream, its installed and pinned versions, the
internal and the rbln-ray code that uses it.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rbln_ray.emulator import ensure_runtime
from rbln_ray.upstream import (
    contract,
    optimum_internals,
    ray_internals,
    rebel_internals,
    torch_internals,
    transformers_internals,
    vllm_internals,
)

ADAPTERS = (
    vllm_internals,
    ray_internals,
    optimum_internals,
    torch_internals,
    rebel_internals,
    transformers_internals,
)
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("adapter", ADAPTERS, ids=lambda m: m.UPSTREAM.name)
def test_every_internal_an_adapter_uses_still_exists(adapter) -> None:
    ensure_runtime()  # optimum-rbln imports rebel at top level (the emulator here)

    broken = contract.check(adapter.UPSTREAM, adapter.REQUIREMENTS)
    assert not broken, "\n".join(broken)


def test_the_m_rope_families_optimum_classes_keep_the_position_embeddings() -> None:
    """The registry passes the optimum classes of its M-RoPE families down (this layer cannot
    ask it); each still computes its cos/sin as the embedder calls it, and a class that
    does not is reported."""
    from rbln_ray.families.registry import VISION

    ensure_runtime()
    classes = [f.optimum_class for f in VISION.values() if f.mrope]
    assert len(classes) == 5  # Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, Qwen3.5
    required = optimum_internals.position_embedding_requirements(classes)
    assert not contract.check(optimum_internals.UPSTREAM, required)
    (broken,) = contract.check(
        optimum_internals.UPSTREAM,
        optimum_internals.position_embedding_requirements(["RBLNLlavaForConditionalGeneration"]),
    )
    assert "RBLNLlavaForConditionalGeneration._get_position_embeddings" in broken


def test_a_renamed_internal_fails_naming_upstream_versions_and_user() -> None:
    req = contract.Requirement(
        "vllm.v1.core.sched.scheduler:Scheduler._preempt_request_renamed", "scheduler.py"
    )
    (message,) = contract.check(vllm_internals.UPSTREAM, (req,))
    assert message.startswith("vLLM 0.30.0 (rbln-ray pins 0.30.0): ")
    assert "_preempt_request_renamed (callable) is missing; used by scheduler.py" in message
    changed = contract.Requirement(
        "vllm.v1.core.sched.scheduler:Scheduler._preempt_request", "x", params=("req", "when")
    )
    assert (
        "takes (request, timestamp, drop_stale_output)"
        in contract.check(vllm_internals.UPSTREAM, (changed,))[0]
    )
    missing_self = contract.Requirement(
        "vllm.v1.core.sched.scheduler:Scheduler.no_such_queue", "x", "instance attribute"
    )
    assert (
        "assigns self.no_such_queue" in contract.check(vllm_internals.UPSTREAM, (missing_self,))[0]
    )


def test_private_upstream_modules_are_imported_only_by_the_adapters() -> None:
    """Outside rbln_ray/upstream, nothing imports a ``_private`` module of an upstream or
    reaches a private method of the ones the adapters cover (a new internal belongs in an
    adapter with a requirement)."""
    guarded = {
        "_preempt_request",
        "_select_waiting_queue_for_scheduling",
        "evict_blocks",
        "_wrap_model_if_needed",
        "_get_position_embeddings",
        "token_ids_cpu",
        "num_tokens_no_spec",
        "add_port_to_grpc_server",
        "_copy_kv_cache",
        "_actions",
        "_apply_token_matches_with_placeholders",
        "_get_audio_token_length",
    }
    offenders = []
    for path in sorted((ROOT / "rbln_ray").rglob("*.py")):
        if "upstream" in path.parts:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            name = None
            if isinstance(node, ast.ImportFrom) and node.module and "._private" in node.module:
                name = node.module
            elif isinstance(node, ast.Attribute) and node.attr in guarded:
                name = node.attr
            if name:
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}")
    assert not offenders, offenders


def test_rbln_linear_swap_is_undone_even_on_error() -> None:
    import torch

    ensure_runtime()  # registers torch.ops.rbln_custom_ops

    original = torch.nn.functional.linear
    with pytest.raises(RuntimeError, match="inside"), torch_internals.rbln_linear_while_compiling():
        assert torch.nn.functional.linear is torch.ops.rbln_custom_ops.linear
        raise RuntimeError("inside")
    assert torch.nn.functional.linear is original


def test_scheduler_view_shows_only_the_visible_and_keeps_the_rest_in_place() -> None:
    class Sched:
        running = ["a", "b", "c"]
        max_num_running_reqs = 8

    s = Sched()
    with vllm_internals.scheduler_view(s, ["b"], 2):
        assert s.running == ["b"] and s.max_num_running_reqs == 2
        s.running.remove("b")  # vLLM preempted it
        s.running.append("d")  # and admitted a waiting one
    assert s.running == ["a", "c", "d"] and s.max_num_running_reqs == 8


def test_replica_grpc_bind_rewrites_the_address_serve_passes(monkeypatch) -> None:
    from ray.serve._private import replica

    seen = []
    monkeypatch.setattr(replica, "add_port_to_grpc_server", lambda srv, addr: seen.append(addr))
    assert ray_internals.rewrite_replica_grpc_bind(lambda a: "127.0.0.1:0")
    assert ray_internals.rewrite_replica_grpc_bind(lambda a: "other")  # idempotent
    replica.add_port_to_grpc_server(None, "[::]:0")
    assert seen == ["127.0.0.1:0"]


def test_extra_graphs_hooks_are_undone_even_on_error() -> None:
    """optimum's class gets its own attributes back (an inherited one is not left shadowed)
    whether the compile inside the block succeeds or raises."""

    class Base:
        @classmethod
        def get_compiled_model(cls, model, rbln_config):
            return {}

        @classmethod
        def _get_compile_context(cls, compile_config, example_inputs):
            return None, {}

        @classmethod
        def set_kvcache_num_blocks_after_compilation(cls, compiled_models, rbln_config):
            return None

    class Decoder(Base):
        @classmethod
        def _compile_model(cls, wrapped_model, *args, **kwargs):
            return "own"

    before = dict(vars(Decoder))
    with (
        pytest.raises(RuntimeError, match="compile failed"),
        optimum_internals.extra_graphs(Decoder, lambda compiler: {}, {}),
    ):
        assert "get_compiled_model" in vars(Decoder)
        raise RuntimeError("compile failed")
    assert dict(vars(Decoder)) == before
    assert Decoder._compile_model(None) == "own"
    assert "get_compiled_model" not in vars(Decoder)
