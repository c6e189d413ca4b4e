"""``expert-threshold`` (Expert Threshold routing, arXiv 2603.11535): the routing and the
thresholds' update against a literal computation over steps, causality (a token's routing depends
on no other token once the thresholds are set), evaluation, 2 ranks = one process, the grid."""

from __future__ import annotations

import copy
import math

import pytest
import torch

import moelab
from router_grid import IMPLS_WITH_TRITON, check_compile, check_hf_refusal, check_kernel, check_save_load

METHOD = "expert-threshold"


def literal_cutoff(probs, k):
    """Per expert: sort its column's scores, descending; the score at rank ⌈T·k/N⌉ (0-based), i.e.
    the largest score that ⌈T·k/N⌉ others exceed; 0 when every token is taken."""
    t, n = probs.shape
    take = min(t, math.ceil(t * k / n))
    out = []
    for e in range(n):
        column = sorted(probs[:, e].tolist(), reverse=True)
        out.append(0.0 if take >= t else column[take])
    return torch.tensor(out, dtype=probs.dtype)


def literal_routing(x, weight, tau):
    """Per token: ``S = softmax(W x)``; every expert with ``S_e > τ_e``, by decreasing ``S``."""
    probs = (x @ weight.T).softmax(-1)
    taken = []
    for row in probs:
        taken.append(sorted((e for e in range(len(row)) if row[e] > tau[e]), key=lambda e: -float(row[e])))
    return probs, taken


def test_expert_threshold_routes_and_moves_its_thresholds_as_the_literal_rule():
    torch.manual_seed(0)
    layer = moelab.MoE(6, 4, 2, d_hidden=5, method=METHOD, ema=0.9).double()
    ctx = moelab.routing_context(layer, total_steps=10)
    router = layer.router
    tau = None
    gen = torch.Generator().manual_seed(1)
    for _step in range(3):
        cutoffs = []
        for _micro in range(2):
            x = torch.randn(10, 6, dtype=torch.float64, generator=gen)
            w = router.weight.detach().clone().requires_grad_()
            scores = (x @ w.detach().T).softmax(-1)
            # before the first update: the forward's own expert-choice cutoff
            probs, taken = literal_routing(x, w, literal_cutoff(scores, 2) if tau is None else tau)
            cutoffs.append(literal_cutoff(probs.detach(), 2))
            g = torch.randn(10, 6, dtype=torch.float64, generator=gen)
            ref_out = sum(probs[t, e] * g[t, e] for t in range(10) for e in taken[t])
            ref_out.backward()

            router.zero_grad()
            r = router(x, layer.experts, ctx)
            for t in range(10):
                assert r.indices[t][r.mask[t]].tolist() == taken[t]
                torch.testing.assert_close(r.weights[t][r.mask[t]], probs[t, taken[t]], rtol=1e-12, atol=0)
            assert (r.weights[~r.mask] == 0).all()
            out = sum(r.weights[t, j] * g[t, int(r.indices[t, j])] for t in range(10) for j in range(4))
            out.backward()
            torch.testing.assert_close(router.weight.grad, w.grad, rtol=1e-10, atol=1e-14)
        ctx.advance()
        mean = torch.stack(cutoffs).mean(0)
        tau = mean if tau is None else 0.9 * tau + 0.1 * mean
        torch.testing.assert_close(router.tau.double(), tau, rtol=1e-6, atol=1e-7)
    assert int(router.tau_updates) == 3


def test_expert_threshold_is_causal_once_its_thresholds_are_set():
    """A token's experts and weights are the same alone as within its batch, in training and
    evaluation (expert-choice's would not be)."""
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, method=METHOD)
    ctx = moelab.routing_context(layer, total_steps=10)
    layer(torch.randn(32, 8)).sum().backward()
    ctx.advance()
    x = torch.randn(6, 8)
    for mode in (True, False):
        layer.train(mode)
        batch = layer.router(x)
        for t in range(6):
            alone = layer.router(x[t : t + 1])
            assert torch.equal(alone.mask[0], batch.mask[t])
            assert torch.equal(alone.indices[0][alone.mask[0]], batch.indices[t][batch.mask[t]])


def test_a_fresh_expert_threshold_layer_routes_as_expert_choice_on_its_batch():
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, method=METHOD).eval()
    r = layer.router(torch.randn(20, 8))
    taken = torch.bincount(r.indices[r.mask], minlength=4)
    assert taken.tolist() == [10, 10, 10, 10]  # ⌈T·K/N⌉ = 10 tokens each


def test_expert_threshold_keeps_its_thresholds_in_evaluation_and_without_gradients():
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, method=METHOD)
    ctx = moelab.routing_context(layer, total_steps=10)
    x = torch.randn(32, 8)
    layer(x).sum().backward()
    ctx.advance()
    tau = layer.router.tau.clone()
    layer.eval()
    with moelab.recording_routing(layer):
        layer(x)
    ctx.advance()
    layer.train()
    with torch.no_grad():
        layer(x)
    ctx.advance()
    assert torch.equal(layer.router.tau, tau) and int(layer.router.tau_updates) == 1
    layer.eval()  # evaluation routes by the thresholds
    probs = (x @ layer.router.weight.detach().T).softmax(-1)
    r = layer.router(x)
    chosen = torch.zeros(32, 4, dtype=torch.bool).scatter(1, r.indices, r.mask)
    assert torch.equal(chosen, probs > tau)


def test_expert_threshold_in_evaluation_gives_each_token_the_thresholded_sum_of_its_experts():
    """Inference follows the paper: token t's output is Σ_{e: S_te > τ_e} S_te E_e(x_t), whatever the
    batch — none for a token below every threshold, more than K for one above more."""
    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, d_hidden=6, method=METHOD).double().eval()
    x = torch.randn(16, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    probs = (x @ layer.router.weight.detach().T).softmax(-1)
    with torch.no_grad():  # thresholds that leave token 0 without an expert
        tau = torch.maximum(probs.quantile(0.3, dim=0), probs[0] + 1e-9)
        layer.router.tau.copy_(tau)
        layer.router.tau_updates.fill_(1)
    taken = probs > tau
    assert taken.sum(1)[0] == 0 and taken.sum(1).max() > 2
    every = torch.arange(4).expand(16, 4)
    with torch.no_grad():
        expected = layer.experts(x, moelab.Routing(indices=every, weights=probs * taken))
        out = layer(x)
        alone = torch.cat([layer(x[t : t + 1]) for t in range(16)])
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(alone, out, rtol=1e-12, atol=1e-12)  # each token alone: the same experts
    assert torch.equal(out[0], torch.zeros(8, dtype=torch.float64))
    assert torch.equal(layer.router.tau, tau) and int(layer.router.tau_updates) == 1


def test_expert_threshold_thresholds_bring_the_mean_experts_per_token_to_k():
    torch.manual_seed(0)
    layer = moelab.MoE(8, 8, 2, method=METHOD, ema=0.5)
    ctx = moelab.routing_context(layer, total_steps=50)
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        layer(torch.randn(64, 8, generator=gen)).square().mean().backward()
        ctx.advance()
    with torch.no_grad():
        r = layer.router(torch.randn(4096, 8, generator=gen))
    assert abs(r.mask.sum(1).float().mean().item() - 2.0) < 0.25


def test_expert_threshold_ema_is_validated_and_tau_stays_float32_in_bf16():
    with pytest.raises(ValueError, match=r"ema=1\.0 is not allowed"):
        moelab.MoE(8, 4, 2, method=METHOD, ema=1.0)
    layer = moelab.MoE(8, 4, 2, method=METHOD).bfloat16()
    assert layer.router.tau.dtype == torch.float32 and layer.router.tau_pending.dtype == torch.float32


# ------------------------------------------------------------------ the layer grid
@pytest.mark.parametrize("impl", IMPLS_WITH_TRITON)
def test_expert_threshold_every_kernel_gives_the_literal_output_and_gradients(impl):
    check_kernel(METHOD, impl)


def test_expert_threshold_compiles_as_one_graph_and_equals_eager():
    check_compile(METHOD, steps=3)


def test_expert_threshold_survives_save_and_load_with_its_thresholds(tmp_path):
    back = check_save_load(METHOD, tmp_path)
    assert int(back.router.tau_updates) == 3 and back.router.tau.abs().sum() > 0


def test_expert_threshold_from_hf_runs_and_to_hf_refuses_in_one_line():
    check_hf_refusal(METHOD)


# ------------------------------------------------------------------ one process = 2 ranks
def _two_ranks(rank: int, world: int, state: dict, xs: list) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    layer = moelab.MoE(8, 4, 2, d_hidden=6, method=METHOD, ema=0.5).double()
    layer.load_state_dict(state)
    ctx = moelab.routing_context(layer, total_steps=10)
    model = DistributedDataParallel(layer)
    for x in xs:
        model(x[rank]).square().sum().backward()
        ctx.advance()
    return {"tau": layer.router.tau.clone(), "grad": layer.router.weight.grad.clone()}


def test_expert_threshold_two_ranks_equal_one_process_with_their_batches_as_micro_batches(tmp_path):
    """The step's cutoff is the mean over its pieces (micro-batches × ranks) of each piece's."""
    from test_parallelize import spawn

    torch.manual_seed(0)
    layer = moelab.MoE(8, 4, 2, d_hidden=6, method=METHOD, ema=0.5).double()
    state = copy.deepcopy(layer.state_dict())
    gen = torch.Generator().manual_seed(3)
    xs = [torch.randn(2, 12, 8, dtype=torch.float64, generator=gen) for _ in range(3)]
    ctx = moelab.routing_context(layer, total_steps=10)
    for x in xs:
        for part in x:
            (layer(part).square().sum() / 2).backward()
        ctx.advance()
    for r in spawn(_two_ranks, 2, tmp_path, state, xs):
        torch.testing.assert_close(r["tau"], layer.router.tau, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(r["grad"], layer.router.weight.grad, rtol=1e-12, atol=1e-12)
