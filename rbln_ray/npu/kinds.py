"""Which RBLN NPU a device is: ATOM (default) or REBEL, and its DRAM budget.

Why: optimum-rbln 0.12 branches on the NPU name (``RBLN-CA*`` vs ``RBLN-CR*``): memory
budget, prefill chunk (512 on REBEL), attention limits, compile paths for CR13 and later.
The budgets below are optimum-rbln's own (``optimum/rbln/utils/runtime_utils.py``,
``_dram_spec``; prefill chunks from ``modeling_attention_utils.set_default_values``), defined
once here for the ledger, the compiled model's memory report, the timing model and the
planner.

Environment (read on every lookup, so each process, and so each Ray node, decides):

===========================  ============  ==========================================
``RBLN_RAY_EMULATED_NPU``    ``atom``      ``atom`` / ``rebel``, or an NPU name
                                           (``RBLN-CA25``, ``RBLN-CR13``)
===========================  ============  ==========================================

Per Ray node: start the node (``ray start``, or ``Cluster.add_node``) with the variable
in its environment; its raylet and every worker it spawns inherit it, and Ray's own
accelerator probe (``rebel.get_npu_name()``) then labels the node ``RBLN-CR13``.
"""

from __future__ import annotations

from dataclasses import dataclass

from rbln_ray.common import envs

KIND_ENV = "RBLN_RAY_EMULATED_NPU"
GiB = 2**30
MiB = 2**20


class DeviceKindError(ValueError):
    """An NPU kind or name the emulator does not know."""


@dataclass(frozen=True)
class DeviceKind:
    """One NPU family as the emulator presents it."""

    family: str  # "ATOM" | "REBEL"
    npu_name: str  # what rebel.get_npu_name() reports
    dram_total: int  # device DRAM, bytes
    reserved_per_chiplet: int  # system reserve per chiplet, bytes
    chiplets: int  # DRAM is partitioned per chiplet; allocations are per chiplet
    prefill_chunk: int  # optimum-rbln's default prefill_chunk_size for this family

    @property
    def chiplet_budget(self) -> int:
        """Bytes a model may use on one chiplet (optimum's ``get_available_dram_per_chiplet``)."""
        return self.dram_total // self.chiplets - self.reserved_per_chiplet

    @property
    def budget(self) -> int:
        """Bytes a model may use on the whole device."""
        return self.chiplet_budget * self.chiplets


# ATOM-Max (RBLN-CA25): 16 GiB GDDR6, 288 MiB reserved, one chiplet.
ATOM = DeviceKind("ATOM", "RBLN-CA25", 16 * GiB, 288 * MiB, 1, prefill_chunk=128)
# REBEL-Quad (RBLN-CR13): 144 GiB HBM3E over 4 chiplets, 1 GiB reserved per chiplet.
REBEL = DeviceKind("REBEL", "RBLN-CR13", 144 * GiB, 1 * GiB, 4, prefill_chunk=512)

KINDS = {"atom": ATOM, "rebel": REBEL}


def kind_by_name(value: str) -> DeviceKind:
    """``atom``/``rebel`` or an NPU name (any ``RBLN-CA*`` is ATOM, any ``RBLN-CR*`` REBEL)."""
    key = value.strip()
    if key.lower() in KINDS:
        return KINDS[key.lower()]
    upper = key.upper()
    if upper.startswith("RBLN-CA"):
        return ATOM
    if upper.startswith("RBLN-CR"):
        return REBEL
    raise DeviceKindError(
        f"unknown RBLN NPU kind {value!r}; expected one of {', '.join(KINDS)} or an NPU name "
        f"({ATOM.npu_name}, {REBEL.npu_name})"
    )


def current() -> DeviceKind:
    """The kind of this process's emulated devices (``RBLN_RAY_EMULATED_NPU``, default ATOM)."""
    value = (envs.get(KIND_ENV) or "").strip()
    if not value:
        return ATOM
    try:
        return kind_by_name(value)
    except DeviceKindError as e:
        raise DeviceKindError(f"{KIND_ENV}={value!r}: {e}") from None
