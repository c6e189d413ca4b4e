import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import moelab
from moelab import metrics

D, N, K, T = 10, 5, 2, 16


def stack(method, layers=2, seed=0, **options):
    torch.manual_seed(seed)
    return nn.Sequential(
        *[
            moelab.MoE(D, N, K, method=method, impl="loop", record_routing=True, **options)
            for _ in range(layers)
        ]
    )


def layer_inputs(model, x):
    """Independent: the input of each layer of a Sequential stack."""
    inputs = []
    with torch.no_grad():
        for layer in model:
            inputs.append(x)
            x = layer(x)
    return inputs


def all_outputs(bank, x):
    return torch.stack([bank.expert_forward(x, e) for e in range(bank.num_experts)], dim=1)


# ---------------------------------------------------------------- hand-made routings
def test_routing_entropy_hand_made():
    probs = torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]])
    assert torch.allclose(metrics.routing_entropy(probs), torch.tensor(math.log(4) / 2))
    assert torch.allclose(metrics.routing_entropy(probs, base=2), torch.tensor(1.0))
    with pytest.raises(ValueError, match=r"probs of shape \(4,\) is not allowed; expected \(T, N\)"):
        metrics.routing_entropy(probs[0])


def test_topk_overlap_hand_made():
    a = torch.tensor([[0, 1], [2, 3], [4, 0]])
    b = torch.tensor([[1, 0], [3, 4], [1, 2]])
    assert metrics.topk_overlap(a, b).item() == pytest.approx((2 + 1 + 0) / 3)
    with pytest.raises(ValueError, match=r"indices of shapes \(3, 2\) and \(2, 2\) are not allowed"):
        metrics.topk_overlap(a, b[:2])


def test_assignment_change_rate_hand_made():
    a = torch.tensor([[0, 1], [2, 3]])
    b = torch.tensor([[1, 0], [2, 4]])  # order swap is no change; one slot differs
    assert metrics.assignment_change_rate(a, b) == pytest.approx(1 / 4)
    assert metrics.assignment_change_rate([a, a], [b, a]) == pytest.approx(1 / 8)
    with pytest.raises(ValueError, match=r"got 2 and 1 layers; expected the same number"):
        metrics.assignment_change_rate([a, a], [b])
    with pytest.raises(ValueError, match=r"expected the same \(T, K\)"):
        metrics.assignment_change_rate(a, b[:1])


# ---------------------------------------------------------------- on models
def test_router_entropy_per_layer_matches_independent_computation():
    model = stack("smoe")
    x = torch.randn(T, D)
    expected = []
    for layer, xi in zip(model, layer_inputs(model, x)):
        p = F.linear(xi, layer.router.weight).softmax(-1)
        expected.append(-(p * p.log()).sum(-1).mean().item())
    got = metrics.router_entropy(model, [x[:7], x[7:]])
    assert got == pytest.approx(expected, rel=1e-5)
    assert model.training  # restored


def test_router_entropy_is_none_without_router_distribution():
    assert metrics.router_entropy(stack("competition", layers=1), [torch.randn(T, D)]) == [None]


def test_competition_overlap_matches_independent_topk():
    model = stack("smoe")
    x = torch.randn(T, D)
    expected = []
    with torch.no_grad():
        for layer, xi in zip(model, layer_inputs(model, x)):
            router = F.linear(xi, layer.router.weight).topk(K, -1).indices
            comp = F.softplus(all_outputs(layer.experts, xi)).mean(-1).topk(K, -1).indices
            expected.append(sum(len(set(r.tolist()) & set(c.tolist())) for r, c in zip(router, comp)) / T)
    assert metrics.competition_overlap(model, [x]) == pytest.approx(expected)
    # pure competition agrees with itself
    assert metrics.competition_overlap(stack("competition"), [x]) == [K, K]


def test_expert_change_rate_between_checkpoints():
    a = stack("smoe", seed=0)
    b = stack("smoe", seed=0)
    x = torch.randn(T, D)
    assert metrics.expert_change_rate(a, b, [x]) == 0.0
    with torch.no_grad():
        b[0].router.weight.add_(torch.randn(N, D))
    with torch.no_grad():
        a(x)
        ia = [layer.last_routing.indices for layer in a]
        b(x)
        ib = [layer.last_routing.indices for layer in b]
    expected = metrics.assignment_change_rate(ia, ib)
    assert expected > 0
    assert metrics.expert_change_rate(a, b, [x[:5], x[5:]]) == pytest.approx(expected)
    with pytest.raises(ValueError, match=r"the models have 2 and 1 MoE layers"):
        metrics.expert_change_rate(a, stack("smoe", layers=1), [x])


def test_expert_output_norms():
    model = stack("competesmoe")
    x = torch.randn(T, D)
    expected = torch.stack(
        [
            all_outputs(layer.experts, xi).norm(dim=-1).mean(0)
            for layer, xi in zip(model, layer_inputs(model.eval(), x))
        ]
    )
    model.train()
    got = metrics.expert_output_norms(model, [x[:4], x[4:]])
    assert got.shape == (2, N)
    assert torch.allclose(got, expected, atol=1e-5)


def test_metrics_refuse_models_without_moe_layers():
    with pytest.raises(ValueError, match=r"model of type Linear has no moelab.MoE layer"):
        metrics.router_entropy(nn.Linear(3, 3), [torch.randn(2, 3)])


# ---------------------------------------------------------------- top-(K+1) swap
def test_swap_top1_smoe_uses_ranks_2_to_k_plus_1():
    model = stack("smoe", layers=1).eval()
    layer = model[0]
    router = layer.router
    x = torch.randn(T, D)
    with torch.no_grad():
        normal = model(x)
        with metrics.swap_top1(model):
            assert isinstance(layer.router, metrics.SwappedRouter) and layer.router.router is router
            swapped = model(x)
            idx = layer.last_routing.indices
        h = F.linear(x, layer.router.weight)
        top, order = h.topk(K + 1, -1)
        w = top[:, 1:].softmax(-1)
        out = all_outputs(layer.experts, x).gather(1, order[:, 1:].unsqueeze(-1).expand(-1, -1, D))
    assert torch.equal(idx, order[:, 1:])
    assert torch.allclose(swapped, (w.unsqueeze(-1) * out).sum(1), atol=1e-5)
    assert layer.router is router and layer.router.top_k == K
    with torch.no_grad():
        assert torch.equal(model(x), normal)


def test_swap_top1_sigma_moe_keeps_raw_scores():
    model = stack("sigma-moe", layers=1).eval()
    layer = model[0]
    x = torch.randn(T, D)
    with torch.no_grad(), metrics.swap_top1(model):
        model(x)
    s = torch.sigmoid(F.linear(x, layer.router.weight))
    top, order = s.topk(K + 1, -1)
    assert torch.equal(layer.last_routing.indices, order[:, 1:])
    assert torch.allclose(layer.last_routing.weights, top[:, 1:])


def test_swap_top1_competesmoe_and_competition():
    for method in ("competesmoe", "competition"):
        model = stack(method, layers=1).eval()
        x = torch.randn(T, D)
        with torch.no_grad(), metrics.swap_top1(model):
            y = model(x)
        assert y.shape == (T, D) and model[0].last_routing.indices.shape == (T, K)
        assert model[0].router.top_k == K
    layer = model[0]
    with torch.no_grad():
        s = F.softplus(all_outputs(layer.experts, x)).mean(-1)
    assert torch.equal(layer.last_routing.indices, s.topk(K + 1, -1).indices[:, 1:])


def test_swap_top1_needs_a_spare_expert():
    model = nn.Sequential(moelab.MoE(D, 3, 3))
    router = model[0].router
    with pytest.raises(ValueError, match=r"swap_top1 needs top_k < num_experts; got top_k=3, num_experts=3"):
        with metrics.swap_top1(model):
            model(torch.randn(2, D))
    assert model[0].router is router and router.top_k == 3


def test_swap_top1_puts_every_router_back_when_the_block_raises():
    model = stack("competesmoe", layers=2).eval()
    routers = [layer.router for layer in model]
    with pytest.raises(RuntimeError, match="inside"):
        with metrics.swap_top1(model):
            assert all(isinstance(layer.router, metrics.SwappedRouter) for layer in model)
            assert all(r.top_k == K + 1 and r.base.top_k == K + 1 for r in routers)
            raise RuntimeError("inside")
    assert [layer.router for layer in model] == routers
    assert all(r.top_k == K and r.base.top_k == K for r in routers)


def test_swap_top1_does_not_nest():
    model = stack("smoe", layers=1).eval()
    router = model[0].router
    with metrics.swap_top1(model):
        with pytest.raises(
            ValueError, match=r"^swap_top1 is already active on MoE layer 0; it does not nest$"
        ):
            with metrics.swap_top1(model, 1):
                pass
    assert model[0].router is router


# ---------------------------------------------------------------- the cheap per-step summary
def test_routing_summary_matches_direct_computation_of_the_last_forward():
    model = stack("smoe")
    x = torch.randn(T, D)
    model(x)
    ents, cvs, vios = [], [], []
    for layer, xi in zip(model, layer_inputs(model, x)):
        p = F.linear(xi, layer.router.weight).softmax(-1)
        ents.append(-(p * p.log()).sum(-1).mean().item())
        load = torch.bincount(p.topk(K, -1).indices.reshape(-1), minlength=N).double()
        cvs.append((load.std(unbiased=False) / load.mean()).item())
        vios.append(max(load.tolist()) / (sum(load.tolist()) / N) - 1)
    got = metrics.routing_summary(model)
    assert got["router_entropy"] == pytest.approx(sum(ents) / 2, rel=1e-5)
    assert got["load_cv"] == pytest.approx(sum(cvs) / 2, rel=1e-9)
    assert got["max_vio"] == pytest.approx(sum(vios) / 2, rel=1e-9)
    assert got["competition_overlap"] is None  # no layer competed


def test_routing_summary_overlap_is_router_topk_against_the_winners_on_competition_steps():
    model = stack("competesmoe", layers=1)

    class Always:
        def active(self, layer, step):
            return True

    ctx = moelab.RoutingContext(schedule=Always())  # competes at every step
    moelab.attach(model, ctx)
    x = torch.randn(T, D)
    model(x)
    layer = model[0]
    with torch.no_grad():
        router = layer.router.base(x, layer.experts).probs.topk(K, -1).indices
        winners = F.softplus(all_outputs(layer.experts, x)).mean(-1).topk(K, -1).indices
    expected = sum(len(set(r.tolist()) & set(w.tolist())) for r, w in zip(router, winners)) / T
    assert metrics.routing_summary(model)["competition_overlap"] == pytest.approx(expected)
    model.eval()  # evaluation never competes
    model(x)
    assert metrics.routing_summary(model)["competition_overlap"] is None


def test_load_cv_and_routing_summary_report_the_fraction_a_capacity_dropped():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        moelab.MoE(D, N, K, capacity_factor=0.5),
        moelab.MoE(D, N, K),
        moelab.MoE(D, N, K, capacity_factor=8.0),
    )
    x = torch.randn(T, D)
    model(x)
    summary = metrics.routing_summary(model)
    assert summary["dropped"] == pytest.approx((model[0].dropped_fraction + 0.0) / 2)
    assert model[0].dropped_fraction > 0 and model[2].dropped_fraction == 0.0
    loads = metrics.load_cv(model, [x])
    assert loads[0]["dropped"] == pytest.approx(model[0].dropped_fraction)
    assert "dropped" not in loads[1] and loads[2]["dropped"] == 0.0
    assert "dropped" not in metrics.routing_summary(model[1])


def test_max_violation_is_the_most_loaded_experts_excess_over_the_mean():
    assert metrics.max_violation(torch.tensor([2.0, 2.0, 2.0, 2.0])) == 0.0
    assert metrics.max_violation(torch.tensor([8.0, 0.0, 0.0, 0.0])) == pytest.approx(3.0)  # N - 1
    assert metrics.max_violation(torch.tensor([3, 1, 1, 1])) == pytest.approx(3 / 1.5 - 1)
    assert metrics.max_violation(torch.zeros(4)) == 0.0
