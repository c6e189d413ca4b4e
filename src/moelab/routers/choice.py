"""Expert-choice routing: ``expert-choice`` (Zhou et al. 2022): each expert chooses its tokens."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Interval, setting
from ..experts.protocol import Experts
from ..routing import Routing, RoutingContext
from .base import InitStdOptions, Router, register


@dataclass(frozen=True)
class ExpertChoiceConfig(InitStdOptions):
    """The options of :class:`ExpertChoiceRouter` (its docstring says what each does)."""

    capacity_factor: float | None = setting(
        None,
        help="c, the mean number of experts per token, in (0, N]; None: top_k",
        allowed=(Interval(float, 0, closed="neither"), None),
    )


@register("expert-choice")
class ExpertChoiceRouter(Router):
    """``S = softmax(W x)`` over the experts; each expert takes the ``k = ⌈T·c/N⌉`` tokens of the
    batch with the largest score for it and weights each by ``S`` — expert-choice routing (Zhou,
    Lei, Liu, Du, Huang, Zhao, Dai, Chen, Le, Laudon, *Mixture-of-Experts with Expert Choice
    Routing*, NeurIPS 2022, §3).

    Every expert processes exactly ``k`` tokens: the load is balanced by construction and no balance
    loss is needed; a token is taken by any number of experts from 0 (its output is 0, plus the
    shared experts) to N, ``c`` on average.  ``capacity_factor`` ``c`` defaults to ``top_k``, so
    ``MoE(d, N, 2, method="expert-choice")`` is the paper's EC-CF2, the compute of top-2 routing.
    (The paper's EC-CAP variant, which caps the experts per token by a linear program, is not
    implemented.)

    **Future tokens.**  An expert's choice of a token depends on the scores of every other token of
    the batch, later positions of the same sequence included: in a causal language model a token's
    output then depends on the tokens after it, which training exploits and generation cannot
    reproduce.  The paper evaluates encoder / encoder-decoder models; here the method is offered
    for encoders and as an ablation, and a causal LM built with it warns
    (:class:`moelab.models.lm.LMConfig`).  The routing is also batch-dependent in evaluation.

    ``Routing.indices``/``weights`` are ``(T, N)``, each token's experts by decreasing score,
    ``Routing.mask`` the experts that chose it; the layer runs only those
    (:func:`moelab.experts.dispatch.dispatch_masked`).

    No aux-loss-free selection bias: the load is balanced by construction, and a per-expert offset
    would not change which tokens an expert takes (the same constant added to its whole column).

    Options:
        capacity_factor: ``c > 0``, the mean number of experts per token (default ``top_k``).
        init_std: std of the N(0, σ²) init of ``W (N, d)``; default ``d^-1/2``.
    """

    weights_sum_to_one = False
    variable_k = True
    #: an expert's choice depends on the later tokens of the batch (see the class docstring)
    leaks_future_tokens = True

    config_class = ExpertChoiceConfig

    def removal_problem(self, kept: int) -> str | None:
        return (
            "expert-choice weighs by the softmax over all N experts and gives each expert T·c/N tokens, both of "
            "which removing experts changes"
        )

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.capacity_factor = float(top_k) if o.capacity_factor is None else o.capacity_factor
        if self.capacity_factor > num_experts:
            raise ValueError(
                f"capacity_factor={o.capacity_factor!r} is not allowed; expected a number in (0, {num_experts}] "
                "(the mean number of experts per token)"
            )
        self.init_std = 1.0 / math.sqrt(d_model) if o.init_std is None else o.init_std
        self.weight = nn.Parameter(torch.empty(num_experts, d_model))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``W ~ N(0, init_std²)``."""
        with torch.no_grad():
            self.weight.copy_(torch.randn(self.weight.shape, dtype=self.weight.dtype) * self.init_std)

    def rule_options(self) -> dict:
        return {"capacity_factor": self.capacity_factor}

    def capacity(self, num_tokens: int) -> int:
        """``k = ⌈T·c/N⌉`` tokens per expert, at most ``T``."""
        return min(num_tokens, math.ceil(num_tokens * self.capacity_factor / self.num_experts))

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        logits = F.linear(x, self.weight)  # (T, N)
        probs = logits.softmax(dim=-1)
        top = probs.detach().topk(self.capacity(x.shape[0]), dim=0).indices  # (k, N): each expert's tokens
        chosen = torch.zeros_like(probs, dtype=torch.bool).scatter(0, top, True)
        order = probs.detach().masked_fill(~chosen, -1.0).argsort(dim=-1, descending=True, stable=True)
        mask = chosen.gather(1, order)
        weights = (probs * chosen.to(probs.dtype)).gather(1, order)
        return Routing(indices=order, weights=weights, probs=probs, logits=logits, mask=mask)
