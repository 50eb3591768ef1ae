"""Speculative decoding's verify graphs: one decode call that scores ``k + 1`` tokens per
sequence, compiled inside optimum-rbln's own decoder compile.

Why a graph of its own: vLLM's speculative decoding checks ``k`` draft tokens by computing
the target model's logits at the last accepted token and at every draft in one forward
pass. optimum-rbln compiles a prefill graph (one sequence, ``prefill_chunk_size`` tokens) and
decode graphs (``[B, 1]``); neither scores a batch of short windows. The verify graph is
optimum's own compile-time wrapper in its ``"decode"`` phase with ``input_ids`` and
``cache_position`` of ``[B, W]`` (``W = k + 1``): the decode attention kernels
(``paged_(flash_)causal_attn_decode``) take any query length and write token ``i`` of row
``b`` at ``cache_position[b, 0] + i``, attending causally; the LM head runs on every
position, so the graph returns logits ``[B, W, V]``. Compiled in optimum's own compile
context (:func:`rbln_ray.upstream.optimum_internals.extra_graphs`), it shares the model's
weights and static KV buffers with ``prefill`` and ``decoder_batch_*``: what it writes is in
the cache the next decode or verify call reads, and what a rejected draft wrote sits at
positions the next call overwrites before anything reads them.

Artifact layout: ``spec/verify_batch_{B}_w{W}.rbln`` per compiled decode batch, listed in
``rbln_spec.json`` (``{"format": 1, "spec_tokens": k, "graphs": [{"name", "batch",
"width", "file"}]}``). Loading: :func:`load_verify_runtimes`, right after optimum's own load
on the same devices.

Not compiled (refused with the reason): sliding-window and hybrid caches (optimum's decode
path writes one token per call to the window, ``valid_input_len = 1``), inputs given as
embeddings, and graphs with ``position_ids`` (their ``[B, S]`` mask cannot be causal within
the window).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rbln_ray.common.artifact_files import SPEC_DIR, SPEC_MANIFEST

FORMAT = 1
WIDENED = ("input_ids", "cache_position")  # [B, 1] in a decode graph, [B, W] here


class SpecGraphError(ValueError):
    """A compiled model cannot get verify graphs (the message names why)."""


@dataclass(frozen=True)
class VerifyGraph:
    """One compiled verify graph: decode batch ``batch``, ``width`` tokens per row."""

    batch: int
    width: int
    file: str  # relative to the compiled directory

    @property
    def name(self) -> str:
        return graph_name(self.batch, self.width)


def graph_name(batch: int, width: int) -> str:
    return f"verify_batch_{batch}_w{width}"


def unsupported_reason(rbln_config: Any) -> str | None:
    """Why optimum's decoder config cannot verify several tokens per call (None: it can)."""
    cache_impl = getattr(rbln_config, "cache_impl", "static") or "static"
    if cache_impl != "static":
        return (
            f"its KV cache is {cache_impl!r}: optimum-rbln's sliding-window decode writes one "
            "token per call"
        )
    if getattr(rbln_config, "use_inputs_embeds", False):
        return "it takes input embeddings (a vision-language model's language model)"
    if getattr(rbln_config, "use_position_ids", False):
        return "its decode graphs take position ids with a [batch, max_seq_len] mask"
    if getattr(rbln_config, "use_lora", False):
        return "it is compiled with LoRA adapters"
    return None


def verify_input_info(
    decode_info: list[tuple[str, list[int], str]], width: int
) -> list[tuple[str, list[int], str]]:
    """A ``[B, 1]`` decode graph's inputs widened to ``width`` tokens per row (the 4-D
    attention mask gets one row per query token)."""
    out = []
    for name, shape, dtype in decode_info:
        if name in WIDENED:
            shape = [shape[0], width]
        elif name == "attention_mask" and len(shape) == 4:
            shape = [shape[0], 1, width, shape[-1]]
        out.append((name, list(shape), dtype))
    return out


def build_verify_graphs(spec_tokens: int, batch_sizes: list[int] | None = None):
    """The :func:`~rbln_ray.upstream.optimum_internals.extra_graphs` builder for width
    ``spec_tokens + 1`` at every compiled decode batch size (or ``batch_sizes``)."""

    def build(compiler: Any) -> dict[str, Any]:
        rbln_config = compiler.rbln_config
        reason = unsupported_reason(rbln_config)
        if reason is not None:
            raise SpecGraphError(f"no verify graphs for {compiler.cls.__name__}: {reason}")
        width = spec_tokens + 1
        graphs = {}
        for batch in batch_sizes or list(rbln_config.decoder_batch_sizes):
            info = verify_input_info(compiler.input_info(batch, 1), width)
            graphs[graph_name(batch, width)] = compiler.compile(
                graph_name(batch, width), info, phase="decode"
            )
        return graphs

    return build


def save_verify_graphs(out_dir: Path, graphs: dict[str, Any], spec_tokens: int) -> None:
    """Save the compiled graphs under ``out_dir/spec`` and list them in the manifest."""
    entries = []
    (out_dir / SPEC_DIR).mkdir(exist_ok=True)
    for name, compiled in sorted(graphs.items()):
        batch, width = _parse(name)
        rel = f"{SPEC_DIR}/{name}.rbln"
        compiled.save(out_dir / rel)
        entries.append({"name": name, "batch": batch, "width": width, "file": rel})
    manifest = {"format": FORMAT, "spec_tokens": spec_tokens, "graphs": entries}
    (out_dir / SPEC_MANIFEST).write_text(json.dumps(manifest, indent=2))


def _parse(name: str) -> tuple[int, int]:
    batch, width = name.removeprefix("verify_batch_").split("_w")
    return int(batch), int(width)


def read_manifest(compiled_dir: Path) -> tuple[VerifyGraph, ...]:
    """The verify graphs a compiled directory has (none without a manifest)."""
    path = Path(compiled_dir) / SPEC_MANIFEST
    if not path.is_file():
        return ()
    raw = json.loads(path.read_text())
    if raw.get("format") != FORMAT:
        raise SpecGraphError(f"{path}: format {raw.get('format')!r}, expected {FORMAT}")
    return tuple(
        VerifyGraph(int(g["batch"]), int(g["width"]), str(g["file"])) for g in raw["graphs"]
    )


def load_verify_runtimes(compiled_dir: Path, graphs: tuple[VerifyGraph, ...], device: Any):
    """``{batch: rebel.Runtime}`` of the widest verify graph per batch, on ``device``.

    Call right after optimum loaded the model on the same devices: a runtime of a graph
    compiled in the model's compile context shares that load's static KV buffers (the
    emulator joins the newest load of the compile group that lacks the graph). Runtimes are
    called positionally, in the graph's input order, as optimum calls its own."""
    import rebel

    widest: dict[int, VerifyGraph] = {}
    for g in graphs:
        if g.batch not in widest or g.width > widest[g.batch].width:
            widest[g.batch] = g
    return {
        batch: rebel.Runtime(
            rebel.RBLNCompiledModel(str(Path(compiled_dir) / g.file)),
            tensor_type="pt",
            device=device,
        )
        for batch, g in sorted(widest.items())
    }
