"""Time one emulated decode step at batch 4 against transformers' own cached decode step.

Why: the emulator runs optimum-rbln's real graphs eagerly; serving tests are only practical if
a decode step costs about what plain transformers costs. Prints one JSON object.

    python scripts/bench_emulator_decode.py [--hidden 512 --layers 8 --context 128 --steps 20]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import tempfile
import time

os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
os.environ.setdefault("RBLN_RAY_NODE_ID", f"bench-{os.getpid()}")

logger = logging.getLogger("bench_emulator_decode")


def _median_ms(fn, steps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--context", type=int, default=128, help="tokens already in the cache")
    parser.add_argument("--max-seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    args = parser.parse_args()

    from rbln_ray.compile import CompileSettings, compile_hf_model
    from rbln_ray.emulator import ensure_runtime

    if ensure_runtime() != "emulated":
        raise SystemExit("this benchmark measures the emulator; set RBLN_RAY_DEVICE=emulated")
    import torch
    from optimum.rbln import RBLNAutoModelForCausalLM
    from transformers import AutoModelForCausalLM

    from rbln_ray.models import build_tiny_model

    if args.threads:
        torch.set_num_threads(args.threads)
    hf_dir = build_tiny_model(
        family="llama",
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        intermediate_size=args.hidden * 3,
    )
    batch = 4
    torch.manual_seed(0)
    prompts = torch.randint(10, 4000, (batch, args.context), dtype=torch.int64)

    with tempfile.TemporaryDirectory() as tmp:
        settings = CompileSettings(batch_size=batch, max_seq_len=args.max_seq_len)
        compile_hf_model(hf_dir, tmp, settings)
        model = RBLNAutoModelForCausalLM.from_pretrained(tmp, export=False)
        tables = torch.arange(batch, dtype=torch.int16).view(batch, 1)
        for i in range(batch):
            model.prefill_decoder(
                input_ids=prompts[i : i + 1],
                cache_position=torch.arange(args.context, dtype=torch.int32)[None],
                block_tables=tables[i],
            )
        next_ids = torch.randint(10, 4000, (batch, 1), dtype=torch.int64)
        positions = torch.full((batch, 1), args.context, dtype=torch.int32)
        decoder = model.decoders[batch]

        def emulated_step() -> None:
            decoder(input_ids=next_ids, cache_position=positions, block_tables=tables)

        emulated_ms = _median_ms(emulated_step, args.steps)

    ref = AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        prefill = ref(prompts, use_cache=True)
        cache = prefill.past_key_values
        position = torch.full((batch, 1), args.context, dtype=torch.int64)

        def step() -> None:
            ref(next_ids, past_key_values=cache, position_ids=position, use_cache=True)
            cache.crop(-1)  # drop the token just added: fixed context between repetitions

        transformers_ms = _median_ms(step, args.steps)

    print(
        json.dumps(
            {
                "model": {"hidden": args.hidden, "layers": args.layers, "vocab": 4096},
                "batch": batch,
                "context": args.context,
                "max_seq_len": args.max_seq_len,
                "torch_threads": torch.get_num_threads(),
                "emulated_decode_ms": round(emulated_ms, 3),
                "transformers_decode_ms": round(transformers_ms, 3),
                "ratio": round(emulated_ms / transformers_ms, 3),
            }
        )
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    main()
