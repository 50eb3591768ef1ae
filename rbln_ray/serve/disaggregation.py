"""Prefill/decode disaggregation in the Serve app: two pools per model, one endpoint.

Why: on RBLN a prefill chunk and a decode batch never share a device call, so every prompt
chunk delays every running stream's next token on its device. A model with ``pd:
{prefill_replicas, decode_replicas}`` gets two deployments (:func:`pools`):

* ``LLMServer:<name>:prefill`` computes each prompt for one token, as vLLM's P/D proxies ask
  (``kv_transfer_params: {"do_remote_decode": true}``), and saves the prompt's KV to its
  node's host KV tier before it answers (:mod:`rbln_ray.vllm_plugin.host_kv_connector`,
  ``kv_role: kv_producer``);
* ``LLMServer:<name>``, the decode pool (the deployment a co-located model has,
  ``kv_role: kv_consumer``), then gets the client's request as it was sent, finds the
  prompt's blocks in the tier by their hashes, loads them instead of computing them, and
  streams the answer.

The client sees one OpenAI endpoint: the prefill hop is the ingress's (:func:`prefill_first`),
for ``/v1/completions`` and ``/v1/chat/completions``; every other route of the model goes to
the decode pool. Nothing is lost when the prefill side fails: a prefill that errors, is
refused (back-pressure), whose replica dies, or that does not answer within
``pd.prefill_timeout_s`` (a pool whose replicas are all restarting holds requests in Serve's
queue) only means the decode replica computes the prompt itself, as a co-located replica
would, with the same answer.

Across nodes, the decode replica first has the prompt's KV fetched from the prefill
replica's node into its own node's tier through Ray's object transfer
(:mod:`rbln_ray.serve.kv_handover`), by what the prefill's answer names
(``kv_transfer_params``, which the ingress forwards). Limits: a model's pools are
single-stage engines with paged KV (the host tier's own limits).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rbln_ray.serve.naming import server_deployment_name

if TYPE_CHECKING:
    from rbln_ray.serve.config import ModelDeploymentConfig
    from rbln_ray.serve.http_call import HTTPCall

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PrefillPool:
    """What the ingress holds of a model's prefill pool."""

    handle: Any  # its deployment handle
    timeout_s: float  # DisaggregationConfig.prefill_timeout_s


PD_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
# Request fields that shape only the output: the prefill call, whose one token is dropped,
# leaves them out (everything that shapes the prompt, e.g. a chat's tools, stays).
OUTPUT_ONLY = frozenset(
    {"stream", "stream_options", "n", "best_of", "use_beam_search", "min_tokens", "logprobs",
     "top_logprobs", "prompt_logprobs", "echo", "max_completion_tokens", "response_format",
     "structured_outputs", "kv_transfer_params"}
)  # fmt: skip


def prefill_deployment_name(model_name: str) -> str:
    """The prefill pool's deployment of a disaggregated model."""
    return f"{server_deployment_name(model_name)}:prefill"


def pools(cfg: ModelDeploymentConfig) -> tuple[ModelDeploymentConfig, ModelDeploymentConfig]:
    """(prefill, decode) deployment configs of a ``pd`` model: its own settings, each pool's
    replica count, and the host tier's connector in the pool's role (the tier's size and
    root as ``engine_kwargs.kv_transfer_config`` gives them)."""
    from rbln_ray.vllm_plugin.host_kv_connector import CONNECTOR

    assert cfg.pd is not None

    def pool(role: str, replicas: int) -> ModelDeploymentConfig:
        kv = dict(cfg.engine_kwargs.get("kv_transfer_config") or {"kv_connector": CONNECTOR})
        kv["kv_role"] = role
        engine = {**cfg.engine_kwargs, "kv_transfer_config": kv}
        update = {"pd": None, "num_replicas": replicas, "engine_kwargs": engine}
        return cfg.model_copy(update=update)

    return pool("kv_producer", cfg.pd.prefill_replicas), pool("kv_consumer", cfg.pd.decode_replicas)


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill pool's request for a client's: the same prompt, one token, and vLLM's ask
    to hand the KV over."""
    kept = {k: v for k, v in body.items() if k not in OUTPUT_ONLY}
    return kept | {"max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}


async def prefill_first(
    pool: PrefillPool, call: HTTPCall, body: dict[str, Any], model: str
) -> HTTPCall:
    """Have the prefill pool compute ``call``'s prompt into the host tier; return the decode
    pool's call once it has (carrying the prefill's ``kv_transfer_params``, as vLLM's P/D
    proxies forward them: where the KV is, for a decode replica on another node), or has
    failed or timed out (then the decode replica computes the prompt, module docstring).
    A client's own ``kv_transfer_params`` never reach the decode pool."""
    prefill = dataclasses.replace(call, body=json.dumps(prefill_body(body)).encode())
    stream = pool.handle.options(stream=True).http.remote(prefill)

    async def answer() -> tuple[int, bytes]:
        first = await stream.__anext__()
        rest = [chunk async for chunk in stream]  # the rest of its (one-token) answer
        return first.status, first.body + b"".join(rest)

    params = None
    try:
        status, text = await asyncio.wait_for(answer(), pool.timeout_s)
    except asyncio.CancelledError:  # the client left: so does its prefill
        stream.cancel()
        raise
    except Exception as exc:  # noqa: BLE001 - the decode replica computes the prompt instead
        stream.cancel()
        reason = "timed out" if isinstance(exc, TimeoutError) else type(exc).__name__
        logger.warning("model %s: prefill pool failed (%s: %s); decoding from the prompt",
                       model, reason, str(exc).split("\n", 1)[0])  # fmt: skip
    else:
        if status == 200:
            params = transfer_params(text)
        else:
            logger.info("model %s: prefill pool answered %d; decoding from the prompt",
                        model, status)  # fmt: skip
    decode = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if params is not None:
        decode["kv_transfer_params"] = params
    if decode == body:
        return call
    return dataclasses.replace(call, body=json.dumps(decode).encode())


def transfer_params(text: bytes) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of a JSON body (a prefill's non-streamed answer, or the
    decode pool's request), if it has them as an object."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return None
    params = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    return params if isinstance(params, dict) else None
