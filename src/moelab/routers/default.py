"""Default MoE: ``default-moe`` (Panda, Baherwani, Sarwar, Therien, Chakraborty, Goldstein, *Dense
Backpropagation Improves Training for Sparse Mixture-of-Experts*, arXiv 2504.12463): the router's
gradient is dense — an expert a token did not go to stands in with its default output, an EMA of
that expert's past outputs — while the forward stays the sparse top-K mixture."""

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
from ..routing import Routing, RoutingContext
from .base import (
    InitStdOptions,
    Router,
    SelectionBiasOptions,
    counts_this_forward,
    register,
)


@dataclass(frozen=True)
class DefaultMoEConfig(InitStdOptions, SelectionBiasOptions):
    """The options of :class:`DefaultMoERouter` (its docstring says what each does)."""

    ema: float = setting(
        0.9,
        help="the default outputs' EMA decay β per optimizer step: Ê ← β·Ê + (1 − β)·(the step's mean output)",
        allowed=Interval(float, 0, 1, closed="left"),
    )


class DefaultGradient(torch.autograd.Function):
    """``(probs (T, N), missing (T, N) bool, defaults (N, d)) → 0 (T, d)`` whose backward gives the
    router probabilities of the missing experts the gradient ``∂L/∂π_{t,i} = ⟨∂L/∂y_t, Ê_i⟩``, as if
    ``Σ_{i missing} π_{t,i} Ê_i`` were added to the output, which it is not: the forward is the sparse
    mixture, bit for bit (a zero added), the backward dense."""

    @staticmethod
    def forward(ctx: Any, probs: Tensor, missing: Tensor, defaults: Tensor) -> Tensor:
        ctx.save_for_backward(missing, defaults)
        return probs.new_zeros(probs.shape[0], defaults.shape[1])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None]:
        missing, defaults = ctx.saved_tensors
        g = grad @ defaults.to(grad.dtype).T  # (T, N)
        return g * missing.to(g.dtype), None, None


@register("default-moe")
class DefaultMoERouter(Router):
    """``π = softmax(W x)``; the K experts of largest ``π`` run, weight ``π_i`` (not renormalised):
    the forward is the top-K mixture ``y = Σ_{i∈A} π_i E_i(x)``.  In training the router's gradient is
    that of ``Σ_{i∈A} π_i E_i(x) + Σ_{i∉A} π_i Ê_i`` (Default MoE, arXiv 2504.12463): each missing
    expert ``i`` contributes its default output ``Ê_i (d,)`` (:class:`DefaultGradient`, through
    ``Routing.direct``, a zero in the forward), so every expert's row of ``W`` learns from every token,
    at the cost of one ``(T, d) × (d, N)`` product in the backward.

    The default outputs: each training forward with gradients runs the chosen experts itself (the
    bank's own sparse dispatch, one row per token slot: every kernel, every bank, expert parallelism) and
    hands their outputs to the layer (``Routing.outputs``), adding each expert's unweighted output sum
    and slot count to a pending buffer; the step hook sums the pending buffer over the data-parallel
    ranks (one all-reduce of ``N·(d + 1)`` numbers per layer, outside any forward) and moves
    ``Ê_i ← β·Ê_i + (1 − β)·Ē_i`` for every expert that received tokens in the step (``Ē_i`` its mean
    output over the step's slots; an expert that received none keeps ``Ê_i``).  ``Ê`` starts at 0 and
    is a saved float32 buffer.  Evaluation and gradient-free forwards are the plain top-K mixture
    through the bank's sparse dispatch and change nothing.

    Options:
        ema: β, the EMA decay per optimizer step (0.9, as we read the paper).
        selection_bias, bias_update_rate: the aux-loss-free selection bias on ``π`` (off).
        init_std: std of the N(0, σ²) init of ``W``; default ``d^-1/2``.
    """

    weights_sum_to_one = False

    config_class = DefaultMoEConfig

    step_state = (
        "its default outputs move only in the step hook ctx.advance() runs (Default MoE); without it they "
        "stay where they are (at 0: the router's gradient is the sparse top-K one)"
    )

    float32_buffers = (*Router.float32_buffers, "default_outputs", "default_pending")

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.ema = o.ema
        self.init_std = 1.0 / math.sqrt(d_model) if o.init_std is None else o.init_std
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.init_selection_bias(o.selection_bias, o.bias_update_rate)
        #: the default outputs Ê (N, d), float32, saved with the model
        self.register_buffer("default_outputs", torch.zeros(num_experts, d_model))
        #: the step's pending output sums and slot counts per expert (N, d + 1) (not saved: the step
        #: hook consumes them)
        self.register_buffer("default_pending", torch.zeros(num_experts, d_model + 1), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``W ~ N(0, init_std²)``; the default outputs zero, nothing pending."""
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, dtype=self.weight.dtype) * self.init_std)
            self.default_outputs.zero_()
            self.default_pending.zero_()
        self.reset_selection_bias()

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        logits = F.linear(x, self.weight)  # (T, N)
        probs = logits.softmax(dim=-1)
        indices = self.biased(probs.detach()).topk(self.top_k, dim=-1).indices
        self.count_load(indices)
        weights = probs.gather(1, indices)
        if not (self.training and torch.is_grad_enabled()):
            return Routing(indices=indices, weights=weights, probs=probs, logits=logits)
        if experts is None:  # torchtitan's router slot: the dense gradient would be dropped without a word
            raise ValueError(
                "experts=None is not allowed with Default MoE in training: its router runs the chosen experts for "
                "their default outputs; expected the layer's expert bank (moelab.MoE passes it)"
            )
        T, K = indices.shape
        rows = x.repeat_interleave(K, dim=0)  # token t's K slots in slot order
        # through the bank's own call (not its mix): FSDP2 gathers an expert unit's weights in its hooks
        slots = Routing(indices=indices.reshape(-1, 1), weights=rows.new_ones(T * K, 1))
        outputs = experts(rows, slots)  # (T·K, ...): each slot's expert output, unweighted
        if outputs.dim() != 2 or outputs.shape[1] != self.d_model:
            raise ValueError(
                f"experts whose outputs have shape {tuple(outputs.shape[1:])} per token are not allowed with "
                f"Default MoE; expected outputs of width d_model={self.d_model} (its default outputs are (N, d))"
            )
        with torch.no_grad():
            if counts_this_forward():  # an activation-checkpointing recomputation adds nothing
                flat = outputs.detach().to(self.default_pending.dtype)
                stats = torch.cat([flat, flat.new_ones(T * K, 1)], dim=1)
                self.default_pending.index_add_(0, indices.reshape(-1), stats)
            missing = torch.ones_like(probs, dtype=torch.bool).scatter(1, indices, False)
        direct = DefaultGradient.apply(probs, missing, self.default_outputs)
        return Routing(
            indices=indices,
            weights=weights,
            probs=probs,
            logits=logits,
            outputs=outputs.view(T, K, self.d_model),
            direct=direct,
        )

    @torch.no_grad()
    def on_step(self, ctx: RoutingContext | None = None) -> None:
        """``Ê_i ← β·Ê_i + (1 − β)·Ē_i`` for the experts that received slots in the step's training
        forwards (summed over the ranks); the others keep ``Ê_i``."""
        super().on_step(ctx)
        pending = self.default_pending.clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(pending)
        counts = pending[:, -1:]
        mean = pending[:, :-1] / counts.clamp(min=1)
        moved = self.ema * self.default_outputs + (1.0 - self.ema) * mean
        self.default_outputs.copy_(torch.where(counts > 0, moved, self.default_outputs))
        self.default_pending.zero_()

    def rule_options(self) -> dict[str, Any]:
        return {"ema": self.ema}
