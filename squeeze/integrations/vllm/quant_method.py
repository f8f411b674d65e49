"""vLLM's quantization config for squeeze artifacts: picked by ``quantization_config.quant_method == "squeeze"``.

From the config dict alone (``from_config``, in the process that starts vLLM) every module entry is checked:
an unknown format version or a method this squeeze cannot run fails there, naming the module. Once vLLM
knows the model's path (``maybe_update_config``), the whole artifact is verified against its manifest
before any weight is read: a tampered artifact stops vLLM with squeeze's IntegrityError. The roles each
module stores are read from the verified headers, so every layer registers exactly its tensors.

Each layer gets its method here: quantized linears :class:`.linear.SqueezeLinearMethod`, a MoE layer's
quantized routed experts :class:`.moe.SqueezeFusedMoEMethod`, a quantized token embedding or LM head (tied or
not) :class:`.embedding.SqueezeEmbeddingMethod`, attention layers the artifact's fp8 KV scales.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from vllm.config import get_current_vllm_config_or_none
from vllm.logger import init_logger
from vllm.model_executor.layers.attention.attention import Attention
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig, QuantizeMethodBase
from vllm.model_executor.layers.quantization.kv_cache import BaseKVCacheMethod
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

from squeeze.errors import FormatError
from squeeze.format.quant_config import QUANT_METHOD
from squeeze.integrations.vllm.artifact import (
    ModuleSpecs,
    artifact_directory,
    checkpoint_modules,
    checkpoint_renames,
    embedding_modules,
    fp8_kv_scales,
    module_specs,
    parse_quant_config,
    renamed,
    verify,
)
from squeeze.integrations.vllm.embedding_method import SqueezeEmbeddingMethod
from squeeze.integrations.vllm.linear_method import SqueezeLinearMethod
from squeeze.integrations.vllm.load_format import LOAD_FORMAT
from squeeze.integrations.vllm.moe import SqueezeFusedMoEMethod, expert_modules

logger = init_logger("vllm.squeeze")


class SqueezeVllmConfig(QuantizationConfig):
    """A squeeze artifact's ``quantization_config``: which linears are quantized, and how."""

    def __init__(
        self, modules: dict[str, dict[str, Any]], kv_cache: object = None, tied: dict[str, str] | None = None
    ) -> None:
        super().__init__()
        self.modules = modules
        self.kv_cache = kv_cache  # quantization_config.kv_cache, if calibrated
        #: LM head -> the quantized embedding it reads (quantization_config.embeddings.tied)
        self.tied = dict(tied or {})
        #: the quantized embeddings and LM heads (quantization_config.embeddings.modules)
        self.embeddings: list[str] = []
        self.specs: ModuleSpecs | None = None
        #: (squeeze's, vLLM's) module name parts where transformers renamed the checkpoint's modules
        self.renames: tuple[tuple[str, str], ...] = ()
        #: attention module -> (k_scale, v_scale) for vLLM's fp8 KV cache (``calibrate-kv --bits fp8``)
        self.kv_scales: dict[str, tuple[float, float]] = {}

    def get_name(self) -> str:
        return QUANT_METHOD

    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        # the kernels accumulate in float32 whatever the activations' dtype
        return [torch.bfloat16, torch.float16, torch.float32]

    @classmethod
    def get_min_capability(cls) -> int:
        return 70  # the Triton LUT kernels' (Volta)

    @staticmethod
    def get_config_filenames() -> list[str]:
        return []  # everything is in config.json's quantization_config

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> SqueezeVllmConfig:
        quant = parse_quant_config(config)
        kv_cache = quant.kv_cache.to_dict() if quant.kv_cache is not None else None
        made = cls({name: entry.to_dict() for name, entry in quant.modules.items()}, kv_cache, quant.tied_heads)
        made.embeddings = embedding_modules(quant)
        return made

    def maybe_update_config(self, model_name: str, hf_config: Any = None, revision: str | None = None) -> None:
        self.attach(model_name, getattr(hf_config, "model_type", None))

    def attach(self, model: str, model_type: str | None = None) -> None:
        """Verify the artifact at ``model`` (IntegrityError if it is not intact), read its module roles, and
        name its modules as vLLM's ``model_type`` does (:func:`.artifact.checkpoint_renames`)."""
        directory = artifact_directory(model)
        report = verify(directory)
        self.specs = module_specs(report, self.modules)
        self.kv_scales = fp8_kv_scales(report, self.kv_cache)
        self.renames = checkpoint_renames(model_type)
        if self.renames:
            self._rename(lambda name: renamed(name, self.renames))
        logger.info(
            "squeeze: verified %s (%d files, %.1f MB hashed, root %s...)",
            directory,
            len(report.files),
            report.bytes_hashed / 1e6,
            report.root_digest[:12],
        )

    def apply_vllm_mapper(self, hf_to_vllm_mapper: Any) -> None:
        """Rename module entries as the model renames its checkpoint's modules."""
        self._rename(lambda name: hf_to_vllm_mapper.map_name(name) or name)

    def _rename(self, rename: Callable[[str], str]) -> None:
        """Every module name this config holds, renamed by ``rename``."""
        self.modules = {rename(name): spec for name, spec in self.modules.items()}
        self.kv_scales = {rename(name): scales for name, scales in self.kv_scales.items()}
        self.tied = {rename(head): rename(source) for head, source in self.tied.items()}
        self.embeddings = [rename(name) for name in self.embeddings]
        if self.specs is not None:
            self.specs = ModuleSpecs(
                modules=self.modules, roles={rename(name): r for name, r in self.specs.roles.items()}
            )

    def _attached(self) -> ModuleSpecs:
        """The module specs; a process that did not build the config itself verifies the artifact here, while
        vLLM builds the model, before any weight is read."""
        if self.specs is None:
            current = get_current_vllm_config_or_none()
            if current is None or current.model_config is None:
                raise FormatError("the squeeze vLLM plugin needs the model's path to verify the artifact")
            self.attach(current.model_config.model, getattr(current.model_config.hf_config, "model_type", None))
        assert self.specs is not None
        if self.renames:
            self._check_load_format()
        return self.specs

    def _check_load_format(self) -> None:
        """An artifact whose names differ from vLLM's (``renames``) loads only through squeeze's loader, which
        renames the tensors it reads; vLLM's own loaders would stop on the first unknown name."""
        current = get_current_vllm_config_or_none()
        load_format = getattr(getattr(current, "load_config", None), "load_format", LOAD_FORMAT)
        if load_format != LOAD_FORMAT:
            ours, theirs = self.renames[0]
            raise FormatError(
                f"this artifact names its modules as transformers loads them ({ours!r} where vLLM reads "
                f"{theirs!r}): vLLM must read it with load_format='squeeze', found {load_format!r}",
                hint="pass --load-format squeeze (LLM(..., load_format='squeeze'))",
            )

    def get_quant_method(self, layer: torch.nn.Module, prefix: str) -> QuantizeMethodBase | None:
        specs = self._attached()
        if isinstance(layer, Attention):
            return self._kv_method(prefix)
        if isinstance(layer, RoutedExperts):
            experts = expert_modules(specs, prefix)
            return SqueezeFusedMoEMethod(layer.moe_config, specs, experts, prefix) if experts else None
        if isinstance(layer, VocabParallelEmbedding):  # an embedding or LM head (weights.embedding_bits)
            return self._embedding_method(layer, prefix, specs)
        if not isinstance(layer, LinearBase):
            inside = [name for name in self.modules if name == prefix or name.startswith(prefix + ".")]
            if inside and prefix:  # e.g. a fused MoE layer whose experts the artifact quantized
                raise FormatError(
                    f"the artifact quantizes {inside[0]}, which vLLM builds into its {type(layer).__name__} "
                    f"{prefix}; the squeeze vLLM plugin serves quantized linear layers only",
                    hint="serve this artifact with squeeze run / squeeze serve",
                )
            return None  # embeddings, the LM head, norms: stored unquantized
        modules = checkpoint_modules(prefix, self.packed_modules_mapping)
        quantized = [name in specs.modules for name in modules]
        if not any(quantized):
            return UnquantizedLinearMethod()
        if not all(quantized):
            plain = [name for name, q in zip(modules, quantized, strict=True) if not q]
            raise FormatError(
                f"vLLM fuses {', '.join(modules)} into {prefix}, but the artifact leaves {plain[0]} unquantized",
                hint="re-compress with a recipe that quantizes all of them, or none",
            )
        return SqueezeLinearMethod(specs, modules)

    def _embedding_method(self, layer: torch.nn.Module, prefix: str, specs: ModuleSpecs) -> QuantizeMethodBase | None:
        """The method of vLLM's embedding / LM head ``prefix``: squeeze's over the artifact's quantized table,
        or None (vLLM's own) when the artifact keeps it. Some vLLM models (Llama's) build the token embedding
        without a prefix: it is then the one input embedding the artifact quantized."""
        if not prefix and not isinstance(layer, ParallelLMHead):
            heads = {*self.tied, *(name for name in self.embeddings if name.rpartition(".")[2] == "lm_head")}
            inputs = [name for name in self.embeddings if name not in heads]
            if len(inputs) > 1:
                raise FormatError(
                    f"vLLM builds a token embedding without a name, and the artifact quantizes {len(inputs)} "
                    f"embeddings ({', '.join(inputs)}): which one it is cannot be told"
                )
            prefix = inputs[0] if inputs else prefix
        if prefix in specs.modules:
            return SqueezeEmbeddingMethod(specs, prefix)
        if prefix in self.tied:
            return SqueezeEmbeddingMethod(specs, self.tied[prefix], tied=True)
        return None

    def _kv_method(self, prefix: str) -> QuantizeMethodBase | None:
        """The fp8 KV scales of attention layer ``prefix`` (``...self_attn.attn``: its module is the parent)."""
        if not self.kv_scales:
            return None
        module = prefix.rpartition(".")[0]
        if module not in self.kv_scales:
            raise FormatError(
                f"the artifact's fp8 KV scales name {len(self.kv_scales)} attention modules, not {module!r}",
                hint="re-run squeeze calibrate-kv --bits fp8 on this artifact",
            )
        logger.info_once("squeeze: the attention layers take the artifact's calibrated fp8 KV scales")
        return Fp8KVScales(self, *self.kv_scales[module])


class Fp8KVScales(BaseKVCacheMethod):
    """An attention layer's k_scale / v_scale, set from the verified artifact (not from vLLM's weight stream:
    the scales live in squeeze's KV-cache file). vLLM uses them with ``kv_cache_dtype="fp8"`` and ignores
    them otherwise."""

    def __init__(self, quant_config: QuantizationConfig, k_scale: float, v_scale: float) -> None:
        super().__init__(quant_config)
        self.scales = (k_scale, v_scale)

    def create_weights(self, layer: torch.nn.Module) -> None:
        super().create_weights(layer)
        for name, value in zip(("k_scale", "v_scale"), self.scales, strict=True):
            getattr(layer, name).data.fill_(value)  # the KVCacheScaleParameters the base class just made


__all__ = ["SqueezeVllmConfig", "Fp8KVScales"]
