"""``remoe`` (ReMoE, Wang et al. 2025): ReLU routing against a literal computation, the adaptive L1
coefficient of the step hook, the skipped compute of inactive experts, and the layer grid."""

from __future__ import annotations

import math

import pytest
import torch

import moelab
from moelab.experts.dispatch import dispatch_masked
from moelab.losses import relu_l1_balance_loss
from moelab.routers import build_router
from router_grid import IMPLS_WITH_TRITON, check_compile, check_hf_refusal, check_kernel, check_save_load


def literal_relu_routing(x, weight):
    """Per token: the gates ``max(0, <w_e, x>)``, the experts in decreasing gate order (ties by
    index), and which are active (a positive gate)."""
    order, gates_sorted, gates = [], [], []
    for xt in x.tolist():
        g = [max(0.0, sum(a * b for a, b in zip(xt, we))) for we in weight.tolist()]
        idx = sorted(range(len(g)), key=lambda i: (-g[i], i))
        gates.append(g)
        order.append(idx)
        gates_sorted.append([g[i] for i in idx])
    return torch.tensor(order), torch.tensor(gates_sorted, dtype=x.dtype), torch.tensor(gates, dtype=x.dtype)


def literal_l1(gates, k):
    """ReMoE §3, the L1 with load balancing: ``(1/T) Σ_t Σ_e f_e R_te`` with ``f_e = N/(K T) · #{t: R_te > 0}``."""
    rows = gates.tolist()
    t_count, n = len(rows), len(rows[0])
    f = [n / (k * t_count) * sum(1 for r in rows if r[e] > 0) for e in range(n)]
    return sum(f[e] * r[e] for r in rows for e in range(n)) / t_count


def test_remoe_routes_every_expert_with_a_positive_relu_gate_weighted_by_it():
    router = build_router("relu", 6, 5, 2).double()
    x = torch.randn(9, 6, dtype=torch.float64)
    r = router(x)
    order, w, gates = literal_relu_routing(x, router.weight.detach())
    assert r.indices.shape == (9, 5)
    assert r.indices.tolist() == order.tolist()
    torch.testing.assert_close(r.weights, w, rtol=1e-12, atol=0)
    assert r.mask.tolist() == (w > 0).tolist()
    assert r.probs is None
    torch.testing.assert_close(r.logits, x @ router.weight.detach().T)
    # the loss: λ₀ = 1e-8 times the L1 with load balancing
    assert r.losses["l1"].item() == pytest.approx(1e-8 * literal_l1(gates, 2), rel=1e-10)
    assert relu_l1_balance_loss(gates, 2).item() == pytest.approx(literal_l1(gates, 2), rel=1e-12)


def test_remoe_preset_defaults_follow_the_authors_code():
    layer = moelab.MoE(8, 4, 2, method="remoe")
    assert layer.coefs == {"l1": 1.0}
    assert layer.router.l1_lambda.item() == pytest.approx(1e-8)
    assert layer.router.l1_multiplier == 1.2
    assert layer.router.target_sparsity == 0.5
    assert not layer.router.weights_sum_to_one


def test_remoe_layer_aux_loss_is_the_adaptive_l1_term():
    layer = moelab.MoE(6, 4, 2, method="remoe", l1_coef=3.0).double()
    x = torch.randn(10, 6, dtype=torch.float64)
    layer(x)
    gates = torch.relu(x @ layer.router.weight.detach().T)
    assert layer.aux_loss.item() == pytest.approx(3.0 * 1e-8 * literal_l1(gates, 2), rel=1e-10)


def _remoe(rate: float = 1.2, **kw) -> tuple[moelab.MoE, moelab.RoutingContext]:
    torch.manual_seed(0)
    layer = moelab.MoE(6, 4, 2, method="remoe", l1_multiplier=rate, **kw).train()
    ctx = moelab.RoutingContext()
    moelab.attach(layer, ctx)
    return layer, ctx


@pytest.mark.parametrize(("shift", "factor"), [(5.0, 1.2), (-5.0, 1 / 1.2)])
def test_remoe_lambda_grows_while_too_dense_and_shrinks_while_too_sparse(shift, factor):
    layer, ctx = _remoe()
    with torch.no_grad():
        layer.router.weight.zero_()
    x = torch.full((8, 6), shift / 6)
    with torch.no_grad():
        layer.router.weight[:, 0] = 1.0  # every gate is `shift`: all active (dense) or none (sparse)
    layer(x)
    assert layer.router.l1_lambda.item() == pytest.approx(1e-8)  # the forward changes nothing
    ctx.advance()
    assert layer.router.l1_lambda.item() == pytest.approx(1e-8 * factor, rel=1e-6)
    assert not layer.router.pending_active.any()


def test_remoe_lambda_stays_at_the_target_sparsity_and_without_a_training_forward():
    router = build_router("relu", 4, 4, 2)
    router.pending_active += torch.tensor([16.0, 32.0])  # sparsity 0.5 = 1 - K/N
    router.on_step()
    assert router.l1_lambda.item() == pytest.approx(1e-8)
    router.on_step()  # no forward since: nothing to measure
    assert router.l1_lambda.item() == pytest.approx(1e-8)
    layer, ctx = _remoe()
    layer.eval()
    layer(torch.randn(8, 6))
    ctx.advance()  # evaluation forwards are not counted
    assert layer.router.l1_lambda.item() == pytest.approx(1e-8)


def test_remoe_lambda_counts_the_micro_batches_of_one_step_together():
    layer, ctx = _remoe()
    micro = [torch.randn(8, 6) for _ in range(3)]
    active = 0
    for x in micro:
        (layer(x).sum() + layer.aux_loss).backward()
        active += int(layer.last_routing.mask.sum())
    assert layer.router.pending_active.tolist() == [active, 3 * 8 * 4]
    ctx.advance()
    sparsity = 1 - active / 96
    expected = 1e-8 * 1.2 ** (math.copysign(1, 0.5 - sparsity) if sparsity != 0.5 else 0)
    assert layer.router.l1_lambda.item() == pytest.approx(expected, rel=1e-6)


def test_remoe_lambda_brings_the_active_experts_to_k_in_training():
    """The mechanism end to end: the coefficient rises until about K of N experts are active per
    token, then hovers there (compressed here by a large ``λ₀`` and multiplier).  The tokens are
    not centred: a router without bias activates half of the experts on centred symmetric tokens
    whatever its weights, as no trained model's hidden states are."""
    torch.manual_seed(0)
    layer = moelab.MoE(16, 8, 2, method="remoe", l1_init=1e-4, l1_multiplier=1.5)
    ctx = moelab.RoutingContext()
    moelab.attach(layer, ctx)
    opt = torch.optim.Adam(layer.parameters(), lr=1e-2)
    x, target = torch.randn(128, 16) + 1.0, torch.randn(128, 16)
    active = []
    for _ in range(100):
        opt.zero_grad()
        ((layer(x) - target).square().mean() + layer.aux_loss).backward()
        opt.step()
        ctx.advance()
        active.append(layer.last_routing.mask.sum(1).float().mean().item())
    assert active[0] > 4.0  # about N/2 at the start
    assert abs(sum(active[-40:]) / 40 - 2.0) < 0.4


class _CountingExperts(torch.nn.Module):
    """A bank that records how many rows each call gets and returns ``w · (e + 1) · x``."""

    num_experts, d_model = 4, 3

    def __init__(self):
        super().__init__()
        self.rows = []

    def mix(self, x, indices, weights):
        self.rows.append(x.shape[0])
        return ((indices + 1).to(x.dtype) * weights).sum(1, keepdim=True) * x


def test_masked_dispatch_runs_only_the_active_slots():
    bank = _CountingExperts()
    x = torch.randn(3, 3)
    indices = torch.tensor([[2, 0, 1], [1, 3, 0], [0, 1, 2]])
    weights = torch.tensor([[0.5, 0.0, 0.0], [0.2, 0.3, 0.0], [0.0, 0.0, 0.0]])
    mask = weights > 0
    y = dispatch_masked(bank, x, indices, weights, mask)
    assert bank.rows == [3]  # three active slots of nine
    expected = torch.stack([0.5 * 3 * x[0], (0.2 * 2 + 0.3 * 4) * x[1], torch.zeros(3)])
    torch.testing.assert_close(y, expected)


def test_remoe_token_without_an_active_expert_outputs_zero():
    layer = moelab.MoE(4, 3, 1, method="remoe")
    with torch.no_grad():
        layer.router.weight.copy_(-torch.eye(3, 4))
    x = torch.tensor([[1.0, 1.0, 1.0, 0.0], [-1.0, 1.0, 1.0, 0.0]])
    y = layer(x)
    assert not layer.last_routing.mask[0].any() and layer.last_routing.mask[1].tolist() == [
        True,
        False,
        False,
    ]
    assert torch.equal(y[0], torch.zeros(4)) and y[1].abs().sum() > 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"l1_multiplier": 1.0}, r"^l1_multiplier=1.0 is not allowed; expected a number > 1$"),
        ({"l1_multiplier": 0.0}, r"^l1_multiplier=0.0 is not allowed; expected a number > 1$"),
        ({"l1_init": 0.0}, r"^l1_init=0.0 is not allowed; expected a number > 0$"),
        ({"init_std": -1.0}, r"^init_std=-1.0 is not allowed; expected a number > 0$"),
    ],
)
def test_remoe_options_are_validated(options, match):
    with pytest.raises(ValueError, match=match):
        moelab.MoE(8, 4, 2, method="remoe", **options)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_remoe_lambda_stays_float32_in_a_low_precision_model(dtype):
    layer = moelab.MoE(8, 4, 2, method="remoe").to(dtype)
    assert layer.router.weight.dtype == dtype
    assert (
        layer.router.l1_lambda.dtype == torch.float32 and layer.router.pending_active.dtype == torch.float32
    )


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS_WITH_TRITON)
def test_remoe_every_kernel_gives_the_literal_output_and_gradients(impl):
    check_kernel("remoe", impl)


def test_remoe_compiles_as_one_graph_and_equals_eager():
    check_compile("remoe")


def test_remoe_survives_save_and_load_with_its_lambda(tmp_path):
    back = check_save_load("remoe", tmp_path)
    assert back.router.l1_lambda.item() != pytest.approx(1e-8)  # the steps moved it, and it came back


def test_remoe_from_hf_runs_and_to_hf_refuses_in_one_line():
    check_hf_refusal("remoe")


# ------------------------------------------------------------------ diagnostics
def test_remoe_diagnostics_count_only_the_active_experts_and_swap_refuses():
    from moelab import metrics

    layer = moelab.MoE(4, 3, 1, method="remoe")
    with torch.no_grad():
        layer.router.weight.copy_(torch.eye(3, 4))
    x = torch.tensor([[1.0, -1.0, -1.0, 0.0], [1.0, 1.0, -1.0, 0.0], [-1.0, -1.0, -1.0, 0.0]])
    loads = metrics.load_cv(layer, [x])
    assert loads[0]["load"] == [2 / 3, 1 / 3, 0.0]  # three active slots: expert 0 twice, expert 1 once
    layer(x)
    load = torch.tensor([2.0, 1.0, 0.0])
    expected_cv = float(load.std(unbiased=False) / load.mean())
    assert metrics.routing_summary(layer)["load_cv"] == pytest.approx(expected_cv)
    assert len(metrics.competition_overlap(layer, [x])) == 1  # the router's K best against the K winners
    with pytest.raises(
        ValueError,
        match=r"^swap_top1 is not allowed on MoE layer 0 \(method='remoe'\): it routes a variable number "
        r"of experts per token, so there is no K-th expert to replace$",
    ):
        with metrics.swap_top1(layer):
            pass


@pytest.mark.parametrize("method", ["remoe", "top-p", "expert-choice"])
def test_masked_dispatch_off_the_cpu_sums_each_row_into_its_own_slot(monkeypatch, method):
    """The path of other devices (no ``index_add`` of rows into tokens: a ``(T·K, d)`` buffer summed
    over K), run here on the CPU: the literal output and gradients."""
    from moelab.experts import dispatch

    monkeypatch.setattr(dispatch, "_scatter_adds", lambda device: False)
    check_kernel(method, "loop")
