"""compress --max-memory: block-by-block streaming gives the unbounded run's artifact, byte for byte; it resumes
after an interruption; preflight refuses a budget below one block plus its activations, and what it cannot
stream."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from squeeze import api
from squeeze.compression import bounded_preflight, quantize
from squeeze.compression.workarea import WORK_NAME, WorkArea
from squeeze.errors import ConfigError, ResourceError
from squeeze.format.manifest import MANIFEST_NAME
from squeeze.models.expert_params import UnroutedExpertsWarning
from squeeze.models.lazy import LazyModel

BUDGET = "64GB"  # above any estimate here: the run streams, preflight lets it through


def _files(directory: Path) -> dict[str, bytes]:
    return {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _manifest(directory: Path) -> dict[str, Any]:
    """The manifest but its creation time and the root digest over it (which differ between any two runs)."""
    data = json.loads((directory / MANIFEST_NAME).read_text())
    return {key: value for key, value in data.items() if key not in ("created", "root_digest")}


def _assert_same_artifact(got: Path, want: Path) -> None:
    """Every file byte for byte (every shard, config.json, tokenizer, recipe); the manifest but its time."""
    files, expected = _files(got), _files(want)
    assert sorted(files) == sorted(expected)
    assert any(name.endswith(".safetensors") for name in files) and WORK_NAME not in str(sorted(files))
    for name in expected:
        if name != MANIFEST_NAME:
            assert files[name] == expected[name], name
    assert _manifest(got) == _manifest(want)


@pytest.fixture(scope="module")
def bf16_llama(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    """The tiny Llama stored in bfloat16, as most checkpoints are (cast to fp32 when read, exactly)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory = tmp_path_factory.mktemp("bf16") / "m"
    AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.bfloat16).save_pretrained(directory)
    AutoTokenizer.from_pretrained(str(tiny_llama_dir)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def tied_llama(tmp_path_factory: pytest.TempPathFactory, resized_tiny_llama: Callable[..., Path]) -> Path:
    """The tiny Llama with its LM head tied to the input embedding (one tensor in the checkpoint)."""
    return resized_tiny_llama(tmp_path_factory.mktemp("tied") / "m", tie_word_embeddings=True)


@pytest.mark.parametrize(
    ("recipe", "overrides", "tied"),
    [("w4", {}, False), ("w3-s045", {}, False), ("w4", {"weights.embedding_bits": 8}, False)]
    + [("w4", {"weights.embedding_bits": 4}, True)],
    ids=["w4", "w3-s045", "w4-e8", "w4-e4-tied"],
)
def test_bounded_run_is_byte_identical(
    recipe: str,
    overrides: dict[str, Any],
    tied: bool,
    tmp_path: Path,
    bf16_llama: Path,
    tied_llama: Path,
    compress_tiny: Callable[..., Path],
) -> None:
    source = tied_llama if tied else bf16_llama
    unbounded = compress_tiny(tmp_path / "unbounded", recipe, source=source, overrides=overrides)
    bounded = compress_tiny(tmp_path / "bounded", recipe, source=source, overrides=overrides, max_memory=BUDGET)
    _assert_same_artifact(bounded, unbounded)


def test_interrupted_bounded_run_resumes_to_identical_bytes(
    tmp_path: Path, bf16_llama: Path, compress_tiny: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    reference = compress_tiny(tmp_path / "ref", source=bf16_llama)
    out = tmp_path / "art"
    # first killed during the Fisher pass (after the last block's group is committed) ...
    real_save = WorkArea.save_fisher_group

    def die_after_first(self: WorkArea, index: int, fisher: dict[str, torch.Tensor]) -> None:
        real_save(self, index, fisher)
        raise KeyboardInterrupt

    monkeypatch.setattr(WorkArea, "save_fisher_group", die_after_first)
    with pytest.raises(KeyboardInterrupt):
        compress_tiny(out, source=bf16_llama, max_memory=BUDGET)
    monkeypatch.setattr(WorkArea, "save_fisher_group", real_save)
    work = WorkArea(out)
    assert len(list((work.root / "fisher-groups").iterdir())) == 1 and not work.activations.exists()
    # ... then during quantization, after one group is committed
    real_group = quantize.quantize_group
    calls: list[int] = []

    def die_on_second(job: Any, names: list[str]) -> Any:
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_group(job, names)

    monkeypatch.setattr(quantize, "quantize_group", die_on_second)
    with pytest.raises(KeyboardInterrupt):
        compress_tiny(out, source=bf16_llama, max_memory=BUDGET)
    monkeypatch.setattr(quantize, "quantize_group", real_group)
    assert work.committed_groups() == 1
    compress_tiny(out, source=bf16_llama, max_memory=BUDGET)
    _assert_same_artifact(out, reference)


def test_budget_below_the_minimum_is_refused_with_the_minimum(tmp_path: Path, bf16_llama: Path) -> None:
    with pytest.raises(ResourceError, match=r"--max-memory 1MB is below the minimum of \d+MB") as info:
        api.compress(str(bf16_llama), tmp_path / "out", recipe="rtn-w4", max_memory="1MB")
    assert "--max-memory" in (info.value.hint or "")
    assert not (tmp_path / "out").exists()  # refused in preflight: nothing left behind


@pytest.mark.parametrize(("recipe", "message"), [("b3.5", "bits-per-weight budget"), ("w3-ec", "error compensation")])
def test_what_cannot_stream_is_refused(
    recipe: str, message: str, tmp_path: Path, bf16_llama: Path, tiny_text_file: Path
) -> None:
    with pytest.raises(ConfigError, match=message):
        api.compress(str(bf16_llama), tmp_path / "a", recipe=recipe, calibration=str(tiny_text_file), max_memory=BUDGET)
    assert not (tmp_path / "a").exists()


def test_peak_estimate_grows_with_the_window_length(bf16_llama: Path) -> None:
    from squeeze.compression.preflight import meta_model
    from squeeze.config import load_recipe
    from squeeze.models import resolve_model
    from squeeze.models.targets import find_target_linears

    skeleton = meta_model(resolve_model(str(bf16_llama)))
    recipe = load_recipe("w4")
    targets = find_target_linears(skeleton, ["q_proj", "down_proj"])
    rtn = bounded_preflight.streaming_peak_bytes(skeleton, recipe, targets, None, 10**6)
    short = bounded_preflight.streaming_peak_bytes(skeleton, recipe, targets, 32, 10**6)
    long = bounded_preflight.streaming_peak_bytes(skeleton, recipe, targets, 512, 10**6)
    assert bounded_preflight.STREAMING_BASE_BYTES < rtn <= short < long


def test_a_gguf_source_is_refused_with_the_conversion_hint(tmp_path: Path) -> None:
    from squeeze.errors import ModelError
    from squeeze.models import resolve_model

    try:
        source = resolve_model("smollm2-135m")
    except ModelError as exc:
        pytest.skip(f"the built-in GGUF model is absent: {exc.message}")
    with pytest.raises(ConfigError, match="GGUF") as info:
        api.compress(source, tmp_path / "out", recipe="rtn-w4", max_memory=BUDGET)
    assert "save_pretrained" in (info.value.hint or "")
    assert not (tmp_path / "out").exists()


def test_bounded_result_reports_the_same_numbers_and_its_estimate(
    tmp_path: Path, bf16_llama: Path, tiny_text_file: Path
) -> None:
    kwargs: dict[str, Any] = {
        "recipe": "w4",
        "calibration": str(tiny_text_file),
        "calibration_overrides": {"num_samples": 2, "seq_len": 32},
    }
    unbounded = api.compress(str(bf16_llama), tmp_path / "a", **kwargs).to_dict()
    bounded = api.compress(str(bf16_llama), tmp_path / "b", max_memory=BUDGET, **kwargs).to_dict()
    assert bounded.pop("max_memory") == 64 * 10**9 and bounded.pop("peak_estimate_bytes") > 0
    assert "max_memory" not in unbounded
    for key in ("output", "seconds", "timings", "root_digest"):  # the root digest covers the manifest's time
        unbounded.pop(key), bounded.pop(key)
    assert bounded == unbounded  # sizes (original, source, artifact), bits per weight, module and weight counts


def test_spill_bytes_count_every_block_input(bf16_llama: Path) -> None:
    from squeeze.compression.preflight import meta_model
    from squeeze.models import resolve_model

    skeleton = meta_model(resolve_model(str(bf16_llama)))
    # 2 blocks: their 2 inputs, the last output, one boundary of gradients; 4 windows x 32 tokens x 64 fp32
    assert bounded_preflight.spill_bytes(skeleton, 4, 32) == 4 * 4 * 32 * 64 * 4


def _save_moe(root: Path, family: str, tokenizer: Any) -> Path:
    """A tiny random MoE (4 experts, hidden 64, 2 layers) saved in bfloat16; gpt-oss with one expert of layer 1
    that no token reaches (its router bias), Qwen3-MoE saved one tensor per expert as transformers saves it."""
    import transformers as tf

    dims = {"hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4}
    dims |= {"num_key_value_heads": 2, "max_position_embeddings": 256, "vocab_size": len(tokenizer), "head_dim": 16}
    dims |= {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3, "tie_word_embeddings": False}
    if family == "qwen3_moe":
        config = tf.Qwen3MoeConfig(**dims, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    else:
        layers = ["sliding_attention", "full_attention"]
        config = tf.GptOssConfig(
            **dims, num_local_experts=4, num_experts_per_tok=2, layer_types=layers, sliding_window=4
        )
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    if family == "gpt_oss":
        with torch.no_grad():
            model.model.layers[1].mlp.router.bias[3] = -1e4
    model.to(torch.bfloat16).save_pretrained(root)
    tokenizer.save_pretrained(root)
    return root


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_moe_bounded_run_is_byte_identical(
    family: str, tmp_path: Path, tiny_tokenizer: Any, tiny_text_file: Path
) -> None:
    """Expert parameters stream with their block: the same shards, the same experts counted and the same
    unrouted-experts warning as the unbounded run."""
    source = _save_moe(tmp_path / "model", family, tiny_tokenizer)
    results: list[api.CompressResult] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for out, budget in (("unbounded", None), ("bounded", BUDGET)):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                results.append(
                    api.compress(
                        str(source),
                        tmp_path / out,
                        recipe="w4",
                        calibration=str(tiny_text_file),
                        calibration_overrides={"num_samples": 2, "seq_len": 32},
                        max_memory=budget,
                    )
                )
            unrouted = [str(w.message) for w in caught if issubclass(w.category, UnroutedExpertsWarning)]
            assert [m.split(" (")[0] for m in unrouted] == (
                ["1 of 8 experts were never routed to by the calibration text"] if family == "gpt_oss" else []
            ), out
            assert all("model.layers.1.mlp.experts [3]" in m for m in unrouted)
    finally:
        torch.set_num_threads(threads)
    _assert_same_artifact(tmp_path / "bounded", tmp_path / "unbounded")
    unbounded, bounded = results
    assert (bounded.experts, bounded.unrouted_experts) == (unbounded.experts, unbounded.unrouted_experts)
    assert (bounded.experts, bounded.unrouted_experts) == (8, 1 if family == "gpt_oss" else 0)
    modules = json.loads((tmp_path / "bounded" / "config.json").read_text())["quantization_config"]["modules"]
    assert sum("experts" in spec for spec in modules.values()) == 4


def test_the_peak_estimate_counts_a_moe_block_with_its_experts(tmp_path: Path, tiny_tokenizer: Any) -> None:
    """The Fisher phase holds the largest block's experts in fp32, their float64 accumulators and a gradient."""
    from squeeze.compression.preflight import meta_model
    from squeeze.config import load_recipe
    from squeeze.models import resolve_model
    from squeeze.models.targets import find_targets

    skeleton = meta_model(resolve_model(str(_save_moe(tmp_path / "model", "qwen3_moe", tiny_tokenizer))))
    targets = find_targets(skeleton, ["q_proj", "down_proj", "gate_up_proj"], [])
    experts = sum(p.numel() for n, p in skeleton.named_parameters() if n.startswith("model.layers.0.mlp.experts."))
    block = sum(p.numel() for p in skeleton.model.layers[0].parameters())
    assert experts > block / 2  # the experts are most of the block
    peak = bounded_preflight.streaming_peak_bytes(skeleton, load_recipe("w4"), targets, 32, 10**6)
    assert peak - bounded_preflight.STREAMING_BASE_BYTES >= block * (4 + 8 + 4)


def test_a_moe_budget_below_the_minimum_is_refused_naming_it(tmp_path: Path, tiny_tokenizer: Any) -> None:
    """A MoE budget below the bounded minimum (the resident part of a block plus one group of 2 routed experts)
    is refused before any work, naming the minimum preflight estimated, which passes."""
    source = _save_moe(tmp_path / "model", "qwen3_moe", tiny_tokenizer)
    with pytest.raises(ResourceError, match=r"--max-memory 100MB is below the minimum of (\d+)MB") as info:
        api.compress(str(source), tmp_path / "out", recipe="rtn-w4", max_memory="100MB")
    assert "pass --max-memory" in (info.value.hint or "")
    assert not (tmp_path / "out").exists()
    minimum = re.search(r"minimum of (\d+)MB", str(info.value))
    assert minimum is not None
    api.compress(str(source), tmp_path / "out", recipe="rtn-w4", max_memory=f"{int(minimum.group(1)) + 1}MB")


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_a_moe_bounded_run_with_expert_groups_is_byte_identical(
    family: str, tmp_path: Path, tiny_tokenizer: Any, tiny_text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Routed experts streamed two at a time (Fisher, k-means, write) give the unbounded run's artifact byte for
    byte; the summary names the group size. (The budget's choice of the size is tested on plans below: here it is
    pinned to 2, as a budget between the two peaks of so tiny a model cannot be told apart.)"""
    from dataclasses import replace

    from squeeze.compression import expert_plan, runner

    chosen = expert_plan.plan_expert_groups
    monkeypatch.setattr(runner.expert_plan, "plan_expert_groups", lambda *a, **k: replace(chosen(*a, **k), group=2))
    slices: list[tuple[int, int]] = []
    original = LazyModel.experts_slice

    def counted(self: LazyModel, module: Any, start: int, stop: int) -> Any:
        slices.append((start, stop))
        return original(self, module, start, stop)

    monkeypatch.setattr(LazyModel, "experts_slice", counted)
    source = _save_moe(tmp_path / "model", family, tiny_tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for out, budget in (("unbounded", None), ("bounded", BUDGET)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                result = api.compress(
                    str(source),
                    tmp_path / out,
                    recipe="w4",
                    calibration=str(tiny_text_file),
                    calibration_overrides={"num_samples": 2, "seq_len": 32},
                    max_memory=budget,
                )
    finally:
        torch.set_num_threads(threads)
    _assert_same_artifact(tmp_path / "bounded", tmp_path / "unbounded")
    assert result.expert_group == 2 and result.to_dict()["expert_group"] == 2
    assert set(slices) == {(0, 2), (2, 4)}  # never the whole parameter


def test_a_moe_device_run_with_expert_groups_is_byte_identical(
    tmp_path: Path, tiny_tokenizer: Any, tiny_text_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--device without --max-memory: when the device cannot hold a whole MoE block, preflight streams its experts
    in groups (here the device's memory is pinned to 1 byte, so the smallest group, 2, is used on device="cpu"):
    the same artifact as the host run."""
    from squeeze.compression import runner, sensitivity

    monkeypatch.setattr(runner, "_device_bytes", lambda device: 1)
    used: list[int | None] = []
    fisher = sensitivity.blockwise_fisher

    def recorded(*args: Any, **kwargs: Any) -> Any:
        used.append(kwargs["experts"].size if kwargs.get("experts") is not None else None)
        return fisher(*args, **kwargs)

    monkeypatch.setattr(sensitivity, "blockwise_fisher", recorded)
    source = _save_moe(tmp_path / "model", "qwen3_moe", tiny_tokenizer)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for out, device in (("host", None), ("device", "cpu")):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                api.compress(
                    str(source),
                    tmp_path / out,
                    recipe="w4",
                    calibration=str(tiny_text_file),
                    calibration_overrides={"num_samples": 2, "seq_len": 32},
                    device=device,
                )
    finally:
        torch.set_num_threads(threads)
    assert used == [2]
    _assert_same_artifact(tmp_path / "device", tmp_path / "host")
