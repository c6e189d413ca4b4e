"""``quantile-balancing`` (Megatron-LM ``moe_router_load_balancing_type="quantile_balancing"``):
the routing and the bias update against a literal re-reading of Megatron-LM's code, the step
hook's averaging over micro-batches and ranks, evaluation, and the layer grid."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import moelab
from router_grid import IMPLS_WITH_TRITON, check_compile, check_hf_refusal, check_kernel, check_save_load

METHOD = "quantile-balancing"


def megatron_qb_dual_update(scores, k, beta):
    """Megatron-LM ``moe_utils.qb_dual_update`` (update_beta=True), as its own unit test states
    the contract: the chosen experts are ``TopK(scores − β)``; ``α`` the token's (K+1)-th largest
    ``scores − β``; the column quantile the ``(T·K/N + 1)``-th largest ``scores − α`` per expert."""
    m, n = scores.shape
    ranked = (scores - beta).sort(dim=1, descending=True)
    indices = ranked.indices[:, :k]
    alpha = ranked.values[:, k : k + 1]
    column = (scores - alpha).sort(dim=0, descending=True).values[m * k // n]
    return indices, column


def megatron_update(beta, quantiles_by_rank, ema):
    """Megatron-LM ``finalize_model_grads._update_router_qb_beta``: each rank's mean quantile over
    its micro-batches, averaged over the ranks (ReduceOp.AVG), blended, centred."""
    local = [torch.stack(q).mean(0) for q in quantiles_by_rank]
    avg = torch.stack(local).mean(0)
    new = ema * beta + (1 - ema) * avg
    return new - new.mean()


@pytest.mark.parametrize("ema", [0.0, 0.5])
def test_quantile_balancing_routes_weights_and_updates_the_bias_as_megatron(ema):
    torch.manual_seed(0)
    layer = moelab.MoE(6, 4, 2, d_hidden=5, method=METHOD, ema=ema).double()
    ctx = moelab.routing_context(layer, total_steps=10)
    router = layer.router
    beta = torch.zeros(4, dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        quantiles = []
        for _micro in range(2):
            x = torch.randn(16, 6, dtype=torch.float64, generator=gen)
            w = router.weight.detach().clone().requires_grad_()
            logits = x @ w.T
            indices, column = megatron_qb_dual_update(logits.detach(), 2, beta)
            quantiles.append(column)
            weights = logits.gather(1, indices).softmax(-1)  # Megatron: softmax over the chosen
            g = torch.randn(16, 2, dtype=torch.float64, generator=gen)
            (weights * g).sum().backward()

            router.zero_grad()
            r = router(x, layer.experts, ctx)
            assert torch.equal(r.indices, indices)
            torch.testing.assert_close(r.weights, weights, rtol=1e-12, atol=0)
            (r.weights * g).sum().backward()
            torch.testing.assert_close(router.weight.grad, w.grad, rtol=1e-12, atol=0)
        ctx.advance()
        beta = megatron_update(beta, [quantiles], ema)
        torch.testing.assert_close(router.qb_beta.double(), beta, rtol=1e-6, atol=1e-7)
    assert router.qb_beta.abs().sum() > 0
    assert router.qb_beta.sum().abs() < 1e-6  # centred


def test_quantile_balancing_brings_each_expert_to_its_share_of_the_tokens():
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 1, method=METHOD)
    ctx = moelab.routing_context(layer, total_steps=10)
    x = torch.randn(64, 8) + torch.randn(8) * 3  # skewed scores: most tokens prefer one expert
    counts = []
    for _ in range(4):
        layer(x).square().mean().backward()
        counts.append(torch.bincount(layer.last_routing.indices.flatten(), minlength=4))
        ctx.advance()
    assert counts[0].max() > 24  # unbalanced before the first update
    # T·K/N = 16 each, up to a token: one coordinate-descent step per update, not an exact solve
    assert (counts[-1] - 16).abs().max() <= 1


def test_quantile_balancing_bias_stays_in_evaluation_and_without_gradients_and_eval_routes_with_it():
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, method=METHOD)
    ctx = moelab.routing_context(layer, total_steps=10)
    x = torch.randn(32, 8)
    layer(x).sum().backward()
    ctx.advance()
    beta = layer.router.qb_beta.clone()
    layer.eval()
    with moelab.recording_routing(layer):
        layer(x)
    ctx.advance()
    layer.train()
    with torch.no_grad():
        layer(x)
    ctx.advance()
    assert torch.equal(layer.router.qb_beta, beta)  # neither forward fed the update
    logits = x @ layer.router.weight.detach().T
    layer.eval()
    with moelab.recording_routing(layer):
        layer(x)
    assert torch.equal(layer.last_routing.indices, (logits - beta).topk(2, dim=1).indices)


def test_quantile_balancing_is_refused_at_k_equal_n_and_its_ema_is_validated():
    with pytest.raises(
        ValueError, match=r"^top_k=4 is not allowed with quantile balancing; expected top_k < "
    ):
        moelab.MoE(8, 4, 4, method=METHOD)
    with pytest.raises(ValueError, match=r"ema=1\.0 is not allowed"):
        moelab.MoE(8, 4, 2, method=METHOD, ema=1.0)


def test_quantile_balancing_bias_stays_float32_in_a_bf16_model():
    layer = moelab.MoE(8, 4, 2, method=METHOD).bfloat16()
    assert layer.router.qb_beta.dtype == torch.float32 and layer.router.qb_pending.dtype == torch.float32


def test_quantile_balancing_warns_without_a_context_that_advances():
    layer = moelab.MoE(8, 4, 2, method=METHOD)
    with pytest.warns(UserWarning, match="quantile balancing"):
        layer(torch.randn(4, 8))


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS_WITH_TRITON)
def test_quantile_balancing_every_kernel_gives_the_literal_output_and_gradients(impl):
    check_kernel(METHOD, impl)


def test_quantile_balancing_compiles_as_one_graph_and_equals_eager():
    check_compile(METHOD, steps=3)


def test_quantile_balancing_survives_save_and_load_with_its_bias(tmp_path):
    back = check_save_load(METHOD, tmp_path)
    assert back.router.qb_beta.abs().sum() > 0  # the steps moved it, and it came back


def test_quantile_balancing_from_hf_runs_and_to_hf_refuses_in_one_line():
    check_hf_refusal(METHOD)


# ------------------------------------------------------------------ one process = 2 ranks
def _two_ranks(rank: int, world: int, state: dict, xs: list) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    layer = moelab.MoE(8, 4, 2, d_hidden=6, method=METHOD).double()
    layer.load_state_dict(state)
    ctx = moelab.routing_context(layer, total_steps=10)
    model = DistributedDataParallel(layer)
    for x in xs:
        model(x[rank]).square().sum().backward()
        ctx.advance()
    return {"beta": layer.router.qb_beta.clone(), "grad": layer.router.weight.grad.clone()}


def test_quantile_balancing_two_ranks_equal_one_process_with_their_batches_as_micro_batches(tmp_path):
    """The bias is the mean over the step's pieces (micro-batches × ranks) of each piece's quantile,
    as Megatron-LM: 2 ranks of one micro-batch each = one process accumulating both."""
    from test_parallelize import spawn

    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, d_hidden=6, method=METHOD).double()
    state = copy.deepcopy(layer.state_dict())
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 12, 8, dtype=torch.float64, generator=gen) for _ in range(2)]
    ctx = moelab.routing_context(layer, total_steps=10)
    for x in xs:
        for part in x:  # the two ranks' batches as micro-batches, the loss averaged as DDP does
            (layer(part).square().sum() / 2).backward()
        ctx.advance()
    got = spawn(_two_ranks, 2, tmp_path, state, xs)
    for r in got:
        torch.testing.assert_close(r["beta"], layer.router.qb_beta, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(r["grad"], layer.router.weight.grad, rtol=1e-12, atol=1e-12)
    assert not dist.is_initialized()
