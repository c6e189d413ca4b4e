"""``stablemoe``: learn a balanced routing, distil it into a light router, then freeze it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Interval, setting
from ..experts.protocol import Experts
from ..functional import resolve_renormalize, topk_gate
from ..routing import Routing, RoutingContext
from .base import (
    RenormalizeOptions,
    Router,
    SelectionBiasOptions,
    join_dependences,
    register,
    softmax_over_all,
)


@dataclass(frozen=True)
class StableConfig(RenormalizeOptions, SelectionBiasOptions):
    """The options of :class:`StableRouter` (its docstring says what each does)."""

    distill_dim: int = setting(50, help="width of the light router", allowed=Interval(int, 1))
    switch_fraction: float = setting(
        0.1, help="stage 2 starts at this fraction of ctx.total_steps", allowed=Interval(float, 0, 1)
    )
    switch_step: int | None = setting(
        None, help="an explicit switch step (overrides switch_fraction)", allowed=(Interval(int, 0), None)
    )
    init_gain: float = setting(
        0.1, help="orthogonal-init gain of the centroids", allowed=Interval(float, 0, closed="neither")
    )


@register("stable")
class StableRouter(Router):
    """StableMoE (Dai et al. 2022; a baseline of CompeteSMoE (2024), §5).

    * Stage 1 (steps ``< switch_step``): logits ``h_i = xᵀ c_i`` with expert centroids ``c``
      (orthogonal init, gain 0.1), trained with the balance loss; at the same time a light router
      is distilled from it: ``L_distill = CE(light(x), argmax_i h_i)``, computed on ``x.detach()``
      so that it trains the light router only.
    * Stage 2: routing by the light router, frozen (no gradient reaches it, the weights are
      constants), so every token keeps its experts for the rest of training.

    Differences from the paper, on purpose: the paper's light router reads the token's word
    embedding (dim 50); a layer sees only hidden states, so here it is a 50-dim projection of the
    layer input.  The paper's top-1 output ``σ(s)·E(h)`` becomes, for top-K, the standard
    ``softmax(TopK(h))`` weighted sum (docs/methods.md, ``stablemoe``).

    Options:
        distill_dim: width of the light router (50).
        switch_fraction: stage 2 starts at this fraction of ``ctx.total_steps`` (0.1: 6k of 60k).
        switch_step: an explicit switch step (overrides ``switch_fraction``).
        init_gain: orthogonal-init gain of the centroids (0.1).
        selection_bias: carry the aux-loss-free selection bias of DeepSeek-V3 (added to
            ``softmax(h)`` for the choice only, moved once per optimizer step towards the mean
            load; :meth:`moelab.routers.Router.init_selection_bias`); default off.
        bias_update_rate: its step γ (1e-3, DeepSeek-V3).
        renormalize: the chosen weights renormalised (``softmax(TopK_-inf(h))``, ``True``) or the
            softmax over all N at the chosen (``False``, Switch Transformer); default ``None``:
            renormalised when K > 1 (StableMoE's own top-1 output is ``σ(s)·E(h)``, a weight with a gradient; at K = 1 a renormalised weight is the constant 1, which no
            task loss can train; :func:`moelab.functional.resolve_renormalize`).

    Without a context (or without ``total_steps`` and ``switch_step``) the router stays in stage 1.
    The stage is a function of the context, so :func:`moelab.save` records the context and
    :func:`moelab.load` attaches it again: a model loaded from a run routes as it did at the end
    of training (stage 2 once the run passed the switch), not with the stage-1 centroids.
    """

    loss_names = ("distill",)

    config_class = StableConfig
    expert_tensors = ("centroids", "light_centroids")

    def removal_problem(self, kept: int) -> str | None:
        return softmax_over_all(self.renormalize)

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.init_selection_bias(o.selection_bias, o.bias_update_rate)
        self.renormalize = resolve_renormalize(o.renormalize, top_k)
        distill_dim = o.distill_dim
        self.switch_fraction = o.switch_fraction
        self.switch_step = o.switch_step
        self.init_gain = o.init_gain
        self.centroids = nn.Parameter(torch.empty(num_experts, d_model))
        nn.init.orthogonal_(self.centroids, gain=self.init_gain)
        self.light_proj = nn.Linear(d_model, distill_dim, bias=False)
        self.light_centroids = nn.Parameter(torch.randn(num_experts, distill_dim) / distill_dim**0.5)

    def reset_parameters(self) -> None:
        """The centroids orthogonal (gain ``init_gain``), the light router as at construction."""
        nn.init.orthogonal_(self.centroids, gain=self.init_gain)
        self.light_proj.reset_parameters()
        with torch.no_grad():
            d = self.light_centroids.shape[1]
            self.light_centroids.copy_(torch.randn(self.light_centroids.shape) / d**0.5)
        self.reset_selection_bias()

    @property
    def weights_sum_to_one(self) -> bool:
        return self.renormalize

    def step_dependence(self) -> str | None:
        when = (
            f"ctx.step={self.switch_step}"
            if self.switch_step is not None
            else (f"{self.switch_fraction:g} of ctx.total_steps")
        )
        own = (
            f"it switches from stage 1 to its frozen light router (stage 2) at {when} (StableMoE); until "
            "then it stays in stage 1"
        )
        return join_dependences(own, super().step_dependence())

    def context_problem(self, ctx: RoutingContext | None) -> str | None:
        problem = super().context_problem(ctx)
        if problem is None and ctx is not None and self.switch_step is None and ctx.total_steps is None:
            return "the RoutingContext has no total_steps"
        return problem

    def stage(self, ctx: RoutingContext | None) -> int:
        """1 (learn and distil) or 2 (frozen light router) at the context's step.  With a context
        that drives it (:func:`moelab.attach`), the stage :meth:`on_step_change` derived when the
        step was set: a compiled forward guards on the stage, not on the step (two compilations
        in a run, one per stage)."""
        if ctx is None:
            return 1
        return self.step_value(ctx, "stage", lambda: self._stage_at(ctx))

    def on_step_change(self, ctx: RoutingContext) -> None:
        self.keep_step_values(ctx, stage=self._stage_at(ctx))

    def _stage_at(self, ctx: RoutingContext) -> int:
        switch = self.switch_step
        if switch is None:
            if ctx.total_steps is None:
                return 1
            switch = round(self.switch_fraction * ctx.total_steps)
        return 2 if ctx.step >= switch else 1

    def light_logits(self, x: Tensor) -> Tensor:
        return F.linear(self.light_proj(x), self.light_centroids)

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        if self.stage(ctx) == 2:
            with torch.no_grad():
                logits = self.light_logits(x)
            weights, indices, probs = topk_gate(logits, self.top_k, self.renormalize, self.selection_bias)
            self.count_load(indices)
            return Routing(indices=indices, weights=weights, probs=probs, logits=logits)
        logits = F.linear(x, self.centroids)  # (T, N)
        weights, indices, probs = topk_gate(logits, self.top_k, self.renormalize, self.selection_bias)
        self.count_load(indices)
        distill = F.cross_entropy(self.light_logits(x.detach()), logits.detach().argmax(dim=-1))
        return Routing(
            indices=indices,
            weights=weights,
            probs=probs,
            logits=logits,
            losses={"distill": distill},
        )
