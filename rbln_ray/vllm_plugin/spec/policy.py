"""When speculation pays: the RBLN scheduler's per-step choice between verifying drafts and
a plain decode step.

Why per step: a verify call scores ``W = k + 1`` tokens per row for about the price of one
decode while the device is bound by reading the weights (ATOM, small batches), but it costs
more as ``batch x W`` grows (compute-bound), and drafts only pay when they are accepted. The
policy compares expected output tokens per second of the two kinds of step:

    decode: rows / t_decode(bs)
    verify: sum over rows of (1 + E[accepted drafts of the row]) / (t_verify(bs, W) + t_host)

``E[accepted | n drafts] = sum_{i<=n} prod_{j<=i} c_j`` with ``c_j`` the running acceptance
rate at draft position ``j`` given the drafts before it were accepted (vLLM's per-position
acceptance, learnt from every verify step and, while steps decode, from *shadow* drafts:
drafts the n-gram proposer made but the step did not verify, compared with the tokens the
steps then produced; a one-hot draft is accepted with the probability that the target
samples it, so the comparison is unbiased). Device times are the cost model's
(:mod:`rbln_ray.npu.cost_model`, the artifact's shape on its device kind) scaled by what the
worker measured for each kind of call at each compiled batch (running averages), so the
policy follows the real device: an emulator computing on the host, a modelled ATOM, an NPU.
A draft model's time is paid before the step (it proposes after the previous one), so it
decides ``k`` for the next step instead, from the same estimate plus the draft's measured
time; while off it re-probes every ``probe_steps`` decode steps.

Pure bookkeeping (no vLLM, no torch): the scheduler feeds it, tests drive it directly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

ALPHA = 0.1  # weight of a new observation in the running averages (once warmed up)
PRIOR_ACCEPTANCE = 0.5  # per-position acceptance before any is measured, worth one sample


def accepted_prefix(drafts: list[int], produced: list[int]) -> int:
    """How many of ``drafts`` greedy verification would have accepted: the length of their
    prefix equal to the tokens the steps produced (shadow drafts, which no step verified)."""
    return next(
        (i for i, (d, t) in enumerate(zip(drafts, produced, strict=True)) if d != t),
        len(drafts),
    )


@dataclass
class SpecStepInfo:
    """What a worker's step tells the scheduler's policy (``RBLNRunnerOutput.rbln_spec``)."""

    kind: str  # "decode" | "verify" | "prefill"
    batch: int  # the compiled batch that ran (0: a prefill)
    context: int  # mean tokens before the step's rows
    device_s: float  # seconds of the step's target device call
    draft_s: float = 0.0  # seconds the draft model spent proposing for the next step
    host_s: float = 0.0  # host seconds of rejection sampling and proposing
    draft_calls: int = 0


# (kind, batch, context, width) -> seconds, from the cost model
Prior = Callable[[str, int, int, int], float]


@dataclass
class SpecPolicy:
    """Acceptance and cost estimates, and the choices made from them (module docstring)."""

    k: int  # drafts per row at most (num_speculative_tokens)
    width: int  # tokens per row of the compiled verify graphs
    prior: Prior
    mode: str = "auto"  # "auto" | "always"
    min_gain: float = 1.05
    probe_steps: int = 32
    draft_model: bool = False
    acceptance: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)  # observations per position
    observed: int = 0  # verify rows (and shadow samples) seen
    _ratio: dict[tuple[str, int], float] = field(default_factory=dict)
    _host: float = 0.0
    _draft: dict[int, float] = field(default_factory=dict)
    _off: int = 0  # decode steps since drafts were last asked for (draft model)

    def __post_init__(self) -> None:
        if not self.acceptance:
            self.acceptance = [PRIOR_ACCEPTANCE] * self.k
            self.samples = [1] * self.k

    # ---------------------------------------------------------------- estimates
    def expected_accepted(self, drafts: int) -> float:
        total, run = 0.0, 1.0
        for i in range(min(drafts, self.k)):
            run *= self.acceptance[i]
            total += run
        return total

    def seconds(self, kind: str, batch: int, context: int) -> float:
        width = self.width if kind == "verify" else 1
        ratio = self._ratio.get((kind, batch)) or self._ratio.get(("decode", batch)) or 1.0
        return self.prior(kind, batch, context, width) * ratio

    def draft_seconds(self, batch: int) -> float:
        return self._draft.get(batch, 0.0)

    def _rates(self, drafts: list[int], batch: int, context: int, draft_cost: bool):
        decode = len(drafts) / self.seconds("decode", batch, context)
        tokens = sum(1.0 + self.expected_accepted(n) for n in drafts)
        cost = self.seconds("verify", batch, context) + self._host
        if draft_cost:
            cost += self.draft_seconds(batch)
        return decode, tokens / cost

    # ---------------------------------------------------------------- choices
    def verify_pays(self, drafts: list[int], batch: int, context: int) -> bool:
        """Whether a step of these rows (``drafts[r]`` drafts each) should verify them."""
        if not any(drafts):
            return False
        if self.mode == "always":
            return True
        decode, verify = self._rates(drafts, batch, context, draft_cost=False)
        return verify >= self.min_gain * decode

    def wants_drafts(self, rows: int, batch: int, context: int) -> bool:
        """Draft model: whether the next step should get drafts (their time is spent now)."""
        if self.mode == "always" or rows == 0:
            return self.mode == "always"
        decode, verify = self._rates([self.k] * rows, batch, context, draft_cost=True)
        if verify >= self.min_gain * decode:
            self._off = 0
            return True
        self._off += 1
        if self._off >= self.probe_steps:  # re-measure acceptance now and then
            self._off = 0
            return True
        return False

    # ---------------------------------------------------------------- observations
    def observe(self, drafts: int, accepted: int) -> None:
        """One row's verify outcome: ``accepted`` of its ``drafts`` drafts."""
        self.observed += 1
        for i in range(min(drafts, accepted + 1, self.k)):
            hit = 1.0 if i < accepted else 0.0
            self.samples[i] += 1
            # a running mean over the first samples, then a moving average (it follows a
            # workload whose acceptance changes)
            weight = max(ALPHA, 1.0 / self.samples[i])
            self.acceptance[i] += weight * (hit - self.acceptance[i])

    def observe_step(self, info: SpecStepInfo) -> None:
        """A step's measured device (and host, draft) times."""
        if info.kind not in ("decode", "verify") or info.batch <= 0 or info.device_s <= 0:
            return
        prior = self.prior(
            info.kind, info.batch, info.context, self.width if info.kind == "verify" else 1
        )
        key = (info.kind, info.batch)
        ratio = info.device_s / prior
        old = self._ratio.get(key)
        self._ratio[key] = ratio if old is None else old + ALPHA * (ratio - old)
        if info.kind == "verify":
            self._host += ALPHA * (info.host_s - self._host)
        if info.draft_calls:
            old_d = self._draft.get(info.batch)
            self._draft[info.batch] = (
                info.draft_s if old_d is None else old_d + ALPHA * (info.draft_s - old_d)
            )
