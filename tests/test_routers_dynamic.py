"""``top-p`` (Huang et al. 2024, "Harder Tasks Need More Experts"): top-p routing against a literal
computation, its dynamic (entropy) loss, the balance over the active slots, and the layer grid."""

from __future__ import annotations

import math

import pytest
import torch

import moelab
from moelab.losses import switch_balance_loss, token_entropy_loss
from moelab.routers import build_router
from router_grid import IMPLS_WITH_SLOW_TRITON, check_compile, check_hf_refusal, check_kernel, check_save_load


def literal_top_p(x, weight, p, max_k=None):
    """Per token: the softmax; the experts by decreasing probability (ties by index); taken while
    the cumulative probability up to and with the previous expert is at most ``p``."""
    order, taken, probs = [], [], []
    for xt in x.tolist():
        logits = [sum(a * b for a, b in zip(xt, we)) for we in weight.tolist()]
        z = sum(math.exp(v) for v in logits)
        pr = [math.exp(v) / z for v in logits]
        idx = sorted(range(len(pr)), key=lambda i: (-pr[i], i))[: max_k or len(pr)]
        keep, cum = [], 0.0
        for i in idx:
            keep.append(cum <= p)
            cum += pr[i]
        order.append(idx)
        taken.append(keep)
        probs.append(pr)
    return torch.tensor(order), torch.tensor(taken), torch.tensor(probs, dtype=x.dtype)


@pytest.mark.parametrize(("p", "max_k"), [(0.4, None), (0.7, None), (0.9, 2)])
def test_top_p_takes_experts_until_their_probability_exceeds_p(p, max_k):
    router = build_router("top-p", 6, 5, 2, threshold=p, max_k=max_k).double()
    with torch.no_grad():
        router.weight.mul_(3)  # spread the probabilities so that tokens take different numbers
    x = torch.randn(40, 6, dtype=torch.float64)
    r = router(x)
    order, taken, probs = literal_top_p(x, router.weight.detach(), p, max_k)
    assert r.indices.tolist() == order.tolist()
    assert r.mask.tolist() == taken.tolist()
    torch.testing.assert_close(r.probs, probs)
    expected = torch.where(taken, probs.gather(1, order), torch.zeros(()).double())
    torch.testing.assert_close(r.weights, expected)  # the probabilities themselves, not renormalised
    counts = r.mask.sum(1)
    assert counts.min() >= 1 and counts.max() <= (max_k or 5)
    assert len(set(counts.tolist())) > 1  # a variable number of experts per token


def test_top_p_losses_are_the_token_entropy_and_the_balance_over_active_slots():
    layer = moelab.MoE(6, 5, 2, method="top-p").double()
    assert layer.coefs == {"balance": 0.01, "dynamic": 1e-4}
    x = torch.randn(12, 6, dtype=torch.float64)
    layer(x)
    r = layer.last_routing
    probs = r.probs.tolist()
    entropy = -sum(sum(q * math.log(q) for q in row) for row in probs) / len(probs)
    assert r.losses["dynamic"].item() == pytest.approx(entropy, rel=1e-8)
    active = [e for row, keep in zip(r.indices.tolist(), r.mask.tolist()) for e, k in zip(row, keep) if k]
    f = [active.count(e) / len(active) for e in range(5)]
    mean_p = [sum(row[e] for row in probs) / len(probs) for e in range(5)]
    balance = 5 * sum(a * b for a, b in zip(f, mean_p))
    assert layer.aux_loss.item() == pytest.approx(0.01 * balance + 1e-4 * entropy, rel=1e-8)
    # the mask changes the balance: the unmasked T·K slots would count every expert equally often
    unmasked = switch_balance_loss(r.probs, r.indices, 5)
    assert unmasked.item() == pytest.approx(1.0) and balance != pytest.approx(1.0)


def test_token_entropy_loss_is_zero_for_one_hot_and_log_n_for_uniform():
    one_hot = torch.eye(4)
    assert token_entropy_loss(one_hot).item() == pytest.approx(0.0, abs=1e-7)
    assert token_entropy_loss(torch.full((3, 4), 0.25)).item() == pytest.approx(math.log(4))


def test_top_p_dynamic_loss_lowers_the_experts_a_token_takes():
    """The dynamic loss sharpens the router: trained on it alone, tokens take fewer experts."""
    torch.manual_seed(0)
    layer = moelab.MoE(8, 8, 2, method="top-p", threshold=0.6, balance_coef=0.0, dynamic_coef=1.0)
    opt = torch.optim.Adam(layer.router.parameters(), lr=0.05)
    x = torch.randn(64, 8)
    layer(x)
    before = layer.last_routing.mask.sum(1).float().mean().item()
    for _ in range(30):
        opt.zero_grad()
        (layer(x).sum() * 0.0).backward()  # the aux loss alone (its gradient rides on the output's graph)
        opt.step()
    layer(x)
    assert before > 2.0 and layer.last_routing.mask.sum(1).float().mean().item() < 1.5


def test_top_p_router_trains_from_the_task_loss():
    layer = moelab.MoE(8, 4, 2, method="top-p")
    layer(torch.randn(16, 8)).square().mean().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"threshold": 1.0}, r"^threshold=1.0 is not allowed; expected a number in \(0, 1\)$"),
        ({"threshold": 0.0}, r"^threshold=0.0 is not allowed; expected a number in \(0, 1\)$"),
        ({"threshold": 1.5}, r"^threshold=1.5 is not allowed; expected a number in \(0, 1\)$"),
        ({"max_k": 5}, r"^max_k=5 is not allowed; expected an integer in \[1, 4\]$"),
        ({"init_std": 0.0}, r"^init_std=0.0 is not allowed; expected a number > 0$"),
    ],
)
def test_top_p_options_are_validated(options, match):
    with pytest.raises(ValueError, match=match):
        moelab.MoE(8, 4, 2, method="top-p", **options)


def test_top_p_max_k_is_the_width_of_the_routing():
    layer = moelab.MoE(8, 6, 2, method="top-p", max_k=3)
    layer(torch.randn(5, 8))
    assert layer.last_routing.indices.shape == (5, 3)


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS_WITH_SLOW_TRITON)
def test_top_p_every_kernel_gives_the_literal_output_and_gradients(impl):
    check_kernel("top-p", impl)


@pytest.mark.slow  # the masked dispatch under compile: remoe's default test runs it
def test_top_p_compiles_as_one_graph_and_equals_eager():
    check_compile("top-p")


def test_top_p_survives_save_and_load(tmp_path):
    back = check_save_load("top-p", tmp_path, threshold=0.5, max_k=3)
    assert back.router.threshold == 0.5 and back.router.max_k == 3


def test_top_p_from_hf_runs_and_to_hf_refuses_in_one_line():
    check_hf_refusal("top-p")


@pytest.mark.parametrize(
    "method", ["top-p", "remoe", "expert-choice", "moepp", "expert-threshold", "routing-free"]
)
@pytest.mark.parametrize("scope", ["sequence", "global"])
def test_variable_k_methods_take_the_micro_balance_scope_only(method, scope):
    with pytest.raises(
        ValueError,
        match=rf"^balance_scope='{scope}' is not allowed with method='{method}': it routes a variable number "
        r"of experts per token, which only the 'micro' scope counts; expected 'micro'$",
    ):
        moelab.MoE(8, 4, 2, method=method, balance_scope=scope)
    assert moelab.MoE(8, 4, 2, method=method, balance_scope="micro").balance_scope == "micro"


@pytest.mark.parametrize(("method", "width"), [("top-p", 4), ("moepp", 8)])
def test_the_selection_bias_moves_once_per_step_from_the_load_of_the_taken_experts(method, width):
    """top-p counts the experts a token took (not the K_max slots); moepp's bias spans its
    zero-computation experts too."""
    torch.manual_seed(0)
    layer = moelab.MoE(6, 4, 2, method=method, selection_bias=True, bias_update_rate=0.01).train()
    ctx = moelab.RoutingContext()
    moelab.attach(layer, ctx)
    total = torch.zeros(width)
    for _ in range(3):
        layer(torch.randn(8, 6)).sum().backward()
        r = layer.last_routing
        taken = r.indices if method == "moepp" else r.indices[r.mask]
        total += torch.bincount(taken.reshape(-1), minlength=width).float()
    assert torch.equal(layer.router.selection_bias, torch.zeros(width))
    ctx.advance()
    torch.testing.assert_close(layer.router.selection_bias, 0.01 * torch.sign(total.mean() - total))


@pytest.mark.parametrize("method", ["remoe", "expert-choice", "expert-threshold", "routing-free"])
def test_routers_without_a_choice_to_shift_refuse_the_selection_bias(method):
    with pytest.raises(
        ValueError, match=rf"^option 'selection_bias' is not accepted by method='{method}'; allowed: "
    ):
        moelab.MoE(8, 4, 2, method=method, selection_bias=True)
