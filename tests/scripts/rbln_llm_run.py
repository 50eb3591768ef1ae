"""Run requests through ``vllm.LLM`` on the RBLN platform; print results as JSON.

Tests run vLLM in a subprocess: vLLM resolves its platform once per process, and engines are
heavy. Input (argv[1], JSON): ``{"model": dir, "llm_kwargs": {...}, "requests": [{"prompt":
str | "prompt_token_ids": [...], "params": {SamplingParams fields; structured_outputs as a
dict}, "images": [tests.vision.image_spec, ...], "videos": [tests.vision.video_spec, ...],
"lora": {"name", "id", "path"} (a LoRARequest), "cache_salt": str}],
"passes": N (default 1: run the requests N times, one ``generate`` call each), "chats":
[{"messages": OpenAI-style messages (images as ``data:`` URLs), "params": {...}}] (then one
``LLM.chat`` call: vLLM's chat path, its template and placeholders, as its OpenAI server
renders them), "refused_chat": {"messages", "params", "mm_processor_kwargs"} (one
``LLM.chat`` call, before the chats, expected to be refused: its error is reported), "rpc":
[method, ...], "metrics": [prefix, ...] (vLLM's metrics whose names start so, summed over
labels; start the engine with ``"disable_log_stats": false``), "ray_local": {ray.init
kwargs} (start a private local Ray instance for this run, e.g. with ``{"resources":
{"RBLN": 1}}``, for ``distributed_executor_backend="ray"``; shut down after the run)}``.
Output: one line ``RESULT {...}`` with per-request outputs (of the last pass; every pass in
``passes``), the prompts' token ids as vLLM processed them, the chats' outputs and prompt
token ids (``chats``), the refused chat's error (``refused_chat``: "" if it was served), and
the collective_rpc results (taken after the generate passes, before the chats).

``argv[1]`` may also be ``@PATH``: the JSON is read from that file (a spec too long for a
command line).

Several engines one after another (``{"runs": [spec, ...]}``): one process pays vLLM's import
cost once for all of them; each engine is shut down (its device freed) before the next
starts, and a run that fails reports ``{"error": ...}`` instead of stopping the others.
Output then: ``RESULT {"runs": [result | {"error": str}, ...]}``.
"""

import json
import os
import sys
from pathlib import Path

os.environ.setdefault("RBLN_RAY_DEVICE", "emulated")
# The engine core in this process (vLLM's InprocClient), not in a spawned one: the plugin's
# worker and model runner run the same either way, and a spawned core would import vLLM
# again for every engine of a run list, on a 2-core machine whose suite is bound by CPU.
# The spawned core is what AsyncLLM always uses: the Serve, executor and vllm serve tests.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def _logprobs(lp):
    if lp is None:
        return None
    return [{str(tok): v.logprob for tok, v in step.items()} for step in lp]


def metrics(llm, prefixes: list[str]) -> dict:
    """vLLM's metrics (``LLM.get_metrics``) named with one of ``prefixes``: counters and
    gauges summed over their labels, vectors element-wise."""
    if not prefixes:
        return {}
    out: dict = {}
    for m in llm.get_metrics():
        if not any(m.name.startswith(p) for p in prefixes):
            continue
        if hasattr(m, "values"):
            old = out.get(m.name) or [0] * len(m.values)
            out[m.name] = [a + b for a, b in zip(old, m.values, strict=False)]
        elif hasattr(m, "value"):
            out[m.name] = out.get(m.name, 0) + m.value
    return out


def start(spec: dict):
    from vllm import LLM

    if "ray_local" in spec:
        import ray

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address="local", include_dashboard=False, **spec["ray_local"])
    return LLM(model=spec["model"], seed=0, **spec.get("llm_kwargs", {}))


def stop(llm, spec: dict) -> None:
    """Stop the engine process (and free its emulated device) before the next run."""
    if llm is not None:
        llm.llm_engine.engine_core.shutdown()
    if "ray_local" in spec:
        import ray

        ray.shutdown()


def run(llm, spec: dict) -> dict:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import StructuredOutputsParams

    prompts, params, loras = [], [], []
    for req in spec["requests"]:
        lora = req.get("lora")  # {"name", "id", "path"}: a LoRARequest
        loras.append(LoRARequest(lora["name"], lora["id"], lora["path"]) if lora else None)
        if "prompt" in req:
            prompt = {"prompt": req["prompt"]}
        else:
            prompt = {"prompt_token_ids": req["prompt_token_ids"]}
        if req.get("cache_salt"):  # vLLM keeps KV of different salts apart
            prompt["cache_salt"] = req["cache_salt"]
        if req.get("images") or req.get("videos"):  # tests/vision.py's deterministic media
            sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
            from tests.vision import make_image, make_video

            media = {}
            if req.get("images"):
                media["image"] = [make_image(**i) for i in req["images"]]
            if req.get("videos"):  # numpy frames [T, H, W, 3]
                media["video"] = [make_video(**v) for v in req["videos"]]
            prompt["multi_modal_data"] = media
        prompts.append(prompt)
        kw = dict(req.get("params", {}))
        if "structured_outputs" in kw:
            kw["structured_outputs"] = StructuredOutputsParams(**kw["structured_outputs"])
        params.append(SamplingParams(**kw))
    passes = []
    for _ in range(spec.get("passes", 1)):
        lora_request = loras if any(loras) else None
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora_request)
        passes.append(
            [
                [
                    {
                        "token_ids": list(c.token_ids),
                        "text": c.text,
                        "finish_reason": c.finish_reason,
                        "logprobs": _logprobs(c.logprobs),
                        "kv_transfer_params": o.kv_transfer_params,  # a P/D prefill's
                    }
                    for c in o.outputs
                ]
                for o in outputs
            ]
        )
    # the engine's state after the generate passes (step counters), before any chat
    rpc = {m: llm.collective_rpc(m) for m in spec.get("rpc", [])}
    refusal = None
    if "refused_chat" in spec:
        asked = spec["refused_chat"]
        try:
            llm.chat(
                asked["messages"],
                SamplingParams(**asked.get("params", {})),
                use_tqdm=False,
                mm_processor_kwargs=asked["mm_processor_kwargs"],
            )
            refusal = ""
        except Exception as exc:  # noqa: BLE001 - the refusal is what the test checks
            refusal = f"{type(exc).__name__}: {exc}"
    chats = spec.get("chats", [])
    chatted = (
        llm.chat(
            [c["messages"] for c in chats],
            [SamplingParams(**c.get("params", {})) for c in chats],
            use_tqdm=False,
        )
        if chats
        else []
    )
    result = {
        "chats": [
            {
                "prompt_token_ids": list(o.prompt_token_ids),
                "token_ids": list(o.outputs[0].token_ids),
            }
            for o in chatted
        ],
        "refused_chat": refusal,
        "outputs": passes[-1],
        "prompt_token_ids": [list(o.prompt_token_ids or []) for o in outputs],
        "request_ids": [o.request_id for o in outputs],
        "passes": passes,
        "rpc": rpc,
        "metrics": metrics(llm, spec.get("metrics", [])),
        "config": {
            "max_num_seqs": llm.llm_engine.vllm_config.scheduler_config.max_num_seqs,
            "max_model_len": llm.llm_engine.vllm_config.model_config.max_model_len,
            "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
            "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
            "enable_prefix_caching": (
                llm.llm_engine.vllm_config.cache_config.enable_prefix_caching
            ),
            "kv_cache_dtype": llm.llm_engine.vllm_config.cache_config.cache_dtype,
        },
    }
    return result


# Marks the start of each run's part of stderr (the engine logs there too), so a
# failed run's root cause can be shown with it: "RUN_MARK<index>".
RUN_MARK = "=== rbln_llm_run: run "

if __name__ == "__main__":
    import logging
    import time
    import traceback

    arg = sys.argv[1]
    spec = json.loads(Path(arg[1:]).read_text() if arg.startswith("@") else arg)
    if "runs" not in spec:
        print("RESULT " + json.dumps(run(start(spec), spec)), flush=True)
        sys.exit(0)
    results = []
    log = logging.getLogger("rbln_llm_run")
    for i, one in enumerate(spec["runs"]):
        llm, started = None, time.monotonic()
        print(f"{RUN_MARK}{i}", file=sys.stderr, flush=True)  # where this run's log starts
        try:
            llm = start(one)
            results.append(run(llm, one))
        except Exception as exc:  # reported per run; the test names the failing one
            traceback.print_exc()
            results.append({"error": f"{type(exc).__name__}: {exc}"})
        finally:
            stop(llm, one)
            del llm
        log.warning("run %s: %.1f s", one["model"], time.monotonic() - started)
    print("RESULT " + json.dumps({"runs": results}), flush=True)
