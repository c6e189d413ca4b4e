"""Errors of a fitted MoE against the truth, beyond the Voronoi losses of :mod:`.voronoi`: the L²
distance between regression functions (the perturbed cosine router (2024) Thms. 1 and 3), the
expected Hellinger and total-variation distances between conditional densities of Gaussian MoE
(CompeteSMoE (2024) Thm. 4.1, CompeteSMoE (2025) Prop. 3.1, Ho (2025)), each a Monte Carlo mean
over inputs with its standard error; Voronoi losses with per-block exponents (Ho (2025)'s D₁/D₂),
the maximum over K-subsets (CompeteSMoE (2024) eq. (9)), and r̄(m), the order of Ho (2025)'s
polynomial system, computed; :mod:`.translation` takes the infimum over a gate's translations.
docs/stats-paper-studies.md gives the formulas (the list of errors under its table of studies).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from .._validate import positive_int
from .voronoi import voronoi_cells

__all__ = [
    "Block",
    "Estimate",
    "density_distances",
    "k_subset_voronoi",
    "l2_distance",
    "mixture_tv",
    "rbar",
    "voronoi_d",
]


@dataclass
class Estimate:
    """A Monte Carlo estimate per replicate: ``value (R,)`` and its standard error ``se (R,)``."""

    value: Tensor
    se: Tensor


def l2_distance(f_hat: Tensor, f_true: Tensor) -> Estimate:
    """``‖f̂ − f*‖_{L²(μ)} = (E_X (f̂(X) − f*(X))²)^{1/2}`` from the two functions evaluated at
    ``m`` inputs drawn from μ: ``(R, m)`` each.  The standard error is the delta method's,
    ``se(mean of squares) / (2·value)``."""
    sq = (f_hat - f_true) ** 2
    m = sq.shape[-1]
    mean = sq.mean(dim=-1)
    value = mean.sqrt()
    se_sq = sq.std(dim=-1) / math.sqrt(m) if m > 1 else torch.zeros_like(mean)
    return Estimate(value, se_sq / (2 * value.clamp_min(torch.finfo(value.dtype).tiny)))


def _gauss_hermite(nodes: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Nodes z and weights w with ``Σ w f(z) ≈ E f(Z)``, Z ~ N(0, 1)."""
    z, w = np.polynomial.hermite_e.hermegauss(nodes)
    return torch.as_tensor(z, dtype=dtype), torch.as_tensor(w / math.sqrt(2 * math.pi), dtype=dtype)


#: a Gaussian mixture in y at every input: weights, means, variances, each ``(..., c)``
Mixture1D = tuple[Tensor, Tensor, Tensor]


def _mixture_log_pdf(y: Tensor, mix: Mixture1D) -> Tensor:
    """``log p(y)`` at ``y (..., Q)`` of the mixture ``(w, mu, var) (..., c)``: ``(..., Q)``."""
    w, mu, var = (t.unsqueeze(-2) for t in mix)
    log_w = w.clamp_min(torch.finfo(w.dtype).tiny).log().masked_fill(w == 0, -math.inf)
    comp = -0.5 * ((y.unsqueeze(-1) - mu) ** 2 / var + var.log() + math.log(2 * math.pi))
    return (log_w + comp).logsumexp(dim=-1)


def _mixture_pdf_cdf(y: Tensor, mix: Mixture1D) -> tuple[Tensor, Tensor]:
    """Density and distribution function of the mixture at ``y (..., Q)``."""
    w, mu, var = (t.unsqueeze(-2) for t in mix)
    sd = var.sqrt()
    z = (y.unsqueeze(-1) - mu) / sd
    pdf = (w * torch.exp(-0.5 * z * z) / (sd * math.sqrt(2 * math.pi))).sum(-1)
    cdf = (w * 0.5 * torch.special.erfc(-z / math.sqrt(2))).sum(-1)
    return pdf, cdf


def mixture_tv(hat: Mixture1D, true: Mixture1D, *, grid: int = 41, width: float = 10.0) -> Tensor:
    """``V = ½∫|p̂ − p*| dy = ∫(p* − p̂)₊ dy`` between two Gaussian mixtures in y at every input,
    exactly up to the crossings' bisection (machine precision).

    The positive part lives between crossings of p* and p̂, and on ``[a, b]`` its integral is
    ``D(b) − D(a)`` with ``D = F* − F̂`` (the mixtures' distribution functions, closed form), so
    ``V = Σ ±D(c)`` over the crossings c.  Crossings are bracketed on a grid of ``grid`` points
    over ``μ ± width·σ`` of every component of both mixtures (so a narrow component gets as fine
    a grid as a wide one) and bisected to machine precision; beyond the grid both densities are
    below ``exp(−width²/2)``.  Quadrature of |p̂ − p*| itself converges slowly at its kinks.

    Args:
        hat, true: ``(w, mu, var)``, each ``(..., c)`` (the two may have different c).

    Returns:
        ``(...)`` distances.
    """
    positive_int("grid", grid)
    batch = hat[0].shape[:-1]
    flat_hat = tuple(t.reshape(-1, t.shape[-1]) for t in hat)
    flat_true = tuple(t.reshape(-1, t.shape[-1]) for t in true)
    n_rows, dtype = flat_hat[0].shape[0], flat_hat[0].dtype
    z = torch.linspace(-width, width, grid, dtype=dtype)
    c_all = flat_hat[0].shape[-1] + flat_true[0].shape[-1]
    chunk = max(1, 2_000_000 // (grid * c_all * c_all))  # rows per chunk: bounded memory
    out = []
    for lo in range(0, n_rows, chunk):
        h = tuple(t[lo : lo + chunk] for t in flat_hat)
        t = tuple(t[lo : lo + chunk] for t in flat_true)
        mu = torch.cat([h[1], t[1]], -1)
        sd = torch.cat([h[2], t[2]], -1).sqrt()
        y = (mu.unsqueeze(-1) + sd.unsqueeze(-1) * z).flatten(-2).sort(-1).values  # (rows, G)

        def gap(points: Tensor, h=h, t=t) -> Tensor:
            return _mixture_pdf_cdf(points, t)[0] - _mixture_pdf_cdf(points, h)[0]

        pos = gap(y) > 0
        change = pos[:, 1:] != pos[:, :-1]
        k_max = int(change.sum(-1).max())
        if k_max == 0:  # p* ≤ p̂ at every grid point or the reverse: both integrate to 1, V = 0
            out.append(torch.zeros(y.shape[0], dtype=dtype))
            continue
        idx = torch.argsort(change.to(torch.int8), dim=-1, descending=True, stable=True)[:, :k_max]
        valid = change.gather(-1, idx)
        a, b, pos_a = y.gather(-1, idx), y.gather(-1, idx + 1), pos.gather(-1, idx)
        for _ in range(200):  # bisection; stops when no bracket shrinks any more
            mid = 0.5 * (a + b)
            if not bool(((mid > a) & (mid < b) & valid).any()):
                break
            same = (gap(mid) > 0) == pos_a
            a, b = torch.where(same, mid, a), torch.where(same, b, mid)
        c = 0.5 * (a + b)
        d = _mixture_pdf_cdf(c, t)[1] - _mixture_pdf_cdf(c, h)[1]
        # a crossing where p* − p̂ turns negative ends a positive interval: +D(c); one where it
        # turns positive starts one: −D(c) (intervals reaching ±∞ add D(±∞) = 0)
        out.append((torch.where(pos_a, d, -d) * valid).sum(-1))
    return torch.cat(out).reshape(batch)


def density_distances(hat: Mixture1D, true: Mixture1D, *, nodes: int = 40) -> dict[str, Estimate]:
    """``E_X[h(p̂(·|X), p*(·|X))]`` and ``E_X[V(p̂(·|X), p*(·|X))]`` for conditional densities of y.

    ``h² = ½∫(√p̂ − √p*)² = 1 − ∫√(p̂ p*)`` (CompeteSMoE (2024) Thm. 4.1), ``V = ½∫|p̂ − p*|``
    (CompeteSMoE (2025) Prop. 3.1).  Both densities are Gaussian mixtures in y at every x,
    ``p(y|x) = Σ_j π_j(x) N(y | μ_j(x), v_j(x))``, given as ``(weights, means, variances)``
    ``(R, m, c)`` at ``m`` inputs.  ∫√(p̂ p*) is Gauss–Hermite quadrature (``nodes`` per true
    component) of the smooth ``√(p̂/p*)`` under each true component; V is exact
    (:func:`mixture_tv`); the mean over the ``m`` inputs is Monte Carlo, with its standard error.
    """
    positive_int("nodes", nodes)
    true_weights, true_means, true_vars = true
    z, w = _gauss_hermite(nodes, true_means.dtype)
    y = true_means.unsqueeze(-1) + true_vars.sqrt().unsqueeze(-1) * z  # (R, m, c, nodes)
    R, m, c, q = y.shape
    flat = y.reshape(R, m, c * q)
    ratio_log = (_mixture_log_pdf(flat, hat) - _mixture_log_pdf(flat, true)).reshape(R, m, c, q)
    weight = true_weights.unsqueeze(-1) * w  # (R, m, c, nodes)
    affinity = (weight * (0.5 * ratio_log).exp()).sum(dim=(-1, -2))  # ∫√(p̂ p*) per input
    h = (1 - affinity).clamp_min(0).sqrt()
    tv = mixture_tv(hat, true)
    out = {}
    for name, per_x in (("hellinger", h), ("tv", tv)):
        se = per_x.std(dim=-1) / math.sqrt(m) if m > 1 else torch.zeros_like(per_x[..., 0])
        out[name] = Estimate(per_x.mean(dim=-1), se)
    return out


#: one parameter block of a Voronoi loss: (fitted (R, k, p) or (R, k), true (R, k*, p) or
#: (R, k*), exponent in singleton cells, exponent in a cell of m > 1 atoms as a function of m);
#: a singleton exponent of None places the cells without adding to the loss
Block = tuple[Tensor, Tensor, float | None, Callable[[int], float] | None]


def _as3(t: Tensor) -> Tensor:
    return t.unsqueeze(-1) if t.dim() == 2 else t


def atom_costs(blocks: Sequence[Block], cells: Tensor) -> Tensor:
    """``Σ_b ‖Δ_b‖^{e_b(|A_j|)}`` of every fitted atom against the true atom of its cell:
    ``cells (R, k)`` (any assignment, Voronoi or not); blocks of exponent ``None`` cost nothing.
    Returns ``(R, k)``."""
    k_true = _as3(blocks[0][1]).shape[1]
    counts = torch.zeros(cells.shape[0], k_true, dtype=torch.long).scatter_add_(
        1, cells, torch.ones_like(cells)
    )
    size = counts.gather(1, cells)
    dtype = blocks[0][0].dtype
    cost = torch.zeros(cells.shape, dtype=dtype)
    for est, tru, e_single, e_multi in blocks:
        if e_single is None:  # a block that places the cells but costs nothing
            continue
        est, tru = _as3(est), _as3(tru)
        matched = tru.gather(1, cells.unsqueeze(-1).expand(-1, -1, tru.shape[-1]))
        cost = cost + (est - matched).norm(dim=-1) ** cell_exponents(e_single, e_multi, size, dtype)
    return cost


def cell_exponents(
    e_single: float, e_multi: Callable[[int], float] | None, size: Tensor, dtype: torch.dtype
) -> Tensor:
    """A block's exponent for atoms in cells of ``size`` atoms: ``e_single`` in singletons,
    ``e_multi(size)`` in cells of more than one."""
    exponent = torch.full(size.shape, float(e_single), dtype=dtype)
    for s in sorted({int(v) for v in size.flatten().tolist() if v > 1}):
        exponent = torch.where(size == s, torch.as_tensor(float(e_multi(s)), dtype=dtype), exponent)
    return exponent


def voronoi_d(
    weights: Tensor | None,
    blocks: Sequence[Block],
    weights_true: Tensor | None,
    *,
    mass_term: bool = True,
) -> Tensor:
    """``Σ_j |Σ_{i∈A_j} wᵢ − w*_j| + Σ_j Σ_{i∈A_j} wᵢ Σ_b ‖Δ_b‖^{e_b(|A_j|)}`` — the Voronoi
    losses of Ho (2025) (D₁ with exponents 1 | 2, D₂ with r̄(|A_j|) and r̄/2 per block) with
    each block's own exponent, singleton and multi-atom cells apart.

    Args:
        weights: ``(R, k)`` atom weights (``exp(β₀)``, or ω), ``None`` = 1.
        blocks: :data:`Block` tuples; cells are built on the concatenated blocks.
        weights_true: ``(R, k*)`` or ``None`` = 1.
        mass_term: include ``Σ_j |Σ_{i∈A_j} wᵢ − w*_j|``.

    Returns:
        ``(R,)`` losses.
    """
    fitted = [_as3(b[0]) for b in blocks]
    true = [_as3(b[1]) for b in blocks]
    R, k = fitted[0].shape[:2]
    k_true = true[0].shape[1]
    dtype = fitted[0].dtype
    w = torch.ones(R, k, dtype=dtype) if weights is None else weights
    w_true = torch.ones(R, k_true, dtype=dtype) if weights_true is None else weights_true
    cells = voronoi_cells(torch.cat(fitted, -1), torch.cat(true, -1))
    loss = (w * atom_costs(blocks, cells)).sum(dim=-1)
    if mass_term:
        mass = torch.zeros(R, k_true, dtype=dtype).scatter_add_(1, cells, w)
        loss = loss + (mass - w_true).abs().sum(dim=-1)
    return loss


def k_subset_voronoi(blocks: Sequence[tuple[Tensor, Tensor]], top_k: int) -> Tensor:
    """CompeteSMoE (2024) eq. (9): ``max over K-subsets {τ₁..τ_K} of [k*] of
    Σ_j Σ_{i∈A_τj} Σ_b ‖Δ_b‖`` for exact-specified fits with top-K competition.  ``blocks`` are
    ``(fitted (R, k, p), true (R, k*, p))`` pairs (scalars may drop p).  Returns ``(R,)``."""
    fitted = [_as3(b[0]) for b in blocks]
    true = [_as3(b[1]) for b in blocks]
    k_true = true[0].shape[1]
    positive_int("top_k", top_k)
    if top_k > k_true:
        raise ValueError(f"top_k={top_k} is not allowed; expected at most k*={k_true}")
    cells = voronoi_cells(torch.cat(fitted, -1), torch.cat(true, -1))
    cost = sum(
        (est - tru.gather(1, cells.unsqueeze(-1).expand(-1, -1, tru.shape[-1]))).norm(dim=-1)
        for est, tru in zip(fitted, true)
    )
    per_true = torch.zeros(cost.shape[0], k_true, dtype=cost.dtype).scatter_add_(1, cells, cost)
    # the maximum over K-subsets of a sum of non-negative per-cell costs: the K largest cells
    return per_true.topk(top_k, dim=-1).values.sum(dim=-1)


# ------------------------------------------------------------------------------------------- r̄(m)


def _index_set(l1: int, l2: int) -> list[tuple[int, int, int, int]]:
    """``I_{ℓ₁,ℓ₂}`` for d = 1: α₁ + α₂ = ℓ₁, α₂ + α₃ + 2α₄ = ℓ₂."""
    out = []
    for a2 in range(min(l1, l2) + 1):
        for a4 in range((l2 - a2) // 2 + 1):
            out.append((l1 - a2, a2, l2 - a2 - 2 * a4, a4))
    return out


def _system(r: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The monomials of the order-r system: exponents ``(T, 4)``, coefficients ``(T,)``, the
    equation of each ``(T,)`` and each equation's degree ℓ₁ + ℓ₂ ``(Q,)``."""
    exps, coefs, eqs, degrees = [], [], [], []
    for order in range(1, r + 1):
        for l1 in range(order + 1):
            for a in _index_set(l1, order - l1):
                exps.append(a)
                coefs.append(1.0 / math.prod(math.factorial(v) for v in a))
                eqs.append(len(degrees))
            degrees.append(order)
    return (
        torch.tensor(exps, dtype=dtype),
        torch.tensor(coefs, dtype=dtype),
        torch.tensor(eqs),
        torch.tensor(degrees, dtype=dtype),
    )


def _system_residual(p: Tensor, r: int) -> Tensor:
    """Scale-free residual of Ho (2025)'s system at order r, d = 1: ``p (B, m, 5)`` holds
    (p₁, p₂, p₃, p₄, v) per atom with p₅² = softmax(v) (every p₅ ≠ 0).  Each equation of degree
    ℓ₁ + ℓ₂ (p₁, p₃ weight 1; p₂, p₄ weight 2) is divided by ``N^{(ℓ₁+ℓ₂)/2}``, N = Σ_j p₅ⱼ² p₃ⱼ²,
    so a solution with every p₃ = 0 (trivial) is never a zero."""
    exps, coefs, eqs, degrees = _system(r, p.dtype)
    w = p[..., 4].softmax(dim=-1)  # (B, m)
    mono = (p[..., :4].unsqueeze(-2) ** exps).prod(dim=-1)  # (B, m, T)
    terms = (w.unsqueeze(-1) * mono).sum(dim=1) * coefs  # (B, T)
    values = torch.zeros(p.shape[0], len(degrees), dtype=p.dtype).index_add_(1, eqs, terms)
    norm = (w * p[..., 2] ** 2).sum(-1, keepdim=True).clamp_min(1e-300)
    return (values**2 / norm**degrees).sum(dim=-1)


def rbar(m: int, *, max_r: int = 8, starts: int = 256, seed: int = 0, tol: float = 1e-12) -> int:
    """r̄(m) of Ho (2025): the smallest r for which the polynomial system of order r (d = 1) has
    no non-trivial solution (every p₅ⱼ ≠ 0, some p₃ⱼ ≠ 0), found numerically: for r = 1, 2, …
    minimise the scale-free residual from ``starts`` random points (batched L-BFGS); a minimum
    below ``tol`` is a solution.  A numerical search, not a proof; returns ``max_r + 1`` when
    every order up to ``max_r`` has a solution.
    """
    from .lbfgs import batched_lbfgs

    positive_int("m", m)
    positive_int("max_r", max_r)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny tensors: one thread (10× faster on a loaded machine), restored after
    try:
        return _rbar(m, max_r, starts, seed, tol, batched_lbfgs)
    finally:
        torch.set_num_threads(threads)


def _rbar(m: int, max_r: int, starts: int, seed: int, tol: float, batched_lbfgs) -> int:
    gen = torch.Generator().manual_seed(seed)
    for r in range(1, max_r + 1):
        x = torch.randn(starts, m, 5, generator=gen, dtype=torch.float64).requires_grad_(True)
        batched_lbfgs(lambda x=x, r=r: _system_residual(x, r), [x], max_iter=800, gtol=1e-14, ftol=0.0)
        with torch.no_grad():
            best = float(_system_residual(x, r).min())
        if not best < tol:
            return r
    return max_r + 1
