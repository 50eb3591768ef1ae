"""``rbln-ray plan``'s prefill/decode disaggregation advice (the Serve app's ``pd``): how many
prefill and decode replicas a workload needs, from the cost model the plan itself uses.

Why per pool. Co-located, a replica's device time per request is its prompt's prefill plus
its share of a decode batch, and every prefill it runs stalls the tokens of the requests it
is decoding (the plan's TPOT spreads the batch's prefills over the decode steps). Split, the
two kinds of time land on different replicas:

* a prefill replica spends, per request, the prompt's prefill and the export of its KV to
  the node's host tier (device to host over the host link,
  :func:`~rbln_ray.npu.cost_model.host_transfer_cost`);
* a decode replica spends its share of a decode batch (``step(B) / B`` per token, for
  ``output_len - 1`` tokens), the load of the prompt's KV from the tier, and the prefill of
  the prompt's last chunk (the handover moves whole vLLM blocks; the engine computes at least
  the last prompt token itself).

Each pool gets ``ceil(rate x seconds per request / utilization)`` replicas of the plan's shard
group and batch. Decode replicas' TPOT is one decode step: nothing else runs on their
devices. Queueing is not modelled here (as in the plan): the TTFT of either layout under load
is what ``benchmarks/pd_disagg.py`` measures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from rbln_ray.npu.cost_model import DeviceSpec, ModelShape, Row, call_cost, host_transfer_cost


@dataclass(frozen=True)
class DisaggregationAdvice:
    prefill_replicas: int
    decode_replicas: int
    cards: int  # both pools
    prefill_s_per_request: float  # a prefill replica's device time per request
    decode_s_per_request: float  # a decode replica's
    tpot_ms: float  # on decode replicas: one decode step

    def split_of(self, devices: int) -> tuple[int, int]:
        """The P:D split of ``devices`` replicas in the pools' proportion (each pool >= 1)."""
        share = self.prefill_s_per_request / (
            self.prefill_s_per_request + self.decode_s_per_request
        )
        prefill = min(devices - 1, max(1, round(devices * share)))
        return prefill, devices - prefill


def advise(
    shape: ModelShape,
    input_len: int,
    output_len: int,
    rate: float,
    utilization: float,
    devices_per_worker: int,
    batch: int,
    prefill_s: float,
    decode_step_s: float,
    chunk: int,
    spec: DeviceSpec,
) -> DisaggregationAdvice:
    """The pools for a workload served by replicas of ``devices_per_worker`` devices and
    compiled ``batch`` whose prompt prefill takes ``prefill_s`` and decode step
    ``decode_step_s`` (the plan's chosen option's figures)."""
    handover = host_transfer_cost(shape, input_len, spec) / devices_per_worker
    tail = call_cost(shape, [Row(chunk, input_len)], 1, spec, devices_per_worker).seconds
    prefill = prefill_s + handover
    decode = max(0, output_len - 1) * decode_step_s / batch + handover + tail
    pools = [max(1, math.ceil(rate * seconds / utilization)) for seconds in (prefill, decode)]
    return DisaggregationAdvice(
        prefill_replicas=pools[0],
        decode_replicas=pools[1],
        cards=sum(pools) * devices_per_worker,
        prefill_s_per_request=prefill,
        decode_s_per_request=decode,
        tpot_ms=decode_step_s * 1e3,
    )


def describe(advice: DisaggregationAdvice, colocated_cards: int, colocated_tpot_ms: float) -> str:
    return (
        f"prefill/decode disaggregation (Serve config `pd`): {advice.prefill_replicas} prefill "
        f"+ {advice.decode_replicas} decode replica(s) = {advice.cards} card(s) (co-located: "
        f"{colocated_cards}); TPOT ~{advice.tpot_ms:.1f} ms on decode replicas (co-located "
        f"~{colocated_tpot_ms:.1f} ms); per request {advice.prefill_s_per_request:.2f} s of a "
        f"prefill replica, {advice.decode_s_per_request:.2f} s of a decode replica"
    )
