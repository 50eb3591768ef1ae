"""Draft proposers: what the next step's drafts are, from vLLM's n-gram proposer or a small
compiled draft model on the same RBLN devices.

- ``ngram`` (prompt lookup): vLLM's own ``NgramProposer`` over the input batch's tokens, on
  the host. Cheap, so it proposes every step; the scheduler decides whether a step verifies.
- ``draft_model``: a second compiled optimum-rbln decoder with the target's KV geometry
  (same ``max_seq_len``, KV block size and count, prefill chunk, decode batches: it uses the
  target's RBLN block tables and scratch block). It runs every prefill chunk and KV copy the
  target runs, and proposes greedily (vLLM's default ``draft_sample_method``, lossless with
  one-hot drafts): one ``[B, 2]`` call of its width-2 verify graph (the last two tokens: it
  rewrites position ``m - 1``, the last draft when all were accepted, and adds the new token
  ``m``), then ``k - 1`` calls of its ``[B, 1]`` decode graph. A row whose draft KV fell
  behind (steps without drafts in between) is caught up by the draft's prefill graph from
  the chunk its valid KV ends in. The draft's KV only ever changes how many drafts are
  accepted, never the output: the target verifies every token.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass
from typing import Any

import torch

from rbln_ray.upstream import rebel_internals, vllm_internals
from rbln_ray.vllm_plugin.kv_blocks import NO_BLOCK


class NgramDrafter:
    """vLLM's prompt-lookup proposer over the input batch (rows in batch order).

    vLLM's proposer is a numba ``parallel`` kernel run on one thread. Numba's default
    OpenMP threading layer shares the process's OpenMP runtime with torch and sets its
    thread count when it starts: the emulated device's torch calls then ran on every core of
    the host (measured: each device call 5-20x slower on 2 busy cores). So numba gets its own
    thread pool (``workqueue``) where it can still choose, torch's thread count is restored
    after every proposal, and the kernel is compiled at load time with a real proposal
    (vLLM's own warm-up proposes nothing, so the first request paid seconds of JIT)."""

    method = "ngram"

    def __init__(self, vllm_config: Any) -> None:
        import numba
        import numpy as np

        if numba.config.THREADING_LAYER == "default":
            numba.config.THREADING_LAYER = "workqueue"
        from vllm.v1.spec_decode.ngram_proposer import NgramProposer

        threads = torch.get_num_threads()
        self.proposer = NgramProposer(vllm_config)
        k = vllm_config.speculative_config.num_speculative_tokens
        tokens = np.tile(np.arange(8, dtype=np.int32), (1, 8))
        self.proposer.propose(k, [[1]], np.array([64], dtype=np.int32), tokens)
        torch.set_num_threads(threads)

    def propose_step(self, runner: Any, so: Any, req_ids, sampled, k: int) -> list[list[int]]:
        """Drafts for the rows of the runner's input batch that sampled now (batch order)."""
        threads = torch.get_num_threads()
        try:
            return vllm_internals.ngram_propose(self.proposer, k, sampled, runner.input_batch)
        finally:
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)


@dataclass
class DraftRow:
    """One request the draft model proposes for: its tokens so far and its block table."""

    req_id: str
    tokens: list[int]  # prompt + outputs (the last one sampled in the step just run)
    table: list[int]  # the target's RBLN block table row (padded to the compiled width)


@dataclass
class _Written:
    """What a request's draft KV holds past its valid prefix: drafts from ``start``."""

    valid: int  # positions [0, valid) hold the real tokens' KV
    start: int  # drafts[i] was written at start + i (valid only if accepted)
    drafts: list[int]


class DraftModelDrafter:
    """A compiled draft model with the target's KV geometry (module docstring)."""

    method = "draft_model"

    def __init__(self, model: Any, artifact: Any, pair_runtimes: dict[int, Any]) -> None:
        self.model = model
        self.artifact = artifact
        self.pairs = pair_runtimes  # width-2 verify graph per compiled batch
        self._written: dict[str, _Written] = {}
        self.calls = 0
        self.resyncs = 0
        self.seconds = 0.0

    # ------------------------------------------------------------- following the target
    def prefill(self, req_id: str, input_ids: torch.Tensor, positions: torch.Tensor, table) -> None:
        """The target's prefill chunk, on the draft model (same positions and blocks)."""
        start = time.perf_counter()
        self.model.prefill_decoder(
            input_ids=input_ids, cache_position=positions, block_tables=table
        )
        self._took(start)
        # A cached prefix before the chunk is the draft's too: it ran the same chunks and
        # copies into the same blocks (a prefix it never wrote costs acceptance, not tokens).
        end = int(positions[0, -1]) + 1
        self._written[req_id] = _Written(end, end, [])

    def copy(self, copies: list[Any]) -> None:
        runtime = self.model.prefill_decoder.runtime
        for c in copies:
            rebel_internals.copy_kv_cache(runtime, c.src, c.dst, c.tokens)

    def forget(self, req_ids) -> None:
        for r in req_ids:
            self._written.pop(r, None)

    # ------------------------------------------------------------- proposing
    def propose_step(self, runner: Any, so: Any, req_ids, sampled, k: int) -> list[list[int]]:
        """Drafts for the rows that sampled now (``req_ids``/``sampled`` in batch order), on
        the step's block tables and scratch block."""
        plan = so.rbln_plan
        live = [i for i, tokens in enumerate(sampled) if tokens]
        rows = []
        for i in live:
            state = runner.requests[req_ids[i]]
            tokens = state.prompt_token_ids + state.output_token_ids
            rows.append(DraftRow(req_ids[i], tokens, runner.table_row(plan.tables[req_ids[i]])))
        limit = runner.vllm_config.model_config.max_model_len
        proposed = self.propose(rows, k, limit, (plan.scratch_block, plan.scratch_position))
        drafts: list[list[int]] = [[] for _ in req_ids]
        for i, mine in zip(live, proposed, strict=True):
            drafts[i] = mine
        return drafts

    def _valid(self, row: DraftRow) -> int:
        """Positions of ``row`` whose draft KV holds its real tokens."""
        known = self._written.get(row.req_id)
        if known is None:
            return 0
        valid = known.valid
        for i, d in enumerate(known.drafts):
            p = known.start + i
            if p != valid or p >= len(row.tokens) or row.tokens[p] != d:
                break
            valid = p + 1
        return valid

    def propose(
        self, rows: list[DraftRow], k: int, max_len: int, scratch: tuple[int, int]
    ) -> list[list[int]]:
        """Up to ``k`` greedy drafts per row (fewer near ``max_len``)."""
        if not rows or k <= 0:
            return [[] for _ in rows]
        want = [max(0, min(k, max_len - len(r.tokens))) for r in rows]
        live = [i for i, n in enumerate(want) if n > 0]
        drafts: list[list[int]] = [[] for _ in rows]
        if not live:
            return drafts
        chunk = self.artifact.prefill_chunk_size
        first: dict[int, int] = {}
        pair_rows = []
        for i in live:
            row, m = rows[i], len(rows[i].tokens) - 1
            valid = self._valid(row)
            if valid >= m - 1:
                pair_rows.append(i)
                continue
            # behind: prefill from the chunk the valid KV ends in up to m (its logits: d1)
            start = (valid // chunk) * chunk
            t0 = time.perf_counter()
            out = self.model.prefill_decoder(
                input_ids=torch.tensor([row.tokens[start : m + 1]]),
                cache_position=torch.arange(start, m + 1, dtype=torch.int32).unsqueeze(0),
                block_tables=torch.tensor(row.table, dtype=torch.int16),
            )
            self._took(t0)
            self.resyncs += 1
            first[i] = int(out.logits[0, -1].argmax())
        if pair_rows:
            logits = self._call(
                self.pairs,
                [[rows[i].tokens[-2], rows[i].tokens[-1]] for i in pair_rows],
                [len(rows[i].tokens) - 2 for i in pair_rows],
                [rows[i].table for i in pair_rows],
                scratch,
                width=2,
            )
            for j, i in enumerate(pair_rows):
                first[i] = int(logits[j, -1].argmax())
        for i in live:
            drafts[i] = [first[i]]
        for step in range(1, max(want)):
            todo = [i for i in live if want[i] > step]
            logits = self._call(
                self.model.decoders,
                [[drafts[i][-1]] for i in todo],
                [len(rows[i].tokens) - 1 + step for i in todo],
                [rows[i].table for i in todo],
                scratch,
                width=1,
            )
            for j, i in enumerate(todo):
                drafts[i].append(int(logits[j, -1].argmax()))
        for i in live:
            m = len(rows[i].tokens) - 1
            # written: the real tokens up to m, then drafts[:-1] at m+1.. (the last is not)
            self._written[rows[i].req_id] = _Written(m + 1, m + 1, drafts[i][:-1])
        return drafts

    def _call(self, graphs, ids, starts, tables, scratch, width: int) -> torch.Tensor:
        """One batched draft call: rows of ``width`` tokens from ``starts``; padding rows on
        the scratch block. Logits of the live rows, in their order."""
        art = self.artifact
        sizes = art.decoder_batch_sizes
        bs = sizes[bisect.bisect_left(sizes, len(ids))]
        order = list(range(len(ids)))
        if art.requires_batch_sort:
            order.sort(key=lambda i: -starts[i])
        scratch_block, scratch_pos = scratch
        pad = bs - len(ids)
        width_blocks = len(tables[0])
        x = torch.tensor([ids[i] for i in order] + [[0] * width] * pad, dtype=torch.long)
        pos = torch.tensor(
            [[starts[i] + j for j in range(width)] for i in order]
            + [[scratch_pos + j for j in range(width)]] * pad,
            dtype=torch.int32,
        )
        scratch_row = [scratch_block] + [NO_BLOCK] * (width_blocks - 1)
        table = torch.tensor([tables[i] for i in order] + [scratch_row] * pad, dtype=torch.int16)
        mask = ()
        if art.use_attention_mask:
            span = torch.arange(art.max_seq_len)
            mask = ((span.view(1, 1, 1, -1) <= pos.view(bs, 1, -1, 1)).float(),)
        t0 = time.perf_counter()
        if width == 1:
            extra = {"attention_mask": mask[0]} if mask else {}
            logits = graphs[bs](input_ids=x, cache_position=pos, block_tables=table, **extra).logits
        else:
            logits = graphs[bs](x, pos, table, *mask)
        self._took(t0)
        inverse = [0] * len(order)
        for row, i in enumerate(order):
            inverse[i] = row
        return logits[torch.tensor(inverse)]

    def _took(self, start: float) -> None:
        self.calls += 1
        self.seconds += time.perf_counter() - start
