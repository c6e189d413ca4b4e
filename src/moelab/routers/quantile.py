"""Quantile balancing: ``quantile`` (Megatron-LM ``moe_router_load_balancing_type="quantile_balancing"``):
a per-expert bias set, once per optimizer step, to the column quantile that gives every expert
``T·K/N`` tokens (a dual coordinate-descent update); no auxiliary loss."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Interval, setting
from ..experts.protocol import Experts
from ..functional import resolve_renormalize, topk_gate_weights_at
from ..routing import Routing, RoutingContext
from .base import (
    InitStdOptions,
    RenormalizeOptions,
    Router,
    ScaleOptions,
    counts_this_forward,
    mean_over_pieces,
    register,
    softmax_over_all,
)


@dataclass(frozen=True)
class QuantileConfig(InitStdOptions, RenormalizeOptions, ScaleOptions):
    """The options of :class:`QuantileBalancingRouter` (its docstring says what each does)."""

    ema: float = setting(
        0.0,
        help="β ← ema·β + (1 − ema)·(the step's quantile), then centred (Megatron-LM's "
        "moe_router_quantile_balancing_ema; 0: the latest quantile)",
        allowed=Interval(float, 0, 1, closed="left"),
    )


def quantile_offsets(logits: Tensor, beta: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """One dual coordinate-descent step of quantile balancing on ``logits (T, N)`` (float32):
    ``(indices (T, K), column quantile (N,))``.

    ``indices = TopK(h − β)``; the per-token offset ``α_t`` is the token's (K+1)-th largest
    ``h − β``; the column quantile of expert ``e`` is the ``(q+1)``-th largest ``h_{t,e} − α_t`` over
    the tokens, ``q = ⌊T·K/N⌋`` — the bias at which expert ``e`` would take its ``T·K/N`` tokens
    (Megatron-LM ``qb_dual_update``, which asserts that ``N`` divides ``T·K``; the floor is our
    reading for the other ``T``, as a token mask makes ``T`` any count)."""
    t, n = logits.shape
    top = (logits - beta).topk(k + 1, dim=1)
    indices = top.indices[:, :k]
    if t == 0:
        return indices, beta.new_zeros(n)
    target = t * k // n
    alpha = top.values[:, k:]  # (T, 1)
    column = (logits - alpha).topk(target + 1, dim=0).values[-1]
    return indices, column


@register("quantile")
class QuantileBalancingRouter(Router):
    """``h = W x``; the K experts of ``TopK(h − β)`` are chosen, weighted by ``softmax`` over the
    chosen logits (Megatron-LM's score function ``softmax`` without ``pre_softmax``): quantile
    balancing (QB), Megatron-LM ``moe_router_load_balancing_type="quantile_balancing"``
    (``Router.quantile_balancing``, ``moe_utils.qb_dual_update``,
    ``finalize_model_grads._update_router_qb_beta``).

    The bias ``β (N,)`` is a dual variable, not a learned parameter: each training forward (with
    gradients) computes, with the current ``β``, the column quantile of ``h − α`` (``α_t`` the
    token's (K+1)-th largest ``h − β``) at which each expert would take exactly ``T·K/N`` tokens
    (:func:`quantile_offsets`) and adds it to a pending sum; the step hook :meth:`on_step` averages
    the pending quantiles over the step's micro-batches and the data-parallel ranks (the mean of
    each piece's quantile, as Megatron-LM: one all-reduce of ``N + 1`` numbers per layer, outside any
    forward), blends ``β ← ema·β + (1 − ema)·mean`` and centres it (``β − mean(β)``).  Evaluation
    and gradient-free forwards route with ``β`` and change nothing.  No auxiliary loss (Megatron-LM
    asserts it off).

    Options:
        ema: the blend of the old bias (0: replaced by the step's quantile, Megatron-LM's default).
        renormalize: ``True``: softmax over the K chosen logits (Megatron-LM); ``False``: the
            softmax over all N at the chosen experts; ``None`` (default): ``True`` for K > 1
            (at K = 1 the chosen expert's probability, as Switch, where Megatron-LM's weight is the
            constant 1).
        init_std: std of the N(0, σ²) init of ``W``; default ``d^-1/2``.
        scale: multiplies the final weights (``moe_router_topk_scaling_factor``).
    """

    config_class = QuantileConfig

    step_state = (
        "its bias β moves only in the step hook ctx.advance() runs (quantile balancing); without it "
        "β stays where it is and nothing balances the experts"
    )
    expert_tensors = ("weight", "qb_beta")

    def removal_problem(self, kept: int) -> str | None:
        if self.top_k >= kept:
            return f"quantile balancing needs top_k={self.top_k} < the {kept} kept experts"
        return softmax_over_all(self.renormalize)

    float32_buffers = (*Router.float32_buffers, "qb_beta", "qb_pending")

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        if top_k >= num_experts:
            raise ValueError(
                f"top_k={top_k} is not allowed with quantile balancing; expected top_k < num_experts="
                f"{num_experts} (a token's offset is its (K+1)-th largest score)"
            )
        o = self.options
        self.ema = o.ema
        self.renormalize = resolve_renormalize(o.renormalize, top_k)
        self.scale = o.scale
        self.init_std = 1.0 / math.sqrt(d_model) if o.init_std is None else o.init_std
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        #: the bias β (float32, saved with the model)
        self.register_buffer("qb_beta", torch.zeros(num_experts))
        #: the step's pending quantiles and their count (not saved: the step hook consumes them)
        self.register_buffer("qb_pending", torch.zeros(num_experts + 1), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``W ~ N(0, init_std²)``; the bias and the pending quantiles zero."""
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, dtype=self.weight.dtype) * self.init_std)
            self.qb_beta.zero_()
            self.qb_pending.zero_()

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        logits = F.linear(x, self.weight)  # (T, N)
        update = self.training and torch.is_grad_enabled() and counts_this_forward()
        with torch.no_grad():
            select = logits.detach().to(torch.promote_types(logits.dtype, torch.float32))
            indices, column = quantile_offsets(select, self.qb_beta.to(select.dtype), self.top_k)
            if update:
                one = column.new_ones(1)
                self.qb_pending.add_(torch.cat([column, one]).to(self.qb_pending.dtype))
        probs = logits.softmax(dim=-1)
        routing = Routing(indices=indices, weights=probs, probs=probs, logits=logits)
        return dataclasses.replace(routing, weights=self.weights_at(routing, indices))

    def weights_at(self, routing: Routing, indices: Tensor) -> Tensor:
        """The softmax over the live logits at ``indices`` (renormalised over the K, or the softmax
        over all N there), times ``scale``: the weights of its own choice and of a replayed one (β
        chooses, it never weighs)."""
        weights = topk_gate_weights_at(routing.logits, routing.probs, indices, self.renormalize)
        return weights * self.scale if self.scale != 1.0 else weights

    @torch.no_grad()
    def on_step(self, ctx: RoutingContext | None = None) -> None:
        """``β ← centre(ema·β + (1 − ema)·q̄)``, ``q̄`` the mean of the step's pending quantiles over
        micro-batches and ranks (ranks without a training forward count for nothing); no training
        forward anywhere: ``β`` stays."""
        mean = mean_over_pieces(self.qb_pending)
        if mean is not None:
            beta = self.ema * self.qb_beta + (1.0 - self.ema) * mean
            self.qb_beta.copy_(beta - beta.mean())
        self.qb_pending.zero_()

    @property
    def weights_sum_to_one(self) -> bool:
        return self.renormalize

    def rule_options(self) -> dict[str, Any]:
        return {"renormalize": self.renormalize, "scale": self.scale, "ema": self.ema}
