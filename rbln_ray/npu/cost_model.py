"""The roofline cost model of one RBLN device call: the emulator's timing mode sleeps
what it predicts and ``rbln-ray plan`` sizes deployments with it.

Why one module: the planner and the emulator must agree on what a call costs, and neither
should need the other (the planner runs on hosts without the emulator).

Model of one device call (roofline, one compiled graph invocation):

- FLOPs = 2 x (decoder-layer parameters) x (tokens in the call, padding rows included, since
  compiled graphs have static shapes) + 2 x vocab x hidden x (rows returning logits)
  + attention 4 x layers x q_heads x head_dim x sum(new tokens x attended context).
- bytes = all weights except the embedding table (read once per call; the LM head is read
  in full) + KV read (cached context of every row) + KV write (new tokens)
  + activations (~(6 x hidden + 2 x intermediate) x tokens x layers) + logits.
- seconds = max(FLOPs / (peak x compute_eff), bytes / (bandwidth x dram_eff)) / tp_eff(N)
  + per-call overhead (+ a per-layer sync cost when the graph spans N > 1 devices).

Weights and KV are costed in FP16 (2 bytes) unless the shape says otherwise: a quantized
artifact's projections (``linear_weight_bytes`` 1 for int8/fp8, plus their per-channel fp32
scales) and fp8 KV caches (``kv_bytes`` 1) are read at their own width. Compute stays at the
FP16 peak (weight-only quantization dequantizes in the graph; REBEL's FP8 compute path is not
modelled). Compiled-in LoRA adapters add their stacked A/B matrices to the weights, read per
call for the adapters the call's rows use, and ``2 x tokens x rank x (in + out)`` FLOPs per
adapted projection and layer (every row pays: the graph computes the LoRA path for base rows
too, with adapter 0's zeros).

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
host link                  PCIe 5.0 x16: 63 GB/s   PCIe 5.0 x16: 63 GB/s per direction
                           per direction           (assumption: REBEL's host interface
                           (published: ATOM's      is not published)
                           "PCIe Gen5 x16" host
                           interface; 32 GT/s x 16
                           lanes, 128b/130b, PCI-
                           SIG's PCIe 5.0 spec)
host link efficiency       0.8 (assumption)        0.8 (assumption)
node-to-node network       100 Gb/s: 12.5 GB/s     100 Gb/s (assumption, both: one 100 GbE
                                                   port per host, the common datacenter
                                                   NIC; set RBLN_RAY_TIMING_NETWORK_GBITS)
network efficiency         0.8 (assumption)        0.8 (assumption)
=========================  ======================  ======================================

The host link carries the KV a host tier moves (``host_transfer_cost``: the
``_fetch_kv_cache`` / ``_update_kv_cache`` of one RBLN block's cached prefix); the network
carries a prompt's KV from a prefill replica's node to a decode replica's on another node
(``network_transfer_cost``, prefill/decode disaggregation).

Overrides (environment, all optional; they apply to whichever kind is emulated):

=====================================  ==============================================
``RBLN_RAY_TIMING_PEAK_TFLOPS``        peak FP16 TFLOPS
``RBLN_RAY_TIMING_DRAM_GBPS``          DRAM bandwidth, GB/s
``RBLN_RAY_TIMING_COMPUTE_EFF``        achieved fraction of peak FLOPs
``RBLN_RAY_TIMING_DRAM_EFF``           achieved fraction of DRAM bandwidth
``RBLN_RAY_TIMING_CALL_US``            fixed cost per runtime call (launch, sync)
``RBLN_RAY_TIMING_TP_EFF``             efficiency of a shard group of N > 1 devices
``RBLN_RAY_TIMING_SYNC_US``            per-layer cross-device sync cost when N > 1
``RBLN_RAY_TIMING_NETWORK_GBITS``      node-to-node network, Gbit/s
=====================================  ==============================================
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from rbln_ray.common import envs
from rbln_ray.npu import kinds

DEVICE_DRAM_BYTES = kinds.ATOM.budget  # ATOM's usable DRAM (the default device)

# config.json model_types whose MLP has no gate (up and down only). Which families those are
# is a fact of the family registry (DecoderFamily.gated_mlp), a layer above this one: it
# passes them down when it loads (declare_ungated_mlp); this layer names no family.
_UNGATED_MLP: set[str] = set()


def declare_ungated_mlp(model_types: Iterable[str]) -> None:
    """Record ``config.json`` model_types whose MLP is up/down only (no gate), which
    :meth:`ModelShape.from_hf_config` then costs with two matrices, not three."""
    _UNGATED_MLP.update(model_types)


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
    name: str = kinds.ATOM.family
    host_link_bytes_per_s: float = 63e9  # PCIe 5.0 x16, one direction
    host_link_eff: float = 0.8
    network_bytes_per_s: float = 12.5e9  # 100 Gb/s Ethernet (module table)
    network_eff: float = 0.8

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None, kind: str | None = None) -> DeviceSpec:
        """The spec of ``kind`` (default: the emulated kind) with the env overrides applied."""
        base = spec_for(kind or kinds.current().family)

        def get(name: str, default: float, scale: float = 1.0) -> float:
            value = envs.get(name, environ)
            return value * scale if value is not None else default

        return replace(
            base,
            peak_flops=get("RBLN_RAY_TIMING_PEAK_TFLOPS", base.peak_flops, 1e12),
            dram_bytes_per_s=get("RBLN_RAY_TIMING_DRAM_GBPS", base.dram_bytes_per_s, 1e9),
            compute_eff=get("RBLN_RAY_TIMING_COMPUTE_EFF", base.compute_eff),
            dram_eff=get("RBLN_RAY_TIMING_DRAM_EFF", base.dram_eff),
            call_overhead_s=get("RBLN_RAY_TIMING_CALL_US", base.call_overhead_s, 1e-6),
            tp_eff=get("RBLN_RAY_TIMING_TP_EFF", base.tp_eff),
            sync_per_layer_s=get("RBLN_RAY_TIMING_SYNC_US", base.sync_per_layer_s, 1e-6),
            network_bytes_per_s=get(
                "RBLN_RAY_TIMING_NETWORK_GBITS", base.network_bytes_per_s, 1e9 / 8
            ),
        )

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


ATOM_SPEC = DeviceSpec()
REBEL_SPEC = DeviceSpec(
    peak_flops=1e15,
    dram_bytes_per_s=2.7e12,
    dram_eff=1.0,
    dram_capacity=kinds.REBEL.budget,
    name=kinds.REBEL.family,
)
SPECS = {"atom": ATOM_SPEC, "rebel": REBEL_SPEC}


def spec_for(kind: str) -> DeviceSpec:
    """The timing parameters of a device kind (``atom``/``rebel`` or an NPU name)."""
    return SPECS[kinds.kind_by_name(kind).family.lower()]


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
    # Quantized projections (q/k/v/o, dense gate/up/down): bytes per weight (int8/fp8: 1),
    # with one fp32 scale per output channel; None: as every other weight.
    linear_weight_bytes: float | None = None
    # Compiled-in LoRA adapters: how many, the stacked rank, and the projections adapted.
    lora_adapters: int = 0
    lora_rank: int = 0
    lora_modules: tuple[str, ...] = ()

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

    def projection_dims(self) -> dict[str, tuple[int, int]]:
        """``(in, out)`` of each attention projection and dense MLP matrix of a layer."""
        h, q = self.hidden_size, self.num_heads * self.head_dim
        kv, inter = self.num_kv_heads * self.head_dim, self.intermediate_size
        dims = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if not self.num_experts:
            mlp = {"up_proj": (h, inter), "down_proj": (inter, h)}
            dims.update({"gate_proj": (h, inter), **mlp} if self.gated_mlp else mlp)
        return dims

    @property
    def _quantized_layer_params(self) -> int:
        """Parameters of one layer stored at ``linear_weight_bytes`` (0 when unquantized)."""
        if self.linear_weight_bytes is None:
            return 0
        return sum(i * o for i, o in self.projection_dims().values())

    def _layer_weight_bytes(self, params: float) -> float:
        """Bytes of ``params`` parameters of one layer, its quantized projections included
        (``params`` counts them)."""
        quantized = self._quantized_layer_params
        if not quantized:
            return params * self.weight_bytes
        scales = 4 * sum(o for _, o in self.projection_dims().values())
        return (
            (params - quantized) * self.weight_bytes + quantized * self.linear_weight_bytes + scales
        )

    def lora_layer_bytes(self, adapters: int | None = None) -> float:
        """Bytes of one layer's stacked LoRA matrices (``adapters`` of them; default all, the
        base model's zero adapter included)."""
        if not self.lora_adapters or not self.lora_modules:
            return 0.0
        n = self.lora_adapters + 1 if adapters is None else adapters
        dims = self.projection_dims()
        return (
            float(n * self.lora_rank * sum(sum(dims[m]) for m in self.lora_modules if m in dims))
            * self.weight_bytes
        )

    def lora_flops_per_token(self) -> float:
        """FLOPs of the LoRA path of one token in one layer."""
        dims = self.projection_dims()
        return 2.0 * self.lora_rank * sum(sum(dims[m]) for m in self.lora_modules if m in dims)

    @property
    def weight_bytes_total(self) -> int:
        embeddings = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        layer = self._layer_weight_bytes(self.layer_params) + self.lora_layer_bytes()
        return int(self.num_layers * layer + (embeddings + self.hidden_size) * self.weight_bytes)

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.kv_bytes

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "custom") -> ModelShape:
        """The shape of an HF ``config.json`` (Llama-style names; GPT2's ``n_*``, OPT's
        ``ffn_dim``, the MoE families' expert fields understood; the MLP gated unless its
        model_type was declared otherwise, :func:`declare_ungated_mlp`)."""
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
            gated_mlp=model_type not in _UNGATED_MLP,
            num_experts=experts,
            experts_per_token=int(cfg.get("num_experts_per_tok") or 0) if experts else 0,
            shared_expert_size=int(cfg.get("shared_expert_intermediate_size") or 0),
        )

    def with_rbln_config(self, raw: dict[str, Any]) -> ModelShape:
        """This shape as a compiled artifact stores it: its ``rbln_config.json``'s
        ``quantization`` (int8/fp8 weights, fp8 KV) and ``lora_config`` (adapters, rank,
        adapted projections)."""
        changes: dict[str, Any] = {}
        quant = raw.get("quantization") or {}
        if quant.get("weights") in ("int8", "fp8"):
            changes["linear_weight_bytes"] = 1.0
        elif quant.get("weights") == "int4":
            changes["linear_weight_bytes"] = 0.5
        if quant.get("kv_caches") == "fp8":
            changes["kv_bytes"] = 1
        adapters = (raw.get("lora_config") or {}).get("adapters") or []
        if adapters:
            modules = {m for a in adapters for m in a.get("target_modules") or ()}
            changes["lora_adapters"] = len(adapters)
            changes["lora_rank"] = int(
                raw["lora_config"].get("max_lora_rank") or max(a["r"] for a in adapters)
            )
            changes["lora_modules"] = tuple(sorted(modules))
        return replace(self, **changes) if changes else self

    def as_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "params": self.params,
            "active_params": self.active_params,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "weight_bytes_total": self.weight_bytes_total,
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
    flops_linear += L * shape.lora_flops_per_token() * tokens
    flops_head = 2.0 * shape.vocab_size * H * logit_rows
    flops_attn = 4.0 * L * q_dim * attended
    flops = flops_linear + flops_head + flops_attn

    per_token_kv = shape.kv_bytes_per_token
    experts_read = shape.expert_params * max(1, shape.num_experts)
    experts_read *= shape.expert_fraction_read(tokens)
    layer_read = shape.layer_params - shape.expert_params * max(1, shape.num_experts)
    # the adapters of the call's rows (at most every compiled one, the base's zeros included)
    lora_read = shape.lora_layer_bytes(min(len(rows), shape.lora_adapters + 1))
    weights = L * (shape._layer_weight_bytes(layer_read + experts_read) + lora_read)
    weights += (shape.vocab_size * H if lm_head else 0) * shape.weight_bytes
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


def host_transfer_cost(shape: ModelShape, tokens: int, spec: DeviceSpec | None = None) -> float:
    """Seconds to move ``tokens`` slots of KV (every layer's K and V) between the device and
    host memory over the host link (one direction), plus one call's fixed cost: what a host
    KV tier pays to save a block before the device reuses it, or to load it back."""
    spec = spec or DeviceSpec()
    nbytes = tokens * shape.kv_bytes_per_token
    return nbytes / (spec.host_link_bytes_per_s * spec.host_link_eff) + spec.call_overhead_s


def network_transfer_cost(
    shape: ModelShape, tokens: int, spec: DeviceSpec | None = None
) -> float:
    """Seconds to send ``tokens`` slots of KV (every layer's K and V) from one node's host
    memory to another's over the network: a prompt's KV handed from a prefill replica to a
    decode replica on another node."""
    spec = spec or DeviceSpec()
    return tokens * shape.kv_bytes_per_token / (spec.network_bytes_per_s * spec.network_eff)


def copy_cost(shape: ModelShape, tokens: int, spec: DeviceSpec | None = None) -> float:
    """Seconds for an on-device KV copy of ``tokens`` slots (every layer's K and V): the
    bytes are read once and written once at DRAM bandwidth, plus one call's fixed cost."""
    spec = spec or DeviceSpec()
    nbytes = 2.0 * tokens * shape.kv_bytes_per_token
    return nbytes / (spec.dram_bytes_per_s * spec.dram_eff) + spec.call_overhead_s


# ----------------------------------------------------------------------------- speculative decoding
def verify_cost(
    shape: ModelShape,
    batch: int,
    context: int,
    width: int,
    spec: DeviceSpec | None = None,
    num_devices: int = 1,
) -> CallCost:
    """One speculative-decoding verify call: ``batch`` rows of ``width`` tokens (the last
    accepted token and ``width - 1`` drafts) after ``context`` cached tokens each, logits for
    every token. ``width=1`` is :func:`decode_cost`. (The ``batch x width x vocab`` logits
    also cross PCIe to the host, which is not modelled: about 10 MB per call at batch 8,
    width 5 and a 128k vocabulary in FP16.)"""
    rows = [Row(width, context)] * batch
    return call_cost(shape, rows, batch * width, spec, num_devices)


def expected_tokens(acceptance: float, drafts: int) -> float:
    """Tokens one verify call yields per row when each of ``drafts`` drafts is accepted with
    probability ``acceptance`` given the ones before it were: ``(1 - a**(k+1)) / (1 - a)``
    (the accepted drafts plus the bonus or recovered token; ``k + 1`` at ``a = 1``)."""
    a, k = min(max(acceptance, 0.0), 1.0), max(0, drafts)
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)
