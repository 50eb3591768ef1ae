"""The RBLN scheduler in process, driven step by step like vLLM's engine core (no engine, no
device, no subprocess): step shapes, chunked prefill with decodes between chunks, prefix-hit
plans, decode rows capped at the compiled batch, async scheduling placeholders.

The artifact is a hand-written ``rbln_config.json`` beside an HF ``config.json`` (no weights):
the scheduler only reads shapes from it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ["RBLN_RAY_DEVICE"] = "emulated"  # the RBLN platform in this process (no device use)

BATCH, MAX_LEN, CHUNK = 4, 512, 128


def write_artifact(root: Path, **rbln: int) -> Path:
    from transformers import LlamaConfig

    out = root / "artifact"
    LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        max_position_embeddings=MAX_LEN,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(out)
    config = {
        "cls_name": "RBLNLlamaForCausalLMConfig",
        "batch_size": BATCH,
        "max_seq_len": MAX_LEN,
        "kvcache_block_size": MAX_LEN,
        "kvcache_num_blocks": BATCH,
        "prefill_chunk_size": CHUNK,
        "decoder_batch_sizes": [4, 2, 1],
        "attn_impl": "eager",
        **rbln,
    }
    (out / "rbln_config.json").write_text(json.dumps(config))
    return out


class Harness:
    """An RBLN scheduler plus the engine core's bookkeeping around it."""

    def __init__(self, artifact: Path, **engine: object) -> None:
        from vllm.engine.arg_utils import EngineArgs
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        args = EngineArgs(model=str(artifact), skip_tokenizer_init=True, seed=0, **engine)
        self.config = args.create_engine_config()
        cache = self.config.cache_config
        # The engine core sets this after profiling the KV cache; there is none here.
        cache.num_gpu_blocks = cache.num_gpu_blocks_override
        spec = FullAttentionSpec(
            block_size=cache.block_size,
            num_kv_heads=1,
            head_size=1,
            dtype=__import__("torch").float32,
        )
        kv = KVCacheConfig(
            num_blocks=cache.num_gpu_blocks_override,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["rbln.kv"], spec)],
        )
        cls = self.config.scheduler_config.get_scheduler_cls()
        self.scheduler = cls(
            vllm_config=self.config,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(self.config),
            block_size=cache.block_size,
        )
        hash_fn = get_hash_fn_by_name(cache.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(cache.block_size, hash_fn)
        self.steps: list[tuple[str, dict[str, int]]] = []

    def add(self, req_id: str, prompt: list[int], max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
        request = Request(req_id, prompt, params, None, block_hasher=self.hasher)
        self.scheduler.add_request(request)

    def step(self):
        """One schedule + a model output that samples token 7 for every finished prefill."""
        from vllm.v1.outputs import ModelRunnerOutput

        output = self.scheduler.schedule()
        plan = output.rbln_plan
        ids = list(output.num_scheduled_tokens)
        sampled = []
        for req_id in ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens
            sampled.append([7] if done else [])
        self.steps.append((plan.kind, dict(output.num_scheduled_tokens)))
        result = ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=sampled,
        )
        self.scheduler.update_from_output(output, result)
        return output

    def run(self, limit: int = 500) -> None:
        for _ in range(limit):
            if not self.scheduler.has_requests():
                return
            self.step()
        raise AssertionError(f"requests still unfinished after {limit} steps")


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield write_artifact(tmp_path_factory.mktemp("sched"))


def test_config_is_synced_from_the_artifact(artifact: Path) -> None:
    h = Harness(artifact)
    sched, cache = h.config.scheduler_config, h.config.cache_config
    assert (sched.max_num_seqs, cache.block_size) == (BATCH, CHUNK)
    assert cache.num_gpu_blocks_override == BATCH * MAX_LEN // CHUNK + 1
    assert cache.enable_prefix_caching and sched.enable_chunked_prefill
    assert sched.async_scheduling  # on by default on RBLN
    assert type(h.scheduler).__name__ == "RBLNAsyncScheduler"


def test_every_step_is_one_prefill_chunk_or_decodes_only(artifact: Path) -> None:
    h = Harness(artifact, async_scheduling=False)
    for i in range(10):
        h.add(f"r{i}", [i + 1] * (10 + 40 * i), max_tokens=5)
    h.run()
    for kind, scheduled in h.steps:
        if kind == "prefill":
            assert len(scheduled) == 1 and next(iter(scheduled.values())) <= CHUNK
        elif kind == "decode":
            assert 1 <= len(scheduled) <= BATCH and set(scheduled.values()) == {1}
    # A 370-token prompt took 3 chunks; a decode step ran between two of them.
    chunks = [i for i, (kind, s) in enumerate(h.steps) if kind == "prefill" and "r9" in s]
    assert len(chunks) == 3
    assert any(h.steps[j][0] == "decode" for j in range(chunks[0], chunks[-1]))


def test_decode_steps_between_chunks_is_honoured(artifact: Path) -> None:
    h = Harness(
        artifact,
        async_scheduling=False,
        additional_config={"rbln_decode_steps_between_chunks": 3},
    )
    h.add("short", [1, 2, 3], max_tokens=40)
    h.step()  # the short request's prefill
    h.add("long", list(range(1, 400)), max_tokens=2)
    h.run()
    kinds = [kind for kind, s in h.steps if "short" in s or "long" in s]
    long_chunks = [i for i, (k, s) in enumerate(h.steps) if k == "prefill" and "long" in s]
    assert len(long_chunks) == 4
    for a, b in zip(long_chunks, long_chunks[1:], strict=False):
        assert b - a - 1 >= 3, kinds  # at least 3 decode steps between two chunks


def test_prefix_hit_is_adopted_or_copied(artifact: Path) -> None:
    h = Harness(artifact, async_scheduling=False)
    shared = list(range(100, 400))  # 300 tokens: two full 128-token blocks
    h.add("a", shared + [1], max_tokens=30)
    while not any("a" in s and k == "decode" for k, s in h.steps):
        h.step()
    h.add("b", shared + [2], max_tokens=3)  # a still runs: its block is copied
    out = h.step()
    assert out.rbln_plan.kind == "prefill"
    (copy,) = out.rbln_plan.copies
    assert copy.tokens == 256 and copy.src == out.rbln_plan.tables.get("a", [copy.src])[0]
    assert out.num_scheduled_tokens["b"] == 301 - 256
    h.run()
    h.add("c", shared + [3], max_tokens=3)  # a and b finished: a block is adopted
    out = h.step()
    assert out.rbln_plan.copies == [] and out.num_scheduled_tokens["c"] == 301 - 256


def test_decode_rows_never_exceed_the_compiled_batch(tmp_path: Path) -> None:
    # A KV cache for two micro-batches (a pipeline's artifact): 8 sequences in flight,
    # decode graphs of 4 rows.
    artifact = write_artifact(tmp_path, kvcache_num_blocks=2 * BATCH, max_num_seqs=2 * BATCH)
    h = Harness(artifact, async_scheduling=False)
    for i in range(8):
        h.add(f"r{i}", [i + 1] * 5, max_tokens=6)
    h.run()
    decodes = [len(s) for kind, s in h.steps if kind == "decode"]
    assert max(decodes) == BATCH
    assert h.config.scheduler_config.max_num_seqs == 2 * BATCH


def test_async_scheduling_schedules_ahead_of_outputs(artifact: Path) -> None:
    """With async scheduling a decoding request is scheduled again before its previous
    step's token came back (vLLM's placeholders), so two steps can be in flight."""
    h = Harness(artifact)
    h.add("r", [5] * 10, max_tokens=8)
    first = h.scheduler.schedule()  # the prefill, output not yet returned
    second = h.scheduler.schedule()  # the first decode, scheduled ahead
    assert first.rbln_plan.kind == "prefill" and second.rbln_plan.kind == "decode"
    assert second.num_scheduled_tokens == {"r": 1}
