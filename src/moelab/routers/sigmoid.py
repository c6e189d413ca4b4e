"""Sigmoid routers: ``sigma-moe`` (σ-MoE), ``sharede-v3`` (DeepSeek-V3 normalised sigmoid) and ``smoe-sg``."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate
from ..functional import expert_counts, normalized_weights
from ..routing import Routing, RoutingContext
from .base import Router, register


@register("sigmoid")
class SigmoidRouter(Router):
    """``s = sigmoid(W x)``; the K experts with the largest ``s + b`` are chosen.

    * ``sigma-moe`` (Csordás et al. 2023; a CompeteSMoE (2025) baseline): weights are the chosen ``s``, NOT
      renormalised; during training each (token, expert) score is dropped from the selection
      with probability ``expert_dropout`` (0.05) before the top-K; regulariser: the entropy of the
      batch-mean ``softmax(W x)`` (``entropy_coef``, :func:`moelab.losses.mean_entropy_loss`).
    * ``sharede-v3`` (DeepSeek-V3; CompeteSMoE (2025) SharedE-V3; Ho (2025) "normalized sigmoid
      gating"): weights ``s / Σ s`` over the chosen (:func:`moelab.functional.normalized_weights`);
      a per-expert bias ``b`` is added for the selection only, and updated without any loss once
      per optimizer step (aux-loss-free balancing): ``b_i -= γ`` if expert i received more than
      the mean load of the step, ``b_i += γ`` if less (γ = ``bias_update_rate`` = 1e-3).  Each
      training forward only adds its expert counts to a pending load; the update is the step hook
      :meth:`on_step`, run by :meth:`moelab.RoutingContext.advance` after the optimizer step (the
      trainer and ``moelab.hf.trainer.MoETrainer`` call it), where the load is summed over ranks
      under torch.distributed so ``b`` stays identical everywhere.  So gradient accumulation
      updates ``b`` once with the load of all micro-batches, an activation-checkpointing
      recomputation (run by the backward pass) is not counted twice, and a forward loop without
      ``ctx.advance()`` never changes ``b``.  (Both public re-implementations forget to use ``b``:
      here it is used.)
    * ``smoe-sg`` (Ho (2025) SMoE-SG): the normalised weights of ``sharede-v3`` without the
      selection bias and without shared experts.

    DeepSeek-V3 options (its technical report, "node-limited routing"; as in transformers'
    ``DeepseekV3TopkRouter``): ``num_groups`` / ``topk_groups`` restrict each token to the
    ``topk_groups`` groups (of ``N / num_groups`` contiguous experts) with the largest sum of
    their two best ``s + b`` (group-limited routing); ``scale`` multiplies the final weights
    (``routed_scaling_factor``).
    The defaults (one group, scale 1) are the plain router above.

    ``Routing.probs`` is ``softmax(W x)`` (the router's distribution, for the regulariser and the
    metrics); the weights are sigmoid scores.
    """

    def __init__(
        self,
        d_model: int,
        num_experts: int,
        top_k: int,
        normalize: bool = False,
        selection_bias: bool = False,
        bias_update_rate: float = 1e-3,
        expert_dropout: float = 0.0,
        init_std: float | None = None,
        num_groups: int = 1,
        topk_groups: int | None = None,
        scale: float = 1.0,
    ) -> None:
        super().__init__(d_model, num_experts, top_k)
        _validate.positive_int("num_groups", num_groups)
        if num_experts % num_groups:
            raise ValueError(
                f"num_groups={num_groups!r} is not allowed; expected a divisor of num_experts={num_experts}"
            )
        topk_groups = num_groups if topk_groups is None else topk_groups
        _validate.int_in_range("topk_groups", topk_groups, 1, num_groups)
        if topk_groups * (num_experts // num_groups) < top_k:
            raise ValueError(
                f"topk_groups={topk_groups!r} is not allowed; its groups hold fewer than top_k={top_k} experts"
            )
        self.num_groups, self.topk_groups = num_groups, topk_groups
        self.scale = _validate.positive("scale", scale)
        std = 1.0 / math.sqrt(d_model) if init_std is None else _validate.positive("init_std", init_std)
        self.normalize = bool(normalize)
        self.bias_update_rate = _validate.non_negative("bias_update_rate", bias_update_rate)
        self.expert_dropout = _validate.probability("expert_dropout", expert_dropout)
        if self.expert_dropout >= 1:
            raise ValueError(f"expert_dropout={expert_dropout!r} is not allowed; expected a number in [0, 1)")
        self.init_std = std
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.register_buffer("selection_bias", torch.zeros(num_experts) if selection_bias else None)
        #: expert counts of the training forwards since the last step hook (not saved: a
        #: checkpoint is written after the hook has consumed them)
        self.register_buffer(
            "pending_load", torch.zeros(num_experts) if selection_bias else None, persistent=False
        )
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``W ~ N(0, init_std²)``, the selection bias and the pending load zero."""
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, dtype=self.weight.dtype) * self.init_std)
            for b in (self.selection_bias, self.pending_load):
                if b is not None:
                    b.zero_()

    def forward(
        self, x: Tensor, experts: nn.Module | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        logits = F.linear(x, self.weight)  # (T, N)
        scores = torch.sigmoid(logits)
        select = scores.detach()
        if self.selection_bias is not None:
            select = select + self.selection_bias
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
        if self.training and self.selection_bias is not None and _counts_this_forward():
            self.pending_load += expert_counts(indices, self.num_experts).to(self.pending_load.dtype)
        return Routing(indices=indices, weights=weights, probs=logits.softmax(dim=-1), logits=logits)

    def _apply(self, fn, *args, **kwargs):
        """Keep ``selection_bias`` (and the pending load) in at least float32 when the model is cast to bf16 / fp16: steps of
        γ = 1e-3 vanish in bfloat16 once ``|b| ≥ 0.5`` (DeepSeek-V3 keeps this bias in float32)."""
        super()._apply(fn, *args, **kwargs)
        for name in ("selection_bias", "pending_load"):
            b = getattr(self, name)
            if b is not None and b.dtype in (torch.float16, torch.bfloat16):
                setattr(self, name, b.float())
        return self

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
                "expert_dropout": self.expert_dropout}  # fmt: skip

    @torch.no_grad()
    def on_step(self, ctx: RoutingContext | None = None) -> None:
        """The step hook: move ``b`` by ``γ·sign(mean load − load)`` with the load of the step's
        training forwards (summed over ranks), then clear it.  Run on every rank."""
        if self.selection_bias is None:
            return
        load = self.pending_load.float()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(load)
        if self.bias_update_rate > 0:  # an empty load (no training forward) moves nothing
            self.selection_bias += self.bias_update_rate * torch.sign(load.mean() - load)
        self.pending_load.zero_()


def _counts_this_forward() -> bool:
    """False while the autograd engine recomputes a forward (activation checkpointing runs the
    forward again inside the backward pass): its tokens were counted by the first forward."""
    if torch.compiler.is_compiling():
        return True
    return torch._C._current_graph_task_id() == -1
