"""``densemixer`` (DenseMixer, Yao et al. 2025): the sparse output with the router gradient of the dense
mixture, against a literal transcription of the authors' algorithm, as a preset and as the
``densemixer=True`` option of any softmax top-K method; and the layer grid."""

from __future__ import annotations

import copy

import pytest
import torch

import moelab
from router_grid import IMPLS_WITH_SLOW_TRITON, check_compile, check_kernel, check_save_load


def literal_densemixer(layer, x):
    """The authors' OLMoE/Qwen block step by step: softmax over N, top-K, the "partscale"
    renormalisation (chosen ``p / Σ_TopK p``, others ``p / (Σ_TopK p).detach()``), every expert on
    every token with its gradient masked to the tokens that chose it, a dense and a sparse sum, and
    ``sparse.detach() + (dense − dense.detach())``."""
    logits = layer.router.logits(x) if hasattr(layer.router, "logits") else layer.router(x).logits
    p = logits.softmax(dim=-1)
    top, chosen = p.topk(layer.top_k, dim=-1)
    if layer.router.renormalize:
        ratio = top.sum(-1, keepdim=True)
        top = top / ratio
        mask = torch.nn.functional.one_hot(chosen, layer.num_experts).sum(1).to(p.dtype)
        p = p * (1 - mask) / ratio.detach() + p * mask / ratio
    dense = torch.zeros_like(x)
    sparse = torch.zeros_like(x)
    for e in range(layer.num_experts):
        out = layer.experts.expert_forward(x, e)
        active = (chosen == e).any(1).to(x.dtype).unsqueeze(-1)
        out.register_hook(lambda g, m=active: g * m)
        dense = dense + out * p[:, e : e + 1]
        for t, k in zip(*torch.where(chosen == e)):
            sparse = sparse.index_add(0, t.view(1), out[t : t + 1] * top[t, k])
    return sparse.detach() + (dense - dense.detach())


def _grads(module, owner, x, g):
    x = x.clone().requires_grad_()
    owner.zero_grad(set_to_none=True)
    y = module(x)
    (y * g).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in owner.named_parameters() if p.grad is not None}


@pytest.mark.parametrize(
    ("method", "options"),
    [("densemixer", {}), ("densemixer", {"renormalize": False}), ("smoe", {"densemixer": True})],
)
def test_densemixer_equals_the_authors_algorithm_in_value_and_every_gradient(method, options):
    torch.manual_seed(0)
    layer = moelab.MoE(6, 5, 2, d_hidden=7, method=method, activation="swiglu", **options).double().train()
    twin = copy.deepcopy(layer)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(11, 6, generator=gen).double(), torch.randn(11, 6, generator=gen).double()
    y, xg, grads = _grads(layer, layer, x, g)
    y_ref, xg_ref, grads_ref = _grads(lambda v: literal_densemixer(twin, v), twin, x, g)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(xg, xg_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], grads_ref[name], msg=name)


def test_densemixer_keeps_the_sparse_output_and_expert_gradients_and_changes_only_the_router_gradient():
    torch.manual_seed(0)
    plain = moelab.MoE(8, 6, 2, method="smoe").double().train()
    dense = moelab.MoE(8, 6, 2, method="smoe", densemixer=True).double().train()
    dense.load_state_dict(plain.state_dict())
    x, g = torch.randn(20, 8).double(), torch.randn(20, 8).double()
    y0, xg0, g0 = _grads(plain, plain, x, g)
    y1, xg1, g1 = _grads(dense, dense, x, g)
    torch.testing.assert_close(y1, y0)
    for name in ("experts.w_in", "experts.w_out"):
        torch.testing.assert_close(g1[name], g0[name])
    assert not torch.allclose(g1["router.weight"], g0["router.weight"])
    assert not torch.allclose(xg1, xg0)  # the input reaches the loss through the router too
    # the router's gradient is the task gradient of Σ_i w̃_i <g, g_i(x)> over every expert
    with torch.no_grad():
        outs = dense.experts.forward_all(x)  # (T, N, d)
    scores = (outs * g.unsqueeze(1)).sum(-1)  # <∂L/∂y, g_i(x)>
    w = dense.router.weight.detach().clone().requires_grad_()
    p = (x @ w.T).softmax(-1)
    top = p.topk(2, dim=-1)
    ratio = top.values.sum(-1, keepdim=True)
    chosen = torch.zeros_like(p, dtype=torch.bool).scatter(1, top.indices, True)
    wt = torch.where(chosen, p / ratio, p / ratio.detach())
    (wt * scores).sum().backward()
    torch.testing.assert_close(g1["router.weight"], w.grad)


def test_densemixer_runs_sparse_in_evaluation_and_without_autograd(monkeypatch):
    layer = moelab.MoE(8, 4, 2, method="densemixer")
    calls = []
    monkeypatch.setattr(
        layer.experts, "forward_all", lambda x: calls.append(1) or (_ for _ in ()).throw(AssertionError)
    )
    layer.eval()(torch.randn(5, 8))
    with torch.no_grad():
        layer.train()(torch.randn(5, 8))
    assert calls == []


def test_densemixer_preset_is_smoe_with_the_option():
    layer = moelab.MoE(8, 4, 2, method="densemixer")
    assert layer.densemixer and layer.coefs == {"balance": 0.01, "z": 0.001}
    assert not moelab.MoE(8, 4, 2, method="smoe").densemixer
    assert not moelab.MoE(8, 4, 2, method="densemixer", densemixer=False).densemixer


@pytest.mark.parametrize(
    ("method", "value", "match"),
    [
        (
            "sigma-moe",
            True,
            r"^densemixer=True is not allowed with method='sigma-moe'; expected a method whose weights are its softmax probabilities",
        ),
        ("remoe", True, r"^densemixer=True is not allowed with method='remoe'"),
        ("competesmoe", True, r"^densemixer=True is not allowed with method='competesmoe'"),
        ("smoe", "yes", r"^densemixer='yes' is not allowed; expected True or False$"),
    ],
)
def test_densemixer_is_refused_where_it_is_not_defined(method, value, match):
    with pytest.raises(ValueError, match=match):
        moelab.MoE(8, 4, 2, method=method, densemixer=value)


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS_WITH_SLOW_TRITON)
def test_densemixer_every_kernel_gives_the_literal_output_and_gradients_in_evaluation(impl):
    check_kernel("densemixer", impl)


def test_densemixer_compiles_as_one_graph_and_equals_eager():
    check_compile("densemixer")


def test_densemixer_survives_save_and_load(tmp_path):
    assert check_save_load("densemixer", tmp_path).densemixer
    assert check_save_load("xmoe", tmp_path / "x", densemixer=True).densemixer


@pytest.mark.parametrize(("method", "options"), [("densemixer", {}), ("smoe", {"densemixer": True})])
def test_densemixer_from_hf_trains_densely_and_to_hf_exports_the_same_inference(method, options):
    """Its inference is ``smoe``'s: the transformers block expresses it (the training gradient
    stays behind), so ``to_hf`` gives the block back with the same outputs."""
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=8, intermediate_size=12, num_local_experts=4, num_experts_per_tok=2)
    block = MixtralSparseMoeBlock(cfg)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_()
    layer = moelab.from_hf(block, method=method, **options)
    assert layer.densemixer  # set_method carries the layer option
    x = torch.randn(2, 3, 8)
    expected = layer.eval()(x)
    back = moelab.to_hf(layer)
    out = back(x)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, expected, rtol=1e-5, atol=1e-6)
