"""SqueezeLinear: the one runtime module for every weight format, and the swap that puts it into a model.

The module holds a registered format's weight (:mod:`squeeze.quant.schemes`) as buffers named as in the
artifact (``weight_packed``, ``weight_lut``...). Its reference path is the format's own ``dequantize``:
exact, and the oracle every kernel is tested against. Which path ``forward`` takes (``weight_path``):

* ``native-<isa>`` (CPU, the default): the native LUT kernels (:mod:`.kernels.cpu_lut`) read the module's
  own packed codes; resident weight memory stays the quantized bytes. ``activations``: "float32" (default) runs
  the exact float32 kernels, "int8" 3/4-bit weights through the W4A8 kernel (:mod:`.kernels.cpu_w8`).
* ``triton`` (CUDA): the Triton LUT kernels, for formats whose ``kernel`` is "lut".
* ``dense``: the dequantized weight cached densely on first use. Asked for with ``dense_cache=True``, and
  the fallback where no kernel covers the weight (a format without one, no C++ compiler).
* ``chunked`` (``low_memory=True`` where no kernel covers the weight): ``chunk_rows`` output rows
  dequantized per call, so the dense weight never exists (peak extra memory: one (chunk_rows, in) slice).

Layouts are prepared when the buffers are set or moved (construction, ``rebind``, ``.to(device)``), never
in ``forward``: the weight object is rebuilt from the moved buffers there, caches are dropped, and the
kernels' layout for the new device is prepared.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from squeeze.errors import FormatError
from squeeze.quant.schemes import WeightFormat
from squeeze.runtime.activations import DEFAULT_ACTIVATIONS, Activations
from squeeze.runtime.kernels.cpu_lut import CpuPreparedLut, cpu_lut_linear, prepare_cpu
from squeeze.runtime.kernels.cpu_w8 import prepare_w8
from squeeze.runtime.kernels.dispatch import drop_prepared, lut_forward, prepare_module, prepared_for
from squeeze.runtime.qmodule import QuantizedModule

#: Output rows dequantized at a time on the low-memory path (1024 x 4096 fp32 = 16 MiB per slice).
DEFAULT_CHUNK_ROWS = 1024

#: True inside :func:`drafting`: modules with a draft form (:meth:`SqueezeLinear.prepare_draft`) run it.
_DRAFTING: ContextVar[bool] = ContextVar("squeeze_drafting", default=False)


@contextmanager
def drafting() -> Iterator[None]:
    """Within: every SqueezeLinear that has a draft form runs it (speculative decoding's int8 drafter,
    squeeze.runtime.speculation); the others run as always. Per thread / context, so a server's engine thread
    drafting never changes another thread's forwards."""
    token = _DRAFTING.set(True)
    try:
        yield
    finally:
        _DRAFTING.reset(token)


def prepare_draft_forms(model: nn.Module) -> int:
    """Give every SqueezeLinear of ``model`` on the native CPU path its W4A8 form for :func:`drafting` (3 and
    4 bits; others draft with their usual path). Returns the bytes the draft forms hold beyond the weights."""
    extra = 0
    for module in model.modules():
        if isinstance(module, SqueezeLinear):
            extra += module.prepare_draft()
    return extra


class SqueezeLinear(QuantizedModule):
    """y = x @ W^T + b with W stored quantized. Buffers are named as in the artifact (``weight_packed`` ...)."""

    unnamed = "linear"

    def __init__(
        self,
        qweight: WeightFormat,
        bias: torch.Tensor | None = None,
        *,
        dense_cache: bool = False,
        low_memory: bool = False,
        activations: Activations = DEFAULT_ACTIVATIONS,
    ):
        super().__init__(qweight)
        self.in_features = qweight.in_features
        self.activations = activations
        self.out_features = qweight.out_features
        self.dense_cache = dense_cache
        self.low_memory = low_memory
        self._cpu: CpuPreparedLut | None = None
        self._draft: CpuPreparedLut | None = None  # the int8 form :func:`drafting` runs (prepare_draft)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self._dense: torch.Tensor | None = None
        #: rows per slice on the chunked path
        self.chunk_rows = DEFAULT_CHUNK_ROWS
        self.prepare_layout()  # a weight built on CUDA gets its kernel layout now, not in the first forward

    def prepare_layout(self) -> None:
        """Drop the dense cache and kernel layouts; prepare the Triton (CUDA) or native (CPU) kernels' form."""
        self._dense = None
        self._cpu = None
        self._draft = None
        drop_prepared(self)
        device = self.storage_device
        if device.type == "cuda":
            prepare_module(self, device)
        elif device.type == "cpu" and not self.dense_cache:
            self._cpu = prepare_cpu(self._qweight, activations=self.activations)  # type: ignore[arg-type]

    def prepare_draft(self) -> int:
        """Build the W4A8 form :func:`drafting` runs (native CPU path, 3 / 4 bits; idempotent); the bytes it holds
        beyond the module's buffers (0 when the module has no such form: it then drafts with its usual path)."""
        if self._cpu is None or self._cpu.w8 is not None:  # no native path, or int8 already
            return 0
        if self._draft is None:
            w8 = prepare_w8(self._qweight, self._cpu.packed)  # type: ignore[arg-type]
            self._draft = dataclasses.replace(self._cpu, w8=w8) if w8 is not None else None
        return self._draft.w8.extra_bytes if self._draft is not None and self._draft.w8 is not None else 0

    @property
    def weight_path(self) -> str:
        """The path ``forward`` takes for inputs on the buffers' device (module docstring)."""
        device = self.storage_device
        if self._cpu is not None and device.type == "cpu":
            return f"native-{self._cpu.kernels.isa}"
        if device.type == "cuda" and prepared_for(self, device) is not None:
            return "triton"
        return "chunked" if self.low_memory and not self.dense_cache else "dense"

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (..., in_features)
        if x.is_cuda:  # Triton LUT kernels (GEMV for decode, tiled GEMM for prefill) when they apply
            y = lut_forward(x, self)
            if y is not None:
                return y
        elif self._cpu is not None and not (torch.is_grad_enabled() and x.requires_grad):  # no backward
            prepared = self._draft if self._draft is not None and _DRAFTING.get() else self._cpu
            return cpu_lut_linear(x, prepared, self.bias)
        if self.low_memory and not self.dense_cache:
            return self.chunked_forward(x)
        if self._dense is None or self._dense.dtype != x.dtype or self._dense.device != x.device:
            self._dense = self._qweight.dequantize(x.dtype).to(x.device)
        return F.linear(x, self._dense, self.bias)

    def dequantize_rows(self, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows [start, stop) of the weight, (stop - start, in_features) in ``dtype``: bit-identical to
        ``self.dequantize(dtype)[start:stop]`` (rows are packed independently, so the slice is exact)."""
        return self._qweight.row_slice(start, stop).dequantize(dtype)

    def chunked_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., in_features) -> (..., out_features), dequantizing ``chunk_rows`` output rows at a time.

        Each slice of output columns is ``x @ W[rows]^T`` (+ bias[rows]); the slices are concatenated, so
        only one (chunk_rows, in_features) piece of the dense weight is alive at any moment.
        """
        step = max(1, int(self.chunk_rows))
        outs = []
        for start in range(0, self.out_features, step):
            stop = min(start + step, self.out_features)
            w = self.dequantize_rows(start, stop, x.dtype).to(x.device)  # (rows, in_features)
            b = self.bias[start:stop] if self.bias is not None else None
            outs.append(F.linear(x, w, b))
            del w  # free the slice before the next one is built
        return torch.cat(outs, dim=-1) if len(outs) != 1 else outs[0]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, {self.format_repr()}, "
            f"bias={self.bias is not None}"
        )


def replace_module(
    model: nn.Module, name: str, kind: type[nn.Module], build: Callable[[Any], nn.Module], error: str
) -> None:
    """Replace the ``kind`` module called ``name`` in ``model`` by ``build(old)``; FormatError(``error``) when
    ``name`` is not a ``kind`` there. The one module swap of both loaders (``squeeze.load``, ``from_pretrained``)."""
    parent_name, _, child = name.rpartition(".")
    try:
        parent: Any = model.get_submodule(parent_name) if parent_name else model
    except AttributeError:
        parent = None
    old = getattr(parent, child, None) if parent is not None else None
    if not isinstance(old, kind):
        raise FormatError(error)
    setattr(parent, child, build(old))


def replace_linear(model: nn.Module, name: str, build: Callable[[nn.Linear], nn.Module]) -> None:
    """Replace the ``nn.Linear`` called ``name`` in ``model`` by ``build(old)`` (FormatError if there is none)."""
    error = f"quantization_config names {name!r}, which is not a linear layer of this architecture"
    replace_module(model, name, nn.Linear, build, error)


__all__ = [
    "SqueezeLinear",
    "drafting",
    "prepare_draft_forms",
    "replace_linear",
    "replace_module",
    "DEFAULT_CHUNK_ROWS",
]
