"""The infimum of a Voronoi loss over the translations of the gate, with a certified bracket.

A softmax gate is unchanged by a common shift (t₁, t₂) of every (β₀ᵢ, β₁ᵢ), so Ho (2025)'s Voronoi
loss of a softmax (or quadratic) gate is its infimum over them; the cosine, perturbed and
competition gates are unchanged by a shift of β₀ alone.  With weights ``wᵢ = exp(β₀ᵢ)`` scaled by
``u = e^{−t₁}`` and the fitted atoms assigned to true atoms by ``a``, the loss is

    L(u, t₂) = Σ_j |u·W_j − w*_j| + u·C_a(t₂),   W_j = Σ_{a(i)=j} wᵢ,
    C_a(t₂) = Σ_i wᵢ (‖β₁ᵢ − t₂ − β*₁a(i)‖^{eᵢ} + the other blocks' costs),

where ``a`` is the Voronoi assignment at t₂.  Three facts make the infimum computable:

* for fixed ``a`` the loss is convex and piecewise linear in u, so its minimum over u ≥ 0 is at u → 0
  or a breakpoint ``w*_j / W_j`` (:func:`scale_inf`, exact), and non-decreasing in C;
* the set of t₂ where ``a`` is the Voronoi assignment is a polyhedron (each "atom i is no farther
  from true atom a(i) than from j" is linear in t₂: the squared distances differ by a linear term);
* ``C_a`` is convex in t₂ (a sum of norms to powers ≥ 1).

So the infimum is the minimum over the k*^k assignments of ``scale_inf`` at the minimum of a convex
function over a polyhedron.  Each such problem is solved by the ellipsoid method, which certifies
a lower bound at every step (``f(c) − √(gᵀPg)`` with g a subgradient at the centre c, since the
minimiser stays in the ellipsoid ``P``); the assignments that cannot beat the best loss found are
cut by the size of the ball their sublevel set lies in.  The result is a :class:`Bracket`: the loss
reached at a translation found (an upper bound) and the certified lower bound.
docs/stats-translation.md states the method and its checks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from .._validate import positive, positive_int
from .measures import Block, atom_costs, cell_exponents
from .voronoi import voronoi_cells

__all__ = ["MEMORY_LIMIT", "Bracket", "scale_inf", "translation_inf"]

#: bytes the k*^k assignment problems of one call may take (about three copies of their tensors)
MEMORY_LIMIT = 4 * 2**30


@dataclass
class Bracket:
    """``lower ≤ infimum ≤ value`` per replicate, ``(R,)`` each: ``value`` is the loss at a
    translation found, ``lower`` a certified lower bound."""

    value: Tensor
    lower: Tensor

    @property
    def gap(self) -> Tensor:
        return self.value - self.lower


def scale_inf(mass: Tensor, weights_true: Tensor, cost: Tensor) -> Tensor:
    """``min_{u ≥ 0} Σ_j |u·W_j − w*_j| + u·C`` exactly, for ``mass W (..., k*)``, ``weights_true
    (..., k*)`` and ``cost C (...)``: a convex piecewise-linear function of u takes its minimum at
    u = 0 (the limit t₁ → ∞) or at a breakpoint u = w*_j / W_j."""
    has = mass > 0
    u = torch.where(has, weights_true / torch.where(has, mass, 1), 0)
    u = torch.cat([torch.zeros_like(u[..., :1]), u], -1)  # (..., k* + 1) candidates
    values = (u.unsqueeze(-1) * mass.unsqueeze(-2) - weights_true.unsqueeze(-2)).abs().sum(-1)
    return (values + u * cost.unsqueeze(-1)).min(-1).values


def _scale_threshold(mass: Tensor, weights_true: Tensor, bound: Tensor) -> Tensor:
    """The least cost C at which ``min_u Σ_j |u·W_j − w*_j| + u·C`` reaches ``bound``: beyond it an
    assignment cannot improve on a loss already found.  ``(..., k*)``, ``(..., k*)``, ``(...)``."""
    has = mass > 0
    u = torch.where(has, weights_true / torch.where(has, mass, 1), 1)
    offset = (u.unsqueeze(-1) * mass.unsqueeze(-2) - weights_true.unsqueeze(-2)).abs().sum(-1)
    need = torch.where(has, (bound.unsqueeze(-1) - offset) / u, -math.inf)
    return need.amax(-1).clamp_min(0)


def translation_inf(
    beta0: Tensor,
    beta0_true: Tensor,
    blocks: Sequence[Block],
    *,
    shift: int | None = 0,
    tol: float = 1e-11,
    max_steps: int | None = None,
) -> Bracket:
    """``inf_{t₁, t₂} D(β₀ − t₁, blocks with block[shift] − t₂)`` of the Voronoi loss
    :func:`moelab.stats.measures.voronoi_d` with weights ``exp(β₀)`` (mass term included), bracketed.

    Args:
        beta0: ``(R, k)`` fitted gate biases; ``beta0_true``: ``(R, k*)``.
        blocks: the loss's :data:`moelab.stats.measures.Block` tuples (cells on their concatenation).
        shift: the index of the block shifted by t₂ (β₁ of a softmax or quadratic gate; it must carry
            a cost), or ``None`` to shift β₀ only (cosine, perturbed and competition gates): then the
            infimum is exact, ``lower == value``.
        tol: the ellipsoid method stops once every assignment's bracket on its cost is within
            ``tol·(1 + cost)``.
        max_steps: ellipsoid steps at most (default ``400·d·(d + 1)``: the ellipsoid's size falls
            by e every 2·d·(d + 1) steps, so by e^200); the bracket stays certified if it stops
            there, only wider.

    Returns:
        a :class:`Bracket` ``(R,)``, computed and returned in float64 whatever the inputs' dtype.

    Raises:
        ValueError: when the k*^k assignment problems of the R replicates would take more than
            :data:`MEMORY_LIMIT` bytes (refused before anything is allocated).
    """
    positive("tol", tol)
    if max_steps is not None:
        positive_int("max_steps", max_steps)
    # float64 throughout: the rounding margins below are 1e-12 of the squared distances
    blocks = [(b[0].double(), b[1].double(), b[2], b[3]) for b in blocks]
    fitted = [b[0] if b[0].dim() == 3 else b[0].unsqueeze(-1) for b in blocks]
    true = [b[1] if b[1].dim() == 3 else b[1].unsqueeze(-1) for b in blocks]
    w, w_true = beta0.double().exp(), beta0_true.double().exp()
    R, k = w.shape
    k_true = w_true.shape[1]

    def loss_at(t2: Tensor | None, rows: Tensor | None = None) -> Tensor:
        """The loss at the shift t₂ ``(P, d)`` of replicates ``rows`` (P,), t₁ exact."""
        pick = (lambda x: x) if rows is None else (lambda x: x[rows])
        moved = [
            pick(f) - t2.unsqueeze(1) if (i == shift and t2 is not None) else pick(f)
            for i, f in enumerate(fitted)
        ]
        tru = [pick(t) for t in true]
        cells = voronoi_cells(torch.cat(moved, -1), torch.cat(tru, -1))
        spec = [(m, t, b[2], b[3]) for m, t, b in zip(moved, tru, blocks)]
        weights = pick(w)
        mass = torch.zeros(cells.shape[0], k_true, dtype=w.dtype).scatter_add_(1, cells, weights)
        return scale_inf(mass, pick(w_true), (weights * atom_costs(spec, cells)).sum(-1))

    if shift is None:
        value = loss_at(None)
        return Bracket(value, value.clone())
    if not 0 <= shift < len(blocks) or blocks[shift][2] is None:
        raise ValueError(f"shift={shift!r} is not allowed; expected None or the index of a block with a cost")
    d = fitted[shift].shape[-1]
    problems = R * k_true**k
    need = problems * (k * k_true * (d + 4) + k * (2 * d + 5) + 3 * d * d) * w.element_size() * 3
    if need > MEMORY_LIMIT:
        raise ValueError(
            f"beta0 of shape {tuple(beta0.shape)} is not allowed with k*={k_true} true atoms: its "
            f"{k_true}^{k} assignments over {R} replicates need about {need / 2**30:.1f} GiB; expected at "
            f"most {MEMORY_LIMIT / 2**30:.0f} GiB (pass fewer replicates at a time, or fit fewer atoms)"
        )
    zero = torch.zeros(R, d, dtype=w.dtype)
    # centre the fitted β₁ on the true one (weighted means): exact when the fit is a shifted truth
    centre = (w.unsqueeze(-1) * fitted[shift]).sum(1) / w.sum(1, keepdim=True) - (
        w_true.unsqueeze(-1) * true[shift]
    ).sum(1) / w_true.sum(1, keepdim=True)
    starts = torch.stack([loss_at(zero), loss_at(centre)], -1)
    bound = starts.amin(-1)

    # every assignment of the k fitted atoms to the k* true atoms: (NA, k)
    assign = torch.tensor(list(itertools.product(range(k_true), repeat=k)), dtype=torch.long)
    NA = assign.shape[0]
    size = (
        torch.zeros(NA, k_true, dtype=torch.long)
        .scatter_add_(1, assign, torch.ones_like(assign))
        .gather(1, assign)
    )
    rows = torch.arange(R).repeat_interleave(NA)  # problem p = (replicate r, assignment a)
    cells = assign.repeat(R, 1)  # (P, k)
    wp = w[rows]
    mass = torch.zeros(R * NA, k_true, dtype=w.dtype).scatter_add_(1, cells, wp)
    others = [
        (f[rows], t[rows], b[2], b[3]) for i, (f, t, b) in enumerate(zip(fitted, true, blocks)) if i != shift
    ]
    c0 = (wp * atom_costs(others, cells)).sum(-1) if others else torch.zeros(R * NA, dtype=w.dtype)
    v = fitted[shift][rows] - true[shift][rows].gather(1, cells.unsqueeze(-1).expand(-1, -1, d))  # (P, k, d)
    e = cell_exponents(blocks[shift][2], blocks[shift][3], size, w.dtype).repeat(R, 1)  # (P, k)

    # "atom i is no farther from true atom a(i) than from j" as g·t₂ ≤ h, with a rounding margin
    z, z_true = torch.cat(fitted, -1), torch.cat(true, -1)
    sq = ((z.unsqueeze(2) - z_true.unsqueeze(1)) ** 2).sum(-1)[rows]  # (P, k, k*)
    own = sq.gather(2, cells.unsqueeze(-1))  # (P, k, 1)
    lo = sum(f.shape[-1] for f in fitted[:shift])
    b_true = z_true[..., lo : lo + d][rows]  # (P, k*, d)
    g_con = 2 * (b_true.gather(1, cells.unsqueeze(-1).expand(-1, -1, d)).unsqueeze(2) - b_true.unsqueeze(1))
    margin = 1e-12 * (sq + own + 1)
    margin = torch.where(cells.unsqueeze(-1) == torch.arange(k_true), -math.inf, margin)  # i against its own
    g_con, h_con, margin = g_con.flatten(1, 2), (sq - own).flatten(1), margin.flatten(1)  # (P, m, d), (P, m)

    threshold = _scale_threshold(mass, w_true[rows], bound[rows])  # cost at which a can't beat bound
    lower_cost, best_t, best_f = _ellipsoid(
        v, e, wp, c0, g_con, h_con, margin, threshold, tol, max_steps or 400 * d * (d + 1)
    )
    per_assign = scale_inf(mass, w_true[rows], torch.minimum(lower_cost, threshold)).view(R, NA)
    found = torch.isfinite(best_f)
    reached = torch.full((R * NA,), math.inf, dtype=w.dtype)
    if bool(found.any()):
        reached[found] = loss_at(best_t[found], rows[found])
    value = torch.minimum(bound, reached.view(R, NA).amin(-1))
    return Bracket(value, torch.minimum(per_assign.amin(-1), value))


def _ellipsoid(
    v: Tensor,
    e: Tensor,
    w: Tensor,
    c0: Tensor,
    g_con: Tensor,
    h_con: Tensor,
    margin: Tensor,
    threshold: Tensor,
    tol: float,
    steps: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """``min f(t) = c0 + Σ_i wᵢ ‖vᵢ − t‖^{eᵢ}`` over ``{g·t ≤ h}`` by the central-cut ellipsoid
    method, batched over problems: ``v (P, k, d)``, ``e``, ``w (P, k)``, ``c0 (P,)``, ``g_con (P, m, d)``,
    ``h_con (P, m)``.  Only the minimum below ``threshold (P,)`` matters: the start is the ball that
    holds ``{f ≤ threshold}``, ``‖t − vᵢ‖ ≤ ((threshold − c0)/wᵢ)^{1/eᵢ}`` for the tightest i.

    The lower bound is of the polyhedron widened by ``margin (P, m)`` (rounding cannot leave it
    out); the best point is inside it narrowed by ``margin`` (rounding cannot put it in another cell:
    the cells are closed at a tie only on one side, so the infimum over a cell's interior is the
    limit of such points).  ``margin`` −inf marks a constraint that always holds.

    Returns a certified lower bound of the minimum (or of ``threshold`` when the minimum lies above
    it), the best inner point and its value (inf where none was found)."""
    P, _, d = v.shape
    radius = ((threshold - c0).clamp_min(0).unsqueeze(-1) / w).pow(1 / e)  # (P, k)
    radius = torch.where(w > 0, radius, math.inf)
    tight = radius.argmin(-1)
    c = v.gather(1, tight.view(P, 1, 1).expand(-1, 1, d)).squeeze(1).clone()
    rho = radius.gather(1, tight.unsqueeze(-1)).squeeze(-1) * (1 + 1e-9) + 1e-300
    Pm = torch.eye(d, dtype=v.dtype).expand(P, d, d) * (rho**2).view(P, 1, 1)
    lower = c0.clone()
    best_f = torch.full((P,), math.inf, dtype=v.dtype)
    best_t = c.clone()
    done = threshold <= c0  # f ≥ c0 ≥ threshold: this assignment cannot beat the bound
    for _ in range(steps):
        if bool(done.all()):
            break
        x = v - c.unsqueeze(1)
        nx = x.norm(dim=-1)
        f = c0 + (w * nx**e).sum(-1)
        scale = torch.where(nx > 0, w * e * nx.clamp_min(1e-300) ** (e - 2), 0)
        grad = -(scale.unsqueeze(-1) * x).sum(1)  # a subgradient of f at c
        gpg = torch.einsum("pi,pij,pj->p", grad, Pm, grad).clamp_min(0)
        lower = torch.where(done, lower, torch.maximum(lower, f - gpg.sqrt()))
        raw = torch.einsum("pmd,pd->pm", g_con, c) - h_con
        slack = torch.where(torch.isinf(margin), -math.inf, raw - margin)  # against the widened set
        feasible = slack.amax(-1) <= 0
        inner = (raw + margin).amax(-1) <= 0  # margin −inf: always holds
        better = inner & (f < best_f) & ~done
        best_f = torch.where(better, f, best_f)
        best_t = torch.where(better.unsqueeze(-1), c, best_t)
        # the ellipsoid lies outside one half-space: no feasible point in it
        reach = torch.einsum("pmi,pij,pmj->pm", g_con, Pm, g_con).clamp_min(0).sqrt()
        empty = ((slack - reach) > 0).any(-1)
        lower = torch.where(empty & ~done, torch.full_like(lower, math.inf), lower)
        at_min = feasible & (gpg == 0)  # a zero subgradient at a feasible centre: lower = f there
        closed = torch.isfinite(best_f) & (best_f - lower <= tol * (1 + best_f.abs()))
        done = done | empty | at_min | (lower >= threshold) | closed
        # cut: by the most violated constraint, else by the objective's subgradient
        worst = slack.argmax(-1)
        g = torch.where(
            feasible.unsqueeze(-1), grad, g_con.gather(1, worst.view(P, 1, 1).expand(-1, 1, d)).squeeze(1)
        )
        pg = torch.einsum("pij,pj->pi", Pm, g)
        gpg_cut = (g * pg).sum(-1)
        live = ~done & (gpg_cut > 0)
        done = done | ~live
        step = pg / gpg_cut.clamp_min(1e-300).sqrt().unsqueeze(-1)
        c = torch.where(live.unsqueeze(-1), c - step / (d + 1), c)
        if d == 1:
            shrunk = Pm / 4
        else:
            shrunk = d * d / (d * d - 1.0) * (Pm - 2.0 / (d + 1) * step.unsqueeze(-1) * step.unsqueeze(-2))
            shrunk = 0.5 * (shrunk + shrunk.transpose(-1, -2))
        Pm = torch.where(live.view(P, 1, 1), shrunk, Pm)
    return lower, best_t, best_f
