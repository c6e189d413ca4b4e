"""Top-p (dynamic) routing: ``top-p`` (Huang et al. 2024, "Harder Tasks Need More Experts"): each
token takes the fewest experts whose probabilities reach ``p``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate
from ..config import Interval, setting
from ..experts.protocol import Experts
from ..losses import token_entropy_loss
from ..routing import Routing, RoutingContext
from .base import InitStdOptions, Router, SelectionBiasOptions, counts_this_forward, register


@dataclass(frozen=True)
class TopPConfig(InitStdOptions, SelectionBiasOptions):
    """The options of :class:`TopPRouter` (its docstring says what each does)."""

    threshold: float = setting(
        0.4,
        help="p: experts are taken until their cumulative probability exceeds it",
        allowed=Interval(float, 0, 1, closed="neither"),
    )
    max_k: int | None = setting(None, help="the most experts a token may take, in [1, N]; None: N")


@register("top-p")
class TopPRouter(Router):
    """``P = softmax(W x)``; the experts, by decreasing ``P_i``, are taken until their cumulative
    probability exceeds ``p``; each weighted by its ``P_i`` (not renormalised) — top-p routing of
    Huang et al. 2024 (*Harder Tasks Need More Experts: Dynamic Routing in MoE Models*, arXiv
    2403.07652, §3).

    A token takes the experts of ranks ``j`` with ``Σ_{r≤j} P_(r) ≤ p`` and the first rank whose
    cumulative probability exceeds ``p`` (so at least one), as the authors' public code
    (ZhenweiAn/Dynamic_MoE, ``top_p_sampling_batched_all_sequence``) does.
    ``p = 0.4`` (``threshold``) is the paper's and that code's default.  Harder tokens — flatter
    distributions — take more experts.

    Losses: the dynamic loss, the mean entropy of each token's ``P``
    (:func:`moelab.losses.token_entropy_loss`, ``dynamic_coef = 1e-4``), keeps the distributions
    from flattening to take every expert; the Switch balance loss (``balance_coef = 0.01``) over the
    active slots (``f_i``: the fraction of the active slots routed to ``i``).

    ``Routing.indices``/``weights`` are ``(T, max_k)`` by decreasing probability and
    ``Routing.mask`` marks the taken experts; the layer runs only those
    (:func:`moelab.experts.dispatch.dispatch_masked`).  ``top_k`` does not enter the routing: it is
    the K of the top-K baseline the method is compared with (counted by ``compare``'s active
    parameters).

    Options:
        threshold: ``p`` in (0, 1) (0.4).
        max_k: the most experts a token may take (default N, as the authors: no cap); the experts
            beyond it are dropped even if ``p`` is not reached.
        init_std: std of the N(0, σ²) init of ``W (N, d)``; default ``d^-1/2``.
        selection_bias: the aux-loss-free selection bias (DeepSeek-V3;
            :meth:`moelab.routers.Router.init_selection_bias`): the experts are ranked by
            ``P_i + b_i`` and taken while the cumulative ``P`` (unbiased) has not exceeded ``p``;
            the load it balances counts the taken experts.  Default off.
        bias_update_rate: its step γ (1e-3).
    """

    loss_names = ("dynamic",)
    weights_sum_to_one = False
    variable_k = True

    config_class = TopPConfig

    def removal_problem(self, kept: int) -> str | None:
        return (
            "top-p takes experts until their softmax probability over all N experts reaches p, so removing "
            "experts changes every token's probabilities and how many experts it takes"
        )

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.init_selection_bias(o.selection_bias, o.bias_update_rate)
        self.threshold = o.threshold
        self.max_k = (
            num_experts if o.max_k is None else _validate.int_in_range("max_k", o.max_k, 1, num_experts)
        )
        self.init_std = 1.0 / math.sqrt(d_model) if o.init_std is None else o.init_std
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``W ~ N(0, init_std²)``."""
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, dtype=self.weight.dtype) * self.init_std)
        self.reset_selection_bias()

    def rule_options(self) -> dict:
        return {"threshold": self.threshold, "max_k": self.max_k, "selection_bias": self.selection_bias}

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        logits = F.linear(x, self.weight)  # (T, N)
        probs = logits.softmax(dim=-1)
        indices = self.biased(probs.detach()).argsort(dim=-1, descending=True, stable=True)[:, : self.max_k]
        ranked = probs.gather(1, indices)
        over = ranked.detach().cumsum(dim=-1) > self.threshold
        mask = ~over | (over & (over.cumsum(dim=-1) == 1))  # up to and with the rank that crosses p
        if self.training and self.selection_bias is not None and counts_this_forward():
            active = mask.reshape(-1).to(self.pending_load.dtype)
            # in place, not `+=` (an attribute store, which compile refuses under activation checkpointing)
            self.pending_load.add_(
                active.new_zeros(self.num_experts).scatter_add(0, indices.reshape(-1), active)
            )
        weights = ranked * mask.to(ranked.dtype)
        losses = {"dynamic": token_entropy_loss(probs)}
        return Routing(indices=indices, weights=weights, probs=probs, logits=logits, losses=losses, mask=mask)
