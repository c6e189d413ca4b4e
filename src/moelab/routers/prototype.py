"""Latent prototype routing: ``latent-prototype`` (Yang, *Latent Prototype Routing: Achieving
Near-Perfect Load Balancing in Mixture-of-Experts*, arXiv 2506.21328): routing as clustering of the
tokens' latents onto learned prototypes, one per expert."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..config import Interval, Options, setting
from ..experts.protocol import Experts
from ..functional import resolve_renormalize, topk_gate, topk_gate_weights_at
from ..losses import gaussian_kl_loss, orthogonality_loss, prototype_alignment_loss
from ..routing import Routing, RoutingContext
from .base import InitStdOptions, RenormalizeOptions, Router, SelectionBiasOptions, register


@dataclass(frozen=True)
class LatentPrototypeConfig(InitStdOptions, RenormalizeOptions, SelectionBiasOptions):
    """The options of :class:`LatentPrototypeRouter` (its docstring says what each does)."""

    aligner: bool = setting(
        True,
        help="add out_proj(softmax(s) P) to the routed experts' input (the authors' aligner)",
        allowed=Options((True, False)),
    )
    latent_dim: int = setting(
        16, help="the latent width D of the encoder and the prototypes", allowed=Interval(int, 1)
    )


def prototype_scores(mu: Tensor, prototypes: Tensor, eps: float = 1e-8) -> Tensor:
    """``(T, N)`` the cosine similarity of each token latent ``μ_t`` to each prototype ``P_e``, as one
    ``(T, D) × (D, N)`` product of the normalised rows (the authors' ``F.cosine_similarity``, equal
    but for rows of norm below ``eps``)."""
    return F.normalize(mu, dim=-1, eps=eps) @ F.normalize(prototypes, dim=-1, eps=eps).transpose(0, 1)


@register("latent-prototype")
class LatentPrototypeRouter(Router):
    """A variational encoder maps each token to a latent, ``[μ, log σ²] = W SiLU(LN(x)) + b``
    (``W (2D, d)``, ``LN`` a LayerNorm); the scores are the cosine similarities ``cos(μ, P_e)`` of the
    mean latent to ``N`` learned prototypes ``P (N, D)``; the token takes the K most similar experts,
    weighted by the softmax of their K similarities (at K = 1, where that weight is the constant 1,
    the chosen expert's softmax over all N, Switch's: ``renormalize=None``) — Latent Prototype Routing (Yang 2025, arXiv
    2506.21328), as the authors' code computes it (``RANDO11199/LatentPrototypeRouter``,
    ``TokenDistributionRouter`` with ``VectorSimilarity`` / ``Cosine``, its published configs).

    Three regularisers, unweighted in ``Routing.losses`` (the method's coefficients weigh them):

    - ``latent_kl``: ``mean_t KL(N(μ_t, σ_t²) ‖ N(0, I))`` (:func:`moelab.losses.gaussian_kl_loss`);
    - ``prototype_diversity``: how far the normalised token latents ``μ`` and, separately, the
      prototypes are from orthonormal (:func:`moelab.losses.orthogonality_loss`, summed);
    - ``prototype_alignment``: ``mean |P − Aᵀ z|``, the prototypes pulled towards the latents
      ``z = μ + σ ε`` (a sample, ``ε ~ N(0, I)``, in training; ``μ`` in evaluation) weighted by the
      assignment ``A = softmax_N(the top-K similarities scattered into zeros)``, the target detached
      (:func:`moelab.losses.prototype_alignment_loss`).

    ``Routing.probs`` is the softmax of the ``N`` similarities (the authors' balance loss reads it;
    their LPR runs set its coefficient to 0), ``Routing.logits`` the similarities.  Evaluation routes
    by the same rule (no sample enters the routing: it is taken for the alignment target only).

    The aligner (``aligner=True``, the authors' code): the routed experts run on
    ``x + out_proj(softmax(s) P)``, a ``D → d`` linear map (with bias) of the token's
    similarity-weighted prototype mixture, which the router hands the layer as ``Routing.inputs``
    (the shared experts run on ``x``, as the authors' DeepSeek-V3 block).

    Options:
        aligner: add the aligner's ``out_proj(softmax(s) P)`` to the experts' input (True, the
            authors' code; its ``out_proj`` is ``N(0, 1/D)``, bias 0).
        latent_dim: ``D`` (16, every published config).
        renormalize: softmax over the K chosen similarities (the authors'); ``None`` (default): so for
            K > 1, the softmax over all N at the chosen for K = 1 (moelab's rule: the authors' weight
            1 would leave the router without a task gradient); ``False``: the softmax over all N.
        selection_bias: the aux-loss-free selection bias (DeepSeek-V3) on the softmax over all N,
            for the choice only; default off (the authors' router has none).
        bias_update_rate: its step γ (1e-3).
        init_std: std of the ``N(0, σ²)`` init of the encoder's ``W``; default ``d^-1/2`` as
            moelab's other routers (the authors' models init linear layers with 0.02).  The
            prototypes are ``N(0, 1)`` as the authors', the bias 0, the LayerNorm the identity.
    """

    loss_names = ("latent_kl", "prototype_diversity", "prototype_alignment")

    config_class = LatentPrototypeConfig

    def __init__(self, d_model: int, num_experts: int, top_k: int, **options: Any) -> None:
        super().__init__(d_model, num_experts, top_k, **options)
        o = self.options
        self.latent_dim = o.latent_dim
        self.renormalize = o.renormalize
        self.init_selection_bias(o.selection_bias, o.bias_update_rate)
        self.init_std = 1.0 / math.sqrt(d_model) if o.init_std is None else o.init_std
        self.norm = nn.LayerNorm(d_model)
        #: the encoder: rows [0, D) give μ, rows [D, 2D) give log σ²
        self.encoder = nn.Linear(d_model, 2 * o.latent_dim)
        self.prototypes = nn.Parameter(torch.empty(num_experts, o.latent_dim))
        #: the aligner: the token's prototype mixture back to the model width, added to the experts' input
        self.out_proj = nn.Linear(o.latent_dim, d_model) if o.aligner else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """``W ~ N(0, init_std²)``, ``b = 0``, ``P ~ N(0, 1)``, the LayerNorm the identity; the
        aligner's ``out_proj`` ``N(0, 1/D)``, bias 0."""
        with torch.no_grad():
            self.norm.reset_parameters()
            self.encoder.weight.copy_(torch.randn(self.encoder.weight.shape) * self.init_std)
            self.encoder.bias.zero_()
            self.prototypes.copy_(torch.randn(self.prototypes.shape))
            if self.out_proj is not None:
                self.out_proj.weight.copy_(
                    torch.randn(self.out_proj.weight.shape) / math.sqrt(self.latent_dim)
                )
                self.out_proj.bias.zero_()

    def encode(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """``(μ, log σ²)``, each ``(T, D)``: the variational encoder ``W SiLU(LN(x)) + b``."""
        mu, logvar = self.encoder(F.silu(self.norm(x))).chunk(2, dim=-1)
        return mu, logvar

    def forward(
        self, x: Tensor, experts: Experts | None = None, ctx: RoutingContext | None = None
    ) -> Routing:
        mu, logvar = self.encode(x)
        prototypes = self.prototypes.to(mu.dtype)
        scores = prototype_scores(mu, prototypes)  # (T, N) cosine similarities
        weights, indices, probs = topk_gate(scores, self.top_k, self.renormalize, self.selection_bias)
        self.count_load(indices)
        top = scores.gather(1, indices)
        # the sample z = μ + σ ε enters only the alignment target (the routing reads μ)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp() if self.training else mu
        assignment = torch.zeros_like(scores).scatter(1, indices, top).softmax(dim=-1).detach()
        losses = {
            "latent_kl": gaussian_kl_loss(mu, logvar),
            "prototype_diversity": orthogonality_loss(mu) + orthogonality_loss(prototypes),
            "prototype_alignment": prototype_alignment_loss(prototypes, assignment, z),
        }
        inputs = None if self.out_proj is None else x + self.out_proj(probs @ prototypes)
        return Routing(
            indices=indices, weights=weights, probs=probs, logits=scores, losses=losses, inputs=inputs
        )

    @property
    def weights_sum_to_one(self) -> bool:
        return resolve_renormalize(self.renormalize, self.top_k)

    def weights_at(self, routing: Routing, indices: Tensor) -> Tensor | None:
        return topk_gate_weights_at(routing.logits, routing.probs, indices, self.weights_sum_to_one)

    def rule_options(self) -> dict[str, Any]:
        return {"renormalize": self.renormalize, "selection_bias": self.selection_bias}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, latent_dim={self.latent_dim}"
