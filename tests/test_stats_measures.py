"""Errors and losses of moelab.stats.measures against direct computations."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from moelab.stats.measures import (
    density_distances,
    k_subset_voronoi,
    l2_distance,
    mixture_tv,
    rbar,
    voronoi_d,
)

D = torch.float64


def test_l2_distance_is_the_root_mean_square_difference_with_its_delta_method_error():
    gen = torch.Generator().manual_seed(0)
    f, g = torch.randn(3, 50, generator=gen, dtype=D), torch.randn(3, 50, generator=gen, dtype=D)
    e = l2_distance(f, g)
    for r in range(3):
        sq = [(a - b) ** 2 for a, b in zip(f[r].tolist(), g[r].tolist())]
        mean = sum(sq) / 50
        sd = math.sqrt(sum((s - mean) ** 2 for s in sq) / 49)
        assert e.value[r].item() == pytest.approx(math.sqrt(mean), rel=1e-12)
        assert e.se[r].item() == pytest.approx(sd / math.sqrt(50) / (2 * math.sqrt(mean)), rel=1e-10)


def _one(mu: float, var: float, shape=(2, 7, 1)):
    """A single normal N(mu, var) at every one of R × m inputs, as (w, mu, var) (R, m, 1)."""
    return tuple(torch.full(shape, v, dtype=D) for v in (1.0, mu, var))


@pytest.mark.parametrize("mu2,var2", [(0.3, 0.5), (1.0, 0.5), (0.2, 1.3)])
def test_hellinger_and_total_variation_match_the_closed_forms_for_two_normals(mu2, var2):
    mu1, var1 = 0.0, 0.5
    dist = density_distances(_one(mu2, var2), _one(mu1, var1), nodes=80)
    s1, s2 = math.sqrt(var1), math.sqrt(var2)
    h2 = 1 - math.sqrt(2 * s1 * s2 / (var1 + var2)) * math.exp(-((mu1 - mu2) ** 2) / (4 * (var1 + var2)))
    torch.testing.assert_close(
        dist["hellinger"].value, torch.full((2,), math.sqrt(h2), dtype=D), rtol=1e-9, atol=1e-9
    )
    assert (dist["hellinger"].se == 0).all()  # the same density at every input: no Monte Carlo error
    if var1 == var2:
        tv = math.erf(abs(mu2 - mu1) / (2 * s1) / math.sqrt(2))  # V = 2Φ(|Δμ|/(2σ)) − 1
    else:  # two crossings y± of the densities; V = |Φ₁ − Φ₂| summed over the three intervals
        a = 1 / var1 - 1 / var2
        b = mu2 / var2 - mu1 / var1
        cc = mu1**2 / var1 - mu2**2 / var2 + math.log(var1 / var2)
        disc = math.sqrt(b * b - a * cc)
        ys = sorted([(-b - disc) / a, (-b + disc) / a])
        cdf = lambda y, m, v: 0.5 * math.erfc(-(y - m) / math.sqrt(2 * v))
        d = [cdf(y, mu1, var1) - cdf(y, mu2, var2) for y in ys]
        tv = 0.5 * (abs(d[0]) + abs(d[1] - d[0]) + abs(d[1]))
    torch.testing.assert_close(dist["tv"].value, torch.full((2,), tv, dtype=D), rtol=1e-10, atol=1e-12)


def _random_mixture(gen, R, m, c, spread=1.5):
    w = torch.rand(R, m, c, generator=gen, dtype=D) + 0.05
    mu = spread * torch.randn(R, m, c, generator=gen, dtype=D)
    var = 0.01 + 0.5 * torch.rand(R, m, c, generator=gen, dtype=D)
    return w / w.sum(-1, keepdim=True), mu, var


def _quad_tv(hat, true, r, i):
    """½∫|p̂ − p*| by scipy's adaptive quadrature (independent of moelab's crossings)."""
    from scipy import integrate
    from scipy.stats import norm

    def pdf(y, mix):
        w, mu, var = (t[r, i].numpy() for t in mix)
        return float((w * norm.pdf(y, mu, np.sqrt(var))).sum())

    mus = np.concatenate([hat[1][r, i].numpy(), true[1][r, i].numpy()])
    sds = np.sqrt(np.concatenate([hat[2][r, i].numpy(), true[2][r, i].numpy()]))
    lo, hi = mus.min() - 12, mus.max() + 12
    points = sorted({float(m + j * s) for m, s in zip(mus, sds) for j in range(-4, 5)})  # each bump's scale
    value, _ = integrate.quad(lambda y: abs(pdf(y, hat) - pdf(y, true)), lo, hi,
                              points=points, limit=2000, epsabs=1e-12, epsrel=1e-12)  # fmt: skip
    return 0.5 * value


@pytest.mark.slow
def test_total_variation_between_gaussian_mixtures_is_within_1e_6_of_scipy_quadrature():
    gen = torch.Generator().manual_seed(7)
    true = _random_mixture(gen, 2, 3, 3)
    # near the truth (a fitted density) and far from it (a random one), with different c
    near = tuple(torch.cat([t, t[..., 2:]], -1) for t in true)  # the third atom split in two
    near = (near[0] * torch.tensor([1.0, 1.0, 0.6, 0.4], dtype=D), near[1] + 0.05 * torch.randn(2, 3, 4, generator=gen, dtype=D),
            near[2] * (1 + 0.1 * torch.rand(2, 3, 4, generator=gen, dtype=D)))  # fmt: skip
    far = _random_mixture(gen, 2, 3, 2)
    for hat in (near, far):
        got = mixture_tv(hat, true)
        for r in range(2):
            for i in range(3):
                assert got[r, i].item() == pytest.approx(_quad_tv(hat, true, r, i), abs=1e-6)


def test_density_distances_are_zero_between_a_density_and_itself():
    mix = tuple(
        torch.tensor(v, dtype=D).expand(1, 5, 2) for v in ([[[0.3, 0.7]]], [[[-1.0, 2.0]]], [[[0.1, 0.4]]])
    )
    dist = density_distances(mix, mix)
    assert dist["hellinger"].value.abs().max() < 1e-7 and dist["tv"].value.abs().max() < 1e-12


def _direct_voronoi(w, blocks, w_true, mass=True):
    """Ho (2025)'s loss by loops: cells on the concatenated blocks, per-block exponents."""
    fitted = torch.cat([b[0] if b[0].dim() == 3 else b[0].unsqueeze(-1) for b in blocks], -1)[0]
    true = torch.cat([b[1] if b[1].dim() == 3 else b[1].unsqueeze(-1) for b in blocks], -1)[0]
    k, k_true = fitted.shape[0], true.shape[0]
    cell = [min(range(k_true), key=lambda j: (float((fitted[i] - true[j]).norm()), j)) for i in range(k)]
    total = 0.0
    for j in range(k_true):
        members = [i for i in range(k) if cell[i] == j]
        if mass:
            total += abs(sum(float(w[0, i]) for i in members) - float(w_true[0, j]))
        for i in members:
            for f, t, e1, em in blocks:
                if e1 is None:
                    continue
                fi = f[0, i] if f.dim() == 3 else f[0, i : i + 1]
                tj = t[0, j] if t.dim() == 3 else t[0, j : j + 1]
                e = e1 if len(members) == 1 else em(len(members))
                total += float(w[0, i]) * float((fi - tj).norm()) ** e
    return total


def test_voronoi_d_with_per_block_exponents_matches_a_direct_computation():
    gen = torch.Generator().manual_seed(1)
    true_a = torch.tensor([[[0.0, 0.0], [3.0, 3.0]]], dtype=D)
    a = torch.cat([true_a[:, :1] + 0.1 * torch.randn(1, 2, 2, generator=gen, dtype=D),
                   true_a[:, 1:] + 0.1 * torch.randn(1, 1, 2, generator=gen, dtype=D)], 1)  # fmt: skip
    true_b, b = torch.tensor([[0.5, -0.5]], dtype=D), torch.tensor([[0.45, 0.6, -0.4]], dtype=D)
    w, w_true = torch.tensor([[0.4, 0.5, 1.1]], dtype=D), torch.tensor([[1.0, 1.0]], dtype=D)
    blocks = [(a, true_a, 1.0, lambda m: 4.0), (b, true_b, 1.0, lambda m: 2.0), (b, true_b, None, None)]
    got = voronoi_d(w, blocks, w_true)
    assert got.item() == pytest.approx(_direct_voronoi(w, blocks, w_true), rel=1e-12)
    no_mass = voronoi_d(w, blocks, w_true, mass_term=False)
    assert no_mass.item() == pytest.approx(_direct_voronoi(w, blocks, w_true, mass=False), rel=1e-12)


def test_the_k_subset_voronoi_loss_is_the_maximum_over_every_k_subset():
    gen = torch.Generator().manual_seed(2)
    true_w, true_s = (
        torch.randn(2, 4, 3, generator=gen, dtype=D) * 3,
        torch.rand(2, 4, generator=gen, dtype=D),
    )
    w = true_w + 0.2 * torch.randn(2, 4, 3, generator=gen, dtype=D)
    s = true_s + 0.1 * torch.randn(2, 4, generator=gen, dtype=D)
    for K in (1, 2, 3):
        got = k_subset_voronoi([(w, true_w), (s, true_s)], K)
        for r in range(2):
            theta, theta_true = (
                torch.cat([w[r], s[r, :, None]], -1),
                torch.cat([true_w[r], true_s[r, :, None]], -1),
            )
            cell = torch.cdist(theta, theta_true).argmin(-1).tolist()
            cost = [
                float((w[r, i] - true_w[r, cell[i]]).norm() + (s[r, i] - true_s[r, cell[i]]).abs())
                for i in range(4)
            ]
            best = max(
                sum(c for i, c in enumerate(cost) if cell[i] in sub)
                for sub in itertools.combinations(range(4), K)
            )
            assert got[r].item() == pytest.approx(best, rel=1e-12)
    with pytest.raises(ValueError, match=r"top_k=5 is not allowed; expected at most k\*=4"):
        k_subset_voronoi([(w, true_w)], 5)


def test_rbar_of_a_singleton_cell_is_one():
    assert rbar(1) == 1  # p₅²p₁ = 0 and p₅²p₃ = 0 already force the trivial solution


@pytest.mark.slow
def test_rbar_of_a_two_atom_cell_is_four_as_tabulated():
    assert rbar(2, max_r=5, starts=128) == 4  # Ho (2025)'s slides; Ho and Nguyen's r̄(2) = 4
