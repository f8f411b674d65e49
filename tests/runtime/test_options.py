"""Options objects checked once, when built: every bad option is a ConfigError with a clear message, a
``squeeze run`` checks each option exactly once, and a public key reaches every loader (squeeze.load,
from_pretrained, the vLLM plugin's verification) and is checked there."""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from squeeze import api
from squeeze.errors import ConfigError, IntegrityError, SqueezeError
from squeeze.runtime import options as options_module
from squeeze.runtime import sampling_params as sampling_module
from squeeze.runtime.options import KVOptions, LoadOptions, split_keywords
from squeeze.runtime.sampling_params import SamplingParams

PROMPT = "Once upon a time"


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: SamplingParams.for_generate(0), r"max_new_tokens must be an integer >= 1, found 0"),
        (lambda: SamplingParams.for_generate(True), r"max_new_tokens must be an integer >= 1, found True"),
        (lambda: SamplingParams(max_tokens=-1), r"max_tokens must be an integer >= 0, found -1"),
        (lambda: SamplingParams(4, temperature=-0.1), r"temperature must be a finite number >= 0"),
        (lambda: SamplingParams(4, temperature=float("inf")), r"temperature must be a finite number >= 0"),
        (lambda: SamplingParams(4, temperature=float("nan")), r"temperature must be a finite number >= 0"),
        (lambda: SamplingParams(4, top_p=0.0), r"top_p must be in \(0, 1\], found 0.0"),
        (lambda: SamplingParams(4, top_p=1.5), r"top_p must be in \(0, 1\], found 1.5"),
        (lambda: SamplingParams(4, seed=1.5), r"seed must be an integer, found 1.5"),  # type: ignore[arg-type]
        (lambda: SamplingParams(4, stop=["x"]), r"stop must be a tuple of strings"),  # type: ignore[arg-type]
        (lambda: SamplingParams(4, logprobs=-1), r"logprobs must be None or an integer >= 0, found -1"),
        (lambda: LoadOptions(dense_cache=True, low_memory=True), r"--dense and --low-memory contradict each other"),
        (
            lambda: LoadOptions(activations="int4"),
            r"activations must be one of 'int8', 'float32', 'bfloat16', found 'int4'",
        ),  # type: ignore[arg-type]
        (lambda: LoadOptions(device="mps"), r"device 'mps' is not supported"),
        (lambda: LoadOptions(public_key="k.pem", verify=False), r"--public-key needs verification"),
        (lambda: LoadOptions(public_key="/nonexistent/k.pem"), r"cannot read the public key"),
        (lambda: KVOptions(kv_bits=5), r"--kv-bits must be 4, 8 or 16 \(no KV quantization\), found 5"),
        (lambda: KVOptions(kv_dynamic=True), r"--kv-dynamic needs --kv-bits 8 or 4"),
        (lambda: LoadOptions.build(LoadOptions(), {"verify": False}), r"pass LoadOptions or its keywords, not both"),
        (lambda: api.EngineConfig(block_size=0), r"--block-size must be a positive integer, found 0"),
        (lambda: api.EngineConfig(kv=KVOptions(3)), r"--kv-bits must be 4, 8 or 16"),
    ],
)
def test_bad_options_are_config_errors_when_built(build: Callable[[], Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        build()
    assert isinstance(info.value, SqueezeError)


def test_good_options_are_kept_as_given() -> None:
    sampling = SamplingParams.for_generate(8, 0.7, 0.9, seed=3)
    assert (sampling.max_tokens, sampling.max_new_tokens, sampling.do_sample, sampling.seed) == (8, 8, True, 3)
    assert len(sampling.processors()) == 2 and not SamplingParams(0).processors()  # serve may score only
    load = LoadOptions(low_memory=True, activations="int8")
    assert load.torch_device.type == "cpu" and load == LoadOptions(low_memory=True, activations="int8")
    assert KVOptions(4, True) == KVOptions(kv_bits=4, kv_dynamic=True)
    with pytest.raises(TypeError, match="unexpected keyword argument 'kv_bits'"):
        split_keywords({"verify": False, "kv_bits": 8}, SamplingParams, LoadOptions)
    assert split_keywords({"verify": False, "kv_bits": 8}, LoadOptions, KVOptions) == [
        {"verify": False},
        {"kv_bits": 8},
    ]


@pytest.fixture(scope="module")
def tiny_w4(tmp_path_factory: pytest.TempPathFactory, compress_tiny: Callable[..., Path]) -> Path:
    return compress_tiny(tmp_path_factory.mktemp("opts") / "w4", "w4", overrides={"weights.sensitivity": "uniform"})


def _counting(monkeypatch: pytest.MonkeyPatch, counts: Counter[str], module: Any, name: str) -> None:
    real = getattr(module, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[f"{module.__name__}.{name}"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)


def test_a_squeeze_run_checks_each_option_once(tiny_w4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from squeeze.cli.app import app
    from squeeze.runtime import checks, kv_selection

    counts: Counter[str] = Counter()
    for module, name in (
        (sampling_module, "_check"),  # max_new_tokens, temperature, top_p, seed
        (options_module, "_check_load"),  # verify, dense / low memory, public key, device
        (options_module, "_check_kv"),
        (options_module, "check_activations"),
        (kv_selection, "check_kv_options"),
        (checks, "resolve_device"),
        (checks, "_checked_prompts"),
    ):
        _counting(monkeypatch, counts, module, name)
    args = ["run", "-m", str(tiny_w4), PROMPT, "-n", "3", "--temperature", "0.5", "--seed", "1", "--kv-bits", "16"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert counts == {
        "squeeze.runtime.sampling_params._check": 1,
        "squeeze.runtime.options._check_load": 1,
        "squeeze.runtime.options._check_kv": 1,
        "squeeze.runtime.options.check_activations": 1,
        "squeeze.runtime.kv_selection.check_kv_options": 1,
        "squeeze.runtime.checks.resolve_device": 1,
        "squeeze.runtime.checks._checked_prompts": 1,
    }


def test_api_generate_builds_its_options_once_from_keywords(tiny_w4: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counts: Counter[str] = Counter()
    _counting(monkeypatch, counts, sampling_module, "_check")
    _counting(monkeypatch, counts, options_module, "_check_load")
    _counting(monkeypatch, counts, options_module, "_check_kv")
    result = api.generate(tiny_w4, PROMPT, max_new_tokens=2, low_memory=True, kv_bits=16)
    assert len(result.texts) == 1 and counts == {
        "squeeze.runtime.sampling_params._check": 1,
        "squeeze.runtime.options._check_load": 1,
        "squeeze.runtime.options._check_kv": 1,
    }
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        api.generate(tiny_w4, PROMPT, bogus=1)
    with pytest.raises(ConfigError, match="pass sampling or its keywords, not both"):
        api.generate(tiny_w4, PROMPT, SamplingParams(2), temperature=0.5)


# -- public keys through every loader ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def signed(tiny_w4: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("model_signing")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    root = tmp_path_factory.mktemp("signed")
    out: dict[str, Path] = {}
    for name in ("signer", "other"):
        key = ec.generate_private_key(ec.SECP256R1())
        out[name] = root / f"{name}.pem"
        out[name].write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
            )
        )
        out[name + ".pub"] = root / f"{name}.pub.pem"
        out[name + ".pub"].write_bytes(
            key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
        )
    out["artifact"] = root / "artifact"
    shutil.copytree(tiny_w4, out["artifact"])
    api.sign(out["artifact"], out["signer"])
    return out


def test_squeeze_load_checks_the_signature(signed: dict[str, Path]) -> None:
    assert api.load(signed["artifact"], public_key=signed["signer.pub"]).signature is not None
    with pytest.raises(IntegrityError):
        api.load(signed["artifact"], LoadOptions(public_key=signed["other.pub"]))


def test_from_pretrained_checks_the_signature_given_through_loading(signed: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM

    from squeeze.runtime.linear import SqueezeLinear

    with api.loading(public_key=signed["signer.pub"], activations="int8") as options:
        model = AutoModelForCausalLM.from_pretrained(signed["artifact"])
    assert options.public_key == signed["signer.pub"]
    linears = [m for m in model.modules() if isinstance(m, SqueezeLinear)]
    assert linears and all(m.activations == "int8" for m in linears)
    with pytest.raises(IntegrityError), api.loading(public_key=signed["other.pub"]):
        AutoModelForCausalLM.from_pretrained(signed["artifact"])
    with pytest.raises(ConfigError, match="from_pretrained always verifies"), api.loading(verify=False):
        pass
    AutoModelForCausalLM.from_pretrained(signed["artifact"])  # outside the block: no key asked for


def test_vllm_verification_checks_the_signature(signed: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    from squeeze.integrations.vllm.artifact import verify  # no vLLM import

    assert verify(signed["artifact"], options=LoadOptions(public_key=signed["signer.pub"])).ok
    with pytest.raises(IntegrityError):
        verify(signed["artifact"], options=LoadOptions(public_key=signed["other.pub"]))
    monkeypatch.setenv("SQUEEZE_PUBLIC_KEY", str(signed["other.pub"]))  # what a vLLM process is given
    with pytest.raises(IntegrityError):
        verify(signed["artifact"], capture=True)
    monkeypatch.setenv("SQUEEZE_PUBLIC_KEY", str(signed["signer.pub"]))
    assert verify(signed["artifact"]).ok
