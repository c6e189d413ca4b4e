"""Routing metrics.

Expert specialization (paper 002 §3 and Appendix A): :func:`specialization` (``H_s``, ``H_u``,
``I_EY``), :func:`selection_table` and :func:`plot_selection_table` (the expert × class table of
002 Fig. 2, 3, 6).  All entropies are in bits (log₂).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

__all__ = [
    "entropy_bits",
    "mutual_information_bits",
    "plot_selection_table",
    "selection_table",
    "specialization",
]


# ---------------------------------------------------------------------- expert specialization (002)
def entropy_bits(p: Tensor, dim: int = -1) -> Tensor:
    """Shannon entropy ``−Σ p log₂ p`` along ``dim`` with ``0 log 0 = 0``."""
    p = p.double()
    return -(torch.where(p > 0, p * torch.log2(p.clamp_min(1e-300)), torch.zeros_like(p))).sum(dim)


def selection_table(experts: Tensor, labels: Tensor, num_experts: int, num_classes: int) -> Tensor:
    """The count matrix ``C (M, K)``: ``C[i, j]`` = samples of class ``j`` sent to expert ``i``
    (002 Appendix A, Table 4).

    Args:
        experts: ``(B,)`` the selected (argmax) expert of each sample.
        labels: ``(B,)`` the TRUE class of each sample.
    """
    if experts.shape != labels.shape or experts.dim() != 1:
        raise ValueError(
            f"experts of shape {tuple(experts.shape)} and labels of shape {tuple(labels.shape)} are not "
            "allowed; expected two 1-d tensors of the same length"
        )
    if labels.numel() and (labels.min() < 0 or labels.max() >= num_classes):
        raise ValueError(
            f"labels must lie in [0, num_classes={num_classes}); got [{labels.min()}, {labels.max()}]"
        )
    flat = experts.long() * num_classes + labels.long()
    return torch.bincount(flat, minlength=num_experts * num_classes).view(num_experts, num_classes)


def mutual_information_bits(table: Tensor) -> Tensor:
    """``I(E;Y) = H(E) + H(Y) − H(E,Y)`` from a count table (002 eq. 3, 11–16)."""
    joint = table.double() / table.sum()
    return entropy_bits(joint.sum(1)) + entropy_bits(joint.sum(0)) - entropy_bits(joint.reshape(-1))


def specialization(gate_probs: Tensor, labels: Tensor, num_classes: int) -> dict[str, float]:
    """The information-theoretic routing metrics of 002 §3, in bits.

    * ``H_s`` — mean per-sample entropy of the gate distribution (002 eq. 1): low = sparse gating.
    * ``H_u`` — entropy of the batch-mean gate distribution (002 eq. 2): high = balanced use.
    * ``I_EY`` — mutual information between the argmax expert ``E`` and the TRUE class ``Y``
      (002 eq. 3, Appendix A).  The authors' code used the predicted class (a defect listed in
      shared/REFERENCES.md); the paper defines ``Y`` as the class distribution, so true labels.

    Args:
        gate_probs: ``(B, M)`` gate distribution p(e|x) of each sample (rows sum to 1).
        labels: ``(B,)`` int true classes in ``[0, num_classes)``.
        num_classes: K.

    Returns:
        ``{"H_s", "H_u", "I_EY"}`` as floats.
    """
    if gate_probs.dim() != 2 or labels.dim() != 1 or gate_probs.shape[0] != labels.shape[0]:
        raise ValueError(
            f"gate_probs of shape {tuple(gate_probs.shape)} and labels of shape {tuple(labels.shape)} are "
            "not allowed; expected (B, M) and (B,)"
        )
    if gate_probs.shape[0] == 0:
        raise ValueError("gate_probs is empty; expected at least one sample")
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 1:
        raise ValueError(f"num_classes={num_classes!r} is not allowed; expected a positive integer")
    p = gate_probs.detach().double()
    table = selection_table(p.argmax(dim=1), labels.detach(), p.shape[1], num_classes)
    return {
        "H_s": float(entropy_bits(p).mean()),
        "H_u": float(entropy_bits(p.mean(dim=0))),
        "I_EY": float(mutual_information_bits(table)),
    }


def plot_selection_table(
    table: Tensor,
    path: str | os.PathLike,
    class_names: list[str] | None = None,
    title: str = "",
) -> None:
    """Save the expert × class count table as an annotated heatmap PNG (like 002 Fig. 2 and 6)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = table.detach().cpu().numpy()
    m, k = t.shape
    fig, ax = plt.subplots(figsize=(max(4.0, 0.55 * k + 1.5), max(3.0, 0.45 * m + 1.2)))
    im = ax.imshow(t, cmap="viridis", aspect="auto")
    ax.set_xticks(
        range(k), class_names if class_names else [str(j) for j in range(k)], rotation=45, ha="right"
    )
    ax.set_yticks(range(m), [f"E{i}" for i in range(m)])
    ax.set_xlabel("class")
    ax.set_ylabel("expert")
    threshold = t.max() / 2 if t.size else 0
    for i in range(m):
        for j in range(k):
            ax.text(
                j,
                i,
                int(t[i, j]),
                ha="center",
                va="center",
                fontsize=7,
                color="k" if t[i, j] > threshold else "w",
            )
    fig.colorbar(im, ax=ax)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
