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
    compute = torch.promote_types(probs.dtype, torch.float32)  # counts above 256 are not exact in bf16
    f = torch.bincount(indices.reshape(-1), minlength=num_experts).to(compute) / indices.numel()
    return (num_experts * (f * probs.to(compute).mean(dim=0)).sum()).to(probs.dtype)


def z_loss(logits: Tensor) -> Tensor:
    """Router z-loss ``mean_x (logsumexp_i h_i(x))²`` (ST-MoE, Zoph et al. 2022, eq. 5; 001 Table 20
    uses 0.001)."""
    compute = torch.promote_types(logits.dtype, torch.float32)  # fp16/bf16 → fp32; float64 stays
    return logits.to(compute).logsumexp(dim=-1).square().mean().to(logits.dtype)


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
