"""MoE artifacts and quantized embeddings / LM heads served by vLLM itself (skipped without vLLM;
scripts/check_vllm.sh builds its environment).

Tiny Qwen3-MoE and Mixtral models (as the MoE family matrix builds them, tests/runtime/test_moe_families.py,
shaped for vLLM's CPU attention: head_dim 64) compressed at 4 bits, their routed experts quantized one LUT per
(expert, row); and the tiny vLLM-shaped Llama with tied embeddings compressed with ``weights.embedding_bits``
4 (recipe w4-e4: one quantized table serves the embedding and the LM head). At tensor parallel 1 vLLM must
give ``squeeze run``'s greedy text, and at tensor parallel 2 (experts split by intermediate channel, the
vocabulary by rows) the same tokens as at 1; with ``enable_expert_parallel`` at tensor parallel 2 (each rank 2 whole
experts) ``squeeze run``'s greedy text again. Mixtral's modules are renamed by transformers (block_sparse_moe
-> mlp): its artifact loads with ``load_format="squeeze"``, and vLLM's own loader is refused in one line.
Each engine starts in a process of its own (15-60 s on 2 idle cores).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/check_vllm.sh builds an environment with it)")

import transformers as tf  # noqa: E402
from vllm_runs import assert_squeeze_run_text, run_vllm  # noqa: E402

from squeeze import api  # noqa: E402
from squeeze.runtime.embedding import SqueezeEmbedding  # noqa: E402
from squeeze.runtime.experts import SqueezeExperts  # noqa: E402

pytestmark = pytest.mark.slow
#: vLLM's CPU attention takes head_dim 64; 4 experts of 64 channels (32 per rank at tensor parallel 2), top-2
DIMS = {
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "tie_word_embeddings": False,
}
FAMILIES: dict[str, Callable[[int], Any]] = {
    "qwen3_moe": lambda vocab: tf.Qwen3MoeConfig(
        **DIMS, vocab_size=vocab, intermediate_size=96, moe_intermediate_size=64, num_experts=4
    ),
    "mixtral": lambda vocab: tf.MixtralConfig(**DIMS, vocab_size=vocab, intermediate_size=64, num_local_experts=4),
}


def build_moe(name: str, root: Path, tokenizer: Any, text_file: Path) -> Path:
    """The family's tiny random model (seeded) saved with the tiny tokenizer, compressed at w4 (Fisher from 4
    windows of 32 tokens of the tiny text)."""
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(FAMILIES[name](len(tokenizer))).eval()
    model.save_pretrained(root / "model")
    tokenizer.save_pretrained(root / "model")
    api.compress(
        str(root / "model"),
        root / "w4",
        recipe="w4",
        calibration=str(text_file),
        calibration_overrides={"num_samples": 4, "seq_len": 32},
    )
    return root / "w4"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def moe(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any, tiny_text_file: Path
) -> tuple[str, Path]:
    name = request.param
    return name, build_moe(name, tmp_path_factory.mktemp(f"vllm-{name}"), tiny_tokenizer, tiny_text_file)


def test_moe_artifacts_give_squeeze_runs_text_at_tensor_parallel_1_and_2(moe: tuple[str, Path]) -> None:
    name, artifact = moe
    loaded = api.load(artifact)  # the experts really are quantized 3-D parameters
    experts = loaded.model.model.layers[0].mlp.experts
    assert isinstance(experts.gate_up_proj, SqueezeExperts) and isinstance(experts.down_proj, SqueezeExperts)
    # Mixtral's artifact loads through squeeze's loader (renamed modules); Qwen3-MoE's through vLLM's own
    fmt = "squeeze" if name == "mixtral" else "auto"
    tp1, log = run_vllm(artifact, load_format=fmt)
    assert tp1 is not None, log[-4000:]
    assert_squeeze_run_text(artifact, tp1)
    tp2, log = run_vllm(artifact, tp=2, load_format="squeeze")
    assert tp2 is not None, log[-4000:]
    assert tp2["tokens"] == tp1["tokens"]


def test_moe_artifacts_give_squeeze_runs_text_with_expert_parallelism_at_tensor_parallel_2(
    moe: tuple[str, Path],
) -> None:
    # --enable-expert-parallel: each of the 2 ranks holds 2 whole experts (all their channels) and skips the
    # tokens routed to the other rank's; vLLM's all-reduce adds the two ranks' sums
    _name, artifact = moe
    ep, log = run_vllm(artifact, tp=2, load_format="squeeze", enable_expert_parallel=True)
    assert ep is not None, log[-4000:]
    assert "Expert parallelism is enabled" in log and "Local/global number of experts: 2/4" in log, log[-4000:]
    assert_squeeze_run_text(artifact, ep)


def test_a_renamed_moe_artifact_on_vllms_own_loader_is_refused_in_one_line(moe: tuple[str, Path]) -> None:
    name, artifact = moe
    if name != "mixtral":
        pytest.skip("only Mixtral's modules are renamed by transformers")
    result, log = run_vllm(artifact)
    assert result is None
    assert (
        "squeeze.errors.FormatError: this artifact names its modules as transformers loads them ('.mlp.' where " in log
    )
    assert "vLLM reads '.block_sparse_moe.'): vLLM must read it with load_format='squeeze', found 'auto'" in log


@pytest.fixture(scope="module")
def tied_e4(
    tmp_path_factory: pytest.TempPathFactory,
    resized_tiny_llama: Callable[..., Path],
    compress_tiny: Callable[..., Path],
) -> Path:
    """The tiny vLLM-shaped Llama with tied embeddings, its table quantized at 4 bits (recipe w4-e4)."""
    source = resized_tiny_llama(
        tmp_path_factory.mktemp("vllm-e4") / "source",
        hidden_size=384,
        intermediate_size=256,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=384,  # vLLM pads the vocabulary to a multiple of 64: 2 ranks hold 192 rows each
        tie_word_embeddings=True,
    )
    return compress_tiny(source.parent / "w4-e4", "w4-e4", source=source)


def test_a_quantized_tied_embedding_gives_squeeze_runs_text_at_tensor_parallel_1_and_2(tied_e4: Path) -> None:
    loaded = api.load(tied_e4)
    assert isinstance(loaded.model.model.embed_tokens, SqueezeEmbedding)
    assert loaded.quantization is not None
    assert loaded.quantization.tied_heads == {"lm_head": "model.embed_tokens"}
    tp1, log = run_vllm(tied_e4)
    assert tp1 is not None, log[-4000:]
    assert_squeeze_run_text(tied_e4, tp1)
    tp2, log = run_vllm(tied_e4, tp=2, load_format="squeeze")
    assert tp2 is not None, log[-4000:]
    assert tp2["tokens"] == tp1["tokens"]
