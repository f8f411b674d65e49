"""gpu_check's ``compress`` section: ``squeeze compress --device cuda`` against the CPU run of the same job.

The device has no network and no ../shared, so the model is SmolLM2-135M's shape (30 blocks, hidden 576, GQA
9 / 3 heads, intermediate 1536, vocabulary 49152, tied embedding) with seeded random weights, saved as bfloat16
safetensors with a byte-level BPE tokenizer trained on seeded generated text (``--compress-model DIR`` takes a
real checkpoint instead). Rows:

* time: the same job (w4, Fisher on ``windows`` x 512 tokens) on the CPU and with ``device="cuda"``: wall seconds
  and each stage's, and the ratio;
* bytes: which stages are the same bits (promised: every tensor left unquantized, config, tokenizer, and the
  RTN recipe's codes and scales, elementwise arithmetic with the same rounding on both), and by how much the rest
  differs (promised only within float tolerance: the Fisher, whose GPU reductions add in another order, and the
  LUT k-means fed with it): the Fisher's relative difference per target, and the share of codes that differ;
* rates: the per-unit rates of plan_rates.json measured on this device (``cuda`` entry), to paste there.

``--dry-run`` runs the same code on a two-block model of that shape on the CPU (``device="cpu"``: the device
path, which must then be byte-identical for every stage).
"""

from __future__ import annotations

import json
import random
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SMOLLM2 = {
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "rope_theta": 100000.0,
    "tie_word_embeddings": True,
}
_WORDS = "the a of to and in is was that for on with as by at from it this be are or an which one".split()


def _text(n_words: int, seed: int) -> str:
    """Seeded word salad with sentence breaks: calibration text the tokenizer is trained on too."""
    rng = random.Random(seed)
    vocab = _WORDS + [f"w{i}{chr(97 + i % 26)}" for i in range(2000)]
    words = [rng.choice(vocab) for _ in range(n_words)]
    return " ".join(w + ("." if i % 17 == 16 else "") for i, w in enumerate(words))


def build_model(directory: Path, blocks: int | None) -> tuple[Path, Path]:
    """A SmolLM2-shaped random Llama (``blocks`` decoder blocks; None: 30) and calibration text, under
    ``directory``; returns (model dir, text file)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    text = _text(120_000, seed=0)
    text_file = directory / "calibration.txt"
    text_file.write_text(text)
    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=4096, special_tokens=["<unk>", "<s>", "</s>"])
    backend.train_from_iterator([text], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    shape = dict(SMOLLM2, **({"num_hidden_layers": blocks} if blocks else {}))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**shape, bos_token_id=1, eos_token_id=2)).to(torch.bfloat16).eval()
    out = directory / "model"
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out, text_file


def _compress(
    model: Path, text: Path, output: Path, recipe: str, windows: int, device: str | None
) -> tuple[float, Any]:
    from squeeze import api

    if device is not None and device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    result = api.compress(
        str(model),
        output,
        recipe=recipe,
        calibration=str(text),
        calibration_overrides={"num_samples": windows, "seq_len": 512},
        overwrite=True,
        device=device,
    )
    return time.perf_counter() - start, result


def _shard_tensors(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(str(shard)))
    return tensors


def compare_artifacts(got: Path, want: Path) -> dict[str, Any]:
    """Which files and tensors are the same bytes, and how far the others are: packed codes (share of bytes
    that differ), LUT values (largest relative difference)."""
    files = sorted(p.name for p in want.iterdir() if p.is_file() and p.suffix != ".safetensors")
    differing_files = [
        name
        for name in files
        if name != "squeeze.manifest.json" and (got / name).read_bytes() != (want / name).read_bytes()
    ]
    a, b = _shard_tensors(got), _shard_tensors(want)
    same = [k for k in b if k in a and a[k].dtype == b[k].dtype and a[k].shape == b[k].shape and a[k].equal(b[k])]
    quantized_roles = ("_packed", "_lut", "_scale", "_zero", "_rowptr", "_cols", "_vals")
    kept = [k for k in b if not k.endswith(quantized_roles)]
    packed = [k for k in b if k.endswith("weight_packed") and k in a and a[k].shape == b[k].shape]
    code_bytes = sum(b[k].numel() for k in packed)
    code_diff = sum(int((a[k] != b[k]).sum()) for k in packed)
    luts = [k for k in b if k.endswith("weight_lut") and k in a and a[k].shape == b[k].shape]
    lut_rel = max(
        (float(((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max().clamp_min(1e-30))) for k in luts),
        default=0.0,
    )
    return {
        "files_other_than_shards_identical": not differing_files,
        "tensors_identical": f"{len(same)}/{len(b)}",
        "unquantized_identical": all(k in same for k in kept),
        "packed_code_bytes_differing": f"{code_diff / max(code_bytes, 1):.2e}",
        "lut_max_rel_diff": lut_rel,
        "all_identical": len(same) == len(b) and not differing_files,
    }


def fisher_difference(model_dir: Path, text: Path, device: torch.device, windows: int) -> dict[str, Any]:
    """The Fisher of two windows on the host (whole model) and block by block on ``device``: largest relative
    difference over the targets (``max |a-b| / max |b|`` per target) and the median of those."""
    from squeeze.calibrate.blockwise import blockwise_fisher
    from squeeze.calibrate.fisher import fisher_information
    from squeeze.calibrate.windows import calibration_windows
    from squeeze.config import CalibrationSpec
    from squeeze.models.source import load_model, resolve_model
    from squeeze.models.targets import find_target_linears

    model, tokenizer = load_model(resolve_model(str(model_dir)), dtype=torch.float32)
    spec = CalibrationSpec(name="check", source="text", path=str(text), num_samples=windows, seq_len=512)
    ids = calibration_windows(spec, tokenizer)
    targets = find_target_linears(model, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    host = fisher_information(model, ids, targets)
    on_device = blockwise_fisher(model, ids, targets, device=device)
    rel = sorted(float((on_device[n] - host[n]).abs().max() / host[n].abs().max().clamp_min(1e-30)) for n in host)
    return {
        "fisher_max_rel_diff": rel[-1],
        "fisher_median_rel_diff": rel[len(rel) // 2],
        "fisher_identical": all(torch.equal(on_device[n], host[n]) for n in host),
    }


def section_compress(rep: Any, device: torch.device, dry: bool, model_dir: str | None = None) -> None:
    """The compress rows of gpu_check (see the module docstring); ``rep.add(section, **row)`` records them."""
    work = Path(tempfile.mkdtemp(prefix="gpu-check-compress-"))
    try:
        windows = 2 if dry else 8
        if model_dir:
            model, text = Path(model_dir), work / "calibration.txt"
            text.write_text(_text(120_000, seed=0))
        else:
            model, text = build_model(work, blocks=2 if dry else None)
        target = "cpu" if dry else str(device)
        for recipe in ("w4", "rtn-w4"):
            cpu_s, cpu = _compress(model, text, work / f"{recipe}-cpu", recipe, windows, None)
            dev_s, dev = _compress(model, text, work / f"{recipe}-dev", recipe, windows, target)
            # "host": no device given; "device": the same job with device=target (cpu in a dry run)
            row = {"recipe": recipe, "device": target, "host_s": cpu_s, "device_s": dev_s}
            row["speedup"] = cpu_s / max(dev_s, 1e-9)
            for stage in ("sensitivity", "quantize"):
                if stage in cpu.timings:
                    row[f"{stage}_host_s"] = cpu.timings[stage]
                    row[f"{stage}_device_s"] = dev.timings.get(stage, float("nan"))
            row.update(compare_artifacts(work / f"{recipe}-dev", work / f"{recipe}-cpu"))
            rep.add("compress", **row)
            if recipe == "w4":
                rep.add("compress-rates", **_rates(dev, target, windows * 512))
            if dry or recipe == "rtn-w4":  # promised identical: the device path on cpu, RTN's elementwise math
                if not row["all_identical"]:
                    rep.failed_checks += 1
            elif not row["unquantized_identical"]:
                rep.failed_checks += 1
        fisher = fisher_difference(model, text, torch.device(target), 2)
        rep.add("compress-fisher", **fisher)
        if dry and not fisher["fisher_identical"]:
            rep.failed_checks += 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _rates(result: Any, target: str, tokens: int) -> dict[str, Any]:
    """plan_rates.json's per-unit rates from one w4 run (seconds over its units), printed as one JSON line."""
    timings = result.timings
    params = result.original_bytes / 4  # the loaded fp32 tensors, tied once
    summary = {
        "device": target,
        "fisher_s_per_param_token": timings.get("sensitivity", 0.0) / max(params * tokens, 1),
        "kmeans_s_per_weight": timings.get("quantize", 0.0) / max(result.quantized_weights, 1),
        "write_s_per_artifact_byte": timings.get("write", 0.0) / max(result.artifact_bytes, 1),
        "seal_s_per_artifact_byte": timings.get("seal", 0.0) / max(result.artifact_bytes, 1),
        "load_s_per_source_byte": timings.get("load", 0.0) / max(result.source_bytes, 1),
    }
    print("plan_rates (paste into squeeze/compression/plan_rates.json):", json.dumps(summary), flush=True)
    return summary
