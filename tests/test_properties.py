"""Property-based tests (hypothesis) for routers and dispatch over shapes, N, K and dtypes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moelab
from moelab.experts import ExpertBank, grouped_mm_available

SETTINGS = settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def layer_case(draw):
    num_experts = draw(st.integers(1, 9))
    top_k = draw(st.integers(1, num_experts))
    tokens = draw(st.integers(1, 40))
    d_model = draw(st.sampled_from([4, 8, 12]))
    method = draw(st.sampled_from(moelab.methods()))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2**16))
    return num_experts, top_k, tokens, d_model, method, dtype, seed


def reference_output(layer: moelab.MoE, x: torch.Tensor) -> torch.Tensor:
    """``Σ_k w_k expert_{i_k}(x)`` token by token (+ shared experts), from the last routing."""
    r = layer.last_routing
    rows = []
    for t in range(x.shape[0]):
        acc = sum(
            r.weights[t, k] * layer.experts.expert_forward(x[t : t + 1], int(r.indices[t, k]))
            for k in range(r.top_k)
        )
        rows.append(acc)
    y = torch.cat(rows)
    if layer.shared is not None:
        y = y + layer.shared(x)
    return y


@SETTINGS
@given(layer_case())
def test_every_method_satisfies_routing_invariants_and_matches_the_literal_sum(case):
    num_experts, top_k, tokens, d_model, method, dtype, seed = case
    torch.manual_seed(seed)
    layer = moelab.MoE(d_model, num_experts, top_k, d_hidden=6, method=method).to(dtype).eval()
    x = torch.randn(tokens, d_model, dtype=dtype)
    with torch.no_grad():
        y = layer(x)
    r = layer.last_routing
    assert y.shape == x.shape and torch.isfinite(y).all()
    assert r.indices.dtype == torch.int64 and r.indices.shape[0] == tokens
    assert ((r.indices >= 0) & (r.indices < num_experts)).all()
    assert (r.indices.sort(dim=-1).values.diff(dim=-1) != 0).all(), "experts repeat within a token"
    assert (r.weights >= 0).all()
    if method != "sigma-moe":  # σ-MoE does not renormalise
        torch.testing.assert_close(r.weights.sum(-1), torch.ones(tokens, dtype=dtype))
    with torch.no_grad():
        ref = reference_output(layer, x)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(y, ref, atol=tol, rtol=tol)


@SETTINGS
@given(
    st.integers(1, 8),
    st.integers(1, 64),
    st.sampled_from(["relu", "gelu", "silu", "swiglu"]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_loop_and_grouped_dispatch_agree_in_value_and_gradient(num_experts, tokens, act, bias, seed):
    if not grouped_mm_available(torch.device("cpu"), torch.float32):  # rows below are 16-byte aligned
        pytest.skip("grouped_mm is not available in this torch")
    torch.manual_seed(seed)
    top_k = min(2, num_experts)
    bank = ExpertBank(num_experts, 8, 16, activation=act, bias=bias)
    if bias:
        torch.nn.init.normal_(bank.b_in)
        torch.nn.init.normal_(bank.b_out)
    x = torch.randn(tokens, 8, requires_grad=True)
    logits = torch.randn(tokens, num_experts)
    weights, indices = moelab.functional.topk_softmax(logits, top_k)
    outs, grads = [], []
    for impl in ("loop", "grouped"):
        bank.impl = impl
        y = bank(x, indices, weights)
        g = torch.autograd.grad(y.square().sum(), [x, bank.w_in, bank.w_out])
        outs.append(y.detach())
        grads.append(g)
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
