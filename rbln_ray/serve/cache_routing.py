"""Cache-aware routing (``routing: cache_aware``): each request goes where its prompt is cached.

Why: in multi-turn chat and RAG every request repeats a long prefix (a tenant's system
prompt, a conversation's history, a retrieved document). A replica that holds that prefix in
its KV cache prefills only the new tokens; any other replica prefills it all again. Round
robin (or least-load) scatters a conversation over every replica, so each re-prefills what
another holds.

What the router knows, per replica:

* **what it caches**: each replica reports the blocks its prefix cache holds
  (:mod:`rbln_ray.serve.kv_events`, from vLLM's KV cache events) as Serve ``routing_stats``,
  and, with a host KV tier, the blocks its device dropped that its node's tier holds (the
  replicas of one node share that tier, so each replica is credited with what any replica
  of its node put there: :meth:`CacheAwareRouter._host_by_node`),
  keyed by :func:`~rbln_ray.serve.kv_index.chain_hashes` of their tokens. The router
  tokenizes a request's prompt as the replica will (the model's tokenizer and chat template)
  and counts how many of its leading blocks each replica holds;
* **what it was just sent**: a report lags by up to ``request_routing_stats_period_s`` plus
  the prefill itself, so the prompt blocks of requests this router sent a replica count as
  held there while they run and for :data:`RECENT_TTL_S` after;
* **its load**: requests in flight (this router's count, or Serve's queue-length cache when
  larger: other ingress replicas route too) against its ``max_ongoing_requests``. With
  several ingress replicas each router counts only its own sends, and Serve's cache forgets
  a replica after 10 s without a send there (at 1,024 replicas a router reaches each one
  every ~10 s): so replicas also report their load with their cache, every router takes
  ``reported - the most it had there since the report before`` when it first sees a report
  as the load the other routers put there (a report is up to a period old when it arrives:
  its own requests that ended meanwhile must not read as others'), and counts ``its own +
  that`` (:meth:`CacheAwareRouter._known_load`);
* **its service times**: each replica also reports how long its recent requests took to
  prefill per uncached token and how long they held a decode slot
  (:mod:`rbln_ray.serve.service_times`, from vLLM's request stats);
* **the session**: requests naming a session (an ``x-session-id`` header, else the OpenAI
  ``user`` field) prefer the replica that served the session last.

Choice (:func:`order_candidates`): the replica where the request's first token comes soonest.
Per replica that is the wait for a decode slot (a replica running ``B`` requests, the
compiled batch, frees one every ``service / B`` seconds, and the request waits for as many as
are ahead of it) plus the prefill of the prompt tokens past the prefix it holds (tokens its
node's host tier holds cost a transfer instead: :data:`HOST_LOAD_FRACTION` of a prefill).
(Prefills ahead of it on a replica with free slots are not priced: requests of a burst
sharing a prefix then wait for its one prefill on one replica instead of each prefilling it on
another, which would be sooner for each and slower for all.) So a turn stays where its
history is cached unless waiting there costs more than prefilling that history elsewhere: a
slot wait of a few seconds is worth a 3,000-token miss, a 100-token miss is not worth any
wait. Ties (equal estimates: replicas with free slots that hold the same prefix) go to the
longer held prefix, then to the session's replica, then to a rendezvous hash of the session
(or, without one, of the prompt's first characters), so a new conversation's turns, and a
burst of requests sharing a prefix nobody holds yet, agree on a replica without any state,
while distinct sessions spread evenly. Until the replicas report times (no user request has
ended yet), a replica carrying at most ``B`` requests more than the least loaded one stands
in for "no wait", and the longest held prefix decides among those. Full replicas come last.
The other replicas follow in the same order, so Serve moves on when the first is full when
it probes it.

At scale (more than :data:`EXACT_SCAN_MAX` replicas) the same order is computed without
visiting every replica per request (:meth:`CacheAwareRouter._indexed_choice`). Replicas get
small integer slots, and sets of replicas are bitmasks of slots: an inverted index from block
key to the replicas holding it (kept per report, :class:`~rbln_ray.serve.kv_index.HolderIndex`,
and likewise for recent sends) gives, with one AND per prompt block, the replicas holding each
prefix depth; the router keeps its replicas grouped by load, and by node where a node's
host KV tier holds blocks past a depth. Every replica of one (load, depth, host depth) class
has the same estimate, so the estimate is computed per class, and only the best
classes' members are ranked, until the :data:`TOP_CHOICES` best replicas are known (Serve asks
again when all of them refuse). The one difference from the full scan is the rendezvous hash
that breaks ties: a 64-bit mix of hashes of the key and of the replica id
(:func:`hashed_ranks`), computed with numpy for a whole class at once, instead of one blake2b
per replica (which alone takes over a millisecond at 1,024 replicas). Both are rendezvous
hashes: every router agrees on the same replica without shared state, sessions spread evenly,
and a replica that leaves moves only its own ties.

Restarts and scale-ups: state is per replica id; a replica that leaves takes its reports,
recent sends and sessions with it (its sessions go where their cached prefix or the hash
sends them), and a new one starts with nothing cached and takes new work by load.
"""

from __future__ import annotations

import asyncio
import bisect
import hashlib
import json
import logging
import threading
import time
from array import array
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from rbln_ray.serve.kv_events import (
    STATS_BLOCK_SIZE,
    STATS_BLOCKS,
    STATS_EVENTS,
    STATS_HOST_BLOCKS,
    report_keys,
)
from rbln_ray.serve.kv_index import (
    HolderIndex,
    chain_hashes,
    depth_classes,
    held_prefix,
    slots_of,
)
from rbln_ray.serve.routing import PREFIX_CHARS, fixed_choice, rank
from rbln_ray.serve.service_times import (
    STATS_LOAD,
    STATS_PREFILL_S_PER_TOKEN,
    STATS_REPORT,
    STATS_SERVICE_S,
)

logger = logging.getLogger(__name__)

SESSION_HEADER = "x-session-id"
SESSION_KWARG = "session"  # the handle-call keyword the ingress passes the header in
MAX_SESSION_CHARS = 256  # a longer session id is cut (it is only a routing key)
DEFAULT_BLOCK_SIZE = 128  # vLLM block size until a replica reports its own (RBLN: the chunk)
# Sent prompt blocks count as held for this long after their request ends: long enough for
# the replica's next report (period 1 s, jittered by Serve, plus the broadcast) to show them.
RECENT_TTL_S = 5.0
STATS_PERIOD_S = 1.0  # request_routing_stats_period_s of cache-aware deployments
MAX_SESSIONS = 100_000  # remembered session -> replica pairs (least recently used dropped)
MAX_PENDING = 4096  # requests whose routing inputs are cached while they wait for a replica
# What a token its node's host KV tier holds costs against a prefilled one: its KV crosses the
# host link (llama-3-8b on ATOM: 128 KiB at ~50 GB/s, ~2.6 us) where a prefill computes it
# (~0.8 ms: npu/cost_model.py). Deliberately pessimistic: the choice only needs its order of
# magnitude.
HOST_LOAD_FRACTION = 0.01
# Up to this many replicas every decision scores every replica (the order every figure up to
# 8 replicas was measured with: BENCHMARKS 15); beyond, the indexed path (module docstring),
# which is cheaper from about there on (BENCHMARKS, "Fleet simulation").
EXACT_SCAN_MAX = 8
TOP_CHOICES = 8  # replicas the indexed path returns, best first
# Tokenizing for routing: at most this long a request (then it is routed without tokens), at
# most this many renders queued, at most this much text (a longer prompt is routed by its
# start, or without tokens for chat).
TOKENIZE_BUDGET_S = 1.0
MAX_WAITING_RENDERS = 64
MAX_CHARS = 256 * 1024
# Chat-template kwargs a request may never pass, whatever the template reads.
REFUSED_TEMPLATE_KWARGS = frozenset(
    {"chat_template", "tokenize", "return_dict", "return_tensors", "tokenizer_kwargs",
     "return_assistant_tokens_mask", "padding", "truncation", "max_length"}
)  # fmt: skip


@dataclass(frozen=True)
class Candidate:
    """One replica as the policy sees it."""

    replica_id: str
    load: int  # requests in flight
    capacity: int  # max_ongoing_requests
    held_blocks: int  # leading blocks of this prompt the replica holds
    ttft_s: float | None = None  # estimated time to this request's first token there
    host_blocks: int = 0  # blocks past those its node's host KV tier holds


@dataclass(frozen=True)
class ServiceRates:
    """What a replica's time goes to, as the replicas last reported it (pooled: the same
    device and model everywhere, so one replica's noise does not break ties)."""

    prefill_s_per_token: float
    service_s: float  # how long a request holds a decode slot


def estimate_ttft(
    rates: ServiceRates, batch_size: int, load: int, uncached_tokens: int, host_tokens: int = 0
) -> float:
    """Seconds to a request's first token on a replica carrying ``load`` requests (running and
    queued) with ``batch_size`` decode slots, that must prefill ``uncached_tokens`` and load
    ``host_tokens`` from its node's host KV tier."""
    ahead = max(0, load - batch_size + 1)  # requests that must end before a slot frees
    slot_wait = ahead * rates.service_s / max(1, batch_size)
    loads = host_tokens * rates.prefill_s_per_token * HOST_LOAD_FRACTION
    return slot_wait + uncached_tokens * rates.prefill_s_per_token + loads


def order_candidates(
    candidates: list[Candidate],
    session_replica: str | None,
    key: str,
    load_slack: int,
    tiebreak: dict[str, int] | None = None,
) -> list[str]:
    """Replica ids, most preferred first (see the module docstring for the rule): by
    estimated time to first token when every candidate has one, else within ``load_slack``
    of the least loaded. ``tiebreak`` (replica id -> place) replaces the blake2b rendezvous
    order of ``key`` as the last rule (the indexed path's, :func:`hashed_ranks`)."""
    if not candidates:
        return []
    hashed = tiebreak or {
        rid: i for i, rid in enumerate(rank(key, [c.replica_id for c in candidates]))
    }
    least = min((c.load for c in candidates if c.load < c.capacity), default=0)
    timed = all(c.ttft_s is not None for c in candidates)

    def preference(c: Candidate) -> tuple:
        soon = c.ttft_s if timed else float(c.load > least + load_slack)
        return (
            c.load >= c.capacity,  # not available: a full replica goes last
            soon,
            -c.held_blocks,
            c.replica_id != session_replica,
            hashed[c.replica_id],
        )

    return [c.replica_id for c in sorted(candidates, key=preference)]


# ------------------------------------------------------------------ the indexed path's hash
_M64 = (1 << 64) - 1
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finalizer


def hash64(text: str) -> int:
    """A 64-bit hash of a routing key or replica id."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def _mix64(x: int) -> int:
    x ^= x >> 30
    x = (x * _MIX1) & _M64
    x ^= x >> 27
    x = (x * _MIX2) & _M64
    return x ^ (x >> 31)


def _mix64_array(x: np.ndarray) -> np.ndarray:
    """:func:`_mix64` of every element of a uint64 array (multiplication wraps mod 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(_MIX1)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(_MIX2)
    return x ^ (x >> np.uint64(31))


def hashed_ranks(key: str, replica_ids: list[str]) -> dict[str, int]:
    """The indexed path's rendezvous order of ``key``: replica id -> place (0 first), by
    ``mix64(hash64(key) ^ hash64(replica id))`` descending, then by replica id."""
    k = hash64(key)
    order = sorted(replica_ids, key=lambda rid: (-_mix64(k ^ hash64(rid)), rid))
    return {rid: place for place, rid in enumerate(order)}


def _bits(mask: int, width: int) -> np.ndarray:
    """The slots of a bitmask as an index array (numpy: for large masks)."""
    raw = np.frombuffer(mask.to_bytes((width + 7) // 8, "little"), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(raw, bitorder="little"))


# ------------------------------------------------------------------ what a request says
def _field(request: Any, name: str) -> Any:
    if isinstance(request, dict):
        return request.get(name)
    return getattr(request, name, None)


def _body(request: Any) -> Any:
    """The request as fields: a parsed vLLM request or dict as is; an HTTP call object (a
    ``body`` of JSON bytes) parsed."""
    body = getattr(request, "body", None)
    if isinstance(body, bytes | bytearray):
        try:
            parsed = json.loads(body or b"{}")
        except ValueError:
            return {}
        return parsed if isinstance(parsed, dict) else {}
    return request


def session_of(request: Any, kwargs: dict[str, Any]) -> str | None:
    """The request's session: the ``x-session-id`` header (passed as the ``session`` keyword,
    or among an HTTP call's headers), else the OpenAI ``user`` field."""
    session = kwargs.get(SESSION_KWARG)
    if not session:
        for name, value in getattr(request, "headers", None) or ():
            if name.lower() in (SESSION_HEADER, SESSION_HEADER.encode()):
                session = value.decode("latin-1") if isinstance(value, bytes) else value
                break
    if not session:
        session = _field(_body(request), "user")
    return str(session)[:MAX_SESSION_CHARS] if session else None


def _text(content: Any) -> str:
    """A chat message's content as vLLM's "string" content format renders it."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [
            p.get("text", "") if isinstance(p, dict) else str(p)
            for p in content
            if not isinstance(p, dict) or p.get("type", "text") == "text"
        ]
        return "\n".join(parts)
    return "" if content is None else str(content)


class PromptTokenizer:
    """The model's tokenizer and chat template, loaded in the background when the router
    starts, to compute a request's prompt tokens as the replica will (best effort: a
    template feature this does not reproduce only costs cache hits, never correctness).

    Why so guarded: the router runs in the ingress (and in every process that holds a
    handle), so whatever it renders, every client waits behind. It renders only the model's
    own template, with only the ``chat_template_kwargs`` that template reads (never a
    template or option the request brings: vLLM refuses those too, but only later, on the
    replica), on one thread of its own, and waits at most ``budget_s`` for the tokens; past
    that, or with more than :data:`MAX_WAITING_RENDERS` renders queued, or for text longer
    than ``max_chars``, the request is routed without tokens (by session and load).
    """

    def __init__(
        self, path: str | None, budget_s: float = TOKENIZE_BUDGET_S, max_chars: int = MAX_CHARS
    ) -> None:
        self.path = path
        self.budget_s = budget_s
        self.max_chars = max_chars
        self._tokenizer: Any = None
        self._template_kwargs: frozenset[str] = frozenset()
        self._failed = path is None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rbln-ray-routing")
        self._waiting = 0
        self._lock = threading.Lock()
        if path is not None:
            self._pool.submit(self._load)

    def _load(self) -> Any:
        if self._tokenizer is None and not self._failed:
            try:
                from transformers import AutoTokenizer

                from rbln_ray.models.demo import resolve_model

                path, _ = resolve_model(self.path)  # "demo": the trained demo model
                tokenizer = AutoTokenizer.from_pretrained(path)
                self._template_kwargs = template_variables(tokenizer)
                self._tokenizer = tokenizer
            except Exception as exc:  # noqa: BLE001 - route by prefix text instead
                logger.warning("cache-aware routing without tokens for %s: %s", self.path, exc)
                self._failed = True
        return self._tokenizer

    async def tokens_within_budget(self, request: Any) -> list[int] | None:
        """:meth:`tokens` on the router's own thread, or None past the budget."""
        return await self._within_budget(self.tokens, request)

    async def keys_within_budget(
        self, request: Any, block_size: int, lora: str | None, salt: str | None
    ) -> tuple[list[int] | None, list[int] | None]:
        """(tokens, their :func:`chain_hashes` keys) on the router's own thread, within the
        same budget: hashing a long prompt's blocks takes as long as a decision, and belongs
        off the event loop as much as tokenizing does."""

        def work(req: Any) -> tuple[list[int] | None, list[int] | None]:
            tokens = self.tokens(req)
            if tokens is None:
                return None, None
            return tokens, chain_hashes(tokens, block_size, lora_name=lora, cache_salt=salt)

        found = await self._within_budget(work, request)
        return found if found is not None else (None, None)

    async def _within_budget(self, work: Callable[[Any], Any], request: Any) -> Any:
        with self._lock:
            if self._waiting >= MAX_WAITING_RENDERS:
                return None
            self._waiting += 1
        future = self._pool.submit(work, request)
        future.add_done_callback(self._finished)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.budget_s)
        except TimeoutError:
            logger.info("routing without tokens: tokenizing took over %g s", self.budget_s)
            return None

    def _finished(self, _: Any) -> None:
        with self._lock:
            self._waiting -= 1

    def tokens(self, request: Any) -> list[int] | None:
        body = _body(request)
        prompt = _field(body, "prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list | str):
            prompt = prompt[0]  # several prompts: route by the first
        if isinstance(prompt, list) and _token_ids(prompt):
            return list(prompt)
        tokenizer = self._load()
        if tokenizer is None:
            return None
        try:
            if isinstance(prompt, str):
                special = _field(body, "add_special_tokens")
                text = prompt[: self.max_chars]
                return tokenizer.encode(text, add_special_tokens=special is not False)
            messages = _field(body, "messages")
            if not isinstance(messages, list) or not messages:
                return None
            rendered = [
                {"role": _field(m, "role"), "content": _text(_field(m, "content"))}
                for m in messages
            ]
            if sum(len(m["content"]) for m in rendered) > self.max_chars:
                return None
            generation = _field(body, "add_generation_prompt")
            given = _field(body, "chat_template_kwargs")
            kwargs = {
                k: v
                for k, v in (given if isinstance(given, dict) else {}).items()
                if k in self._template_kwargs
            }
            text = tokenizer.apply_chat_template(
                rendered,
                tokenize=False,
                add_generation_prompt=generation is not False,
                **kwargs,
            )
            special = _field(body, "add_special_tokens")
            return tokenizer.encode(text[: self.max_chars], add_special_tokens=bool(special))
        except Exception as exc:  # noqa: BLE001 - route without tokens
            logger.debug("could not tokenize a request for routing: %s", exc)
            return None


def _token_ids(values: list[Any]) -> bool:
    """Whether a prompt is token ids: 64-bit integers (what block keys pack), checked in C
    (a 4,000-token prompt's ``isinstance`` per token took milliseconds in the ingress)."""
    try:
        array("q", values)
    except (TypeError, OverflowError):
        return False
    return True


def template_variables(tokenizer: Any) -> frozenset[str]:
    """The variables the model's own chat template reads, less what a request may never set
    (the ``chat_template_kwargs`` a router passes on: vLLM's replica filters them the same
    way, ``resolve_chat_template_kwargs``)."""
    import jinja2
    import jinja2.meta

    templates = getattr(tokenizer, "chat_template", None)
    if isinstance(templates, dict):
        templates = list(templates.values())
    names: set[str] = set()
    for template in [templates] if isinstance(templates, str) else templates or ():
        try:
            names |= jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(template))
        except jinja2.TemplateError:
            continue
    return frozenset(names - REFUSED_TEMPLATE_KWARGS)


def request_scope(body: Any, served_name: str | None) -> tuple[str | None, str | None]:
    """(LoRA adapter name, ``cache_salt``) of a request: what vLLM keeps its cached blocks
    apart by. A ``model`` other than the deployment's own name is one of its adapters."""
    model = _field(body, "model")
    lora = model if isinstance(model, str) and served_name and model != served_name else None
    salt = _field(body, "cache_salt")
    return lora, salt if isinstance(salt, str) and salt else None


def prefix_text(request: Any) -> str:
    """The start of a request's prompt text (the rendezvous key without a session)."""
    body = _body(request)
    prompt = _field(body, "prompt")
    if prompt is None and _field(body, "messages") is not None:
        prompt = "\n".join(_text(_field(m, "content")) for m in _field(body, "messages"))
    return str(prompt or "")[:PREFIX_CHARS]


# ------------------------------------------------------------------ router state
class _RecentMasks:
    """Per block key, the slots of the replicas it was recently sent to: ``running`` (a
    request carrying it runs there) and ``expiring`` (it has an expiry there, possibly
    passed: :class:`_Recent` owns the times). Shared by one router's replicas."""

    def __init__(self) -> None:
        self.running: dict[int, int] = {}
        self.expiring: dict[int, int] = {}

    @staticmethod
    def set(table: dict[int, int], key: int, bit: int) -> None:
        table[key] = table.get(key, 0) | bit

    @staticmethod
    def clear(table: dict[int, int], key: int, bit: int) -> None:
        left = table.get(key, 0) & ~bit
        if left:
            table[key] = left
        else:
            table.pop(key, None)


class _Recent:
    """Keys of prompt blocks sent to one replica: held while their requests run (counted),
    then until an expiry; mirrored in the router's :class:`_RecentMasks` under the
    replica's slot."""

    def __init__(
        self,
        slot: int = 0,
        masks: _RecentMasks | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.bit = 1 << slot
        self.masks = masks or _RecentMasks()
        self.clock = clock
        self.running: Counter[int] = Counter()
        self.expiry: dict[int, float] = {}

    def __contains__(self, key: int) -> bool:
        if self.running.get(key):
            return True
        expiry = self.expiry.get(key)
        return expiry is not None and expiry > self.clock()

    def add(self, keys: list[int]) -> None:
        running = self.masks.running
        for key in keys:
            self.running[key] += 1
            if self.running[key] == 1:
                _RecentMasks.set(running, key, self.bit)

    def done(self, keys: list[int], ttl: float) -> None:
        until = self.clock() + ttl
        masks = self.masks
        for key in keys:
            self.running[key] -= 1
            if self.running[key] <= 0:
                del self.running[key]
                _RecentMasks.clear(masks.running, key, self.bit)
                self.expiry[key] = until
                _RecentMasks.set(masks.expiring, key, self.bit)

    def prune(self) -> None:
        now = self.clock()
        for key in [k for k, t in self.expiry.items() if t <= now]:
            del self.expiry[key]
            _RecentMasks.clear(self.masks.expiring, key, self.bit)

    def forget(self) -> None:
        """Take every key out of the masks (the replica is gone)."""
        for key in self.running:
            _RecentMasks.clear(self.masks.running, key, self.bit)
        for key in self.expiry:
            _RecentMasks.clear(self.masks.expiring, key, self.bit)


@dataclass
class _Request:
    session: str | None  # scoped: tenant, cache_salt and adapter before the client's id
    key: str  # rendezvous key: the session, else the prompt prefix
    tokens: list[int] | None
    keys: dict[int, list[int]]  # block size -> chain keys
    lora: str | None = None
    salt: str | None = None
    block_size: int = DEFAULT_BLOCK_SIZE  # the one it was last routed with

    def chain(self, block_size: int) -> list[int]:
        if block_size not in self.keys:
            if self.tokens is None:
                return []
            self.keys[block_size] = chain_hashes(
                self.tokens, block_size, lora_name=self.lora, cache_salt=self.salt
            )
        return self.keys[block_size]


def scoped_session(
    request: Any, session: str | None, lora: str | None, salt: str | None
) -> str | None:
    """A session id as the router keys it: within the caller's tenant (the digest of its API
    key, :attr:`~rbln_ray.serve.http_call.HTTPCall.tenant`), ``cache_salt`` and adapter, so
    one tenant's session id never steers, or reveals, another's."""
    if not session:
        return None
    tenant = getattr(request, "tenant", "") or ""
    return "\0".join((tenant, salt or "", lora or "", session))


class CacheAwareRouter(RequestRouter):
    """Serve request router for ``routing: cache_aware`` (module docstring)."""

    # As PrefixAffinityRouter: a busy replica may answer its queue-length probe late, and the
    # request would leave the replica holding its cache for one that answered first.
    queue_len_response_deadline_s = max(RequestRouter.queue_len_response_deadline_s, 0.5)

    def initialize_state(
        self,
        tokenizer: str | None = None,
        batch_size: int = 4,
        recent_ttl_s: float = RECENT_TTL_S,
        served_name: str | None = None,
        clock: Callable[[], float] | None = None,
        exact_scan_max: int = EXACT_SCAN_MAX,
        top_choices: int = TOP_CHOICES,
    ) -> None:
        """``clock``: the time recent sends expire by (default ``time.monotonic``; the fleet
        simulation passes its simulated time); ``exact_scan_max`` and ``top_choices``: the
        indexed path's (module docstring)."""
        self._tokenizer = PromptTokenizer(tokenizer)
        self._served_name = served_name
        self._batch_size = max(1, batch_size)
        self._recent_ttl_s = recent_ttl_s
        self._clock = clock or time.monotonic
        self._exact_scan_max = exact_scan_max
        self._top_choices = max(1, top_choices)
        self._pending: OrderedDict[str, _Request] = OrderedDict()
        self._inflight: dict[str, tuple[str, _Request]] = {}  # request id -> replica, request
        self._load: Counter[str] = Counter()
        # Load other routers put on a replica, as of its last report (replica id -> load),
        # which report that was (its sequence number), and the most this router had there
        # since it read the report before.
        self._others: dict[str, int] = {}
        self._others_report: dict[str, Any] = {}
        self._own_peak: dict[str, int] = {}
        self._recent: dict[str, _Recent] = {}
        self._recent_masks = _RecentMasks()
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._reports: dict[str, tuple[int, frozenset[int], int | None]] = {}
        self._holders = HolderIndex()  # key -> slots of the replicas whose report holds it
        self._routed = 0
        self._live: set[str] = set()  # the replicas of the last choice
        # Slots: a small integer per known replica (reused after it leaves).
        self._slots: dict[str, int] = {}
        self._slot_ids: list[str | None] = []
        self._slot_hashes: list[int] = []
        self._free_slots: list[int] = []
        # The indexed path's view of one replica list (refresh_index).
        self._indexed: list[RunningReplica] | None = None
        self._indexed_replica: dict[int, RunningReplica] = {}  # slot -> replica
        self._indexed_mask = 0  # their slots
        self._by_load: dict[int, int] = {}  # this router's load -> slots carrying it
        self._hash_array = np.zeros(0, dtype=np.uint64)  # per slot: hash64(replica id)
        self._indexed_capacity: int | None = None  # None: replicas differ (full scan)
        self._indexed_rates: ServiceRates | None = None
        self._indexed_block_size = DEFAULT_BLOCK_SIZE  # the replicas' last reported one
        # Per node whose host KV tier holds blocks: its replicas' slots, and those blocks' keys.
        self._host_nodes: list[tuple[int, frozenset[int]]] = []

    # ------------------------------------------------------------------ inputs
    async def _request(self, pending: PendingRequest) -> _Request:
        rid = pending.metadata.internal_request_id
        found = self._pending.get(rid)
        if found is None:
            arg = pending.args[0]
            lora, salt = request_scope(_body(arg), self._served_name)
            session = scoped_session(arg, session_of(arg, pending.kwargs), lora, salt)
            block = self._indexed_block_size  # the replicas' last reported block size
            tokens, keys = await self._tokenizer.keys_within_budget(arg, block, lora, salt)
            chains = {block: keys} if keys is not None else {}
            found = _Request(session, session or prefix_text(arg), tokens, chains, lora, salt)
            self._pending[rid] = found
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)
        return found

    def _slot(self, rid: str) -> int:
        slot = self._slots.get(rid)
        if slot is None:
            if self._free_slots:
                slot = self._free_slots.pop()
                self._slot_ids[slot], self._slot_hashes[slot] = rid, hash64(rid)
            else:
                slot = len(self._slot_ids)
                self._slot_ids.append(rid)
                self._slot_hashes.append(hash64(rid))
            self._slots[rid] = slot
        return slot

    def _held(self, replica: RunningReplica) -> tuple[frozenset[int], int | None]:
        """The keys a replica last reported (parsed once per report, and indexed by key) and
        its block size."""
        rid = replica.replica_id.unique_id
        stats = replica.routing_stats or {}
        events = stats.get(STATS_EVENTS)
        cached = self._reports.get(rid)
        if cached is None or cached[0] != events:
            keys = report_keys(stats.get(STATS_BLOCKS))
            old = cached[1] if cached is not None else frozenset()
            slot = self._slot(rid)
            self._holders.remove(slot, old - keys)
            self._holders.add(slot, keys - old)
            host = report_keys(stats.get(STATS_HOST_BLOCKS))
            cached = (events, keys, stats.get(STATS_BLOCK_SIZE), host)
            self._reports[rid] = cached
        load, seq = stats.get(STATS_LOAD), stats.get(STATS_REPORT)
        if load is not None and seq != self._others_report.get(rid):
            self._others_report[rid] = seq
            before, own = self._known_load(rid), self._load[rid]
            self._others[rid] = max(0, int(load) - max(own, self._own_peak.get(rid, own)))
            self._own_peak[rid] = own
            self._regroup(rid, before)
        return cached[1], cached[2]

    def _known_load(self, rid: str) -> int:
        """Requests on a replica as this router knows them: its own in flight, plus what the
        other routers had there at the replica's last report (0 without load reports)."""
        return self._load[rid] + self._others.get(rid, 0)

    def _regroup(self, rid: str, before: int) -> None:
        """The indexed path's load groups follow a replica's known load."""
        after = self._known_load(rid)
        slot = self._slots.get(rid)
        if after == before or slot is None or slot not in self._indexed_replica:
            return
        bit = 1 << slot
        left = self._by_load.get(before, 0) & ~bit
        if left:
            self._by_load[before] = left
        else:
            self._by_load.pop(before, None)
        self._by_load[after] = self._by_load.get(after, 0) | bit

    def _host_by_node(self, candidates: list[RunningReplica]) -> dict[Any, frozenset[int]]:
        """Per node, the keys its host KV tier holds: every replica of it reports the blocks
        its own device dropped into the tier they share."""
        nodes: dict[Any, set[int]] = {}
        for replica in candidates:
            self._held(replica)
            host = self._reports[replica.replica_id.unique_id][3]
            if host:
                nodes.setdefault(getattr(replica, "node_id", None), set()).update(host)
        return {node: frozenset(keys) for node, keys in nodes.items()}

    def _block_size(self, candidates: list[RunningReplica]) -> int:
        for replica in candidates:
            _, size = self._held(replica)
            if size:
                return size
        return DEFAULT_BLOCK_SIZE

    @staticmethod
    def _rates(candidates: list[RunningReplica]) -> ServiceRates | None:
        """The replicas' reported service times, averaged; None until one reports both."""
        found = [
            (stats[STATS_PREFILL_S_PER_TOKEN], stats[STATS_SERVICE_S])
            for stats in (r.routing_stats or {} for r in candidates)
            if STATS_PREFILL_S_PER_TOKEN in stats and STATS_SERVICE_S in stats
        ]
        if not found:
            return None
        return ServiceRates(
            prefill_s_per_token=sum(f[0] for f in found) / len(found),
            service_s=sum(f[1] for f in found) / len(found),
        )

    def _candidate(
        self,
        replica: RunningReplica,
        request: _Request,
        rates: ServiceRates | None,
        host: dict[Any, frozenset[int]] | None = None,
    ) -> Candidate:
        rid = replica.replica_id.unique_id
        reported, _ = self._held(replica)
        recent = self._recent.get(rid) or ()
        cached_len = self.replica_queue_len_cache.get(replica.replica_id) or 0
        load = max(self._known_load(rid), cached_len)
        keys = request.chain(request.block_size)
        held = held_prefix(keys, reported, recent)
        node_host = (host or {}).get(getattr(replica, "node_id", None))
        hosted = held_prefix(keys[held:], node_host) if node_host else 0
        ttft = None
        if rates is not None:
            tokens = len(request.tokens or ())
            covered = min(tokens, (held + hosted) * request.block_size)
            loaded = max(0, covered - held * request.block_size)
            ttft = estimate_ttft(rates, self._batch_size, load, tokens - covered, loaded)
        return Candidate(
            replica_id=rid,
            load=load,
            capacity=replica.max_ongoing_requests,
            held_blocks=held,
            ttft_s=ttft,
            host_blocks=hosted,
        )

    # ------------------------------------------------------------------ the indexed path
    def refresh_index(self, replicas: list[RunningReplica]) -> None:
        """Take ``replicas`` as the indexed path's replica list: parse the reports that
        changed (updating the key index), group the replicas by load, pool their times.
        O(replicas); Serve calls it when it hands the router a new replica list
        (:meth:`update_replicas`: on a change of membership or of a report), not per
        request; a driver outside Serve (the fleet simulation) calls it the same way."""
        live = {r.replica_id.unique_id for r in replicas}
        same = live == self._live and self._indexed is not None
        if not same:
            self._live = live
            self._forget_except(live)
        by_slot: dict[int, RunningReplica] = {}
        for replica in replicas:
            self._held(replica)
            by_slot[self._slot(replica.replica_id.unique_id)] = replica
        self._indexed = replicas
        self._indexed_replica = by_slot
        if not same:  # the same replicas keep their slots and load groups (_count)
            by_load: dict[int, int] = {}
            for slot, replica in by_slot.items():
                load = self._known_load(replica.replica_id.unique_id)
                by_load[load] = by_load.get(load, 0) | (1 << slot)
            self._by_load = by_load
            self._indexed_mask = sum(1 << slot for slot in by_slot)
            self._hash_array = np.array(self._slot_hashes, dtype=np.uint64)
        capacities = {r.max_ongoing_requests for r in replicas}
        self._indexed_capacity = capacities.pop() if len(capacities) == 1 else None
        self._indexed_rates = self._rates(replicas)
        self._indexed_block_size = self._block_size(replicas)
        node_slots: dict[Any, int] = {}
        for slot, replica in by_slot.items():
            node = getattr(replica, "node_id", None)
            node_slots[node] = node_slots.get(node, 0) | (1 << slot)
        self._host_nodes = [
            (node_slots[node], keys) for node, keys in self._host_by_node(replicas).items()
        ]

    def _host_split(self, keys: list[int], depth: int, mask: int) -> Iterator[tuple[int, int]]:
        """The replicas of ``mask`` (each holding ``depth`` leading ``keys`` on its device)
        by how many keys past those their node's host tier holds: ``(host depth, slots)``."""
        rest = mask
        for node_mask, held in self._host_nodes:
            part = mask & node_mask
            if part:
                hosted = held_prefix(keys[depth:], held)
                if hosted:
                    rest &= ~part
                    yield hosted, part
        if rest:
            yield 0, rest

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        if len(self._replicas_list) > getattr(self, "_exact_scan_max", len(replicas)):
            self.refresh_index(self._replicas_list)

    def _holder_mask(self, key: int) -> int:
        """Slots of the replicas holding ``key``: by their last report, or by a recent send
        still held (running, or not yet expired)."""
        masks = self._recent_masks
        mask = self._holders.mask(key) | masks.running.get(key, 0)
        expiring = masks.expiring.get(key, 0) & ~mask
        if expiring:
            now = self._clock()
            for slot in slots_of(expiring):
                recent = self._recent.get(self._slot_ids[slot] or "")
                until = recent.expiry.get(key) if recent is not None else None
                if until is not None and until > now:
                    mask |= 1 << slot
        return mask

    def _members(self, mask: int, key_hash: int, session: int | None) -> Iterator[tuple]:
        """A class's replicas in tie-break order, lazily: (not the session's, inverse hash,
        id, slot) ascending (:func:`hashed_ranks`). Large classes are ranked with numpy,
        the first few members first (the caller rarely needs more)."""
        ids = self._slot_ids
        if mask.bit_count() <= 32:
            yield from sorted(
                (int(slot != session), _M64 ^ _mix64(key_hash ^ self._slot_hashes[slot]),
                 ids[slot], slot)
                for slot in slots_of(mask)
            )  # fmt: skip
            return
        slots = _bits(mask, len(self._slot_ids))
        inverse = ~_mix64_array(np.uint64(key_hash) ^ self._hash_array[slots])
        first = min(len(slots), 2 * self._top_choices + 1)
        head = np.argpartition(inverse, first - 1)[:first]
        head = head[np.argsort(inverse[head])]
        values = inverse[head]
        if (values[1:] == values[:-1]).any() or (inverse == values[-1]).sum() > 1:
            # a 64-bit tie: order the whole class by id as well
            yield from sorted(
                (int(s != session), int(v), ids[s], s)
                for s, v in zip(slots.tolist(), inverse.tolist(), strict=True)
            )
            return
        if session is not None and mask >> session & 1:
            at = int(np.flatnonzero(slots == session)[0])
            yield (0, int(inverse[at]), ids[session], session)
        for s, v in zip(slots[head].tolist(), values.tolist(), strict=True):
            if s != session:
                yield (1, v, ids[s], s)
        rest = np.argsort(inverse, kind="stable")[first:]
        for s, v in zip(slots[rest].tolist(), inverse[rest].tolist(), strict=True):
            if s != session:
                yield (1, v, ids[s], s)

    def _indexed_choice(
        self, request: _Request, session_replica: str | None
    ) -> list[list[RunningReplica]]:
        """The :data:`TOP_CHOICES` first replicas of :func:`order_candidates`' order (with
        :func:`hashed_ranks` as the tie-break), without a :class:`Candidate` per replica.

        Replicas of one class (this router's load, held prefix depth) share an estimate;
        classes are ranked by it and their members by the tie-break. Serve's queue-length
        cache can only raise a load (``max``), and a higher load never makes a replica
        preferred, so replicas are visited in that order and the cache is read only for the
        visited ones, until the next one's estimate is already worse than the last of the
        choices so far. Until replicas report times the rule needs the least loaded replica,
        so every replica's load is read (as the full scan does)."""
        rates, batch = self._indexed_rates, self._batch_size
        capacity = self._indexed_capacity
        assert capacity is not None
        cache = self.replica_queue_len_cache
        by_load = self._by_load
        if rates is None:  # the load-slack rule: loads as the full scan reads them
            by_load = {}
            for slot, replica in self._indexed_replica.items():
                rid = replica.replica_id.unique_id
                load = max(self._known_load(rid), cache.get(replica.replica_id) or 0)
                by_load[load] = by_load.get(load, 0) | (1 << slot)
            least = min((load for load in by_load if load < capacity), default=0)

        def estimate(load: int, uncached: int, loaded: int) -> float:
            if rates is None:
                return float(load > least + batch)
            return estimate_ttft(rates, batch, load, uncached, loaded)

        def tokens_past(depth: int, hosted: int) -> tuple[int, int]:
            """(to prefill, to load from the host tier), as :meth:`_candidate` counts them."""
            covered = min(tokens, (depth + hosted) * block)
            return tokens - covered, max(0, covered - depth * block)

        request.block_size = block = self._indexed_block_size
        keys = request.chain(block)
        tokens = len(request.tokens or ())
        live = self._indexed_mask
        groups = [(d, m & live) for d, m in depth_classes(keys, self._holder_mask)]
        holding = 0
        for _, m in groups:
            holding |= m
        classes: dict[tuple, int] = {}  # ((full, estimate, -depth), host depth) -> slots
        for depth, dmask in [(0, live & ~holding), *groups]:
            for hosted, hmask in self._host_split(keys, depth, dmask) if dmask else ():
                uncached, loaded = tokens_past(depth, hosted)
                for load, lmask in by_load.items():
                    members = hmask & lmask
                    if members:
                        head = (load >= capacity, estimate(load, uncached, loaded), -depth)
                        classes[head, hosted] = classes.get((head, hosted), 0) | members
        session = self._slots.get(session_replica) if session_replica else None
        key_hash = hash64(request.key)
        top = min(self._top_choices, live.bit_count())
        chosen: list[tuple[tuple, int]] = []  # (preference, slot), best first
        replica_at, known, cached = self._indexed_replica, self._known_load, cache.get
        for (head, hosted), mask in sorted(classes.items()):
            if len(chosen) >= top and head > chosen[-1][0][:3]:
                break
            for other, inverse, rid, slot in self._members(mask, key_hash, session):
                bound = (*head, other, inverse, rid)
                if len(chosen) >= top and bound > chosen[-1][0]:
                    break
                replica = replica_at[slot]
                own = known(rid)
                load = max(own, cached(replica.replica_id) or 0)
                preference = bound
                if load != own and rates is not None:
                    uncached, loaded = tokens_past(-head[2], hosted)
                    ttft = estimate_ttft(rates, batch, load, uncached, loaded)
                    preference = (load >= capacity, ttft, *bound[2:])
                if not chosen or preference > chosen[-1][0]:
                    chosen.append((preference, slot))
                else:
                    bisect.insort(chosen, (preference, slot))
                if len(chosen) > top:
                    chosen.pop()
        return [[replica_at[slot]] for _, slot in chosen]

    # ------------------------------------------------------------------ Serve's hooks
    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        fixed = fixed_choice(candidate_replicas, pending_request)  # e.g. a stored response's
        if fixed is not None:
            return fixed
        if len(candidate_replicas) > self._exact_scan_max:
            if candidate_replicas is not self._indexed:
                self.refresh_index(candidate_replicas)
            request = await self._request(pending_request)
            if self._indexed_capacity is not None:  # else (capacities differ) the full scan
                session = self._sessions.get(request.session) if request.session else None
                return self._indexed_choice(request, session)
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        if by_id.keys() != self._live:  # Serve passes every running replica
            self._live = set(by_id)
            self._forget_except(self._live)
        request = await self._request(pending_request)
        request.block_size = self._block_size(candidate_replicas)
        self._indexed_block_size = request.block_size  # the next requests' keys' size
        rates = self._rates(candidate_replicas)
        session_replica = self._sessions.get(request.session) if request.session else None
        host = self._host_by_node(candidate_replicas)
        order = order_candidates(
            [self._candidate(r, request, rates, host) for r in candidate_replicas],
            session_replica,
            request.key,
            self._batch_size,
        )
        return [[by_id[rid]] for rid in order]

    def _count(self, rid: str, delta: int) -> None:
        """This router's load of a replica changes (and the replica's load group)."""
        before = self._known_load(rid)
        self._load[rid] = own = max(0, self._load[rid] + delta)
        if own > self._own_peak.get(rid, 0):
            self._own_peak[rid] = own
        self._regroup(rid, before)

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: Any, result: Any
    ) -> None:
        rid = replica_id.unique_id
        request = self._pending.pop(pending_request.metadata.internal_request_id, None)
        if request is None:
            return
        self._inflight[pending_request.metadata.internal_request_id] = (rid, request)
        self._count(rid, +1)
        recent = self._recent.get(rid)
        if recent is None:
            recent = _Recent(self._slot(rid), self._recent_masks, self._clock)
            self._recent[rid] = recent
        recent.add(request.chain(request.block_size))
        # Routed: only its keys are needed from here on (its recent sends, when it ends);
        # a prompt's tokens are most of what a router holds per request in flight.
        request.tokens = None
        request.keys = {request.block_size: request.keys.get(request.block_size, [])}
        if request.session:
            self._sessions[request.session] = rid
            self._sessions.move_to_end(request.session)
            while len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)
        self._routed += 1
        if self._routed % 256 == 0:
            for recent in self._recent.values():
                recent.prune()

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        found = self._inflight.pop(internal_request_id, None)
        if found is None:
            return
        rid, request = found
        self._count(rid, -1)
        recent = self._recent.get(rid)
        if recent is not None:
            recent.done(request.chain(request.block_size), self._recent_ttl_s)

    def _forget_except(self, live: set[str]) -> None:
        """Drop what the router knows about replicas that are gone (restarted, scaled down,
        dead: Serve no longer offers them): their reports, recent sends, load, sessions and
        slots."""
        self._indexed = None  # the indexed path lays its replicas out again
        for rid in [r for r in self._reports if r not in live]:
            self._holders.remove(self._slots[rid], self._reports.pop(rid)[1])
        for rid in [r for r in self._recent if r not in live]:
            self._recent.pop(rid).forget()
        for rid in [r for r in self._load if r not in live]:
            del self._load[rid]
        for table in (self._others, self._others_report, self._own_peak):
            for rid in [r for r in table if r not in live]:
                del table[rid]
        for rid in [r for r in self._slots if r not in live]:
            slot = self._slots.pop(rid)
            self._slot_ids[slot] = None
            self._free_slots.append(slot)
            self._indexed_replica.pop(slot, None)
        gone = [s for s, rid in self._sessions.items() if rid not in live]
        for session in gone:
            del self._sessions[session]


def router_config(cfg: Any, batch_size: int) -> Any:
    """Serve's ``RequestRouterConfig`` of a cache-aware model deployment (``cfg``: its
    :class:`~rbln_ray.serve.config.ModelDeploymentConfig`): this router, the tokenizer it
    counts prompt blocks with (vLLM's ``tokenizer`` option, else the model's), the compiled
    batch (the decode slots a replica has) and the report period."""
    from ray.serve.config import RequestRouterConfig

    return RequestRouterConfig(
        request_router_class=f"{__name__}.CacheAwareRouter",
        request_router_kwargs={
            "tokenizer": cfg.engine_kwargs.get("tokenizer") or cfg.model,
            "batch_size": max(1, batch_size),
            "served_name": cfg.name,
        },
        request_routing_stats_period_s=STATS_PERIOD_S,
    )
