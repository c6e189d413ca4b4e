"""``routing-free`` (Routing-Free MoE, arXiv 2604.00801): each expert gates itself by the norm of its
own low-rank gate pre-activation; the output, the gradients, the balancing objective and its adaptive
coefficient over steps against the authors' code written out, evaluation, refusals, 2 ranks = one
process, the layer grid."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import moelab
from router_grid import IMPLS_WITH_TRITON, D, check_compile, check_kernel, check_save_load, make

METHOD = "routing-free"


def authors_layer(x, bank, scale, bias, theta):
    """The authors' ``RoutingFreeMaskedMoE.forward`` written out, one expert at a time: ``a = A_e x``,
    ``s = ‖a‖·c_e − b_e``, the expert runs on the tokens with ``s ≥ θ`` and its output is weighted by
    ``s``; the per-expert gate scores are ``s`` where active, ``−inf`` elsewhere."""
    out = torch.zeros_like(x)
    scores = []
    for e in range(bank.num_experts):
        a = x @ bank.gate_down[e].T
        s = torch.norm(a, p=2, dim=-1) * scale[e] - bias[e]
        on = s >= theta
        if on.any():
            out = out.index_add(
                0, on.nonzero().squeeze(-1), bank.expert_forward(x[on], e) * s[on].unsqueeze(1)
            )
        full = s.new_full(s.shape, -float("inf"))
        full = torch.where(on, s, full)
        scores.append(full)
    return out, torch.stack(scores, dim=-1)


def authors_aux(gate_scores, theta, lam, per_expert=0.5, per_token=0.5):
    """The authors' ``compute_routing_free_aux`` (``gate_act_fn='relu'``, temperature 1) for one
    layer: ``λ · (0.5·balancing(dim=0) + 0.5·balancing(dim=1))`` and the density."""
    probs = F.relu(gate_scores)
    mask = (probs >= theta).to(probs.dtype)  # the code's .float(): the computation's dtype here (float64)

    def balancing(dim):
        return torch.mean(torch.mean(mask, dim=dim) * torch.mean(probs, dim=dim))

    return lam * (balancing(0) * per_expert + balancing(1) * per_token), mask.mean()


def test_routing_free_gates_weights_gradients_and_balancing_are_the_authors_code():
    torch.manual_seed(0)
    layer = moelab.MoE(
        6, 5, 2, d_hidden=7, method=METHOD, rank=3, activation="swiglu", threshold=0.9, lambda_init=0.05
    ).double()
    ctx = moelab.routing_context(layer, total_steps=10)
    with torch.no_grad():  # every expert its own scale and bias
        layer.router.gate_scale.copy_(torch.tensor([1.0, 0.8, 1.3, 0.6, 1.1]))
        layer.router.gate_bias.copy_(torch.tensor([0.1, -0.2, 0.3, 0.0, -0.1]))
    twin = copy.deepcopy(layer)
    gen = torch.Generator().manual_seed(1)
    lam = float(layer.router.rf_lambda)  # λ is kept in float32
    for _step in range(3):
        densities = []
        for _micro in range(2):
            x = torch.randn(11, 6, dtype=torch.float64, generator=gen)
            g = torch.randn(11, 6, dtype=torch.float64, generator=gen)
            twin.zero_grad()
            r = twin.router
            want, scores = authors_layer(x, twin.experts, r.gate_scale, r.gate_bias, 0.9)
            aux, density = authors_aux(scores, 0.9, lam)
            ((want * g).sum() + aux).backward()
            densities.append(density)

            layer.zero_grad()
            y = layer(x)
            ((y * g).sum() + layer.aux_loss).backward()
            torch.testing.assert_close(y, want, rtol=1e-12, atol=1e-12)
            torch.testing.assert_close(layer.aux_loss, aux, rtol=1e-12, atol=0)
            routing = layer.last_routing
            active = torch.isfinite(scores)
            assert torch.equal(routing.mask.sum(1), active.sum(1))
            for t in range(11):
                assert (
                    sorted(routing.indices[t][routing.mask[t]].tolist())
                    == active[t].nonzero().squeeze(-1).tolist()
                )
            got = dict(layer.named_parameters())
            for name, p in twin.named_parameters():
                torch.testing.assert_close(got[name].grad, p.grad, rtol=1e-10, atol=1e-12, msg=name)
        ctx.advance()
        # the step's density over its micro-batches (equal sizes: the mean of theirs), K/N = 0.4
        rho = torch.stack(densities).mean()
        lam = min(1.0, lam * 1.02 ** float(torch.sign(rho - 0.4)))
        torch.testing.assert_close(layer.router.rf_lambda.double(), torch.tensor(lam, dtype=torch.float64))
        lam = float(layer.router.rf_lambda)


def test_routing_free_preset_defaults_and_parameters():
    layer = moelab.MoE(16, 4, 2, method=METHOD)
    r = layer.router
    assert layer.coefs == {"rf_balance": 1.0}
    assert r.rank == 4 and layer.experts.gate_rank == 4  # d_model // 4
    assert (r.threshold, r.eval_threshold, r.density_target, r.token_balance) == (1.0, 1.0, 0.5, 0.5)
    assert (r.lambda_init, r.lambda_rate) == (1e-10, 0.02)
    assert r.gate_scale.tolist() == [1.0] * 4 and torch.equal(r.gate_bias, torch.full((4,), -1e-6))
    assert {n for n, _ in r.named_parameters()} == {"gate_scale", "gate_bias"}
    assert r.variable_k and not r.weights_sum_to_one
    assert moelab.MoE(16, 4, 2, method=METHOD, density_target=0.3).router.density_target == 0.3


def test_routing_free_gates_itself_in_evaluation_at_its_eval_threshold_and_keeps_lambda():
    """Evaluation: the same self-gating rule (the paper's inference), at ``eval_threshold``; the
    coefficient and the pending density do not move."""
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, method=METHOD, threshold=0.5, eval_threshold=0.9)
    ctx = moelab.routing_context(layer, total_steps=10)
    x = torch.randn(32, 8)
    (layer(x).square().mean() + layer.aux_loss).backward()
    ctx.advance()
    lam = layer.router.rf_lambda.clone()
    layer.eval()
    s = layer.router.self_gates(x, layer.experts).detach()
    r = layer.router(x, layer.experts)
    chosen = torch.zeros(32, 4, dtype=torch.bool).scatter(1, r.indices, r.mask)
    assert torch.equal(chosen, s >= 0.9)
    torch.testing.assert_close(r.weights[r.mask], s.gather(1, r.indices)[r.mask])
    assert (r.weights[~r.mask] == 0).all()
    layer(x)
    ctx.advance()
    assert torch.equal(layer.router.rf_lambda, lam) and not layer.router.rf_pending.any()
    layer.train()
    r = layer.router(x, layer.experts)
    chosen = torch.zeros(32, 4, dtype=torch.bool).scatter(1, r.indices, r.mask)
    assert torch.equal(chosen, s >= 0.5)  # training gates at θ


def test_routing_free_lambda_rises_while_too_dense_and_is_capped_at_one():
    layer = moelab.MoE(8, 4, 1, method=METHOD, threshold=1e-6, lambda_init=0.5, lambda_rate=1.0)
    ctx = moelab.routing_context(layer, total_steps=10)
    for expected in (1.0, 1.0):  # every expert active (ρ = 1 > 1/4): λ doubles, then stays at 1
        layer(torch.randn(8, 8)).sum().backward()
        ctx.advance()
        assert float(layer.router.rf_lambda) == expected


def test_routing_free_refusals_are_one_line():
    for option, value, allowed in (
        ("threshold", 0.0, "threshold=0.0 is not allowed"),
        ("token_balance", 1.5, "token_balance=1.5 is not allowed"),
        ("density_target", 0.0, "density_target=0.0 is not allowed"),
        ("lambda_rate", 0.0, "lambda_rate=0.0 is not allowed"),
    ):
        with pytest.raises(ValueError, match=rf"^{allowed}") as e:
            moelab.MoE(8, 4, 2, method=METHOD, **{option: value})
        assert "\n" not in str(e.value)
    with pytest.raises(
        ValueError,
        match=r"^capacity_factor=1.0 is not allowed with method='routing-free': it routes a variable",
    ):
        moelab.MoE(8, 4, 2, method=METHOD, capacity_factor=1.0)
    layer = moelab.MoE(8, 4, 2, method=METHOD)
    with pytest.raises(
        ValueError,
        match=r"^experts of type ExpertBank are not allowed with the routing-free router; expected an "
        r"ExpertBank with gate_rank=2 \(Routing-Free MoE gates each expert",
    ):
        layer.router(torch.randn(3, 8), moelab.experts.ExpertBank(4, 8, 6))
    with pytest.raises(
        ValueError, match=r"^from_hf\(method='routing-free'\) is not allowed: Routing-Free MoE "
    ):
        moelab.hf.convert.refuse_factorised_gates(METHOD, "from_hf")


def test_routing_free_keeps_lambda_float32_in_bf16_and_gates_in_float32_with_router_dtype():
    layer = moelab.MoE(8, 4, 2, method=METHOD).bfloat16()
    assert layer.router.rf_lambda.dtype == torch.float32 and layer.router.rf_pending.dtype == torch.float32
    layer = moelab.MoE(8, 4, 2, method=METHOD, router_dtype="float32", threshold=0.5).bfloat16()
    layer.router.float()
    x = torch.randn(6, 8, dtype=torch.bfloat16)
    assert layer(x).dtype == torch.bfloat16
    s = torch.linalg.vector_norm(x.float() @ layer.experts.gate_down.float().transpose(1, 2), dim=-1).T
    torch.testing.assert_close(layer.last_routing.logits, s - layer.router.gate_bias.detach())


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS_WITH_TRITON)
def test_routing_free_every_kernel_gives_the_literal_output_and_gradients(impl):
    check_kernel(METHOD, impl, threshold=0.5)


def test_routing_free_compiles_as_one_graph_and_equals_eager():
    check_compile(METHOD, steps=3, threshold=0.5, lambda_init=1e-3)


def test_routing_free_survives_save_and_load_with_its_coefficient(tmp_path):
    back = check_save_load(METHOD, tmp_path, threshold=0.5)
    assert float(back.router.rf_lambda) != 1e-10


def test_routing_free_runs_in_eval_without_any_expert_active():
    layer = make(METHOD, eval_threshold=1e6).eval()
    x = torch.randn(5, D)
    assert torch.equal(layer(x), torch.zeros_like(x))  # no expert reached its threshold
    assert not layer.last_routing.mask.any()


# ------------------------------------------------------------------ one process = 2 ranks
def _two_ranks(rank: int, world: int, state: dict, xs: list) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    layer = moelab.MoE(8, 4, 2, d_hidden=6, method=METHOD, threshold=0.5, lambda_init=1e-3).double()
    layer.load_state_dict(state)
    ctx = moelab.routing_context(layer, total_steps=10)
    model = DistributedDataParallel(layer)
    for x in xs:
        model(x[rank]).square().sum().backward()  # the layer adds the aux loss's gradient itself
        ctx.advance()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()}
    return {"lambda": layer.router.rf_lambda.clone(), "grads": grads}


def test_routing_free_two_ranks_equal_one_process_with_their_batches_as_micro_batches(tmp_path):
    """λ moves by the density of the step's pieces (micro-batches × ranks) pooled; the gradients
    are DDP's mean of the ranks'."""
    from test_parallelize import spawn

    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, d_hidden=6, method=METHOD, threshold=0.5, lambda_init=1e-3).double()
    state = copy.deepcopy(layer.state_dict())
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 12, 8, dtype=torch.float64, generator=gen) for _ in range(3)]
    ctx = moelab.routing_context(layer, total_steps=10)
    moelab.set_aux_scale(layer, 0.5)  # the mean of the two pieces' aux losses, as DDP averages the ranks'
    for x in xs:
        for part in x:
            (layer(part).square().sum() / 2).backward()
        ctx.advance()
    for r in spawn(_two_ranks, 2, tmp_path, state, xs):
        torch.testing.assert_close(r["lambda"], layer.router.rf_lambda, rtol=0, atol=0)
        for name, p in layer.named_parameters():
            torch.testing.assert_close(r["grads"][name], p.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_routing_free_refuses_expert_parallelism_in_one_line():
    from moelab.train.parallelize import ExpertParallel

    layer = moelab.MoE(8, 4, 2, method=METHOD)
    with pytest.raises(
        ValueError,
        match=r"^an ExpertBank with gate_rank=2 \(method='aoe' or 'routing-free'\) is not allowed with expert "
        r"parallelism",
    ):
        ExpertParallel()._apply(layer.experts, None)


def test_routing_free_balancing_objective_lowers_the_gates_of_a_dense_start_and_lambda_follows_the_density():
    """From every expert active (θ low), the objective alone (no task loss) lowers the gates, so the
    density falls; λ rises while the density is above K/N and falls once it is below."""
    torch.manual_seed(0)
    layer = moelab.MoE(16, 8, 2, method=METHOD, threshold=0.1, lambda_init=0.1, lambda_rate=0.5)
    ctx = moelab.routing_context(layer, total_steps=100)
    opt = torch.optim.Adam(layer.router.parameters(), lr=0.05)
    x = torch.randn(256, 16)
    densities, lambdas = [], []
    for _ in range(40):
        opt.zero_grad()
        (layer(x).sum() * 0).backward()  # no task loss: the gradient the layer adds is the objective's
        densities.append(float(layer.last_routing.mask.float().mean()))
        opt.step()
        ctx.advance()
        lambdas.append(float(layer.router.rf_lambda))
    assert densities[0] == 1.0 and densities[-1] < 0.25
    for rho, before, after in zip(densities[1:], lambdas, lambdas[1:]):
        assert after == pytest.approx(
            min(1.0, before * 1.5 ** (1 if rho > 0.25 else -1 if rho < 0.25 else 0))
        )
