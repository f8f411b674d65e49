"""Compress as a job of named stages, and the one artifact writer both compress and calibrate-kv use.

On the tiny random Llama of conftest.py: nothing here needs ../shared.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import squeeze
from squeeze import api
from squeeze.compression import preflight, runner
from squeeze.compression.pipelines import STAGES
from squeeze.compression.writer import quantization_header, state_bytes, unique_tensors

#: Timing keys that break a stage down (included in that stage's seconds).
BREAKDOWNS = {"checkpoint", "sparse", "kmeans", "rtn"}


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(3, 4, bias=False)
        self.head = nn.Linear(3, 4, bias=False)
        self.head.weight = self.embed.weight  # tied: one storage, two state-dict names
        self.register_buffer("empty_a", torch.zeros(0))
        self.register_buffer("empty_b", torch.zeros(0))


def test_unique_tensors_keeps_a_tied_weight_under_its_first_name_only() -> None:
    model = Tied()
    assert list(model.state_dict()) == ["empty_a", "empty_b", "embed.weight", "head.weight"]
    assert [name for name, _ in unique_tensors(model.state_dict())] == ["empty_a", "empty_b", "embed.weight"]
    assert state_bytes(model) == 4 * 3 * 4  # the tied weight once, fp32; empty tensors cost nothing


def test_format_version_and_quant_method_are_defined_once() -> None:
    root = Path(squeeze.__file__).parent
    for name in ("FORMAT_VERSION", "QUANT_METHOD"):
        defining = sorted(p.relative_to(root).as_posix() for p in root.rglob("*.py") if f"\n{name} = " in p.read_text())
        assert defining == ["format/quant_config.py"], name


def test_an_rtn_job_runs_its_stages_and_searches_the_targets_on_the_meta_model_only(
    tmp_path: Path, tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    searched: list[str] = []
    real = runner.find_targets

    def counting(model, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        searched.append(next(model.parameters()).device.type)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(runner, "find_targets", counting)
    monkeypatch.setattr(preflight, "find_targets", counting)
    result = api.compress(str(tiny_llama_dir), tmp_path / "out", "rtn-w4")
    # once for the job, on the meta-device build; the loaded model is never searched again, and estimate_size
    # takes the targets (preflight's estimate_peak_memory may still search the meta model itself)
    assert "cpu" not in searched and 1 <= searched.count("meta") <= 2, searched
    stages = [name for name in result.timings if name not in BREAKDOWNS]
    assert stages == [s for s in STAGES if s not in ("calibrate", "sensitivity")]  # no calibration: skipped
    assert set(result.timings) - set(STAGES) <= BREAKDOWNS and "rtn" in result.timings
    quant = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert quant.items() >= quantization_header().items() and quant["method"] == "rtn"


def test_a_fisher_job_times_every_stage(tmp_path: Path, tiny_llama_dir: Path, tiny_text_file: Path) -> None:
    result = api.compress(
        str(tiny_llama_dir),
        tmp_path / "out",
        "w3",
        str(tiny_text_file),
        calibration_overrides={"num_samples": 2, "seq_len": 32},
    )
    assert [name for name in result.timings if name not in BREAKDOWNS] == list(STAGES)
    assert {"checkpoint", "kmeans"} <= set(result.timings)
    assert sum(result.timings[s] for s in STAGES) <= result.seconds


def test_calibrate_kv_on_a_plain_model_writes_the_same_header(
    tmp_path: Path, tiny_llama_dir: Path, tiny_text_file: Path
) -> None:
    out = tmp_path / "kv"
    api.calibrate_kv(
        str(tiny_llama_dir), tiny_text_file, bits=8, output=out, calibration_overrides={"num_samples": 2, "seq_len": 32}
    )
    quant = json.loads((out / "config.json").read_text())["quantization_config"]
    assert quant.items() >= quantization_header().items()
    assert quant["method"] == "none" and quant["modules"] == {} and "kv_cache" in quant
    assert api.verify_model_integrity(out).ok
