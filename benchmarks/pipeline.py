"""Pipeline stages at saturation: output throughput with S = 1, 2, 4 stages.

Each stage is a vLLM pipeline-parallel rank in its own Ray actor on its own emulated ATOM;
vLLM's batch queue keeps one micro-batch (up to the compiled batch) in every stage, and the
artifact's KV cache holds all S of them. Timing mode with ``--shape`` (default llama-3-8b):
a stage's device time is its share of the layers (the LM head on the last stage only), so
the run measures the pipeline's overlap on this machine. Saturation: ``--waves`` x S x batch
requests at once, so every micro-batch stays full while requests wait.
Goal: throughput(S) >= 0.9 x S x throughput(1) for S = 2 and 4.

Every engine runs in a fresh process (:mod:`benchmarks.engine_run`, ``executor: ray``) on
the same tiny 32-layer Llama, compiled once per S (cached). ``--layers`` builds it with fewer
layers (shorter device steps, so the host's share of each step grows); ``--name`` names the
results file.

    python -m benchmarks.pipeline [--quick]
    python -m benchmarks.pipeline --stages 1,2 --layers 16 --output-len 48 --name pipeline_l16
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tqdm import tqdm

from benchmarks import common

GOAL = 0.9


def compiled(stages: int, batch: int, max_seq_len: int, root: Path, layers: int = 32) -> Path:
    """The tiny ``layers``-layer Llama as one optimum artifact (S = 1) or S pipeline stages."""
    import os

    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.compile.artifact import is_compiled_dir
    from rbln_ray.models import build_tiny_model

    # 32 layers and an LM head worth ~2.4 layers, as Llama-3-8B's (the default --shape): the
    # stages' layer split, made from this model, is then the one a Llama-3-8B would get.
    hf = build_tiny_model(family="llama", num_layers=layers, intermediate_size=448)
    settings = {"batch_size": batch, "max_seq_len": max_seq_len, "decoder_batch_sizes": (batch,)}
    if stages == 1:
        return resolve_compiled_dir(hf, CompileSettings(**settings))
    from rbln_ray.compile import compile_pipeline

    out = root / f"tiny-llama-{layers}l-b{batch}-s{stages}"
    if not is_compiled_dir(out):
        compile_pipeline(hf, out, stages, CompileSettings(**settings))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small smoke run")
    p.add_argument("--shape", default="llama-3-8b", help="timing-mode device model")
    p.add_argument("--stages", default="1,2,4")
    p.add_argument("--batch", type=int, default=4, help="compiled batch = one micro-batch")
    p.add_argument("--waves", type=int, default=4, help="requests = waves x S x batch")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--layers", type=int, default=32, help="decoder layers of the tiny Llama")
    p.add_argument("--name", default="pipeline", help="results file name")
    args = p.parse_args(argv)
    if args.quick:
        args.waves, args.output_len = 1, 16
    from rbln_ray.common.paths import cache_dir

    root = cache_dir() / "bench-pipeline"
    stage_counts = [int(s) for s in args.stages.split(",")]
    results: dict[int, dict] = {}
    for stages in tqdm(stage_counts, desc="pipeline runs"):
        model = compiled(stages, args.batch, 512, root, args.layers)
        spec = {
            "backend": "rbln",
            "executor": "ray",
            "model": str(model),
            "api": "llm",
            "emulator_mode": "timing",
            "timing_shape": args.shape,
            "num_prompts": args.waves * stages * args.batch,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "max_num_seqs": stages * args.batch,
            "warmup": stages * args.batch,
        }
        results[stages] = common.run_json("engine_run.py", spec, common.base_env(), 3600)
    base = results[stage_counts[0]]["output_tok_per_s"] if 1 in results else None
    summary = {}
    for stages, r in results.items():
        ratio = r["output_tok_per_s"] / (stages * base) if base else None
        # Each stage's device-busy fraction: modelled device seconds / wall time of the run.
        busy = [c["total_modelled_seconds"] / r["elapsed_s"] for c in r["rbln"]["calls_by_rank"]]
        summary[stages] = {
            "output_tok_per_s": r["output_tok_per_s"],
            "efficiency": ratio,
            "goal_met": ratio is not None and (stages == 1 or ratio >= GOAL),
            "stage_busy": busy,
        }
        print(
            f"S={stages}: {r['output_tok_per_s']:.1f} tok/s, efficiency "
            f"{'-' if ratio is None else f'{ratio:.2f}'}, "
            f"stage busy {', '.join(f'{b:.2f}' for b in busy)}"
        )
    common.save(args.name, {"args": vars(args), "results": results, "summary": summary}, args.quick)
    plot(summary, common.plot_path(args.name, args.quick))
    return 0


def plot(summary: dict[int, dict], path: Path) -> None:
    plt = common.pyplot()
    stages = sorted(summary)
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(stages, [summary[s]["output_tok_per_s"] for s in stages], "o-", label="measured")
    base = summary[stages[0]]["output_tok_per_s"] / stages[0]
    ax.plot(stages, [base * s for s in stages], "--", label="S x one stage")
    ax.set_xlabel("pipeline stages S (one ATOM each)")
    ax.set_ylabel("output tok/s")
    ax.set_xticks(stages)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
