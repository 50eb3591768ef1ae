"""A replica's report of what its prefix cache holds, from its engine's KV cache events.

Why events: vLLM's scheduler (in the engine core process) publishes every block it caches,
reuses or evicts (``kv_events_config``, vLLM's own interface for cache-aware routers), so the
replica learns what is cached without reaching into the scheduler. The engine publishes on a
private IPC socket this listener connects to *before* the engine starts (so no early event is
lost); a thread applies the events to a :class:`~rbln_ray.serve.kv_index.CachedBlocks`, and
Serve's controller fetches :meth:`KVEventListener.report` every
``request_routing_stats_period_s`` (``LLMServer.record_routing_stats``) and hands it to the
routers (:mod:`rbln_ray.serve.cache_routing`) as the replica's ``routing_stats``.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
import threading
from array import array
from pathlib import Path
from typing import Any

from rbln_ray.serve.kv_index import CachedBlocks

logger = logging.getLogger(__name__)

POLL_MS = 200  # how often the listener thread looks at its stop flag while idle
# Keys of ``routing_stats`` (read by rbln_ray.serve.cache_routing).
STATS_BLOCK_SIZE = "kv_block_size"
STATS_BLOCKS = "kv_blocks"
STATS_EVENTS = "kv_events"
STATS_HOST_BLOCKS = "kv_host_blocks"  # held in the node's host KV tier, not on the device


def pack_keys(keys: list[int]) -> bytes:
    """Block keys as a report carries them: one byte string of native int64s (every key is
    an 8-byte digest). Serve pickles every replica's report into every router's broadcast;
    at 1,024 replicas the keys as lists of ints took 18 ms per broadcast to unpickle, as byte
    strings 1.7 ms (BENCHMARKS, "Fleet simulation")."""
    return array("q", keys).tobytes()


def report_keys(blocks: Any) -> frozenset[int]:
    """A report's keys (:func:`pack_keys`; a list of ints, as replicas reported them before,
    is read too)."""
    if isinstance(blocks, bytes | bytearray | memoryview):
        return frozenset(array("q", bytes(blocks)))
    return frozenset(blocks or ())


class KVEventListener:
    """Subscribes to one engine's KV cache events; :meth:`start` returns a running one."""

    def __init__(self) -> None:
        from vllm import envs

        # beside vLLM's own IPC sockets (VLLM_RPC_BASE_PATH): a killed replica leaves it there
        self._dir = Path(tempfile.mkdtemp(prefix="rbln-ray-kv-", dir=envs.VLLM_RPC_BASE_PATH))
        self.endpoint = f"ipc://{self._dir / 'events'}"
        self.index = CachedBlocks()
        # The node's host KV tier, when the engine has one (rbln_ray.vllm_plugin.host_tier):
        # blocks the device drops that it holds are reported as held there.
        self.tier: Any = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rbln-ray-kv-events", daemon=True)

    @classmethod
    def start(cls, timeout: float = 10.0) -> KVEventListener:
        listener = cls()
        listener._thread.start()
        if not listener._connected.wait(timeout):
            raise RuntimeError(f"KV event listener did not connect to {listener.endpoint}")
        return listener

    def engine_config(self) -> Any:
        """vLLM's ``kv_events_config`` that makes the engine publish to this listener."""
        from vllm.config import KVEventsConfig

        return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=self.endpoint)

    def report(self) -> dict[str, Any]:
        """The replica's ``routing_stats``: the block size, the keys of blocks held on the
        device, and of those held only in the node's host tier."""
        with self._lock:
            if self.tier is not None:
                self.index.prune_host(self._in_tier)
            return {
                STATS_BLOCK_SIZE: self.index.block_size,
                STATS_BLOCKS: pack_keys(self.index.keys()),
                STATS_HOST_BLOCKS: pack_keys(self.index.host_keys()),
                STATS_EVENTS: self.index.events,
            }

    def _in_tier(self, hashes: list[Any]) -> set[Any]:
        held = self.tier.held_hashes(hashes)
        return {h for h in hashes if isinstance(h, bytes) and h in held}

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=2 * POLL_MS / 1000)
        shutil.rmtree(self._dir, ignore_errors=True)

    def apply(self, events: list[Any]) -> None:
        """Apply one batch of vLLM KV events (``BlockStored`` / ``BlockRemoved`` /
        ``AllBlocksCleared``) in order."""
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        with self._lock:
            for event in events:
                if isinstance(event, BlockStored):
                    self.index.stored(
                        event.block_hashes,
                        event.parent_block_hash,
                        event.token_ids,
                        event.block_size,
                        event.extra_keys,
                    )
                elif isinstance(event, BlockRemoved):
                    in_tier = self._in_tier if self.tier is not None else None
                    self.index.removed(event.block_hashes, in_tier)
                elif isinstance(event, AllBlocksCleared):
                    self.index.cleared()

    def _run(self) -> None:
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        sock = zmq.Context.instance().socket(zmq.SUB)
        sock.setsockopt(zmq.SUBSCRIBE, b"")
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self._connected.set()
        expected: int | None = None
        try:
            while not self._stop.is_set():
                if not sock.poll(POLL_MS):
                    continue
                _topic, seq_bytes, payload = sock.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if expected is not None and seq != expected:
                    # The publisher's high-water mark dropped batches: what they stored is
                    # unknown here (reported as not cached), what they evicted may linger
                    # until evicted again; the router's load balance bounds the harm.
                    logger.warning("KV events %d..%d lost", expected, seq - 1)
                expected = seq + 1
                try:
                    self.apply(decoder.decode(payload).events)
                except Exception:  # noqa: BLE001 - one bad batch must not stop the reports
                    logger.exception("could not apply a KV event batch")
        finally:
            sock.close(linger=0)
