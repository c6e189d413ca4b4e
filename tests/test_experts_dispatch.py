"""The shared dispatch: sort once, gather, run, combine — for every bank, deterministic on every device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from experts_helpers import IMPLS, random_routing, reference
from moelab.experts import ExpertBank, ModuleExperts, sort_slots


def test_sort_slots_groups_slots_by_expert():
    idx = torch.tensor([[2, 0], [1, 2], [0, 1], [2, 1]])
    order, counts, tokens, inverse = sort_slots(idx, 4)
    flat = idx.reshape(-1)
    assert flat[order].tolist() == sorted(flat.tolist())
    assert counts.tolist() == [2, 3, 3, 0]
    assert tokens.tolist() == (order // 2).tolist()
    assert flat[order][inverse].tolist() == flat.tolist()


def _module_experts(n, d_in, d_out):
    return ModuleExperts(
        [nn.Sequential(nn.Linear(d_in, 5), nn.Tanh(), nn.Linear(5, d_out)) for _ in range(n)]
    )


@pytest.mark.parametrize(("t", "n", "k"), [(1, 3, 3), (7, 4, 2), (12, 5, 1)])
def test_module_experts_dispatch_equals_weighted_sum(t, n, k):
    g = torch.Generator().manual_seed(3)
    bank = _module_experts(n, 6, 3)
    x = torch.randn(t, 6, generator=g)
    idx, w = random_routing(t, n, k, g, experts=list(range(n - 1)) if k < n else None)
    out = bank(x, idx, w)
    assert out.shape == (t, 3)
    torch.testing.assert_close(out, reference(bank, x, idx, w), rtol=1e-5, atol=1e-6)


def test_module_experts_forward_all_stacks_expert_forward():
    bank = _module_experts(4, 6, 3)
    x = torch.randn(5, 6)
    expected = torch.stack([bank.expert_forward(x, e) for e in range(4)], dim=1)
    torch.testing.assert_close(bank.forward_all(x), expected)


def test_module_experts_rejects_an_empty_list():
    with pytest.raises(
        ValueError, match=r"experts=\[\] is not allowed; expected a non-empty list of nn.Module"
    ):
        ModuleExperts([])


@pytest.mark.parametrize("impl", IMPLS)
def test_gather_combine_of_the_gpu_equals_the_cpu_scatter_add_in_values_and_gradients(monkeypatch, impl):
    """The CPU sums slots into tokens by scatter-add, other devices by gathers: same numbers."""
    g = torch.Generator().manual_seed(11)
    bank = ExpertBank(6, 8, 8, activation="swiglu", impl=impl)
    x = torch.randn(13, 8, generator=g)
    idx, w = random_routing(13, 6, 3, g)
    w.requires_grad_()
    runs = []
    for scatter in (True, False):
        monkeypatch.setattr("moelab.experts.dispatch._scatter_adds", lambda device, s=scatter: s)
        xi = x.clone().requires_grad_()
        y = bank(xi, idx, w)
        grads = torch.autograd.grad((y * y).sum(), [xi, w, *bank.parameters()])
        with torch.inference_mode():
            plain = bank(x, idx, w.detach())
        runs.append([y.detach(), plain, *grads])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs[0][0], reference(bank, x, idx, w.detach()).detach(), rtol=1e-5, atol=1e-6)


def test_module_experts_dispatch_of_zero_tokens_is_empty():
    modules = _module_experts(3, 6, 2)
    assert modules(torch.randn(0, 6), torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1)).shape == (0, 2)
