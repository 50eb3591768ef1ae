"""Which prompt prefixes a replica's KV cache holds, in a key space the router can compute.

Why a key of our own. vLLM names a cached block by a hash chained over the tokens of every
block before it, salted per process (``PYTHONHASHSEED``) and by extra keys (LoRA, images,
``cache_salt``): one replica's names mean nothing to the router or to another replica. Its KV
cache events (``BlockStored``) carry each stored block's tokens, its extra keys and its
parent's vLLM hash, so a replica can rename every block it holds by :func:`chain_hashes` over
the same tokens and extra keys, which the router computes from a request alone: block ``i``'s
key stands for the whole prefix ``tokens[: (i + 1) * block_size]`` under the request's LoRA
adapter and ``cache_salt``, so "the first ``k`` keys are held" means "``k`` blocks of this
prompt need no prefill there".

Why the extra keys: vLLM never shares a block between two ``cache_salt`` values or two LoRA
adapters (they are in its block hashes), and neither may the router's keys, or a request
would be routed to a replica because *another tenant* cached its prompt there, and a client
could learn from where it was sent what others ask (RELIABILITY.md, "Tenant isolation").
:func:`block_extra_keys` builds a request's keys as vLLM's ``generate_block_hash_extra_keys``
does for text (the adapter's name on every block, the salt on the first); a block with image
keys the router cannot compute is simply never matched.

Pure bookkeeping (no vLLM, no ZeroMQ): :mod:`rbln_ray.serve.kv_events` feeds it the engine's
events; :mod:`rbln_ray.serve.cache_routing` computes the same keys for requests.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any

ROOT = b"rbln-ray-kv-root"  # the parent of every prompt's first block
ExtraKeys = tuple[Any, ...] | None  # one block's extra keys, as vLLM's events carry them


def _key(parent: bytes, tokens: Sequence[int], extra: ExtraKeys = None) -> bytes:
    data = parent + array("q", tokens).tobytes()
    if extra:
        data += b"\0" + repr(tuple(extra)).encode()
    return hashlib.blake2b(data, digest_size=8).digest()


def block_extra_keys(index: int, lora_name: str | None, cache_salt: str | None) -> ExtraKeys:
    """Block ``index``'s extra keys for a text prompt, as vLLM computes them (LoRA name on
    every block, then the ``cache_salt`` on the first)."""
    keys = ([lora_name] if lora_name else []) + ([cache_salt] if index == 0 and cache_salt else [])
    return tuple(keys) if keys else None


def chain_hashes(
    tokens: Sequence[int],
    block_size: int,
    limit: int | None = None,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """Keys of the full blocks of ``tokens`` (a partial last block has none), at most
    ``limit``; key ``i`` depends on every token up to the end of block ``i`` and on the
    request's LoRA adapter and ``cache_salt``."""
    if block_size < 1:
        raise ValueError(f"block_size must be positive, not {block_size}")
    count = len(tokens) // block_size
    if limit is not None:
        count = min(count, limit)
    # The bytes _key hashes, packed once for the whole prompt (the same keys, ~10 % faster).
    packed = array("q", tokens[: count * block_size]).tobytes()
    width = 8 * block_size
    keys, parent = [], ROOT
    for i in range(count):
        data = parent + packed[i * width : (i + 1) * width]
        extra = block_extra_keys(i, lora_name, cache_salt)
        if extra:
            data += b"\0" + repr(tuple(extra)).encode()
        parent = hashlib.blake2b(data, digest_size=8).digest()
        keys.append(int.from_bytes(parent, "big", signed=True))
    return keys


def extend_chain(
    keys: Sequence[int],
    tokens: Sequence[int],
    block_size: int,
    lora_name: str | None = None,
    cache_salt: str | None = None,
) -> list[int]:
    """:func:`chain_hashes` of ``tokens`` when ``keys`` are already those of its first
    ``len(keys)`` blocks (a conversation's next turn extends the last one's prompt): only
    the blocks after them are hashed."""
    done = len(keys)
    if not done:
        return chain_hashes(tokens, block_size, lora_name=lora_name, cache_salt=cache_salt)
    count = len(tokens) // block_size
    packed = array("q", tokens[done * block_size : count * block_size]).tobytes()
    width = 8 * block_size
    out, parent = list(keys[:count]), keys[done - 1].to_bytes(8, "big", signed=True)
    for i in range(done, count):
        data = parent + packed[(i - done) * width : (i - done + 1) * width]
        extra = block_extra_keys(i, lora_name, cache_salt)
        if extra:
            data += b"\0" + repr(tuple(extra)).encode()
        parent = hashlib.blake2b(data, digest_size=8).digest()
        out.append(int.from_bytes(parent, "big", signed=True))
    return out


def held_prefix(keys: Sequence[int], *holds: Iterable[int] | set[int]) -> int:
    """How many leading ``keys`` are in any of ``holds`` (sets or dict-likes)."""
    count = 0
    for key in keys:
        if not any(key in h for h in holds):  # type: ignore[operator]
            break
        count += 1
    return count


class CachedBlocks:
    """The blocks one engine's prefix cache holds, renamed to :func:`chain_hashes` keys.

    Applies vLLM's KV cache events in order: ``stored`` (a block became cached, or a cached
    one was reused: the same names again), ``removed`` (evicted), ``cleared`` (the whole
    cache reset). A stored block whose parent this index never saw (an event lost before the
    listener connected) cannot be renamed and is left out: the router then sees less cached
    than there is, never more.
    """

    def __init__(self) -> None:
        self._keys: dict[Hashable, bytes] = {}  # vLLM block hash -> our key
        # Blocks the device dropped that the node's host KV tier holds (vLLM hash -> key)
        self.host: dict[Hashable, bytes] = {}
        self.block_size: int | None = None
        self.events = 0  # events applied (reports say how fresh they are)

    def stored(
        self,
        block_hashes: Sequence[Hashable],
        parent: Hashable | None,
        token_ids: Sequence[int],
        block_size: int,
        extra_keys: Sequence[ExtraKeys] | None = None,
    ) -> None:
        self.events += 1
        if len(token_ids) != len(block_hashes) * block_size:
            return  # a partial block (vLLM caches those only with hybrid block sizes)
        if parent is None:
            key = ROOT
        elif parent in self._keys:
            key = self._keys[parent]
        elif parent in self.host:  # loaded back from the host tier
            key = self.host[parent]
        else:
            return
        self.block_size = block_size
        for i, block_hash in enumerate(block_hashes):
            self.host.pop(block_hash, None)  # back on the device
            extra = extra_keys[i] if extra_keys and i < len(extra_keys) else None
            key = _key(key, token_ids[i * block_size : (i + 1) * block_size], extra)
            self._keys[block_hash] = key

    def removed(
        self, block_hashes: Iterable[Hashable], in_host: Callable[[list], set] | None = None
    ) -> None:
        """Blocks evicted from the device; those ``in_host`` says the host tier holds (a
        filter over vLLM hashes) stay known as held there."""
        self.events += 1
        gone = [(h, self._keys.pop(h)) for h in block_hashes if h in self._keys]
        if in_host is not None and gone:
            kept = in_host([h for h, _ in gone])
            self.host.update((h, key) for h, key in gone if h in kept)

    def prune_host(self, in_host: Callable[[list], set]) -> None:
        """Forget host-held blocks the tier no longer holds (evicted by any engine)."""
        if self.host:
            kept = in_host(list(self.host))
            self.host = {h: k for h, k in self.host.items() if h in kept}

    def host_keys(self) -> list[int]:
        """Keys of the blocks held only in the host tier (sorted)."""
        device = set(self._keys.values())
        return sorted({int.from_bytes(k, "big", signed=True) for k in self.host.values()
                       if k not in device})  # fmt: skip

    def cleared(self) -> None:
        self.events += 1
        self._keys.clear()
        self.host.clear()

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self) -> list[int]:
        """Every held block's key (sorted, so equal contents report equal lists)."""
        return sorted({int.from_bytes(k, "big", signed=True) for k in self._keys.values()})


class HolderIndex:
    """Which replicas hold each key: the inverse of every replica's report, replicas named by
    small integer *slots* and sets of them as bitmasks (bit ``s`` = slot ``s``).

    Why: a router over hundreds of replicas cannot afford to ask each replica's key set
    whether it holds a prompt's blocks (:func:`held_prefix` per replica is O(replicas) per
    request); this answers "who holds key ``k``" with one lookup, and :func:`depth_classes`
    walks a prompt's keys through it with one AND per key. Bounded by what the reports hold:
    one entry per key held anywhere; a key one replica holds costs a small int (its slot,
    stored as ``~slot``), a key several hold one bitmask of the slots.
    """

    def __init__(self) -> None:
        self._holders: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._holders)

    def add(self, slot: int, keys: Iterable[int]) -> None:
        holders, bit = self._holders, 1 << slot
        for key in keys:
            found = holders.get(key)
            if found is None:
                holders[key] = ~slot
            elif found < 0:
                if found != ~slot:
                    holders[key] = (1 << ~found) | bit
            else:
                holders[key] = found | bit

    def remove(self, slot: int, keys: Iterable[int]) -> None:
        holders, bit = self._holders, 1 << slot
        for key in keys:
            found = holders.get(key)
            if found is None:
                continue
            if found < 0:
                if found == ~slot:
                    del holders[key]
                continue
            left = found & ~bit
            if left & (left - 1):
                holders[key] = left
            elif left:
                holders[key] = ~(left.bit_length() - 1)
            else:
                del holders[key]

    def mask(self, key: int) -> int:
        """The slots holding ``key``, as a bitmask (0: none)."""
        found = self._holders.get(key)
        if found is None:
            return 0
        return 1 << ~found if found < 0 else found

    def entries(self) -> int:
        """(key, replica) pairs held: the index's size in holdings."""
        return sum(1 if h < 0 else h.bit_count() for h in self._holders.values())


def slots_of(mask: int) -> list[int]:
    """The slots (set bits) of a bitmask, lowest first."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def depth_classes(keys: Sequence[int], mask_of: Callable[[int], int]) -> list[tuple[int, int]]:
    """The replicas holding a prompt's first key, grouped by how many leading ``keys`` they
    hold (:func:`held_prefix` of each replica at once): ``[(depth, slots bitmask), ...]``,
    deepest last, each replica in one group; ``mask_of(key)`` gives the slots holding
    ``key``. Replicas holding none are in no group (depth 0)."""
    if not keys:
        return []
    alive = mask_of(keys[0])
    groups: list[tuple[int, int]] = []
    for i in range(1, len(keys)):
        if not alive:
            return groups
        kept = alive & mask_of(keys[i])
        if kept != alive:
            groups.append((i, alive & ~kept))
            alive = kept
    if alive:
        groups.append((len(keys), alive))
    return groups
