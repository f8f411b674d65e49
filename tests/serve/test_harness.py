"""lm-evaluation-harness on stories260K: the adapter's scores are squeeze eval's NLL and the server's echo
log-probabilities (to 1e-4, the same items right), with lm-eval installed or not."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import httpx
import pytest
import torch
from fake_engine import serving
from typer.testing import CliRunner

from squeeze import api
from squeeze.cli.app import app
from squeeze.errors import ConfigError
from squeeze.eval.harness import HarnessModel, load_harness_model
from squeeze.eval.perplexity import token_nlls
from squeeze.runtime.options import KVOptions
from squeeze.serve.http.app import create_app
from squeeze.serve.types import EngineConfig

TASKS = Path(__file__).parents[1] / "data" / "lm_eval"
TASK = "squeeze_tinystories_mc"
HAS_LM_EVAL = importlib.util.find_spec("lm_eval") is not None
PAIRS = [
    ("Once upon a time", " there was a little girl."),
    ("Tom and his dog went to the ", "park."),  # the trailing space moves to the continuation, as lm-eval does
    ("", "The sun was hot."),  # an empty context: the BOS token stands for it
    ("The cat sat on the mat and looked at the bird in the tree. It", " wanted to play."),
]


@pytest.fixture(scope="module")
def core(serve_artifact: Path) -> HarnessModel:
    return load_harness_model(serve_artifact, batch_size=3, kv_bits=16)


def test_loglikelihoods_are_squeeze_evals_nll(core: HarnessModel) -> None:
    scores = core.loglikelihood(PAIRS)
    for (context, continuation), (score, greedy) in zip(PAIRS, scores, strict=True):
        ctx, cont = core.encode_pair(context, continuation)
        nll = token_nlls(core.model, torch.tensor([ctx + cont]))[0]
        assert score == pytest.approx(-float(nll[len(ctx) - 1 :].sum()), abs=1e-4)
        assert isinstance(greedy, bool)
    assert core.encode_pair("", "x")[0] == [core.tokenizer.bos_token_id]
    ctx, cont = core.encode_pair("a dog ", "ran")
    assert ctx == core.encode("a dog") and ctx + cont == core.encode("a dog ran")
    # the greedy continuation is greedy
    ids = core.encode("Once upon a time")
    with torch.inference_mode():
        best = int(core.model(torch.tensor([ids])).logits[0, -1].argmax())
    assert core.loglikelihood_ids([(ids, [best])])[0][1] is True
    rolled = core.loglikelihood_rolling(["Once upon a time there was a dog."])[0]
    whole = [core.prefix_token_id, *core.encode("Once upon a time there was a dog.")]
    assert rolled == pytest.approx(-float(token_nlls(core.model, torch.tensor([whole])).sum()), abs=1e-4)


def test_the_server_scores_what_the_adapter_scores(serve_artifact: Path, core: HarnessModel) -> None:
    """lm-eval's local-completions request (token ids, echo, logprobs 1, max_tokens 1) against the in-process
    adapter: the same log-likelihoods to 1e-4 and the same greedy flags."""
    engine = api.serve_engine(serve_artifact, config=EngineConfig(kv=KVOptions(16), kv_memory_bytes=4 << 20))
    encoded = [core.encode_pair(c, x) for c, x in PAIRS]
    request = {
        "prompt": [c + x for c, x in encoded],
        "echo": True,
        "logprobs": 1,
        "max_tokens": 1,
        "temperature": 0,
        "seed": 1234,
    }
    with serving(create_app(engine, shutdown_grace_seconds=1.0)) as url:
        choices = httpx.post(f"{url}/v1/completions", json=request, timeout=60).json()["choices"]
    local = core.loglikelihood_ids(encoded)
    for (ctx, _), choice, (score, greedy) in zip(
        encoded, sorted(choices, key=lambda c: c["index"]), local, strict=True
    ):
        logprobs = choice["logprobs"]["token_logprobs"][len(ctx) : -1]  # what lm-eval's parse_logprobs reads
        tops = choice["logprobs"]["top_logprobs"][len(ctx) : -1]
        assert sum(logprobs) == pytest.approx(score, abs=1e-4)
        assert all(lp == max(top.values()) for lp, top in zip(logprobs, tops, strict=True)) == greedy


def test_without_lm_eval_the_install_line_is_the_message(serve_artifact: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lm_eval", None)  # import lm_eval raises ImportError, installed or not
    with pytest.raises(ConfigError, match="lm_eval") as missing:
        api.evaluate_tasks(serve_artifact, [TASK], include_path=TASKS)
    assert missing.value.hint == "pip install 'squeeze[eval]'"
    cli = CliRunner().invoke(app, ["eval", str(serve_artifact), "--tasks", TASK])
    assert cli.exit_code == 2 and "pip install 'squeeze[eval]'" in cli.stderr  # the brackets are not markup


def test_eval_needs_text_or_tasks(serve_artifact: Path) -> None:
    result = CliRunner().invoke(app, ["eval", str(serve_artifact)])
    assert result.exit_code == 2 and "either --text FILE" in result.stderr
    both = CliRunner().invoke(app, ["eval", str(serve_artifact), "--text", "x.txt", "--tasks", TASK])
    assert both.exit_code == 2


@pytest.mark.skipif(not HAS_LM_EVAL, reason="lm_eval is not installed (pip install 'squeeze[eval]')")
def test_lm_eval_runs_a_local_task_on_the_artifact(serve_artifact: Path, core: HarnessModel) -> None:
    result = api.evaluate_tasks(serve_artifact, [TASK], include_path=TASKS, limit=12, batch_size=4, kv_bits=16)
    (acc,) = [value for task, metric, value, _ in result.rows if task == TASK and metric == "acc"]
    import json

    docs = [json.loads(line) for line in (TASKS / "tinystories_mc.jsonl").read_text().splitlines()[:12]]
    right = 0
    for doc in docs:
        scores = [s for s, _ in core.loglikelihood([(doc["context"], c) for c in doc["choices"]])]
        right += scores.index(max(scores)) == doc["label"]
    assert acc == pytest.approx(right / len(docs))
    with pytest.raises(ConfigError, match="does not know the task no_such_task") as unknown:
        api.evaluate_tasks(serve_artifact, ["no_such_task"], include_path=TASKS)
    assert "lm_eval ls tasks" in str(unknown.value.hint)
    cli = CliRunner().invoke(
        app, ["eval", str(serve_artifact), "--tasks", TASK, "--include-path", str(TASKS), "--limit", "4", "--json"]
    )
    assert cli.exit_code == 0, cli.output
    assert TASK in json.loads(cli.stdout)["results"]
    # --model squeeze beside lm-eval's own models (python -m squeeze.eval.harness)
    from lm_eval.api.registry import get_model

    api.register()
    assert get_model("squeeze").__name__ == "SqueezeLM" and get_model("hf") is not None


def test_the_int4_kv_cache_scores_the_same_in_the_server_and_in_process(serve_artifact: Path) -> None:
    """The artifact's calibrated int4 KV cache, both ways: the paged pool's codes and squeeze eval's cache."""
    core = load_harness_model(serve_artifact, batch_size=1)  # the calibrated cache, as squeeze eval uses it
    engine = api.serve_engine(serve_artifact, config=EngineConfig(kv_memory_bytes=4 << 20))
    assert engine.pool.bits == 4
    encoded = [core.encode_pair(c, x) for c, x in PAIRS]
    request = {"prompt": [c + x for c, x in encoded], "echo": True, "logprobs": 1, "max_tokens": 0}
    with serving(create_app(engine, shutdown_grace_seconds=1.0)) as url:
        choices = httpx.post(f"{url}/v1/completions", json=request, timeout=60).json()["choices"]
    for (ctx, _), choice, (score, _) in zip(encoded, choices, core.loglikelihood_ids(encoded), strict=True):
        assert sum(choice["logprobs"]["token_logprobs"][len(ctx) :]) == pytest.approx(score, abs=1e-4)


def test_the_tasks_run_with_the_activations_asked_for(serve_artifact: Path) -> None:
    """``squeeze eval --tasks ... --activations int8`` loads the artifact's LUT kernels with int8 activations,
    as ``squeeze eval --text`` does (the option used to stop at the perplexity path)."""
    from squeeze.runtime.linear import SqueezeLinear

    for activations in ("float32", "int8"):
        core = load_harness_model(serve_artifact, batch_size=1, kv_bits=16, activations=activations)
        linears = [m for m in core.model.modules() if isinstance(m, SqueezeLinear)]
        assert linears and {m.activations for m in linears} == {activations}
