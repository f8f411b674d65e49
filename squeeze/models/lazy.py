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
from squeeze.models.checkpoint_keys import (
    has_unknown_renames,
    match_checkpoint,
    source_mismatch,
    tensor_files,
)
from squeeze.models.config_bounds import check_config_sizes
from squeeze.models.expert_params import per_expert_parameters
from squeeze.models.source import ModelSource

_HINT_GGUF = (
    "convert it to a safetensors directory once (transformers: AutoModelForCausalLM.from_pretrained(dir, "
    "gguf_file=..., dtype=torch.float32).save_pretrained(out, ...) plus the tokenizer), or drop --max-memory"
)


class LazyModel:
    """The meta-device model of ``source`` (a safetensors directory) with its weights read on demand.

    ``model`` is an ordinary transformers model in fp32 whose parameters are on the meta device outside
    :meth:`materialized`. Raises ConfigError for a GGUF source or a checkpoint whose names transformers
    renames on load in ways this reader does not know; ModelError for a checkpoint that does not match its
    config.json (a weight missing or left over, squeeze.models.checkpoint_keys) or a config size out of bounds.
    """

    def __init__(self, source: ModelSource) -> None:
        if source.kind == "gguf":
            raise ConfigError(
                f"--max-memory reads the weights block by block from safetensors, and {source.model_id} is a GGUF "
                "file (its blocks are quantized and cannot be memory-mapped as they are)",
                hint=_HINT_GGUF,
            )
        self.source = source
        check_config_sizes(source)  # before the architecture is built: num_hidden_layers 1e12 would hang it
        self.model = _meta_model(source.directory)
        self._files = tensor_files(source.directory)
        # every parameter slot (module, attribute) by the meta parameter it holds: tied slots share one
        self._slots: dict[int, list[tuple[nn.Module, str]]] = {}
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
        # meta parameter -> the source tensor it is read from (a tie: its saved name); fused expert parameters
        # saved one tensor per expert: {parameter key: per expert, the keys to concatenate}; a parameter saved
        # under its checkpoint name (Mixtral's ``block_sparse_moe``): {parameter key: that name}
        match = match_checkpoint(self.model, self._files)
        self._keys, self._parts, self._aliases = match.keys, match.parts, match.aliases
        if (match.missing or match.unexpected) and has_unknown_renames(self.model):
            raise ConfigError(
                f"--max-memory reads each parameter from the source safetensors by its name, and transformers "
                f"renames {source.model_id}'s weights on load ({source.path} has no tensor "
                f"{(match.missing or match.unexpected)[0]!r})",
                hint="save the model with transformers' save_pretrained (safetensors) first, or drop --max-memory",
            )
        if match.missing or match.unexpected:  # never read a model with weights it lacks or drops
            raise source_mismatch(source, self.model.config, match.missing, match.unexpected)

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


__all__ = ["LazyModel"]
