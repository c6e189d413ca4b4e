"""``default-moe`` (Default MoE, arXiv 2504.12463): the sparse forward, the dense router gradient
with the default outputs standing in for the missing experts, and the default outputs' EMA over
steps, against a literal computation; evaluation; refusals; 2 ranks = one process under DDP and
expert parallelism; the grid."""

from __future__ import annotations

import copy

import pytest
import torch

import moelab
from router_grid import (
    IMPLS_WITH_SLOW_TRITON,
    check_checkpointed_compile,
    check_compile,
    check_hf_refusal,
    check_kernel,
    check_save_load,
)

METHOD = "default-moe"


def literal_step(layer, x, g, defaults):
    """Per token: ``π = softmax(W x)``, the K largest chosen; the output ``Σ_chosen π_i E_i(x)``; the
    router's objective ``⟨g, Σ_chosen π_i E_i(x) + Σ_missing π_i Ê_i⟩`` with ``Ê`` fixed; each
    chosen slot's unweighted expert output, by expert."""
    w = layer.router.weight.detach().clone().requires_grad_()
    outputs: dict[int, list] = {}
    ys, objective = [], 0
    for t in range(x.shape[0]):
        pi = (x[t] @ w.T).softmax(-1)
        chosen = sorted(range(pi.shape[0]), key=lambda e: -float(pi[e].detach()))[: layer.top_k]
        y = 0
        for e in chosen:
            out = layer.experts.expert_forward(x[t : t + 1], e)[0].detach()
            outputs.setdefault(e, []).append(out)
            y = y + pi[e] * out
        ys.append(y.detach())
        dense = y + sum(pi[e] * defaults[e] for e in range(pi.shape[0]) if e not in chosen)
        objective = objective + (dense * g[t]).sum()
    objective.backward()
    return torch.stack(ys), w.grad, outputs


def test_default_moe_forward_is_sparse_its_router_gradient_dense_and_its_defaults_an_ema_as_the_literal_rule():
    torch.manual_seed(0)
    layer = moelab.MoE(6, 4, 2, d_hidden=5, method=METHOD, ema=0.7, balance_coef=0.0, z_coef=0.0).double()
    ctx = moelab.routing_context(layer, total_steps=10)
    router = layer.router
    defaults = torch.zeros(4, 6, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    for _step in range(3):
        seen: dict[int, list] = {}
        for _micro in range(2):
            x = torch.randn(9, 6, dtype=torch.float64, generator=gen)
            g = torch.randn(9, 6, dtype=torch.float64, generator=gen)
            y_ref, grad_ref, outputs = literal_step(layer, x, g, defaults)
            for e, outs in outputs.items():
                seen.setdefault(e, []).extend(outs)
            layer.zero_grad()
            y = layer(x)
            torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=1e-14)
            (y * g).sum().backward()
            torch.testing.assert_close(router.weight.grad, grad_ref, rtol=1e-10, atol=1e-13)
        ctx.advance()
        for e, outs in seen.items():
            defaults[e] = 0.7 * defaults[e] + 0.3 * torch.stack(outs).mean(0)
        torch.testing.assert_close(router.default_outputs.double(), defaults, rtol=1e-6, atol=1e-7)
    assert defaults.abs().sum() > 0


def test_default_moe_router_gradient_reaches_every_expert_row_once_the_defaults_are_set():
    torch.manual_seed(0)
    layer = moelab.MoE(8, 8, 1, method=METHOD, balance_coef=0.0, z_coef=0.0)
    ctx = moelab.routing_context(layer, total_steps=10)
    x = torch.randn(64, 8)
    layer(x).sum().backward()
    ctx.advance()
    layer.zero_grad()
    x1 = torch.randn(1, 8)
    layer(
        x1
    ).sum().backward()  # one token, one expert: a sparse router gradient would touch one row... of π's softmax
    assert (layer.router.weight.grad.abs().sum(1) > 0).all()
    sparse = moelab.MoE(8, 8, 1, method="smoe", balance_coef=0.0, z_coef=0.0, renormalize=False)
    sparse.router.weight.data.copy_(layer.router.weight.data)
    sparse.experts.load_state_dict(layer.experts.state_dict())
    sparse(x1).sum().backward()
    assert not torch.allclose(sparse.router.weight.grad, layer.router.weight.grad)


def test_default_moe_evaluates_as_the_plain_top_k_mixture_and_changes_nothing():
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, method=METHOD)
    ctx = moelab.routing_context(layer, total_steps=10)
    x = torch.randn(16, 8)
    layer(x).sum().backward()
    ctx.advance()
    defaults = layer.router.default_outputs.clone()
    layer.eval()
    with moelab.recording_routing(layer):
        y = layer(x)
    r = layer.last_routing
    assert r.outputs is None and r.direct is None  # the bank's sparse dispatch
    pi = (x @ layer.router.weight.detach().T).softmax(-1)
    want = torch.stack(
        [
            sum(
                pi[t, e] * layer.experts.expert_forward(x[t : t + 1], int(e))[0]
                for e in pi[t].topk(2).indices
            )
            for t in range(16)
        ]
    )
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    layer.train()
    with torch.no_grad():
        layer(x)
    ctx.advance()
    assert torch.equal(layer.router.default_outputs, defaults)


def test_default_moe_refuses_what_it_cannot_run_in_one_line():
    with pytest.raises(ValueError, match=r"^ema=1\.0 is not allowed"):
        moelab.MoE(8, 4, 2, method=METHOD, ema=1.0)
    with pytest.raises(
        ValueError, match=r"^pad_to_capacity=True is not allowed with method='default-moe': its router runs"
    ):
        moelab.MoE(8, 4, 2, method=METHOD, capacity_factor=1.0, pad_to_capacity=True)
    with pytest.raises(
        ValueError, match=r"^token_rounding='up' is not allowed with method='default-moe' and experts it runs"
    ):
        moelab.MoE(8, 4, 2, method=METHOD, token_rounding="up")
    with pytest.raises(ValueError, match=r"^densemixer=True is not allowed with method='default-moe'"):
        moelab.MoE(8, 4, 2, method=METHOD, densemixer=True)
    with pytest.raises(
        ValueError, match=r"^experts=None is not allowed with Default MoE in training: its router runs"
    ):
        moelab.MoE(8, 4, 2, method=METHOD).router(torch.randn(3, 8))
    layer = moelab.MoE(8, 4, 2, method=METHOD).bfloat16()
    assert (
        layer.router.default_outputs.dtype == torch.float32
        and layer.router.default_pending.dtype == torch.float32
    )


def test_default_moe_under_capacity_weighs_dropped_slots_zero():
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, method=METHOD, capacity_factor=0.5)
    x = torch.randn(16, 8)
    with moelab.recording_routing(layer):
        y = layer(x)
    r = layer.last_routing
    assert r.keep is not None and not r.keep.all()
    pi = (x @ layer.router.weight.detach().T).softmax(-1)
    want = torch.stack(
        [
            sum(
                (pi[t, e] * layer.experts.expert_forward(x[t : t + 1], int(e))[0])
                if bool(r.keep[t, j])
                else x.new_zeros(8)
                for j, e in enumerate(r.indices[t])
            )
            for t in range(16)
        ]
    )
    torch.testing.assert_close(y.detach(), want.detach(), rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS_WITH_SLOW_TRITON)
@pytest.mark.parametrize("train", [False, True])
def test_default_moe_every_kernel_gives_the_literal_output_and_gradients(impl, train):
    check_kernel(METHOD, impl, train=train, balance_coef=0.0, z_coef=0.0)


@pytest.mark.slow
def test_default_moe_compiles_per_block_under_activation_checkpointing_and_equals_eager():
    check_checkpointed_compile(METHOD)


def test_default_moe_compiles_as_one_graph_and_equals_eager():
    check_compile(METHOD, steps=3)


def test_default_moe_survives_save_and_load_with_its_default_outputs(tmp_path):
    back = check_save_load(METHOD, tmp_path)
    assert back.router.default_outputs.abs().sum() > 0


def test_default_moe_from_hf_runs_and_to_hf_refuses_in_one_line():
    check_hf_refusal(METHOD)


# ------------------------------------------------------------------ one process = 2 ranks
def _layer(state=None):
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, d_hidden=6, method=METHOD, ema=0.5, balance_coef=0.0, z_coef=0.0).double()
    if state is not None:
        layer.load_state_dict(state)
    return layer


def _batches(world: int = 2):
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(world, 10, 8, dtype=torch.float64, generator=gen) for _ in range(3)]


def _ranks(rank: int, world: int, state: dict, dp: str, ep: int) -> dict:
    from torch.distributed.tensor import DTensor

    from moelab.train.parallelize import parallelize

    layer = _layer(state)
    ctx = moelab.routing_context(layer, total_steps=10)
    model = parallelize(
        torch.nn.Sequential(layer), dp=dp, ep=ep
    )  # FSDP2: the layer one unit, the model another
    grads = []
    for x in _batches(world):
        model(x[rank]).square().sum().backward()
        g = layer.router.weight.grad
        grads.append((g.full_tensor() if isinstance(g, DTensor) else g).clone())
        layer.zero_grad()
        ctx.advance()
    return {"grads": grads, "defaults": layer.router.default_outputs.clone()}


@pytest.mark.parametrize(
    "world, dp, ep",
    [
        (2, "ddp", 1),
        pytest.param(2, "ddp", 2, marks=pytest.mark.slow),
        pytest.param(4, "fsdp", 2, marks=pytest.mark.slow),
    ],
)
def test_default_moe_ranks_equal_one_process_with_their_batches_as_micro_batches(world, dp, ep, tmp_path):
    """The default outputs average the expert outputs of every rank's tokens (an all-reduce in the step
    hook); under DDP, expert parallelism, and FSDP2 with the experts their own unit (4 ranks: 2 × 2)."""
    from test_parallelize import spawn

    layer = _layer()
    state = copy.deepcopy(layer.state_dict())
    ctx = moelab.routing_context(layer, total_steps=10)
    want = []
    for x in _batches(world):
        for part in x:
            (layer(part).square().sum() / world).backward()
        want.append(layer.router.weight.grad.clone())
        layer.zero_grad()
        ctx.advance()
    assert layer.router.default_outputs.abs().sum() > 0
    for r in spawn(_ranks, world, tmp_path, state, dp, ep):
        for got, ref in zip(r["grads"], want, strict=True):
            torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(r["defaults"], layer.router.default_outputs, rtol=1e-6, atol=1e-7)
