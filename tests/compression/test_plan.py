"""compress --plan: the run's needs from config.json alone, the same numbers preflight checks, work split across
ranks as the run splits it; frontier MoE configs (DeepSeek-V3, Kimi K2) plan without weights; what squeeze
cannot compress is named."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from squeeze import api
from squeeze.calibrate.expert_streaming import group_bounds
from squeeze.cli.app import app
from squeeze.compression import bounded_preflight, expert_plan
from squeeze.compression.plan import load_rates
from squeeze.compression.preflight import estimate_peak_memory, estimate_size, meta_model
from squeeze.config import load_recipe
from squeeze.errors import ConfigError, ModelError, ResourceError
from squeeze.models.source import resolve_model
from squeeze.models.targets import find_targets

CONFIGS = Path(__file__).resolve().parent.parent / "data" / "configs"
runner = CliRunner()


@pytest.fixture()
def config_only(tmp_path: Path, tiny_llama_dir: Path) -> Path:
    """The tiny Llama's config.json alone: no weights, no tokenizer."""
    directory = tmp_path / "config-only"
    directory.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", directory / "config.json")
    return directory


def test_plan_from_config_alone_matches_preflight(config_only: Path, tiny_llama_dir: Path) -> None:
    plan = api.plan_compress(str(config_only), "w4", calibration_overrides={"num_samples": 4, "seq_len": 32})
    skeleton = meta_model(resolve_model(str(tiny_llama_dir)))
    recipe = load_recipe("w4")
    targets = find_targets(skeleton, recipe.weights.targets, recipe.weights.ignore)
    size = estimate_size(skeleton, recipe, targets=targets)
    (rank,) = plan.ranks
    assert rank.host_peak_bytes == estimate_peak_memory(skeleton, recipe, 32, targets=targets)
    assert rank.gpu_peak_bytes is None and rank.windows == 4 and rank.layer_groups == 2
    assert plan.artifact_bytes == size.total_bytes and plan.quantized_weights == size.n_quantized_weights
    assert plan.work_disk_bytes == size.total_bytes + size.quantized_bytes + size.n_quantized_weights * 4
    rates = load_rates("cpu")
    assert rates is not None and plan.rates == rates and rates.machine and rates.command
    want = plan.active_parameters * 4 * 32 * rates.fisher_s_per_param_token
    assert rank.seconds["sensitivity"] == pytest.approx(want) and rank.total_seconds is not None


def test_bounded_plan_is_the_streaming_estimate_and_counts_spills(config_only: Path) -> None:
    plan = api.plan_compress(
        str(config_only), "w4", calibration_overrides={"num_samples": 4, "seq_len": 32}, max_memory="1KB"
    )
    skeleton = meta_model(resolve_model(str(config_only)))
    recipe = load_recipe("w4")
    targets = find_targets(skeleton, recipe.weights.targets, recipe.weights.ignore)
    peak = bounded_preflight.streaming_peak_bytes(skeleton, recipe, targets, 32, plan.artifact_bytes)
    assert plan.ranks[0].host_peak_bytes == peak
    assert any("below this run's minimum" in note for note in plan.notes)
    unbounded = api.plan_compress(str(config_only), "w4", calibration_overrides={"num_samples": 4, "seq_len": 32})
    assert plan.work_disk_bytes - unbounded.work_disk_bytes == bounded_preflight.spill_bytes(skeleton, 4, 32)


def test_ranks_split_windows_and_deal_groups(config_only: Path) -> None:
    plan = api.plan_compress(str(config_only), "w4", calibration_overrides={"num_samples": 5, "seq_len": 32}, ranks=2)
    assert [r.windows for r in plan.ranks] == [2, 3] and [r.layer_groups for r in plan.ranks] == [1, 1]
    assert plan.ranks[1].seconds["write"] == 0.0 and plan.ranks[0].seconds["write"] > 0  # rank 0 seals


def test_gpu_plan_has_device_memory_and_no_time_without_rates(config_only: Path) -> None:
    plan = api.plan_compress(str(config_only), "w4", device="cuda:3")  # planned away from the GPUs: not checked
    rank = plan.ranks[0]
    assert plan.device == "cuda:3" and rank.gpu_peak_bytes is not None and rank.gpu_peak_bytes > 0
    assert load_rates("cuda") is None and rank.total_seconds is None and plan.rates is None


def test_deepseek_v3_plans_from_its_published_config() -> None:
    plan = api.plan_compress(str(CONFIGS / "deepseek-v3"), "w4", ranks=8, device="cuda", max_memory="1TB")
    assert plan.parameters == 671_026_404_352  # 671 B: the main model (the multi-token-prediction layer is not)
    assert 30e9 < plan.active_parameters < 45e9  # 37 B activated per token, as published
    # the whole MoE block (301 GB on the GPU) exceeds an 80 GB GPU: routed experts in groups, dealt to ranks one
    # by one with each block's own targets (3 dense blocks, 58 MoE blocks of 256 experts)
    assert plan.expert_group is not None and plan.experts == 256
    units = 3 + 58 * (1 + len(group_bounds(256, plan.expert_group)))
    assert sum(r.layer_groups for r in plan.ranks) == units and [r.windows for r in plan.ranks] == [4] * 8
    assert plan.ranks[0].gpu_peak_bytes is not None and plan.work_disk_bytes > plan.artifact_bytes


def test_cli_plan_json_and_table(config_only: Path) -> None:
    result = runner.invoke(app, ["compress", str(config_only), "--plan", "--ranks", "2", "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert [r["rank"] for r in data["ranks"]] == [0, 1] and data["num_samples"] == 32 and data["seq_len"] == 512
    table = runner.invoke(app, ["compress", str(config_only), "--plan", "--device", "cuda"])
    assert table.exit_code == 0 and "rank 0: peak host" in table.stdout and "GPU" in table.stdout
    assert not (Path.cwd() / "config-only-w4").exists()  # nothing written


def test_unknown_architecture_is_named(tmp_path: Path) -> None:
    directory = tmp_path / "m"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "not-a-model", "hidden_size": 8}))
    with pytest.raises(ModelError, match="not-a-model"):
        api.plan_compress(str(directory), "w4")


def test_nothing_to_quantize_is_named(config_only: Path) -> None:
    with pytest.raises(ModelError):
        api.plan_compress(str(config_only), "w4", overrides={"weights.targets": ["no_such_proj"]})


def test_bad_plan_options_are_refused(config_only: Path) -> None:
    for ranks in (0, 4097, 10**6):  # a line per rank: a million printed 699,387 lines (issue 50 item 9)
        with pytest.raises(ConfigError, match="--ranks must be from 1 to 4096"):
            api.plan_compress(str(config_only), "w4", ranks=ranks)
    with pytest.raises(ConfigError, match="expected cpu, cuda or cuda:N"):
        api.plan_compress(str(config_only), "w4", device="gpu")
    with pytest.raises(ConfigError, match="does not run error compensation"):
        api.plan_compress(str(config_only), "w3-ec", device="cuda")


def test_kimi_k2_plans_within_one_h100_and_256_gb_of_host_memory() -> None:
    """Kimi K2 (384 routed experts per block, config.json only) at w4 with --device cuda and --max-memory 256GB:
    the routed experts are streamed in groups sized so that every rank needs at most 80 GB on the GPU and 256 GB
    of host memory (issue 48: one fused expert parameter as the unit needed 452 / 498 GB)."""
    plan = api.plan_compress(str(CONFIGS / "kimi-k2"), "w4", ranks=8, device="cuda", max_memory="256GB")
    assert plan.experts == 384 and plan.expert_group is not None and 2 <= plan.expert_group < 384
    for rank in plan.ranks:
        assert rank.host_peak_bytes <= 256 * 10**9
        assert rank.gpu_peak_bytes is not None and rank.gpu_peak_bytes <= 80 * 10**9
    assert plan.minimum_bytes is not None and plan.minimum_bytes <= plan.ranks[0].host_peak_bytes
    assert any(f"streamed {plan.expert_group} at a time" in note for note in plan.notes)
    assert not any("H100 holds" in note for note in plan.notes)
    assert plan.to_dict()["expert_group"] == plan.expert_group  # --plan --json reports it


def test_expert_groups_are_sized_to_the_budget_and_the_minimum_is_one_group() -> None:
    """The largest group that fits the budget: a larger budget never gets a smaller group; whole blocks when
    they fit; the minimum is the peak with groups of 2, and a budget below it is refused naming it."""
    skeleton = meta_model(resolve_model(str(CONFIGS / "kimi-k2")))
    recipe = load_recipe("w4")
    targets = find_targets(skeleton, recipe.weights.targets, recipe.weights.ignore)
    size = estimate_size(skeleton, recipe, targets=targets).total_bytes

    def plan(budget: float) -> expert_plan.ExpertPlan:
        return expert_plan.plan_expert_groups(skeleton, recipe, targets, 512, size, int(budget))

    small, large, whole = plan(120e9), plan(200e9), plan(10e12)
    assert small.group is not None and large.group is not None and small.group < large.group
    assert small.peak_bytes <= 120e9 and large.peak_bytes <= 200e9
    assert whole.group is None and whole.peak_bytes == bounded_preflight.streaming_peak_bytes(
        skeleton, recipe, targets, 512, size
    )
    assert small.minimum_bytes == expert_plan.bounded_peak_bytes(skeleton, recipe, targets, 512, size, 2)
    assert small.minimum_bytes < small.peak_bytes < whole.peak_bytes
    with pytest.raises(ResourceError, match=r"below the minimum of .* one group of 2 of its 384 routed experts"):
        expert_plan.check_expert_budget(plan(50e9), int(50e9))
    expert_plan.check_expert_budget(plan(50e9), int(50e9), force=True)  # --force lets it through


def test_rates_name_their_machine_and_a_plan_elsewhere_says_so(
    config_only: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """plan_rates.json records the CPU model, ISA and cores it was measured on; a plan made on another machine
    keeps the times and says whose they are."""
    from squeeze.compression import plan_rates as plan_module
    from squeeze.compression.machine import Machine

    rates = load_rates("cpu")
    assert rates is not None and rates.cpu_model and rates.isa and rates.cores >= 1
    monkeypatch.setattr(plan_module, "this_machine", lambda: Machine("Other CPU", "AVX2", 64))
    plan = api.plan_compress(str(config_only), "w4", calibration_overrides={"num_samples": 4, "seq_len": 32})
    (note,) = [n for n in plan.notes if "rates measured on" in n]
    assert rates.cpu_model in note and "Other CPU, AVX2, 64 cores" in note
    assert plan.ranks[0].total_seconds is not None
    monkeypatch.setattr(plan_module, "this_machine", lambda: plan_module.rates_machine(rates))
    same = api.plan_compress(str(config_only), "w4", calibration_overrides={"num_samples": 4, "seq_len": 32})
    assert not any("rates measured on" in n for n in same.notes)
