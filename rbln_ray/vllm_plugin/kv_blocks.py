"""Where each request's KV lives on the device: vLLM's small blocks on RBLN's compiled blocks.

Why two block sizes. optimum-rbln compiles the KV cache as ``kvcache_num_blocks`` *RBLN
blocks* of ``kvcache_block_size`` tokens: one whole sequence each with eager attention, one
partition each with flash attention. A sequence's positions ``[j*P, (j+1)*P)`` live in its
``j``-th RBLN block at the same offsets, so prefixes are shareable only position for position.
vLLM's prefix cache works on smaller blocks (here the compiled ``prefill_chunk_size``, 128
tokens: optimum's prefill can resume only at a multiple of it). vLLM's own hash-based KV
cache manager decides which of its blocks are cached, hit and evicted (LRU); this module
decides which RBLN block holds what, and turns a vLLM hit into device work:

* a hit whose KV sits in a *free* RBLN block (a finished or preempted request's) is
  **adopted**: the new request takes that block over, nothing is copied;
* a hit whose KV sits in a block a *running* request owns is **copied** on the device with
  ``rebel.Runtime._copy_kv_cache(src, dst, tokens)`` into a fresh block;
* a hit nobody holds any more (vLLM thought it cached, the device block was reused) is
  **recomputed**: the prefill starts earlier than vLLM's ``num_computed_tokens``.

With a host KV tier (:mod:`rbln_ray.vllm_plugin.host_tier`, switched on by the
``RBLNHostKVConnector``), cached content is not lost when its block is reused: a free block's
chain is **saved** to the tier first (:class:`HostSave`, run by the workers before anything of
the step writes that block), and a hit the tier holds further than any device block is
**loaded** into a fresh block (:class:`HostLoad`) instead of being recomputed.

Each RBLN block remembers the chain of vLLM block hashes it holds (a hash identifies the
whole prefix up to that block, so equal hashes mean equal KV at equal positions). When a
block is overwritten, hashes no other block holds are evicted from vLLM's prefix cache, so
vLLM never reports a hit the device cannot serve in the common case.

Pure bookkeeping (no vLLM, no torch): :class:`~rbln_ray.vllm_plugin.scheduler.RBLNScheduler`
drives it and ships each step's :class:`KVStepPlan` to the workers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from rbln_ray.compile.artifact import CompiledArtifact

logger = logging.getLogger(__name__)

NO_BLOCK = -1  # "no block" in an RBLN block table (unused entries, and no scratch block)


@dataclass(frozen=True)
class BlockLayout:
    """The two block sizes and how many RBLN blocks the compiled artifact has."""

    outer_size: int  # tokens per RBLN block (compiled kvcache_block_size)
    inner_size: int  # tokens per vLLM block
    num_outer: int  # compiled kvcache_num_blocks
    max_seq_len: int

    def __post_init__(self) -> None:
        if self.outer_size % self.inner_size:
            raise ValueError(
                f"vLLM block size {self.inner_size} must divide the RBLN block size "
                f"{self.outer_size}"
            )

    @property
    def per_outer(self) -> int:
        """vLLM blocks per RBLN block."""
        return self.outer_size // self.inner_size

    @property
    def segments_per_seq(self) -> int:
        """RBLN blocks one sequence of ``max_seq_len`` tokens spans (block-table width)."""
        return -(-self.max_seq_len // self.outer_size)

    @property
    def num_inner(self) -> int:
        """vLLM blocks covering every RBLN block (vLLM adds its own null block)."""
        return self.num_outer * self.per_outer

    def segments_for(self, tokens: int) -> int:
        return -(-tokens // self.outer_size)

    @classmethod
    def for_artifact(
        cls, outer_size: int, num_outer: int, max_seq_len: int, chunk: int
    ) -> BlockLayout:
        """vLLM blocks of one prefill chunk when they tile the RBLN block, else whole blocks."""
        inner = chunk if outer_size % chunk == 0 else outer_size
        return cls(outer_size, inner, num_outer, max_seq_len)


def block_layout(art: CompiledArtifact) -> BlockLayout:
    """vLLM blocks of one prefill chunk on the artifact's RBLN blocks."""
    return BlockLayout.for_artifact(
        art.kvcache_block_size, art.kvcache_num_blocks, art.max_seq_len, art.prefill_chunk_size
    )


def shares_uncomputed_blocks(
    waiting: Sequence[Hashable], prompt: Sequence[Hashable], computed_tokens: int, block: int
) -> bool:
    """Whether a waiting prompt (its blocks' prefix-cache hashes) shares more leading blocks
    with a prompt in prefill than that prompt has computed so far (``computed_tokens``, in
    blocks of ``block`` tokens): admitted now, the waiting request would compute them again.
    The RBLN scheduler's rule for advancing that prompt first, and the fleet simulation's."""
    shared = 0
    for mine, theirs in zip(waiting, prompt, strict=False):
        if mine != theirs:
            break
        shared += 1
    return shared > computed_tokens // block


@dataclass(frozen=True)
class KVCopy:
    """One on-device copy: the first ``tokens`` slots of RBLN block ``src`` into ``dst``."""

    src: int
    dst: int
    tokens: int


@dataclass(frozen=True)
class HostSave:
    """Save the first ``tokens`` slots of RBLN block ``block`` to the host tier, before the
    step writes it: positions ``[start, start + tokens)`` of a prefix whose vLLM block hashes
    (of those positions) are ``hashes``."""

    block: int
    start: int
    tokens: int
    hashes: tuple[Hashable, ...]


@dataclass(frozen=True)
class HostLoad:
    """Load host tier entry ``entry``'s first ``tokens`` slots (positions from ``start``)
    into RBLN block ``block`` for request ``req_id``, before its prefill."""

    req_id: str
    entry: int
    block: int
    start: int
    tokens: int


class HostLookup(Protocol):
    """What the block plan asks of a host tier (:class:`~rbln_ray.vllm_plugin.host_tier.
    HostKVTier`)."""

    def segment_hit(self, hashes: Sequence[Hashable], start: int) -> Any: ...

    def holds(self, hashes: Sequence[Hashable], start: int) -> bool: ...


@dataclass
class KVStepPlan:
    """What the workers need from the scheduler for one step, beyond vLLM's own output."""

    kind: str  # "prefill" | "decode" | "verify" (speculative decoding) | "idle"
    tables: dict[str, list[int]] = field(default_factory=dict)  # RBLN block per segment
    copies: list[KVCopy] = field(default_factory=list)  # run before the step's prefill
    # Where a prefill must start when that is earlier than vLLM's num_computed_tokens
    # (part of a vLLM hit no device block holds any more).
    prefill_start: dict[str, int] = field(default_factory=dict)
    scratch_block: int = NO_BLOCK  # padding rows of a decode step write here ...
    scratch_position: int = 0  # ... from this position on, which holds no cached KV
    # A verify step: tokens per row (the compiled verify graph's width; rows with fewer
    # drafts are padded). The tables cover every position it writes, plus ``lookahead``
    # positions a draft model writes while proposing for the next step.
    width: int = 1
    lookahead: int = 0
    # Sliding-window artifacts only (rbln_ray.vllm_plugin.kv_slots): each scheduled
    # request's pinned cache slot, and the slot decode padding rows use.
    slots: dict[str, int] = field(default_factory=dict)
    scratch_slot: int = NO_BLOCK
    # Host KV tier: blocks to save before anything of the step writes them, and entries to
    # load before the prefill (a load that fails prefills from its start instead).
    host_saves: list[HostSave] = field(default_factory=list)
    host_loads: list[HostLoad] = field(default_factory=list)
    # Prefill/decode disaggregation: a prompt's KV saved to the tier after its last chunk,
    # before its first token leaves the engine, for a decode engine to load.
    host_exports: list[HostSave] = field(default_factory=list)


@dataclass
class _Outer:
    """One RBLN block: who writes it, which segment of a sequence it holds, what is cached."""

    index: int
    owner: str | None = None
    segment: int = 0
    chain: list[Hashable] = field(default_factory=list)  # vLLM block hashes held, in order
    last_used: int = 0


class OuterBlockManager:
    """Assigns RBLN blocks to requests and tracks which cached prefixes each one holds.

    ``evict`` is called with vLLM block hashes whose KV no RBLN block holds any more;
    ``host`` is the node's host KV tier, if one is on.
    """

    def __init__(
        self,
        layout: BlockLayout,
        evict: Callable[[list[Hashable]], None],
        host: HostLookup | None = None,
    ) -> None:
        self.layout = layout
        self._evict = evict
        self._host = host
        self._saves: list[HostSave] = []
        self.loads: list[HostLoad] = []
        self._outers = [_Outer(i) for i in range(layout.num_outer)]
        self._owned: dict[str, list[int]] = {}  # request -> RBLN block per segment
        self._holders: dict[Hashable, set[int]] = {}  # hash -> RBLN blocks holding it
        self._maybe_lost: set[Hashable] = set()  # dropped from a chain since the last flush
        self._clock = 0

    # ------------------------------------------------------------------ queries
    def table(self, req_id: str) -> list[int]:
        return list(self._owned.get(req_id, ()))

    def owns(self, req_id: str) -> bool:
        return req_id in self._owned

    def free_count(self) -> int:
        return sum(1 for o in self._outers if o.owner is None)

    def new_blocks_needed(self, req_id: str, end_tokens: int) -> int:
        """RBLN blocks ``req_id`` still needs to hold ``end_tokens`` tokens."""
        return max(0, self.layout.segments_for(end_tokens) - len(self._owned.get(req_id, ())))

    def held_tokens(self, hashes: Sequence[Hashable]) -> int:
        """Tokens of the prefix ``hashes`` that some RBLN block holds, position for position."""
        k, size = self.layout.per_outer, self.layout.inner_size
        held = 0
        for start in range(0, len(hashes), k):
            target = hashes[start : start + k]
            _, matched = self._best_holder(target, free_only=False)
            held += matched * size
            if matched < len(target):
                break
        return held

    # ------------------------------------------------------------------ lifecycle
    def tick(self) -> None:
        self._clock += 1

    def release_missing(self, live: set[str]) -> None:
        """Free the blocks of requests that are no longer running (finished, preempted,
        aborted). Their cached chains stay: a later request may adopt them."""
        for req_id in [r for r in self._owned if r not in live]:
            for index in self._owned.pop(req_id):
                outer = self._outers[index]
                outer.owner = None
                outer.last_used = self._clock

    def admit(
        self, req_id: str, hashes: Sequence[Hashable], hit_tokens: int, end_tokens: int
    ) -> tuple[list[KVCopy], int]:
        """Give a request starting its prefill the RBLN blocks for ``[0, end_tokens)``.

        ``hashes`` are its vLLM block hashes; vLLM reported its first ``hit_tokens`` as cached.
        Returns the copies to run before its prefill and the position the prefill must
        start at (``hit_tokens``, or earlier where no device block holds part of the hit).
        """
        if req_id in self._owned:
            raise RuntimeError(f"request {req_id} already holds RBLN blocks {self._owned[req_id]}")
        size, k = self.layout.inner_size, self.layout.per_outer
        if hit_tokens % size:
            raise ValueError(f"prefix hit of {hit_tokens} tokens is not whole {size}-token blocks")
        hit_blocks = hit_tokens // size
        segments = self.layout.segments_for(max(end_tokens, 1))
        # First pass: which segments reuse a held prefix, and from which block.
        sources: list[tuple[int, int] | None] = []  # (block, blocks matched) per segment
        tier: dict[int, tuple[int, int]] = {}  # segment -> (tier entry, blocks matched)
        start = hit_tokens
        for j in range(segments):
            target = list(hashes[j * k : min((j + 1) * k, hit_blocks)])
            if not target or start < j * self.layout.outer_size:
                sources.append(None)
                continue
            holder, matched = self._best_holder(target, free_only=False)
            hosted = self._host.segment_hit(target, j * self.layout.outer_size) if (
                self._host is not None and matched < len(target)) else None  # fmt: skip
            if hosted is not None and hosted.blocks > matched:  # the tier holds more
                tier[j] = (hosted.entry, hosted.blocks)
                holder, matched = NO_BLOCK, hosted.blocks
                sources.append(None)
            elif matched == 0:
                sources.append(None)
                start = min(start, j * self.layout.outer_size)
                continue
            else:
                free_holder, free_matched = self._best_holder(target, free_only=True)
                if free_matched == matched:  # adopt rather than copy when it costs nothing
                    holder = free_holder
                sources.append((holder, matched))
            if matched < len(target):
                start = min(start, j * self.layout.outer_size + matched * size)
        # Second pass: adopt free holders, then take fresh blocks (never a reserved one).
        reserved = {src for src, _ in filter(None, sources)}
        owned: list[int] = []
        copies: list[KVCopy] = []
        for j, source in enumerate(sources):
            if source is not None and self._outers[source[0]].owner is None:
                index, matched = source
                self._take(index, req_id, j, keep=matched)
            else:
                index = self._fresh(req_id, j, reserved)
                if source is not None:
                    src, matched = source
                    copies.append(KVCopy(src, index, matched * size))
                    self._set_chain(index, list(self._outers[src].chain[:matched]))
                elif j in tier:
                    entry, matched = tier[j]
                    first = j * self.layout.outer_size
                    self.loads.append(HostLoad(req_id, entry, index, first, matched * size))
                    self._set_chain(index, list(hashes[j * k : j * k + matched]))
            owned.append(index)
        self._owned[req_id] = owned
        self.record(req_id, hashes, end_tokens)
        return copies, start

    def export(self, req_id: str) -> list[HostSave]:
        """Saves of what ``req_id``'s blocks hold as recorded (:meth:`record`: its full vLLM
        blocks so far) that the tier does not hold yet, segment by segment (run after the step
        that computes them)."""
        saves = (self._host_save(self._outers[i]) for i in self._owned.get(req_id, ()))
        return [save for save in saves if save is not None]

    def take_host_work(self) -> tuple[list[HostSave], list[HostLoad]]:
        """The host tier saves and loads planned since the last call (one step's)."""
        saves, self._saves = self._saves, []
        loads, self.loads = self.loads, []
        return saves, loads

    def extend(self, req_id: str, hashes: Sequence[Hashable], end_tokens: int) -> None:
        """A running request computes up to ``end_tokens``: add blocks for new segments."""
        owned = self._owned[req_id]
        while len(owned) < self.layout.segments_for(end_tokens):
            owned.append(self._fresh(req_id, len(owned), set()))
        self.record(req_id, hashes, end_tokens)

    def record(self, req_id: str, hashes: Sequence[Hashable], end_tokens: int) -> None:
        """After this step ``req_id``'s blocks hold its first ``end_tokens`` tokens: note the
        full vLLM blocks among them as cached in its RBLN blocks."""
        k = self.layout.per_outer
        full = min(len(hashes), end_tokens // self.layout.inner_size)
        for j, index in enumerate(self._owned[req_id]):
            chain = list(hashes[j * k : min((j + 1) * k, full)])
            if chain != self._outers[index].chain:
                self._set_chain(index, chain)
            self._outers[index].last_used = self._clock

    def scratch(self, tokens: int = 1) -> tuple[int, int]:
        """(block, position) padding rows may write ``tokens`` tokens at without destroying
        cached KV (``tokens`` <= the vLLM block size: a verify step's width).

        The free block with the least cached content, at the first position past it; a
        fully cached block gives up its last vLLM block. ``NO_BLOCK`` when none is free.
        """
        if tokens > self.layout.inner_size:
            raise ValueError(f"scratch of {tokens} tokens exceeds a vLLM block")
        free = [o for o in self._outers if o.owner is None]
        if not free:
            return NO_BLOCK, 0
        outer = min(free, key=lambda o: (len(o.chain), o.last_used))
        if len(outer.chain) >= self.layout.per_outer:
            self._spill(outer)
            self._set_chain(outer.index, outer.chain[: self.layout.per_outer - 1])
            return outer.index, self.layout.outer_size - tokens
        return outer.index, len(outer.chain) * self.layout.inner_size

    # ------------------------------------------------------------------ internals
    def _best_holder(self, target: Sequence[Hashable], free_only: bool) -> tuple[int, int]:
        """(block, matched vLLM blocks) of the block holding the longest prefix of ``target``."""
        for i in range(len(target) - 1, -1, -1):
            holders = self._holders.get(target[i], ())
            for index in sorted(holders):
                outer = self._outers[index]
                if free_only and outer.owner is not None:
                    continue
                if i < len(outer.chain) and outer.chain[i] == target[i]:
                    return index, i + 1
        return NO_BLOCK, 0

    def _take(self, index: int, req_id: str, segment: int, keep: int) -> None:
        outer = self._outers[index]
        if keep < len(outer.chain):
            self._spill(outer)  # before the new owner writes past what it keeps
            self._set_chain(index, outer.chain[:keep])
        outer.owner, outer.segment, outer.last_used = req_id, segment, self._clock

    def _spill(self, outer: _Outer) -> None:
        """Plan saving a free block's cached chain to the host tier before it is lost
        (unless the tier already holds it)."""
        save = self._host_save(outer) if outer.owner is None else None
        if save is not None:
            self._saves.append(save)

    def _host_save(self, outer: _Outer) -> HostSave | None:
        """A save of ``outer``'s cached chain to the host tier, unless there is nothing to
        save or the tier already holds it."""
        if self._host is None or not outer.chain:
            return None
        start = outer.segment * self.layout.outer_size
        if self._host.holds(outer.chain, start):
            return None
        tokens = len(outer.chain) * self.layout.inner_size
        return HostSave(outer.index, start, tokens, tuple(outer.chain))

    def _fresh(self, req_id: str, segment: int, reserved: set[int]) -> int:
        """A free block for a new segment: one with nothing cached, else the least recently
        used (its cached chain is lost)."""
        candidates = [o for o in self._outers if o.owner is None and o.index not in reserved]
        if not candidates:
            raise RuntimeError(
                f"no free RBLN KV block for request {req_id} (all {self.layout.num_outer} "
                "are held by running requests); the scheduler must not admit or extend it"
            )
        outer = min(candidates, key=lambda o: (bool(o.chain), o.last_used))
        self._take(outer.index, req_id, segment, keep=0)
        return outer.index

    def flush_evictions(self) -> None:
        """Evict from vLLM the hashes no RBLN block holds any more. Called once per step,
        after every request's blocks are recorded: a hash dropped by one block and written
        by another in the same step (a request recomputing a prefix) stays cached."""
        gone = [h for h in self._maybe_lost if not self._holders.get(h)]
        self._maybe_lost.clear()
        for h in gone:
            self._holders.pop(h, None)
        if gone:
            self._evict(gone)

    def _set_chain(self, index: int, chain: list[Hashable]) -> None:
        outer = self._outers[index]
        for h in set(outer.chain) - set(chain):
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(index)
            self._maybe_lost.add(h)
        for h in chain:
            self._holders.setdefault(h, set()).add(index)
        outer.chain = chain
