"""Linear top-K softmax routers: ``smoe``, ``smoe-fixed``, ``smoe-dropout``, ``sharede-v2``."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _validate
from ..config import Options, setting
from ..experts.protocol import Experts
from ..functional import resolve_renormalize, topk_gate, topk_gate_weights_at
from ..routing import Routing, RoutingContext
from .base import (
    InitStdOptions,
    RenormalizeOptions,
    Router,
    ScaleOptions,
    SelectionBiasOptions,
    join_dependences,
    register,
    softmax_over_all,
)


@dataclass(frozen=True)
class TopKConfig(InitStdOptions, RenormalizeOptions, ScaleOptions, SelectionBiasOptions):
    """The options of :class:`TopKRouter` (its docstring says what each does)."""

    frozen: bool = setting(False, help="keep W at its random init (SMoE-Fixed, SMoE-Dropout)")
    k_max: int | str | None = setting(
        None,
        help="K grows linearly from top_k to k_max over ctx.total_steps ('all': num_experts; in [top_k, N])",
        allowed=(int, Options(("all",)), None),
    )
    eval_k: int | None = setting(
        None, help="K in evaluation mode, in [1, N]; None: the K the schedule reached"
    )


@register("topk")
class TopKRouter(Router):
    """``h = W x``, ``w = softmax(TopK_-inf(h))`` — the SMoE router (CompeteSMoE (2024) eq. 1-2; CompeteSMoE
    (2025) eq. 1).

    Options:
        init_std: std of the N(0, σ²) init of ``W (N, d)``; default ``d^-1/2`` (the LM code of
            CompeteSMoE (2024)); the VLM setting of CompeteSMoE (2025) uses 0.02.
        frozen: keep ``W`` at its random init for the whole run (SMoE-Fixed, CompeteSMoE (2024) §5 baselines,
            after SMoE-Dropout, Chen et al. 2023).
        k_max: if set, K grows linearly from ``top_k`` at step 0 to ``k_max`` at
            ``ctx.total_steps`` ("self-slimmable" SMoE-Dropout; the reference grows 8 → 16 with
            16 experts); ``"all"`` means ``num_experts``.  Without a context, or without
            ``total_steps``, K stays ``top_k``.
        eval_k: K in evaluation mode.  ``None`` (default): the K the schedule has reached at the
            context's step — SMoE-Dropout evaluates with the experts it trained with, so a model
            at the end of training routes to all ``k_max`` experts (the test figures of
            ``smoe-dropout`` are those of its final, widest routing); an integer fixes K for
            evaluation (SMoE-Dropout's "self-slimmable" inference with fewer experts).
        renormalize: ``True``: the softmax over the K chosen logits.  ``False``: the softmax over
            all N experts evaluated at the chosen K, weights summing to less than 1 (Switch
            Transformer; Qwen2-MoE / Qwen3-MoE / OLMoE with ``norm_topk_prob=False``).  ``None``
            (default): ``True`` when K > 1, ``False`` at K = 1, where a renormalised weight is the
            constant 1 and the task loss would never reach the router
            (:func:`moelab.functional.resolve_renormalize`); with ``k_max`` (a K that grows, over a
            frozen router that has nothing to learn) ``True`` at every K, as SMoE-Dropout.
        selection_bias: carry the aux-loss-free selection bias of DeepSeek-V3 (added to
            ``softmax(h)`` for the choice only, moved once per optimizer step towards the mean
            load; :meth:`moelab.routers.Router.init_selection_bias`); default off.
        bias_update_rate: its step γ (1e-3, DeepSeek-V3).
        scale: multiplies the final weights (DeepSeek-V2's ``routed_scaling_factor``; kept when a
            DeepSeek-V3 layer is switched to ``smoe`` by :func:`moelab.set_method`); default 1.
    """

    config_class = TopKConfig
    expert_tensors = ("weight",)

    def removal_problem(self, kept: int) -> str | None:
        for name in ("k_max", "eval_k"):  # k_max="all" follows the experts
            k = getattr(self.options, name)
            if isinstance(k, int) and k > kept:
                return f"its {name}={k} exceeds the {kept} kept experts"
        return softmax_over_all(self.renormalize)

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.init_selection_bias(o.selection_bias, o.bias_update_rate)
        k_max = num_experts if o.k_max == "all" else o.k_max
        if k_max is not None:
            _validate.int_in_range("k_max", k_max, top_k, num_experts)
        self.k_max = k_max
        self.eval_k = None if o.eval_k is None else _validate.int_in_range("eval_k", o.eval_k, 1, num_experts)
        self.frozen = o.frozen
        #: whether the chosen weights are renormalised (the option resolved for this router's K)
        self.renormalize = resolve_renormalize(o.renormalize, top_k if k_max is None else max(top_k, 2))
        self.scale = o.scale
        self.init_std = 1.0 / math.sqrt(d_model) if o.init_std is None else o.init_std
        weight = torch.empty(num_experts, d_model)
        if self.frozen:  # a buffer: no optimizer or requires_grad_(True) can unfreeze it
            self.register_buffer("weight", weight)
        else:
            self.weight = nn.Parameter(weight)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``W ~ N(0, init_std²)`` (also after ``to_empty`` from the meta device)."""
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, dtype=self.weight.dtype) * self.init_std)
        self.reset_selection_bias()

    def rule_options(self) -> dict[str, Any]:
        return {"renormalize": self.renormalize, "scale": self.scale, "frozen": self.frozen,
                "k_max": self.k_max, "eval_k": self.eval_k,
                "selection_bias": self.selection_bias}  # fmt: skip

    @property
    def weights_sum_to_one(self) -> bool:  # Switch's K = 1 weight is the chosen expert's probability
        return self.renormalize

    def step_dependence(self) -> str | None:
        grows = self.k_max is not None and self.k_max != self.top_k
        own = (
            f"its K grows from top_k={self.top_k} to k_max={self.k_max} with ctx.step / ctx.total_steps "
            f"(SMoE-Dropout); without them it stays {self.top_k}"
        )
        return join_dependences(own if grows else None, super().step_dependence())

    def context_problem(self, ctx: RoutingContext | None) -> str | None:
        problem = super().context_problem(ctx)
        grows = self.k_max is not None and self.k_max != self.top_k
        if problem is None and ctx is not None and grows and ctx.total_steps is None:
            return "the RoutingContext has no total_steps"
        return problem

    def current_k(self, ctx: RoutingContext | None) -> int:
        """K at the context's step (SMoE-Dropout's linear growth), else ``top_k``; in evaluation
        mode ``eval_k`` when set.  With a context that drives it (:func:`moelab.attach`), K is the
        one :meth:`on_step_change` derived when the step was set: a compiled forward guards on K,
        not on the step (one compilation per distinct K, at most ``k_max - top_k + 1``)."""
        if not self.training and self.eval_k is not None:
            return self.eval_k
        if self.k_max is None or ctx is None:
            return self.top_k
        return self.step_value(ctx, "k", lambda: self._k_at(ctx))

    def _k_at(self, ctx: RoutingContext) -> int:
        if self.k_max is None or ctx.progress is None:
            return self.top_k
        return self.top_k + round((self.k_max - self.top_k) * ctx.progress)

    def on_step_change(self, ctx: RoutingContext) -> None:
        self.keep_step_values(ctx, k=self._k_at(ctx))

    def weights_at(self, routing: Routing, indices: Tensor) -> Tensor:
        """:func:`moelab.functional.topk_gate_weights_at` of the live scores, times ``scale``."""
        weights = topk_gate_weights_at(routing.logits, routing.probs, indices, self.renormalize)
        return weights * self.scale if self.scale != 1.0 else weights

    def logits(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        logits = self.logits(x)  # (T, N)
        weights, indices, probs = topk_gate(
            logits, self.current_k(ctx), self.renormalize, self.selection_bias
        )
        self.count_load(indices)
        if self.scale != 1.0:
            weights = weights * self.scale
        return Routing(indices=indices, weights=weights, probs=probs, logits=logits)
