"""Model families: what squeeze knows of a decoder architecture, in one place (docs/architecture.md, "A new
model family").

A :class:`ModelFamily` names the ``config.model_type`` values it covers and says

- ``projections``: the nn.Linear name suffixes a recipe quantizes by default. A recipe's default
  ``weights.targets`` is the union of every registered family's projections (:func:`default_targets`), so a
  recipe names targets only to change them;
- ``expert_params``: the 3-D parameter names of a MoE experts module that hold projection matrices
  (squeeze.models.expert_params; :func:`expert_param_names` is the union);
- ``fused``: groups of projections a runtime fuses into one matrix (vLLM's qkv_proj and gate_up_proj), which a
  ``weights.target_bpw`` plan gives one setting (squeeze.compression.bit_budget; :func:`fused_groups`);
- ``parts``: how its causal LM splits into ``(input embedding, decoder blocks, final norm, LM head)`` for the
  block-by-block passes of ``--max-memory`` / ``--device`` (:func:`model_parts`; ConfigError when a model is
  not that shape); ``before_blocks``: the modules besides the input embedding that the model runs before its
  first block (OPT's learned position embeddings), loaded with the embedding when the blocks are streamed;
- ``fast_path``: whether ``squeeze run`` / ``squeeze serve`` may take the flat forward
  (squeeze.runtime.fast_path, which still checks the model's modules one by one).

A model whose ``model_type`` no family names falls to the generic transformers decoder family
(:data:`DECODER`). :func:`register_family` adds one from outside squeeze (tests/toy_family.py does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from squeeze.errors import ConfigError

#: ``(input embedding, decoder blocks, final norm, LM head)`` of a causal LM.
DecoderParts = tuple[nn.Module, nn.ModuleList, nn.Module, nn.Module]
#: ``parts(model, option)``: a model's DecoderParts; ConfigError (naming the command-line ``option``) if it
#: has another shape.
PartsFn = Callable[[nn.Module, str], DecoderParts]


def llama_parts(model: nn.Module, option: str = "--max-memory") -> DecoderParts:
    """The parts of a model shaped like Llama: ``get_decoder().layers`` / ``.norm``, the input and output
    embeddings, and logits ``lm_head(norm(hidden))`` (no soft-capping or logit scale, which the block-by-block
    passes cannot reproduce)."""
    arch = type(model).__name__
    get_decoder = getattr(model, "get_decoder", None)
    base = get_decoder() if callable(get_decoder) else None
    return checked_parts(model, getattr(base, "layers", None), getattr(base, "norm", None), option, arch)


def checked_parts(model: nn.Module, blocks: Any, norm: Any, option: str, arch: str) -> DecoderParts:
    """``(embed, blocks, norm, head)`` with the model's own input / output embeddings; ConfigError unless
    ``blocks`` is a ModuleList, ``norm`` a module, the head an nn.Linear and the logits unscaled."""
    get_embed, get_head = getattr(model, "get_input_embeddings", None), getattr(model, "get_output_embeddings", None)
    embed = get_embed() if callable(get_embed) else None
    head = get_head() if callable(get_head) else None
    config = getattr(model, "config", None)
    scaled = any(getattr(config, key, None) not in (None, 1, 1.0) for key in ("final_logit_softcapping", "logit_scale"))
    if not isinstance(blocks, nn.ModuleList) or not isinstance(norm, nn.Module) or not isinstance(head, nn.Linear):
        raise ConfigError(
            f"{option} streams decoder blocks of models shaped like Llama (model.layers, model.norm, lm_head); "
            f"{arch} is not",
            hint=f"drop {option} for this model, or register its family's parts (docs/architecture.md, "
            "'A new model family')",
        )
    if scaled or not isinstance(embed, nn.Module):
        raise ConfigError(
            f"{option} cannot stream {arch}: its logits are not lm_head(norm(hidden))",
            hint=f"drop {option} for this model",
        )
    return embed, blocks, norm, head


@dataclass(frozen=True)
class ModelFamily:
    """One decoder architecture family (see the module docstring for what each field drives)."""

    name: str
    #: ``config.model_type`` values of the family; empty for the generic family every other model falls to
    model_types: frozenset[str] = frozenset()
    projections: tuple[str, ...] = ()
    expert_params: tuple[str, ...] = ()
    fused: tuple[tuple[str, ...], ...] = ()
    parts: PartsFn = field(default=llama_parts)
    before_blocks: Callable[[nn.Module], tuple[nn.Module, ...]] = field(default=lambda _model: ())
    fast_path: bool = False


#: Dense and shared-expert MLP linears, fused gate_up_proj (Phi-3 linears), and the routed experts' 3-D
#: parameters of transformers 5 MoE models (Mixtral, Qwen2/3-MoE, GLM-4-MoE, gpt-oss): any transformers decoder.
DECODER = ModelFamily(
    name="decoder",
    projections=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "gate_up_proj"),
    expert_params=("gate_up_proj", "down_proj", "gate_proj", "up_proj"),
    fused=(("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj")),
)
#: Llama's decoder layer (Qwen3 adds q/k norms): the families the flat forward computes.
LLAMA = ModelFamily(
    name="llama",
    model_types=frozenset({"llama", "mistral", "qwen2", "qwen3"}),
    projections=DECODER.projections[:7],
    fast_path=True,
)
#: The projections only multi-head latent attention has (its cache holds keys and values of different sizes).
MLA_KV_PROJECTIONS = ("kv_a_proj_with_mqa", "kv_b_proj")
#: Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): its low-rank query and key/value projections.
MLA = ModelFamily(
    name="mla",
    model_types=frozenset({"deepseek_v2", "deepseek_v3"}),  # Kimi K2 is deepseek_v3
    projections=("o_proj", *DECODER.projections[4:7], "q_a_proj", "q_b_proj", *MLA_KV_PROJECTIONS),
    expert_params=DECODER.expert_params,
)

_REGISTRY: dict[str, ModelFamily] = {family.name: family for family in (DECODER, LLAMA, MLA)}


def register_family(family: ModelFamily) -> None:
    """Add ``family``: ValueError if its name is taken or another family already covers one of its model types."""
    if family.name in _REGISTRY:
        raise ValueError(f"a model family named {family.name!r} is already registered")
    for other in _REGISTRY.values():
        if shared := family.model_types & other.model_types:
            raise ValueError(f"model types {sorted(shared)} already belong to the family {other.name!r}")
    _REGISTRY[family.name] = family


def unregister_family(name: str) -> None:
    """Remove the family named ``name`` (tests undo their :func:`register_family`); the built-ins stay."""
    if name in (DECODER.name, LLAMA.name, MLA.name):
        raise ValueError(f"the built-in model family {name!r} cannot be removed")
    _REGISTRY.pop(name, None)


def families() -> tuple[ModelFamily, ...]:
    """The registered families, in registration order (the built-ins first)."""
    return tuple(_REGISTRY.values())


def family_of(model_or_type: nn.Module | str | None) -> ModelFamily:
    """The family covering a model (its ``config.model_type``) or a model type; :data:`DECODER` for any other."""
    if isinstance(model_or_type, nn.Module):
        model_or_type = getattr(getattr(model_or_type, "config", None), "model_type", None)
    for family in _REGISTRY.values():
        if model_or_type in family.model_types:
            return family
    return DECODER


def default_targets() -> tuple[str, ...]:
    """A recipe's default ``weights.targets``: every registered family's projections, each once, in order."""
    return tuple(dict.fromkeys(name for family in _REGISTRY.values() for name in family.projections))


def expert_param_names() -> tuple[str, ...]:
    """The 3-D expert parameter names every registered family quantizes, each once, in order."""
    return tuple(dict.fromkeys(name for family in _REGISTRY.values() for name in family.expert_params))


def fused_groups() -> tuple[tuple[str, ...], ...]:
    """Every registered family's fused projection groups, each once, in order."""
    return tuple(dict.fromkeys(group for family in _REGISTRY.values() for group in family.fused))


def model_parts(model: nn.Module, option: str = "--max-memory") -> DecoderParts:
    """``(input embedding, decoder blocks, final norm, LM head)`` of a causal LM, as its family splits it;
    ConfigError if it has another shape (or post-processes its logits), which the block-by-block passes cannot
    reproduce. ``option``: the command-line option the message names (``--max-memory`` or ``--device``)."""
    return family_of(model).parts(model, option)


def takes_fast_path(model_type: object) -> bool:
    """Whether models of ``model_type`` are of a family the flat forward (squeeze.runtime.fast_path) computes."""
    return isinstance(model_type, str) and family_of(model_type).fast_path


#: The built-in families' default targets (the recipes' default while no other family is registered).
DEFAULT_TARGETS = default_targets()

__all__ = [
    "DECODER",
    "DEFAULT_TARGETS",
    "LLAMA",
    "MLA",
    "MLA_KV_PROJECTIONS",
    "DecoderParts",
    "ModelFamily",
    "PartsFn",
    "checked_parts",
    "default_targets",
    "expert_param_names",
    "families",
    "fused_groups",
    "family_of",
    "llama_parts",
    "model_parts",
    "register_family",
    "takes_fast_path",
    "unregister_family",
]
