"""QuantizedModule: the one base of the runtime modules that hold a registered weight format as buffers.

:class:`~squeeze.runtime.linear.SqueezeLinear`, :class:`~squeeze.runtime.embedding.SqueezeEmbedding` and
:class:`~squeeze.runtime.experts.SqueezeExperts` each hold one weight of a registered format
(:mod:`squeeze.quant.schemes`) and differ only in what ``forward`` computes from it. What they share lives
here, once:

* the buffers, one per tensor role, named as in the artifact (``weight_packed``, ``weight_lut``...);
* the weight object (:attr:`qweight`), rebuilt from the live buffers whenever they are replaced
  (``.to(device)``: shapes re-checked) or filled in place (``load_state_dict``, a loader's ``rebind``:
  every format check, values included);
* two hooks a subclass may override: :meth:`check_weight` (what this module needs of a weight beyond the
  format's own checks) and :meth:`prepare_layout` (rebuild the kernels' forms for the buffers' device).

The split follows optimum-quanto's ``QModuleMixin``: the base owns the quantized state and its life cycle,
each module keeps its ``forward`` and its extras.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import nn

from squeeze.quant.schemes import WeightFormat


class QuantizedModule(nn.Module):
    """An ``nn.Module`` whose state is one weight of a registered format, as buffers by role.

    ``qweight``: the weight (any device, meta included: a loader then fills the buffers and calls
    :meth:`rebind`). Subclasses call ``super().__init__(qweight)`` first, set their own attributes, then
    :meth:`prepare_layout` if they have one (the buffers are registered by then).
    """

    #: what error messages call a module that was given no name
    unnamed: ClassVar[str] = "module"

    def __init__(self, qweight: WeightFormat):
        super().__init__()
        self._qweight = qweight
        for name, tensor in qweight.tensors_by_role().items():
            self.register_buffer(name, tensor)

    @property
    def qweight(self) -> WeightFormat:
        """The weight object over the module's current buffers."""
        return self._qweight

    @property
    def method(self) -> str:
        """The weight format's registered name (``lut``, ``rtn``...)."""
        return self._qweight.method

    @property
    def storage_device(self) -> torch.device:
        """The device the buffers are on."""
        return next(self.buffers(recurse=False)).device

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight's matrix (out_features, in_features) in ``dtype``, by the format's exact reference path."""
        return self._qweight.dequantize(dtype)

    # -- hooks -----------------------------------------------------------------------------------------

    def check_weight(self, qweight: WeightFormat, name: str) -> None:
        """Raise FormatError when ``qweight`` (rebuilt from the buffers) cannot serve this module; ``name``
        names it in the message. The base accepts every weight of the format."""

    def prepare_layout(self) -> None:
        """Drop what was derived from the previous buffers and prepare the kernels' forms for the buffers'
        device. Called whenever the buffers are set or moved, never in ``forward``. The base has none."""

    # -- buffers set or moved --------------------------------------------------------------------------

    def rebind(self, name: str = "") -> None:
        """Rebuild the weight from the live buffers with every format check (FormatError), then this module's
        own checks, and prepare the layout again.

        For loaders that fill the buffers after construction (transformers' ``from_pretrained`` builds the
        module with meta buffers, then assigns the checkpoint's tensors by name), and after any in-place
        change of the buffers. ``name``: the module's name, so errors name the tensor.
        """
        self._qweight = self._from_buffers(name, check=True)
        self.check_weight(self._qweight, name or self.unnamed)
        self.prepare_layout()

    def _from_buffers(self, prefix: str = "", *, check: bool) -> WeightFormat:
        tensors = {f"{prefix}.{name}": buf for name, buf in self.named_buffers(recurse=False)}
        q = self._qweight
        return type(q).from_tensors(
            tensors, prefix, bits=q.bits, in_features=q.in_features, check_values=check, **q.params()
        )

    def _buffers_loaded(self) -> bool:
        return not any(b.is_meta for b in self.buffers(recurse=False))

    def _move_buffers(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool) -> None:
        """Apply ``fn`` to the buffers (``nn.Module._apply``); a subclass may restore what must not change."""
        super()._apply(fn, recurse)

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> QuantizedModule:
        # .to() / .cuda() / .half() replace the buffers: the weight object is rebuilt over them (shapes are
        # re-checked; values were checked when loaded) and the kernels' layout prepared for the new device
        self._move_buffers(fn, recurse)
        if self._buffers_loaded():
            self._qweight = self._from_buffers(check=False)
        self.prepare_layout()
        return self

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any, **kwargs: Any) -> None:
        # load_state_dict copies INTO the buffers: whatever was derived from them (kernel layouts, a dense
        # cache) is stale, so the weight is rebuilt with every format check
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
        if self._buffers_loaded():
            self.rebind(prefix.rstrip("."))

    def format_repr(self) -> str:
        """``format=<name>, bits=<b>``: the tail of every subclass's ``extra_repr``."""
        return f"format={self._qweight.name}, bits={self._qweight.bits}"


__all__ = ["QuantizedModule"]
