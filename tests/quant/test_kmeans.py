"""Weighted 1-D k-means: quality against sklearn, exact nearest codes, degenerate rows, determinism."""

from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

import squeeze.quant.kmeans as km
from squeeze.errors import ModelError
from squeeze.quant.kmeans import nearest_codes, weighted_kmeans_1d
from squeeze.quant.kmeans_rows import sort_rows

QUANT_DIR = Path(km.__file__).resolve().parent


def weighted_sse(x: torch.Tensor, w: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor:
    """(R,) sum_j w_j * min_c (x_j - c)^2, float64."""
    d = (x.double()[:, :, None] - centroids.double()[:, None, :]) ** 2
    return (w.double() * d.min(-1).values).sum(-1)


def sklearn_sse(x: torch.Tensor, w: torch.Tensor, k: int) -> torch.Tensor:
    """The reference: sklearn KMeans per row (k-means++, max_iter 50), its weighted SSE per row."""
    from sklearn.cluster import KMeans
    from threadpoolctl import threadpool_limits

    out = []
    with threadpool_limits(1):
        for r in range(x.shape[0]):
            xr = x[r].double().numpy().reshape(-1, 1)
            wr = w[r].double().numpy()
            fit = KMeans(n_clusters=k, n_init="auto", max_iter=50, random_state=0).fit(xr, sample_weight=wr)
            out.append(weighted_sse(x[r : r + 1], w[r : r + 1], torch.from_numpy(fit.cluster_centers_.T)))
    return torch.cat(out)


def assert_nearest(x: torch.Tensor, centroids: torch.Tensor, codes: torch.Tensor) -> None:
    """Every code is a nearest centroid (exact distances in float64)."""
    d = (x.double()[:, :, None] - centroids.double()[:, None, :]).abs()
    assert torch.equal(d.gather(2, codes[:, :, None]).squeeze(2), d.min(2).values)


def heavy_tailed_rows(rows: int, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    normal = torch.randn(rows, n, generator=g)
    chi2 = (torch.randn(rows, n, 3, generator=g) ** 2).sum(-1)
    x = 0.02 * normal / (chi2 / 3).sqrt()  # Student-t, 3 degrees of freedom
    w = torch.randn(rows, n, generator=g) ** 2  # Fisher-like: squared gradients
    return x, w


# ------------------------------------------------------------------------------------------------------
# Quality bar: weighted SSE ratio ours / sklearn, mean <= 1.02 and max <= 1.10, bits 3 and 4.


@pytest.mark.parametrize("bits", [3, 4])
@pytest.mark.parametrize("weighting", ["squared-noise", "abs-weight"])
def test_quality_matches_sklearn_on_a_real_layer(stories_tensors, bits: int, weighting: str) -> None:
    x = stories_tensors["model.layers.0.mlp.down_proj.weight"].float()[:64]  # (64, 172)
    g = torch.Generator().manual_seed(bits)
    if weighting == "squared-noise":
        w = torch.randn(x.shape, generator=g) ** 2
    else:
        w = x.abs() * torch.rand(x.shape, generator=g)
    centroids, codes = weighted_kmeans_1d(x, w, 2**bits)
    ratio = weighted_sse(x, w, centroids) / sklearn_sse(x, w, 2**bits)
    assert ratio.mean() <= 1.02, ratio
    assert ratio.max() <= 1.10, ratio
    assert_nearest(x, centroids, codes)


@pytest.mark.parametrize("bits", [3, 4])
def test_quality_matches_sklearn_on_heavy_tailed_rows(bits: int) -> None:
    x, w = heavy_tailed_rows(64, 576, seed=bits)
    centroids, codes = weighted_kmeans_1d(x, w, 2**bits)
    ratio = weighted_sse(x, w, centroids) / sklearn_sse(x, w, 2**bits)
    assert ratio.mean() <= 1.02, ratio
    assert ratio.max() <= 1.10, ratio
    assert_nearest(x, centroids, codes)


# ------------------------------------------------------------------------------------------------------
# Contract


@pytest.mark.parametrize("k", [1, 2, 3, 4, 8, 16, 32, 256])
@pytest.mark.parametrize("n", [1, 7, 33, 172, 700])
def test_shapes_order_and_exact_nearest_codes(k: int, n: int) -> None:
    g = torch.Generator().manual_seed(k * 1000 + n)
    x = torch.randn(3, n, generator=g) * torch.tensor([[1.0], [1e-3], [50.0]])
    w = torch.rand(3, n, generator=g)
    centroids, codes = weighted_kmeans_1d(x, w, k)
    assert centroids.shape == (3, k) and centroids.dtype == torch.float32
    assert codes.shape == (3, n) and codes.dtype == torch.int64
    assert torch.isfinite(centroids).all()
    assert (centroids[:, 1:] >= centroids[:, :-1]).all()
    assert_nearest(x, centroids, codes)
    assert torch.equal(codes, nearest_codes(x, centroids))


def test_more_centroids_never_hurt() -> None:
    x, w = heavy_tailed_rows(16, 576, seed=7)
    errors = [weighted_sse(x, w, weighted_kmeans_1d(x, w, 2**b)[0]) for b in (2, 3, 4, 8)]
    for coarse, fine in zip(errors, errors[1:], strict=False):
        assert bool((fine <= coarse * (1 + 1e-9)).all())


def test_deterministic_and_seed_independent() -> None:
    x, w = heavy_tailed_rows(8, 300, seed=1)
    a = weighted_kmeans_1d(x, w, 16, seed=0)
    b = weighted_kmeans_1d(x, w, 16, seed=0)
    c = weighted_kmeans_1d(x, w, 16, seed=123)  # documented: no random initialisation
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])


def test_result_does_not_depend_on_chunking(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = heavy_tailed_rows(40, 400, seed=2)
    whole = weighted_kmeans_1d(x, w, 8)
    monkeypatch.setattr(km, "_CHUNK_ELEMENTS", 1000)  # a few rows per chunk
    chunked = weighted_kmeans_1d(x, w, 8)
    assert torch.equal(whole[0], chunked[0]) and torch.equal(whole[1], chunked[1])


def test_zero_weight_points_do_not_move_centroids() -> None:
    x, w = heavy_tailed_rows(16, 576, seed=3)
    base, _ = weighted_kmeans_1d(x, w, 16)
    # far-away points with zero weight (as the sparse outliers are in nuq)
    g = torch.Generator().manual_seed(0)
    far = torch.randn(16, 30, generator=g) * 50
    x2 = torch.cat([x, far], 1)
    w2 = torch.cat([w, torch.zeros(16, 30)], 1)
    centroids, codes = weighted_kmeans_1d(x2, w2, 16)
    # no centroid is pulled out of the weighted points' range ...
    assert (centroids >= x.min(1, keepdim=True).values).all()
    assert (centroids <= x.max(1, keepdim=True).values).all()
    # ... the fit of the weighted points is as good as without them ...
    ratio = weighted_sse(x, w, centroids) / weighted_sse(x, w, base)
    assert float(ratio.max()) <= 1.02 and float(ratio.min()) >= 0.98
    # ... and the zero-weight points still get their nearest code
    assert_nearest(x2, centroids, codes)


def test_zero_weight_values_are_irrelevant() -> None:
    """Where zero-weight points sit does not matter: moving them leaves the fit unchanged."""
    x, w = heavy_tailed_rows(6, 200, seed=4)
    w[:, :40] = 0
    a = x.clone()
    a[:, :40] = 3.0
    b = x.clone()
    b[:, :40] = -3.0
    ca, _ = weighted_kmeans_1d(a, w, 8)
    cb, _ = weighted_kmeans_1d(b, w, 8)
    assert torch.allclose(ca, cb, rtol=0, atol=1e-6)


def test_constant_row() -> None:
    x = torch.full((2, 50), 0.25)
    centroids, codes = weighted_kmeans_1d(x, torch.rand(2, 50), 8)
    assert torch.equal(centroids, torch.full((2, 8), 0.25))
    assert (codes == 0).all()


def test_fewer_distinct_values_than_k() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 3, (4, 100), generator=g).float() - 1.0  # values -1, 0, 1
    w = torch.rand(4, 100, generator=g)
    centroids, codes = weighted_kmeans_1d(x, w, 16)
    assert torch.isfinite(centroids).all()
    assert float(weighted_sse(x, w, centroids).max()) == 0.0
    assert torch.equal(centroids.gather(1, codes), x)


def test_fewer_points_than_k_is_exact() -> None:
    x = torch.tensor([[0.5, -1.0, 2.0]])
    centroids, codes = weighted_kmeans_1d(x, torch.ones(1, 3), 8)
    assert torch.equal(centroids.gather(1, codes), x)


def test_all_zero_or_non_finite_weights_fall_back_to_uniform() -> None:
    x, w = heavy_tailed_rows(4, 300, seed=6)
    uniform, _ = weighted_kmeans_1d(x, torch.ones_like(w), 8)
    w_bad = w.clone()
    w_bad[0] = 0
    w_bad[1, 3] = float("nan")
    w_bad[2, 5] = float("inf")
    centroids, _ = weighted_kmeans_1d(x, w_bad, 8)
    assert torch.equal(centroids[:3], uniform[:3])
    assert torch.equal(centroids[3], weighted_kmeans_1d(x[3:], w[3:], 8)[0][0])


def test_k_equal_one_is_the_weighted_mean() -> None:
    x = torch.tensor([[1.0, 2.0, 4.0]])
    w = torch.tensor([[1.0, 1.0, 2.0]])
    centroids, codes = weighted_kmeans_1d(x, w, 1)
    assert centroids.item() == pytest.approx(2.75)
    assert (codes == 0).all()


def test_empty_inputs() -> None:
    c, codes = weighted_kmeans_1d(torch.zeros(0, 5), torch.zeros(0, 5), 4)
    assert c.shape == (0, 4) and codes.shape == (0, 5)
    c, codes = weighted_kmeans_1d(torch.zeros(3, 0), torch.zeros(3, 0), 4)
    assert c.shape == (3, 4) and codes.shape == (3, 0)


def test_centroid_dtype_rounds_before_assigning_codes() -> None:
    x, w = heavy_tailed_rows(8, 576, seed=8)
    centroids, codes = weighted_kmeans_1d(x, w, 16, centroid_dtype=torch.float16)
    assert torch.equal(centroids, centroids.half().float())  # representable in float16
    assert_nearest(x, centroids, codes)


def test_misuse_is_a_value_error_and_unclusterable_weights_a_model_error() -> None:
    x = torch.randn(2, 10)
    with pytest.raises(ValueError, match="nonnegative"):
        weighted_kmeans_1d(x, -torch.ones(2, 10), 4)
    for bad in (float("nan"), float("inf"), -float("inf")):
        values = torch.randn(3, 20)
        values[1, 7] = bad
        with pytest.raises(ModelError, match="NaN or infinite"):
            weighted_kmeans_1d(values, torch.ones(3, 20), 4)
    with pytest.raises(ValueError, match="same shape"):
        weighted_kmeans_1d(x, torch.ones(2, 9), 4)
    with pytest.raises(ValueError, match="positive integer"):
        weighted_kmeans_1d(x, torch.ones(2, 10), 0)
    with pytest.raises(ValueError, match="floating point"):
        weighted_kmeans_1d(x.long(), torch.ones(2, 10), 4)
    with pytest.raises(ModelError, match="float16 range"):
        weighted_kmeans_1d(torch.tensor([[1e6, 0.0]]), torch.ones(1, 2), 2, centroid_dtype=torch.float16)
    bad = torch.ones(2, 10)
    bad[0, 0] = float("nan")
    bad[1, 1] = -1.0
    with pytest.raises(ValueError, match="nonnegative"):
        weighted_kmeans_1d(x, bad, 4)
    with pytest.raises(TypeError, match="torch tensors"):
        weighted_kmeans_1d(x.numpy(), torch.ones(2, 10), 4)  # type: ignore[arg-type]


def test_quant_package_never_imports_sklearn() -> None:
    """sklearn is a reference in tests only (the layering inside squeeze is tests/test_import_layers.py)."""
    for path in QUANT_DIR.rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert not name.startswith("sklearn"), f"{path.name} imports {name}"


def test_numpy_sort_helper_matches_torch() -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(5, 300, generator=g)
    x[0, :10] = 0.0
    x[0, 10:20] = -0.0
    x[1] = 1.0  # all ties
    x[2, ::3] = torch.finfo(torch.float32).tiny / 8  # float32 subnormals
    values, order = sort_rows(x)
    assert torch.equal(values, torch.sort(x, dim=1).values.double())
    assert torch.equal(x.gather(1, order).double(), values)
    assert torch.equal(torch.sort(order, dim=1).values, torch.arange(300).expand(5, 300))
    assert np.all(np.diff(values.numpy(), axis=1) >= 0)
