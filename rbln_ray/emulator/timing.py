"""Emulator *timing mode*: an ATOM/REBEL latency model, spent sleeping instead of computing.

Why: on a 2-core host the emulator can run one or two devices' worth of real compute. For
replica scaling and capacity planning we need many emulated devices at once with realistic
device latency, so in timing mode (``RBLN_RAY_EMULATOR_MODE=timing``) a ``rebel.Runtime``
call does **not** run the graph: it works out the FLOPs and DRAM bytes of the call from the
model's shape and the call's inputs, converts them to seconds with a roofline model of the
device kind being emulated (ATOM by default, REBEL with ``RBLN_RAY_EMULATED_NPU=rebel``; see
:mod:`rbln_ray.emulator.device_kinds`) and sleeps that long (no CPU burnt, the GIL released).

**Outputs in timing mode are zeros and the KV cache is never written: generated text is
garbage by design.** Timing mode exists for throughput/latency measurements only; it is never
on by default, it logs a warning in every process that enables it, and ``Runtime`` reprs say
``timing``. Nothing that checks token correctness may run with it.

The same cost model (:func:`call_cost`) drives ``rbln-ray plan`` (``--device atom|rebel``).

Model of one device call (roofline, one compiled graph invocation):

- FLOPs = 2 x (decoder-layer parameters) x (tokens in the call, padding rows included, since
  compiled graphs have static shapes) + 2 x vocab x hidden x (rows returning logits)
  + attention 4 x layers x q_heads x head_dim x sum(new tokens x attended context).
- bytes = all weights except the embedding table (read once per call; the LM head is read
  in full) + KV read (cached context of every row) + KV write (new tokens)
  + activations (~(6 x hidden + 2 x intermediate) x tokens x layers) + logits.
- seconds = max(FLOPs / (peak x compute_eff), bytes / (bandwidth x dram_eff)) / tp_eff(N)
  + per-call overhead (+ a per-layer sync cost when the graph spans N > 1 devices).

Weights and KV are costed in FP16 (2 bytes); REBEL's FP8 path is not modelled.

Device parameters (published where marked; every other figure is an assumption):

=========================  ======================  ======================================
parameter                  ATOM (RBLN-CA25)        REBEL-Quad (RBLN-CR13)
=========================  ======================  ======================================
peak FLOPS (FP16)          32 T (published)        1 P (reported from Rebellions' ISSCC
                                                   2026 paper: 2 PFLOPS FP8 / 1 PFLOPS
                                                   FP16 dense; not on the product page)
DRAM bandwidth             256 GB/s (assumption:   2.7 TB/s (published: "effective
                           GDDR6, unpublished)     bandwidth with software-tuned DMA")
compute efficiency         0.6 (assumption)        0.6 (assumption)
DRAM efficiency            0.8 (assumption)        1.0 (assumption: the published figure
                                                   is already an effective bandwidth)
per-call overhead          100 us (assumption)     100 us (assumption)
shard-group efficiency     0.85 (assumption)       0.85 (assumption)
per-layer sync, N > 1      10 us (assumption)      10 us (assumption)
usable DRAM                16 GiB - 288 MiB        4 x (36 GiB - 1 GiB) = 140 GiB
                           (optimum-rbln)          (optimum-rbln; 144 GB HBM3E published)
=========================  ======================  ======================================

Overrides (environment, all optional; they apply to whichever kind is emulated):

=====================================  ==============================================
``RBLN_RAY_TIMING_PEAK_TFLOPS``        peak FP16 TFLOPS
``RBLN_RAY_TIMING_DRAM_GBPS``          DRAM bandwidth, GB/s
``RBLN_RAY_TIMING_COMPUTE_EFF``        achieved fraction of peak FLOPs
``RBLN_RAY_TIMING_DRAM_EFF``           achieved fraction of DRAM bandwidth
``RBLN_RAY_TIMING_CALL_US``            fixed cost per runtime call (launch, sync)
``RBLN_RAY_TIMING_TP_EFF``             efficiency of a shard group of N > 1 devices
``RBLN_RAY_TIMING_SYNC_US``            per-layer cross-device sync cost when N > 1
``RBLN_RAY_TIMING_SHAPE``              model the latency of a preset (e.g.
                                       ``llama-3-8b``) or a JSON shape instead of
                                       the compiled graph's own config
=====================================  ==============================================
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rbln_ray.emulator import device_kinds

logger = logging.getLogger(__name__)

MODE_ENV = "RBLN_RAY_EMULATOR_MODE"
SHAPE_ENV = "RBLN_RAY_TIMING_SHAPE"
DEVICE_DRAM_BYTES = device_kinds.ATOM.budget  # ATOM's usable DRAM (the default device)


# ----------------------------------------------------------------------------- parameters
@dataclass(frozen=True)
class DeviceSpec:
    """One device, as the timing model sees it (defaults: ATOM; see the module table)."""

    peak_flops: float = 32e12
    dram_bytes_per_s: float = 256e9
    compute_eff: float = 0.6
    dram_eff: float = 0.8
    call_overhead_s: float = 100e-6
    tp_eff: float = 0.85
    sync_per_layer_s: float = 10e-6
    dram_capacity: int = DEVICE_DRAM_BYTES
    name: str = device_kinds.ATOM.family

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, kind: str | None = None) -> DeviceSpec:
        """The spec of ``kind`` (default: the emulated kind) with the env overrides applied."""
        env = os.environ if environ is None else environ
        base = spec_for(kind or device_kinds.current().family)

        def get(name: str, default: float, scale: float = 1.0) -> float:
            raw = env.get(name)
            return float(raw) * scale if raw not in (None, "") else default

        return replace(
            base,
            peak_flops=get("RBLN_RAY_TIMING_PEAK_TFLOPS", base.peak_flops, 1e12),
            dram_bytes_per_s=get("RBLN_RAY_TIMING_DRAM_GBPS", base.dram_bytes_per_s, 1e9),
            compute_eff=get("RBLN_RAY_TIMING_COMPUTE_EFF", base.compute_eff),
            dram_eff=get("RBLN_RAY_TIMING_DRAM_EFF", base.dram_eff),
            call_overhead_s=get("RBLN_RAY_TIMING_CALL_US", base.call_overhead_s, 1e-6),
            tp_eff=get("RBLN_RAY_TIMING_TP_EFF", base.tp_eff),
            sync_per_layer_s=get("RBLN_RAY_TIMING_SYNC_US", base.sync_per_layer_s, 1e-6),
        )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


# Kept for callers written before REBEL: the class is the same, its defaults are ATOM's.
AtomSpec = DeviceSpec

ATOM_SPEC = DeviceSpec()
REBEL_SPEC = DeviceSpec(
    peak_flops=1e15,
    dram_bytes_per_s=2.7e12,
    dram_eff=1.0,
    dram_capacity=device_kinds.REBEL.budget,
    name=device_kinds.REBEL.family,
)
SPECS = {"atom": ATOM_SPEC, "rebel": REBEL_SPEC}


def spec_for(kind: str) -> DeviceSpec:
    """The timing parameters of a device kind (``atom``/``rebel`` or an NPU name)."""
    return SPECS[device_kinds.kind_by_name(kind).family.lower()]


@dataclass(frozen=True)
class ModelShape:
    """What the cost model needs to know about a decoder-only transformer.

    Mixture-of-experts models (``num_experts`` > 0) hold every expert's weights (memory,
    capacity) but compute only ``experts_per_token`` experts per token (FLOPs); a call reads
    the weights of the experts its tokens are routed to (see :meth:`expert_fraction_read`).
    """

    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense MLP width; with experts, each expert's width
    vocab_size: int
    tie_word_embeddings: bool = False
    weight_bytes: int = 2  # per parameter on the device (FP16)
    kv_bytes: int = 2  # per KV element on the device
    name: str = "custom"
    gated_mlp: bool = True  # gate/up/down (Llama, Gemma, Mixtral...); False: up/down (GPT2, OPT)
    num_experts: int = 0  # routed experts per layer (0: dense MLP)
    experts_per_token: int = 0
    shared_expert_size: int = 0  # width of an always-active shared expert (Qwen2-MoE)

    @property
    def _mlp_matrices(self) -> int:
        return 3 if self.gated_mlp else 2

    @property
    def attention_params(self) -> int:
        h, q, kv = (
            self.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        return h * q + 2 * h * kv + q * h + 2 * h  # + two norms

    @property
    def expert_params(self) -> int:
        """One MLP (one expert, or the dense MLP)."""
        return self._mlp_matrices * self.hidden_size * self.intermediate_size

    @property
    def _always_active_params(self) -> int:
        """Per layer: attention, router and shared expert (computed for every token)."""
        router = self.hidden_size * self.num_experts
        shared = self._mlp_matrices * self.hidden_size * self.shared_expert_size
        return self.attention_params + router + shared

    @property
    def layer_params(self) -> int:
        """Parameters one layer stores (every expert)."""
        return self._always_active_params + self.expert_params * max(1, self.num_experts)

    @property
    def active_layer_params(self) -> int:
        """Parameters one token computes with per layer (only its routed experts)."""
        active = self.experts_per_token if self.num_experts else 1
        return self._always_active_params + self.expert_params * active

    def expert_fraction_read(self, tokens: int) -> float:
        """Expected share of a layer's experts a call with ``tokens`` tokens reads: each
        token picks ``experts_per_token`` of ``num_experts`` (uniform routing assumed), so
        ``1 - (1 - k/E) ** tokens``; 1 for a dense model."""
        if not self.num_experts:
            return 1.0
        return 1.0 - (1.0 - self.experts_per_token / self.num_experts) ** max(0, tokens)

    @property
    def params(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.layer_params + embeddings + self.hidden_size

    @property
    def active_params(self) -> int:
        """Parameters computed per token (MoE: only the routed experts)."""
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * self.active_layer_params + embeddings + self.hidden_size

    @property
    def weight_bytes_total(self) -> int:
        return self.params * self.weight_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "custom") -> ModelShape:
        """The shape of an HF ``config.json`` (Llama-style names; GPT2's ``n_*``, OPT's
        ``ffn_dim``, the MoE families' expert fields understood)."""
        cfg = {**cfg.get("text_config", {}), **cfg} if "text_config" in cfg else cfg
        heads = int(cfg.get("num_attention_heads") or cfg["n_head"])
        hidden = int(cfg.get("hidden_size") or cfg["n_embd"])
        experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
        dense = cfg.get("intermediate_size") or cfg.get("ffn_dim") or cfg.get("n_inner")
        width = cfg.get("moe_intermediate_size") if experts else None
        model_type = cfg.get("model_type", "")
        return cls(
            num_layers=int(cfg.get("num_hidden_layers") or cfg["n_layer"]),
            hidden_size=hidden,
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            intermediate_size=int(width or dense or 4 * hidden),
            vocab_size=int(cfg["vocab_size"]),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            name=name,
            gated_mlp=model_type not in ("gpt2", "opt", "phi"),
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "params": self.params,
            "active_params": self.active_params,
            "kv_bytes_per_token": self.kv_bytes_per_token,
        }


# Public architecture numbers of common models (config.json values).
PRESETS: dict[str, ModelShape] = {
    "llama-3.2-1b": ModelShape(16, 2048, 32, 8, 64, 8192, 128256, True, name="llama-3.2-1b"),
    "llama-3.2-3b": ModelShape(28, 3072, 24, 8, 128, 8192, 128256, True, name="llama-3.2-3b"),
    "llama-2-7b": ModelShape(32, 4096, 32, 32, 128, 11008, 32000, name="llama-2-7b"),
    "llama-3-8b": ModelShape(32, 4096, 32, 8, 128, 14336, 128256, name="llama-3-8b"),
    "mistral-7b": ModelShape(32, 4096, 32, 8, 128, 14336, 32768, name="mistral-7b"),
    "qwen2.5-7b": ModelShape(28, 3584, 28, 4, 128, 18944, 152064, name="qwen2.5-7b"),
    "llama-2-13b": ModelShape(40, 5120, 40, 40, 128, 13824, 32000, name="llama-2-13b"),
    "llama-3-70b": ModelShape(80, 8192, 64, 8, 128, 28672, 128256, name="llama-3-70b"),
    # model-zoo families (google/gemma-2-9b, microsoft/phi-2, mistralai/Mixtral-8x7B-v0.1,
    # Qwen/Qwen1.5-MoE-A2.7B, Qwen/Qwen3-30B-A3B, openai/gpt-oss-20b config.json values;
    # sliding-window layers are costed as full attention: an upper bound)
    "gemma-2-9b": ModelShape(42, 3584, 16, 8, 256, 14336, 256000, True, name="gemma-2-9b"),
    "phi-2": ModelShape(32, 2560, 32, 32, 80, 10240, 51200, name="phi-2", gated_mlp=False),
    "mixtral-8x7b": ModelShape(
        32,
        4096,
        32,
        8,
        128,
        14336,
        32000,
        name="mixtral-8x7b",
        num_experts=8,
        experts_per_token=2,
    ),
    "qwen1.5-moe-a2.7b": ModelShape(
        24,
        2048,
        16,
        16,
        128,
        1408,
        151936,
        name="qwen1.5-moe-a2.7b",
        num_experts=60,
        experts_per_token=4,
        shared_expert_size=5632,
    ),
    "qwen3-30b-a3b": ModelShape(
        48,
        2048,
        32,
        4,
        128,
        768,
        151936,
        name="qwen3-30b-a3b",
        num_experts=128,
        experts_per_token=8,
    ),
    "gpt-oss-20b": ModelShape(
        24,
        2880,
        64,
        8,
        64,
        2880,
        201088,
        name="gpt-oss-20b",
        num_experts=32,
        experts_per_token=4,
    ),
}


def preset(name: str) -> ModelShape:
    key = name.strip().lower()
    if key not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return PRESETS[key]


def shape_from_spec(spec: str) -> ModelShape:
    """A preset name, a JSON object of HF config fields, or a path to a ``config.json``."""
    spec = spec.strip()
    if spec.startswith("{"):
        return ModelShape.from_hf_config(json.loads(spec))
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return ModelShape.from_hf_config(json.loads(path.read_text()), name=path.parent.name)
    return preset(spec)


# ----------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class Row:
    """One sequence in a call: ``new`` tokens computed after ``start`` cached ones."""

    new: int
    start: int = 0


@dataclass(frozen=True)
class CallCost:
    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    seconds: float
    bound: str  # "compute" or "bandwidth"
    breakdown: dict[str, float] = field(default_factory=dict)


def call_cost(
    shape: ModelShape,
    rows: list[Row],
    logit_rows: int,
    spec: DeviceSpec | None = None,
    num_devices: int = 1,
    lm_head: bool = True,
) -> CallCost:
    """Device time of one compiled-graph call (see the module docstring for the formula).

    ``lm_head=False``: a pipeline stage before the last, which neither reads the LM head's
    weights nor computes logits (``logit_rows`` is then ignored).
    """
    spec = spec or DeviceSpec()
    logit_rows = logit_rows if lm_head else 0
    n = max(1, int(num_devices))
    L, H = shape.num_layers, shape.hidden_size  # noqa: N806 - the usual symbols
    tokens = sum(r.new for r in rows)
    q_dim = shape.num_heads * shape.head_dim
    attended = sum(r.new * (r.start + (r.new + 1) / 2) for r in rows)  # causal within the call
    flops_linear = 2.0 * L * shape.active_layer_params * tokens  # MoE: routed experts only
    flops_head = 2.0 * shape.vocab_size * H * logit_rows
    flops_attn = 4.0 * L * q_dim * attended
    flops = flops_linear + flops_head + flops_attn

    per_token_kv = shape.kv_bytes_per_token
    experts_read = shape.expert_params * max(1, shape.num_experts)
    experts_read *= shape.expert_fraction_read(tokens)
    layer_read = shape.layer_params - shape.expert_params * max(1, shape.num_experts)
    weights = (L * (layer_read + experts_read) + (shape.vocab_size * H if lm_head else 0)) * (
        shape.weight_bytes
    )
    kv_read = per_token_kv * sum(r.start for r in rows)
    kv_write = per_token_kv * tokens
    mlp_width = shape.intermediate_size * (shape.experts_per_token or 1) + shape.shared_expert_size
    act = L * tokens * (6 * H + 2 * mlp_width) * 2 + logit_rows * shape.vocab_size * 4
    nbytes = float(weights + kv_read + kv_write + act)

    compute_s = flops / (spec.peak_flops * spec.compute_eff * n)
    memory_s = nbytes / (spec.dram_bytes_per_s * spec.dram_eff * n)
    body = max(compute_s, memory_s)
    extra = spec.call_overhead_s
    if n > 1:
        body /= spec.tp_eff
        extra += L * spec.sync_per_layer_s
    return CallCost(
        flops=flops,
        bytes=nbytes,
        compute_s=compute_s,
        memory_s=memory_s,
        seconds=body + extra,
        bound="compute" if compute_s >= memory_s else "bandwidth",
        breakdown={
            "flops_linear": flops_linear,
            "flops_lm_head": flops_head,
            "flops_attention": flops_attn,
            "bytes_weights": float(weights),
            "bytes_kv_read": float(kv_read),
            "bytes_kv_write": float(kv_write),
            "bytes_activations": float(act),
            "overhead_s": extra,
        },
    )


def decode_cost(
    shape: ModelShape,
    batch: int,
    context: int,
    spec: DeviceSpec | None = None,
    num_devices: int = 1,
) -> CallCost:
    """One decode step of ``batch`` rows, each with ``context`` tokens already cached."""
    return call_cost(shape, [Row(1, context)] * batch, batch, spec, num_devices)


def prefill_cost(
    shape: ModelShape,
    prompt_len: int,
    chunk: int = 128,
    spec: DeviceSpec | None = None,
    num_devices: int = 1,
) -> float:
    """Seconds to prefill one prompt in static ``chunk``-token calls (the last one padded)."""
    total, start = 0.0, 0
    while start < max(1, prompt_len):
        total += call_cost(shape, [Row(chunk, start)], 1, spec, num_devices).seconds
        start += chunk
    return total


def copy_cost(shape: ModelShape, tokens: int, spec: DeviceSpec | None = None) -> float:
    """Seconds for an on-device KV copy of ``tokens`` slots (every layer's K and V): the
    bytes are read once and written once at DRAM bandwidth, plus one call's fixed cost."""
    spec = spec or DeviceSpec()
    nbytes = 2.0 * tokens * shape.kv_bytes_per_token
    return nbytes / (spec.dram_bytes_per_s * spec.dram_eff) + spec.call_overhead_s


# ----------------------------------------------------------------------------- mode
_WARNED = False


def timing_enabled() -> bool:
    """Whether emulated runtimes sleep the modelled latency instead of computing."""
    global _WARNED
    value = os.environ.get(MODE_ENV, "compute").strip().lower() or "compute"
    if value not in ("compute", "timing"):
        raise ValueError(f"{MODE_ENV}={value!r}; expected 'compute' or 'timing'")
    if value == "timing" and not _WARNED:
        _WARNED = True
        logger.warning(
            "rebel emulator in TIMING mode: device calls sleep the modelled device latency and "
            "return zeros; generated tokens are NOT the model's output"
        )
    return value == "timing"


# ----------------------------------------------------------------------------- recording
@dataclass
class CallRecord:
    start: float  # time.perf_counter() at entry
    end: float
    modelled_s: float | None  # None in compute mode
    kind: str  # "prefill", "decode" or "copy"
    batch: int


class Recorder:
    """Per-process log of runtime calls: totals plus the last ``maxlen`` calls."""

    def __init__(self, maxlen: int = 20000) -> None:
        self._lock = threading.Lock()
        self.calls: deque[CallRecord] = deque(maxlen=maxlen)
        self.total_calls = 0
        self.total_seconds = 0.0
        self.total_modelled = 0.0

    def add(self, rec: CallRecord) -> None:
        with self._lock:
            self.calls.append(rec)
            self.total_calls += 1
            self.total_seconds += rec.end - rec.start
            self.total_modelled += rec.modelled_s or 0.0

    def reset(self) -> None:
        with self._lock:
            self.calls.clear()
            self.total_calls, self.total_seconds, self.total_modelled = 0, 0.0, 0.0

    def snapshot(self) -> dict[str, Any]:
        import torch

        with self._lock:
            return {
                "pid": os.getpid(),
                "mode": "timing" if timing_enabled() else "compute",
                "torch_threads": torch.get_num_threads(),  # what compute-mode calls ran on
                "total_calls": self.total_calls,
                "total_seconds": self.total_seconds,
                "total_modelled_seconds": self.total_modelled,
                "calls": [asdict(c) for c in self.calls],
            }


RECORDER = Recorder()


def snapshot(*_: Any) -> dict[str, Any]:
    """Recorded calls of this process (usable as a ``collective_rpc`` callable)."""
    return RECORDER.snapshot()


def reset(*_: Any) -> bool:
    RECORDER.reset()
    return True


# ----------------------------------------------------------------------------- the runtime side
class GraphTiming:
    """Timing-mode behaviour of one emulated runtime: cost per call, zero outputs."""

    def __init__(self, cm: Any) -> None:
        self.spec = DeviceSpec.from_env()
        self.shape, self.lm_head = graph_shape(cm), True
        stage = pipeline_stage(cm)
        if stage is not None:  # a pipeline stage: its share of the layers, maybe no LM head
            share, self.lm_head = stage
            self.shape = replace(
                self.shape, num_layers=max(1, round(self.shape.num_layers * share))
            )
        self.num_devices = int(getattr(cm, "num_devices", 1) or 1)
        names = [name for name, _, _ in cm.input_info]
        self._pos_index = names.index("cache_position") if "cache_position" in names else None
        self._one_logit = "query_position" in names
        self._outputs: list[tuple[tuple[int, ...], Any]] | None = None

    def rows(self, inputs: tuple[Any, ...]) -> tuple[list[Row], int, str]:
        kind, batch, length = describe(inputs)
        if self._pos_index is not None:
            starts = inputs[self._pos_index].reshape(batch, -1)[:, 0].tolist()
        else:
            starts = [0] * batch
        rows = [Row(length, max(0, int(s))) for s in starts]
        logit_rows = batch if (kind == "decode" or self._one_logit) else batch * length
        return rows, logit_rows, kind

    def cost(self, inputs: tuple[Any, ...]) -> CallCost:
        rows, logit_rows, _ = self.rows(inputs)
        return call_cost(
            self.shape, rows, logit_rows, self.spec, self.num_devices, lm_head=self.lm_head
        )

    def run(self, module: Any, inputs: tuple[Any, ...], kv: list[Any], start: float) -> list[Any]:
        """One timing-mode call: zero outputs after sleeping the modelled latency."""
        import torch

        seconds = self.cost(inputs).seconds
        if self._outputs is None:  # output shapes, found once without computing
            self._outputs = _output_specs(module, inputs, kv)
            start = time.perf_counter()  # the one-off shape pass is not device time
        outputs = [torch.zeros(s, dtype=d) for s, d in self._outputs]
        sleep_until(start + seconds)
        record_call(start, inputs, seconds)
        return outputs

    def sleep_copy(self, tokens: int, start: float) -> None:
        """Timing-mode ``_copy_kv_cache``: sleep the modelled copy time (nothing is copied;
        timing mode never writes the KV cache)."""
        seconds = copy_cost(self.shape, tokens, self.spec)
        sleep_until(start + seconds)
        record_copy(start, seconds)


def describe(inputs: tuple[Any, ...]) -> tuple[str, int, int]:
    """(kind, batch, tokens per row) of a call from its first input ``[batch, tokens]``."""
    first = inputs[0]
    batch, length = (int(first.shape[0]), int(first.shape[1])) if first.dim() >= 2 else (1, 1)
    return ("decode" if length == 1 else "prefill"), batch, length


def record_call(start: float, inputs: tuple[Any, ...], modelled_s: float | None = None) -> None:
    kind, batch, _ = describe(inputs)
    RECORDER.add(CallRecord(start, time.perf_counter(), modelled_s, kind, batch))


def record_copy(start: float, modelled_s: float | None = None) -> None:
    """Log one ``_copy_kv_cache`` call (kind ``"copy"``, batch 1)."""
    RECORDER.add(CallRecord(start, time.perf_counter(), modelled_s, "copy", 1))


def _output_specs(module: Any, inputs: tuple[Any, ...], kv: list[Any]):
    import torch

    try:
        from torch._subclasses.fake_tensor import FakeTensorMode

        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode, torch.no_grad():
            fake_kv = [mode.from_tensor(t) for t in kv]
            result = module(*inputs, *fake_kv)
    except Exception:  # noqa: BLE001 - fall back to one real call (tiny graphs only)
        logger.debug("fake-tensor shape pass failed; running the graph once", exc_info=True)
        with torch.no_grad():
            result = module(*[t.clone() for t in inputs], *[t.clone() for t in kv])
    outs = list(result) if isinstance(result, (tuple, list)) else [result]
    return [(tuple(o.shape), o.dtype) for o in outs]


PIPELINE_MANIFEST = "rbln_pipeline.json"  # a staged artifact (rbln_ray.pipeline) has one


def pipeline_stage(cm: Any) -> tuple[float, bool] | None:
    """(share of the model's layers, has the LM head) when ``cm`` is one stage's graph of a
    staged artifact (``<dir>/stage_<i>/*.rbln`` beside ``<dir>/rbln_pipeline.json``)."""
    path = getattr(cm, "path", None)
    if path is None or not (Path(path).parents[1] / PIPELINE_MANIFEST).is_file():
        return None
    manifest = json.loads((Path(path).parents[1] / PIPELINE_MANIFEST).read_text())
    stage_dir = Path(path).parent.name
    for stage in manifest["stages"]:
        if stage["subdir"] == stage_dir:
            layers = stage["layer_end"] - stage["layer_start"]
            return layers / manifest["num_hidden_layers"], bool(stage["has_lm_head"])
    return None


def graph_shape(cm: Any) -> ModelShape:
    """The shape to model: ``RBLN_RAY_TIMING_SHAPE``, else the compiled dir's config.json
    (a pipeline stage's graphs find it one directory up)."""
    override = os.environ.get(SHAPE_ENV, "").strip()
    if override:
        return shape_from_spec(override)
    path = getattr(cm, "path", None)
    for directory in (Path(path).parent, Path(path).parents[1]) if path is not None else ():
        if (directory / "config.json").is_file():
            cfg = json.loads((directory / "config.json").read_text())
            return ModelShape.from_hf_config(cfg, name=directory.name)
    for module in cm.module.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and hasattr(cfg, "num_hidden_layers"):
            return ModelShape.from_hf_config(cfg.to_dict())
    raise RuntimeError(
        f"timing mode cannot find the model config of {cm!r}; set {SHAPE_ENV} to a preset "
        f"({', '.join(sorted(PRESETS))}) or a config.json path"
    )


def sleep_until(deadline: float) -> None:
    """Sleep (not spin) until ``time.perf_counter()`` reaches ``deadline``."""
    while True:
        left = deadline - time.perf_counter()
        if left <= 0:
            return
        time.sleep(left)


class RuntimeCallsExtension:
    """vLLM ``worker_extension_cls``: exposes this process's runtime-call log to
    ``collective_rpc("emulator_calls")`` / ``collective_rpc("emulator_calls_reset")``.

    Use ``worker_extension_cls="rbln_ray.emulator.timing.RuntimeCallsExtension"``.
    """

    def emulator_calls(self) -> dict[str, Any]:
        return snapshot()

    def emulator_calls_reset(self) -> bool:
        return reset()
