"""A toy model family, registered by the tests that use it: transformers' OPT, whose linears are not Llama's
(``out_proj``, ``fc1``, ``fc2``) and whose decoder ends in ``final_layer_norm`` rather than ``norm``.

Nothing in squeeze names OPT: this module is all a new family needs (docs/architecture.md, "A new model
family"), as tests/toy_format.py is for a weight format.
"""

from __future__ import annotations

from torch import nn

from squeeze.models.families import DecoderParts, ModelFamily, checked_parts


def opt_parts(model: nn.Module, option: str) -> DecoderParts:
    """OPT's decoder: ``model.decoder.layers``, its ``final_layer_norm``, the model's embeddings."""
    get_decoder = getattr(model, "get_decoder", None)
    decoder = get_decoder() if callable(get_decoder) else None
    blocks, norm = getattr(decoder, "layers", None), getattr(decoder, "final_layer_norm", None)
    return checked_parts(model, blocks, norm, option, type(model).__name__)


TOY_OPT = ModelFamily(
    name="toy-opt",
    model_types=frozenset({"opt"}),
    projections=("q_proj", "k_proj", "v_proj", "out_proj", "fc1", "fc2"),
    parts=opt_parts,
    before_blocks=lambda model: (model.get_decoder().embed_positions,),
)
