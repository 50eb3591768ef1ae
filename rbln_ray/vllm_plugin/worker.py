"""RBLN worker: vLLM's ``WorkerBase`` for one process that owns a shard group of devices.

The KV cache lives inside the compiled runtimes (static buffers), so this worker reports a
nominal KV spec of vLLM blocks (one prefill chunk each) whose count covers the compiled RBLN
blocks exactly (+1 null block, see :mod:`rbln_ray.vllm_plugin.kv_blocks`), and allocates
nothing itself.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheSpec
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
from vllm.v1.worker.worker_base import CompilationTimes, WorkerBase

from rbln_ray.common import envs, framing
from rbln_ray.compile.artifact import CompiledArtifact
from rbln_ray.emulator import is_emulated
from rbln_ray.families.registry import VISION
from rbln_ray.vllm_plugin.device_metrics import DeviceMetrics
from rbln_ray.vllm_plugin.host_kv_connector import open_tier
from rbln_ray.vllm_plugin.host_transfer import HostTransfer, kv_layout
from rbln_ray.vllm_plugin.kv_blocks import block_layout
from rbln_ray.vllm_plugin.loader import load_compiled_model
from rbln_ray.vllm_plugin.lora import CompiledLoRAWorker
from rbln_ray.vllm_plugin.model_runner import RBLNModelRunner
from rbln_ray.vllm_plugin.platform import compiled_artifact
from rbln_ray.vllm_plugin.spec.verify import Speculator
from rbln_ray.vllm_plugin.step_loop import Ahead, Deferred, StepLoop

logger = logging.getLogger(__name__)

KV_LAYER = "rbln.kv"  # one nominal layer: vLLM only needs the block count and size


class RBLNWorker(CompiledLoRAWorker, WorkerBase):
    """Loads the compiled model on this process's RBLN devices and runs scheduler steps."""

    artifact: CompiledArtifact
    model_runner: RBLNModelRunner
    metrics: DeviceMetrics | None = None  # in a Ray actor: its devices' Ray metrics
    _step_listener: framing.Listener | None = None
    _step_loop: StepLoop | None = None  # the Ray executor's path only (accept_step_stream)

    def init_device(self) -> None:
        self.device = torch.device("cpu")
        if is_emulated():
            # An emulated device computes on host cores; one thread each keeps several
            # emulated devices on a small host from fighting over OpenMP barriers.
            torch.set_num_threads(envs.get("RBLN_RAY_EMULATOR_THREADS") or 1)
        self._resolve_artifact()
        n = self.artifact.num_devices
        # Indices into this process's visible devices (RBLN_DEVICES, set by Ray per actor).
        self.device_ids = list(range(self.local_rank * n, (self.local_rank + 1) * n))
        logger.info(
            "RBLN worker rank %d: devices %s (RBLN_DEVICES=%s)",
            self.rank,
            self.device_ids,
            os.environ.get("RBLN_DEVICES"),
        )
        self.metrics = DeviceMetrics.for_this_worker(
            self.vllm_config.model_config.served_model_name, self.artifact.batch_size
        )

    def _resolve_artifact(self) -> None:
        self.artifact = compiled_artifact(self.vllm_config)
        self.layout = block_layout(self.artifact)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        model = load_compiled_model(self.artifact, self.device_ids)
        speculator = None
        if self.vllm_config.speculative_config is not None:
            speculator = self._load_speculator()
        self.model_runner = RBLNModelRunner(
            self.vllm_config, self.artifact, model, self.layout, speculator=speculator
        )
        self.model_runner.host = self._host_transfer(model)

    def _host_transfer(self, model: Any) -> HostTransfer | None:
        """The node's host KV tier, when the engine's kv_transfer_config switches it on
        (:mod:`rbln_ray.vllm_plugin.host_kv_connector`)."""
        tier = open_tier(self.vllm_config)
        if tier is None:
            return None
        runtime = model.prefill_decoder.runtime  # shares its KV buffers with the decoders
        hf_config = self.vllm_config.model_config.hf_text_config
        return HostTransfer(runtime, kv_layout(runtime, self.artifact, hf_config), tier)

    def get_kv_connector_handshake_metadata(self) -> dict | None:
        """vLLM's engine asks every worker (collective_rpc) when a KV connector is on; the
        host tier needs no handshake (its data is on the node, found by key)."""
        return None

    def _load_speculator(self) -> Speculator:
        """Speculative decoding: the artifact's verify runtimes (right after the model: they
        share its KV buffers) and the proposer (a draft model loads on the same devices)."""
        from rbln_ray.compile.artifact import load_artifact
        from rbln_ray.compile.spec_graphs import load_verify_runtimes
        from rbln_ray.vllm_plugin.options import engine_decisions
        from rbln_ray.vllm_plugin.spec.proposers import DraftModelDrafter, NgramDrafter

        ids = self.device_ids
        device: int | list[int] = ids[0] if len(ids) == 1 else list(ids)
        art = self.artifact
        verify = load_verify_runtimes(art.path, art.verify_graphs, device)
        spec = self.vllm_config.speculative_config
        if spec.method == "draft_model":
            draft_art = load_artifact(engine_decisions(self.vllm_config).draft_compiled_dir)
            draft = load_compiled_model(draft_art, ids)
            pairs = load_verify_runtimes(draft_art.path, draft_art.verify_graphs, device)
            return Speculator(verify, DraftModelDrafter(draft, draft_art, pairs))
        return Speculator(verify, NgramDrafter(self.vllm_config))

    def take_draft_token_ids(self) -> DraftTokenIds | None:
        """The drafts proposed after the last step (vLLM's synchronous engine asks)."""
        return self.model_runner.take_draft_token_ids()

    def _kv_blocks(self) -> tuple[int, int, str]:
        """(tokens per vLLM block, vLLM blocks the compiled cache holds, what holds them):
        vLLM plans exactly that many (+1 null block), never a memory-derived number."""
        layout = self.layout
        held = f"the compiled model's {layout.num_outer} RBLN blocks hold {layout.num_inner}"
        return layout.inner_size, layout.num_inner, held

    def get_kv_cache_spec(self) -> dict[str, KVCacheSpec]:
        block_size, _, _ = self._kv_blocks()
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=1,
            head_size=1,
            dtype=torch.float32,
        )
        return {KV_LAYER: spec}

    def determine_available_memory(self) -> int:
        spec = self.get_kv_cache_spec()[KV_LAYER]
        return (self._kv_blocks()[1] + 1) * spec.page_size_bytes

    def initialize_from_config(self, kv_cache_config: KVCacheConfig) -> None:
        _, blocks, held = self._kv_blocks()
        if kv_cache_config.num_blocks != blocks + 1:
            raise RuntimeError(
                f"vLLM planned {kv_cache_config.num_blocks} KV blocks; {held} (+1 null block)"
            )

    def compile_or_warm_up_model(self) -> CompilationTimes:
        return CompilationTimes(language_model=0.0, encoder=0.0)

    def get_supported_tasks(self) -> tuple[str, ...]:
        # A decoder over audio features (Qwen3-ASR) also transcribes, as vLLM's own runner
        # reports for a model that supports transcription: vLLM then serves /v1/audio/*.
        family = VISION.get(self.artifact.vision_family)
        return ("generate", "transcription") if family and family.transcribes else ("generate",)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        output = self.model_runner.execute_model(scheduler_output)
        self._observe_step()
        return output

    def sample_tokens(self, grammar_output: GrammarOutput | None) -> ModelRunnerOutput:
        return self.model_runner.sample_tokens(grammar_output)

    def _observe_step(self) -> None:
        if self.metrics is not None:
            self.metrics.observe(self.model_runner.stats, len(self.model_runner.requests))

    # -- the step stream (the Ray executor's per-step path, see step_loop) -------------------
    def open_step_stream(self, token: str) -> tuple[str, int]:
        """Listen for the engine's step stream; the address the executor connects to."""
        import ray

        self._step_listener = framing.Listener(ray.util.get_node_ip_address(), token)
        return self._step_listener.address

    def accept_step_stream(self, reports_results: bool) -> None:
        """Take the engine's connection and start the step loop on it."""
        if self._step_listener is None:
            raise RuntimeError(f"worker {self.rank}: accept_step_stream before open_step_stream")
        conn, self._step_listener = self._step_listener.accept(), None
        self._step_loop = StepLoop(
            conn,
            self.run_step,
            reports_results=reports_results,
            urgent_results=self.urgent_results,
            prepare=self.prepare_ahead,
            name=f"rbln-steps-{self.rank}",
        )
        self.model_runner.before_device = self._step_loop.release_held

    def run_step(
        self, seq: int, step: SchedulerOutput | Ahead, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | Deferred:
        """One whole step on the step loop: what the engine's ``execute_model`` +
        ``sample_tokens`` pair does."""
        if isinstance(step, Ahead):  # its inputs built on the reader thread (prepare_ahead)
            runner = self.model_runner
            output = runner.launch(runner.prepare(step.scheduler_output, step.get()))
        else:
            output = self.model_runner.execute_model(step)
        if output is not None:
            self._observe_step()
            return output
        return self.finish_later(self.model_runner.sample(grammar_output))

    def finish_later(self, output: Callable[[], Any]) -> Deferred:
        """A step's output, built and sent by the step loop once the next step's device call
        has started, then its device metrics (a dozen Ray metric calls, BENCHMARKS §10): neither
        delays the device."""
        return Deferred(output, then=self._observe_step)

    @property
    def urgent_results(self) -> bool:
        """Whether the step loop sends a result before it reads the next step (StepLoop)."""
        return False

    @property
    def prepare_ahead(self) -> Callable[[SchedulerOutput], Any] | None:
        """What the step loop prepares on its reader thread, while earlier steps are on the
        device (StepLoop): a decode step's inputs but its token ids, which need the previous
        step's sampling (RBLNModelRunner.decode_ahead)."""
        return self.model_runner.decode_ahead

    def step_stats(self) -> dict:
        """Runner counters (collective_rpc target for tests and benchmarks)."""
        from dataclasses import asdict

        stats = asdict(self.model_runner.stats)
        stats["slots_in_use"] = len(self.model_runner.requests)
        stats["batch_size"] = self.artifact.batch_size
        return stats

    def device_info(self) -> dict:
        """Where this worker runs: pid, node, the devices it pinned (collective_rpc target)."""
        return {
            "pid": os.getpid(),
            "rbln_devices": os.environ.get("RBLN_DEVICES"),
            "device_ids": self.device_ids,
            "node": envs.get("RBLN_RAY_NODE_ID"),
        }

    def check_health(self) -> None:
        return

    def shutdown(self) -> None:
        if self._step_loop is not None:
            self._step_loop.stop()
        self.model_runner = None  # type: ignore[assignment]
