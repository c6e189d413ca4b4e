"""The Voronoi loss's infimum over a gate's translations: exact in the weights' scale, bracketed in
the shift of β₁, against literal minimisations over breakpoints and fine grids."""

from __future__ import annotations

import pytest
import torch

from moelab.stats.measures import voronoi_d
from moelab.stats.translation import scale_inf, translation_inf

D = torch.float64
RBAR = {1: 1.0, 2: 4.0, 3: 6.0}  # r̄(m) of Ho (2025); 2m past the table, as the studies use it


def _literal_scale_inf(W, w_true, C):
    """min over u ≥ 0 of Σ_j |u·W_j − w*_j| + u·C at u = 0 and every breakpoint u = w*_j / W_j."""
    cands = [0.0] + [wt / m for m, wt in zip(W, w_true) if m > 0]
    return min(sum(abs(u * m - wt) for m, wt in zip(W, w_true)) + u * C for u in cands)


def test_the_minimum_over_the_weights_scale_is_the_best_breakpoint_and_no_grid_point_is_below_it():
    gen = torch.Generator().manual_seed(0)
    W = torch.rand(50, 3, generator=gen, dtype=D) * 3
    W[::5, 1] = 0  # a true atom no fitted atom is assigned to
    w_true, C = torch.rand(50, 3, generator=gen, dtype=D) * 2, torch.rand(50, generator=gen, dtype=D) * 4
    got = scale_inf(W, w_true, C)
    for r in range(50):
        want = _literal_scale_inf(W[r].tolist(), w_true[r].tolist(), C[r].item())
        assert got[r].item() == pytest.approx(want, rel=1e-14, abs=1e-14)
    u = torch.linspace(0, 20, 20_001, dtype=D)
    grid = ((u[:, None, None] * W - w_true).abs().sum(-1) + u[:, None] * C).amin(0)
    assert (grid >= got - 1e-12).all() and (grid <= got + 1e-2).all()


def _problem(seed, R, k, k_true, d, spread, rbar=False):
    """A softmax-gated fit near the truth, with the blocks of D₁ (exponents 1 | 2) or D₂ (r̄)."""
    gen = torch.Generator().manual_seed(seed)
    b0t, b1t = (
        torch.randn(R, k_true, generator=gen, dtype=D),
        torch.randn(R, k_true, d, generator=gen, dtype=D),
    )
    eta_t = torch.randn(R, k_true, 2, generator=gen, dtype=D)
    idx = [i % k_true for i in range(k)]
    b0 = b0t[:, idx] + spread * torch.randn(R, k, generator=gen, dtype=D)
    b1 = b1t[:, idx] + spread * torch.randn(R, 1, d, generator=gen, dtype=D)
    b1 = b1 + 0.3 * spread * torch.randn(R, k, d, generator=gen, dtype=D)
    eta = eta_t[:, idx] + 0.3 * spread * torch.randn(R, k, 2, generator=gen, dtype=D)
    if rbar:
        ex = [(1.0, lambda m: RBAR.get(m, 2.0 * m)), (1.0, lambda m: RBAR.get(m, 2.0 * m) / 2)]
    else:
        ex = [(1.0, lambda m: 2.0)] * 2
    return b0, b0t, [(b1, b1t, *ex[0]), (eta, eta_t, *ex[1])]


def _grid_min(b0, b0t, blocks, r, d, levels=((4.0, 201), (0.05, 201), (1e-3, 201))):
    """The smallest loss over a t₂ grid refined around its best point, t₁ exact at each point."""
    (b1, b1t, *e1), (eta, eta_t, *e2) = blocks
    centre, best = torch.zeros(d, dtype=D), float("inf")
    for half, n in levels:
        axis = torch.linspace(-half, half, n, dtype=D)
        t2 = torch.stack(torch.meshgrid(*[axis] * d, indexing="ij"), -1).reshape(-1, d) + centre
        rows = torch.full((t2.shape[0],), r)
        shifted = [(b1[rows] - t2[:, None], b1t[rows], *e1), (eta[rows], eta_t[rows], *e2)]
        values = translation_inf(b0[rows], b0t[rows], shifted, shift=None).value
        i = int(values.argmin())
        centre, best = t2[i], min(best, values[i].item())
    return best


@pytest.mark.parametrize("d,rbar", [(1, False), (2, False), (2, True)])
def test_the_bracket_holds_the_best_of_a_fine_shift_grid_and_is_narrower_than_1e_9(d, rbar):
    b0, b0t, blocks = _problem(5 + d, 4, 3, 2, d, 1.0, rbar)
    got = translation_inf(b0, b0t, blocks)
    assert (got.gap >= 0).all() and (got.gap <= 1e-9).all()
    for r in range(4):
        grid = _grid_min(b0, b0t, blocks, r, d)
        # every grid value is reached, so the certified lower bound is below it; the grid's last
        # step is 1e-5, so it cannot be much above the infimum either
        assert got.lower[r].item() <= grid + 1e-12
        assert got.value[r].item() <= grid + 1e-6


def test_the_infimum_is_zero_for_a_shifted_truth_and_never_above_the_unshifted_loss():
    gen = torch.Generator().manual_seed(3)
    b0t, b1t = torch.randn(3, 2, generator=gen, dtype=D), torch.randn(3, 2, 2, generator=gen, dtype=D)
    eta_t = torch.randn(3, 2, 3, generator=gen, dtype=D)
    t1, t2 = torch.tensor([0.7, -0.3, 1.2], dtype=D), torch.randn(3, 2, generator=gen, dtype=D)
    two = lambda m: 2.0
    exact = translation_inf(
        b0t + t1[:, None], b0t, [(b1t + t2[:, None], b1t, 1.0, two), (eta_t, eta_t, 1.0, two)]
    )
    assert exact.value.abs().max() < 1e-12 and exact.lower.abs().max() < 1e-12
    eta = eta_t + 0.1 * torch.randn(3, 2, 3, generator=gen, dtype=D)
    b0 = b0t + t1[:, None] + 0.05 * torch.randn(3, 2, generator=gen, dtype=D)
    blocks = [(b1t + t2[:, None], b1t, 1.0, two), (eta, eta_t, 1.0, two)]
    plain = voronoi_d(b0.exp(), blocks, b0t.exp())
    got = translation_inf(b0, b0t, blocks)
    assert (got.value < plain).all() and (got.lower <= got.value).all()


def test_over_a_beta0_shift_alone_the_infimum_is_exact_at_the_breakpoints():
    gen = torch.Generator().manual_seed(4)
    R, k, k_true = 5, 4, 3
    b0t = torch.randn(R, k_true, generator=gen, dtype=D)
    eta_t = 2 * torch.randn(R, k_true, 2, generator=gen, dtype=D)
    eta = eta_t[:, [0, 1, 2, 2]] + 0.3 * torch.randn(R, k, 2, generator=gen, dtype=D)
    b0 = 2 * torch.randn(R, k, generator=gen, dtype=D)  # far from the truth: random fits
    got = translation_inf(b0, b0t, [(eta, eta_t, 1.0, lambda m: 2.0)], shift=None)
    assert torch.equal(got.value, got.lower)
    cells = torch.cdist(eta, eta_t).argmin(-1)
    for r in range(R):
        c = cells[r].tolist()
        size = [c.count(c[i]) for i in range(k)]
        w = b0[r].exp().tolist()
        cost = [float((eta[r, i] - eta_t[r, c[i]]).norm()) ** (1 if size[i] == 1 else 2) for i in range(k)]
        W = [sum(w[i] for i in range(k) if c[i] == j) for j in range(k_true)]
        want = _literal_scale_inf(W, b0t[r].exp().tolist(), sum(wi * ci for wi, ci in zip(w, cost)))
        assert got.value[r].item() == pytest.approx(want, abs=1e-12, rel=1e-12)


def test_a_bracket_cut_short_is_wider_but_still_holds_the_infimum():
    b0, b0t, blocks = _problem(11, 6, 4, 3, 2, 1.5, rbar=True)
    full = translation_inf(b0, b0t, blocks)
    assert (full.gap <= 1e-9).all()
    short = translation_inf(b0, b0t, blocks, max_steps=3)
    assert (short.lower <= full.value + 1e-12).all() and (short.value >= full.lower - 1e-12).all()
    assert (short.gap > 1e-6).any()


def test_a_shift_of_a_block_that_is_not_there_or_costs_nothing_is_refused():
    b0, b0t, blocks = _problem(0, 2, 3, 2, 2, 0.5)
    for shift in (2, -1):
        with pytest.raises(
            ValueError, match=rf"^shift={shift} is not allowed; expected None or the index of a block"
        ):
            translation_inf(b0, b0t, blocks, shift=shift)
    free = [(blocks[0][0], blocks[0][1], None, None), blocks[1]]
    with pytest.raises(
        ValueError, match=r"^shift=0 is not allowed; expected None or the index of a block with a cost"
    ):
        translation_inf(b0, b0t, free, shift=0)


def test_assignments_that_cannot_fit_in_memory_are_refused_before_allocating():
    b0, b0t, blocks = _problem(0, 2, 16, 4, 2, 0.5)  # 4^16 assignments a replicate
    with pytest.raises(
        ValueError,
        match=r"^beta0 of shape \(2, 16\) is not allowed with k\*=4 true atoms: its 4\^16 assignments over 2 "
        r"replicates need about \d+\.\d GiB; expected at most 4 GiB",
    ):
        translation_inf(b0, b0t, blocks)


@pytest.mark.parametrize(
    "option,value,allowed",
    [("tol", 0.0, "a number > 0"), ("tol", -1e-9, "a number > 0"), ("max_steps", 0, "a positive integer")],
)
def test_a_tolerance_or_step_budget_that_cannot_stop_is_refused(option, value, allowed):
    b0, b0t, blocks = _problem(0, 2, 3, 2, 2, 0.5)
    with pytest.raises(ValueError, match=rf"^{option}={value!r} is not allowed; expected {allowed}"):
        translation_inf(b0, b0t, blocks, **{option: value})


def test_float32_fits_are_bracketed_in_float64():
    b0, b0t, blocks = _problem(2, 3, 3, 2, 2, 1.0)
    want = translation_inf(b0, b0t, blocks)
    single = [(f.float(), t.float(), *e) for f, t, *e in blocks]
    got = translation_inf(b0.float(), b0t.float(), single)
    assert got.value.dtype == got.lower.dtype == torch.float64
    # the float32 inputs are the float64 ones rounded: the same problem to float32's precision
    assert torch.allclose(got.value, want.value, rtol=1e-5) and (got.gap <= 1e-9).all()
