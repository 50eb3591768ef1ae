"""KV block access for ``rebel.Runtime``: range checks shared by the KV methods, and the
host<->device transfers ``_fetch_kv_cache`` / ``_update_kv_cache`` / ``_get_kv_cache_size``.

Why: neither optimum-rbln 0.12.0 nor vllm-rbln 0.12.0 calls the two transfer methods, but
Rebellions' runtime has them and a Rebellions KV-cache hook for vllm-rbln (public, later than
0.12.0) calls them as ``runtime._fetch_kv_cache(host, block_idx, block_offset, size,
layer_name)`` / ``runtime._update_kv_cache(...)``, sizing ``host`` with
``runtime._get_kv_cache_size(layer_name)`` and passing ``layer_name=None`` for "every KV
cache at once". That signature is the one emulated. Semantics, consistent with
``Runtime._copy_kv_cache`` (same block ids, same checks):

- ``layer_name``: the name of one static KV buffer of the load (``past_key_values_<i>``:
  optimum keeps K and V of each layer as separate buffers), or ``None`` for all of them in
  the runtime's KV input order.
- ``host``: a contiguous CPU tensor of at least ``_get_kv_cache_size(layer_name)`` bytes,
  of any dtype (the caller's hook allocates float16 and views it). It mirrors the device
  layout: the named buffer's bytes (``[num_blocks, Hkv, 1, block, D]``, row-major), or every
  buffer's bytes back to back for ``None``. A transfer touches only token slots
  ``[block_offset, block_offset + size)`` of block ``block_idx``, at the same place on both
  sides, in every selected buffer; the rest of ``host`` is left as it was.
- Errors (never a silent partial transfer): unknown ``layer_name`` (names the known ones),
  block id out of range, a slot range past the block, a ``host`` too small, not contiguous
  or not on the CPU.

Timing and modelled modes spend the modelled transfer time (the transferred slots' bytes
over the device kind's host link, :func:`rbln_ray.npu.cost_model.host_transfer_cost`, with
the modelled model's KV bytes per token), so no benchmark gets a host KV tier's transfers
for free; timing mode copies nothing (its KV cache holds nothing), modelled mode copies then
sleeps the rest. Not modelled: the host's 4 KiB alignment the real runtime requires.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

import torch


def check_blocks(op: str, name: str, buf: torch.Tensor, blocks: Iterable[int]) -> None:
    """Every id in ``blocks`` must be a block of ``buf`` (``[num_blocks, ..., slots, D]``)."""
    count = buf.shape[0]
    if not all(0 <= b < count for b in blocks):
        raise ValueError(f"{op}: block ids must be in [0, {count}) for {name}")


def check_slots(op: str, name: str, buf: torch.Tensor, offset: int, length: int) -> None:
    """Slots ``[offset, offset + length)`` must lie inside one block of ``buf``."""
    slots = buf.shape[-2]
    if offset == 0 and not 0 <= length <= slots:
        raise ValueError(f"{op}: length must be in [0, {slots}] (the KV block size of {name})")
    if offset < 0 or length < 0 or offset + length > slots:
        raise ValueError(
            f"{op}: slots [{offset}, {offset + length}) must lie in [0, {slots}] "
            f"(the KV block size of {name})"
        )


class KVHostTransfer:
    """Mixin for ``Runtime``: needs ``self.kv_buffers`` (name -> static KV tensor, in order)
    and ``self._timing`` / ``self._modelled`` (the emulator mode's device-time model)."""

    kv_buffers: dict[str, torch.Tensor]
    _timing: Any
    _modelled: bool

    def _selected(self, op: str, layer_name: str | None) -> list[tuple[str, torch.Tensor]]:
        buffers = self.kv_buffers
        if not buffers:
            raise RuntimeError(f"{op}: {self!r} has no KV cache")
        if layer_name is None:
            return list(buffers.items())
        if layer_name not in buffers:
            raise KeyError(f"{op}: no KV cache named {layer_name!r}; known: {sorted(buffers)}")
        return [(layer_name, buffers[layer_name])]

    def _get_kv_cache_size(self, layer_name: str | None = None) -> int:
        """Bytes of the named KV buffer, or of all of them (``None``): the host size needed."""
        op = f"_get_kv_cache_size({layer_name!r})"
        return sum(b.numel() * b.element_size() for _, b in self._selected(op, layer_name))

    def _transfer(
        self,
        op: str,
        host: torch.Tensor,
        block: int,
        offset: int,
        size: int,
        layer_name: str | None,
        to_host: bool,
    ) -> None:
        selected = self._selected(op, layer_name)
        for name, buf in selected:
            check_blocks(op, name, buf, [block])
            check_slots(op, name, buf, offset, size)
        need = sum(b.numel() * b.element_size() for _, b in selected)
        if not isinstance(host, torch.Tensor) or host.device.type != "cpu":
            raise TypeError(f"{op}: host must be a CPU torch.Tensor, got {type(host).__name__}")
        if not host.is_contiguous():
            raise ValueError(f"{op}: host must be contiguous")
        have = host.numel() * host.element_size()
        if have < need:
            raise ValueError(f"{op}: host holds {have} bytes but the KV cache needs {need}")
        began = time.perf_counter()
        if self._timing is not None and not self._modelled:  # timing: no KV to move
            self._timing.sleep_transfer(size, began)
            return
        raw = host.reshape(-1).view(torch.uint8)
        start = 0
        for _, buf in selected:
            nbytes = buf.numel() * buf.element_size()
            mirror = raw[start : start + nbytes].view(buf.dtype).view(buf.shape)
            start += nbytes
            src, dst = (buf, mirror) if to_host else (mirror, buf)
            dst[block, ..., offset : offset + size, :] = src[block, ..., offset : offset + size, :]
        if self._timing is not None:  # modelled: the rest of the modelled transfer time
            self._timing.sleep_transfer(size, began)

    def _fetch_kv_cache(
        self,
        host: torch.Tensor,
        block_idx: int,
        block_offset: int,
        size: int,
        layer_name: str | None = None,
    ) -> None:
        """Copy slots ``[block_offset, block_offset + size)`` of block ``block_idx`` from the
        device KV cache into the same place of ``host`` (see the module docstring)."""
        block, offset, size = int(block_idx), int(block_offset), int(size)
        op = f"_fetch_kv_cache(host, {block}, {offset}, {size}, {layer_name!r})"
        self._transfer(op, host, block, offset, size, layer_name, to_host=True)

    def _update_kv_cache(
        self,
        host: torch.Tensor,
        block_idx: int,
        block_offset: int,
        size: int,
        layer_name: str | None = None,
    ) -> None:
        """Copy slots ``[block_offset, block_offset + size)`` of block ``block_idx`` from
        ``host`` into the device KV cache (the reverse of :meth:`_fetch_kv_cache`)."""
        block, offset, size = int(block_idx), int(block_offset), int(size)
        op = f"_update_kv_cache(host, {block}, {offset}, {size}, {layer_name!r})"
        self._transfer(op, host, block, offset, size, layer_name, to_host=False)
