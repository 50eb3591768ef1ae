"""The RBLN block manager on its own: adoption, copies, recompute, eviction, scratch."""

from __future__ import annotations

import pytest

from rbln_ray.vllm_plugin.kv_blocks import (
    NO_BLOCK,
    BlockLayout,
    KVCopy,
    OuterBlockManager,
    shares_uncomputed_blocks,
)

EAGER = BlockLayout(outer_size=512, inner_size=128, num_outer=4, max_seq_len=512)
FLASH = BlockLayout(outer_size=1024, inner_size=128, num_outer=8, max_seq_len=2048)


def hashes(tag: str, n: int, shared: int = 0) -> list[str]:
    """Block hashes of a prompt: the first ``shared`` blocks common to every tag."""
    return [f"p{i}" if i < shared else f"{tag}{i}" for i in range(n)]


class Evictions(list):
    def __call__(self, gone):
        self.extend(gone)


def manager(layout=EAGER):
    evicted = Evictions()
    return OuterBlockManager(layout, evicted), evicted


def test_layout_validates_and_counts() -> None:
    assert (EAGER.per_outer, EAGER.num_inner, EAGER.segments_per_seq) == (4, 16, 1)
    assert (FLASH.per_outer, FLASH.segments_per_seq, FLASH.segments_for(1025)) == (8, 2, 2)
    with pytest.raises(ValueError, match="must divide"):
        BlockLayout(outer_size=500, inner_size=128, num_outer=1, max_seq_len=500)
    assert BlockLayout.for_artifact(500, 4, 500, 128).inner_size == 500


def test_no_hit_takes_a_fresh_block_and_records_full_blocks_only() -> None:
    m, evicted = manager()
    copies, start = m.admit("a", hashes("a", 2), hit_tokens=0, end_tokens=300)
    assert (copies, start) == ([], 0)
    assert len(m.table("a")) == 1 and m.free_count() == 3
    # 300 tokens: two full 128-token blocks are cached in a's block.
    assert m.held_tokens(hashes("a", 2)) == 256
    assert evicted == []


def test_hit_in_a_free_block_is_adopted_without_copy() -> None:
    m, _ = manager()
    m.admit("a", hashes("a", 3, shared=2), 0, 400)
    block = m.table("a")[0]
    m.release_missing(set())  # a finished: its block is free but keeps its cache
    copies, start = m.admit("b", hashes("b", 3, shared=2), hit_tokens=256, end_tokens=300)
    assert copies == [] and start == 256
    assert m.table("b") == [block]


def test_hit_in_a_running_requests_block_is_copied() -> None:
    m, _ = manager()
    m.admit("a", hashes("a", 3, shared=2), 0, 400)
    src = m.table("a")[0]
    copies, start = m.admit("b", hashes("b", 3, shared=2), hit_tokens=256, end_tokens=300)
    (dst,) = m.table("b")
    assert copies == [KVCopy(src, dst, 256)] and start == 256 and dst != src


def test_hit_nobody_holds_is_recomputed_from_where_the_device_copy_ends() -> None:
    m, _ = manager()
    m.admit("a", hashes("a", 1, shared=1), 0, 200)  # holds p0 only
    # vLLM claims 3 shared blocks (e.g. after the device block holding them was reused).
    copies, start = m.admit("b", hashes("b", 4, shared=3), hit_tokens=384, end_tokens=500)
    assert start == 128  # p0 is copied, p1 and p2 must be computed again
    assert copies == [KVCopy(m.table("a")[0], m.table("b")[0], 128)]


def test_reusing_a_block_evicts_what_only_it_held() -> None:
    m, evicted = manager()
    for i in range(4):
        m.admit(f"r{i}", hashes(f"r{i}", 3), 0, 400)
    m.release_missing({"r1", "r2", "r3"})  # r0 finished; its block is the only free one
    m.admit("new", hashes("new", 2), 0, 300)
    m.flush_evictions()
    assert sorted(evicted) == ["r00", "r01", "r02"]
    assert m.held_tokens(hashes("r0", 3)) == 0


def test_flush_keeps_a_hash_rewritten_in_the_same_step() -> None:
    """A request recomputing a prefix nobody held drops and re-adds its hashes in one step:
    they must stay in vLLM's cache."""
    m, evicted = manager()
    m.admit("a", hashes("a", 3, shared=3), 0, 400)
    m.release_missing(set())
    # Adopting a's block with a 2-block hit truncates p2 there, but b recomputes p2 itself.
    copies, start = m.admit("b", hashes("b", 3, shared=3), hit_tokens=256, end_tokens=400)
    m.flush_evictions()
    assert copies == [] and start == 256 and evicted == []


def test_flash_segments_adopt_and_copy_independently() -> None:
    m, _ = manager(FLASH)
    long_prompt = hashes("a", 12, shared=12)  # 1536 tokens: both partitions
    m.admit("a", long_prompt, 0, 1536)
    first, second = m.table("a")
    assert m.new_blocks_needed("a", 2048) == 0 and m.new_blocks_needed("x", 1025) == 2
    copies, start = m.admit("b", long_prompt, hit_tokens=1536, end_tokens=1600)
    b_first, b_second = m.table("b")
    assert start == 1536
    assert copies == [KVCopy(first, b_first, 1024), KVCopy(second, b_second, 512)]


def test_scratch_prefers_empty_blocks_and_never_overwrites_cached_kv() -> None:
    m, evicted = manager()
    assert m.scratch()[1] == 0  # an empty block, position 0
    for i in range(4):
        m.admit(f"r{i}", hashes(f"r{i}", 4), 0, 512)
    assert m.scratch() == (NO_BLOCK, 0)  # everything is owned
    r3_block = m.table("r3")[0]
    m.release_missing({"r0", "r1", "r2"})  # r3's block is free and fully cached
    block, position = m.scratch()
    assert block == r3_block
    assert position == 511  # its last slot; the last cached vLLM block is given up
    m.flush_evictions()
    assert evicted == ["r33"]
    assert m.held_tokens(hashes("r3", 4)) == 384


def test_admit_twice_and_running_out_are_errors() -> None:
    m, _ = manager()
    m.admit("a", [], 0, 10)
    with pytest.raises(RuntimeError, match="already holds"):
        m.admit("a", [], 0, 10)
    for i in range(3):
        m.admit(f"b{i}", [], 0, 10)
    with pytest.raises(RuntimeError, match="no free RBLN KV block"):
        m.admit("c", [], 0, 10)
    with pytest.raises(ValueError, match="whole 128-token blocks"):
        OuterBlockManager(EAGER, Evictions()).admit("d", ["x"], 100, 200)


def test_a_waiting_prompt_waits_only_for_shared_blocks_not_yet_computed() -> None:
    """Three blocks of 128 tokens shared; the waiting prompt should wait while the prompt in
    prefill has computed fewer than all three, and not once it has (or if they differ)."""
    prompt, waiting = ["a", "b", "c", "d"], ["a", "b", "c", "x"]
    assert shares_uncomputed_blocks(waiting, prompt, 0, 128)
    assert shares_uncomputed_blocks(waiting, prompt, 2 * 128 + 127, 128)
    assert not shares_uncomputed_blocks(waiting, prompt, 3 * 128, 128)
    assert not shares_uncomputed_blocks(["z", "b"], prompt, 0, 128)  # chains differ at once
    assert not shares_uncomputed_blocks([], prompt, 0, 128)
