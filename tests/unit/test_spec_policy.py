"""The speculation policy's choices, and what an engine with a speculative_config is refused
at start (the platform names what it cannot serve)."""

from __future__ import annotations

from pathlib import Path

import pytest

from rbln_ray.vllm_plugin.spec.policy import SpecPolicy, SpecStepInfo
from tests.unit.engine_harness import Harness, write_artifact


def policy(verify_over_decode: float, **kw) -> SpecPolicy:
    def prior(kind, batch, context, width):
        return verify_over_decode if kind == "verify" else 1.0

    return SpecPolicy(k=3, width=4, prior=prior, **kw)


def test_verifies_while_it_pays_and_decodes_when_compute_bound() -> None:
    p = policy(1.01)
    for _ in range(50):
        p.observe(3, 1)  # position 1 always, position 2 never accepted
    assert p.acceptance[0] > 0.95 and p.acceptance[1] < 0.05
    assert p.verify_pays([3, 3], 2, 100)  # ~2 tokens per row for ~1 call
    assert not p.verify_pays([0, 0], 2, 100)  # nothing to verify
    assert not policy(2.5).verify_pays([3, 3], 2, 100)  # 2 tokens for 2.5 calls
    p.acceptance = [0.02, 0.0, 0.0]
    assert not p.verify_pays([3, 3], 2, 100)  # rarely accepted: a plain decode is better
    assert policy(9.0, mode="always").verify_pays([1, 0], 2, 100)


def test_measured_times_scale_the_prior() -> None:
    p = policy(1.0)
    for _ in range(60):
        p.observe(3, 3)
        p.observe_step(SpecStepInfo("decode", 4, 100, 0.010))
        p.observe_step(SpecStepInfo("verify", 4, 100, 0.050))  # verify measured 5x decode
    assert p.seconds("verify", 4, 100) == pytest.approx(0.050, rel=0.01)
    assert not p.verify_pays([3] * 4, 4, 100)  # 4 tokens per row cost 5 decode calls


def test_draft_model_probes_while_speculation_does_not_pay() -> None:
    p = policy(1.0, draft_model=True, probe_steps=5)
    p.acceptance = [0.0, 0.0, 0.0]
    p.observe_step(SpecStepInfo("decode", 1, 10, 0.01, draft_s=0.05, draft_calls=3))
    asked = [p.wants_drafts(1, 1, 10) for _ in range(10)]
    assert asked == [False, False, False, False, True] * 2
    p.acceptance = [0.9, 0.9, 0.9]  # 3.4 tokens for a verify and 5 draft decodes' time
    assert not p.wants_drafts(1, 1, 10)
    p.observe_step(SpecStepInfo("decode", 1, 10, 0.01, draft_s=0.005, draft_calls=3))
    assert p.draft_seconds(1) == pytest.approx(0.0455)
    p._draft[1] = 0.005  # a cheap draft: 3.4 tokens for 1.5 decodes' time
    assert p.wants_drafts(1, 1, 10)


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    return write_artifact(tmp_path, spec_tokens=3)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def test_an_engine_with_ngram_is_sized_for_drafts_and_runs_synchronously(artifact) -> None:
    config = Harness(artifact, speculative_config=NGRAM).config
    sched = config.scheduler_config
    assert sched.async_scheduling is False
    assert sched.max_num_batched_tokens >= 4 * (1 + 3)  # every row's token and drafts
    assert sched.scheduler_cls.endswith("RBLNScheduler")
    # vLLM re-checks the config in the engine process: async scheduling with ngram raises
    config.__post_init__()


@pytest.mark.parametrize(
    ("spec", "rbln", "message"),
    [
        (
            {"method": "eagle", "model": "ARTIFACT", "num_speculative_tokens": 3},
            {},
            "method='eagle': needs the target model's hidden states",
        ),
        (
            {"method": "medusa", "model": "ARTIFACT", "num_speculative_tokens": 3},
            {},
            "method='medusa': needs extra decoding heads",
        ),
        ({**NGRAM, "num_speculative_tokens": 5}, {}, "rbln-ray compile --spec-tokens 5"),
        (NGRAM, {"spec_tokens": 0}, "no verify graphs"),
        (
            NGRAM,
            {"cache_impl": "sliding_window", "sliding_window": 64},
            "sliding_window KV cache",
        ),
        ({**NGRAM, "draft_sample_method": "probabilistic"}, {}, "draft_sample_method"),
    ],
    ids=["eagle", "medusa", "too-few-drafts", "no-verify-graphs", "sliding", "probabilistic"],
)
def test_what_cannot_be_served_is_refused_naming_it(tmp_path, spec, rbln, message) -> None:
    rbln = dict(rbln)
    spec_tokens = rbln.pop("spec_tokens", 3)
    art = write_artifact(tmp_path, spec_tokens=spec_tokens, **rbln)
    spec = {k: (str(art) if v == "ARTIFACT" else v) for k, v in spec.items()}
    with pytest.raises(Exception, match=message):
        Harness(art, speculative_config=spec)
