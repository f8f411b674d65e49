"""Shared fixtures: a tiny random Llama built in memory, paths to ../shared (tests skip with a reason when
absent) and small artifacts."""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers/huggingface_hub are imported
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# tests/runtime/test_kernels.py runs the Triton kernels in Triton's CPU interpreter, which must be on before
# triton is first imported (triton.language's own @jit helpers are built then); transformers' cache and
# quantizer modules import triton, and other test modules import those at collection, before test_kernels
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

import squeeze  # noqa: E402
from missing_extras import (  # noqa: E402, F401 - in CI, a skip for a missing package fails the run
    pytest_collectreport,
    pytest_runtest_logreport,
    pytest_sessionfinish,
    pytest_terminal_summary,
)
from squeeze.format import Provenance, seal_artifact, write_shards  # noqa: E402

# the tests load artifacts with AutoModelForCausalLM.from_pretrained as a user does after squeeze.register()
# (`import squeeze` registers nothing); lm-eval registers itself where a test needs it
squeeze.register(lm_eval=False)

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("SQUEEZE_SHARED", REPO.parent / "shared"))
STORIES = SHARED / "models" / "stories260K"
CORPORA = SHARED / "corpora"


def require_shared(path: Path) -> Path:
    """Skip the calling test (with a reason) when a file or folder from ../shared is absent."""
    if not path.exists():
        pytest.skip(f"{path} is absent (tests that need ../shared skip on machines without it)")
    return path


@pytest.fixture(autouse=True)
def _one_torch_thread(request: pytest.FixtureRequest):
    """Run tiny-model tests on one thread (restored afterwards; slow-marked tests keep all threads).

    stories260K's matmuls take microseconds; with 2 OpenMP threads on a shared, busy machine every op can
    wait a scheduler tick for a descheduled peer thread (measured: 3.5 s instead of 0.1 s per call).
    """
    if request.node.get_closest_marker("slow"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def stories_dir() -> Path:
    if not (STORIES / "config.json").is_file():
        pytest.skip(f"stories260K not found at {STORIES} (../shared is absent)")
    return STORIES


@pytest.fixture(scope="session")
def stories(stories_dir: Path):
    """(model, tokenizer) of stories260K, loaded once per session. Tests must not modify it."""
    from squeeze.models import load_model, resolve_model

    return load_model(resolve_model(str(stories_dir)))


@pytest.fixture(scope="session")
def corpora_dir() -> Path:
    return require_shared(CORPORA)


@pytest.fixture(scope="session")
def tinystories_file() -> Path:
    return require_shared(CORPORA / "tinystories_sample.txt")


@pytest.fixture(scope="session")
def tinystories_text(tinystories_file: Path) -> str:
    return tinystories_file.read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def sotu_text() -> str:
    """../shared's sotu.txt, the calibration text that is not the evaluated domain."""
    return require_shared(CORPORA / "sotu.txt").read_text(encoding="utf-8")


# ------------------------------------------------------------------------------------------------------
# A tiny random Llama (no files, no downloads): for tests that need "some small model", not stories260K's
# quality. Built once per session in well under a second (transformers' import aside).

#: The tiny Llama's dimensions. intermediate_size 144: RTN groups of 32 leave a partial last group; 512
#: positions as stories260K. Weights drawn with std 0.1 (not 0.02): logits spread (std ~0.8) instead of
#: near-uniform, so a wrong weight moves the perplexity by percents, not per mille.
TINY_LLAMA = {
    "hidden_size": 64,
    "intermediate_size": 144,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.1,
}
TINY_SPECIAL = ["<unk>", "<s>", "</s>", "<pad>"]  # ids 0..3: unk, bos, eos, pad
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
_WORDS = (
    "once upon a time there was little girl boy named lily tom who liked to play in the park with her his "
    "dog cat one day found big red blue ball under tree and they were happy sad sun warm sky bright said "
    "mom let us go home after lunch because it is late"
).split()


def tiny_story_text(sentences: int = 250, seed: int = 0) -> str:
    """Deterministic story-like English (about 40 characters a sentence), five sentences a line."""
    rng = random.Random(seed)
    lines, line = [], []
    for i in range(sentences):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 10))]
        line.append(" ".join(words).capitalize() + rng.choice(".!?"))
        if i % 5 == 4:
            lines.append(" ".join(line))
            line = []
    return "\n".join(lines + [" ".join(line)]).strip() + "\n"


def build_tiny_tokenizer(text: str, vocab_size: int = 320) -> Any:
    """A byte-level BPE tokenizer trained on ``text`` (milliseconds), as a PreTrainedTokenizerFast.

    Its alphabet is printable ASCII plus space/newline/tab (other bytes are ``<unk>``), so any token
    sequence decodes to plain text; it adds ``<s>`` in front like Llama's tokenizers.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    alphabet = [chr(b) for b in range(33, 127)] + ["\u0120", "\u010a", "\u0109"]  # byte-level space, \n, \t
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=TINY_SPECIAL,
        initial_alphabet=alphabet,
        limit_alphabet=len(alphabet),
        show_progress=False,
    )
    backend.train_from_iterator(text.splitlines(), trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>"
    )
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    return tokenizer


def save_tiny_model(model: Any, tokenizer: Any, directory: Path) -> Path:
    """``model`` and ``tokenizer`` saved as an ordinary HF checkpoint directory (safetensors)."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_llama_config(tokenizer: Any, **changes: Any) -> Any:
    """The tiny Llama's LlamaConfig (``changes`` override TINY_LLAMA, e.g. tie_word_embeddings=True)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        **{
            **TINY_LLAMA,
            "vocab_size": len(tokenizer),
            "bos_token_id": 1,
            "eos_token_id": 2,
            "pad_token_id": 3,
            "tie_word_embeddings": False,
            **changes,
        }
    )


@pytest.fixture(scope="session")
def tiny_text() -> str:
    """About 8 KB of generated text (about 2000 tokens of the tiny tokenizer): calibration and evaluation."""
    return tiny_story_text()


@pytest.fixture(scope="session")
def tiny_text_file(tmp_path_factory: pytest.TempPathFactory, tiny_text: str) -> Path:
    path = tmp_path_factory.mktemp("tiny-text") / "tiny_stories.txt"
    path.write_text(tiny_text, encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_text: str) -> Any:
    """The in-memory tokenizer every tiny model shares. Tests must not modify it."""
    return build_tiny_tokenizer(tiny_text)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer: Any) -> Path:
    """A random LlamaForCausalLM (seeded; 2 layers, hidden 64, GQA 4/2 heads) saved with its tokenizer."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config(tiny_tokenizer)).eval()
    return save_tiny_model(model, tiny_tokenizer, tmp_path_factory.mktemp("tiny-llama") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_llama(tiny_llama_dir: Path) -> tuple[Any, Any]:
    """(model, tokenizer) of the tiny Llama, loaded once per session as squeeze loads models. Do not modify."""
    from squeeze.models import load_model, resolve_model

    return load_model(resolve_model(str(tiny_llama_dir)))


@pytest.fixture(scope="session")
def resized_tiny_llama(tiny_llama_dir: Path) -> Callable[..., Path]:
    """``resized_tiny_llama(directory, **config_changes)``: a random (seeded) Llama of the tiny Llama's config
    with ``config_changes`` (e.g. intermediate_size=128), saved in ``directory`` with the tiny tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    def build(directory: Path, **config_changes: Any) -> Path:
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig.from_pretrained(tiny_llama_dir, **config_changes)).eval().save_pretrained(
            directory
        )
        AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(directory)
        return directory

    return build


@pytest.fixture(scope="session")
def compress_tiny(tiny_llama_dir: Path, tiny_text_file: Path) -> Callable[..., Path]:
    """``compress_tiny(output, recipe="w4", source=None, **kwargs)``: api.compress of the tiny Llama (or of the
    model directory ``source``), Fisher calibration on 4 windows of 32 tokens of the tiny text (so any built-in
    recipe runs in about a second)."""
    from squeeze import api

    def compress(output: Path, recipe: str = "w4", source: Path | None = None, **kwargs: Any) -> Path:
        kwargs.setdefault("calibration", str(tiny_text_file))
        kwargs.setdefault("calibration_overrides", {"num_samples": 4, "seq_len": 32})
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # often called from module-scoped fixtures, before _one_torch_thread applies
        try:
            api.compress(str(source or tiny_llama_dir), output, recipe=recipe, **kwargs)
        finally:
            torch.set_num_threads(threads)
        return output

    return compress


def make_artifact(directory: Path, max_shard_bytes: int = 3000) -> Path:
    """A small sealed artifact: two shards, an index, a config and a nested tokenizer file."""
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "model.layers.0.mlp.weight": torch.randn(20, 30, generator=generator),
        "model.layers.1.mlp.weight": torch.randn(20, 30, generator=generator),
        "model.norm.weight": torch.ones(30),
        "codes": torch.arange(100, dtype=torch.uint8),
    }
    write_shards(directory, tensors, max_shard_bytes)
    (directory / "config.json").write_text('{"model_type": "llama"}\n')
    (directory / "extra").mkdir()
    (directory / "extra" / "notes.txt").write_text("hello\n")
    seal_artifact(directory, Provenance(source_model="unit-test"))
    return directory


@pytest.fixture
def artifact(tmp_path: Path) -> Path:
    return make_artifact(tmp_path / "artifact")


@pytest.fixture(scope="session")
def wide32_artifact(
    tmp_path_factory: pytest.TempPathFactory,
    resized_tiny_llama: Callable[..., Path],
    compress_tiny: Callable[..., Path],
) -> Path:
    """The tiny Llama with every layer width a multiple of 32 (intermediate 128 instead of 144), compressed w4.

    torch's elementwise CPU kernels run vectors of 32 floats and compute a leftover tail in scalar code, so
    only at such widths (those of real models) is each row's activation independent of the tensor around it.
    """
    source = resized_tiny_llama(tmp_path_factory.mktemp("wide32") / "tiny-llama-128", intermediate_size=128)
    return compress_tiny(source.parent / "tiny-llama-128-w4", "w4", source=source)
