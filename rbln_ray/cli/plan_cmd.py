"""``rbln-ray plan``: how many RBLN cards, devices per worker and replicas a workload needs.

    rbln-ray plan --model llama-3-8b --input-len 1024 --output-len 256 --rate 10
    rbln-ray plan --device rebel --model llama-3-70b --input-len 1024 --output-len 256 --rate 10
    rbln-ray plan --params 8e9 --layers 32 --hidden 4096 --kv-bytes-per-token 131072 ...
    rbln-ray plan --model path/to/hf_dir ... --json
    rbln-ray plan --model llama-3-8b --weights int8 --kv-cache-dtype fp8 ...
    rbln-ray plan --model llama-3-8b --lora-adapters 4 --max-lora-rank 16 ...
    rbln-ray plan --model llama-3-8b --input-len 3000 --output-len 128 --rate 4 --host-gib 64
    rbln-ray plan --model llama-3-8b --input-len 2048 --output-len 80 --rate 12 --simulate
    rbln-ray plan --model llama-3-8b --input-len 3000 --output-len 200 --rate 1 --pd

Estimates come from the cost model of the chosen device (ATOM by default, or
REBEL; rbln_ray.npu.cost_model lists which figures are published and which are
assumptions); the hardware flags below override the device's figures.

--simulate then sizes the fleet by simulating it (rbln_ray/planning/fleet): the
plan's replicas (its shard group and compiled batch, 4,096-token sequences, the KV
blocks its memory leaves) serve multi-turn chat and RAG sessions (BENCHMARKS 15's
workload: shared system prompts and documents, not the fixed --input-len) at --rate
behind the real cache-aware router, and the fewest replicas whose requests meet the
SLO (--ttft-slo-ms, --tpot-slo-ms; default 2 s and 150 ms) for --slo-attainment of
them is the answer, with the ingress replicas that fleet needs.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from typing import Any

from rbln_ray.npu import kinds
from rbln_ray.npu.cost_model import PRESETS, SPECS, DeviceSpec, ModelShape, shape_from_spec
from rbln_ray.planning import Limits, Plan, Workload, compiled_shape, plan, shape_from_dims
from rbln_ray.planning import disaggregation as pd_advice
from rbln_ray.planning.host_tier import HostTierSizing, describe, size_host_tier


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model (a preset / config, or coarse numbers)")
    m.add_argument(
        "--model",
        help=f"preset ({', '.join(sorted(PRESETS))}), an HF model dir or config.json",
    )
    m.add_argument("--params", type=float, help="parameter count, e.g. 8e9")
    m.add_argument("--layers", type=int)
    m.add_argument("--hidden", type=int)
    m.add_argument("--kv-bytes-per-token", type=int, help="all layers, K and V, FP16")
    m.add_argument("--vocab", type=int, default=32000)
    v = p.add_argument_group(
        "how the model is compiled (default: as --model DIR says: its quantization_config, "
        "or a compiled dir's rbln_config.json; else FP16 with no adapters)"
    )
    v.add_argument("--weights", choices=("fp16", "int8", "fp8"), help="projection weights")
    v.add_argument("--kv-cache-dtype", choices=("fp16", "fp8"), help="KV cache elements")
    v.add_argument("--lora-adapters", type=int, help="LoRA adapters compiled in")
    v.add_argument("--max-lora-rank", type=int, default=16, help="their stacked rank")
    v.add_argument(
        "--lora-targets",
        default="q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        help="projections the adapters adapt (comma list)",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--input-len", type=int, required=True)
    w.add_argument("--output-len", type=int, required=True)
    w.add_argument("--rate", type=float, required=True, help="requests/s to sustain")
    w.add_argument("--max-seq-len", type=int, help="compiled length (default in + out)")
    w.add_argument("--utilization", type=float, default=0.8, help="target device busy fraction")
    w.add_argument("--tpot-slo-ms", type=float)
    w.add_argument("--ttft-slo-ms", type=float)
    w.add_argument("--host-ms-per-step", type=float, default=0.0)
    w.add_argument(
        "--host-gib", type=float, help="host KV tier per node (GiB): what it holds, and costs"
    )
    w.add_argument(
        "--pd", action="store_true", help="advise prefill and decode pools (Serve config `pd`)"
    )
    h = p.add_argument_group(
        "hardware model (default: the device's figures; see rbln_ray/npu/cost_model.py)"
    )
    h.add_argument(
        "--device",
        choices=sorted(SPECS),
        help=f"device kind to plan for (default: {kinds.KIND_ENV}, else atom)",
    )
    h.add_argument("--dram-gbps", type=float)
    h.add_argument("--peak-tflops", type=float)
    h.add_argument("--compute-eff", type=float)
    h.add_argument("--dram-eff", type=float)
    h.add_argument("--call-overhead-us", type=float)
    h.add_argument("--cards-per-node", type=int, default=Limits().cards_per_node)
    h.add_argument(
        "--batch-sizes", help="comma list of compiled batches to consider (default 1..128)"
    )
    s = p.add_argument_group(
        "simulation (--simulate: size the fleet by simulating chat and RAG sessions on the "
        "plan's replicas behind the real cache-aware router)"
    )
    s.add_argument("--simulate", action="store_true", help="size by simulation as well")
    s.add_argument(
        "--slo-attainment", type=float, default=0.9, help="share of requests within the SLO"
    )
    s.add_argument("--tenants", type=int, help="system prompts (default: 22 per req/s)")
    s.add_argument("--documents", type=int, help="RAG documents (default: 22 per req/s)")
    s.add_argument("--sim-duration", type=float, default=180.0, help="simulated seconds")
    s.add_argument("--sim-max-replicas", type=int, default=256, help="largest fleet to simulate")
    p.add_argument("--json", action="store_true", help="print the full plan as JSON")
    p.add_argument("--all", action="store_true", help="list every fitting option, not the best")


def device_spec(args: argparse.Namespace) -> DeviceSpec:
    """The chosen device's figures (env overrides applied), then any hardware flags."""
    spec = DeviceSpec.from_env(kind=args.device)
    flags = {
        "dram_bytes_per_s": (args.dram_gbps, 1e9),
        "peak_flops": (args.peak_tflops, 1e12),
        "compute_eff": (args.compute_eff, 1.0),
        "dram_eff": (args.dram_eff, 1.0),
        "call_overhead_s": (args.call_overhead_us, 1e-6),
    }
    given = {k: v * scale for k, (v, scale) in flags.items() if v is not None}
    return replace(spec, **given)


def with_flags(shape: ModelShape, args: argparse.Namespace) -> ModelShape:
    """``shape`` stored as the weights / KV / LoRA flags say (flags not given: unchanged)."""
    changes: dict = {}
    if args.weights is not None:
        changes["linear_weight_bytes"] = None if args.weights == "fp16" else 1.0
    if args.kv_cache_dtype is not None:
        changes["kv_bytes"] = 1 if args.kv_cache_dtype == "fp8" else 2
    if args.lora_adapters is not None:
        changes["lora_adapters"] = args.lora_adapters
        changes["lora_rank"] = args.max_lora_rank if args.lora_adapters else 0
        changes["lora_modules"] = tuple(t for t in args.lora_targets.split(",") if t)
    return replace(shape, **changes)


def _shape(args: argparse.Namespace) -> ModelShape:
    if args.model:
        return compiled_shape(shape_from_spec(args.model), args.model)
    if args.params and args.layers and args.hidden and args.kv_bytes_per_token:
        return shape_from_dims(
            args.params, args.layers, args.hidden, args.kv_bytes_per_token, args.vocab
        )
    raise SystemExit(
        "give --model PRESET|DIR, or --params, --layers, --hidden and --kv-bytes-per-token"
    )


def build(args: argparse.Namespace) -> Plan:
    shape = with_flags(_shape(args), args)
    spec = device_spec(args)
    limits = Limits(cards_per_node=args.cards_per_node)
    if args.batch_sizes:
        limits = replace(limits, batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")))
    work = Workload(
        input_len=args.input_len,
        output_len=args.output_len,
        rate=args.rate,
        max_seq_len=args.max_seq_len,
        utilization=args.utilization,
        tpot_slo_ms=args.tpot_slo_ms,
        ttft_slo_ms=args.ttft_slo_ms,
        host_ms_per_step=args.host_ms_per_step,
        prefill_chunk=kinds.kind_by_name(spec.name).prefill_chunk,
    )
    return plan(shape, work, spec, limits)


def storage(m: dict) -> str:
    """How a planned model's weights are stored, for the plan's first line."""
    lwb = m.get("linear_weight_bytes")
    text = "FP16" if lwb is None else f"{'8-bit' if lwb == 1 else f'{lwb * 8:g}-bit'} projections"
    if m.get("lora_adapters"):
        text += f", {m['lora_adapters']} LoRA adapters of rank {m['lora_rank']}"
    return text


def render(result: Plan, show_all: bool = False) -> str:
    m, w = result.model, result.workload
    device = result.spec.get("name", "ATOM")
    lines = [
        f"model {m['name']}: {m['params'] / 1e9:.2f} B params, {m['num_layers']} layers, "
        f"hidden {m['hidden_size']}, weights {m['weight_bytes_total'] / 2**30:.1f} GiB "
        f"({storage(m)}), KV {m['kv_bytes_per_token'] / 1024:.0f} KiB/token "
        f"({'FP8' if m['kv_bytes'] == 1 else 'FP16'})",
        f"workload: {w['input_len']} in / {w['output_len']} out tokens, {w['rate']:g} req/s, "
        f"max_seq_len {w['max_seq_len']}, target utilization {w['utilization']:.0%}",
        f"{device} model: {result.spec['peak_flops'] / 1e12:g} TFLOPS x "
        f"{result.spec['compute_eff']}, {result.spec['dram_bytes_per_s'] / 1e9:g} GB/s x "
        f"{result.spec['dram_eff']}, {result.spec['call_overhead_s'] * 1e6:g} us/call, "
        f"{result.spec['dram_capacity'] / 2**30:.1f} GiB usable (rbln_ray/npu/cost_model.py "
        "says which figures are published and which assumed)",
        "",
    ]
    header = (
        f"{'dev/worker':>10} {'batch':>5} {'GiB w/dev':>9} {'GiB kv/dev':>10} {'prefill ms':>10} "
        f"{'step ms':>8} {'TPOT ms':>8} {'req/s/rep':>9} {'tok/s/rep':>9} {'replicas':>8} "
        f"{'cards':>6} {'nodes':>5}"
    )
    rows = [o for o in result.options if o.fits]
    if not show_all:  # best batch per shard size
        best: dict[int, object] = {}
        for o in rows:
            if not o.meets_slo:
                continue
            cur = best.get(o.devices_per_worker)
            if cur is None or (o.cards, o.tpot_ms) < (cur.cards, cur.tpot_ms):
                best[o.devices_per_worker] = o
        rows = list(best.values())
    lines.append(header)
    for o in rows:
        mark = " <- plan" if o is result.chosen else ""
        lines.append(
            f"{o.devices_per_worker:>10} {o.batch:>5} {o.weights_per_device_gib:>9.2f} "
            f"{o.kv_per_device_gib:>10.2f} {o.prefill_ms:>10.1f} {o.decode_step_ms:>8.2f} "
            f"{o.tpot_ms:>8.2f} {o.replica_req_s:>9.2f} {o.replica_tok_s:>9.0f} "
            f"{o.replicas:>8} {o.cards:>6} {o.nodes:>5}{mark}"
            + (f"  ({'; '.join(o.notes)})" if o.notes else "")
        )
    lines.append("")
    c = result.chosen
    if c is None:
        lines.append(f"no plan: {result.bounds.get('plan')}")
    else:
        lines.append(
            f"PLAN: {c.cards} {device} card(s) on {c.nodes} node(s) = {c.replicas} replica(s) x "
            f"{c.devices_per_worker} device(s) per worker, compiled batch {c.batch}; "
            f"~{c.replica_tok_s * c.replicas:.0f} output tok/s capacity, TTFT >= {c.ttft_ms:.0f} "
            f"ms, TPOT ~{c.tpot_ms:.1f} ms"
        )
        for key, why in result.bounds.items():
            lines.append(f"  bound by {key}: {why}")
    return "\n".join(lines)


SIM_SEQ_LEN = 4096  # the session workload's prompts reach ~3,800 tokens


def simulation_replica(result: Plan, args: argparse.Namespace) -> Any:
    """The plan's replica as the fleet simulation models it (a ``ReplicaConfig``), or why
    it cannot be (a string)."""
    from rbln_ray.planning.fleet.replica import ReplicaConfig

    chosen = result.chosen
    if chosen is None:
        return "no plan to simulate"
    shape = with_flags(_shape(args), args)
    spec = device_spec(args)
    n, batch = chosen.devices_per_worker, chosen.batch
    kv_bytes = (chosen.kv_per_device_gib + chosen.free_per_device_gib) * 2**30 * n
    blocks = int(kv_bytes // (SIM_SEQ_LEN * shape.kv_bytes_per_token))
    if blocks <= batch:
        return (
            f"the plan's memory holds {blocks} sequences of {SIM_SEQ_LEN} tokens; the "
            f"simulated sessions need more than its batch of {batch} (one per slot, plus cache)"
        )
    return ReplicaConfig(
        shape=shape,
        spec=spec,
        batch=batch,
        devices=n,
        decode_sizes=tuple(sorted({batch, *(b for b in (1, 2, 4) if b < batch)})),
        max_seq_len=SIM_SEQ_LEN,
        kv_blocks=blocks,
        kv_block_tokens=SIM_SEQ_LEN,
        chunk=kinds.kind_by_name(spec.name).prefill_chunk,
        max_ongoing=2 * batch,
        host_s_per_step=(args.host_ms_per_step or 0.5) / 1e3,
    )


def simulate(result: Plan, args: argparse.Namespace) -> dict:
    """``--simulate``: the fewest replicas that meet the SLO in simulation (module doc)."""
    import sys

    from rbln_ray.planning.fleet.ingress import DEFAULT_MODE, THROUGHPUT_MODE, replicas_needed
    from rbln_ray.planning.fleet.sizing import SizingTarget, size_fleet
    from rbln_ray.serve.fleet_router import SimulatedRouter, block_keys

    replica = simulation_replica(result, args)
    if isinstance(replica, str):
        return {"replicas": None, "reason": replica}
    target = SizingTarget(
        rate=args.rate,
        ttft_slo_s=(args.ttft_slo_ms or 2000.0) / 1e3,
        tpot_slo_s=(args.tpot_slo_ms or 150.0) / 1e3,
        attainment=args.slo_attainment,
        tenants=args.tenants,
        documents=args.documents,
        duration_s=args.sim_duration,
        warmup_s=args.sim_duration / 3,
        max_replicas=args.sim_max_replicas,
    )

    def routers(n: int, clock) -> list:
        return [SimulatedRouter(n, clock, batch_size=replica.batch,
                                max_ongoing=replica.max_ongoing)]  # fmt: skip

    def progress(res: dict) -> None:
        print(
            f"  simulated {res['replicas']} replica(s): {res['slo_attainment'] or 0:.0%} within "
            f"the SLO, hit rate {res['hit_rate'] or 0:.0%}",
            file=sys.stderr,
            flush=True,
        )

    first = result.chosen.replicas if result.chosen else 1
    sizing = size_fleet(target, replica, routers, block_keys(replica.chunk), first, progress)
    out: dict = {
        "replicas": sizing.replicas,
        "cards": sizing.replicas * replica.devices if sizing.replicas else None,
        "reason": sizing.reason,
        "workload": {**vars(target.spec()), "slo_attainment": target.attainment,
                     "ttft_slo_s": target.ttft_slo_s, "tpot_slo_s": target.tpot_slo_s},
        "replica": {"devices": replica.devices, "batch": replica.batch,
                    "kv_blocks": replica.kv_blocks, "max_seq_len": replica.max_seq_len},
        "tried": [{k: v for k, v in r.items() if k in TRIED_KEYS} for r in sizing.tried],
    }  # fmt: skip
    found = [r for r in sizing.tried if r["replicas"] == sizing.replicas]
    if found:
        r = found[0]
        per_request = r.get("router_cpu_s_per_request", 0.0)
        out["ingress_replicas"] = {
            mode: replicas_needed(r["output_tok_per_s"], r["req_per_s"], per_request, 0, 0, c)
            for mode, c in (("default", DEFAULT_MODE), ("throughput_optimized", THROUGHPUT_MODE))
        }
    return out


TRIED_KEYS = ("replicas", "met", "slo_attainment", "goodput_req_per_s", "hit_rate", "ttft_ms",
              "tpot_ms", "req_per_s", "output_tok_per_s", "decision_cpu_us_p99")  # fmt: skip


def render_simulation(sim: dict) -> str:
    if sim.get("replicas") is None and "tried" not in sim:
        return f"SIMULATION: not run: {sim['reason']}"
    w = sim["workload"]
    lines = [
        "",
        f"SIMULATED (rbln_ray/planning/fleet, the real cache-aware router): chat and RAG "
        f"sessions at {w['rate']:g} req/s ({w['tenants']} tenants, {w['num_docs']} documents), "
        f"{sim['replica']['kv_blocks']} KV blocks of {sim['replica']['max_seq_len']} tokens "
        f"per replica; SLO TTFT <= {w['ttft_slo_s']:g} s and TPOT <= "
        f"{w['tpot_slo_s'] * 1e3:g} ms for {w['slo_attainment']:.0%} of requests",
        f"{'replicas':>8} {'in SLO':>7} {'goodput':>8} {'hit rate':>8} {'TTFT p50/p99 ms':>16}",
    ]
    for r in sim["tried"]:
        ttft = r["ttft_ms"]
        lines.append(
            f"{r['replicas']:>8} {r['slo_attainment'] or 0:>7.0%} "
            f"{r['goodput_req_per_s']:>8.2f} {r['hit_rate'] or 0:>8.0%} "
            f"{ttft['p50'] or 0:>7.0f}/{ttft['p99'] or 0:<8.0f}"
        )
    if sim["replicas"] is None:
        lines.append(f"SIMULATED PLAN: none: {sim['reason']}")
    else:
        ingress = sim.get("ingress_replicas", {})
        lines.append(
            f"SIMULATED PLAN: {sim['replicas']} replica(s) = {sim['cards']} card(s); ingress "
            f"replicas: {ingress.get('default')} (Serve's default mode), "
            f"{ingress.get('throughput_optimized')} (throughput-optimized mode)"
        )
    return "\n".join(lines)


def host_tier(result: Plan, args: argparse.Namespace) -> HostTierSizing | None:
    """``--host-gib``: the node tier's sizing for the chosen option."""
    chosen = result.chosen
    if args.host_gib is None or chosen is None:
        return None
    per_node = min(chosen.cards, args.cards_per_node)
    return size_host_tier(
        with_flags(_shape(args), args),
        device_spec(args),
        args.host_gib,
        args.input_len,
        chosen.prefill_ms,
        chosen.kv_per_device_gib,
        per_node,
    )


def disaggregation(result: Plan, args: argparse.Namespace) -> pd_advice.DisaggregationAdvice | None:
    """``--pd``: prefill and decode pools of the chosen option's replicas."""
    chosen = result.chosen
    if not args.pd or chosen is None:
        return None
    spec = device_spec(args)
    return pd_advice.advise(
        with_flags(_shape(args), args), args.input_len, args.output_len, args.rate,
        args.utilization, chosen.devices_per_worker, chosen.batch, chosen.prefill_ms / 1e3,
        chosen.decode_step_ms / 1e3, kinds.kind_by_name(spec.name).prefill_chunk, spec,
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    result = build(args)
    sim = simulate(result, args) if args.simulate else None
    tier = host_tier(result, args)
    pd = disaggregation(result, args)
    if args.json:
        extra = {"simulation": sim} if sim else {}
        if tier is not None:
            extra["host_tier"] = tier.to_dict()
        if pd is not None:
            extra["disaggregation"] = asdict(pd)
        print(json.dumps({**result.to_dict(), **extra}, indent=2))
    else:
        print(render(result, show_all=args.all))
        if tier is not None:
            print(describe(tier))
        if pd is not None and result.chosen is not None:
            print(pd_advice.describe(pd, result.chosen.cards, result.chosen.tpot_ms))
        if sim is not None:
            print(render_simulation(sim))
    if sim is not None and sim.get("replicas") is None:
        return 1
    return 0 if result.chosen is not None else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rbln-ray plan", description=__doc__.splitlines()[0])
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
