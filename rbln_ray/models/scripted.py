"""A logits processor that makes any model emit a given token sequence (tests, the API
compatibility checker).

Why: the tiny test models have random weights; no prompt makes one write
``<tool_call>{"name": ...}</tool_call>`` or ``...</think>answer``, yet tool-call and reasoning
parsers only run on what a model writes. A request names its tokens in
``vllm_xargs={"rbln_script": [id, id, ...]}`` (chat, completion, Responses and Anthropic
requests all carry ``vllm_xargs`` into ``SamplingParams.extra_args``): generation step ``k``
can only sample ``script[k]``; after the script the model is free again (end a script with
the EOS id to stop there). Requests without a script are untouched.

Load it as any vLLM logits processor, in rbln-ray (``engine_kwargs: {logits_processors:
[rbln_ray.models.scripted:ScriptedOutput]}``) and in plain vLLM alike
(``--logits-processors rbln_ray.models.scripted:ScriptedOutput``), so both run the same
script through their own samplers.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

KEY = "rbln_script"
QUALNAME = "rbln_ray.models.scripted:ScriptedOutput"


def script_of(params: Any) -> list[int] | None:
    """The request's script (``vllm_xargs.rbln_script``), or None."""
    return (getattr(params, "extra_args", None) or {}).get(KEY)


class ScriptedOutput(AdapterLogitsProcessor):
    """Step ``k`` of a request with a script may only sample ``script[k]``."""

    @classmethod
    def validate_params(cls, sampling_params: Any) -> None:
        script = script_of(sampling_params)
        if script is None:
            return
        if not (
            isinstance(script, list)
            and script
            and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in script)
        ):
            raise ValueError(f"vllm_xargs.{KEY} must be a non-empty list of token ids")

    def is_argmax_invariant(self) -> bool:
        return False  # it changes greedy results too

    def new_req_logits_processor(self, params: Any):
        script = script_of(params)
        if not script:
            return None

        def force(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            # output_ids is the request's live list of sampled tokens (vLLM appends to it,
            # and so does rbln-ray's runner): its length is this step's index.
            step = len(output_ids)
            if step >= len(script) or script[step] >= logits.shape[-1]:
                return logits
            forced = torch.full_like(logits, float("-inf"))
            forced[script[step]] = 0.0
            return forced

        return force
