"""ReLU routing: ``remoe`` (ReMoE: a variable number of experts per token, sparsity held at K/N by an
adaptive L1 regulariser)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Interval, setting
from ..experts.protocol import Experts
from ..losses import relu_l1_balance_loss
from ..routing import Routing, RoutingContext
from .base import InitStdOptions, Router, counts_this_forward, register


@dataclass(frozen=True)
class ReLUConfig(InitStdOptions):
    """The options of :class:`ReLURouter` (its docstring says what each does)."""

    l1_init: float = setting(
        1e-8, help="λ₀, the L1 coefficient at step 0", allowed=Interval(float, 0, closed="neither")
    )
    l1_multiplier: float = setting(
        1.2, help="α > 1, the factor λ moves by each step", allowed=Interval(float, 1, closed="neither")
    )


@register("relu")
class ReLURouter(Router):
    """``R(x) = relu(W x)``: every expert whose gate is positive runs, weighted by its gate, so each
    token takes a variable number of experts — ReMoE (Wang, Zhu, Chen, *ReMoE: Fully
    Differentiable Mixture-of-Experts with ReLU Routing*, ICLR 2025), §3.

    The routing is differentiable everywhere (no TopK): a gate that crosses 0 switches its expert
    on or off continuously.  The average number of active experts is held at ``top_k`` by the
    L1 regulariser with load balancing (§3, :func:`moelab.losses.relu_l1_balance_loss`), in
    ``Routing.losses["l1"]`` already multiplied by its adaptive coefficient ``λ``; ``l1_coef``
    (default 1) multiplies it again.  ``λ`` changes in the step hook (:meth:`on_step`, once per
    optimizer step, from the training forwards of that step summed over ranks):
    ``λ ← λ · α^{sign((1 − K/N) − S)}`` with ``S`` the fraction of zero gates (§3).

    ``Routing.indices`` and ``weights`` are ``(T, N)``, the experts sorted by decreasing gate;
    ``Routing.mask`` says which slots are active (a positive gate): the layer runs only those
    (:func:`moelab.experts.dispatch.dispatch_masked`).  The weights are the gates themselves, not
    normalised; ``Routing.probs`` is ``None`` (there is no distribution over the experts).

    Defaults from the authors' public Megatron-LM code (``ReLURouter``; their training scripts):
    ``λ₀ = 1e-8`` and ``α = 1.2``.  There one ``λ`` is shared by all layers and moved by their
    mean sparsity; here each layer holds its own ``λ``, moved by its own sparsity (a layer's hook
    sees only its layer), so every layer is held at K/N.

    No aux-loss-free selection bias: ReLU routing makes no choice among experts that an offset
    could shift (a gate is on or off by its own sign), and its load-balanced L1 already balances.

    Options:
        init_std: std of the N(0, σ²) init of ``W (N, d)``; default ``d^-1/2`` as moelab's other
            linear routers (Megatron-LM's default is 0.02).
        l1_init: ``λ₀``, the coefficient at step 0 (1e-8).
        l1_multiplier: ``α > 1`` (1.2).
    """

    loss_names = ("l1",)
    gate = "relu"  # the gates are ReLU outputs, not probabilities: they need not sum to at most 1
    weights_sum_to_one = False
    variable_k = True

    config_class = ReLUConfig
    expert_tensors = ("weight",)  # each gate is its own ReLU: removing others changes none

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.init_std = 1.0 / math.sqrt(d_model) if o.init_std is None else o.init_std
        self.l1_init = o.l1_init
        self.l1_multiplier = o.l1_multiplier
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        #: λ, saved with the model: a resumed run continues with the coefficient it had reached
        self.register_buffer("l1_lambda", torch.tensor(self.l1_init))
        #: [active gates, all gates] of the training forwards since the last step hook
        self.register_buffer("pending_active", torch.zeros(2), persistent=False)
        self.reset_parameters()

    @property
    def target_sparsity(self) -> float:
        """``1 − K/N``: the fraction of zero gates the coefficient steers to."""
        return 1.0 - self.top_k / self.num_experts

    def reset_parameters(self) -> None:
        """``W ~ N(0, init_std²)``, ``λ = l1_init``, the pending counts zero."""
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, dtype=self.weight.dtype) * self.init_std)
            self.l1_lambda.fill_(self.l1_init)
            self.pending_active.zero_()

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        logits = F.linear(x, self.weight)  # (T, N)
        gates = F.relu(logits)
        weights, indices = gates.sort(dim=-1, descending=True, stable=True)  # active slots first
        mask = weights > 0
        l1 = self.l1_lambda.to(gates.dtype) * relu_l1_balance_loss(gates, self.top_k)
        if self.training and counts_this_forward():
            active = mask.sum().to(self.pending_active.dtype)
            # in place, not `+=` (an attribute store, which compile refuses under activation checkpointing)
            self.pending_active.add_(torch.stack((active, torch.full_like(active, mask.numel()))))
        return Routing(
            indices=indices, weights=weights, probs=None, logits=logits, losses={"l1": l1}, mask=mask
        )

    def _apply(self, fn, *args, **kwargs):
        """Keep ``λ`` and the pending counts in float32 when the model is cast to bf16 / fp16 (a
        factor 1.2 moves a bfloat16 ``λ`` by whole steps of its 8-bit mantissa; counts above 256
        are not exact)."""
        super()._apply(fn, *args, **kwargs)
        for name in ("l1_lambda", "pending_active"):
            b = getattr(self, name)
            if b.dtype in (torch.float16, torch.bfloat16):
                setattr(self, name, b.float())
        return self

    @torch.no_grad()
    def on_step(self, ctx: RoutingContext | None = None) -> None:
        """The step hook: ``λ ← λ · α^{sign((1 − K/N) − S)}`` with the sparsity ``S`` of the step's
        training forwards (counts summed over ranks), then clear the counts.  Run on every rank;
        a step without a training forward moves nothing."""
        super().on_step(ctx)
        counts = self.pending_active.float()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts)
        if counts[1] > 0:
            sparsity = 1.0 - counts[0] / counts[1]
            self.l1_lambda *= self.l1_multiplier ** torch.sign(self.target_sparsity - sparsity)
        self.pending_active.zero_()
