"""Batched estimators in scikit-learn's shape: least squares for regression MoE
(:class:`LeastSquaresMoE`, the perturbed cosine router (2024) eq. 3/9) and maximum likelihood for
Gaussian MoE (:class:`GaussianMoEMLE`, Ho (2025) and CompeteSMoE (2025) eq. 4).  R replicates are
fitted in one batched optimisation, each with its own line search and stopping test; embeddings
live in a ball of radius ``beta1_bound`` through a smooth bijection.  docs/methods.md ("The
estimators of moelab.stats") states the conventions, the initialisation, the bound, the
convergence test and the translation invariance; docs/results.md ("Statistical convergence")
shows them at work.
"""

from __future__ import annotations

import inspect
import math
import numbers
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor

from .._validate import non_negative, one_of, positive, positive_int
from .lbfgs import REASONS, STALL_RESTARTS, LBFGSResult, batched_lbfgs
from .models import GaussianMoE, GaussianParams, MoEParams, RegressionMoE, inputs_t

__all__ = ["INITS", "OPTIMIZERS", "GaussianMoEMLE", "LeastSquaresMoE", "from_ball", "minimize", "to_ball"]

OPTIMIZERS = ("sgd", "adam", "lbfgs")
INITS = ("near", "truth", "random")  # "truth" is the older name of "near"
#: starting embeddings are shortened radially to at most this fraction of ``beta1_bound``
_START_FRACTION = 0.99


def to_ball(u: Tensor, bound: float) -> Tensor:
    """``β = B · tanh(‖u‖/B) · u/‖u‖`` over the last dimension: a smooth bijection of R^d onto the
    open ball ‖β‖ < B (the identity for ``bound = inf``).  Module docstring for why."""
    if math.isinf(bound):
        return u
    tiny = torch.finfo(u.dtype).tiny
    r = (u * u).sum(dim=-1, keepdim=True).clamp_min(tiny).sqrt()
    return u * (bound * torch.tanh(r / bound) / r)


def from_ball(beta: Tensor, bound: float) -> Tensor:
    """The inverse of :func:`to_ball`: ``u = B · artanh(‖β‖/B) · β/‖β‖`` (needs ‖β‖ < B)."""
    if math.isinf(bound):
        return beta
    tiny = torch.finfo(beta.dtype).tiny
    r = (beta * beta).sum(dim=-1, keepdim=True).clamp_min(tiny).sqrt()
    return beta * (bound * torch.atanh(r / bound) / r)


def _into_ball(beta: Tensor, bound: float) -> Tensor:
    """Starting embeddings shortened radially to at most ``_START_FRACTION · bound``."""
    if math.isinf(bound):
        return beta
    r = beta.norm(dim=-1, keepdim=True)
    limit = _START_FRACTION * bound
    return torch.where(r > limit, beta * (limit / r.clamp_min(torch.finfo(beta.dtype).tiny)), beta)


def check_bound(value: object, name: str = "beta1_bound") -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} is not allowed; expected a number > 0 (inf = unconstrained)")
    return float(value)


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
    gtol: float = 1e-7,
    ftol: float = 1e-12,
    stall_restarts: int = STALL_RESTARTS,
) -> LBFGSResult:
    """Minimise ``Σ_r loss_fn(idx)[r]`` over ``params`` (leaf tensors with ``requires_grad``).

    ``loss_fn(idx)`` returns the ``(R,)`` per-replicate losses on the samples ``idx (R, b)``
    (``None`` = all samples).  ``sgd`` with ``batch_size`` runs ``steps`` epochs of mini-batch SGD
    (perturbed cosine router (2024), App. E.1: SGD over epochs), each replicate with its own shuffle; otherwise ``steps``
    full-batch iterations.  ``lbfgs`` runs :func:`moelab.stats.lbfgs.batched_lbfgs`: every replicate
    its own L-BFGS, to convergence (``gtol``, ``ftol``: :func:`~moelab.stats.lbfgs.batched_lbfgs`) or
    ``steps`` iterations, a replicate at that cap restarted up to ``stall_restarts`` times from its
    perturbed best point.  Returns the per-replicate iterations,
    final gradient max-norms and whether each converged before the cap (an
    :class:`~moelab.stats.lbfgs.LBFGSResult`; for sgd/adam every replicate ran every iteration and
    no convergence is tested).
    """
    one_of("optimizer", optimizer, OPTIMIZERS)
    positive("lr", lr)
    positive_int("steps", steps)
    if optimizer == "lbfgs":  # per-replicate line search, curvature and stopping: independent fits
        return batched_lbfgs(
            lambda: loss_fn(None), params, max_iter=steps, lr=lr, gtol=gtol, ftol=ftol,
            stall_restarts=stall_restarts,
        )  # fmt: skip
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
    B = params[0].shape[0]
    grad = torch.cat(
        [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(B, -1) for p in params], 1
    )
    with torch.no_grad():
        finite = torch.isfinite(loss_fn(None)) & torch.isfinite(grad).all(dim=1)
    return LBFGSResult(
        n_iter=torch.full((B,), iters, dtype=torch.long),
        grad_norm=grad.detach().abs().amax(dim=1),
        converged=torch.zeros(B, dtype=torch.bool),
        reason=torch.where(finite, REASONS.index("not tested"), REASONS.index("loss not finite")),
    )


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


def _as_float_tensor(a: Any, dtype: torch.dtype | None = None) -> Tensor:
    """A tensor (kept as is) or an array-like (NumPy arrays keep their float dtype); integers
    become floating point.  ``dtype`` converts to the fitted parameters' dtype."""
    t = torch.as_tensor(a)
    if dtype is not None:
        return t.to(dtype)
    return t if t.is_floating_point() else t.to(torch.get_default_dtype())


def _batched(X: Any, Y: Any, dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, bool]:
    """``X (R, n, d)``, ``Y (R, n)`` as tensors, and whether the input was unbatched ``(n, d)``, ``(n,)``."""
    X = _as_float_tensor(X, dtype)
    Y = _as_float_tensor(Y, X.dtype)
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


def _repeat(truth: Any, R: int, restarts: int) -> Any:
    """``truth`` (1 or R parameter sets) as R · restarts sets, restart-major blocks of R."""
    return type(truth)(
        *(
            t.expand(R, *t.shape[1:]).repeat(restarts, *([1] * (t.dim() - 1)))
            for t in truth.tensors().values()
        )
    )


class _BatchedEstimator:
    """What both estimators share: scikit-learn's parameter protocol (``get_params``,
    ``set_params``, ``clone``), the checks of the shared hyper-parameters and the fit driver
    (initialise, run one batched optimisation, keep each replicate's best restart).

    Subclasses list every hyper-parameter explicitly in ``__init__`` (``get_params`` reads the
    signature, as scikit-learn does) and provide the model, its parameter count, the objective
    and the fitted attributes.

    Shared args:
        n_experts: k, the number of fitted experts (k* exact-specified, > k* over-specified).
        optimizer: ``sgd`` (perturbed cosine router (2024), App. E.1), ``adam`` or ``lbfgs``.
        lr, steps, batch_size: optimiser settings (``steps`` = epochs for mini-batch SGD).
        init: ``near`` (alias ``truth``: near the true parameters; needs ``truth`` in :meth:`fit`)
            or ``random``.
        init_noise: std of the perturbation of the true parameters.
        init_scale: std of the random initialisation (``init="random"``).
        restarts: starts per replicate (each its own draw); the lowest training loss is kept.
        beta1_bound: B, the radius of the ball that holds every gate embedding β₁ᵢ (the compact
            parameter space; module docstring); ``math.inf`` = unconstrained.
        gtol, ftol: L-BFGS stopping tolerances: gradient max-norm, and loss change per iteration
            relative to max(1, |loss|).
        seed: seeds the initialisation and the SGD shuffles.

    Shared attributes (after ``fit``): ``model_``, ``params_``, ``loss_`` (``(R,)`` final training
    loss of the kept restart), ``restart_losses_`` (``(restarts, R)``), and per replicate, of the
    kept restart: ``n_iter_`` (iterations), ``grad_norm_`` (final gradient max-norm, in the
    optimised coordinates), ``converged_`` (the stopping test held after at least one accepted
    step, at a finite loss), ``stop_reason_`` (why it stopped: an entry of
    :data:`moelab.stats.lbfgs.REASONS`), ``hit_cap_`` (stopped by the
    cap ``steps`` without converging); ``n_features_in_``.
    """

    _estimator_type_tag: ClassVar[str | None] = None

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
        beta1_bound: float,
        gtol: float,
        ftol: float,
        seed: int,
    ) -> None:
        self.n_experts = n_experts
        self.optimizer = optimizer
        self.lr = lr
        self.steps = steps
        self.batch_size = batch_size
        self.init = init
        self.init_noise = init_noise
        self.init_scale = init_scale
        self.restarts = restarts
        self.beta1_bound = beta1_bound
        self.gtol = gtol
        self.ftol = ftol
        self.seed = seed

    # ------------------------------------------------------------ scikit-learn parameter protocol

    @classmethod
    def _get_param_names(cls) -> list[str]:
        """The hyper-parameters: the named parameters of the class's ``__init__``."""
        params = inspect.signature(cls.__init__).parameters.values()
        return [
            p.name for p in params if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
        ]

    def get_params(self, deep: bool = True) -> dict[str, Any]:
        """The hyper-parameters as ``{name: value}`` (``deep`` is accepted for scikit-learn; no
        hyper-parameter is itself an estimator)."""
        return {name: getattr(self, name) for name in self._get_param_names()}

    def set_params(self, **params: Any) -> _BatchedEstimator:
        """Set hyper-parameters by name; returns ``self``.  Values are checked by ``fit``."""
        valid = self._get_param_names()
        for name, value in params.items():  # all names first: a bad one changes nothing
            if name not in valid:
                raise ValueError(
                    f"{name}={value!r} is not a parameter of {type(self).__name__}; expected one of {valid}"
                )
        for name, value in params.items():
            setattr(self, name, value)
        return self

    def __repr__(self) -> str:
        """``Name(...)`` with the hyper-parameters that differ from their defaults."""
        sig = inspect.signature(type(self).__init__).parameters
        shown = []
        for name, value in self.get_params().items():
            default = sig[name].default
            is_default = value is default or (
                isinstance(value, (str, int, float)) and type(value) is type(default) and value == default
            )
            if default is inspect.Parameter.empty or not is_default:
                shown.append(f"{name}={value!r}")
        return f"{type(self).__name__}({', '.join(shown)})"

    def __sklearn_is_fitted__(self) -> bool:
        return hasattr(self, "params_")

    def __sklearn_tags__(self) -> Any:  # called by scikit-learn only, so it may import it
        from sklearn.utils import RegressorTags, Tags, TargetTags

        regressor = self._estimator_type_tag == "regressor"
        return Tags(
            estimator_type=self._estimator_type_tag,
            target_tags=TargetTags(required=True),
            regressor_tags=RegressorTags() if regressor else None,
        )

    def _check_is_fitted(self, method: str) -> None:
        if self.__sklearn_is_fitted__():
            return
        msg = f"This {type(self).__name__} instance is not fitted yet; call fit(X, Y) before {method}"
        try:
            from sklearn.exceptions import NotFittedError
        except ImportError:
            raise ValueError(msg) from None
        raise NotFittedError(msg)

    # ------------------------------------------------------------------------------- checks

    def _check_params(self) -> None:
        """The shared hyper-parameters (scikit-learn checks in ``fit``, not in ``__init__``)."""
        positive_int("n_experts", self.n_experts)
        one_of("optimizer", self.optimizer, OPTIMIZERS)
        positive("lr", self.lr)
        positive_int("steps", self.steps)
        if self.batch_size is not None:
            positive_int("batch_size", self.batch_size)
        one_of("init", self.init, INITS)
        non_negative("init_noise", self.init_noise)
        positive("init_scale", self.init_scale)
        positive_int("restarts", self.restarts)
        check_bound(self.beta1_bound)
        non_negative("gtol", self.gtol)
        non_negative("ftol", self.ftol)
        if isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral):
            raise ValueError(f"seed={self.seed!r} is not allowed; expected an integer")

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

    def _inputs(self, X: Any) -> tuple[Tensor, bool]:
        """``X`` as ``(R, n, d)`` in the fitted dtype, and whether it was unbatched ``(n, d)``."""
        X = _as_float_tensor(X, self.params_.beta0.dtype)
        if X.dim() not in (2, 3):
            raise ValueError(f"X must be (n, d) or (R, n, d); got shape {tuple(X.shape)}")
        if X.shape[-1] != self.n_features_in_:
            raise ValueError(
                f"X has d={X.shape[-1]} features; {type(self).__name__} was fitted with "
                f"d={self.n_features_in_}"
            )
        return (X.unsqueeze(0), True) if X.dim() == 2 else (X, False)

    def _scoring_data(self, X: Any, Y: Any) -> tuple[Tensor, Tensor, bool]:
        """``X (R, n, d)``, ``Y (R, n)`` in the fitted dtype, and whether they were unbatched."""
        X, unbatched = self._inputs(X)
        Y = _as_float_tensor(Y, X.dtype)
        X, Y, _ = _batched(X[0] if unbatched else X, Y)
        return X, Y, unbatched

    def _check_truth_in_ball(self, truth: Any) -> None:
        """The near-truth start needs the truth inside the compact parameter space (the closed ball:
        a reference fit Ḡ may lie on its sphere; the start is pulled in to 0.99 of the radius)."""
        largest = float(truth.beta1.norm(dim=-1).max())
        if not largest <= self.beta1_bound * (1 + 1e-9):  # a target fitted onto the sphere is inside
            raise ValueError(
                f"beta1_bound={self.beta1_bound!r} is not allowed for this truth: its largest "
                f"‖β₁ᵢ‖ is {largest:.4g}; expected a bound at or above it (inf = unconstrained)"
            )

    def _noise(self, t: Tensor, gen: torch.Generator, centered: bool = False) -> Tensor:
        """``t`` plus N(0, init_noise²); ``centered`` removes the noise's mean over the atoms (dim 1)."""
        noise = self.init_noise * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        if centered:
            noise = noise - noise.mean(dim=1, keepdim=True)
        return t + noise

    # ------------------------------------------------------------------- what subclasses provide

    def _make_model(self) -> Any:
        raise NotImplementedError

    def _n_params(self, model: Any, d: int) -> int:
        raise NotImplementedError

    def _objective(
        self, model: Any, X: Tensor, Y: Tensor, truth: Any, restarts: int, gen: torch.Generator
    ) -> tuple[Callable[[Tensor | None], Tensor], list[Tensor], Callable[[], Any]]:
        """``(loss_fn, trainable leaves, current parameters)`` on ``restarts`` stacked copies of
        the data (restart-major blocks of R replicates); ``truth`` is ``None`` for ``init="random"``."""
        raise NotImplementedError

    def _set_fitted_params(self, params: Any) -> None:
        raise NotImplementedError

    # ---------------------------------------------------------------------------------- fit

    def _fit(self, X: Any, Y: Any, truth: Any) -> None:
        self._check_params()
        X, Y, _ = _batched(X, Y)
        model = self._make_model()
        R, n, d = X.shape
        near = self.init in ("near", "truth")
        if near and truth is None:
            raise ValueError(f"init={self.init!r} needs the true parameters: fit(X, Y, truth=...)")
        self._check_sizes(n, d, self._n_params(model, d), truth.num_experts if truth is not None else None)
        if truth is not None and truth.replicates not in (1, R):
            raise ValueError(f"truth has R={truth.replicates} parameter sets; expected 1 or {R}")
        if near:
            self._check_truth_in_ball(truth)
        gen = torch.Generator().manual_seed(int(self.seed))
        restarts = self.restarts
        start = _repeat(truth, R, restarts) if near else None
        loss_fn, trainable, current = self._objective(model, X, Y, start, restarts, gen)
        result = minimize(
            loss_fn,
            trainable,
            optimizer=self.optimizer,
            lr=self.lr,
            steps=self.steps,
            batch_size=self.batch_size,
            n=n,
            replicates=R * restarts,
            generator=gen,
            gtol=self.gtol,
            ftol=self.ftol,
        )
        with torch.no_grad():
            final = loss_fn(None).view(restarts, R)
            finite = torch.where(torch.isfinite(final), final, torch.full_like(final, math.inf))
            pick = finite.argmin(dim=0) * R + torch.arange(R)
            params = current().detach().select(pick)
            loss = finite.min(dim=0).values
        self.model_ = model
        self.n_features_in_ = d
        #: per replicate (of the best restart): iterations, final gradient max-norm, converged
        self.n_iter_ = result.n_iter[pick]
        self.grad_norm_ = result.grad_norm[pick]
        self.converged_ = result.converged[pick]
        #: why each replicate's kept restart stopped: an entry of moelab.stats.lbfgs.REASONS
        self.stop_reason_ = [REASONS[int(i)] for i in result.reason[pick]]
        self.hit_cap_ = ~self.converged_ & (self.n_iter_ >= self.steps)
        self.restart_losses_ = final
        self.loss_ = loss
        self.params_ = params
        self._set_fitted_params(params)


class LeastSquaresMoE(_BatchedEstimator):
    """Least-squares fit of a regression MoE (perturbed cosine router (2024), eq. (3)/(9)),
    R replicates at once.

    Args:
        n_experts: k, the number of fitted experts (k* exact-specified, > k* over-specified).
        gate, expert, degree, activation, expert_bias, top_k: the model (:class:`RegressionMoE`).
        tau: τ₁ = τ₂ of the perturbed gate (the perturbed cosine router (2024), §5.1, uses τ₁ = τ₂).
        eta_bound: radius of the ball that holds every expert's parameter vector ηᵢ (module
            docstring); ``math.inf`` (default) = unconstrained.
        optimizer, lr, steps, batch_size, init, init_noise, init_scale, restarts, beta1_bound, gtol,
            ftol, seed: the fit (shared with :class:`GaussianMoEMLE`; see ``_BatchedEstimator``).

    Attributes (after ``fit``): ``params_`` (:class:`MoEParams`), ``beta0_``, ``beta1_``, ``eta_``,
    ``loss_`` (``(R,)`` final mean squared error), ``restart_losses_`` (``(restarts, R)``),
    ``n_iter_``, ``grad_norm_``, ``converged_``, ``hit_cap_``, ``n_features_in_``, ``model_`` (the
    :class:`RegressionMoE`).

    ``score(X, Y)`` is scikit-learn's regressor score: R² = 1 − Σ(y − ŷ)² / Σ(y − ȳ)².
    """

    _estimator_type_tag: ClassVar[str | None] = "regressor"

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
        eta_bound: float = math.inf,
        optimizer: str = "adam",
        lr: float = 1e-2,
        steps: int = 500,
        batch_size: int | None = None,
        init: str = "truth",
        init_noise: float = 0.1,
        init_scale: float = 1.0,
        restarts: int = 1,
        beta1_bound: float = 10.0,
        gtol: float = 1e-7,
        ftol: float = 1e-12,
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
            beta1_bound=beta1_bound,
            gtol=gtol,
            ftol=ftol,
            seed=seed,
        )
        self.gate = gate
        self.expert = expert
        self.tau = tau
        self.degree = degree
        self.activation = activation
        self.expert_bias = expert_bias
        self.top_k = top_k
        self.eta_bound = eta_bound

    def _make_model(self) -> RegressionMoE:
        non_negative("tau", self.tau)
        check_bound(self.eta_bound, "eta_bound")
        return RegressionMoE(
            gate=self.gate,
            expert=self.expert,
            tau1=self.tau,
            tau2=self.tau,
            degree=self.degree,
            activation=self.activation,
            expert_bias=self.expert_bias,
            top_k=self.top_k,
        )

    def _n_params(self, model: RegressionMoE, d: int) -> int:
        return self.n_experts * (1 + d + model.expert_dim(d))

    def _init(
        self, model: RegressionMoE, R: int, d: int, truth: MoEParams | None, gen: torch.Generator, dtype
    ) -> MoEParams:
        k, q = self.n_experts, model.expert_dim(d)
        if truth is not None:
            if truth.replicates == 1:
                truth = truth.expand(R)
            k_true = truth.num_experts
            beta0 = _split_truth(truth.beta0, k) - _copies(k_true, k).to(dtype).log()
            beta1, eta = _split_truth(truth.beta1, k), _split_truth(truth.eta, k)
            # β₀'s noise is centred for every gate: a common shift leaves the gate unchanged but not
            # the Voronoi loss (perturbed cosine router (2024) eq. 11), which it would floor; β₁'s
            # only for the linear gate (the one invariant to it)
            c = model.gate == "linear"
            return MoEParams(self._noise(beta0, gen, True), self._noise(beta1, gen, c), self._noise(eta, gen))
        s = self.init_scale
        return MoEParams(
            torch.zeros(R, k, dtype=dtype),
            s * torch.randn(R, k, d, generator=gen, dtype=dtype),
            s * torch.randn(R, k, q, generator=gen, dtype=dtype),
        )

    def _objective(
        self,
        model: RegressionMoE,
        X: Tensor,
        Y: Tensor,
        truth: MoEParams | None,
        restarts: int,
        gen: torch.Generator,
    ) -> tuple[Callable[[Tensor | None], Tensor], list[Tensor], Callable[[], MoEParams]]:
        R, _, d = X.shape
        Xr, Yr = X.contiguous().repeat(restarts, 1, 1), Y.repeat(restarts, 1)  # restart-major blocks
        Xtr = inputs_t(Xr)
        init = self._init(model, R * restarts, d, truth, gen, X.dtype)
        bound, eta_bound = float(self.beta1_bound), float(self.eta_bound)
        u = from_ball(_into_ball(init.beta1, bound), bound)  # β₁ = to_ball(u): the compact space
        v = from_ball(_into_ball(init.eta, eta_bound), eta_bound)  # η = to_ball(v)
        leaves = [t.detach().clone().requires_grad_(True) for t in (init.beta0, u, v)]

        def current() -> MoEParams:
            return MoEParams(leaves[0], to_ball(leaves[1], bound), to_ball(leaves[2], eta_bound))

        def loss_fn(idx: Tensor | None) -> Tensor:
            xt, y = _take(Xtr, idx), _take(Yr, idx)
            x = Xr if idx is None else _take(Xr, idx, sample_dim=1)
            return ((y - model.mean_t(xt, current(), x)) ** 2).mean(dim=-1)

        return loss_fn, leaves, current

    def _check_truth_in_ball(self, truth: MoEParams) -> None:
        super()._check_truth_in_ball(truth)
        largest = float(truth.eta.norm(dim=-1).max())
        if not largest <= self.eta_bound * (1 + 1e-9):
            raise ValueError(
                f"eta_bound={self.eta_bound!r} is not allowed for this truth: its largest ‖ηᵢ‖ is "
                f"{largest:.4g}; expected a bound at or above it (inf = unconstrained)"
            )

    def _set_fitted_params(self, params: MoEParams) -> None:
        self.beta0_, self.beta1_, self.eta_ = params.beta0, params.beta1, params.eta

    def fit(self, X: Any, Y: Any, truth: MoEParams | None = None) -> LeastSquaresMoE:
        """Fit to ``X (R, n, d)``, ``Y (R, n)`` (or unbatched ``(n, d)``, ``(n,)``); returns ``self``.

        ``truth`` (R = 1 or R parameter sets) is the starting point of ``init="truth"``.
        """
        self._fit(X, Y, truth)
        return self

    def predict(self, X: Any) -> Tensor:
        """``f_Ĝ(X)``: ``(R, n)`` for batched ``X (R, n, d)``, ``(n,)`` for ``(n, d)`` with R = 1."""
        self._check_is_fitted("predict")
        X, unbatched = self._inputs(X)
        out = self.model_.mean(X, self.params_)
        return out[0] if unbatched else out

    def score(self, X: Any, Y: Any) -> Tensor | float:
        """Coefficient of determination R² = 1 − Σ(y − ŷ)² / Σ(y − ȳ)² (scikit-learn's regressor
        score; 1 when Y is constant and predicted exactly, else 0 for constant Y): ``(R,)`` for
        batched data, a float for unbatched ``(n, d)``, ``(n,)``."""
        self._check_is_fitted("score")
        X, Y, unbatched = self._scoring_data(X, Y)
        residual = ((Y - self.model_.mean(X, self.params_)) ** 2).sum(dim=-1)
        total = ((Y - Y.mean(dim=-1, keepdim=True)) ** 2).sum(dim=-1)
        r2 = torch.where(total > 0, 1 - residual / total, (residual == 0).to(Y.dtype))
        return float(r2[0]) if unbatched else r2


class GaussianMoEMLE(_BatchedEstimator):
    """Maximum-likelihood fit of a Gaussian mixture of linear experts (Ho (2025); CompeteSMoE
    (2025), eq. (4)), R replicates at once.

    Args:
        n_experts: k fitted experts.
        gating: ``softmax`` or ``competition`` (:class:`GaussianMoE`).
        top_k: optional sparse gate.
        gate_bias: per-expert gate bias for competition gating (:class:`GaussianMoE`).
        optimizer, lr, steps, batch_size, init, init_noise, init_scale, restarts, beta1_bound, gtol,
            ftol, seed: the fit (shared with :class:`LeastSquaresMoE`).  Variances are optimised as
            log(ν − nu_min); ``beta1_bound`` bounds the softmax gate's β₁ᵢ (competition gating has none).
        nu_min: floor of every variance, ν = nu_min + exp(·) (default 0: none).  The Gaussian
            likelihood has no maximum without one — a component with ν → 0 on a few points raises
            it without bound — and the rate theorems of Ho (2025) and CompeteSMoE (2025) assume a
            compact parameter space with ν bounded away from 0; an over-specified fit run to
            convergence finds that degenerate direction (docs/results.md, "The estimator").

    Attributes (after ``fit``): ``params_`` (:class:`GaussianParams`), ``a_``, ``b_``, ``nu_``,
    ``beta0_``, ``beta1_``, ``loss_`` (``(R,)`` final mean negative log-likelihood),
    ``restart_losses_``, ``n_iter_``, ``grad_norm_``, ``converged_``, ``hit_cap_``, ``n_features_in_``,
    ``model_`` (the :class:`GaussianMoE`).

    ``predict(X)`` is the conditional mean ``E_Ĝ[Y | X] = Σᵢ πᵢ(X)(aᵢᵀX + bᵢ)``; ``score(X, Y)``
    is the mean log-likelihood ``(1/n) Σ log p_Ĝ(Yᵢ | Xᵢ)`` (as scikit-learn's density estimators).
    """

    def __init__(
        self,
        n_experts: int,
        *,
        gating: str = "softmax",
        top_k: int | None = None,
        gate_bias: bool = False,
        nu_min: float = 0.0,
        optimizer: str = "adam",
        lr: float = 1e-2,
        steps: int = 500,
        batch_size: int | None = None,
        init: str = "truth",
        init_noise: float = 0.1,
        init_scale: float = 1.0,
        restarts: int = 1,
        beta1_bound: float = 10.0,
        gtol: float = 1e-7,
        ftol: float = 1e-12,
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
            beta1_bound=beta1_bound,
            gtol=gtol,
            ftol=ftol,
            seed=seed,
        )
        self.gating = gating
        self.top_k = top_k
        self.gate_bias = gate_bias
        self.nu_min = nu_min

    def _make_model(self) -> GaussianMoE:
        non_negative("nu_min", self.nu_min)
        return GaussianMoE(gating=self.gating, top_k=self.top_k, gate_bias=self.gate_bias)

    def _n_params(self, model: GaussianMoE, d: int) -> int:
        k = self.n_experts
        gate_params = k * (1 + d) if model.gating == "softmax" else k * model.gate_bias
        return gate_params + k * (d + 2)

    def _init(
        self, model: GaussianMoE, R: int, d: int, truth: GaussianParams | None, gen: torch.Generator, dtype
    ) -> list[Tensor]:
        k = self.n_experts
        if truth is not None:
            k_true = truth.num_experts
            beta0 = _split_truth(truth.beta0, k) - _copies(k_true, k).to(dtype).log()
            parts = [beta0, *(_split_truth(t, k) for t in (truth.beta1, truth.a, truth.b))]
            c = model.gating == "softmax" or model.gate_bias  # translation-invariant gates
            parts = [self._noise(t, gen, centered=c and i < 2) for i, t in enumerate(parts)]
            log_nu = self._noise((_split_truth(truth.nu, k) - self.nu_min).log(), gen)
            return [*parts, log_nu]
        s = self.init_scale
        return [
            torch.zeros(R, k, dtype=dtype),
            s * torch.randn(R, k, d, generator=gen, dtype=dtype),
            s * torch.randn(R, k, d, generator=gen, dtype=dtype),
            s * torch.randn(R, k, generator=gen, dtype=dtype),
            torch.zeros(R, k, dtype=dtype),
        ]

    def _objective(
        self,
        model: GaussianMoE,
        X: Tensor,
        Y: Tensor,
        truth: GaussianParams | None,
        restarts: int,
        gen: torch.Generator,
    ) -> tuple[Callable[[Tensor | None], Tensor], list[Tensor], Callable[[], GaussianParams]]:
        R, _, d = X.shape
        Xr, Yr = inputs_t(X).repeat(restarts, 1, 1), Y.repeat(restarts, 1)
        init = self._init(model, R * restarts, d, truth, gen, X.dtype)
        bound, nu_min = float(self.beta1_bound), float(self.nu_min)
        init[1] = from_ball(_into_ball(init[1], bound), bound)  # β₁ = to_ball(u): the compact space
        leaves = [t.detach().clone().requires_grad_(True) for t in init]
        if model.gating == "competition":  # no gate parameters (CompeteSMoE (2025), eq. (13)) but a bias
            leaves[0].requires_grad_(model.gate_bias)
            leaves[1].requires_grad_(False)

        def current() -> GaussianParams:
            beta0, u, a, b, log_nu = leaves
            return GaussianParams(beta0, to_ball(u, bound), a, b, nu_min + log_nu.exp())

        def loss_fn(idx: Tensor | None) -> Tensor:
            x, y = _take(Xr, idx), _take(Yr, idx)
            return -model.log_density_t(x, y, current()).mean(dim=-1)

        return loss_fn, [t for t in leaves if t.requires_grad], current

    def _check_truth_in_ball(self, truth: GaussianParams) -> None:
        super()._check_truth_in_ball(truth)
        smallest = float(truth.nu.min())
        if not smallest > self.nu_min:
            raise ValueError(
                f"nu_min={self.nu_min!r} is not allowed for this truth: its smallest ν is {smallest:.4g}; "
                "expected a floor below it"
            )

    def _set_fitted_params(self, params: GaussianParams) -> None:
        p = params
        self.beta0_, self.beta1_, self.a_, self.b_, self.nu_ = p.beta0, p.beta1, p.a, p.b, p.nu

    def fit(self, X: Any, Y: Any, truth: GaussianParams | None = None) -> GaussianMoEMLE:
        """Fit to ``X (R, n, d)``, ``Y (R, n)`` (or unbatched ``(n, d)``, ``(n,)``); returns ``self``.

        ``truth`` (R = 1 or R parameter sets) is the starting point of ``init="truth"``.
        """
        self._fit(X, Y, truth)
        return self

    def predict(self, X: Any) -> Tensor:
        """The conditional mean ``E_Ĝ[Y | X]``: ``(R, n)`` for ``X (R, n, d)``, ``(n,)`` for ``(n, d)``."""
        self._check_is_fitted("predict")
        X, unbatched = self._inputs(X)
        out = (self.model_.gate_weights(X, self.params_) * self.model_.means(X, self.params_)).sum(dim=-1)
        return out[0] if unbatched else out

    def score(self, X: Any, Y: Any) -> Tensor | float:
        """Mean log-likelihood ``(1/n) Σ log p_Ĝ(Yᵢ | Xᵢ)``: ``(R,)`` for batched data, a float for
        unbatched ``(n, d)``, ``(n,)``."""
        self._check_is_fitted("score")
        X, Y, unbatched = self._scoring_data(X, Y)
        ll = self.model_.log_density(X, Y, self.params_).mean(dim=-1)
        return float(ll[0]) if unbatched else ll
