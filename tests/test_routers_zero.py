"""``moepp`` (MoE++, Jin et al. 2025): zero, copy and constant experts beside the FFN experts, against a
literal transcription of the authors' layer; the skipped compute; the heterogeneous balance loss; and
the layer grid."""

from __future__ import annotations

import pytest
import torch

import moelab
from router_grid import IMPLS_WITH_SLOW_TRITON, check_compile, check_hf_refusal, check_kernel, check_save_load


def literal_moepp(layer, x):
    """The authors' ``gating`` and ``MOELayer`` token by token: softmax over the N + Z experts of the
    two-layer gate, top-K, a zero expert's gate 0, renormalised; FFN experts, then the constant
    (``a₁ x + a₂ v``, ``a = softmax(W_c x)``), copy and zero experts, in that order."""
    r = layer.router
    n, c, p = r.num_experts, r.num_constant, r.num_copy
    out = []
    for xt in x:
        logits = r.weight2 @ torch.tanh(r.weight @ xt)
        probs = logits.softmax(-1)
        order = sorted(range(len(probs)), key=lambda i: -float(probs[i]))[: r.top_k]
        gates = [0.0 * probs[i] if i >= n + c + p else probs[i] for i in order]
        total = sum(gates)
        y = torch.zeros_like(xt)
        for i, g in zip(order, gates):
            w = g / total
            if i < n:
                y = y + w * layer.experts.expert_forward(xt[None], i)[0]
            elif i < n + c:
                a = (r.constant_gate[i - n] @ xt).softmax(-1)
                y = y + w * (a[0] * xt + a[1] * r.constants[i - n])
            elif i < n + c + p:
                y = y + w * xt
        out.append(y)
    return torch.stack(out)


def test_moepp_equals_the_authors_layer_and_runs_only_the_ffn_slots_in_the_bank(monkeypatch):
    torch.manual_seed(0)
    layer = moelab.MoE(6, 3, 2, d_hidden=5, method="moepp", activation="swiglu").double()
    with torch.no_grad():
        layer.router.weight2.mul_(20)  # spread the scores so that every kind of expert is chosen
    x = torch.randn(40, 6, dtype=torch.float64)
    rows = []
    mix = layer.experts.mix
    monkeypatch.setattr(layer.experts, "mix", lambda xs, i, w: rows.append(len(xs)) or mix(xs, i, w))
    y = layer(x)
    torch.testing.assert_close(y, literal_moepp(layer, x))
    r = layer.last_routing
    kinds = layer.router.expert_kinds()
    chosen = {kinds[i] for i in r.indices.reshape(-1).tolist()}
    assert chosen == {"ffn", "constant", "copy", "zero"}
    assert rows == [int((r.indices < 3).sum())]  # the bank saw the FFN slots only
    assert r.mask.tolist() == (r.indices < 3).tolist()


def test_moepp_gradients_reach_the_gate_the_constants_and_the_experts():
    torch.manual_seed(0)
    layer = moelab.MoE(6, 3, 2, d_hidden=5, method="moepp").double()
    with torch.no_grad():
        layer.router.weight2.mul_(20)
    x = torch.randn(30, 6, dtype=torch.float64, requires_grad=True)
    (layer(x).square().mean() + layer.aux_loss).backward()
    twin_x = x.detach().clone().requires_grad_()
    for p in layer.parameters():
        p.grad = None
    literal_moepp(layer, twin_x).square().mean().backward()
    for name, p in layer.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_moepp_heterogeneous_balance_loss_weighs_the_zero_computation_experts_by_tau():
    layer = moelab.MoE(6, 3, 2, method="moepp", tau=0.5).double()
    x = torch.randn(25, 6, dtype=torch.float64)
    layer(x)
    r = layer.last_routing
    m = 7
    counts = [r.indices.reshape(-1).tolist().count(i) for i in range(m)]
    f = [c / (25 * 2) for c in counts]
    p = r.probs.mean(0).tolist()
    eta = [1.0] * 3 + [0.5] * 4
    expected = m * sum(e * a * b for e, a, b in zip(eta, f, p))
    assert r.losses["balance"].item() == pytest.approx(expected, rel=1e-10)
    assert layer.aux_loss.item() == pytest.approx(0.01 * expected, rel=1e-10)


def test_moepp_defaults_follow_the_authors_code():
    layer = moelab.MoE(8, 4, 2, method="moepp")
    r = layer.router
    assert (r.num_zero, r.num_copy, r.num_constant, r.tau, r.two_layer_gate) == (1, 1, 2, 0.75, True)
    assert r.expert_kinds() == ["ffn"] * 4 + ["constant", "constant", "copy", "zero"]
    assert r.weight.shape == (64, 8) and r.weight2.shape == (8, 64)  # Linear(d, 8M) → tanh → Linear(8M, M)
    assert layer.coefs == {"balance": 0.01}
    assert moelab.MoE(8, 4, 2, method="moepp", two_layer_gate=False).router.weight.shape == (8, 8)


def test_moepp_a_token_whose_choices_are_all_zero_experts_outputs_zero():
    layer = moelab.MoE(4, 2, 1, method="moepp", num_zero=1, num_copy=0, num_constant=0, two_layer_gate=False)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2, 0] = 10.0  # the zero expert wins whenever x₀ > 0
    x = torch.tensor([[1.0, 0.5, -0.2, 0.3], [-1.0, 0.5, -0.2, 0.3]])
    y = layer(x)
    assert layer.last_routing.indices[0].tolist() == [2]
    assert torch.equal(y[0], torch.zeros(4)) and torch.isfinite(y).all()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"num_zero": -1}, r"^num_zero=-1 is not allowed; expected an integer in \[0, "),
        ({"num_constant": 1.5}, r"^num_constant=1.5 is not allowed; expected an integer in \[0, "),
        ({"tau": -0.1}, r"^tau=-0.1 is not allowed; expected a number >= 0$"),
        ({"init_std": 0.0}, r"^init_std=0.0 is not allowed; expected a number > 0$"),
    ],
)
def test_moepp_options_are_validated(options, match):
    with pytest.raises(ValueError, match=match):
        moelab.MoE(8, 4, 2, method="moepp", **options)


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS_WITH_SLOW_TRITON)
def test_moepp_every_kernel_gives_the_literal_output_and_gradients(impl):
    check_kernel("moepp", impl)


def test_moepp_compiles_as_one_graph_and_equals_eager():
    check_compile("moepp")


def test_moepp_survives_save_and_load(tmp_path):
    back = check_save_load("moepp", tmp_path, num_constant=1, tau=0.25)
    assert back.router.num_constant == 1 and back.router.tau == 0.25


def test_moepp_from_hf_runs_and_to_hf_refuses_in_one_line():
    check_hf_refusal("moepp")


def test_moepp_at_k1_weighs_by_the_probability_so_the_task_loss_reaches_the_gate():
    layer = moelab.MoE(6, 3, 1, method="moepp")
    assert not layer.router.renormalize and moelab.MoE(6, 3, 2, method="moepp").router.renormalize
    x = torch.randn(20, 6)
    layer(x).square().mean().backward()
    r = layer.last_routing
    expected = r.probs.gather(1, r.indices).masked_fill(r.indices == 6, 0.0)  # the zero expert's weight 0
    torch.testing.assert_close(r.weights, expected)
    assert layer.router.weight.grad.abs().sum() > 0 and layer.router.weight2.grad.abs().sum() > 0
    forced = moelab.MoE(6, 3, 1, method="moepp", renormalize=True)
    forced(x)
    w = forced.last_routing.weights
    assert torch.equal(w[w > 0], torch.ones_like(w[w > 0]))  # renormalised at K = 1: the constant 1
