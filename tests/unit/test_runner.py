"""The RBLN model runner in process, under the real RBLN scheduler, on a fake compiled model.

The fake (:class:`KVCacheLM`) stands in for optimum-rbln's decoder model the way a device
does: it keeps a KV cache of ``kvcache_num_blocks`` RBLN blocks, writes each call's tokens at
the ``cache_position`` slots of the blocks its ``block_tables`` name, and predicts the next
token from what its cache holds for that row. So a wrong position, block table, padding row
or KV copy in the runner corrupts the context and shows up as a wrong token against the
reference, which is computed from the token sequence itself (no runner, no cache).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.unit.engine_harness import MAX_LEN, Harness, write_artifact

VOCAB = 4096


def next_token(context: list[int]) -> int:
    """The fake model's language: a function of the whole context, order-sensitive."""
    h = 0
    for t in context:
        h = (h * 31 + t + 7) % 1_000_003
    return 10 + h % (VOCAB - 10)


def reference(prompt: list[int], max_tokens: int, adapter: int = 0) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(adapted(next_token(seq), adapter))
        seq.append(out[-1])
    return out


def adapted(token: int, adapter: int) -> int:
    """The fake model's LoRA adapters: adapter ``k`` > 0 shifts the prediction (0: base)."""
    return token if not adapter else 10 + (token * 7 + adapter) % (VOCAB - 10)


def adapters_shape(input_ids: torch.Tensor) -> tuple[int]:
    return (input_ids.shape[0],)


class Prefill:
    """``model.prefill_decoder``: callable, with the runtime (for KV copies) beside it."""

    def __init__(self, model: KVCacheLM) -> None:
        self.model, self.runtime = model, model

    def __call__(self, **inputs):
        return self.model._call(**inputs)


class KVCacheLM:
    """optimum-rbln's serving surface (``prefill_decoder``, ``decoders[bs]``, the runtime's
    ``_copy_kv_cache``) over a token-level KV cache of the compiled block shape."""

    def __init__(self, num_blocks: int, block_size: int, decoder_batch_sizes: list[int]) -> None:
        self.block_size = block_size
        self.kv = torch.full((num_blocks, block_size), -1, dtype=torch.long)
        self.prefill_decoder = Prefill(self)
        self.decoders = {bs: self._call for bs in decoder_batch_sizes}
        self.copies = 0

    def _slot(self, table: list[int], position: int) -> tuple[int, int] | None:
        """Where ``position`` lives; None for a row without a block (``NO_BLOCK``: a padding
        row when no scratch block is free), which a device neither writes nor reads."""
        block = table[position // self.block_size]
        return None if block < 0 else (block, position % self.block_size)

    def _call(
        self,
        input_ids,
        cache_position,
        block_tables,
        local_block_tables=None,
        attention_mask=None,
        position_ids=None,
        lora_int_ids=None,
    ):
        # A static-cache model: no sliding-window slots, positions are the cache positions.
        assert local_block_tables is None and position_ids is None
        adapters = [0] * input_ids.shape[0]
        if lora_int_ids is not None:  # one compiled adapter id per row, as optimum takes them
            assert lora_int_ids.dtype == torch.int32 and lora_int_ids.shape == adapters_shape(
                input_ids
            )
            adapters = lora_int_ids.tolist()
        tables = block_tables.view(input_ids.shape[0], -1).tolist()
        logits = torch.zeros(input_ids.shape[0], input_ids.shape[1], VOCAB)
        for row, (ids, positions, table) in enumerate(
            zip(input_ids.tolist(), cache_position.tolist(), tables, strict=True)
        ):
            slots = [self._slot(table, p) for p in range(positions[-1] + 1)]
            if None in slots:
                continue  # zero logits: a live row here samples token 0, never the reference
            for token, position in zip(ids, positions, strict=True):
                self.kv[slots[position]] = token
            context = [int(self.kv[slot]) for slot in slots]
            if -1 not in context:  # else unwritten KV was read: zero logits, a wrong token
                logits[row, -1, adapted(next_token(context), adapters[row])] = 1.0
        return SimpleNamespace(logits=logits)

    def _copy_kv_cache(self, src: int, dst: int, length: int) -> None:
        self.kv[dst, :length] = self.kv[src, :length]
        self.copies += 1


class Engine(Harness):
    """The scheduler harness plus a real RBLNModelRunner on the fake model, stepped like
    vLLM's engine core (synchronously, or one step ahead with async scheduling)."""

    def __init__(self, artifact: Path, **engine: object) -> None:
        super().__init__(artifact, **engine)
        from rbln_ray.compile.artifact import CompiledArtifact
        from rbln_ray.vllm_plugin.kv_blocks import block_layout
        from rbln_ray.vllm_plugin.model_runner import RBLNModelRunner

        art = CompiledArtifact.load(artifact)
        self.model = KVCacheLM(
            art.kvcache_num_blocks, art.kvcache_block_size, list(art.decoder_batch_sizes)
        )
        self.runner = RBLNModelRunner(self.config, art, self.model, block_layout(art))
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, object] = {}  # request id -> vLLM's finish reason

    def drive(self, limit: int = 2000) -> dict[str, list[int]]:
        in_flight = None
        for _ in range(limit):
            if not self.scheduler.has_requests() and in_flight is None:
                return self.outputs
            so = self.scheduler.schedule()
            result = self.run_step(so)
            if self.config.scheduler_config.async_scheduling:
                # vLLM's async loop: step N's output is applied after step N+1 was scheduled.
                if in_flight is not None:
                    self._apply(*in_flight)
                in_flight = (so, result) if so.total_num_scheduled_tokens else None
            else:
                self._apply(so, result)
        raise AssertionError(f"requests unfinished after {limit} steps")

    def run_step(self, so):
        self.runner.execute_model(so)
        return self.runner.sample_tokens(None)

    def _apply(self, so, result) -> None:
        for req_id, tokens in zip(result.req_ids, result.sampled_token_ids, strict=True):
            self.outputs.setdefault(req_id, []).extend(tokens)
        for client in self.scheduler.update_from_output(so, result).values():
            for out in client.outputs:
                if out.finish_reason is not None:
                    self.finished[out.request_id] = out.finish_reason


class AheadEngine(Engine):
    """Steps as the Ray executor's step loop does: each decode step's inputs but its token
    ids built by ``decode_ahead`` before the previous step's tokens are known (its reader
    thread, while the device runs), the rest by ``prepare``. ``misguess``: hand ``prepare``
    the ahead inputs with their rows reversed, which it must not use."""

    def __init__(self, artifact: Path, misguess: bool = False, **engine: object) -> None:
        super().__init__(artifact, **engine)
        self.misguess = misguess

    def run_step(self, so):
        ahead = self.runner.decode_ahead(so)
        if ahead is not None and self.misguess and len(ahead.req_ids) > 1:
            ahead.req_ids = ahead.req_ids[::-1]
        self.runner.launch(self.runner.prepare(so, ahead))
        return self.runner.sample_tokens(None)


PROMPTS = {
    "one": [5],
    "short": [100, 200, 300],
    "chunk": list(range(1000, 1130)),  # crosses a 128-token chunk
    "long": [7 + (i % 50) for i in range(300)],  # three chunks
    "mid": list(range(2000, 2060)),
}
LENGTHS = {"one": 9, "short": 20, "chunk": 5, "long": 12, "mid": 30}


@pytest.fixture(
    params=[
        {},  # eager: one RBLN block of max_seq_len per sequence
        {"kvcache_block_size": 256, "kvcache_num_blocks": 8},  # flash-like: 2 blocks each
    ],
    ids=["eager", "paged"],
)
def artifact(request, tmp_path: Path) -> Path:
    return write_artifact(tmp_path, **request.param)


def drive_mixed_batch(engine: Engine):
    """Run every prompt of ``PROMPTS`` to its length; assert each output equals the reference
    and return the runner's counters."""
    for req_id, prompt in PROMPTS.items():
        engine.add(req_id, prompt, LENGTHS[req_id])
    outputs = engine.drive()
    for req_id, prompt in PROMPTS.items():
        assert outputs[req_id] == reference(prompt, LENGTHS[req_id]), req_id
    return engine.runner.stats


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_mixed_batch_matches_the_reference(artifact: Path, async_scheduling: bool) -> None:
    stats = drive_mixed_batch(Engine(artifact, async_scheduling=async_scheduling))
    assert stats.padded_rows > 0  # requests finished at different times: padding rows ran
    assert stats.prefill_requests == len(PROMPTS)


@pytest.mark.parametrize("misguess", [False, True], ids=["ahead", "misguessed"])
def test_decode_inputs_built_ahead_match_the_reference(artifact: Path, misguess: bool) -> None:
    """The step loop's split: a decode step's positions, block tables and padding rows built
    from its scheduler output alone, one step early; its token ids after sampling. Exact in a
    mixed batch (starts, chunked prompts, finishes at different times), and a step whose rows
    are not the ones built ahead is built again rather than run on the wrong rows."""
    stats = drive_mixed_batch(AheadEngine(artifact, misguess=misguess, async_scheduling=True))
    if misguess:  # only single-row steps (nothing to reverse) may use the ahead inputs
        assert stats.decode_inputs_ahead < stats.decode_steps
        assert stats.decode_rows > stats.decode_steps  # multi-row steps ran, built again
    else:
        # every decode step but one after a prefill step or a finish (a changed batch)
        misses = stats.decode_steps - stats.decode_inputs_ahead
        assert misses <= stats.prefill_steps + len(PROMPTS), stats
        assert stats.decode_inputs_ahead > 0


def test_prefix_hits_copy_or_adopt_kv_and_stay_exact(artifact: Path) -> None:
    engine = Engine(artifact, async_scheduling=False)
    shared = [3 + (i * 7) % 900 for i in range(260)]  # two full 128-token vLLM blocks
    engine.add("a", shared + [1], max_tokens=40)
    while not engine.outputs.get("a"):  # a's prompt done; a keeps its block while decoding
        so = engine.scheduler.schedule()
        engine._apply(so, engine.run_step(so))
    engine.add("b", shared + [2, 3], max_tokens=6)  # a still runs: the KV is copied
    engine.drive()
    stats = engine.runner.stats
    assert engine.model.copies >= 1 and stats.kv_copies == engine.model.copies
    assert stats.prefix_reused_tokens == 256  # b's two full vLLM blocks
    engine.add("c", shared + [4], max_tokens=6)  # a and b finished: a free block is adopted
    outputs = engine.drive()
    # At least one block of the hit is reused (a free holder may have given its last vLLM
    # block to the decode steps' scratch slot).
    assert stats.prefix_reused_tokens >= 256 + 128
    for req_id, prompt in {"a": shared + [1], "b": shared + [2, 3], "c": shared + [4]}.items():
        assert outputs[req_id] == reference(prompt, len(outputs[req_id])), req_id


def test_the_compiled_length_bounds_a_request(artifact: Path) -> None:
    engine = Engine(artifact, async_scheduling=False)
    prompt = list(range(10, 10 + MAX_LEN - 4))
    engine.add("edge", prompt, max_tokens=4)  # fills the compiled max_seq_len exactly
    assert engine.drive()["edge"] == reference(prompt, 4)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_the_engines_custom_logits_processors_run(tmp_path: Path, async_scheduling: bool) -> None:
    """``--logits-processors`` reach the runner's sampler (vLLM's own runners pass them to
    ``build_logitsprocs``): the scripted processor forces its request's tokens, then the
    model continues from them; a request beside it without a script is untouched."""
    from vllm import SamplingParams
    from vllm.v1.request import Request

    from rbln_ray.models.scripted import QUALNAME

    engine = Engine(
        write_artifact(tmp_path), async_scheduling=async_scheduling, logits_processors=[QUALNAME]
    )
    script = [11, 22, 33, 44, 55]
    params = SamplingParams(
        max_tokens=9, ignore_eos=True, temperature=0, extra_args={"rbln_script": script}
    )
    engine.scheduler.add_request(
        Request("scripted", [5, 6], params, None, block_hasher=engine.hasher)
    )
    engine.add("free", [5, 6], max_tokens=9)
    outputs = engine.drive()
    assert outputs["scripted"] == script + reference([5, 6, *script], 4)
    assert outputs["free"] == reference([5, 6], 9)


def test_lora_rows_reach_the_graphs_by_adapter_name(tmp_path: Path) -> None:
    """Each row's compiled adapter id, chosen by the request's adapter *name* (vLLM's ids
    differ), reaches prefill and every decode call in the device's row order (length-sorted
    here) with 0 for base and padding rows; a request naming an adapter that is not compiled
    in finishes with an error while the others run on; max_loras is raised to the adapters."""
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine import FinishReason

    lora_config = {
        "adapters": [
            {
                "lora_int_id": 1,
                "lora_name": "a",
                "lora_path": "/x/a",
                "r": 4,
                "target_modules": ["q_proj"],
            },
            {
                "lora_int_id": 2,
                "lora_name": "b",
                "lora_path": "/x/b",
                "r": 8,
                "target_modules": ["o_proj"],
            },
        ],
        "max_lora_rank": 8,
    }
    art = write_artifact(tmp_path, lora_config=lora_config, _requires_batch_sort=True)
    engine = AheadEngine(art, enable_lora=True, max_loras=1, max_lora_rank=8, async_scheduling=True)
    assert engine.config.lora_config.max_loras == 2
    names = {"one": None, "short": "a", "chunk": "b", "long": "a", "mid": "b", "x": "zzz"}
    for req_id, name in names.items():
        prompt = PROMPTS.get(req_id, [1, 2, 3])
        lora = LoRARequest(name, 40 + len(req_id), f"/nowhere/{name}") if name else None
        request = make_request(engine, req_id, prompt, LENGTHS.get(req_id, 5), lora)
        engine.scheduler.add_request(request)
    outputs = engine.drive()
    ids = {None: 0, "a": 1, "b": 2}
    for req_id, prompt in PROMPTS.items():
        expected = reference(prompt, LENGTHS[req_id], ids[names[req_id]])
        assert outputs[req_id] == expected, req_id
    assert "x" not in outputs and engine.finished["x"] == FinishReason.ERROR
    assert engine.runner.stats.decode_rows > engine.runner.stats.decode_steps


def make_request(engine, req_id, prompt, max_tokens, lora_request):
    from vllm import SamplingParams
    from vllm.v1.request import Request

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    return Request(
        req_id, prompt, params, None, lora_request=lora_request, block_hasher=engine.hasher
    )
