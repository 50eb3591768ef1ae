"""The host KV tier's pieces on their own: the node store (index, files, LRU bound, two
models, several processes, a writer that dies), the block plan's saves, loads and exports
(prefill/decode disaggregation), and the connector's answers to vLLM."""

from __future__ import annotations

import multiprocessing
import os
import threading
import types

import pytest

from rbln_ray.vllm_plugin.host_tier import HostKVTier
from rbln_ray.vllm_plugin.kv_blocks import BlockLayout, HostLoad, HostSave, OuterBlockManager

EAGER = BlockLayout(outer_size=512, inner_size=128, num_outer=2, max_seq_len=512)
FLASH = BlockLayout(outer_size=256, inner_size=128, num_outer=4, max_seq_len=1024)
PAYLOAD = 1000  # bytes per test entry


def hashes(tag: str, n: int) -> list[bytes]:
    return [f"{tag}{i}".encode() for i in range(n)]


def tier(root, capacity: int = 10_000, model: str = "m") -> HostKVTier:
    return HostKVTier(root, capacity, model)


# ------------------------------------------------------------------ the node store
def test_an_entry_is_found_by_any_prefix_of_its_hashes_at_its_start(tmp_path) -> None:
    t = tier(tmp_path)
    entry = t.put(0, hashes("a", 3), 384, b"x" * PAYLOAD)
    assert t.segment_hit(hashes("a", 3), 0).blocks == 3
    assert t.segment_hit(hashes("a", 2), 0).blocks == 2  # a shorter prefix is in it too
    assert t.segment_hit(hashes("a", 3) + [b"other"], 0).blocks == 3
    assert t.segment_hit(hashes("a", 3), 512) is None  # another position: another segment
    assert t.segment_hit([b"b0", *hashes("a", 3)[1:]], 0) is None
    assert t.read(entry, 384) == b"x" * PAYLOAD and t.read(entry, 385) is None
    assert tier(tmp_path, model="other").segment_hit(hashes("a", 3), 0) is None  # per model


def test_the_size_bound_holds_by_evicting_the_least_recently_used(tmp_path) -> None:
    t = tier(tmp_path, capacity=3 * (PAYLOAD + 24))
    first, second, third = (t.put(0, hashes(tag, 1), 128, b"x" * PAYLOAD) for tag in "abc")
    t.read(first, 128)  # a is used again: b is now the least recently used
    t.put(0, hashes("d", 1), 128, b"x" * PAYLOAD)
    assert t.usage() == (3 * (PAYLOAD + 24), 3)
    assert t.added() == 4  # one evicted: added minus held
    assert t.read(second, 128) is None and not t.path(second).exists()
    assert t.read(first, 128) is not None and t.read(third, 128) is not None
    with pytest.raises(ValueError, match="exceeds"):
        t.put(0, hashes("e", 1), 128, b"x" * 10 * PAYLOAD)


def test_every_thread_of_a_process_uses_the_tier(tmp_path) -> None:
    """A worker opens the tier in the thread that loads its model and steps it in another:
    each thread gets its own connection to the index (SQLite's are per thread)."""
    t = tier(tmp_path)
    t.put(0, hashes("a", 3), 384, b"x" * PAYLOAD)
    found: list = []
    thread = threading.Thread(target=lambda: found.append(t.segment_hit(hashes("a", 3), 0)))
    thread.start()
    thread.join()
    assert [hit.blocks for hit in found] == [3]
    t.close()


def _writer(root: str, tag: str, n: int) -> None:
    t = HostKVTier(root, 20 * (PAYLOAD + 24), "m")
    for i in range(n):
        t.put(0, hashes(f"{tag}{i}-", 2), 256, bytes([i % 256]) * PAYLOAD)


def test_processes_sharing_the_node_tier_keep_it_consistent(tmp_path) -> None:
    """Three processes add 30 entries each at once into a tier of 20: the bound holds, every
    indexed entry's file is whole, no file is left without its entry."""
    ctx = multiprocessing.get_context("fork")  # the writers touch nothing but the tier
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), tag, 30)) for tag in "xyz"]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    t = tier(tmp_path, capacity=20 * (PAYLOAD + 24))
    nbytes, count = t.usage()
    assert count == 20 and nbytes == 20 * (PAYLOAD + 24)
    ids = {entry for entry, _, _ in t.entries()}
    assert {int(f.stem) for f in tmp_path.glob("*.kv")} == ids
    assert all(t.read(entry, 256) is not None for entry in ids)


def test_a_writer_that_dies_mid_entry_leaves_nothing_visible(tmp_path) -> None:
    """A process killed while writing (its temporary file written, no index row) leaves the
    tier as it was: readers never see a partial entry."""
    t = tier(tmp_path)
    t.put(0, hashes("a", 1), 128, b"x" * PAYLOAD)
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_die_mid_put, args=(str(tmp_path),))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -9  # SIGKILL
    assert t.usage() == (PAYLOAD + 24, 1) and t.segment_hit(hashes("b", 1), 0) is None


def _die_mid_put(root: str) -> None:
    t = HostKVTier(root, 10_000, "m")
    t._db.execute("BEGIN IMMEDIATE")
    t._db.execute("INSERT INTO entries (model, start, tokens, nbytes, last_used) VALUES "
                  "('m', 0, 128, 10, 0)")  # fmt: skip
    with open(os.path.join(root, ".99.tmp"), "wb") as f:
        f.write(b"partial")
    os.kill(os.getpid(), 9)


def test_a_prompts_entries_travel_whole_to_another_nodes_tier(tmp_path) -> None:
    """What a decode replica on another node imports: every entry holding one of the prompt's
    hashes (this model's only), added where missing, found there as on the first node."""
    a, b = tier(tmp_path / "a", capacity=10**6), tier(tmp_path / "b", capacity=10**6)
    h = hashes("p", 4)
    a.put(0, h[:2], 256, b"first" * 10)
    a.put(256, h[2:], 256, b"second" * 10)
    a.put(0, hashes("q", 2), 256, b"other prompt")
    tier(tmp_path / "a", model="other").put(0, h[:2], 256, b"other model")
    records = a.records(h)
    assert [(r.start, r.tokens, r.hashes) for r in records] == [(0, 256, tuple(h[:2])),
                                                                (256, 256, tuple(h[2:]))]
    assert b.add(records) == 512 and b.add(records) == 0  # what it holds is not added again
    first, second = b.segment_hit(h[:2], 0), b.segment_hit(h[2:], 256)
    assert first.blocks == second.blocks == 2
    assert b.read(first.entry, 256) == b"first" * 10 and b.read(second.entry, 256) == b"second" * 10
    assert b.segment_hit(hashes("q", 2), 0) is None


# ------------------------------------------------------------------ the block plan
def test_a_cached_block_is_saved_before_reuse_and_loaded_back(tmp_path) -> None:
    """Two eager blocks, three prompts: the third takes the least recently used block, whose
    chain is saved first; when the first prompt's prefix comes back it is loaded from the
    tier into a fresh block, and the prefill starts past it."""
    t = tier(tmp_path, capacity=10**7)
    m = OuterBlockManager(EAGER, lambda gone: None, t)
    a, b, c = hashes("a", 3), hashes("b", 3), hashes("c", 3)
    for req, h in (("a", a), ("b", b)):
        m.admit(req, h, 0, 400)
        m.tick()
    m.release_missing(set())
    block_a = 0
    m.admit("c", c, 0, 400)
    saves, loads = m.take_host_work()
    assert saves == [HostSave(block_a, 0, 384, tuple(a))] and loads == []
    t.put(0, a, 384, b"kv" * 10)  # what the worker's save writes
    m.release_missing(set())
    m.tick()
    copies, start = m.admit("a2", a + hashes("z", 1), hit_tokens=384, end_tokens=450)
    saves, loads = m.take_host_work()
    assert copies == [] and start == 384  # nothing computed of the hit
    (load,) = loads
    assert load == HostLoad("a2", load.entry, m.table("a2")[0], 0, 384)
    (save,) = saves  # the block it took held another prompt's chain: saved first
    assert save.block == load.block and save.hashes in (tuple(b), tuple(c))


def test_the_device_copy_wins_when_it_holds_as_much(tmp_path) -> None:
    t = tier(tmp_path, capacity=10**7)
    m = OuterBlockManager(EAGER, lambda gone: None, t)
    a = hashes("a", 3)
    m.admit("a", a, 0, 400)
    t.put(0, a, 384, b"kv")
    copies, start = m.admit("b", a + hashes("b", 1), hit_tokens=384, end_tokens=450)
    assert [c.tokens for c in copies] == [384] and m.take_host_work() == ([], [])


def test_an_export_saves_each_segments_full_blocks_the_tier_lacks(tmp_path) -> None:
    """Prefill/decode disaggregation: a prompt's full vLLM blocks, segment by segment, from
    the blocks it owns; nothing of a partial last block, nothing the tier already holds."""
    t = tier(tmp_path, capacity=10**7)
    m = OuterBlockManager(FLASH, lambda gone: None, t)
    h = hashes("p", 5)  # FLASH: segments of 2 vLLM blocks
    m.admit("p", h, 0, 5 * 128 + 40)
    first, second, third = m.table("p")
    assert m.export("p") == [
        HostSave(first, 0, 256, tuple(h[:2])),
        HostSave(second, 256, 256, tuple(h[2:4])),
        HostSave(third, 512, 128, tuple(h[4:5])),
    ]
    t.put(256, h[2:4], 256, b"kv")  # already there: not saved again
    assert [s.start for s in m.export("p")] == [0, 512]
    untiered = OuterBlockManager(FLASH, lambda gone: None)
    untiered.admit("p", h, 0, 640)
    assert untiered.export("p") == []  # no tier


def test_a_prompt_is_exported_after_its_last_chunk_by_role_request_or_write_through() -> None:
    """A prefill engine (``kv_producer``) hands every prompt over, an engine of another role
    a request carrying vLLM's ``do_remote_decode``; a write-through tier saves every prompt
    without handing it over; all only once the whole prompt is computed."""
    from rbln_ray.vllm_plugin.scheduler import RBLNScheduler

    def request(computed: int, params: dict | None = None) -> types.SimpleNamespace:
        return types.SimpleNamespace(
            num_computed_tokens=computed, num_prompt_tokens=300, kv_transfer_params=params
        )

    def scheduler(producer: bool, connector: object, through: bool) -> types.SimpleNamespace:
        s = types.SimpleNamespace(_producer=producer, connector=connector, _write_through=through)
        s._prompt_done = lambda req: RBLNScheduler._prompt_done(s, req)
        return s

    def hands_over(producer: bool, req: types.SimpleNamespace, connector: object = True) -> bool:
        return RBLNScheduler._hands_over(scheduler(producer, connector, False), req)

    def writes_through(through: bool, req: types.SimpleNamespace) -> bool:
        return RBLNScheduler._writes_through(scheduler(False, True, through), req)

    assert hands_over(True, request(300)) and not hands_over(True, request(256))
    assert not hands_over(False, request(300)) and not hands_over(True, request(300), None)
    assert hands_over(False, request(300, {"do_remote_decode": True}))
    assert not hands_over(False, request(300, {"do_remote_decode": False}))
    assert writes_through(True, request(300)) and not writes_through(True, request(256))
    assert not writes_through(False, request(300))


# ------------------------------------------------------------------ the connector
def test_write_through_is_a_boolean_or_refused_by_name() -> None:
    from rbln_ray.vllm_plugin.host_kv_connector import write_through

    assert write_through({}) is False and write_through({"write_through": True}) is True
    for wrong in ("false", 1, None):
        with pytest.raises(ValueError, match="write_through must be true or false"):
            write_through({"write_through": wrong})


def test_the_connector_counts_what_the_plan_can_place(tmp_path) -> None:
    """Segment by segment from the device's hit, each from an entry starting there, and
    never the prompt's last token (vLLM computes at least one)."""
    # imported here: importing vLLM at collection would fix its platform before the unit
    # tier's conftest chooses the emulated RBLN one
    from rbln_ray.vllm_plugin.host_kv_connector import RBLNHostKVConnector

    t = tier(tmp_path, capacity=10**7)
    h = hashes("p", 5)  # FLASH: segments of 2 vLLM blocks
    t.put(0, h[:2], 256, b"kv")
    t.put(256, h[2:4], 256, b"kv")
    connector = RBLNHostKVConnector.__new__(RBLNHostKVConnector)
    connector.tier, connector.block_size = t, 128
    connector.set_layout(FLASH.outer_size, FLASH.per_outer)

    def request(tokens: int) -> types.SimpleNamespace:
        return types.SimpleNamespace(block_hashes=h[: tokens // 128], num_tokens=tokens)

    assert connector.get_num_new_matched_tokens(request(640), 0) == (512, False)
    assert connector.get_num_new_matched_tokens(request(640), 256) == (256, False)
    assert connector.get_num_new_matched_tokens(request(512), 0) == (384, False)  # last token
    assert connector.get_num_new_matched_tokens(request(640), 128) == (384, False)
    # what a prefill engine's answer says of a request it exported (vLLM's kv_transfer_params)
    connector._exported, connector.node_id = {}, "node-a"
    connector.exported("r", 256)
    connector.exported("r", 128)  # preempted and prefilled again: its further blocks
    done = types.SimpleNamespace(request_id="r", block_hashes=h)
    params = {"do_remote_prefill": True, "host_tier": tmp_path.name, "node_id": "node-a",
              "exported_tokens": 384, "block_hashes": [x.hex() for x in h[:3]]}  # fmt: skip
    assert connector.request_finished(done, []) == (False, params)
    assert connector.request_finished(done, []) == (False, None)  # told once
