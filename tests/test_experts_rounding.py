"""Token rounding (SonicMoE, arXiv 2512.14080): each expert's token count rounded to a multiple of the
GEMM tile in training, against a literal re-reading of SonicMoE's ``forward_token_choice_rounding``
(the pairs, weights, output and gradients, every kernel), on any fixed top-K router; evaluation
keeps the router's top-K; the refusals; compile and save/load."""

from __future__ import annotations

import copy

import pytest
import torch

import moelab
from router_grid import IMPLS_WITH_TRITON, check_compile, check_save_load

D, H, N, K = 8, 12, 4, 2


def sonicmoe_token_rounding(logits, k, tile, mode):
    """SonicMoE ``benchmarks/moe-token-rounding.py``, ``forward_token_choice_rounding``, step by step
    (its argsort made stable): ``(scores of the kept pairs, their tokens, their experts)``."""
    t, e = logits.shape
    scores = logits.softmax(dim=-1)
    values, indices = scores.topk(k, dim=-1)  # the token choice
    freq = torch.bincount(indices.view(-1), minlength=e)
    rounded = {
        "up": torch.ceil(freq / tile) * tile,
        "down": freq // tile * tile,
        "nearest": torch.round(freq / tile) * tile,
    }[mode].long()
    values = values / values.sum(dim=-1, keepdim=True)
    combined = scores.scatter(-1, indices, values).detach()
    combined -= 1  # the others below every chosen pair, in their scores' order
    combined.scatter_(1, indices, values.detach())
    order = combined.argsort(dim=0, descending=True, stable=True)  # each expert's tokens
    keep = torch.arange(t)[:, None].expand(-1, e) < rounded[None, :]
    tokens = order[keep]
    experts = torch.arange(e)[None, :].expand(t, -1)[keep]
    return scores[tokens, experts], tokens, experts


def _pairs(routing):
    tokens = torch.arange(routing.indices.shape[0]).unsqueeze(1).expand_as(routing.indices)
    return sorted(zip(tokens[routing.mask].tolist(), routing.indices[routing.mask].tolist()))


def _layer(mode, impl="auto", **kw):
    torch.manual_seed(0)
    layer = moelab.MoE(D, N, K, d_hidden=H, activation="swiglu", bias=True, impl=impl,
                       token_rounding=mode, rounding_tile=4, balance_coef=0.0, z_coef=0.0, **kw)  # fmt: skip
    with torch.no_grad():
        layer.experts.b_in.normal_()
        layer.experts.b_out.normal_()
    return layer


@pytest.mark.parametrize("mode", ["up", "down", "nearest"])
def test_token_rounding_keeps_sonicmoes_pairs_weights_output_and_gradients(mode):
    layer = _layer(mode).double()
    x = torch.randn(26, D, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    g = torch.randn(26, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    xa = x.clone().requires_grad_()
    y = layer(xa)
    (y * g).sum().backward()
    got = {n: p.grad.clone() for n, p in layer.named_parameters()}
    r = layer.last_routing

    layer.zero_grad()
    xb = x.clone().requires_grad_()
    scores, tokens, experts = sonicmoe_token_rounding(layer.router.logits(xb), K, 4, mode)
    assert _pairs(r) == sorted(zip(tokens.tolist(), experts.tolist()))
    ref = torch.zeros_like(xb)
    for s, t, e in zip(scores, tokens.tolist(), experts.tolist()):
        ref = ref.index_add(0, torch.tensor([t]), s * layer.experts.expert_forward(xb[t : t + 1], e))
    torch.testing.assert_close(y, ref, rtol=1e-10, atol=1e-12)
    for t, e, s in zip(tokens.tolist(), experts.tolist(), scores):  # the weights: the softmax over all N
        assert r.weights[t][r.indices[t] == e].item() == pytest.approx(s.item(), rel=1e-12)
    (ref * g).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-12)
    for name, p in layer.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-10, atol=1e-12, msg=name)
    counts = torch.bincount(r.indices[r.mask], minlength=N)
    assert ((counts % 4 == 0) | (counts == 26)).all()


@pytest.mark.parametrize("method", ["smoe", "sharede-v3", "deepseek-v4", "quantile-balancing", "xmoe"])
def test_token_rounding_is_an_option_of_every_top_k_router(method):
    torch.manual_seed(0)
    layer = moelab.MoE(D, N, K, method=method, token_rounding="up", rounding_tile=8, num_shared=0)
    layer(torch.randn(30, D)).sum().backward()
    r = layer.last_routing
    counts = torch.bincount(r.indices[r.mask], minlength=N)
    assert ((counts % 8 == 0) | (counts == 30)).all() and (counts >= 15).any()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in layer.router.parameters())


def test_token_rounding_applies_in_training_only():
    layer = _layer("down").eval()
    plain = moelab.MoE(
        D, N, K, d_hidden=H, activation="swiglu", bias=True, balance_coef=0.0, z_coef=0.0
    ).eval()
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(13, D)
    with moelab.recording_routing(layer):
        y = layer(x)
    assert layer.last_routing.mask is None and layer.last_routing.indices.shape == (13, K)
    torch.testing.assert_close(y, plain(x), rtol=0, atol=0)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"method": "top-p"}, "and a variable number of experts per token"),
        ({"capacity_factor": 1.0}, "and capacity_factor=1.0"),
        ({"densemixer": True}, "and densemixer=True"),
        ({"method": "competesmoe"}, r"and experts it runs itself \(competition\)"),
        ({"balance_scope": "global"}, "and balance_scope='global', which counts K slots a token"),
    ],
)
def test_token_rounding_refusals_are_one_line(options, match):
    with pytest.raises(
        ValueError, match=rf"^token_rounding='up' is not allowed with method='\S+' {match}; "
    ) as e:
        moelab.MoE(D, N, K, token_rounding="up", **options)
    assert "\n" not in str(e.value)
    with pytest.raises(
        ValueError, match=r"^rounding_tile=8 is not allowed without token_rounding; expected "
    ):
        moelab.MoE(D, N, K, rounding_tile=8)
    with pytest.raises(ValueError, match=r"token_rounding='sideways' is not allowed"):
        moelab.MoE(D, N, K, token_rounding="sideways")


@pytest.mark.parametrize("impl", IMPLS_WITH_TRITON)
def test_token_rounding_every_kernel_gives_the_literal_output_and_gradients(impl):
    layer = _layer("up", impl=impl)
    twin = copy.deepcopy(layer)
    x = torch.randn(13, D, generator=torch.Generator().manual_seed(5))
    g = torch.randn(13, D, generator=torch.Generator().manual_seed(6))
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    (layer(xa) * g).sum().backward()
    scores, tokens, experts = sonicmoe_token_rounding(twin.router.logits(xb), K, 4, "up")
    ref = torch.stack([
        sum((s * twin.experts.expert_forward(xb[t : t + 1], e)[0]
             for s, tt, e in zip(scores, tokens.tolist(), experts.tolist()) if tt == t), xb.new_zeros(D))
        for t in range(13)
    ])  # fmt: skip
    (ref * g).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-5, atol=1e-6)
    for (name, p), (_, q) in zip(layer.named_parameters(), twin.named_parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_token_rounding_compiles_as_one_graph_and_equals_eager():
    check_compile("smoe", steps=2, token_rounding="up", rounding_tile=4)


def test_token_rounding_survives_save_and_load(tmp_path):
    back = check_save_load("smoe", tmp_path, token_rounding="nearest", rounding_tile=4)
    assert back.config.token_rounding == "nearest" and back.config.rounding_tile == 4
