"""Prefix caching and chunked prefill on RBLN: shared system prompts, and long prompts.

1. **Shared prefix**: ``--num-requests`` requests, each a ``--system-len``-token system
   prompt (the same for all) plus its own ``--user-len``-token user turn, ``--output-len``
   tokens out, ``--concurrency`` closed-loop clients; prefix caching on vs off, in emulator
   timing mode (``--shape``, default llama-3-8b on ATOM: the goal is judged here) and in
   compute mode (the tiny model really runs on the host). TTFT p50/p99, TPOT, throughput.
   Goal: TTFT p50 at least 4x lower with caching, timing mode.
2. **Long-prompt interference** (timing mode): short requests keep the batch decoding while
   ``--long-len``-token prompts arrive; chunked prefill on (the default: one 128-token chunk
   per step, one decode step in between), on with 3 decode steps between chunks, and off
   (whole prompt in one step). Goal: TPOT p99 of the short requests at most 1.5x their TPOT
   p50 with chunked prefill. The longest inter-token gap (ITL max) shows the stall a whole
   prompt's prefill causes without chunking.

Every run is a fresh engine process (:mod:`benchmarks.prefix_run`) on the same compiled
artifact: a tiny Llama compiled for batch 4 and ``--max-seq-len`` (eager attention).

    python -m benchmarks.prefix_cache [--quick]
"""

from __future__ import annotations

import argparse

from tqdm import tqdm

from benchmarks import common

GOAL_TTFT_RATIO = 4.0
GOAL_TPOT_SPREAD = 1.5


def compiled_model(max_seq_len: int) -> str:
    import os

    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models import build_tiny_model

    hf = build_tiny_model(family="llama", max_position_embeddings=max_seq_len)
    settings = CompileSettings(batch_size=4, max_seq_len=max_seq_len, decoder_batch_sizes=(4, 2, 1))
    return str(resolve_compiled_dir(hf, settings))


def run(spec: dict, timeout: float) -> dict:
    return common.run_json("prefix_run.py", spec, common.base_env(), timeout)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--shape", default="llama-3-8b", help="timing-mode device model")
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--user-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--long-len", type=int, default=2048)
    p.add_argument("--num-long", type=int, default=4)
    p.add_argument("--long-every-s", type=float, default=6.0)
    p.add_argument("--num-short", type=int, default=24)
    p.add_argument("--short-output-len", type=int, default=128)
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.num_long, args.num_short = 8, 2, 6
        args.output_len, args.short_output_len, args.long_every_s = 16, 48, 2.0

    model = compiled_model(args.max_seq_len)
    shared = {
        "kind": "shared_prefix",
        "system_len": args.system_len,
        "user_len": args.user_len,
        "num_requests": args.num_requests,
        "output_len": args.output_len,
        "concurrency": args.concurrency,
    }
    long_prompt = {
        "kind": "long_prompt",
        "short_len": 64,
        "short_output_len": args.short_output_len,
        "num_short": args.num_short,
        "short_concurrency": 3,
        "long_len": args.long_len,
        "long_output_len": 8,
        "num_long": args.num_long,
        "long_every_s": args.long_every_s,
    }
    runs = [
        (f"shared/{mode}/cache-{'on' if cache else 'off'}", mode, cache, True, shared)
        for mode in ("timing", "compute")
        for cache in (True, False)
    ] + [
        (f"long/timing/chunked-{'on' if chunked else 'off'}", "timing", True, chunked, long_prompt)
        for chunked in (True, False)
    ]
    # The decode-steps-between-chunks knob at 3 (fewer slowed decode steps, later first token).
    runs.append(("long/timing/chunked-on-gap-3", "timing", True, True, long_prompt))
    results: dict[str, dict] = {}
    for name, mode, cache, chunked, workload in tqdm(runs, desc="prefix-cache runs"):
        spec = {
            "model": model,
            "emulator_mode": mode,
            "timing_shape": args.shape if mode == "timing" else "",
            "enable_prefix_caching": cache,
            "enable_chunked_prefill": chunked,
            "decode_steps_between_chunks": 3 if name.endswith("gap-3") else None,
            "workload": workload,
        }
        results[name] = run(spec, timeout=3600)

    def ttft_p50(name: str) -> float:
        return results[name]["all"]["ttft_ms"]["p50"]

    def tpot_spread(name: str) -> float:
        tpot = results[name]["short"]["tpot_ms"]
        return tpot["p99"] / tpot["p50"]

    ratio = {
        m: ttft_p50(f"shared/{m}/cache-off") / ttft_p50(f"shared/{m}/cache-on")
        for m in ("timing", "compute")
    }
    spread = {c: tpot_spread(f"long/timing/chunked-{c}") for c in ("on", "off", "on-gap-3")}
    goals = {
        "ttft_p50_ratio_timing": ratio["timing"],
        "ttft_goal_met": ratio["timing"] >= GOAL_TTFT_RATIO,
        "ttft_p50_ratio_compute": ratio["compute"],
        "tpot_p99_over_p50_chunked_on": spread["on"],
        "tpot_p99_over_p50_chunked_off": spread["off"],
        "tpot_p99_over_p50_chunked_on_gap_3": spread["on-gap-3"],
        "tpot_goal_met": spread["on"] <= GOAL_TPOT_SPREAD,
    }
    common.save(
        "prefix_cache", {"args": vars(args), "results": results, "goals": goals}, args.quick
    )
    plot(results, common.plot_path("prefix_cache", args.quick))
    for key, value in goals.items():
        print(f"{key}: {value:.2f}" if isinstance(value, float) else f"{key}: {value}")
    return 0


def plot(results: dict[str, dict], path) -> None:
    plt = common.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [n for n in results if n.startswith("shared/")]
    p50 = [results[n]["all"]["ttft_ms"]["p50"] for n in names]
    p99 = [results[n]["all"]["ttft_ms"]["p99"] for n in names]
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], p50, 0.4, label="p50")
    ax1.bar([i + 0.2 for i in x], p99, 0.4, label="p99")
    ax1.set_xticks(list(x), [n.removeprefix("shared/") for n in names], rotation=20)
    ax1.set_yscale("log")
    ax1.set_ylabel("TTFT (ms)")
    ax1.set_title("shared 1k-token system prompt")
    ax1.legend()
    names = [n for n in results if n.startswith("long/")]
    for key, offset in (("p50", -0.2), ("p99", 0.2)):
        vals = [results[n]["short"]["tpot_ms"][key] for n in names]
        ax2.bar([i + offset for i in range(len(names))], vals, 0.4, label=f"TPOT {key}")
    ax2.set_xticks(range(len(names)), [n.removeprefix("long/") for n in names])
    ax2.set_ylabel("short requests' TPOT (ms)")
    ax2.set_title("long prompts arriving while decoding")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
