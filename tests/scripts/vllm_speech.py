"""Transcribe audio through ``vllm.LLM``; JSON on stdout.

rbln-ray with ``RBLN_RAY_DEVICE=emulated`` (the RBLN platform runs the compiled model),
plain vLLM-CPU with ``auto`` and no runtime. Usage: vllm_speech.py @SPEC_PATH, the spec:
``model``, ``llm_kwargs``, ``requests`` (``audio``: a path to a float32 .npy of 16 kHz
samples, or null for a text-only prompt; ``prompt``: the decoder prompt, ``max_tokens``),
``refusals``: further LLM kwargs
that must each be refused; ``audio_in_prompt``: the audio belongs to the prompt itself (a
decoder-only model over audio features, Qwen3-ASR), else to an encoder prompt (Whisper's
encoder-decoder prompts). Output: per request its prompt and output token ids, the
runner's step stats (rbln-ray), and each refusal's error.
"""

import gc
import json
import os
import sys


def main(spec: dict) -> dict:
    import numpy as np
    from vllm import LLM, SamplingParams

    llm = LLM(model=spec["model"], seed=0, enforce_eager=True, **spec.get("llm_kwargs", {}))
    prompts, params = [], []
    for req in spec["requests"]:
        audio = {"audio": (np.load(req["audio"]), 16000)} if req["audio"] else None
        if audio is None:  # a text-only prompt (a decoder-only model's)
            prompts.append({"prompt": req["prompt"]})
        elif spec.get("audio_in_prompt"):
            prompts.append({"prompt": req["prompt"], "multi_modal_data": audio})
        else:
            prompts.append(
                {
                    "encoder_prompt": {"prompt": "", "multi_modal_data": audio},
                    "decoder_prompt": req["prompt"],
                }
            )
        params.append(SamplingParams(temperature=0, max_tokens=req["max_tokens"]))
    outs = llm.generate(prompts, params, use_tqdm=False)
    result = {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
        "prompt_token_ids": [list(o.prompt_token_ids or []) for o in outs],
        "tasks": list(llm.llm_engine.get_supported_tasks()),
    }
    if os.environ.get("RBLN_RAY_DEVICE") == "emulated":
        result["step_stats"] = llm.collective_rpc("step_stats")
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    refused = []
    for kwargs in spec.get("refusals", []):
        try:
            LLM(model=spec["model"], enforce_eager=True, **kwargs)
            refused.append(None)
        except Exception as exc:  # noqa: BLE001 - reported to the test, which checks it
            refused.append(f"{type(exc).__name__}: {exc}")
    result["refused"] = refused
    return result


if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    arg = sys.argv[1]
    if arg.startswith("@"):
        with open(arg[1:]) as f:
            arg = f.read()
    spec = json.loads(arg)
    print("RESULT " + json.dumps(main(spec)))
