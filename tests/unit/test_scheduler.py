"""The RBLN scheduler in process, driven step by step like vLLM's engine core (no engine, no
device, no subprocess): step shapes, chunked prefill with decodes between chunks, prefix-hit
plans, decode rows capped at the compiled batch, async scheduling placeholders.

The artifact is hand-written (tests/unit/engine_harness.py): the scheduler reads shapes only.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.unit.engine_harness import BATCH, CHUNK, MAX_LEN, Harness, write_artifact


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


def test_a_kv_pool_smaller_than_one_sequence_bounds_max_model_len(tmp_path: Path) -> None:
    """vllm-rbln #957: a prompt that fits max_seq_len but not the KV pool was admitted and
    waited for blocks that do not exist. Here max_model_len is the pool's size, so vLLM
    refuses such a prompt as too long; asking for more is an error naming the pool."""
    small = write_artifact(
        tmp_path, attn_impl="flash_attn", kvcache_block_size=256, kvcache_num_blocks=1,
        kvcache_partition_len=256,
    )  # fmt: skip
    assert Harness(small).config.model_config.max_model_len == 256  # max_seq_len is 512
    with pytest.raises(ValueError, match=r"KV pool \(1 blocks x 256 tokens\)"):
        Harness(small, max_model_len=384)


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


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_prompts_sharing_a_prefix_wait_for_it_instead_of_computing_it(
    artifact: Path, async_scheduling: bool
) -> None:
    """Four prompts with one 300-token prefix (two full 128-token blocks) arrive together.
    vLLM caches a block once it is scheduled, so a prompt admitted after the first one's
    first chunk would find one block and compute the second itself (peer benchmark: one
    prefill call more than vllm-rbln on ``shared_prefix``). Each later prompt must find
    both blocks and prefill only its own 45 tokens: 3 + 3 x 1 prefill steps."""
    h = Harness(artifact, async_scheduling=async_scheduling)
    shared = list(range(100, 400))
    for i in range(BATCH):
        h.add(f"r{i}", shared + [i + 1], max_tokens=3)
    h.run()
    prefills = [s for kind, s in h.steps if kind == "prefill"]
    assert [s["r0"] for s in prefills if "r0" in s] == [CHUNK, CHUNK, 301 - 2 * CHUNK]
    for i in range(1, BATCH):
        assert [s[f"r{i}"] for s in prefills if f"r{i}" in s] == [301 - 2 * CHUNK], h.steps
    assert len(prefills) == 3 + (BATCH - 1)


def test_unrelated_prompts_are_admitted_while_another_is_prefilled(artifact: Path) -> None:
    """Waiting for a prefix applies only to prompts that share one: an unrelated prompt still
    starts as soon as a slot is free (its first chunk before the long prompt's second)."""
    h = Harness(artifact, async_scheduling=False)
    h.add("long", list(range(100, 400)), max_tokens=3)
    h.add("other", list(range(500, 520)), max_tokens=3)
    h.run()
    order = [next(iter(s)) for kind, s in h.steps if kind == "prefill"]
    assert order[:2] == ["long", "other"], h.steps


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
