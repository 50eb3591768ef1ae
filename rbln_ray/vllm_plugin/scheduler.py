"""vLLM scheduler for compiled RBLN graphs: each step is one prefill, or decodes only.

Why: optimum-rbln compiles a prefill graph for one sequence and decode graphs for fixed batch
sizes; a step can run exactly one of them. vLLM's ``Scheduler.schedule`` admits waiting
requests only while ``len(running) < max_num_running_reqs``, so bounding that limit per step
(through the public ``scheduler_cls`` hook) yields the RBLN step shapes without touching its
internals:
- prefill step: hide the running requests and allow one admission;
- decode step: set the limit to the running count, so nothing new is admitted.
"""

from __future__ import annotations

from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler


class RBLNScheduler(Scheduler):
    """Enforces DESIGN §4: at most one prefill per step, never mixed with decodes."""

    def _prefill_can_start(self) -> bool:
        if not (self.waiting or self.skipped_waiting):
            return False
        if len(self.running) >= self.max_num_running_reqs:
            return False
        request = self._select_waiting_queue_for_scheduling().peek_request()
        needed = -(-request.num_tokens // self.block_size)
        return self.kv_cache_manager.block_pool.get_num_free_blocks() >= needed

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        limit = self.max_num_running_reqs
        if self._prefill_can_start():
            running = self.running
            self.running, self.max_num_running_reqs = [], 1
            try:
                return super().schedule(throttle_prefills)
            finally:
                self.running = running + self.running
                self.max_num_running_reqs = limit
        self.max_num_running_reqs = len(self.running)
        try:
            return super().schedule(throttle_prefills)
        finally:
            self.max_num_running_reqs = limit
