"""A bank of arbitrary expert modules (e.g. the CNN experts of Krishnamurthy et al. (2023))."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from .. import _validate
from .base import SparseExperts
from .dispatch import Slots, dispatch, tracks_grad

__all__ = ["ModuleExperts"]


class ModuleExperts(SparseExperts):
    """The :class:`moelab.experts.Experts` protocol over a list of arbitrary modules.

    Each module maps ``(T, *in_shape)`` to ``(T, *out_shape)``.  :meth:`forward` is the shared
    sorted dispatch (:func:`moelab.experts.dispatch.dispatch`): each module runs once on its
    contiguous slice of the expert-sorted tokens, a module with no tokens is skipped.

    Args:
        experts: the N modules.
        d_model: the width of one expert output, if known (``None``: the competition chunks its
            pass by the input width instead).
        chunk_elements: output elements of ``forward_all`` that :meth:`forward_winners`
            materialises at once.
    """

    def __init__(
        self, experts: Sequence[nn.Module], d_model: int | None = None, chunk_elements: int = 1 << 22
    ) -> None:
        super().__init__()
        experts = list(experts)
        if len(experts) < 1 or not all(isinstance(m, nn.Module) for m in experts):
            raise ValueError(f"experts={experts!r} is not allowed; expected a non-empty list of nn.Module")
        self.experts = nn.ModuleList(experts)
        self.num_experts = len(experts)
        self.d_model = None if d_model is None else _validate.positive_int("d_model", d_model)
        self.chunk_elements = _validate.positive_int("chunk_elements", chunk_elements)

    def mix(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """``Σ_k w_k · expert_{i_k}(x)``: ``x (T, ...)``, ``indices``/``weights (T, K)`` → ``(T, ...)``."""
        return dispatch(x, indices, weights, self.num_experts, self._run, tracks_grad(self, x, weights))

    def expert_forward(self, x: Tensor, e: int) -> Tensor:
        """Module ``e`` on ``x (T, ...)``."""
        return self.experts[e](x)

    def forward_all(self, x: Tensor) -> Tensor:
        """``(T, ...)`` → ``(T, N, ...)``."""
        return torch.stack([m(x) for m in self.experts], dim=1)

    def _run(self, xs: Tensor, slots: Slots) -> Tensor:
        counts = slots.counts.tolist()  # the one host sync
        outs = [m(x_e) for m, x_e, c in zip(self.experts, xs.split(counts), counts) if c > 0]
        return torch.cat(outs) if outs else self.experts[0](xs)  # no tokens: an empty output
