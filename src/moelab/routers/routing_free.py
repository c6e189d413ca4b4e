"""Routing-free MoE: ``routing-free`` (Liu, Han, Yan, Tresp, Ma, *Routing-Free Mixture-of-Experts*,
arXiv 2604.00801): no router; each expert gates itself by the norm of its own low-rank gate
pre-activation against a threshold, and an adaptive balancing objective holds the activation density."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..config import Interval, setting
from ..experts.protocol import Experts
from ..losses import routing_free_balance_loss
from ..routing import Routing, RoutingContext
from .base import Router, counts_this_forward, register

#: the authors' code clamps the adaptive coefficient at 1
_LAMBDA_MAX = 1.0
#: the authors' init of each expert's gate bias ``b_e`` (``s = c·‖a‖ − b``: a hair above ``‖a‖``)
_BIAS_INIT = -1e-6


@dataclass(frozen=True)
class RoutingFreeConfig:
    """The options of :class:`RoutingFreeRouter` (its docstring says what each does)."""

    rank: int | None = setting(
        None,
        help="r, the rank of the experts' gate factors; None: max(1, d_model // 4)",
        allowed=(Interval(int, 1), None),
    )
    threshold: float = setting(
        1.0,
        help="θ: an expert runs on a token iff its self-gate s = c·‖A x‖ − b reaches θ",
        allowed=Interval(float, 0, closed="neither"),
    )
    eval_threshold: float | None = setting(
        None,
        help="θ in evaluation (the inference-time sparsity control); None: threshold",
        allowed=(Interval(float, 0, closed="neither"), None),
    )
    density_target: float | None = setting(
        None,
        help="ρ∞, the share of (token, expert) pairs active that λ steers to; None: top_k / num_experts",
        allowed=(Interval(float, 0, 1, closed="right"), None),
    )
    token_balance: float = setting(
        0.5,
        help="μ: the balancing objective is (1 − μ)·expert balance + μ·token balance",
        allowed=Interval(float, 0, 1),
    )
    lambda_init: float = setting(
        1e-10, help="λ₀, the balancing coefficient at step 0", allowed=Interval(float, 0, closed="neither")
    )
    lambda_rate: float = setting(
        0.02,
        help="η: λ ← min(1, λ·(1 + η)^sign(ρ − ρ∞)) once per optimizer step",
        allowed=Interval(float, 0, closed="neither"),
    )


@register("routing-free")
class RoutingFreeRouter(Router):
    """No router: expert ``e`` computes ``a_e = A_e x`` (the low-rank factor of its own gate
    projection ``W_g^e = B_e A_e``), its self-gate ``s_e = c_e·‖a_e‖₂ − b_e`` (``c_e``, ``b_e`` two
    learned scalars per expert), and runs on the token iff ``s_e ≥ θ``; its output is weighted by
    ``s_e`` (not normalised).  Each token takes a variable number of experts, 0 to N — Routing-Free
    MoE (Liu et al. 2026, arXiv 2604.00801), as the authors' code computes it
    (``liuyilun2000/RoutingFreeMoE``, ``RoutingFreeGate`` / ``RoutingFreeMaskedMoE``).

    ``A_e`` belongs to the expert bank (built with ``gate_rank = rank``, as Autonomy-of-Experts'):
    the expert finishes its gate with the same ``a_e``, so what gates and what computes cannot
    disagree.  This router owns only ``c`` (init 1) and ``b`` (init −1e-6), shape ``(N,)``.

    The balancing objective (:func:`moelab.losses.routing_free_balance_loss`) on the gates
    ``g = s·[s ≥ θ]`` interpolates expert balance and token balance by ``μ = token_balance``, times
    an adaptive coefficient ``λ`` (in ``Routing.losses["rf_balance"]``; ``rf_balance_coef``, default 1,
    multiplies it again).  ``λ`` moves in the step hook, once per optimizer step, from the step's
    activation density ``ρ`` (active pairs over all pairs of its training forwards, summed over
    micro-batches and ranks): ``λ ← min(1, λ·(1 + η)^sign(ρ − ρ∞))``.

    In evaluation the experts gate themselves by the same rule at ``eval_threshold`` (default
    ``θ``): the paper's inference-time control of sparsity; ``λ`` does not move.

    Where moelab departs from the authors' code (docs/methods.md says each): the code pools every
    layer's gates into one ``(T, L·N)`` matrix with one ``λ`` and moves ``λ`` after every training
    forward (then averages it over ranks); here each layer holds its own objective and ``λ``, moved
    once per optimizer step by the global density, so that one process and its ranks agree.

    Options:
        rank: ``r``; default ``max(1, d_model // 4)`` (the code's documented default; its runs use
            ``d/16``).
        threshold: ``θ`` (1.0, the authors' training script).
        eval_threshold: ``θ`` in evaluation (None: ``threshold``).
        density_target: ``ρ∞`` (None: ``top_k / num_experts``, moelab's compute budget; the
            script's runs use 0.25 with 12 experts).
        token_balance: ``μ`` (0.5: the code's per-expert and per-token coefficients 0.5 and 0.5).
        lambda_init: ``λ₀`` (1e-10, the script).
        lambda_rate: ``η`` (0.02, the script).
    """

    loss_names = ("rf_balance",)
    gate = "relu"  # the gates are thresholded scores, not probabilities
    weights_sum_to_one = False
    variable_k = True

    config_class = RoutingFreeConfig

    step_state = (
        "its balancing coefficient λ moves only in the step hook ctx.advance() runs (Routing-Free MoE); "
        "without it λ stays at lambda_init and nothing holds the activation density"
    )

    float32_buffers = (*Router.float32_buffers, "rf_lambda", "rf_pending")

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.rank = max(1, d_model // 4) if o.rank is None else o.rank
        self.threshold = o.threshold
        self.eval_threshold = o.threshold if o.eval_threshold is None else o.eval_threshold
        self.density_target = top_k / num_experts if o.density_target is None else o.density_target
        self.token_balance = o.token_balance
        self.lambda_init = o.lambda_init
        self.lambda_rate = o.lambda_rate
        #: ``c`` and ``b`` of ``s = c·‖A x‖ − b``, one each per expert
        self.gate_scale = nn.Parameter(torch.ones(num_experts))
        self.gate_bias = nn.Parameter(torch.full((num_experts,), _BIAS_INIT))
        #: λ, saved with the model: a resumed run continues with the coefficient it had reached
        self.register_buffer("rf_lambda", torch.tensor(self.lambda_init))
        #: [active pairs, all pairs] of the training forwards since the last step hook
        self.register_buffer("rf_pending", torch.zeros(2), persistent=False)
        self.reset_parameters()

    @property
    def expert_gate_rank(self) -> int:
        """The rank of the factorised gate projections the layer's expert bank must have."""
        return self.rank

    #: the paper whose experts' gate projections are the low-rank factors this router reads
    factorised_gates = "Routing-Free MoE"

    def reset_parameters(self) -> None:
        """``c = 1``, ``b = −1e-6``, ``λ = lambda_init``, nothing pending."""
        with torch.no_grad():
            self.gate_scale.fill_(1.0)
            self.gate_bias.fill_(_BIAS_INIT)
            self.rf_lambda.fill_(self.lambda_init)
            self.rf_pending.zero_()

    def self_gates(self, x: Tensor, experts: Experts | None) -> Tensor:
        """``s (T, N)``: every expert's self-gate ``c_e·‖A_e x‖ − b_e`` on every token."""
        if getattr(experts, "gate_rank", None) != self.rank:
            raise ValueError(
                f"experts of type {type(experts).__name__} are not allowed with the routing-free router; "
                f"expected an ExpertBank with gate_rank={self.rank} (Routing-Free MoE gates each expert by "
                "its own low-rank gate pre-activation)"
            )
        norms = experts.gate_low_rank(x).norm(dim=-1)  # (T, N)
        return norms * self.gate_scale.to(norms.dtype) - self.gate_bias.to(norms.dtype)

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        scores = self.self_gates(x, experts)
        theta = self.threshold if self.training else self.eval_threshold
        active = scores.detach() >= theta
        gates = scores * active.to(scores.dtype)  # θ > 0: an active gate is positive, an inactive one 0
        weights, indices = gates.sort(dim=-1, descending=True, stable=True)  # active slots first
        mask = active.gather(1, indices)
        loss = self.rf_lambda.to(gates.dtype) * routing_free_balance_loss(gates, active, self.token_balance)
        if self.training and counts_this_forward():
            count = active.sum().to(self.rf_pending.dtype)
            # in place, not `+=` (an attribute store, which compile refuses under activation checkpointing)
            self.rf_pending.add_(torch.stack((count, torch.full_like(count, active.numel()))))
        return Routing(
            indices=indices,
            weights=weights,
            probs=None,
            logits=scores,
            losses={"rf_balance": loss},
            mask=mask,
        )

    @torch.no_grad()
    def on_step(self, ctx: RoutingContext | None = None) -> None:
        """``λ ← min(1, λ·(1 + η)^sign(ρ − ρ∞))`` with the density ``ρ`` of the step's training
        forwards (counts summed over micro-batches and ranks), then clear the counts.  Run on every
        rank; a step without a training forward moves nothing."""
        super().on_step(ctx)
        counts = self.rf_pending.float()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        if counts[1] > 0:
            density = counts[0] / counts[1]
            factor = (1.0 + self.lambda_rate) ** torch.sign(density - self.density_target)
            self.rf_lambda.copy_((self.rf_lambda * factor).clamp(max=_LAMBDA_MAX))
        self.rf_pending.zero_()

    def rule_options(self) -> dict[str, Any]:
        return {"rank": self.rank, "threshold": self.threshold, "eval_threshold": self.eval_threshold}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}, threshold={self.threshold}"
