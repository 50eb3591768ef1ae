"""Multi-turn chat and RAG sessions for serving benchmarks: an open-loop workload and its client.

The workload (:func:`build_workload`, deterministic for a seed) is
:mod:`rbln_ray.planning.fleet.workload`'s sessions (tenants' system prompts, chat and RAG
sessions, Poisson arrivals, think times: the draws are described there, and the fleet
simulation replays the same ones in token space), rendered as text here.

Text is real text (windows of the local Python standard library, tokenized with the served
model's tokenizer, so lengths are in that tokenizer's tokens); every turn asks for its
``max_tokens`` with ``ignore_eos``. The previous answer a turn appends is the workload's own
text of the answer's length, not what the server generated, so every system sees exactly the
same prompts (in the emulator's timing mode the generated tokens are garbage anyway). Each
request carries its session in an ``x-session-id`` header.

The client (:func:`run_sessions`) streams ``/v1/chat/completions`` and records per request,
as ``vllm bench serve`` defines them: TTFT (send to first streamed token), TPOT ((last token
- first token) / (output tokens - 1)), prompt and output tokens.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field, replace
from typing import Any

from benchmarks.common import summary
from rbln_ray.planning.fleet.workload import SessionSpec, Span, build_sessions


@dataclass
class Turn:
    user: str
    answer: str  # appended to the history after this turn
    max_tokens: int


@dataclass
class Session:
    sid: str
    start_s: float
    system: str
    turns: list[Turn]
    think_s: list[float]
    doc: int | None = None  # RAG: which document the first turn carries
    records: list[dict[str, Any]] = field(default_factory=list)


class TextSource:
    """Windows of real text of a given length in the model's tokens."""

    def __init__(self, tokenizer: Any, max_chars: int = 1_500_000) -> None:
        from rbln_ray.models.tokenizer import corpus_files

        text, size = [], 0
        for path in corpus_files():
            chunk = path.read_text(errors="replace")
            text.append(chunk)
            size += len(chunk)
            if size >= max_chars:
                break
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode("\n".join(text), add_special_tokens=False)

    def text(self, span: Span) -> str:
        """The text of a drawn window: ``(start, length)`` in the source's tokens."""
        start, n = span
        return self.tokenizer.decode(self.ids[start : start + n])


def build_workload(source: TextSource, spec: SessionSpec, tag: str) -> list[Session]:
    """The sessions of one run (``tag`` makes session ids unique across runs): the planner's
    draws (:func:`build_sessions`, which the fleet simulation replays in token space) over
    this source's tokens, as text."""
    drawn = build_sessions(replace(spec, corpus_tokens=len(source.ids)), tag)
    systems = [
        f"You are the assistant of tenant {t}. Policies and reference code follow.\n"
        + source.text(span)
        for t, span in enumerate(drawn.systems)
    ]
    docs = [source.text(span) for span in drawn.docs]
    sessions = []
    for s in drawn.sessions:
        turns = []
        for k, turn in enumerate(s.turns):
            user = source.text(turn.user)
            if s.doc is not None and k == 0:
                user = f"Document:\n{docs[s.doc]}\n\nQuestion: {user}"
            turns.append(Turn(user, source.text(turn.answer), turn.max_tokens))
        sessions.append(Session(s.sid, s.start_s, systems[s.tenant], turns, s.think_s, s.doc))
    return sessions


async def _one(client: Any, url: str, body: dict, headers: dict, timeout: float) -> dict:
    sent = time.perf_counter()
    first = last = None
    usage: dict[str, Any] = {}
    try:
        async with client.stream("POST", url, json=body, headers=headers, timeout=timeout) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode()[:200]
                return {"sent": sent, "error": f"{resp.status_code}: {text}"}
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("error"):
                    return {"sent": sent, "error": str(chunk["error"])[:200]}
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices"):
                    now = time.perf_counter()
                    first = first or now
                    last = now
    except Exception as exc:  # noqa: BLE001 - a failed request is a data point
        return {"sent": sent, "error": repr(exc)[:200]}
    if first is None:
        return {"sent": sent, "error": "no tokens"}
    return {
        "sent": sent,
        "first": first,
        "last": last,
        "prompt_tokens": usage.get("prompt_tokens"),
        "output_tokens": usage.get("completion_tokens", 0),
    }


async def run_sessions(
    base_url: str,
    model: str,
    sessions: list[Session],
    stop_s: float,
    timeout: float = 900.0,
    progress: bool = True,
    desc: str = "",
) -> float:
    """Play every session (open loop: sessions start at their times whatever the server
    does) until ``stop_s`` after the start (no turn is sent later; turns under way finish);
    fill each session's ``records`` (send and token times relative to the start); return the
    wall time."""
    import httpx
    from tqdm import tqdm

    url = base_url.rstrip("/") + "/v1/chat/completions"
    total = sum(len(s.turns) for s in sessions)
    bar = tqdm(total=total, desc=desc or base_url, disable=not progress)
    limits = httpx.Limits(max_connections=1024, max_keepalive_connections=256)
    start = time.perf_counter()

    async def play(client: Any, s: Session) -> None:
        await asyncio.sleep(max(0.0, s.start_s - (time.perf_counter() - start)))
        history = [{"role": "system", "content": s.system}]
        for turn, think in zip(s.turns, s.think_s, strict=True):
            if time.perf_counter() - start >= stop_s:
                bar.update(1)
                continue  # past the measured window: the run winds down
            history.append({"role": "user", "content": turn.user})
            body = {
                "model": model,
                "messages": list(history),
                "max_tokens": turn.max_tokens,
                "ignore_eos": True,
                "temperature": 0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            record = await _one(client, url, body, {"x-session-id": s.sid}, timeout)
            for key in ("sent", "first", "last"):
                if key in record:
                    record[key] -= start
            s.records.append(record)
            bar.update(1)
            if record.get("error"):
                return  # a conversation whose turn failed ends there
            history.append({"role": "assistant", "content": turn.answer})
            await asyncio.sleep(think)

    async with httpx.AsyncClient(limits=limits, trust_env=False) as client:
        await asyncio.gather(*(play(client, s) for s in sessions))
    bar.close()
    return time.perf_counter() - start


def reuse_bound(sessions: list[Session], tokenizer: Any, block_size: int) -> float | None:
    """Share of the prompt tokens a run sent that an unbounded prefix cache shared by every
    replica could have served: the ceiling of any cache, on the devices or in a host tier.

    Each prompt sent (in the order sent) counts its longest prefix of whole ``block_size``
    blocks that an earlier prompt already had, short of its last token (which vLLM always
    computes). Prompts as the server tokenizes them (the served model's chat template)."""
    sent = []
    for s in sessions:
        history = [{"role": "system", "content": s.system}]
        for turn, record in zip(s.turns, s.records, strict=False):  # the turns sent
            history.append({"role": "user", "content": turn.user})
            sent.append((record["sent"], list(history)))
            history.append({"role": "assistant", "content": turn.answer})
    seen: set[int] = set()
    hits = total = 0
    for _, messages in sorted(sent, key=lambda x: x[0]):
        ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        keys = [hash(tuple(ids[: (i + 1) * block_size])) for i in range(len(ids) // block_size)]
        cached = 0
        while cached < len(keys) and keys[cached] in seen:
            cached += 1
        hits += min(cached * block_size, (len(ids) - 1) // block_size * block_size)
        total += len(ids)
        seen.update(keys)
    return hits / total if total else None


def summarise(
    sessions: list[Session], window: tuple[float, float], ttft_slo_s: float, tpot_slo_s: float
) -> dict[str, Any]:
    """Throughput, TTFT/TPOT percentiles and goodput of the requests sent during ``window``
    (seconds after the start: the steady state, after the sessions' ramp-up); rates are per
    second of the window."""
    lo, hi = window
    records = [r for s in sessions for r in s.records if lo <= r["sent"] < hi]
    sent_turns = len(records)
    ok = [r for r in records if not r.get("error")]
    if not ok:
        return {"requests": sent_turns, "completed": 0, "failed": len(records)}
    elapsed = hi - lo
    ttft = [r["first"] - r["sent"] for r in ok]
    tpot = [
        (r["last"] - r["first"]) / (r["output_tokens"] - 1) for r in ok if r["output_tokens"] > 1
    ]

    def good(r: dict) -> bool:
        per_token = (r["last"] - r["first"]) / max(1, r["output_tokens"] - 1)
        return r["first"] - r["sent"] <= ttft_slo_s and per_token <= tpot_slo_s

    met = sum(good(r) for r in ok)
    return {
        "requests": sent_turns,
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "not_sent": sum(  # turns of conversations whose earlier turn failed
            len(s.turns) - len(s.records)
            for s in sessions
            if any(r.get("error") for r in s.records)
        ),
        "elapsed_s": elapsed,
        "req_per_s": len(ok) / elapsed,
        "output_tok_per_s": sum(r["output_tokens"] for r in ok) / elapsed,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "ttft_ms": summary(ttft, 1e3),
        "tpot_ms": summary(tpot, 1e3),
        "slo_met": met,
        "slo_attainment": met / sent_turns if sent_turns else None,
        "goodput_req_per_s": met / elapsed,
        "errors": sorted({r["error"] for r in records if r.get("error")})[:5],
    }
