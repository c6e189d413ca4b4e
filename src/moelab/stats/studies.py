"""Convergence-rate studies of the MoE estimators: :func:`run_study` simulates data from a known
mixing measure at every sample size of a grid, fits each router's estimator on many replicates at
once, measures the losses against the truth (or against the best approximating measure) and fits
their rates in n, with the constants of :class:`StudyConfig` and :data:`STUDY_DEFAULTS`; ``moelab
simulate`` (:mod:`moelab.experiments.simulate`) runs a study into a run directory.
docs/methods.md ("The studies") describes each study, its losses and why the default optimiser is
L-BFGS; docs/results.md ("Statistical convergence") has the results.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tqdm import tqdm

from .._validate import non_negative, one_of, positive, positive_int
from .fit import OPTIMIZERS, GaussianMoEMLE, LeastSquaresMoE, check_bound
from .lbfgs import CONVERGED_REASONS, REASONS
from .models import GaussianMoE, MoEParams, RegressionMoE
from .paper_studies import PAPER_STUDIES, PAPER_THEORY, RBAR_NOTE, RBAR_STUDIES, paper_series, run_paper_study
from .rates import fit_rate, mean_table, slope_difference
from .simulate import gaussian_truth, regression_truth, simulate_gaussian, simulate_regression
from .voronoi import gaussian_voronoi_loss, voronoi_loss

__all__ = ["STUDIES", "THEORY", "StudyConfig", "StudyResult", "bench", "run_study", "study_config"]

STUDIES = (
    "cosine-vs-perturbed",
    "misspecified",
    "linear-vs-perturbed",
    "softmax-vs-competition",
    *PAPER_STUDIES,
)
PAPER_THEORY_STUDIES = frozenset(PAPER_STUDIES)
STUDY_INITS = ("near", "random")

#: the rates the papers state, drawn dashed on the plots and written beside each fitted slope:
#: (study, loss) or (study, setting, loss) → [(slope, label, routers)].  ``routers`` names the
#: series the rate is stated for; a row of any other router gets no theory (blank): the cosine
#: router (minimax slower than any polynomial), ridge and linear experts under softmax gating, a
#: misspecified fit.  An entry with ``routers=()`` is drawn for scale only and never printed.
THEORY: dict[tuple[str, ...], list[tuple[float, str, tuple[str, ...]]]] = {
    ("cosine-vs-perturbed", "exact-specified", "voronoi"): [
        (-0.5, "n^-1/2: perturbed (perturbed cosine router (2024) Thm. 3)", ("perturbed",))
    ],
    ("cosine-vs-perturbed", "over-specified", "voronoi"): [
        (-0.5, "n^-1/2: perturbed, D (perturbed cosine router (2024) Thm. 4)", ("perturbed",))
    ],
    ("misspecified", "voronoi"): [(-0.5, "n^-1/2 (parametric, for scale)", ())],
    ("linear-vs-perturbed", "voronoi"): [
        (
            -0.5,
            "n^-1/2: perturbed, polynomial experts (perturbed cosine router (2024) Thm. A.2)",
            ("perturbed",),
        )
    ],
    ("softmax-vs-competition", "expert"): [
        (-0.25, "n^-1/4: competition (CompeteSMoE (2025) Thm. 3.2)", ("competition", "competition-bias")),
        (-0.5, "n^-1/2 (parametric, for scale)", ()),
    ],
    ("softmax-vs-competition", "voronoi"): [
        (-0.5, "n^-1/2: CompeteSMoE (2025) Thm. 3.2, App. J", ("competition", "competition-bias"))
    ],
}


def theory_slopes(study: str, setting: str, loss: str) -> list[tuple[float, str]]:
    """Every reference slope of :data:`THEORY` for one panel, for the plot (empty if none)."""
    table = PAPER_THEORY if study in PAPER_THEORY_STUDIES else THEORY
    entries = table.get((study, setting, loss), table.get((study, loss), []))
    return [(slope, label) for slope, label, _ in entries]


def stated_rates(study: str, setting: str, loss: str, router: str) -> list[dict[str, Any]]:
    """The rates the papers state for one series (blank — empty — where they state none)."""
    table = PAPER_THEORY if study in PAPER_THEORY_STUDIES else THEORY
    entries = table.get((study, setting, loss), table.get((study, loss), []))
    return [{"slope": slope, "label": label} for slope, label, routers in entries if router in routers]


@dataclass
class StudyConfig:
    """Every constant of a study (written to config.yaml and metrics.json)."""

    study: str
    seed: int = 0
    d: int = 4
    k_true: int = 2
    extra_experts: int = 1
    noise_var: float = 0.01
    tau: float = 1.0
    expert: str = "ffn"
    activation: str = "tanh"
    degree: int = 2
    input_distribution: str = "uniform"
    input_bound: float = 1.0
    router_std: float = 1.0
    expert_std: float = 1.0
    nu_range: tuple[float, float] = (0.05, 0.2)
    sample_sizes: list[int] = field(default_factory=lambda: [500, 1000, 2000, 4000, 8000, 16000])
    replicates: int = 20
    optimizer: str = "lbfgs"
    lr: float = 1.0
    steps: int = 500
    batch_size: int | None = None
    init: str = "near"
    init_noise: float = 0.05
    init_scale: float = 1.0
    restarts: int = 1
    gtol: float = 1e-7
    #: an over-specified fit is singular at the truth, so L-BFGS creeps along its flat directions: a
    #: loss change of 1e-10·max(1, |loss|) per iteration (far below the loss's O(1/n) statistical
    #: noise) stops it within the cap, where 1e-12 left 55–81 % of the over-specified fits at a cap
    #: of 2000 (docs/results.md)
    ftol: float = 1e-10
    #: radius of the ball holding every β₁ᵢ; None = 10 · router_std · √d; inf = unconstrained
    beta1_bound: float | None = None
    #: radius of the ball holding every expert's ηᵢ (regression studies); None = 10 · expert_std · √q
    eta_bound: float | None = None
    #: floor of the fitted variances (Gaussian study); None = nu_range[0] / 5
    nu_min: float | None = None
    reference_n: int = 128000
    #: the reference fit must converge like every other: every loss of its series is a distance to it,
    #: so a Ḡ stopped by this cap makes the series not measured (docs/stats-estimator.md)
    reference_steps: int = 2000
    n_boot: int = 2000
    #: inputs drawn per replicate to measure the L², Hellinger and total-variation distances (paper studies)
    eval_n: int = 2000
    quick: bool = False

    def validate(self) -> StudyConfig:
        one_of("study", self.study, STUDIES)
        positive_int("d", self.d)
        positive_int("k_true", self.k_true)
        positive_int("extra_experts", self.extra_experts)
        non_negative("noise_var", self.noise_var)
        if not (isinstance(self.tau, (int, float)) and self.tau >= 0):
            raise ValueError(f"tau={self.tau!r} is not allowed; expected a number >= 0")
        positive_int("replicates", self.replicates)
        one_of("optimizer", self.optimizer, OPTIMIZERS)
        positive("lr", self.lr)
        positive_int("steps", self.steps)
        one_of("init", self.init, STUDY_INITS)
        non_negative("init_noise", self.init_noise)
        positive("init_scale", self.init_scale)
        positive_int("restarts", self.restarts)
        non_negative("gtol", self.gtol)
        non_negative("ftol", self.ftol)
        positive("router_std", self.router_std)
        if self.beta1_bound is None:
            self.beta1_bound = 10.0 * self.router_std * self.d**0.5
        check_bound(self.beta1_bound)
        positive("expert_std", self.expert_std)
        if self.eta_bound is None:
            q = self.d + 2 if self.expert == "ffn" else self.d + 1
            self.eta_bound = 10.0 * self.expert_std * q**0.5
        check_bound(self.eta_bound, "eta_bound")
        if self.nu_min is None:
            self.nu_min = self.nu_range[0] / 5
        non_negative("nu_min", self.nu_min)
        positive_int("n_boot", self.n_boot)
        positive_int("reference_n", self.reference_n)
        positive_int("reference_steps", self.reference_steps)
        positive_int("eval_n", self.eval_n)
        if len(self.sample_sizes) < 2 or len(set(self.sample_sizes)) < 2:
            raise ValueError(
                f"sample_sizes={self.sample_sizes!r} is not allowed; expected >= 2 distinct sizes"
            )
        for n in self.sample_sizes:
            positive_int("sample_sizes[i]", n)
        k = self.k_true + self.extra_experts
        q = self.d + 2
        n_params = k * (1 + self.d + q)
        if min(self.sample_sizes) < n_params:
            raise ValueError(
                f"sample_sizes={self.sample_sizes!r}: the smallest n={min(self.sample_sizes)} is below the "
                f"number of parameters of the largest fit ({n_params}); use n >= {n_params}"
            )
        return self


#: the defaults of each study (over the dataclass defaults)
STUDY_DEFAULTS: dict[str, dict[str, Any]] = {
    # its over-specified fits creep longest along their flat directions: the older studies' 500
    # iterations a round leave too few of them converged for a slope (docs/stats-estimator.md)
    "cosine-vs-perturbed": {"steps": 2000},
    "misspecified": {},
    "linear-vs-perturbed": {"expert": "polynomial", "degree": 2},
    "softmax-vs-competition": {"d": 2, "init_noise": 0.05},
    **{
        name: {
            "d": 2,
            "sample_sizes": [500, 1000, 2000, 4000, 8000],
            "replicates": 12,
            "steps": 1000,
        }
        for name in PAPER_STUDIES
    },
    "replora": {
        "d": 3,
        "sample_sizes": [500, 1000, 2000, 4000, 8000],
        "replicates": 12,
        "steps": 1000,
    },
}

#: the quick reductions: a smaller grid and fewer replicates, never fewer iterations (a capped fit
#: measures nothing)
QUICK: dict[str, Any] = {
    "sample_sizes": [500, 1000, 2000],
    "replicates": 3,
    "reference_n": 16000,
    "n_boot": 500,
    "quick": True,
}
#: the quick reductions of the paper studies
PAPER_QUICK: dict[str, Any] = {
    "sample_sizes": [300, 600, 1200],
    "replicates": 3,
    "eval_n": 500,
    "n_boot": 300,
    "quick": True,
}
#: the share of a series' replicates (over all n) that must have converged for its slope to be
#: set against a stated rate; below it the row says "not measured" and why
MEASURED_SHARE = 0.9


#: settings of the four older studies that the paper studies' fits do not use: refused, not ignored
_NOT_IN_PAPER_STUDIES = frozenset(
    {
        "optimizer",
        "batch_size",
        "init",
        "restarts",
        "beta1_bound",
        "eta_bound",
        "reference_n",
        "reference_steps",
        "init_scale",
    }
)


def study_config(study: str, quick: bool = False, seed: int = 0, **overrides: Any) -> StudyConfig:
    """The configuration of ``study`` (its defaults, the ``quick`` reductions, then ``overrides``)."""
    one_of("study", study, STUDIES)
    values: dict[str, Any] = dict(STUDY_DEFAULTS[study])
    if quick:
        values.update(PAPER_QUICK if study in PAPER_THEORY_STUDIES else QUICK)
        if study in ("rate-grid", "competition-v1"):  # nine series / a top-K gate: a smaller quick grid
            values.update({"sample_sizes": [200, 400, 800], "replicates": 2})
    given = {k: v for k, v in overrides.items() if v is not None}
    if study in PAPER_THEORY_STUDIES:  # a value other than the study's own would be silently unused
        own = StudyConfig(study=study, seed=seed, **values).validate()
        for name in sorted(given):
            unused = name in _NOT_IN_PAPER_STUDIES or (name == "tau" and study != "rate-grid")
            if unused and given[name] != getattr(own, name):
                raise ValueError(
                    f"{name}={given[name]!r} is not allowed for study {study!r}: its fits are batched "
                    "L-BFGS from near the truth (moelab.stats.mixtures.fit_params), which do not use it"
                )
    values.update(given)
    names = {f.name for f in dataclasses.fields(StudyConfig)}
    unknown = sorted(set(values) - names)
    if unknown:
        raise ValueError(f"unknown study settings {unknown}; allowed: {sorted(names)}")
    return StudyConfig(study=study, seed=seed, **values).validate()


# --------------------------------------------------------------------------------------------- runs


def _expand(p: MoEParams, R: int) -> MoEParams:
    return p.expand(R) if p.replicates == 1 else p


def _fit_options(cfg: StudyConfig, fit_gate: str, *, steps: int, init_noise: float) -> dict:
    """The :class:`LeastSquaresMoE` options of a study's fits."""
    return dict(
        gate=fit_gate,
        expert=cfg.expert,
        tau=cfg.tau if fit_gate == "perturbed" else 0.0,
        degree=cfg.degree,
        activation=cfg.activation,
        eta_bound=cfg.eta_bound,
        **_optimiser_options(cfg, steps=steps, init_noise=init_noise),
    )


def _optimiser_options(cfg: StudyConfig, *, steps: int, init_noise: float) -> dict:
    """The options both estimators share."""
    return dict(
        optimizer=cfg.optimizer,
        lr=cfg.lr,
        steps=steps,
        batch_size=cfg.batch_size,
        init=cfg.init,
        init_noise=init_noise,
        init_scale=cfg.init_scale,
        restarts=cfg.restarts,
        beta1_bound=cfg.beta1_bound,
        gtol=cfg.gtol,
        ftol=cfg.ftol,
    )


#: per-replicate fit diagnostics kept for losses.csv and table.csv
DIAGNOSTICS = ("n_iter", "grad_norm", "converged", "hit_cap", "beta1_max_norm")


class _Collector:
    """Per sample size: losses, training losses, diagnostics and estimates of one series."""

    def __init__(self) -> None:
        self.train: list[list[float]] = []
        self.reasons: list[list[str]] = []
        self.diag: dict[str, list[list[float]]] = {name: [] for name in DIAGNOSTICS}
        self.estimates: dict[str, list[np.ndarray]] = {}

    def add(self, est: Any) -> None:
        self.train.append(est.loss_.tolist())
        self.reasons.append(list(est.stop_reason_))
        self.diag["n_iter"].append(est.n_iter_.tolist())
        self.diag["grad_norm"].append(est.grad_norm_.tolist())
        self.diag["converged"].append(est.converged_.tolist())
        self.diag["hit_cap"].append(est.hit_cap_.tolist())
        self.diag["beta1_max_norm"].append(est.beta1_.norm(dim=-1).amax(dim=-1).tolist())
        for name, t in est.params_.tensors().items():
            self.estimates.setdefault(name, []).append(t.detach().cpu().numpy())
        self.estimates.setdefault("restart_losses", []).append(est.restart_losses_.T.cpu().numpy())

    def result(self, target: Any) -> dict[str, Any]:
        """``train (S, R)``, ``diag`` name → ``(S, R)``, ``estimates`` name → ``(S, R, ...)``
        (``target_*``: the parameters the loss is measured against)."""
        estimates = {name: np.stack(v) for name, v in self.estimates.items()}
        for name, t in target.tensors().items():
            estimates[f"target_{name}"] = t.detach().cpu().numpy()
        return {
            "train": np.array(self.train),
            "reasons": self.reasons,
            "diag": {name: np.array(v, dtype=float) for name, v in self.diag.items()},
            "estimates": estimates,
        }


def _regression_series(cfg: StudyConfig, *, data_model, truth, fit_gate, k, target, gen, bar) -> dict:
    """Fit every sample size; return per-n Voronoi losses ``(S, R)``, training MSEs, diagnostics
    and estimates."""
    fit_kwargs = _fit_options(cfg, fit_gate, steps=cfg.steps, init_noise=cfg.init_noise)
    losses = []
    collect = _Collector()
    R = cfg.replicates
    tgt = _expand(target, R)
    for n in cfg.sample_sizes:
        X, Y = simulate_regression(
            data_model,
            truth,
            n,
            R,
            noise_var=cfg.noise_var,
            distribution=cfg.input_distribution,
            bound=cfg.input_bound,
            generator=gen,
        )
        seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
        est = LeastSquaresMoE(k, seed=seed, **fit_kwargs).fit(X, Y, target)
        loss = voronoi_loss(est.beta0_, est.beta1_, est.eta_, tgt.beta0, tgt.beta1, tgt.eta)
        losses.append(loss.tolist())
        collect.add(est)
        bar.update(1)
    return {"loss": np.array(losses), **collect.result(target)}


def _reference_fit(
    cfg: StudyConfig, *, data_model, truth, fit_gate, k, init_from, gen
) -> tuple[MoEParams, str]:
    """Ḡ: the least-squares fit on one large sample (the limit of the misspecified estimator), and why
    it did not converge (empty when it did): every loss of the series is measured against it."""
    X, Y = simulate_regression(
        data_model,
        truth,
        cfg.reference_n,
        1,
        noise_var=cfg.noise_var,
        distribution=cfg.input_distribution,
        bound=cfg.input_bound,
        generator=gen,
    )
    options = {**_fit_options(cfg, fit_gate, steps=cfg.reference_steps, init_noise=0.0), "init": "near"}
    est = LeastSquaresMoE(k, **{**options, "restarts": 1}).fit(X, Y, init_from)
    return est.params_, why_not_converged(list(est.stop_reason_))


def _series_plan(cfg: StudyConfig) -> list[dict[str, Any]]:
    """The (router, setting) series of a study."""
    k_exact, k_over = cfg.k_true, cfg.k_true + cfg.extra_experts
    if cfg.study == "cosine-vs-perturbed":
        return [
            {"router": r, "setting": s, "k": k}
            for s, k in (("exact-specified", k_exact), ("over-specified", k_over))
            for r in ("cosine", "perturbed")
        ]
    if cfg.study == "misspecified":
        return [{"router": r, "setting": "misspecified", "k": k_exact} for r in ("cosine", "perturbed")]
    if cfg.study == "linear-vs-perturbed":
        return [{"router": r, "setting": "exact-specified", "k": k_exact} for r in ("linear", "perturbed")]
    return [
        {"router": r, "setting": "over-specified", "k": k_over}
        for r in ("softmax", "competition", "competition-bias")
    ]


def _run_regression(cfg: StudyConfig, gen: torch.Generator, bar) -> list[dict[str, Any]]:
    results = []
    if cfg.study == "cosine-vs-perturbed":
        for spec in _series_plan(cfg):
            gate = spec["router"]
            model = RegressionMoE(
                gate=gate, expert=cfg.expert, tau1=cfg.tau if gate == "perturbed" else 0.0,
                tau2=cfg.tau if gate == "perturbed" else 0.0, activation=cfg.activation, degree=cfg.degree,
            )  # fmt: skip
            truth_gen = torch.Generator().manual_seed(cfg.seed)  # same truth for both routers
            truth = regression_truth(
                model, cfg.k_true, cfg.d, router_std=cfg.router_std, expert_std=cfg.expert_std,
                generator=truth_gen,
            )  # fmt: skip
            out = _regression_series(
                cfg, data_model=model, truth=truth, fit_gate=gate, k=spec["k"], target=truth, gen=gen, bar=bar
            )
            results.append({**spec, "loss_name": "voronoi", **out})
        return results
    # App. F: data from a linear-router MoE
    data_model = RegressionMoE(gate="linear", expert=cfg.expert, activation=cfg.activation, degree=cfg.degree)
    truth = regression_truth(
        data_model, cfg.k_true, cfg.d, router_std=cfg.router_std, expert_std=cfg.expert_std,
        generator=torch.Generator().manual_seed(cfg.seed),
    )  # fmt: skip
    for spec in _series_plan(cfg):
        gate = spec["router"]
        reference_why = ""
        if gate == "linear":
            target = truth
        else:
            target, reference_why = _reference_fit(
                cfg, data_model=data_model, truth=truth, fit_gate=gate, k=spec["k"], init_from=truth, gen=gen
            )
        out = _regression_series(
            cfg,
            data_model=data_model,
            truth=truth,
            fit_gate=gate,
            k=spec["k"],
            target=target,
            gen=gen,
            bar=bar,
        )
        results.append(
            {
                **spec,
                "loss_name": "voronoi",
                "target": "truth" if gate == "linear" else "reference",
                "reference_why": reference_why,
                **out,
            }
        )
    return results


def _run_gaussian(cfg: StudyConfig, gen: torch.Generator, bar) -> list[dict[str, Any]]:
    results = []
    R = cfg.replicates
    for spec in _series_plan(cfg):
        gating, bias = spec["router"].split("-")[0], spec["router"].endswith("-bias")
        model = GaussianMoE(gating=gating, gate_bias=bias)
        truth = gaussian_truth(
            cfg.k_true, cfg.d, router_std=cfg.router_std, expert_std=cfg.expert_std, nu_range=tuple(cfg.nu_range),
            generator=torch.Generator().manual_seed(cfg.seed),
        )  # fmt: skip
        tgt = truth.expand(R)
        expert_losses, vor_losses = [], []
        collect = _Collector()
        for n in cfg.sample_sizes:
            X, Y = simulate_gaussian(
                model, truth, n, R, distribution=cfg.input_distribution, bound=cfg.input_bound, generator=gen
            )
            seed = int(torch.randint(0, 2**31 - 1, (1,), generator=gen))
            est = GaussianMoEMLE(
                spec["k"], gating=gating, gate_bias=bias, nu_min=cfg.nu_min, seed=seed,
                **_optimiser_options(cfg, steps=cfg.steps, init_noise=cfg.init_noise),
            ).fit(X, Y, truth)  # fmt: skip
            args = (est.a_, est.b_, est.nu_, tgt.a, tgt.b, tgt.nu)
            expert_losses.append(gaussian_voronoi_loss(*args, r_multi=1.0, mass_term=False).tolist())
            if gating == "softmax" or bias:  # CompeteSMoE (2025) eq. (14) with the gate weights e^{β₀}
                vor = gaussian_voronoi_loss(*args, est.beta0_, tgt.beta0)
            else:  # no gate weights (CompeteSMoE (2025) eq. (13)): the mass term would be the constant Σ_j ||A_j| − 1|
                vor = gaussian_voronoi_loss(*args, mass_term=False)
            vor_losses.append(vor.tolist())
            collect.add(est)
            bar.update(1)
        fitted = collect.result(truth)
        results.append({**spec, "loss_name": "expert", "loss": np.array(expert_losses), **fitted})
        results.append({**spec, "loss_name": "voronoi", "loss": np.array(vor_losses), **fitted})
    return results


@dataclass
class StudyResult:
    """What a study measured: ``metrics`` (the rates, their differences, the per-n table, the
    means and the constants), ``losses`` (one row per series, n and replicate, with the fit's
    diagnostics) and ``estimates`` (every replicate's estimates and their targets, as arrays)."""

    metrics: dict[str, Any]
    losses: list[dict[str, Any]]
    estimates: dict[str, np.ndarray]


def run_study(cfg: StudyConfig, progress: bool = True) -> StudyResult:
    """Run the study ``cfg`` (a progress bar unless ``progress`` is false)."""
    cfg.validate()
    start = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    n_series = len(paper_series(cfg)) if cfg.study in PAPER_THEORY_STUDIES else len(_series_plan(cfg))
    total = n_series * len(cfg.sample_sizes)
    with tqdm(total=total, desc=cfg.study, disable=not progress, leave=False) as bar:
        if cfg.study in PAPER_THEORY_STUDIES:
            results = run_paper_study(cfg, gen, bar)
        elif cfg.study == "softmax-vs-competition":
            results = _run_gaussian(cfg, gen, bar)
        else:
            results = _run_regression(cfg, gen, bar)
    rates, means, rows, table, estimates = [], [], [], [], {"sample_sizes": np.array(cfg.sample_sizes)}
    bound = float(cfg.beta1_bound)
    for res in results:
        loss = res["loss"]
        positive_loss = np.maximum(loss, 1e-300)
        fit = fit_rate(cfg.sample_sizes, positive_loss, n_boot=cfg.n_boot, seed=cfg.seed)
        key = {"router": res["router"], "setting": res["setting"], "loss": res["loss_name"]}
        share = float(np.mean(res["diag"]["converged"]))
        reasons = [r for per_n in res["reasons"] for r in per_n]
        not_measured = not_measured_reason(share, reasons, res.get("saturated"))
        if res.get("reference_why"):
            # every loss of the series is a distance to Ḡ: an unconverged Ḡ makes none of them a rate
            not_measured = (
                f"the reference fit Ḡ did not converge ({res['reference_why']}); raise --reference-steps"
            )
        theory = [
            {**t, "verdict": "not measured" if not_measured else verdict(t["slope"], fit.ci_low, fit.ci_high)}
            for t in stated_rates(cfg.study, res["setting"], res["loss_name"], res["router"])
        ]
        rates.append({**key, "k": res["k"], "slope": fit.slope, "ci_low": fit.ci_low, "ci_high": fit.ci_high,
                      "intercept": fit.intercept, "target": res.get("target", "truth"), "theory": theory,
                      "converged": share, "not_measured": not_measured})  # fmt: skip
        means.append(
            {**key, "n": list(cfg.sample_sizes), "mean": loss.mean(1).tolist(), "std": loss.std(1).tolist()}
        )
        diag = res["diag"]
        at_bound = diag["beta1_max_norm"] >= (1 - 1e-6) * bound
        lower = res.get("lower")  # a certified lower bound per replicate where the loss is bracketed
        for s, row in enumerate(
            mean_table(cfg.sample_sizes, positive_loss, n_boot=cfg.n_boot, seed=cfg.seed)
        ):
            table.append({**key, "k": res["k"], **row, "converged": float(diag["converged"][s].mean()),
                          "hit_cap": float(diag["hit_cap"][s].mean()), "at_bound": float(at_bound[s].mean()),
                          "median_iter": float(np.median(diag["n_iter"][s])),
                          "mc_se": float(res["mc_se"][s].mean()) if res.get("mc_se") is not None else "",
                          "lower": float(lower[s].mean()) if lower is not None else "",
                          "gap": float((loss[s] - lower[s]).max()) if lower is not None else "",
                          "why_not": why_not_converged(res["reasons"][s])})  # fmt: skip
        for s, n in enumerate(cfg.sample_sizes):
            for r in range(loss.shape[1]):
                rows.append(
                    {
                        **key,
                        "k": res["k"],
                        "n": n,
                        "replicate": r,
                        "value": loss[s, r],  # "loss" names which loss (expert or voronoi)
                        "lower": lower[s, r] if lower is not None else "",
                        "train": res["train"][s, r],
                        **{name: diag[name][s, r] for name in DIAGNOSTICS},
                        "stop_reason": res["reasons"][s][r],
                    }
                )
        for name, array in res["estimates"].items():
            estimates[f"{res['router']}__{res['setting']}__{name}"] = array
    differences = _differences(cfg, results)
    wall = time.perf_counter() - start
    config = dataclasses.asdict(cfg)
    metrics = {"study": cfg.study, "rates": rates, "differences": differences, "table": table, "means": means,
               "notes": study_notes(cfg.study), "config": config, "wall_seconds": wall,
               "torch_threads": torch.get_num_threads()}  # fmt: skip
    return StudyResult(metrics, rows, estimates)


def study_notes(study: str) -> list[str]:
    """What a reader must know to read a study's stated rates: where moelab's constants differ
    from the paper's print (the r̄(m) values of Ho (2025))."""
    return [RBAR_NOTE] if study in RBAR_STUDIES else []


def verdict(stated: float, ci_low: float, ci_high: float) -> str:
    """A stated rate against the bootstrap interval of the fitted slope: ``consistent`` (inside),
    ``faster`` (the interval lies below it: the error falls faster than stated) or ``slower``."""
    if ci_low <= stated <= ci_high:
        return "consistent"
    return "faster" if ci_high < stated else "slower"


def not_measured_reason(share: float, reasons: list[str], saturated: np.ndarray | None = None) -> str:
    """Why a series' slope is not set against a stated rate (empty when it is): fewer than
    :data:`MEASURED_SHARE` of its replicates converged (the share and the stop reasons), or more
    than the rest have a Voronoi loss at its bound over translations (``saturated``, per replicate)."""
    if share < MEASURED_SHARE:
        return (
            f"{share:.0%} of replicates converged, below {MEASURED_SHARE:.0%} ({why_not_converged(reasons)})"
        )
    if saturated is not None and float(np.mean(saturated)) > 1 - MEASURED_SHARE:
        return (
            f"the infimum over translations sits at its bound Σ exp(β*₀) in {float(np.mean(saturated)):.0%} "
            "of replicates (fits too far from the truth for this loss)"
        )
    return ""


def why_not_converged(reasons: list[str]) -> str:
    """Why the replicates that did not converge stopped, most common first: ``"iteration cap 3/4;
    no step accepted 1/4"`` (empty when every replicate converged)."""
    bad = [r for r in reasons if r not in [REASONS[i] for i in CONVERGED_REASONS]]
    counts = sorted(((bad.count(r), r) for r in set(bad)), key=lambda t: (-t[0], t[1]))
    return "; ".join(f"{r} {c}/{len(reasons)}" for c, r in counts)


def _differences(cfg: StudyConfig, results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Slope of router a − slope of router b, with its bootstrap CI, for every pair of routers in
    the same (setting, loss) panel (their data are independent samples)."""
    out = []
    panels = list(dict.fromkeys((r["setting"], r["loss_name"]) for r in results))
    for setting, loss_name in panels:
        series = [r for r in results if (r["setting"], r["loss_name"]) == (setting, loss_name)]
        for i, a in enumerate(series):
            for b in series[i + 1 :]:
                if cfg.study == "rate-grid" and a["router"].split("-", 1)[1] != b["router"].split("-", 1)[1]:
                    continue  # the grid compares routers at a fixed expert
                diff = slope_difference(
                    cfg.sample_sizes, np.maximum(a["loss"], 1e-300), np.maximum(b["loss"], 1e-300),
                    n_boot=cfg.n_boot, seed=cfg.seed,
                )  # fmt: skip
                out.append({"setting": setting, "loss": loss_name, "router_a": a["router"],
                            "router_b": b["router"], **diff.as_dict()})  # fmt: skip
    return out


# ------------------------------------------------------------------------------------------ benchmark


def bench(
    replicates: int = 20, n: int = 2000, steps: int = 100, repeats: int = 3, seed: int = 0
) -> dict[str, float]:
    """Fits per second: R replicates in one batched fit vs a Python loop over R single fits.

    Least squares, perturbed cosine gate, one-unit tanh experts, d = 4, k = 3, Adam with a fixed
    number of steps (so both do the same arithmetic); median over ``repeats``.
    """
    gen = torch.Generator().manual_seed(seed)
    model = RegressionMoE(gate="perturbed", expert="ffn", tau1=1.0, tau2=1.0)
    truth = regression_truth(model, 2, 4, generator=gen)
    X, Y = simulate_regression(model, truth, n, replicates, generator=gen)
    kw = dict(
        gate="perturbed", tau=1.0, optimizer="adam", lr=1e-2, steps=steps, init="truth", init_noise=0.05
    )

    def batched() -> None:
        LeastSquaresMoE(3, **kw).fit(X, Y, truth)

    def loop() -> None:
        for r in range(replicates):
            LeastSquaresMoE(3, **kw).fit(X[r : r + 1], Y[r : r + 1], truth)

    times = {}
    for name, fn in (("batched", batched), ("loop", loop)):
        samples = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        times[name] = float(np.median(samples))
    return {
        "replicates": replicates,
        "n": n,
        "steps": steps,
        "batched_seconds": times["batched"],
        "loop_seconds": times["loop"],
        "batched_fits_per_s": replicates / times["batched"],
        "loop_fits_per_s": replicates / times["loop"],
        "speedup": times["loop"] / times["batched"],
        "torch_threads": torch.get_num_threads(),
    }
