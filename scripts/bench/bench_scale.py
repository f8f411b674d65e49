"""Frontier-model scale measurements (issue 16), one part per run.

    .venv/bin/python scripts/bench/bench_scale.py --part coverage                  # MoE expert coverage, w4 + Fisher
    .venv/bin/python scripts/bench/bench_scale.py --part coverage --sensitivity uniform --experts 8 --out cov.json

coverage: tiny random MoE models built from each family's transformers config (no downloads; hidden 128,
3 layers, --experts routed experts, shared experts / dense first layers where the family has them):
Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 (Kimi K2's architecture, MLA attention), GLM-4-MoE, gpt-oss.
For each: the share of the non-embedding parameters the recipe's targets quantize (goal >= 95%), and, from
a real compress, the artifact's bits per quantized weight and the bits per weight over every matrix
parameter (linears, expert parameters, routers; embeddings and LM head excluded) with what stays
unquantized counted at 16 bits, as a bf16 checkpoint stores it. With Fisher sensitivity the count of
experts the calibration text never reached is reported too. Prints a table; --out writes JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts" / "bench"))

from bench_common import command_line, revision  # noqa: E402

from squeeze import api  # noqa: E402
from squeeze.config import load_recipe  # noqa: E402
from squeeze.models.targets import find_targets  # noqa: E402

#: Shared by every family (3 layers: DeepSeek-V3 / GLM-4-MoE keep their first one dense).
DIMS = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 3,
    "tie_word_embeddings": False,
}
MOE_INTERMEDIATE = 64


def family_configs(experts: int) -> dict[str, tuple[str, dict[str, Any]]]:
    """family -> (transformers config class name, its settings beyond DIMS)."""
    moe = {"num_experts_per_tok": 2, "moe_intermediate_size": MOE_INTERMEDIATE}
    return {
        "mixtral": ("MixtralConfig", {"num_local_experts": experts, "num_experts_per_tok": 2}),
        "qwen2_moe": (
            "Qwen2MoeConfig",
            {"num_experts": experts, **moe, "shared_expert_intermediate_size": 2 * MOE_INTERMEDIATE},
        ),
        "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": experts, **moe, "head_dim": 32}),
        "deepseek_v3": (
            "DeepseekV3Config",
            {
                "n_routed_experts": experts,
                **moe,
                "n_shared_experts": 1,
                "first_k_dense_replace": 1,
                "num_key_value_heads": DIMS["num_attention_heads"],  # MLA: every head has its key and value
                "q_lora_rank": 64,
                "kv_lora_rank": 32,
                "qk_nope_head_dim": 32,
                "qk_rope_head_dim": 16,
                "v_head_dim": 32,
                "n_group": 1,
                "topk_group": 1,
            },
        ),
        "glm4_moe": (
            "Glm4MoeConfig",
            {
                "n_routed_experts": experts,
                **moe,
                "n_shared_experts": 1,
                "first_k_dense_replace": 1,
                "head_dim": 32,
                "n_group": 1,
                "topk_group": 1,
            },
        ),
        "gpt_oss": (
            "GptOssConfig",
            {
                "num_local_experts": experts,
                "num_experts_per_tok": 2,
                "intermediate_size": MOE_INTERMEDIATE,
                "head_dim": 32,
                "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "sliding_window": 64,
            },
        ),
    }


_WORDS = (
    "the a little girl boy named tim lily sue saw went played with her his friend dog cat one day found big red "
    "blue ball under tree and they were happy sad sun warm sky bright said mom let us go home after lunch"
).split()


def story_text(sentences: int = 1500, seed: int = 0) -> str:
    rng = random.Random(seed)
    return "\n".join(
        " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 10))).capitalize() + "." for _ in range(sentences)
    )


def tiny_tokenizer(text: str) -> Any:
    """A byte-level BPE tokenizer (vocabulary 320) trained on ``text`` in milliseconds."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<s>", "</s>", "<pad>"], show_progress=False)
    backend.train_from_iterator(text.splitlines(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )


def parameter_shares(model: torch.nn.Module, targets: dict[str, Any]) -> dict[str, int]:
    """Counts over the model's unique parameters: non-embedding, quantized, matrix (>= 2-D, non-embedding)."""
    embeddings = {id(model.get_input_embeddings().weight)}
    head = model.get_output_embeddings()
    if head is not None:
        embeddings.add(id(head.weight))
    quantized_ids = {id(t.weight) for t in targets.values()}
    counts = {"non_embedding": 0, "quantized": 0, "matrix": 0, "experts": 0}
    seen: set[int] = set()
    for param in model.parameters():
        if id(param) in seen or id(param) in embeddings:
            continue
        seen.add(id(param))
        counts["non_embedding"] += param.numel()
        if param.ndim >= 2:
            counts["matrix"] += param.numel()
        if id(param) in quantized_ids:
            counts["quantized"] += param.numel()
            if param.ndim == 3:
                counts["experts"] += param.numel()
    return counts


def coverage_row(
    family: str, config_name: str, settings: dict[str, Any], args: argparse.Namespace, work: Path, text: Path
) -> dict[str, Any]:
    import transformers

    tokenizer = tiny_tokenizer(text.read_text(encoding="utf-8"))
    config = getattr(transformers, config_name)(**{**DIMS, "vocab_size": len(tokenizer), **settings})
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_config(config).eval()
    recipe = load_recipe(args.recipe)
    targets = find_targets(model, recipe.weights.targets, recipe.weights.ignore)
    counts = parameter_shares(model, targets)
    source = work / family / "model"
    model.save_pretrained(source)
    tokenizer.save_pretrained(source)
    overrides = {"weights.sensitivity": args.sensitivity}
    started = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = api.compress(
            str(source),
            work / family / "artifact",
            recipe=args.recipe,
            calibration=str(text) if args.sensitivity == "fisher" else None,
            calibration_overrides={"num_samples": args.num_samples, "seq_len": args.seq_len},
            overrides=overrides,
        )
    seconds = time.perf_counter() - started
    stored_bits = result.bits_per_weight * result.quantized_weights
    unquantized = counts["matrix"] - result.quantized_weights
    return {
        "family": family,
        "architecture": type(model).__name__,
        "experts_per_layer": int(
            getattr(config, "num_local_experts", 0)
            or getattr(config, "num_experts", 0)
            or getattr(config, "n_routed_experts", 0)
        ),
        "non_embedding_params": counts["non_embedding"],
        "quantized_params": counts["quantized"],
        "expert_params_quantized": counts["experts"],
        "coverage": round(counts["quantized"] / counts["non_embedding"], 4),
        # what the linears alone cover (squeeze before expert parameters were targets)
        "coverage_linears_only": round((counts["quantized"] - counts["experts"]) / counts["non_embedding"], 4),
        "artifact_bits_per_weight": result.bits_per_weight,
        "bits_per_weight_all_matrices": round((stored_bits + 16 * unquantized) / counts["matrix"], 4),
        "quantized_weights_in_artifact": result.quantized_weights,
        "experts": result.experts,
        "unrouted_experts": result.unrouted_experts,
        "unrouted_warning": any("never routed" in str(w.message) for w in caught),
        "compress_seconds": round(seconds, 2),
    }


def part_coverage(args: argparse.Namespace) -> dict[str, Any]:
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="bench-scale-coverage-"))
    try:
        text = work / "calibration.txt"
        text.write_text(story_text(), encoding="utf-8")
        rows = [
            coverage_row(family, name, settings, args, work, text)
            for family, (name, settings) in family_configs(args.experts).items()
            if not args.families or family in args.families.split(",")
        ]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"{'family':<12} {'coverage':>8} {'linears':>8} {'quantized':>10} {'non-emb':>10} {'bpw(art)':>8} "
        f"{'bpw(all)':>8} {'unrouted':>9} {'sec':>6}"
    )
    for r in rows:
        print(
            f"{r['family']:<12} {100 * r['coverage']:>7.2f}% {100 * r['coverage_linears_only']:>7.2f}% "
            f"{r['quantized_params']:>10} "
            f"{r['non_embedding_params']:>10} {r['artifact_bits_per_weight']:>8.3f} "
            f"{r['bits_per_weight_all_matrices']:>8.3f} {r['unrouted_experts']:>4}/{r['experts']:<4} "
            f"{r['compress_seconds']:>6.1f}"
        )
    return {
        "part": "coverage",
        "recipe": args.recipe,
        "sensitivity": args.sensitivity,
        "calibration": {"num_samples": args.num_samples, "seq_len": args.seq_len}
        if args.sensitivity == "fisher"
        else None,
        "dims": {**DIMS, "moe_intermediate_size": MOE_INTERMEDIATE, "experts": args.experts},
        "rows": rows,
    }


PARTS = {"coverage": part_coverage}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=sorted(PARTS), required=True)
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    parser.add_argument("--recipe", default="w4", help="coverage: the built-in recipe (its default targets)")
    parser.add_argument("--sensitivity", choices=["fisher", "uniform"], default="fisher")
    parser.add_argument("--experts", type=int, default=16, help="coverage: routed experts per MoE layer")
    parser.add_argument("--num-samples", type=int, default=8, help="coverage: calibration windows")
    parser.add_argument("--seq-len", type=int, default=64, help="coverage: calibration window length")
    parser.add_argument("--families", default="", help="coverage: comma-separated subset (default: all six)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    print(revision())
    print(command_line())
    result = PARTS[args.part](args)
    result["revision"], result["command"] = revision(), command_line()
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
