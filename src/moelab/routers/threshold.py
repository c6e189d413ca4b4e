"""Expert-threshold routing: ``expert-threshold`` (ET, arXiv 2603.11535): each expert keeps a
threshold, an EMA of its expert-choice cutoff over the global token distribution; a token goes to
every expert whose score exceeds its threshold, in training and inference alike."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Interval, setting
from ..experts.protocol import Experts
from ..functional import taken_weights
from ..routing import Routing, RoutingContext
from .base import InitStdOptions, Router, counts_this_forward, mean_over_pieces, register


@dataclass(frozen=True)
class ExpertThresholdConfig(InitStdOptions):
    """The options of :class:`ExpertThresholdRouter` (its docstring says what each does)."""

    ema: float = setting(
        0.99,
        help="the thresholds' EMA decay per optimizer step: τ ← ema·τ + (1 − ema)·(the step's cutoff)",
        allowed=Interval(float, 0, 1, closed="left"),
    )


def expert_choice_cutoff(probs: Tensor, k: float) -> Tensor:
    """``(N,)`` each expert's expert-choice cutoff on ``probs (T, N)``: the ``(⌈T·k/N⌉ + 1)``-th
    largest score of its column, so that exactly ``⌈T·k/N⌉`` tokens exceed it (0 when that is every
    token: softmax scores are positive)."""
    t, n = probs.shape
    take = min(t, math.ceil(t * k / n))
    if take >= t:
        return probs.new_zeros(n)
    return probs.topk(take + 1, dim=0).values[-1]


@register("expert-threshold")
class ExpertThresholdRouter(Router):
    """``S = softmax(W x)``; token ``t`` goes to every expert ``e`` with ``S_{t,e} > τ_e``, weight
    ``S_{t,e}`` (not renormalised) — Expert Threshold (ET) routing (arXiv 2603.11535): the causal
    counterpart of expert-choice routing, whose batch cutoff is replaced by a per-expert threshold
    ``τ_e`` estimated from the global token distribution, so a token's routing depends on no other
    token of its batch, in training and inference.  A variable number of experts per token (0 to N,
    ``top_k`` on average once the thresholds settle); no auxiliary loss (the thresholds balance).

    The thresholds: each training forward with gradients adds its expert-choice cutoff
    (:func:`expert_choice_cutoff`, the score above which exactly ``⌈T·K/N⌉`` of its tokens lie, the
    capacity of expert-choice at ``c = top_k``) to a pending sum; the step hook averages the pending
    cutoffs over the step's micro-batches and ranks (:func:`moelab.routers.base.mean_over_pieces`)
    and moves ``τ ← ema·τ + (1 − ema)·cutoff`` (the first update sets ``τ`` to the cutoff).  Until the
    first update (a fresh layer) ``τ`` is the forward's own cutoff: expert-choice on its batch.
    ``τ`` and the update count are saved buffers.

    Options:
        ema: the EMA decay per optimizer step (0.99, as we read the paper: its abstract fixes none).
        init_std: std of the N(0, σ²) init of ``W``; default ``d^-1/2``.
    """

    weights_sum_to_one = False
    variable_k = True

    config_class = ExpertThresholdConfig

    step_state = (
        "its thresholds τ move only in the step hook ctx.advance() runs (expert-threshold routing); "
        "without it they stay where they are (at none: each batch is routed by its own expert-choice cutoff)"
    )

    def removal_problem(self, kept: int) -> str | None:
        return (
            "expert-threshold weighs by the softmax over all N experts, whose denominator the removed experts "
            "are part of, and its thresholds are quantiles of that softmax"
        )

    float32_buffers = (*Router.float32_buffers, "tau", "tau_pending")

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.ema = o.ema
        self.init_std = 1.0 / math.sqrt(d_model) if o.init_std is None else o.init_std
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        #: the thresholds τ (float32) and how many step hooks set them (0: none yet)
        self.register_buffer("tau", torch.zeros(num_experts))
        self.register_buffer("tau_updates", torch.zeros((), dtype=torch.long))
        #: the step's pending cutoffs and their count (not saved: the step hook consumes them)
        self.register_buffer("tau_pending", torch.zeros(num_experts + 1), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``W ~ N(0, init_std²)``; no threshold yet, nothing pending."""
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, dtype=self.weight.dtype) * self.init_std)
            self.tau.zero_()
            self.tau_updates.zero_()
            self.tau_pending.zero_()

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        logits = F.linear(x, self.weight)  # (T, N)
        probs = logits.softmax(dim=-1)
        update = self.training and torch.is_grad_enabled() and counts_this_forward()
        with torch.no_grad():
            scores = probs.detach()
            cutoff = expert_choice_cutoff(scores, self.top_k)
            if update:
                self.tau_pending.add_(torch.cat([cutoff, cutoff.new_ones(1)]).to(self.tau_pending.dtype))
            tau = torch.where(self.tau_updates > 0, self.tau.to(scores.dtype), cutoff)
            chosen = scores > tau  # (T, N)
            order = scores.masked_fill(~chosen, -1.0).argsort(dim=-1, descending=True, stable=True)
            mask = chosen.gather(1, order)
        weights = (probs * chosen.to(probs.dtype)).gather(1, order)
        return Routing(indices=order, weights=weights, probs=probs, logits=logits, mask=mask)

    def weights_at(self, routing: Routing, indices: Tensor) -> Tensor:
        """Routing replay of a recorded variable choice, ``indices (T, W)`` with ``-1`` in a slot the
        token did not take: the live ``S_{t,e}`` at each taken expert, 0 elsewhere
        (:func:`moelab.functional.taken_weights`, the weights its own choice gets).  The thresholds
        keep moving with the live scores' cutoff: a replay changes the choice, not the scores."""
        return taken_weights(routing.probs, indices)

    @torch.no_grad()
    def on_step(self, ctx: RoutingContext | None = None) -> None:
        """``τ ← ema·τ + (1 − ema)·c̄`` (``τ ← c̄`` at the first update), ``c̄`` the mean cutoff of
        the step's training forwards over micro-batches and ranks; none anywhere: ``τ`` stays."""
        mean = mean_over_pieces(self.tau_pending)
        if mean is not None:
            first = int(self.tau_updates) == 0
            self.tau.copy_(mean if first else self.ema * self.tau + (1.0 - self.ema) * mean)
            self.tau_updates.add_(1)
        self.tau_pending.zero_()

    def rule_options(self) -> dict[str, Any]:
        return {"ema": self.ema}
