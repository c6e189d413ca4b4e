"""``hyperrouter``: a frozen random hypernetwork generates the router from a trained embedding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Interval, setting
from ..experts.protocol import Experts
from ..functional import resolve_renormalize, topk_gate, topk_gate_weights_at
from ..routing import Routing, RoutingContext
from .base import RenormalizeOptions, Router, SelectionBiasOptions, register, softmax_over_all


@dataclass(frozen=True)
class HyperConfig(RenormalizeOptions, SelectionBiasOptions):
    """The options of :class:`HyperRouter` (its docstring says what each does)."""

    hyper_dim: int = setting(64, help="h, the hypernetwork's hidden width", allowed=Interval(int, 1))
    embed_dim: int | None = setting(
        None, help="d_e, the width of the trained embedding; None: d_model", allowed=(Interval(int, 1), None)
    )
    embed_std: float = setting(
        1.0, help="std of the N(0, σ²) init of the embedding", allowed=Interval(float, 0, closed="neither")
    )


@register("hyper")
class HyperRouter(Router):
    """HyperRouter (Do et al. 2023; cited by CompeteSMoE (2024) §2): ``[W_r | b_r] = H(e)`` with
    ``H = Linear(d_e, h) → ReLU → Linear(h, N(d+1))`` frozen at its random init; only the
    embedding ``e ∈ R^{d_e}`` is trained.  Logits ``W_r x + b_r``, top-K softmax.

    Options:
        hyper_dim: ``h`` (64, the enwik8 setting).
        embed_dim: ``d_e``; default ``d_model`` (docs/methods.md, ``hyperrouter``).
        embed_std: std of the N(0, σ²) init of ``e`` (1.0).
        selection_bias: carry the aux-loss-free selection bias of DeepSeek-V3 (added to
            ``softmax(h)`` for the choice only, moved once per optimizer step towards the mean
            load; :meth:`moelab.routers.Router.init_selection_bias`); default off.
        bias_update_rate: its step γ (1e-3, DeepSeek-V3).
        renormalize: the chosen weights renormalised (``softmax(TopK_-inf(h))``, ``True``) or the
            softmax over all N at the chosen (``False``, Switch Transformer); default ``None``:
            renormalised when K > 1 (at K = 1 a renormalised weight is the constant 1, which no
            task loss can train; :func:`moelab.functional.resolve_renormalize`).

    ``H`` is kept as buffers (``h1_*``, ``h2_*``): checkpoints carry it and nothing can train it.
    """

    config_class = HyperConfig

    def removal_problem(self, kept: int) -> str | None:
        return softmax_over_all(self.renormalize)

    def kept_state(self, state: dict[str, Tensor], keep: Tensor) -> dict[str, Tensor]:
        """The hypernetwork's output layer generates ``(W_r | b_r)`` row by row, ``d + 1`` outputs
        per expert: the kept experts' blocks of ``h2_weight`` and ``h2_bias``."""
        out = super().kept_state(state, keep)
        for name in ("h2_weight", "h2_bias"):
            t = out[name]
            blocks = t.view(self.num_experts, self.d_model + 1, *t.shape[1:])
            out[name] = blocks.index_select(0, keep.to(t.device)).reshape(-1, *t.shape[1:])
        return out

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.init_selection_bias(o.selection_bias, o.bias_update_rate)
        self.renormalize = resolve_renormalize(o.renormalize, top_k)
        hyper_dim = o.hyper_dim
        embed_dim = d_model if o.embed_dim is None else o.embed_dim
        self.embed_std, self.hyper_dim = o.embed_std, hyper_dim
        self.embedding = nn.Parameter(torch.empty(embed_dim))
        # frozen at its random init: kept as buffers, so no optimizer or requires_grad_(True) trains it
        for name, shape in (
            ("h1_weight", (hyper_dim, embed_dim)),
            ("h1_bias", (hyper_dim,)),
            ("h2_weight", (num_experts * (d_model + 1), hyper_dim)),
            ("h2_bias", (num_experts * (d_model + 1),)),
        ):
            self.register_buffer(name, torch.empty(shape))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """A new embedding ``N(0, embed_std²)`` and hypernetwork (``nn.Linear``'s init)."""
        with torch.no_grad():
            embed_dim = self.embedding.shape[0]
            self.embedding.copy_(torch.randn(embed_dim) * self.embed_std)
            h1, h2 = nn.Linear(embed_dim, self.hyper_dim), nn.Linear(self.hyper_dim, self.h2_bias.shape[0])
            for name, tensor in (("h1_weight", h1.weight), ("h1_bias", h1.bias), ("h2_weight", h2.weight),
                                 ("h2_bias", h2.bias)):  # fmt: skip
                getattr(self, name).copy_(tensor)
        self.reset_selection_bias()

    def router_weights(self) -> tuple[Tensor, Tensor]:
        """The generated ``W_r (N, d)`` and ``b_r (N,)``."""
        hidden = F.relu(F.linear(self.embedding, self.h1_weight, self.h1_bias))
        wb = F.linear(hidden, self.h2_weight, self.h2_bias).view(self.num_experts, self.d_model + 1)
        return wb[:, :-1], wb[:, -1]

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        w, b = self.router_weights()
        logits = F.linear(x, w, b)
        weights, indices, probs = topk_gate(logits, self.top_k, self.renormalize, self.selection_bias)
        self.count_load(indices)
        return Routing(indices=indices, weights=weights, probs=probs, logits=logits)

    def weights_at(self, routing: Routing, indices: Tensor) -> Tensor:
        """:func:`moelab.functional.topk_gate_weights_at` of the live scores."""
        return topk_gate_weights_at(routing.logits, routing.probs, indices, self.renormalize)

    @property
    def weights_sum_to_one(self) -> bool:
        return self.renormalize
