"""ExpertBank and MLP: the bank's forward equals the literal per-token sum for every
implementation; forward_all, expert_forward, forward_winners; layout, init and bad input."""

from __future__ import annotations

import pytest
import torch

import moelab
from experts_helpers import ACTS, IMPLS, random_routing, reference
from moelab.experts import MLP, ExpertBank

# sizes are multiples of 4 so that the grouped implementation runs on them too
CASES = [
    # T, N, K, d, h
    (1, 4, 2, 8, 4),  # a single token
    (1, 3, 3, 4, 8),  # T=1, K=N
    (9, 5, 5, 8, 8),  # K=N
    (13, 6, 2, 12, 8),
    (32, 8, 1, 4, 12),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("case", CASES)
def test_dispatch_equals_weighted_sum_of_expert_forward(impl, act, bias, case):
    t, n, k, d, h = case
    g = torch.Generator().manual_seed(t * 100 + n * 10 + k)
    bank = ExpertBank(n, d, h, activation=act, bias=bias, impl=impl)
    if bias:  # zero-initialised biases would not test anything
        with torch.no_grad():
            bank.b_in.normal_()
            bank.b_out.normal_()
    x = torch.randn(t, d, generator=g)
    idx, w = random_routing(t, n, k, g)
    torch.testing.assert_close(bank.mix(x, idx, w), reference(bank, x, idx, w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", ["loop", "auto"])
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("seed", range(4))
def test_dispatch_equals_weighted_sum_on_random_odd_shapes(impl, act, seed):
    g = torch.Generator().manual_seed(1000 + seed)
    t, n, d, h = (int(v) for v in torch.randint(1, 12, (4,), generator=g))
    k = int(torch.randint(1, n + 1, (1,), generator=g))
    bank = ExpertBank(n, d, h, activation=act, bias=seed % 2 == 1, impl=impl)
    x = torch.randn(t, d, generator=g)
    idx, w = random_routing(t, n, k, g)
    torch.testing.assert_close(bank.mix(x, idx, w), reference(bank, x, idx, w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("impl", IMPLS)
def test_dispatch_skips_experts_with_no_tokens(impl):
    g = torch.Generator().manual_seed(1)
    bank = ExpertBank(8, 8, 8, activation="swiglu", bias=True, impl=impl)
    with torch.no_grad():
        bank.b_in.normal_()
        bank.b_out.normal_()
    x = torch.randn(10, 8, generator=g, requires_grad=True)
    idx, w = random_routing(10, 8, 2, g, experts=[1, 4, 6])  # experts 0, 2, 3, 5, 7 idle
    y = bank.mix(x, idx, w)
    torch.testing.assert_close(y, reference(bank, x, idx, w), rtol=1e-5, atol=1e-6)
    y.sum().backward()
    idle = [0, 2, 3, 5, 7]
    assert bank.w_in.grad[idle].abs().sum() == 0
    assert bank.w_out.grad[idle].abs().sum() == 0
    assert bank.w_in.grad[[1, 4, 6]].abs().sum() > 0


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bias", [False, True])
def test_forward_all_stacks_expert_forward(act, bias):
    bank = ExpertBank(5, 6, 7, activation=act, bias=bias, chunk_elements=40)  # forces several chunks
    if bias:
        with torch.no_grad():
            bank.b_in.normal_()
            bank.b_out.normal_()
    x = torch.randn(9, 6)
    expected = torch.stack([bank.expert_forward(x, e) for e in range(5)], dim=1)
    out = bank.forward_all(x)
    assert out.shape == (9, 5, 6)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


def test_expert_forward_is_the_mlp_formula():
    bank = ExpertBank(3, 4, 5, activation="swiglu", bias=True)
    with torch.no_grad():
        bank.b_in.normal_()
        bank.b_out.normal_()
    x = torch.randn(2, 4)
    h = x @ bank.w_in[1].T + bank.b_in[1]
    gate, up = h[:, :5], h[:, 5:]
    expected = (torch.nn.functional.silu(gate) * up) @ bank.w_out[1].T + bank.b_out[1]
    torch.testing.assert_close(bank.expert_forward(x, 1), expected)


def test_expert_bank_weight_layout_and_init_bounds():
    bank = ExpertBank(4, 16, 32, activation="swiglu", bias=True)
    assert bank.w_in.shape == (4, 64, 16)
    assert bank.w_out.shape == (4, 16, 32)
    assert bank.w_in.abs().max() <= 16**-0.5
    assert bank.w_out.abs().max() <= 32**-0.5
    assert bank.b_in.abs().sum() == 0 and bank.b_out.abs().sum() == 0
    plain = ExpertBank(4, 16, 32, activation="relu")
    assert plain.w_in.shape == (4, 32, 16) and plain.b_in is None


@pytest.mark.parametrize("activation", ["relu", "gelu", "silu", "swiglu"])
def test_forward_winners_matches_autograd_through_forward_all_without_rerunning_experts(activation):
    torch.manual_seed(0)
    bank = ExpertBank(5, 6, 8, activation=activation, bias=True).double()
    for b in (bank.b_in, bank.b_out):
        torch.nn.init.normal_(b)
    x = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)

    def choose(y):
        s = y.norm(dim=-1)
        return s.topk(2, dim=-1).indices, s

    winners, out, scores = bank.forward_winners(x, choose)
    params = [x, bank.w_in, bank.w_out, bank.b_in, bank.b_out]
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, params, g)
    all_out = bank.forward_all(x)  # the literal: gather the winners from a differentiable pass
    ref_winners = all_out.detach().norm(dim=-1).topk(2, dim=-1).indices
    ref = all_out.gather(1, ref_winners.unsqueeze(-1).expand(-1, -1, 6))
    want = torch.autograd.grad(ref, params, g)
    assert torch.equal(winners, ref_winners)
    torch.testing.assert_close(out.detach(), ref.detach())
    torch.testing.assert_close(scores, all_out.detach().norm(dim=-1))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_mlp_is_dense_two_layer_ffn():
    mlp = MLP(4, 6, activation="gelu", bias=True)
    x = torch.randn(3, 4)
    expected = torch.nn.functional.gelu(x @ mlp.fc_in.weight.T + mlp.fc_in.bias) @ mlp.fc_out.weight.T
    torch.testing.assert_close(mlp(x), expected + mlp.fc_out.bias)


@pytest.mark.parametrize("impl", IMPLS)
def test_dispatch_of_zero_tokens_is_empty(impl):
    bank = ExpertBank(4, 8, 8, activation="swiglu", impl=impl)
    out = bank.mix(torch.randn(0, 8), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert out.shape == (0, 8)


# ---------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_experts": 0}, r"num_experts=0 is not allowed; expected a positive integer"),
        ({"d_model": -2}, r"d_model=-2 is not allowed; expected a positive integer"),
        ({"d_hidden": 0}, r"d_hidden=0 is not allowed; expected a positive integer"),
        (
            {"activation": "tanh"},
            r"activation='tanh' is not allowed; expected one of \[.*'gelu', .*'swiglu', 'swiglu_clamp'\]",
        ),
        (
            {"impl": "fast"},
            r"impl='fast' is not allowed; expected one of \['auto', 'loop', 'grouped', 'stream', 'triton'\]",
        ),
        ({"chunk_elements": 0}, r"chunk_elements=0 is not allowed"),
    ],
)
def test_expert_bank_rejects_bad_arguments(kwargs, match):
    args = {"num_experts": 4, "d_model": 8, "d_hidden": 8, **kwargs}
    with pytest.raises(ValueError, match=match):
        ExpertBank(**args)


def test_the_layer_rejects_experts_that_are_not_an_expert_bank():
    with pytest.raises(ValueError, match=r"experts of type Linear is not allowed; expected an expert bank"):
        moelab.MoE(6, 4, 2, experts=torch.nn.Linear(6, 6))


def test_a_bank_called_the_former_way_is_refused_naming_mix():
    """``experts(x, routing)`` is the protocol; ``bank(x, indices, weights)`` (the former call) and a
    non-routing second argument are refused in one line that names ``mix``."""
    bank = ExpertBank(4, 8, 16)
    x = torch.randn(3, 8)
    idx, w = torch.tensor([[0, 1], [2, 3], [1, 0]]), torch.full((3, 2), 0.5)
    for args in ((x, idx, w), (x, idx)):
        with pytest.raises(
            ValueError, match=r"^ExpertBank\(x, routing\) takes a moelab.Routing.*bank.mix\(x, indices"
        ):
            bank(*args)
    torch.testing.assert_close(bank(x, moelab.Routing(idx, w)), bank.mix(x, idx, w), rtol=0, atol=0)


def test_a_bank_of_the_former_protocol_is_refused_by_the_layer_naming_what_it_lacks():
    class Former(torch.nn.Module):  # forward(x, indices, weights), no mix
        num_experts, d_model = 4, 8

        def forward(self, x, indices, weights):
            return x

        def expert_forward(self, x, e):
            return x

        def forward_all(self, x):
            return x.unsqueeze(1).expand(-1, 4, -1)

        def forward_winners(self, x, choose):
            raise NotImplementedError

    with pytest.raises(ValueError, match=r"^experts of type Former is not allowed; .*mix.*SparseExperts"):
        moelab.MoE(8, 4, 2, experts=Former())
