"""int4 KV on small heads (stories260K, head_dim 8): two key grids per head by default, and they pay off."""

from __future__ import annotations

from squeeze.calibrate.kv import calibrate_kv
from squeeze.calibrate.windows import sample_windows, tokenize_text
from squeeze.eval.perplexity import perplexity_from_ids
from squeeze.kvcache import SqueezeKVCache
from squeeze.quant.kv_spec import LayerKV


def test_small_heads_get_two_key_grids_and_lose_less(stories, tinystories_text) -> None:  # noqa: ANN001
    model, tokenizer = stories
    ids = tokenize_text(tinystories_text, tokenizer)
    windows = sample_windows(ids, 8, 128, seed=0)
    default = calibrate_kv(model, windows, 4).spec
    one_grid = calibrate_kv(model, windows, 4, key_group=8).spec
    assert {layer.key_group for layer in default.layers if isinstance(layer, LayerKV)} == {4}

    def ppl(spec):  # noqa: ANN001, ANN202
        factory = None if spec is None else (lambda: SqueezeKVCache(spec))
        return perplexity_from_ids(model, ids[None], seq_len=128, max_windows=6, kv_cache=factory).perplexity

    full, two, one = ppl(None), ppl(default), ppl(one_grid)
    # measured: full precision 5.850, two grids 6.013 (+2.8%), one grid 6.119 (+4.6%)
    assert full < two < one
    assert two / full - 1 < 0.8 * (one / full - 1)
