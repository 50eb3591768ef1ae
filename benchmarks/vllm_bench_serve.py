"""vLLM's own load generator (``vllm bench serve``) against the rbln-ray Serve app, beside ours.

An independent check of the project's load generator (``benchmarks/loadgen.py``): the same
Serve app (demo model, batch 4, ``--replicas`` replicas, emulated ATOM in compute mode, local
Ray) is measured by ``vllm bench serve`` (random dataset, ``--input-len``/``--output-len``,
``--max-concurrency``, ``--ignore-eos``, its streaming ``openai`` backend on
``/v1/completions``) and then by ``loadgen.run_load`` with the same lengths, concurrency and
request count. Needs the venv's ``vllm`` console script, which ``make setup`` makes work
(``scripts/vllm_dist_alias.py``).

    python -m benchmarks.vllm_bench_serve [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from benchmarks import common
from benchmarks.loadgen import run_load, wait_ready

VLLM_CLI = Path(sys.executable).parent / "vllm"
# vllm bench serve's result keys -> the loadgen summary they correspond to.
KEYS = {
    "request_throughput": "req/s",
    "output_throughput": "output tok/s",
    "median_ttft_ms": "TTFT p50 ms",
    "p99_ttft_ms": "TTFT p99 ms",
    "median_tpot_ms": "TPOT p50 ms",
    "p99_tpot_ms": "TPOT p99 ms",
    "median_itl_ms": "ITL p50 ms",
}


def vllm_bench(url: str, hf_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``vllm bench serve`` once; its saved result JSON."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            str(VLLM_CLI), "bench", "serve",
            "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions",
            "--model", "demo", "--tokenizer", str(hf_dir),
            "--dataset-name", "random",
            "--random-input-len", str(args.input_len),
            "--random-output-len", str(args.output_len),
            "--num-prompts", str(args.num_prompts),
            "--max-concurrency", str(args.concurrency),
            "--ignore-eos", "--seed", "0", "--num-warmups", "2",
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--save-result", "--result-dir", tmp, "--result-filename", "result.json",
        ]  # fmt: skip
        print("$", " ".join(cmd), flush=True)
        proc = subprocess.run(cmd, env=common.base_env(), text=True, timeout=3600)
        if proc.returncode != 0:
            raise SystemExit(f"vllm bench serve failed with {proc.returncode}")
        return json.loads((Path(tmp) / "result.json").read_text())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.output_len, args.input_len = 16, 32, 32
    hf_dir, compiled = common.compiled_demo(args.batch)

    import ray
    from ray import serve

    common.emulator_env("compute")
    common.start_local_ray(num_cpus=8, rbln_devices=4)
    try:
        port = common.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = common.deploy_serve_app(compiled, args.replicas, port)
        asyncio.run(wait_ready(url, 600))
        theirs = vllm_bench(url, hf_dir, args)
        prompts = common.prompts(args.num_prompts, args.input_len, common.vocab_of(hf_dir))
        ours = asyncio.run(run_load(url, "demo", prompts, args.output_len, args.concurrency))
    finally:
        serve.shutdown()
        ray.shutdown()
    vllm_side = {label: theirs.get(key) for key, label in KEYS.items()}
    ours_side = {
        "req/s": ours["req_per_s"],
        "output tok/s": ours["output_tok_per_s"],
        "TTFT p50 ms": ours["ttft_ms"]["p50"],
        "TTFT p99 ms": ours["ttft_ms"]["p99"],
        "TPOT p50 ms": ours["tpot_ms"]["p50"],
        "TPOT p99 ms": ours["tpot_ms"]["p99"],
        "ITL p50 ms": ours["itl_ms"]["p50"],
    }
    data = {
        "config": vars(args),
        "vllm_bench_serve": {"summary": vllm_side, "completed": theirs.get("completed")},
        "loadgen": {"summary": ours_side, "completed": ours.get("completed")},
        "vllm_bench_serve_raw": {k: v for k, v in theirs.items() if not isinstance(v, list)},
    }
    common.save("vllm_bench_serve", data, args.quick)
    for label in KEYS.values():
        theirs_v, ours_v = vllm_side[label], ours_side[label]
        print(f"{label:>14}: vllm bench serve {theirs_v!s:>10.10}  loadgen {ours_v!s:>10.10}")
    plot(vllm_side, ours_side, args.quick)
    return 0


def plot(theirs: dict[str, Any], ours: dict[str, Any], quick: bool) -> None:
    plt = common.pyplot()
    labels = list(KEYS.values())
    fig, axes = plt.subplots(1, len(labels), figsize=(2.2 * len(labels), 3.2))
    for ax, label in zip(axes, labels, strict=True):
        ax.bar(["vllm bench", "loadgen"], [theirs[label] or 0, ours[label] or 0])
        ax.set_title(label, fontsize=9)
        ax.tick_params(labelsize=8)
    fig.suptitle("rbln-ray Serve app: vllm bench serve vs benchmarks/loadgen.py")
    fig.tight_layout()
    fig.savefig(common.plot_path("vllm_bench_serve", quick))


if __name__ == "__main__":
    raise SystemExit(main())
