"""The model card squeeze push writes: golden text on the tiny Llama's artifact, its numbers are inspect's, the
base model and evaluation reports it accepts and refuses."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from squeeze import api
from squeeze.distribution.model_card import base_model_of, eval_rows, read_eval_report, render_model_card
from squeeze.errors import ConfigError
from squeeze.eval.compare import EvalResult
from squeeze.eval.harness import HarnessResult
from squeeze.eval.perplexity import PerplexityResult
from squeeze.format.verify import verify_artifact

#: The card of the tiny Llama compressed with rtn-w4 (calibration-free: the same bytes on any CPU) pushed to
#: org/tiny-w4 with base model org/tiny-base and both kinds of evaluation report. {digest} and {version} vary
#: (the manifest's creation time and source path, squeeze's version).
GOLDEN = """\
---
base_model: org/tiny-base
base_model_relation: quantized
library_name: squeeze
pipeline_tag: text-generation
tags:
- squeeze
- quantized
- 4-bit
- rtn
---

# tiny-w4

[org/tiny-base](https://huggingface.co/org/tiny-base), compressed by squeeze and sealed with a manifest: every \
file is checked against its SHA-256 when it is pulled and when it is loaded.

| | |
|---|---|
| base model | [org/tiny-base](https://huggingface.co/org/tiny-base) |
| recipe | `rtn-w4` |
| weight method | `rtn` |
| quantized modules | 14 (14 at 4 bits) |
| bits per weight | 4.4359 |
| KV cache | not calibrated (full precision unless quantized when run) |
| root digest | `{digest}` |
| written by | squeeze {version} |

Bits per weight: every byte of the quantized layers (codes, look-up tables, sparse entries, packing) over their \
weights, as `squeeze inspect` reports it.

## Evaluation

Measured with `squeeze eval --json` on this artifact (reported by its publisher; squeeze push runs no evaluation).

| evaluation | metric | value |
|---|---|---|
| perplexity (40 windows, 20440 tokens) | perplexity | 21.500 (baseline 20.250) |
| perplexity (40 windows, 20440 tokens) | word perplexity | 60.125 (baseline 55.000) |
| arc_easy | acc | 0.4167 ± 0.1486 |
| arc_easy | acc_norm | 0.5000 ± 0.1508 |
| gsm8k | exact_match (strict-match) | 0.2500 |

## Use it

```bash
squeeze pull org/tiny-w4 -o tiny-w4  # every byte checked against the manifest as it streams
squeeze verify tiny-w4  # again, at any time: sizes, SHA-256, root digest
squeeze run "Once upon a time" -m tiny-w4
squeeze serve tiny-w4  # an OpenAI-compatible server
```

## Recipe

`recipe.yaml`, as `squeeze compress` resolved it:

```yaml
{recipe}
```

## Integrity

`squeeze.manifest.json` lists every file of the artifact with its size and SHA-256; its root digest is \
`{digest}`. This README is not part of the artifact: the manifest does not list it, `squeeze pull` does not \
fetch it, and editing it changes nothing that is verified.
"""


@pytest.fixture(scope="module")
def rtn_artifact(tmp_path_factory: pytest.TempPathFactory, compress_tiny: Callable[..., Path]) -> Path:
    return compress_tiny(tmp_path_factory.mktemp("card") / "tiny-w4", "rtn-w4")


def perplexity_report() -> dict[str, object]:
    """What ``squeeze eval ART --text F --baseline M --json`` prints (the CLI prints EvalResult.to_dict())."""
    result = PerplexityResult(21.5, 60.125, math.log(21.5), 40, 20440, 15000, 512)
    baseline = PerplexityResult(20.25, 55.0, math.log(20.25), 40, 20440, 15000, 512)
    kv = {"kv_bits": 16, "kv_dynamic": False, "kv_cache": "float32"}
    return EvalResult("tiny-w4", result, "tiny-base", baseline, kv).to_dict()


def tasks_report() -> dict[str, object]:
    """What ``squeeze eval ART --tasks ... --json`` prints (HarnessResult.to_dict() of lm-eval's results)."""
    results = {
        "results": {
            "gsm8k": {"alias": "gsm8k", "exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": "N/A"},
            "arc_easy": {
                "alias": "arc_easy",
                "acc,none": 0.4166666666666667,
                "acc_stderr,none": 0.14863,
                "acc_norm,none": 0.5,
                "acc_norm_stderr,none": 0.15076,
            },
        },
        "n-samples": {"arc_easy": {"original": 12, "effective": 12}},
    }
    return HarnessResult((), results).to_dict()


def write_reports(directory: Path) -> list[Path]:
    paths = [directory / "ppl.json", directory / "tasks.json"]
    for path, report in zip(paths, (perplexity_report(), tasks_report()), strict=True):
        path.write_text(json.dumps(report))
    return paths


def test_the_card_of_the_tiny_artifact_is_the_golden_text(rtn_artifact: Path, tmp_path: Path) -> None:
    evals = [row for path in write_reports(tmp_path) for row in read_eval_report(path)]
    card = render_model_card(rtn_artifact, "org/tiny-w4", base_model="org/tiny-base", evals=evals)
    info = api.inspect(rtn_artifact)
    assert info.root_digest is not None and info.quantization is not None
    expected = GOLDEN.format(
        digest=info.root_digest,
        version=info.quantization.squeeze_version,
        recipe=(rtn_artifact / "recipe.yaml").read_text().rstrip(),
    )
    assert card == expected
    # its numbers are the artifact's own: inspect's bits per weight, the verified manifest's digest
    assert f"| bits per weight | {info.bits_per_weight} |" in card
    assert verify_artifact(rtn_artifact).manifest.root_digest == info.root_digest  # type: ignore[union-attr]
    # the front matter is YAML the Hub reads
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["base_model"] == "org/tiny-base" and front["base_model_relation"] == "quantized"


def test_without_a_hub_base_model_the_card_names_the_local_source_and_no_relation(rtn_artifact: Path) -> None:
    card = render_model_card(rtn_artifact, "org/tiny-w4")  # the manifest's source is a local directory
    front = yaml.safe_load(card.split("---\n")[1])
    assert "base_model" not in front and "base_model_relation" not in front
    assert front["library_name"] == "squeeze" and "4-bit" in front["tags"]
    assert "| base model | a local checkpoint (`tiny-llama`) |" in card
    assert "## Evaluation" not in card  # no report given, no table


def test_the_card_states_the_kv_cache_and_each_tag_once(
    compress_tiny: Callable[..., Path], tiny_text_file: Path, tmp_path: Path
) -> None:
    artifact = compress_tiny(tmp_path / "w4", "w4", overrides={"weights.sensitivity": "uniform"})
    api.calibrate_kv(artifact, tiny_text_file, bits=4, calibration_overrides={"num_samples": 2, "seq_len": 32})
    card = render_model_card(artifact, "org/tiny-w4-kv4")
    assert "| KV cache | 4 bits (int4, calibrated scales) |" in card
    assert f"| bits per weight | {api.inspect(artifact).bits_per_weight} |" in card
    assert yaml.safe_load(card.split("---\n")[1])["tags"] == ["squeeze", "quantized", "4-bit"]  # method "squeeze"


def test_base_model_of_the_manifest_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert base_model_of("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"  # read from the HF cache
    assert base_model_of("smollm2-135m") == "HuggingFaceTB/SmolLM2-135M-Instruct"  # the built-in alias
    for local in ("models/mine", "/work/models/x", "./x/y", "a/b/c", "model.gguf", "a/../b", None, ""):
        assert base_model_of(local) is None


def test_a_base_model_that_is_not_a_hub_id_is_refused(rtn_artifact: Path) -> None:
    for bad in ("just-a-name", "https://huggingface.co/org/x", "org/x/y", "org/.."):
        with pytest.raises(ConfigError, match="is not a Hub model id"):
            render_model_card(rtn_artifact, "org/tiny-w4", base_model=bad)


def test_evaluation_reports_that_are_not_squeeze_eval_json_are_refused(tmp_path: Path, rtn_artifact: Path) -> None:
    cases = {
        "missing.json": None,
        "not-json.json": "perplexity: 3",
        "list.json": "[1, 2]",
        "other.json": '{"accuracy": 0.5}',
        "nan.json": '{"perplexity": NaN}',
        "no-metrics.json": '{"results": {"arc_easy": {"alias": "arc_easy"}}}',
    }
    for name, text in cases.items():
        if text is not None:
            (tmp_path / name).write_text(text)
        with pytest.raises(ConfigError) as refused:
            read_eval_report(tmp_path / name)
        assert name in refused.value.message and "squeeze eval" in str(refused.value.hint)
    assert eval_rows({"perplexity": True}) == []  # a boolean is not a number
    # squeeze eval writes NaN for a word perplexity it could not count: the row is left out, the rest kept
    (tmp_path / "nan-word.json").write_text('{"perplexity": 3.5, "word_perplexity": NaN}')
    assert [row.metric for row in read_eval_report(tmp_path / "nan-word.json")] == ["perplexity"]
    rows = eval_rows({"results": {"a|b": {"acc,none": 0.5}}})
    assert "| a\\|b | acc | 0.5000 |" in render_model_card(rtn_artifact, "org/x", evals=rows)
