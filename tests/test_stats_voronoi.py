"""Voronoi losses: zero at the truth, permutation invariance, hand-computed split-atom cases."""

from __future__ import annotations

import math

import pytest
import torch

from moelab.stats import block_voronoi_loss, gaussian_voronoi_loss, voronoi_loss

T = torch.float64


def _t(v):
    return torch.tensor(v, dtype=T)


# truth: two atoms in (β₁, η) = (0, 0) and (10, 10), unit weights
B0_TRUE, B1_TRUE, ETA_TRUE = _t([0.0, 0.0]), _t([[0.0], [10.0]]), _t([[0.0], [10.0]])


def test_zero_at_the_truth():
    torch.manual_seed(0)
    b0, b1, eta = torch.randn(3, dtype=T), torch.randn(3, 4, dtype=T), torch.randn(3, 6, dtype=T)
    assert voronoi_loss(b0, b1, eta, b0, b1, eta).item() == 0.0


def test_zero_for_an_exactly_split_atom():
    # atom 1 split into two copies carrying half its weight each: same mixing measure
    b0 = _t([math.log(0.5), math.log(0.5), 0.0])
    b1, eta = _t([[0.0], [0.0], [10.0]]), _t([[0.0], [0.0], [10.0]])
    assert voronoi_loss(b0, b1, eta, B0_TRUE, B1_TRUE, ETA_TRUE).item() == pytest.approx(0.0, abs=1e-12)


def test_hand_computed_split_atom_case():
    # cell 1 holds atoms 1, 2 (weights 0.5, 0.25; Δβ₁ = ±2, Δη = 0): squared terms 0.5·4 + 0.25·4 = 3
    # cell 2 holds atom 3 (weight 2; Δβ₁ = 0, Δη = 2): linear terms 2·(0 + 2) = 4
    # masses: |0.75 − 1| + |2 − 1| = 1.25                                        total 8.25
    b0 = _t([math.log(0.5), math.log(0.25), math.log(2.0)])
    b1, eta = _t([[2.0], [-2.0], [10.0]]), _t([[0.0], [0.0], [12.0]])
    got = voronoi_loss(b0, b1, eta, B0_TRUE, B1_TRUE, ETA_TRUE)
    assert got.item() == pytest.approx(8.25)
    # exponent-r variant (Ho (2025)): r(|A_j| = 2) = 4 -> 0.5·16 + 0.25·16 = 12 in cell 1
    got_r = voronoi_loss(b0, b1, eta, B0_TRUE, B1_TRUE, ETA_TRUE, r_multi=lambda size: 2.0 * size)
    assert got_r.item() == pytest.approx(12 + 4 + 1.25)


def test_empty_cell_pays_its_whole_mass():
    # both fitted atoms sit at true atom 1: cell 2 is empty -> mass term |0 − e^{β*₀₂}| = e^{0.5}
    b0 = _t([math.log(0.5), math.log(0.5)])
    b1, eta = _t([[1.0], [0.0]]), _t([[0.0], [0.0]])
    b0_true = _t([0.0, 0.5])
    expected = 0.5 * 1.0 + 0.0 + abs(1.0 - 1.0) + math.exp(0.5)
    assert voronoi_loss(b0, b1, eta, b0_true, B1_TRUE, ETA_TRUE).item() == pytest.approx(expected)


def test_invariant_to_permuting_atoms():
    torch.manual_seed(1)
    b0, b1, eta = torch.randn(5, dtype=T), torch.randn(5, 3, dtype=T), torch.randn(5, 4, dtype=T)
    tb0, tb1, teta = torch.randn(3, dtype=T), torch.randn(3, 3, dtype=T), torch.randn(3, 4, dtype=T)
    base = voronoi_loss(b0, b1, eta, tb0, tb1, teta)
    p, q = torch.randperm(5), torch.randperm(3)
    torch.testing.assert_close(voronoi_loss(b0[p], b1[p], eta[p], tb0, tb1, teta), base)
    torch.testing.assert_close(voronoi_loss(b0, b1, eta, tb0[q], tb1[q], teta[q]), base)


def test_batched_equals_loop_over_replicates():
    torch.manual_seed(2)
    R = 4
    args = (torch.randn(R, 3, dtype=T), torch.randn(R, 3, 2, dtype=T), torch.randn(R, 3, 3, dtype=T))
    truth = (torch.randn(R, 2, dtype=T), torch.randn(R, 2, 2, dtype=T), torch.randn(R, 2, 3, dtype=T))
    batched = voronoi_loss(*args, *truth)
    assert batched.shape == (R,)
    loop = torch.stack([voronoi_loss(*(a[r] for a in args), *(t[r] for t in truth)) for r in range(R)])
    torch.testing.assert_close(batched, loop)


def test_gaussian_voronoi_loss_hand_computed():
    # CompeteSMoE (2025) App. J eq. (14), unit weights (competition gating): atoms 1, 2 split true atom 1
    a_true, b_true, nu_true = _t([[0.0, 0.0], [5.0, 5.0]]), _t([0.0, 5.0]), _t([1.0, 1.0])
    a, b, nu = _t([[3.0, 4.0], [0.0, 0.0], [5.0, 5.0]]), _t([0.0, 1.0, 5.0]), _t([1.0, 1.0, 1.5])
    # cell 1 (size 2): (25 + 0 + 0) + (0 + 1 + 0) = 26;  cell 2: 0 + 0 + 0.5;  masses |2 − 1| + |1 − 1| = 1
    assert gaussian_voronoi_loss(a, b, nu, a_true, b_true, nu_true).item() == pytest.approx(27.5)
    # expert-parameter error (exponent 1 everywhere, no mass term): 5 + 1 + 0.5
    got = gaussian_voronoi_loss(a, b, nu, a_true, b_true, nu_true, r_multi=1.0, mass_term=False)
    assert got.item() == pytest.approx(6.5)


def test_block_loss_rejects_mismatched_blocks():
    with pytest.raises(ValueError, match="blocks must hold"):
        block_voronoi_loss(None, [])
    with pytest.raises(ValueError, match="powers has 1 entries for 2 blocks"):
        block_voronoi_loss(None, [(_t([[0.0]]), _t([[0.0]])), (_t([[0.0]]), _t([[0.0]]))], powers=[1.0])
