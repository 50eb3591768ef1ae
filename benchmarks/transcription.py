"""Transcription throughput on one emulated device: audio seconds transcribed per second of
wall time (timing mode: the device's time modelled as a real Whisper checkpoint on ATOM).

For each device model (``--shapes``: Whisper presets of ``rbln_ray.npu.speech_cost``) and
each compiled decoder batch (``--batches``: requests in flight), one ``vllm.LLM`` process on
the tiny Whisper compiled at that batch runs ``--requests-per-row`` x batch requests of
``--audio-s`` seconds of audio at once, each decoding ``--output-len`` tokens (about the
tokens of 30 s of English speech; timing mode's outputs are zeros, so every request decodes
exactly that many). Reported: audio seconds per second of wall time per device, the same
bounded by the modelled device time alone (no host), the device-busy fraction, and the
encoder's share of the device time.

    python -m benchmarks.transcription            # full
    python -m benchmarks.transcription --quick    # smoke
"""

from __future__ import annotations

import argparse

from tqdm import tqdm

from benchmarks import common


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--shapes", default="whisper-small,whisper-large-v3")
    p.add_argument("--batches", default="1,4,8")
    p.add_argument("--requests-per-row", type=int, default=3)
    p.add_argument("--audio-s", type=float, default=30.0)
    p.add_argument("--output-len", type=int, default=128)
    args = p.parse_args(argv)
    if args.quick:
        args.shapes, args.batches, args.requests_per_row, args.output_len = (
            "whisper-small",
            "1,4",
            1,
            16,
        )
    import os

    os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir
    from rbln_ray.models import build_tiny_whisper

    shapes = args.shapes.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    hf_dir = build_tiny_whisper()
    runs = []
    plan = [(s, b) for s in shapes for b in batches]
    for shape, batch in tqdm(plan, desc="transcription runs", unit="run"):
        compiled = resolve_compiled_dir(hf_dir, CompileSettings(batch_size=batch))
        n = args.requests_per_row * batch
        spec = {
            "model": str(compiled),
            "batch": batch,
            "num_requests": n,
            "audio_s": args.audio_s,
            "output_len": args.output_len,
            "timing_shape": shape,
            "warmup": 1,
        }
        result = common.run_json("speech_run.py", spec, common.base_env(), timeout=3600)
        audio = n * args.audio_s
        runs.append(
            {
                "shape": shape,
                "batch": batch,
                "requests": n,
                "audio_s_total": audio,
                "wall_s": result["wall_s"],
                "audio_s_per_s": audio / result["wall_s"],
                "device_bound_audio_s_per_s": audio / result["modelled_s"],
                "device_busy": result["modelled_s"] / result["wall_s"],
                "encoder_share": result["encoder_modelled_s"] / result["modelled_s"],
                "output_tokens": result["output_tokens"],
                "decoder_calls": result["stats"]["decode_steps"],
                "encoder_calls": result["stats"]["encoder_calls"],
                "rows_per_decoder_call": result["stats"]["decode_rows"]
                / max(1, result["stats"]["decode_steps"]),
            }
        )
        r = runs[-1]
        tqdm.write(
            f"{shape} batch {batch}: {r['audio_s_per_s']:.1f} audio s/s "
            f"(device bound {r['device_bound_audio_s_per_s']:.1f}, busy {r['device_busy']:.0%})"
        )
    config = {k: v for k, v in vars(args).items() if k != "quick"}
    common.save("transcription", {"config": config, "runs": runs}, args.quick)
    plot(runs, args.quick)
    return 0


def plot(runs: list[dict], quick: bool) -> None:
    plt = common.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for shape in dict.fromkeys(r["shape"] for r in runs):
        mine = [r for r in runs if r["shape"] == shape]
        xs = [r["batch"] for r in mine]
        line = ax.plot(xs, [r["audio_s_per_s"] for r in mine], marker="o", label=f"{shape}")
        ax.plot(
            xs,
            [r["device_bound_audio_s_per_s"] for r in mine],
            linestyle="--",
            color=line[0].get_color(),
            label=f"{shape}, device time only",
        )
    ax.set_xlabel("compiled decoder batch (requests in flight)")
    ax.set_ylabel("audio seconds transcribed per second, one device")
    ax.set_title("Whisper on one emulated ATOM (timing mode)")
    ax.set_xticks(sorted({r["batch"] for r in runs}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(common.plot_path("transcription", quick), dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
