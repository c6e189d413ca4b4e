"""Sigmoid routers: ``sigma-moe`` (σ-MoE), ``sharede-v3`` (DeepSeek-V3 normalised sigmoid) and ``smoe-sg``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate
from ..config import Interval, Options, setting
from ..experts.protocol import Experts
from ..functional import normalized_weights, resolve_renormalize
from ..routing import Routing, RoutingContext
from .base import InitStdOptions, Router, ScaleOptions, SelectionBiasOptions, register


@dataclass(frozen=True)
class SigmoidConfig(InitStdOptions, ScaleOptions, SelectionBiasOptions):
    """The options of :class:`SigmoidRouter` (its docstring says what each does)."""

    normalize: bool | None = setting(
        False,
        help="weights s / Σ s over the chosen (DeepSeek-V3); None: when K > 1 (False: σ-MoE's raw s)",
        allowed=Options((True, False, None)),
    )
    expert_dropout: float = setting(
        0.0,
        help="probability of dropping a (token, expert) score from the selection in training (σ-MoE)",
        allowed=Interval(float, 0, 1, closed="left"),
    )
    num_groups: int = setting(
        1, help="groups of N / num_groups contiguous experts (DeepSeek-V3)", allowed=Interval(int, 1)
    )
    topk_groups: int | None = setting(
        None, help="the groups a token may route to, in [1, num_groups]; None: num_groups"
    )
    gate_bias: bool = setting(
        False,
        help="a learned per-expert bias inside the sigmoid, s = sigmoid(W x + β₀) (Ho (2025)'s gating)",
        allowed=Options((True, False)),
    )

    def check(self) -> None:
        if self.topk_groups is not None:
            _validate.int_in_range("topk_groups", self.topk_groups, 1, self.num_groups)


@register("sigmoid")
class SigmoidRouter(Router):
    """``s = sigmoid(W x)``; the K experts with the largest ``s + b`` are chosen.

    * ``sigma-moe`` (Csordás et al. 2023; a CompeteSMoE (2025) baseline): weights are the chosen ``s``, NOT
      renormalised; during training each (token, expert) score is dropped from the selection
      with probability ``expert_dropout`` (0.05) before the top-K; regulariser: the entropy of the
      batch-mean ``softmax(W x)`` (``entropy_coef``, :func:`moelab.losses.mean_entropy_loss`).
    * ``sharede-v3`` (DeepSeek-V3; CompeteSMoE (2025) SharedE-V3; Ho (2025) "normalized sigmoid
      gating"): weights ``s / Σ s`` over the chosen (:func:`moelab.functional.normalized_weights`;
      ``normalize=None``, the preset: for K > 1, and the score ``s`` itself at K = 1);
      a per-expert bias ``b`` is added for the selection only, and updated without any loss once
      per optimizer step (aux-loss-free balancing): ``b_i -= γ`` if expert i received more than
      the mean load of the step, ``b_i += γ`` if less (γ = ``bias_update_rate`` = 1e-3).  The
      mechanism is every router's (:meth:`moelab.routers.Router.init_selection_bias`; the step hook
      :meth:`on_step` sums the load over ranks, so ``b`` stays identical everywhere).  (Both public
      re-implementations forget to use ``b``: here it is used.)
    * ``smoe-sg`` (Ho (2025) SMoE-SG): the normalised weights of ``sharede-v3`` without the
      selection bias and without shared experts.

    DeepSeek-V3 options (its technical report, "node-limited routing"; as in transformers'
    ``DeepseekV3TopkRouter``): ``num_groups`` / ``topk_groups`` restrict each token to the
    ``topk_groups`` groups (of ``N / num_groups`` contiguous experts) with the largest sum of
    their two best ``s + b`` (group-limited routing); ``scale`` multiplies the final weights
    (``routed_scaling_factor``).
    The defaults (one group, scale 1) are the plain router above.

    ``gate_bias=True`` adds a learned per-expert bias β₀ inside the sigmoid, ``s = sigmoid(W x +
    β₀)``: the normalised sigmoid gating of Ho (2025) has one (DeepSeek-V3 and σ-MoE have none; it
    is distinct from the selection bias, which only moves the choice).  Initialised at zero.

    ``Routing.probs`` is ``softmax(W x)`` (the router's distribution, for the regulariser and the
    metrics); the weights are sigmoid scores.
    """

    gate = "sigmoid"

    config_class = SigmoidConfig
    expert_tensors = ("weight",)

    def removal_problem(self, kept: int) -> str | None:
        if self.num_groups > 1:  # groups are contiguous runs of N / num_groups experts
            return f"its experts form num_groups={self.num_groups} groups that removing experts would break"
        return None

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        num_groups = o.num_groups
        if num_experts % num_groups:
            raise ValueError(
                f"num_groups={num_groups!r} is not allowed; expected a divisor of num_experts={num_experts}"
            )
        topk_groups = num_groups if o.topk_groups is None else o.topk_groups  # in [1, num_groups]: check()
        if topk_groups * (num_experts // num_groups) < top_k:
            raise ValueError(
                f"topk_groups={topk_groups!r} is not allowed; its groups hold fewer than top_k={top_k} experts"
            )
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.scale = o.scale
        #: ``s / Σ s`` over the chosen; ``None`` (the ``sharede-v3`` preset): when K > 1 only, since at
        #: K = 1 the normalised weight is the constant 1 and the task loss never reaches the router
        #: (Switch Transformer weights its one expert by its score)
        self.normalize = resolve_renormalize(o.normalize, top_k)
        self.expert_dropout = o.expert_dropout
        self.init_std = 1.0 / math.sqrt(d_model) if o.init_std is None else o.init_std
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.gate_bias = nn.Parameter(torch.zeros(num_experts)) if o.gate_bias else None
        self.init_selection_bias(o.selection_bias, o.bias_update_rate)  # the one mechanism (Router)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``W ~ N(0, init_std²)``; the gate bias, the selection bias and the pending load zero."""
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, dtype=self.weight.dtype) * self.init_std)
            if self.gate_bias is not None:
                self.gate_bias.zero_()
        self.reset_selection_bias()

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        logits = F.linear(x, self.weight, self.gate_bias)  # (T, N)
        scores = torch.sigmoid(logits)
        select = self.biased(scores.detach())
        if self.training and self.expert_dropout > 0:
            select = select.masked_fill(torch.rand_like(select) < self.expert_dropout, float("-inf"))
        if self.topk_groups < self.num_groups:
            select = self._limit_groups(select)
        indices = select.topk(self.top_k, dim=-1).indices  # (T, K)
        weights = scores.gather(1, indices)
        if self.normalize:
            weights = normalized_weights(weights)
        if self.scale != 1.0:
            weights = weights * self.scale
        self.count_load(indices)
        return Routing(indices=indices, weights=weights, probs=logits.softmax(dim=-1), logits=logits)

    def weights_at(self, routing: Routing, indices: Tensor) -> Tensor:
        """The sigmoid scores of the live logits at ``indices``, normalised and scaled as
        :meth:`forward` weighs its own choice."""
        weights = torch.sigmoid(routing.logits).gather(1, indices)
        if self.normalize:
            weights = normalized_weights(weights)
        return weights * self.scale if self.scale != 1.0 else weights

    def _limit_groups(self, select: Tensor) -> Tensor:
        """Keep the ``topk_groups`` groups with the largest sum of their top-2 scores (DeepSeek-V3)."""
        T = select.shape[0]
        grouped = select.view(T, self.num_groups, -1)  # (T, G, N/G)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(-1)  # (T, G)
        keep = group_scores.topk(self.topk_groups, dim=-1).indices
        mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)  # (T, G)
        return grouped.masked_fill(~mask.unsqueeze(-1), float("-inf")).view(T, -1)

    @property
    def weights_sum_to_one(self) -> bool:  # σ-MoE keeps the raw sigmoid scores
        return self.normalize

    def rule_options(self) -> dict[str, Any]:
        return {"normalize": self.normalize, "scale": self.scale, "num_groups": self.num_groups,
                "topk_groups": self.topk_groups, "selection_bias": self.selection_bias,
                "expert_dropout": self.expert_dropout, "gate_bias": self.gate_bias is not None}  # fmt: skip
