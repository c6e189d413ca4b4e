"""moelab.losses against literal formulas."""

from __future__ import annotations

import math

import pytest
import torch

from moelab.losses import importance_loss, mean_entropy_loss, switch_balance_loss, z_loss


def test_switch_balance_is_one_under_perfect_balance():
    n = 4
    indices = torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])  # every expert gets 2 of 8 slots
    probs = torch.full((4, n), 1.0 / n)
    assert switch_balance_loss(probs, indices, n).item() == pytest.approx(1.0)


def test_switch_balance_matches_n_sum_f_times_p():
    t, n, k = 7, 5, 2
    probs = torch.randn(t, n, dtype=torch.float64).softmax(-1)
    indices = torch.stack([torch.randperm(n)[:k] for _ in range(t)])
    expected = 0.0
    for i in range(n):
        f_i = sum(int(v == i) for v in indices.reshape(-1).tolist()) / (t * k)
        p_i = sum(probs[x, i].item() for x in range(t)) / t
        expected += f_i * p_i
    expected *= n
    assert switch_balance_loss(probs, indices, n).item() == pytest.approx(expected, rel=1e-12)


def test_switch_balance_is_larger_when_collapsed():
    n = 4
    probs = torch.zeros(4, n)
    probs[:, 0] = 1.0
    indices = torch.zeros(4, 1, dtype=torch.long)
    assert switch_balance_loss(probs, indices, n).item() == pytest.approx(n)


def test_z_loss_is_mean_squared_logsumexp():
    logits = torch.randn(6, 4, dtype=torch.float64) * 3
    expected = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 6
    got = z_loss(logits)
    assert got.dim() == 0
    assert got.item() == pytest.approx(expected, rel=1e-12)


def test_z_loss_keeps_float64_precision():
    logits = torch.randn(6, 4, dtype=torch.float64)
    got = z_loss(logits)
    assert got.dtype == torch.float64
    torch.autograd.gradcheck(z_loss, (logits.requires_grad_(),))


def test_importance_loss_is_the_coefficient_of_variation_as_the_paper_writes_it():
    probs = torch.randn(9, 4, dtype=torch.float64).softmax(-1)
    imp = [sum(probs[x, i].item() for x in range(9)) for i in range(4)]
    mean = sum(imp) / 4
    var = sum((v - mean) ** 2 for v in imp) / 4
    assert importance_loss(probs).item() == pytest.approx(var**0.5 / mean, rel=1e-12)  # CV, not CV²


def test_importance_loss_is_zero_under_equal_importance():
    assert importance_loss(torch.full((5, 4), 0.25)).item() == pytest.approx(0.0, abs=1e-12)


def test_mean_entropy_loss_is_negative_entropy_of_batch_mean():
    probs = torch.randn(8, 5, dtype=torch.float64).softmax(-1)
    mean = [sum(probs[x, i].item() for x in range(8)) / 8 for i in range(5)]
    expected = sum(m * math.log(m) for m in mean)
    assert mean_entropy_loss(probs).item() == pytest.approx(expected, rel=1e-6)


def test_mean_entropy_loss_is_minus_log_n_when_uniform():
    assert mean_entropy_loss(torch.full((3, 8), 1 / 8)).item() == pytest.approx(-math.log(8), rel=1e-6)
