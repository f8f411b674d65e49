"""vLLM's fused-MoE method for squeeze's routed experts: the rank's experts kept compressed, run on the codes.

A squeeze MoE artifact stores each layer's routed experts as two quantized expert parameters (one LUT per
(expert, row); the experts contract of docs/format.md): ``{layer}.gate_up_proj`` (E*2I, H) and
``{layer}.down_proj`` (E*H, I). vLLM builds the layer as its ``RoutedExperts`` (``...mlp.experts``) and asks
this method for its weights. What happens:

* loading: vLLM's own ``RoutedExperts.load_weights`` maps checkpoint names to its ``w13_weight`` /
  ``w2_weight``; this method installs a loader of its own on the layer (``create_weights``) that stages the
  two parameters' stored tensors (``weight_packed``, ``weight_lut``, the sparse CSR...) and, once both are
  complete, rebuilds each with the format's full checks (the same :func:`quantized_weight_from` as the
  linears: from the bytes the config verified, or with ``load_format="squeeze"`` from the bytes hashed while
  loading) and keeps only this rank's part (:func:`.sharding.take_expert_shards`: its experts under expert
  parallelism, its intermediate channels under tensor parallelism);
* forward: for each expert the batch routes to this rank, ``gate_up`` then SiLU-and-multiply then ``down``
  by :meth:`squeeze.runtime.experts.SqueezeExperts.linear` (the native LUT kernels on the packed codes on
  CPU, the dequantized expert elsewhere), weighted by the router and summed per token; vLLM's runner then
  all-reduces the tensor-parallel partial sums, as for its own experts.

The choice and its cost: the experts stay compressed in memory (the rank's packed codes and LUTs, plus the
native kernels' prepared form: 12 bytes per sparse entry, none for a dense LUT), about bits/16 of the bf16
weights vLLM's unquantized method would hold; no dense expert matrix is kept. The price is speed on wide
batches: one kernel call per routed expert and projection (a loop over at most E experts per layer and
step) instead of vLLM's grouped GEMM. Supported: gated SiLU experts without biases (Mixtral, Qwen2/3-MoE,
DeepSeek-V3, GLM-4-MoE...); transposed or biased experts (gpt-oss) are refused at start, naming the layer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

from squeeze.errors import FormatError
from squeeze.integrations.vllm.artifact import ModuleSpecs
from squeeze.integrations.vllm.sharding import ExpertGeometry, take_expert_shards
from squeeze.quant.schemes import WeightFormat
from squeeze.runtime.experts import SqueezeExperts, check_expert_rows, experts_layout, format_spec
from squeeze.runtime.loader import quantized_weight_from

#: The attribute of a vLLM RoutedExperts layer that holds its :class:`ExpertsState`.
STATE = "squeeze_experts_state"
#: The two expert parameters of a gated MoE layer, by the names a checkpoint module may have after vLLM's
#: renames (Mixtral's mapper turns ``.down_proj.`` into ``.w2.``).
PROJECTIONS = {"gate_up_proj": ("gate_up_proj", "w13"), "down_proj": ("down_proj", "w2")}


@dataclass
class ExpertsState:
    """One vLLM MoE layer's squeeze experts: where they come from, the tensors still arriving, the runtime form."""

    prefix: str
    geometry: ExpertGeometry
    num_experts: int
    #: global expert id -> local id (-1: another rank's), or None when the rank holds every expert
    local_of: torch.Tensor | None
    device: torch.device
    staged: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    gate_up: SqueezeExperts | None = None
    down: SqueezeExperts | None = None


#: Every MoE layer's state built in this process, indexed by handle: the custom op below takes a handle, so
#: torch.compile traces through it without seeing the native kernels' ctypes calls.
_EXPERTS: list[ExpertsState] = []


@torch.library.custom_op("squeeze::experts", mutates_args=())
def squeeze_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, handle: int) -> torch.Tensor:
    """x (T, H), router weights (T, K), global expert ids int (T, K) -> (T, H): the rank's routed experts' sum."""
    return routed_experts(_EXPERTS[handle], x, topk_weights, topk_ids)


@squeeze_experts.register_fake
def _squeeze_experts_shape(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, handle: int) -> Any:
    return torch.empty_like(x)


def routed_experts(state: ExpertsState, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The eager MoE loop of transformers' families (experts in ascending order, each over the tokens routed
    to it, weighted and summed by ``index_add_``) over the rank's experts: x (T, H) -> (T, H) in x's dtype."""
    assert state.gate_up is not None and state.down is not None, "weights not loaded"
    ids = ids.to(torch.int64)
    if state.local_of is not None:  # expert parallelism: other ranks' experts map to -1 and are skipped
        ids = state.local_of.to(ids.device)[ids]
    out = torch.zeros_like(x)
    for e in torch.unique(ids).tolist():
        if e < 0:
            continue
        pos, tok = torch.where(ids.T == e)
        gate, up = state.gate_up.linear(e, x[tok]).chunk(2, dim=-1)
        y = state.down.linear(e, F.silu(gate) * up)
        out.index_add_(0, tok, (y * weights[tok, pos, None]).to(out.dtype))
    return out


def expert_modules(specs: ModuleSpecs, prefix: str) -> dict[str, str]:
    """Projection ("gate_up_proj" / "down_proj") -> the artifact's expert parameter of vLLM's MoE layer
    ``prefix``; empty when the artifact quantizes none there. FormatError for a layout vLLM's experts cannot
    take (transposed, a projection missing) or a parameter that is not an expert parameter."""
    found: dict[str, str] = {}
    for proj in PROJECTIONS:
        name = f"{prefix}.{proj}"
        spec = specs.modules.get(name)
        if spec is None:
            continue
        layout = experts_layout(spec, name)
        if layout is None:
            raise FormatError(f"quantization_config.modules[{name!r}] is not an expert parameter (no 'experts')")
        if layout[1]:
            raise FormatError(
                f"{name}: the artifact's experts are transposed (E, in, out), a layout the squeeze vLLM plugin "
                "does not serve",
                hint="serve this artifact with squeeze run / squeeze serve",
            )
        found[proj] = name
    if found and len(found) < len(PROJECTIONS):
        kept = next(f"{prefix}.{p}" for p in PROJECTIONS if p not in found)
        raise FormatError(
            f"vLLM runs the experts of {prefix} as one fused layer, but the artifact leaves {kept} unquantized",
            hint="re-compress with a recipe that quantizes both expert projections, or neither",
        )
    return found


class SqueezeFusedMoEMethod(FusedMoEMethodBase):
    """The fused-MoE method of one vLLM MoE layer whose experts are the artifact's ``modules``
    (projection -> expert parameter, :func:`expert_modules`)."""

    def __init__(self, moe: Any, specs: ModuleSpecs, modules: dict[str, str], prefix: str) -> None:
        super().__init__(moe)
        self.specs = specs
        self.modules = modules
        self.prefix = prefix

    def create_weights(
        self,
        layer: nn.Module,
        num_experts: int,
        hidden_size: int,
        intermediate_size_per_partition: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        self._check_layer(layer)
        parallel = self.moe.moe_parallel_config
        local_of = getattr(layer, "expert_map", None)
        total = int(self.moe.num_experts)
        if local_of is None:
            experts: tuple[int, ...] = tuple(range(total))
        else:
            local_of = local_of.detach().to("cpu", torch.int64)
            order = sorted((int(local), g) for g, local in enumerate(local_of.tolist()) if local >= 0)
            experts = tuple(g for _local, g in order)
        stored = {experts_layout(self.specs.modules[name], name) for name in self.modules.values()}
        count = {layout[0] for layout in stored if layout is not None}
        if count != {total}:
            raise FormatError(
                f"{self.prefix}: the artifact stores {sorted(count)} experts, but vLLM's layer routes to {total}",
                hint="config.json does not match the tensors; re-create the artifact with squeeze compress",
            )
        geometry = ExpertGeometry(
            experts=experts,
            tp_rank=int(parallel.tp_rank),
            tp_size=int(parallel.tp_size),
            hidden=int(hidden_size),
            intermediate=int(intermediate_size_per_partition) * int(parallel.tp_size),
        )
        state = ExpertsState(self.prefix, geometry, total, local_of, torch.device(self.moe.device or "cpu"))
        _EXPERTS.append(state)
        layer.__dict__[STATE] = len(_EXPERTS) - 1  # plain state, not a parameter or submodule
        # vLLM's RoutedExperts.load_weights maps names to its w13 / w2 tensors: squeeze's go through this one
        routed: Any = layer  # vLLM's RoutedExperts
        routed.load_weights = self._loader(state)

    def _check_layer(self, layer: nn.Module) -> None:
        """FormatError for an MoE layer this method cannot run as vLLM configured it."""
        moe = self.moe
        activation = getattr(moe.activation, "value", moe.activation)
        unsupported = []
        if activation != "silu" or not moe.is_act_and_mul:
            unsupported.append(f"activation {activation!r} (gated SiLU only)")
        if moe.has_bias:
            unsupported.append("expert biases")
        if getattr(layer, "apply_router_weight_on_input", False):
            unsupported.append("router weights applied to the input")
        if unsupported:
            raise FormatError(
                f"{self.prefix}: the squeeze vLLM plugin cannot run these experts: {', '.join(unsupported)}",
                hint="serve this artifact with squeeze run / squeeze serve",
            )

    def _loader(self, state: ExpertsState) -> Callable[[Iterable[tuple[str, torch.Tensor]]], Iterator[str]]:
        names = {alias: proj for proj, aliases in PROJECTIONS.items() for alias in aliases}
        expected = {proj: frozenset(self.specs.roles[name]) for proj, name in self.modules.items()}

        def load_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[str]:
            for name, tensor in weights:  # names relative to the layer: "gate_up_proj.weight_packed"...
                module, _, role = name.rpartition(".")
                proj = names.get(module)
                if proj is None or role not in expected[proj]:
                    raise FormatError(
                        f"{state.prefix}: the artifact has tensor {state.prefix}.{name}, which is not a stored "
                        "role of the layer's quantized experts",
                        hint="the artifact does not match its config.json; re-create it with squeeze compress",
                    )
                state.staged.setdefault(proj, {})[role] = tensor
                yield name
                if all(state.staged.get(p, {}).keys() >= expected[p] for p in expected):
                    self._build(state)

        return load_weights

    def _build(self, state: ExpertsState) -> None:
        """Both expert parameters rebuilt from the staged tensors with every format check, this rank's part of
        them kept (a copy of its own on the layer's device: the loaded file's bytes can be freed)."""
        whole: dict[str, WeightFormat] = {}
        for proj, name in self.modules.items():
            tensors = {f"{name}.{role}": t for role, t in state.staged[proj].items()}
            whole[proj] = quantized_weight_from(tensors, name, format_spec(dict(self.specs.modules[name])))
            check_expert_rows(whole[proj], state.num_experts, name)
        state.staged.clear()
        parts = take_expert_shards(
            whole["gate_up_proj"], whole["down_proj"], state.num_experts, state.geometry, state.prefix
        )
        local = len(state.geometry.experts)
        gate_up, down = (self._owned(part, state.device) for part in parts)
        state.gate_up = SqueezeExperts(gate_up, local)
        state.down = SqueezeExperts(down, local)

    @staticmethod
    def _owned(part: WeightFormat, device: torch.device) -> WeightFormat:
        owned = {role: tensor.to(device, copy=True) for role, tensor in part.tensors_by_role().items()}
        return type(part).from_roles(part.bits, part.in_features, part.params(), owned)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        state = _EXPERTS[layer.__dict__[STATE]]
        if state.gate_up is not None:
            return
        for proj, name in self.modules.items():
            found = state.staged.get(proj, {})
            missing = sorted(frozenset(self.specs.roles[name]) - found.keys())
            if missing:
                raise FormatError(
                    f"the artifact lacks tensor {name}.{missing[0]}",
                    hint="the artifact is incomplete; re-create it with squeeze compress",
                )
        raise AssertionError(f"{state.prefix}: every expert tensor arrived, yet the experts were not built")

    def get_fused_moe_quant_config(self, layer: nn.Module) -> None:
        return None  # no vLLM kernel runs these experts: nothing to describe to one

    def apply(
        self,
        layer: nn.Module,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        shared_experts: Any,
        shared_experts_input: torch.Tensor | None,
    ) -> torch.Tensor:
        # shared experts, when the model has them, are run by vLLM's runner (this method has no fused kernel)
        return squeeze_experts(x, topk_weights, topk_ids, layer.__dict__[STATE])


__all__ = ["SqueezeFusedMoEMethod", "ExpertsState", "expert_modules", "routed_experts", "squeeze_experts"]
