"""One simulated replica: rbln-ray's engine step shapes on the cost model's device times.

What it models, from the code it mirrors:

* **steps** (:class:`~rbln_ray.vllm_plugin.scheduler.RBLNScheduler`): each step is one
  prefill chunk (``chunk`` tokens, a static shape: a short last chunk costs a whole one) or
  one decode step of the running requests (at most ``batch``, padded to the smallest
  compiled decoder batch that fits). A waiting request starts its prefill as soon as a slot
  is free, unless it shares blocks a prompt in prefill has yet to compute (that prompt goes
  first); among prompts in prefill the one closest to its first token goes first; at least
  ``decode_steps_between_chunks`` decode steps run between two chunks while requests
  decode (BENCHMARKS 15 ran 0: chunks back to back);
* **prefix caching on the compiled RBLN blocks**: the real
  :class:`~rbln_ray.vllm_plugin.kv_blocks.OuterBlockManager` (``kv_blocks`` blocks of
  ``kv_block_tokens``; a free block keeps what it cached until it is reused, least recently
  used first; a hit in a running request's block is copied on the device) decides what is
  cached; vLLM's hit is the longest prefix some block holds, at most the prompt less one
  token, in whole ``chunk``-token blocks;
* **device time** of every call from :mod:`rbln_ray.npu.cost_model` (prefill
  ``Row(chunk, start)``; decode one row per request at its position, padding rows at the
  scratch block's position; KV copies), plus ``host_s_per_step`` of host work per step;
* **what it reports** to routers every ``report_period_s`` (± 10 %, as Serve jitters it):
  the keys of the blocks its prefix cache holds (the router's key function, injected), its
  service times as :mod:`rbln_ray.serve.service_times` computes them (the last 64 finished
  requests' prefill seconds per prefilled token and mean slot time) and its load (requests
  running and waiting: the engine's scheduler stats), unless ``report_load`` is off.

What it leaves out: preemption (the 16 blocks always cover the 4 running sequences and the
scheduler never runs short), speculative decoding, a host KV tier, the engine's own queue
and IPC latencies beyond the host time per step.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from rbln_ray.npu.cost_model import DeviceSpec, ModelShape, Row, call_cost, copy_cost, preset
from rbln_ray.vllm_plugin.kv_blocks import (
    BlockLayout,
    OuterBlockManager,
    shares_uncomputed_blocks,
)


def output_key(replica: int, n: int) -> int:
    """The key of a generated block (the ``n``-th one on ``replica``): 64 bits, as a real
    block's key, and matching no prompt's (the workload never repeats generated text)."""
    digest = hashlib.blake2b(f"out:{replica}:{n}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


@dataclass(frozen=True)
class ReplicaConfig:
    """One replica as BENCHMARKS 15 ran it (defaults): Llama-3-8B's device time on one ATOM,
    an artifact of batch 4 and 16 RBLN KV blocks of 4,096 tokens, chunks back to back."""

    shape: ModelShape = field(default_factory=lambda: preset("llama-3-8b"))
    spec: DeviceSpec = field(default_factory=DeviceSpec)
    batch: int = 4
    devices: int = 1  # per replica (a shard group: the cost model's num_devices)
    decode_sizes: tuple[int, ...] = (1, 2, 4)
    max_seq_len: int = 4096
    kv_blocks: int = 16
    kv_block_tokens: int = 4096
    chunk: int = 128
    decode_steps_between_chunks: int = 0
    max_ongoing: int = 8  # Serve's max_ongoing_requests: 2 x the batch (builder default)
    # Host work per step with the worker in a Ray actor (BENCHMARKS 3: 0.43-0.54 ms p50).
    host_s_per_step: float = 0.0005
    report_period_s: float = 1.0
    report_load: bool = True
    stats_window: int = 64  # rbln_ray.serve.service_times.WINDOW


class StepCosts:
    """Device seconds per step shape, from :func:`~rbln_ray.npu.cost_model.call_cost`.

    A decode call's FLOPs and bytes are linear in the sum of its rows' positions (attention
    and KV reads; everything else depends on the compiled batch only), so its compute and
    memory times are two lines per batch, and the call costs the larger plus the per-call
    overhead (one device): :meth:`decode` evaluates those lines, fitted from two
    ``call_cost`` calls per batch (``tests/unit/test_fleet_sim.py`` checks it against
    ``call_cost``). Prefill chunks and copies are memoized."""

    def __init__(self, cfg: ReplicaConfig) -> None:
        self.cfg = cfg
        self.prefill = lru_cache(maxsize=None)(self._prefill)
        self.copy = lru_cache(maxsize=None)(self._copy)
        self._lines: dict[int, tuple[float, float, float, float]] = {}

    def _prefill(self, start: int) -> float:
        cfg = self.cfg
        return call_cost(cfg.shape, [Row(cfg.chunk, start)], 1, cfg.spec, cfg.devices).seconds

    def decode_call(self, batch: int, positions: int) -> float:
        """``call_cost`` of a decode call itself (rows' positions summing to ``positions``:
        one row carries them all, which changes neither FLOPs nor bytes)."""
        cfg = self.cfg
        rows = [Row(1, positions)] + [Row(1, 0)] * (batch - 1)
        return call_cost(cfg.shape, rows, batch, cfg.spec, cfg.devices).seconds

    def decode(self, batch: int, positions: int) -> float:
        line = self._lines.get(batch)
        cfg = self.cfg
        if line is None:
            span = 1 << 16
            lo = call_cost(cfg.shape, [Row(1, 0)] * batch, batch, cfg.spec, cfg.devices)
            rows = [Row(1, span)] + [Row(1, 0)] * (batch - 1)
            hi = call_cost(cfg.shape, rows, batch, cfg.spec, cfg.devices)
            line = self._lines[batch] = (
                lo.compute_s, (hi.compute_s - lo.compute_s) / span,
                lo.memory_s, (hi.memory_s - lo.memory_s) / span,
                lo.seconds - max(lo.compute_s, lo.memory_s) / (cfg.spec.tp_eff
                                                               if cfg.devices > 1 else 1),
            )  # fmt: skip
        c0, c1, m0, m1, extra = line
        body = max(c0 + c1 * positions, m0 + m1 * positions)
        return (body / cfg.spec.tp_eff if cfg.devices > 1 else body) + extra

    def _copy(self, tokens: int) -> float:
        """Each device of a shard group copies its share of the KV (in parallel)."""
        cfg = self.cfg
        share = copy_cost(cfg.shape, tokens, cfg.spec) - cfg.spec.call_overhead_s
        return share / cfg.devices + cfg.spec.call_overhead_s


@dataclass(eq=False)
class SimRequest:
    """One turn of one session, as the router and a replica see it."""

    rid: str
    session: str
    turn: int
    sent: float
    tokens: list[int] | None  # the prompt (what the router reads; dropped once routed)
    keys: list[int]  # its full blocks' keys (what a replica reports holding)
    out_len: int
    prompt_len: int = 0
    router: int = 0
    replica: int = -1
    # replica side
    hashes: list[int] = field(default_factory=list)  # prompt keys, then generated blocks'
    computed: int = 0
    generated: int = 0
    hit: int = 0
    target: int = 0  # tokens it generates (max_tokens, or up to the compiled length)
    scheduled: float = -1.0
    first: float = -1.0
    last: float = -1.0

    def __post_init__(self) -> None:
        if self.tokens is not None:
            self.prompt_len = len(self.tokens)


@dataclass
class Report:
    """What a replica reports (``routing_stats``, without Serve's key names)."""

    block_size: int | None
    keys: list[int]
    version: int
    prefill_s_per_token: float | None
    service_s: float | None
    load: int | None = None  # requests in the engine (running and waiting)
    seq: int = 0  # which report (a load is read once per report)


class Replica:
    """A replica's engine (module docstring). ``clock()`` is the simulation's time;
    ``schedule(delay, action)`` runs ``action`` that much later; ``on_first(request)`` and
    ``on_finish(request)`` are called at a request's first and last token."""

    def __init__(
        self,
        index: int,
        cfg: ReplicaConfig,
        costs: StepCosts,
        clock: Callable[[], float],
        schedule: Callable[..., None],
        on_first: Callable[[SimRequest], None],
        on_finish: Callable[[SimRequest], None],
    ) -> None:
        self.index, self.cfg, self.costs = index, cfg, costs
        self.clock, self.schedule = clock, schedule
        self.on_first, self.on_finish = on_first, on_finish
        if cfg.kv_block_tokens < cfg.max_seq_len or cfg.kv_blocks <= cfg.batch:
            raise ValueError(
                "the replica model takes one RBLN block per sequence and more blocks than "
                f"sequences: kv_block_tokens {cfg.kv_block_tokens} >= max_seq_len "
                f"{cfg.max_seq_len}, kv_blocks {cfg.kv_blocks} > batch {cfg.batch}"
            )
        layout = BlockLayout.for_artifact(
            cfg.kv_block_tokens, cfg.kv_blocks, cfg.max_seq_len, cfg.chunk
        )
        self.block = layout.inner_size
        self.blocks = OuterBlockManager(layout, self._evicted)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.busy = False
        self.decodes_since_prefill = cfg.decode_steps_between_chunks
        self.cached: set[int] = set()  # keys of the blocks the prefix cache holds
        self.version = 0  # changes of ``cached`` (a report's freshness)
        self.stored = False  # a block was ever cached (the report's block size is known)
        self.finished_times: deque[tuple[int, float, float]] = deque(maxlen=cfg.stats_window)
        self._outputs = 0
        self._reports = 0
        # counters
        self.queries = self.hits = 0  # prompt tokens looked up / found (vLLM's counters)
        self.busy_s = 0.0
        self.steps = {"prefill": 0, "decode": 0}
        self.copied_tokens = 0
        self._decode_sizes = sorted(cfg.decode_sizes)
        self._generation = 0  # of the event that ends the step or run under way
        self._run: tuple[list[SimRequest], float, list[float]] | None = None
        self._prefilling: tuple[SimRequest, int] | None = None

    # ------------------------------------------------------------------ Serve's view
    @property
    def ongoing(self) -> int:
        """Requests accepted and not finished (what the replica tells Serve)."""
        return len(self.waiting) + len(self.running)

    def accept(self, request: SimRequest) -> None:
        request.replica = self.index
        request.hashes = list(request.keys)
        self.waiting.append(request)
        if not self.busy:
            self._step()
        elif self._run is not None and len(self.running) < self.cfg.batch:
            self._cut_run()  # it starts at the next step boundary

    def report(self) -> Report:
        times = list(self.finished_times)
        prefill = service = None
        if times:
            service = sum(t[2] for t in times) / len(times)
            tokens = sum(t[0] for t in times)
            if tokens:
                prefill = sum(t[1] for t in times) / tokens
        self._reports += 1
        return Report(
            self.block if self.stored else None, sorted(self.cached), self.version, prefill,
            service, self.ongoing if self.cfg.report_load else None, self._reports,
        )  # fmt: skip

    # ------------------------------------------------------------------ the cache
    def _evicted(self, hashes: list) -> None:
        self.cached.difference_update(hashes)
        self.version += 1

    def _recorded(self, request: SimRequest, end: int) -> None:
        full = min(len(request.hashes), end // self.block)
        fresh = [k for k in request.hashes[:full] if k not in self.cached]
        if fresh:
            self.cached.update(fresh)
            self.version += 1
            self.stored = True

    # ------------------------------------------------------------------ steps
    def _step(self) -> None:
        """Start the next step (the scheduler's choice), or go idle."""
        cfg = self.cfg
        self.blocks.tick()
        prefilling, decoding = [], []
        for r in self.running:
            (prefilling if r.computed < r.prompt_len else decoding).append(r)
        gap = cfg.decode_steps_between_chunks
        chunk_due = not decoding or self.decodes_since_prefill >= gap
        sharer = self._prefix_in_flight(prefilling) if prefilling else None
        chunk = None
        if prefilling and chunk_due:
            chunk = sharer or min(prefilling, key=lambda r: r.prompt_len - r.computed)
        if sharer is None and self.waiting and len(self.running) < cfg.batch:
            seconds = self._admit(self.waiting.popleft())
        elif chunk is not None:
            seconds = self._chunk(chunk)
        elif decoding:
            limit = gap - self.decodes_since_prefill if prefilling else None
            self.blocks.flush_evictions()
            self._decode_run(decoding, limit)
            return
        else:
            self.busy = False
            return
        self.blocks.flush_evictions()
        self.busy = True
        seconds += cfg.host_s_per_step
        self.busy_s += seconds
        self._generation += 1
        self.schedule(seconds, self._prefill_end, self._generation)

    def _prefix_in_flight(self, prefilling: list[SimRequest]) -> SimRequest | None:
        """A prompt in prefill whose next blocks the next waiting request shares."""
        if not self.waiting:
            return None
        waiting = self.waiting[0].keys
        return next(
            (
                request
                for request in prefilling
                if shares_uncomputed_blocks(waiting, request.keys, request.computed, self.block)
            ),
            None,
        )

    def _admit(self, request: SimRequest) -> float:
        """A waiting request starts: vLLM's prefix hit, its RBLN block, its first chunk."""
        block, size = self.block, request.prompt_len
        hit = self.blocks.held_tokens(request.keys)
        hit = min(hit, (size - 1) // block * block)  # vLLM computes at least one token
        self.queries += size
        self.hits += hit
        request.hit = request.computed = hit
        request.scheduled = self.clock()
        request.target = max(1, min(request.out_len, self.cfg.max_seq_len - size))
        self.running.append(request)
        end = min(hit + self.cfg.chunk, size)
        copies, start = self.blocks.admit(request.rid, request.hashes, hit, end)
        request.computed = start  # earlier than the hit only if no block holds part of it
        self._recorded(request, end)
        seconds = 0.0
        for copy in copies:
            self.copied_tokens += copy.tokens
            seconds += self.costs.copy(copy.tokens)
        self._prefilling = (request, end)
        self.steps["prefill"] += 1
        return seconds + self.costs.prefill(start)

    def _chunk(self, request: SimRequest) -> float:
        end = min(request.computed + self.cfg.chunk, request.prompt_len)
        self.blocks.extend(request.rid, request.hashes, end)
        self._recorded(request, end)
        self._prefilling = (request, end)
        self.steps["prefill"] += 1
        return self.costs.prefill(request.computed)

    def _prefill_end(self, generation: int) -> None:
        request, end = self._prefilling
        request.computed = end
        self.decodes_since_prefill = 0
        done = []
        if end >= request.prompt_len:  # the prompt's last chunk gives the first token
            request.generated = 1
            request.first = self.clock()
            self.on_first(request)
            if request.generated >= request.target:
                done.append(request)
        self._finished(done)

    # A run of decode steps over the same rows is one event: it ends when the first of its
    # rows finishes (or, with prompts in prefill, when their next chunk is due), and is cut
    # at the step boundary after a request arrives that could start (a slot is free).
    def _decode_run(self, decoding: list[SimRequest], limit: int | None) -> None:
        cfg = self.cfg
        rows = decoding[: cfg.batch]
        batch = next((b for b in self._decode_sizes if b >= len(rows)), len(rows))
        positions = sum(r.prompt_len + r.generated - 1 for r in rows)
        if batch > len(rows):  # padding rows write the scratch block at its free position
            # (the scheduler asks for it every decode step; unasked, only a free block
            # holding a full 4,096-token chain would keep one more vLLM block: rare here)
            positions += (batch - len(rows)) * self.blocks.scratch(1)[1]
        steps = min(r.target - r.generated for r in rows)
        if limit is not None:
            steps = max(1, min(steps, limit))
        ends, total = [], 0.0
        for k in range(steps):
            total += self.costs.decode(batch, positions + k * len(rows)) + cfg.host_s_per_step
            ends.append(total)
        self._run = (rows, self.clock(), ends)
        self.busy = True
        self.busy_s += total
        self._generation += 1
        self.schedule(total, self._run_end, self._generation, steps)

    def _cut_run(self) -> None:
        """A request that could start arrived during a decode run: end the run at the
        boundary of the step under way."""
        _, start, ends = self._run
        done = bisect.bisect_left(ends, self.clock() - start) + 1
        if done < len(ends):
            self.busy_s -= ends[-1] - ends[done - 1]
            self._generation += 1
            self.schedule(start + ends[done - 1] - self.clock(), self._run_end,
                          self._generation, done)  # fmt: skip

    def _run_end(self, generation: int, steps: int) -> None:
        if generation != self._generation:
            return  # cut short: a later event ends this run
        rows, _, _ = self._run
        self._run = None
        for _ in range(steps - 1):
            self.blocks.tick()  # the run's later steps (the first ticked when it started)
        self.decodes_since_prefill += steps
        self.steps["decode"] += steps
        done = []
        for request in rows:
            request.generated += steps
            request.computed = request.prompt_len + request.generated - 1
            filled = request.computed // self.block
            if filled > len(request.hashes):  # generated blocks filled
                while len(request.hashes) < filled:
                    request.hashes.append(output_key(self.index, self._outputs))
                    self._outputs += 1
                self.blocks.extend(request.rid, request.hashes, request.computed)
                self._recorded(request, request.computed)
            if request.generated >= request.target:
                done.append(request)
        self._finished(done)

    def _finished(self, done: list[SimRequest]) -> None:
        now = self.clock()
        for request in done:
            request.last = now
            self.running.remove(request)
            self.finished_times.append(
                (request.prompt_len - request.hit, request.first - request.scheduled,
                 request.last - request.scheduled)
            )  # fmt: skip
        if done:
            self.blocks.release_missing({r.rid for r in self.running})
            for request in done:
                request.keys = request.hashes = []  # what a finished request no longer needs
                self.on_finish(request)
        self._step()
