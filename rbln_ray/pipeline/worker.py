"""vLLM worker for one pipeline stage: one vLLM pipeline-parallel rank, one Ray actor.

Every rank keeps vLLM's request state, builds each step's inputs (positions, block tables,
padding rows: the same on every rank, since they follow from the scheduler output alone) and
runs its own layers with the unchanged ``RBLNModelRunner`` over a
:class:`~rbln_ray.pipeline.stage.StageModel`. The first rank embeds token ids, every later one
takes the previous rank's hidden states, and the last one samples; ranks before the last
learn the sampled tokens from the next scheduler output (vLLM's pipeline-parallel contract).
The executor sends every step to every rank at once; each rank streams its hidden states
straight to the next rank (:mod:`~rbln_ray.pipeline.channel`), so they move worker to
worker, never through vLLM's engine process, and vLLM's batch queue keeps one micro-batch in
every stage.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from vllm.v1.core.sched.output import GrammarOutput, SchedulerOutput
from vllm.v1.outputs import ModelRunnerOutput

from rbln_ray.common import framing
from rbln_ray.pipeline.channel import HiddenStream, StageFailure
from rbln_ray.pipeline.stage import StageModel
from rbln_ray.vllm_plugin.model_runner import RBLNModelRunner
from rbln_ray.vllm_plugin.step_loop import Ahead, Deferred
from rbln_ray.vllm_plugin.worker import RBLNWorker

logger = logging.getLogger(__name__)


class PipelineWorker(RBLNWorker):
    """Loads stage ``rank`` of a staged artifact and runs it as pipeline rank ``rank``."""

    stage: StageModel
    _listener: framing.Listener | None = None
    _receiver: HiddenStream | None = None  # from rank - 1 (None on the first rank)
    _sender: HiddenStream | None = None  # to rank + 1 (None on the last rank)

    def load_model(self, *, load_dummy_weights: bool = False) -> None:
        from rbln_ray.emulator import require_runtime

        require_runtime("load a pipeline stage")
        self.stage = StageModel.load(self.artifact.path, self.rank, self.device_ids)
        self.model_runner = RBLNModelRunner(
            self.vllm_config,
            self.artifact,
            self.stage,
            self.layout,
            first_stage=self.rank == 0,
            last_stage=self.rank == self.artifact.num_stages - 1,
        )

    @property
    def prepare_ahead(self) -> Callable[[SchedulerOutput], Any] | None:
        """A rank before the last samples nothing: a step's inputs come from the scheduler
        output alone (its tokens too, vLLM's pipeline-parallel contract), so the reader thread
        prepares each whole step while earlier ones are on the device. The last rank, like a
        single worker, builds a decode step's inputs there and updates its sampler's state
        on the loop thread."""
        if self._sender is None:
            return super().prepare_ahead
        return self.model_runner.prepare

    @property
    def urgent_results(self) -> bool:
        """The last rank sends each result at once: the engine's turn-around to the next
        micro-batch is on the pipeline's critical path, and this rank's next step waits for
        the previous rank anyway."""
        return self._receiver is not None and self._sender is None

    # -- the hidden-state streams (set up by the executor, see rbln_ray.pipeline.channel) --
    def open_inbound(self, token: str) -> tuple[str, int]:
        """Listen for the previous rank's stream; the address it should connect to."""
        import ray

        self._listener = framing.Listener(ray.util.get_node_ip_address(), token)
        return self._listener.address

    def connect_outbound(self, address: tuple[str, int], token: str) -> None:
        """Connect this rank's stream to the next rank's :meth:`open_inbound` address."""
        self._sender = HiddenStream(framing.connect(tuple(address), token), self.rank + 1)

    def accept_inbound(self) -> None:
        """Take the previous rank's connection (made by its :meth:`connect_outbound`)."""
        if self._listener is None:
            raise RuntimeError(f"pipeline rank {self.rank}: accept_inbound before open_inbound")
        conn, self._listener = self._listener.accept(), None
        self._receiver = HiddenStream(conn, self.rank - 1)

    def run_step(  # type: ignore[override]
        self, seq: int, step: SchedulerOutput | Ahead, grammar_output: GrammarOutput | None
    ) -> ModelRunnerOutput | Deferred:
        """This rank's share of step ``seq``: its layers, then the hidden states straight to
        the next rank's stream, or (last rank) the sampled output for the engine.

        Every rank gets every step from the engine at once, so it updates its request state
        and builds the step's inputs while the previous rank still computes (a rank before
        the last even while its own previous step is on the device: :attr:`prepare_ahead`);
        only the device call waits for the previous rank's hidden states, read from its
        stream (:mod:`~rbln_ray.pipeline.channel`).
        """
        receiver = self._receiver
        receive = None if receiver is None else lambda: receiver.receive(seq)
        ahead = isinstance(step, Ahead)
        scheduler_output = step.scheduler_output if ahead else step
        try:
            if not ahead:
                prepared = self.model_runner.prepare(step)
            elif self._sender is not None:  # prepared whole on the reader thread
                prepared = step.get()
            else:
                prepared = self.model_runner.prepare(scheduler_output, step.get())
            output = self.model_runner.launch(prepared, receive)
        except BaseException as e:
            if self._sender is not None and scheduler_output.total_num_scheduled_tokens:
                # The next rank waits for this step's hidden states: tell it why none come.
                self._sender.send_failure(seq, StageFailure(self.rank, repr(e)))
            raise
        if self._sender is not None:
            if output is not None:
                self._sender.send(seq, output)
            return self.finish_later(lambda: None)
        if output is not None:
            self._observe_step()
            return output
        return self.finish_later(self.model_runner.sample(grammar_output))

    def step_stats(self) -> dict:
        return {**super().step_stats(), "stage_device_seconds": self.stage.device_seconds}

    def device_info(self) -> dict:
        spec = self.stage.spec
        return {
            **super().device_info(),
            "stage": spec.index,
            "layers": [spec.layer_start, spec.layer_end],
        }

    def shutdown(self) -> None:
        for end in (self._receiver, self._sender):
            if end is not None:
                end.close()
        super().shutdown()
        self.stage = None  # type: ignore[assignment]
