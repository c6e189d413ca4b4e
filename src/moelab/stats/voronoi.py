"""Voronoi losses between a fitted mixing measure and the true one: the loss of the perturbed cosine
router (2024) eq. (11), its exponent-r variants (Ho (2025)) and losses over any list of parameter
blocks (:func:`block_voronoi_loss`, :func:`gaussian_voronoi_loss` for CompeteSMoE (2025)), on
unbatched tensors or with a leading replicate dimension.  docs/methods.md ("Voronoi losses") gives
the formula, the options and the tie rule.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = ["block_voronoi_loss", "gaussian_voronoi_loss", "voronoi_cells", "voronoi_loss"]

Exponent = float | Callable[[int], float]


def voronoi_cells(omega: Tensor, omega_true: Tensor) -> Tensor:
    """Index of the nearest true atom for every fitted atom.

    Args:
        omega: ``(R, k, p)`` fitted atoms.
        omega_true: ``(R, k*, p)`` true atoms.

    Returns:
        ``(R, k)`` int64 cell index in ``[0, k*)``.
    """
    dist = torch.cdist(omega, omega_true)  # (R, k, k*)
    return dist.argmin(dim=-1)  # first minimum: ties go to the lower true index


def block_voronoi_loss(
    log_weights: Tensor | None,
    blocks: Sequence[tuple[Tensor, Tensor]],
    log_weights_true: Tensor | None = None,
    *,
    r_single: float = 1.0,
    r_multi: Exponent = 2.0,
    powers: Sequence[float] | None = None,
    mass_term: bool = True,
) -> Tensor:
    """Voronoi loss over parameter blocks, each measured by its own Euclidean norm.

    Args:
        log_weights: ``β₀`` of the fitted atoms ``(R, k)`` (or ``(k,)``); ``None`` gives every atom
            weight 1 (the unweighted mixing measures of CompeteSMoE v1 (2024), eq. (9); CompeteSMoE (2025), eq. (3)).
        blocks: pairs ``(fitted (R, k, p_b), true (R, k*, p_b))``; a block may drop its last
            dimension (scalars such as b or ν).  Cells are built on the concatenation of all blocks.
        log_weights_true: ``β*₀`` of the true atoms ``(R, k*)``; ``None`` = weight 1.
        r_single: exponent of each block's norm in singleton cells (1 in the perturbed cosine router (2024) and CompeteSMoE (2025)).
        r_multi: exponent in multi-atom cells: a number (2 in the perturbed cosine router (2024) and CompeteSMoE (2025)) or a function of the cell
            size (Ho (2025)'s r̄(|A_j|)).
            The first block must be vector-valued (it decides whether the input is batched).
        powers: per-block multiplier of the exponent (Ho (2025)'s Gaussian loss raises the (a, σ) block
            to r/2: ``powers=(1, 0.5)``).
        mass_term: add ``Σ_j |Σ_{i∈A_j} e^{β₀ᵢ} − e^{β*₀ⱼ}|``.

    Returns:
        ``(R,)`` losses, or a 0-dim tensor for unbatched input.
    """
    if not blocks:
        raise ValueError("blocks must hold at least one (fitted, true) parameter pair")
    unbatched = blocks[0][0].dim() in (1, 2) and blocks[0][1].dim() == blocks[0][0].dim()
    fitted, true = [], []
    for est, tru in blocks:
        if est.dim() != tru.dim():
            raise ValueError(
                f"fitted and true blocks differ in rank: {tuple(est.shape)} vs {tuple(tru.shape)}"
            )
        est = est.unsqueeze(0) if unbatched else est
        tru = tru.unsqueeze(0) if unbatched else tru
        if est.dim() == 2:  # scalar parameter per atom
            est, tru = est.unsqueeze(-1), tru.unsqueeze(-1)
        if est.dim() != 3 or est.shape[-1] != tru.shape[-1]:
            raise ValueError(
                f"block shapes {tuple(est.shape)} and {tuple(tru.shape)} are not (R,k,p)/(R,k*,p)"
            )
        fitted.append(est)
        true.append(tru)
    R, k = fitted[0].shape[:2]
    k_true = true[0].shape[1]
    if powers is None:
        powers = [1.0] * len(blocks)
    if len(powers) != len(blocks):
        raise ValueError(f"powers has {len(powers)} entries for {len(blocks)} blocks")
    dtype, device = fitted[0].dtype, fitted[0].device
    if log_weights is None:
        weights = torch.ones(R, k, dtype=dtype, device=device)
    else:
        weights = (log_weights.unsqueeze(0) if unbatched else log_weights).exp()
    if log_weights_true is None:
        weights_true = torch.ones(R, k_true, dtype=dtype, device=device)
    else:
        weights_true = (log_weights_true.unsqueeze(0) if unbatched else log_weights_true).exp()

    cells = voronoi_cells(torch.cat(fitted, dim=-1), torch.cat(true, dim=-1))  # (R, k)
    counts = torch.zeros(R, k_true, dtype=torch.long, device=device).scatter_add_(
        1, cells, torch.ones_like(cells)
    )
    size = counts.gather(1, cells)  # (R, k): size of each atom's own cell
    if callable(r_multi):
        sizes = sorted({int(s) for s in size.flatten().tolist() if s > 1})
        r_of = {s: float(r_multi(s)) for s in sizes}
        r_multi_t = torch.ones_like(size, dtype=dtype)
        for s, r in r_of.items():
            r_multi_t = torch.where(size == s, torch.as_tensor(r, dtype=dtype), r_multi_t)
    else:
        r_multi_t = torch.full_like(size, float(r_multi), dtype=dtype)
    exponent = torch.where(size == 1, torch.as_tensor(float(r_single), dtype=dtype), r_multi_t)

    cost = torch.zeros(R, k, dtype=dtype, device=device)
    for est, tru, power in zip(fitted, true, powers):
        matched = tru.gather(1, cells.unsqueeze(-1).expand(-1, -1, tru.shape[-1]))  # (R, k, p)
        cost = cost + (est - matched).norm(dim=-1) ** (exponent * power)
    loss = (weights * cost).sum(dim=-1)
    if mass_term:
        mass = torch.zeros(R, k_true, dtype=dtype, device=device).scatter_add_(1, cells, weights)
        loss = loss + (mass - weights_true).abs().sum(dim=-1)
    return loss[0] if unbatched else loss


def voronoi_loss(
    beta0: Tensor,
    beta1: Tensor,
    eta: Tensor,
    beta0_true: Tensor,
    beta1_true: Tensor,
    eta_true: Tensor,
    *,
    r_single: float = 1.0,
    r_multi: Exponent = 2.0,
) -> Tensor:
    """The Voronoi loss ``D(G, G*)`` of the perturbed cosine router (2024) (module docstring) with ω = (β₁, η).

    Args:
        beta0, beta1, eta: fitted ``(k,)``, ``(k, d)``, ``(k, q)`` — or with a leading ``R``.
        beta0_true, beta1_true, eta_true: the truth, ``k*`` atoms, same batching.
        r_single, r_multi: exponents (1 and 2 in the perturbed cosine router (2024); Ho (2025)'s D_r via a number or function of |A_j|).

    Returns:
        the loss: 0-dim, or ``(R,)`` with a replicate dimension.
    """
    return block_voronoi_loss(
        beta0,
        [(beta1, beta1_true), (eta, eta_true)],
        beta0_true,
        r_single=r_single,
        r_multi=r_multi,
    )


def gaussian_voronoi_loss(
    a: Tensor,
    b: Tensor,
    nu: Tensor,
    a_true: Tensor,
    b_true: Tensor,
    nu_true: Tensor,
    beta0: Tensor | None = None,
    beta0_true: Tensor | None = None,
    *,
    r_single: float = 1.0,
    r_multi: Exponent = 2.0,
    mass_term: bool = True,
) -> Tensor:
    """Voronoi loss of a Gaussian mixture of linear experts: CompeteSMoE (2025) App. J eq. (14).

    ``Σ_j |Σ_{i∈A_j} e^{cᵢ} − e^{c*ⱼ}| + Σ_{|A_j|=1} e^{cᵢ}(‖Δa‖ + |Δb| + |Δν|)
    + Σ_{|A_j|>1} e^{cᵢ}(‖Δa‖² + |Δb|² + |Δν|²)``, cells on θ = (a, b, ν).  Competition gating has
    no gate parameters (CompeteSMoE (2025) eq. (13)): leave ``beta0`` as ``None`` (weights 1).  With
    ``r_multi=1, mass_term=False`` it is the plain expert-parameter error Σ_j Σ_{i∈A_j} ‖Δθ‖ used
    to read off expert estimation rates (CompeteSMoE (2025) §3 remark (i)).
    """
    return block_voronoi_loss(
        beta0,
        [(a, a_true), (b, b_true), (nu, nu_true)],
        beta0_true,
        r_single=r_single,
        r_multi=r_multi,
        mass_term=mass_term,
    )
