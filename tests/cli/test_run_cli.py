"""``squeeze run``: streamed text, the stats line, JSON, batches from a file, and every bad input."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app

runner = CliRunner()
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def rtn_artifact(tmp_path_factory: pytest.TempPathFactory, stories_dir: Path) -> Path:
    out = tmp_path_factory.mktemp("run") / "stories-rtn-w4"
    api.compress(str(stories_dir), out, recipe="rtn-w4")
    return out


def run(*args: str):
    return runner.invoke(app, ["run", *args])


def test_run_streams_the_text_and_reports_stats_on_stderr(rtn_artifact: Path) -> None:
    result = run(PROMPT, "-m", str(rtn_artifact), "--max-new-tokens", "16")
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() and result.stdout.endswith("\n")
    last = result.stderr.strip().splitlines()[-1]
    for part in ("load", "(verified)", "first token", "tok/s", "peak RSS"):
        assert part in last, last
    # the streamed text is the JSON text (same greedy run)
    as_json = json.loads(run(PROMPT, "-m", str(rtn_artifact), "--max-new-tokens", "16", "--json").stdout)
    assert result.stdout == as_json["text"] + "\n"


def test_run_keeps_the_first_words_space(rtn_artifact: Path) -> None:
    """Issue 50 item 2: after "Once upon a time," it printed "there was a" (SentencePiece writes a word's space
    only in context): streamed and --json, the text is read after the prompt."""
    streamed = run(f"{PROMPT},", "-m", str(rtn_artifact), "-n", "6")
    as_json = json.loads(run(f"{PROMPT},", "-m", str(rtn_artifact), "-n", "6", "--json").stdout)
    assert streamed.stdout == as_json["text"] + "\n" and as_json["text"].startswith(" ") and as_json["text"].strip()


def test_json_prints_only_json_with_the_stats(rtn_artifact: Path) -> None:
    result = run(PROMPT, "-m", str(rtn_artifact), "-n", "8", "--json", "--temperature", "0.8", "--seed", "3")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert {
        "text",
        "texts",
        "load_seconds",
        "ttft_seconds",
        "tokens_per_second",
        "new_tokens",
        "peak_memory_bytes",
        "prompt_tokens",
        "verified",
        "model",
    } <= set(data)
    assert data["texts"] == [data["text"]] and 1 <= data["new_tokens"] <= 8 and data["verified"] is True
    assert data["load_seconds"] > 0 and data["ttft_seconds"] > 0 and data["peak_memory_bytes"] > 0
    again = json.loads(
        run(PROMPT, "-m", str(rtn_artifact), "-n", "8", "--json", "--temperature", "0.8", "--seed", "3").stdout
    )
    assert again["text"] == data["text"]  # seeded sampling is reproducible


def test_prompts_file_runs_one_batch_and_low_memory_agrees(rtn_artifact: Path, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n\n   \nThe little dog\n", encoding="utf-8")
    dense = run("-m", str(rtn_artifact), "--prompts-file", str(prompts), "-n", "10", "--json")
    assert dense.exit_code == 0, dense.output
    data = json.loads(dense.stdout)
    assert len(data["texts"]) == 2 and len(data["prompt_tokens_per_prompt"]) == 2
    low = json.loads(
        run("-m", str(rtn_artifact), "--prompts-file", str(prompts), "-n", "10", "--json", "--low-memory").stdout
    )
    assert low["texts"] == data["texts"] and low["low_memory"] is True
    text_mode = run("-m", str(rtn_artifact), "--prompts-file", str(prompts), "-n", "10")
    assert text_mode.stdout.startswith(data["texts"][0]) and "--- prompt 2 ---" in text_mode.stdout


def test_no_verify_warns_and_still_runs(rtn_artifact: Path) -> None:
    result = run(PROMPT, "-m", str(rtn_artifact), "-n", "4", "--no-verify", "--json")
    assert result.exit_code == 0, result.output
    assert result.stderr.startswith("Warning: loading without verification")
    assert json.loads(result.stdout)["verified"] is False


def _bad(result, code: int, message: str) -> None:
    assert result.exit_code == code, (result.exit_code, result.output)
    assert result.stderr.startswith("Error: "), result.stderr
    assert message in result.stderr, result.stderr
    assert result.stdout == ""  # nothing partial on stdout


def test_missing_artifact_exits_2(tmp_path: Path) -> None:
    _bad(run(PROMPT, "-m", str(tmp_path / "none")), 2, "no such artifact directory")


def test_tampered_artifact_exits_1(rtn_artifact: Path, tmp_path: Path) -> None:
    copy = tmp_path / "tampered"
    shutil.copytree(rtn_artifact, copy)
    shard = sorted(copy.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit pattern in the last tensor's bytes
    shard.write_bytes(bytes(data))
    _bad(run(PROMPT, "-m", str(copy), "-n", "4"), 1, "failed verification")


def test_tampered_config_exits_1_even_in_json_mode(artifact: Path) -> None:
    (artifact / "config.json").write_text('{"model_type": "llama", "hidden_size": 1}\n')
    _bad(run(PROMPT, "-m", str(artifact), "--json"), 1, "failed verification: config.json")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["", "-n", "4"], "empty"),
        (["-n", "4"], "no prompt"),
        ([PROMPT, "--max-new-tokens", "0"], "max_new_tokens"),
        ([PROMPT, "--max-new-tokens", "-2"], "max_new_tokens"),
        ([PROMPT, "--temperature", "-1"], "temperature"),
        ([PROMPT, "--top-p", "0"], "top_p"),
        ([PROMPT, "--top-p", "1.5"], "top_p"),
        ([PROMPT, "--device", "tpu"], "unknown device"),
        ([PROMPT, "--device", "meta"], "not supported"),
        ([PROMPT, "--prompts-file", "/nonexistent/prompts.txt"], "does not exist"),
        ([PROMPT, "--chat", "-n", "4"], "chat template"),
        ([PROMPT, "-n", "600"], "context of 512"),
    ],
)
def test_bad_input_is_one_error_line_and_no_stdout(rtn_artifact: Path, args: list[str], message: str) -> None:
    _bad(run(*args, "-m", str(rtn_artifact)), 2, message)


def test_bad_options_fail_before_the_artifact_is_touched(tmp_path: Path) -> None:
    _bad(run("", "-m", str(tmp_path / "none")), 2, "empty")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_clear_error(rtn_artifact: Path) -> None:
    _bad(run(PROMPT, "-m", str(rtn_artifact), "--device", "cuda"), 2, "torch.cuda.is_available() is False")


def test_empty_prompts_file_is_an_error(rtn_artifact: Path, tmp_path: Path) -> None:
    empty = tmp_path / "blank.txt"
    empty.write_text("\n  \n", encoding="utf-8")
    _bad(run("-m", str(rtn_artifact), "--prompts-file", str(empty)), 2, "holds no prompt")


def test_model_too_large_for_memory_is_one_error_before_reading(rtn_artifact: Path, monkeypatch) -> None:
    import squeeze.format.hashing as hashing
    import squeeze.runtime.memory as memory

    estimate = memory.estimate_load(rtn_artifact)
    monkeypatch.setattr(memory, "available_memory_bytes", lambda: estimate.total(dense_cache=True) - 1)
    monkeypatch.setattr(hashing, "hash_file", lambda *a, **k: pytest.fail("read before the memory check"))
    result = run(PROMPT, "-m", str(rtn_artifact), "-n", "4")
    _bad(result, 2, "not enough memory to load")
    assert "--low-memory" in result.stderr and len(result.stderr.strip().splitlines()) == 2  # error + hint
