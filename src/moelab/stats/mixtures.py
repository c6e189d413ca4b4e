"""The MoE models of the paper studies, with parameters in a dict of ``(R, k, ...)`` tensors, and
their batched fit (least squares or maximum likelihood, every replicate its own L-BFGS).

:class:`Mixture` covers what :class:`~.models.RegressionMoE` and :class:`~.models.GaussianMoE` do
not: shared + routed experts (DeepSeek-V2 style, Ho (2025)'s density ``g_{G₁,G₂}``), the
normalised-sigmoid gate (DeepSeek-V3, Ho (2025)), quadratic gating (each self-attention row is a
quadratic-gating MoE, Ho (2025) after Akbarian et al.), the competition gate on |g(x, W)| with
top-K (CompeteSMoE (2024) eq. (6)) and on softplus(g(x, W)) (CompeteSMoE (2025) eq. (13)) over
FFN experts, and the normalised-input expert σ(aᵀx/‖x‖ + b) (Ho (2025)'s strongly identifiable
example).  :class:`LoRAMixture` is a self-attention row with low-rank adapters on the query and
value matrices, the adapters estimated separately (LoRA) or through a shared reparameterisation
(RepLoRA; Ho (2025) after Truong et al.).  docs/methods.md ("The paper studies") has the formulas.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import functional
from .._validate import non_negative, one_of, positive_int
from .fit import from_ball, to_ball
from .lbfgs import REASONS, STALL_RESTARTS, batched_lbfgs

__all__ = ["MIX_EXPERTS", "MIX_GATES", "FitResult", "LoRAMixture", "Mixture", "fit_params"]

MIX_GATES = (
    "softmax",
    "normalized-sigmoid",
    "quadratic",
    "cosine",
    "perturbed",
    "competition",
    "competition-v1",
)
MIX_EXPERTS = ("linear", "polynomial", "ffn", "normalized-input")
_ACTIVATIONS = {"tanh": torch.tanh, "sigmoid": torch.sigmoid, "gelu": F.gelu, "relu": F.relu}
_LOG_2PI = math.log(2 * math.pi)


def _expert(kind: str, act: str, x: Tensor, eta: Tensor) -> Tensor:
    """Expert outputs ``(R, k, n)`` for ``x (R, n, d)``, ``eta (R, k, q)``."""
    d = x.shape[-1]
    if kind in ("linear", "polynomial"):  # aᵀx + b, or (aᵀx + b)² (perturbed cosine router (2024) Table 1)
        lin = eta[..., :d] @ x.transpose(-2, -1) + eta[..., d].unsqueeze(-1)
        return lin if kind == "linear" else lin**2
    if kind == "ffn":  # one hidden unit: η₀ σ(η₁ᵀx + η₂) (ReLU FFN: Ho (2025); CompeteSMoE (2025) Thm. 3.2)
        pre = eta[..., 1 : d + 1] @ x.transpose(-2, -1) + eta[..., d + 1].unsqueeze(-1)
        return eta[..., 0].unsqueeze(-1) * _ACTIVATIONS[act](pre)
    # σ(aᵀx/‖x‖ + b): Ho (2025)'s strongly identifiable expert
    unit = x / x.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)
    return _ACTIVATIONS[act](eta[..., :d] @ unit.transpose(-2, -1) + eta[..., d].unsqueeze(-1))


def expert_dim(kind: str, d: int) -> int:
    """Parameters per expert: d + 1 (linear, polynomial, normalised-input), d + 2 (one-unit FFN)."""
    return d + 2 if kind == "ffn" else d + 1


def _quad_features(x: Tensor) -> Tensor:
    """``(R, n, d(d+1)/2)``: the upper-triangular products xᵢxⱼ (i ≤ j), so xᵀAx = ⟨vech A', ·⟩."""
    d = x.shape[-1]
    i, j = torch.triu_indices(d, d)
    return x[..., i] * x[..., j]


@dataclass(frozen=True)
class Mixture:
    """A mixture of experts with parameters ``params`` (a dict of ``(R, k, ...)`` tensors).

    Routed part: ``Σ_i gateᵢ(x) h(x, ηᵢ)``, ``beta0 (R,k)``, ``beta1 (R,k,d)``, ``eta (R,k,q)``,
    ``quad (R,k,d(d+1)/2)`` (quadratic gate), ``nu (R,k)`` (Gaussian).  Shared part (``shared``):
    constant weights ``ω = softmax(omega (R,k₁))`` over experts ``h(x, κᵢ)``, ``kappa (R,k₁,q)``,
    ``tau (R,k₁)``; the density is ``½ Σ ωᵢ N(y|h(x,κᵢ),τᵢ) + ½ Σ gateᵢ(x) N(y|h(x,ηᵢ),νᵢ)`` (Ho
    (2025)) and the regression function ``½ Σ ωᵢ h(x,κᵢ) + ½ Σ gateᵢ(x) h(x,ηᵢ)``.

    Args:
        likelihood: ``gaussian`` (MLE) or ``regression`` (least squares, Gaussian noise).
        gate: ``softmax`` (β₁ᵀx + β₀), ``normalized-sigmoid`` (σ(β₁ᵀx + β₀)/Σⱼσ(β₁ⱼᵀx + β₀ⱼ)),
            ``quadratic`` (softmax of xᵀAᵢx + β₁ᵢᵀx + β₀ᵢ), ``competition`` (softmax of
            softplus(h(x, ηᵢ)) + β₀ᵢ, CompeteSMoE (2025)), ``competition-v1`` (softmax over the
            top-K of |h(x, ηᵢ)|, CompeteSMoE (2024) eq. (6); no gate parameters).
        expert, activation: the routed experts (and the shared ones): ``linear``, ``ffn``,
            ``normalized-input``; σ of the last two.
        shared: add the shared experts.
        top_k: K of ``competition-v1``.
        tau: τ₁ = τ₂ of the ``perturbed`` cosine gate (``cosine``: softmax of
            β₁ᵢᵀx/(‖β₁ᵢ‖‖x‖) + β₀ᵢ, perturbed cosine router (2024) eq. (2); ``perturbed`` adds τ to
            both norms, eq. (8)).
    """

    likelihood: str = "gaussian"
    gate: str = "softmax"
    expert: str = "linear"
    activation: str = "tanh"
    shared: bool = False
    top_k: int = 1
    tau: float = 1.0

    def __post_init__(self) -> None:
        non_negative("tau", self.tau)
        one_of("likelihood", self.likelihood, ("gaussian", "regression"))
        one_of("gate", self.gate, MIX_GATES)
        one_of("expert", self.expert, MIX_EXPERTS)
        one_of("activation", self.activation, _ACTIVATIONS)
        positive_int("top_k", self.top_k)

    def q(self, d: int) -> int:
        return expert_dim(self.expert, d)

    def experts(self, x: Tensor, eta: Tensor) -> Tensor:
        """``h(x, ηᵢ)`` ``(R, k, n)``."""
        return _expert(self.expert, self.activation, x, eta)

    def gate_weights(self, x: Tensor, p: dict[str, Tensor], h: Tensor | None = None) -> Tensor:
        """Routed gate weights ``(R, k, n)`` (``h``: the routed experts' outputs, if computed)."""
        if self.gate in ("competition", "competition-v1"):
            h = self.experts(x, p["eta"]) if h is None else h
            if self.gate == "competition":
                return (F.softplus(h) + p["beta0"].unsqueeze(-1)).softmax(dim=-2)
            affinity = functional.competition_affinity(h.unsqueeze(-1), reduce="norm")  # |h|
            if self.top_k >= affinity.shape[-2]:
                return affinity.softmax(dim=-2)
            w, idx = functional.topk_softmax(affinity.transpose(-2, -1), self.top_k)
            return torch.zeros_like(affinity).transpose(-2, -1).scatter(-1, idx, w).transpose(-2, -1)
        if self.gate in ("cosine", "perturbed"):  # perturbed cosine router (2024) eq. (2), (8)
            tau = self.tau if self.gate == "perturbed" else 0.0
            raw = functional.cosine_logits(p["beta1"], x, tau_x=tau, tau_e=tau)
            return (raw + p["beta0"].unsqueeze(-1)).softmax(dim=-2)
        logits = p["beta1"] @ x.transpose(-2, -1) + p["beta0"].unsqueeze(-1)
        if self.gate == "quadratic":
            logits = logits + p["quad"] @ _quad_features(x).transpose(-2, -1)
        if self.gate == "normalized-sigmoid":
            s = torch.sigmoid(logits)
            return s / s.sum(dim=-2, keepdim=True)
        return logits.softmax(dim=-2)

    def mean(self, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        """The regression function ``E[y | x]`` ``(R, n)``."""
        h = self.experts(x, p["eta"])
        out = (self.gate_weights(x, p, h) * h).sum(dim=-2)
        if self.shared:
            hs = self.experts(x, p["kappa"])
            out = 0.5 * out + 0.5 * (p["omega"].softmax(-1).unsqueeze(-1) * hs).sum(dim=-2)
        return out

    def components(self, x: Tensor, p: dict[str, Tensor]) -> tuple[Tensor, Tensor, Tensor]:
        """The Gaussian mixture in y at every x: weights, means, variances ``(R, n, c)``."""
        h = self.experts(x, p["eta"])
        w, mu, var = self.gate_weights(x, p, h), h, p["nu"].unsqueeze(-1).expand_as(h)
        if self.shared:
            hs = self.experts(x, p["kappa"])
            ws = p["omega"].softmax(-1).unsqueeze(-1).expand_as(hs)
            w = torch.cat([0.5 * ws, 0.5 * w], dim=-2)
            mu = torch.cat([hs, mu], dim=-2)
            var = torch.cat([p["tau"].unsqueeze(-1).expand_as(hs), var], dim=-2)
        return w.transpose(-2, -1), mu.transpose(-2, -1), var.transpose(-2, -1)

    def log_density(self, x: Tensor, y: Tensor, p: dict[str, Tensor]) -> Tensor:
        """``log p(y | x)``: ``y (R, n)`` → ``(R, n)``; ``y (R, n, Q)`` (Q points per x) → ``(R, n, Q)``."""
        w, mu, var = self.components(x, p)  # (R, n, c)
        yy = y.unsqueeze(-1) if y.dim() == 2 else y  # (R, n, Q)
        log_w = w.clamp_min(torch.finfo(w.dtype).tiny).log().masked_fill(w == 0, -math.inf)
        z = yy.unsqueeze(-1) - mu.unsqueeze(-2)  # (R, n, Q, c)
        comp = -0.5 * (z**2 / var.unsqueeze(-2) + var.log().unsqueeze(-2) + _LOG_2PI)
        out = (log_w.unsqueeze(-2) + comp).logsumexp(dim=-1)
        return out.squeeze(-1) if y.dim() == 2 else out

    def objective(self, x: Tensor, y: Tensor, p: dict[str, Tensor]) -> Tensor:
        """Per replicate: mean squared error (regression) or mean negative log-likelihood."""
        if self.likelihood == "regression":
            return ((y - self.mean(x, p)) ** 2).mean(dim=-1)
        return -self.log_density(x, y, p).mean(dim=-1)

    def sample(self, x: Tensor, p: dict[str, Tensor], noise_var: float, gen: torch.Generator) -> Tensor:
        """Responses at ``x``: ``f(x) + ε`` (regression), or a draw from ``p(·|x)`` (Gaussian)."""
        if self.likelihood == "regression":
            f = self.mean(x, p)
            return f + math.sqrt(noise_var) * torch.randn(f.shape, generator=gen, dtype=f.dtype)
        w, mu, var = self.components(x, p)
        R, n, c = w.shape
        z = torch.multinomial(w.reshape(-1, c), 1, generator=gen).view(R, n, 1)
        m, v = mu.gather(-1, z).squeeze(-1), var.gather(-1, z).squeeze(-1)
        return m + v.sqrt() * torch.randn(m.shape, generator=gen, dtype=m.dtype)

    def trainable(self) -> tuple[str, ...]:
        """The parameter names the fit optimises."""
        names = ["eta"]
        if self.gate in ("softmax", "normalized-sigmoid", "quadratic", "cosine", "perturbed"):
            names += ["beta0", "beta1"]
        if self.gate == "quadratic":
            names.append("quad")
        if self.gate == "competition":
            names.append("beta0")
        if self.likelihood == "gaussian":
            names.append("nu")
        if self.shared:
            names += ["omega", "kappa"] + (["tau"] if self.likelihood == "gaussian" else [])
        return tuple(names)


@dataclass(frozen=True)
class LoRAMixture:
    """One self-attention row with low-rank adapters as a quadratic-gating MoE (Ho (2025), after
    Truong et al.): ``f(x) = Σⱼ softmaxⱼ(xᵀ(Cⱼ + B_Q A_Q Dⱼ)x) · vᵀ(W + B_V A_V)ᵀ Rⱼ x``, with
    fixed (pre-trained) Cⱼ, Dⱼ, Rⱼ, W, v and rank-``rank`` adapters.

    ``separate`` (LoRA): ``bq (R,d,r)``, ``aq (R,r,d)``, ``bv``, ``av`` free.  ``shared``
    (RepLoRA): A_Q = A_V = φ₁(A), B_Q = B_V = φ₂(B) with φ = tanh elementwise (a one-layer
    stand-in for RepLoRA's MLP), parameters ``a (R,r,d)``, ``b (R,d,r)``.
    """

    mode: str = "shared"
    positions: int = 3

    def __post_init__(self) -> None:
        one_of("mode", self.mode, ("separate", "shared"))
        positive_int("positions", self.positions)

    def adapters(self, p: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """The low-rank products ``(B_Q A_Q, B_V A_V)``, each ``(R, d, d)``."""
        if self.mode == "shared":
            a, b = torch.tanh(p["a"]), torch.tanh(p["b"])
            return b @ a, b @ a
        return p["bq"] @ p["aq"], p["bv"] @ p["av"]

    def mean(self, x: Tensor, p: dict[str, Tensor]) -> Tensor:
        q_delta, v_delta = self.adapters(p)
        fixed = p["fixed"]  # (R, 3·positions + 1, d, d): C₁..C_J, D₁..D_J, R₁..R_J, W; v = W's first column
        J = self.positions
        C, D, Rm, W = fixed[:, :J], fixed[:, J : 2 * J], fixed[:, 2 * J : 3 * J], fixed[:, 3 * J]
        gate_mats = C + q_delta.unsqueeze(1) @ D  # (R, J, d, d)
        logits = torch.einsum("rni,rjik,rnk->rjn", x, gate_mats, x)
        u = ((W + v_delta) @ W[:, :, :1]).squeeze(-1)  # vᵀ(W + ΔV)ᵀ = ((W + ΔV)v)ᵀ, v = W's first column
        expert = torch.einsum("ri,rjik,rnk->rjn", u, Rm, x)
        return (logits.softmax(dim=-2) * expert).sum(dim=-2)

    def objective(self, x: Tensor, y: Tensor, p: dict[str, Tensor]) -> Tensor:
        return ((y - self.mean(x, p)) ** 2).mean(dim=-1)

    def sample(self, x: Tensor, p: dict[str, Tensor], noise_var: float, gen: torch.Generator) -> Tensor:
        f = self.mean(x, p)
        return f + math.sqrt(noise_var) * torch.randn(f.shape, generator=gen, dtype=f.dtype)

    def trainable(self) -> tuple[str, ...]:
        return ("a", "b") if self.mode == "shared" else ("bq", "aq", "bv", "av")


@dataclass
class FitResult:
    """A batched fit: ``params`` (every tensor ``(R, ...)``), ``loss (R,)`` and per replicate
    ``n_iter``, ``grad_norm``, ``converged`` and ``reason`` (entries of
    :data:`moelab.stats.lbfgs.REASONS`)."""

    params: dict[str, Tensor]
    loss: Tensor
    n_iter: Tensor
    grad_norm: Tensor
    converged: Tensor
    reason: list[str]


#: parameters kept in a ball (the compact parameter space of the rate theorems): radius
#: ``bound_scale · √(last dimension)``
_BALLED = ("beta1", "eta", "kappa", "quad")
_VARIANCES = ("nu", "tau")


def fit_params(
    model: Mixture | LoRAMixture,
    x: Tensor,
    y: Tensor,
    start: dict[str, Tensor],
    *,
    steps: int = 500,
    gtol: float = 1e-7,
    ftol: float = 1e-12,
    lr: float = 1.0,
    nu_min: float = 0.0,
    bound_scale: float = 10.0,
    stall_restarts: int = STALL_RESTARTS,
) -> FitResult:
    """Minimise ``model.objective`` over ``model.trainable()`` from ``start`` (every replicate its
    own L-BFGS: a batched fit equals the separate fits).  Variances are optimised as
    log(ν − nu_min); ``beta1``, ``eta``, ``kappa``, ``quad`` live in balls of radius
    ``bound_scale · √dim`` (:func:`moelab.stats.fit.to_ball`); parameters not trained keep
    their start.  A replicate at the cap of ``steps`` iterations is restarted up to
    ``stall_restarts`` times from its perturbed best point
    (:func:`moelab.stats.lbfgs.batched_lbfgs`)."""
    non_negative("nu_min", nu_min)
    names = model.trainable()
    bounds = {k: bound_scale * math.sqrt(start[k].shape[-1]) for k in names if k in _BALLED}
    leaves = {}
    for k in names:
        t = start[k].detach()
        if k in _VARIANCES:
            t = (t - nu_min).clamp_min(1e-12).log()
        elif k in bounds:
            r = t.norm(dim=-1, keepdim=True)
            limit = 0.99 * bounds[k]
            t = from_ball(torch.where(r > limit, t * limit / r.clamp_min(1e-300), t), bounds[k])
        leaves[k] = t.clone().requires_grad_(True)

    def current() -> dict[str, Tensor]:
        p = dict(start)
        for k, v in leaves.items():
            p[k] = nu_min + v.exp() if k in _VARIANCES else to_ball(v, bounds[k]) if k in bounds else v
        return p

    result = batched_lbfgs(
        lambda: model.objective(x, y, current()),
        list(leaves.values()),
        max_iter=steps,
        lr=lr,
        gtol=gtol,
        ftol=ftol,
        stall_restarts=stall_restarts,
    )
    with torch.no_grad():
        params = {k: v.detach() for k, v in current().items()}
        loss = model.objective(x, y, params)
    return FitResult(
        params,
        loss,
        result.n_iter,
        result.grad_norm,
        result.converged,
        [REASONS[int(i)] for i in result.reason],
    )
