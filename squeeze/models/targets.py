"""Pick the nn.Linear layers a recipe quantizes, by module-name suffix."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from squeeze.errors import ModelError


def _matches_suffix(name: str, suffix: str) -> bool:
    # Suffix match on a dotted boundary: "q_proj" matches "model.layers.0.self_attn.q_proj" but not
    # "model.layers.0.self_attn.xq_proj"; a dotted suffix ("self_attn.q_proj") works the same way.
    return name == suffix or name.endswith("." + suffix)


def find_target_linears(model: nn.Module, targets: Sequence[str], ignore: Sequence[str] = ()) -> dict[str, nn.Linear]:
    """The nn.Linear modules to quantize, keyed by fully qualified name, in ``named_modules()`` order.

    A module is picked when its name ends with one of ``targets`` (on a ``.`` boundary) and contains none
    of ``ignore`` (plain substrings). The names are also the modules' state-dict prefixes. Raises
    ModelError when nothing matches.
    """
    if isinstance(targets, str) or isinstance(ignore, str):
        # A bare string would be iterated character by character and match almost everything.
        raise ModelError(
            "targets and ignore must be lists of module-name suffixes, found a plain string",
            hint='write targets=["q_proj"], not targets="q_proj"',
        )
    wanted = tuple(t.strip(".") for t in targets if t.strip("."))
    skipped = tuple(i for i in ignore if i)
    found: dict[str, nn.Linear] = {}
    linear_names: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        linear_names.append(name)
        if any(_matches_suffix(name, t) for t in wanted) and not any(i in name for i in skipped):
            found[name] = module
    if not found:
        arch = _architecture(model)
        seen = ", ".join(_short_names(linear_names)) or "none"
        raise ModelError(
            f"no nn.Linear in {arch} matches targets {list(targets)} (ignore {list(ignore)}); "
            f"linear layers seen: {seen}",
            hint="set weights.targets to suffixes of these names (e.g. q_proj, down_proj)",
        )
    return found


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
    """Names of the attention modules in cache order (their ``layer_idx``): ModelError if there are none."""
    found: dict[int, str] = {}
    for name, module in model.named_modules():
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


__all__ = ["find_target_linears", "attention_modules", "embedding_modules"]
