"""``aoe`` (Autonomy-of-Experts, Lv et al. 2025): the experts rank themselves by the norm of their
low-rank gate pre-activation; against a literal computation, the factorised expert, and the layer
grid."""

from __future__ import annotations

import math

import pytest
import torch

import moelab
from moelab.experts import ExpertBank
from router_grid import IMPLS_WITH_TRITON, D, H, K, N, check_compile, check_kernel, check_save_load, make


def literal_aoe_routing(x, gate_down, k):
    """Per token: ``s_e = ‖A_e x‖`` for every expert, ``P = softmax(s)``, the K experts of largest
    ``P`` in decreasing order (ties by index) with weight ``P_e`` (the authors' ``VanillaAoE``)."""
    order, weights, norms = [], [], []
    for xt in x.tolist():
        s = [
            math.sqrt(sum(sum(a * b for a, b in zip(row, xt)) ** 2 for row in a_e))
            for a_e in gate_down.tolist()
        ]
        z = sum(math.exp(v) for v in s)
        p = [math.exp(v) / z for v in s]
        idx = sorted(range(len(p)), key=lambda i: (-p[i], i))[:k]
        order.append(idx)
        weights.append([p[i] for i in idx])
        norms.append(s)
    return order, torch.tensor(weights, dtype=x.dtype), torch.tensor(norms, dtype=x.dtype)


def test_aoe_ranks_experts_by_the_norm_of_their_low_rank_gate_activation():
    layer = moelab.MoE(6, 5, 2, d_hidden=7, method="aoe", rank=3).double()
    x = torch.randn(9, 6, dtype=torch.float64)
    r = layer.router(x, layer.experts)
    order, w, norms = literal_aoe_routing(x, layer.experts.gate_down.detach(), 2)
    assert r.indices.tolist() == order
    torch.testing.assert_close(r.weights, w, rtol=1e-12, atol=0)
    torch.testing.assert_close(r.logits, norms, rtol=1e-12, atol=0)
    torch.testing.assert_close(r.probs, norms.softmax(-1), rtol=1e-12, atol=0)
    assert r.weights.sum(1).lt(1).all()  # not renormalised (the authors' code)


def test_aoe_chosen_expert_finishes_with_the_factorised_gate():
    """The expert computes ``W_out (silu(B (A x) + b_g) ⊙ (W_up x + b_up)) + b_out``: its gate
    pre-activation is the low-rank activation ``A x`` the ranking read, carried on by ``B``."""
    torch.manual_seed(0)
    bank = ExpertBank(3, 5, 4, activation="swiglu", bias=True, gate_rank=2).double()
    with torch.no_grad():
        bank.b_in.normal_()
        bank.b_out.normal_()
    x = torch.randn(6, 5, dtype=torch.float64)
    for e in range(3):
        a = x @ bank.gate_down[e].T  # (T, r): the activation the ranking read
        gate = a @ bank.gate_up[e].T + bank.b_in[e, :4]
        up = x @ bank.w_in[e].T + bank.b_in[e, 4:]
        want = (torch.nn.functional.silu(gate) * up) @ bank.w_out[e].T + bank.b_out[e]
        torch.testing.assert_close(bank.expert_forward(x, e), want)
        torch.testing.assert_close(bank.gate_low_rank(x)[:, e], a)
    plain = ExpertBank(3, 5, 4, activation="relu", gate_rank=2)  # the whole input projection is W_g
    assert plain.w_in.shape == (3, 0, 5) and plain.expert_weights.w_in.shape == (3, 4, 5)
    xf = x.float()
    want = torch.relu(xf @ (plain.gate_up[1] @ plain.gate_down[1]).T) @ plain.w_out[1].T
    torch.testing.assert_close(plain.expert_forward(xf, 1), want)


def test_aoe_preset_defaults_and_parameters():
    layer = moelab.MoE(16, 4, 2, method="aoe")
    assert layer.coefs == {"balance": 0.01}
    assert layer.router.rank == 4 and layer.experts.gate_rank == 4  # d_model // 4
    assert layer.router.renormalize is False and not layer.router.weights_sum_to_one
    assert list(layer.router.parameters()) == []  # no router: the factors are the experts'
    names = {n for n, _ in layer.named_parameters()}
    assert names == {"experts.w_in", "experts.gate_down", "experts.gate_up", "experts.w_out"}
    assert layer.experts.gate_down.shape == (4, 4, 16) and layer.experts.gate_up.shape == (4, 16, 4)
    assert moelab.MoE(2, 2, 1, method="aoe").router.rank == 1
    assert "aoe" in moelab.methods()


@pytest.mark.parametrize("k", [1, 2])
def test_aoe_task_loss_alone_reaches_the_ranking_factors(k):
    """The ranking's own parameters (``A``) learn from the task loss through the weights ``P_e``,
    at K = 1 too (not renormalised: Switch's weight)."""
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, k, method="aoe", rank=2, balance_coef=0.0)  # the task loss alone
    x = torch.randn(10, 8)
    a = layer.experts.gate_down
    (g,) = torch.autograd.grad(layer(x).pow(2).mean(), a)
    r = layer.last_routing
    chosen = set(r.indices.flatten().tolist())
    assert g.abs().sum() > 0
    unchosen = [e for e in range(4) if e not in chosen]
    for e in unchosen:  # an unchosen expert's A still learns: its norm enters the softmax
        assert g[e].abs().sum() > 0


def test_aoe_balance_loss_is_switchs_on_the_norm_softmax():
    from moelab.losses import switch_balance_loss

    layer = moelab.MoE(8, 4, 2, method="aoe", balance_coef=1.0)
    x = torch.randn(12, 8)
    layer(x)
    r = layer.last_routing
    assert layer.aux_loss.item() == pytest.approx(switch_balance_loss(r.probs, r.indices, 4).item())


def test_aoe_renormalize_and_selection_bias_options():
    layer = moelab.MoE(8, 4, 2, method="aoe", renormalize=True)
    x = torch.randn(5, 8)
    layer(x)
    r = layer.last_routing
    torch.testing.assert_close(r.weights, r.logits.gather(1, r.indices).softmax(-1))
    biased = moelab.MoE(8, 4, 2, method="aoe", selection_bias=True).eval()
    with torch.no_grad():
        biased.router.selection_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    biased(x)
    assert (biased.last_routing.indices[:, 0] == 3).all()  # the choice moves, the weights do not
    p = biased.last_routing.probs
    torch.testing.assert_close(biased.last_routing.weights[:, 0], p[:, 3])


# ------------------------------------------------------------------ refusals
@pytest.mark.parametrize(
    ("build", "match"),
    [
        (
            lambda: moelab.MoE(8, 4, 2, method="aoe", rank=0),
            r"^rank=0 is not allowed; expected a positive integer",
        ),
        (
            lambda: ExpertBank(4, 8, 8, gate_rank=0),
            r"^gate_rank=0 is not allowed; expected a positive integer",
        ),
        (
            lambda: moelab.MoE(8, 4, 2, method="aoe", renormalize="yes"),
            r"^renormalize='yes' is not allowed; expected one of \[True, False, None\]$",
        ),
        (
            lambda: moelab.MoE(8, 4, 2, method="aoe", experts=ExpertBank(4, 8, 8)),
            r"^experts of type ExpertBank are not allowed with method='aoe'; expected an ExpertBank with "
            r"gate_rank=2 \(leave experts=None and the layer builds it\)$",
        ),
        (
            lambda: ExpertBank(4, 8, 8).gate_low_rank(torch.randn(2, 8)),
            r"^gate_low_rank is not allowed on an ExpertBank with gate_rank=None; expected a bank built with "
            r"gate_rank=r \(its gate projections factorised, as method='aoe' builds it\)$",
        ),
        (
            lambda: moelab.routers.build_router("aoe", 8, 4, 2)(torch.randn(2, 8), ExpertBank(4, 8, 8)),
            r"^experts of type ExpertBank are not allowed with the aoe router; expected an ExpertBank with "
            r"gate_rank=2 \(Autonomy-of-Experts",
        ),
    ],
)
def test_aoe_refusals_are_one_line(build, match):
    with pytest.raises(ValueError, match=match) as e:
        build()
    assert "\n" not in str(e.value)


def test_aoe_set_method_refuses_full_rank_experts():
    layer = moelab.MoE(8, 4, 2)
    with pytest.raises(
        ValueError,
        match=r"^set_method\(method='aoe'\) is not allowed: Autonomy-of-Experts needs experts whose gate "
        r"projections are low-rank factors \(W_g = B A\), which full-rank experts are not; build the layer "
        r"with moelab.MoE\(..., method='aoe'\) instead$",
    ):
        moelab.set_method(layer, "aoe")
    assert layer.method == "smoe"
    aoe = moelab.MoE(8, 4, 2, method="aoe")
    with pytest.raises(
        ValueError,
        match=r"^set_method\(method='smoe'\) is not allowed on a layer of method='aoe': its experts' gate "
        r"projections are low-rank factors \(W_g = B A\) that the new method's experts are not; build a new "
        r"layer instead$",
    ):
        moelab.set_method(aoe, "smoe")
    moelab.set_method(aoe, "aoe", renormalize=True)  # its own router family: options change
    assert aoe.router.renormalize is True and aoe.experts.gate_rank == 2


def test_aoe_upcycle_refuses_in_one_line():
    dense = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    with pytest.raises(ValueError, match=r"^upcycle\(method='aoe'\) is not allowed: Autonomy-of-Experts "):
        moelab.upcycle(dense, num_experts=4, top_k=2, method="aoe")


def test_aoe_expert_parallelism_refuses_the_factorised_bank():
    from moelab.train.parallelize import ExpertParallel

    bank = moelab.MoE(8, 4, 2, method="aoe").experts
    with pytest.raises(
        ValueError,
        match=r"^an ExpertBank with gate_rank=2 \(method='aoe' or 'routing-free'\) is not allowed with expert parallelism; expected "
        r"full-rank gate projections \(sharding factorised gates is not implemented\)$",
    ):
        ExpertParallel()._apply(bank, None)  # refused before the mesh is read


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS_WITH_TRITON)
def test_aoe_every_kernel_gives_the_literal_output_and_gradients(impl):
    check_kernel("aoe", impl)


def test_aoe_compiles_as_one_graph_and_equals_eager():
    check_compile("aoe")


def test_aoe_survives_save_and_load(tmp_path):
    back = check_save_load("aoe", tmp_path, rank=3)
    assert back.experts.gate_rank == 3 and back.router.rank == 3


def test_aoe_from_hf_and_to_hf_refuse_in_one_line():
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=D, intermediate_size=H, num_local_experts=N, num_experts_per_tok=K)
    with pytest.raises(
        ValueError, match=r"^from_hf\(method='aoe'\) is not allowed: Autonomy-of-Experts "
    ) as e:
        moelab.from_hf(MixtralSparseMoeBlock(cfg), method="aoe")
    assert "\n" not in str(e.value)
    with pytest.raises(
        ValueError, match=r"^the layer \(method='aoe'\) cannot go back to transformers: "
    ) as e:
        moelab.to_hf(make("aoe"))
    assert "\n" not in str(e.value) and "moelab.save" in str(e.value)
