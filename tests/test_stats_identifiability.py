"""Strong identifiability of expert families, checked numerically (Ho (2025))."""

from __future__ import annotations

import pytest
import torch

from moelab.stats import check_strong_identifiability
from moelab.stats.identifiability import EXPERT_FAMILIES

P2 = torch.tensor([[0.5, -1.0, 0.3], [1.2, 0.4, -0.7]], dtype=torch.float64)  # two experts, d = 2
P3 = torch.tensor([[0.5, -1.0, 0.3, 1.1], [1.2, 0.4, -0.7, 0.8]], dtype=torch.float64)


def test_linear_experts_fail_with_the_identity_the_slides_give():
    """Ho (2025): linear experts are not strongly identifiable "because ∂h/∂η₁ = x ∂h/∂η₀" (and in
    the shared set, (∂h/∂κ₀)² = 1): the check names exactly such pairs."""
    general = check_strong_identifiability("linear", P2)
    assert general.identifiable is False and ("x1·∂h/∂b[η1]", "∂h/∂a1[η1]") in {
        tuple(sorted(pair, key=len, reverse=True)) for pair in general.equal
    }
    shared = check_strong_identifiability("linear", P2, kind="shared")
    assert shared.identifiable is False
    assert ("1", "∂h/∂b[η1]·∂h/∂b[η1]") in shared.equal
    assert "not strongly identifiable" in shared.regime and "fails" in str(shared)


def test_a_polynomial_ridge_expert_fails_and_a_gelu_network_holds_for_the_shared_sets():
    square = check_strong_identifiability("ridge-square", P2)
    assert square.identifiable is False and square.sets[0][2] < square.sets[0][1]
    gelu = check_strong_identifiability("ffn-gelu", P3, kind="shared")
    assert gelu.identifiable is True and not gelu.dependence and not gelu.equal and not gelu.zero
    assert all(rank == m for _, m, rank, _ in gelu.sets)
    assert "n^-1/4" in gelu.regime
    # ReLU is positively homogeneous: c ∂h/∂c = Σ aᵢ ∂h/∂aᵢ + b ∂h/∂b ties the shared set's first derivatives
    relu = check_strong_identifiability("ffn-relu", P3, kind="shared")
    assert relu.identifiable is False and relu.sets[0][2] == relu.sets[0][1] - 2  # one identity per expert


def test_the_function_set_is_the_literal_one():
    """For a linear expert h = aᵀx + b (d = 1, k = 1) the general set is, in order, h, x·h, x²·h,
    ∂h/∂a = x, ∂h/∂b = 1, x·∂h/∂a = x², x·∂h/∂b = x and the zero second derivatives."""
    from moelab.stats.identifiability import _function_sets

    x = torch.tensor([[0.5], [-2.0], [3.0]], dtype=torch.float64)
    a, b = 1.5, -0.5
    (_, functions), = _function_sets(EXPERT_FAMILIES["linear"][0], torch.tensor([[a, b]], dtype=torch.float64),
                                     x, "general", ["a1", "b"])  # fmt: skip
    h = a * x[:, 0] + b
    X = x[:, 0]
    want = {"h": h, "x1·h": X * h, "x1·x1·h": X * X * h, "∂h/∂a1": X, "∂h/∂b": torch.ones(3, dtype=torch.float64),
            "x1·∂h/∂a1": X * X, "x1·∂h/∂b": X, "∂²h/∂a1∂a1": 0 * X, "∂²h/∂a1∂b": 0 * X, "∂²h/∂b∂b": 0 * X}  # fmt: skip
    assert [name for name, _ in functions] == list(want)
    for name, f in functions:
        torch.testing.assert_close(f, want[name], rtol=1e-15, atol=1e-15)


def test_a_nearly_dependent_set_is_undecided_not_guessed():
    """A tanh ridge expert without a bias at inputs so small that tanh is nearly linear: the set is
    nearly dependent, which the check says instead of a verdict."""

    def h(x, eta):
        return torch.tanh(x @ eta)

    report = check_strong_identifiability(
        h, torch.tensor([[0.7], [-1.3]], dtype=torch.float64), d=1, scale=0.05
    )
    assert report.identifiable is None and "undecided" in report.regime and "undecided" in str(report)


@pytest.mark.parametrize(
    "args, kwargs, message",
    [
        (("softplus", P2), {}, r"expert='softplus' is not allowed; expected a function or one of \["),
        (("linear", P2), {"kind": "weak"}, r"kind='weak' is not allowed; expected one of \['general'"),
        (("linear", torch.zeros(3)), {}, r"params of shape \(3,\) is not allowed; expected \(k, q\)"),
        (("linear", torch.ones(2, 3)), {}, r"params has two equal rows; the definition asks for distinct"),
        (("ffn-gelu", torch.ones(1, 2)), {}, r"params with q=2 does not fit the family; expected q = d \+ 2"),
        ((lambda x, e: x @ e, torch.ones(1, 2)), {}, r"d=None is not allowed for an expert function"),
    ],
)
def test_bad_input_is_refused_naming_it(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_strong_identifiability(*args, **kwargs)
