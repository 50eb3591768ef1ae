"""Online serving: the rbln-ray Serve app vs ``vllm serve`` (vLLM-CPU), plus Serve overhead.

For each concurrency level the same load generator (streaming /v1/completions, token-id
prompts, ignore_eos, fixed max_tokens) runs against:
  1. the rbln-ray Serve app (1 replica, emulated ATOM) over HTTP;
  2. rbln-ray in-process: vLLM ``AsyncLLM`` on the RBLN platform, same compiled model;
  3. ``vllm serve`` = ``python -m vllm.entrypoints.openai.api_server`` (plain vLLM-CPU, the
     same HF weights, same max_num_seqs) over HTTP;
  4. vLLM-CPU in-process (``AsyncLLM``), for vLLM's own HTTP overhead.
Reported: req/s, output tok/s, TTFT/TPOT/ITL/E2E mean/p50/p99 (vllm bench serve
conventions). Serve overhead = (1) output tok/s / (2) output tok/s; the goal is >= 0.98.

Those runs use compute mode: the emulated ATOM computes on the same 2 host cores as HTTP, so
every cycle Serve spends is taken from the "device". On ATOM the device computes off the
host; ``--goal-shape`` (default llama-3-8b) repeats (1) and (2) in emulator timing mode with
that model's device time, and (2) once more with the worker in a Ray actor
(RBLNRayExecutor, as in the Serve replica). The goal is judged on Serve HTTP / that Ray
in-process engine: what Serve's HTTP, routing and streaming cost. The other ratios are
reported beside it.

    python -m benchmarks.online_serving [--quick] [--emulator-mode timing --timing-shape ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from benchmarks import common
from benchmarks.loadgen import run_load, wait_ready

GOAL_SERVE_RATIO = 0.98  # Serve HTTP / in-process on the same (Ray) executor, modelled ATOM
GOAL_RAY_EXECUTOR_RATIO = 0.99  # in-process: the Ray executor / vLLM's in-process worker


def http_runs(name: str, url: str, prompts, concurrencies, args) -> dict:
    """The load generator at each concurrency against a server that is starting at ``url``."""
    asyncio.run(wait_ready(url, 600))
    out = {}
    for c in concurrencies:
        out[str(c)] = asyncio.run(run_load(url, "demo", prompts, args.output_len, c))
        _print(name, c, out[str(c)])
    return out


def serve_runs(compiled, prompts, concurrencies, args) -> dict:
    """(1): the Serve app with one replica, in ``args.emulator_mode``."""
    import ray
    from ray import serve

    common.emulator_env(args.emulator_mode, args.timing_shape)
    common.start_local_ray(num_cpus=8, rbln_devices=4)
    try:
        port = common.free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        url = common.deploy_serve_app(compiled, 1, port)
        return http_runs("serve-http", url, prompts, concurrencies, args)
    finally:
        serve.shutdown()
        ray.shutdown()


def vllm_serve_runs(hf_dir, prompts, concurrencies, args) -> dict:
    options = ["--max-model-len", str(args.max_seq_len), "--max-num-seqs", str(args.batch)]
    log = common.RESULTS / "vllm_serve.log"
    with common.vllm_serve(
        hf_dir, "demo", [*options, "--no-enable-prefix-caching"], log=log
    ) as url:
        return http_runs("vllm-serve", url, prompts, concurrencies, args)


def inprocess_runs(backend, model, concurrencies, args, executor: str = "uni") -> dict:
    out = {}
    for c in concurrencies:
        spec = {
            "backend": backend,
            "executor": executor,
            "model": str(model),
            "api": "async",
            "concurrency": c,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "max_num_seqs": args.batch,
            "max_model_len": args.max_seq_len,
            "emulator_mode": args.emulator_mode,
            "timing_shape": args.timing_shape,
            "warmup": 2,
        }
        out[str(c)] = common.run_json("engine_run.py", spec, common.base_env(), timeout=3600)
        _print(f"{backend}-inproc{'-ray' if executor == 'ray' else ''}", c, out[str(c)])
    return out


def modelled_atom_runs(compiled, hf_dir, args) -> dict:
    """Serve HTTP vs in-process with ATOM's device time modelled (timing mode, goal shape)."""
    targs = argparse.Namespace(
        **{
            **vars(args),
            "emulator_mode": "timing",
            "timing_shape": args.goal_shape,
            "num_prompts": args.goal_num_prompts,
            "input_len": args.goal_len,
            "output_len": args.goal_len,
        }
    )
    concurrencies = [int(c) for c in args.goal_concurrency.split(",")]
    prompts = common.prompts(targs.num_prompts, targs.input_len, common.vocab_of(hf_dir))
    print(f"== modelled ATOM ({args.goal_shape}, timing mode): Serve overhead", flush=True)
    return {
        "rbln-ray serve (http)": serve_runs(compiled, prompts, concurrencies, targs),
        "rbln-ray in-process, ray executor": inprocess_runs(
            "rbln", compiled, concurrencies, targs, executor="ray"
        ),
        "rbln-ray in-process": inprocess_runs("rbln", compiled, concurrencies, targs),
    }


def ratio(results: dict, http: str, inproc: str) -> dict:
    """Output tok/s of ``http`` / ``inproc`` per concurrency (both must have run)."""
    if http not in results or inproc not in results:
        return {}
    return {
        c: results[http][c]["output_tok_per_s"] / results[inproc][c]["output_tok_per_s"]
        for c in results[http]
    }


def _goal(results: dict, http: str, inproc: str, least: float) -> dict:
    r = ratio(results, http, inproc)
    return {"ratio_by_concurrency": r, "goal": least, "met": bool(r) and min(r.values()) >= least}


def _print(name: str, c: int, r: dict) -> None:
    print(
        f"   {name:>16} c={c:<3} {r['req_per_s']:6.2f} req/s {r['output_tok_per_s']:8.1f} tok/s "
        f"TTFT p50 {r['ttft_ms']['p50']:.0f} ms TPOT p50 {r['tpot_ms']['p50']:.1f} ms "
        f"failed {r['failed']}",
        flush=True,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--concurrency", default="1,4,8", help="comma list")
    p.add_argument("--num-prompts", type=int, default=48)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-seq-len", type=int, default=1024)
    p.add_argument("--emulator-mode", choices=["compute", "timing"], default="compute")
    p.add_argument("--timing-shape", default="")
    p.add_argument("--skip", default="", help="comma list of: serve,rbln,vllm-serve,vllm-cpu")
    p.add_argument("--goal-shape", default="llama-3-8b", help="timing-mode pass; '' skips it")
    p.add_argument("--goal-concurrency", default="4,8")
    p.add_argument("--goal-num-prompts", type=int, default=16)
    p.add_argument("--goal-len", type=int, default=64, help="input and output tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.num_prompts, args.input_len, args.output_len = "4", 8, 32, 16
        args.goal_concurrency, args.goal_num_prompts, args.goal_len = "4", 8, 16
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    skip = set(filter(None, args.skip.split(",")))
    hf_dir, compiled = common.compiled_demo(args.batch, args.max_seq_len)
    prompts = common.prompts(args.num_prompts, args.input_len, common.vocab_of(hf_dir))
    common.RESULTS.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    t0 = time.time()
    if "serve" not in skip:
        print("== rbln-ray Serve app over HTTP", flush=True)
        results["rbln-ray serve (http)"] = serve_runs(compiled, prompts, concurrencies, args)
    if "rbln" not in skip:
        print("== rbln-ray AsyncLLM in-process", flush=True)
        results["rbln-ray in-process"] = inprocess_runs("rbln", compiled, concurrencies, args)
    if "vllm-serve" not in skip:
        print("== vllm serve (vLLM-CPU) over HTTP", flush=True)
        results["vllm-cpu serve (http)"] = vllm_serve_runs(hf_dir, prompts, concurrencies, args)
    if "vllm-cpu" not in skip:
        print("== vLLM-CPU AsyncLLM in-process", flush=True)
        results["vllm-cpu in-process"] = inprocess_runs("vllm-cpu", hf_dir, concurrencies, args)

    modelled: dict[str, dict] = {}
    if args.goal_shape:
        modelled = modelled_atom_runs(compiled, hf_dir, args)

    goals = {
        "serve_http_over_in_process": _goal(
            modelled,
            "rbln-ray serve (http)",
            "rbln-ray in-process, ray executor",
            GOAL_SERVE_RATIO,
        )
        | {"device_model": args.goal_shape, "baseline": "in-process AsyncLLM, Ray executor"},
        "ray_executor_over_in_process_worker": _goal(
            modelled,
            "rbln-ray in-process, ray executor",
            "rbln-ray in-process",
            GOAL_RAY_EXECUTOR_RATIO,
        )
        | {"device_model": args.goal_shape, "baseline": "in-process AsyncLLM, vLLM's worker"},
        "serve_http_over_in_process_uni_executor_modelled": ratio(
            modelled, "rbln-ray serve (http)", "rbln-ray in-process"
        ),
        "serve_http_over_in_process_compute_mode": ratio(
            results, "rbln-ray serve (http)", "rbln-ray in-process"
        ),
        "vllm_http_over_in_process": ratio(results, "vllm-cpu serve (http)", "vllm-cpu in-process"),
    }
    common.save(
        "online_serving",
        {
            "settings": vars(args) | {"compiled": str(compiled), "hf_dir": str(hf_dir)},
            "wall_s": time.time() - t0,
            "results": results,
            "results_modelled_atom": modelled,
            "goals": goals,
            "note": (
                "emulator timing mode: rbln-ray outputs are garbage, latencies are modelled"
                if args.emulator_mode == "timing"
                else "compute mode: rbln-ray devices compute on the same host CPU as vLLM-CPU"
            ),
        },
        args.quick,
    )
    plt = common.pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(17, 4))
    for name, per_c in results.items():
        xs = [int(c) for c in per_c]
        axes[0].plot(xs, [per_c[str(c)]["output_tok_per_s"] for c in xs], marker="o", label=name)
        axes[1].plot(xs, [per_c[str(c)]["ttft_ms"]["p50"] for c in xs], marker="o", label=name)
        axes[2].plot(xs, [per_c[str(c)]["tpot_ms"]["p50"] for c in xs], marker="o", label=name)
    for ax, title in zip(axes[:3], ["output tok/s", "TTFT p50 (ms)", "TPOT p50 (ms)"], strict=True):
        ax.set_xlabel("concurrency")
        ax.set_title(title)
    axes[0].legend(fontsize=7)
    for name, goal in goals.items():
        ratios = goal.get("ratio_by_concurrency", goal)  # the judged goal, or a plain ratio
        if ratios:
            xs = sorted(int(c) for c in ratios)
            axes[3].plot(xs, [ratios[str(c)] for c in xs], marker="o", label=name)
    axes[3].axhline(GOAL_SERVE_RATIO, linestyle=":", color="gray")
    axes[3].set_title("HTTP / in-process throughput")
    axes[3].set_xlabel("concurrency")
    axes[3].legend(fontsize=6)
    fig.suptitle(f"online serving ({args.emulator_mode} mode){' quick' if args.quick else ''}")
    fig.tight_layout()
    fig.savefig(common.plot_path("online_serving", args.quick))
    for name in ("serve_http_over_in_process", "ray_executor_over_in_process_worker"):
        g = goals[name]
        print(f"goal {name} >= {g['goal']}: {'MET' if g['met'] else 'NOT MET'} {g}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    raise SystemExit(main())
