"""Host overhead per decode step at batch 1/4/8, and slot occupancy under saturation.

rbln-ray's ``vllm.LLM`` in emulator timing mode (device calls sleep the modelled ATOM
latency, so the host's own work is what the CPU does). Host overhead per decode step =
step period (start of one decode call to the next) minus time inside the ``rebel.Runtime``
call: scheduler, input prep in the runner and optimum, sampling, output processing, IPC.

Three runs: the compiled demo graph's own shape (tiny: device time ~0.2 ms); ``--shape``
(default llama-3-8b: the device time of a real 8B model on ATOM, ~74 ms per decode step),
against which the goal "host overhead <= 2 % of device time" is judged, with vLLM's
in-process worker; and ``--shape`` again with the worker in a Ray actor (RBLNRayExecutor, as
in a Serve replica), where steps reach the worker's step loop on a stream and its host work
overlaps the device. Before each run a wake-up probe times a fixed piece of host work warm
and right after 74 ms idle (``common.wake_probe``): what this machine charges the first host
work after every modelled device call. Occupancy: many
requests with jittered output lengths; live decode rows / compiled batch over the decode
steps taken while requests wait for a slot (the drain tail is reported apart).

    python -m benchmarks.host_overhead [--quick]
"""

from __future__ import annotations

import argparse

from benchmarks import common

GOAL_HOST_RATIO = 0.02  # vLLM's in-process worker
GOAL_HOST_RATIO_RAY = 0.01  # the worker in a Ray actor (the Serve replica's path)
GOAL_ENGINE_CPU = 0.20  # engine-core CPU time / wall time while the device works
GOAL_OCCUPANCY = 0.90


def occupancy(phase: dict, batch: int) -> dict:
    """Decode-row occupancy of a saturation phase, from the runner's step history.

    "Under saturation" means while requests are still waiting for a slot: decode steps up to
    the last admission (the phase's last prefill). After it the batch drains as requests
    finish and nothing replaces them, which is the end of a finite run, not a batching loss;
    that tail is reported separately, as is the whole phase.
    """
    rb = phase["rbln"]
    after, before = rb["step_stats"], rb["step_stats_before"]
    first = before["prefill_steps"] + before["decode_steps"]
    history = after["history"]
    if history and history[0][0] > first + 1:
        raise ValueError(
            f"step history starts at step {history[0][0]}, after the phase's first step "
            f"{first + 1}: the phase is longer than the runner keeps; shorten it"
        )
    steps = [(kind, len(ids)) for idx, kind, ids in history if idx > first]
    last_admission = max(i for i, (kind, _) in enumerate(steps) if kind == "prefill")
    saturated, tail = steps[:last_admission], steps[last_admission:]

    def decode_rows(window: list[tuple[str, int]]) -> list[int]:
        return [n for kind, n in window if kind == "decode"]

    def rows_ratio(window: list[tuple[str, int]]) -> float | None:
        rows = decode_rows(window)
        return sum(rows) / (len(rows) * batch) if rows else None

    calls = rb["calls"]["calls"]
    start, end = rb["window"]
    busy = sum(c["end"] - c["start"] for c in calls if start <= c["start"] <= end)
    decode_calls = [c for c in calls if c["kind"] == "decode"]
    return {
        "decode_steps": len(decode_rows(steps)),
        "prefill_steps": len(steps) - len(decode_rows(steps)),
        "row_occupancy": rows_ratio(saturated),
        "saturated_decode_steps": len(decode_rows(saturated)),
        "row_occupancy_drain_tail": rows_ratio(tail),
        "row_occupancy_whole_phase": rows_ratio(steps),
        "device_busy_fraction": busy / (end - start),
        "decode_calls_by_graph_batch": {
            str(b): sum(1 for c in decode_calls if c["batch"] == b)
            for b in sorted({c["batch"] for c in decode_calls})
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--shape", default="llama-3-8b", help="timing preset for the goal check")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--saturation-factor", type=int, default=6, help="requests = factor x batch")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.quick:
        args.output_len, args.saturation_factor = 24, 3
    top = max(batches)
    _, compiled = common.compiled_demo(top)
    phases = [{"num_prompts": b, "output_len": args.output_len} for b in batches]
    phases.append(
        {"num_prompts": top * args.saturation_factor, "output_len": args.output_len, "jitter": 0.5}
    )
    results = {}
    ray_label = f"{args.shape}, Ray executor"
    runs = (
        ("graph shape", "", "uni"),
        (args.shape, args.shape, "uni"),
        (ray_label, args.shape, "ray"),
    )
    probes = []
    for label, shape, executor in runs:
        print(f"== timing mode, device model: {label}", flush=True)
        probes.append(common.wake_probe())
        print(
            f"   host wake-up probe: {probes[-1]['warm_us']:.0f} us warm, "
            f"{probes[-1]['after_idle_us']:.0f} us after {probes[-1]['idle_ms']:.0f} ms idle",
            flush=True,
        )
        spec = {
            "executor": executor,
            "backend": "rbln",
            "model": str(compiled),
            "emulator_mode": "timing",
            "timing_shape": shape,
            "num_prompts": 0,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "max_num_seqs": top,
            "max_model_len": 1024,
            "api": "llm",
            "warmup": 2,
            "phases": phases,
        }
        out = common.run_json("engine_run.py", spec, common.base_env(), timeout=3600)
        per_batch = {}
        for b, phase in zip(batches, out["phases"], strict=False):
            per_batch[str(b)] = common.host_overhead(phase["rbln"]["calls"]["calls"], batch=b)
            per_batch[str(b)]["output_tok_per_s"] = phase["output_tok_per_s"]
            per_batch[str(b)]["engine_core_cpu_share"] = phase["engine_core_cpu_share"]
            ho = per_batch[str(b)]
            if ho.get("steps"):
                print(
                    f"   batch {b}: host {ho['host_ms']['p50']:.3f} ms p50 / device "
                    f"{ho['device_ms']['p50']:.3f} ms p50 = {ho['host_over_device_p50']:.1%}; "
                    f"engine core CPU {phase['engine_core_cpu_share']:.1%} of wall time",
                    flush=True,
                )
        sat = out["phases"][-1]
        occ = occupancy(sat, top)
        occ["output_tok_per_s"] = sat["output_tok_per_s"]
        print(
            f"   saturation (batch {top}): occupancy {occ['row_occupancy']:.1%} while requests "
            f"wait, {occ['row_occupancy_whole_phase']:.1%} with the drain tail",
            flush=True,
        )
        results[label] = {"per_batch": per_batch, "saturation": occ}

    def host_goal(label: str, limit: float) -> dict:
        ratios = {
            b: v.get("host_over_device_p50")
            for b, v in results[label]["per_batch"].items()
            if v.get("steps")
        }
        return {
            "device_model": args.shape,
            "host_over_device_p50": ratios,
            "met": all(r is not None and r <= limit for r in ratios.values()),
        }

    goal = results[args.shape]
    cpu = {b: v["engine_core_cpu_share"] for b, v in results[ray_label]["per_batch"].items()}
    goals = {
        "host_overhead_le_2pct_of_device": host_goal(args.shape, GOAL_HOST_RATIO),
        "host_overhead_le_1pct_of_device_ray_executor": host_goal(ray_label, GOAL_HOST_RATIO_RAY),
        "engine_core_cpu_le_20pct_ray_executor": {
            "share_of_wall_time": cpu,
            "met": all(c <= GOAL_ENGINE_CPU for c in cpu.values()),
        },
        "occupancy_ge_90pct_under_saturation": {
            "row_occupancy": goal["saturation"]["row_occupancy"],
            "met": (goal["saturation"]["row_occupancy"] or 0) >= GOAL_OCCUPANCY,
        },
    }
    common.save(
        "host_overhead",
        {
            "settings": vars(args) | {"compiled": str(compiled), "batches": batches},
            "results": results,
            "goals": goals,
            "wake_probes": probes,
        },
        args.quick,
    )
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for label, res in results.items():
        xs = [int(b) for b, v in res["per_batch"].items() if v.get("steps")]
        ax.plot(
            xs,
            [res["per_batch"][str(b)]["host_ms"]["p50"] for b in xs],
            marker="o",
            label=f"host ms/step ({label})",
        )
        ax.plot(
            xs,
            [res["per_batch"][str(b)]["device_ms"]["p50"] for b in xs],
            marker="s",
            linestyle="--",
            label=f"device ms/step ({label})",
        )
    ax.set_yscale("log")
    ax.set_xlabel("decode batch")
    ax.set_ylabel("ms per decode step (p50)")
    ax.set_title("host overhead vs device time per decode step (timing mode)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(common.plot_path("host_overhead", args.quick))
    for name, g in goals.items():
        print(f"goal {name}: {'MET' if g['met'] else 'NOT MET'} {g}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
