"""vLLM's method for a quantized token embedding and LM head (``weights.embedding_bits``), vocab-parallel.

vLLM splits an embedding (``VocabParallelEmbedding``) and an LM head (``ParallelLMHead``) by vocabulary rows:
each rank holds rows ``[org_vocab_start, org_vocab_end)`` of the table, padded after them to
``num_embeddings_per_partition``. This method registers one placeholder per stored role (as the linear method
does); when a module's tensors have all arrived, its weight is rebuilt with the format's checks and the
rank's rows kept (:func:`.sharding.vocab_rows`), compressed:

* ``embedding``: the looked-up rows' codes are gathered and only those rows dequantized
  (:func:`squeeze.runtime.embedding.gather_rows`, as ``squeeze run``'s SqueezeEmbedding does); the table is
  never expanded;
* ``apply`` (the LM head's logits): squeeze's runtime linear over the same rows (the native LUT kernels on
  CPU), zeros in the padding rows, which vLLM's logits processor drops;
* a tied LM head (``quantization_config.embeddings.tied``) shares the embedding's state (``tie_weights``):
  one stored copy serves both, as in squeeze's own runtime.

Memory: the rank's packed codes and LUT rows (bits/16 of a bf16 table), plus the native kernels' prepared
form for a head.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.utils import set_weight_attrs

from squeeze.errors import FormatError
from squeeze.format.dtypes import torch_dtype
from squeeze.integrations.vllm.artifact import ModuleSpecs
from squeeze.integrations.vllm.linear_method import register_linear, squeeze_linear
from squeeze.integrations.vllm.sharding import vocab_rows
from squeeze.quant.schemes import WeightFormat
from squeeze.runtime.embedding import check_embedding_weight, gather_rows
from squeeze.runtime.linear import SqueezeLinear
from squeeze.runtime.loader import quantized_weight_from

#: The attribute of a vLLM embedding / LM head layer that holds its :class:`EmbeddingState`.
STATE = "squeeze_embedding_state"


@dataclass
class EmbeddingState:
    """The rank's rows of one quantized table: where they come from, the tensors arriving, the weight kept."""

    module: str
    start: int
    stop: int
    #: rows of the rank's shard with vLLM's padding
    padded: int
    dtype: torch.dtype
    staged: dict[str, torch.Tensor] = field(default_factory=dict)
    weight: WeightFormat | None = None
    #: handle of the runtime linear (squeeze_linear) once a head reads the table
    handle: int | None = None


class SqueezeEmbeddingMethod(QuantizeMethodBase):
    """The method of a vLLM embedding or LM head over the artifact's quantized table ``module``; ``tied``: an
    LM head that reads the embedding ``module`` (it registers no tensors of its own)."""

    def __init__(self, specs: ModuleSpecs, module: str, *, tied: bool = False) -> None:
        self.specs = specs
        self.module = module
        self.tied = tied

    def create_weights(
        self,
        layer: nn.Module,
        input_size_per_partition: int,
        output_partition_sizes: list[int],
        input_size: int,
        output_size: int,
        params_dtype: torch.dtype,
        **extra_weight_attrs: Any,
    ) -> None:
        indices: Any = layer.shard_indices  # vLLM's VocabParallelEmbeddingShardIndices
        state = EmbeddingState(
            module=self.module,
            start=int(indices.org_vocab_start_index),
            stop=int(indices.org_vocab_end_index),
            padded=int(sum(output_partition_sizes)),
            dtype=params_dtype,
        )
        layer.__dict__[STATE] = state  # plain state, not a parameter or submodule
        if self.tied:  # the embedding's state arrives by tie_weights
            return
        for role, dtype in self.specs.roles[self.module].items():
            param = nn.Parameter(torch.empty(0, dtype=torch_dtype(dtype)), requires_grad=False)
            set_weight_attrs(param, {"weight_loader": self._loader(state, role)})
            layer.register_parameter(role, param)

    def _loader(self, state: EmbeddingState, role: str) -> Callable[..., None]:
        expected = frozenset(self.specs.roles[self.module])

        def load(param: nn.Parameter, loaded: torch.Tensor, *args: Any, **kwargs: Any) -> None:
            state.staged[role] = loaded
            if state.staged.keys() >= expected:
                self._build(state, param.device)

        return load

    def _build(self, state: EmbeddingState, device: torch.device) -> None:
        tensors = {f"{state.module}.{role}": t for role, t in state.staged.items()}
        whole = quantized_weight_from(tensors, state.module, self.specs.modules[state.module])
        check_embedding_weight(whole, state.module)
        part = vocab_rows(whole, state.start, state.stop, state.module)
        owned = {role: t.to(device, copy=True) for role, t in part.tensors_by_role().items()}
        state.weight = type(part).from_roles(part.bits, part.in_features, part.params(), owned)
        state.staged.clear()

    def tie_weights(self, layer: nn.Module, embed_tokens: nn.Module) -> nn.Module:
        """A tied LM head reads the embedding's rows (the same state: one stored copy)."""
        shared = embed_tokens.__dict__.get(STATE)
        if not isinstance(shared, EmbeddingState) or shared.module != self.module:
            raise FormatError(
                f"the artifact ties the LM head to its quantized embedding {self.module}, but vLLM ties it to "
                "a layer that does not hold it",
                hint="config.json does not match the tensors; re-create the artifact with squeeze compress",
            )
        layer.__dict__[STATE] = shared
        return layer

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        state: EmbeddingState = layer.__dict__[STATE]
        if state.weight is None:
            missing = sorted(frozenset(self.specs.roles.get(self.module, {})) - state.staged.keys())
            raise FormatError(
                f"the artifact lacks tensor {self.module}.{missing[0] if missing else 'weight_packed'}",
                hint="the artifact is incomplete; re-create it with squeeze compress",
            )
        if isinstance(layer, ParallelLMHead) and state.handle is None:
            state.handle = register_linear(SqueezeLinear(state.weight))

    def embedding(self, layer: nn.Module, input_: torch.Tensor) -> torch.Tensor:
        """ids (...) in [0, padded) -> (..., d) in the layer's dtype; padding rows (which vLLM masks) read row 0."""
        state: EmbeddingState = layer.__dict__[STATE]
        assert state.weight is not None, "weights not loaded"
        flat = input_.reshape(-1).to(torch.int64)
        flat = torch.where(flat < state.weight.out_features, flat, torch.zeros_like(flat))
        rows = gather_rows(state.weight, flat).dequantize(torch.float32).to(state.dtype)
        return rows.reshape(*input_.shape, state.weight.in_features)

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (T, d) -> logits of the rank's padded vocabulary shard (T, padded)."""
        state: EmbeddingState = layer.__dict__[STATE]
        assert state.handle is not None and state.weight is not None, "weights not loaded"
        y = squeeze_linear(x, state.handle)
        pad = state.padded - state.weight.out_features
        if pad:
            y = torch.nn.functional.pad(y, (0, pad))
        return y + bias if bias is not None else y


__all__ = ["SqueezeEmbeddingMethod", "EmbeddingState"]
