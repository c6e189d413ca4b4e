"""The convergence rates the papers state, one study each (``moelab simulate --study NAME``):
``shared-experts`` and ``sigmoid-vs-softmax`` (Ho (2025)'s DeepSeek tables), ``strong-vs-ridge``,
``gaussian-vs-regression``, ``attention-gating`` and ``replora`` (Ho (2025)), ``rate-grid`` (the
perturbed cosine router (2024) Table 1), ``competition-v1`` (CompeteSMoE (2024) §4) and
``competition-ffn`` (CompeteSMoE (2025) Thm. 3.2).  Each series is fitted at every n of the grid
on R replicates at once (:func:`moelab.stats.mixtures.fit_params`) and measured by every error
that applies to it (:mod:`moelab.stats.measures`); :data:`PAPER_THEORY` holds the stated rates.
docs/methods.md ("The paper studies") describes each; docs/results.md has the runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .measures import density_distances, k_subset_voronoi, l2_distance, voronoi_d
from .mixtures import LoRAMixture, Mixture, fit_params
from .simulate import sample_inputs
from .translation import translation_inf

__all__ = [
    "PAPER_STUDIES",
    "PAPER_THEORY",
    "RBAR",
    "RBAR_NOTE",
    "RBAR_SLIDES",
    "RBAR_STUDIES",
    "paper_series",
    "run_paper_study",
]

PAPER_STUDIES = (
    "shared-experts",
    "sigmoid-vs-softmax",
    "strong-vs-ridge",
    "gaussian-vs-regression",
    "attention-gating",
    "replora",
    "rate-grid",
    "competition-v1",
    "competition-ffn",
)

#: r̄(m) of Ho (2025) for d = 1, computed by :func:`moelab.stats.measures.rbar` (r̄(1), r̄(2) in
#: tests/test_stats_measures.py; r̄(3) in docs/results.md with its command and time).
RBAR = {1: 1, 2: 4, 3: 6}
#: r̄(m) as the slides print it ("when m = 1, r̄(m) = 4; when m = 2, r̄(m) = 6"): one step off the
#: system's solution, which moelab uses; :data:`RBAR_NOTE` says which stated rates this changes.
RBAR_SLIDES = {1: 4, 2: 6}
RBAR_NOTE = (
    "r̄(m): moelab solves Ho (2025)'s polynomial system and gets r̄(1) = 1, r̄(2) = 4, r̄(3) = 6; the slides "
    "print r̄(1) = 4, r̄(2) = 6.  The rates stated here use the computed values, so a cell of two atoms has "
    "softmax weights and expert biases at n^-1/(2r̄(2)) = n^-1/8 (the slides' value gives n^-1/12) and expert "
    "weights and variances at n^-1/r̄(2) = n^-1/4 (the slides': n^-1/6)."
)
#: studies whose stated rates depend on r̄ (their output carries :data:`RBAR_NOTE`)
RBAR_STUDIES = ("shared-experts", "sigmoid-vs-softmax", "gaussian-vs-regression")


def _rbar(m: int) -> float:
    return float(
        RBAR.get(m, 2 * m)
    )  # 2m continues 4, 6 past the table (cells of > 3 atoms: not in the studies)


_H = "Ho (2025)"
_P = "perturbed cosine router (2024)"
_DENSITY = "n^-1/2 (up to log n): density, "
_RATE_GRID_FAST = ("softmax-ffn", "perturbed-polynomial", "perturbed-ffn")
_RATE_GRID_ALL = tuple(
    f"{g}-{e}" for g in ("softmax", "cosine", "perturbed") for e in ("linear", "polynomial", "ffn")
)

#: (study, loss) → [(slope, label, series the rate is stated for)]; rows of other series: blank
PAPER_THEORY: dict[tuple[str, ...], list[tuple[float, str, tuple[str, ...]]]] = {
    ("shared-experts", "shared"): [
        (-0.25, f"n^-1/4: shared experts ({_H}, DeepSeek-V2 table)", ("ffn", "linear"))
    ],
    ("shared-experts", "expert"): [
        (-0.25, f"n^-1/4: routed ReLU-FFN experts ({_H})", ("ffn",)),
        (
            -1 / (2 * RBAR[2]),
            f"n^-1/(2r̄(2)) = n^-1/8 (slides' r̄: n^-1/12): routed linear experts, slowest part η₀ ({_H})",
            ("linear",),
        ),
    ],
    ("shared-experts", "voronoi"): [(-0.5, f"n^-1/2: D₁ (ReLU FFN), D₂ (linear) ({_H})", ("ffn", "linear"))],
    ("shared-experts", "hellinger"): [(-0.5, _DENSITY + _H, ("ffn", "linear"))],
    ("shared-experts", "tv"): [(-0.5, _DENSITY + "V ≤ √2 h", ("ffn", "linear"))],
    ("sigmoid-vs-softmax", "expert"): [
        (
            -0.5,
            f"n^-1/2: normalised sigmoid, every expert ({_H}, DeepSeek-V3 row)",
            ("sigmoid-ffn", "sigmoid-linear"),
        ),
        (-0.25, f"n^-1/4: softmax, ReLU FFN ({_H}, DeepSeek-V2 row)", ("softmax-ffn",)),
        (
            -1 / (2 * RBAR[2]),
            f"n^-1/(2r̄(2)) = n^-1/8 (slides' r̄: n^-1/12): softmax, linear experts ({_H})",
            ("softmax-linear",),
        ),
    ],
    ("sigmoid-vs-softmax", "hellinger"): [
        (-0.5, _DENSITY + _H, ("softmax-ffn", "softmax-linear", "sigmoid-ffn", "sigmoid-linear"))
    ],
    ("sigmoid-vs-softmax", "tv"): [
        (-0.5, _DENSITY + "V ≤ √2 h", ("softmax-ffn", "softmax-linear", "sigmoid-ffn", "sigmoid-linear"))
    ],
    ("strong-vs-ridge", "expert"): [
        (-0.25, f"n^-1/4: strongly identifiable, over-specified cells ({_H})", ("strong",))
    ],
    ("strong-vs-ridge", "voronoi"): [(-0.5, f"n^-1/2: Voronoi loss, exponents 1 | 2 ({_H})", ("strong",))],
    ("strong-vs-ridge", "l2"): [
        (-0.5, "n^-1/2 (up to log n): least squares regression function", ("strong", "ridge"))
    ],
    ("gaussian-vs-regression", "expert"): [
        (
            -1 / (2 * RBAR[2]),
            f"n^-1/(2r̄(2)) = n^-1/8 (slides' r̄: n^-1/12): Gaussian MoE, b in cells of 2 ({_H} table)",
            ("gaussian",),
        )
    ],
    ("gaussian-vs-regression", "voronoi"): [(-0.5, f"n^-1/2: D_r̄ ({_H})", ("gaussian",))],
    ("gaussian-vs-regression", "l2"): [
        (-0.5, "n^-1/2 (up to log n): regression function", ("gaussian", "regression"))
    ],
    ("gaussian-vs-regression", "hellinger"): [(-0.5, _DENSITY + _H, ("gaussian",))],
    ("gaussian-vs-regression", "tv"): [(-0.5, _DENSITY + "V ≤ √2 h", ("gaussian",))],
    ("attention-gating", "expert"): [
        (
            -0.25,
            f"n^-1/4: non-linear experts, over-specified cells ({_H}, after Akbarian et al.)",
            ("nonlinear",),
        )
    ],
    ("attention-gating", "voronoi"): [
        (-0.5, f"n^-1/2: Voronoi loss, exponents 1 | 2 ({_H})", ("nonlinear",))
    ],
    ("attention-gating", "l2"): [
        (-0.5, "n^-1/2 (up to log n): regression function", ("linear", "nonlinear"))
    ],
    ("replora", "lora"): [
        (-0.5, f"n^-1/2: shared reparameterisation ({_H}, after Truong et al.)", ("replora",))
    ],
    ("replora", "l2"): [(-0.5, "n^-1/2 (up to log n): regression function", ("replora", "lora"))],
    ("rate-grid", "expert"): [
        (-0.25, f"n^-1/4: strongly identifiable, over-specified cells ({_P} Table 1)", _RATE_GRID_FAST)
    ],
    ("rate-grid", "voronoi"): [(-0.5, f"n^-1/2: D of {_P} eq. (11)", _RATE_GRID_FAST)],
    ("rate-grid", "l2"): [(-0.5, f"n^-1/2 (up to log n): {_P} Thms. 1 and 3", _RATE_GRID_ALL)],
    ("competition-v1", "voronoi"): [
        (-0.5, "n^-1/2: K-subset Voronoi loss (CompeteSMoE (2024) Thm. 4.2)", ("top-1", "top-2"))
    ],
    ("competition-v1", "hellinger"): [(-0.5, _DENSITY + "CompeteSMoE (2024) Thm. 4.1", ("top-1", "top-2"))],
    ("competition-v1", "tv"): [(-0.5, _DENSITY + "V ≤ √2 h", ("top-1", "top-2"))],
    ("competition-ffn", "expert"): [
        (-0.25, "n^-1/4: FFN experts, cells > 1 (CompeteSMoE (2025) Thm. 3.2)", ("competition",))
    ],
    ("competition-ffn", "voronoi"): [
        (-0.5, "n^-1/2: L₁ (CompeteSMoE (2025) eq. (6), Thm. 3.2)", ("competition",))
    ],
    ("competition-ffn", "tv"): [
        (-0.5, _DENSITY + "CompeteSMoE (2025) Prop. 3.1", ("competition", "softmax"))
    ],
    ("competition-ffn", "hellinger"): [(-0.5, _DENSITY + "h ≤ √V", ("competition", "softmax"))],
}


@dataclass
class Series:
    """One fitted series: its name (the table's ``router`` column), the model that generates the
    data (``data``) and the fitted model (``fit``, default the same), the true and fitted numbers
    of routed (``k_true``, ``k``) and shared (``k1_true``, ``k1``) experts, and the losses."""

    name: str
    setting: str
    data: Any
    k_true: int
    k: int
    losses: tuple[str, ...]
    fit: Any = None
    k1_true: int = 0
    k1: int = 0
    voronoi: str = ""  # "d1", "d2", "eq11", "k-subset", "l1", "" (none)
    extra: dict = field(default_factory=dict)


def paper_series(cfg: Any) -> list[Series]:
    """The series of ``cfg.study`` (a :class:`moelab.stats.studies.StudyConfig`)."""
    k_true, k_over = cfg.k_true, cfg.k_true + cfg.extra_experts
    over = "over-specified"
    dens = ("expert", "voronoi", "hellinger", "tv", "l2")
    s = cfg.study
    if s == "shared-experts":
        return [
            Series(e, over, Mixture("gaussian", "softmax", e2, "relu" if e == "ffn" else "tanh", shared=True),
                   k_true, k_over, ("shared", *dens), k1_true=1, k1=2, voronoi="d1" if e == "ffn" else "d2")
            for e, e2 in (("ffn", "ffn"), ("linear", "linear"))
        ]  # fmt: skip
    if s == "sigmoid-vs-softmax":
        return [
            Series(f"{g}-{e}", over,
                   Mixture("gaussian", "softmax" if g == "softmax" else "normalized-sigmoid", e, "relu", shared=True),
                   k_true, k_over, ("expert", "hellinger", "tv", "l2"), k1_true=1, k1=1)
            for g in ("softmax", "sigmoid") for e in ("ffn", "linear")
        ]  # fmt: skip
    if s == "strong-vs-ridge":
        return [
            Series("strong", over, Mixture("regression", "softmax", "normalized-input", "tanh"), k_true, k_over,
                   ("expert", "voronoi", "l2"), voronoi="d1"),
            Series("ridge", over, Mixture("regression", "softmax", "linear"), k_true, k_over,
                   ("expert", "voronoi", "l2"), voronoi="d1"),
        ]  # fmt: skip
    if s == "gaussian-vs-regression":
        return [
            Series("gaussian", over, Mixture("gaussian", "softmax", "linear"), k_true, k_over, dens, voronoi="d2"),
            Series("regression", over, Mixture("regression", "softmax", "linear"), k_true, k_over,
                   ("expert", "voronoi", "l2"), voronoi="d2"),
        ]  # fmt: skip
    if s == "attention-gating":
        return [
            Series(name, over, Mixture("regression", "quadratic", e, "tanh"), k_true, k_over,
                   ("expert", "voronoi", "l2"), voronoi="d1")
            for name, e in (("linear", "linear"), ("nonlinear", "ffn"))
        ]  # fmt: skip
    if s == "replora":
        truth_model = LoRAMixture("shared")
        return [
            Series("replora", "exact-specified", truth_model, 1, 1, ("lora", "l2")),
            Series("lora", "exact-specified", truth_model, 1, 1, ("lora", "l2"), fit=LoRAMixture("separate")),
        ]
    if s == "rate-grid":
        return [
            Series(f"{g}-{e}", over, Mixture("regression", g, e, "relu", tau=cfg.tau), k_true, k_over,
                   ("expert", "voronoi", "l2"), voronoi="eq11")
            for g in ("softmax", "cosine", "perturbed") for e in ("linear", "polynomial", "ffn")
        ]  # fmt: skip
    if s == "competition-v1":
        k = max(k_true, 3)
        return [
            Series(f"top-{K}", "exact-specified", Mixture("gaussian", "competition-v1", "linear", top_k=K), k, k,
                   ("voronoi", "hellinger", "tv"), voronoi="k-subset", extra={"top_k": K})
            for K in (1, 2)
        ]  # fmt: skip
    if s == "competition-ffn":
        return [
            Series(g, over, Mixture("gaussian", g, "ffn", "tanh"), k_true, k_over, dens,
                   voronoi="l1" if g == "competition" else "")
            for g in ("competition", "softmax")
        ]  # fmt: skip
    raise ValueError(f"study={s!r} is not allowed; expected one of {list(PAPER_STUDIES)}")


# ------------------------------------------------------------------------------------- the truth


def _truth(series: Series, d: int, cfg: Any, gen: torch.Generator) -> dict[str, Tensor]:
    """True parameters (R = 1) of a series' data model."""
    dt = torch.float64
    if isinstance(series.data, LoRAMixture):
        J, r = series.data.positions, 1
        fixed = torch.randn(1, 3 * J + 1, d, d, generator=gen, dtype=dt) / math.sqrt(d)
        a = cfg.expert_std * torch.randn(1, r, d, generator=gen, dtype=dt)
        b = cfg.expert_std * torch.randn(1, d, r, generator=gen, dtype=dt)
        return {"fixed": fixed, "a": a, "b": b}
    m: Mixture = series.data
    k, q = series.k_true, m.q(d)
    p = {
        "beta0": cfg.router_std * torch.randn(1, k, generator=gen, dtype=dt),
        "beta1": cfg.router_std * torch.randn(1, k, d, generator=gen, dtype=dt),
        "eta": cfg.expert_std * torch.randn(1, k, q, generator=gen, dtype=dt),
    }
    if m.gate in ("softmax", "quadratic", "competition"):  # identifiable up to translation: pin the last
        p["beta0"][:, -1] = 0
        p["beta1"][:, -1] = 0
    if m.gate == "competition":
        p["beta0"].zero_()  # CompeteSMoE (2025) eq. (13) has no gate bias: the truth has none
    if m.gate == "quadratic":
        p["quad"] = cfg.router_std * torch.randn(1, k, d * (d + 1) // 2, generator=gen, dtype=dt)
        p["quad"][:, -1] = 0
    if (
        m.expert == "ffn"
    ):  # keep every expert's output weight away from 0 (an expert that is 0 is not identifiable)
        p["eta"][..., 0] = p["eta"][..., 0].sign() * (0.5 + p["eta"][..., 0].abs())
    lo, hi = cfg.nu_range
    p["nu"] = lo + (hi - lo) * torch.rand(1, k, generator=gen, dtype=dt)
    if m.shared:
        k1 = series.k1_true
        p["omega"] = torch.zeros(1, k1, dtype=dt)
        p["kappa"] = cfg.expert_std * torch.randn(1, k1, q, generator=gen, dtype=dt)
        if m.expert == "ffn":
            p["kappa"][..., 0] = p["kappa"][..., 0].sign() * (0.5 + p["kappa"][..., 0].abs())
        p["tau"] = lo + (hi - lo) * torch.rand(1, k1, generator=gen, dtype=dt)
    return p


def _split(t: Tensor, k: int) -> Tensor:
    """``(R, k*, ...)`` → ``(R, k, ...)``: fitted atom i starts at true atom i mod k*."""
    return t[:, torch.arange(k) % t.shape[1]]


def _log_copies(k_true: int, k: int, dtype: torch.dtype) -> Tensor:
    src = torch.arange(k) % k_true
    return torch.bincount(src, minlength=k_true)[src].to(dtype).log()


def _start(
    series: Series, truth: dict[str, Tensor], R: int, noise: float, gen: torch.Generator
) -> dict[str, Tensor]:
    """Near the truth: over-specified atoms split a true atom (weights divided among the copies),
    every trained parameter plus N(0, noise²)."""
    fit_model = series.fit or series.data
    p = {name: t.expand(R, *t.shape[1:]).clone() for name, t in truth.items()}
    if isinstance(fit_model, LoRAMixture):
        if fit_model.mode == "separate":
            a, b = torch.tanh(p.pop("a")), torch.tanh(p.pop("b"))
            p.update({"aq": a, "av": a.clone(), "bq": b, "bv": b.clone()})
    else:
        k, k_true = series.k, series.k_true
        for name in ("beta0", "beta1", "eta", "nu", "quad"):
            if name in p:
                p[name] = _split(p[name], k)
        if k > k_true and fit_model.gate == "normalized-sigmoid":
            # 2σ(z − log 2) ≠ σ(z): a normalised sigmoid cannot split an atom's weight; the extra
            # copies start nearly off instead (σ(z − 8) ≈ 3·10⁻⁴ e^z), the truth almost exactly
            later = torch.arange(k) >= k_true
            p["beta0"] = p["beta0"] - 8.0 * later.to(p["beta0"].dtype)
        elif k > k_true:
            p["beta0"] = p["beta0"] - _log_copies(k_true, k, p["beta0"].dtype)
        if fit_model.shared:
            for name in ("omega", "kappa", "tau"):
                p[name] = _split(p[name], series.k1)
            if series.k1 > series.k1_true:
                p["omega"] = p["omega"] - _log_copies(series.k1_true, series.k1, p["omega"].dtype)
    for name in fit_model.trainable():
        t = p[name]
        eps = noise * torch.randn(t.shape, generator=gen, dtype=t.dtype)
        if name in ("nu", "tau"):
            p[name] = t * (1 + eps).abs().clamp_min(0.2)
        else:
            if name == "beta0":
                eps = eps - eps.mean(dim=1, keepdim=True)  # a common shift moves nothing
            p[name] = t + eps
    return p


# ----------------------------------------------------------------------------------- the measures


def _expert_blocks(p: dict[str, Tensor], gaussian: bool, prefix: str = "") -> list[Tensor]:
    names = ("kappa", "tau") if prefix == "shared" else ("eta", "nu")
    return [p[names[0]]] + ([p[names[1]]] if gaussian else [])


def _saturated(series: Series, true: dict[str, Tensor], routed: Tensor) -> Tensor:
    """Per replicate, whether the routed part of the Voronoi loss sits at its bound: with the shift
    of β₀ free, a fit whose weighted parameter cost exceeds its mass reaches the infimum at
    weights → 0, ``Σ_j exp(β*₀ⱼ)`` — the loss's upper bound, which measures no rate."""
    m = series.fit or series.data
    if series.voronoi == "k-subset" or m.gate not in _TRANSLATED:
        return torch.zeros(routed.shape[0], dtype=torch.bool)
    return routed >= true["beta0"].exp().sum(-1) * (1 - 1e-9)


#: gates identifiable up to a shift of β₀ (and of β₁ for softmax and quadratic)
_TRANSLATED = ("softmax", "quadratic", "competition", "cosine", "perturbed")


def _voronoi(
    series: Series,
    fit: dict[str, Tensor],
    true: dict[str, Tensor],
    gaussian: bool,
    d: int,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """The series' Voronoi loss (its infimum over the gate's translations where the gate has
    them), the routed experts' part of it (the whole loss without shared experts) and, where the
    infimum is over a shift of β₁ (softmax and quadratic gates: solved numerically), its certified
    lower bound; ``None`` where the loss is exact."""
    kind = series.voronoi
    m = series.fit or series.data
    if kind == "k-subset":  # CompeteSMoE (2024) eq. (9), exact-specified
        loss = k_subset_voronoi([(fit["eta"], true["eta"]), (fit["nu"], true["nu"])], series.extra["top_k"])
        return loss, loss, None
    one, two = (lambda s: 2.0), (lambda s: 2.0)

    def routed_blocks() -> list:
        beta1 = fit["beta1"]
        blocks = []
        if kind == "d2":  # Ho (2025) D₂: (β₁, η₀) to r̄, (η₁, ν) to r̄/2 in cells of m > 1 atoms
            blocks.append((beta1, true["beta1"], 1.0, _rbar))
            blocks.append((fit["eta"][..., :d], true["eta"][..., :d], 1.0, lambda s: _rbar(s) / 2))
            blocks.append((fit["eta"][..., d], true["eta"][..., d], 1.0, _rbar))
            if gaussian:
                blocks.append((fit["nu"], true["nu"], 1.0, lambda s: _rbar(s) / 2))
            return blocks
        if m.gate != "competition":
            blocks.append((beta1, true["beta1"], 1.0, two))
        blocks.append((fit["eta"], true["eta"], 1.0, two))
        if gaussian:
            blocks.append((fit["nu"], true["nu"], 1.0, two))
        if "quad" in fit:
            blocks.append((fit["quad"], true["quad"], 1.0, two))
        return blocks

    blocks = routed_blocks()
    if m.gate in _TRANSLATED:
        # a softmax or quadratic gate is invariant to a shift of (β₀, β₁), the cosine, perturbed
        # and competition gates to a shift of β₀ only (the first block is β₁ where it is shifted)
        shifted = m.gate in ("softmax", "quadratic")
        inf = translation_inf(fit["beta0"], true["beta0"], blocks, shift=0 if shifted else None)
        routed, lower = inf.value, (inf.lower if shifted else None)
    else:
        routed, lower = voronoi_d(fit["beta0"].exp(), blocks, true["beta0"].exp()), None
    if not m.shared:
        return routed, routed, lower
    if kind == "d2":
        sblocks = [
            (fit["kappa"][..., :d], true["kappa"][..., :d], 1.0, one),
            (fit["kappa"][..., d], true["kappa"][..., d], 1.0, _rbar),
            (fit["tau"], true["tau"], 1.0, lambda s: _rbar(s) / 2),
        ]
    else:
        sblocks = [(fit["kappa"], true["kappa"], 1.0, two), (fit["tau"], true["tau"], 1.0, two)]
    shared = voronoi_d(fit["omega"].softmax(-1), sblocks, true["omega"].softmax(-1))
    return routed + shared, routed, None if lower is None else lower + shared


def _measure(
    series: Series, cfg: Any, fit: dict[str, Tensor], true: dict[str, Tensor], x_eval: Tensor
) -> dict[str, Tensor]:
    """Every loss of ``series.losses`` per replicate ``(R,)``; ``l2``, ``hellinger`` and ``tv``
    also give their Monte Carlo standard error as ``<name>_se``."""
    data_model, fit_model = series.data, series.fit or series.data
    out: dict[str, Tensor] = {}
    gaussian = getattr(data_model, "likelihood", "regression") == "gaussian"
    d = x_eval.shape[-1]
    if "l2" in series.losses:
        e = l2_distance(fit_model.mean(x_eval, fit), data_model.mean(x_eval, true))
        out["l2"], out["l2_se"] = e.value, e.se
    if "hellinger" in series.losses:
        dist = density_distances(
            fit_model.components(x_eval, fit), data_model.components(x_eval, true), nodes=_nodes(cfg)
        )
        for name in ("hellinger", "tv"):
            out[name], out[f"{name}_se"] = dist[name].value, dist[name].se
    if "lora" in series.losses:
        fq, fv = fit_model.adapters(fit)
        tq, tv_ = data_model.adapters(true)
        out["lora"] = (fq - tq).flatten(1).norm(dim=-1) + (fv - tv_).flatten(1).norm(dim=-1)
    if "expert" in series.losses:  # Σ_j Σ_{i∈A_j} ‖Δθ‖: exponent 1 in every cell, no weights
        gates = (
            [fit["beta1"]]
            if "beta1" in fit and fit_model.gate not in ("competition", "competition-v1")
            else []
        )
        tgates = [true["beta1"]] if gates else []
        blocks = [
            (f, t, 1.0, lambda s: 1.0)
            for f, t in zip(_expert_blocks(fit, gaussian), _expert_blocks(true, gaussian))
        ]
        # cells on the whole atom (gate and expert), cost on the expert only
        cells_on = [(f, t, None, None) for f, t in zip(gates, tgates)]
        out["expert"] = voronoi_d(None, blocks + cells_on, None, mass_term=False)
    if "shared" in series.losses:
        blocks = [(f, t, 1.0, lambda s: 1.0) for f, t in zip(_expert_blocks(fit, gaussian, "shared"),
                                                                 _expert_blocks(true, gaussian, "shared"))]  # fmt: skip
        out["shared"] = voronoi_d(None, blocks, None, mass_term=False)
    if "voronoi" in series.losses and series.voronoi:
        out["voronoi"], routed, lower = _voronoi(series, fit, true, gaussian, d)
        if lower is not None:
            out["voronoi_lower"] = lower
        out["voronoi_saturated"] = _saturated(series, true, routed)
    return out


def _nodes(cfg: Any) -> int:
    return 24 if cfg.quick else 40


# ------------------------------------------------------------------------------------------ runs


def run_paper_study(cfg: Any, gen: torch.Generator, bar: Any) -> list[dict[str, Any]]:
    """Fit every series of ``cfg.study`` at every n; one result dict per (series, loss) in the
    layout of :func:`moelab.stats.studies.run_study`.

    Runs on one intra-op thread (restored after): the tensors are tiny, and on a loaded machine
    two threads made every op wait for the other (0.30 s against 0.011 s per objective and
    gradient of a shared-experts fit, R = 3, n = 300, load 21 on 2 cores; docs/results.md)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _run(cfg, gen, bar)
    finally:
        torch.set_num_threads(threads)


def _run(cfg: Any, gen: torch.Generator, bar: Any) -> list[dict[str, Any]]:
    results = []
    R, d = cfg.replicates, cfg.d
    for series in paper_series(cfg):
        truth = _truth(series, d, cfg, torch.Generator().manual_seed(cfg.seed))  # same truth per study
        fit_model = series.fit or series.data
        per_loss: dict[str, list] = {}
        train, reasons, diag, estimates = (
            [],
            [],
            {k: [] for k in ("n_iter", "grad_norm", "converged", "hit_cap", "beta1_max_norm")},
            {},
        )
        x_eval = sample_inputs(R, cfg.eval_n, d, bound=cfg.input_bound, generator=gen)
        true_r = {k: v.expand(R, *v.shape[1:]) for k, v in truth.items()}
        for n in cfg.sample_sizes:
            x = sample_inputs(
                R, n, d, distribution=cfg.input_distribution, bound=cfg.input_bound, generator=gen
            )
            y = series.data.sample(x, true_r, cfg.noise_var, gen)
            start = _start(series, truth, R, cfg.init_noise, gen)
            res = fit_params(fit_model, x, y, start, steps=cfg.steps, gtol=cfg.gtol, ftol=cfg.ftol, lr=cfg.lr,
                             nu_min=cfg.nu_min)  # fmt: skip
            for name, value in _measure(series, cfg, res.params, true_r, x_eval).items():
                per_loss.setdefault(name, []).append(value.tolist())
            train.append(res.loss.tolist())
            reasons.append(res.reason)
            diag["n_iter"].append(res.n_iter.tolist())
            diag["grad_norm"].append(res.grad_norm.tolist())
            diag["converged"].append(res.converged.tolist())
            diag["hit_cap"].append(((~res.converged) & (res.n_iter >= cfg.steps)).tolist())
            b1 = res.params.get("beta1")
            diag["beta1_max_norm"].append(b1.norm(dim=-1).amax(-1).tolist() if b1 is not None else [0.0] * R)
            for name in fit_model.trainable():
                estimates.setdefault(name, []).append(res.params[name].numpy())
            bar.update(1)
        est = {k: np.stack(v) for k, v in estimates.items()}
        est.update({f"target_{k}": v.numpy() for k, v in truth.items() if k != "fixed"})
        common = {
            "router": series.name, "setting": series.setting, "k": series.k, "train": np.array(train),
            "reasons": reasons, "diag": {k: np.array(v, dtype=float) for k, v in diag.items()}, "estimates": est,
        }  # fmt: skip
        for name in series.losses:
            if name == "voronoi" and not series.voronoi:
                continue
            loss = np.array(per_loss[name])
            se = np.array(per_loss[f"{name}_se"]) if f"{name}_se" in per_loss else None
            saturated = np.array(per_loss["voronoi_saturated"], dtype=float) if name == "voronoi" else None
            lower = (
                np.array(per_loss["voronoi_lower"])
                if name == "voronoi" and "voronoi_lower" in per_loss
                else None
            )
            results.append(
                {
                    **common,
                    "loss_name": name,
                    "loss": loss,
                    "mc_se": se,
                    "saturated": saturated,
                    "lower": lower,
                }
            )
    return results
