"""Each router against an independent, literal computation of its formula."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import moelab
from moelab.methods import get_method
from moelab.routers import ROUTERS, build_router, router_options
from moelab.routing import RoutingContext


def literal_topk_softmax(logits, k):
    """Per token: the K largest logits in decreasing order and the softmax over them."""
    idx, w = [], []
    for row in logits.tolist():
        order = sorted(range(len(row)), key=lambda i: -row[i])[:k]
        z = sum(math.exp(row[i]) for i in order)
        idx.append(order)
        w.append([math.exp(row[i]) / z for i in order])
    return torch.tensor(idx), torch.tensor(w, dtype=logits.dtype)


def literal_cosine(u, e, tau):
    out = torch.empty(u.shape[0], e.shape[0], dtype=u.dtype)
    for t in range(u.shape[0]):
        for i in range(e.shape[0]):
            dot = sum(a * b for a, b in zip(u[t].tolist(), e[i].tolist()))
            nu = math.sqrt(sum(a * a for a in u[t].tolist()))
            ne = math.sqrt(sum(a * a for a in e[i].tolist()))
            out[t, i] = dot / ((nu + tau) * (ne + tau))
    return out


def check_routing(routing, logits, k):
    idx, w = literal_topk_softmax(logits, k)
    assert routing.indices.tolist() == idx.tolist()
    torch.testing.assert_close(routing.weights, w)
    torch.testing.assert_close(routing.probs, logits.softmax(-1))


# ------------------------------------------------------------------------------------------ smoe
def test_smoe_router_is_topk_softmax_of_linear_logits():
    router = build_router("topk", 6, 5, 2).double()
    x = torch.randn(7, 6, dtype=torch.float64)
    logits = torch.tensor(
        [[sum(a * b for a, b in zip(xt, wi)) for wi in router.weight.tolist()] for xt in x.tolist()],
        dtype=torch.float64,
    )
    r = router(x)
    torch.testing.assert_close(r.logits, logits)
    check_routing(r, logits, 2)


def test_smoe_router_init_std_defaults_to_inverse_sqrt_d():
    router = build_router("topk", 400, 64, 2)
    assert router.weight.std().item() == pytest.approx(400**-0.5, rel=0.05)
    router = build_router("topk", 400, 64, 2, init_std=0.02)
    assert router.weight.std().item() == pytest.approx(0.02, rel=0.05)


def test_smoe_fixed_router_weight_is_frozen_through_an_optimizer_step():
    layer = moelab.MoE(8, 4, 2, method="smoe-fixed")
    before = layer.router.weight.detach().clone()
    assert not layer.router.weight.requires_grad
    layer.requires_grad_(True)  # a buffer: cannot be unfrozen by accident
    assert "router.weight" not in dict(layer.named_parameters())
    opt = torch.optim.AdamW([p for p in layer.parameters() if p.requires_grad], lr=0.1)
    (layer(torch.randn(10, 8)).square().sum() + moelab.aux_loss(layer)).backward()
    assert layer.router.weight.grad is None
    assert layer.experts.w_in.grad is not None
    opt.step()
    assert torch.equal(layer.router.weight, before)


def test_smoe_router_weight_trains():
    layer = moelab.MoE(8, 4, 2, method="smoe")
    layer(torch.randn(10, 8)).square().sum().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(("top_k", "n", "total"), [(2, 8, 10), (1, 4, 7), (3, 3, 5)])
def test_smoe_dropout_k_grows_linearly_from_top_k_to_n(top_k, n, total):
    layer = moelab.MoE(6, n, top_k, method="smoe-dropout")
    ctx = RoutingContext(step=0, total_steps=total)
    moelab.attach(layer, ctx)
    x = torch.randn(5, 6)
    seen = []
    for step in range(total + 3):
        ctx.step = step
        layer(x)
        k = layer.last_routing.indices.shape[1]
        expected = top_k + round((n - top_k) * min(step / total, 1.0))
        assert k == expected
        seen.append(k)
        logits = layer.last_routing.logits
        check_routing(layer.last_routing, logits, k)
    assert seen[0] == top_k and seen[-1] == n
    assert seen == sorted(seen)
    assert not layer.router.weight.requires_grad  # the SMoE-Dropout router is frozen


def test_smoe_dropout_without_context_keeps_top_k():
    layer = moelab.MoE(6, 8, 2, method="smoe-dropout")
    layer(torch.randn(5, 6))
    assert layer.last_routing.indices.shape[1] == 2


def test_smoe_dropout_k_max_option_caps_growth():
    router = build_router("topk", 6, 8, 2, k_max=4)
    assert router.current_k(RoutingContext(step=10, total_steps=10)) == 4
    assert router.current_k(RoutingContext(step=5, total_steps=10)) == 3


# ------------------------------------------------------------------------------------ xmoe / pcosine
def test_xmoe_logits_are_cosine_of_projection_over_temperature():
    router = build_router("cosine", 6, 8, 2, temperature=0.3).double()
    assert router.proj.out_features == 4  # d_e = N / 2
    x = torch.randn(5, 6, dtype=torch.float64)
    u = x @ router.proj.weight.T
    logits = literal_cosine(u, router.embeddings.detach(), 0.0) / 0.3
    r = router(x)
    torch.testing.assert_close(r.logits, logits)
    check_routing(r, logits, 2)


def test_xmoe_temperature_is_learned_by_default_as_the_competesmoe_2024_baseline():
    layer = moelab.MoE(6, 4, 2, method="xmoe", temperature=0.5)
    assert isinstance(layer.router.temperature, torch.nn.Parameter)
    layer(torch.randn(5, 6)).square().sum().backward()
    assert layer.router.temperature.grad is not None and layer.router.temperature.grad != 0
    fixed = moelab.MoE(6, 4, 2, method="xmoe", learn_temperature=False)
    assert not isinstance(fixed.router.temperature, torch.nn.Parameter)


def test_xmoe_embeddings_are_orthogonal_with_gain():
    router = build_router("cosine", 16, 4, 2, proj_dim=8, init_gain=0.32)
    gram = router.embeddings @ router.embeddings.T
    torch.testing.assert_close(gram, 0.32**2 * torch.eye(4), atol=1e-6, rtol=0)


def test_pcosine_with_zero_perturbation_equals_xmoe():
    x = torch.randn(3, 5, 8)
    xmoe = moelab.MoE(8, 6, 2, method="xmoe")
    pcos = moelab.MoE(8, 6, 2, method="pcosine", perturbation=0.0)
    pcos.load_state_dict(xmoe.state_dict())
    torch.testing.assert_close(pcos(x), xmoe(x), rtol=0, atol=0)
    assert torch.equal(pcos.last_routing.indices, xmoe.last_routing.indices)


@pytest.mark.parametrize("tau", [0.1, 0.5])
def test_pcosine_logits_follow_the_perturbed_cosine_formula(tau):
    layer = moelab.MoE(6, 8, 2, method="pcosine", perturbation=tau).double()
    router = layer.router
    x = torch.randn(5, 6, dtype=torch.float64)
    u = x @ router.proj.weight.T
    logits = literal_cosine(u, router.embeddings.detach(), tau) / 0.3
    r = router(x)
    torch.testing.assert_close(r.logits, logits)
    check_routing(r, logits, 2)


def test_pcosine_preset_uses_positive_perturbation():
    assert moelab.MoE(6, 4, 2, method="pcosine").router.perturbation == pytest.approx(0.1)
    assert moelab.MoE(6, 4, 2, method="xmoe").router.perturbation == 0.0


# ------------------------------------------------------------------------------------------ sigma-moe
def test_sigma_moe_weights_are_sigmoid_scores_not_renormalised():
    layer = moelab.MoE(6, 8, 3, method="sigma-moe").double().eval()
    x = torch.randn(9, 6, dtype=torch.float64)
    r = layer.router(x)
    logits = x @ layer.router.weight.T
    for t in range(9):
        scores = [1 / (1 + math.exp(-v)) for v in logits[t].tolist()]
        order = sorted(range(8), key=lambda i: -scores[i])[:3]
        assert sorted(r.indices[t].tolist()) == sorted(order)
        for k in range(3):
            assert r.weights[t, k].item() == pytest.approx(scores[r.indices[t, k].item()], rel=1e-12)
    assert not torch.allclose(r.weights.sum(-1), torch.ones(9, dtype=torch.float64))
    torch.testing.assert_close(r.probs, logits.softmax(-1))


def test_sigma_moe_expert_dropout_only_in_training():
    layer = moelab.MoE(6, 8, 2, method="sigma-moe", expert_dropout=0.5)
    x = torch.randn(64, 6)
    layer.eval()
    top = torch.sigmoid(x @ layer.router.weight.T).topk(2, dim=-1).indices
    for _ in range(3):
        assert torch.equal(layer.router(x).indices.sort(-1).values, top.sort(-1).values)
    layer.train()
    r = layer.router(x)
    differs = (r.indices.sort(-1).values != top.sort(-1).values).any(-1)
    assert differs.any()  # with p = 0.5 some token's top-2 is dropped
    scores = torch.sigmoid(x @ layer.router.weight.T)
    torch.testing.assert_close(r.weights, scores.gather(1, r.indices))  # still the sigmoid scores
    assert (r.indices.sort(-1).values[:, 1:] != r.indices.sort(-1).values[:, :-1]).all()


def test_sigma_moe_preset_defaults():
    layer = moelab.MoE(6, 8, 2, method="sigma-moe")
    assert layer.router.expert_dropout == pytest.approx(0.05)
    assert layer.coefs == {"entropy": pytest.approx(1e-3)}
    assert not layer.router.normalize and layer.router.selection_bias is None


# ------------------------------------------------------------------------------------------ sharede-v3
def test_sharede_v3_weights_are_normalised_sigmoid_of_chosen():
    layer = moelab.MoE(6, 8, 2, method="sharede-v3").double().eval()
    x = torch.randn(7, 6, dtype=torch.float64)
    r = layer.router(x)
    scores = torch.sigmoid(x @ layer.router.weight.T)
    for t in range(7):
        s = [scores[t, i].item() for i in r.indices[t].tolist()]
        assert r.weights[t].tolist() == pytest.approx([v / sum(s) for v in s], rel=1e-12)
    torch.testing.assert_close(r.weights.sum(-1), torch.ones(7, dtype=torch.float64))


@pytest.mark.parametrize("method", ["sharede-v3", "smoe-sg"])
def test_a_gate_bias_enters_the_sigmoid_and_gets_the_literal_gradient(method):
    """Ho (2025)'s normalised sigmoid gating, s_i = sigmoid(β₁ᵢᵀ x + β₀ᵢ) / Σ over the chosen: the
    weights and the gradient of β₀ and W against the formula written out (float64)."""
    layer = moelab.MoE(6, 8, 2, method=method, gate_bias=True).double().eval()
    router = layer.router
    assert router.gate_bias.shape == (8,) and not router.gate_bias.any()  # zero at init
    with torch.no_grad():
        router.gate_bias.copy_(torch.randn(8, dtype=torch.float64))
    x = torch.randn(7, 6, dtype=torch.float64)
    r = router(x)
    w, b = router.weight.detach().clone().requires_grad_(), router.gate_bias.detach().clone().requires_grad_()
    scores = torch.sigmoid(x @ w.T + b)
    chosen = scores.gather(1, r.indices)
    literal = chosen / chosen.sum(-1, keepdim=True)
    torch.testing.assert_close(r.weights, literal, rtol=1e-12, atol=0)
    # the selection follows s (with the bias inside), not W x alone
    assert torch.equal(r.indices.sort(-1).values, scores.topk(2, dim=-1).indices.sort(-1).values)
    probe = torch.randn(7, 2, dtype=torch.float64)
    (r.weights * probe).sum().backward()
    (literal * probe).sum().backward()
    torch.testing.assert_close(router.gate_bias.grad, b.grad, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(router.weight.grad, w.grad, rtol=1e-12, atol=1e-15)
    assert moelab.MoE(6, 8, 2, method=method).router.gate_bias is None  # off by default: the presets' numbers


def test_sharede_v3_selection_bias_changes_selection_not_weights():
    layer = moelab.MoE(6, 8, 2, method="sharede-v3").eval()
    x = torch.randn(20, 6)
    scores = torch.sigmoid(x @ layer.router.weight.T)
    with torch.no_grad():
        layer.router.selection_bias[5] = 10.0  # expert 5 always selected
    r = layer.router(x)
    assert (r.indices == 5).any(-1).all()
    for t in range(20):
        chosen = r.indices[t].tolist()
        other = next(i for i in chosen if i != 5)
        best_other = max((i for i in range(8) if i != 5), key=lambda i: scores[t, i].item())
        assert other == best_other
        s = [scores[t, i].item() for i in chosen]
        assert r.weights[t].tolist() == pytest.approx([v / sum(s) for v in s], rel=1e-5)


def test_sharede_v3_bias_update_lowers_overloaded_and_raises_underloaded():
    layer = moelab.MoE(6, 4, 1, method="sharede-v3", bias_update_rate=0.01).train()
    ctx = moelab.RoutingContext()
    moelab.attach(layer, ctx)
    with torch.no_grad():
        layer.router.selection_bias.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0]))  # expert 0 takes all
    x = torch.randn(16, 6)
    layer(x)
    load = torch.bincount(layer.last_routing.indices.reshape(-1), minlength=4).float()
    assert load.tolist() == [16.0, 0.0, 0.0, 0.0]
    assert layer.router.selection_bias.tolist() == [5.0, 0.0, 0.0, 0.0]  # forward changes nothing
    ctx.advance()
    torch.testing.assert_close(layer.router.selection_bias, torch.tensor([4.99, 0.01, 0.01, 0.01]))
    assert ctx.step == 1 and not layer.router.pending_load.any()
    layer.eval()
    before = layer.router.selection_bias.clone()
    layer(x)
    ctx.advance()
    assert torch.equal(layer.router.selection_bias, before)  # evaluation forwards are not counted


def _sharede_v3(rate: float = 1e-3) -> tuple[moelab.MoE, moelab.RoutingContext]:
    torch.manual_seed(0)
    layer = moelab.MoE(6, 4, 1, method="sharede-v3", bias_update_rate=rate).train()
    ctx = moelab.RoutingContext()
    moelab.attach(layer, ctx)
    return layer, ctx


def test_sharede_v3_bias_update_keeps_balanced_experts_unchanged():
    router = build_router("sigmoid", 4, 4, 1, normalize=True, selection_bias=True)
    router.pending_load += torch.tensor([2.0, 2.0, 1.0, 1.0])  # mean 1.5
    router.on_step()
    torch.testing.assert_close(router.selection_bias, torch.tensor([-1e-3, -1e-3, 1e-3, 1e-3]))
    router = build_router("sigmoid", 4, 4, 1, normalize=True, selection_bias=True)
    router.pending_load += 1.0
    router.on_step()
    assert torch.equal(router.selection_bias, torch.zeros(4))


def test_sharede_v3_bias_never_changes_in_a_forward_loop_without_advance():
    layer, _ = _sharede_v3(rate=0.1)
    for _ in range(5):
        layer(torch.randn(32, 6)).sum().backward()
    assert torch.equal(layer.router.selection_bias, torch.zeros(4))
    assert layer.router.pending_load.sum().item() == 5 * 32  # the load waits for the step hook


def test_sharede_v3_bias_updates_once_per_step_with_the_load_of_all_micro_batches():
    micro = [torch.randn(8, 6) for _ in range(4)]
    layer, ctx = _sharede_v3(rate=0.01)
    total = torch.zeros(4)
    for x in micro:  # gradient accumulation: four forwards and backwards, one optimizer step
        layer(x).sum().backward()
        total += torch.bincount(layer.last_routing.indices.reshape(-1), minlength=4).float()
    ctx.advance()
    expected = 0.01 * torch.sign(total.mean() - total)
    torch.testing.assert_close(layer.router.selection_bias, expected)
    # the same as one forward of the whole batch
    whole, ctx_whole = _sharede_v3(rate=0.01)
    whole(torch.cat(micro)).sum().backward()
    ctx_whole.advance()
    torch.testing.assert_close(whole.router.selection_bias, layer.router.selection_bias)


@pytest.mark.parametrize("reentrant", [False, True])
def test_sharede_v3_bias_counts_a_checkpointed_forward_once(reentrant):
    from torch.utils.checkpoint import checkpoint

    x = torch.randn(16, 6, requires_grad=True)
    plain, ctx_plain = _sharede_v3(rate=0.01)
    plain(x).sum().backward()
    ctx_plain.advance()
    ckpt, ctx_ckpt = _sharede_v3(rate=0.01)
    checkpoint(ckpt, x, use_reentrant=reentrant).sum().backward()  # the backward runs forward again
    assert ckpt.router.pending_load.sum().item() == 16  # counted once, not twice
    ctx_ckpt.advance()
    assert not plain.router.selection_bias.eq(0).all()
    torch.testing.assert_close(ckpt.router.selection_bias, plain.router.selection_bias)


def test_attach_registers_each_step_hook_once():
    layer, ctx = _sharede_v3()
    moelab.attach(layer, ctx)
    moelab.attach(layer, ctx)
    assert ctx.hooks == [layer.router.on_step]
    with pytest.raises(ValueError, match=r"hook=3 is not allowed; expected a callable taking the context"):
        ctx.add_step_hook(3)


def test_sharede_v3_has_shared_experts_and_no_aux_loss():
    layer = moelab.MoE(6, 8, 2, method="sharede-v3")
    assert layer.shared is not None and layer.num_shared == 1
    assert layer.coefs == {}
    layer(torch.randn(4, 6))
    assert layer.aux_loss.item() == 0.0


# ------------------------------------------------------------------------------------------ stablemoe
def test_stablemoe_switches_stage_at_switch_fraction_of_total_steps():
    router = build_router("stable", 6, 4, 2, switch_fraction=0.25)
    assert router.stage(None) == 1
    assert router.stage(RoutingContext(step=1000)) == 1  # total_steps unknown
    assert router.stage(RoutingContext(step=24, total_steps=100)) == 1
    assert router.stage(RoutingContext(step=25, total_steps=100)) == 2
    assert router.stage(RoutingContext(step=99, total_steps=100)) == 2
    explicit = build_router("stable", 6, 4, 2, switch_step=3)
    assert explicit.stage(RoutingContext(step=2)) == 1
    assert explicit.stage(RoutingContext(step=3, total_steps=100)) == 2


def test_stablemoe_default_switch_is_ten_percent():
    router = build_router("stable", 6, 4, 2)
    assert router.stage(RoutingContext(step=5999, total_steps=60000)) == 1
    assert router.stage(RoutingContext(step=6000, total_steps=60000)) == 2


def test_stablemoe_stage1_routes_by_centroids_and_distills_to_argmax():
    layer = moelab.MoE(6, 4, 2, method="stablemoe").double()
    router = layer.router
    x = torch.randn(9, 6, dtype=torch.float64, requires_grad=True)
    r = router(x, layer.experts, RoutingContext(step=0, total_steps=100))
    logits = x.detach() @ router.centroids.detach().T
    torch.testing.assert_close(r.logits, logits)
    check_routing(r, logits, 2)
    light = (x.detach() @ router.light_proj.weight.T) @ router.light_centroids.T
    target = [max(range(4), key=lambda i: logits[t, i].item()) for t in range(9)]
    ce = -sum(light[t].log_softmax(-1)[target[t]].item() for t in range(9)) / 9
    assert r.losses["distill"].item() == pytest.approx(ce, rel=1e-10)
    r.losses["distill"].backward()
    assert router.light_centroids.grad is not None and router.light_proj.weight.grad is not None
    assert router.centroids.grad is None and x.grad is None  # distillation trains the light router only


def test_stablemoe_stage2_routes_by_frozen_light_router():
    layer = moelab.MoE(6, 4, 2, method="stablemoe", switch_step=5)
    ctx = RoutingContext(step=5, total_steps=100)
    moelab.attach(layer, ctx)
    x = torch.randn(9, 6, requires_grad=True)
    y = layer(x)
    r = layer.last_routing
    light = layer.router.light_logits(x.detach()).detach()
    check_routing(r, light, 2)
    assert "distill" not in r.losses
    (y.square().sum() + moelab.aux_loss(layer)).backward()
    router = layer.router
    for p in (router.centroids, router.light_centroids, router.light_proj.weight):
        assert p.grad is None  # no gradient reaches the routing in stage 2
    assert layer.experts.w_in.grad is not None and x.grad is not None
    assert not layer.router(x, layer.experts, ctx).weights.requires_grad


def test_stablemoe_stage1_aux_loss_includes_balance_and_distill():
    layer = moelab.MoE(6, 4, 2, method="stablemoe")
    moelab.attach(layer, RoutingContext(step=0, total_steps=100))
    layer(torch.randn(9, 6))
    r = layer.last_routing
    balance = moelab.losses.switch_balance_loss(r.probs, r.indices, 4)
    expected = 0.01 * balance + 1.0 * r.losses["distill"]
    torch.testing.assert_close(layer.aux_loss.detach(), expected)


# ------------------------------------------------------------------------------------------ hyperrouter
def test_hyperrouter_generated_router_matches_hypernetwork_of_embedding():
    router = build_router("hyper", 5, 3, 2, hyper_dim=7).double()
    e = router.embedding.detach()
    hidden = [
        max(0.0, sum(a * b for a, b in zip(row, e.tolist())) + b1)
        for row, b1 in zip(router.h1_weight.tolist(), router.h1_bias.tolist())
    ]
    out = [
        sum(a * b for a, b in zip(row, hidden)) + b2
        for row, b2 in zip(router.h2_weight.tolist(), router.h2_bias.tolist())
    ]
    wb = torch.tensor(out, dtype=torch.float64).view(3, 6)
    w, b = router.router_weights()
    torch.testing.assert_close(w, wb[:, :5])
    torch.testing.assert_close(b, wb[:, 5])
    x = torch.randn(4, 5, dtype=torch.float64)
    logits = x @ wb[:, :5].T + wb[:, 5]
    r = router(x)
    torch.testing.assert_close(r.logits, logits)
    check_routing(r, logits, 2)


def test_hyperrouter_trains_only_the_embedding():
    layer = moelab.MoE(6, 4, 2, method="hyperrouter")
    assert layer.router.embedding.shape == (6,)  # d_e defaults to d_model
    assert [n for n, p in layer.router.named_parameters() if p.requires_grad] == ["embedding"]
    (layer(torch.randn(8, 6)).square().sum() + moelab.aux_loss(layer)).backward()
    assert layer.router.embedding.grad is not None and layer.router.embedding.grad.abs().sum() > 0
    layer.requires_grad_(True)  # the hypernetwork is buffers: nothing can unfreeze it
    assert [n for n, p in layer.router.named_parameters()] == ["embedding"]


# ------------------------------------------------------------------------------------------ registry / bad input
def test_every_method_router_is_registered():
    from moelab.methods import get_method

    for name in moelab.methods():
        assert get_method(name).router in ROUTERS


def test_router_options_lists_keyword_options():
    # the shared options (declared once in moelab.routers.base) first, then the family's own
    assert router_options(ROUTERS["topk"]) == [
        "selection_bias",
        "bias_update_rate",
        "scale",
        "renormalize",
        "init_std",
        "frozen",
        "k_max",
        "eval_k",
    ]


def test_every_router_family_declares_its_options_in_one_config():
    """router_options is the config's fields; the router keeps the validated config as ``options``;
    the shared options are the base's declarations (one help and constraint each)."""
    import dataclasses

    from moelab.routers.base import InitStdOptions, RenormalizeOptions, SelectionBiasOptions

    shared = {
        f.name: f.metadata
        for mixin in (InitStdOptions, RenormalizeOptions, SelectionBiasOptions)
        for f in dataclasses.fields(mixin)
    }
    for name, cls in ROUTERS.items():
        names = [f.name for f in dataclasses.fields(cls.config_class)]
        assert router_options(cls) == names, name
        for f in dataclasses.fields(cls.config_class):
            if f.name in shared:
                assert f.metadata == shared[f.name], (name, f.name)
    router = build_router("topk", 8, 6, 2, k_max="all", init_std=1)
    assert router.options == ROUTERS["topk"].config_class(k_max="all", init_std=1.0)
    assert (router.k_max, router.init_std) == (6, 1.0)
    aoe = ROUTERS["aoe"].config_class()
    assert aoe.renormalize is False  # the family's default, the shared declaration's constraint


def test_an_unknown_router_option_is_refused_in_one_line():
    with pytest.raises(
        ValueError,
        match=r"^option 'bogus' is not accepted by router='topk'; allowed: \['bias_update_rate', 'eval_k', "
        r"'frozen', 'init_std', 'k_max', 'renormalize', 'scale', 'selection_bias'\]$",
    ):
        build_router("topk", 8, 6, 2, bogus=1)
    with pytest.raises(ValueError, match=r"^option 'bogus' is not accepted by router='topk'; allowed: "):
        moelab.MoE(8, 4, 2, method="competesmoe", base_options={"bogus": 1})


def test_build_router_rejects_unknown_router():
    with pytest.raises(ValueError, match=r"router='nope' is not registered; allowed: \["):
        build_router("nope", 4, 4, 2)


@pytest.mark.parametrize(
    ("router", "options", "match"),
    [
        ("topk", {"init_std": 0.0}, r"init_std=0.0 is not allowed; expected a number > 0"),
        ("topk", {"k_max": 1}, r"k_max=1 is not allowed; expected an integer in \[2, 6\]"),
        ("topk", {"k_max": 7}, r"k_max=7 is not allowed; expected an integer in \[2, 6\]"),
        ("cosine", {"proj_dim": 0}, r"proj_dim=0 is not allowed; expected a positive integer"),
        ("cosine", {"temperature": 0}, r"temperature=0 is not allowed; expected a number > 0"),
        ("cosine", {"perturbation": -0.1}, r"perturbation=-0.1 is not allowed; expected a number >= 0"),
        ("cosine", {"init_gain": -1.0}, r"init_gain=-1.0 is not allowed; expected a number > 0"),
        (
            "sigmoid",
            {"bias_update_rate": -1e-3},
            r"bias_update_rate=-0.001 is not allowed; expected a number >= 0",
        ),
        (
            "sigmoid",
            {"expert_dropout": 1.0},
            r"expert_dropout=1.0 is not allowed; expected a number in \[0, 1\)",
        ),
        (
            "sigmoid",
            {"expert_dropout": -0.1},
            r"expert_dropout=-0.1 is not allowed; expected a number in \[0, 1\)",
        ),
        ("sigmoid", {"init_std": -1.0}, r"init_std=-1.0 is not allowed; expected a number > 0"),
        ("stable", {"distill_dim": 0}, r"distill_dim=0 is not allowed; expected a positive integer"),
        (
            "stable",
            {"switch_fraction": 1.5},
            r"switch_fraction=1.5 is not allowed; expected a number in \[0, 1\]",
        ),
        ("stable", {"switch_step": -1}, r"^switch_step=-1 is not allowed; expected an integer >= 0$"),
        ("stable", {"init_gain": 0.0}, r"init_gain=0.0 is not allowed; expected a number > 0"),
        ("hyper", {"hyper_dim": 0}, r"hyper_dim=0 is not allowed; expected a positive integer"),
        ("hyper", {"embed_dim": -3}, r"embed_dim=-3 is not allowed; expected a positive integer"),
        ("hyper", {"embed_std": 0.0}, r"embed_std=0.0 is not allowed; expected a number > 0"),
    ],
)
def test_router_options_are_validated(router, options, match):
    with pytest.raises(ValueError, match=match):
        build_router(router, 8, 6, 2, **options)


@pytest.mark.parametrize("router", sorted(["topk", "cosine", "sigmoid", "stable", "hyper"]))
def test_router_rejects_bad_sizes(router):
    with pytest.raises(ValueError, match=r"top_k=0 is not allowed; expected an integer in \[1, 4\]"):
        build_router(router, 8, 4, 0)
    with pytest.raises(ValueError, match=r"d_model=0 is not allowed; expected a positive integer"):
        build_router(router, 0, 4, 1)
    with pytest.raises(ValueError, match=r"num_experts=0 is not allowed; expected a positive integer"):
        build_router(router, 8, 0, 1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sharede_v3_selection_bias_keeps_accumulating_in_a_low_precision_model(dtype):
    layer = moelab.MoE(8, 4, 1, method="sharede-v3").to(dtype).train()
    assert layer.router.weight.dtype == dtype
    assert layer.router.selection_bias.dtype == torch.float32
    with torch.no_grad():
        layer.router.selection_bias.copy_(torch.tensor([3.0, 1.0, 1.0, 1.0]))  # expert 0 takes every token
    ctx = moelab.RoutingContext()
    moelab.attach(layer, ctx)
    x = torch.randn(16, 8, dtype=dtype)
    for _ in range(5):
        layer(x)
        ctx.advance()
    assert layer.router.pending_load.dtype == torch.float32
    torch.testing.assert_close(layer.router.selection_bias, torch.tensor([2.995, 1.005, 1.005, 1.005]))


def test_smoe_dropout_evaluates_with_the_k_it_reached_unless_eval_k_is_set():
    ctx = RoutingContext(step=6, total_steps=6)
    wide = moelab.MoE(6, 8, 2, method="smoe-dropout")
    moelab.attach(wide, ctx)
    wide.eval()(torch.randn(3, 6))
    assert wide.last_routing.indices.shape[-1] == 8  # the end of training: all experts, as trained
    slim = moelab.MoE(6, 8, 2, method="smoe-dropout", eval_k=2)
    moelab.attach(slim, ctx)
    slim.train()(torch.randn(3, 6))
    assert slim.last_routing.indices.shape[-1] == 8  # training follows the schedule
    slim.eval()(torch.randn(3, 6))
    assert slim.last_routing.indices.shape[-1] == 2
    with pytest.raises(ValueError, match=r"eval_k=9 is not allowed; expected an integer in \[1, 8\]"):
        moelab.MoE(6, 8, 2, method="smoe-dropout", eval_k=9)


def test_smoe_dropout_k_at_each_step_of_a_short_run():
    router = moelab.MoE(6, 8, 2, method="smoe-dropout").router
    ks = [router.current_k(RoutingContext(step=s, total_steps=6)) for s in range(8)]
    assert ks == [2, 3, 4, 5, 6, 7, 8, 8]  # K = 2 + 6 · step / 6, then stays at N


def test_the_registry_refuses_a_class_that_is_not_a_router():
    from torch import nn

    from moelab.routers import register

    with pytest.raises(
        ValueError,
        match=r"^router 'mine' of type 'Linear' is not allowed; expected a subclass of moelab\.routers\.Router$",
    ):
        register("mine")(nn.Linear)
    assert "mine" not in ROUTERS


def test_every_router_has_every_hook_with_its_default():
    """Callers never probe a router: the base class gives each optional hook a default."""
    from moelab.routers import Router

    class Plain(Router):
        def forward(self, x, experts=None, ctx=None):
            raise NotImplementedError

    r = Plain(4, 3, 1)
    assert r.loss_names == () and r.weights_sum_to_one is True
    assert r.on_step(RoutingContext()) is None and r.base_router is r and r.rule_options() == {}
    assert all(issubclass(cls, Router) for cls in ROUTERS.values())
    compete = moelab.MoE(4, 3, 1, method="competesmoe").router
    assert compete.base_router is compete.base
    assert moelab.MoE(4, 3, 2, method="sigma-moe").router.rule_options()["selection_bias"] is None


# ---------------------------------------------------------------- the selection bias of every router
#: methods with a router that chooses: each takes the aux-loss-free selection bias as a layer option
#: (remoe and expert-choice by design: no choice an offset shifts, and balanced by construction;
#: quantile-balancing and expert-threshold: their own bias β or thresholds τ are the balancing, a
#: second offset would pull against them)
NOT_BIASED = (
    "competition",
    "sharede-v3",
    "remoe",
    "expert-choice",
    "quantile-balancing",
    "expert-threshold",
    "emo",
    "routing-free",  # each expert gates itself by its own threshold: no choice among experts an offset shifts
)
BIASED = [m for m in moelab.methods() if m not in NOT_BIASED]


@pytest.mark.parametrize("method", [m for m in BIASED if get_method(m).router != "competition"])
def test_every_router_takes_the_selection_bias_for_the_choice_only(method):
    torch.manual_seed(0)
    layer = moelab.MoE(6, 4, 2, method=method, selection_bias=True, bias_update_rate=0.01).eval()
    router = layer.router.base_router
    assert router.selection_bias is not None and any(k.endswith("selection_bias") for k in layer.state_dict())
    x = torch.randn(20, 6)
    unbiased = layer.router(x, layer.experts, None)
    with torch.no_grad():
        router.selection_bias[3] = 10.0  # expert 3 always chosen
    r = layer.router(x, layer.experts, None)
    assert (r.indices == 3).any(-1).all()
    torch.testing.assert_close(r.probs, unbiased.probs)  # the scores and the distribution never see b
    same = (r.indices == unbiased.indices).all(-1)  # tokens whose choice the bias did not change
    assert same.any()
    torch.testing.assert_close(r.weights[same], unbiased.weights[same])


@pytest.mark.parametrize("method", ["smoe", "xmoe", "hyperrouter", "stablemoe", "sigma-moe", "competesmoe"])
def test_every_router_moves_its_bias_once_per_step_from_the_load_of_the_step(method):
    torch.manual_seed(0)
    layer = moelab.MoE(6, 4, 1, method=method, selection_bias=True, bias_update_rate=0.01).train()
    ctx = moelab.RoutingContext()
    moelab.attach(layer, ctx)
    router = layer.router.base_router
    total = torch.zeros(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # competesmoe without a schedule routes like its base
        for _ in range(3):  # three micro-batches, one optimizer step
            layer(torch.randn(8, 6)).sum().backward()
            total += torch.bincount(layer.last_routing.indices.reshape(-1), minlength=4).float()
    assert torch.equal(router.selection_bias, torch.zeros(4))  # forwards change nothing
    ctx.advance()
    torch.testing.assert_close(router.selection_bias, 0.01 * torch.sign(total.mean() - total))
    assert not router.pending_load.any()


def test_the_selection_bias_composes_with_a_balance_loss():
    layer = moelab.MoE(6, 4, 2, method="smoe", selection_bias=True, balance_coef=0.01)
    layer(torch.randn(10, 6))
    assert layer.aux_loss.item() > 0 and layer.router.selection_bias is not None


def test_competition_has_no_router_to_bias():
    with pytest.raises(ValueError, match=r"option 'selection_bias' is not accepted by method='competition'"):
        moelab.MoE(6, 4, 2, method="competition", selection_bias=True)


def test_sharede_v3_state_dict_keys_are_those_of_before():
    layer = moelab.MoE(6, 4, 2, method="sharede-v3")
    keys = [k for k in layer.state_dict() if k.startswith("router.")]
    assert keys == ["router.weight", "router.selection_bias"]  # pending_load is not saved
    assert moelab.MoE(6, 4, 2, method="smoe").router.selection_bias is None


def test_xmoe_checkpoints_with_a_0_dim_temperature_still_load():
    # the temperature is shape (1,) (FSDP2 refuses 0-dim parameters); older checkpoints hold a scalar
    layer = moelab.MoE(6, 4, 2, method="xmoe", temperature=0.5)
    assert layer.router.temperature.shape == (1,)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    state["router.temperature"] = torch.tensor(0.7)
    layer.load_state_dict(state)
    assert layer.router.temperature.shape == (1,) and layer.router.temperature.item() == pytest.approx(0.7)


def test_a_selection_bias_of_any_router_survives_save_and_load(tmp_path):
    layer = moelab.MoE(6, 4, 2, method="xmoe", selection_bias=True, balance_scope="sequence")
    with torch.no_grad():
        layer.router.selection_bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0]))
    moelab.save(layer, tmp_path / "m")
    again = moelab.load(tmp_path / "m")
    assert torch.equal(again.router.selection_bias, layer.router.selection_bias)
    assert again.balance_scope == "sequence"
    x = torch.randn(2, 3, 6)
    torch.testing.assert_close(again.eval()(x), layer.eval()(x))


@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_every_router_takes_the_layers_experts_as_the_expert_bank_protocol(name):
    """``forward(x, experts, ctx)``: ``experts`` is annotated with :class:`moelab.experts.protocol.Experts`
    (what every bank implements), not a bare ``nn.Module``."""
    import typing

    from moelab.experts.protocol import Experts

    hint = typing.get_type_hints(ROUTERS[name].forward)["experts"]
    assert Experts in (hint, *typing.get_args(hint))
