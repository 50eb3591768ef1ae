"""The RBLN platform for vLLM 0.30: host tensors on the CPU, compute on RBLN devices.

It subclasses vLLM's ``CpuPlatform`` because everything vLLM itself touches (sampling,
input batches, detokenising) is host-side; the device work happens inside optimum-rbln's
runtimes, driven by :class:`~rbln_ray.vllm_plugin.worker.RBLNWorker`.

Config policy: the compiled artifact's ``rbln_config.json`` is the source of truth. Values the
user did not set are overridden from it (logged); a user value the artifact cannot honour
(``max_model_len`` above its ``max_seq_len``, a different ``block_size`` or block count) is an
error that names both values. vLLM's KV blocks are one compiled prefill chunk (128 tokens)
mapped onto the compiled RBLN blocks (:mod:`rbln_ray.vllm_plugin.kv_blocks`), so vLLM's
automatic prefix caching (on by default, ``enable_prefix_caching=False`` honoured) and
chunked prefill work on RBLN. Prefix caching is turned off (logged) for sliding-window
artifacts, as vllm-rbln does, and both are off for families whose compiled prefill cannot
resume mid-prompt (Gemma3).

Speculative decoding (vLLM's ``speculative_config``, methods ``ngram`` and ``draft_model``)
needs the artifact's verify graphs (:mod:`rbln_ray.compile.spec_graphs`; an HF directory is
compiled with them); what optimum-rbln's graphs cannot serve is refused here, naming it
(:func:`_sync_speculative`).

A compiled encoder (:mod:`rbln_ray.compile.encoders`) is configured for vLLM's pooling runner
instead: no KV cache, vLLM's own scheduler batching whole prompts up to the compiled batch,
:class:`~rbln_ray.vllm_plugin.pooling_worker.RBLNPoolingWorker`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm.platforms.cpu import CpuPlatform

from rbln_ray.compile.artifact import CompiledArtifact, load_artifact
from rbln_ray.compile.encoders import EncoderArtifact
from rbln_ray.compile.speech import SpeechArtifact
from rbln_ray.families.registry import (
    POOLING_DECODERS,
    VISION,
    PoolingDecoderFamily,
    pooling_decoder_for,
)
from rbln_ray.vllm_plugin import lora, quantization
from rbln_ray.vllm_plugin.driver_cluster import remember_driver_cluster
from rbln_ray.vllm_plugin.kv_blocks import block_layout
from rbln_ray.vllm_plugin.options import decide, engine_decisions, engine_options

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

WORKER_CLS = "rbln_ray.vllm_plugin.worker.RBLNWorker"
POOLING_WORKER_CLS = "rbln_ray.vllm_plugin.pooling_worker.RBLNPoolingWorker"
SPEECH_WORKER_CLS = "rbln_ray.vllm_plugin.speech_worker.RBLNSpeechWorker"
VLLM_SCHEDULER_CLS = "vllm.v1.core.sched.scheduler.Scheduler"
SCHEDULER_CLS = "rbln_ray.vllm_plugin.scheduler.RBLNScheduler"
ASYNC_SCHEDULER_CLS = "rbln_ray.vllm_plugin.scheduler.RBLNAsyncScheduler"
# The layers above, named (vLLM's config takes qualnames) and never imported from here: the
# platform chooses them, vLLM loads them in the processes that run them.
PIPELINE_WORKER_CLS = "rbln_ray.pipeline.worker.PipelineWorker"
RAY_EXECUTOR_CLS = "rbln_ray.executor.RBLNRayExecutor"
RAY_EXECUTOR_PACKAGE = "rbln_ray.executor"


class RBLNConfigError(ValueError):
    """A vLLM setting conflicts with what the compiled RBLN artifact supports."""


def compiled_dir(vllm_config: VllmConfig) -> str:
    """The engine's compiled directory: the model itself, or (compiled on first use) the cached
    compile of an HF directory, recorded so every later call and process reuses it."""
    from rbln_ray.compile import resolve_compiled_dir

    compiled = engine_decisions(vllm_config).compiled_dir
    if compiled is None:
        model_config = vllm_config.model_config
        settings = engine_options(vllm_config).compile
        settings = quantization.compile_settings(vllm_config, settings)
        settings = lora.compile_settings(vllm_config, settings)
        user_len = model_config.original_max_model_len
        if settings.max_seq_len is None and user_len and user_len > 0:
            settings = settings.model_copy(update={"max_seq_len": user_len})
        spec = vllm_config.speculative_config
        if spec is not None and settings.spec_tokens is None and spec.method in SPEC_METHODS:
            # speculative decoding: compile the verify graphs with the model
            settings = settings.model_copy(update={"spec_tokens": spec.num_speculative_tokens})
        if model_config.runner_type == "pooling":
            wanted = pooling_decoder_for(model_config.hf_config)
            if wanted is not None and wanted.task == "embed":  # its own graph (no LM head)
                settings = settings.model_copy(update={"purpose": "embed"})
        compiled = str(resolve_compiled_dir(model_config.model, settings))
        decide(vllm_config, compiled_dir=compiled)
    return compiled


def compiled_artifact(vllm_config: VllmConfig) -> CompiledArtifact:
    """The engine's compiled decoder (see :func:`compiled_dir`)."""
    art = load_artifact(compiled_dir(vllm_config))
    if not isinstance(art, CompiledArtifact):
        raise RBLNConfigError(f"{art.path} is a compiled encoder, not a decoder")
    return art


def compiled_model(vllm_config: VllmConfig) -> CompiledArtifact | EncoderArtifact | SpeechArtifact:
    """The engine's compiled decoder, encoder or speech model, for what all have
    (``num_devices``, ``num_stages``, ``batch_size``): the executor's placement, for one."""
    return load_artifact(compiled_dir(vllm_config))


def pooling_decoder(vllm_config: VllmConfig) -> PoolingDecoderFamily | None:
    """What a decoder engine with ``runner="pooling"`` serves (a decoder-based embedder or
    reranker, :class:`~rbln_ray.families.registry.PoolingDecoderFamily`); None for any other
    engine. Raises naming the problem when the checkpoint, the way vLLM reads it
    (``hf_overrides``) and the compiled graph do not make one such family."""
    model_config = vllm_config.model_config
    art = compiled_model(vllm_config)
    if model_config.runner_type != "pooling" or not isinstance(art, CompiledArtifact):
        return None
    wanted = pooling_decoder_for(model_config.hf_config)
    if wanted is None:
        raise RBLNConfigError(
            f"{art.path} is a compiled decoder ({art.cls_name}); as a pooling model rbln-ray "
            "serves "
            + "; ".join(
                f"{f.name} ({f.architecture}"
                + (f", hf_overrides={dict(f.hf_overrides)}" if f.hf_overrides else "")
                + ")"
                for f in POOLING_DECODERS.values()
            )
        )
    compiled = POOLING_DECODERS.get(art.pooling)
    if wanted.task == "embed" and compiled is not wanted:
        raise RBLNConfigError(
            f"{art.path} is compiled as {art.cls_name}; {wanted.name} embeds with "
            f"{wanted.optimum_class} (compile its HF directory with purpose=embed, or pass "
            "the HF directory)"
        )
    if wanted.task != "embed" and compiled is not None:
        raise RBLNConfigError(
            f"{art.path} is compiled for embeddings ({art.cls_name}); {wanted.name} reads the "
            f"causal LM's logits ({wanted.optimum_class})"
        )
    return wanted


def usable_len(art: CompiledArtifact | EncoderArtifact | SpeechArtifact) -> tuple[int, str]:
    """The longest sequence the artifact can hold, and what bounds it: its compiled
    ``max_seq_len``, or (a decoder compiled with fewer KV blocks than one such sequence
    spans) every KV block together. A prompt longer than the KV pool could never start (it
    would wait for blocks that do not exist): vLLM refuses it instead, as too long."""
    if isinstance(art, CompiledArtifact):
        pool = art.kvcache_num_blocks * art.kvcache_block_size
        if pool < art.max_seq_len:
            return pool, (
                f"the KV pool ({art.kvcache_num_blocks} blocks x {art.kvcache_block_size} tokens)"
            )
    return art.max_seq_len, f"the compiled max_seq_len={art.max_seq_len}"


def _sync_model_len(
    vllm_config: VllmConfig, art: CompiledArtifact | EncoderArtifact | SpeechArtifact
) -> None:
    model_config = vllm_config.model_config
    user_len = model_config.original_max_model_len
    usable, bound = usable_len(art)
    if user_len and user_len > usable:
        raise RBLNConfigError(
            f"max_model_len={user_len} exceeds {bound} of {art.path}; recompile with a larger "
            "max_seq_len (or more KV blocks) or lower max_model_len"
        )
    wanted = user_len if user_len and user_len > 0 else usable
    if model_config.max_model_len != wanted:
        logger.info("max_model_len %s -> %d (%s)", model_config.max_model_len, wanted, bound)
        model_config.max_model_len = wanted


def _sync_kv_cache(vllm_config: VllmConfig, art: CompiledArtifact) -> None:
    cache = vllm_config.cache_config
    layout = block_layout(art)
    if cache.user_specified_block_size and cache.block_size != layout.inner_size:
        raise RBLNConfigError(
            f"block_size={cache.block_size} conflicts with {art.path}: vLLM blocks on RBLN are "
            f"{layout.inner_size} tokens (the compiled prefill_chunk_size "
            f"{art.prefill_chunk_size} tiling kvcache_block_size {art.kvcache_block_size})"
        )
    cache.block_size = layout.inner_size
    blocks = layout.num_inner + 1  # +1: vLLM reserves block 0 as its null block
    if cache.num_gpu_blocks_override not in (None, blocks):
        raise RBLNConfigError(
            f"num_gpu_blocks_override={cache.num_gpu_blocks_override} conflicts with the compiled "
            f"kvcache_num_blocks={art.kvcache_num_blocks} of {layout.outer_size} tokens "
            f"(= {layout.num_inner} vLLM blocks of {layout.inner_size}, +1 null block = {blocks})"
        )
    cache.num_gpu_blocks_override = blocks
    if cache.enable_prefix_caching and layout.inner_size % art.prefill_chunk_size:
        # optimum-rbln resumes a prefill only at a multiple of prefill_chunk_size.
        logger.info(
            "prefix caching off: kvcache_block_size %d is not a multiple of prefill_chunk_size %d",
            art.kvcache_block_size,
            art.prefill_chunk_size,
        )
        cache.enable_prefix_caching = False
    if cache.enable_prefix_caching and art.uses_local_cache:
        # As vllm-rbln: a sliding-window slot holds only a sequence's last window tokens, in
        # a per-request slot, so no cached prefix can be adopted or copied into another.
        logger.info(
            "prefix caching off: %s uses a sliding-window KV cache (%s, window %s)",
            art.path.name,
            art.cache_impl,
            art.sliding_window,
        )
        cache.enable_prefix_caching = False
    if cache.enable_prefix_caching and not art.prefill_resumable:
        logger.info("prefix caching off: %s: %s", art.path.name, _NOT_RESUMABLE)
        cache.enable_prefix_caching = False
    vision = VISION.get(art.vision_family)
    if cache.enable_prefix_caching and vision is not None and not vision.prefix_caching:
        logger.info("prefix caching off: %s (%s): %s", art.path.name, vision.name, vision.notes)
        cache.enable_prefix_caching = False


# Why some families' prompts are prefilled whole (see rbln_ray.families.registry).
_NOT_RESUMABLE = (
    "its compiled prefill cannot start mid-prompt (optimum-rbln 0.12's "
    "RBLNDecoderOnlyChunkedMultimodalPrefillMixin builds the attention mask from position 0)"
)


def _sync_scheduler(vllm_config: VllmConfig, art: CompiledArtifact) -> None:
    sched = vllm_config.scheduler_config
    if sched.max_num_seqs > art.max_num_seqs:
        logger.info(
            "max_num_seqs %d -> %d (sequences the compiled KV cache holds)",
            sched.max_num_seqs,
            art.max_num_seqs,
        )
    elif sched.max_num_seqs < art.max_num_seqs:
        # e.g. `vllm serve DIR` without --max-num-seqs: vLLM's server default on a CPU-derived
        # platform is 128 sequences (the Serve app passes the compiled count instead).
        logger.info(
            "max_num_seqs %d of the %d sequences %s holds: --max-num-seqs %d fills its batch",
            sched.max_num_seqs,
            art.max_num_seqs,
            art.path.name,
            art.max_num_seqs,
        )
    sched.max_num_seqs = min(sched.max_num_seqs, art.max_num_seqs)
    max_len = vllm_config.model_config.max_model_len
    if sched.enable_chunked_prefill and not art.prefill_resumable:
        logger.info("chunked prefill off: %s: %s", art.path.name, _NOT_RESUMABLE)
        sched.enable_chunked_prefill = False
    vision = VISION.get(art.vision_family)
    if sched.enable_chunked_prefill and vision is not None and not vision.chunked_prefill:
        logger.info("chunked prefill off: %s (%s): %s", art.path.name, vision.name, vision.notes)
        sched.enable_chunked_prefill = False
    if sched.enable_chunked_prefill:
        # One compiled chunk per prefill step, so decodes run between a long prompt's chunks;
        # a decode step needs one token per compiled batch row.
        sched.max_num_batched_tokens = max(art.prefill_chunk_size, sched.max_num_seqs)
        sched.long_prefill_token_threshold = min(art.prefill_chunk_size, max_len)
    else:
        # The user turned chunked prefill off: whole prompts in one step (chunked inside the
        # compiled prefill graph), as vLLM does without chunking.
        sched.max_num_batched_tokens = max(sched.max_num_batched_tokens, max_len)
        sched.long_prefill_token_threshold = 0
    sched.max_num_scheduled_tokens = None
    sched.verify_max_model_len(max_len)


SPEC_METHODS = ("ngram", "draft_model")
# Why the other methods vLLM 0.30 has are refused (RBLNConfigError names the method).
_SPEC_REFUSED = {
    "eagle": "needs the target model's hidden states, which optimum-rbln's compiled graphs "
    "do not return",
    "mtp": "needs the target model's hidden states and its multi-token-prediction layers, "
    "which optimum-rbln does not compile",
    "medusa": "needs extra decoding heads on the target's hidden states, which optimum-rbln "
    "does not compile",
    "suffix": "needs vLLM's suffix-decoding proposer (arctic_inference), not supported yet",
}
# The artifact geometry a draft model shares with its target (it uses the target's blocks).
DRAFT_GEOMETRY = (
    "max_seq_len",
    "kvcache_block_size",
    "kvcache_num_blocks",
    "prefill_chunk_size",
    "decoder_batch_sizes",
    "batch_size",
)


def _spec_refusal(method: str) -> str:
    for prefix, why in _SPEC_REFUSED.items():
        if method.startswith(prefix):
            return why
    if method in ("mlp_speculator", "dflash", "dspark", "extract_hidden_states"):
        return _SPEC_REFUSED["eagle"]
    return "not supported on RBLN"


def _sync_speculative(vllm_config: VllmConfig, art: CompiledArtifact) -> None:
    """Speculative decoding on RBLN (ngram, draft_model) with synchronous scheduling; refuse,
    naming it, what the compiled graphs cannot serve."""
    spec = vllm_config.speculative_config
    if spec is None:
        return
    method, k = str(spec.method), spec.num_speculative_tokens
    if method not in SPEC_METHODS:
        raise RBLNConfigError(
            f"speculative_config method={method!r}: {_spec_refusal(method)}; speculative "
            f"decoding on RBLN supports {', '.join(SPEC_METHODS)}"
        )
    refused = [
        (spec.parallel_drafting, "parallel_drafting"),
        (spec.use_heterogeneous_vocab, "use_heterogeneous_vocab"),
        (spec.draft_sample_method != "greedy", f"draft_sample_method={spec.draft_sample_method!r}"),
        (spec.rejection_sample_method == "block", "rejection_sample_method='block'"),
        (
            spec.num_speculative_tokens_per_batch_size is not None,
            "num_speculative_tokens_per_batch_size (the RBLN scheduler decides per step "
            "whether to speculate: additional_config rbln_spec_policy)",
        ),
    ]
    for bad, what in refused:
        if bad:
            raise RBLNConfigError(f"speculative_config {what} is not supported on RBLN")
    where = f"speculative decoding ({method}) on {art.path}"
    if art.num_stages > 1:
        raise RBLNConfigError(f"{where}: pipeline stages ({art.num_stages}) are not supported")
    if art.uses_local_cache:
        raise RBLNConfigError(
            f"{where}: its {art.cache_impl} KV cache (sliding window {art.sliding_window}) "
            "decodes one token per call; verify graphs need several"
        )
    if art.is_multimodal:
        raise RBLNConfigError(f"{where}: vision-language models are not supported")
    if art.state_slots:
        raise RBLNConfigError(
            f"{where}: linear-attention layers keep one state per sequence, which a verify "
            "call cannot roll back past rejected drafts"
        )
    if art.use_position_ids:
        raise RBLNConfigError(f"{where}: graphs with position ids are not supported")
    if art.spec_tokens < k:
        have = f"verify graphs for {art.spec_tokens}" if art.spec_tokens else "no verify graphs"
        raise RBLNConfigError(
            f"{where}: num_speculative_tokens={k} but the artifact has {have} draft tokens; "
            f"recompile it with `rbln-ray compile --spec-tokens {k}` (or serve the HF "
            "directory: it is compiled with them)"
        )
    if k + 1 > art.prefill_chunk_size:
        raise RBLNConfigError(f"{where}: num_speculative_tokens={k} exceeds a prefill chunk")
    if method == "draft_model":
        _sync_draft_model(vllm_config, art)
    sched = vllm_config.scheduler_config
    slots = spec.max_num_new_slots_for_drafting
    # A decode step schedules 1 + k tokens per row (vLLM truncates drafts past the budget);
    # vLLM also keeps `slots` tokens of the budget per request for drafting, which must not
    # cut a prefill chunk short (the compiled prefill resumes only at whole chunks).
    sched.max_num_batched_tokens = max(
        sched.max_num_batched_tokens,
        art.prefill_chunk_size + slots,
        sched.max_num_seqs * (1 + k + slots),
    )
    sched.max_num_scheduled_tokens = None
    if sched.async_scheduling:
        # vLLM itself refuses async scheduling with `ngram` (its re-check in the engine
        # process raises); the RBLN runner's async path (filling vLLM's draft placeholders
        # with its own proposals) is not verified token-exact, so neither method uses it.
        logger.info(
            "async scheduling off: speculative decoding (%s) on RBLN runs synchronously", method
        )
    sched.async_scheduling = False
    from rbln_ray.emulator import timing

    if spec.rejection_sample_method != "synthetic" and timing.emulator_mode() == "timing":
        logger.warning(
            "speculative decoding in the emulator's timing mode: outputs are zeros, so every "
            "draft is accepted; use rejection_sample_method='synthetic' with "
            "synthetic_acceptance_rates, or RBLN_RAY_EMULATOR_MODE=modelled"
        )


def draft_compiled_dir(vllm_config: VllmConfig, art: CompiledArtifact) -> str:
    """The draft model's compiled directory: itself, or its HF directory compiled once with
    the target's KV geometry and a width-2 verify graph."""
    from rbln_ray.compile import CompileSettings, resolve_compiled_dir

    decided = engine_decisions(vllm_config).draft_compiled_dir
    if decided is not None:
        return decided
    spec = vllm_config.speculative_config
    model = spec.draft_model_config.model if spec.draft_model_config else spec.model
    settings = CompileSettings(
        batch_size=art.batch_size,
        max_seq_len=art.max_seq_len,
        attn_impl="flash_attn" if art.attn_impl == "flash_attn" else "eager",
        kvcache_partition_len=art.kvcache_block_size if art.attn_impl == "flash_attn" else None,
        num_devices=art.num_devices,
        use_attention_mask=art.use_attention_mask,
        decoder_batch_sizes=art.decoder_batch_sizes,
        kvcache_num_blocks=art.kvcache_num_blocks,
        spec_tokens=1,
    )
    compiled = str(resolve_compiled_dir(model, settings))
    decide(vllm_config, draft_compiled_dir=compiled)
    return compiled


def _sync_draft_model(vllm_config: VllmConfig, art: CompiledArtifact) -> None:
    draft = load_artifact(draft_compiled_dir(vllm_config, art))
    if not isinstance(draft, CompiledArtifact):
        raise RBLNConfigError(f"draft model {draft.path} is a compiled encoder, not a decoder")
    where = f"draft model {draft.path} for {art.path}"
    for name in DRAFT_GEOMETRY:
        mine, theirs = getattr(draft, name), getattr(art, name)
        if mine != theirs:
            raise RBLNConfigError(
                f"{where}: {name}={mine} differs from the target's {theirs}; the draft uses "
                "the target's KV blocks, so compile it with the target's geometry (or give "
                "its HF directory: it is compiled so)"
            )
    if draft.uses_local_cache or draft.num_stages > 1 or draft.is_multimodal:
        raise RBLNConfigError(f"{where}: a sliding-window, staged or vision-language draft")
    if draft.spec_tokens < 1:
        raise RBLNConfigError(
            f"{where}: it has no verify graphs; recompile it with `rbln-ray compile "
            "--spec-tokens 1`"
        )


def _sync_async_scheduling(vllm_config: VllmConfig, requested_backend: object) -> None:
    """Async scheduling (vLLM schedules step N+1 while step N runs) is on by default.

    vLLM decides it before this hook from the executor the user named; for ``"ray"`` it sees
    its own Ray executor, which cannot, and turns it off. On RBLN ``"ray"`` means
    ``RBLNRayExecutor``, which can, so rbln-ray's default applies there. Any other choice of
    the user (``async_scheduling=False``, ``--no-async-scheduling``) is kept.
    """
    sched = vllm_config.scheduler_config
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        # vLLM 0.30's v1 runner path runs pipeline stages with its batch queue (one
        # micro-batch per stage in flight), not with async scheduling.
        if sched.async_scheduling:
            logger.info("async scheduling off: pipeline stages overlap through the batch queue")
        sched.async_scheduling = False
    elif vllm_config.speculative_config is not None:
        sched.async_scheduling = False  # _sync_speculative: synchronous scheduling
    elif requested_backend == "ray" and not sched.async_scheduling:
        logger.info("async scheduling on: the RBLN Ray executor supports it")
        sched.async_scheduling = True
    sched.scheduler_cls = ASYNC_SCHEDULER_CLS if sched.async_scheduling else SCHEDULER_CLS


def _sync_parallel(vllm_config: VllmConfig, art: CompiledArtifact) -> None:
    """One vLLM pipeline-parallel rank per compiled stage; no tensor parallelism in vLLM.

    Sharding inside a node is the compiled shard group (``num_devices``, one process on N
    devices), not vLLM's TP; across stages it is vLLM's own pipeline-parallel contract.
    """
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1:
        raise RBLNConfigError(
            f"tensor_parallel_size={parallel.tensor_parallel_size}: on RBLN a model is sharded "
            f"over the devices it was compiled for (num_devices={art.num_devices} in "
            f"{art.path}); leave tensor_parallel_size at 1"
        )
    if parallel.pipeline_parallel_size not in (1, art.num_stages):
        raise RBLNConfigError(
            f"pipeline_parallel_size={parallel.pipeline_parallel_size} conflicts with "
            f"{art.path}, compiled as {art.num_stages} pipeline stage(s)"
        )
    if art.num_stages > 1 and art.uses_local_cache:
        raise RBLNConfigError(
            f"{art.path}: pipeline stages of a sliding-window ({art.cache_impl}) artifact are "
            "not supported"
        )
    parallel.pipeline_parallel_size = art.num_stages
    parallel.world_size = art.num_stages
    parallel.worker_cls = PIPELINE_WORKER_CLS if art.num_stages > 1 else WORKER_CLS
    if art.num_stages > 1 and parallel.distributed_executor_backend in (None, "mp", "uni"):
        # Stages are separate Ray actors: a staged artifact always runs on the Ray executor.
        logger.info("%d pipeline stages: using the RBLN Ray executor", art.num_stages)
        parallel.distributed_executor_backend = RAY_EXECUTOR_CLS
    _sync_executor(vllm_config)


def _sync_executor(vllm_config: VllmConfig) -> None:
    """``"ray"`` means the RBLN Ray executor; multiprocessing means one in-process worker (the
    devices sit behind one process either way)."""
    parallel = vllm_config.parallel_config
    if parallel.distributed_executor_backend == "ray":
        parallel.distributed_executor_backend = RAY_EXECUTOR_CLS
    elif parallel.distributed_executor_backend in (None, "mp"):
        parallel.distributed_executor_backend = "uni"
    backend = parallel.distributed_executor_backend
    if backend == RAY_EXECUTOR_CLS or (
        isinstance(backend, type) and backend.__module__.startswith(RAY_EXECUTOR_PACKAGE)
    ):
        # The engine core starts in a new process: tell it which Ray cluster the driver uses.
        remember_driver_cluster(vllm_config)


def _sync_multimodal(vllm_config: VllmConfig, art: CompiledArtifact) -> None:
    """vLLM casts a request's preprocessed pixels to the model dtype (its multimodal
    processor's ``_postprocess_output``), and vLLM's "auto" dtype downcasts a float32 model
    to bfloat16 on the CPU; the compiled vision tower computes in the artifact's dtype, so the
    pixels must reach it in that dtype (bfloat16 pixels would change the image features)."""
    import torch

    model_config = vllm_config.model_config
    dtype = getattr(torch, art.dtype)
    if model_config.dtype != dtype:
        logger.info("dtype %s -> %s (compiled vision-language artifact)", model_config.dtype, dtype)
        model_config.dtype = dtype


def _sync_decoder(vllm_config: VllmConfig, art: CompiledArtifact) -> None:
    if pooling_decoder(vllm_config) is not None:
        _sync_pooling(vllm_config, art)
        return
    if art.pooling:
        raise RBLNConfigError(
            f"{art.path} is compiled for embeddings ({art.cls_name}, no decode graph): serve "
            "it with runner='pooling'"
        )
    _sync_model_len(vllm_config, art)
    _sync_kv_cache(vllm_config, art)
    _sync_scheduler(vllm_config, art)
    if art.is_multimodal:
        _sync_multimodal(vllm_config, art)
    _sync_speculative(vllm_config, art)
    requested_backend = vllm_config.parallel_config.distributed_executor_backend
    _sync_parallel(vllm_config, art)
    _sync_async_scheduling(vllm_config, requested_backend)


def _sync_encoder(vllm_config: VllmConfig, art: EncoderArtifact) -> None:
    """An encoder runs whole prompts, up to ``batch_size`` of them per compiled call, with no
    KV cache: vLLM's own scheduler (no RBLN block plan to make), no prefix caching, no
    chunking, one in-process or Ray worker."""
    model_config = vllm_config.model_config
    if model_config.runner_type != "pooling":
        raise RBLNConfigError(
            f"{art.path} is a compiled {art.family.architecture} encoder: it serves "
            "embeddings or scores (runner='pooling'), not text generation"
        )
    _sync_pooling(vllm_config, art)
    sched = vllm_config.scheduler_config
    sched.max_num_seqs = min(sched.max_num_seqs, art.batch_size)
    sched.max_num_batched_tokens = art.batch_size * model_config.max_model_len


def _sync_pooling(vllm_config: VllmConfig, art: CompiledArtifact | EncoderArtifact) -> None:
    """A pooling model (an encoder, or a decoder read as an embedder or reranker) runs each
    prompt whole, in the step that schedules it, and keeps nothing for later steps: vLLM's own
    scheduler (no RBLN block plan to make, no KV blocks for vLLM to manage), no prefix
    caching, no chunking, one in-process or Ray worker."""
    model_config = vllm_config.model_config
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise RBLNConfigError(
            f"{art.path}: a pooling model runs on the devices it was compiled for; leave "
            "tensor_parallel_size and pipeline_parallel_size at 1"
        )
    _sync_model_len(vllm_config, art)
    vllm_config.cache_config.enable_prefix_caching = False
    sched = vllm_config.scheduler_config
    sched.enable_chunked_prefill = False
    # whole prompts: at least one of the longest per step
    sched.max_num_batched_tokens = max(sched.max_num_batched_tokens, model_config.max_model_len)
    sched.long_prefill_token_threshold = 0
    sched.max_num_scheduled_tokens = None
    sched.async_scheduling = False  # nothing to overlap: a step's output is its last
    sched.verify_max_model_len(model_config.max_model_len)
    parallel.worker_cls = POOLING_WORKER_CLS
    _sync_executor(vllm_config)


def _sync_speech(vllm_config: VllmConfig, art: SpeechArtifact) -> None:
    """A speech encoder-decoder (Whisper): vLLM's own scheduler and encoder budget (its
    encoder-decoder path: each request's audio is scheduled with its decoder prompt, which
    runs whole), one KV block per sequence, and a block id that names the request's row:
    vLLM's block ``b`` is the compiled self-attention block and cross-attention slot
    ``b - 1`` (block 0 is vLLM's null block), the row of every decoder call the request takes
    part in (optimum's decoder reads row *i*'s cross-attention from slot *i*)."""
    import torch

    model_config = vllm_config.model_config
    if model_config.runner_type != "generate":
        raise RBLNConfigError(
            f"{art.path} is a compiled {art.family.architecture}: it transcribes and "
            f"translates audio (runner='generate'), not runner={model_config.runner_type!r}"
        )
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        raise RBLNConfigError(
            f"{art.path}: a speech model runs on the devices it was compiled for; leave "
            "tensor_parallel_size and pipeline_parallel_size at 1"
        )
    if vllm_config.lora_config is not None:
        raise RBLNConfigError(f"{art.path}: LoRA adapters are not compiled into this model")
    _sync_model_len(vllm_config, art)
    cache = vllm_config.cache_config
    if cache.user_specified_block_size and cache.block_size != art.kvcache_block_size:
        raise RBLNConfigError(
            f"block_size={cache.block_size} conflicts with {art.path}: one block holds a "
            f"whole sequence ({art.kvcache_block_size} tokens)"
        )
    cache.block_size = art.kvcache_block_size
    cache.num_gpu_blocks_override = art.batch_size + 1  # +1: vLLM's null block
    cache.enable_prefix_caching = False  # vLLM has none for encoder-decoder models either
    sched = vllm_config.scheduler_config
    sched.max_num_seqs = min(sched.max_num_seqs, art.batch_size)
    sched.enable_chunked_prefill = False
    sched.long_prefill_token_threshold = 0
    sched.max_num_scheduled_tokens = None
    audio = int(getattr(model_config.hf_config, "max_source_positions", art.enc_max_seq_len))
    sched.max_num_batched_tokens = max(
        sched.max_num_batched_tokens, model_config.max_model_len, audio
    )
    # vLLM sized these from max_num_batched_tokens before this hook: room for a new audio in
    # every row in one step
    sched.max_num_encoder_input_tokens = sched.encoder_cache_size = art.batch_size * audio
    sched.async_scheduling = False
    sched.scheduler_cls = VLLM_SCHEDULER_CLS
    sched.verify_max_model_len(model_config.max_model_len)
    dtype = getattr(torch, art.dtype)
    if model_config.dtype != dtype:  # the mel features reach the encoder in its dtype
        logger.info("dtype %s -> %s (compiled speech artifact)", model_config.dtype, dtype)
        model_config.dtype = dtype
    parallel.worker_cls = SPEECH_WORKER_CLS
    _sync_executor(vllm_config)


class RBLNPlatform(CpuPlatform):
    """vLLM platform for Rebellions RBLN NPUs (ATOM), real or emulated."""

    device_name = "rbln"
    ray_device_key = "RBLN"
    device_control_env_var = "RBLN_DEVICES"
    # vLLM's small host-side helpers (its CPU sampler's random sample, logprobs) are
    # torch.compile'd with this backend. The device work is compiled by rebel, never by
    # inductor, and "inductor" would build C++ in every engine process at its first sampled
    # step (seconds per replica start) into the machine-wide cache /tmp/torchinductor_root,
    # where a process killed mid-build (a replica stopped while it starts) leaves a truncated
    # .so that fails every later process on the machine ("file too short"). Eager runs the
    # same ops.
    simple_compile_backend = "eager"

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        import rebel  # the real runtime or the emulator; the plugin activated one

        return rebel.get_npu_name(device_id)

    @classmethod
    def pre_register_and_update(cls, parser=None) -> None:
        """Before vLLM builds its configs: rbln-ray's quantization method (quantized
        artifacts keep their checkpoint's quantization_config), and on ``vllm serve``'s
        parser, --lora-modules recorded for the engine (adapters are compiled in)."""
        from rbln_ray.vllm_plugin import quant_config  # imports vLLM's quantization package

        quant_config.register()
        if parser is not None:
            lora.record_cli_modules(parser)

    @classmethod
    def check_and_update_config(cls, vllm_config: VllmConfig) -> None:
        """Align vLLM with the compiled artifact. Idempotent: vLLM calls it in the driver and
        again in the engine-core process, so everything derives from ``rbln_config.json``."""
        from vllm.config import CompilationMode

        if vllm_config.model_config is None:
            return
        engine_options(vllm_config)  # invalid options fail here, in the driver
        quantization.check_request(vllm_config)  # before anything compiles
        lora.check_request(vllm_config)
        art = compiled_model(vllm_config)
        if isinstance(art, EncoderArtifact):
            _sync_encoder(vllm_config, art)
        elif isinstance(art, SpeechArtifact):
            _sync_speech(vllm_config, art)
        else:
            _sync_decoder(vllm_config, art)
        quantization.sync(vllm_config, art)
        lora.sync(vllm_config, art)
        vllm_config.model_config.disable_cascade_attn = True
        vllm_config.compilation_config.mode = CompilationMode.NONE
        vllm_config.compilation_config.cudagraph_capture_sizes = []

    @classmethod
    def validate_request(cls, processed_inputs, params) -> None:
        """Reject what the compiled graphs cannot compute, with a message naming it."""
        if getattr(params, "prompt_logprobs", None) is not None:
            from vllm.exceptions import VLLMValidationError

            # A client error (400): vLLM's engine turns any other exception raised here
            # into an EngineGenerateError, a 500 with no message.
            raise VLLMValidationError(
                "prompt_logprobs (and echo with logprobs) is not supported on RBLN: the "
                "compiled prefill graph returns logits for the last prompt token only",
                parameter="prompt_logprobs",
            )
