"""The tiny tool-calling model of tests and the API compatibility checker.

A tiny Qwen2 whose tokenizer also knows ``<think>``, ``</think>``, ``<tool_call>`` and
``</tool_call>`` as single tokens (reasoning parsers such as ``deepseek_r1`` look their ids
up; non-special, so a response's text keeps them), served with :data:`HERMES_TEMPLATE`
(a Hermes-style tool-calling chat template written for the tiny models' format) and vLLM's
``hermes`` tool parser. Its weights are random: what it writes is chosen per request by the
scripted logits processor (:mod:`rbln_ray.models.scripted`).
"""

from __future__ import annotations

from pathlib import Path

TOOL_TOKENS = ("<think>", "</think>", "<tool_call>", "</tool_call>")
HERMES_TEMPLATE = Path(__file__).parent / "templates" / "hermes_tools.jinja"


def build_tool_model() -> Path:
    """The tool-calling tiny model's HF directory (built once, cached)."""
    from rbln_ray.models.builder import build_tiny_model

    return build_tiny_model(family="qwen2", added_tokens=TOOL_TOKENS)
