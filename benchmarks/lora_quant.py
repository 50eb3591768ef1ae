"""LoRA adapters and quantized artifacts in timing mode (issue 33): modelled ATOM throughput.

The tiny llama is compiled as it is, with 1 and with 2 LoRA adapters (ranks 4 and 8), and
from its int8 / fp8 / int8+fp8-KV checkpoints; each artifact is served by ``vllm.LLM`` in the
emulator's timing mode with the latency of a real model's shape (``--timing-shape``, read
with the artifact's quantization and adapters, as the cost model prices them). LoRA
artifacts run request sets of only base rows, only adapter rows, and a mix. Throughput is
output tokens per *modelled* device second (independent of this machine's load); wall-clock
tok/s is reported beside it.

    python -m benchmarks.lora_quant            # full
    python -m benchmarks.lora_quant --quick    # smoke
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from benchmarks import common

BATCH, MAX_SEQ_LEN = 4, 512


def artifacts() -> dict[str, tuple[Any, dict[str, str]]]:
    """name -> (compiled dir, its LoRA adapters)."""
    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models import build_tiny_model
    from rbln_ray.models.adapters import build_tiny_adapter
    from rbln_ray.models.quantized import build_tiny_quantized_model

    hf = build_tiny_model(family="llama")
    a = str(build_tiny_adapter(hf, r=4, alpha=8, targets=("q_proj", "v_proj"), seed=1))
    b_targets = ("o_proj", "gate_proj", "down_proj")
    b = str(build_tiny_adapter(hf, r=8, alpha=16, targets=b_targets, seed=2))
    base = {"batch_size": BATCH, "max_seq_len": MAX_SEQ_LEN, "decoder_batch_sizes": (4, 2, 1)}

    def compiled(model, **extra):
        return resolve_compiled_dir(model, CompileSettings(**base, **extra))

    return {
        "fp16": (compiled(hf), {}),
        "lora x1": (compiled(hf, lora_modules={"a": a}), {"a": a}),
        "lora x2": (compiled(hf, lora_modules={"a": a, "b": b}), {"a": a, "b": b}),
        "int8": (compiled(build_tiny_quantized_model("int8")), {}),
        "fp8": (compiled(build_tiny_quantized_model("fp8")), {}),
        "int8+fp8kv": (compiled(build_tiny_quantized_model("int8", "fp8")), {}),
    }


def mixes(adapters: dict[str, str]) -> dict[str, list[str | None]]:
    """Request sets of an artifact: base rows only; with adapters, adapter rows only and a
    mix of the base and every adapter."""
    if not adapters:
        return {"base": [None]}
    names: list[str | None] = list(adapters)
    return {"base": [None], "adapters": names, "mixed": [None, *names]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--timing-shape", default="llama-3.2-3b", help="preset the latency models")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.input_len, args.output_len = 8, 32, 8
    rows = []
    for name, (compiled, adapters) in artifacts().items():
        sets = mixes(adapters)
        spec = {
            "backend": "rbln",
            "model": str(compiled),
            "emulator_mode": "timing",
            "timing_shape": args.timing_shape,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "max_num_seqs": BATCH,
            "max_model_len": MAX_SEQ_LEN,
            "api": "llm",
            "warmup": 2,
            "lora_modules": adapters,
            "phases": [
                {"num_prompts": args.num_prompts, "output_len": args.output_len, "lora_mix": mix}
                for mix in sets.values()
            ],
        }
        print(f"== {name}", flush=True)
        out = common.run_json("engine_run.py", spec, common.base_env(), timeout=3600)
        for set_name, phase in zip(sets, out["phases"], strict=True):
            calls = phase["rbln"]["calls"]
            modelled = calls["total_modelled_seconds"]
            rows.append(
                {
                    "artifact": name,
                    "requests": set_name,
                    "output_tokens": phase["output_tokens"],
                    "modelled_device_s": modelled,
                    "modelled_output_tok_per_s": phase["output_tokens"] / modelled,
                    "wall_output_tok_per_s": phase["output_tok_per_s"],
                    "device_calls": len(calls["calls"]),
                }
            )
            print(f"   {set_name:9s} {rows[-1]['modelled_output_tok_per_s']:9.1f} tok/s (modelled)")
    data = {"timing_shape": args.timing_shape, "batch": BATCH, "args": vars(args), "rows": rows}
    common.save("lora_quant", data, args.quick)
    plot(rows, args)
    return 0


def plot(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{r['artifact']}\n{r['requests']}" for r in rows]
    values = [r["modelled_output_tok_per_s"] for r in rows]
    colors = ["tab:blue" if "lora" in r["artifact"] or r["artifact"] == "fp16" else "tab:green"
              for r in rows]  # fmt: skip
    ax.bar(range(len(rows)), values, color=colors)
    ax.set_xticks(range(len(rows)), labels, fontsize=8)
    ax.set_ylabel("output tok/s (modelled ATOM time)")
    ax.set_title(
        f"LoRA adapters and quantized artifacts, timing mode as {args.timing_shape}, batch "
        f"{BATCH}, {args.input_len} in / {args.output_len} out"
    )
    fig.tight_layout()
    fig.savefig(common.plot_path("lora_quant", args.quick))


if __name__ == "__main__":
    raise SystemExit(main())
