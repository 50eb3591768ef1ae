"""Speculative decoding in process: the real RBLN scheduler and runner, vLLM's spec
bookkeeping and rejection sampler, on the fake compiled model of ``test_runner``.

The fake's verify graph computes every window position's next token from what its KV cache
holds for that row up to that position, so a wrong position, block table, padding or roll
back corrupts the context and shows up as a wrong token against the reference (computed
from the token sequence alone). Drafts come from an oracle that knows the reference and is
right for the first ``j`` positions of each proposal only, so every step mixes accepted and
rejected drafts; greedy outputs must equal the reference exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.unit.engine_harness import MAX_LEN, write_artifact
from tests.unit.test_runner import LENGTHS, PROMPTS, VOCAB, Engine, KVCacheLM, next_token, reference

K = 3


class VerifyLM(KVCacheLM):
    """The fake model plus verify graphs: ``verify[bs](input_ids [bs,W], cache_position
    [bs,W], block_tables [bs,nblk])`` -> logits ``[bs, W, V]``, every position's own."""

    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.verify = {bs: self._verify for bs in self.decoders}
        self.windows: list[tuple[int, ...]] = []  # first positions of live verify rows

    def _verify(self, input_ids, cache_position, block_tables):
        bs, width = input_ids.shape
        logits = torch.zeros(bs, width, VOCAB)
        for row in range(bs):
            table = block_tables[row].tolist()
            positions = cache_position[row].tolist()
            slots = [self._slot(table, p) for p in range(positions[-1] + 1)]
            if None in slots:
                continue
            for token, p in zip(input_ids[row].tolist(), positions, strict=True):
                self.kv[slots[p]] = token
            for i, p in enumerate(positions):
                context = [int(self.kv[slot]) for slot in slots[: p + 1]]
                if -1 not in context:
                    logits[row, i, next_token(context)] = 1.0
        return logits


class OracleDrafter:
    """Drafts the reference continuation, right for the first ``j`` positions of a proposal
    (``j`` cycles 0..K over proposals), then wrong."""

    method = "oracle"

    def __init__(self) -> None:
        self.proposals = 0

    def propose_step(self, runner, so, req_ids, sampled, k):
        drafts = []
        for req_id, tokens in zip(req_ids, sampled, strict=True):
            if not tokens:
                drafts.append([])
                continue
            state = runner.requests[req_id]
            seq = state.prompt_token_ids + state.output_token_ids
            right = self.proposals % (k + 1)
            self.proposals += 1
            n = min(k, runner.vllm_config.model_config.max_model_len - len(seq))
            out = []
            for i in range(max(0, n)):
                token = next_token(seq + out)
                out.append(token if i < right else (token + 1) % VOCAB)
            drafts.append(out)
        return drafts


class SpecEngine(Engine):
    """Engine with speculative decoding: vLLM's synchronous post-step hands the runner's
    drafts to the scheduler (EngineCore.post_step)."""

    def __init__(self, artifact: Path, policy: str = "always", **engine) -> None:
        engine.setdefault("speculative_config", {"method": "ngram", "num_speculative_tokens": K})
        engine.setdefault("additional_config", {"rbln_spec_policy": policy})
        super().__init__(artifact, **engine)
        from rbln_ray.compile.artifact import CompiledArtifact
        from rbln_ray.vllm_plugin.kv_blocks import block_layout
        from rbln_ray.vllm_plugin.model_runner import RBLNModelRunner
        from rbln_ray.vllm_plugin.spec.verify import Speculator

        art = CompiledArtifact.load(artifact)
        self.model = VerifyLM(
            art.kvcache_num_blocks, art.kvcache_block_size, list(art.decoder_batch_sizes)
        )
        self.drafter = OracleDrafter()
        spec = Speculator(self.model.verify, self.drafter)
        self.runner = RBLNModelRunner(
            self.config, art, self.model, block_layout(art), speculator=spec
        )
        self.kinds: list[str] = []

    def run_step(self, so):
        self.kinds.append(so.rbln_plan.kind)
        return super().run_step(so)

    def _apply(self, so, result) -> None:
        # the tokens vLLM keeps (a verify step may sample past max_tokens: vLLM trims)
        for outputs in self.scheduler.update_from_output(so, result).values():
            for out in outputs.outputs:
                self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        drafts = self.runner.take_draft_token_ids()
        if drafts is not None:
            self.scheduler.update_draft_token_ids(drafts)


@pytest.fixture(
    params=[{}, {"kvcache_block_size": 256, "kvcache_num_blocks": 8}], ids=["eager", "paged"]
)
def artifact(request, tmp_path: Path) -> Path:
    return write_artifact(tmp_path, spec_tokens=K, **request.param)


def test_mixed_batch_with_partial_acceptance_matches_the_reference(artifact: Path) -> None:
    engine = SpecEngine(artifact, async_scheduling=False)
    for req_id, prompt in PROMPTS.items():
        engine.add(req_id, prompt, LENGTHS[req_id] + 10)
    outputs = engine.drive()
    for req_id, prompt in PROMPTS.items():
        assert outputs[req_id] == reference(prompt, LENGTHS[req_id] + 10), req_id
    stats = engine.runner.stats
    assert stats.verify_steps > 0 and stats.padded_rows > 0
    assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens
    # fewer device steps than tokens: accepted drafts came for free
    decoded = sum(len(o) for o in outputs.values()) - len(PROMPTS)
    assert stats.verify_steps + stats.decode_steps < decoded
    assert "verify" in engine.kinds and engine.scheduler.spec_policy.observed > 0


def test_windows_near_the_compiled_length_are_front_padded(artifact: Path) -> None:
    engine = SpecEngine(artifact, async_scheduling=False)
    prompt = list(range(10, 10 + MAX_LEN - 8))
    engine.add("edge", prompt, max_tokens=8)  # ends exactly at the compiled max_seq_len
    engine.add("short", [5, 6, 7], max_tokens=20)
    outputs = engine.drive()
    assert outputs["edge"] == reference(prompt, 8)
    assert outputs["short"] == reference([5, 6, 7], 20)
    assert engine.runner.stats.verify_steps > 0


def test_prefix_hits_stay_exact_with_speculation(artifact: Path) -> None:
    engine = SpecEngine(artifact, async_scheduling=False)
    shared = [3 + (i * 7) % 900 for i in range(260)]
    engine.add("a", shared + [1], max_tokens=30)
    while not engine.outputs.get("a"):
        so = engine.scheduler.schedule()
        engine._apply(so, engine.run_step(so))
    engine.add("b", shared + [2, 3], max_tokens=12)  # a still runs: its KV is copied
    outputs = engine.drive()
    assert engine.runner.stats.prefix_reused_tokens >= 256
    assert outputs["a"] == reference(shared + [1], 30)
    assert outputs["b"] == reference(shared + [2, 3], 12)


def test_auto_policy_decodes_when_drafts_are_rejected(artifact: Path) -> None:
    """Drafts that are never right: once their acceptance is measured the policy stops
    verifying and decodes (setting the drafts aside as shadows, which keep being measured),
    and outputs stay exact. Costs injected: a verify call costs what a decode call does (an
    ATOM at small batch), so any acceptance above ~5% would pay."""
    engine = SpecEngine(artifact, policy="auto", async_scheduling=False)
    policy = engine.scheduler.spec_policy
    policy.prior = lambda kind, batch, context, width: 1.0
    policy.observe_step = lambda info: None
    engine.drafter.propose_step = lambda runner, so, ids, sampled, k: [
        [1] * k if t else [] for t in sampled
    ]
    engine.add("x", [11, 12, 13], max_tokens=120)
    assert engine.drive()["x"] == reference([11, 12, 13], 120)
    stats = engine.runner.stats
    assert stats.spec_accepted_tokens == 0
    assert stats.verify_steps <= 25 and stats.decode_steps >= 90, stats
    assert policy.acceptance[0] < 0.03
    assert policy.observed > stats.verify_steps  # shadow drafts were measured too


def test_take_draft_token_ids_hands_each_step_s_drafts_once(artifact: Path) -> None:
    engine = SpecEngine(artifact, async_scheduling=False)
    engine.add("x", [11, 12, 13], max_tokens=4)
    so = engine.scheduler.schedule()
    result = engine.run_step(so)  # the prompt: its first token, drafts for the next step
    drafts = engine.runner.take_draft_token_ids()
    assert drafts.req_ids == ["x"] and len(drafts.draft_token_ids[0]) == K
    assert result.rbln_drafts is drafts and result.rbln_spec.kind == "prefill"
    assert engine.runner.take_draft_token_ids() is None
