"""The :class:`Experts` protocol: what a router and the :class:`moelab.MoE` layer may call on an expert bank."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

from torch import Tensor

from ..routing import Routing

__all__ = ["Experts"]


@runtime_checkable
class Experts(Protocol):
    """An expert bank: N experts behind one sparse ``forward`` and the calls routers make.

    Every bank of moelab is a :class:`moelab.experts.SparseExperts` (:class:`moelab.ExpertBank`,
    :class:`moelab.ModuleExperts`, :class:`moelab.experts.ExpertParallelBank`,
    ``moelab.models.vision.BatchedExperts``), whose ``forward`` runs every layout of a routing
    once; a bank implements the plain mixture ``mix`` and the per-expert calls, so callers never
    probe with ``hasattr``.  ``isinstance(bank, Experts)`` checks that the members exist.

    Shapes: ``T`` tokens, ``K`` experts per token, ``N`` experts; ``x (T, ...)`` is ``(T, d)`` for
    MLP experts and e.g. ``(T, C, H, W)`` images for CNN experts; an expert output is ``(d)`` (or
    any shape ``(...)`` for arbitrary modules).
    """

    #: N, the number of experts (global, for a bank spread over a process group)
    num_experts: int
    #: d, the width of one expert output (and of the tokens, for MLP experts); ``None`` where the
    #: bank cannot know it before running (arbitrary modules)
    d_model: int | None

    def __call__(self, x: Tensor, routing: Routing) -> Tensor: ...

    def forward(self, x: Tensor, routing: Routing) -> Tensor:
        """``Σ_k w_k · expert_{i_k}(x)`` over the routing's kept active slots for every token:
        ``x (T, ...)`` → ``(T, ...)``, in the layout the routing asks for (capacity padding,
        DenseMixer, a variable K, outputs the router computed; :class:`moelab.experts.SparseExperts`)."""
        ...

    def mix(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """The plain sparse mixture: ``x (T, ...)``, ``indices (T, K)`` int64, ``weights (T, K)`` →
        ``(T, ...)``; only the chosen experts run."""
        ...

    def expert_forward(self, x: Tensor, e: int) -> Tensor:
        """Expert ``e`` alone on every token: ``x (T, ...)`` → ``(T, ...)``."""
        ...

    def forward_all(self, x: Tensor) -> Tensor:
        """Every expert on every token: ``x (T, ...)`` → ``(T, N, ...)``, with autograd."""
        ...

    def forward_winners(
        self, x: Tensor, choose: Callable[[Tensor], tuple[Tensor, Any]]
    ) -> tuple[Tensor, Tensor, Any]:
        """The competition's pass (CompeteSMoE (2024) §3.1; CompeteSMoE (2025) §2.2): every expert
        on every token without autograd, ``choose(outputs (t, N, ...)) -> (indices (t, K), extra)``
        on each chunk of tokens, and the chosen experts' outputs with autograd (flowing to those
        experts only).

        Returns:
            ``(indices (T, K), outputs (T, K, ...), extra)``, ``extra`` concatenated over chunks.
        """
        ...
