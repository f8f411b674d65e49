"""A model whose weights stay in the source checkpoint until a part of it is needed (``--max-memory``).

The architecture is built on the meta device (accelerate's ``init_empty_weights``: parameters take no
memory, buffers such as rotary frequencies are real, as in a loaded model); :meth:`LazyModel.materialized`
reads one module's tensors from the source safetensors (``safe_open``, memory-mapped) in the model's fp32,
and puts the meta parameters back when the block ends, so only the modules in use are resident. Tied
parameters (an LM head sharing the input embedding) are materialized and released together, as one.

A MoE model's routed experts are one 3-D parameter per projection in transformers 5, but many checkpoints
(and transformers' own save_pretrained for Qwen2/3-MoE, DeepSeek-V3, GLM-4-MoE, Mixtral) store one 2-D tensor
per expert (``experts.{e}.gate_proj.weight`` ...), which from_pretrained fuses on load; such a parameter is
read here by the same fusion: the experts stacked on dim 0, a ``gate_up_proj`` being each expert's gate rows
then its up rows (transformers' qwen2_moe / mixtral conversion mapping; Mixtral's ``block_sparse_moe`` module
name is renamed back too).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from squeeze.errors import ConfigError
from squeeze.models.expert_params import per_expert_parameters
from squeeze.models.source import ModelSource

_HINT_GGUF = (
    "convert it to a safetensors directory once (transformers: AutoModelForCausalLM.from_pretrained(dir, "
    "gguf_file=..., dtype=torch.float32).save_pretrained(out, ...) plus the tokenizer), or drop --max-memory"
)


class LazyModel:
    """The meta-device model of ``source`` (a safetensors directory) with its weights read on demand.

    ``model`` is an ordinary transformers model in fp32 whose parameters are on the meta device outside
    :meth:`materialized`. Raises ConfigError for a GGUF source or a checkpoint that lacks one of the
    model's parameters under its state-dict name (e.g. a model whose weights transformers renames on load).
    """

    def __init__(self, source: ModelSource) -> None:
        if source.kind == "gguf":
            raise ConfigError(
                f"--max-memory reads the weights block by block from safetensors, and {source.model_id} is a GGUF "
                "file (its blocks are quantized and cannot be memory-mapped as they are)",
                hint=_HINT_GGUF,
            )
        self.source = source
        self.model = _meta_model(source.directory)
        self._files = _tensor_files(source.directory)
        # every parameter slot (module, attribute) by the meta parameter it holds: tied slots share one
        self._slots: dict[int, list[tuple[nn.Module, str]]] = {}
        self._keys: dict[int, str] = {}  # meta parameter -> the source tensor it is read from (a tie: its saved name)
        self._meta: dict[int, nn.Parameter] = {}
        self._by_name: dict[str, int] = {}  # every state-dict name of a parameter -> its meta parameter
        for module_name, module in self.model.named_modules(remove_duplicate=False):
            for attr, param in module._parameters.items():
                if param is None:
                    continue
                pid, key = id(param), f"{module_name}.{attr}" if module_name else attr
                self._slots.setdefault(pid, []).append((module, attr))
                self._meta[pid] = param
                self._by_name[key] = pid
                if pid not in self._keys or (self._keys[pid] not in self._files and key in self._files):
                    self._keys[pid] = key
        # fused expert parameters saved one tensor per expert: {parameter key: per expert, the keys to concatenate}
        # and a parameter saved under its checkpoint name (Mixtral's ``block_sparse_moe``): {parameter key: that name}
        self._parts: dict[str, list[list[str]]] = {}
        self._aliases: dict[str, str] = {}
        for pid, key in self._keys.items():
            if key in self._files:
                continue
            for alias in _saved_names(key):
                if alias in self._files:
                    self._aliases[key] = alias
                elif (parts := _expert_parts(alias, self._meta[pid], self._files)) is not None:
                    self._parts[key] = parts
                if key in self._aliases or key in self._parts:
                    break
        found = lambda key: key in self._files or key in self._aliases or key in self._parts  # noqa: E731
        missing = [key for key in self._keys.values() if not found(key)]
        if missing:
            raise ConfigError(
                f"--max-memory reads each parameter from the source safetensors by its name, and {source.path} "
                f"has no tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""),
                hint="save the model with transformers' save_pretrained (safetensors) first, or drop --max-memory",
            )

    def state(self) -> list[tuple[str, torch.Tensor | None]]:
        """The model's state dict in its order, each tensor once (a tied weight under its first name):
        ``(name, None)`` for a parameter (read it with :meth:`read_state`), ``(name, tensor)`` for a buffer."""
        seen: set[int] = set()
        found: list[tuple[str, torch.Tensor | None]] = []
        for name, tensor in self.model.state_dict(keep_vars=True).items():
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            found.append((name, None if isinstance(tensor, nn.Parameter) else tensor))
        return found

    def read_state(self, name: str) -> torch.Tensor:
        """The parameter whose state-dict name is ``name``, read from the source in the model's dtype."""
        pid = self._by_name[name]
        return self.read(self._keys[pid], self._meta[pid].dtype)

    def read(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The source tensor ``key`` (CPU), cast to ``dtype`` when given (bf16 -> fp32 is exact); a fused expert
        parameter stored per expert is fused here as from_pretrained fuses it."""
        if key in self._parts:
            return torch.stack([torch.cat([self.read(k, dtype) for k in keys]) for keys in self._parts[key]])
        key = self._aliases.get(key, key)
        with safe_open(str(self._files[key]), framework="pt") as handle:
            tensor = handle.get_tensor(key)
        return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() else tensor

    @contextlib.contextmanager
    def materialized(self, *modules: nn.Module) -> Iterator[None]:
        """``modules``' parameters read from the source (fp32, ``requires_grad=False``) for the block; the meta
        parameters are put back after it, so nothing read stays resident. Nested use is allowed."""
        placed: list[int] = []
        try:
            for module in modules:
                for param in list(module.parameters()):
                    meta_id = id(param)
                    if meta_id not in self._meta or not param.is_meta:
                        continue  # already materialized (a tie, or an enclosing block)
                    meta = self._meta[meta_id]
                    real = nn.Parameter(self.read(self._keys[meta_id], meta.dtype), requires_grad=False)
                    for owner, attr in self._slots[meta_id]:
                        owner._parameters[attr] = real
                    placed.append(meta_id)
            yield
        finally:
            for meta_id in placed:
                meta = self._meta[meta_id]
                for owner, attr in self._slots[meta_id]:
                    owner._parameters[attr] = meta

    @contextlib.contextmanager
    def experts_slice(self, module: nn.Module, start: int, stop: int) -> Iterator[None]:
        """A MoE experts module's per-expert parameters (the 3-D projections and their (E, out) biases: every
        direct parameter whose dim 0 is the expert count) holding only experts ``start .. stop-1``, read from the
        source (fp32, ``requires_grad=False``): a slice of a fused tensor, or those experts' own tensors; never the
        whole parameter. The meta parameters are put back after the block."""
        saved = {name: module._parameters[name] for name in per_expert_parameters(module)}
        try:
            for name, meta in saved.items():
                assert meta is not None
                rows = self._read_rows(self._keys[id(meta)], start, stop, meta.dtype)
                module._parameters[name] = nn.Parameter(rows, requires_grad=False)
            yield
        finally:
            module._parameters.update(saved)

    def _read_rows(self, key: str, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``start:stop`` of the source tensor ``key`` (dim 0: the experts), cast to ``dtype``."""
        if key in self._parts:
            return torch.stack(
                [torch.cat([self.read(k, dtype) for k in keys]) for keys in self._parts[key][start:stop]]
            )
        key = self._aliases.get(key, key)
        with safe_open(str(self._files[key]), framework="pt") as handle:
            tensor = handle.get_slice(key)[start:stop]
        return tensor.to(dtype) if tensor.is_floating_point() else tensor


#: a fused expert parameter -> the per-expert tensors it is made of, in order, under each naming in use
#: (gate/up/down: Qwen2/3-MoE, DeepSeek-V3, GLM-4-MoE; w1/w3/w2: Mixtral)
_EXPERT_SOURCES = {
    "gate_up_proj": (("gate_proj", "up_proj"), ("w1", "w3")),
    "down_proj": (("down_proj",), ("w2",)),
    "gate_proj": (("gate_proj",), ("w1",)),
    "up_proj": (("up_proj",), ("w3",)),
}


#: module names transformers renames on load (checkpoint name, model name): Mixtral's MoE block
_SAVED_RENAMES = ((".block_sparse_moe.", ".mlp."),)


def _saved_names(key: str) -> list[str]:
    """``key`` and the names a checkpoint may store it under (transformers' renamings, undone)."""
    return [key] + [key.replace(model, saved) for saved, model in _SAVED_RENAMES if model in key]


def _expert_parts(key: str, meta: nn.Parameter, files: dict[str, Path]) -> list[list[str]] | None:
    """For a 3-D expert parameter ``key`` (``....experts.gate_up_proj``) absent from the checkpoint, the source
    keys of its per-expert 2-D tensors (expert e: ``....experts.{e}.gate_proj.weight``, then the up one), or None
    when the checkpoint has no complete such set."""
    prefix, _, attr = key.rpartition(".")
    if meta.ndim != 3 or attr not in _EXPERT_SOURCES:
        return None
    for names in _EXPERT_SOURCES[attr]:
        parts = [[f"{prefix}.{e}.{name}.weight" for name in names] for e in range(meta.shape[0])]
        if all(k in files for keys in parts for k in keys):
            return parts
    return None


def _meta_model(directory: Path) -> nn.Module:
    """The causal LM of ``directory``'s config on the meta device, fp32 (as compress loads it), eval mode."""
    import accelerate
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    with accelerate.init_empty_weights(include_buffers=False), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=False, dtype=torch.float32)
    model.tie_weights()  # init_empty_weights replaces parameters after the constructor tied them; tie them again
    if (directory / "generation_config.json").is_file():  # as from_pretrained: the saved one wins
        model.generation_config = GenerationConfig.from_pretrained(str(directory), local_files_only=True)
    model.eval()
    return model


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Every tensor name of the directory's safetensors files -> the file holding it (headers only)."""
    files: dict[str, Path] = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                files.setdefault(key, path)
    return files


__all__ = ["LazyModel"]
