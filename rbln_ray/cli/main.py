"""Entry point of the ``rbln-ray`` command."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

from rbln_ray.common.logging_setup import LEVELS, apply_process_defaults, setup_logging
from rbln_ray.serve.local_ray import METRICS_EXPORT_PORT


def cmd_compile(args: argparse.Namespace) -> int:
    from rbln_ray.cli.compile_flags import settings_from_args
    from rbln_ray.cli.runtime_choice import choose_runtime
    from rbln_ray.compile.family_compile import compile_directory

    try:
        settings = settings_from_args(args)
        choose_runtime()
        what = compile_directory(
            args.hf_dir, args.out_dir, settings, pipeline_stages=args.pipeline_stages
        )
    except ValueError as exc:
        print(f"rbln-ray compile: {exc}", file=sys.stderr)
        return 2
    print(f"compiled {what} written to {args.out_dir}")
    return 0


def cmd_devices(args: argparse.Namespace) -> int:
    from rbln_ray.cli.runtime_choice import choose_runtime

    if choose_runtime() != "emulated":
        import rebel

        print(f"{'ID':>3}  NAME")
        for i in range(rebel.device_count()):
            print(f"{i:>3}  {rebel.get_npu_name(i)}")
        return 0
    from rbln_ray.emulator import list_devices

    rows = list_devices()
    print(f"{'ID':>3}  {'NAME':<10} {'MEMORY (MiB)':>19}  {'PID':>8}  NODE")
    for d in rows:
        mem = f"{d.memory_used / 2**20:.0f} / {d.memory_total / 2**20:.0f}"
        pid = str(d.pid) if d.pid else "-"
        hidden = "" if d.visible else " (hidden)"
        print(f"{d.id:>3}  {d.name:<10} {mem:>19}  {pid:>8}  {d.node}{hidden}")
    return 0


def cmd_build_model(args: argparse.Namespace) -> int:
    from rbln_ray.families.registry import (
        DecoderFamily,
        EncoderFamily,
        PoolingDecoderFamily,
        SpeechFamily,
        family,
    )
    from rbln_ray.models import (
        TinyModelSpec,
        build_tiny_encoder,
        build_tiny_model,
        build_tiny_vlm,
        build_tiny_whisper,
    )
    from rbln_ray.models.demo import DEMO_MODEL, resolve_model

    if args.family == DEMO_MODEL:  # trained on first use
        print(resolve_model(DEMO_MODEL)[0])
        return 0
    record = family(args.family)
    shape = dict(
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        intermediate_size=args.intermediate_size,
    )
    if isinstance(record, EncoderFamily):
        print(build_tiny_encoder(family=record.name, out_dir=args.out, **shape))
        return 0
    if isinstance(record, SpeechFamily):  # its own shape (an encoder and a decoder)
        print(build_tiny_whisper(out_dir=args.out))
        return 0
    decoder = dict(
        num_kv_heads=args.num_kv_heads,
        max_position_embeddings=args.max_position_embeddings,
        **shape,
    )
    if isinstance(record, DecoderFamily | PoolingDecoderFamily):
        # a decoder-based embedder or reranker is its decoder's checkpoint (vLLM reads a
        # reranker through the record's hf_overrides)
        name = record.decoder_family if isinstance(record, PoolingDecoderFamily) else record.name
        moe = dict(num_experts=args.num_experts, experts_per_token=args.experts_per_token)
        path = build_tiny_model(
            family=name,
            sliding_window=args.sliding_window,
            out_dir=args.out,
            **decoder,
            **moe,
        )
        print(path)
        return 0
    language = TinyModelSpec(family=record.tiny_language_family, **decoder)
    print(build_tiny_vlm(family=record.name, language=language, out_dir=args.out))
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from rbln_ray.serve.local_ray import prepare_loopback

    if not (args.address or os.environ.get("RAY_ADDRESS")):
        prepare_loopback()  # before anything imports ray (serve_cmd does)
    from rbln_ray.cli.serve_cmd import run

    return run(args)


def apply_log_level(level: str | None) -> None:
    """``--log-level``: rbln-ray's own logger, and (through the environment, which every
    process started from here inherits) vLLM's and Serve's logs of replicas and workers."""
    setup_logging(level)
    if level is not None:
        os.environ["VLLM_LOGGING_LEVEL"] = level.upper()


def parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--log-level",
        choices=LEVELS,
        help="log level of rbln-ray, vLLM and Serve in every process (default: info; "
        "env RBLN_RAY_LOG_LEVEL)",
    )
    p = argparse.ArgumentParser(prog="rbln-ray", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    def add_parser(name: str, **kwargs: Any) -> argparse.ArgumentParser:
        return sub.add_parser(name, parents=[common], **kwargs)

    s = add_parser("serve", help="serve models over OpenAI-compatible HTTP (Ray Serve)")
    s.add_argument("--config", help="YAML config (default: the embedded demo, 2 replicas)")
    s.add_argument("--host", help="bind address (default 127.0.0.1)")
    s.add_argument("--port", type=int, help="HTTP port (default 8000)")
    key = s.add_mutually_exclusive_group()
    key.add_argument(
        "--api-key",
        help="require this bearer token on /v1 routes (visible in the process list: prefer "
        "--api-key-file or the config's api_key_env)",
    )
    key.add_argument("--api-key-file", help="require the bearer token this file holds (0600)")
    s.add_argument(
        "--address", help="Ray cluster to join (default: RAY_ADDRESS or a new local one)"
    )
    s.add_argument(
        "--metrics-port",
        type=int,
        default=METRICS_EXPORT_PORT,
        help="Prometheus port of Ray's metrics export on the new local instance, "
        f"127.0.0.1 (default {METRICS_EXPORT_PORT}; a joined cluster keeps its own)",
    )
    s.set_defaults(func=cmd_serve)

    from rbln_ray.cli.compile_flags import add_compile_flags

    c = add_parser("compile", help="compile an HF model directory with optimum-rbln")
    c.add_argument("hf_dir")
    c.add_argument("out_dir")
    add_compile_flags(c)
    c.add_argument(
        "--pipeline-stages",
        type=int,
        default=1,
        help="split the decoder into S stages by layers, one worker (and device set) each",
    )
    c.set_defaults(func=cmd_compile)

    d = add_parser("devices", help="list RBLN devices (real or emulated)")
    d.set_defaults(func=cmd_devices)

    b = add_parser(
        "build-model",
        help="build a local test model: decoder, encoder, vision-language or speech (or train "
        "the demo)",
    )
    from rbln_ray.families.registry import FAMILIES
    from rbln_ray.models.demo import DEMO_MODEL

    b.add_argument(
        "family",
        # qwen2-vl = qwen2_vl, gpt-oss = gpt_oss; encoders keep their dashes (xlm-roberta)
        type=lambda name: name if name in FAMILIES else name.replace("-", "_"),
        choices=[*FAMILIES, DEMO_MODEL],
    )
    b.add_argument("--out", type=Path)
    b.add_argument("--hidden-size", type=int, default=128)
    b.add_argument("--num-layers", type=int, default=2)
    b.add_argument("--num-heads", type=int, default=4)
    b.add_argument("--num-kv-heads", type=int, default=2)
    b.add_argument("--intermediate-size", type=int, default=256)
    b.add_argument("--max-position-embeddings", type=int, default=1024)
    b.add_argument(
        "--sliding-window",
        type=int,
        help="window of the sliding layers (gemma2/gemma3/gpt_oss: default 64; mistral: none)",
    )
    b.add_argument("--num-experts", type=int, default=4, help="MoE families: experts per layer")
    b.add_argument("--experts-per-token", type=int, default=2, help="MoE families: top-k")
    b.set_defaults(func=cmd_build_model)

    from rbln_ray.cluster import node_stop

    st = add_parser(
        "stop-node",
        help="stop this host's Ray node of one cluster (a scoped `ray stop`; see ray-up configs)",
    )
    node_stop.add_arguments(st)
    st.set_defaults(func=node_stop.run)

    from rbln_ray.cli import plan_cmd

    pl = add_parser("plan", help="estimate RBLN cards, devices per worker and replicas")
    plan_cmd.add_arguments(pl)
    pl.set_defaults(func=plan_cmd.run)
    return p


def main(argv: list[str] | None = None) -> int:
    apply_process_defaults()
    args = parser().parse_args(argv)
    apply_log_level(args.log_level)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
