"""Strong identifiability of an expert family, checked numerically (Ho (2025)).

Ho (2025) ties the rate at which an MoE's parameters can be estimated to a linear-independence
condition on the expert function ``h(x, η)``: the expert is *strongly identifiable* when, for any
distinct ``η₁ … η_k``, the functions

    general:  { x^ν · ∂^ρ h(x, η_j) / ∂η^ρ  :  j ≤ k, |ν| + |ρ| ≤ 2 }

are linearly independent in ``x`` (the slides' "Strongly Identifiable Experts"; then over-specified
Voronoi cells have weights and expert parameters at n^-1/4, exact cells at n^-1/2).  The DeepSeekMoE
part of the slides (Definition 1) asks it of two sets separately: for the shared experts ``h₁``, the
first derivatives ``{∂_u h₁}`` and ``{∂_u h₁ · ∂_v h₁, 1}``; for the routed experts ``h₂``,
``{∂_u h₂, ∂²_uv h₂, x^(u) ∂_v h₂}``.

:func:`check_strong_identifiability` evaluates every function of the set at random inputs (in
float64), scales each column to unit norm and takes the singular values: the set is independent
(to ``tol``) when the smallest singular value relative to the largest is above ``tol``, and
otherwise the right singular vector of the smallest names the dependent combination.  A verdict
at the parameters given: a family that is independent there may still fail at others (the
definition asks it for every distinct choice), so check at several.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import Tensor
from torch.func import hessian, jacrev

__all__ = ["EXPERT_FAMILIES", "KINDS", "IdentifiabilityReport", "check_strong_identifiability"]

Expert = Callable[[Tensor, Tensor], Tensor]

#: the sets of functions each kind of the definition asks to be independent
KINDS = ("general", "shared", "routed")


def _split(eta: Tensor, d: int) -> tuple[Tensor, Tensor]:
    return eta[:d], eta[d]


def _linear(x: Tensor, eta: Tensor) -> Tensor:
    a, b = _split(eta, x.shape[1])
    return x @ a + b


def _ridge_square(x: Tensor, eta: Tensor) -> Tensor:
    a, b = _split(eta, x.shape[1])
    return (x @ a + b) ** 2


def _normalized(activation: Callable[[Tensor], Tensor]) -> Expert:
    def h(x: Tensor, eta: Tensor) -> Tensor:
        a, b = _split(eta, x.shape[1])
        return activation(x @ a / x.norm(dim=1) + b)

    return h


def _ffn(activation: Callable[[Tensor], Tensor]) -> Expert:
    def h(x: Tensor, eta: Tensor) -> Tensor:  # η = (κ₁ ∈ R^d, κ₀, κ₂): κ₂ σ(κ₁ᵀx + κ₀)
        d = x.shape[1]
        return eta[d + 1] * activation(x @ eta[:d] + eta[d])

    return h


#: named expert families ``h(x (n, d), η) -> (n,)`` and the size of η for input dimension d
EXPERT_FAMILIES: dict[str, tuple[Expert, Callable[[int], int]]] = {
    "linear": (_linear, lambda d: d + 1),  # aᵀx + b
    "ridge-square": (_ridge_square, lambda d: d + 1),  # (aᵀx + b)²: a polynomial ridge expert
    "normalized-sigmoid": (_normalized(torch.sigmoid), lambda d: d + 1),  # σ(aᵀx/‖x‖ + b)
    "normalized-tanh": (_normalized(torch.tanh), lambda d: d + 1),
    "normalized-gelu": (_normalized(torch.nn.functional.gelu), lambda d: d + 1),
    "ffn-relu": (_ffn(torch.relu), lambda d: d + 2),  # κ₂ ReLU(κ₁ᵀx + κ₀)
    "ffn-gelu": (_ffn(torch.nn.functional.gelu), lambda d: d + 2),
    "ffn-tanh": (_ffn(torch.tanh), lambda d: d + 2),
}


@dataclass
class IdentifiabilityReport:
    """What :func:`check_strong_identifiability` found."""

    kind: str
    #: True: every set the kind asks for is linearly independent at these parameters; False: one is
    #: dependent (``dependence`` names the combination); None: undecided (nearly dependent)
    identifiable: bool | None
    #: per set: (its name, its number of functions, their numerical rank, smallest relative singular value)
    sets: list[tuple[str, int, int, float]]
    #: the dependent combination of the first dependent set: (function, coefficient), largest first
    dependence: list[tuple[str, float]] = field(default_factory=list)
    #: the rate regime Ho (2025) states for the verdict
    regime: str = ""
    #: pairs of members that are the same function (each pair a dependence)
    equal: list[tuple[str, str]] = field(default_factory=list)
    #: members that are zero everywhere (each a dependence)
    zero: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        verdict = {True: "holds", False: "fails", None: "undecided (nearly dependent at these points)"}
        lines = [f"strong identifiability ({self.kind}): {verdict[self.identifiable]}"]
        for name, m, rank, smallest in self.sets:
            lines.append(
                f"  {name}: {m} functions, rank {rank}, smallest relative singular value {smallest:.2e}"
            )
        if self.zero:
            lines.append(
                f"  zero everywhere: {', '.join(self.zero[:6])}{' ...' if len(self.zero) > 6 else ''}"
            )
        if self.equal:
            pairs = "; ".join(f"{a} = {b}" for a, b in self.equal[:6])
            lines.append(f"  the same function: {pairs}{' ...' if len(self.equal) > 6 else ''}")
        if self.dependence:
            terms = " + ".join(f"{c:+.3g}·{f}" for f, c in self.dependence)
            lines.append(f"  dependent: {terms} ≈ 0")
        lines.append(f"  regime: {self.regime}")
        return "\n".join(lines)


_REGIMES: dict[bool | None, str] = {
    None: "undecided: the functions are nearly dependent at these points (relative singular value between "
    "the thresholds); no rate regime is stated — try other parameters, more points or a wider input scale",
    True: "strongly identifiable at these parameters: over-specified Voronoi cells n^-1/4 for the weights "
    "and expert parameters, exact cells n^-1/2 (Ho (2025))",
    False: "not strongly identifiable: the rates of the expert parameters can be as slow as exponential "
    "(ridge experts with a polynomial σ) or follow the D_r̄ loss (linear experts, n^-1/(2r̄)) (Ho (2025))",
}


def _monomials(x: Tensor, degree: int) -> list[tuple[str, Tensor]]:
    d = x.shape[1]
    out: list[tuple[str, Tensor]] = [("", torch.ones_like(x[:, 0]))]
    for deg in range(1, degree + 1):
        for idx in itertools.combinations_with_replacement(range(d), deg):
            out.append(("·".join(f"x{i + 1}" for i in idx) + "·", x[:, list(idx)].prod(dim=1)))
    return out


def _function_sets(
    expert: Expert, params: Tensor, x: Tensor, kind: str, names: list[str]
) -> list[tuple[str, list[tuple[str, Tensor]]]]:
    """Every function the definition of ``kind`` names, evaluated at ``x``, grouped by set."""
    q = params.shape[1]
    pairs = list(itertools.combinations_with_replacement(range(q), 2))
    general, first, products, routed = [], [], [], []
    for j, eta in enumerate(params):
        tag = f"[η{j + 1}]" if len(params) > 1 else ""
        value = expert(x, eta)
        grad = jacrev(lambda e: expert(x, e))(eta)  # (n, q)
        hess = hessian(lambda e: expert(x, e))(eta)  # (n, q, q)
        d_ = [(f"∂h/∂{names[u]}{tag}", grad[:, u]) for u in range(q)]
        d2 = [(f"∂²h/∂{names[u]}∂{names[v]}{tag}", hess[:, u, v]) for u, v in pairs]
        for mono, m in _monomials(x, 2):
            general.append((f"{mono}h{tag}", m * value))
        for mono, m in _monomials(x, 1):
            general.extend((mono + n, m * g) for n, g in d_)
        general.extend(d2)
        first.extend(d_)
        products.extend((f"{d_[u][0]}·{d_[v][0]}", d_[u][1] * d_[v][1]) for u, v in pairs)
        routed.extend(d_ + d2)
        for mono, m in _monomials(x, 1)[1:]:
            routed.extend((mono + n, m * g) for n, g in d_)
    products.append(("1", torch.ones_like(x[:, 0])))
    if kind == "general":
        return [("x^ν ∂^ρ h, |ν| + |ρ| ≤ 2", general)]
    if kind == "shared":
        return [("∂h/∂κ", first), ("∂h/∂κ_u · ∂h/∂κ_v, 1", products)]
    return [("∂h/∂η, ∂²h/∂η², x ∂h/∂η", routed)]


def check_strong_identifiability(
    expert: str | Expert,
    params: Tensor,
    *,
    d: int | None = None,
    kind: str = "general",
    points: int | None = None,
    seed: int = 0,
    scale: float = 3.0,
    dependent_below: float = 1e-10,
    independent_above: float = 1e-6,
    names: list[str] | None = None,
) -> IdentifiabilityReport:
    """Check numerically whether the functions Ho (2025)'s strong identifiability asks for are
    linearly independent at the distinct parameters ``params``.

    Args:
        expert: a name of :data:`EXPERT_FAMILIES` or a function ``h(x (n, d), η (q,)) -> (n,)``,
            twice differentiable in ``η`` (torch operations only).
        params: ``(k, q)`` distinct parameters ``η₁ … η_k``.
        d: the input dimension (needed for a function; a named family reads it from ``q``).
        kind: ``general`` (the slides' definition), ``shared`` or ``routed`` (Definition 1 of
            the DeepSeekMoE part: the shared experts' sets, or the routed experts').
        points: inputs ``x ~ N(0, scale² I_d)`` to evaluate at (default: 4 × the functions, at
            least 256).
        scale: the inputs' standard deviation (3: wide enough that a smooth activation is not
            nearly polynomial over the sample).
        seed: seed of the inputs.
        dependent_below, independent_above: with every function scaled to unit norm at the
            points, a set is *dependent* when its smallest singular value relative to the largest
            is at most ``dependent_below`` (an exact dependence sits at rounding, about 1e-16)
            at ``scale`` and again, with the same rank, at ten times it; *independent* when it is
            above ``independent_above``; and *undecided* otherwise: nearly dependent at these
            points, which the sample cannot settle (said, rather than guessed).
        names: names of η's coordinates (default ``η1 … ηq``; ``a1 … ad, b`` for a named
            family with η = (a, b)).

    Raises:
        ValueError: an unknown family or kind, parameters that are not ``(k, q)`` or not
            distinct, or a ``q`` that does not fit the family.
    """
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r} is not allowed; expected one of {list(KINDS)}")
    params = torch.as_tensor(params, dtype=torch.float64)
    if params.dim() != 2 or params.shape[0] < 1 or params.shape[1] < 1:
        raise ValueError(
            f"params of shape {tuple(params.shape)} is not allowed; expected (k, q): k distinct parameters η"
        )
    k, q = params.shape
    if k > 1 and torch.cdist(params, params).add(torch.eye(k, dtype=params.dtype)).min() == 0:
        raise ValueError("params has two equal rows; the definition asks for distinct parameters η₁ … η_k")
    if isinstance(expert, str):
        if expert not in EXPERT_FAMILIES:
            raise ValueError(
                f"expert={expert!r} is not allowed; expected a function or one of {list(EXPERT_FAMILIES)}"
            )
        expert, size = EXPERT_FAMILIES[expert]
        extra = q - size(0)
        if extra < 1 or (d is not None and d != extra):
            raise ValueError(
                f"params with q={q} does not fit the family; expected q = d + {size(0)} for d >= 1"
            )
        d = extra
        names = names or [*(f"a{i + 1}" for i in range(d)), "b", *(["c"] if size(0) == 2 else [])]
    elif d is None or not isinstance(d, int) or d < 1:
        raise ValueError(
            f"d={d!r} is not allowed for an expert function; expected the input dimension, an int >= 1"
        )
    names = names or [f"η{u + 1}" for u in range(q)]
    if len(names) != q:
        raise ValueError(f"names has {len(names)} entries; expected one per coordinate of η (q={q})")
    gen = torch.Generator().manual_seed(seed)
    probe = _function_sets(expert, params, torch.randn(2, d, generator=gen, dtype=torch.float64), kind, names)
    m_max = max(len(functions) for _, functions in probe)
    n = points or max(256, 4 * m_max)
    if n < m_max:
        raise ValueError(f"points={n} is not allowed; expected at least as many as the {m_max} functions")
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    sets, dependence, equal, zero = [], [], [], []
    for set_name, functions in _function_sets(expert, params, scale * x, kind, names):
        set_zero, set_equal = _degenerate(functions)
        zero += set_zero
        equal += set_equal
        rank, smallest, v = _rank(functions, dependent_below)
        sets.append((set_name, len(functions), rank, smallest))
        if rank < len(functions) and not dependence:
            if set_zero:
                dependence = [(set_zero[0], 1.0)]
            elif set_equal:
                dependence = [(set_equal[0][0], 1.0), (set_equal[0][1], -1.0)]
            else:
                order = [
                    int(i) for i in v.abs().argsort(descending=True) if v[i].abs() > 1e-3 * v.abs().max()
                ]
                dependence = [(functions[i][0], float(v[i] / v[order[0]])) for i in order[:8]]
    # an exact dependence holds at every scale of the inputs; one that goes at ten times the scale
    # was rounding where the functions are nearly polynomial over the sample
    wider = [
        _rank(f, dependent_below)[0] for _, f in _function_sets(expert, params, 10 * scale * x, kind, names)
    ]
    if any(rank < m for _, m, rank, _ in sets) and wider == [rank for _, _, rank, _ in sets]:
        identifiable: bool | None = False
    elif all(rank == m and smallest > independent_above for _, m, rank, smallest in sets):
        identifiable = True
    else:
        identifiable = None
    return IdentifiabilityReport(kind, identifiable, sets, dependence, _REGIMES[identifiable], equal, zero)


def _rank(functions: list[tuple[str, Tensor]], dependent_below: float) -> tuple[int, float, Tensor]:
    """The numerical rank of the functions (each scaled to unit norm at the points), the smallest
    singular value relative to the largest, and its right singular vector (the combination)."""
    matrix = torch.stack([f for _, f in functions], dim=1)  # (n, m)
    scaled = matrix / matrix.norm(dim=0).clamp_min(torch.finfo(matrix.dtype).tiny)
    _, sv, vh = torch.linalg.svd(scaled, full_matrices=False)
    relative = sv / sv[0]
    return int((relative > dependent_below).sum()), float(relative[-1]), vh[-1]


def _degenerate(functions: list[tuple[str, Tensor]]) -> tuple[list[str], list[tuple[str, str]]]:
    """The members of the family that make it dependent on their own: zero everywhere, or equal to
    another member (``∂h/∂η₁ = x ∂h/∂η₀`` for a linear expert), to 1e-12 of the largest norm."""
    scale = max(float(f.norm()) for _, f in functions)
    zero = [name for name, f in functions if float(f.norm()) <= 1e-12 * scale]
    equal = [
        (a, b)
        for (i, (a, f)), (b, g) in itertools.product(enumerate(functions), functions)
        if a < b and a not in zero and float((f - g).norm()) <= 1e-12 * scale
    ]
    return zero, equal
