import warnings

import pytest
import torch
import torch.nn.functional as F

import moelab
from moelab.losses import (
    competition_router_loss,
    distillation_loss,
    diversity_loss,
    switch_balance_loss,
)
from moelab.routers.compete import compete

D, N, K, T = 12, 6, 2, 20


class Always:
    """A schedule on which every layer competes at every step."""

    def __init__(self, num_layers=1, on=True):
        self.num_layers = num_layers
        self.on = on

    def active(self, layer, step):
        return self.on


def make(method, seed=0, schedule=None, **options):
    torch.manual_seed(seed)
    layer = moelab.MoE(D, N, K, method=method, impl="loop", **options)
    if schedule is not None:
        moelab.attach(layer, moelab.RoutingContext(schedule=schedule))
    return layer


def all_outputs(bank, x):
    """Independent: every expert through ``expert_forward``, stacked to (T, N, d)."""
    return torch.stack([bank.expert_forward(x, e) for e in range(bank.num_experts)], dim=1)


def literal_affinity(out, kappa, reduce):
    if reduce == "norm":
        return out.norm(dim=-1)
    if kappa == "exp":
        return out.double().exp().mean(dim=-1)
    if kappa == "softmax":
        return out.softmax(dim=1).mean(dim=-1)
    return {"softplus": F.softplus, "silu": F.silu, "sigmoid": torch.sigmoid, "relu": F.relu}[kappa](
        out
    ).mean(dim=-1)


@pytest.mark.parametrize(
    ("kappa", "reduce"),
    [
        ("softplus", "mean"),
        ("silu", "mean"),
        ("sigmoid", "mean"),
        ("relu", "mean"),
        ("exp", "mean"),
        ("softmax", "mean"),
        ("softplus", "norm"),
    ],
)
@pytest.mark.parametrize("grad_path", ["winners", "all"])
def test_winners_are_topk_of_independent_expert_forward(kappa, reduce, grad_path):
    layer = make("competition", kappa=kappa, reduce=reduce, grad_path=grad_path)
    x = torch.randn(T, D)
    y = layer(x)
    with torch.no_grad():
        out = all_outputs(layer.experts, x)
        s = literal_affinity(out, kappa, reduce)
    top, idx = s.topk(K, dim=-1)
    assert torch.equal(layer.last_routing.indices, idx)
    w = (top / top.sum(-1, keepdim=True)).float()
    assert torch.allclose(layer.last_routing.weights, w, atol=1e-5)
    expected = (w.unsqueeze(-1) * out.gather(1, idx.unsqueeze(-1).expand(-1, -1, D))).sum(1)
    assert torch.allclose(y, expected, atol=1e-5)


def test_softmax_weighting_and_eval_also_compete():
    layer = make("competition", weighting="softmax", reduce="norm").eval()
    x = torch.randn(T, D)
    with torch.no_grad(), moelab.recording_routing(layer):
        y = layer(x)
        out = all_outputs(layer.experts, x)
    top, idx = out.norm(dim=-1).topk(K, dim=-1)
    w = top.softmax(-1)
    assert torch.equal(layer.last_routing.indices, idx)
    assert torch.allclose(
        y, (w.unsqueeze(-1) * out.gather(1, idx.unsqueeze(-1).expand(-1, -1, D))).sum(1), atol=1e-5
    )


def test_exp_affinity_does_not_overflow():
    layer = make("competition", kappa="exp")
    with torch.no_grad():
        layer.experts.w_out.mul_(1e3)  # outputs of order 1e3: exp overflows float32
    x = torch.randn(T, D) * 10
    y = layer(x)
    assert torch.isfinite(y).all() and torch.isfinite(layer.last_routing.weights).all()
    y.sum().backward()
    assert torch.isfinite(layer.experts.w_in.grad).all()


@pytest.mark.parametrize("method", ["competition", "competesmoe"])
@pytest.mark.parametrize("grad_path", ["winners", "all"])
def test_unselected_experts_get_exactly_zero_gradient(method, grad_path):
    layer = make(method, seed=1, schedule=Always() if method == "competesmoe" else None, grad_path=grad_path)
    x = torch.randn(3, D)  # 3 tokens × 2 winners: at most 6 of 6 experts, usually fewer
    y = layer(x)
    (y.square().sum() + layer.aux_loss).backward()
    chosen = set(layer.last_routing.indices.unique().tolist())
    assert len(chosen) < N, "test needs an expert nobody selected"
    for e in range(N):
        g_in, g_out = layer.experts.w_in.grad[e], layer.experts.w_out.grad[e]
        if e in chosen:
            assert g_out.abs().sum() > 0
        else:
            assert torch.count_nonzero(g_in) == 0 and torch.count_nonzero(g_out) == 0


def test_grad_paths_agree():
    x = torch.randn(T, D)
    grads, ys = [], []
    for path in ("winners", "all"):
        layer = make("competition", seed=3, grad_path=path)
        y = layer(x)
        y.square().sum().backward()
        ys.append(y.detach())
        grads.append((layer.experts.w_in.grad.clone(), layer.experts.w_out.grad.clone()))
    assert torch.allclose(ys[0], ys[1], atol=1e-5)
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-4)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-4)


# ---------------------------------------------------------------- losses, literal
def test_distillation_loss_literal():
    torch.manual_seed(0)
    s_r = torch.randn(5, N).softmax(-1)
    s = torch.rand(5, N)
    winners = s.topk(K, dim=-1).indices
    s_c = torch.zeros(5, N)
    for t in range(5):
        tot = sum(s[t, j] for j in winners[t])
        for j in winners[t]:
            s_c[t, j] = s[t, j] / tot
    alpha = 0.1
    mse = sum((s_r[t, i] - s_c[t, i]) ** 2 for t in range(5) for i in range(N)) / (5 * N)
    win = sum(sum((s_c[t, j] - s_r[t, j]) ** 2 for j in winners[t]) * alpha / K for t in range(5)) / 5
    assert torch.allclose(distillation_loss(s_r, s_c, winners, alpha), mse + win, atol=1e-7)


def test_distillation_loss_trains_only_the_router_side():
    s_r = torch.randn(4, N).softmax(-1).requires_grad_()
    s_c = torch.rand(4, N).requires_grad_()
    distillation_loss(s_r, s_c, s_c.topk(K, -1).indices, 0.1).backward()
    assert s_c.grad is None and s_r.grad is not None


def test_diversity_loss_literal():
    torch.manual_seed(1)
    o = torch.randn(4, 3, 5)
    tot_f, tot_c = 0.0, 0.0
    for t in range(4):
        m = o[t]
        C = m @ m.T / (m.norm() ** 2)  # Frobenius norm
        U = m / m.norm(dim=1, keepdim=True)
        Cc = U @ U.T
        tot_f += sum(C[i, j] for i in range(3) for j in range(3) if i != j) / (3 * 2)
        tot_c += sum(Cc[i, j] for i in range(3) for j in range(3) if i != j) / (3 * 2)
    assert torch.allclose(diversity_loss(o), tot_f / 4, atol=1e-6)
    assert torch.allclose(diversity_loss(o, "cosine"), tot_c / 4, atol=1e-6)
    assert diversity_loss(o[:, :1]).item() == 0.0
    with pytest.raises(
        ValueError, match=r"normalize='l1' is not supported; allowed: \['frobenius', 'cosine'\]"
    ):
        diversity_loss(o, "l1")


def test_v1_router_loss_literal():
    torch.manual_seed(2)
    h = torch.randn(3, N)
    s = torch.rand(3, N)

    def dense_topk_softmax(v):
        out = torch.zeros(N)
        top = sorted(range(N), key=lambda i: -v[i])[:K]
        z = sum(torch.exp(v[i]) for i in top)
        for i in top:
            out[i] = torch.exp(v[i]) / z
        return out

    lit = sum(((dense_topk_softmax(h[t]) - dense_topk_softmax(s[t])) ** 2).sum() for t in range(3)) / (3 * N)
    assert torch.allclose(competition_router_loss(h, s, K), lit, atol=1e-7)


# ---------------------------------------------------------------- competesmoe
def test_competesmoe_eval_equals_router_path():
    cs = make("competesmoe", schedule=Always())
    sm = make("smoe")
    sm.router.load_state_dict(cs.router.base.state_dict())
    sm.experts.load_state_dict(cs.experts.state_dict())
    cs.eval(), sm.eval()
    x = torch.randn(T, D)
    with torch.no_grad(), moelab.recording_routing(cs), moelab.recording_routing(sm):
        assert torch.equal(cs(x), sm(x))
    assert torch.equal(cs.last_routing.indices, sm.last_routing.indices)


def test_competesmoe_off_schedule_step_is_the_router_path_and_on_step_competes():
    cs = make("competesmoe", schedule=Always(on=False))
    sm = make("smoe")
    sm.router.load_state_dict(cs.router.base.state_dict())
    sm.experts.load_state_dict(cs.experts.state_dict())
    x = torch.randn(T, D)
    assert torch.allclose(cs(x), sm(x))
    assert "distill" not in cs.last_routing.losses
    cs.ctx.schedule.on = True
    y = cs(x)
    expected = make("competition")
    expected.experts.load_state_dict(cs.experts.state_dict())
    assert torch.allclose(y, expected(x), atol=1e-6)
    assert torch.equal(cs.last_routing.indices, expected.last_routing.indices)


def test_competesmoe_aux_loss_is_the_weighted_sum():
    cs = make("competesmoe", schedule=Always())
    x = torch.randn(T, D)
    y = cs(x)
    r = cs.last_routing
    probs = F.linear(x, cs.router.base.weight).softmax(-1)
    s_c = torch.zeros(T, N).scatter(1, r.indices, r.weights)
    with torch.no_grad():
        everything = all_outputs(cs.experts, x)
        out = everything.gather(1, r.indices.unsqueeze(-1).expand(-1, -1, D))
        affinity = torch.nn.functional.softplus(everything).mean(-1).softmax(-1)
    # on a competition step: no router balance or z term; the competition's own balance instead
    expected = (
        0.01 * distillation_loss(probs, s_c, r.indices, 0.1)
        + 0.005 * diversity_loss(out)
        + 0.01 * switch_balance_loss(affinity, r.indices, N)
    )
    assert torch.allclose(cs.aux_loss, expected, atol=1e-6)
    # the router learns from L_D on a competition step: its weight gets the aux gradient, which the
    # layer attached to its output (a zero task gradient leaves the aux one alone)
    (y * 0).sum().backward()
    assert cs.router.base.weight.grad.abs().sum() > 0


def _router_grad(layer, x, loss=None):
    """The router's gradient of the layer's whole aux loss, or of one of its losses."""
    layer.zero_grad()
    if loss is None:  # the aux gradient the layer attaches to its output
        (layer(x) * 0).sum().backward()
    else:  # the competition is deterministic: the router again gives this forward's routing
        layer.router(x, layer.experts, layer.ctx).losses[loss].backward()
    return layer.router.base.weight.grad.flatten().clone()


@pytest.mark.parametrize("balance,positive", [("affinity", True), ("off", True), ("router", False)])
def test_on_a_competition_step_the_router_follows_the_distillation(balance, positive):
    torch.manual_seed(0)
    layer = moelab.MoE(16, 16, 2, method="competesmoe", competition_balance=balance).train()
    moelab.attach(layer, moelab.RoutingContext(schedule=Always()))
    x = torch.nn.functional.layer_norm(torch.randn(4096, 16), (16,))
    whole = _router_grad(layer, x)
    distill = _router_grad(layer, x, "distill")
    cosine = torch.nn.functional.cosine_similarity(whole, distill, dim=0).item()
    if positive:
        assert cosine > 0.999  # the router learns from L_D alone
    else:  # the router's balance with the winners' load dominates and opposes L_D
        assert cosine < 0.5


def test_the_competition_balance_and_distillation_options_are_validated():
    with pytest.raises(
        ValueError,
        match=r"competition_balance='x' is not allowed; expected one of \['affinity', 'router', 'off'\]",
    ):
        moelab.MoE(8, 4, 2, method="competesmoe", competition_balance="x")
    with pytest.raises(ValueError, match=r"distill='kl' is not allowed; expected one of \['paper', 'mse'\]"):
        moelab.MoE(8, 4, 2, method="competesmoe", distill="kl")


def test_the_mse_distillation_is_the_authors_softmax_of_affinities():
    torch.manual_seed(1)
    cs = make("competesmoe", schedule=Always(), distill="mse")
    x = torch.randn(T, D)
    cs(x)
    probs = F.linear(x, cs.router.base.weight).softmax(-1)
    with torch.no_grad():
        target = torch.nn.functional.softplus(all_outputs(cs.experts, x)).mean(-1).softmax(-1)
    torch.testing.assert_close(cs.last_routing.losses["distill"], (probs - target).square().mean())


def test_competesmoe_without_context_warns_once_and_routes_like_base():
    cs = make("competesmoe")
    sm = make("smoe")
    sm.router.load_state_dict(cs.router.base.state_dict())
    sm.experts.load_state_dict(cs.experts.state_dict())
    x = torch.randn(T, D)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")  # Python's default: once per place and text
        y = cs(x)
        cs(x)
    told = [str(w.message) for w in caught if "no RoutingContext with a schedule" in str(w.message)]
    assert len(told) == 1, told
    assert torch.allclose(y, sm(x))


def test_competesmoe_uses_the_schedule_per_layer_and_step():
    model = torch.nn.Sequential(*[moelab.MoE(D, N, K, method="competesmoe") for _ in range(3)])
    sched = moelab.CompetitionSchedule(3, 16, omega=0.3, a_max=1, warmup=0.0, seed=4)
    ctx = moelab.RoutingContext(schedule=sched, total_steps=16)
    layers = moelab.attach(model, ctx)
    x = torch.randn(T, D)
    for step in range(16):
        ctx.step = step
        model(x)
        for i, layer in enumerate(layers):
            assert ("distill" in layer.last_routing.losses) == sched.active(i, step)


@pytest.mark.parametrize("base", ["xmoe", "pcosine", "sigma-moe", "sharede-v3", "hyperrouter"])
def test_competesmoe_wraps_any_base_router(base):
    cs = make("competesmoe", schedule=Always(), base=base)
    y = cs(torch.randn(T, D))
    assert y.shape == (T, D) and "distill" in cs.last_routing.losses
    assert type(cs.router.base).__name__ != "TopKRouter"


def test_competesmoe_v1_step():
    v1 = make("competesmoe-v1", schedule=Always())
    x = torch.randn(T, D)
    y = v1(x)
    with torch.no_grad():
        out = all_outputs(v1.experts, x)
    s = out.norm(dim=-1)
    top, idx = s.topk(K, -1)
    w = top.softmax(-1)
    assert torch.equal(v1.last_routing.indices, idx)
    assert torch.allclose(
        y, (w.unsqueeze(-1) * out.gather(1, idx.unsqueeze(-1).expand(-1, -1, D))).sum(1), atol=1e-5
    )
    h = F.linear(x, v1.router.base.weight)
    assert torch.allclose(v1.aux_loss, competition_router_loss(h, s, K), atol=1e-7)


def test_densemoe_scheduled_output_is_the_weighted_sum_of_all_experts():
    dm = make("densemoe", schedule=Always())
    x = torch.randn(T, D)
    y = dm(x)
    p = F.linear(x, dm.router.base.weight).softmax(-1)
    with torch.no_grad():
        out = all_outputs(dm.experts, x)
    assert torch.allclose(y, (p.unsqueeze(-1) * out).sum(1), atol=1e-5)
    assert dm.last_routing.indices.shape == (T, N)
    # off schedule it is smoe
    dm.ctx.schedule.on = False
    y2 = dm(x)
    w, idx = p.topk(K, -1)
    w = w / w.sum(-1, keepdim=True)
    assert torch.allclose(
        y2, (w.unsqueeze(-1) * out.gather(1, idx.unsqueeze(-1).expand(-1, -1, D))).sum(1), atol=1e-5
    )


def test_competition_layer_trains_end_to_end():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        moelab.MoE(D, N, K, method="competesmoe"), moelab.MoE(D, N, K, method="competesmoe")
    )
    sched = moelab.CompetitionSchedule(2, 15, omega=0.5, a_max=1, warmup=0.1, seed=0)
    ctx = moelab.RoutingContext(schedule=sched, total_steps=15)
    moelab.attach(model, ctx)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, target = torch.randn(64, D), torch.randn(64, D)
    losses = []
    for _ in range(15):
        loss = F.mse_loss(model(x), target)
        (loss + moelab.aux_loss(model)).backward()
        opt.step()
        opt.zero_grad()
        ctx.advance()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0]


# ---------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    ("method", "options", "match"),
    [
        ("competition", {"kappa": "tanh"}, r"kappa='tanh' is not allowed; expected one of \['softplus'"),
        (
            "competition",
            {"reduce": "max"},
            r"reduce='max' is not allowed; expected one of \['mean', 'norm'\]",
        ),
        ("competition", {"weighting": "sum"}, r"weighting='sum' is not allowed"),
        ("competition", {"grad_path": "some"}, r"grad_path='some' is not allowed"),
        (
            "competesmoe",
            {"mode": "hybrid"},
            r"mode='hybrid' is not allowed; expected one of \['compete', 'v1', 'dense', 'router'\]",
        ),
        ("competesmoe", {"base": "stablemoe"}, r"base='stablemoe' is not allowed"),
        ("competesmoe", {"base": "competition"}, r"base='competition' is not allowed"),
        ("competesmoe", {"base": "nope"}, r"method='nope' is not a moelab method"),
        ("competesmoe", {"alpha": -1}, r"alpha=-1 is not allowed; expected a number >= 0"),
        ("competesmoe", {"diversity": "l1"}, r"diversity='l1' is not allowed"),
        ("competesmoe", {"base_options": 3}, r"base_options=3 is not allowed"),
    ],
)
def test_bad_options(method, options, match):
    with pytest.raises(ValueError, match=match):
        moelab.MoE(D, N, K, method=method, **options)


def test_top_k_larger_than_experts_is_refused():
    with pytest.raises(ValueError, match=r"top_k=7 is not allowed; expected an integer in \[1, 6\]"):
        moelab.MoE(D, N, 7, method="competesmoe")


def test_compete_function_matches_layer():
    layer = make("competition")
    x = torch.randn(T, D)
    winners, weights, outputs, scores = compete(x, layer.experts, K)
    assert torch.allclose(weights.sum(-1), torch.ones(T))
    assert outputs.shape == (T, K, D) and scores.shape == (T, N)
    (grad,) = torch.autograd.grad(scores.sum(), outputs)  # the winners' affinities carry a gradient
    assert grad.abs().sum() > 0
    assert torch.equal(winners, scores.topk(K, -1).indices)


def test_competition_over_module_experts():
    torch.manual_seed(0)
    mods = [
        torch.nn.Sequential(torch.nn.Linear(D, 8), torch.nn.ReLU(), torch.nn.Linear(8, D)) for _ in range(N)
    ]
    layer = moelab.MoE(D, N, K, method="competesmoe", experts=moelab.ModuleExperts(mods))
    moelab.attach(layer, moelab.RoutingContext(schedule=Always()))
    x = torch.randn(T, D)
    y = layer(x)
    with torch.no_grad():
        out = torch.stack([m(x) for m in mods], dim=1)
    top, idx = F.softplus(out).mean(-1).topk(K, -1)
    w = top / top.sum(-1, keepdim=True)
    assert torch.equal(layer.last_routing.indices, idx)
    assert torch.allclose(
        y, (w.unsqueeze(-1) * out.gather(1, idx.unsqueeze(-1).expand(-1, -1, D))).sum(1), atol=1e-5
    )
    y.sum().backward()
    unused = set(range(N)) - set(idx.unique().tolist())
    for e in unused:
        assert all(p.grad is None or torch.count_nonzero(p.grad) == 0 for p in mods[e].parameters())


def _bench_args(**changes):
    import argparse

    from moelab.bench import compete as bench_compete

    parser = argparse.ArgumentParser()
    bench_compete.add_arguments(parser)
    argv = ["--layers", "2", "--d-model", "8", "--d-hidden", "8", "--experts", "4", "--tokens", "16"]
    argv += ["--steps", "4", "--omega", "0.5", "--a-max", "1", "--no-memory"]
    for key, value in changes.items():
        argv += [f"--{key.replace('_', '-')}", str(value)]
    return bench_compete, parser.parse_args(argv)


def test_bench_compete_smoke(capsys):
    bench, args = _bench_args()
    assert bench.run(args) == 0
    out = capsys.readouterr().out
    assert "ratio competesmoe / smoe" in out and "ω·(N−K)/K × share" in out


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"top_k": 4}, r"--top-k=4 is not allowed; expected an integer in \[1, 3\]"),
        ({"omega": 2.0}, r"omega=2.0 is not allowed"),
        ({"a_max": 0}, r"a_max=0 is not allowed"),
        ({"tokens": 0}, r"--tokens=0 is not allowed"),
    ],
)
def test_bench_compete_bad_input(changes, match):
    bench, args = _bench_args(**changes)
    with pytest.raises(ValueError, match=match):
        bench.run(args)


# ------------------------------------------------- CompeteSMoE (2024) eq. 5 and the ablations of (2025)
def _router_params(layer):
    return [p for p in layer.router.base.parameters() if p.requires_grad]


@pytest.mark.parametrize("method", ["competesmoe-v1", "competesmoe"])
def test_router_nll_adds_alpha_times_the_task_gradient_through_the_routers_weights_of_the_winners(method):
    alpha = 0.7
    x = torch.randn(T, D)
    target = torch.randn(T, D)

    def task(y):
        return (y - target).pow(2).mean()

    grads, outputs = {}, {}
    for nll in (0.0, alpha):
        layer = make(method, schedule=Always(), router_nll=nll).train()
        y = layer(x)
        (task(y) + layer.aux_loss).backward()
        grads[nll] = [p.grad.clone() for p in _router_params(layer)]
        outputs[nll] = y.detach()
    y0 = outputs[0.0]
    assert torch.equal(outputs[alpha], y0)  # the output is the competition's (eq. 2) either way
    # the literal α·∂NLL/∂W_r: the winners' outputs (constants) weighted by the router's own
    # probabilities renormalised over the winners, the gradient of the task loss at the output
    layer = make(method, schedule=Always()).train()
    layer(x)
    winners = layer.last_routing.indices
    with torch.no_grad():
        chosen = all_outputs(layer.experts, x).gather(1, winners.unsqueeze(-1).expand(-1, -1, D))
    y_var = y0.clone().requires_grad_()
    (g_y,) = torch.autograd.grad(task(y_var), y_var)
    probs = F.linear(x, layer.router.base.weight).softmax(-1).gather(1, winners)
    y_router = ((probs / probs.sum(-1, keepdim=True)).unsqueeze(-1) * chosen).sum(1)
    literal = torch.autograd.grad(y_router, _router_params(layer), grad_outputs=g_y)
    for got, base, lit in zip(grads[alpha], grads[0.0], literal):
        torch.testing.assert_close(got, base + alpha * lit, rtol=1e-5, atol=1e-7)
        assert lit.abs().sum() > 0


def test_without_task_gradient_the_router_learns_from_the_task_loss_on_no_step():
    x = torch.randn(T, D)
    for on in (False, True):
        for task_gradient, expect_zero in ((True, on), (False, True)):
            # no aux loss: the task loss alone (on a competing step the router is off the output path)
            layer = make("competesmoe", schedule=Always(on=on), task_gradient=task_gradient,
                         balance_coef=0, z_coef=0, distill_coef=0, diversity_coef=0,
                         competition_balance_coef=0).train()  # fmt: skip
            layer(x).pow(2).mean().backward()
            total = sum(float(p.grad.abs().sum()) for p in _router_params(layer) if p.grad is not None)
            assert (total == 0) == expect_zero, (on, task_gradient)
    # the competition still teaches it
    layer = make("competesmoe", schedule=Always(), task_gradient=False).train()
    (layer(x) * 0).sum().backward()  # the aux gradient the layer attaches to its output
    assert layer.router.base.weight.grad.abs().sum() > 0


def test_router_mode_is_the_routers_top_k_with_the_diversity_of_their_outputs():
    # CompeteSMoE (2025) Table 10 row (2): diversity loss without competition
    layer = make("competesmoe", schedule=Always(), mode="router", balance_coef=0, z_coef=0,
                 distill_coef=0, diversity_coef=1.0, competition_balance_coef=0).train()  # fmt: skip
    x = torch.randn(T, D)
    y = layer(x)
    p = F.linear(x, layer.router.base.weight).softmax(-1)
    w, idx = p.topk(K, -1)
    w = w / w.sum(-1, keepdim=True)
    out = all_outputs(layer.experts, x).gather(1, idx.unsqueeze(-1).expand(-1, -1, D))
    torch.testing.assert_close(y, (w.unsqueeze(-1) * out).sum(1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(layer.aux_loss, diversity_loss(out), rtol=1e-5, atol=1e-7)


def test_densemoe_with_a_diversity_weight_adds_the_diversity_of_the_routers_top_k():
    # CompeteSMoE (2025) Table 10 row (4): DenseMoE + diversity loss
    dm = make("densemoe", schedule=Always(), balance_coef=0, z_coef=0, diversity_coef=1.0).train()
    x = torch.randn(T, D)
    y = dm(x)
    p = F.linear(x, dm.router.base.weight).softmax(-1)
    out = all_outputs(dm.experts, x)
    torch.testing.assert_close(y, (p.unsqueeze(-1) * out).sum(1), rtol=1e-5, atol=1e-6)
    idx = p.topk(K, -1).indices
    torch.testing.assert_close(
        dm.aux_loss, diversity_loss(out.gather(1, idx.unsqueeze(-1).expand(-1, -1, D))), rtol=1e-5, atol=1e-7
    )
    assert make("densemoe", schedule=Always()).coefs.get("diversity", 0) == 0  # row (3): none


def test_router_nll_and_task_gradient_are_validated():
    with pytest.raises(ValueError, match=r"router_nll=0.5 is not allowed with mode='dense'"):
        make("densemoe", router_nll=0.5)
    with pytest.raises(ValueError, match=r"router_nll=-1 is not allowed; expected a number >= 0"):
        make("competesmoe", router_nll=-1)
    with pytest.raises(ValueError, match=r"task_gradient='no' is not allowed; expected True or False"):
        make("competesmoe", task_gradient="no")
