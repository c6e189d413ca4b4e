"""Auxiliary losses of the routers, one function per formula.

Each returns an unweighted 0-dim tensor; a layer multiplies it by its coefficient
(``balance_coef``, ``z_coef``, ...).  Formulas: shared/REFERENCES.md, "Losses".
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "LOSS_NAMES",
    "importance_loss",
    "mean_entropy_loss",
    "sample_similarity_loss",
    "switch_balance_loss",
    "z_loss",
]

#: the aux losses a layer computes from a Routing, each with its ``<name>_coef`` option
LOSS_NAMES = ("balance", "z", "importance", "entropy")


def switch_balance_loss(probs: Tensor, indices: Tensor, num_experts: int) -> Tensor:
    """Switch Transformer load-balancing loss ``N · Σ_i f_i P_i``.

    ``f_i`` is the fraction of the ``T·K`` token slots routed to expert ``i``; ``P_i`` the mean
    router probability of ``i`` (Fedus et al. 2022, eq. 4; used by 001 §4 with coefficient 0.01).
    Equals 1 under perfect balance.

    Args:
        probs: ``(T, N)`` router distribution.
        indices: ``(T, K)`` chosen experts.
    """
    counts = torch.bincount(indices.reshape(-1), minlength=num_experts).to(probs.dtype)
    f = counts / indices.numel()
    return num_experts * (f * probs.mean(dim=0)).sum()


def z_loss(logits: Tensor) -> Tensor:
    """Router z-loss ``mean_x (logsumexp_i h_i(x))²`` (ST-MoE, Zoph et al. 2022, eq. 5; 001 Table 20
    uses 0.001)."""
    return logits.float().logsumexp(dim=-1).square().mean().to(logits.dtype)


def importance_loss(probs: Tensor) -> Tensor:
    """Importance loss ``CV(Σ_x p(·|x))²`` with ``CV = std / mean`` (002 eq. 7, after Shazeer et al.
    2017); the paper's weight ``w`` is the coefficient."""
    importance = probs.sum(dim=0)  # (N,)
    return importance.var(unbiased=False) / importance.mean().square()


def mean_entropy_loss(probs: Tensor, eps: float = 1e-9) -> Tensor:
    """σ-MoE regulariser: the negative entropy of the batch-mean router distribution,
    ``−H(mean_x softmax(W x))`` (Csordás et al. 2023, §4 "entropy regularisation"; 001 σ-MoE
    baseline, coefficient ≈ 1e-3).  Minimising it spreads the load."""
    mean = probs.mean(dim=0)
    return (mean * (mean + eps).log()).sum()


def sample_similarity_loss(probs: Tensor, x: Tensor, beta_s: float, beta_d: float) -> Tensor:
    """Sample-similarity regulariser ``L_s`` of 002 eq. 8–10, as the paper writes it.

    ``L_s = 1/(N²−N) Σ_{x,x'} [S(x,x') − D(x,x')]`` over the ``N`` samples of the batch, with
    ``S = β_s/M Σ_e p(e|x) p(e|x') ‖x−x'‖²`` (similar samples to the same expert) and
    ``D = β_d/(M²−M) Σ_{e≠e'} p(e|x) p(e'|x') ‖x−x'‖²`` (dissimilar samples to different ones).
    Pairs ``x = x'`` contribute 0 (zero distance).  The authors' code divides the distances by
    their maximum and, by an operator-precedence slip, divides only the D term by B² (a defect,
    shared/REFERENCES.md): not copied here; distances are raw squared Euclidean distances.

    Args:
        probs: ``(N, M)`` gate distribution.
        x: ``(N, ...)`` the samples (flattened to vectors).
        beta_s, beta_d: the paper's weights (002 Appendix C, Table 6).
    """
    n, m = probs.shape
    if n < 2 or m < 2:
        raise ValueError(
            f"probs of shape {tuple(probs.shape)} is not allowed; expected N >= 2 samples and M >= 2 experts"
        )
    flat = x.reshape(n, -1).to(probs.dtype)
    sq = flat.square().sum(1)
    dist = (sq[:, None] + sq[None, :] - 2 * flat @ flat.T).clamp_min(0)  # (N, N) ‖x − x'‖²
    same = probs @ probs.T  # Σ_e p(e|x) p(e|x')
    mass = probs.sum(1)
    different = mass[:, None] * mass[None, :] - same  # Σ_{e≠e'} p(e|x) p(e'|x')
    s = beta_s / m * same * dist
    d = beta_d / (m * m - m) * different * dist
    return (s - d).sum() / (n * n - n)
