"""Compile a Hugging Face decoder into S pipeline stages with ``rebel.compile_from_torch``.

Why this reuses optimum-rbln as far as it does: optimum's config logic (``prepare_rbln_config``
/ ``update_rbln_config``) decides block size, chunk size, KV cache shapes and the graph input
contract, and its ``_wrap_model_if_needed`` converts the HF layers to RBLN attention layers.
Using both keeps a stage's graphs identical in kernels, shapes and names to the matching slice
of optimum's own single-graph compile; only the slicing (:class:`StageGraph`) is ours.

Each stage gets its own ``CompileContext`` with its own layers' KV buffers marked static, so
the stage's prefill and decode graphs share them when loaded in one process, and stages on
different devices/nodes never share anything.
"""

from __future__ import annotations

import logging
import shutil
import time
from pathlib import Path
from typing import Any

from rbln_ray.common.dtypes import torch_dtype
from rbln_ray.compile.pipeline_manifest import PipelineManifest, StageSpec, split_layers
from rbln_ray.compile.settings import CompileSettings
from rbln_ray.families.registry import family_for_dir
from rbln_ray.upstream import optimum_internals, torch_internals

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt")


def _stage_input_info(
    optimum_info: list[tuple[str, list[int], Any]],
    spec: StageSpec,
    hidden_size: int,
    dtype: Any,
) -> list[tuple[str, list[int], Any]]:
    """optimum's input contract for one graph, narrowed to what ``spec``'s stage takes."""
    kv = set(spec.kv_names)
    info = []
    for name, shape, dt in optimum_info:
        if name == "input_ids" and not spec.has_embedding:
            info.append(("inputs_embeds", [*shape, hidden_size], dtype))
        elif name == "query_position" and not spec.has_lm_head:
            continue
        elif name.startswith("past_key_values"):
            if name in kv:
                info.append((name, shape, dt))
        else:
            info.append((name, shape, dt))
    return info


def _example_inputs(info, static: dict[str, Any]) -> list[Any]:
    import torch

    out = []
    for name, shape, dt in info:
        if name.startswith("past_key_values"):
            if name not in static:
                # Meta tensors, as optimum uses: no host memory for KV at compile time.
                static[name] = torch.zeros(shape, dtype=torch_dtype(dt), device="meta")
            out.append(static[name])
        else:
            out.append(torch.zeros(shape, dtype=torch_dtype(dt)))
    return out


def _lm_head_in_layers(text_config: Any) -> float:
    """The LM head's weights in decoder layers' worth (what the last stage carries extra)."""
    from rbln_ray.npu.cost_model import ModelShape

    shape = ModelShape.from_hf_config(text_config.to_dict())
    return shape.vocab_size * shape.hidden_size / shape.layer_params


def _copy_hf_files(hf_dir: Path, out: Path) -> None:
    """config, generation config and tokenizer files, so vLLM loads them from ``out``."""
    for path in hf_dir.iterdir():
        if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy2(path, out / path.name)


def compile_pipeline(
    hf_dir: str | Path,
    out_dir: str | Path,
    stages: int,
    settings: CompileSettings,
    *,
    micro_batches: int | None = None,
) -> Path:
    """Compile ``hf_dir`` into ``stages`` stage directories under ``out_dir`` plus a manifest.

    ``settings.num_devices`` is per stage (each stage a shard group of that many ATOMs).
    Returns ``out_dir``. ``settings.batch_size`` is one micro-batch (the compiled decode
    graph's rows); the KV cache holds ``micro_batches`` (default: ``stages``) of them at full
    length, so vLLM's pipeline batch queue keeps one micro-batch in every stage. The block
    count is fixed, so every stage has the same and one block table drives all of them (a
    ``kvcache_num_blocks`` setting is refused).
    """
    if settings.kvcache_num_blocks is not None:
        raise ValueError(
            "kvcache_num_blocks cannot be combined with pipeline stages (every stage is "
            "compiled with full KV capacity)"
        )
    import torch

    from rbln_ray.emulator import require_runtime

    require_runtime("compile pipeline stages")
    import optimum.rbln as orb
    import rebel
    from optimum.rbln.modeling_base import normalize_contiguous_
    from optimum.rbln.utils.runtime_utils import compiler_num_devices_kwarg
    from rebel.compile_context import CompileContext
    from transformers import AutoModelForCausalLM

    from rbln_ray.compile.stage_graph import StageGraph

    hf_dir, out = Path(hf_dir), Path(out_dir)
    arch = family_for_dir(hf_dir).architecture
    started = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    text_config = model.config.get_text_config()
    num_layers = text_config.num_hidden_layers
    ranges = split_layers(num_layers, stages, head_layers=_lm_head_in_layers(text_config))
    settings = settings.with_max_seq_len(text_config.to_dict())

    cls = getattr(orb, f"RBLN{arch}")
    micro_batches = stages if micro_batches is None else micro_batches
    if micro_batches < 1:
        raise ValueError(f"micro_batches must be >= 1, not {micro_batches}")
    # eager attention: one KV block is a whole sequence
    partition = settings.kvcache_partition_len
    blocks_per_seq = 1 if partition is None else settings.max_seq_len // partition
    sizes = settings.decoder_batch_sizes
    kwargs = settings.rbln_kwargs(
        decoder_batch_sizes=sorted(set(sizes), reverse=True) if sizes else None,
        # Full capacity for every micro-batch, fixed: an automatic count could differ by stage.
        kvcache_num_blocks=micro_batches * settings.batch_size * blocks_per_seq,
    )
    rbln_config, unused = cls.prepare_rbln_config(rbln_config=None, **kwargs)
    if unused:
        raise ValueError(f"unknown compile options {sorted(unused)}")
    rbln_config = cls.update_rbln_config(
        preprocessors=[], model=model, model_config=model.config, rbln_config=rbln_config
    )
    if rbln_config.use_attention_mask or rbln_config.sliding_window_layers:
        raise NotImplementedError("pipeline stages support causal attention without masks only")
    wrapper = optimum_internals.compile_wrapper(cls, model, rbln_config)
    normalize_contiguous_(wrapper)
    compile_cfgs = rbln_config.compile_cfgs  # [prefill, decoder_batch_<b>...]
    dec_sizes = list(rbln_config.decoder_batch_sizes)
    graph_names = ["prefill"] + [f"decoder_batch_{b}" for b in dec_sizes]
    hidden_size = text_config.hidden_size

    out.mkdir(parents=True, exist_ok=True)
    specs: list[StageSpec] = []
    # optimum's own compile swap: linear layers become the RBLN custom op in the graph.
    with torch_internals.rbln_linear_while_compiling():
        for index, (start, end) in enumerate(ranges):
            first, last = index == 0, index == stages - 1
            kv_names = tuple(
                f"past_key_values_{2 * layer + k}" for layer in range(start, end) for k in (0, 1)
            )
            spec = StageSpec(
                index=index,
                layer_start=start,
                layer_end=end,
                has_embedding=first,
                has_lm_head=last,
                subdir=f"stage_{index}",
                num_devices=settings.num_devices,
                kv_names=kv_names,
            )
            graph = StageGraph(wrapper, start, end, first=first, last=last).eval()
            stage_dir = out / spec.subdir
            stage_dir.mkdir(exist_ok=True)
            context = CompileContext(use_weight_sharing=True)
            static: dict[str, Any] = {}
            input_names: tuple[str, ...] = ()
            for name, cfg in zip(graph_names, compile_cfgs, strict=True):
                graph.phase = "prefill" if name == "prefill" else "decode"
                info = _stage_input_info(cfg.input_info, spec, hidden_size, rbln_config.dtype)
                examples = _example_inputs(info, static)
                if name == "prefill":
                    for kv_name in kv_names:
                        context.mark_static_address(static[kv_name], kv_name)
                    input_names = tuple(n for n, _, _ in info if n not in static)
                with torch.inference_mode():
                    compiled = rebel.compile_from_torch(
                        graph,
                        input_info=info,
                        npu=rbln_config.npu,
                        example_inputs=examples,
                        compile_context=context,
                        **{compiler_num_devices_kwarg(): settings.num_devices},
                    )
                compiled.save(stage_dir / f"{name}.rbln")
            specs.append(StageSpec(**{**spec.__dict__, "input_names": input_names}))
            logger.info("stage %d: layers [%d, %d) compiled", index, start, end)

    manifest = PipelineManifest(
        architecture=arch,
        num_hidden_layers=num_layers,
        hidden_size=hidden_size,
        vocab_size=text_config.vocab_size,
        batch_size=rbln_config.batch_size,
        max_seq_len=rbln_config.max_seq_len,
        kvcache_block_size=rbln_config.kvcache_block_size,
        kvcache_num_blocks=rbln_config.kvcache_num_blocks,
        attn_impl=rbln_config.attn_impl,
        kvcache_partition_len=rbln_config.kvcache_partition_len,
        prefill_chunk_size=rbln_config.prefill_chunk_size,
        decoder_batch_sizes=tuple(sorted(dec_sizes)),
        stages=tuple(specs),
        npu=rbln_config.npu,
        max_num_seqs=micro_batches * rbln_config.batch_size,
    )
    _copy_hf_files(hf_dir, out)
    manifest.save(out)
    logger.info(
        "compiled %s into %d stages at %s in %.1f s",
        hf_dir,
        stages,
        out,
        time.monotonic() - started,
    )
    return out
