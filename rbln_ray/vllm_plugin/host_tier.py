"""A node's host-memory KV tier: KV blocks the device had to drop, kept in host DRAM and shared
by every engine of the node, so a later prompt with the same prefix loads them back instead
of computing them again.

Why: an ATOM holds a few GB of KV cache (16 compiled KV blocks per device in BENCHMARKS 15),
the node beside it hundreds of GB of DRAM. The device's prefix cache drops a cached prefix as
soon as its RBLN block is needed again; a multi-tenant workload (system prompts, documents,
conversations) comes back to it minutes later and prefills it again. Copying the block out
before it is reused (``rebel.Runtime._fetch_kv_cache``) and back when a prompt needs it
(``_update_kv_cache``) costs bytes over the host link (PCIe) instead of a prefill.

Layout, chosen so that any process of the node (engine schedulers, device workers of any
replica) can use it, and a process that dies leaves it consistent:

* **data**: one file per entry in a tmpfs directory (``/dev/shm``: host memory, no disk), the
  KV of one RBLN block's cached prefix (every layer's K and V, positions
  ``[start, start + tokens)``); written under a temporary name and renamed, so a reader sees
  whole files or none; an entry is never changed once written.
* **index**: an SQLite database in the same directory (transactions, one writer at a time,
  readers never blocked): which entries there are, their size and last use (LRU), and for
  every vLLM block hash an entry holds, at which block of the entry. Eviction (beyond
  ``capacity_bytes``) deletes index rows first, then files: a reader that found a row may
  find its file gone and falls back to computing, never to wrong data.

Keys are vLLM's block hashes: with vLLM's default ``sha256`` hashing they are the same in
every process for the same tokens (and fold in the LoRA adapter, ``cache_salt`` and images),
so two replicas of one model share entries and two tenants never do. Entries are also keyed
by ``model``, the compiled artifact's identity (:func:`model_key`), so replicas of different
models on one node never mix.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import sqlite3
import threading
import time
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_ROOT = Path("/dev/shm/rbln-ray-kv")  # tmpfs: host memory
MAGIC = b"RBLNKV01"
_SCHEMA = """
CREATE TABLE IF NOT EXISTS entries (
    id INTEGER PRIMARY KEY AUTOINCREMENT, model TEXT NOT NULL, start INTEGER NOT NULL,
    tokens INTEGER NOT NULL, nbytes INTEGER NOT NULL, last_used REAL NOT NULL);
CREATE TABLE IF NOT EXISTS blocks (
    model TEXT NOT NULL, hash BLOB NOT NULL, entry INTEGER NOT NULL, pos INTEGER NOT NULL,
    PRIMARY KEY (model, hash, entry));
CREATE INDEX IF NOT EXISTS entries_lru ON entries (last_used);
"""


def hash_bytes(block_hash: Hashable) -> bytes:
    """A vLLM block hash as stored (vLLM's ``BlockHash`` is bytes; anything else by repr)."""
    return (
        bytes(block_hash)
        if isinstance(block_hash, bytes | bytearray)
        else repr(block_hash).encode()
    )


def model_key(identity: dict) -> str:
    """A short key of what makes KV reusable: the compiled artifact's identity (its config,
    KV shapes and dtype, given as a JSON-able dict)."""
    text = json.dumps(identity, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class TierHit:
    """Where a segment's cached prefix lies in the tier: ``entry`` holds its first
    ``blocks`` vLLM blocks."""

    entry: int
    blocks: int


@dataclass(frozen=True)
class KVRecord:
    """One entry as it travels between nodes' tiers: the KV of ``tokens`` tokens from
    position ``start`` and the vLLM block hashes it holds (in order, as stored)."""

    start: int
    tokens: int
    hashes: tuple[bytes, ...]
    payload: bytes


class HostKVTier:
    """One node's tier (module docstring). Every method may be called from any process."""

    def __init__(self, root: Path, capacity_bytes: int, model: str) -> None:
        self.root = Path(root)
        self.capacity_bytes = int(capacity_bytes)
        self.model = model
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        self._local = threading.local()
        self._connections: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        self._db.executescript(_SCHEMA)

    @property
    def _db(self) -> sqlite3.Connection:
        """This thread's connection to the index. Per thread: a worker opens the tier in the
        thread that loads its model and steps it in another, and an SQLite connection may
        only be used by one thread at a time."""
        db = getattr(self._local, "db", None)
        if db is None:
            path = self.root / "index.sqlite"  # closed by close(), from any thread:
            db = sqlite3.connect(path, timeout=30, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=OFF")  # tmpfs: nothing survives a reboot anyway
            self._local.db = db
            with self._lock:
                self._connections.append(db)
        return db

    def close(self) -> None:
        with self._lock:
            for db in self._connections:
                db.close()
            self._connections.clear()
        self._local = threading.local()

    # ------------------------------------------------------------------ queries
    def segment_hit(self, hashes: Sequence[Hashable], start: int) -> TierHit | None:
        """The entry starting at token ``start`` that holds the longest prefix of ``hashes``
        (one RBLN block's worth of vLLM block hashes), or None."""
        if not hashes:
            return None
        keys = [hash_bytes(h) for h in hashes]
        marks = ",".join("?" * len(keys))
        rows = self._db.execute(
            f"SELECT b.hash, b.pos, b.entry FROM blocks b JOIN entries e ON e.id = b.entry "
            f"WHERE b.model = ? AND e.start = ? AND b.hash IN ({marks})",
            (self.model, start, *keys),
        ).fetchall()
        position = {key: i for i, key in enumerate(keys)}
        matched: dict[int, set[int]] = {}  # entry -> positions where it holds our hash
        for key, pos, entry in rows:
            if position.get(bytes(key)) == pos:
                matched.setdefault(entry, set()).add(pos)
        best: TierHit | None = None
        for entry, positions in matched.items():
            run = 0
            while run in positions:  # a run from the segment's start (chained hashes make
                run += 1  # any match a whole prefix; this holds without relying on that)
            if run and (best is None or run > best.blocks):
                best = TierHit(entry, run)
        return best

    def held_hashes(self, hashes: Sequence[Hashable]) -> set[bytes]:
        """Which of ``hashes`` some entry of this model holds (at any position)."""
        return {bytes(h) for h in self._blocks_holding("hash", hashes)}

    def _blocks_holding(self, column: str, hashes: Sequence[Hashable]) -> set:
        """``column`` (``hash`` or ``entry``) of this model's block rows with one of
        ``hashes``."""
        keys = [hash_bytes(h) for h in hashes]
        found: set = set()
        for i in range(0, len(keys), 500):  # SQLite's bound on query parameters
            part = keys[i : i + 500]
            rows = self._db.execute(
                f"SELECT DISTINCT {column} FROM blocks WHERE model = ? AND hash IN "
                f"({','.join('?' * len(part))})",
                (self.model, *part),
            )
            found.update(value for (value,) in rows)
        return found

    def holds(self, hashes: Sequence[Hashable], start: int) -> bool:
        """Whether some entry starting at ``start`` already holds all of ``hashes``."""
        hit = self.segment_hit(hashes, start)
        return hit is not None and hit.blocks == len(hashes)

    def usage(self) -> tuple[int, int]:
        """(bytes, entries) held now."""
        nbytes, count = self._db.execute("SELECT COALESCE(SUM(nbytes), 0), COUNT(*) FROM entries"
                                         ).fetchone()  # fmt: skip
        return int(nbytes), int(count)

    def added(self) -> int:
        """Entries ever added to this tier (their ids count up and are never reused): with
        :meth:`usage`'s count, how many the LRU has evicted (soak reports)."""
        row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name = 'entries'"
                               ).fetchone()  # fmt: skip
        return int(row[0]) if row else 0

    # ------------------------------------------------------------------ data
    def path(self, entry: int) -> Path:
        return self.root / f"{entry}.kv"

    def read(self, entry: int, tokens: int) -> bytes | None:
        """An entry's payload if it is still there and holds at least ``tokens`` tokens;
        marks it used (LRU)."""
        try:
            data = self.path(entry).read_bytes()
        except FileNotFoundError:
            return None
        header = data[: len(MAGIC) + 16]
        if header[: len(MAGIC)] != MAGIC or int.from_bytes(header[8:16], "big") < tokens:
            return None
        with contextlib.suppress(sqlite3.OperationalError):  # busy: LRU order can wait
            self._db.execute("UPDATE entries SET last_used = ? WHERE id = ?",
                             (time.time(), entry))  # fmt: skip
        return data[len(MAGIC) + 16 :]

    def put(self, start: int, hashes: Sequence[Hashable], tokens: int, payload: bytes) -> int:
        """Add an entry (the KV of ``tokens`` tokens from position ``start``, whose vLLM block
        hashes are ``hashes``), evicting the least recently used beyond the capacity. Returns
        its id."""
        nbytes = len(payload) + len(MAGIC) + 16
        if nbytes > self.capacity_bytes:
            raise ValueError(f"a {nbytes}-byte KV entry exceeds the tier's {self.capacity_bytes}")
        cur = self._db.execute("BEGIN IMMEDIATE")
        try:
            cur.execute(
                "INSERT INTO entries (model, start, tokens, nbytes, last_used) VALUES "
                "(?, ?, ?, ?, ?)",
                (self.model, start, tokens, nbytes, time.time()),
            )
            entry = int(cur.lastrowid)
            tmp = self.root / f".{entry}.{os.getpid()}.tmp"
            tmp.write_bytes(MAGIC + tokens.to_bytes(8, "big") + len(payload).to_bytes(8, "big")
                            + payload)  # fmt: skip
            os.replace(tmp, self.path(entry))
            cur.executemany(
                "INSERT OR IGNORE INTO blocks (model, hash, entry, pos) VALUES (?, ?, ?, ?)",
                [(self.model, hash_bytes(h), entry, i) for i, h in enumerate(hashes)],
            )
            gone = self._evict(cur)
            cur.execute("COMMIT")
        except BaseException:
            cur.execute("ROLLBACK")
            with contextlib.suppress(NameError, FileNotFoundError):
                tmp.unlink()
            raise
        for old in gone:  # rows are gone: nobody finds these files any more
            with contextlib.suppress(FileNotFoundError):
                self.path(old).unlink()
        return entry

    def _evict(self, cur: sqlite3.Cursor) -> list[int]:
        """Drop least recently used entries (any model's) until within capacity."""
        (total,) = cur.execute("SELECT COALESCE(SUM(nbytes), 0) FROM entries").fetchone()
        gone: list[int] = []
        if total <= self.capacity_bytes:
            return gone
        for entry, nbytes in cur.execute(
            "SELECT id, nbytes FROM entries ORDER BY last_used, id"
        ).fetchall():
            if total <= self.capacity_bytes:
                break
            cur.execute("DELETE FROM entries WHERE id = ?", (entry,))
            cur.execute("DELETE FROM blocks WHERE entry = ?", (entry,))
            total -= nbytes
            gone.append(entry)
        return gone

    def records(self, hashes: Sequence[Hashable]) -> list[KVRecord]:
        """The entries of this model that hold any of ``hashes``, whole (a prompt's KV handed
        to another node's tier; an entry evicted meanwhile is left out)."""
        out = []
        for entry in sorted(self._blocks_holding("entry", hashes)):
            row = self._db.execute("SELECT start, tokens FROM entries WHERE id = ?", (entry,)
                                   ).fetchone()  # fmt: skip
            held = self._db.execute(
                "SELECT hash FROM blocks WHERE entry = ? ORDER BY pos", (entry,)
            ).fetchall()
            payload = self.read(entry, 0) if row else None
            if row and payload is not None:
                out.append(KVRecord(row[0], row[1], tuple(bytes(h) for (h,) in held), payload))
        return out

    def add(self, records: Sequence[KVRecord]) -> int:
        """Put ``records`` (from another node's :meth:`records`) that this tier does not hold
        yet; returns the tokens added."""
        added = 0
        for record in records:
            if not self.holds(record.hashes, record.start):
                self.put(record.start, record.hashes, record.tokens, record.payload)
                added += record.tokens
        return added

    def clear(self) -> None:
        """Empty the tier (every model's entries): benchmarks start each run from nothing."""
        cur = self._db.execute("BEGIN IMMEDIATE")
        ids = [e for (e,) in cur.execute("SELECT id FROM entries").fetchall()]
        cur.execute("DELETE FROM entries")
        cur.execute("DELETE FROM blocks")
        cur.execute("COMMIT")
        for entry in ids:
            with contextlib.suppress(FileNotFoundError):
                self.path(entry).unlink()

    def entries(self) -> Iterator[tuple[int, int, int]]:
        """(id, start, tokens) of every entry of this model (tests, reports)."""
        yield from self._db.execute(
            "SELECT id, start, tokens FROM entries WHERE model = ? ORDER BY id", (self.model,)
        )
