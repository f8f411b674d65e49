"""Pick what a recipe quantizes, by name suffix: nn.Linear layers and 3-D expert parameters (experts.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from squeeze.errors import ModelError
from squeeze.models.expert_params import ExpertWeight, is_experts_module
from squeeze.models.families import MLA_KV_PROJECTIONS, expert_param_names


def _matches_suffix(name: str, suffix: str) -> bool:
    # Suffix match on a dotted boundary: "q_proj" matches "model.layers.0.self_attn.q_proj" but not
    # "model.layers.0.self_attn.xq_proj"; a dotted suffix ("self_attn.q_proj") works the same way.
    return name == suffix or name.endswith("." + suffix)


#: A quantization target: an nn.Linear (its (out, in) weight) or a 3-D expert parameter (its (E*out, in) view).
Target = nn.Linear | ExpertWeight


def find_target_linears(model: nn.Module, targets: Sequence[str], ignore: Sequence[str] = ()) -> dict[str, nn.Linear]:
    """The nn.Linear modules to quantize, keyed by fully qualified name, in ``named_modules()`` order.

    A module is picked when its name ends with one of ``targets`` (on a ``.`` boundary) and contains none
    of ``ignore`` (plain substrings). The names are also the modules' state-dict prefixes. Raises
    ModelError when nothing matches.
    """
    found = {name: t for name, t in _find(model, targets, ignore, experts=False).items() if isinstance(t, nn.Linear)}
    return found


def find_targets(model: nn.Module, targets: Sequence[str], ignore: Sequence[str] = ()) -> dict[str, Target]:
    """What compress quantizes: the target nn.Linear modules and the 3-D expert parameters, in model order.

    Linears are keyed by module name (their weight is ``{name}.weight``); expert parameters (squeeze.models.
    experts) by parameter path (``...mlp.experts.gate_up_proj``), matched by the same rules: the name ends
    with one of ``targets`` on a ``.`` boundary and contains none of ``ignore``. Routers and gates are never
    picked (they are neither nn.Linear targets by default nor expert projections). ModelError when nothing
    matches.
    """
    return _find(model, targets, ignore, experts=True)


def _find(model: nn.Module, targets: Sequence[str], ignore: Sequence[str], *, experts: bool) -> dict[str, Target]:
    if isinstance(targets, str) or isinstance(ignore, str):
        # A bare string would be iterated character by character and match almost everything.
        raise ModelError(
            "targets and ignore must be lists of module-name suffixes, found a plain string",
            hint='write targets=["q_proj"], not targets="q_proj"',
        )
    wanted = tuple(t.strip(".") for t in targets if t.strip("."))
    skipped = tuple(i for i in ignore if i)

    def picked(name: str) -> bool:
        return any(_matches_suffix(name, t) for t in wanted) and not any(i in name for i in skipped)

    found: dict[str, Target] = {}
    seen_names: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            seen_names.append(name)
            if picked(name):
                found[name] = module
        elif experts and is_experts_module(module):
            for attr, param in module.named_parameters(recurse=False):
                if attr in expert_param_names() and param.ndim == 3:
                    path = f"{name}.{attr}" if name else attr
                    seen_names.append(path)
                    if picked(path):
                        found[path] = ExpertWeight(module, attr)
    if not found:
        arch = _architecture(model)
        seen = ", ".join(_short_names(seen_names)) or "none"
        raise ModelError(
            f"no nn.Linear in {arch} matches targets {list(targets)} (ignore {list(ignore)}); "
            f"{'linear layers and expert parameters' if experts else 'linear layers'} seen: {seen}",
            hint="set weights.targets to suffixes of these names (e.g. q_proj, down_proj)",
        )
    return found


def target_at(model: nn.Module, name: str) -> Target:
    """The target named ``name`` in ``model`` (a linear's module name or an expert parameter's path), as
    find_targets found it on the same architecture; TypeError when ``name`` is neither (a bug: the names
    come from find_targets)."""
    module = model.get_submodule(name) if _has_submodule(model, name) else None
    if isinstance(module, nn.Linear):
        return module
    parent_name, _, attr = name.rpartition(".")
    parent = model.get_submodule(parent_name) if _has_submodule(model, parent_name) else None
    if parent is not None and is_experts_module(parent) and attr in expert_param_names():
        param = getattr(parent, attr, None)
        if isinstance(param, nn.Parameter) and param.ndim == 3:
            return ExpertWeight(parent, attr)
    raise TypeError(f"{name} is neither an nn.Linear nor a 3-D expert parameter of {type(model).__name__}")


def _has_submodule(model: nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
    except AttributeError:
        return False
    return True


def target_shape(target: Target) -> tuple[int, int]:
    """(out, in) of the matrix a target is quantized as: a linear's weight, or an expert parameter's (E*out, in)."""
    if isinstance(target, ExpertWeight):
        return target.matrix_shape
    out_features, in_features = target.weight.shape
    return int(out_features), int(in_features)


def target_matrix(target: Target) -> torch.Tensor:
    """The fp32 (out, in) matrix a target is quantized as (detached; an expert parameter's is a stacked copy)."""
    if isinstance(target, ExpertWeight):
        return target.matrix()
    return target.weight.detach().float()


def matrix_fisher(target: Target, fisher: torch.Tensor) -> torch.Tensor:
    """``fisher`` (shaped like the target's weight) as the (out, in) matrix the target is quantized as."""
    return target.stack(fisher) if isinstance(target, ExpertWeight) else fisher


def linear_targets(targets: Mapping[str, Target]) -> dict[str, nn.Linear]:
    """The nn.Linear targets of ``targets`` (those with an input: hooks, input Hessians), in order."""
    return {name: t for name, t in targets.items() if isinstance(t, nn.Linear)}


def embedding_modules(model: nn.Module) -> tuple[dict[str, nn.Embedding | nn.Linear], str | None]:
    """The token embeddings to quantize: ``({name: module}, tied LM head name or None)``.

    The input embedding (an ``nn.Embedding``, (V, d) weight) always; the output embedding (the LM head, an
    ``nn.Linear`` with a (V, d) weight) too when it has a weight of its own. When the LM head shares the
    input embedding's weight (``tie_word_embeddings``), it is left out and its name returned: that one
    weight is quantized once and serves both. ModelError when the model has no token embedding module.
    """
    get_input = getattr(model, "get_input_embeddings", None)
    try:
        embedding = get_input() if callable(get_input) else None
    except (NotImplementedError, AttributeError):
        embedding = None
    if not isinstance(embedding, nn.Embedding):
        raise ModelError(
            f"weights.embedding_bits is set, but {_architecture(model)} has no token embedding (nn.Embedding) "
            "that squeeze can quantize",
            hint="remove embedding_bits (--embedding-bits) from the recipe for this model",
        )
    get_output = getattr(model, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    names = {id(module): name for name, module in model.named_modules()}
    found: dict[str, nn.Embedding | nn.Linear] = {names[id(embedding)]: embedding}
    tied = getattr(getattr(model, "config", None), "tie_word_embeddings", False) is True
    if isinstance(head, nn.Linear) and id(head) in names and tuple(head.weight.shape) == tuple(embedding.weight.shape):
        if tied or head.weight is embedding.weight:
            return found, names[id(head)]
        found[names[id(head)]] = head
    return found, None


def _architecture(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    architectures = getattr(config, "architectures", None)
    if architectures:
        return "/".join(architectures)
    return type(model).__name__


def _short_names(names: list[str], limit: int = 8) -> list[str]:
    # Show the distinct leaf names first (q_proj, k_proj, ...): that is what a user types as a target.
    leaves = list(dict.fromkeys(name.rsplit(".", 1)[-1] for name in names))
    shown = leaves[:limit]
    if len(leaves) > limit:
        shown.append(f"... ({len(leaves) - limit} more)")
    return shown


def attention_modules(model: nn.Module) -> tuple[str, ...]:
    """Names of the attention modules in cache order (their ``layer_idx``): ModelError if there are none, or
    if the model's attention is MLA (its cache's keys and values differ in size: see the message)."""
    found: dict[int, str] = {}
    for name, module in model.named_modules():
        if name.endswith("attn") and any(hasattr(module, p) for p in MLA_KV_PROJECTIONS):
            raise ModelError(
                f"calibrate-kv does not support the multi-head latent attention (MLA) of {_architecture(model)}: "
                "its cache holds per-head keys (nope + rope dimensions) and values (v_head_dim) of different sizes, "
                "and squeeze's int8/int4 KV format needs keys and values of one head_dim",
                hint="compress, run and eval work on this model with its KV cache unquantized: leave out "
                "calibrate-kv and --kv-bits",
            )
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and name.endswith("attn") and hasattr(module, "k_proj") and idx not in found:
            found[idx] = name
    if not found or sorted(found) != list(range(len(found))):
        raise ModelError(
            f"found no attention modules with a layer_idx and k_proj in {type(model).__name__}",
            hint="calibrate-kv supports decoder-only transformers models with self_attn.k_proj "
            "(Llama, Mistral, Qwen...)",
        )
    return tuple(found[i] for i in range(len(found)))


__all__ = [
    "Target",
    "find_target_linears",
    "find_targets",
    "linear_targets",
    "matrix_fisher",
    "target_at",
    "target_matrix",
    "target_shape",
    "attention_modules",
    "embedding_modules",
]
