"""QuantizedModule: the life cycle SqueezeLinear, SqueezeEmbedding and SqueezeExperts share (buffers by role,
state-dict loading, rebind, moves), each held to the format's reference dequantization bit for bit."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from squeeze.errors import FormatError
from squeeze.quant.schemes import WeightFormat
from squeeze.quant.schemes.lut import quantize_lut
from squeeze.quant.schemes.rtn import rtn_quantize
from squeeze.runtime.embedding import SqueezeEmbedding
from squeeze.runtime.experts import SqueezeExperts
from squeeze.runtime.linear import SqueezeLinear
from squeeze.runtime.qmodule import QuantizedModule

ROWS, COLS = 4 * 6, 36  # 4 experts of 6 rows; 36 columns: a ragged last byte at 3 bits
MATRIX = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(3))
OTHER = torch.randn(ROWS, COLS, generator=torch.Generator().manual_seed(4))
MODULES: dict[str, Callable[[WeightFormat], QuantizedModule]] = {
    "linear": SqueezeLinear,
    "embedding": SqueezeEmbedding,
    "experts": lambda q: SqueezeExperts(q, 4),
}
FORMATS: dict[str, Callable[[torch.Tensor], WeightFormat]] = {
    "lut3": lambda w: quantize_lut(w, None, 3),
    "lut4-int8": lambda w: quantize_lut(w, None, 4, lut_dtype="int8"),
    "rtn8": lambda w: rtn_quantize(w, 8),
}


def _matrix(module: QuantizedModule) -> torch.Tensor:
    """The module's weight as (rows, cols) float32, by the format's reference path over its buffers."""
    return module.qweight.dequantize(torch.float32).reshape(ROWS, COLS)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("kind", sorted(MODULES))
def test_buffers_by_role_and_state_dict_loading_rebuild_the_weight(kind: str, fmt: str) -> None:
    module = MODULES[kind](FORMATS[fmt](MATRIX))
    other = FORMATS[fmt](OTHER)
    assert dict(module.named_buffers()).keys() == other.tensors_by_role().keys()  # the artifact's role names
    assert module.method == other.method and f"format={other.name}" in repr(module)
    module.load_state_dict(other.tensors_by_role())  # copies INTO the buffers: the weight must follow
    assert torch.equal(_matrix(module), other.dequantize(torch.float32))


@pytest.mark.parametrize("dense_cache", [False, True])
def test_loading_a_state_dict_drops_what_was_derived_from_the_old_buffers(dense_cache: bool) -> None:
    fisher = torch.rand(ROWS, COLS, generator=torch.Generator().manual_seed(5))
    module = SqueezeLinear(quantize_lut(MATRIX, fisher, 3, 0.05), dense_cache=dense_cache)  # a sparse part too
    x = OTHER[:3]
    module(x)  # the dense cache, or the kernels' sparse residuals, now derive from MATRIX
    other = quantize_lut(OTHER, fisher, 3, 0.05)
    module.load_state_dict(other.tensors_by_role())
    torch.testing.assert_close(module(x), x @ other.dequantize(torch.float32).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_a_module_built_on_meta_is_filled_then_rebound(kind: str) -> None:
    real = FORMATS["lut3"](MATRIX)
    meta = type(real).from_roles(
        real.bits, real.in_features, real.params(), {k: v.to("meta") for k, v in real.tensors_by_role().items()}
    )
    module = MODULES[kind](meta)
    assert module.storage_device.type == "meta"
    for name, tensor in real.tensors_by_role().items():  # what transformers' loader does: assign by name
        module._buffers[name] = tensor
    module.rebind("model.layer")
    assert torch.equal(_matrix(module), real.dequantize(torch.float32))
    if kind == "linear":
        x = MATRIX[:2]  # the kernels sum in their own order: equal to rounding, not bit for bit
        torch.testing.assert_close(module(x), x @ real.dequantize(torch.float32).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_rebind_runs_every_format_check_and_names_the_module(kind: str) -> None:
    module = MODULES[kind](FORMATS["lut3"](MATRIX))
    module._buffers["weight_packed"] = module._buffers["weight_packed"][:, :-1]  # a byte short per row
    with pytest.raises(FormatError, match=r"model\.bad"):
        module.rebind("model.bad")


def test_each_module_adds_its_own_check_on_rebind() -> None:
    experts = SqueezeExperts(FORMATS["lut3"](MATRIX), 4)
    for name, tensor in FORMATS["lut3"](MATRIX[:-1]).tensors_by_role().items():  # 23 rows: 4 does not divide
        experts._buffers[name] = tensor
    with pytest.raises(FormatError, match=r"experts\.up.*not a multiple of its 4 experts"):
        experts.rebind("experts.up")
    embedding = SqueezeEmbedding(FORMATS["lut3"](MATRIX))
    with_sparse = quantize_lut(MATRIX, torch.rand(ROWS, COLS), 3, sensitive_fraction=0.05)
    for name, tensor in with_sparse.tensors_by_role().items():  # a CSR part: its tensors are not by row
        embedding.register_buffer(name, tensor)
    with pytest.raises(FormatError, match=r"embed\.tokens: a quantized embedding stores every tensor by row"):
        embedding.rebind("embed.tokens")


@pytest.mark.parametrize("kind", sorted(MODULES))
def test_a_move_rebuilds_the_weight_over_the_moved_buffers(kind: str) -> None:
    module = MODULES[kind](FORMATS["lut3"](MATRIX))
    before = module.qweight
    module._apply(lambda t: t.clone())  # what .to(device) does: new storage, same values
    assert module.qweight is not before and module.qweight.packed is module.weight_packed
    assert torch.equal(_matrix(module), before.dequantize(torch.float32))


def test_experts_keep_their_stored_dtypes_and_return_the_new_one() -> None:
    experts = SqueezeExperts(FORMATS["lut3"](MATRIX), 4)
    before = _matrix(experts)
    experts.to(torch.float64)
    assert experts.weight_lut.dtype == torch.float16 and experts.dtype == torch.float64  # the format's LUT dtype
    assert experts[0].dtype == torch.float64 and torch.equal(_matrix(experts), before)
