"""The goodput benchmark's workload (benchmarks/sessions.py) and its arithmetic, on the locally
built tokenizer and hand-made request records."""

from __future__ import annotations

import hashlib
import json

import pytest

from benchmarks.sessions import (
    Session,
    TextSource,
    Turn,
    build_workload,
    reuse_bound,
    summarise,
)
from rbln_ray.planning.fleet import SessionSpec
from rbln_ray.planning.fleet.workload import CORPUS_TOKENS


@pytest.fixture(scope="module")
def source() -> TextSource:
    from transformers import AutoTokenizer

    from rbln_ray.models.tokenizer import build_tokenizer

    return TextSource(AutoTokenizer.from_pretrained(str(build_tokenizer())), max_chars=60_000)


def test_sessions_repeat_tenant_prompts_and_documents(source: TextSource) -> None:
    spec = SessionSpec(rate=2.0, duration_s=120, seed=3, tenants=3, num_docs=2)
    sessions = build_workload(source, spec, tag="t")
    again = build_workload(source, spec, tag="t")
    assert [(s.sid, s.start_s, s.turns) for s in sessions] == [
        (s.sid, s.start_s, s.turns) for s in again
    ], "a seed must give the same workload"
    # sessions arrive at rate / mean turns per session: about rate x duration requests
    requests = sum(len(s.turns) for s in sessions)
    assert 0.6 * 240 < requests < 1.4 * 240, requests
    assert all(0 < s.start_s < spec.duration_s for s in sessions)
    # every session carries one of the tenants' system prompts; a few tenants are shared
    systems = {s.system for s in sessions}
    assert len(systems) == spec.tenants
    first = source.tokenizer.encode(next(iter(systems)), add_special_tokens=False)
    assert abs(len(first) - spec.system_len) < 40  # re-tokenizing decoded text may shift a bit
    rag = [s for s in sessions if s.doc is not None]
    chat = [s for s in sessions if s.doc is None]
    assert rag and chat
    assert all(spec.turns[0] <= len(s.turns) <= spec.turns[1] for s in chat)
    assert all(spec.rag_turns[0] <= len(s.turns) <= spec.rag_turns[1] for s in rag)
    # a RAG session's first turn carries its document, which other sessions reuse
    docs = {s.turns[0].user.split("\n\nQuestion: ")[0] for s in rag}
    assert len(docs) <= spec.num_docs < len(rag)
    assert all(spec.output_len[0] <= t.max_tokens <= spec.output_len[1] for s in sessions
               for t in s.turns)  # fmt: skip
    # another rate's run keeps the tenants and documents (so caches could carry over) but not
    # the sessions' ids
    other = build_workload(source, SessionSpec(rate=1.0, duration_s=60, tenants=3, num_docs=2), "u")
    assert {s.system for s in other} <= systems
    assert not {s.sid for s in other} & {s.sid for s in sessions}


class _SpanSource(TextSource):
    """A source of CORPUS_TOKENS tokens whose text names its window."""

    def __init__(self) -> None:
        self.ids = range(CORPUS_TOKENS)  # type: ignore[assignment]

    def text(self, span: tuple[int, int]) -> str:
        return "{}:{}".format(*span)


@pytest.mark.parametrize(
    ("seed", "rate", "sessions", "digest"),
    [(100, 1.0, 28, "5ee71eefe7191ef1"), (103, 1.4375, 36, "07881b2bdb908aad")],
)
def test_the_committed_runs_sessions_are_drawn_unchanged(
    seed: int, rate: float, sessions: int, digest: str
) -> None:
    """The sessions of BENCHMARKS 15's and 20's runs (32 tenants and documents), as the
    benchmark's own draws made them when those runs were measured (``benchmarks/sessions.py``
    of efa0c16, before the draws moved to ``rbln_ray.planning.fleet.workload``): a change of
    the draws' order or arithmetic would make new runs incomparable with the committed ones."""
    spec = SessionSpec(rate=rate, duration_s=120, seed=seed, tenants=32, num_docs=32)
    drawn = build_workload(_SpanSource(), spec, "t")
    rows = [
        (s.sid, s.start_s, s.system, [(t.user, t.answer, t.max_tokens) for t in s.turns],
         s.think_s, s.doc)
        for s in drawn
    ]  # fmt: skip
    assert len(drawn) == sessions
    assert hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:16] == digest
    rag = next(s for s in drawn if s.doc is not None)
    assert rag.turns[0].user.startswith("Document:\n") and "\n\nQuestion: " in rag.turns[0].user


def _record(sent: float, ttft: float, tpot: float, tokens: int = 11) -> dict:
    first = sent + ttft
    return {"sent": sent, "first": first, "last": first + tpot * (tokens - 1),
            "prompt_tokens": 100, "output_tokens": tokens}  # fmt: skip


def test_goodput_counts_requests_meeting_both_slos_in_the_window() -> None:
    def session(records: list[dict], turns: int) -> Session:
        s = Session(sid="s", start_s=0, system="", turns=[None] * turns, think_s=[])  # type: ignore[list-item]
        s.records = records
        return s

    sessions = [
        session([_record(12, 0.5, 0.05), _record(20, 1.9, 0.149)], 2),  # both meet the SLO
        session([_record(15, 2.5, 0.05), _record(30, 0.5, 0.2)], 2),  # TTFT, then TPOT missed
        session([_record(5, 0.1, 0.01)], 1),  # before the window: not counted at all
        session([{"sent": 40.0, "error": "500: boom"}], 3),  # failed; its 2 later turns unsent
    ]
    res = summarise(sessions, (10.0, 50.0), ttft_slo_s=2.0, tpot_slo_s=0.15)
    assert res["requests"] == 5 and res["completed"] == 4 and res["failed"] == 1
    assert res["not_sent"] == 2
    assert res["slo_met"] == 2
    assert res["slo_attainment"] == pytest.approx(2 / 5)
    assert res["goodput_req_per_s"] == pytest.approx(2 / 40)
    assert res["req_per_s"] == pytest.approx(4 / 40)
    assert res["ttft_ms"]["max"] == pytest.approx(2500)
    assert res["tpot_ms"]["max"] == pytest.approx(200)
    assert res["errors"] == ["500: boom"]


class _Chars:
    """A tokenizer whose chat template is the messages' characters, one id each."""

    @staticmethod
    def apply_chat_template(messages: list, tokenize: bool, add_generation_prompt: bool) -> list:
        return [ord(c) for m in messages for c in m["content"]]


def test_reuse_bound_counts_whole_blocks_seen_before_short_of_the_last_token() -> None:
    def session(sid: str, user: str, sent: list[float], turns: list[Turn] | None = None):
        turns = turns or [Turn(user, "", 8)]
        s = Session(sid, 0.0, "S" * 8, turns, [0.0] * len(turns))
        s.records = [{"sent": t} for t in sent]
        return s

    a = session("a", "", [0.0, 2.0], [Turn("u" * 4, "a" * 3, 8), Turn("w" * 2, "", 8),
                                       Turn("never sent", "", 8)])  # fmt: skip
    b = session("b", "v" * 4, [1.0])
    c = session("c", "u" * 4, [3.0])  # a's first prompt again
    # blocks of 4: a1 (12 ids) nothing before; b1 (12) its 2 system blocks; a2 (17) 3 of its
    # 4 full blocks; c1 (12) all 3, but its last token is computed: 2 blocks
    assert reuse_bound([a, b, c], _Chars(), 4) == (0 + 8 + 12 + 8) / (12 + 12 + 17 + 12)
    assert reuse_bound([], _Chars(), 4) is None
