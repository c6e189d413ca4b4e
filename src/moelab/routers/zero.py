"""Zero-computation experts: ``moepp`` (MoE++, Jin et al. 2025): zero, copy and constant experts beside
the FFN experts of the bank, chosen by the same router."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Interval, setting
from ..experts.protocol import Experts
from ..functional import expert_counts, resolve_renormalize
from ..losses import heterogeneous_balance_loss
from ..routing import Routing, RoutingContext
from .base import (
    InitStdOptions,
    RenormalizeOptions,
    Router,
    SelectionBiasOptions,
    counts_this_forward,
    register,
    softmax_over_all,
)

_COUNT = Interval(int, 0, 1 << 20)


@dataclass(frozen=True)
class MoEPPConfig(InitStdOptions, RenormalizeOptions, SelectionBiasOptions):
    """The options of :class:`ZeroComputationRouter` (its docstring says what each does)."""

    num_zero: int = setting(1, help="zero experts E(x) = 0", allowed=_COUNT)
    num_copy: int = setting(1, help="copy experts E(x) = x", allowed=_COUNT)
    num_constant: int = setting(2, help="constant experts E(x) = a₁ x + a₂ v", allowed=_COUNT)
    tau: float = setting(
        0.75, help="τ, the balance loss's weight of the zero-computation experts", allowed=Interval(float, 0)
    )
    two_layer_gate: bool = setting(True, help="the two-layer gate Linear(d, 8M) → tanh → Linear(8M, M)")


@register("moepp")
class ZeroComputationRouter(Router):
    """The router of MoE++ (Jin, Zhu, Yuan, Yan, *MoE++: Accelerating Mixture-of-Experts Methods with
    Zero-Computation Experts*, ICLR 2025, §3): over the N FFN experts of the bank and ``Z`` experts
    that need no FFN — ``num_constant`` constant experts ``E(x) = a₁ x + a₂ v`` (``[a₁, a₂] =
    softmax(W_c x)``, ``v`` a trained vector), ``num_copy`` copy experts ``E(x) = x`` and
    ``num_zero`` zero experts ``E(x) = 0`` — numbered ``N, …, N+Z−1`` in that order (the authors'
    order: the zero expert last).

    Routing as the authors' public code (SkyworkAI/MoE-plus-plus, ``moe_plus_plus_layer.py``):
    ``P = softmax(g(x))`` over the ``N + Z`` experts, the top-K, a zero expert's weight set to 0 and
    the K weights renormalised (so a token that chose a zero expert and one FFN expert gives that
    expert weight 1; at K = 1 not renormalised by default, see ``renormalize``).  ``g`` is the code's default two-layer gate ``Linear(d, 8M) → tanh →
    Linear(8M, M)`` (``two_layer_gate``; ``False``: one linear map), ``M = N + Z``.

    Only the FFN slots reach the bank: ``Routing.mask`` marks them, and the layer dispatches those
    alone (:func:`moelab.experts.dispatch.dispatch_masked`); the copy and constant experts' weighted
    outputs are computed here (``Routing.direct``), the zero experts' not at all.  A token takes
    0 to K FFN experts.

    Loss: the heterogeneous load balance (:func:`moelab.losses.heterogeneous_balance_loss`) with
    ``η = 1`` for the FFN experts and ``τ`` (``tau``, 0.75) for the others, in
    ``Routing.losses["balance"]`` (``balance_coef``, 0.01).

    Not implemented: the gating residuals (each layer's router adds a linear map of the previous
    layer's logits), which need the previous layer's routing; and the code's multiplication of the
    experts' input by K (``moe_feature_no_mul_topk=False``), which the paper does not describe.

    Options:
        num_zero, num_copy, num_constant: how many of each (1, 1, 2 as the authors' code).
        tau: ``τ`` of the balance loss (0.75).
        two_layer_gate: the two-layer gate (default, the authors' configuration) or a linear one.
        init_std: std of the N(0, σ²) init of the gate's (first) matrix; default ``d^-1/2``.
        selection_bias: the aux-loss-free selection bias (DeepSeek-V3;
            :meth:`moelab.routers.Router.init_selection_bias`) over all ``N + Z`` experts, added to
            ``P`` for the top-K only.  Default off.
        bias_update_rate: its step γ (1e-3).
        renormalize: renormalise the K weights (after zeroing the zero experts') to sum to 1, as
            the authors' code; default ``K > 1`` (:func:`moelab.functional.resolve_renormalize`:
            at K = 1 a renormalised weight is the constant 1 and the task loss never reaches the
            gate, so there the weight is the chosen expert's probability, as Switch).
    """

    weights_sum_to_one = False  # a token whose K choices are all zero experts has weights 0
    variable_k = True

    config_class = MoEPPConfig

    def expert_rows(self, keep: Tensor) -> Tensor:
        """The kept FFN experts' gate rows and every zero-computation expert's (after the N)."""
        return torch.cat([keep, torch.arange(self.num_experts, self.num_all, device=keep.device)])

    def removal_problem(self, kept: int) -> str | None:
        if self.weight2 is not None:
            return "its two-layer gate's hidden width is 8·M, tied to the number of experts M"
        return softmax_over_all(self.renormalize)

    def kept_state(self, state: dict[str, Tensor], keep: Tensor) -> dict[str, Tensor]:
        """The gate's output rows (``weight2`` of the two-layer gate, else ``weight``) and the
        selection bias at :meth:`expert_rows`."""
        out = super().kept_state(state, keep)
        name = "weight2" if self.weight2 is not None else "weight"
        out[name] = out[name].index_select(0, self.expert_rows(keep).to(out[name].device))
        return out

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.renormalize = resolve_renormalize(o.renormalize, top_k)
        num_constant = o.num_constant
        self.num_zero, self.num_copy, self.num_constant = o.num_zero, o.num_copy, num_constant
        self.tau = o.tau
        self.two_layer_gate = o.two_layer_gate
        self.init_std = 1.0 / math.sqrt(d_model) if o.init_std is None else o.init_std
        m = self.num_all
        if top_k > m:
            raise ValueError(f"top_k={top_k!r} is not allowed; expected an integer in [1, {m}]")
        self.weight = nn.Parameter(torch.empty(8 * m if self.two_layer_gate else m, d_model))
        self.weight2 = nn.Parameter(torch.empty(m, 8 * m)) if self.two_layer_gate else None
        self.constants = nn.Parameter(torch.empty(num_constant, d_model))
        self.constant_gate = nn.Parameter(torch.empty(num_constant, 2, d_model))
        self.init_selection_bias(o.selection_bias, o.bias_update_rate)
        if o.selection_bias:  # over every expert the gate scores, the zero-computation ones too
            self.selection_bias, self.pending_load = torch.zeros(m), torch.zeros(m)
        self.reset_parameters()

    @property
    def num_all(self) -> int:
        """``M = N + Z``: every expert the router scores."""
        return self.num_experts + self.num_zero + self.num_copy + self.num_constant

    def expert_kinds(self) -> list[str]:
        """The kind of each of the ``M`` experts: ``"ffn"``, ``"constant"``, ``"copy"`` or ``"zero"``."""
        return (["ffn"] * self.num_experts + ["constant"] * self.num_constant + ["copy"] * self.num_copy
                + ["zero"] * self.num_zero)  # fmt: skip

    def reset_parameters(self) -> None:
        """The gate ``N(0, init_std²)`` (its second matrix ``U(±(8M)^-1/2)``, as ``nn.Linear``),
        ``v ~ N(0, 1)`` and ``W_c ~ U(±d^-1/2)`` (the authors' ``normal_`` and ``nn.Linear``)."""
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, dtype=self.weight.dtype) * self.init_std)
            if self.weight2 is not None:
                bound = 1.0 / math.sqrt(self.weight2.shape[1])
                self.weight2.uniform_(-bound, bound)
            self.constants.normal_()
            bound = 1.0 / math.sqrt(self.d_model)
            self.constant_gate.uniform_(-bound, bound)
        self.reset_selection_bias()

    def rule_options(self) -> dict:
        return {"num_zero": self.num_zero, "num_copy": self.num_copy, "num_constant": self.num_constant,
                "two_layer_gate": self.two_layer_gate, "selection_bias": self.selection_bias,
                "renormalize": self.renormalize}  # fmt: skip

    def logits(self, x: Tensor) -> Tensor:
        h = F.linear(x, self.weight)
        return F.linear(torch.tanh(h), self.weight2) if self.weight2 is not None else h

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        n, c, p = self.num_experts, self.num_constant, self.num_copy
        logits = self.logits(x)  # (T, M)
        probs = logits.softmax(dim=-1)
        indices = self.biased(probs.detach()).topk(self.top_k, dim=-1).indices
        top = probs.gather(1, indices)
        if self.training and self.selection_bias is not None and counts_this_forward():
            # in place, not `+=` (an attribute store, which compile refuses under activation checkpointing)
            self.pending_load.add_(expert_counts(indices, self.num_all).to(self.pending_load.dtype))
        top = top.masked_fill(indices >= n + c + p, 0.0)  # a zero expert's weight is 0
        weights = (
            top / top.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(top.dtype).tiny)
            if self.renormalize
            else top
        )
        mask = indices < n
        full = torch.zeros_like(probs).scatter(1, indices, weights)  # (T, M) each expert's weight
        direct = full[:, n + c : n + c + p].sum(-1, keepdim=True) * x
        if c:
            a = torch.einsum("td,cjd->tcj", x, self.constant_gate).softmax(dim=-1)  # (T, C, 2)
            outs = a[..., :1] * x.unsqueeze(1) + a[..., 1:] * self.constants  # (T, C, d)
            direct = direct + torch.einsum("tc,tcd->td", full[:, n : n + c], outs)
        eta = torch.ones(self.num_all, dtype=probs.dtype, device=probs.device)
        eta[n:] = self.tau
        losses = {"balance": heterogeneous_balance_loss(probs, indices, eta)}
        return Routing(indices=indices, weights=weights, probs=probs, logits=logits, losses=losses,
                       mask=mask, direct=direct)  # fmt: skip
