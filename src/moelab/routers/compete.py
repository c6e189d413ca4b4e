"""Competition routing: ``competition`` (pure) and ``competesmoe`` (a router that learns it on a
schedule).  Every expert runs, each expert's affinity is its own response ``s_i = mean(κ(g_i(x)))``
(or ``‖g_i(x)‖₂``), the K strongest win and produce the output (CompeteSMoE (2024) §3.1;
CompeteSMoE (2025) §2.2); the routers hand the layer the winners' outputs (``Routing.outputs``), and
the option ``grad_path`` chooses how those outputs get their gradient.  docs/methods.md
("Competition") gives the formulas, the gradient paths and their cost in expert passes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from ..config import Interval, Options, setting
from ..experts.protocol import Experts
from ..functional import COMPETITION_ACTIVATIONS, competition_affinity
from ..losses import (
    affinity_distillation_loss,
    competition_router_loss,
    distillation_loss,
    diversity_loss,
    switch_balance_loss,
)
from ..routing import Routing, RoutingContext
from .base import Router, build_router, join_dependences, register

__all__ = [
    "CompeteSMoEConfig",
    "CompeteSMoERouter",
    "CompetitionConfig",
    "CompetitionOptions",
    "CompetitionRouter",
    "compete",
]

WEIGHTINGS = ("normalized", "softmax")
GRAD_PATHS = ("winners", "all")
MODES = ("compete", "v1", "dense", "router")


class _StraightThrough(torch.autograd.Function):
    """``forward``'s values; the gradient reaches ``forward`` unchanged and ``gradient`` scaled."""

    @staticmethod
    def forward(ctx, forward: Tensor, gradient: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return forward.clone()

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None]:  # type: ignore[override]
        return grad, grad * ctx.scale, None


def straight_through_weights(forward: Tensor, gradient: Tensor, scale: float) -> Tensor:
    """``forward``'s values exactly, with ``scale`` × the gradient that ``gradient`` would receive
    in its place added to ``gradient``'s: CompeteSMoE (2024) eq. 5's α·NLL for a router that is off
    the output path (``router_nll``)."""
    return _StraightThrough.apply(forward, gradient, scale)


def _choose(outputs: Tensor, k: int, kappa: str, reduce: str) -> tuple[Tensor, Tensor]:
    """Winners ``TopK(s)`` of all experts' outputs ``(t, N, d)`` and the affinities ``s (t, N)``."""
    s = competition_affinity(outputs, kappa, reduce)
    return s.topk(k, dim=-1).indices, s


def compete(
    x: Tensor,
    experts: Experts,
    k: int,
    kappa: str = "softplus",
    reduce: str = "mean",
    weighting: str = "normalized",
    grad_path: str = "winners",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The competition mechanism (CompeteSMoE (2024) §3.1; CompeteSMoE (2025) §2.2, eq. 4-5).

    1. ``g_i(x)`` for all N experts; 2. ``s_i = mean(κ(g_i(x)))`` (``reduce="mean"``,
    CompeteSMoE (2025)) or ``‖g_i(x)‖₂`` (``reduce="norm"``, CompeteSMoE (2024)) via
    :func:`moelab.functional.competition_affinity`;
    3. winners ``I_C = TopK(s)``; weights ``TopK_0(s) / Σ TopK_0(s)`` (``weighting="normalized"``,
    CompeteSMoE (2025)) or ``softmax(TopK_-inf(s))`` (``"softmax"``, CompeteSMoE (2024)).

    Returns:
        ``(winners (T, K), weights (T, K), outputs (T, K, d), scores (T, N))``: winners sorted by
        decreasing affinity; the weights, the outputs and the winners' entries of ``scores``
        carry gradients to the winners (the other entries are constants: non-winners get no
        gradient on either path).
    """
    if grad_path == "all" or kappa == "softmax":
        if torch.is_grad_enabled():
            all_out = experts.forward_all(x)  # (T, N, d), differentiable
            s = competition_affinity(all_out, kappa, reduce)
            winners = s.detach().topk(k, dim=-1).indices
            outputs = all_out.gather(1, winners.unsqueeze(-1).expand(-1, -1, all_out.shape[-1]))
            win_scores = s.gather(1, winners)
            scores = s.detach().scatter(1, winners, win_scores)
            return winners, _weights(win_scores, weighting), outputs, scores
    winners, outputs, scores = experts.forward_winners(x, lambda y: _choose(y, k, kappa, reduce))
    # the affinity of a winner depends on its own output only (for exp the shift is the top-1
    # winner's, the same as over all N): recomputed from the outputs, with autograd
    if torch.is_grad_enabled():
        win_scores = competition_affinity(outputs, kappa, reduce)
        scores = scores.detach().scatter(1, winners, win_scores.to(scores.dtype))
    else:
        win_scores = scores.gather(1, winners)
    return winners, _weights(win_scores, weighting), outputs, scores


def _weights(win_scores: Tensor, weighting: str) -> Tensor:
    if weighting == "normalized":
        return win_scores / win_scores.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(win_scores.dtype).tiny)
    return win_scores.softmax(dim=-1)


@dataclass(frozen=True)
class CompetitionOptions:
    """The options of the competition (:func:`compete`), shared by ``competition`` and ``competesmoe``."""

    kappa: str = setting(
        "softplus",
        help="κ of s_i = mean(κ(g_i(x))) (reduce='mean')",
        allowed=Options(COMPETITION_ACTIVATIONS),
    )
    reduce: str = setting(
        "mean",
        help="the affinity: 'mean' of κ(g_i(x)) or the L2 'norm' of g_i(x)",
        allowed=Options(("mean", "norm")),
    )
    weighting: str = setting(
        "normalized",
        help="the winners' weights: TopK_0(s)/Σ or softmax(TopK(s))",
        allowed=Options(WEIGHTINGS),
    )
    grad_path: str = setting(
        "winners", help="which experts' outputs carry the gradient", allowed=Options(GRAD_PATHS)
    )


@dataclass(frozen=True)
class CompetitionConfig(CompetitionOptions):
    """The options of :class:`CompetitionRouter`: the competition's."""


@dataclass(frozen=True)
class CompeteSMoEConfig(CompetitionOptions):
    """The options of :class:`CompeteSMoERouter` (its docstring says what each does)."""

    base: Router | None = setting(
        None, help="the base router, built (moelab.methods.build_method_router builds it); None: smoe's"
    )
    base_method: str = setting("smoe", help="the base's method name, for messages and repr")
    mode: str = setting("compete", help="what a competition step does", allowed=Options(MODES))
    alpha: float = setting(0.1, help="α of the winner term of L_D", allowed=Interval(float, 0))
    diversity: str = setting(
        "frobenius", help="the diversity loss's form", allowed=Options(("frobenius", "cosine"))
    )
    distill: str = setting(
        "paper",
        help="the distillation: L_D of the paper or the authors' 'mse'",
        allowed=Options(("paper", "mse")),
    )
    competition_balance: str = setting(
        "affinity",
        help="the balance term on competition steps",
        allowed=Options(("affinity", "router", "off")),
    )
    task_gradient: bool = setting(True, help="the task loss trains the router whenever it routes")
    router_nll: float = setting(
        0.0,
        help="α of CompeteSMoE (2024) eq. 5's α·NLL term (mode 'compete' or 'v1')",
        allowed=Interval(float, 0),
    )

    def check(self) -> None:
        if self.router_nll and self.mode not in ("compete", "v1"):
            raise ValueError(
                f"router_nll={self.router_nll!r} is not allowed with mode={self.mode!r}; the router is on the "
                "output path there: router_nll applies to mode='compete' or 'v1'"
            )


# torch.compiler.disable, with torch._dynamo imported at the first call rather than with moelab (its
# import time counts against every process start: docs/performance.md, "torch._dynamo loaded on first use")
@torch._disable_dynamo
def _schedule_active(ctx: RoutingContext, router: Router) -> bool:
    """``ctx.schedule.active(layer, ctx.step)``, run outside torch.compile: the lookup is Python on a
    step that changes every call, so tracing it would recompile every step.  The router's
    ``layer_index`` is read here too, outside the traced code: read there it would become a guard, and
    every layer would compile its own graph (past 8 layers, the recompile limit).  Under compile this
    is one graph break, and the code after it is compiled once per branch (competes or not)."""
    return bool(ctx.schedule.active(router.layer_index, ctx.step))


def _say_competition_breaks_the_graph(_: Any = None) -> None:
    """Said by torch.compile's tracer where it meets the schedule lookup (``comptime``: at trace time,
    so also where the trace of a checkpointed block is given up and the block runs eagerly)."""
    warnings.warn(
        "CompeteSMoE under torch.compile: whether a layer competes is looked up outside the graph "
        "(a graph break at every step) and a competition step does not compile as one graph (the "
        "winners' expert backward loops over the experts on the host); inside activation checkpointing "
        "the checkpointed block therefore runs eagerly",
        stacklevel=2,
    )


@register("competition")
class CompetitionRouter(Router):
    """Pure competition (CompeteSMoE (2024) §3.1; CompeteSMoE (2025) §2.2): no learned router.

    Every expert runs on every token and the K with the strongest response produce the output, in
    training and evaluation alike.

    Options:
        kappa: κ of ``s_i = mean(κ(g_i(x)))``: ``softplus`` (CompeteSMoE (2025) default), ``silu``,
            ``sigmoid``, ``relu``, ``softmax``, ``exp`` (computed stably; CompeteSMoE (2025) App. C.3).
        reduce: ``"mean"`` (CompeteSMoE (2025) eq. 4) or ``"norm"`` (``s_i = ‖g_i(x)‖₂``,
            CompeteSMoE (2024) §3.1; CompeteSMoE (2025) App. C.4).
        weighting: ``"normalized"`` (``TopK_0(s)/Σ TopK_0(s)``, CompeteSMoE (2025)) or ``"softmax"``
            (``softmax(TopK(s))``, CompeteSMoE (2024)).  The normalised weights assume positive
            affinities (softplus, sigmoid, exp, softmax, norm); with ``silu`` or ``relu`` a token
            whose winners all score ≤ 0 gets meaningless weights (zero for relu): use
            ``"softmax"`` there.
        grad_path: ``"winners"`` or ``"all"`` (module docstring).

    ``Routing.probs`` and ``logits`` are ``None`` (there is no router distribution); the balance
    and z losses therefore do not apply.
    """

    config_class = CompetitionConfig

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.kappa, self.reduce, self.weighting, self.grad_path = o.kappa, o.reduce, o.weighting, o.grad_path

    def forward(self, x: Tensor, experts: Experts, ctx: RoutingContext | None = None) -> Routing:
        winners, weights, outputs, _ = compete(
            x, experts, self.top_k, self.kappa, self.reduce, self.weighting, self.grad_path
        )
        return Routing(indices=winners, weights=weights, outputs=outputs)


@register("competesmoe")
class CompeteSMoERouter(Router):
    """A base router trained on a schedule from the competition: one class, three ``mode`` presets.

    CompeteSMoE (2025) §2.3-2.4; CompeteSMoE (2024) §3.2-3.3; CompeteSMoE (2025) Table 10's
    DenseMoE ablation.

    Every forward runs the base router (``base``: any method name whose router has no losses of
    its own; default ``smoe``).  In evaluation, without a context, or when the context's schedule
    says this layer does not compete at this step, its routing is returned unchanged.  When
    ``ctx.schedule.active(layer_index, ctx.step)`` in training:

    * ``mode="compete"`` (``competesmoe``, CompeteSMoE (2025)): the output goes through the
      competition winners ``I_C`` with weights ``s_C = TopK_0(s)/Σ TopK_0(s)``; losses ``distill`` =
      :func:`moelab.losses.distillation_loss` ``(s_R, s_C)`` with ``s_R = softmax(h)`` the base
      router's distribution (weight ``distill_coef`` = γ = 0.01, ``alpha`` = α = 0.1) and
      ``diversity`` = :func:`moelab.losses.diversity_loss` of the winners' outputs (weight
      ``diversity_coef`` = β = 0.005).  The balance loss counts the winners' load (the tokens the
      experts actually received) against the router's mean probabilities.
    * ``mode="v1"`` (``competesmoe-v1``, CompeteSMoE (2024)): affinity ``‖g_i(x)‖₂``, weights
      ``softmax(TopK(s))``, loss ``distill`` = :func:`moelab.losses.competition_router_loss`
      (CompeteSMoE (2024) eq. 3), weight ``distill_coef`` = α, as the authors' public code
      (eq. 5's ``α·NLL`` term: ``router_nll``; docs/methods.md says why).  The
      schedule is normally a :class:`moelab.schedules.CoinFlipSchedule` (λ = 0.05).
    * ``mode="dense"`` (``densemoe``, CompeteSMoE (2025) Table 10 rows 3-4): all N experts
      contribute, weighted by the router's softmax over all N; the balance loss keeps the
      router's own top-K selection; ``diversity`` is the diversity loss of the outputs of the
      router's top-K (row 4 gives it a weight: ``--opt diversity_coef=0.005``; row 3 none).
    * ``mode="router"`` (CompeteSMoE (2025) Table 10 row 2, "diversity loss without
      competition"): the router's own top-K produce the output, and ``diversity`` is the
      diversity loss of their outputs (every expert runs with autograd on these steps).

    On competition steps the router receives no task-loss gradient (it is not on the output path);
    it learns from ``distill``, as in the authors' public code.  The task loss trains it on every
    other step (CompeteSMoE (2025) §2.3, C.2); ``task_gradient=False`` turns that off
    (CompeteSMoE (2025) Table 11, "competition policy only").  ``router_nll`` is CompeteSMoE (2024)
    eq. 5's α·NLL read literally (docs/methods.md, ``competesmoe-v1``).

    Options:
        base: the base router, built (default: a plain top-K softmax router, ``smoe``'s).  A
            layer builds it from the method name in its ``base`` option and ``base_options``
            (:func:`moelab.methods.build_method_router`).  Shared experts (``num_shared``) are a
            layer option.
        base_method: the base's method name, for messages and ``repr``.
        mode: ``"compete"``, ``"v1"`` or ``"dense"``.
        kappa, reduce, weighting, grad_path: the competition (:class:`CompetitionRouter`).
        alpha: α of the winner term of L_D (0.1, CompeteSMoE (2025) Table 20).
        diversity: ``"frobenius"`` (CompeteSMoE (2025) eq. 2) or ``"cosine"``
            (:func:`moelab.losses.diversity_loss`).
        distill: ``"paper"`` — L_D of CompeteSMoE (2025) eq. 1 (:func:`moelab.losses.distillation_loss`)
            — or ``"mse"`` — the authors' public code: MSE between the router's softmax and the
            softmax of the affinities over all N (:func:`moelab.losses.affinity_distillation_loss`).
        competition_balance: the balance term on competition steps (``mode="compete"``):
            ``"affinity"`` (default, the authors' public code): the Switch balance loss of the
            competition's own distribution ``softmax(s)`` with the winners' load, weighted by
            ``competition_balance_coef``; it balances the experts' responses (its gradient reaches
            the winners' experts through their affinities) and sends no gradient to the router — on a competition step the router learns from the
            distillation alone (its balance and z terms are not applied there);
            ``"router"``: the router's probabilities with the winners' load under
            ``balance_coef``, an ablation (it pushes the router away from the experts the
            competition chose, against the distillation); ``"off"``: no balance term and no
            router term but the distillation on competition steps.
        task_gradient: ``True`` (default): the task loss trains the router whenever it routes;
            ``False``: never (its weights are detached: it learns from the competition's
            distillation and its own balance and z terms only; CompeteSMoE (2025) Table 11).
        router_nll: α of CompeteSMoE (2024) eq. 5's ``α·NLL`` term of the router update on a
            competing layer (default 0: the authors' public code, where the router is off the
            output path there).  With ``router_nll = α > 0`` the output is unchanged (the
            competition's winners and weights, eq. 2) and the router receives α × the task-loss
            gradient it would receive if its own probabilities, renormalised over the winners,
            weighted them (a straight-through estimator: the paper does not say how the NLL
            reaches a router that is not on the output path).  ``mode="compete"`` or ``"v1"`` only.

    Without a context (or a schedule) in training the layer routes like its base router and warns
    once.
    """

    loss_names = ("distill", "diversity", "competition_balance")

    config_class = CompeteSMoEConfig

    def removal_problem(self, kept: int) -> str | None:
        return self.base.removal_problem(kept)

    def kept_state(self, state: dict[str, Tensor], keep: Tensor) -> dict[str, Tensor]:
        """The base router's state with its kept experts (the competition itself reads the bank)."""
        own = super().kept_state({k: v for k, v in state.items() if not k.startswith("base.")}, keep)
        base = self.base.kept_state({k[5:]: v for k, v in state.items() if k.startswith("base.")}, keep)
        return {**own, **{f"base.{k}": v for k, v in base.items()}}

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        base, base_method = o.base, o.base_method
        if base is None:
            base = build_router("topk", d_model, num_experts, top_k)
        if base.loss_names or isinstance(base, (CompetitionRouter, CompeteSMoERouter)):
            raise ValueError(
                f"base={base_method!r} is not allowed: the base must be a plain router method without its own "
                "losses or competition (e.g. 'smoe', 'xmoe', 'pcosine', 'sigma-moe', 'sharede-v3', 'hyperrouter')"
            )
        if (base.d_model, base.num_experts, base.top_k) != (d_model, num_experts, top_k):
            raise ValueError(
                f"base has d_model={base.d_model}, num_experts={base.num_experts}, top_k={base.top_k}; "
                f"expected {d_model}, {num_experts}, {top_k} like the competition"
            )
        self.mode, self.alpha, self.diversity, self.distill = o.mode, o.alpha, o.diversity, o.distill
        self.competition_balance = o.competition_balance
        self.task_gradient = o.task_gradient
        self.router_nll = o.router_nll
        self.base_method = base_method
        self.base = base
        self.kappa, self.reduce, self.weighting, self.grad_path = o.kappa, o.reduce, o.weighting, o.grad_path

    def reset_parameters(self) -> None:
        """The base router's (the competition has no parameters)."""
        self.base.reset_parameters()

    # ``top_k`` is the base router's (the top-(K+1) swap of moelab.metrics.swap_top1 changes it).
    @property
    def top_k(self) -> int:
        return self.base.top_k if "base" in self._modules else self.__dict__["_top_k"]

    @top_k.setter
    def top_k(self, value: int) -> None:
        self.__dict__["_top_k"] = value
        if "base" in self._modules:
            self.base.top_k = value

    @property
    def weights_sum_to_one(self) -> bool:
        return self.base.weights_sum_to_one

    @property
    def base_router(self) -> Router:
        return self.base

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base_method!r}, mode={self.mode!r}"

    def step_dependence(self) -> str | None:
        own = (
            f"it competes on the steps of the context's schedule; without one it routes like "
            f"{self.base_method!r} and never competes"
        )
        base = self.base.step_dependence()
        return join_dependences(own, None if base is None else f"its base: {base}", super().step_dependence())

    def context_problem(self, ctx: RoutingContext | None) -> str | None:
        if ctx is None:
            return "no RoutingContext with a schedule is attached"
        if ctx.schedule is None:
            return "the RoutingContext holds no schedule"
        return self.base.context_problem(ctx) or super().context_problem(ctx)

    def competes(self, ctx: RoutingContext | None) -> bool:
        """Whether this layer competes at the context's step (training only)."""
        if not self.training:
            return False
        if ctx is None or ctx.schedule is None:  # the layer says so once (moelab.layer.check_context)
            return False
        if torch.compiler.is_compiling():  # said while tracing: a checkpoint falls back to eager silently
            from torch._dynamo.comptime import comptime

            comptime(_say_competition_breaks_the_graph)
        return _schedule_active(ctx, self)

    def forward(self, x: Tensor, experts: Experts, ctx: RoutingContext | None = None) -> Routing:
        routing = self.base(x, experts, ctx)
        if not self.task_gradient:  # CompeteSMoE (2025) Table 11: the task loss never reaches the router
            routing = replace(routing, weights=routing.weights.detach())
        if not self.competes(ctx):
            return routing
        if routing.probs is None:
            raise ValueError(f"base={self.base_method!r} gives no router distribution (Routing.probs)")
        if self.mode == "dense":
            return self._dense(routing, x, experts)
        if self.mode == "router":
            return self._router_diversity(routing, x, experts)
        k = self.base.top_k
        winners, weights, outputs, scores = compete(
            x, experts, k, self.kappa, self.reduce, self.weighting, self.grad_path
        )
        losses = dict(routing.losses)
        if self.mode == "v1" and routing.logits is None:
            raise ValueError(
                f"base={self.base_method!r} gives no router logits (Routing.logits) for mode='v1'"
            )
        if self.mode == "v1":
            losses["distill"] = competition_router_loss(routing.logits, scores, k)
        else:
            if self.distill == "mse":
                losses["distill"] = affinity_distillation_loss(routing.probs, scores)
            else:
                s_c = torch.zeros_like(routing.probs).scatter(
                    1, winners, weights.detach().to(routing.probs.dtype)
                )
                losses["distill"] = distillation_loss(routing.probs, s_c, winners, self.alpha)
            losses["diversity"] = diversity_loss(outputs, self.diversity)
            if self.competition_balance != "router":  # the router learns from the distillation only
                zero = routing.probs.new_zeros(())
                losses["balance"] = losses["z"] = zero
                if self.competition_balance == "affinity":
                    affinity = scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(dim=-1)
                    losses["competition_balance"] = switch_balance_loss(affinity, winners, self.num_experts)
        if self.router_nll:
            router = routing.probs.gather(1, winners)
            router = router / router.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(router.dtype).tiny)
            weights = straight_through_weights(weights, router.to(weights.dtype), self.router_nll)
        return Routing(
            indices=winners,
            weights=weights,
            probs=routing.probs,
            logits=routing.logits,
            losses=losses,
            outputs=outputs,
        )

    def _chosen_outputs(self, x: Tensor, experts: Experts, indices: Tensor) -> Tensor:
        """The outputs ``(T, K, d)`` of the experts ``indices`` chose, with autograd (every expert
        runs: the ablations that need them activate all experts on their steps anyway)."""
        all_out = experts.forward_all(x)  # (T, N, d)
        return all_out.gather(1, indices.unsqueeze(-1).expand(-1, -1, all_out.shape[-1]))

    def _dense(self, routing: Routing, x: Tensor, experts: Experts) -> Routing:
        probs = routing.probs
        weights, indices = probs.sort(dim=-1, descending=True)  # all N, top-1 first
        losses = dict(routing.losses)
        losses["balance"] = switch_balance_loss(probs, routing.indices, self.num_experts)
        outputs = self._chosen_outputs(x, experts, indices)  # (T, N, d), the router's top-K first
        losses["diversity"] = diversity_loss(outputs[:, : routing.top_k], self.diversity)
        return Routing(
            indices=indices,
            weights=weights,
            probs=probs,
            logits=routing.logits,
            losses=losses,
            outputs=outputs,
        )

    def _router_diversity(self, routing: Routing, x: Tensor, experts: Experts) -> Routing:
        outputs = self._chosen_outputs(x, experts, routing.indices)
        losses = {**routing.losses, "diversity": diversity_loss(outputs, self.diversity)}
        return replace(routing, losses=losses, outputs=outputs)
