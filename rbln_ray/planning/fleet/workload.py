"""The session workload of BENCHMARKS section 15, drawn in token space (deterministic for a seed).

- **tenants**, each with a ``system_len``-token system prompt; a session's tenant is drawn
  Zipf-like (``zipf_s``), so a few tenants are hot;
- **chat sessions** of ``turns`` turns (4-6 by default): each turn appends ``user_len``
  (50-300) tokens of user text to the conversation, and the answer of the previous turn;
- **RAG sessions** (``rag_fraction`` of sessions, 1-2 turns): the first turn carries one of
  ``num_docs`` ``doc_len``-token documents (also drawn Zipf-like) before its question;
- sessions **arrive as a Poisson process** at ``rate / mean turns per session`` (so requests
  arrive at about ``rate`` per second); a session's next turn is sent when the previous one
  has finished and the user has thought for an exponential ``think_s``; every turn asks for
  ``output_len`` (32-128) tokens.

Every text is drawn as a window ``(start, length)`` of a corpus of ``corpus_tokens`` tokens.
The benchmarks (``benchmarks/sessions.py``) render those windows as real text (the standard
library tokenized by the served model, :data:`CORPUS_TOKENS` long in the demo model's
tokenizer); the fleet simulation takes them from a synthetic corpus of the same length
(:class:`Corpus`), so for the same spec it replays the measured run's sessions (arrival times,
tenants, documents, turn counts, lengths, think times) and every prompt shares exactly the
prefixes it shares in the benchmark.

Prompts are rendered as the served tiny Llama's chat template renders them
(``<|role|>\\ncontent\\n`` per message, then ``<|assistant|>\\n``), with that tokenizer's
token counts for the template and the fixed phrases (measured: role headers of 6 and 8
tokens, the tenant line 24-25, ``Document:\\n`` 5, ``\\n\\nQuestion: `` 8). What differs from the
benchmark: the benchmark decodes a window of ``n`` tokens to text and the chat template
re-tokenizes it, which may give a token or two more or less at a window's edges; here a
window is exactly ``n`` tokens.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

# Tokens of the benchmark's text corpus (the standard library's first 1.5 M characters) in
# the served tiny Llama's tokenizer: only the range its random draws are taken over.
CORPUS_TOKENS = 456_425
VOCAB = 4096
# The tiny Llama's chat template, in its tokenizer's ids.
SYSTEM_HEADER = (30, 94, 2745, 94, 32, 201)  # "<|system|>\n"
USER_HEADER = (30, 94, 1491, 94, 32, 201)  # "<|user|>\n"
ASSISTANT_HEADER = (30, 94, 3361, 629, 848, 94, 32, 201)  # "<|assistant|>\n"
NEWLINE = (201,)
DOCUMENT = (38, 752, 526, 28, 201)  # "Document:\n"
QUESTION = (201, 201, 51, 325, 275, 298, 28, 223)  # "\n\nQuestion: "


@dataclass(frozen=True)
class SessionSpec:
    """What a run's sessions are drawn from (the module docstring); ``rate`` in requests per
    second, sessions arriving for ``duration_s``; ``corpus_tokens``: the length of the
    corpus the text windows are drawn from."""

    rate: float
    duration_s: float
    seed: int = 0
    tenants: int = 8
    system_len: int = 1024
    zipf_s: float = 1.0
    num_docs: int = 8
    doc_len: int = 2048
    rag_fraction: float = 0.25
    turns: tuple[int, int] = (4, 6)
    rag_turns: tuple[int, int] = (1, 2)
    user_len: tuple[int, int] = (50, 300)
    rag_question_len: tuple[int, int] = (50, 150)
    output_len: tuple[int, int] = (32, 128)
    think_s: float = 3.0
    corpus_tokens: int = CORPUS_TOKENS

    def mean_turns(self) -> float:
        chat = sum(self.turns) / 2
        rag = sum(self.rag_turns) / 2
        return (1 - self.rag_fraction) * chat + self.rag_fraction * rag


Span = tuple[int, int]  # (start, length) of a window of the corpus


@dataclass
class Turn:
    user: Span
    answer: Span  # appended to the history after this turn
    max_tokens: int


@dataclass
class Session:
    sid: str
    start_s: float
    tenant: int
    turns: list[Turn]
    think_s: list[float]
    doc: int | None = None  # RAG: the document the first turn carries
    # what the simulation fills: the conversation so far and its block keys
    history: list[int] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)


class Corpus:
    """Synthetic token ids standing for the benchmark's text (deterministic)."""

    def __init__(self, size: int = CORPUS_TOKENS, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.ids: list[int] = rng.integers(0, VOCAB, size=size).tolist()

    def tokens(self, span: Span) -> list[int]:
        start, n = span
        return self.ids[start : start + n]


def _text(spec: SessionSpec, n: int, rng: random.Random) -> Span:
    """A window of ``n`` tokens: one ``randrange`` over the corpus."""
    return rng.randrange(0, spec.corpus_tokens - n - 1), n


class _Zipf:
    """Index ``i`` of ``n`` with weight ``1 / (i + 1) ** s``, the cumulative weights computed
    once (``random.choices`` makes the same single draw from ``weights`` or from their running
    sum, so the committed runs' draws, made with ``weights``, are unchanged)."""

    def __init__(self, n: int, s: float) -> None:
        total, self.cum = 0.0, []
        for i in range(n):
            total += 1 / (i + 1) ** s
            self.cum.append(total)
        self.population = range(n)

    def __call__(self, rng: random.Random) -> int:
        return rng.choices(self.population, cum_weights=self.cum)[0]


@dataclass
class Workload:
    spec: SessionSpec
    systems: list[Span]  # per tenant: its system prompt's text
    docs: list[Span]
    sessions: list[Session]


def build_sessions(spec: SessionSpec, tag: str = "") -> Workload:
    """The sessions of one run (``tag`` makes session ids unique across runs; the module
    docstring says what is drawn)."""
    fixed = random.Random(1234)  # tenants and documents are the same in every run
    systems = [_text(spec, spec.system_len, fixed) for _ in range(spec.tenants)]
    docs = [_text(spec, spec.doc_len, fixed) for _ in range(spec.num_docs)]
    rng = random.Random(spec.seed)
    docs_zipf, tenants_zipf = _Zipf(spec.num_docs, spec.zipf_s), _Zipf(spec.tenants, spec.zipf_s)
    session_rate = spec.rate / spec.mean_turns()
    sessions, t, i = [], 0.0, 0
    while True:
        t += rng.expovariate(session_rate)
        if t >= spec.duration_s:
            break
        rag = rng.random() < spec.rag_fraction
        lo, hi = spec.rag_turns if rag else spec.turns
        doc = docs_zipf(rng) if rag else None
        turns = []
        for _ in range(rng.randint(lo, hi)):
            q_lo, q_hi = spec.rag_question_len if rag else spec.user_len
            user = _text(spec, rng.randint(q_lo, q_hi), rng)
            out = rng.randint(*spec.output_len)
            turns.append(Turn(user, _text(spec, out, rng), out))
        tenant = tenants_zipf(rng)
        think = [rng.expovariate(1 / spec.think_s) for _ in turns]
        sessions.append(Session(f"{tag}-s{i}", t, tenant, turns, think, doc))
        i += 1
    return Workload(spec, systems, docs, sessions)


def tenant_line(tenant: int) -> list[int]:
    """``"You are the assistant of tenant {t}. ..."``: 24 tokens, 25 from two digits on,
    one of them the tenant's number (distinct ids per tenant)."""
    return [40, 41, 42, 43, 44, 45, 3000 + tenant % 1000, *range(46, 63 if tenant < 10 else 64)]


def system_message(workload: Workload, corpus: Corpus, tenant: int) -> list[int]:
    content = tenant_line(tenant) + corpus.tokens(workload.systems[tenant])
    return [*SYSTEM_HEADER, *content, *NEWLINE]


def user_message(workload: Workload, corpus: Corpus, session: Session, turn: int) -> list[int]:
    text = corpus.tokens(session.turns[turn].user)
    if session.doc is not None and turn == 0:
        text = [*DOCUMENT, *corpus.tokens(workload.docs[session.doc]), *QUESTION, *text]
    return [*USER_HEADER, *text, *NEWLINE]


def assistant_message(corpus: Corpus, session: Session, turn: int) -> list[int]:
    return [*ASSISTANT_HEADER, *corpus.tokens(session.turns[turn].answer), *NEWLINE]


def prompt(workload: Workload, corpus: Corpus, session: Session, turn: int) -> list[int]:
    """Turn ``turn``'s prompt: the history (system, earlier turns and answers), the user's
    message and the generation prompt; extends ``session.history`` to it."""
    if turn == 0:
        session.history = system_message(workload, corpus, session.tenant)
    else:
        session.history += assistant_message(corpus, session, turn - 1)
    session.history += user_message(workload, corpus, session, turn)
    return [*session.history, *ASSISTANT_HEADER]
