"""The grid every router preset of the recent papers passes (tests/test_routers_<family>.py): each
expert kernel against the literal per-token sum (output and gradients), ``torch.compile`` against
eager, ``moelab.save`` / ``moelab.load``, and ``from_hf`` / ``to_hf`` where transformers has no
counterpart (a one-line refusal)."""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch

import moelab
from moelab.experts import grouped_mm_available

if not torch.cuda.is_available() and importlib.util.find_spec("triton") is not None:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports the triton kernels

D, H, N, K = 8, 12, 4, 2


def _triton_runs() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    from moelab.experts import triton_kernels

    return triton_kernels.available(torch.device("cpu"), torch.float32)


#: every kernel that runs here; triton under its interpreter in float32
IMPLS = ["loop", "stream", "auto"] + (
    ["grouped"] if grouped_mm_available(torch.device("cpu"), torch.float32) else []
)
IMPLS_WITH_TRITON = [
    *IMPLS,
    pytest.param("triton", marks=pytest.mark.skipif(not _triton_runs(), reason="no triton")),
]
#: the same, triton (its interpreter: about a second) in the slow suite only: for the presets whose
#: dispatch path another preset's default test already runs through triton
IMPLS_WITH_SLOW_TRITON = [
    *IMPLS,
    pytest.param(
        "triton", marks=[pytest.mark.slow, pytest.mark.skipif(not _triton_runs(), reason="no triton")]
    ),
]


def doc_inputs(layer: moelab.MoE, x: torch.Tensor) -> dict:
    """The forward's extra inputs: for a router that routes by document (EMO), two documents per
    sequence (ids 7 and 3: any integers); nothing for the others."""
    if not layer.router.takes_doc_ids:
        return {}
    s = x.shape[-2]
    return {"doc_ids": torch.where(torch.arange(s) < s // 2, 7, 3).expand(x.shape[:-1]).contiguous()}


def router_docs(layer: moelab.MoE, x: torch.Tensor) -> dict:
    """:func:`doc_inputs` as the layer hands them to its router for a 2-D ``x`` (one sequence)."""
    from moelab.functional import document_index

    given = doc_inputs(layer, x)
    if not given:
        return {}
    ids = given["doc_ids"].reshape(-1)
    return {"doc_ids": document_index(ids, torch.zeros_like(ids))}


def make(method: str, impl: str = "auto", **options) -> moelab.MoE:
    torch.manual_seed(0)
    return moelab.MoE(
        D, N, K, d_hidden=H, method=method, activation="swiglu", bias=True, impl=impl, **options
    )


def literal_output(layer: moelab.MoE, x: torch.Tensor) -> torch.Tensor:
    """``Σ_{active k} w_k · expert_{i_k}(x_t)`` (+ the router's own experts' output) one token at a
    time, the routing recomputed with autograd (so gradients flow to the router and the experts as
    in the layer)."""
    r = layer.router(x, layer.experts, layer.ctx, **router_docs(layer, x))
    xin = x if r.inputs is None else r.inputs  # the experts' input, where the router changes it
    rows = []
    for t in range(x.shape[0]):
        y = x.new_zeros(D)
        for k in range(r.indices.shape[1]):
            if r.mask is None or bool(r.mask[t, k]):
                y = (
                    y
                    + r.weights[t, k] * layer.experts.expert_forward(xin[t : t + 1], int(r.indices[t, k]))[0]
                )
        if r.direct is not None:  # the experts the router ran itself (MoE++)
            y = y + r.direct[t]
        rows.append(y)
    return torch.stack(rows)


def check_kernel(method: str, impl: str, train: bool = False, **options) -> None:
    """The layer with kernel ``impl``: the literal output, and the gradients of ``<y, g>`` for the
    input, the router and every expert weight (in evaluation; ``train``: in training, the random
    draws of both forwards from one seed)."""
    layer = make(method, impl=impl, **options).train(train)
    with torch.no_grad():
        layer.experts.b_in.normal_()
        layer.experts.b_out.normal_()
    twin = copy.deepcopy(layer)
    gen = torch.Generator().manual_seed(5)
    x, g = torch.randn(13, D, generator=gen), torch.randn(13, D, generator=gen)
    results = []
    for module, fn in ((layer, layer), (twin, lambda v: literal_output(twin, v))):
        xi = x.clone().requires_grad_()
        torch.manual_seed(7)
        y = fn(xi, **doc_inputs(layer, xi)) if module is layer else fn(xi)
        (y * g).sum().backward()
        grads = {n: p.grad for n, p in module.named_parameters() if p.requires_grad}
        results.append((y.detach(), xi.grad, grads))
    (y, xg, grads), (y_ref, xg_ref, grads_ref) = results
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(xg, xg_ref, rtol=1e-5, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        if grads_ref[name] is None:
            assert grads[name] is None or not grads[name].any(), name
        else:
            torch.testing.assert_close(grads[name], grads_ref[name], rtol=1e-5, atol=1e-6, msg=name)


def _step(module, owner, x, g):
    x = x.clone().requires_grad_()
    owner.zero_grad(set_to_none=True)
    y = module(x, **doc_inputs(owner, x))
    ((y * g).sum() + owner.aux_loss).backward()
    return y.detach(), x.grad, {n: p.grad for n, p in owner.named_parameters()}, owner.aux_loss.detach()


def check_compile(method: str, steps: int = 2, **options) -> None:
    """Training steps (task + aux loss, then ``ctx.advance()``) of a ``torch.compile``-d copy
    (``aot_eager``, ``fullgraph=True``: no graph break) equal the eager ones, and so do the
    router's buffers after the step hooks."""
    torch._dynamo.reset()
    eager = make(method, **options).train()
    owner = copy.deepcopy(eager)
    compiled = torch.compile(owner, backend="aot_eager", fullgraph=True)
    ctx_e, ctx_c = moelab.RoutingContext(total_steps=10), moelab.RoutingContext(total_steps=10)
    moelab.attach(eager, ctx_e)
    moelab.attach(owner, ctx_c)
    gen = torch.Generator().manual_seed(1)
    try:
        for _ in range(steps):
            x, g = torch.randn(32, D, generator=gen), torch.randn(32, D, generator=gen)
            torch.manual_seed(3)
            got = _step(compiled, owner, x, g)
            torch.manual_seed(3)
            want = _step(eager, eager, x, g)
            for a, b in zip(got[:2] + got[3:], want[:2] + want[3:]):
                torch.testing.assert_close(a, b)
            assert got[2].keys() == want[2].keys()
            for name in want[2]:
                torch.testing.assert_close(got[2][name], want[2][name], msg=name)
            ctx_e.advance()
            ctx_c.advance()
        for (name, a), (_, b) in zip(eager.router.named_buffers(), owner.router.named_buffers()):
            torch.testing.assert_close(a, b, msg=name)
    finally:
        torch._dynamo.reset()


def check_checkpointed_compile(method: str, steps: int = 3, **options) -> None:
    """Training steps of the layer ``torch.compile``-d (``fullgraph=True``) inside non-reentrant
    activation checkpointing (the forward recomputed in the backward) equal the eager ones, and so
    do the router's buffers after the step hooks: a training forward's state changes once."""
    from torch.utils.checkpoint import checkpoint

    torch._dynamo.reset()
    eager = make(method, **options).train()
    owner = copy.deepcopy(eager)
    compiled = torch.compile(owner, backend="aot_eager", fullgraph=True)
    ctx_e, ctx_c = moelab.RoutingContext(total_steps=10), moelab.RoutingContext(total_steps=10)
    moelab.attach(eager, ctx_e)
    moelab.attach(owner, ctx_c)
    gen = torch.Generator().manual_seed(1)
    try:
        for step in range(steps):
            x, g = torch.randn(3, 10, D, generator=gen), torch.randn(3, 10, D, generator=gen)
            docs = doc_inputs(eager, x)
            torch.manual_seed(step)
            y = eager(x, **docs)
            ((y * g).sum() + eager.aux_loss).backward()
            torch.manual_seed(step)
            yc = checkpoint(lambda v, d=docs: compiled(v, **d), x, use_reentrant=False)
            ((yc * g).sum() + owner.aux_loss).backward()
            torch.testing.assert_close(yc, y)
            for (name, a), (_, b) in zip(eager.named_parameters(), owner.named_parameters()):
                torch.testing.assert_close(b.grad, a.grad, msg=name)
            ctx_e.advance()
            ctx_c.advance()
            eager.zero_grad()
            owner.zero_grad()
        for (name, a), (_, b) in zip(eager.router.named_buffers(), owner.router.named_buffers()):
            torch.testing.assert_close(a, b, msg=name)
    finally:
        torch._dynamo.reset()


def check_save_load(method: str, tmp_path, **options) -> moelab.MoE:
    """``moelab.save`` then ``moelab.load``: the same outputs, routing and router buffers (state
    the step hook changed included).  Returns the loaded layer."""
    layer = make(method, **options).train()
    ctx = moelab.RoutingContext(total_steps=10)
    moelab.attach(layer, ctx)
    x = torch.randn(16, D)
    docs = doc_inputs(layer, x)
    for _ in range(3):  # the step hooks move the router's state away from its init
        (layer(x, **docs).square().mean() + layer.aux_loss).backward()
        ctx.advance()
    layer.eval()
    expected = layer(x, **docs)
    moelab.save(layer, tmp_path / "m")
    back = moelab.load(tmp_path / "m").eval()
    assert back.method == method
    torch.testing.assert_close(back(x, **docs), expected, rtol=0, atol=0)
    assert torch.equal(back.last_routing.indices, layer.last_routing.indices)
    saved, loaded = layer.router.state_dict(), back.router.state_dict()
    assert saved.keys() == loaded.keys()
    for name in saved:  # the persistent buffers too (state a step hook changed)
        torch.testing.assert_close(loaded[name], saved[name], rtol=0, atol=0, msg=name)
    return back


def check_hf_refusal(method: str, **options) -> None:
    """A transformers Mixtral block switched to ``method`` runs, and going back to transformers is
    refused in one line naming the method (transformers has no counterpart)."""
    pytest.importorskip("transformers")
    from transformers.models.mixtral.modeling_mixtral import MixtralConfig, MixtralSparseMoeBlock

    cfg = MixtralConfig(hidden_size=D, intermediate_size=H, num_local_experts=N, num_experts_per_tok=K)
    block = MixtralSparseMoeBlock(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # transformers leaves some weights uninitialised until a model inits them
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    layer = moelab.from_hf(block, method=method, **options)
    assert layer.method == method
    x = torch.randn(2, 5, D)
    assert layer(x, **doc_inputs(layer, x)).shape == (2, 5, D)
    with pytest.raises(
        ValueError, match=rf"^the layer \(method='{method}'\) cannot go back to transformers: "
    ) as e:
        moelab.to_hf(layer)
    assert "\n" not in str(e.value) and "moelab.save" in str(e.value)
