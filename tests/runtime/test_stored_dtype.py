"""The token embedding and the LM head stay in the artifact's float16 / bfloat16 (issue 36 item 5): half their
memory, and the same bits as the float32 copy the loader used to make (kernel, gather, whole model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from squeeze import api
from squeeze.runtime.dense_linear import RowStableLinear
from squeeze.runtime.kernels.cpu_build import ISAS, CpuKernels, cpu_kernels
from squeeze.runtime.kernels.cpu_dense import cpu_dense_linear
from squeeze.runtime.stored_dtype import Float32OutputEmbedding


@pytest.fixture()
def kernels() -> CpuKernels:
    found = cpu_kernels()
    if found is None:
        pytest.skip("no working C++ compiler: the native CPU kernels are unavailable")
    return found


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("isa", list(ISAS))
@pytest.mark.parametrize("n", [7, 64, 200, 576])  # lane tails of 16 and 8, and none
def test_a_stored_dtype_weight_gives_the_bits_of_its_float32_copy(
    kernels: CpuKernels, dtype: torch.dtype, isa: str, n: int
) -> None:
    if not kernels.supports(isa):
        pytest.skip(f"this CPU does not run the {isa} kernels")
    k = kernels.with_isa(isa)
    g = torch.Generator().manual_seed(n)
    stored = (torch.randn(130, n, generator=g) * 3).to(dtype)
    stored[0, 0] = 6e-8 if dtype == torch.float16 else 1e-40  # a subnormal converts exactly too
    bias, x = torch.randn(130, generator=g), torch.randn(11, n, generator=g)
    for batch in (1, 3, 8, 11):
        assert torch.equal(
            cpu_dense_linear(x[:batch], stored, bias, k), cpu_dense_linear(x[:batch], stored.float(), bias, k)
        )


def test_the_f_linear_path_upcasts_tiles_not_the_whole_weight(monkeypatch: pytest.MonkeyPatch) -> None:
    import squeeze.runtime.dense_linear as dense_linear

    monkeypatch.setattr(dense_linear, "UPCAST_TILE_ELEMENTS", 64 * 10)  # 10 rows of 64 per tile: 4 tiles
    head = nn.Linear(64, 37)
    head.__class__ = RowStableLinear
    head.weight.data = head.weight.data.to(torch.bfloat16)
    monkeypatch.setattr(dense_linear, "cpu_kernels", lambda: None)  # no native kernels: the F.linear path
    x = torch.randn(37, 64)
    with torch.inference_mode():
        y = head(x)
    assert y.dtype == torch.float32 and y.shape == (37, 37)
    assert torch.allclose(y, F.linear(x, head.weight.float(), head.bias), atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def half_artifact(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any, tiny_text_file: Path) -> Path:
    """A tiny tied Llama saved in float16, compressed w4: its embedding (and tied head) stored as float16."""
    from transformers import LlamaForCausalLM

    from tests.conftest import save_tiny_model, tiny_llama_config

    root = tmp_path_factory.mktemp("half")
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tiny_tokenizer, tie_word_embeddings=True)).eval().half()
    source = save_tiny_model(model, tiny_tokenizer, root / "source")
    out = root / "w4"
    api.compress(
        str(source),
        out,
        recipe="w4",
        calibration=str(tiny_text_file),
        calibration_overrides={"num_samples": 4, "seq_len": 32},
    )
    return out


def test_the_loaded_embedding_and_tied_head_stay_float16_with_the_same_logits(half_artifact: Path) -> None:
    loaded = api.load(half_artifact)
    model = loaded.model
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(embed, Float32OutputEmbedding) and embed.weight.dtype == torch.float16
    assert isinstance(head, RowStableLinear) and head.weight is embed.weight  # still tied, one float16 table
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "embed" not in n)
    ids = loaded.tokenizer("Once upon a time there was", return_tensors="pt").input_ids
    long_ids = ids.repeat(1, 8)  # a prompt's worth of rows: the same kernel, one order per row
    with torch.inference_mode():
        kept = [model(x).logits for x in (ids, long_ids)]
        assert all(k.dtype == torch.float32 for k in kept)
        embed.weight.data = embed.weight.data.float()  # what the loader used to hold: a float32 copy
        embed.__class__ = nn.Embedding
        upcast = [model(x).logits for x in (ids, long_ids)]
    assert torch.equal(kept[0], upcast[0])  # the kernel path: bit for bit
    assert torch.equal(kept[1], upcast[1])  # every row count: the same kernel


def test_from_pretrained_holds_them_as_squeeze_load_does(half_artifact: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(half_artifact, dtype=torch.float32)
    reference = api.load(half_artifact).model
    assert isinstance(model.get_input_embeddings(), Float32OutputEmbedding)
    ours, theirs = model.state_dict(), reference.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(ours[k].dtype == theirs[k].dtype and torch.equal(ours[k], theirs[k]) for k in ours)
    ids = torch.tensor([[1, 5, 9, 12, 7]])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, reference(ids).logits)
