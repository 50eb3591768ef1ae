"""Per-request cache slots of sliding-window layers (optimum's ``local_block_tables``).

Why: a sliding-window (or hybrid) artifact compiles every sliding layer's KV cache as
``batch_size`` *slots*, each holding one sequence's last ``sliding_window`` tokens. Unlike
paged blocks, a slot is not addressed by position: the compiled graphs read and shift it as
a whole, so a request must keep the same slot from its first prefill chunk to its last
decode (chunks of other prompts and other requests' decodes run in between), and no other
request may write it meanwhile. This mirrors vllm-rbln 0.12's ``cache_slot_id_dict``
(``v1/core/optimum_scheduler.py``): the lowest free slot at admission, pinned until the
request leaves the running set (finished, aborted or preempted; a preempted request is
prefilled again from position 0 into whatever slot is free then).

Decode padding rows need a slot too (the graphs have static batch shapes): they get a slot no
running request holds, whose content is garbage by definition (vllm-rbln 0.12 takes one not
used by the decode batch, which can be a slot of a request mid-prefill; this is stricter).
When every slot is held (a decode of B-1 rows padded to B while the B-th request is
prefilling) they get ``NO_BLOCK``: the emulator reads and writes nothing for it, as for a
``-1`` block id. How a real NPU treats a ``-1`` slot is not verified here (optimum's own
runtime never passes ``-1`` block ids to the device: it substitutes a free block).

Pure bookkeeping; :class:`~rbln_ray.vllm_plugin.scheduler.RBLNScheduler` drives it in the
engine-core process and ships the slots in each step's ``KVStepPlan``, so every worker
(Ray actors, pipeline ranks) sees the same assignment.
"""

from __future__ import annotations

from rbln_ray.vllm_plugin.kv_blocks import NO_BLOCK


class SlotManager:
    """Assigns each running request one of ``num_slots`` sliding-window cache slots."""

    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"need at least one cache slot, got {num_slots}")
        self.num_slots = num_slots
        self._slots: dict[str, int] = {}

    def slot(self, req_id: str) -> int:
        """The request's slot, assigning the lowest free one on first use."""
        if req_id in self._slots:
            return self._slots[req_id]
        held = set(self._slots.values())
        free = [s for s in range(self.num_slots) if s not in held]
        if not free:
            raise RuntimeError(
                f"no free sliding-window cache slot for request {req_id} (all {self.num_slots} "
                f"held by {sorted(self._slots)}); the scheduler must not run more requests "
                "than the compiled batch size"
            )
        self._slots[req_id] = free[0]
        return free[0]

    def release_missing(self, live: set[str]) -> None:
        """Free the slots of requests that are no longer running."""
        for req_id in [r for r in self._slots if r not in live]:
            del self._slots[req_id]

    def scratch(self) -> int:
        """A slot padding rows may write: one nobody holds, else ``NO_BLOCK``."""
        held = set(self._slots.values())
        return next((s for s in range(self.num_slots) if s not in held), NO_BLOCK)

    def assignment(self) -> dict[str, int]:
        return dict(self._slots)
