"""SqueezeExperts: one quantized 3-D expert parameter of a MoE model, kept compressed; only routed experts run.

transformers 5 keeps a MoE layer's routed experts as 3-D parameters of one experts module
(``...mlp.experts.gate_up_proj`` of shape (E, out, in), or (E, in, out) where the class sets
``is_transposed``, as gpt-oss does). squeeze quantizes such a parameter as ONE matrix of shape (E*out, in)
by a registered weight format: rows ``e*out .. (e+1)*out-1`` are expert e's output rows (the experts
contract of docs/format.md). This module stands in for the parameter: it holds the format's buffers (named
as in the artifact, ``{name}.weight_packed`` ...) and is registered on the experts module under the
parameter's attribute name.

Two ways to use it, both touching only the experts the batch routes to:

* ``experts.gate_up_proj.linear(e, x)``: ``x @ W_e^T`` for expert e. On the CPU the native LUT kernels run
  it on the packed codes (their one matmul; at one row ~50x faster than dequantizing the expert first,
  1536 x 2048 at 4 bits); elsewhere the expert is dequantized and multiplied. The experts forward the loaders select
  (:func:`~squeeze.runtime.experts_forward.squeeze_experts_forward`, registered with transformers'
  ``ExpertsInterface`` as "squeeze") computes each routed expert this way, with the family's own gate
  (``_apply_gate``), activation and biases.
* indexing it like the parameter (``experts.gate_up_proj[e]``, a 0-d tensor, or a 1-D index tensor) returns
  the dequantized expert(s) in the parameter's layout and dtype: what transformers' own eager experts
  forward (and ``batched_mm``) read, so they run unchanged too; the grouped forwards read whole 3-D tensors
  (not supported).

Dequantization paths, each bit-identical to the reference ``dequantize`` of the expert's rows: on the CPU
the native kernels' row-range dequantization (``sq_dequant_rows``, then one gather back from the kernels'
column order); on CUDA with triton one grouped Triton kernel for all selected experts
(:mod:`.kernels.triton_experts`); otherwise (RTN, no C++ compiler) the format's own ``dequantize`` of the
expert's row slice. The native kernels' prepared form (one per expert, over the module's own codes and LUT)
adds 12 bytes per sparse entry, and its int8 form (``activations="int8"``) 20 bytes per row and
8 per sparse entry.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from squeeze.errors import FormatError
from squeeze.limits import is_int
from squeeze.quant.schemes import WeightFormat
from squeeze.runtime.activations import DEFAULT_ACTIVATIONS, Activations
from squeeze.runtime.kernels.cpu_lut import CpuPreparedLut, cpu_lut_linear, permuted_positions, prepare_cpu
from squeeze.runtime.qmodule import QuantizedModule

#: The module-entry keys of an expert parameter (popped before the format's ``from_spec``).
EXPERTS_KEY, TRANSPOSED_KEY = "experts", "transposed"


def experts_layout(spec: Any, name: str) -> tuple[int, bool] | None:
    """(E, transposed) of a ``quantization_config.modules`` entry naming an expert parameter, or None for an
    ordinary linear / embedding entry (no "experts" key). FormatError for malformed values."""
    if not isinstance(spec, Mapping) or EXPERTS_KEY not in spec:
        return None
    experts, transposed = spec.get(EXPERTS_KEY), spec.get(TRANSPOSED_KEY, False)
    if not is_int(experts) or experts < 1:
        raise FormatError(
            f"quantization_config.modules[{name!r}].experts must be an integer >= 1, found {experts!r}",
            hint="re-create the artifact with squeeze compress",
        )
    if not isinstance(transposed, bool):
        raise FormatError(
            f"quantization_config.modules[{name!r}].transposed must be true or false, found {transposed!r}",
            hint="re-create the artifact with squeeze compress",
        )
    return int(experts), transposed


def format_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The module entry without the experts keys: what the weight format's ``from_spec`` reads."""
    return {k: v for k, v in spec.items() if k not in (EXPERTS_KEY, TRANSPOSED_KEY)}


def check_expert_rows(qweight: WeightFormat, experts: int, name: str) -> int:
    """Output rows per expert (the weight's rows / E); FormatError when E does not divide them."""
    rows = qweight.out_features
    if experts < 1 or rows % experts:
        raise FormatError(
            f"{name}: the quantized weight has {rows} rows, not a multiple of its {experts} experts",
            hint="config.json does not belong to these tensors; re-create the artifact",
        )
    return rows // experts


class SqueezeExperts(QuantizedModule):
    """A quantized expert parameter: ``self[e]`` is expert e's matrix, (out, in) or (in, out) when transposed.

    ``qweight``: the format's weight of shape (E*out, in); ``experts``: E; ``transposed``: the parameter is
    (E, in, out); ``dtype``: the dtype matrices are returned in (the parameter's).
    """

    #: transformers' init helpers skip a tensor so flagged; a loaded quantized weight has nothing to initialise
    _is_hf_initialized = True
    unnamed = "experts"

    def __init__(
        self,
        qweight: WeightFormat,
        experts: int,
        *,
        transposed: bool = False,
        dtype: torch.dtype = torch.float32,
        activations: Activations = DEFAULT_ACTIVATIONS,
    ):
        expert_rows = check_expert_rows(qweight, int(experts), self.unnamed)
        super().__init__(qweight)
        #: the native LUT kernels' activation precision (cpu_w8.ACTIVATIONS)
        self.activations = activations
        self.num_experts = int(experts)
        self.expert_rows = expert_rows
        self.in_features = qweight.in_features
        self.transposed = bool(transposed)
        self.compute_dtype = dtype
        #: expert matrices used so far (dequantized, or run by ``linear``): one per routed expert per call
        self.used = 0
        self._prepared: Any = None  # the grouped Triton kernel's layout, on CUDA
        self._cpu: list[CpuPreparedLut] | None = None  # the native kernels' form of each expert, on CPU
        self._cpu_columns: Tensor | None = None  # int64 (in,): column j's position in the kernels' order
        self.prepare_layout()

    # -- what transformers may read off a parameter --------------------------------------------------

    @property
    def shape(self) -> torch.Size:
        """(E, out, in), or (E, in, out) when transposed: the parameter's shape."""
        inner = (self.in_features, self.expert_rows) if self.transposed else (self.expert_rows, self.in_features)
        return torch.Size((self.num_experts, *inner))

    @property
    def dtype(self) -> torch.dtype:
        return self.compute_dtype

    @property
    def device(self) -> torch.device:
        return self.storage_device

    @property
    def ndim(self) -> int:
        return 3

    def dim(self) -> int:
        return 3

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def __len__(self) -> int:
        return self.num_experts

    @property
    def weight_path(self) -> str:
        """How routed experts run (module docstring): ``native-<isa>`` (the native kernels on the packed codes),
        ``triton`` (dequantized by the grouped kernel) or ``reference`` (dequantized by the format)."""
        if self._prepared is not None:
            return "triton"
        return f"native-{self._cpu[0].kernels.isa}" if self._cpu else "reference"

    # -- the product -----------------------------------------------------------------------------------

    def linear(self, e: int, x: Tensor) -> Tensor:
        """``x (..., in) @ W_e^T`` -> (..., out) in x's dtype: expert ``e``'s linear, by the native kernels on the
        packed codes where they run (CPU, LUT formats, no gradient wanted), else through the dequantized expert
        (whatever the parameter's layout, W_e here is (out, in))."""
        if self._cpu and not (torch.is_grad_enabled() and x.requires_grad) and x.device.type == "cpu":
            self.used += 1
            return cpu_lut_linear(x, self._cpu[e])
        weight = self.dequantize_experts(torch.tensor([e]), x.dtype)[0]  # (out, in)
        return F.linear(x, weight.to(x.device))

    # -- indexing ------------------------------------------------------------------------------------

    def __getitem__(self, index: Any) -> Tensor:
        """Expert ``index``'s matrix (int or 0-d integer tensor), or (k, ...) stacked for a 1-D index tensor
        (or a slice). Only the indexed experts are dequantized. IndexError for an expert outside [0, E)."""
        if isinstance(index, slice):
            index = torch.arange(self.num_experts)[index]
        if isinstance(index, Tensor):
            if index.dtype.is_floating_point or index.dtype == torch.bool or index.dim() > 1:
                raise IndexError(
                    f"experts are indexed by an integer or a 1-D integer tensor, found {index.dtype} "
                    f"{tuple(index.shape)}"
                )
            if index.dim() == 0:
                return self.expert(int(index))
            return self.experts(index)
        if is_int(index):
            return self.expert(int(index))
        raise IndexError(f"experts are indexed by an integer or a 1-D integer tensor, found {type(index).__name__}")

    def expert(self, e: int) -> Tensor:
        """Expert ``e``'s matrix in the parameter's layout and dtype."""
        return self.experts(torch.tensor([e]))[0]

    def experts(self, index: Tensor) -> Tensor:
        """(k, out, in) (or (k, in, out) when transposed) for the k expert ids of ``index`` (int (k,)); each
        distinct expert is dequantized once."""
        ids = index.reshape(-1).to(device="cpu", dtype=torch.int64)
        if ids.numel() and (int(ids.min()) < -self.num_experts or int(ids.max()) >= self.num_experts):
            raise IndexError(f"expert index out of range: this layer has {self.num_experts} experts")
        ids = ids % self.num_experts  # negative indices count from the end, as for the parameter
        unique, inverse = torch.unique(ids, return_inverse=True)
        mats = self.dequantize_experts(unique, self.compute_dtype)  # (u, out, in)
        out = mats if unique.numel() == ids.numel() and bool((unique == ids).all()) else mats[inverse.to(mats.device)]
        return out.transpose(1, 2) if self.transposed else out

    def dequantize_experts(self, ids: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
        """(k, out, in) in ``dtype``: the experts ``ids`` (int64 (k,), each in [0, E)) as stored (rows of the
        format's matrix), bit-identical to the reference ``dequantize()`` of their rows."""
        self.used += int(ids.numel())
        if self._prepared is not None:
            from squeeze.runtime.kernels.triton_experts import dequantize_experts

            return dequantize_experts(self._prepared, self._qweight, ids, self.expert_rows, dtype)
        if self._cpu and self._cpu_columns is not None:
            return self._native_rows(self._cpu, self._cpu_columns, ids, dtype)
        out = self.expert_rows
        mats = [self._qweight.row_slice(e * out, (e + 1) * out).dequantize(dtype) for e in ids.tolist()]
        if not mats:
            return torch.empty(0, out, self.in_features, dtype=dtype, device=self.device)
        return torch.stack(mats)

    def _native_rows(self, cpu: list[CpuPreparedLut], columns: Tensor, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """(k, out, in) float32 rows of the experts ``ids`` by the native kernels, columns put back in order."""
        rows = self.expert_rows
        tiles = torch.empty(int(ids.numel()), rows, self.in_features, dtype=torch.float32)  # kernels' column order
        threads = torch.get_num_threads()
        for i, e in enumerate(ids.tolist()):
            kernels = cpu[e].kernels
            kernels.lib.sq_dequant_rows(cpu[e].weight_ref, 0, rows, tiles[i].data_ptr(), kernels.isa_code, threads)
        # a gather along dim 1 of the 2-D view: 25x faster than along dim 2 of the 3-D tensor (measured)
        out = tiles.view(-1, self.in_features).index_select(1, columns).view(tiles.shape) if tiles.numel() else tiles
        return out if dtype == torch.float32 else out.to(dtype)  # float32 values rounded once, as the reference

    def dequantize(self, dtype: torch.dtype | None = None) -> Tensor:
        """The whole parameter (E, out, in) (or (E, in, out)) in ``dtype`` (default: the parameter's), by the
        reference path: for tests and exports; ``forward`` paths never build it."""
        full = self._qweight.dequantize(dtype or self.compute_dtype).reshape(
            self.num_experts, self.expert_rows, self.in_features
        )
        return full.transpose(1, 2) if self.transposed else full

    # -- buffers set or moved ------------------------------------------------------------------------

    def check_weight(self, qweight: WeightFormat, name: str) -> None:
        check_expert_rows(qweight, self.num_experts, name)

    def _move_buffers(self, fn: Callable[[Tensor], Tensor], recurse: bool) -> None:
        # .to(device) moves the buffers; .to(dtype) / .half() must not convert the stored LUT or sparse values
        # (the format fixes their dtypes): they are put back, and the experts are returned in the new dtype
        stored = dict(self.named_buffers(recurse=False))
        super()._move_buffers(fn, recurse)
        for name, old in stored.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:  # the original, moved: a cast back could round
                self.compute_dtype = new.dtype
                self._buffers[name] = old.to(new.device)

    def prepare_layout(self) -> None:
        """Drop the experts' kernel forms; prepare the grouped Triton (CUDA) or per-expert native (CPU) ones."""
        self._prepared, self._cpu, self._cpu_columns = None, None, None
        if self.device.type == "cuda":
            from squeeze.runtime.kernels.triton_experts import prepare_experts

            self._prepared = prepare_experts(self._qweight, self.device)
        elif self.device.type == "cpu":
            rows = self.expert_rows
            parts = [self._qweight.row_slice(e * rows, (e + 1) * rows) for e in range(self.num_experts)]
            prepared = [prepare_cpu(part, activations=self.activations) for part in parts]  # type: ignore[arg-type]
            if all(p is not None for p in prepared):  # each over views of the module's own codes and LUT
                self._cpu = [p for p in prepared if p is not None]
                n, bits = self.in_features, self._qweight.bits
                self._cpu_columns = permuted_positions(torch.arange(n), n, bits)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, shape={tuple(self.shape)}, transposed={self.transposed}, {self.format_repr()}"
        )


def replace_expert_parameter(
    model: nn.Module,
    name: str,
    qweight: WeightFormat,
    experts: int,
    transposed: bool,
    *,
    dtype: torch.dtype | None = None,
    activations: Activations = DEFAULT_ACTIVATIONS,
) -> SqueezeExperts:
    """Replace the 3-D parameter ``name`` of ``model`` (e.g. ``model.layers.1.mlp.experts.gate_up_proj``) by a
    SqueezeExperts over ``qweight`` (E*out, in). FormatError when the model has no such parameter, or one of
    another shape or layout. ``dtype``: the dtype experts are returned in (default: the parameter's).
    ``activations``: the native kernels' activation precision (cpu_w8.ACTIVATIONS)."""
    parent_name, _, child = name.rpartition(".")
    try:
        parent: Any = model.get_submodule(parent_name) if parent_name else model
    except AttributeError:
        parent = None
    old = parent._parameters.get(child) if parent is not None else None
    if old is None or old.dim() != 3:
        raise FormatError(
            f"quantization_config names {name!r} as an expert parameter, which is not a 3-D parameter of this "
            "architecture",
            hint="config.json does not belong to these tensors; re-create the artifact",
        )
    layout = getattr(parent, "is_transposed", None)
    if isinstance(layout, bool) and layout != transposed:
        raise FormatError(
            f"{name}: the artifact says transposed={transposed}, but this architecture's experts are "
            f"{'' if layout else 'not '}transposed",
            hint="config.json does not belong to these tensors; re-create the artifact",
        )
    rows = check_expert_rows(qweight, experts, name)
    want = (experts, qweight.in_features, rows) if transposed else (experts, rows, qweight.in_features)
    if tuple(old.shape) != want:
        raise FormatError(
            f"{name}: config.json builds a {tuple(old.shape)} expert parameter, but the artifact's weight is "
            f"{want} ({experts} experts of {rows} x {qweight.in_features})",
            hint="config.json does not belong to these tensors; re-create the artifact",
        )
    module = SqueezeExperts(qweight, experts, transposed=transposed, dtype=dtype or old.dtype, activations=activations)
    del parent._parameters[child]
    setattr(parent, child, module)
    return module


__all__ = [
    "SqueezeExperts",
    "replace_expert_parameter",
    "experts_layout",
    "format_spec",
    "check_expert_rows",
    "EXPERTS_KEY",
    "TRANSPOSED_KEY",
]
