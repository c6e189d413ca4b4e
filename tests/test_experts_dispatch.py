"""The shared dispatch: sort once, gather, run, combine — for every bank, deterministic on every device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from experts_helpers import IMPLS, random_routing, reference
from moelab.experts import ExpertBank, Experts, ModuleExperts, sort_slots
from moelab.experts.dispatch import winners_by_rerun
from moelab.routing import Routing


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
    out = bank.mix(x, idx, w)
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
        y = bank.mix(xi, idx, w)
        grads = torch.autograd.grad((y * y).sum(), [xi, w, *bank.parameters()])
        with torch.inference_mode():
            plain = bank.mix(x, idx, w.detach())
        runs.append([y.detach(), plain, *grads])
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(runs[0][0], reference(bank, x, idx, w.detach()).detach(), rtol=1e-5, atol=1e-6)


def test_module_experts_dispatch_of_zero_tokens_is_empty():
    modules = _module_experts(3, 6, 2)
    assert modules.mix(torch.randn(0, 6), torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1)).shape == (
        0,
        2,
    )


def test_every_bank_implements_the_experts_protocol():
    from moelab.models.vision import BatchedExperts

    banks = [
        ExpertBank(3, 4, 4),
        _module_experts(3, 4, 4),
        BatchedExperts([nn.Linear(4, 4) for _ in range(3)]),
    ]
    for bank in banks:
        assert isinstance(bank, Experts), type(bank).__name__
    assert not isinstance(nn.Linear(4, 4), Experts)


def test_module_experts_on_images_dispatch_with_deterministic_gradients():
    """CNN experts: ``(T, C, H, W)`` in, ``(T, C', H', W')`` out, through the same gather and combine."""
    g = torch.Generator().manual_seed(4)
    bank = ModuleExperts([nn.Conv2d(2, 3, 3, padding=1) for _ in range(4)])
    x = torch.randn(6, 2, 5, 5, generator=g, requires_grad=True)
    idx, w = random_routing(6, 4, 2, g)
    w.requires_grad_()
    y = bank.mix(x, idx, w)
    assert y.shape == (6, 3, 5, 5)
    want = torch.stack(
        [sum(w[t, k] * bank.experts[int(idx[t, k])](x[t : t + 1])[0] for k in range(2)) for t in range(6)]
    )
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    got = torch.autograd.grad(y.square().sum(), [x, w, *bank.parameters()])
    ref = torch.autograd.grad(want.square().sum(), [x, w, *bank.parameters()])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [None, 40])  # one chunk; several chunks
def test_winners_by_rerun_equals_the_winners_of_a_differentiable_forward_all(budget):
    torch.manual_seed(0)
    bank = _module_experts(5, 6, 4).double()
    x = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)

    def choose(y):
        s = y.norm(dim=-1)
        return s.topk(2, dim=-1).indices, s

    winners, out, scores = winners_by_rerun(bank, x, choose, budget)
    all_out = bank.forward_all(x)
    ref_scores = all_out.detach().norm(dim=-1)
    ref_winners = ref_scores.topk(2, dim=-1).indices
    ref = all_out.gather(1, ref_winners.unsqueeze(-1).expand(-1, -1, 4))
    assert torch.equal(winners, ref_winners)
    torch.testing.assert_close(scores, ref_scores)
    torch.testing.assert_close(out.detach(), ref.detach())
    params = [x, *bank.parameters()]
    g = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad(out, params, g), torch.autograd.grad(ref, params, g)):
        torch.testing.assert_close(a, b)
    assert bank.forward_winners(x, choose)[0].equal(winners)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_slot_sums_into_tokens_are_the_same_bits_with_one_thread_and_several(top_k):
    """One thread sums each token's slots by ``index_add``, several by gathers: the same bits."""
    from moelab.experts.dispatch import _scatter_rows

    g = torch.Generator().manual_seed(11)
    idx, _ = random_routing(50, 6, top_k, g)
    _, _, tokens, inverse = sort_slots(idx, 6)
    rows = torch.randn(50 * top_k, 7, generator=g) * 1e3
    rows[0] = -0.0  # a token whose first slot is -0.0 sums to +0.0 from zero, as index_add does
    expected = torch.zeros(50, 7).index_add_(0, tokens, rows)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            got = _scatter_rows(rows, tokens, inverse, top_k)
            assert torch.equal(got, expected)
            assert torch.equal(got.signbit(), expected.signbit())
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("grad", [True, False])
def test_a_banks_output_is_a_new_tensor_not_a_view(grad):
    """FSDP2 warns of a unit's output that is a view (an expert bank is its own unit under expert
    parallelism x FSDP2 with more ranks than the expert mesh): the combine returns its rows as they
    are."""
    torch.manual_seed(0)
    bank = ExpertBank(4, 8, 8)
    x = torch.randn(6, 8, requires_grad=grad)
    indices = torch.tensor([[0, 1], [1, 2], [2, 3], [3, 0], [0, 2], [1, 3]])
    y = bank(x, Routing(indices, torch.rand(6, 2, requires_grad=grad)))
    assert y.shape == (6, 8) and y._base is None
