""":class:`SparseExperts`: the base of every expert bank — ``experts(x, routing)`` runs the
routing in its layout, written once here:

* the router already ran the chosen experts (``routing.outputs``, the competition): combine them;
* a variable number of experts per token (``routing.mask``): only the active slots run;
* DenseMixer (``routing.dense_gradient``): every expert runs, the router gets the dense gradient;
* capacity padding (``routing.pad_to``): every expert runs on exactly C rows;
* otherwise the plain sparse mixture, the bank's :meth:`SparseExperts.mix`.

Slots over their expert's capacity (``routing.keep``) add 0 in every layout.  A bank implements
:meth:`~SparseExperts.mix`, :meth:`~SparseExperts.forward_all` and
:meth:`~SparseExperts.expert_forward`; the competition's pass and the padded layout have defaults
through them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..routing import Routing
from .dispatch import (
    combine,
    combine_densemixer,
    combine_padded,
    dispatch_masked,
    gather_padded,
    pad_slots,
    winners_by_rerun,
)
from .protocol import Experts

__all__ = ["SparseExperts", "check_bank"]


class SparseExperts(nn.Module):
    """N experts behind ``forward(x, routing) -> (T, ...)`` (the :class:`moelab.experts.Experts`
    protocol).

    Attributes:
        num_experts: N (global, for a bank spread over a process group).
        d_model: the width of one expert output, or ``None`` where only running an expert tells.
        chunk_elements: the output elements the competition's pass materialises at once.
    """

    num_experts: int
    d_model: int | None
    chunk_elements: int = 1 << 22

    def forward(self, x: Tensor, routing: Routing, *unexpected: object) -> Tensor:
        """``Σ_k w_k · expert_{i_k}(x)`` over the kept active slots of ``routing`` for every token
        of ``x (T, ...)``, in the layout the routing asks for (module docstring) → ``(T, ...)``.
        The former call ``bank(x, indices, weights)`` is refused in one line naming
        :meth:`mix`, which takes them."""
        if unexpected or not isinstance(routing, Routing):
            raise ValueError(
                f"{type(self).__name__}(x, routing) takes a moelab.Routing, got "
                f"{1 + len(unexpected)} argument(s) after x; expected bank(x, moelab.Routing(indices, "
                "weights)), or bank.mix(x, indices, weights) for the plain mixture"
            )
        weights = routing.kept_weights
        if routing.outputs is not None:  # the router already ran the chosen experts
            return combine(routing.outputs, weights)
        if routing.mask is not None:  # a variable number of experts per token: inactive slots do not run
            return dispatch_masked(self, x, routing.indices, weights, routing.mask)
        if routing.dense_gradient:  # every expert runs
            return combine_densemixer(self.forward_all(x), routing.indices, weights, routing.probs)
        if routing.pad_to is not None and routing.keep is not None:
            N, C = self.num_experts, routing.pad_to
            padded = pad_slots(routing.indices, routing.keep, N, C)
            xs = gather_padded(x, padded, routing.indices.shape[1])  # (N·C, ...)
            ys = self.mix_padded(xs.view(N, C, *xs.shape[1:])).flatten(0, 1)
            return combine_padded(ys, weights, padded)
        return self.mix(x, routing.indices, weights)

    def mix(self, x: Tensor, indices: Tensor, weights: Tensor) -> Tensor:
        """The plain sparse mixture: ``x (T, ...)``, ``indices (T, K)`` int64, ``weights (T, K)`` →
        ``Σ_k w_k · expert_{i_k}(x)`` ``(T, ...)``; only the chosen experts run."""
        raise NotImplementedError(f"{type(self).__name__} does not implement mix(x, indices, weights)")

    def mix_padded(self, xs: Tensor) -> Tensor:
        """Every expert on its ``C`` rows: ``xs (N, C, ...)`` → ``(N, C, ...)``.  By default
        through :meth:`mix`, each row routed to its expert with weight 1."""
        N, C = xs.shape[:2]
        rows = xs.flatten(0, 1)
        expert = torch.arange(N, device=xs.device).repeat_interleave(C).unsqueeze(1)
        return self.mix(rows, expert, rows.new_ones(expert.shape)).view(N, C, *xs.shape[2:])

    def expert_forward(self, x: Tensor, e: int) -> Tensor:
        """Expert ``e`` alone on every token: ``x (T, ...)`` → ``(T, ...)``."""
        raise NotImplementedError(f"{type(self).__name__} does not implement expert_forward(x, e)")

    def forward_all(self, x: Tensor) -> Tensor:
        """Every expert on every token: ``x (T, ...)`` → ``(T, N, ...)``, with autograd."""
        raise NotImplementedError(f"{type(self).__name__} does not implement forward_all(x)")

    def forward_winners(
        self, x: Tensor, choose: Callable[[Tensor], tuple[Tensor, Any]]
    ) -> tuple[Tensor, Tensor, Any]:
        """The competition's pass (CompeteSMoE (2024) §3.1; CompeteSMoE (2025) §2.2): every expert
        on every token without autograd, ``choose(outputs (t, N, ...)) -> (indices (t, K), extra)``
        per chunk of tokens, and the chosen experts' outputs with autograd (flowing to those experts
        only).  By default the winners run again (:func:`moelab.experts.dispatch.winners_by_rerun`).

        Returns:
            ``(indices (T, K), outputs (T, K, ...), extra)``, ``extra`` concatenated over chunks.
        """
        return winners_by_rerun(self, x, choose, self.chunk_elements)


def check_bank(experts: object, num_experts: int) -> None:
    """``experts`` is a bank of the :class:`moelab.experts.Experts` protocol with ``num_experts``
    experts; refused in one line otherwise."""
    if not isinstance(experts, Experts):
        raise ValueError(
            f"experts of type {type(experts).__name__} is not allowed; expected an expert bank implementing "
            "moelab.experts.Experts (num_experts, d_model, forward(x, routing), mix, expert_forward, "
            "forward_all, forward_winners; subclass moelab.experts.SparseExperts)"
        )
    if experts.num_experts != num_experts:
        raise ValueError(
            f"experts.num_experts={experts.num_experts!r} does not match num_experts={num_experts}"
        )
