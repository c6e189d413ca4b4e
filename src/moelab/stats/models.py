"""Regression and Gaussian mixture-of-experts models with a leading replicate dimension ``R``
(inputs ``(R, n, d)``, parameters ``beta0 (R, k)``, ``beta1 (R, k, d)``, ``eta (R, k, q)``), so R
independent fits run as one batched computation: regression MoE with ``linear``, ``cosine``,
``perturbed`` or ``sigmoid`` gates over ``linear``, ``polynomial`` or ``ffn`` experts, and Gaussian
MoE with ``softmax`` or ``competition`` gating, each optionally top-K sparse; the gates are computed
by the routers' own functions (:mod:`moelab.functional`).  docs/methods.md ("The models") gives
every formula with its paper and equation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import functional
from .._validate import non_negative, one_of, positive_int

__all__ = [
    "EXPERTS",
    "EXPERT_ACTIVATIONS",
    "GATES",
    "GAUSSIAN_GATINGS",
    "GaussianMoE",
    "GaussianParams",
    "MoEParams",
    "RegressionMoE",
    "inputs_t",
]

GATES = ("linear", "cosine", "perturbed", "sigmoid")
EXPERTS = ("linear", "polynomial", "ffn")
EXPERT_ACTIVATIONS = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "gelu": F.gelu, "relu": F.relu}
GAUSSIAN_GATINGS = ("softmax", "competition")


@dataclass
class MoEParams:
    """Parameters of R regression MoEs with k experts: ``beta0 (R,k)``, ``beta1 (R,k,d)``, ``eta (R,k,q)``.

    The mixing measure ``G = Σ_i exp(β₀ᵢ) δ_(β₁ᵢ, ηᵢ)`` of the perturbed cosine router (2024) §2.
    """

    beta0: Tensor
    beta1: Tensor
    eta: Tensor

    def __post_init__(self) -> None:
        if self.beta0.dim() != 2 or self.beta1.dim() != 3 or self.eta.dim() != 3:
            raise ValueError(
                "MoEParams expects beta0 (R,k), beta1 (R,k,d), eta (R,k,q); got shapes "
                f"{tuple(self.beta0.shape)}, {tuple(self.beta1.shape)}, {tuple(self.eta.shape)}"
            )
        if not (self.beta0.shape == self.beta1.shape[:2] == self.eta.shape[:2]):
            raise ValueError(
                "MoEParams: beta0, beta1, eta disagree on (R, k): "
                f"{tuple(self.beta0.shape)}, {tuple(self.beta1.shape)}, {tuple(self.eta.shape)}"
            )

    @property
    def replicates(self) -> int:
        return self.beta0.shape[0]

    @property
    def num_experts(self) -> int:
        return self.beta0.shape[1]

    def tensors(self) -> dict[str, Tensor]:
        return {"beta0": self.beta0, "beta1": self.beta1, "eta": self.eta}

    def detach(self) -> MoEParams:
        return MoEParams(self.beta0.detach(), self.beta1.detach(), self.eta.detach())

    def select(self, index: Tensor) -> MoEParams:
        """Replicates ``index`` (a 1-D index tensor)."""
        return MoEParams(self.beta0[index], self.beta1[index], self.eta[index])

    def expand(self, replicates: int) -> MoEParams:
        """Repeat a single set of parameters (R = 1) ``replicates`` times."""
        if self.replicates != 1:
            raise ValueError(f"expand needs R=1 parameters, got R={self.replicates}")
        return MoEParams(
            self.beta0.expand(replicates, -1).clone(),
            self.beta1.expand(replicates, -1, -1).clone(),
            self.eta.expand(replicates, -1, -1).clone(),
        )


@dataclass
class GaussianParams:
    """Parameters of R Gaussian MoEs: gate ``beta0 (R,k)``, ``beta1 (R,k,d)`` (unused by competition
    gating, may be zeros), expert means ``aᵀx + b`` with ``a (R,k,d)``, ``b (R,k)``, variances ``nu (R,k)``.
    """

    beta0: Tensor
    beta1: Tensor
    a: Tensor
    b: Tensor
    nu: Tensor

    @property
    def replicates(self) -> int:
        return self.a.shape[0]

    @property
    def num_experts(self) -> int:
        return self.a.shape[1]

    def tensors(self) -> dict[str, Tensor]:
        return {"beta0": self.beta0, "beta1": self.beta1, "a": self.a, "b": self.b, "nu": self.nu}

    def detach(self) -> GaussianParams:
        return GaussianParams(*(t.detach() for t in self.tensors().values()))

    def select(self, index: Tensor) -> GaussianParams:
        return GaussianParams(*(t[index] for t in self.tensors().values()))

    def expand(self, replicates: int) -> GaussianParams:
        if self.replicates != 1:
            raise ValueError(f"expand needs R=1 parameters, got R={self.replicates}")
        return GaussianParams(*(t.expand(replicates, *t.shape[1:]).clone() for t in self.tensors().values()))


def _check_x(x: Tensor) -> None:
    if x.dim() != 3:
        raise ValueError(
            f"x must be (R, n, d) with a leading replicate dimension, got shape {tuple(x.shape)}"
        )


def inputs_t(x: Tensor) -> Tensor:
    """``x (R, n, d)`` → the expert-major layout ``(R, d, n)`` used internally.

    Every internal tensor is laid out ``(R, k, n)``: with k and d tiny, reductions and softmaxes
    over a middle axis of a contiguous ``(R, k, n)`` tensor vectorise on the CPU, where the same ops
    over the last axis of ``(R, n, k)`` do not (timed in docs/performance-stats.md, "Layout").  Estimators transpose the data
    once per fit and call the ``*_t`` methods.
    """
    _check_x(x)
    return x.transpose(-2, -1).contiguous()


def _sparse_t(logits: Tensor, k: int | None) -> Tensor:
    """Gate weights ``(R, k, n)`` from logits ``(R, k, n)``: softmax over experts, or top-K sparse."""
    if k is None or k >= logits.shape[-2]:
        return logits.softmax(dim=-2)
    weights, idx = functional.topk_softmax(logits.transpose(-2, -1), k)
    return torch.zeros_like(logits).transpose(-2, -1).scatter(-1, idx, weights).transpose(-2, -1)


@dataclass(frozen=True)
class RegressionMoE:
    """The regression MoE ``f_G(x) = Σ_i gate_i(x) h(x, η_i)`` (module docstring for the formulas).

    Args:
        gate: ``linear`` | ``cosine`` | ``perturbed`` | ``sigmoid``.
        expert: ``linear`` | ``polynomial`` | ``ffn``.
        tau1: perturbation of the expert-embedding norm ‖β₁ᵢ‖ (perturbed gate only).
        tau2: perturbation of the input norm ‖x‖ (perturbed gate only).  perturbed cosine router (2024) §5.1 uses τ₁ = τ₂.
        degree: polynomial degree p (``polynomial`` experts).
        activation: σ of the ``ffn`` expert: tanh | sigmoid | gelu | relu.
        expert_bias: include the inner bias c of the ``ffn`` expert.
        top_k: keep the top-K gate logits (sparse softmax); ``None`` = dense.

    Public methods take ``x (R, n, d)`` and return ``(R, n, k)`` / ``(R, n)``; the ``*_t`` methods
    take ``xt (R, d, n)`` (:func:`inputs_t`) and return ``(R, k, n)`` / ``(R, n)``.
    """

    gate: str = "perturbed"
    expert: str = "ffn"
    tau1: float = 0.1
    tau2: float = 0.1
    degree: int = 2
    activation: str = "tanh"
    expert_bias: bool = True
    top_k: int | None = None

    def __post_init__(self) -> None:
        one_of("gate", self.gate, GATES)
        one_of("expert", self.expert, EXPERTS)
        non_negative("tau1", self.tau1)
        non_negative("tau2", self.tau2)
        positive_int("degree", self.degree)
        one_of("activation", self.activation, EXPERT_ACTIVATIONS)
        if self.top_k is not None:
            positive_int("top_k", self.top_k)

    def expert_dim(self, d: int) -> int:
        """Size q of one expert's parameter vector η for inputs in R^d."""
        if self.expert == "ffn":
            return d + 2 if self.expert_bias else d + 1
        return d + 1

    # ---- expert-major internals: xt (R, d, n) -> (R, k, n)
    def logits_t(self, xt: Tensor, beta0: Tensor, beta1: Tensor, x: Tensor | None = None) -> Tensor:
        """Logits ``(R, k, n)``; ``x`` is the same data sample-major and contiguous (computed if None:
        the cosine gates take norms over d, fast only on that layout)."""
        if self.gate in ("linear", "sigmoid"):
            raw = beta1 @ xt
        else:
            if x is None:
                x = xt.transpose(-2, -1).contiguous()
            # cosine_logits(a, b) = aᵀb / ((‖a‖ + τ_a)(‖b‖ + τ_b)) is symmetric: call it expert-major,
            # τ₁ on ‖β₁ᵢ‖ and τ₂ on ‖x‖ (perturbed cosine router (2024) eq. (8)); the cosine gate is τ₁ = τ₂ = 0 (perturbed cosine router (2024) eq. (2))
            tau1, tau2 = (self.tau1, self.tau2) if self.gate == "perturbed" else (0.0, 0.0)
            raw = functional.cosine_logits(beta1, x, tau_x=tau1, tau_e=tau2)
        return raw + beta0.unsqueeze(-1)

    def gate_weights_t(self, xt: Tensor, beta0: Tensor, beta1: Tensor, x: Tensor | None = None) -> Tensor:
        logits = self.logits_t(xt, beta0, beta1, x)
        if self.gate == "sigmoid":
            scores = torch.sigmoid(logits)
            if self.top_k is None or self.top_k >= scores.shape[-2]:
                return scores
            idx = scores.topk(self.top_k, dim=-2).indices
            return torch.zeros_like(scores).scatter(-2, idx, scores.gather(-2, idx))
        return _sparse_t(logits, self.top_k)

    def experts_t(self, xt: Tensor, eta: Tensor) -> Tensor:
        d = xt.shape[-2]
        if eta.shape[-1] != self.expert_dim(d):
            raise ValueError(
                f"eta has {eta.shape[-1]} parameters per expert; expert={self.expert!r} with d={d} needs "
                f"{self.expert_dim(d)}"
            )
        if self.expert == "ffn":
            pre = eta[..., 1 : d + 1] @ xt  # (R, k, n)
            if self.expert_bias:
                pre = pre + eta[..., d + 1].unsqueeze(-1)
            return eta[..., 0].unsqueeze(-1) * EXPERT_ACTIVATIONS[self.activation](pre)
        lin = eta[..., :d] @ xt + eta[..., d].unsqueeze(-1)
        return lin if self.expert == "linear" else lin**self.degree

    def mean_t(self, xt: Tensor, params: MoEParams, x: Tensor | None = None) -> Tensor:
        w = self.gate_weights_t(xt, params.beta0, params.beta1, x)
        return (w * self.experts_t(xt, params.eta)).sum(dim=-2)

    # ---- public, sample-major
    def logits(self, x: Tensor, beta0: Tensor, beta1: Tensor) -> Tensor:
        """Gate logits ``ℓ (R, n, k)``."""
        return self.logits_t(inputs_t(x), beta0, beta1, x.contiguous()).transpose(-2, -1)

    def gate_weights(self, x: Tensor, beta0: Tensor, beta1: Tensor) -> Tensor:
        """Gate weights ``(R, n, k)``: softmax of the logits (or σ of them for the sigmoid gate)."""
        return self.gate_weights_t(inputs_t(x), beta0, beta1, x.contiguous()).transpose(-2, -1)

    def experts(self, x: Tensor, eta: Tensor) -> Tensor:
        """Expert outputs ``h(x, η_i)`` for every expert: ``(R, n, k)``."""
        return self.experts_t(inputs_t(x), eta).transpose(-2, -1)

    def mean(self, x: Tensor, params: MoEParams) -> Tensor:
        """``f_G(x)`` for every replicate: ``(R, n)``."""
        return self.mean_t(inputs_t(x), params, x.contiguous())


@dataclass(frozen=True)
class GaussianMoE:
    """Gaussian mixture of linear experts ``p_G(y|x) = Σ_i π_i(x) N(y | aᵢᵀx + bᵢ, νᵢ)``.

    Args:
        gating: ``softmax`` (π = softmax(β₁ᵀx + β₀); Ho (2025), Nguyen et al. 2023) or ``competition``
            (π = softmax(softplus(aᵢᵀx + bᵢ)); CompeteSMoE (2025) eq. (13)).
        top_k: optional top-K sparse softmax over the gate logits (CompeteSMoE v1 (2024) eq. (6) uses a top-K gate).
        gate_bias: competition gating only: add a per-expert bias, π ∝ exp(softplus(μᵢ) + β₀ᵢ).
            CompeteSMoE (2025) eq. (3)/(13) has no such parameter, but its Voronoi losses (eq. (6), (14)) weigh
            atoms by exp(cᵢ) and need it: without it every atom's gate numerator is
            1 + e^{μᵢ} ≥ 1, so an over-specified fit cannot put two atoms where one was (their
            weights add up) and the k* + 1 model cannot represent the k* truth.

    Public methods take ``x (R, n, d)``; ``*_t`` methods take ``xt (R, d, n)`` (see RegressionMoE).
    """

    gating: str = "softmax"
    top_k: int | None = None
    gate_bias: bool = False

    def __post_init__(self) -> None:
        one_of("gating", self.gating, GAUSSIAN_GATINGS)
        if self.top_k is not None:
            positive_int("top_k", self.top_k)

    def means_t(self, xt: Tensor, params: GaussianParams) -> Tensor:
        return params.a @ xt + params.b.unsqueeze(-1)

    def gate_logits_t(self, xt: Tensor, params: GaussianParams, means: Tensor | None = None) -> Tensor:
        if self.gating == "softmax":
            return params.beta1 @ xt + params.beta0.unsqueeze(-1)
        if means is None:
            means = self.means_t(xt, params)
        # one-dimensional expert outputs: the mean over features of softplus is softplus itself
        affinity = functional.competition_affinity(means.unsqueeze(-1), "softplus", "mean")
        return affinity + params.beta0.unsqueeze(-1) if self.gate_bias else affinity

    def log_density_t(self, xt: Tensor, y: Tensor, params: GaussianParams) -> Tensor:
        means = self.means_t(xt, params)  # (R, k, n)
        logits = self.gate_logits_t(xt, params, means)
        if self.top_k is None or self.top_k >= logits.shape[-2]:
            log_pi = logits.log_softmax(dim=-2)
        else:
            w = _sparse_t(logits, self.top_k)
            log_pi = w.clamp_min(torch.finfo(w.dtype).tiny).log().masked_fill(w == 0, -math.inf)
        nu = params.nu.unsqueeze(-1)  # (R, k, 1)
        log_norm = -0.5 * ((y.unsqueeze(-2) - means) ** 2 / nu + nu.log() + math.log(2 * math.pi))
        return (log_pi + log_norm).logsumexp(dim=-2)

    def means(self, x: Tensor, params: GaussianParams) -> Tensor:
        """Expert means ``aᵢᵀx + bᵢ``: ``(R, n, k)``."""
        return self.means_t(inputs_t(x), params).transpose(-2, -1)

    def gate_logits(self, x: Tensor, params: GaussianParams) -> Tensor:
        """Gate logits ``(R, n, k)``: β₁ᵀx + β₀, or the softplus competition affinity of the means."""
        return self.gate_logits_t(inputs_t(x), params).transpose(-2, -1)

    def gate_weights(self, x: Tensor, params: GaussianParams) -> Tensor:
        """Gate weights π ``(R, n, k)``."""
        return _sparse_t(self.gate_logits_t(inputs_t(x), params), self.top_k).transpose(-2, -1)

    def log_density(self, x: Tensor, y: Tensor, params: GaussianParams) -> Tensor:
        """``log p_G(y | x)`` for every sample: ``(R, n)``; ``y`` is ``(R, n)``."""
        return self.log_density_t(inputs_t(x), y, params)
