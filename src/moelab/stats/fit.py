"""Batched estimators: least squares for regression MoE, maximum likelihood for Gaussian MoE.

R replicates are fitted in ONE optimisation: every replicate's loss depends only on its own
parameters, so minimising the sum ``Σ_r L_r`` moves each replicate exactly as its own fit would
under SGD and Adam (both act coordinate-wise).  L-BFGS shares its line search and curvature
pairs across the sum; it reaches the same minimisers but along a different path than R separate
runs (it is not bit-identical to a loop).

Estimators (scikit-learn style: hyper-parameters in ``__init__``, ``fit``, ``predict``, learned
attributes with a trailing underscore):

* :class:`LeastSquaresMoE` — the least-squares estimator of 003 eq. (3)/(9):
  ``Ĝ_n ∈ argmin (1/n) Σ (Y_i − f_G(X_i))²``.
* :class:`GaussianMoEMLE` — the MLE of 004 / 001 eq. (4): ``argmax (1/n) Σ log p_G(Y_i | X_i)``.

Initialisation: ``init="truth"`` starts near the true parameters (003 App. E.1: "initialization
... adjusted to be near the true parameters"): truth + N(0, init_noise²).  An over-specified fit
(k > k*) splits true atoms: the extra atom k* + t copies true atom t mod k*, and the copies of
atom j share its weight, β₀ = β*₀ⱼ − log(copies), so the initial function is the truth up to the
noise.  ``init="random"`` draws β₁, η ~ N(0, init_scale²), β₀ = 0, runs ``restarts`` fits per
replicate (batched too) and keeps the one with the lowest training loss.

Translation: a softmax gate over linear logits is invariant to adding the same (t₁, t₂) to every
atom's (β₀, β₁) — the MoE is identifiable only up to this translation (004, "Identifiability up
to translation"; 003 pins the last true atom to 0).  Gradient steps are orthogonal to that flat
direction, so SGD, full-batch GD and L-BFGS conserve Σᵢ β₁ᵢ and Σᵢ β₀ᵢ.  For the linear gate
(and softmax-gated Gaussian MoE) the near-truth initial noise of the gate is therefore centred
over the atoms: the fit keeps the truth's translation and parameters can be compared with it
directly.  Adam rescales coordinates and does not conserve it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from .._validate import non_negative, one_of, positive, positive_int
from .models import GaussianMoE, GaussianParams, MoEParams, RegressionMoE, inputs_t

__all__ = ["OPTIMIZERS", "GaussianMoEMLE", "LeastSquaresMoE", "minimize"]

OPTIMIZERS = ("sgd", "adam", "lbfgs")
INITS = ("truth", "random")


def minimize(
    loss_fn: Callable[[Tensor | None], Tensor],
    params: list[Tensor],
    *,
    optimizer: str = "adam",
    lr: float = 1e-2,
    steps: int = 500,
    batch_size: int | None = None,
    n: int | None = None,
    replicates: int = 1,
    generator: torch.Generator | None = None,
) -> int:
    """Minimise ``Σ_r loss_fn(idx)[r]`` over ``params`` (leaf tensors with ``requires_grad``).

    ``loss_fn(idx)`` returns the ``(R,)`` per-replicate losses on the samples ``idx (R, b)``
    (``None`` = all samples).  ``sgd`` with ``batch_size`` runs ``steps`` epochs of mini-batch SGD
    (003 App. E.1: SGD over epochs), each replicate with its own shuffle; otherwise ``steps``
    full-batch iterations.  Returns the number of optimiser iterations.
    """
    one_of("optimizer", optimizer, OPTIMIZERS)
    positive("lr", lr)
    positive_int("steps", steps)
    if optimizer == "lbfgs":
        opt = torch.optim.LBFGS(
            params,
            lr=lr,
            max_iter=steps,
            history_size=20,
            tolerance_grad=1e-10,
            tolerance_change=1e-14,
            line_search_fn="strong_wolfe",
        )

        def closure() -> Tensor:
            opt.zero_grad()
            loss = loss_fn(None).sum()
            loss.backward()
            return loss

        opt.step(closure)
        return int(opt.state[params[0]].get("n_iter", steps))
    opt = torch.optim.SGD(params, lr=lr) if optimizer == "sgd" else torch.optim.Adam(params, lr=lr)
    iters = 0
    minibatch = optimizer == "sgd" and batch_size is not None and n is not None and batch_size < n
    for _ in range(steps):
        if minibatch:
            perm = torch.rand(replicates, n, generator=generator).argsort(dim=-1)
            for start in range(0, n, batch_size):
                opt.zero_grad()
                loss_fn(perm[:, start : start + batch_size]).sum().backward()
                opt.step()
                iters += 1
        else:
            opt.zero_grad()
            loss_fn(None).sum().backward()
            opt.step()
            iters += 1
    return iters


def _take(t: Tensor, idx: Tensor | None, sample_dim: int = -1) -> Tensor:
    """Samples ``idx (R, b)`` of ``y (R, n)``, of expert-major ``xt (R, d, n)`` (``sample_dim=-1``)
    or of sample-major ``x (R, n, d)`` (``sample_dim=1``)."""
    if idx is None:
        return t
    if t.dim() == 2:
        return t.gather(1, idx)
    if sample_dim == 1:
        return t.gather(1, idx.unsqueeze(-1).expand(-1, -1, t.shape[-1]))
    return t.gather(2, idx.unsqueeze(1).expand(-1, t.shape[1], -1))


def _batched(X: Tensor, Y: Tensor) -> tuple[Tensor, Tensor, bool]:
    if X.dim() == 2 and Y.dim() == 1:
        return X.unsqueeze(0), Y.unsqueeze(0), True
    if X.dim() != 3 or Y.dim() != 2 or X.shape[:2] != Y.shape:
        raise ValueError(
            f"X, Y must be (n, d), (n,) or (R, n, d), (R, n); got {tuple(X.shape)}, {tuple(Y.shape)}"
        )
    return X, Y, False


def _split_truth(t: Tensor, k: int) -> Tensor:
    """Extend true atoms ``(R, k*, ...)`` to k atoms: atom k* + t copies true atom t mod k*."""
    k_true = t.shape[1]
    src = torch.arange(k, device=t.device) % k_true
    return t[:, src]


def _copies(k_true: int, k: int) -> Tensor:
    src = torch.arange(k) % k_true
    return torch.bincount(src, minlength=k_true)[src]


class _BatchedEstimator:
    def __init__(
        self,
        n_experts: int,
        *,
        optimizer: str,
        lr: float,
        steps: int,
        batch_size: int | None,
        init: str,
        init_noise: float,
        init_scale: float,
        restarts: int,
        seed: int,
    ) -> None:
        self.n_experts = positive_int("n_experts", n_experts)
        self.optimizer = one_of("optimizer", optimizer, OPTIMIZERS)
        self.lr = positive("lr", lr)
        self.steps = positive_int("steps", steps)
        self.batch_size = None if batch_size is None else positive_int("batch_size", batch_size)
        self.init = one_of("init", init, INITS)
        self.init_noise = non_negative("init_noise", init_noise)
        self.init_scale = positive("init_scale", init_scale)
        self.restarts = positive_int("restarts", restarts)
        self.seed = seed

    def _check_sizes(self, n: int, d: int, n_params: int, truth_k: int | None) -> None:
        if n < n_params:
            raise ValueError(
                f"sample size n={n} is smaller than the number of parameters ({n_params} for "
                f"{self.n_experts} experts in d={d}); use n >= {n_params}"
            )
        if truth_k is not None and self.n_experts < truth_k:
            raise ValueError(
                f"n_experts={self.n_experts} is smaller than the true number of experts k*={truth_k}; "
                "an exact- or over-specified fit needs n_experts >= k*"
            )

    def _noise(self, t: Tensor, gen: torch.Generator, centered: bool = False) -> Tensor:
        """``t`` plus N(0, init_noise²); ``centered`` removes the noise's mean over the atoms (dim 1)."""
        noise = self.init_noise * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        if centered:
            noise = noise - noise.mean(dim=1, keepdim=True)
        return t + noise

    def _minimize(self, loss_fn, leaves, n: int, replicates: int, gen: torch.Generator) -> int:
        return minimize(
            loss_fn,
            leaves,
            optimizer=self.optimizer,
            lr=self.lr,
            steps=self.steps,
            batch_size=self.batch_size,
            n=n,
            replicates=replicates,
            generator=gen,
        )


class LeastSquaresMoE(_BatchedEstimator):
    """Least-squares fit of a regression MoE (003 eq. (3)/(9)), R replicates at once.

    Args:
        n_experts: k, the number of fitted experts (k* exact-specified, > k* over-specified).
        gate, expert, tau, degree, activation, expert_bias, top_k: the model (:class:`RegressionMoE`);
            ``tau`` sets τ₁ = τ₂ (003 §5.1).
        optimizer: ``sgd`` (003 App. E.1), ``adam`` or ``lbfgs``.
        lr, steps, batch_size: optimiser settings (``steps`` = epochs for mini-batch SGD).
        init: ``truth`` (near the true parameters; needs ``truth`` in :meth:`fit`) or ``random``.
        init_noise: std of the perturbation of the true parameters.
        init_scale, restarts: random initialisation scale and number of restarts.
        seed: seeds the initialisation and the SGD shuffles.

    Attributes (after ``fit``): ``params_`` (:class:`MoEParams`), ``beta0_``, ``beta1_``, ``eta_``,
    ``loss_`` (``(R,)`` final mean squared error), ``restart_losses_`` (``(restarts, R)``),
    ``n_iter_``, ``model_``.
    """

    def __init__(
        self,
        n_experts: int,
        *,
        gate: str = "perturbed",
        expert: str = "ffn",
        tau: float = 0.1,
        degree: int = 2,
        activation: str = "tanh",
        expert_bias: bool = True,
        top_k: int | None = None,
        optimizer: str = "adam",
        lr: float = 1e-2,
        steps: int = 500,
        batch_size: int | None = None,
        init: str = "truth",
        init_noise: float = 0.1,
        init_scale: float = 1.0,
        restarts: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__(
            n_experts,
            optimizer=optimizer,
            lr=lr,
            steps=steps,
            batch_size=batch_size,
            init=init,
            init_noise=init_noise,
            init_scale=init_scale,
            restarts=restarts,
            seed=seed,
        )
        self.model_ = RegressionMoE(
            gate=gate,
            expert=expert,
            tau1=tau,
            tau2=tau,
            degree=degree,
            activation=activation,
            expert_bias=expert_bias,
            top_k=top_k,
        )

    def _init(self, R: int, d: int, truth: MoEParams | None, gen: torch.Generator, dtype) -> MoEParams:
        k, q = self.n_experts, self.model_.expert_dim(d)
        if truth is not None:
            if truth.replicates == 1:
                truth = truth.expand(R)
            k_true = truth.num_experts
            beta0 = _split_truth(truth.beta0, k) - _copies(k_true, k).to(dtype).log()
            beta1, eta = _split_truth(truth.beta1, k), _split_truth(truth.eta, k)
            c = self.model_.gate == "linear"
            return MoEParams(self._noise(beta0, gen, c), self._noise(beta1, gen, c), self._noise(eta, gen))
        s = self.init_scale
        return MoEParams(
            torch.zeros(R, k, dtype=dtype),
            s * torch.randn(R, k, d, generator=gen, dtype=dtype),
            s * torch.randn(R, k, q, generator=gen, dtype=dtype),
        )

    def fit(self, X: Tensor, Y: Tensor, truth: MoEParams | None = None) -> LeastSquaresMoE:
        """Fit to ``X (R, n, d)``, ``Y (R, n)`` (or unbatched ``(n, d)``, ``(n,)``)."""
        X, Y, _ = _batched(X, Y)
        R, n, d = X.shape
        k, q = self.n_experts, self.model_.expert_dim(d)
        if self.init == "truth" and truth is None:
            raise ValueError("init='truth' needs the true parameters: fit(X, Y, truth=...)")
        self._check_sizes(n, d, k * (1 + d + q), truth.num_experts if truth is not None else None)
        if truth is not None and truth.replicates not in (1, R):
            raise ValueError(f"truth has R={truth.replicates} parameter sets; expected 1 or {R}")
        gen = torch.Generator().manual_seed(self.seed)
        restarts = self.restarts if self.init == "random" else 1
        Xr, Yr = X.contiguous().repeat(restarts, 1, 1), Y.repeat(restarts, 1)  # restart-major blocks
        Xtr = inputs_t(Xr)
        if self.init == "truth":
            init = self._init(R, d, truth, gen, X.dtype)
        else:
            init = self._init(R * restarts, d, None, gen, X.dtype)
        leaves = [t.detach().clone().requires_grad_(True) for t in init.tensors().values()]
        params = MoEParams(*leaves)
        model = self.model_

        def loss_fn(idx: Tensor | None) -> Tensor:
            xt, y = _take(Xtr, idx), _take(Yr, idx)
            x = Xr if idx is None else _take(Xr, idx, sample_dim=1)
            return ((y - model.mean_t(xt, params, x)) ** 2).mean(dim=-1)

        self.n_iter_ = self._minimize(loss_fn, leaves, n, R * restarts, gen)
        with torch.no_grad():
            final = loss_fn(None).view(restarts, R)
            self.restart_losses_ = final
            best = final.argmin(dim=0)  # (R,)
            pick = best * R + torch.arange(R)
            self.params_ = params.detach().select(pick)
            self.loss_ = final.min(dim=0).values
        self.beta0_, self.beta1_, self.eta_ = self.params_.beta0, self.params_.beta1, self.params_.eta
        return self

    def predict(self, X: Tensor) -> Tensor:
        """``f_Ĝ(X)``: ``(R, n)`` for batched ``X (R, n, d)``, ``(n,)`` for ``(n, d)`` with R = 1."""
        if X.dim() == 2:
            return self.model_.mean(X.unsqueeze(0), self.params_)[0]
        return self.model_.mean(X, self.params_)


class GaussianMoEMLE(_BatchedEstimator):
    """Maximum-likelihood fit of a Gaussian mixture of linear experts (004; 001 eq. (4)), batched.

    Args:
        n_experts: k fitted experts.
        gating: ``softmax`` or ``competition`` (:class:`GaussianMoE`).
        top_k: optional sparse gate.
        gate_bias: per-expert gate bias for competition gating (:class:`GaussianMoE`).
        Other arguments as :class:`LeastSquaresMoE`.  Variances are optimised as log ν.

    Attributes: ``params_`` (:class:`GaussianParams`), ``a_``, ``b_``, ``nu_``, ``beta0_``,
    ``beta1_``, ``loss_`` (``(R,)`` final mean negative log-likelihood), ``n_iter_``, ``model_``.
    """

    def __init__(
        self,
        n_experts: int,
        *,
        gating: str = "softmax",
        top_k: int | None = None,
        gate_bias: bool = False,
        optimizer: str = "adam",
        lr: float = 1e-2,
        steps: int = 500,
        batch_size: int | None = None,
        init: str = "truth",
        init_noise: float = 0.1,
        init_scale: float = 1.0,
        restarts: int = 1,
        seed: int = 0,
    ) -> None:
        super().__init__(
            n_experts,
            optimizer=optimizer,
            lr=lr,
            steps=steps,
            batch_size=batch_size,
            init=init,
            init_noise=init_noise,
            init_scale=init_scale,
            restarts=restarts,
            seed=seed,
        )
        self.model_ = GaussianMoE(gating=gating, top_k=top_k, gate_bias=gate_bias)

    def _init(self, R: int, d: int, truth: GaussianParams | None, gen, dtype) -> list[Tensor]:
        k = self.n_experts
        if truth is not None:
            k_true = truth.num_experts
            beta0 = _split_truth(truth.beta0, k) - _copies(k_true, k).to(dtype).log()
            parts = [beta0, *(_split_truth(t, k) for t in (truth.beta1, truth.a, truth.b))]
            c = self.model_.gating == "softmax" or self.model_.gate_bias  # translation-invariant gates
            parts = [self._noise(t, gen, centered=c and i < 2) for i, t in enumerate(parts)]
            log_nu = self._noise(_split_truth(truth.nu, k).log(), gen)
            return [*parts, log_nu]
        s = self.init_scale
        return [
            torch.zeros(R, k, dtype=dtype),
            s * torch.randn(R, k, d, generator=gen, dtype=dtype),
            s * torch.randn(R, k, d, generator=gen, dtype=dtype),
            s * torch.randn(R, k, generator=gen, dtype=dtype),
            torch.zeros(R, k, dtype=dtype),
        ]

    def fit(self, X: Tensor, Y: Tensor, truth: GaussianParams | None = None) -> GaussianMoEMLE:
        X, Y, _ = _batched(X, Y)
        R, n, d = X.shape
        k = self.n_experts
        if self.init == "truth" and truth is None:
            raise ValueError("init='truth' needs the true parameters: fit(X, Y, truth=...)")
        gate_params = k * (1 + d) if self.model_.gating == "softmax" else k * self.model_.gate_bias
        self._check_sizes(n, d, gate_params + k * (d + 2), truth.num_experts if truth is not None else None)
        if truth is not None and truth.replicates not in (1, R):
            raise ValueError(f"truth has R={truth.replicates} parameter sets; expected 1 or {R}")
        gen = torch.Generator().manual_seed(self.seed)
        restarts = self.restarts if self.init == "random" else 1
        Xr, Yr = inputs_t(X).repeat(restarts, 1, 1), Y.repeat(restarts, 1)
        if self.init == "truth":
            init = self._init(R, d, truth.expand(R) if truth.replicates == 1 else truth, gen, X.dtype)
        else:
            init = self._init(R * restarts, d, None, gen, X.dtype)
        leaves = [t.detach().clone().requires_grad_(True) for t in init]
        if self.model_.gating == "competition":  # no gate parameters (001 eq. (13)) but the optional bias
            leaves[0].requires_grad_(self.model_.gate_bias)
            leaves[1].requires_grad_(False)
        model = self.model_

        def current() -> GaussianParams:
            beta0, beta1, a, b, log_nu = leaves
            return GaussianParams(beta0, beta1, a, b, log_nu.exp())

        def loss_fn(idx: Tensor | None) -> Tensor:
            x, y = _take(Xr, idx), _take(Yr, idx)
            return -model.log_density_t(x, y, current()).mean(dim=-1)

        trainable = [t for t in leaves if t.requires_grad]
        self.n_iter_ = self._minimize(loss_fn, trainable, n, R * restarts, gen)
        with torch.no_grad():
            final = loss_fn(None).view(restarts, R)
            final = torch.where(torch.isfinite(final), final, torch.full_like(final, math.inf))
            pick = final.argmin(dim=0) * R + torch.arange(R)
            self.params_ = current().detach().select(pick)
            self.loss_ = final.min(dim=0).values
        p = self.params_
        self.beta0_, self.beta1_, self.a_, self.b_, self.nu_ = p.beta0, p.beta1, p.a, p.b, p.nu
        return self

    def score(self, X: Tensor, Y: Tensor) -> Tensor:
        """Mean log-likelihood per replicate: ``(R,)``."""
        X, Y, _ = _batched(X, Y)
        return self.model_.log_density(X, Y, self.params_).mean(dim=-1)
