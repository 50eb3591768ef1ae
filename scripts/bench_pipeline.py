"""Decode throughput of one engine with S = 1, 2, 4 pipeline stages on a local 2-node cluster.

Why: pipeline stages add one Ray hop per stage boundary per step (stage 0 → ... → last stage
→ logits back to stage 0); this measures what that costs against the single-stage artifact
on the same weights. Stages of one step run one after another (no overlap of consecutive
steps yet), so S > 1 is expected to be slower per step on emulated devices; the point of
stages is capacity (a model too big for one node), not speed.

Method per S: one engine (``RBLNRayExecutor``, placement strategy ``--strategy``), a warm-up,
then ``batch`` requests with ``max_tokens=1`` (prefill only, time ``t1``) and the same requests
with ``max_tokens=1+T`` (time ``t2``); decode tok/s = ``batch*T / (t2 - t1)``. Prints JSON.

    python scripts/bench_pipeline.py [--hidden 256 --layers 8 --tokens 64 --stages 1 2 4]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

logger = logging.getLogger("bench_pipeline")


def _compile(hf: Path, root: Path, stages: int, args: argparse.Namespace) -> Path:
    settings = {
        "batch_size": args.batch,
        "max_seq_len": args.max_seq_len,
        "decoder_batch_sizes": [args.batch],
    }
    out = root / f"s{stages}"
    if stages == 1:
        from rbln_ray.emulator import compile_hf_model

        return compile_hf_model(hf, out, attn_impl="eager", **settings)
    from rbln_ray.pipeline import compile_pipeline

    return compile_pipeline(hf, out, stages, **settings)


def _measure(model: Path, args: argparse.Namespace) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(model),
        distributed_executor_backend="ray",
        additional_config={"rbln_placement_strategy": args.strategy},
        skip_tokenizer_init=True,
    )
    prompts = [
        {"prompt_token_ids": [(17 * r + i) % 4000 + 1 for i in range(args.prompt_len)]}
        for r in range(args.batch)
    ]

    def run(max_tokens: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - start

    run(4)  # warm-up
    t1 = min(run(1) for _ in range(2))
    t2 = run(1 + args.tokens)
    devices = llm.collective_rpc("device_info")
    stats = llm.collective_rpc("step_stats")
    llm.llm_engine.engine_core.shutdown()
    decode_s = max(t2 - t1, 1e-9)
    steps = stats[0]["decode_steps"]
    return {
        "stages": len(devices),
        "decode_tok_s": args.batch * args.tokens / decode_s,
        "decode_step_ms": 1e3 * decode_s / args.tokens,
        "prefill_only_s": t1,
        "generate_s": t2,
        "end_to_end_output_tok_s": args.batch * (1 + args.tokens) / t2,
        "decode_steps_total": steps,
        "stage_device_seconds": [
            s.get("stage_device_seconds", s.get("device_seconds")) for s in stats
        ],
        "nodes": [d["node"][:8] for d in devices],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-seq-len", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64, help="decode tokens per request")
    parser.add_argument("--stages", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--strategy", default="SPREAD")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    import ray
    from ray.cluster_utils import Cluster

    from rbln_ray.emulator import ensure_runtime
    from rbln_ray.models import build_tiny_model

    ensure_runtime()
    hf = Path(
        build_tiny_model(
            family="llama", hidden_size=args.hidden, num_layers=args.layers, num_heads=4
        )
    )
    root = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    models = {s: _compile(hf, root, s, args) for s in args.stages}
    head = {"num_cpus": 1, "resources": {"RBLN": 0}}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    for _ in range(2):
        cluster.add_node(num_cpus=2, resources={"RBLN": 2})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        results = []
        for stages in args.stages:
            results.append(_measure(models[stages], args))
            logger.warning("S=%d: %s", stages, json.dumps(results[-1]))
    finally:
        ray.shutdown()
        cluster.shutdown()
    report = {
        "note": "emulated devices on a shared 2-core machine; numbers are noisy and relative",
        "model": {"hidden": args.hidden, "layers": args.layers, "batch": args.batch},
        "cpu_load_avg": os.getloadavg(),
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
