"""Capacity planning: RBLN cards (ATOM or REBEL), shard groups and replicas for a model and
a request rate.

Uses the emulator's timing model (:mod:`rbln_ray.emulator.timing`) so a plan and a
timing-mode benchmark agree by construction. The serving model is rbln-ray's: one prefill per
step, never mixed with decode, decode steps over a static compiled batch.

For each shard-group size N (devices per worker: tensor parallel inside a node) and compiled
batch B that fit one device's DRAM (weights/N + KV(B x max_seq_len)/N + a program/activation
reserve <= the device's usable DRAM: ATOM 16 GiB - 288 MiB, REBEL 140 GiB; the spec's
``dram_capacity``), one replica saturated with requests of ``input_len`` prompt and
``output_len`` generated tokens serves::

    R(N, B) = B / (B x T_prefill(input_len) + (output_len - 1) x T_decode(B, mean context))

requests/s. Replicas = ceil(rate / (R x utilization)); cards = replicas x N. The plan with the
fewest cards wins (ties: the lower TPOT). Latency SLOs, when given, drop the (N, B) that miss.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from rbln_ray.npu.cost_model import (
    DeviceSpec,
    ModelShape,
    Row,
    call_cost,
    decode_cost,
    prefill_cost,
)

GiB = 2**30
MiB = 2**20


@dataclass(frozen=True)
class Workload:
    input_len: int
    output_len: int
    rate: float  # requests per second to sustain
    max_seq_len: int | None = None  # default input_len + output_len
    utilization: float = 0.8  # plan devices to be busy at most this fraction of the time
    tpot_slo_ms: float | None = None
    ttft_slo_ms: float | None = None
    prefill_chunk: int = 128
    host_ms_per_step: float = 0.0  # host overhead added to every device step

    @property
    def seq_len(self) -> int:
        return self.max_seq_len or self.input_len + self.output_len


@dataclass(frozen=True)
class Limits:
    shard_sizes: tuple[int, ...] = (1, 2, 4, 8, 16)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
    cards_per_node: int = 8
    reserve_bytes: int = 512 * MiB  # program + activations per device (assumption)


@dataclass
class Option:
    devices_per_worker: int
    batch: int
    fits: bool
    weights_per_device_gib: float
    kv_per_device_gib: float
    free_per_device_gib: float
    prefill_ms: float = 0.0
    decode_step_ms: float = 0.0
    ttft_ms: float = 0.0
    tpot_ms: float = 0.0
    replica_req_s: float = 0.0
    replica_tok_s: float = 0.0
    replicas: int = 0
    cards: int = 0
    nodes: int = 0
    prefill_bound: str = ""
    decode_bound: str = ""
    device_time_share_prefill: float = 0.0
    meets_slo: bool = True
    notes: list[str] = field(default_factory=list)


@dataclass
class Plan:
    model: dict[str, Any]
    workload: dict[str, Any]
    spec: dict[str, Any]
    limits: dict[str, Any]
    chosen: Option | None
    bounds: dict[str, str]
    options: list[Option]

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "workload": self.workload,
            "spec": self.spec,
            "limits": self.limits,
            "chosen": asdict(self.chosen) if self.chosen else None,
            "bounds": self.bounds,
            "options": [asdict(o) for o in self.options],
        }


def memory_per_device(
    shape: ModelShape,
    n: int,
    batch: int,
    seq_len: int,
    limits: Limits,
    spec: DeviceSpec | None = None,
):
    weights = shape.weight_bytes_total / n
    kv = batch * seq_len * shape.kv_bytes_per_token / n
    free = (spec or DeviceSpec()).dram_capacity - limits.reserve_bytes - weights - kv
    return weights, kv, free


def evaluate(
    shape: ModelShape,
    work: Workload,
    n: int,
    batch: int,
    spec: DeviceSpec,
    limits: Limits,
) -> Option:
    weights, kv, free = memory_per_device(shape, n, batch, work.seq_len, limits, spec)
    opt = Option(
        devices_per_worker=n,
        batch=batch,
        fits=free >= 0,
        weights_per_device_gib=weights / GiB,
        kv_per_device_gib=kv / GiB,
        free_per_device_gib=free / GiB,
    )
    if not opt.fits:
        return opt
    host = work.host_ms_per_step / 1e3
    chunks = max(1, math.ceil(work.input_len / work.prefill_chunk))
    t_pre = prefill_cost(shape, work.input_len, work.prefill_chunk, spec, n) + host * chunks
    context = work.input_len + work.output_len // 2
    dec = decode_cost(shape, batch, context, spec, n)
    t_dec = dec.seconds + host
    steps = max(0, work.output_len - 1)
    cycle = batch * t_pre + steps * t_dec
    opt.prefill_ms = t_pre * 1e3
    opt.decode_step_ms = t_dec * 1e3
    opt.ttft_ms = t_pre * 1e3  # device-only lower bound: no queueing
    opt.tpot_ms = (t_dec + (batch * t_pre / steps if steps else 0.0)) * 1e3
    opt.replica_req_s = batch / cycle
    opt.replica_tok_s = opt.replica_req_s * work.output_len
    opt.replicas = max(1, math.ceil(work.rate / (opt.replica_req_s * work.utilization)))
    opt.cards = opt.replicas * n
    opt.nodes = math.ceil(opt.cards / limits.cards_per_node)
    chunk_cost = call_cost(shape, [Row(work.prefill_chunk, 0)], 1, spec, n)
    opt.prefill_bound = chunk_cost.bound
    opt.decode_bound = dec.bound
    opt.device_time_share_prefill = batch * t_pre / cycle
    if work.tpot_slo_ms is not None and opt.tpot_ms > work.tpot_slo_ms:
        opt.meets_slo = False
        opt.notes.append(f"TPOT {opt.tpot_ms:.1f} ms > SLO {work.tpot_slo_ms} ms")
    if work.ttft_slo_ms is not None and opt.ttft_ms > work.ttft_slo_ms:
        opt.meets_slo = False
        opt.notes.append(f"TTFT {opt.ttft_ms:.1f} ms > SLO {work.ttft_slo_ms} ms")
    if n > limits.cards_per_node:
        opt.meets_slo = False
        opt.notes.append(f"shard group of {n} exceeds {limits.cards_per_node} cards per node")
    if shape.num_kv_heads % n and shape.num_heads % n:
        opt.meets_slo = False
        opt.notes.append(f"{shape.num_heads} heads do not split over {n} devices")
    return opt


def plan(
    shape: ModelShape,
    work: Workload,
    spec: DeviceSpec | None = None,
    limits: Limits | None = None,
) -> Plan:
    spec = spec or DeviceSpec()
    limits = limits or Limits()
    options = [
        evaluate(shape, work, n, b, spec, limits)
        for n in limits.shard_sizes
        for b in limits.batch_sizes
    ]
    usable = [o for o in options if o.fits and o.meets_slo]
    chosen = min(usable, key=lambda o: (o.cards, o.tpot_ms, o.devices_per_worker), default=None)
    return Plan(
        model=shape.as_dict(),
        workload={**asdict(work), "max_seq_len": work.seq_len},
        spec=spec.as_dict(),
        limits=asdict(limits),
        chosen=chosen,
        bounds=explain(shape, work, chosen, options, limits, spec),
        options=options,
    )


def explain(
    shape: ModelShape,
    work: Workload,
    chosen: Option | None,
    options: list[Option],
    limits: Limits,
    spec: DeviceSpec | None = None,
) -> dict[str, str]:
    """Plain words for what limits each choice."""
    if chosen is None:
        fitting = [o for o in options if o.fits]
        if not fitting:
            return {
                "plan": "memory: no shard group size up to "
                f"{max(limits.shard_sizes)} devices fits the weights and one sequence's KV"
            }
        reasons = sorted(
            {re.sub(r"^(TPOT|TTFT) [\d.]+ ms", r"\1", n) for o in fitting for n in o.notes}
        )
        return {"plan": "every configuration that fits memory is rejected: " + "; ".join(reasons)}
    n, b = chosen.devices_per_worker, chosen.batch
    budget = ((spec or DeviceSpec()).dram_capacity - limits.reserve_bytes) / GiB
    min_n = min((o.devices_per_worker for o in options if o.fits), default=n)
    if n == min_n and n > 1:
        shard = (
            f"memory: weights {shape.weight_bytes_total / GiB:.1f} GiB (+KV) exceed one device's "
            f"{budget:.1f} GiB usable, so the smallest shard group is {n} devices"
        )
    elif n == min_n:
        shard = f"memory allows 1 device per worker ({chosen.weights_per_device_gib:.1f} GiB)"
    else:
        shard = (
            f"throughput/latency: {n} devices per worker need fewer cards (or meet the SLO) "
            f"than the {min_n} that memory alone requires"
        )
    larger = [o for o in options if o.devices_per_worker == n and o.batch > b]
    if not larger:
        batch = f"candidate limit: {b} is the largest batch considered"
    elif not any(o.fits for o in larger):
        batch = (
            f"memory: batch {larger[0].batch} would not fit the KV cache ({work.seq_len} tokens)"
        )
    elif not any(o.fits and o.meets_slo for o in larger):
        batch = "latency SLO: larger batches miss the TPOT/TTFT target"
    else:
        batch = "fewest cards (larger batches fit but do not reduce the card count)"
    share = chosen.device_time_share_prefill
    if share >= 0.5:
        device = f"prefill ({share:.0%} of device time), {chosen.prefill_bound}-bound"
    else:
        device = f"decode ({1 - share:.0%} of device time), {chosen.decode_bound}-bound"
    return {
        "devices_per_worker": shard,
        "batch": batch,
        "replica_throughput": device,
        "replicas": (
            f"request rate: {work.rate:g} req/s at {work.utilization:.0%} target utilization / "
            f"{chosen.replica_req_s:.2f} req/s per replica"
        ),
    }


def shape_from_dims(
    params: float,
    num_layers: int,
    hidden_size: int,
    kv_bytes_per_token: int,
    vocab_size: int = 32000,
    head_dim: int = 128,
    name: str = "custom",
) -> ModelShape:
    """A Llama-like shape from coarse numbers (parameter count, layers, hidden, KV/token)."""
    heads = max(1, hidden_size // head_dim)
    kv_heads = max(1, round(kv_bytes_per_token / (2 * num_layers * head_dim * 2)))
    body = params - 2 * vocab_size * hidden_size
    per_layer = body / num_layers
    attention = 2 * hidden_size * heads * head_dim + 2 * hidden_size * kv_heads * head_dim
    intermediate = max(1, round((per_layer - attention) / (3 * hidden_size)))
    return ModelShape(
        num_layers=num_layers,
        hidden_size=hidden_size,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate,
        vocab_size=vocab_size,
        name=name,
    )


def compiled_shape(shape: ModelShape, model: str) -> ModelShape:
    """``shape`` as the model ``model`` names is stored: a compiled directory's
    ``rbln_config.json`` (quantization, LoRA adapters), or an HF directory's pre-quantized
    ``quantization_config`` (what ``rbln-ray compile`` would make of it); a preset as is."""
    from pathlib import Path

    from rbln_ray.compile.quantization import spec_from_hf_config

    directory = Path(model)
    if directory.is_file():
        directory = directory.parent
    if (directory / "rbln_config.json").is_file():
        return shape.with_rbln_config(json.loads((directory / "rbln_config.json").read_text()))
    if (directory / "config.json").is_file():
        spec = spec_from_hf_config(json.loads((directory / "config.json").read_text()))
        if spec is not None:
            return shape.with_rbln_config({"quantization": spec.as_optimum()})
    return shape
