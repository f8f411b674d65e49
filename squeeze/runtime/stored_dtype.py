"""The token embedding and the LM head kept in the dtype the artifact stores them in (float16 / bfloat16).

The runtime computes in float32, and small unquantized tensors (norms, biases) are upcast once when loaded.
The embedding and the LM head are not small: on SmolLM2-135M (tied) they are half of a w4 artifact, and their
float32 copy doubled them in memory, so the compressed model did not shrink the process. They stay as stored:

- the input embedding (a plain ``nn.Embedding``) gathers its rows in the stored dtype and upcasts only those
  (:class:`Float32OutputEmbedding`): the same values as gathering from an upcast table;
- the LM head (``RowStableLinear``, squeeze.runtime.dense_linear) reads the stored weight through the native
  dense kernel, each element converted exactly to float32 as it is read, so every logit has the bits it had
  with the float32 copy; elsewhere it upcasts one tile of rows at a time.

A quantized embedding or head (SqueezeEmbedding, SqueezeLinear) is left alone: it is packed already.

Because of that, a model's first parameter (the embedding) says nothing about the dtype it computes in: that
dtype is decided once, when the model is loaded (:func:`set_compute_dtype`), and read with
:func:`compute_dtype` by everything that must follow it (the native attention kernel, serve's full-precision KV
pool, the reports).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

#: Stored dtypes kept as they are (others, and every other floating tensor, are upcast to float32).
KEPT_DTYPES = (torch.float16, torch.bfloat16)
#: The attribute the loaders record the compute dtype in (a plain attribute: not a parameter or buffer).
_COMPUTE_DTYPE = "_squeeze_compute_dtype"


def set_compute_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Record the dtype ``model``'s layers compute in (the loaders call this once, when they know it)."""
    setattr(model, _COMPUTE_DTYPE, dtype)


def compute_dtype(model: nn.Module) -> torch.dtype:
    """The dtype ``model``'s layers compute in (activations, attention, a full-precision KV cache).

    What the loader recorded (float32 for ``squeeze.load``; the dtype ``from_pretrained`` was asked for); for a
    model no squeeze loader built, the dtype of its floating parameters other than an embedding or LM head
    kept in a stored half-precision dtype (float32 when it has none). Never the first parameter's dtype: that
    is the embedding, which stays float16 in an artifact that stores it so.
    """
    recorded = getattr(model, _COMPUTE_DTYPE, None)
    if isinstance(recorded, torch.dtype):
        return recorded
    kept = stored_dtype_names(model)
    for name, param in model.named_parameters():
        if param.is_floating_point() and name not in kept:
            return param.dtype
    return torch.float32


class Float32OutputEmbedding(nn.Embedding):
    """``nn.Embedding`` over a float16 / bfloat16 table that returns float32 rows (ids (...) -> (..., d))."""

    def forward(self, input: Tensor) -> Tensor:  # noqa: A002 - nn.Embedding's own parameter name
        return super().forward(input).to(torch.float32)


def stored_dtype_names(model: nn.Module) -> set[str]:
    """Parameter names (as in the state dict) of ``model``'s plain input embedding and plain LM head: the
    weights loaded in their stored dtype. Empty for a model without such modules."""
    wanted: dict[int, str] = {}
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        module = getattr(model, getter, lambda: None)()
        if type(module) in (nn.Embedding, nn.Linear):
            wanted[id(module)] = getter
    return {f"{name}.weight" if name else "weight" for name, m in model.named_modules() if id(m) in wanted}


def upcast_embedding_output(model: nn.Module) -> bool:
    """Make ``model``'s input embedding a :class:`Float32OutputEmbedding` when its table is not float32 (in
    place: the class is swapped, parameters and ties stay); True when it did."""
    module = getattr(model, "get_input_embeddings", lambda: None)()
    if type(module) is nn.Embedding and module.weight.dtype in KEPT_DTYPES:
        module.__class__ = Float32OutputEmbedding
        return True
    return False


def restore_stored_dtype(model: nn.Module, stored: dict[str, torch.dtype]) -> bool:
    """For a model whose loader upcast everything to float32 (``from_pretrained``): put the weights named in
    ``stored`` (:func:`stored_dtype_names` -> the artifact's dtype) back in their float16 / bfloat16 (exact:
    they were upcast from it) and make the embedding return float32 rows. A weight loaded in another dtype
    (the user asked for one) is left alone. True when anything changed."""
    changed = False
    for name, dtype in stored.items():
        param = model.get_parameter(name)
        if dtype in KEPT_DTYPES and param.dtype == torch.float32:
            param.data = param.data.to(dtype)  # a tied head shares this Parameter: converted once for both
            changed = True
    if changed:
        upcast_embedding_output(model)
    return changed


__all__ = [
    "KEPT_DTYPES",
    "compute_dtype",
    "set_compute_dtype",
    "Float32OutputEmbedding",
    "stored_dtype_names",
    "upcast_embedding_output",
    "restore_stored_dtype",
]
