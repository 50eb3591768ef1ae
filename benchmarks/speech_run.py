"""One Whisper engine run in a fresh process (vLLM resolves its platform once per process).

argv[1] is a JSON spec::

    {"model": COMPILED_DIR, "batch": B, "num_requests": N, "audio_s": 30.0,
     "output_len": M, "timing_shape": PRESET, "warmup": W}

Runs ``vllm.LLM`` on the emulator in timing mode (the device modelled as ``timing_shape``):
``N`` requests of ``audio_s`` seconds of audio each, submitted at once, each decoding exactly
``M`` tokens (timing mode's zero logits never choose ``<|endoftext|>``). Prints one
``RESULT {...}`` line: wall time, the runner's counters and the runtime-call log.
"""

from __future__ import annotations

import json
import os
import sys
import time

SPEC = json.loads(sys.argv[1]) if __name__ == "__main__" else {}
if SPEC:
    os.environ["RBLN_RAY_NODE_ID"] = f"bench-{os.getpid()}"  # private emulated devices
    os.environ["RBLN_RAY_DEVICE"] = "emulated"
    os.environ["RBLN_RAY_EMULATOR_MODE"] = "timing"
    os.environ["RBLN_RAY_TIMING_SHAPE"] = SPEC["timing_shape"]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

EXTENSION = "rbln_ray.emulator.call_log.RuntimeCallsExtension"
PROMPT = "<|startoftranscript|><|en|><|transcribe|><|notimestamps|>"


def main(spec: dict) -> dict:
    from vllm import LLM, SamplingParams

    from rbln_ray.models.speech import tone_clip

    llm = LLM(
        model=spec["model"],
        seed=0,
        enforce_eager=True,
        max_num_seqs=spec["batch"],
        worker_extension_cls=EXTENSION,
    )
    params = SamplingParams(temperature=0, max_tokens=spec["output_len"], ignore_eos=True)

    def requests(n: int, seed: int) -> list[dict]:
        return [
            {
                "encoder_prompt": {
                    "prompt": "",
                    "multi_modal_data": {
                        "audio": (tone_clip(spec["audio_s"], 220 + i, seed), 16000)
                    },
                },
                "decoder_prompt": PROMPT,
            }
            for i in range(n)
        ]

    llm.generate(requests(spec["warmup"], 1), params, use_tqdm=False)
    batch = requests(spec["num_requests"], 2)
    llm.collective_rpc("emulator_calls_reset")
    (before,) = llm.collective_rpc("step_stats")  # cumulative: the warm-up's, subtracted
    started = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    wall = time.perf_counter() - started
    (calls,) = llm.collective_rpc("emulator_calls")
    (after,) = llm.collective_rpc("step_stats")
    stats = {k: after[k] - before[k] for k in ("decode_steps", "decode_rows", "encoder_calls")}
    return {
        "wall_s": wall,
        "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
        "stats": stats,
        "modelled_s": calls["total_modelled_seconds"],
        "device_calls": calls["total_calls"],
        "encoder_modelled_s": sum(
            c["modelled_s"] or 0 for c in calls["calls"] if c["kind"] == "prefill"
        ),
    }


if __name__ == "__main__":
    print("RESULT " + json.dumps(main(SPEC)))
